"""Known wrong answers to lab 11a's exercises (speculative decoding: rolling a paged sequence back, the acceptance rule,
and the decision of which k to speculate with): see kvlib.course.mistakes."""

from __future__ import annotations

import torch

__all__ = ["paged_state", "truncate_transcript", "truncate_seq", "accept_transcript", "speculative_accept", "k_choice"]

# --------------------------------------------------------------------------------------------
# Lab 11a · rolling a paged sequence back, the acceptance rule
# --------------------------------------------------------------------------------------------


def paged_state(cache, where: str) -> list[str]:
    """A paged cache's bookkeeping as text: tables and lengths, reference counts, the free stack, the registry."""
    a = cache.allocator
    tables = ", ".join(f"{s!r}: {t}" for s, t in cache.tables.items())
    lengths = ", ".join(f"{s!r}: {n}" for s, n in cache.lens.items())
    counts = {b: n for b, n in enumerate(a.refcount) if n}
    return [f"{where}: tables {{{tables}}}, lengths {{{lengths}}}",
            f"{where}: refcounts {counts}",
            f"{where}: free blocks, the next one handed out last: {list(a._free)}",
            f"{where}: registered blocks {sorted(cache.block_hash)}"]


def _append(cache, seq_id, tokens):
    """Feed ``tokens`` to ``seq_id`` through the cache's own seam, every layer (K and V of the right shapes)."""
    n_layers, (_, _, H_KV, D) = len(cache.k), cache.k[0].shape
    view = cache.batch([seq_id], [list(tokens)])
    x = torch.zeros(1, H_KV, len(tokens), D, dtype=cache.k[0].dtype)
    for layer in range(n_layers):
        view.attend(layer, x, x, x)


def truncate_transcript(make_cache, scenarios) -> list[str]:
    """What each scenario leaves in a fresh ``make_cache()`` after every truncate, as text lines.

    scenarios: {name: [operation, ...]}, an operation one of ("prompt", seq, tokens) (a new sequence: the
    prompt's cached prefix blocks are shared, the rest is fed), ("append", seq, tokens), ("fork", parent, child)
    or ("truncate", seq, length). A learner's exception is part of the transcript, and ends its scenario;
    NotImplementedError (an exercise not written yet) goes through."""
    lines = []
    for name, operations in scenarios.items():
        cache = make_cache()
        for op, seq, arg in operations:
            what = f"{op}({seq!r}, {arg!r})" if op in ("fork", "truncate") else f"{op}({seq!r}, {len(arg)} tokens)"
            try:
                if op == "prompt":
                    cached = cache.add_sequence(seq, arg)
                    _append(cache, seq, arg[cached:])
                elif op == "append":
                    _append(cache, seq, arg)
                elif op == "fork":
                    cache.fork(seq, arg)
                elif op == "truncate":
                    cache.truncate(seq, arg)
                else:
                    raise ValueError(f"unknown operation {op!r}")
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - a wrong rollback's error is part of its answer
                lines.append(f"{name}, {what}: raised {type(err).__name__}")
                break
            if op == "truncate":
                lines += paged_state(cache, f"{name}, {what}")
    return lines


