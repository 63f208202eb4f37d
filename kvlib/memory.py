"""How many bytes a KV cache takes, and what fits on a GPU (chapter 04).

Every layer keeps one key and one value vector per K/V head per cached token, so

    KV bytes = 2 (K and V) x n_layers x n_kv_heads x head_dim x seq_len x batch x bytes per element

Note what is *not* in the formula: the number of query heads and the model width. Each K/V head
holds head_dim numbers per token; with plain multi-head attention n_kv_heads x head_dim equals the
model width, with GQA/MQA it is smaller (chapter 07).

A quantized cache also stores its scales. kvlib's INT8 cache (``kvlib.quant.Int8KVCache``, chapter
06) keeps one fp16 scale per (sequence, K/V head, position) for K and one for V, so each row of
head_dim int8 values costs head_dim + 2 bytes: pass ``scale_bytes=INT8_SCALE_BYTES`` to
``kv_cache_bytes``. ``ModelSpec.kv_bytes_per_token``, ``max_batch``, ``max_context`` and ``fit``
count those scales for "int8" on their own.

``REAL_MODELS`` lists public model configurations (numbers copied from each model's Hugging Face
``config.json``, linked by ``config_url``) to work the formula on. ``max_batch``, ``max_context`` and
``fit`` respect each model's maximum context (``max_position_embeddings``).

``measure_allocation`` checks the formula against memory actually taken: on a GPU the growth of
``torch.cuda.memory_allocated``, on a CPU the growth of the resident memory of a fresh process.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import asdict, dataclass

import torch

__all__ = ["kv_cache_bytes", "dtype_bytes", "scale_bytes_for", "INT8_SCALE_BYTES", "ModelSpec", "REAL_MODELS",
           "spec", "kv_table", "max_batch", "max_context", "Fit", "fit", "resident_bytes", "measure_allocation",
           "GiB"]

GiB = 2**30

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "int8": 1,
                "fp8": 1, "float8_e4m3fn": 1}

INT8_SCALE_BYTES = 2  # kvlib.quant.Int8KVCache: one fp16 scale per (sequence, K/V head, position), for K and for V


def dtype_bytes(dtype) -> int:
    """Bytes per element for a torch dtype or a name such as "fp16", "bf16", "int8", "fp8"."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype.lower()]
    raise ValueError(f"dtype must be a torch.dtype or one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")


