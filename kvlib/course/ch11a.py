"""Chapter 11a's harnesses: speculative decoding, the rollback it needs, and what it costs on this machine.

The notebook calls these; each returns numbers or tables and prints no verdict (the notebook's markdown says what
each outcome would mean, and ``speed_verdicts`` prints a line only where two ranges of times separate).

- ``clock`` / ``timed``: ONE clock for every timing of the chapter: this thread's CPU time on a CPU (other programs
  on a busy laptop do not count), wall time after ``torch.cuda.synchronize`` on a GPU.
- ``TASKS``: the two prompts (code to edit, a chat question), ``capture_step``: one verification step taken apart
  (the draft, the target's choice per row, the cache before and after the rollback) for the picture.
- ``rollback_table``: every cache kind of the course against a twin that never saw the rejected rows.
- ``identity_table``: greedy speculative decoding against ``generate`` on every cache kind (tiny model).
- ``rule_distances``: the rejection rule sampled, two plausible wrong rules computed exactly.
- ``forward_costs``: the cost of one forward over T tokens, several interleaved runs per T.
- ``speed_session`` / ``speed_runs`` / ``speed_table`` / ``predicted``: plain and speculative decoding, several
  interleaved runs with the prediction's inputs (forward costs, prefill) timed between them, and the speed-up
  predicted from each verification step's *actual* draft length beside the old prediction that assumed every step
  fed k + 1 tokens; ``speed_verdicts`` / ``chance_separation``: a verdict only where the ranges of at least five
  runs each separate, and how often that happens by chance.
- ``alpha_table``, ``iid_spread``, ``zero_steps``: Leviathan et al.'s per-draft rate with its Wilson interval, and
  what a run of few steps can and cannot tell about their formula (its average; its independence assumption).
- ``k_evidence``, ``k_reference``, ``check_k_choice``: lab 11a's decision (which k, or none).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time

import torch

from .. import runtime
from ..stats import separated, wilson

__all__ = ["FUNC", "tasks", "clock", "timed", "StepTrace", "capture_step", "rollback_table", "identity_table",
           "rule_distances", "forward_costs", "cost_table", "speed_runs", "speed_table", "predicted", "plot_speed",
           "speed_verdicts", "chance_separation", "speed_session", "zero_steps", "prefill_ms", "transformers_names", "hf_prompt_lookup", "hf_line", "alpha_table", "leviathan", "iid_spread", "k_evidence", "k_reference", "check_k_choice", "lab_docstring",
           "MARGIN"]

FUNC = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''  # written for this course


def tasks(tok) -> dict:
    """The two prompts: **code** (the answer repeats most of the prompt: prompt lookup's best case) and **chat**
    (nothing to copy)."""
    return {
        "code": tok.chat([{"role": "user", "content": "Add type hints to this Python function and reply with the "
                           "full code:\n```python\n" + FUNC + "```"}]),
        "chat": tok.chat([{"role": "user", "content": "Give me three tips for staying focused while studying."}]),
    }


# --------------------------------------------------------------------------------------------
# One clock
# --------------------------------------------------------------------------------------------


def clock() -> float:
    """Seconds: this thread's CPU time on a CPU, wall time on a GPU (``timed`` synchronizes first)."""
    return time.perf_counter() if runtime.DEVICE == "cuda" else time.thread_time()


def timed(fn):
    """(fn(), seconds by ``clock``)."""
    if runtime.DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = clock()
    out = fn()
    if runtime.DEVICE == "cuda":
        torch.cuda.synchronize()
    return out, clock() - t0


# --------------------------------------------------------------------------------------------
# One verification step, taken apart (the picture)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StepTrace:
    """One step of greedy speculative decoding over a contiguous cache, as the picture draws it.

    ``cache``: the live cache after the step's truncate; ``n0``: positions it held before the step; ``fed``: the
    tokens of the verification forward (the last emitted token, then the drafts); ``target``: the target's argmax
    at each of those rows; ``accepted``: drafts kept; ``written``: positions the cache held right after the forward
    (n0 + len(fed)); ``tokens``: prompt + everything emitted before the step."""
    cache: object
    n0: int
    fed: list
    target: list
    accepted: int
    written: int
    tokens: list
    step: int


@torch.no_grad()
def capture_step(model, prompt, k: int, max_new_tokens: int, eos_id=None, partial: bool = True) -> StepTrace:
    """Run greedy speculative decoding with prompt lookup (the loop of ``kvlib.speculate.speculative_generate`` on
    a contiguous cache) and stop after the first step that accepts some drafts but not all (``partial``), or the
    first step that drafts anything. Returns that step's ``StepTrace``."""
    from ..cache import KVCache
    from ..speculate import greedy_accept, prompt_lookup

    prompt = list(prompt)
    dev = model.device
    cache = KVCache.for_model(model, 1, len(prompt) + max_new_tokens)
    logits = model(torch.tensor([prompt], device=dev), cache=cache)
    out = [int(logits[0, -1].argmax())]
    step = 0
    while len(out) < max_new_tokens and not (eos_id is not None and eos_id in out):
        n0 = int(cache.seq_lens[0])
        d = min(k, max_new_tokens - len(out) - 1)
        draft = prompt_lookup(prompt + out, d) if d else []
        fed = [out[-1]] + draft
        positions = torch.arange(n0, n0 + len(fed), device=dev)[None]
        logits = model(torch.tensor([fed], device=dev), positions=positions, cache=cache)[0]
        written = int(cache.seq_lens[0])
        a, nxt = greedy_accept(logits, draft)
        cache.truncate(0, n0 + 1 + a)
        trace = StepTrace(cache, n0, fed, logits.argmax(-1).tolist(), a, written, prompt + out, step)
        out += draft[:a] + [nxt]
        step += 1
        if draft and (not partial or 0 < a < len(draft)):
            return trace
    raise ValueError("no step of this run accepted part of its draft: try another prompt or k")


# --------------------------------------------------------------------------------------------
# truncate on every cache kind, against a twin that never saw the rejected rows
# --------------------------------------------------------------------------------------------

H_, HKV_, D_ = 4, 2, 16  # small random heads: the check is about bookkeeping, not about the model


def _rows(g, T, n_layers=2):  # per layer: q (1, H, T, D), k and v (1, H_KV, T, D)
    return [tuple(torch.randn(1, h, T, D_, generator=g) for h in (H_, HKV_, HKV_)) for _ in range(n_layers)]


def _feed(cache, rows, upto=None):  # one call of every layer with the first `upto` tokens
    for i, (q, k, v) in enumerate(rows):
        cache.attend(i, q[:, :, :upto], k[:, :, :upto], v[:, :, :upto])


def _state(c):
    """Everything sequence 0 holds that attention can read, independent of where it is stored."""
    from ..kivi import KiviCache
    from ..paged import PagedKVCache

    if isinstance(c, PagedKVCache):  # K/V through the block table, shared blocks, references, hashes, free blocks
        L, bs, table = c.lens[0], c.block_size, c.tables[0]
        pos = torch.arange(L)
        blocks = torch.tensor(table, dtype=torch.long)[pos // bs]
        return [L, c.tokens[0], [b in c.tables[1] for b in table], [c.allocator.refcount[b] for b in table],
                [c.block_hash.get(b) for b in table], sorted(c.hash_to_block), c.allocator.num_free,
                *[pool[blocks, pos % bs] for pool in c.k + c.v]]
    if isinstance(c, KiviCache):  # codes, scales and zero points of what left the window, the exact window
        n, (nk, nv), G = int(c.seq_lens[0]), c.n_quantized(0), c.group
        out = [n, nk, nv]
        for i in range(len(c.k)):
            out += [c.k_packed[i][:, :, :nk], c.k_scale[i][:, :, :nk // G], c.k_zero[i][:, :, :nk // G],
                    c.v_packed[i][:, :, :nv], c.v_scale[i][:, :, :nv], c.v_zero[i][:, :, :nv],
                    c.k[i][:, :, :n - nk], c.v[i][:, :, :n - nv]]
        return out
    if hasattr(c, "n_held"):  # a budgeted cache: which positions each K/V head holds, and their rows
        out = [c.seq_lens.tolist()]
        for i in range(len(c.k)):
            idx = c.index[i][0, :, :int(c.n_held[i][0])]
            out += [c.pos[i][0].gather(1, idx)] + [t[0].gather(1, idx[..., None].expand(-1, -1, D_))
                                                   for t in (c.k[i], c.v[i])]
        return out
    n = int(c.seq_lens[0])  # contiguous (and INT8: its per-row scales; Quest: its block summaries)
    rows = [t[:, :, :n] for name in ("k", "v", "k_scale", "v_scale") for t in getattr(c, name, [])]
    return [n] + rows + [t for name in ("kmin", "kmax") for t in _summaries(c, name)]


def _summaries(c, name):
    """Quest's per-block min/max of the blocks that hold a position (nothing for other caches)."""
    t = getattr(c, name, None)
    if not isinstance(t, list) or not hasattr(c, "block_size"):
        return []
    n_blocks = -(-int(c.seq_lens[0]) // c.block_size)
    return [x[:, :, :n_blocks] for x in t]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def accept_reject(make, seed: int, steps: int = 12, max_k: int = 6) -> tuple[bool, bool]:
    """``steps`` random verification steps on one cache (d + 1 rows fed, a random prefix kept, truncate) beside a
    twin fed only the kept rows. Returns (equal after every step, every truncate said it was exact)."""
    from ..paged import PagedKVCache

    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    spec, twin = make(), make()
    paged = isinstance(spec, PagedKVCache)
    prompt = [rng.randrange(50) for _ in range(11)]
    first, other = _rows(g, 11), _rows(g, 3)
    for c in (spec, twin):
        if paged:  # sequence 1 shares the prompt's two full blocks through the prefix cache
            _feed(c.prefill_view(0, prompt)[0], first)
            _feed(c.prefill_view(1, prompt)[0], other)
        else:
            _feed(c, first)
    equal, exact = True, True
    for _ in range(steps):
        d = rng.randint(0, max_k)
        keep = rng.randint(1, d + 1)  # the last emitted token + the accepted drafts
        rows, toks = _rows(g, d + 1), [rng.randrange(50) for _ in range(d + 1)]
        n0 = spec.lens[0] if paged else int(spec.seq_lens[0])
        _feed(spec.batch([0], [toks]) if paged else spec, rows)
        said = spec.truncate(0, n0 + keep)
        exact &= said is None or bool(said)  # the paged cache's truncate is always exact (returns None)
        _feed(twin.batch([0], [toks[:keep]]) if paged else twin, rows, keep)
        equal &= _same(_state(spec), _state(twin))
    return equal, exact


def cache_kinds() -> dict:
    """{name: a function making a fresh 2-layer cache of that kind} for the rollback check."""
    from ..cache import KVCache
    from ..evict import SinkCache
    from ..kivi import KiviCache
    from ..paged import PagedKVCache
    from ..quant import Int8KVCache
    from ..sparse import QuestCache

    def kivi():
        c = KiviCache(2, 1, HKV_, 160, D_, bits=2, group=4, residual=8, kernels="torch")
        c.enable_rollback()  # keep the full-precision rows of the groups a call quantizes, until the next call
        return c

    return {
        "KVCache (03)": lambda: KVCache(2, 1, HKV_, 128, D_, kernels="torch"),
        "PagedKVCache, shared prefix (05)": lambda: PagedKVCache(2, 40, 4, HKV_, D_, kernels="torch",
                                                                 prefix_caching=True),
        "Int8KVCache (06)": lambda: Int8KVCache(2, 1, HKV_, 128, D_, kernels="torch"),
        "KiviCache 2-bit, G = 4, R = 8 (09b)": kivi,
        "QuestCache, blocks of 4 (11b)": lambda: QuestCache(2, 1, HKV_, 128, D_, kernels="torch", block_size=4,
                                                            n_select=2),
        "SinkCache, budget 200: never full (09a)": lambda: SinkCache(2, 1, HKV_, 200, D_, kernels="torch", chunk=8),
        "SinkCache, budget 16: evicts (09a)": lambda: SinkCache(2, 1, HKV_, 16, D_, kernels="torch", chunk=8),
    }


def rollback_table(seeds=(0, 1, 2)):
    """One row per cache kind: equal to the twin after every step, for each seed, and whether every truncate said
    it was exact."""
    import pandas as pd

    rows = []
    for name, make in cache_kinds().items():
        runs = [accept_reject(make, s) for s in seeds]
        rows.append({"cache": name, **{f"seed {s}": "equal" if e else "DIFFERENT" for s, (e, _) in zip(seeds, runs)},
                     "truncate says exact": all(x for _, x in runs)})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# Greedy identity on every cache kind (the tiny model)
# --------------------------------------------------------------------------------------------


def identity_table(tiny, tiny_tok, n_new: int = 80, k: int = 4):
    """Greedy speculative decoding (prompt lookup, k drafts) against ``generate`` on a fresh cache of each kind."""
    import pandas as pd

    from ..generate import generate
    from ..kivi import KiviCache
    from ..sparse import QuestCache
    from ..speculate import speculative_generate

    prompt = tiny_tok.encode("the cache keeps the keys and the values. the cache keeps the keys and the")
    L = len(prompt) + n_new
    caches = {"contiguous": lambda: "contiguous", "paged": lambda: "paged", "int8": lambda: "int8",
              "KIVI 2-bit": lambda: KiviCache.for_model(tiny, 1, L, bits=2, group=8, residual=8, kernels="torch"),
              "Quest, 2 blocks of 8": lambda: QuestCache.for_model(tiny, 1, L, block_size=8, n_select=2,
                                                                    dense_layers=0)}
    rows = []
    for name, make in caches.items():
        plain = generate(tiny, [prompt], n_new, cache=make())[0].tolist()
        res = speculative_generate(tiny, prompt, n_new, k=k, cache=make())
        rows.append({"cache": name, "identical to generate": res.tokens == plain,
                     "drafts accepted": f"{sum(res.accepted)} of {sum(res.drafted)}",
                     "target forwards": f"{res.target_forwards} for {len(res.tokens)} tokens",
                     "next position = prompt + emitted - 1": res.held[-1] == len(prompt) + len(res.tokens) - 1})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# The rejection rule: the first emitted token's distribution
# --------------------------------------------------------------------------------------------


def rule_distances(p_row, q_row, n_draws: int = 20_000, n_null: int = 200, seed: int = 0) -> dict:
    """The first emitted token of one-draft speculative sampling (drafter q, target p): ``speculative_accept``
    sampled ``n_draws`` times, and two plausible wrong rules computed exactly (accept iff p(x) >= q(x); draw from
    p after a rejection). Returns total-variation distances from p and the noise limit: the 99th percentile of the
    distance of ``n_draws`` draws from p itself over ``n_null`` simulated runs."""
    from ..speculate import speculative_accept

    V = p_row.numel()
    p = torch.stack([p_row, torch.full((V,), 1.0 / V)])  # (d + 1, V): the draft position, then the bonus position
    q = q_row[None]
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q_row, n_draws, replacement=True, generator=g).tolist()
    counts = torch.zeros(V)
    for x in drafts:
        a, nxt = speculative_accept(p, q, [x], g)
        counts[x if a == 1 else nxt] += 1  # the first emitted token: the draft if accepted, else the draw
    both = torch.minimum(p_row, q_row)  # what an accepted draft covers: min(p, q) per token
    resample_p = both + (1 - both.sum()) * p_row
    keep = p_row >= q_row  # accept iff p(x) >= q(x): those drafts always, the others never
    residual = (p_row - q_row).clamp(min=0)
    deterministic = torch.where(keep, q_row, 0.0) + q_row[~keep].sum() * residual / residual.sum()

    def tv(f):
        return 0.5 * float((f - p_row).abs().sum())

    null = sorted(tv(torch.multinomial(p_row, n_draws, replacement=True, generator=g).bincount(minlength=V) / n_draws)
                  for _ in range(n_null))
    return {"speculative_accept (sampled)": tv(counts / n_draws), "accept iff p >= q (exact)": tv(deterministic),
            "draw from p after a rejection (exact)": tv(resample_p), "noise limit": null[int(0.99 * n_null)]}


# --------------------------------------------------------------------------------------------
# What a forward over T tokens costs here
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def forward_costs(model, sizes, cache_len: int = 128, runs: int = 5, seed: int = 0) -> dict:
    """{T: [ms, ...]}: ``runs`` timings (``clock``) of one forward over T tokens on a cache holding ``cache_len``
    positions, the sizes interleaved run by run (so a slow moment of the machine hits every T alike); each
    forward's rows are truncated away again."""
    sweep = _sweeper(model, sizes, cache_len, seed)
    out = {T: [] for T in sizes}
    for _ in range(runs):
        for T, ms in sweep().items():
            out[T].append(ms)
    return out


@torch.no_grad()
def _sweeper(model, sizes, cache_len: int, seed: int):
    """A function timing one forward over each T in ``sizes`` ({T: ms}) on a cache of ``cache_len`` positions, made
    once (the cache filled, one warm-up forward) so that it can be called between other runs."""
    from ..cache import KVCache

    g = torch.Generator().manual_seed(seed)
    dev, V = model.device, model.config.vocab_size
    cache = KVCache.for_model(model, 1, cache_len + max(sizes))
    model(torch.randint(0, V, (1, cache_len), generator=g).to(dev), cache=cache)

    @torch.no_grad()
    def forward(T):
        x = torch.randint(0, V, (1, T), generator=g).to(dev)
        model(x, positions=torch.arange(cache_len, cache_len + T, device=dev)[None], cache=cache)
        cache.truncate(0, cache_len)  # take the T rows back out: the rollback this chapter is about

    forward(1)  # warm-up
    return lambda: {T: 1000 * timed(lambda: forward(T))[1] for T in sizes}


def _spread(xs, fmt="{:.3g}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def cost_table(costs: dict):
    """One row per T: ms per forward (median, min–max), ms per token, and the median against T = 1."""
    import pandas as pd

    t1 = statistics.median(costs[min(costs)])
    return pd.DataFrame([{"T (tokens per forward)": T, "ms per forward, median (min–max)": _spread(ms),
                          "runs": len(ms), "ms per token": f"{statistics.median(ms) / T:.1f}",
                          "cost vs T = 1": f"{statistics.median(ms) / t1:.2f}x"} for T, ms in costs.items()])


# --------------------------------------------------------------------------------------------
# Plain against speculative decoding, several interleaved runs
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SpeedRun:
    task: str
    k: int
    tokens: list
    drafted: list
    accepted: list
    seconds: list  # one per repetition, by ``clock``
    prefill_len: int


def speed_runs(model, tok, prompts: dict, ks, n_new: dict, reps: int = 3, between=None) -> list:
    """For each task, plain ``generate`` (k = 0) and ``speculative_generate`` with prompt lookup at each k, greedy,
    stopping at the end-of-turn token; ``reps`` repetitions, interleaved (every configuration once, then again), each
    timed by ``clock``. Greedy decoding is deterministic, so the tokens and drafts of every repetition are the same
    (checked); only the times differ. ``between``: called before each repetition (``speed_session`` times the
    forward costs and the prefill there)."""
    from ..generate import generate
    from ..speculate import speculative_generate

    generate(model, [prompts[next(iter(prompts))]], 4)  # warm-up
    runs = {}
    for _ in range(reps):
        if between is not None:
            between()
        for task, ids in prompts.items():
            for k in [0, *ks]:
                if k == 0:
                    out, s = timed(lambda: generate(model, [ids], n_new[task], eos_id=tok.eos_id)[0].tolist())
                    toks, drafted, accepted = out, [], []
                else:
                    res, s = timed(lambda: speculative_generate(model, ids, n_new[task], k=k, eos_id=tok.eos_id))
                    toks, drafted, accepted = res.tokens, res.drafted, res.accepted
                run = runs.setdefault((task, k), SpeedRun(task, k, toks, drafted, accepted, [], len(ids)))
                if (toks, drafted, accepted) != (run.tokens, run.drafted, run.accepted):
                    raise AssertionError(f"greedy decoding changed between repetitions ({task}, k = {k})")
                run.seconds.append(s)
    return list(runs.values())


@torch.no_grad()
def prefill_ms(model, prompts: dict, runs: int = 3) -> dict:
    """{task: median ms (``clock``) of the forward over the task's prompt into a fresh cache}: the part of a
    generation that plain and speculative decoding share. Timed as ``generate`` and ``speculative_generate`` run it:
    the logits of every prompt row (on the code prompt that costs about a fifth more than the last row's alone)."""
    from ..cache import KVCache

    out = {}
    for task, ids in prompts.items():
        x = torch.tensor([list(ids)], device=model.device)
        times = [1000 * timed(lambda: model(x, cache=KVCache.for_model(model, 1, x.shape[1])))[1]
                 for _ in range(runs)]
        out[task] = statistics.median(times)
    return out


def speed_session(model, tok, prompts: dict, ks, n_new: dict, reps: int = 5, sizes=range(1, 10),
                  cache_len: int = 128):
    """``speed_runs`` with the prediction's inputs measured between its repetitions, so that the machine's drift hits
    them as it hits the runs: before each repetition one forward over each T in ``sizes`` (cache of ``cache_len``)
    and one prefill per task. Returns (runs, {T: [ms, one per repetition]}, {task: median prefill ms}): the
    forward costs as ``forward_costs`` gives them (section 6's table reads them; ``speed_table`` their medians)."""
    sweep = _sweeper(model, list(sizes), cache_len, seed=1)
    costs, pre = {T: [] for T in sizes}, {task: [] for task in prompts}

    def between():
        for T, ms in sweep().items():
            costs[T].append(ms)
        for task, ms in prefill_ms(model, prompts, runs=1).items():
            pre[task].append(ms)

    runs = speed_runs(model, tok, prompts, ks, n_new, reps=reps, between=between)
    return runs, costs, {task: statistics.median(ms) for task, ms in pre.items()}


def transformers_names() -> str:
    """Where speculative decoding lives in the installed transformers: its version, and whether
    ``GenerationConfig`` knows ``prompt_lookup_num_tokens`` and ``DynamicCache`` has ``crop``."""
    import importlib.util

    others = ", ".join(f"{name} {'installed' if importlib.util.find_spec(name) else 'not installed'}"
                       for name in ("vllm", "sglang"))
    try:
        import transformers
    except ImportError:
        return f"transformers not installed (pip install transformers); {others}"
    config = transformers.GenerationConfig()
    return (f"transformers {transformers.__version__}: prompt_lookup_num_tokens "
            f"{'present' if hasattr(config, 'prompt_lookup_num_tokens') else 'missing'}, DynamicCache.crop "
            f"{'present' if hasattr(transformers.DynamicCache, 'crop') else 'missing'}; {others}")


@torch.no_grad()
def hf_prompt_lookup(model, tok, n_new: int = 40, k: int = 4):
    """(transformers' tokens, the course's tokens): the same weights (``kvlib.bench.peers.hf_model_from_kvlib``),
    greedy, prompt lookup with k drafts in both (``generate(prompt_lookup_num_tokens=k)`` against
    ``speculative_generate``), on a prompt that repeats itself. (None, tokens) without transformers."""
    from ..speculate import speculative_generate

    prompt = tok.encode("the cache keeps the keys and the values. the cache keeps the keys and the")
    ours = speculative_generate(model, prompt, n_new, k=k).tokens
    try:
        from ..bench.peers import hf_model_from_kvlib
        hf = hf_model_from_kvlib(model.cpu() if runtime.DEVICE == "cuda" else model)
    except ImportError:
        return None, ours
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                      prompt_lookup_num_tokens=k, pad_token_id=0)
    if runtime.DEVICE == "cuda":
        model.to(runtime.DEVICE)
    return out[0, len(prompt):].tolist(), ours


def hf_line(hf_tokens, ours) -> str:
    """One line comparing ``hf_prompt_lookup``'s two token lists (or saying transformers was not there to run)."""
    if hf_tokens is None:
        return "transformers is not installed here: its prompt lookup was not run"
    return (f"transformers' prompt lookup vs speculative_generate, tiny model, greedy: {len(hf_tokens)} and "
            f"{len(ours)} tokens, identical: {hf_tokens == ours}")


def leviathan(alpha: float, k: int) -> float:
    """Expected tokens per target forward when each of k drafts is accepted independently with probability alpha
    (Leviathan et al. 2023, section 3.1): (1 - alpha^(k + 1)) / (1 - alpha)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _alpha_counts(drafted, accepted) -> tuple[int, int]:
    """(accepted drafts, checked drafts): a step that accepts a < d drafts checked a + 1 of them."""
    acc = sum(accepted)
    return acc, acc + sum(a < d for a, d in zip(accepted, drafted))


def predicted(run: SpeedRun, cost: dict, prefill_ms: float) -> dict:
    """The speed-up this run should show if a step costs what a forward over its tokens costs (``cost``: {T: ms},
    medians): plain = prefill + (n - 1) one-token forwards; speculative = prefill + one forward over d_s + 1 tokens
    per step s, at each step's **actual** draft length d_s. Beside it the old prediction, which divided the tokens
    per forward by the cost of a forward over k + 1 at every step."""
    n = len(run.tokens)
    plain = prefill_ms + (n - 1) * cost[1]
    spec = prefill_ms + sum(cost[d + 1] for d in run.drafted)
    steps = len(run.drafted)
    tpf = (n - 1) / steps if steps else float("nan")
    return {"predicted (actual draft lengths)": plain / spec,
            "old prediction (k + 1 every step)": tpf * cost[1] / cost[min(run.k + 1, max(cost))]}


def speed_table(runs: list, cost: dict, prefill_ms: dict):
    """One row per (task, k): tokens, steps, steps that drafted nothing, acceptance, tokens per forward, ms per token
    (median, min–max over the repetitions), measured speed-up (median, min–max of plain's median over each run) and
    both predictions."""
    import pandas as pd

    plain = {r.task: r for r in runs if r.k == 0}
    rows = []
    for r in runs:
        n = len(r.tokens)
        base = statistics.median(plain[r.task].seconds)
        ups = [base / s for s in r.seconds]
        acc, checked = _alpha_counts(r.drafted, r.accepted)
        row = {"task": r.task, "k": r.k, "tokens": n, "identical to plain": r.tokens == plain[r.task].tokens,
               "steps": len(r.drafted), "steps drafting nothing": sum(d == 0 for d in r.drafted),
               "drafts accepted": f"{acc} of {sum(r.drafted)}" if r.k else "",
               "tokens per forward": (n - 1) / len(r.drafted) if r.drafted else 1.0,
               "ms per token, median (min–max)": _spread([1000 * s / n for s in r.seconds], "{:.1f}"),
               "speed-up, median": statistics.median(ups), "min": min(ups), "max": max(ups)}
        if r.k:
            row.update({k: v for k, v in predicted(r, cost, prefill_ms[r.task]).items()})
        rows.append(row)
    return pd.DataFrame(rows)


def chance_separation(n_a: int, n_b: int) -> float:
    """The probability that the ranges of ``n_a`` and ``n_b`` runs of two configurations that cost the same do not
    overlap (every run of one below every run of the other, either way): 2 / C(n_a + n_b, n_a). 0.1 for 3 against 3,
    1/126 for 5 against 5."""
    return 2 / math.comb(n_a + n_b, n_a)


def speed_verdicts(runs: list, min_runs: int = 5) -> list[str]:
    """One line per (task, k): whether the speculative run's per-token times (min–max over the repetitions) separate
    from plain decoding's (``kvlib.stats.separated``); 'not separated' otherwise, and always with fewer than
    ``min_runs`` runs on either side (with 3 against 3, equal configurations separate one time in ten)."""
    plain = {r.task: r for r in runs if r.k == 0}
    lines = []
    for r in runs:
        if r.k == 0:
            continue
        n, b = len(r.tokens), plain[r.task]
        mine = (1000 * min(r.seconds) / n, 1000 * max(r.seconds) / n)
        base = (1000 * min(b.seconds) / n, 1000 * max(b.seconds) / n)
        if min(len(r.seconds), len(b.seconds)) < min_runs:
            word = f"not separated (fewer than {min_runs} runs)"
        elif not separated(mine, base):
            word = "not separated"
        else:
            word = "faster than plain" if mine[1] < base[0] else "slower than plain"
        lines.append(f"{r.task}, k = {r.k}: {mine[0]:.1f}–{mine[1]:.1f} vs plain {base[0]:.1f}–{base[1]:.1f} "
                     f"ms/token: {word}")
    return lines


def plot_speed(table, title: str = ""):
    """Left: measured speed-up (median, min–max bar) against both predictions, per task; right: tokens per forward."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    spec = table[table.k > 0]
    for i, (task, part) in enumerate(spec.groupby("task", sort=False)):
        color = f"C{i}"
        yerr = [part["speed-up, median"] - part["min"], part["max"] - part["speed-up, median"]]
        axes[0].errorbar(part.k, part["speed-up, median"], yerr=yerr, fmt="o-", color=color, capsize=3,
                         label=f"{task}: measured (min–max)")
        axes[0].plot(part.k, part["predicted (actual draft lengths)"], "x--", color=color,
                     label=f"{task}: predicted, actual draft lengths")
        axes[0].plot(part.k, part["old prediction (k + 1 every step)"], ":", marker="s", mfc="none", color=color,
                     label=f"{task}: old prediction, k + 1 every step")
        axes[1].plot(part.k, part["tokens per forward"], "o-", color=color, label=task)
    axes[0].axhline(1, color="grey", lw=0.8)
    ks = sorted(spec.k.unique())
    axes[0].set(xlabel="k (most drafts per step)", ylabel="speed-up over plain decoding (x)", xticks=ks, title=title)
    axes[1].set(xlabel="k (most drafts per step)", ylabel="new tokens per target forward", xticks=ks,
                title="What each forward yields")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def alpha_table(runs: list):
    """Leviathan et al.'s alpha (accepted / checked drafts) per speculative run, with its 95% Wilson interval, and the
    share of drafted tokens accepted (which falls with k: drafts after a rejection are never checked)."""
    import pandas as pd

    rows = []
    for r in runs:
        if r.k == 0:
            continue
        acc, checked = _alpha_counts(r.drafted, r.accepted)
        lo, hi = wilson(acc, checked) if checked else (float("nan"), float("nan"))
        rows.append({"task": r.task, "k": r.k, "accepted": acc, "checked": checked, "drafted": sum(r.drafted),
                     "alpha": acc / checked if checked else float("nan"), "alpha 95% low": lo, "alpha 95% high": hi,
                     "share of drafts accepted": acc / sum(r.drafted) if sum(r.drafted) else float("nan")})
    return pd.DataFrame(rows)


def iid_spread(alpha: float, drafted, n_sims: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """What Leviathan et al.'s model says a run of these steps would give: each step s drafts ``drafted[s]`` tokens,
    each accepted independently with probability ``alpha`` until the first rejection, plus one token of the target's.
    Returns (mean, 2.5th, 97.5th percentile) of the tokens per forward over ``n_sims`` simulated runs."""
    g = torch.Generator().manual_seed(seed)
    d = torch.tensor(list(drafted))
    ok = torch.rand(n_sims, len(d), int(d.max()), generator=g) < alpha  # (sims, steps, draft position)
    run = ok.int().cumprod(-1).sum(-1)  # accepted until the first rejection
    accepted = torch.minimum(run, d[None])
    tpf = (accepted + 1).float().mean(-1)
    lo, hi = torch.quantile(tpf, torch.tensor([0.025, 0.975])).tolist()
    return float(tpf.mean()), lo, hi


def zero_steps(drafted, accepted, n_sims: int = 20_000, seed: int = 0) -> dict:
    """Does acceptance come all-or-nothing? Counts the steps that drafted something and accepted nothing, against what
    independent drafts at the run's alpha expect: m (1 - alpha) of the m drafting steps. Two tail probabilities of
    seeing that many or more: ``exact``, the binomial at the measured alpha; ``simulated``, ``n_sims`` runs of these
    steps under independence, each run's alpha re-estimated from its own steps (alpha comes from the same steps), the
    statistic being the zero-steps in excess of what the run's own alpha expects."""
    acc, checked = _alpha_counts(drafted, accepted)
    alpha = acc / checked
    d = torch.tensor([x for x in drafted if x > 0])
    m = len(d)
    observed = sum(a == 0 for a, x in zip(accepted, drafted) if x > 0)
    exact = sum(math.comb(m, j) * (1 - alpha) ** j * alpha ** (m - j) for j in range(observed, m + 1))
    g = torch.Generator().manual_seed(seed)
    ok = torch.rand(n_sims, m, int(d.max()), generator=g) < alpha
    sim = torch.minimum(ok.int().cumprod(-1).sum(-1), d[None])  # (sims, steps): accepted until the first rejection
    acc_s = sim.sum(-1).double()
    a_s = acc_s / (acc_s + (sim < d[None]).sum(-1)).clamp(min=1)
    excess = (sim == 0).sum(-1) - m * (1 - a_s)
    simulated = float((excess >= observed - m * (1 - alpha) - 1e-9).double().mean())
    return {"steps": m, "accepting nothing": observed, "expected": m * (1 - alpha), "alpha": alpha,
            "exact": exact, "simulated": simulated, "n_sims": n_sims}


# --------------------------------------------------------------------------------------------
# Lab 11a's decision: which k, or none
# --------------------------------------------------------------------------------------------

MARGIN = 1.05  # a choice of k must be predicted to beat plain decoding by 5%, or the answer is 0 (do not speculate)


def lab_docstring() -> str:
    """The first 400 characters of the tiny model's training text (``kvlib.corpus.course_texts``): lab 11a's prompt."""
    from ..corpus import course_texts

    return course_texts()[0][:400]


def k_evidence(runs: list, cost: dict):
    """Per (task, k): the steps of the run by tokens fed (T = d + 1), and the cost of a forward over each T. The
    lab's decision is made from this table; ``cost`` is {T: cost of a forward over T tokens / one over 1}."""
    import pandas as pd

    rows = []
    for r in runs:
        if r.k == 0:
            continue
        steps = {}
        for d in r.drafted:
            steps[d + 1] = steps.get(d + 1, 0) + 1
        rows.append({"task": r.task, "k": r.k, "new tokens": len(r.tokens),
                     "steps by tokens fed (T: steps)": dict(sorted(steps.items())),
                     "cost of the steps (forwards over 1)": sum(n * cost[T] for T, n in steps.items()),
                     "share of drafts accepted": sum(r.accepted) / max(1, sum(r.drafted)),
                     "tokens per forward": (len(r.tokens) - 1) / len(r.drafted)})
    return pd.DataFrame(rows)


def k_reference(evidence, task: str) -> int:
    """The k whose steps cost least for the task's tokens (prefill left out: it is the same for every k), or 0 when
    none is predicted to beat plain decoding, which costs (new tokens - 1) one-token forwards, by ``MARGIN``."""
    part = evidence[evidence.task == task]
    plain = float(part["new tokens"].iloc[0] - 1)
    speed = plain / part["cost of the steps (forwards over 1)"]
    best = int(speed.idxmax())
    return int(part.loc[best, "k"]) if speed[best] >= MARGIN else 0


def check_k_choice(choices: dict, evidence) -> bool:
    """Lab 11a's decision: {task: k, or 0 to decode without speculation}. Prints yours vs the reference; a wrong
    choice fails with its diagnosis (``kvlib.course.mistakes.lab11a.k_choice``)."""
    from .check import check_choice
    from .mistakes import lab11a

    tasks_ = list(dict.fromkeys(evidence.task))
    yours = {t: choices.get(t) if isinstance(choices, dict) else None for t in tasks_}
    ref = {t: k_reference(evidence, t) for t in tasks_}
    return check_choice("k for " + ", ".join(repr(t) for t in tasks_) + " (0: do not speculate)", yours, ref,
                        lambda: lab11a.k_choice(yours, ref, evidence, MARGIN),
                        shown=(str(list(yours.values())), str(list(ref.values()))))