def _truncate_seq(cache, seq_id, length, *, keep="ceil", shared="decrement", freed_hash=True, cut_hash=False,
                  last_hash=True, last_shared=False, set_length=True, order="last first", cut_table=True):
    """The block side of PagedKVCache.truncate with one mistake switched on (the right one with none)."""
    bs, table, a = cache.block_size, cache.tables[seq_id], cache.allocator
    n = {"ceil": -(-length // bs), "floor": length // bs, "plus one": length // bs + 1}[keep]
    cut = table[n:]
    for b in (reversed(cut) if order == "last first" else cut):
        if shared == "decrement":
            freed = a.free(b)
        else:  # back to the pool whoever else holds it
            while not a.free(b):
                pass
            freed = True
        if (freed and freed_hash) or cut_hash:
            cache.block_hash.pop(b, None)
    if cut_table:
        del table[n:]
    if last_hash and length % bs and table and (last_shared or a.refcount[table[-1]] == 1):
        cache.block_hash.pop(table[-1], None)
    if set_length:
        cache.lens[seq_id] = length


def truncate_seq(make_cache, scenarios):
    """The transcripts of the usual wrong rollbacks; make_cache(rollback) -> a fresh cache whose truncate runs
    ``rollback(cache, seq_id, length)``."""
    def each(**mistake):
        return lambda: truncate_transcript(lambda: make_cache(lambda c, s, n: _truncate_seq(c, s, n, **mistake)),
                                           scenarios)

    return {
        "one block too few: length // block_size rounds down, and the partly filled last block (with positions "
        "the sequence keeps) is released; keep ceil(length / block_size) blocks, -(-length // block_size)": each(
            keep="floor"),
        "one block too many when length is a multiple of block_size: length // block_size + 1 keeps an empty block "
        "(with a stale hash); keep ceil(length / block_size) blocks, -(-length // block_size)": each(keep="plus one"),
        "a block another sequence still holds went back to the pool: call allocator.free(b) once, it drops this "
        "sequence's reference and frees the block only when it was the last": each(shared="free"),
        "a freed block kept its hash: a later prompt could be handed a block that is free, and soon overwritten; "
        "when allocator.free(b) returns True, remove b from block_hash": each(freed_hash=False),
        "a released block lost its hash while another sequence still holds it, full and right: unregister a "
        "released block only when allocator.free(b) returns True": each(freed_hash=False, cut_hash=True),
        "the last kept block, no longer full, kept its hash: the next tokens overwrite its rows past length, and a "
        "prompt that finds it would read them; unregister it when this sequence alone holds it (refcount 1)": each(
            last_hash=False),
        "the last kept block lost its hash while another sequence holds it too: for that one it is still full and "
        "right (this one copies it before writing, copy-on-write); unregister it only at refcount 1": each(
            last_shared=True),
        "the length was not shortened: set cache.lens[seq_id] = length, or the next token goes after the rejected "
        "ones": each(set_length=False),
        "the blocks were released first to last: release them last first (reversed), so that the pool hands the "
        "cut blocks back out in their old order, the first one first (the free list is a stack)": each(
            order="first last"),
        "the released blocks stayed in the block table: cut it too, del table[keep:]": each(cut_table=False),
    }


def _accept(p, q, draft, generator=None, *, rule="ratio", resample="residual", bonus="d", upfront=False,
            clamp=True, count="i"):
    """The rejection rule with one mistake switched on (the right one with none): (accepted, next token)."""
    d = len(draft)
    u_all = torch.rand(d, generator=generator) if upfront else None
    for i, x in enumerate(draft):
        px, qx = float(p[i, x]), float(q[i, x])
        if rule == "deterministic":
            ok = px >= qx
        else:
            u = float(u_all[i]) if upfront else float(torch.rand((), generator=generator))
            ok = {"ratio": u * qx < px, "p": u < px, "inverted": u * px < qx}[rule]
        if ok:
            continue
        weights = {"residual": p[i] - q[i], "p": p[i], "swapped": q[i] - p[i]}[resample]
        if clamp and resample != "p":
            weights = weights.clamp(min=0)
        nxt = int(torch.multinomial(weights, 1, generator=generator))
        return (i + 1 if count == "i + 1" else i), nxt
    return d, int(torch.multinomial(p[d - 1 if bonus == "d - 1" and d else d], 1, generator=generator))


def accept_transcript(accept, cases, seeds) -> list[str]:
    """What ``accept(p, q, draft, generator)`` returns on each case with a generator seeded with each seed."""
    lines = []
    for name, (p, q, draft) in cases.items():
        for seed in seeds:
            try:
                a, nxt = accept(p.clone(), q.clone(), list(draft), torch.Generator().manual_seed(seed))
                lines.append(f"{name}, seed {seed}: accepted {int(a)}, next token {int(nxt)}")
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - a wrong rule's error is part of its answer
                lines.append(f"{name}, seed {seed}: raised {type(err).__name__}")
    return lines


def speculative_accept(cases, seeds):
    """The transcripts of the usual wrong acceptance rules on the lab's cases."""
    def each(**mistake):
        return lambda: accept_transcript(lambda p, q, d, g: _accept(p, q, d, g, **mistake), cases, seeds)

    return {
        "a draft was accepted whenever p(x) >= q(x), without a random draw: accept with probability "
        "min(1, p(x) / q(x)), i.e. when u * q(x) < p(x) for a fresh uniform u": each(rule="deterministic"),
        "a draft was accepted with probability p(x): the rule divides by the drafter's q(x), accept when "
        "u * q(x) < p(x)": each(rule="p"),
        "the ratio is upside down, q(x) / p(x): accept when u * q(x) < p(x)": each(rule="inverted"),
        "after a rejection the token was drawn from p: draw it from the residual max(0, p - q) (normalised), "
        "which holds exactly the probability the accepted drafts did not cover": each(resample="p"),
        "the residual is max(0, q - p): it is what the target wants *more* of than the drafter gave, "
        "max(0, p - q)": each(resample="swapped"),
        "the residual p - q was not clamped at 0: torch.multinomial refuses negative weights; "
        "(p[i] - q[i]).clamp(min=0)": each(clamp=False),
        "the bonus token (all d drafts accepted) came from p[d - 1]: it is the target's next distribution, "
        "p[d], the row after the last draft": each(bonus="d - 1"),
        "at a rejection, i + 1 drafts were counted as accepted: drafts 0 .. i - 1 were, so i": each(count="i + 1"),
        "the d uniforms were drawn all at once, before the loop: draw one per draft, only until the first "
        "rejection, so that the resample takes the generator's next numbers (the order the spec states)": each(
            upfront=True),
    }


# --------------------------------------------------------------------------------------------
# Lab 11a's decision: which k, or none
# --------------------------------------------------------------------------------------------


def _speeds(evidence, task) -> dict:
    """{k: predicted speed-up} for one task: (new tokens - 1) one-token forwards over what the run's steps cost."""
    part = evidence[evidence.task == task]
    plain = float(part["new tokens"].iloc[0] - 1)
    return {int(r.k): plain / r["cost of the steps (forwards over 1)"] for _, r in part.iterrows()}


def k_choice(yours: dict, ref: dict, evidence, margin: float = 1.05) -> list[str]:
    """Lab 11a's decision ({task: k, 0 = do not speculate}): why each wrong k is not the reference's, from the evidence
    (``kvlib.course.ch11a.k_evidence``), in one short line each. ``margin``: the predicted speed-up a k must reach
    (``kvlib.course.ch11a.MARGIN``)."""
    MARGIN = margin
    lines = []
    for task, r in ref.items():
        y = yours.get(task)
        if y == r:
            continue
        speeds = _speeds(evidence, task)
        part = evidence[evidence.task == task].set_index("k")
        if isinstance(y, bool) or not isinstance(y, int) or (y != 0 and y not in speeds):
            lines.append(f"{task}: {y!r} is not one of " + ", ".join(str(k) for k in [0, *speeds]))
            continue
        best = max(speeds, key=speeds.get)
        said = f"{task}: k = {y}" if y else f"{task}: 0 (plain decoding)"
        tpf = part["tokens per forward"]
        if y and y != best and tpf[y] == tpf.max() and int((tpf == tpf.max()).sum()) == 1:
            lines.append(f"{said} yields the most tokens per forward ({part.loc[y, 'tokens per forward']:.2f}), but "
                         f"its steps cost {part.loc[y, 'cost of the steps (forwards over 1)']:.1f} forwards over one")
        if y and y == int(part["share of drafts accepted"].idxmax()) and y != best:
            lines.append(f"{said} has the highest share of drafts accepted: that share falls with k because drafts "
                         "after a rejection are never checked; what pays is tokens per forward against the cost")
        if y and r == 0:
            lines.append(f"{said} is predicted at {speeds[y]:.2f}x; no k reaches {MARGIN:.2f}x (best {speeds[best]:.2f}x "
                         f"at k = {best}): decode without speculation")
        elif y == 0:
            lines.append(f"{said}, but k = {r} is predicted at {speeds[r]:.2f}x, above {MARGIN:.2f}x")
        else:
            lines.append(f"{said} is predicted at {speeds[y]:.2f}x, k = {r} at {speeds[r]:.2f}x (plain: new tokens - 1 "
                         "one-token forwards; each step: one forward over its d + 1 tokens)")
    return lines
