"""How many bytes a KV cache takes, and what fits on a GPU (chapter 04).

Every layer keeps one key and one value vector per K/V head per cached token, so

    KV bytes = 2 (K and V) x n_layers x n_kv_heads x head_dim x seq_len x batch x bytes per element

Note what is *not* in the formula: the number of query heads and the model width. Each K/V head
holds head_dim numbers per token; with plain multi-head attention n_kv_heads x head_dim equals the
model width, with GQA/MQA it is smaller (chapter 07).

``REAL_MODELS`` lists public model configurations (numbers copied from each model's Hugging Face
``config.json``, named in ``hf_repo``) to work the formula on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["kv_cache_bytes", "dtype_bytes", "ModelSpec", "REAL_MODELS", "spec", "kv_table", "max_batch",
           "max_context", "GiB"]

GiB = 2**30

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "int8": 1,
                "fp8": 1, "float8_e4m3fn": 1}


def dtype_bytes(dtype) -> int:
    """Bytes per element for a torch dtype or a name such as "fp16", "bf16", "int8", "fp8"."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype.lower()]
    raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch: int, dtype) -> int:
    """Exact bytes of a KV cache holding ``seq_len`` tokens for each of ``batch`` sequences."""
    for name, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                    ("seq_len", seq_len), ("batch", batch)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes(dtype)


@dataclass(frozen=True)
class ModelSpec:
    name: str  # a short display name
    hf_repo: str  # where the numbers come from: this repository's config.json
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads (query heads)
    n_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim (hidden_size / num_attention_heads where not given)
    hidden_size: int  # hidden_size (model width)
    max_context: int  # max_position_embeddings
    n_params: float  # parameter count (for the weights' bytes)

    def kv_bytes_per_token(self, dtype="fp16") -> int:
        return kv_cache_bytes(self.n_layers, self.n_kv_heads, self.head_dim, 1, 1, dtype)

    def weight_bytes(self, dtype="fp16") -> int:
        return int(self.n_params * dtype_bytes(dtype))


REAL_MODELS = [
    ModelSpec("LLaMA-7B", "huggyllama/llama-7b", 32, 32, 32, 128, 4096, 2048, 6.74e9),
    ModelSpec("Llama-2-7B", "meta-llama/Llama-2-7b-hf", 32, 32, 32, 128, 4096, 4096, 6.74e9),
    ModelSpec("Llama-2-13B", "meta-llama/Llama-2-13b-hf", 40, 40, 40, 128, 5120, 4096, 13.0e9),
    ModelSpec("Llama-2-70B", "meta-llama/Llama-2-70b-hf", 80, 64, 8, 128, 8192, 4096, 69.0e9),
    ModelSpec("Llama-3-8B", "meta-llama/Meta-Llama-3-8B", 32, 32, 8, 128, 4096, 8192, 8.03e9),
    ModelSpec("Llama-3.1-8B", "meta-llama/Llama-3.1-8B", 32, 32, 8, 128, 4096, 131072, 8.03e9),
    ModelSpec("Llama-3-70B", "meta-llama/Meta-Llama-3-70B", 80, 64, 8, 128, 8192, 8192, 70.6e9),
    ModelSpec("Mistral-7B-v0.3", "mistralai/Mistral-7B-v0.3", 32, 32, 8, 128, 4096, 32768, 7.25e9),
    ModelSpec("Qwen2.5-7B", "Qwen/Qwen2.5-7B", 28, 28, 4, 128, 3584, 131072, 7.62e9),
    ModelSpec("SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M", 30, 9, 3, 64, 576, 8192, 1.35e8),
]


def spec(name: str) -> ModelSpec:
    for m in REAL_MODELS:
        if m.name.lower() == name.lower():
            return m
    raise ValueError(f"unknown model {name!r}; known: {[m.name for m in REAL_MODELS]}")


def kv_table(dtype="fp16") -> list[dict]:
    """One row per real model: its shape numbers, KV bytes per token and for one full context."""
    rows = []
    for m in REAL_MODELS:
        row = asdict(m)
        row["kv_per_token_KiB"] = m.kv_bytes_per_token(dtype) / 2**10
        row["kv_full_context_GiB"] = m.kv_bytes_per_token(dtype) * m.max_context / GiB
        row["weights_GiB"] = m.weight_bytes(dtype) / GiB
        rows.append(row)
    return rows


def max_batch(m: ModelSpec, gpu_bytes: int, context: int, kv_dtype="fp16", weight_dtype="fp16",
              reserve_bytes: int = 0) -> int:
    """How many sequences of ``context`` tokens fit after the weights (and a reserve for activations)."""
    free = gpu_bytes - m.weight_bytes(weight_dtype) - reserve_bytes
    per_seq = kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, context, 1, kv_dtype)
    return max(0, free // per_seq)


def max_context(m: ModelSpec, gpu_bytes: int, batch: int, kv_dtype="fp16", weight_dtype="fp16",
                reserve_bytes: int = 0) -> int:
    """The longest context that ``batch`` sequences can each hold after the weights."""
    free = gpu_bytes - m.weight_bytes(weight_dtype) - reserve_bytes
    per_token = kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, 1, batch, kv_dtype)
    return max(0, free // per_token)
