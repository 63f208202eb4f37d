"""A block-pool simulator (chapter 05): how much KV memory holds real tokens, step by step.

What you will learn:
- why reserving ``max_len`` slots per request (as systems before vLLM did) leaves most of the
  KV memory empty: a request that will stop after 300 tokens still holds 2048 slots;
- how paging fixes it: memory is taken one block of ``block_size`` slots at a time, so the only
  empty slots are in each sequence's last, partly filled block (internal fragmentation, under one
  block per sequence), and the freed memory lets many more requests run at once;
- what a paged server does when the pool runs dry mid-generation: it *preempts* the most recently
  admitted request and later *recomputes* its KV cache, which costs prefill work, and how an
  admission *watermark* (blocks kept free for growth) trades batch size against that cost;
- ``padded_batch_savings``: the simplest case, one batch held at once, padded to its longest
  sequence versus rounded up to whole blocks.

This is a pure-Python model of memory *management* only: no tensors, no attention, no torch.
Nothing here is measured on hardware; the numbers follow from the rules below and a seeded
workload, so they are the same on every machine.

The rules (one iteration of a continuous-batching server):
1. Admit waiting requests that have arrived, first come first served, while memory allows; stop
   at the first one that does not fit (no overtaking). Admission stores the whole prompt
   (prefill); a request that was preempted stores its prompt *and* the tokens it had generated.
2. Every running request generates one token, which is stored in its cache. So a request that
   has generated g tokens stores ``prompt_len + g`` tokens; it is admitted and generates its
   first token in the same iteration.
3. Memory use is measured (after step 2), then requests that have generated ``output_len``
   tokens finish and free their memory.

Policies:
- ``"contiguous"``: a request reserves ``max_len`` slots at admission (it *may* generate up to
  ``max_len`` tokens, and its row must be contiguous). Admission needs ``max_len`` free slots;
  capacity is a flat count of slots (no fragmentation between requests is modelled).
  Utilization = stored tokens / (running × max_len); everything else is ``reserved_waste``.
- ``"paged"``: ``capacity_tokens // block_size`` blocks. Admission needs blocks for the tokens it
  stores plus one (the next generated token), and, with ``watermark`` w > 0, must leave at least
  ``int(w * num_blocks)`` blocks free afterwards (vLLM's ``watermark``, default 0.01 there; here
  0, so that the bare mechanism is seen first). A running request takes one new block when its length
  crosses a block boundary; growth may use the blocks the watermark keeps free. Requests grow in
  admission order; if no block is free, the most recently admitted running request is preempted —
  the growing request itself when every other one is older, as in vLLM's scheduler: its blocks are
  freed and it goes back to the front of the waiting queue. This repeats until a block is free (or
  the growing request was the one preempted). The oldest running request is therefore never
  preempted, so every request finishes. A request that cannot grow even when it is alone means the
  pool is too small: ``ValueError``. With a watermark, every request must fit, whole, in the blocks
  the watermark does not keep free (otherwise a preempted one could never be admitted again):
  ``ValueError`` up front.

Preemption is by *recompute*, as in vLLM (Kwon et al., SOSP 2023, section 4.5): the preempted
request keeps the tokens it has generated (they were already sent to the user), but its KV cache is
gone, so when it is admitted again its prompt and those tokens are prefilled together as one longer
prompt. ``recomputed_tokens`` counts these re-prefilled tokens; ``prefill_tokens`` = every prompt once
+ ``recomputed_tokens``. (Swapping the blocks to host memory instead is the other option; a later
chapter compares the two.)

Time. Each iteration is one decode pass and costs one step. The tokens prefilled in an iteration
(new prompts and re-prefills) run in extra passes of at most ``prefill_tokens_per_step`` tokens
each, and each extra pass costs one step too: ``prefill_steps`` = sum over iterations of
ceil(tokens prefilled / ``prefill_tokens_per_step``), and ``steps = iterations + prefill_steps``.
The assumption behind it: a decode pass is memory-bound (it reads all the weights for one token per
sequence), and a pass over n prompt tokens costs about the same until n reaches the GPU's ridge
point, (peak FLOP/s) / (memory bytes/s) × (bytes per weight) / (2 FLOP per weight per token) —
about 150 tokens on an A100 and 300 on an H100 for 16-bit weights — beyond which its cost grows
in proportion to n. The default, 256, sits in that range; it ignores attention FLOPs and KV reads
(which make long-context decode passes slower, i.e. prefill relatively cheaper). It is an
assumption to vary, not a measurement. ``prefill_tokens_per_step=None`` makes prefill free
(``steps == iterations``). No cap on the batch (vLLM's ``max_num_seqs``) is modelled.

The three shares add up: utilization + internal_fragmentation + reserved_waste = 1 at every
iteration (contiguous has no internal fragmentation here; paged reserves nothing ahead).
``pool_usage`` is the share of the whole pool that holds tokens, so it also counts what is free
(which a watermark keeps free on purpose).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["Request", "SimResult", "sample_requests", "simulate", "padded_batch_savings", "PREFILL_TOKENS_PER_STEP"]

POLICIES = ("contiguous", "paged")
DRAW_BLOCK = 16  # contiguous snapshots are drawn at this granularity (slots per cell)
PREFILL_TOKENS_PER_STEP = 256  # default: prompt tokens that cost as much time as one decode iteration (module doc)


@dataclass
class Request:
    rid: int  # request id
    arrival: int  # step at which it arrives
    prompt_len: int  # tokens in the prompt (all stored at admission = prefill)
    output_len: int  # tokens it will generate, one per step once running


@dataclass
class SimResult:
    policy: str  # "contiguous" or "paged"
    block_size: int | None  # None for contiguous
    steps: int  # time until every request finished, in steps: iterations + prefill_steps
    utilization: float  # time-average of stored tokens / allocated slots, over iterations with anything allocated
    internal_fragmentation: float  # time-average share of allocated slots empty in a sequence's last block (paged)
    reserved_waste: float  # time-average share of allocated slots reserved for tokens not written (contiguous)
    mean_running: float  # average number of requests running at once (over all iterations)
    max_running: int  # most requests running at once
    preemptions: int  # paged: requests evicted (blocks freed, recomputed later) because the pool ran dry
    tokens_per_step: float  # generated tokens (sum of output_len) / steps
    snapshots: list | None  # record=True: per iteration, the rid owning each block (or drawing cell), -1 if free
    snapshot_fill: list | None = None  # record=True: per iteration, tokens written in each block (or cell)
    finished: int = 0  # requests that finished (all of them, when simulate returns)
    generated_tokens: int = 0  # tokens generated (= sum of output_len: a preempted request keeps its tokens)
    recomputed_tokens: int = 0  # tokens prefilled again after a preemption (its prompt + the tokens it had generated)
    iterations: int = 0  # scheduler iterations, one decode pass each (= len(snapshots))
    prefill_steps: int = 0  # steps spent prefilling: per iteration, ceil(tokens prefilled / prefill_tokens_per_step)
    prefill_tokens: int = 0  # tokens prefilled in all: every prompt once, plus recomputed_tokens
    pool_usage: float = 0.0  # time-average share of the whole pool's slots holding tokens (over all iterations)
    watermark: float = 0.0  # the admission watermark used (paged)


def sample_requests(n: int, seed: int = 0, mean_prompt: float = 160, mean_output: float = 240,
                    sigma: float = 1.0, max_len: int = 2048, arrival_rate: float | None = None) -> list[Request]:
    """A seeded, long-tailed workload: log-normal prompt and output lengths with the given means.

    Each length is drawn from a log-normal whose mean is ``mean_prompt`` (or ``mean_output``):
    mu = ln(mean) - sigma**2 / 2. Lengths are rounded, at least 1, and clipped so that
    ``prompt_len + output_len <= max_len`` (the clip lowers the means a little).
    ``arrival_rate=None``: all arrive at step 0; otherwise Poisson arrivals with that many requests
    per step (exponential gaps, arrival step rounded down).
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if mean_prompt <= 0 or mean_output <= 0:
        raise ValueError(f"mean_prompt and mean_output must be > 0, got {mean_prompt}, {mean_output}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an int >= 2 (one prompt and one output token), got {max_len!r}")
    if arrival_rate is not None and not arrival_rate > 0:
        raise ValueError(f"arrival_rate must be > 0 or None, got {arrival_rate}")
    rng = random.Random(seed)
    mu_p = math.log(mean_prompt) - sigma**2 / 2
    mu_o = math.log(mean_output) - sigma**2 / 2
    requests, t = [], 0.0
    for rid in range(n):
        prompt = min(max(1, round(rng.lognormvariate(mu_p, sigma))), max_len - 1)
        output = min(max(1, round(rng.lognormvariate(mu_o, sigma))), max_len - prompt)
        if arrival_rate is not None:
            t += rng.expovariate(arrival_rate)
        requests.append(Request(rid=rid, arrival=int(t), prompt_len=prompt, output_len=output))
    return requests


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)  # ceil


