"""kvlib's serving engine side by side with Hugging Face transformers' own two ways to serve a batch.

Three runners take the same prompts (lists of token ids) and the same number of new tokens, decode
greedily in fp32 on the CPU, and return ``(outputs, stats)``: one list of generated token ids per
prompt, in prompt order, and a dict with the wall time, the generated tokens per second and each
request's time to first token (TTFT):

- ``run_kvlib_engine``: ``kvlib.engine.Engine`` (chapter 08): continuous batching on the paged
  cache, chunked prefill under a ``max_batched_tokens`` budget.
- ``run_hf_continuous``: transformers' continuous batching, ``model.generate_batch`` (a background
  thread runs a FIFO scheduler on a paged cache of its own; see below for the knobs).
- ``run_hf_static``: transformers' classic ``model.generate`` on a padded batch: every prompt is
  left-padded to the longest, an ``attention_mask`` hides the padding, and the whole batch decodes
  in lock step until every row has its tokens (static batching).

``side_by_side`` runs the three, checks that their greedy outputs are token-identical (per request:
the first index where a peer's tokens differ from kvlib's) and returns a pandas DataFrame of the
figures and of the ratios kvlib / peer. ``python -m kvlib.bench.peers`` does it on SmolLM2-135M.

What transformers' continuous batching needs on a CPU (read from transformers 5.24's
``generation/continuous_batching``; older versions spell things differently):
- the attention implementation: ``attn_implementation="sdpa"`` (plain SDPA reads the paged cache
  since 5.x; the old ``"paged|sdpa"`` / ``"sdpa_paged"`` spellings are deprecated) or
  ``"paged|eager"`` (``"eager"`` is switched to it). Flash attention is tried first when installed,
  unless ``auto_switch_to_flash=False``; on a CPU it never is. ``generate_batch`` always builds its own
  ``PagedAttentionCache``; ``generate(..., cache_implementation="paged")`` reroutes to ``generate_batch`` and
  forwards ``continuous_batching_config`` (without one it sizes the cache to a share of free RAM: a first
  call on SmolLM2 took about a minute on the 2-core development machine, zeroing that pool).
- the knobs live in ``transformers.ContinuousBatchingConfig``, passed separately from the
  ``GenerationConfig``: ``page_size`` (tokens per block, default 256), ``num_blocks`` (blocks of
  ``page_size`` tokens for all layers), ``max_batch_tokens`` (query tokens per forward, default 8192)
  and ``max_requests_per_batch``. Leave ``num_blocks`` unset and the cache is sized to
  ``max_memory_percent`` (0.6 on a CPU) of the free RAM: gigabytes, all zeroed up front.
- greedy, fixed length: ``GenerationConfig(do_sample=False, max_new_tokens=N, eos_token_id=-1)``
  (-1 turns end-of-sequence off; with ``None`` it falls back to the model config's EOS).
- TTFT: ``record_timestamps=True`` gives each output a ``timestamps`` list (one per generated token,
  ``time.perf_counter``) beside ``created_time`` (when ``add_requests`` queued it).
- each ``generate_batch`` call ends with two ``gc.collect()`` and a thread join (about 0.4 s here,
  whatever the workload), so ``stats`` also gives ``serve_s``, first request queued to last request
  done from transformers' own timestamps, beside the whole call's ``wall_s``;
- its scheduler admits no new prefill while fewer than ``safety_margin`` (0.15) of the blocks are
  free, so a pool sized exactly to the requests staggers them: give it some slack.
- on the sdpa path all the requests of a step are packed into one row of query tokens, and each
  query attends to every key the step reads (all the requests' cached tokens) through a
  block-diagonal mask of shape ``[M, N + M]``: attention work grows with the square of the batch's
  tokens, where kvlib's decode attention reads only each request's own blocks.

transformers stays optional: it is imported inside the functions that need it, and kvlib never
depends on it (it is a ``dev`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
import types

import torch

__all__ = ["hf_model_from_kvlib", "run_hf_continuous", "run_hf_static", "run_kvlib_engine", "side_by_side",
           "decode_step_ms", "first_mismatch", "chat_workload", "QUESTIONS"]

# The chapter's targets on the workload (16 chat requests at once, 32 greedy tokens, fp32, 1 thread):
# kvlib's tokens/s over each peer's, and the engine's decode step at batch 8 over generate's.
TARGETS = {"transformers generate (padded)": 1.2, "transformers generate_batch": 2.0}

RUNNERS = {  # row label -> stats["runner"]
    "kvlib": "kvlib Engine",
    "hf_continuous": "transformers generate_batch",
    "hf_static": "transformers generate (padded)",
}


def _transformers():
    """Import transformers, or say clearly why this module needs it and how to get it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "kvlib.bench.peers compares kvlib with Hugging Face transformers, which is not installed. "
            "Install it with `pip install transformers` (or `pip install -e '.[dev]'); kvlib itself "
            "never needs it.") from e
    return transformers


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' logger at ERROR while we run (its info lines and one-time warnings are noise here)."""
    tf_logging = _transformers().utils.logging
    level, bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()  # "Loading weights: 100%" on every from_pretrained
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)
        if bars:
            tf_logging.enable_progress_bar()


