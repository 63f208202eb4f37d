"""Known wrong answers to lab 05's exercises (paged KV): see kvlib.course.mistakes."""

from __future__ import annotations

import torch

from ._common import GQA_MODULO, NO_SQRT_D
from .lab03 import _decode

__all__ = ['allocator_step', 'slot_of', 'gather_kv', 'paged_attention_one', 'combine_blocks']

# --------------------------------------------------------------------------------------------
# Lab 05 · paged KV
# --------------------------------------------------------------------------------------------


def allocator_step(call: str, yours: str, reference: str) -> str:
    """A diagnosis for the first step where a learner's allocator and the reference disagree."""
    op = call.split("(")[0]
    if reference == "OutOfBlocksError" and yours != reference:
        if yours.endswith("Error"):
            return f"raise OutOfBlocksError when too few blocks are free, not {yours}"
        return "allocate must raise OutOfBlocksError when fewer than n blocks are free (and change nothing)"
    if reference == "ValueError" and yours != reference:
        return (f"{op} of an id that is not in the pool, or of a free block, must raise ValueError: "
                "call self._check(block) first")
    if op == "allocate" and reference.startswith("[") and yours.startswith("["):
        if sorted(eval(yours)) == sorted(eval(reference)):  # noqa: S307 - our own repr of a list of ints
            return "the right blocks in the wrong order: pop them one by one from the end of _free"
        return "other blocks than the reference's: _free is a stack, pop() from its end (and free pushes on it)"
    if op == "free" and reference in ("True", "False") and yours not in ("True", "False"):
        return "free must return True when the block went back to the pool, False while others still use it"
    if op == "free" and {yours, reference} == {"True", "False"}:
        return ("free returned the wrong bool: a block goes back to the pool (True) only when its count "
                "reaches 0")
    return ""


def slot_of(table, n_tokens, block_size):
    def each(f):
        return lambda: torch.tensor([f(pos) for pos in range(n_tokens)])

    return {
        "the block table is not used: logical block pos // block_size is not where the data is; look up "
        "block_table[pos // block_size]": each(lambda pos: pos),
        "the block is not multiplied by block_size: block b's rows start at slot b * block_size": each(
            lambda pos: table[pos // block_size] + pos % block_size),
        "a global offset inside the block (the source article's mistake): the row inside block "
        "block_table[i] is pos % block_size, not pos": each(lambda pos: table[pos // block_size] * block_size + pos),
    }


def gather_kv(k_blocks, table, seq_len):
    bs = k_blocks.shape[1]
    n = -(-seq_len // bs)
    return {
        "the block table is not used: the pool's blocks 0, 1, 2 … are not the sequence's; read "
        "k_blocks[block_table[pos // block_size], pos % block_size]": lambda: k_blocks.reshape(
            -1, *k_blocks.shape[2:])[:seq_len],
        f"whole blocks were gathered ({n * bs} rows); only the first seq_len = {seq_len} positions belong to the "
        "sequence": lambda: k_blocks[table.long()[:n]].reshape(-1, *k_blocks.shape[2:]),
    }


def paged_attention_one(q, k_blocks, v_blocks, table, seq_len):
    bs, H_KV = k_blocks.shape[1], k_blocks.shape[2]

    def gathered(L, ignore_table=False):
        pos = torch.arange(L)
        blocks = pos // bs if ignore_table else table.long()[pos // bs]
        k = k_blocks[blocks, pos % bs].transpose(0, 1)[None]  # (1, H_KV, L, D)
        v = v_blocks[blocks, pos % bs].transpose(0, 1)[None]
        return k, v

    def run(L=seq_len, ignore_table=False, **kw):
        k, v = gathered(L, ignore_table)
        return _decode(q[None], k, v, [L], **kw)[0]

    full = -(-seq_len // bs) * bs
    out = {
        NO_SQRT_D: lambda: run(scale=1.0),
        "the block table is not used: the pool's blocks 0, 1, 2 … are not the sequence's": lambda: run(
            ignore_table=True),
        f"the whole last block was read ({full} positions): only seq_len = {seq_len} are the sequence's": lambda: run(
            full),
    }
    if 1 < H_KV < q.shape[0]:
        out[GQA_MODULO] = lambda: run(head=lambda h: h % H_KV)
    return out


def combine_blocks(outs, lses):
    m = lses.max(dim=0).values
    w = torch.exp(lses - m)[..., None]
    return {
        "the blocks' outputs are averaged: each must weigh by its share exp(lse_i) of the total softmax sum":
            lambda: outs.mean(dim=0),
        "the blocks' outputs are added: each is already normalised over its own block": lambda: outs.sum(dim=0),
        "the weighted sum is not divided by the sum of the weights": lambda: (w * outs).sum(dim=0),
        "the weights are lse_i themselves; the weights are exp(lse_i - m)": lambda: (
            lses[..., None] * outs).sum(dim=0) / lses[..., None].sum(dim=0),
    }


