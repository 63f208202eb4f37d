"""Serving many requests at once (chapter 08): an iteration-level scheduler on the paged cache.

What you will learn:
- iteration-level (continuous) batching: the scheduler decides again at *every* step which
  requests run, so a finished request's blocks go to a waiting one at once instead of the whole
  batch waiting for its longest member (static batching);
- one forward per step: the step's prefill chunks and decode tokens are laid end to end in one flat
  batch (each token with its sequence and position), attended by ragged paged attention
  (``kvlib.ragged``), and the output head runs only where a token is sampled: the last token of each
  sequence whose prompt is done. This is why chunked prefill is cheap (Sarathi-Serve, vLLM V1);
- watermark admission: a waiting request gets in only if its blocks fit and a reserve of free
  blocks (the watermark) is left for the running requests to grow into;
- chunked prefill: a long prompt is fed in pieces, so that no step computes more than
  ``max_batched_tokens`` tokens and the running requests keep decoding meanwhile;
- preemption when blocks run out: the newest request gives its blocks up, by *recompute* (drop
  them; prefill prompt + generated tokens again later) or by *swap* (copy them to host memory and
  back later): compute against copy bandwidth;
- prefix caching across requests: the paged cache is the one owner of the blocks (reference counts,
  hashes, the LRU of cached blocks, the tiers). A block whose last request let go keeps its chained
  hash until it is reused, so a later request with the same prefix (a system prompt, a shared document,
  or the same request after a recompute preemption) finds it; every hit compares tokens. Even when the
  whole prompt is cached, its last token is computed: its logits give the first new token;
- a tiered prefix store (off by default: ``host_blocks``, ``disk_dir``, ``disk_blocks``;
  ``kvlib.tiers``): a cached block evicted from the device pool moves to host memory, from there to
  disk (one safetensors file per block), and comes back when a later prompt's lookup reaches it. A
  damaged or missing file is a miss, never an error;
- what a server needs around it: ``abort(id)``, ``stream()`` (new tokens as they are made), stop token
  ids and stop strings, and logs that stay bounded (``max_events``, ``max_finished``).

The rules of one ``step()`` (time is the step counter; "available" counts the free blocks plus the
cached ones, which are evicted, least recently used first, when a fresh block is needed):
1. Swap-in, then admission, while fewer than ``max_num_seqs`` requests run. Swapped-out requests
   come back first, oldest first; while any waits in host memory no new request is admitted.
   Then waiting requests in arrival order (recompute-preempted ones keep their place by age): a
   request is admitted when the blocks of its tokens not found in the device pool's prefix cache
   (a host or disk hit needs a fresh device block too) fit beside those the running requests still
   need for their pending tokens, leaving ``int(watermark * num_blocks)`` blocks free; when nothing
   runs they only have to fit. The first that does not fit stops admission.
2. Budget: every running request with one token to compute (decoding) gets that token; the
   requests still prefilling share the rest of ``max_batched_tokens`` in arrival order, each taking
   a chunk of min(its remaining tokens, what is left of the budget).
3. Blocks, oldest first: if a request's tokens need more blocks than are available, the newest running
   request is preempted (recompute or swap), repeatedly; when no newer one is left, a prefill
   chunk shrinks to what fits (maybe to nothing) and a decoding request preempts itself.
4. Compute first, commit after: one forward over every scheduled token, then one sample per request
   whose tokens are all computed (each with its own generator). Only when all of that succeeded do the
   requests move on: a request finishes on ``eos_id``, a stop token or string, or after
   ``max_new_tokens``, and frees its blocks at once.
An exception raised by the work of ``step()`` (the forward, a sample, a stop-string decode, a tier's copy
or file, or a KeyboardInterrupt arriving during the forward or the sampling) leaves every request either
as it was before the step or cleanly back in the queue, and every block accounted for; the exception is
raised and the next ``step()`` carries on. A request whose own sampling fails ``MAX_SAMPLE_FAILURES``
steps in a row (logits that are not numbers, say) ends with finish_reason "error" instead, so that it cannot stall the
others. (An interrupt that lands inside the engine's own bookkeeping, between two Python lines, is not
covered: no Python program can make that atomic.)

>>> from kvlib.generate import generate
>>> from kvlib.model import ModelConfig, Transformer
>>> with torch.random.fork_rng():  # seeded weights, without touching the global generator
...     _ = torch.manual_seed(0)
...     model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()
>>> engine = Engine(model, num_blocks=8, block_size=4, max_num_seqs=2, max_batched_tokens=6)
>>> prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 3], [1, 2, 3, 4, 9]]  # the third shares the first's first block
>>> ids = [engine.add_request(p, max_new_tokens=3) for p in prompts]
>>> out = engine.run()
>>> all(out[i] == generate(model, [p], 3)[0].tolist() for i, p in zip(ids, prompts))  # token-identical
True
>>> [(e["prefill_tokens"], e["decode_tokens"]) for e in engine.events]  # a 6-token chunk, then 1 + 2 ...
[(6, 0), (2, 1), (0, 2), (0, 2), (0, 1), (0, 1), (0, 1)]
>>> [engine.events[i]["admitted"] for i in (0, 4)], engine.metrics(ids[2])["cached_tokens"]
([[0, 1], [2]], 4)
>>> engine.forwards == len(engine.events)  # one forward per step, prefill chunks and decodes together
True
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from .cache import check_int
from .generate import _check_sampling, check_prompt_fits, sample_next
from .paged import PagedKVCache
from .tiers import TIER_COUNTERS, HostDiskTiers

__all__ = ["Engine", "EngineConfig", "Request", "TIER_COUNTERS", "MAX_SAMPLE_FAILURES"]

MAX_SAMPLE_FAILURES = 3  # a request whose sampling raises this many steps in a row ends with "error"


@dataclass
class EngineConfig:
    num_blocks: int  # blocks in the paged pool (per layer), shared by all requests
    block_size: int = 16  # positions per block
    max_num_seqs: int = 8  # most requests running (holding blocks) at once
    max_batched_tokens: int = 64  # most tokens computed in one step: decode tokens + prefill chunks
    preemption: str = "recompute"  # "recompute": drop the blocks, prefill again; "swap": copy to host and back
    watermark: float = 0.01  # fraction of the pool admission leaves free for running requests to grow
    prefix_caching: bool = True  # share full blocks of identical prefixes, also from finished requests
    host_blocks: int = 0  # evicted prefix blocks kept in host memory (LRU); 0: no host tier
    disk_dir: str | None = None  # folder for the disk tier's block files (one safetensors file per block)
    disk_blocks: int = 0  # most block files kept in disk_dir (the oldest is deleted); 0: no disk tier
    max_events: int = 100_000  # step events kept in Engine.events (the oldest go first)
    max_finished: int = 100_000  # finished or aborted requests kept in Engine.requests (the oldest go first)

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_batched_tokens", "max_events",
                     "max_finished"):
            setattr(self, name, check_int(name, getattr(self, name)))
        for name in ("host_blocks", "disk_blocks"):
            setattr(self, name, check_int(name, getattr(self, name), minimum=0))
        if self.disk_blocks and self.disk_dir is None:
            raise ValueError(f"disk_blocks={self.disk_blocks} needs disk_dir, the folder for the block files")
        if self.disk_dir is not None and not self.disk_blocks:
            raise ValueError(f"disk_dir={self.disk_dir!r} is set but disk_blocks is 0: give disk_blocks >= 1 "
                             "(the most block files to keep), or leave disk_dir out")
        if self.tiered and not self.prefix_caching:
            raise ValueError("host_blocks / disk_blocks keep evicted prefix-cache blocks: "
                             "they need prefix_caching=True")
        if self.max_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running request decodes one token per step")
        if self.preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        if isinstance(self.watermark, bool) or not isinstance(self.watermark, (int, float)) \
                or not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be a fraction of the pool in [0, 1), got {self.watermark!r}")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    @property
    def tiered(self) -> bool:
        return bool(self.host_blocks or self.disk_blocks)


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    seed: int | None = None
    eos_id: int | None = None
    stop_token_ids: tuple = ()  # more token ids that end the request (like eos_id)
    stop: tuple = ()  # strings that end the request once the decoded output contains one
    output: list[int] = field(default_factory=list)  # generated token ids
    state: str = "waiting"  # "waiting" | "running" | "swapped" | "finished" | "aborted"
    finish_reason: str | None = None  # "stop" (eos, a stop token or string), "length", "abort" or "error"
    error: str | None = None  # with finish_reason "error": why its sampling failed
    text: str | None = None  # with stop strings: the decoded output, cut before the stop string
    computed: int = 0  # tokens of prompt + output whose K/V are in the cache (or in `host`)
    generator: torch.Generator | None = None  # this request's own sampling generator (from seed)
    host: list | None = None  # swapped-out K/V: per layer (k, v), each (n_blocks, block_size, H_KV, D)
    preemptions: int = 0
    sample_failures: int = 0  # steps in a row whose draw for this request raised
    cached_tokens: int = 0  # positions served by the prefix cache instead of computed (all admissions)
    cached_tokens_host: int = 0  # of cached_tokens, those copied back from the host tier
    cached_tokens_disk: int = 0  # of cached_tokens, those read back from the disk tier
    arrival_step: int = 0  # logical clock: the step during which the request was added
    admitted_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    arrival_time: float = 0.0  # wall clock (time.perf_counter), for the curious: not deterministic
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens still to compute: 1 while decoding, more while (re)prefilling."""
        return len(self.prompt) + len(self.output) - self.computed