def quanto_unpack_in_pytorch() -> bool:
    """Let optimum-quanto unpack its 2- and 4-bit codes with PyTorch shifts instead of building its C++ extension.

    quanto compiles ``unpack.cpp`` (with ninja and the system compiler) the first time a packed tensor is read on
    the CPU: about a minute in a new environment, and a failure where no compiler is installed. Unpacking is a
    shift and a mask per code, so these PyTorch operations give the same bytes (tested against the C++ build where
    one exists). Returns True if quanto is installed and now unpacks this way (or already did)."""
    try:
        from optimum.quanto.library.extensions import get_extension, is_extension_available
    except ImportError:
        return False
    if not is_extension_available("quanto_cpp"):
        return False
    ext = get_extension("quanto_cpp")
    if ext._lib is None:  # not loaded yet: this process never compiles it
        ext._lib = types.SimpleNamespace(unpack=unpack_codes)
    return True


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's packing undone: ``8 // bits`` codes per uint8, the i-th in bits ``[bits*i, bits*(i+1))``, each group
    of codes concatenated along dim 0 (as ``quanto::unpack`` returns them)."""
    return torch.cat([(packed >> (bits * i)) & (2 ** bits - 1) for i in range(8 // bits)]).to(torch.uint8)


def _check_prompts(prompts, max_new_tokens) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (each a list of token ids)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple)) or not p:
            raise TypeError(f"prompts[{i}] must be a non-empty list of token ids, got {p!r:.60}")
        out.append([int(t) for t in p])
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    return out


def _stats(runner: str, outputs, wall_s: float, serve_s: float, ttft_s, **extra) -> dict:
    """The figures every runner returns. ``wall_s``: the whole call, setup and teardown included;
    ``serve_s``: from the first request queued to the last one done; tokens/s for both."""
    n = sum(len(o) for o in outputs)
    return dict(runner=runner, requests=len(outputs), new_tokens=n, wall_s=wall_s, serve_s=serve_s,
                tokens_per_s=n / wall_s if wall_s > 0 else float("nan"),
                serve_tokens_per_s=n / serve_s if serve_s > 0 else float("nan"), ttft_s=ttft_s, **extra)


# --------------------------------------------------------------------------------------------
# The same weights in transformers
# --------------------------------------------------------------------------------------------


def hf_model_from_kvlib(model, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """The same weights as a transformers ``LlamaForCausalLM``, in eval mode, on the CPU.

    ``kvlib.model.save_hf`` writes the Hugging Face layout (``config.json`` + ``model.safetensors``)
    into a temporary folder, and transformers reads it back: the round trip is the proof that the two
    models share one checkpoint format. The folder lives as long as the returned model (it is kept
    on it as ``_kvlib_tmpdir``), since safetensors may map the file instead of copying it.

    ``attn_implementation``: ``"sdpa"`` (the default; what both of transformers' engines use on a
    CPU) or ``"eager"``. The logits agree with kvlib's to about 1e-4 in fp32 (tests/test_model.py).
    """
    transformers = _transformers()
    from ..model import save_hf

    tmp = tempfile.TemporaryDirectory(prefix="kvlib-hf-")
    save_hf(model, tmp.name)
    with _quiet_transformers():
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp.name, dtype=dtype,
                                                           attn_implementation=attn_implementation)
    hf = hf.to("cpu").eval()
    hf._kvlib_tmpdir = tmp  # cleaned up when the model is garbage-collected
    return hf


# --------------------------------------------------------------------------------------------
# The three runners
# --------------------------------------------------------------------------------------------


def _blocks_for(prompts, max_new_tokens, block_size) -> int:
    return sum(math.ceil((len(p) + max_new_tokens) / block_size) for p in prompts)


def run_hf_continuous(hf_model, prompts, max_new_tokens: int, *, page_size: int = 16, num_blocks: int | None = None,
                      max_batch_tokens: int = 256, max_requests_per_batch: int | None = None, **engine_knobs):
    """Greedy generation through transformers' continuous batching (``model.generate_batch``).

    Every prompt is queued at once and gets exactly ``max_new_tokens`` tokens (EOS is off). Knobs
    (fields of ``transformers.ContinuousBatchingConfig``): ``page_size`` tokens per block;
    ``num_blocks`` blocks in the pool (default: every request's blocks, plus 25% because the FIFO
    scheduler stops admitting prefills below 15% free blocks); ``max_batch_tokens`` query tokens per
    forward; ``max_requests_per_batch`` (default: all the prompts); anything else in
    ``engine_knobs`` goes to the config as is (e.g. ``allow_block_sharing=False``,
    ``scheduler_type="prefill_first"``).

    Returns ``(outputs, stats)``: stats has ``wall_s`` (the whole call: building the cache, the
    background thread, every request, the teardown), ``serve_s`` (first request queued to last
    request finished, transformers' ``created_time`` and ``lifespan``), ``tokens_per_s`` and
    ``serve_tokens_per_s`` (generated tokens over each), and ``ttft_s``, one per request: its first
    token's timestamp minus the moment it was queued (transformers records both with
    ``record_timestamps=True``). transformers only logs a failed request; here it raises.
    """
    transformers = _transformers()
    if not hasattr(transformers, "ContinuousBatchingConfig") or not hasattr(hf_model, "generate_batch"):
        raise ImportError(f"transformers {transformers.__version__} has no ContinuousBatchingConfig / "
                          "generate_batch: run_hf_continuous was written against transformers 5.24")
    prompts = _check_prompts(prompts, max_new_tokens)
    if num_blocks is None:
        num_blocks = math.ceil(_blocks_for(prompts, max_new_tokens, page_size) * 1.25) + 2
    cb = transformers.ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch or len(prompts), auto_switch_to_flash=False, **engine_knobs)
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1,
                                        pad_token_id=0)
    with _quiet_transformers():
        t0 = time.perf_counter()
        results = hf_model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                          record_timestamps=True)
        wall_s = time.perf_counter() - t0
    results = list(results.values())  # generate_batch returns them in input order
    bad = [(r.request_id, r.error) for r in results if r.error is not None]
    if len(results) != len(prompts) or bad:
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} requests; failed: {bad} "
                           f"(knobs: page_size={page_size}, num_blocks={num_blocks}, "
                           f"max_batch_tokens={max_batch_tokens})")
    outputs = [list(r.generated_tokens) for r in results]
    ttft = [r.timestamps[0] - r.created_time if r.timestamps else None for r in results]
    serve_s = max(r.lifespan[1] for r in results) - min(r.created_time for r in results)
    return outputs, _stats(RUNNERS["hf_continuous"], outputs, wall_s, serve_s, ttft,
                           knobs=dict(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=cb.max_requests_per_batch, **engine_knobs))


class _FirstTokenClock:
    """A transformers streamer that notes when ``generate`` hands out its first new tokens.

    ``generate`` calls ``put`` once with the prompt, then once per decoding step with the batch's
    new tokens (one per row): the second call is the first token of every row of the batch.
    """

    def __init__(self):
        self.calls, self.first_token_time = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.perf_counter()

    def end(self):
        pass


def run_hf_static(hf_model, prompts, max_new_tokens: int, batch_size: int | None = None, pad_token_id: int = 0):
    """Greedy generation through transformers' ``generate`` on left-padded batches (static batching).

    Prompts go in arrival order, ``batch_size`` at a time (default: all at once). Each batch is
    left-padded with ``pad_token_id`` to its longest prompt, with an ``attention_mask`` of 0 over the
    padding (transformers derives the position ids from it, so a padded row sees the same positions
    as alone); EOS is off (``eos_token_id=-1``), so every row gets exactly ``max_new_tokens`` tokens.
    ``min_new_tokens`` is not used: it would forbid EOS, changing the greedy choice.

    Returns ``(outputs, stats)``; ``serve_s`` is ``wall_s`` (there is no setup to leave out);
    ``ttft_s`` per request is the time from the start of the call (all requests arrive then) to its
    batch's first decoding step, measured with a streamer.
    """
    transformers = _transformers()
    prompts = _check_prompts(prompts, max_new_tokens)
    batch_size = len(prompts) if batch_size is None else int(batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1,
                                        pad_token_id=pad_token_id)
    outputs, ttft = [], []
    with _quiet_transformers(), torch.no_grad():
        t0 = time.perf_counter()
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            clock = _FirstTokenClock()
            out = hf_model.generate(input_ids=ids, attention_mask=mask, generation_config=gen, streamer=clock)
            outputs += out[:, width:].tolist()
            ttft += [clock.first_token_time - t0] * len(batch)
        wall_s = time.perf_counter() - t0
    return outputs, _stats(RUNNERS["hf_static"], outputs, wall_s, wall_s, ttft, knobs=dict(batch_size=batch_size))


def run_kvlib_engine(model, prompts, max_new_tokens: int, *, block_size: int = 16, num_blocks: int | None = None,
                     max_num_seqs: int | None = None, max_batched_tokens: int = 256, **engine_kw):
    """Greedy generation through ``kvlib.engine.Engine``, every request added at once.

    ``num_blocks`` defaults to enough for every request at once (so nothing is preempted);
    ``max_num_seqs`` to all the prompts; other keywords go to ``Engine`` as they are. Only the
    engine's public surface is used (``add_request``, ``run``, ``metrics``), so this keeps working
    while the engine's insides change.

    Returns ``(outputs, stats)``: ``wall_s`` covers building the engine (its paged pool) and
    ``run()``, ``serve_s`` the first ``add_request`` to the end of ``run()``; ``ttft_s`` per request
    is the engine's own ``metrics(id)["ttft_s"]``.
    """
    from ..engine import Engine

    prompts = _check_prompts(prompts, max_new_tokens)
    if num_blocks is None:
        num_blocks = _blocks_for(prompts, max_new_tokens, block_size) + 1
    max_num_seqs = max_num_seqs or len(prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        engine = Engine(model, num_blocks, block_size, max_num_seqs=max_num_seqs,
                        max_batched_tokens=max_batched_tokens, **engine_kw)
        t1 = time.perf_counter()
        ids = [engine.add_request(p, max_new_tokens) for p in prompts]
        done = engine.run()
        t2 = time.perf_counter()
        wall_s, serve_s = t2 - t0, t2 - t1
    outputs = [list(done[i]) for i in ids]
    ttft = [engine.metrics(i).get("ttft_s") for i in ids]
    return outputs, _stats(RUNNERS["kvlib"], outputs, wall_s, serve_s, ttft,
                           knobs=dict(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                      max_batched_tokens=max_batched_tokens, **engine_kw))


def decode_step_ms(model, prompts, new_tokens: int = 16, block_size: int = 16) -> dict:
    """Median wall time of one decode step over ``len(prompts)`` requests: kvlib's engine (its steps that
    only decode, from ``event["wall_s"]``) against ``kvlib.generate.generate`` on its contiguous cache (the
    time between the ends of consecutive decode forwards, sampling included). Greedy, every request the
    same number of tokens, so both decode the whole batch at every step."""
    import statistics

    from ..engine import Engine
    from ..generate import generate

    prompts = _check_prompts(prompts, new_tokens)
    ends = []

    class _Timed:  # the model as generate sees it, noting when each forward ends
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, *args, **kw):
            out = model(*args, **kw)
            ends.append(time.perf_counter())
            return out

    with torch.no_grad():
        engine = Engine(model, _blocks_for(prompts, new_tokens, block_size) + 1, block_size,
                        max_num_seqs=len(prompts), max_batched_tokens=max(256, len(prompts)))
        for q in prompts:
            engine.add_request(q, new_tokens)
        engine.run()
        generate(_Timed(), prompts, new_tokens)
    engine_steps = [ev["wall_s"] for ev in engine.events if ev["decode_tokens"] == len(prompts)
                    and not ev["prefill_tokens"]]
    generate_steps = [b - a for a, b in zip(ends[1:], ends[2:])]  # ends[0] is the prefill
    return dict(batch=len(prompts), engine_ms=1e3 * statistics.median(engine_steps),
                generate_ms=1e3 * statistics.median(generate_steps), steps=len(engine_steps))


# --------------------------------------------------------------------------------------------
# Side by side
# --------------------------------------------------------------------------------------------


def first_mismatch(a, b) -> int | None:
    """The first index where token lists ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _pct(xs, q):
    import numpy as np

    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else float("nan")