def scale_bytes_for(dtype) -> int:
    """Bytes of scale that kvlib's cache for ``dtype`` stores per (token, K/V head), for K and for V alike.

    int8: one fp16 scale (``kvlib.quant.Int8KVCache``); everything else: none (fp8 has no kvlib cache).
    """
    return INT8_SCALE_BYTES if dtype in (torch.int8, "int8", "INT8") else 0


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch: int, dtype,
                   scale_bytes: int = 0) -> int:
    """Exact bytes of a KV cache holding ``seq_len`` tokens for each of ``batch`` sequences.

    ``scale_bytes``: bytes of scale stored beside each row of ``head_dim`` values (one row per token,
    K/V head, K or V); 0 for an unquantized cache, ``INT8_SCALE_BYTES`` for kvlib's int8 cache.
    """
    for name, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                    ("seq_len", seq_len), ("batch", batch), ("scale_bytes", scale_bytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    row = head_dim * dtype_bytes(dtype) + scale_bytes  # one token's K (or V) for one K/V head
    return 2 * n_layers * n_kv_heads * seq_len * batch * row


@dataclass(frozen=True)
class ModelSpec:
    name: str  # a short display name
    hf_repo: str  # where the numbers come from: this repository's config.json (see config_url)
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads (query heads)
    n_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim (hidden_size / num_attention_heads where not given)
    hidden_size: int  # hidden_size (model width)
    max_context: int  # max_position_embeddings: the longest sequence the model is configured for
    n_params: float  # parameter count (for the weights' bytes), from the model card: embedding table and output
    #                  head included, once when they are tied
    vocab_size: int  # vocab_size: the output head is a vocab_size x hidden_size matrix
    tie_embeddings: bool  # tie_word_embeddings: the output head is the embedding table (one matrix, used twice)

    @property
    def config_url(self) -> str:
        """The config.json these numbers are copied from."""
        return f"https://huggingface.co/{self.hf_repo}/blob/main/config.json"

    def kv_bytes_per_token(self, dtype="fp16") -> int:
        """Bytes one cached token takes across all layers, K and V, scales included for "int8"."""
        return kv_cache_bytes(self.n_layers, self.n_kv_heads, self.head_dim, 1, 1, dtype, scale_bytes_for(dtype))

    def weight_bytes(self, dtype="fp16") -> int:
        return int(self.n_params * dtype_bytes(dtype))


REAL_MODELS = [
    ModelSpec("LLaMA-7B", "huggyllama/llama-7b", 32, 32, 32, 128, 4096, 2048, 6.74e9, 32000, False),
    ModelSpec("Llama-2-7B", "meta-llama/Llama-2-7b-hf", 32, 32, 32, 128, 4096, 4096, 6.74e9, 32000, False),
    ModelSpec("Llama-2-13B", "meta-llama/Llama-2-13b-hf", 40, 40, 40, 128, 5120, 4096, 13.0e9, 32000, False),
    ModelSpec("Llama-2-70B", "meta-llama/Llama-2-70b-hf", 80, 64, 8, 128, 8192, 4096, 69.0e9, 32000, False),
    ModelSpec("Llama-3-8B", "meta-llama/Meta-Llama-3-8B", 32, 32, 8, 128, 4096, 8192, 8.03e9, 128256, False),
    ModelSpec("Llama-3.1-8B", "meta-llama/Llama-3.1-8B", 32, 32, 8, 128, 4096, 131072, 8.03e9, 128256, False),
    ModelSpec("Llama-3-70B", "meta-llama/Meta-Llama-3-70B", 80, 64, 8, 128, 8192, 8192, 70.6e9, 128256, False),
    ModelSpec("Mistral-7B-v0.3", "mistralai/Mistral-7B-v0.3", 32, 32, 8, 128, 4096, 32768, 7.25e9, 32768, False),
    ModelSpec("Qwen2.5-7B", "Qwen/Qwen2.5-7B", 28, 28, 4, 128, 3584, 131072, 7.62e9, 152064, False),
    # The course's real model (chapters 03-09); the base SmolLM2-135M has the same config.
    ModelSpec("SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct", 30, 9, 3, 64, 576, 8192, 1.35e8, 49152, True),
]


def spec(name: str) -> ModelSpec:
    """The row of ``REAL_MODELS`` called ``name`` (or whose Hugging Face repository is named ``name``)."""
    for m in REAL_MODELS:
        if name.lower() in (m.name.lower(), m.hf_repo.lower(), m.hf_repo.split("/")[-1].lower()):
            return m
    raise ValueError(f"unknown model {name!r}; known: {[m.name for m in REAL_MODELS]}")


def kv_table(dtype="fp16") -> list[dict]:
    """One row per real model: its shape numbers, KV bytes per token and for one full context."""
    rows = []
    for m in REAL_MODELS:
        row = asdict(m)
        row["config_url"] = m.config_url
        row["kv_per_token_KiB"] = m.kv_bytes_per_token(dtype) / 2**10
        row["kv_full_context_GiB"] = m.kv_bytes_per_token(dtype) * m.max_context / GiB
        row["weights_GiB"] = m.weight_bytes(dtype) / GiB
        rows.append(row)
    return rows


def _free_bytes(m: ModelSpec, gpu_bytes: int, weight_dtype, reserve_bytes: int) -> int:
    """GPU memory left for KV caches after the weights and a reserve (negative: the weights do not fit)."""
    return gpu_bytes - m.weight_bytes(weight_dtype) - reserve_bytes


def _positive_int(name, v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def max_batch(m: ModelSpec, gpu_bytes: int, context: int, kv_dtype="fp16", weight_dtype="fp16",
              reserve_bytes: int = 0) -> int:
    """How many sequences of ``context`` tokens fit after the weights (and a reserve for activations).

    Raises ValueError when ``context`` is longer than the model's maximum context: no batch size
    makes such a sequence servable. An "int8" cache counts its fp16 scales.
    """
    _positive_int("context", context)
    if context > m.max_context:
        raise ValueError(f"{m.name} supports at most {m.max_context:,} tokens (max_position_embeddings), "
                         f"asked for {context:,}")
    per_seq = m.kv_bytes_per_token(kv_dtype) * context
    return max(0, _free_bytes(m, gpu_bytes, weight_dtype, reserve_bytes) // per_seq)


def max_context(m: ModelSpec, gpu_bytes: int, batch: int, kv_dtype="fp16", weight_dtype="fp16",
                reserve_bytes: int = 0) -> int:
    """The longest context that ``batch`` sequences can each hold after the weights, at most the
    model's maximum context. An "int8" cache counts its fp16 scales."""
    _positive_int("batch", batch)
    per_token = m.kv_bytes_per_token(kv_dtype) * batch
    return min(m.max_context, max(0, _free_bytes(m, gpu_bytes, weight_dtype, reserve_bytes) // per_token))


@dataclass(frozen=True)
class Fit:
    fits: bool  # does a cache of batch x context (plus the weights and the reserve) fit?
    reason: str  # in words: why it fits or does not
    weight_bytes: int  # the weights in weight_dtype
    kv_bytes: int  # the cache for batch x context in kv_dtype, scales included
    free_bytes: int  # memory left for the cache after weights and reserve (negative: weights do not fit)
    max_batch: int  # sequences of `context` tokens that fit (0 when context exceeds the model's maximum)
    max_context: int  # tokens each of `batch` sequences can hold, at most the model's maximum context
    context_limit: str  # what bounds max_context: "memory" or "model" (max_position_embeddings)


def fit(m: ModelSpec, gpu_bytes: int, batch: int, context: int, kv_dtype="fp16", weight_dtype="fp16",
        reserve_bytes: int = 0) -> Fit:
    """Does a batch of ``batch`` sequences of ``context`` tokens fit on a GPU of ``gpu_bytes``? And if
    not, why not: the weights alone, a context the model does not support, or the cache's size."""
    _positive_int("batch", batch)
    _positive_int("context", context)
    weights, free = m.weight_bytes(weight_dtype), _free_bytes(m, gpu_bytes, weight_dtype, reserve_bytes)
    kv = m.kv_bytes_per_token(kv_dtype) * batch * context
    ctx = max_context(m, gpu_bytes, batch, kv_dtype, weight_dtype, reserve_bytes)
    memory_ctx = max(0, free // (m.kv_bytes_per_token(kv_dtype) * batch))
    if free <= 0:
        ok, reason = False, (f"does not fit: the {weight_dtype} weights ({weights / GiB:.1f} GiB) plus the reserve "
                             f"({reserve_bytes / GiB:.1f} GiB) already exceed the GPU's {gpu_bytes / GiB:.1f} GiB")
    elif context > m.max_context:
        ok, reason = False, (f"does not fit the model: {m.name} supports at most {m.max_context:,} tokens "
                             f"(max_position_embeddings), asked for {context:,}")
    elif kv > free:
        ok, reason = False, (f"does not fit: the cache needs {kv / GiB:.2f} GiB but only {free / GiB:.2f} GiB are "
                             f"left after the weights and the reserve ({kv / free:.1f}x too much)")
    else:
        ok, reason = True, (f"fits: the cache takes {kv / GiB:.2f} GiB of the {free / GiB:.2f} GiB left "
                            f"({kv / free:.0%})")
    mb = 0 if context > m.max_context else max_batch(m, gpu_bytes, context, kv_dtype, weight_dtype, reserve_bytes)
    return Fit(ok, reason, weights, kv, free, mb, ctx, "model" if memory_ctx > m.max_context else "memory")


# ---- measuring what an allocation really takes ---------------------------------------------------

def resident_bytes() -> int | None:
    """This process's resident set size: bytes of RAM it holds now (None where it cannot be read)."""
    try:
        import psutil  # installed with Jupyter (ipykernel needs it)

        return psutil.Process().memory_info().rss
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:  # Linux: (size, resident, ...) in pages
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


_KEPT = []  # every build's result, kept alive in the measuring process: freed memory would hide the next growth


def _warm_up():
    """The first large fill starts torch's thread pool, whose stacks are resident memory: do it before measuring."""
    torch.zeros(1 << 22).fill_(1.0)


def _grow_one(build, args, kwargs, device, trials: int = 3):
    """Run one build ``trials`` times, keeping every result alive; return the median of the bytes each run added
    (one other allocation during a run, e.g. a thread starting on a busy machine, moves one run only)."""
    read = torch.cuda.memory_allocated if device == "cuda" else resident_bytes
    if read() is None:
        return None
    runs = []
    for _ in range(trials):
        if device == "cuda":
            torch.cuda.synchronize()
        before = read()
        _KEPT.append(build(*args, **kwargs))
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append(read() - before)
    return sorted(runs)[len(runs) // 2]


def _grow_one_cpu(item):
    return _grow_one(*item, "cpu")


def measure_allocation(builds, device="cpu", progress=None) -> list[int] | None:
    """Bytes of memory each of ``builds`` really took: a list of (callable, args, kwargs), e.g.
    ``(KVCache, (4, 2, 8, 1024, 64), dict(dtype=torch.float16))``, built one after the other.

    GPU: the growth of ``torch.cuda.memory_allocated`` (the caching allocator rounds each tensor up
    to 512 bytes). CPU: the growth of the resident memory (RSS, counted in whole pages, 4 KiB on
    x86-64 Linux) of a *fresh* Python process, so that memory freed earlier in this one cannot be
    reused and hide the growth; where glibc allocates (Linux), every block of 16 KiB or more gets
    pages of its own. A cache's buffers are made by ``torch.zeros``, which writes every byte, so
    every page is resident. Each build runs three times and the median growth is returned, so one stray
    allocation on a busy machine does not move the figure. Returns None where the resident size cannot
    be read. The callables must be importable (a class or a function of a module): on a CPU they run in
    another process. ``progress``: optional wrapper of the results as they arrive, e.g. ``tqdm.auto.tqdm``
    (called as ``progress(iterable, total=len(builds))``).
    """
    builds = [(b, tuple(a), dict(k)) for b, a, k in builds]
    wrap = (lambda it: progress(it, total=len(builds))) if progress is not None else (lambda it: it)
    if device == "cuda":
        grown = [_grow_one(b, a, k, "cuda") for b, a, k in wrap(builds)]
        _KEPT.clear()
        torch.cuda.empty_cache()
        return grown
    # glibc (Linux) gives a block of at least this many bytes its own fresh pages, and returns them on free,
    # instead of carving it out of heap memory freed earlier (which is resident already and would hide the
    # growth). Setting it also stops glibc raising the threshold on its own. Other C libraries ignore it.
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(16 * 2**10)
    try:  # one worker process runs every build in turn (its _KEPT holds them all); it reads the variable at start
        with multiprocessing.get_context("spawn").Pool(1, initializer=_warm_up) as pool:
            grown = list(wrap(pool.imap(_grow_one_cpu, builds)))
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return None if any(g is None for g in grown) else grown
