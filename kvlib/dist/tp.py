"""Tensor parallelism (Megatron's column/row split) of kvlib's Llama-style model: each rank caches its K/V heads.

What you will learn here:
- which heads each of ``tp`` ranks computes and caches (:func:`plan`), and the rule the engines apply:
  the query heads must divide evenly by ``tp``; K/V heads are split when ``tp`` divides their count and
  *replicated* when ``tp`` is a multiple of it (vLLM's ``QKVParallelLinear``: one K/V head per rank, each
  held by ``tp / H_KV`` ranks);
- how a rank's copy of the model is cut (:func:`shard_model`): q/k/v and gate/up are split by output
  columns (each rank gets whole heads, a slice of the MLP's hidden width), o and down by input rows, and
  the two row-split products are summed across ranks by one all-reduce each (after attention, after MLP);
- what that does to the cache: a rank's ``KVCache`` holds ``H_KV / tp`` heads (or one, replicated), so
  its bytes are the one-process bytes over ``tp`` (or over ``H_KV`` once ``tp`` passes it): :func:`kv_bytes_per_rank`.

Simplification (named where the chapter shows it): the embedding and the output head stay whole on every
rank (vLLM splits them over the vocabulary too); they hold no cache and change no token.

The rank function :func:`generate_tp` runs under :func:`kvlib.dist.launch.run`; greedy decoding there is
token-identical to one process, because every rank computes the same sums (the all-reduce leaves the
same bits on every rank) and picks the same token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..cache import KVCache
from ..model import ModelConfig, Transformer

__all__ = ["TPPlan", "plan", "shard_model", "RowParallelLinear", "kv_bytes_per_rank", "generate_tp"]


@dataclass(frozen=True)
class TPPlan:
    tp: int  # ranks in the tensor-parallel group
    q_heads: tuple[tuple[int, ...], ...]  # q_heads[r]: the query heads rank r computes
    kv_heads: tuple[tuple[int, ...], ...]  # kv_heads[r]: the K/V heads rank r computes and caches
    kv_replicas: int  # how many ranks hold each K/V head (1: split, > 1: replicated)
    hidden: tuple[tuple[int, int], ...]  # hidden[r]: (start, stop) of rank r's slice of the MLP's hidden width


def plan(config: ModelConfig, tp: int, mlp: bool = True) -> TPPlan:
    """Which heads each rank holds, with the rule vLLM applies (a ValueError in its words otherwise).

    ``mlp=False`` checks the heads only (what the cache depends on); with ``mlp=True`` the MLP's hidden width
    must divide by ``tp`` too (vLLM's ``divide`` asserts it when it splits gate/up/down).

    >>> p = plan(ModelConfig(n_heads=9, n_kv_heads=3, dim=576, hidden_dim=1536), 3)
    >>> p.q_heads, p.kv_heads, p.kv_replicas
    (((0, 1, 2), (3, 4, 5), (6, 7, 8)), ((0,), (1,), (2,)), 1)
    >>> plan(ModelConfig(n_heads=9, n_kv_heads=3, dim=576, hidden_dim=1536), 9, mlp=False).kv_heads[:4]  # replicated
    ((0,), (0,), (0,), (1,))
    >>> plan(ModelConfig(n_heads=9, n_kv_heads=3, dim=576, hidden_dim=1536), 2)
    Traceback (most recent call last):
    ...
    ValueError: Total number of attention heads (9) must be divisible by tensor parallel size (2).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    H, H_KV = config.n_heads, config.n_kv_heads
    if H % tp:  # vLLM: ModelConfig.verify_with_parallel_config, same words
        raise ValueError(f"Total number of attention heads ({H}) must be divisible by tensor parallel size ({tp}).")
    if H_KV >= tp and H_KV % tp:  # vLLM's attention layers: assert total_num_kv_heads % tp_size == 0
        raise ValueError(f"the K/V heads ({H_KV}) must be divisible by tensor parallel size ({tp}) when there are at "
                         f"least as many K/V heads as ranks")
    if H_KV < tp and tp % H_KV:  # vLLM: assert tp_size % total_num_kv_heads == 0 (replication)
        raise ValueError(f"tensor parallel size ({tp}) must be a multiple of the K/V heads ({H_KV}) to replicate them")
    if mlp and config.hidden_dim % tp:
        raise ValueError(f"the MLP's hidden width ({config.hidden_dim}) must be divisible by tensor parallel size ({tp})")
    hq = H // tp
    q_heads = tuple(tuple(range(r * hq, (r + 1) * hq)) for r in range(tp))
    if H_KV >= tp:
        hk = H_KV // tp
        kv_heads = tuple(tuple(range(r * hk, (r + 1) * hk)) for r in range(tp))
        replicas = 1
    else:
        replicas = tp // H_KV
        kv_heads = tuple((r // replicas,) for r in range(tp))
    n_rep = H // H_KV  # query heads per K/V head: each rank's query heads must read only its own K/V heads
    for r in range(tp):
        assert {h // n_rep for h in q_heads[r]} <= set(kv_heads[r]), (r, q_heads[r], kv_heads[r])
    w = config.hidden_dim // tp  # (with mlp=False the slices may not cover the width: only the heads are planned)
    return TPPlan(tp, q_heads, kv_heads, replicas, tuple((r * w, (r + 1) * w) for r in range(tp)))


def kv_bytes_per_rank(config: ModelConfig, tp: int, seq_len: int, batch: int = 1, dtype=torch.float32) -> int:
    """The cache one rank holds: 2 (K and V) x layers x batch x seq_len x (its K/V heads) x D x bytes."""
    heads = len(plan(config, tp, mlp=False).kv_heads[0])
    size = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.n_layers * batch * seq_len * heads * config.head_dim * size


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard @ W_shard^T) + b: this rank's slice of the input rows, summed over the group."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (C_out, C_in / tp)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)  # added once, after the sum
        self.group = group
        self.calls = 0  # all-reduces run (the notebook counts them per token)
        self.bytes = 0  # payload all-reduced (the tensor's bytes, not what a ring moves on the wire)
        self.decode_bytes = 0  # the same, for one-token forwards only (decode steps)
        self.decode_calls = 0
        self.seconds = 0.0  # wall time inside all_reduce: waiting for the peers + the transfer

    def forward(self, x):
        y = F.linear(x, self.weight)  # this rank's partial sum
        if dist.is_initialized():
            t0 = time.perf_counter()
            dist.all_reduce(y, group=self.group)  # every rank ends with the same bits
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            self.bytes += y.nbytes
            if y.shape[-2] == 1:
                self.decode_bytes += y.nbytes
                self.decode_calls += 1
        return y if self.bias is None else y + self.bias


def _rows(t: torch.Tensor | None, idx: torch.Tensor):
    return None if t is None else t.index_select(0, idx).clone()


def shard_model(model: Transformer, rank: int, tp: int, group=None) -> Transformer:
    """Rank ``rank``'s copy of ``model``: its heads and its slice of the MLP, with the o and down projections
    replaced by :class:`RowParallelLinear` (one all-reduce each). The full model is left unchanged."""
    p = plan(model.config, tp)
    c = model.config
    D = c.head_dim
    q_idx = torch.tensor([h * D + d for h in p.q_heads[rank] for d in range(D)])
    kv_idx = torch.tensor([h * D + d for h in p.kv_heads[rank] for d in range(D)])
    w = c.hidden_dim // tp
    h_idx = torch.arange(*p.hidden[rank])
    local_cfg = ModelConfig(**{**vars(c), "n_heads": len(p.q_heads[rank]), "n_kv_heads": len(p.kv_heads[rank]),
                               "hidden_dim": w, "head_dim": D})
    with torch.device("meta"):
        local = Transformer(local_cfg)
    state = {}
    full = model.state_dict()
    for name, t in full.items():
        if name.endswith(("attn.wq.weight", "attn.wq.bias")):
            t = _rows(t, q_idx)
        elif name.endswith(("attn.wk.weight", "attn.wk.bias", "attn.wv.weight", "attn.wv.bias")):
            t = _rows(t, kv_idx)
        elif name.endswith(("mlp.w_gate.weight", "mlp.w_gate.bias", "mlp.w_up.weight", "mlp.w_up.bias")):
            t = _rows(t, h_idx)
        elif name.endswith("attn.wo.weight"):
            t = t.index_select(1, q_idx).clone()  # (C, H*D) -> (C, its heads' columns)
        elif name.endswith("mlp.w_down.weight"):
            t = t.index_select(1, h_idx).clone()
        state[name] = t
    local.load_state_dict(state, assign=True)
    local.inv_freq = model.inv_freq.clone()
    if c.tie_embeddings:
        local.lm_head.weight = local.tok_emb.weight
    for layer in local.layers:  # the two row-split products become partial sums + one all-reduce each
        layer.attn.wo = RowParallelLinear(layer.attn.wo.weight.data, layer.attn.wo.bias, group)
        layer.mlp.w_down = RowParallelLinear(layer.mlp.w_down.weight.data, layer.mlp.w_down.bias, group)
    return local.eval()


def all_reduce_count(model: Transformer) -> int:
    """All-reduces this rank's model has run so far (two per layer per forward)."""
    return sum(m.calls for m in model.modules() if isinstance(m, RowParallelLinear))


def all_reduce_stats(model: Transformer) -> dict:
    """What this rank's all-reduces carried and cost so far: calls, payload bytes (all, and at one-token decode
    steps only), wall seconds spent inside them."""
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    return {"calls": sum(m.calls for m in rows), "bytes": sum(m.bytes for m in rows),
            "decode_bytes": sum(m.decode_bytes for m in rows), "seconds": sum(m.seconds for m in rows),
            "decode_forwards": sum(m.decode_calls for m in rows) // max(1, len(rows))}


def generate_tp(rank: int, world_size: int, model: Transformer, prompt: list[int], max_new_tokens: int) -> dict:
    """Rank function for ``launch.run``: greedy decoding with this rank's shard and its own cache.

    Returns the tokens, which heads this rank held, its cache's bytes and shape, the all-reduces run and the bytes
    they carried per decode step, and three timings of the decoding: wall seconds, the CPU seconds of the thread
    that ran the model (``time.thread_time``), and the wall seconds spent inside the all-reduces (waiting for the
    peers + the transfer; under NCCL only the launch, since NCCL returns before the GPU has finished).
    """
    from ..generate import generate
    from .launch import rank_device

    p = plan(model.config, world_size)
    local = shard_model(model, rank, world_size).to(rank_device())  # its GPU under NCCL
    del model  # this rank keeps only its shard
    max_len = len(prompt) + max_new_tokens
    cache = KVCache.for_model(local, batch=1, max_len=max_len)
    dist.barrier()  # every rank has its shard: time the decoding alone
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.no_grad():
        out = generate(local, [prompt], max_new_tokens, cache=cache)
    seconds, cpu_seconds = time.perf_counter() - t0, time.thread_time() - c0
    ar = all_reduce_stats(local)
    steps = max(1, ar["decode_forwards"])  # one-token forwards (the first token comes from the prefill)
    return {"rank": rank, "seconds": seconds, "cpu_seconds": cpu_seconds, "collective_seconds": ar["seconds"],
            "tokens": out[0].tolist(), "q_heads": p.q_heads[rank], "kv_heads": p.kv_heads[rank],
            "cache_bytes": cache.nbytes(), "cache_shape": tuple(cache.k[0].shape), "max_len": max_len,
            "all_reduces": ar["calls"], "all_reduce_bytes_per_step": ar["decode_bytes"] // steps,
            "weight_bytes": sum(t.nbytes for t in local.state_dict().values())}