def side_by_side(model, prompts, max_new_tokens: int, threads: int | None = 1, *, hf_model=None,
                 engine_kw: dict | None = None, hf_continuous_kw: dict | None = None,
                 static_batch_size: int | None = None, warmup: bool = True):
    """Run kvlib's engine and transformers' two engines on the same prompts; compare tokens and speed.

    Greedy, fp32, on the CPU with ``torch.set_num_threads(threads)`` (restored afterwards; None
    leaves it as it is). ``hf_model``: the transformers twin of ``model`` (built with
    ``hf_model_from_kvlib`` when None). ``warmup``: first run each engine once on two short requests,
    untimed, so one-time costs (lazy initialisation, first-call kernel selection) stay out of the
    figures.

    Returns a DataFrame, one row per engine: tokens/s and wall s (the whole call), serve tokens/s
    and serve s (first request queued to last one done: no engine setup or teardown), TTFT median
    and p99 (numpy's linear interpolation: with 16 requests p99 is nearly the maximum), how many
    requests are token-identical to kvlib's and, for the others, the first differing index per
    request. Ratios: ``kvlib_x`` is kvlib's tokens/s over that row's (> 1: kvlib is faster),
    ``kvlib_serve_x`` the same for the serve figures, ``ttft_median_ratio`` kvlib's median TTFT
    over that row's (< 1: kvlib answers first). ``df.attrs`` keeps the outputs, the mismatches
    ({row: {request: first differing index}}), the per-runner stats and the threads used.
    """
    import pandas as pd

    prompts = _check_prompts(prompts, max_new_tokens)
    engine_kw, hf_continuous_kw = dict(engine_kw or {}), dict(hf_continuous_kw or {})
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        hf = hf_model if hf_model is not None else hf_model_from_kvlib(model)
        runs = {
            "kvlib": lambda ps, n: run_kvlib_engine(model, ps, n, **engine_kw),
            "hf_continuous": lambda ps, n: run_hf_continuous(hf, ps, n, **hf_continuous_kw),
            "hf_static": lambda ps, n: run_hf_static(hf, ps, n, batch_size=static_batch_size),
        }
        if warmup:
            short = [p[:8] for p in prompts[:2]]
            for run in runs.values():
                run(short, 2)
        results = {name: run(prompts, max_new_tokens) for name, run in runs.items()}
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)

    ref, ref_stats = results["kvlib"]
    rows, mismatches = [], {}
    for name, (outs, st) in results.items():
        mism = {i: first_mismatch(ref[i], o) for i, o in enumerate(outs) if first_mismatch(ref[i], o) is not None}
        mismatches[name] = mism
        rows.append(dict(
            engine=st["runner"], requests=st["requests"], new_tokens=st["new_tokens"],
            wall_s=st["wall_s"], tokens_per_s=st["tokens_per_s"], serve_s=st["serve_s"],
            serve_tokens_per_s=st["serve_tokens_per_s"],
            ttft_median_s=_pct(st["ttft_s"], 50), ttft_p99_s=_pct(st["ttft_s"], 99),
            identical=f"{len(outs) - len(mism)}/{len(outs)}",
            first_mismatch=", ".join(f"req {i} @ {j}" for i, j in mism.items()) or "-",
        ))
    df = pd.DataFrame(rows).set_index("engine")
    df["kvlib_x"] = ref_stats["tokens_per_s"] / df["tokens_per_s"]
    df["kvlib_serve_x"] = ref_stats["serve_tokens_per_s"] / df["serve_tokens_per_s"]
    df["ttft_median_ratio"] = df.loc[RUNNERS["kvlib"], "ttft_median_s"] / df["ttft_median_s"]
    df.attrs.update(outputs={k: v[0] for k, v in results.items()}, mismatches=mismatches,
                    stats={k: v[1] for k, v in results.items()}, threads=used_threads)
    return df


