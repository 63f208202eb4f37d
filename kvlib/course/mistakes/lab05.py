"""Known wrong answers to lab 05's exercises (paged KV): see kvlib.course.mistakes."""

from __future__ import annotations

import torch

from ._common import GQA_MODULO, NO_SQRT_D
from .lab03 import _decode

__all__ = ['allocator_step', 'slot_of', 'slot_by_hand', 'gather_kv', 'paged_attention_one', 'combine_blocks',
           'block_size_choice']

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
    } if not torch.isinf(lses).any() else {
        "a block with no valid position (lse = -inf, output NaN) has weight 0, but 0 × NaN is NaN: leave its "
        "output out of the sum where its weight is 0": lambda: (w * outs).sum(dim=0) / w.sum(dim=0),
    }




def slot_by_hand(table, pos, block_size, yours) -> str:
    """Exercise 2's first question (the slot of one position, read off the picture): what a wrong number means."""
    logical, offset = divmod(pos, block_size)
    if yours == pos:
        return (f"that is the position itself, as if logical block {logical} were kept in block {logical}: the pool is "
                f"shared, and the table keeps it in physical block {table[logical]}")
    if yours == table[logical] + offset:
        return (f"block {table[logical]} is right, but its slots start at {table[logical]} × {block_size} = "
                f"{table[logical] * block_size}: a block holds block_size slots")
    if yours == table[logical] * block_size + pos:
        return "the offset inside the block is pos % block_size, not pos (the first source article's global offset)"
    if 0 <= logical + 1 < len(table) and yours == table[logical + 1] * block_size + offset:
        return f"logical block pos // block_size = {logical} (counting from 0), not {logical + 1}"
    if isinstance(yours, int) and yours // block_size == table[logical]:
        return (f"block {table[logical]} is right, but slot {yours % block_size} inside it is not: position {pos} sits "
                f"at pos % block_size = {offset}, counting the block's slots from 0")
    if isinstance(yours, int) and yours % block_size == offset and yours // block_size in table:
        entry = table.index(yours // block_size)
        return (f"the right slot inside the block, but in table entry {entry} (block {yours // block_size}); position "
                f"{pos} is in logical block pos // block_size = {logical}, so entry {logical}: block {table[logical]}")
    return ""


def block_size_choice(evidence, yours: int, ref: int, tolerance: float) -> str:
    """Lab 05's decision (the largest block size whose mean steps over the seeds are within ``tolerance`` of the
    fastest's): why ``yours`` is not the answer, from the simulator's evidence (a DataFrame indexed by block size)."""
    if yours not in evidence.index:
        return f"{yours} is not one of the candidates {list(evidence.index)}"
    mine, best = evidence.loc[yours], evidence.loc[ref]
    lead = "16 is vLLM's default, not the answer for every length mix; " if yours == 16 else ""
    if yours < ref:
        return (f"{lead}block {yours} is fast enough, but so is block {ref} ({best['vs fastest']:.1%} more steps "
                f"than the fastest on average over the seeds, within {tolerance:.0%}), and its block tables are "
                f"{ref // yours}× shorter: less fragmentation is not worth it once the steps are within the tolerance")
    return (f"{lead}block {yours} took {mine['vs fastest']:.1%} more steps than the fastest on average over the seeds "
            f"(more than {tolerance:.0%}): its partly filled last blocks waste {mine['internal fragmentation']:.1%} of "
            f"the allocated memory, so {mine['mean running']:.1f} requests run at once against "
            f"{best['mean running']:.1f} with block {ref}")
