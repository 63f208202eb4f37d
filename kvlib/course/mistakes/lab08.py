"""Known wrong answers to lab 08's exercises (serving): see kvlib.course.mistakes."""

from __future__ import annotations

import torch

__all__ = ['admission', 'preemption', 'chunk_slots', 'swap_or_recompute', 'crossover', 'preemption_choice',
           'host_tier_choice', 'cached_tokens']

# --------------------------------------------------------------------------------------------
# Lab 08 · serving
# --------------------------------------------------------------------------------------------


def _admit(step, *, watermark=True, when_idle=False, stop=True, cached=True, round_up=True, extra=0,
           accumulate=True):
    """Which waiting requests (queue indices) one scheduler step admits, under a configurable rule."""
    bs = step["block_size"]
    reserve = int(step["watermark"] * step["num_blocks"]) if watermark else 0
    committed, running = sum(step["running_needs"]), len(step["running_needs"])
    admitted = []
    for i, (n_tokens, cached_tokens) in enumerate(step["waiting"]):
        blocks = -(-(n_tokens + extra) // bs) if round_up else (n_tokens + extra) // bs
        need = blocks - (cached_tokens // bs if cached else 0)
        left = step["free_blocks"] - committed - (reserve if running or when_idle else 0)
        if need <= left:
            admitted.append(i)
            running += 1
            committed += need if accumulate else 0
        elif stop:
            break
    return admitted


def admission_flags(decisions, width):
    """Per step, a row of ``width`` flags: True for each queue position admitted (steps, width)."""
    out = torch.zeros(len(decisions), width, dtype=torch.bool)
    for s, admitted in enumerate(decisions):
        for i in admitted:
            out[s, i] = True
    return out


def admission(trace):
    """trace: the steps of an engine run, each a dict of admit()'s arguments."""
    width = max(len(s["waiting"]) for s in trace)

    def each(**rule):
        return lambda: admission_flags([_admit(s, **rule) for s in trace], width)

    return {
        "the watermark is ignored: with requests running, leave int(watermark * num_blocks) blocks free for "
        "them to grow into": each(watermark=False),
        "the watermark is kept even when nothing runs: a request that needs almost the whole pool would then "
        "never get in (the engine would stall)": each(when_idle=True),
        "admission skips a request that does not fit and tries the next ones: first come, first served stops "
        "at the first misfit, or a long request could wait forever behind short ones": each(stop=False),
        "the cached tokens are counted as needing blocks: blocks of a cached prefix are shared, not taken from "
        "the pool; subtract cached_tokens // block_size": each(cached=False),
        "the blocks are rounded down (n_tokens // block_size): a partly filled last block is still a block, "
        "ceil(n_tokens / block_size)": each(round_up=False),
        "one position too many (n_tokens + 1): the engine stores a generated token only at the next step, "
        "when it counts among the running requests' pending tokens": each(extra=1),
        "an admitted request's blocks are not added to what the running requests need: the next candidate "
        "in the same step must fit beside it too": each(accumulate=False),
    }


def _preempt(step, *, victim="newest", release=True, promise=True):
    """Which running requests (ids, in order) one step preempts, under a configurable rule."""
    free, alive, victims, promised = step["free_blocks"], list(step["running"]), [], 0
    for r in step["running"]:
        rid, _, need = r
        if rid in victims:
            continue
        while need > free - (promised if promise else 0):
            others = [x for x in alive if x[0] != rid]
            if victim == "newest":
                v = alive[-1]
            elif victim == "oldest":
                v = others[0] if others else r
            elif victim == "first":  # alive.pop(0): the oldest still running, the asking request included
                v = alive[0]
            elif victim == "self":
                v = r
            else:  # the one holding the most blocks
                v = max(alive, key=lambda x: (x[1], x[0]))
            alive.remove(v)
            victims.append(v[0])
            free += v[1] if release else 0
            if v[0] == rid:
                break
        else:
            promised += need
    return victims


def preemption_flags(decisions, trace):
    """Per step and running position, the order (1, 2 ...) in which it was preempted, 0 if not (steps, width)."""
    width = max(len(s["running"]) for s in trace)
    out = torch.zeros(len(decisions), width, dtype=torch.int64)
    for s, (victims, step) in enumerate(zip(decisions, trace)):
        ids = [r[0] for r in step["running"]]
        for order, rid in enumerate(victims, start=1):
            out[s, ids.index(rid)] = order
    return out


def preemption(trace):
    """trace: decode-only steps of an engine run, each {"free_blocks", "running": [(id, held, need)]}."""

    def each(**rule):
        return lambda: preemption_flags([_preempt(s, **rule) for s in trace], trace)

    return {
        "the oldest request was preempted: the newest gives way, so the requests that have waited longest "
        "finish first": each(victim="oldest"),
        "the oldest running request was preempted (alive.pop(0), which is the asking request itself when it is "
        "the oldest): the newest gives way, alive.pop(), so the requests that have waited longest finish first":
            each(victim="first"),
        "the request that asked for a block preempted itself although newer ones were running: the newest "
        "running request gives way, and the asking one only when it is the newest": each(victim="self"),
        "the request holding the most blocks was preempted: the engine's rule is by age, newest first": each(
            victim="longest"),
        "a preempted request's blocks were not given back: after preempting, its held blocks are free "
        "again (free_blocks += held)": each(release=False),
        "the blocks promised to older requests in this step were not subtracted: each request must fit in "
        "free_blocks minus what the older ones already took": each(promise=False),
    }


def chunk_slots(cases):
    """cases: [(block_table, block_size, seq_len, T), ...]; the slots of all chunks, concatenated."""

    def each(f):
        return lambda: torch.tensor([f(table, bs, L, i) for table, bs, L, T in cases for i in range(T)])

    return {
        "a global offset inside the block (the source article's paged sketch): the row inside block "
        "block_table[p // block_size] is p % block_size, not p": each(
            lambda t, bs, L, i: t[(L + i) // bs] * bs + L + i),
        "the chunk's positions start at 0: they start at seq_len, the tokens already in the cache": each(
            lambda t, bs, L, i: t[i // bs] * bs + i % bs),
        "the block table is not used: logical block p // block_size is not where the data is; look up "
        "block_table[p // block_size]": each(lambda t, bs, L, i: L + i),
        "the block is not multiplied by block_size: block b's rows start at slot b * block_size": each(
            lambda t, bs, L, i: t[(L + i) // bs] + (L + i) % bs),
    }


def _swap_or_recompute(prompt_len, generated, prefill_s, bytes_per_token, bandwidth, *, ways=2, recomputed=None,
                       mixed=None):
    n = prompt_len + generated
    recompute = prefill_s(n if recomputed is None else recomputed(prompt_len, generated))
    swap = ways * n * bytes_per_token / bandwidth
    if mixed == "recompute per token":
        recompute /= n
    elif mixed == "swap per token":
        swap /= n
    return "swap" if swap < recompute else "recompute"


def _cost_variants():
    return {
        "swap is counted one way only: a swapped-out request's K/V go to host memory and come back, "
        "2 × n × bytes_per_token / bandwidth": dict(ways=1),
        "recompute re-prefills the prompt only: a recompute-preempted request computes its prompt AND the "
        "tokens it had generated again (n = prompt_len + generated)": dict(recomputed=lambda p, g: p),
        "recompute's time per token is compared with swap's total time: compare the totals for all n tokens":
            dict(mixed="recompute per token"),
        "recompute's total time is compared with swap's time per token: compare the totals for all n tokens":
            dict(mixed="swap per token"),
    }


def swap_or_recompute(cases, prefill_s, bytes_per_token, bandwidth):
    """cases: [(prompt_len, generated), ...]; the check compares ``choice == "swap"`` per case."""
    return {what: (lambda kw=kw: torch.tensor([
        _swap_or_recompute(p, g, prefill_s, bytes_per_token, bandwidth, **kw) == "swap" for p, g in cases]))
            for what, kw in _cost_variants().items()}


def crossover(prefill_s, bytes_per_token, bandwidth, max_len):
    def first(**kw):
        return lambda: next((n for n in range(1, max_len + 1)
                             if _swap_or_recompute(n, 0, prefill_s, bytes_per_token, bandwidth, **kw) == "swap"), None)

    out = {what: first(**kw) for what, kw in _cost_variants().items() if "recomputed" not in kw}
    out["the last length where recompute is cheaper, one too few: the crossover is the first n where swap "
        "is cheaper"] = lambda: (first()() or 1) - 1
    return out




# --------------------------------------------------------------------------------------------
# Lab 08a's decision, lab 08b (the prefix cache)
# --------------------------------------------------------------------------------------------


def preemption_choice(choice, right) -> str:
    """The diagnosis of a wrong preemption mode for this machine (lab 08a, exercise 5)."""
    if choice not in ("swap", "recompute", "it depends"):
        return 'answer "swap", "recompute" or "it depends"'
    if right == "it depends":
        return ("here the cheaper mode changed with the length: one mode for every request is not what the table "
                "says; a server on this machine would pick per request, or by the length its requests reach")
    if choice == "recompute":
        return ("recompute is the usual answer on a GPU for short sequences, but this machine's table says swap was "
                "cheaper at every length: here a copy inside one memory costs far less than computing the K/V again")
    if choice == "swap":
        return "this machine's table says recompute was cheaper at every length measured: the copy cost more here"
    return "the table names one mode at every length measured: choose that one"


def host_tier_choice(choice, right, table) -> str:
    """The diagnosis of a wrong host-tier size (lab 08b, exercise 2)."""
    sizes = list(table.index)
    if not isinstance(choice, int) or isinstance(choice, bool) or choice not in sizes:
        return f"choose one of the sizes measured: {sizes}"
    best = table["prefill tokens computed"].min()
    if table.loc[choice, "prefill tokens computed"] > best:
        if choice == 0:
            return ("with no host tier every document block the pool evicts is computed again: the table shows "
                    "prefill a host tier saves")
        return ("too small: this tier still computes more prefill than the largest one, so some evicted document "
                "blocks were pushed out of host memory before a request came back for them")
    return ("it saves all the prefill the largest tier saves, but so does a smaller one: host memory a tier holds and "
            "never hits is memory a server pays for nothing (compare 'host blocks used, most')")


def _cached_tokens(prompt, cached, block_size, *, chain=True, last_rule=True, unit="tokens"):
    n_max = (len(prompt) - 1) // block_size if last_rule else len(prompt) // block_size
    parent, hits = None, 0
    for i in range(n_max):
        h = hash((parent if chain else None, tuple(prompt[i * block_size: (i + 1) * block_size])))
        if h not in cached:
            break
        hits += 1
        parent = h
    return hits * block_size if unit == "tokens" else hits


def cached_tokens(prompts, cached, block_size):
    """prompts: the lab's prompts; cached: the set of chained hashes in the cache. The check compares one count per
    prompt."""

    def each(**rule):
        return lambda: torch.tensor([_cached_tokens(p, cached, block_size, **rule) for p in prompts])

    return {
        "each block's hash does not chain its parent's: block i's key is hash((block i-1's hash, its tokens)), so "
        "equal keys mean equal prefixes, not only equal blocks": each(chain=False),
        "a prompt whose every block is cached was served whole: its last token must be computed, because its "
        "logits give the first new token; look at most (len(prompt) - 1) // block_size blocks up": each(
            last_rule=False),
        "blocks were counted, not positions: the cache serves whole blocks, block_size positions each": each(
            unit="blocks"),
    }