# --------------------------------------------------------------------------------------------
# The workload of the issue: 16 chat requests at once, 41-130 prompt tokens, 32 new tokens each
# --------------------------------------------------------------------------------------------

# Made-up user questions written for this benchmark, short to long, so that with SmolLM2's chat
# template (which adds its default system prompt) the prompts are 41 to 130 tokens long.
QUESTIONS = [
    "How many legs does a spider have, and why?",
    "What makes bread dough rise when it bakes in a hot oven?",
    "Can you explain in simple words why ice floats on water instead of sinking to the bottom?",
    "My tomato plants have yellow leaves near the bottom. What could be wrong, and what should I check first?",
    "Give me three practical tips for keeping a houseplant alive in a dark, north-facing apartment during a long, cold winter.",
    "What is the difference between a virus and a bacterium, and why do antibiotics only work against one of them? Please keep it short.",
    "I am planning a weekend hike of about twenty kilometres. What should I pack, and how much water "
    "do I need if the weather is warm and sunny?",
    "Write a short, friendly note to a neighbour asking them to water my garden and collect my post while "
    "I am away for a week in the mountains.",
    "Why do we see lightning before we hear thunder? Please include a rough way to estimate how far away "
    "the storm is, using only a watch and some simple arithmetic.",
    "Explain how the gears on a bicycle work, what the numbers on the front and back sprockets mean, and when a "
    "rider should shift to a lower gear while climbing a steep hill.",
    "I keep forgetting where I put my keys. Suggest a few habits or small tricks that could help me stop "
    "losing them every morning before work, especially on days when I am in a hurry and leave the house late.",
    "What is a prime number? List the first ten primes, explain how I could check whether 91 is prime "
    "without a calculator, and tell me why mathematicians care so much about primes in the first place.",
    "Our team of five is arguing about whether to meet every day for fifteen minutes or once a week for an "
    "hour. What are the trade-offs, and what would you suggest for a small software project that lasts about "
    "three months and has one tight deadline?",
    "I am learning to cook and want a simple weekly plan: five dinners that share ingredients so that "
    "nothing goes to waste, with a short shopping list at the end. I have an oven, two pans and about "
    "thirty minutes each evening, and I do not eat meat on Mondays or Fridays.",
    "Describe the water cycle for a ten-year-old: evaporation, condensation, precipitation and collection. "
    "Use an everyday example for each step, such as a puddle drying in the sun, drops forming on a cold glass "
    "or a grey cloud over the hills, and finish with one question the child could try to answer on their own "
    "after school.",
    "I run a small bakery and sell about two hundred loaves a week. Flour prices went up by a fifth this "
    "year, and customers complain whenever I raise prices. Walk me through a few options, such as smaller "
    "loaves, a loyalty card, or a cheaper everyday bread next to a premium one, and say which one you "
    "would try first and why. Keep it to a few short paragraphs, and mention how I could tell after a month "
    "whether the change is working from my till receipts.",
]


