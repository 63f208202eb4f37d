"""Decode context parallelism: the cached sequence striped across ranks, partial attentions merged by log-sum-exp.

What you will learn here:
- how ``cp`` ranks share one sequence's cache: token ``p`` is stored only on rank ``p % cp`` (vLLM's DCP
  stores the same way, with its default interleave size 1), so each rank holds about ``S / cp`` positions of
  every layer and every K/V head;
- why that is exact: at a decode step each rank attends the new query over *its* positions and returns
  (output, log-sum-exp); chapter 03's split-K merge, ``sum_r exp(lse_r - m) o_r / sum_r exp(lse_r - m)``, turns
  the partials into attention over all positions. Here the "splits" live on different processes, and one
  all-gather per layer brings them together (:class:`StripedCache`);
- what it costs: the cache bytes per rank fall by ``cp``; each decode step all-gathers ``B x H x (D + 1)``
  fp32 numbers per layer from every rank (:func:`allgather_bytes_per_step`), independent of the length S.

Simplifications, named where the chapter shows them: every rank holds the whole model (vLLM's DCP reuses the
tensor-parallel ranks, whose weights are split); the prompt is prefilled on every rank, which then keeps
only its stripe (DCP shards what the prefill wrote the same way); one all-gather of (output, lse) per layer
(vLLM all-gathers the queries and reduce-scatters the outputs, or uses an all-to-all).

The merge runs chapter 03's kernel (``kvlib.cache.merge_splits``) when the cache's kernels are Triton (on a
GPU); on a CPU the Triton interpreter would spend tens of milliseconds per call, so :func:`merge_ref`, the same
formula in PyTorch, runs instead (as every kvlib cache uses the ``_ref`` of its kernels on a CPU).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..attention import attention_ref
from ..cache import merge_splits, pick_kernels
from ..model import Transformer

__all__ = ["owner", "stripe", "merge_ref", "merge", "local_attention", "StripedCache", "kv_bytes_per_rank",
           "allgather_bytes_per_step", "generate_cp"]

LOG2E = 1.0 / math.log(2.0)  # chapter 03's kernels keep log-sum-exps in log2 units: lse2 = lse * log2(e)


def owner(position: int, cp: int) -> int:
    """The rank that stores position ``position``: round robin (vLLM DCP's interleave size 1)."""
    return position % cp


def stripe(rank: int, cp: int, seq_len: int) -> list[int]:
    """The positions rank ``rank`` stores out of ``seq_len``.

    >>> stripe(1, 3, 10)
    [1, 4, 7]
    """
    return list(range(rank, seq_len, cp))


def merge_ref(part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Chapter 03's merge in PyTorch: partials (N, SPLITS, D) with their log-sum-exps (N, SPLITS), natural
    log, -inf for an empty split -> (N, D) = sum_s exp(lse_s - m) part_s / sum_s exp(lse_s - m), m = max_s lse_s.
    At least one split of each row must be non-empty (all empty gives NaN; ``StripedCache`` stores the new token
    before anyone attends, so it never happens there)."""
    m = lse.max(dim=1, keepdim=True).values  # (N, 1): every exponent below is <= 0, nothing overflows
    w = torch.exp(lse - m)  # (N, SPLITS): each split's share of the row's softmax sum (0 for an empty split)
    return (w[..., None] * part).sum(1) / w.sum(1, keepdim=True)


def merge(q: torch.Tensor, part: torch.Tensor, lse: torch.Tensor, kernels: str) -> torch.Tensor:
    """(B, H, D) attention from the ranks' partials: part (B, H, R, D), lse (B, H, R) natural log.

    kernels "triton": chapter 03's ``merge_splits`` kernel (log2 units, splits padded to a power of two with
    empty ones); "torch": :func:`merge_ref`."""
    B, H, R, D = part.shape
    part, lse = part.reshape(B * H, R, D).float(), lse.reshape(B * H, R).float()
    if kernels != "triton":
        return merge_ref(part, lse).view(B, H, D).to(q.dtype)
    pad = (1 << (R - 1).bit_length()) - R  # the kernel's tl.arange needs a power-of-two split count
    if pad:
        part = torch.cat([part, part.new_zeros(B * H, pad, D)], dim=1)
        lse = torch.cat([lse, lse.new_full((B * H, pad), float("-inf"))], dim=1)
    return merge_splits(q, part.contiguous(), (lse * LOG2E).contiguous())


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """One query token over this rank's positions: q (B, H, D), k/v (B, H_KV, S_r, D) ->
    (output (B, H, D), log-sum-exp (B, H)); S_r = 0 gives output 0 and lse -inf (an empty split)."""
    B, H, D = q.shape
    if k.shape[2] == 0:
        return q.new_zeros(B, H, D, dtype=torch.float32), q.new_full((B, H), float("-inf"), dtype=torch.float32)
    n_rep = H // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)  # (B, H, S_r, D): GQA, each K/V head serves n_rep query heads
    v = v.repeat_interleave(n_rep, dim=1)
    scores = (q[:, :, None, :] @ k.transpose(-1, -2))[:, :, 0].float() / math.sqrt(D)  # (B, H, S_r)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H)
    probs = torch.exp(scores - lse[..., None])  # softmax over this rank's positions only
    return (probs[:, :, None, :] @ v.float())[:, :, 0], lse  # (B, H, D), (B, H)


class StripedCache:
    """This rank's stripe of a batch's cache, plugged into ``Transformer.forward(..., cache=...)``.

    Prefill (T > 1, from an empty cache): causal attention over the whole prompt, then only the positions
    this rank owns are kept. Decode (T = 1): the new K/V is stored by its owner; every rank attends over its
    stripe, the (output, lse) partials are all-gathered (one collective per layer) and merged.
    ``positions[b]`` lists the global positions this rank holds for sequence b (all sequences advance together).
    """

    def __init__(self, model: Transformer, batch: int, max_len: int, rank: int, cp: int, kernels=None, group=None):
        c = model.config
        self.rank, self.cp, self.group = rank, cp, group
        self.kernels = pick_kernels(kernels, model.device)
        self.capacity = -(-max_len // cp)  # ceil(max_len / cp): the most positions one rank can own
        shape = (batch, c.n_kv_heads, self.capacity, c.head_dim)  # (B, H_KV, S_max / cp, D)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.n_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.n_layers)]
        self.seq_len = 0  # global positions filled (the same for every sequence of the batch)
        self.held = 0  # rows filled in this rank's buffers
        self.max_len = max_len
        self.gathered_bytes = 0  # bytes this rank received from the others in all-gathers (measured on the tensors)
        self.gathers = 0
        self.gather_seconds = 0.0  # wall time inside all_gather: waiting for the peers + the transfer

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def positions(self) -> list[int]:
        """The global positions this rank holds."""
        return stripe(self.rank, self.cp, self.seq_len)

    def next_positions(self, batch: int) -> torch.Tensor:
        return torch.full((batch, 1), self.seq_len, dtype=torch.long, device=self.k[0].device)

    def attend(self, layer_idx, q, k, v):
        """q (B, H, T, D), k/v (B, H_KV, T, D) of the new tokens -> (B, H, T, D)."""
        T = q.shape[2]
        last = layer_idx == len(self.k) - 1
        if T > 1:
            if self.seq_len:
                raise ValueError("StripedCache prefills from an empty cache only (one prompt per batch row)")
            if T > self.max_len:
                raise ValueError(f"the prompt ({T} positions) is longer than max_len={self.max_len}")
            mine = torch.tensor(stripe(self.rank, self.cp, T), dtype=torch.long, device=q.device)
            self.k[layer_idx][:, :, : len(mine)] = k.index_select(2, mine)  # keep only this rank's stripe
            self.v[layer_idx][:, :, : len(mine)] = v.index_select(2, mine)
            if last:
                self.seq_len, self.held = T, len(mine)
            return attention_ref(q, k, v, causal=True)  # (B, H, T, D): the whole prompt, on every rank
        if self.seq_len >= self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; it is full")
        held = self.held
        if owner(self.seq_len, self.cp) == self.rank:  # the new token's K/V lives on one rank only
            self.k[layer_idx][:, :, held] = k[:, :, 0]
            self.v[layer_idx][:, :, held] = v[:, :, 0]
            held += 1
        part, lse = local_attention(q[:, :, 0], self.k[layer_idx][:, :, :held], self.v[layer_idx][:, :, :held])
        mine = torch.cat([part, lse[..., None]], dim=-1).contiguous()  # (B, H, D + 1): one collective per layer
        if self.cp > 1:
            parts = [torch.empty_like(mine) for _ in range(self.cp)]
            t0 = time.perf_counter()
            dist.all_gather(parts, mine, group=self.group)
            self.gather_seconds += time.perf_counter() - t0
            self.gathered_bytes += mine.nbytes * (self.cp - 1)
            self.gathers += 1
        else:
            parts = [mine]
        both = torch.stack(parts, dim=2)  # (B, H, cp, D + 1)
        out = merge(q[:, :, 0], both[..., :-1], both[..., -1], self.kernels)  # (B, H, D)
        if last:
            self.seq_len += 1
            self.held = held
        return out[:, :, None]  # (B, H, 1, D)


def kv_bytes_per_rank(config, cp: int, max_len: int, batch: int = 1, dtype=torch.float32) -> int:
    """The cache one rank preallocates: 2 x layers x batch x ceil(max_len / cp) x H_KV x D x bytes."""
    size = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.n_layers * batch * -(-max_len // cp) * config.n_kv_heads * config.head_dim * size


def allgather_bytes_per_step(config, cp: int, batch: int = 1) -> int:
    """Bytes one rank receives per decode step: layers x (cp - 1) x B x H x (D + 1) fp32 numbers x 4.
    It does not grow with the sequence: the partials are per query head, not per position."""
    return config.n_layers * (cp - 1) * batch * config.n_heads * (config.head_dim + 1) * 4


@torch.no_grad()
def greedy(model: Transformer, prompt: list[int], max_new_tokens: int, cache: StripedCache) -> list[int]:
    """Greedy decoding through a striped cache (prefill, then one token per step): the new token ids."""
    ids = torch.tensor([list(prompt)], device=model.device)
    logits = model(ids, cache=cache, logits_to_keep=1)
    new = []
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(dim=-1)  # (1,)
        new.append(int(nxt))
        if step == max_new_tokens - 1:
            break
        logits = model(nxt[:, None], positions=cache.next_positions(1), cache=cache)
    return new


def generate_cp(rank: int, world_size: int, model: Transformer, prompt: list[int], max_new_tokens: int,
                kernels=None) -> dict:
    """Rank function for ``launch.run``: greedy decoding with the sequence striped over ``world_size`` ranks.

    Returns the new tokens (as ``kvlib.generate.generate`` does), the positions this rank held, its cache bytes, the
    all-gather bytes it received per decode step (measured on the tensors it gathered), and three timings of the
    decoding: wall seconds, the CPU seconds of the thread that ran the model (``time.thread_time``), and the wall
    seconds spent inside the all-gathers (waiting for the peers + the transfer; under NCCL only the launch)."""
    from .launch import rank_device

    model = model.to(rank_device())  # its GPU under NCCL (a copy per rank); on the CPU the shared weights
    max_len = len(prompt) + max_new_tokens
    cache = StripedCache(model, batch=1, max_len=max_len, rank=rank, cp=world_size, kernels=kernels)
    if dist.is_initialized():
        dist.barrier()  # time the decoding alone
    t0, c0 = time.perf_counter(), time.thread_time()
    new = greedy(model, prompt, max_new_tokens, cache)
    seconds, cpu_seconds = time.perf_counter() - t0, time.thread_time() - c0
    steps = max(1, cache.gathers // model.config.n_layers)  # steps that gathered (a 1-token prompt's prefill too)
    return {"rank": rank, "seconds": seconds, "cpu_seconds": cpu_seconds, "collective_seconds": cache.gather_seconds,
            "tokens": new, "positions": cache.positions(), "cache_bytes": cache.nbytes(),
            "max_len": max_len, "gathered_bytes_per_step": cache.gathered_bytes // steps,
            "gathers_per_step": cache.gathers // steps}