def simulate(requests, capacity_tokens: int, policy: str, block_size: int = 16, max_len: int = 2048,
             record: bool = False, watermark: float = 0.0,
             prefill_tokens_per_step: int | None = PREFILL_TOKENS_PER_STEP) -> SimResult:
    """Run the workload through a KV pool of ``capacity_tokens`` slots under ``policy`` (see module doc).

    ``watermark`` (paged only): the share of the pool's blocks that admission keeps free, as vLLM's
    ``watermark``: a waiting request is admitted only if ``int(watermark * num_blocks)`` blocks stay free
    after its blocks are taken. Running requests may still grow into those blocks.
    ``prefill_tokens_per_step``: prompt tokens that cost one step of time (see module doc); ``None``
    makes prefill free (the step count is then the number of iterations).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
    if not isinstance(capacity_tokens, int) or capacity_tokens < 1:
        raise ValueError(f"capacity_tokens must be a positive int, got {capacity_tokens!r}")
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
    if prefill_tokens_per_step is not None and (not isinstance(prefill_tokens_per_step, int)
                                                or prefill_tokens_per_step < 1):
        raise ValueError(f"prefill_tokens_per_step must be a positive int or None, got {prefill_tokens_per_step!r}")
    paged = policy == "paged"
    if not paged and capacity_tokens < max_len:
        raise ValueError(f"capacity_tokens={capacity_tokens} is smaller than one max_len={max_len} "
                         f"reservation: no request could ever be admitted (contiguous)")
    num_blocks = capacity_tokens // block_size if paged else 0
    keep_free = int(watermark * num_blocks) if paged else 0  # vLLM: watermark_blocks
    for r in requests:
        if r.prompt_len < 1 or r.output_len < 1 or r.prompt_len + r.output_len > max_len:
            raise ValueError(f"request {r.rid}: prompt_len={r.prompt_len}, output_len={r.output_len} must be "
                             f">= 1 each with a sum <= max_len={max_len}")
        # a re-admitted request needs blocks for up to prompt_len + output_len tokens, under the watermark
        if paged and _blocks_for(r.prompt_len + r.output_len, block_size) > num_blocks - keep_free:
            raise ValueError(f"request {r.rid} needs {r.prompt_len + r.output_len} tokens but "
                             f"capacity_tokens={capacity_tokens} holds only {num_blocks} block(s) of "
                             f"{block_size}, {keep_free} of them kept free by watermark={watermark}: "
                             f"capacity too small even for this request alone")

    pending = sorted(requests, key=lambda r: (r.arrival, r.rid))  # not yet arrived
    waiting: list = []  # arrived, not running; FCFS (preempted requests go back to the front)
    running: list = []  # in admission order: the last one is the most recently admitted
    generated = {}  # rid -> tokens generated so far (kept across a preemption)
    tables = {}  # paged: rid -> list of block ids
    free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids come out first
    rows = {}  # contiguous: rid -> index of its max_len row
    free_rows = list(range(capacity_tokens // max_len - 1, -1, -1)) if not paged else []

    iteration = preemptions = recomputed = prefilled = prefill_steps = useful = finished = 0
    util_sum = frag_sum = waste_sum = pool_sum = 0.0
    busy_steps = running_sum = max_running = 0
    preempted: set = set()  # rids preempted and not yet re-admitted
    snapshots, fills = ([], []) if record else (None, None)
    n_total = len(requests)
    pool_slots = num_blocks * block_size if paged else (capacity_tokens // max_len) * max_len

    while finished < n_total:
        while pending and pending[0].arrival <= iteration:
            waiting.append(pending.pop(0))
        # 1. admit, first come first served, stopping at the first request that does not fit
        prefill_now = 0  # tokens prefilled in this iteration: new prompts and re-prefills
        while waiting:
            r = waiting[0]
            have = generated.get(r.rid, 0)  # > 0: preempted earlier, its KV is computed again
            if paged:
                need = _blocks_for(r.prompt_len + have + 1, block_size)
                if len(free_blocks) - need < keep_free:
                    break
                tables[r.rid] = [free_blocks.pop() for _ in range(need)]
            else:
                if not free_rows:
                    break
                rows[r.rid] = free_rows.pop()
            waiting.pop(0)
            running.append(r)
            generated[r.rid] = have
            prefill_now += r.prompt_len + have
            if r.rid in preempted:  # recompute: prompt and kept tokens prefilled again
                recomputed += r.prompt_len + have
                preempted.discard(r.rid)
        prefilled += prefill_now
        if prefill_tokens_per_step is not None:
            prefill_steps += _blocks_for(prefill_now, prefill_tokens_per_step)  # ceil
        # 2. every running request generates one token (taking a new block at a boundary)
        for r in list(running):
            if r.rid in preempted:  # preempted earlier in this iteration
                continue
            length = r.prompt_len + generated[r.rid] + 1  # tokens stored once this one is written
            if paged and length > len(tables[r.rid]) * block_size:
                while not free_blocks:
                    victim = running[-1]  # the most recently admitted: r itself when all others are older
                    if victim is r and len(running) == 1:
                        raise ValueError(f"request {r.rid} cannot grow to {length} tokens even alone: "
                                         f"capacity_tokens={capacity_tokens} is too small")
                    running.pop()
                    free_blocks.extend(reversed(tables.pop(victim.rid)))
                    preempted.add(victim.rid)
                    waiting.insert(0, victim)  # older victims end up in front of newer ones
                    preemptions += 1
                    if victim is r:
                        break
                if r.rid in preempted:  # it preempted itself: it generates nothing this iteration
                    continue
                tables[r.rid].append(free_blocks.pop())
            generated[r.rid] += 1
        # 3. measure, then free finished requests
        stored = sum(r.prompt_len + generated[r.rid] for r in running)
        if paged:
            allocated = sum(len(t) for t in tables.values()) * block_size
        else:
            allocated = len(running) * max_len
        pool_sum += stored / pool_slots
        if allocated:
            busy_steps += 1
            util_sum += stored / allocated
            if paged:
                frag_sum += (allocated - stored) / allocated
            else:
                waste_sum += (allocated - stored) / allocated
        running_sum += len(running)
        max_running = max(max_running, len(running))
        if record:
            snap, fill = _snapshot(running, generated, tables, rows, paged, num_blocks, block_size,
                                   capacity_tokens, max_len)
            snapshots.append(snap)
            fills.append(fill)
        for r in [r for r in running if generated[r.rid] == r.output_len]:
            running.remove(r)
            del generated[r.rid]
            if paged:
                free_blocks.extend(reversed(tables.pop(r.rid)))
            else:
                free_rows.append(rows.pop(r.rid))
            useful += r.output_len
            finished += 1
        iteration += 1

    busy = max(busy_steps, 1)
    steps = iteration + prefill_steps
    return SimResult(
        policy=policy, block_size=block_size if paged else None, steps=steps,
        utilization=util_sum / busy, internal_fragmentation=frag_sum / busy, reserved_waste=waste_sum / busy,
        mean_running=running_sum / max(iteration, 1), max_running=max_running, preemptions=preemptions,
        tokens_per_step=useful / max(steps, 1), snapshots=snapshots, snapshot_fill=fills,
        finished=finished, generated_tokens=useful, recomputed_tokens=recomputed,
        iterations=iteration, prefill_steps=prefill_steps, prefill_tokens=prefilled,
        pool_usage=pool_sum / max(iteration, 1), watermark=watermark if paged else 0.0)


def _snapshot(running, generated, tables, rows, paged, num_blocks, block_size, capacity_tokens, max_len):
    """Owner rid and tokens written, per block (paged) or per DRAW_BLOCK-slot cell (contiguous)."""
    if paged:
        owner, fill = [-1] * num_blocks, [0] * num_blocks
        for r in running:
            length = r.prompt_len + generated[r.rid]
            for i, b in enumerate(tables[r.rid]):
                owner[b] = r.rid
                fill[b] = min(block_size, length - i * block_size)
        return owner, fill
    cells = capacity_tokens // DRAW_BLOCK
    owner, fill = [-1] * cells, [0] * cells
    for r in running:
        start, length = rows[r.rid] * max_len, r.prompt_len + generated[r.rid]
        for c in range(start // DRAW_BLOCK, min(cells, _blocks_for(start + max_len, DRAW_BLOCK))):
            lo, hi = max(c * DRAW_BLOCK, start), min((c + 1) * DRAW_BLOCK, start + max_len)
            owner[c] = r.rid
            fill[c] = max(0, min(hi, start + length) - lo)
    return owner, fill


def padded_batch_savings(lengths: list[int], block_size: int = 16) -> dict:
    """One batch held at once: padded to its longest sequence vs. rounded up to whole blocks.

    "padded": every sequence reserves the batch's max length (one contiguous tensor plus a mask);
    "paged": each sequence holds ceil(len / block_size) blocks.
    Returns {"padded_slots", "paged_slots", "saving": 1 - paged/padded, "max_over_min": max/min}.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    lengths = list(lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be a non-empty list of positive ints, got {lengths!r}")
    padded = len(lengths) * max(lengths)
    paged = sum(_blocks_for(n, block_size) * block_size for n in lengths)
    return {"padded_slots": padded, "paged_slots": paged, "saving": 1 - paged / padded,
            "max_over_min": max(lengths) / min(lengths)}