def chat_workload(tokenizer, n: int = 16) -> list[list[int]]:
    """``n`` chat prompts (token ids) from ``QUESTIONS``, through the tokenizer's chat template."""
    if not 1 <= n <= len(QUESTIONS):
        raise ValueError(f"n must be between 1 and {len(QUESTIONS)} (the questions written here), got {n}")
    return [tokenizer.chat([{"role": "user", "content": q}]) for q in QUESTIONS[:n]]


def _load_average() -> str:
    try:
        import os

        return "load average %.2f, %.2f, %.2f" % os.getloadavg()
    except (OSError, AttributeError):
        return "load average unknown"


def main(argv=None) -> int:
    """``python -m kvlib.bench.peers``: the side by side on SmolLM2-135M-Instruct, printed as a table."""
    p = argparse.ArgumentParser(prog="python -m kvlib.bench.peers", description=main.__doc__)
    p.add_argument("--requests", type=int, default=16, help="chat requests arriving at once (1-16)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for the run")
    p.add_argument("--block-size", type=int, default=16, help="kvlib block_size and transformers page_size")
    p.add_argument("--max-batched-tokens", type=int, default=256,
                   help="kvlib max_batched_tokens and transformers max_batch_tokens")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a kvlib.model.load_pretrained name, or 'tiny'")
    args = p.parse_args(argv)
    _transformers()  # fail early, with the install hint

    from ..model import load_pretrained, load_tiny

    if args.model == "tiny":
        model, tok = load_tiny(device="cpu")
        prompts = [list(q.encode())[:60 + 5 * i] for i, q in enumerate(QUESTIONS[:args.requests])]
    else:
        model, tok = load_pretrained(args.model, device="cpu")
        prompts = chat_workload(tok, args.requests)
    lens = [len(q) for q in prompts]
    print(f"{args.requests} requests at once, prompts of {min(lens)}-{max(lens)} tokens "
          f"(total {sum(lens)}), {args.new_tokens} new tokens each, greedy, fp32, CPU, {args.threads} thread(s); "
          f"{_load_average()} before the run", flush=True)
    df = side_by_side(model, prompts, args.new_tokens, threads=args.threads,
                      engine_kw=dict(block_size=args.block_size, max_batched_tokens=args.max_batched_tokens),
                      hf_continuous_kw=dict(page_size=args.block_size, max_batch_tokens=args.max_batched_tokens))
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 60):
        print(df.drop(columns=["first_mismatch"]).round(3).to_string())
    for name, st in df.attrs["stats"].items():
        print(f"  {st['runner']}: {st['knobs']}")
    kv = df.iloc[0]
    for engine, row in df.iloc[1:].iterrows():
        target = TARGETS.get(engine)
        verdict = "" if target is None else f" (target >= {target}x: {'met' if row['kvlib_x'] >= target else 'not met'})"
        print(f"kvlib / {engine}: {row['kvlib_x']:.2f}x tokens/s{verdict}, median TTFT {kv['ttft_median_s']:.3f}s vs "
              f"{row['ttft_median_s']:.3f}s; identical {row['identical']}; first mismatch: {row['first_mismatch']}")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        step = decode_step_ms(model, prompts[:8], block_size=args.block_size)
    finally:
        torch.set_num_threads(old_threads)
    print(f"decode step at batch {step['batch']} (median of {step['steps']}): engine {step['engine_ms']:.1f} ms, "
          f"generate {step['generate_ms']:.1f} ms, ratio {step['engine_ms'] / step['generate_ms']:.2f} "
          f"(target <= 1: {'met' if step['engine_ms'] <= step['generate_ms'] else 'not met'})")
    print(_load_average() + " after the run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