def _by_id(r):
    return r.id


def _factory_cache(cache_factory, model, config: EngineConfig) -> PagedKVCache:
    """The cache ``cache_factory(model, num_blocks, block_size)`` builds (the capstone's seam: a learner's cache class
    behind the engine and the server), checked: a PagedKVCache (or a subclass) with exactly that pool. The factory's
    cache decides prefix caching; host/disk tiers and swap preemption copy only the plain K/V pools, so they stay
    with the engine's own cache."""
    if not callable(cache_factory):
        raise TypeError(f"cache_factory must be a callable (model, num_blocks, block_size) -> PagedKVCache, got "
                        f"{type(cache_factory).__name__}")
    if config.tiered or config.preemption != "recompute":
        raise ValueError("cache_factory works with preemption='recompute' and no host/disk tiers (they copy the "
                         "engine's own K/V pools, not a custom cache's other buffers)")
    cache = cache_factory(model, config.num_blocks, config.block_size)
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache_factory must return a kvlib.paged.PagedKVCache (or a subclass), got "
                        f"{type(cache).__name__}")
    if cache.allocator.num_blocks != config.num_blocks or cache.block_size != config.block_size:
        raise ValueError(f"cache_factory returned a pool of {cache.allocator.num_blocks} blocks of {cache.block_size}; "
                         f"the engine asked for num_blocks={config.num_blocks}, block_size={config.block_size}")
    if cache.tables:
        raise ValueError(f"cache_factory must return an empty cache, got one holding {len(cache.tables)} sequence(s)")
    return cache


