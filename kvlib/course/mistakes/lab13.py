"""Known wrong answers to lab 13's exercises (the capstone): see kvlib.course.mistakes.

Exercises 1 and 2 (the paged INT8 store and load, the block-level eviction rule) get ``{description: wrong result}``
for ``check``; the three decisions (rule, budget, block size) get a diagnosis from the evidence the lab printed."""

from __future__ import annotations

import torch

__all__ = ["store_int8", "drop_blocks", "rule_choice", "budget_choice", "block_choice"]


def store_int8(codes, scales, rows, slots) -> dict:
    """Mistakes of the quantize-on-store, as the (codes, scales) pools they leave."""
    from ...quant import quantize_int8

    H_KV, D = codes.shape[2], codes.shape[3]

    def written(q, s):
        c, sc = codes.clone(), scales.clone()
        c.view(-1, H_KV, D)[slots] = q
        sc.view(-1, H_KV)[slots] = s.to(sc.dtype).expand(len(slots), H_KV)
        return c, sc

    def per_tensor():
        q, s = quantize_int8(rows, dim=None)  # one scale for everything (the source article's choice)
        return written(q, s.reshape(1, 1))

    def per_token():
        q, s = quantize_int8(rows, dim=(1, 2))  # one scale per token, shared by its heads
        return written(q, s.reshape(-1, 1))

    def no_rounding():
        amax = rows.abs().amax(-1, keepdim=True)
        s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        return written((rows / s).to(torch.int8), s[..., 0])  # truncates toward zero

    return {"one scale for the whole tensor (per-tensor): a row's scale is its own absmax / 127": per_tensor,
            "one scale per token shared by its K/V heads: each (token, head) row gets its own scale": per_token,
            "the codes are truncated, not rounded: round half away from zero before the cast to int8": no_rounding}


def drop_blocks(table, held, budget, block_size, sink_blocks) -> dict:
    """Mistakes of the block-level eviction rule, as the number of blocks they would drop."""
    def until_under():  # drops one block too many: stops only when strictly under the budget
        n = 0
        while held - n * block_size >= budget and len(table) - n > sink_blocks + 1:
            n += 1
        return n

    def whole_overflow():  # divides the overflow rounding down: drops only a whole block's worth of overflow
        over = max(0, held - budget)
        return min(over // block_size, max(0, len(table) - sink_blocks - 1))

    def sinks_too():  # the sink blocks are dropped like the others
        n = 0
        while held - n * block_size > budget and len(table) - n > 1:
            n += 1
        return n

    return {"it drops until strictly under the budget: a sequence at exactly the budget keeps every block":
            until_under,
            "it rounds the overflow down: the sequence stays over the budget until a whole block's worth has built up":
            whole_overflow,
            "the sink blocks are dropped too: the first sink_blocks blocks are never given back": sinks_too}


def rule_choice(yours, accepted, evidence) -> list[str]:
    if yours not in evidence.index:
        return [f"{yours!r} is not one of the rules: " + ", ".join(repr(r) for r in evidence.index)]
    mine = evidence.loc[yours]
    if not bool(mine["meets target"]):
        return [f"{yours} holds {mine['decode peak KiB']:.0f} KiB per sequence during a decode step: over the memory "
                "target"]
    best = evidence.loc[accepted[0]]
    lines = [f"{yours} fits, but its perplexity {mine['perplexity']:.1f} [{mine['ppl low']:.1f}, {mine['ppl high']:.1f}]"
             f" is separated from {accepted[0]}'s {best['perplexity']:.1f} [{best['ppl low']:.1f}, {best['ppl high']:.1f}]"]
    if yours == "window":
        lines.append("without a sink block the first tokens go, and the attention the model parks there goes "
                     "elsewhere (chapter 09a's attention sinks)")
    return lines


def budget_choice(yours, ref, evidence, target_bytes) -> list[str]:
    if yours not in evidence.index:
        return [f"{yours!r} is not one of the budgets: " + ", ".join(str(b) for b in evidence.index)]
    mine = evidence.loc[yours]
    target = target_bytes / 1024
    if not bool(mine["meets target"]):
        line = f"budget {yours} holds {mine['decode peak KiB']:.0f} KiB during a decode step, over the {target:.0f} KiB target"
        if mine["between steps KiB"] <= target:
            line += (f": between steps it holds {mine['between steps KiB']:.0f} KiB, but a step that opens a block "
                     "takes the block before the forward and eviction gives one back only after it, so the pool pays "
                     "one block more")
        elif mine["int8 codes count KiB"] <= target:
            line += ": the int8 codes alone fit, but every row has an fp16 scale and every block a table entry"
        return [line]
    lines = [f"budget {yours} fits ({mine['decode peak KiB']:.0f} KiB during a decode step), but {ref} fits too and a "
             "window with more budget holds every position a smaller one holds"]
    if mine["fp16 count KiB"] <= target < evidence.loc[ref, "fp16 count KiB"]:
        lines.append("counting the budget's positions at fp16 bytes misses the point of the INT8 cache: measure "
                     "what it holds")
    return lines


def block_choice(yours, ref, evidence, keep_pct) -> list[str]:
    if yours not in evidence.index:
        return [f"{yours!r} is not one of the block sizes: " + ", ".join(str(b) for b in evidence.index)]
    mine = evidence.loc[yours]
    if "meets target" in evidence and not bool(mine["meets target"]):
        return [f"blocks of {yours} hold {mine['decode peak KiB']:.0f} KiB during a decode step, over the target: the "
                f"step that opens a block holds a whole block of {yours} more until eviction runs"]
    if mine["held % of budget"] < keep_pct:
        return [f"blocks of {yours} hold {mine['held % of budget']:.0f}% of the budget on average, under {keep_pct:g}%: "
                f"eviction frees a whole block at a time, so the window saws down by up to {yours - 1} positions, and "
                f"the sink block takes {yours} of them"]
    return [f"blocks of {yours} keep {mine['held % of budget']:.0f}% of the budget, but blocks of {ref} keep "
            f"{evidence.loc[ref, 'held % of budget']:.0f}% and fit the target too: the rule asks for the larger block "
            "(a shorter block table, fewer blocks to allocate and free)"]