class Engine:
    """Continuous batching over one PagedKVCache; see the module docstring for the rules.

    ``cache_factory``: None (the engine builds ``PagedKVCache.for_model``), or a callable (model, num_blocks,
    block_size) -> an empty PagedKVCache subclass with that pool, used instead (the capstone's paged INT8 cache
    with eviction); it needs ``preemption="recompute"`` and no host/disk tiers.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> with torch.random.fork_rng():
    ...     _ = torch.manual_seed(0)
    ...     model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()
    >>> engine = Engine(model, num_blocks=4, block_size=4)  # room for 16 positions in all
    >>> engine.add_request([1, 2, 3], max_new_tokens=2)
    0
    >>> engine.add_request(list(range(15)), max_new_tokens=4)  # refused up front; the others are served
    Traceback (most recent call last):
    ...
    ValueError: prompt_ids (15 tokens) + max_new_tokens (4) needs 5 blocks of 4 positions, more than the whole ...
    >>> out = engine.run()
    >>> len(out[0]), engine.metrics(0)["ttft_steps"], engine.metrics(0)["finish_reason"]
    (2, 1, 'length')
    >>> engine.cache.allocator.num_free, len(engine.cache.cached)  # 3 + 1 positions filled a block: kept for reuse
    (3, 1)
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16, *, max_num_seqs: int = 8,
                 max_batched_tokens: int = 64, preemption: str = "recompute", watermark: float = 0.01,
                 prefix_caching: bool = True, kernels: str | None = None, host_blocks: int = 0,
                 disk_dir: str | None = None, disk_blocks: int = 0, tokenizer=None, max_events: int = 100_000,
                 max_finished: int = 100_000, cache_factory=None):
        self.config = EngineConfig(num_blocks, block_size, max_num_seqs, max_batched_tokens, preemption,
                                   watermark, prefix_caching, host_blocks, disk_dir, disk_blocks, max_events,
                                   max_finished)
        self.model, self.tokenizer = model, tokenizer  # the tokenizer decodes outputs for stop strings
        if cache_factory is not None:
            self.cache = _factory_cache(cache_factory, model, self.config)
        else:
            tiers = None
            if self.config.tiered:
                tiers = HostDiskTiers(host_blocks, disk_dir, disk_blocks, pin=torch.device(model.device).type == "cuda")
            self.cache = PagedKVCache.for_model(model, num_blocks, block_size, kernels=kernels,
                                                prefix_caching=prefix_caching, retain_freed=prefix_caching, tiers=tiers)
        self.requests: dict[int, Request] = {}  # requests by id (= arrival order); finished ones up to max_finished
        self._finished: deque = deque()  # ids of finished / aborted requests still in self.requests, oldest first
        self._aborted: list = []  # aborted since the last step, for stream()
        self._next_id = 0
        self.waiting: list[Request] = []  # sorted by id
        self.swapped: list[Request] = []  # sorted by id
        self.running: list[Request] = []  # sorted by id
        self.clock = 0  # steps taken
        self.forwards = 0  # model forwards run (one per step that computes anything)
        self.events: deque = deque(maxlen=self.config.max_events)  # one dict per step (see step())

    # ---- the tiers, as the cache keeps them -------------------------------------------------

    @property
    def tier_stats(self) -> dict:
        """Totals since the start (see TIER_COUNTERS); all zero without tiers."""
        return dict(self.cache.tiers.stats) if self.cache.tiers is not None else dict.fromkeys(TIER_COUNTERS, 0)

    # ---- requests -----------------------------------------------------------------------

    def add_request(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, *, top_k: int | None = None,
                    seed: int | None = None, eos_id: int | None = None, stop_token_ids=(), stop=()) -> int:
        """Queue a request; returns its id. Refuses (ValueError/TypeError, nothing queued) what could
        never be served: past the model's context, or more blocks than the whole pool. ``stop``: strings
        that end the request (they need the engine's ``tokenizer``)."""
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
            raise TypeError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
        prompt = [check_int("prompt_ids token", t, minimum=0) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token, got []")
        V, bs = self.model.config.vocab_size, self.config.block_size
        max_new_tokens = check_int("max_new_tokens", max_new_tokens)
        check_prompt_fits(self.model, prompt, max_new_tokens, "prompt_ids")
        total = len(prompt) + max_new_tokens
        blocks = -(-(total - 1) // bs)  # the last new token is never stored
        if blocks > self.config.num_blocks:
            raise ValueError(f"prompt_ids ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) needs "
                             f"{blocks} blocks of {bs} positions, more than the whole pool (num_blocks="
                             f"{self.config.num_blocks})")
        _check_sampling(temperature, top_k)
        if seed is not None:
            seed = check_int("seed", seed, minimum=0)
        if eos_id is not None and not 0 <= check_int("eos_id", eos_id, minimum=0) < V:
            raise ValueError(f"eos_id must lie in the vocabulary 0..{V - 1}, got {eos_id}")
        if isinstance(stop_token_ids, int) or isinstance(stop, str):
            raise TypeError("stop_token_ids and stop take a list (of token ids, of strings), not one value")
        stop_token_ids = tuple(check_int("stop_token_ids entry", t, minimum=0) for t in stop_token_ids)
        if any(t >= V for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in the vocabulary 0..{V - 1}, got {list(stop_token_ids)}")
        stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise TypeError(f"stop must be a list of non-empty strings, got {list(stop)!r}")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output: Engine(..., tokenizer=tok)")
        r = Request(self._next_id, prompt, max_new_tokens, float(temperature), top_k, seed, eos_id,
                    stop_token_ids, stop, arrival_step=self.clock, arrival_time=time.perf_counter(),
                    generator=torch.Generator().manual_seed(seed) if seed is not None else None)
        self._next_id += 1
        self.requests[r.id] = r
        self.waiting.append(r)  # the newest id: the list stays sorted
        return r.id

    def abort(self, request_id: int) -> bool:
        """Cancel a request between steps: its blocks (or its host copy) are freed at once, it keeps the
        tokens it has and ends with finish_reason "abort". False if it had already ended."""
        r = self.requests.get(request_id)
        if r is None:
            if isinstance(request_id, int) and 0 <= request_id < self._next_id:
                return False  # ended long ago (dropped from the log by max_finished)
            raise ValueError(f"abort: unknown request {request_id!r}")
        if r.state in ("finished", "aborted"):
            return False
        if r.state == "running":
            self.cache.free_sequence(r.id)
            self.running.remove(r)
        elif r.state == "swapped":
            self.swapped.remove(r)
            r.host = None
        else:
            self.waiting.remove(r)
        self._end(r, "aborted", "abort")
        self._aborted.append(r.id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def run(self) -> dict[int, list[int]]:
        """Step until every request has ended; {request id: generated token ids} of the requests kept."""
        while self.has_unfinished():
            ev = self.step()
            if not (ev["scheduled"] or ev["admitted"] or ev["swapped_in"] or ev["finished"]):
                raise RuntimeError(f"step {ev['step']} made no progress: {ev}")  # a scheduler bug, never a hang
        return {i: list(r.output) for i, r in self.requests.items()}

    def stream(self):
        """Step until every request has ended, yielding (request id, new token ids, finish_reason or None)
        for each request that got tokens in a step, as soon as that step is done, and (id, [], reason) for one
        that ended without a token (aborted between steps, or failed)."""
        while True:
            while self._aborted:
                yield self._aborted.pop(0), [], "abort"
            if not self.has_unfinished():
                return
            ev = self.step()
            reasons = ev["finish_reasons"]
            for rid, toks in ev["emitted"].items():
                yield rid, toks, reasons.get(rid)
            for rid, reason in reasons.items():
                if rid not in ev["emitted"]:
                    yield rid, [], reason
            if not (ev["scheduled"] or ev["admitted"] or ev["swapped_in"] or ev["finished"]):
                raise RuntimeError(f"step {ev['step']} made no progress: {ev}")

    def drop_prefix_cache(self) -> int:
        """Forget the cached blocks (those no running request holds), and empty the host and disk tiers;
        returns how many device blocks were dropped."""
        c = self.cache
        n = c.evict_cached(len(c.cached), demote=False)
        if c.tiers is not None:
            c.tiers.clear()
        return n

    def metrics(self, request_id: int) -> dict:
        """Times in steps (the logical clock) and seconds: queue, TTFT, TPOT; preemptions, cached tokens
        (in all, and by the tier they came from: device pool, host, disk); how it ended."""
        r = self.requests[request_id]
        n = len(r.output)
        done = r.finish_step is not None
        return dict(
            state=r.state, finish_reason=r.finish_reason, prompt_tokens=len(r.prompt), new_tokens=n,
            preemptions=r.preemptions, cached_tokens=r.cached_tokens,
            cached_tokens_device=r.cached_tokens - r.cached_tokens_host - r.cached_tokens_disk,
            cached_tokens_host=r.cached_tokens_host, cached_tokens_disk=r.cached_tokens_disk,
            queue_steps=None if r.admitted_step is None else r.admitted_step - r.arrival_step,
            ttft_steps=None if r.first_token_step is None else r.first_token_step - r.arrival_step + 1,
            tpot_steps=(r.finish_step - r.first_token_step) / (n - 1) if done and n > 1 and r.first_token_step
            is not None else None,
            ttft_s=None if r.first_token_time is None else r.first_token_time - r.arrival_time,
            tpot_s=(r.finish_time - r.first_token_time) / (n - 1) if done and n > 1 and r.first_token_time
            is not None else None)

    # ---- one scheduler iteration --------------------------------------------------------

    @torch.no_grad()
    def step(self) -> dict:
        """One iteration: admit, budget, find blocks (maybe preempting), compute, sample, commit.

        Returns the step's event, also appended to ``self.events``: ``step``; request ids
        ``admitted``, ``swapped_in``, ``preempted``, ``finished``; ``scheduled`` {id: tokens computed};
        ``emitted`` {id: [new token ids]}; ``finish_reasons`` {id: reason} of the requests that ended;
        ``prefill_tokens``, ``decode_tokens``, ``sampled`` (rows of the
        output head), ``forwards`` (0 or 1); after the step, counts ``running``, ``waiting``, ``swapped``,
        ``free_blocks`` (in the allocator), ``cached_blocks`` (kept for reuse); ``wall_s``; ``error``
        (the exception's text, if the step raised); with a host or disk tier also ``tiers``: this step's
        TIER_COUNTERS and the blocks held after it, ``host_blocks`` and ``disk_blocks``."""
        ev = dict(step=self.clock, admitted=[], swapped_in=[], preempted=[], finished=[], scheduled={},
                  emitted={}, finish_reasons={}, prefill_tokens=0, decode_tokens=0, sampled=0, forwards=0)
        self._aborted.clear()  # stream() has seen them
        before = self.tier_stats
        t0 = time.perf_counter()
        try:
            self._admit(ev)
            work = self._schedule(ev)
            if work:
                self._compute(work, ev)
        except BaseException as err:
            ev["error"] = f"{type(err).__name__}: {err}"
            raise
        finally:
            c = self.cache
            ev.update(running=len(self.running), waiting=len(self.waiting), swapped=len(self.swapped),
                      free_blocks=c.allocator.num_free, cached_blocks=len(c.cached),
                      wall_s=time.perf_counter() - t0)
            if c.tiers is not None:
                after = self.tier_stats
                ev["tiers"] = {k: after[k] - before[k] for k in TIER_COUNTERS}
                ev["tiers"].update(host_blocks=len(c.tiers.host), disk_blocks=len(c.tiers.disk))
            self.events.append(ev)
            self.clock += 1
        return ev

    def _admit(self, ev):
        c = self.cache
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            r = self.swapped[0]
            if not self._fits(r.host[0][0].shape[0] if r.host else 0):
                break
            c.swap_in(r.id, r.host, r.tokens[: r.computed])  # all-or-nothing
            self.swapped.pop(0)
            r.host, r.state = None, "running"
            bisect.insort(self.running, r, key=_by_id)
            ev["swapped_in"].append(r.id)
        if self.swapped:
            return  # requests in host memory come back before any new one gets in
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            r = self.waiting[0]
            tokens = r.tokens
            plan = c.plan_prefix(tokens)  # device pool, then host, then disk; changes nothing
            if not self._fits(c.plan_cost(plan, len(tokens))):
                break
            got = c.attach_prefix(r.id, plan)  # all-or-nothing; an unreadable tier copy is a miss
            self.waiting.pop(0)
            cached = c.lens[r.id]
            r.computed, r.state = cached, "running"
            r.cached_tokens += cached
            r.cached_tokens_host += got["host"]
            r.cached_tokens_disk += got["disk"]
            if r.admitted_step is None:
                r.admitted_step = self.clock
            bisect.insort(self.running, r, key=_by_id)
            ev["admitted"].append(r.id)

    def _fits(self, need: int) -> bool:
        """Admission: ``need`` blocks fit beside what the running requests still need for their pending
        tokens, leaving the watermark free; with nothing running they only have to fit."""
        avail = self.cache.num_available
        if not self.running:
            return need <= avail
        committed = sum(self.cache.blocks_needed(r.id, r.pending) for r in self.running)
        return need <= avail - committed - self.config.watermark_blocks

    def _schedule(self, ev) -> list:
        """Token budget and blocks for this step: [(request, tokens to compute)], oldest first."""
        c = self.cache
        budget = self.config.max_batched_tokens - sum(r.pending == 1 for r in self.running)
        plan = {}
        for r in self.running:  # oldest first
            if r.pending == 1:
                plan[r.id] = 1
            elif budget > 0:
                plan[r.id] = min(r.pending, budget)
                budget -= plan[r.id]
        promised = 0  # blocks this step's earlier (older) requests will take
        for r in list(self.running):
            if r.state != "running" or r.id not in plan:  # preempted by an older one just now
                continue
            n = plan[r.id]
            while c.blocks_needed(r.id, n) > c.num_available - promised:
                if self.running[-1] is not r:
                    self._preempt(self.running[-1], ev)  # the newest gives way
                elif r.pending > 1 and n > 0:
                    n = min(n - 1, c.tokens_that_fit(r.id, c.num_available - promised))  # the chunk shrinks to fit
                else:
                    self._preempt(r, ev)  # a decode with no room, and no newer request to take it from
                    break
            if r.state == "running":
                plan[r.id] = n
                promised += c.blocks_needed(r.id, n)
        work = [(r, plan[r.id]) for r in self.running if plan.get(r.id)]
        ev["scheduled"] = {r.id: n for r, n in work}
        ev["prefill_tokens"] = sum(n for r, n in work if r.pending > 1)
        ev["decode_tokens"] = sum(1 for r, n in work if r.pending == 1)
        return work

    def _compute(self, work, ev):
        """Compute first: one forward over every scheduled token, the samples, the stop decisions. Commit
        after: only when all of that succeeded do sequences, requests and generators move on."""
        c, dev = self.cache, self.model.device
        chunks = [r.tokens[r.computed: r.computed + n] for r, n in work]
        samplers, rows, end = [], [], 0  # requests that draw a token this step, and their rows
        for (r, n), chunk in zip(work, chunks):
            end += n
            if r.computed + n == len(r.tokens):
                samplers.append(r)
                rows.append(end - 1)
        states = [(r, r.generator.get_state()) for r in samplers if r.generator is not None]
        view = None
        try:
            view = c.ragged([r.id for r, _ in work], chunks)  # reserves the slots, all-or-nothing
            ids = torch.tensor([[t for chunk in chunks for t in chunk]], device=dev)  # (1, N)
            self.forwards += 1
            ev["forwards"] = 1
            logits = self.model(ids, positions=view.positions, cache=view,
                                logits_index=torch.tensor(rows, dtype=torch.long, device=dev))[0]  # (len(rows), V)
            new, failed = self._sample(samplers, logits)
            decisions = [self._decide(r, token) for r, token in zip(samplers, new)]  # may decode (stop strings)
        except BaseException:
            if view is not None:
                view.rollback()  # the reserved blocks go back; no request moved
            for r, state in states:
                r.generator.set_state(state)  # a retried step draws the same numbers
            raise
        view.commit()
        for r, n in work:
            r.computed += n
        ev["sampled"] = len(samplers)
        for r, token, (reason, text) in zip(samplers, new, decisions):
            if r.id in failed:
                self._finish(r, ev, "error")
            else:
                r.sample_failures = 0
                self._emit(r, token, reason, text, ev)

    def _sample(self, samplers, logits):
        """One token per sampling request from its row of logits: the greedy ones in one argmax. Returns
        (tokens, failed): a request whose draw raises MAX_SAMPLE_FAILURES steps in a row is in ``failed``
        (token None); before that its error is raised (the step rolls back and is retried)."""
        out, failed = [None] * len(samplers), {}
        greedy = [i for i, r in enumerate(samplers) if r.temperature == 0.0]
        if greedy:
            for i, t in zip(greedy, logits[greedy].argmax(-1).tolist()):
                out[i] = t
        for i, r in enumerate(samplers):
            if r.temperature != 0.0:
                try:
                    out[i] = int(sample_next(logits[i: i + 1], r.temperature, r.top_k, r.generator)[0])
                except Exception as err:
                    r.sample_failures += 1
                    if r.sample_failures < MAX_SAMPLE_FAILURES:
                        raise
                    failed[r.id] = r.error = f"{type(err).__name__}: {err}"
        return out, failed

    def _decide(self, r, token):
        """(finish reason or None, text cut before a stop string or None) if r draws ``token``: no state changes."""
        if token is None:
            return None, None
        if token == r.eos_id or token in r.stop_token_ids:
            return "stop", None
        if r.stop:
            text = self.tokenizer.decode(r.output + [token])
            cut = min((i for i in (text.find(s) for s in r.stop) if i >= 0), default=-1)
            if cut >= 0:
                return "stop", text[:cut]
        return ("length" if len(r.output) + 1 == r.max_new_tokens else None), None

    def _emit(self, r, token: int, reason, text, ev):
        """Append r's new token (committed); end r if ``_decide`` said so."""
        r.output.append(token)
        ev["emitted"].setdefault(r.id, []).append(token)
        if r.first_token_step is None:
            r.first_token_step, r.first_token_time = self.clock, time.perf_counter()
        if text is not None:
            r.text = text
        if reason is not None:
            self._finish(r, ev, reason)

    def _finish(self, r, ev, reason):
        self.running.remove(r)
        self.cache.free_sequence(r.id)  # its blocks go back at once (full ones stay findable)
        self._end(r, "finished", reason)
        ev["finished"].append(r.id)
        ev["finish_reasons"][r.id] = reason

    def _end(self, r, state: str, reason: str):
        r.state, r.finish_reason = state, reason
        r.finish_step, r.finish_time = self.clock, time.perf_counter()
        if r.stop and r.text is None and self.tokenizer is not None:
            r.text = self.tokenizer.decode(r.output)
        self._finished.append(r.id)
        while len(self._finished) > self.config.max_finished:  # bounded: the oldest ended requests go
            self.requests.pop(self._finished.popleft(), None)

    # ---- preemption --------------------------------------------------------------------

    def _preempt(self, r, ev):
        if self.config.preemption == "swap":
            r.host = self.cache.swap_out(r.id)  # copies first, then the blocks are freed
            self.running.remove(r)
            r.state = "swapped"
            bisect.insort(self.swapped, r, key=_by_id)
        else:
            self.cache.free_sequence(r.id)  # its full blocks stay cached: its re-admission finds them
            self.running.remove(r)
            r.state, r.computed = "waiting", 0
            bisect.insort(self.waiting, r, key=_by_id)
        r.preemptions += 1
        ev["preempted"].append(r.id)
