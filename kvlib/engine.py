"""Serving many requests at once (chapter 08): an iteration-level scheduler on the paged cache.

What you will learn:
- iteration-level (continuous) batching: the scheduler decides again at *every* step which
  requests run, so a finished request's blocks go to a waiting one at once instead of the whole
  batch waiting for its longest member (static batching);
- watermark admission: a waiting request gets in only if its blocks fit and a reserve of free
  blocks (the watermark) is left for the running requests to grow into;
- chunked prefill: a long prompt is fed in pieces, so that no step computes more than
  ``max_batched_tokens`` tokens and the running requests keep decoding meanwhile;
- preemption when blocks run out: the newest request gives its blocks up, by *recompute* (drop
  them; prefill prompt + generated tokens again later) or by *swap* (copy them to host memory and
  back later): compute against copy bandwidth;
- prefix caching across requests: a finished request leaves its full blocks in the pool, found
  again by chapter 05's chained block hashes, so a request with the same prefix (a system prompt,
  a shared document) skips that part of its prefill. Even when the whole prompt is cached, its last
  token is computed: its logits give the first new token;
- a tiered prefix store (off by default: ``host_blocks``, ``disk_dir``, ``disk_blocks``): a cached
  block evicted from the device pool moves, with its chained hash and its tokens, to host memory
  (least recently used out first, pinned on a GPU), from there to disk (one safetensors file per
  block), and comes back to the device when a later prompt's lookup reaches it.

The rules of one ``step()`` (time is the step counter; "free" counts the blocks no one holds plus
the cached blocks of finished requests, which are evicted, least recently used first, when needed):
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
3. Blocks, oldest first: if a request's tokens need more blocks than are free, the newest running
   request is preempted (recompute or swap), repeatedly; when no newer one is left, a prefill
   chunk shrinks to what fits (maybe to nothing) and a decoding request preempts itself.
4. Compute: one forward per prefill chunk (the paged cache's prefill path is batch-1), then one
   batched forward over all decoding requests (ragged lengths). A request that has computed all
   its tokens samples the next one with its own generator; it finishes on ``eos_id`` or after
   ``max_new_tokens`` and frees its blocks at once.
A forward that raises (even KeyboardInterrupt) takes its requests back to waiting with no blocks,
so the engine stays consistent and the next ``step()`` carries on.

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
"""

from __future__ import annotations

import bisect
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .cache import check_int
from .generate import _check_sampling, check_prompt_fits, sample_next
from .paged import PagedKVCache, chained_block_hashes

__all__ = ["Engine", "EngineConfig", "Request", "TIER_COUNTERS"]

# What the tiered prefix store counts (Engine.tier_stats, and per step in event["tiers"]): blocks
# found in the host / disk tier, blocks moved down (device -> host, host -> disk) or dropped off the
# end, and the bytes each move copied.
TIER_COUNTERS = ("host_hits", "disk_hits", "to_host", "to_disk", "dropped",
                 "bytes_to_host", "bytes_to_disk", "bytes_from_host", "bytes_from_disk")


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

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_batched_tokens"):
            setattr(self, name, check_int(name, getattr(self, name)))
        for name in ("host_blocks", "disk_blocks"):
            setattr(self, name, check_int(name, getattr(self, name), minimum=0))
        if self.disk_dir is not None:
            self.disk_dir = os.fspath(self.disk_dir)
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
    output: list[int] = field(default_factory=list)  # generated token ids
    state: str = "waiting"  # "waiting" | "running" | "swapped" | "finished"
    computed: int = 0  # tokens of prompt + output whose K/V are in the cache (or in `host`)
    generator: torch.Generator | None = None  # this request's own sampling generator (from seed)
    host: list | None = None  # swapped-out K/V: per layer (k, v), each (n_blocks, block_size, H_KV, D)
    preemptions: int = 0
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


class Engine:
    """Continuous batching over one PagedKVCache; see the module docstring for the rules.

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
    >>> len(out[0]), engine.metrics(0)["ttft_steps"]  # its first token came in its first step
    (2, 1)
    >>> engine.cache.allocator.num_free, len(engine.retained)  # 3 + 1 positions filled a block: kept for reuse
    (3, 1)
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16, *, max_num_seqs: int = 8,
                 max_batched_tokens: int = 64, preemption: str = "recompute", watermark: float = 0.01,
                 prefix_caching: bool = True, kernels: str | None = None, host_blocks: int = 0,
                 disk_dir: str | None = None, disk_blocks: int = 0):
        self.config = EngineConfig(num_blocks, block_size, max_num_seqs, max_batched_tokens, preemption,
                                   watermark, prefix_caching, host_blocks, disk_dir, disk_blocks)
        self.model = model
        self.cache = PagedKVCache.for_model(model, num_blocks, block_size, kernels=kernels,
                                            prefix_caching=prefix_caching)
        self.requests: dict[int, Request] = {}  # every request ever added, by id (= arrival order)
        self.waiting: list[Request] = []  # sorted by id
        self.swapped: list[Request] = []  # sorted by id
        self.running: list[Request] = []  # sorted by id
        self.retained: OrderedDict = OrderedDict()  # block id -> its tokens: finished requests' blocks (LRU first)
        self.host: OrderedDict = OrderedDict()  # host tier: hash -> (tokens, k, v), k/v (n_layers, block_size, H_KV, D)
        self.disk: OrderedDict = OrderedDict()  # disk tier: hash -> tokens, the K/V in the block's file (oldest first)
        self.tier_stats = dict.fromkeys(TIER_COUNTERS, 0)  # totals since the start (see TIER_COUNTERS)
        if self.config.disk_dir is not None:
            os.makedirs(self.config.disk_dir, exist_ok=True)
        self.clock = 0  # steps taken
        self.events: list[dict] = []  # one dict per step (see step())

    # ---- requests -----------------------------------------------------------------------

    def add_request(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, *, top_k: int | None = None,
                    seed: int | None = None, eos_id: int | None = None) -> int:
        """Queue a request; returns its id. Refuses (ValueError/TypeError, nothing queued) what could
        never be served: past the model's context, or more blocks than the whole pool."""
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
        r = Request(len(self.requests), prompt, max_new_tokens, float(temperature), top_k, seed, eos_id,
                    arrival_step=self.clock, arrival_time=time.perf_counter(),
                    generator=torch.Generator().manual_seed(seed) if seed is not None else None)
        self.requests[r.id] = r
        self.waiting.append(r)  # the newest id: the list stays sorted
        return r.id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def run(self) -> dict[int, list[int]]:
        """Step until every request has finished; {request id: generated token ids}."""
        while self.has_unfinished():
            ev = self.step()
            if not (ev["scheduled"] or ev["admitted"] or ev["swapped_in"] or ev["finished"]):
                raise RuntimeError(f"step {ev['step']} made no progress: {ev}")  # a scheduler bug, never a hang
        return {i: list(r.output) for i, r in self.requests.items()}

    def drop_prefix_cache(self) -> int:
        """Forget the blocks kept for finished requests (those no running request shares), and empty the
        host and disk tiers; returns how many device blocks were dropped."""
        n = len(self._evictable())
        self._evict(-n, demote=False)
        self.host.clear()
        while self.disk:
            os.remove(self._block_file(self.disk.popitem()[0]))
        return n

    def metrics(self, request_id: int) -> dict:
        """Times in steps (the logical clock) and seconds: queue, TTFT, TPOT; preemptions, cached tokens
        (in all, and by the tier they came from: device pool, host, disk)."""
        r = self.requests[request_id]
        n = len(r.output)
        done = r.finish_step is not None
        return dict(
            state=r.state, prompt_tokens=len(r.prompt), new_tokens=n, preemptions=r.preemptions,
            cached_tokens=r.cached_tokens,
            cached_tokens_device=r.cached_tokens - r.cached_tokens_host - r.cached_tokens_disk,
            cached_tokens_host=r.cached_tokens_host, cached_tokens_disk=r.cached_tokens_disk,
            queue_steps=None if r.admitted_step is None else r.admitted_step - r.arrival_step,
            ttft_steps=None if r.first_token_step is None else r.first_token_step - r.arrival_step + 1,
            tpot_steps=(r.finish_step - r.first_token_step) / (n - 1) if done and n > 1 else None,
            ttft_s=None if r.first_token_time is None else r.first_token_time - r.arrival_time,
            tpot_s=(r.finish_time - r.first_token_time) / (n - 1) if done and n > 1 else None)

    # ---- one scheduler iteration --------------------------------------------------------

    @torch.no_grad()
    def step(self) -> dict:
        """One iteration: admit, budget, find blocks (maybe preempting), compute, sample.

        Returns the step's event, also appended to ``self.events``: ``step``; request ids
        ``admitted``, ``swapped_in``, ``preempted``, ``finished``; ``scheduled`` {id: tokens computed};
        ``prefill_tokens``, ``decode_tokens``; after the step, counts ``running``, ``waiting``,
        ``swapped``, ``free_blocks`` (in the allocator), ``cached_blocks`` (kept for finished
        requests); ``wall_s``; with a host or disk tier also ``tiers``: this step's TIER_COUNTERS and the
        blocks held after it, ``host_blocks`` and ``disk_blocks``."""
        ev = dict(step=self.clock, admitted=[], swapped_in=[], preempted=[], finished=[], scheduled={},
                  prefill_tokens=0, decode_tokens=0)
        before = dict(self.tier_stats)
        t0 = time.perf_counter()
        try:
            self._admit(ev)
            prefills, decodes = self._schedule(ev)
            for r, n in prefills:  # batch-1 prefill chunks
                chunk = r.tokens[r.computed: r.computed + n]
                positions = torch.arange(r.computed, r.computed + n, device=self.model.device)[None]  # (1, n)
                logits = self._forward([r], torch.tensor([chunk], device=self.model.device), positions, [chunk])
                r.computed += n
                if r.pending == 0:
                    self._emit(r, logits[:, -1], ev)  # (1, V)
            if decodes:  # one batched decode forward, ragged lengths
                last = [[r.tokens[-1]] for r in decodes]
                ids = torch.tensor(last, device=self.model.device)  # (B, 1)
                positions = torch.tensor([[r.computed] for r in decodes], device=self.model.device)  # (B, 1)
                logits = self._forward(decodes, ids, positions, last)[:, -1]  # (B, V)
                for i, r in enumerate(decodes):
                    r.computed += 1
                    self._emit(r, logits[i: i + 1], ev)
        finally:
            ev.update(running=len(self.running), waiting=len(self.waiting), swapped=len(self.swapped),
                      free_blocks=self.cache.allocator.num_free, cached_blocks=len(self.retained),
                      wall_s=time.perf_counter() - t0)
            if self.config.tiered:
                ev["tiers"] = {k: self.tier_stats[k] - before[k] for k in TIER_COUNTERS}
                ev["tiers"].update(host_blocks=len(self.host), disk_blocks=len(self.disk))
            self.events.append(ev)
            self.clock += 1
        return ev

    def _admit(self, ev):
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            r = self.swapped[0]
            if not self._fits(r.host[0][0].shape[0]):
                break
            self._swap_in(self.swapped.pop(0))
            ev["swapped_in"].append(r.id)
        if self.swapped:
            return  # requests in host memory come back before any new one gets in
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            r = self.waiting[0]
            cached = self.cache.add_sequence(r.id, r.tokens)  # shares the cached prefix blocks
            table = self.cache.tables[r.id]
            plan = self._tier_lookup(r) if self.config.tiered else []  # the lookup goes on in host, disk
            shared = len(table) + sum(tier == "device" for tier, *_ in plan)
            if not self._fits(-(-len(r.tokens) // self.config.block_size) - shared):  # tier hits need blocks
                for tier, b, *_ in plan:
                    if tier == "device":
                        self.cache.release_block(b)
                self.cache.free_sequence(r.id)  # undo: drops the shared references again
                break
            if plan:
                self._tier_fetch(r, plan)
                cached = self.cache.lens[r.id]
            for b in table:
                if b in self.retained:
                    self.retained.move_to_end(b)  # recently used
            self.waiting.pop(0)
            r.computed, r.state = cached, "running"
            r.cached_tokens += cached
            if r.admitted_step is None:
                r.admitted_step = self.clock
            bisect.insort(self.running, r, key=lambda x: x.id)
            ev["admitted"].append(r.id)

    def _schedule(self, ev):
        """Token budget and blocks for this step: ([(request, chunk)], [decoding requests])."""
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
            while self.cache.blocks_needed(r.id, n) > self._available() - promised:
                if self.running[-1] is not r:
                    self._preempt(self.running[-1], ev)  # the newest gives way
                elif r.pending > 1 and n > 0:
                    n -= 1  # a prefill chunk shrinks to what fits
                else:
                    self._preempt(r, ev)  # a decode with no room, and no newer request to take it from
                    break
            if r.state == "running":
                plan[r.id] = n
                promised += self.cache.blocks_needed(r.id, n)
        self._evict(self.cache.allocator.num_free - promised)
        prefills = [(r, plan[r.id]) for r in self.running if plan.get(r.id) and r.pending > 1]
        decodes = [r for r in self.running if plan.get(r.id) and r.pending == 1]
        ev["scheduled"] = {r.id: plan[r.id] for r in self.running if plan.get(r.id)}
        ev["prefill_tokens"] = sum(n for _, n in prefills)
        ev["decode_tokens"] = len(decodes)
        return prefills, decodes

    def _forward(self, reqs, ids, positions, new_tokens):
        try:
            return self.model(ids, positions=positions, cache=self.cache.batch([r.id for r in reqs], new_tokens))
        except BaseException:  # e.g. KeyboardInterrupt mid-forward: no half-written sequence stays
            for r in reqs:
                if r.state == "running":
                    self.cache.free_sequence(r.id)
                    self._to_waiting(r)
            raise

    def _emit(self, r, logits, ev):
        """Sample r's next token from logits (1, V); finish r on eos or max_new_tokens."""
        token = int(sample_next(logits, r.temperature, r.top_k, r.generator)[0])
        r.output.append(token)
        if r.first_token_step is None:
            r.first_token_step, r.first_token_time = self.clock, time.perf_counter()
        if len(r.output) == r.max_new_tokens or token == r.eos_id:
            r.state, r.finish_step, r.finish_time = "finished", self.clock, time.perf_counter()
            self.running.remove(r)
            self._retain(r.id)
            self.cache.free_sequence(r.id)  # its blocks go back at once (cached ones stay findable)
            ev["finished"].append(r.id)

    # ---- blocks: free, retained (prefix cache), preempted --------------------------------

    def _evictable(self) -> list[int]:
        return [b for b in self.retained if self.cache.allocator.refcount[b] == 1]  # only we hold it

    def _available(self) -> int:
        return self.cache.allocator.num_free + len(self._evictable())

    def _fits(self, need: int) -> bool:
        """Admission: ``need`` blocks fit beside what the running requests still need for their pending
        tokens, leaving the watermark free; with nothing running they only have to fit."""
        avail = self._available()
        if not self.running:
            return need <= avail
        committed = sum(self.cache.blocks_needed(r.id, r.pending) for r in self.running)
        return need <= avail - committed - self.config.watermark_blocks

    def _retain(self, seq_id):
        """Keep one reference to each of seq_id's full, findable blocks, so later requests hit them."""
        c, bs = self.cache, self.config.block_size
        table, tokens = c.tables[seq_id], c.tokens[seq_id]
        for i in reversed(range(len(table))):  # the first block ends most recently used: evicted last
            b, h = table[i], c.block_hash.get(table[i])
            if h is not None and c.hash_to_block.get(h) == b:
                if b not in self.retained:
                    c.allocator.share(b)
                    self.retained[b] = tuple(tokens[i * bs: (i + 1) * bs])
                self.retained.move_to_end(b)

    def _evict(self, surplus: int, demote: bool = True):
        """Drop retained blocks (least recently used first) until ``surplus`` (free - needed) >= 0;
        with a host or disk tier (and ``demote``) each goes there first."""
        c = self.cache
        for b in self._evictable():
            if surplus >= 0:
                break
            tokens = self.retained.pop(b)
            if demote and self.config.tiered:
                self._demote(b, tokens)
            c.release_block(b)  # its last reference: back to the pool, its hash forgotten
            surplus += 1

    def _preempt(self, r, ev):
        r.preemptions += 1
        ev["preempted"].append(r.id)
        if self.config.preemption == "swap":
            c, table = self.cache, self.cache.tables[r.id]
            idx = torch.tensor(table, dtype=torch.long, device=c.device)
            pin = torch.device(c.device).type == "cuda"  # pinned host memory copies fast, asynchronously
            r.host = []
            for k, v in zip(c.k, c.v):
                pair = []
                for pool in (k, v):
                    host = torch.empty((len(table),) + pool.shape[1:], dtype=pool.dtype, pin_memory=pin)
                    pair.append(host.copy_(pool[idx]))  # (n_blocks, block_size, H_KV, D)
                r.host.append(tuple(pair))
            c.free_sequence(r.id)
            self.running.remove(r)
            r.state = "swapped"
            bisect.insort(self.swapped, r, key=lambda x: x.id)
        else:
            self.cache.free_sequence(r.id)
            self._to_waiting(r)

    def _to_waiting(self, r):
        """Back to the queue with no blocks: everything computed so far is computed again."""
        self.running.remove(r)
        r.state, r.computed = "waiting", 0
        bisect.insort(self.waiting, r, key=lambda x: x.id)

    def _swap_in(self, r):
        c, n = self.cache, r.host[0][0].shape[0]
        self._evict(c.allocator.num_free - n)
        blocks = c.allocator.allocate(n)
        idx = torch.tensor(blocks, dtype=torch.long, device=c.device)
        for (hk, hv), k, v in zip(r.host, c.k, c.v):
            k[idx] = hk.to(c.device, non_blocking=True)
            v[idx] = hv.to(c.device, non_blocking=True)
        c.add_sequence(r.id)  # no prompt: no prefix lookup; the blocks get their hashes at the next forward
        c.tables[r.id], c.lens[r.id], c.tokens[r.id] = blocks, r.computed, r.tokens[: r.computed]
        r.host, r.state = None, "running"
        bisect.insort(self.running, r, key=lambda x: x.id)

    # ---- the tiered prefix store: host memory, then disk --------------------------------

    def _block_file(self, h: int) -> str:
        return os.path.join(self.config.disk_dir, f"block_{h & (2**64 - 1):016x}.safetensors")

    def _demote(self, b: int, tokens: tuple):
        """Copy device block b's K/V (every layer) into the host tier, under its chained hash."""
        c = self.cache
        pin = torch.device(c.device).type == "cuda"  # pinned host memory copies fast, asynchronously
        shape = (len(c.k),) + c.k[0].shape[1:]  # (n_layers, block_size, H_KV, D)
        k, v = (torch.empty(shape, dtype=c.k[0].dtype, pin_memory=pin) for _ in range(2))
        for layer, (pool_k, pool_v) in enumerate(zip(c.k, c.v)):
            k[layer].copy_(pool_k[b])
            v[layer].copy_(pool_v[b])
        h = c.block_hash[b]
        if self.disk.pop(h, None) is not None:  # one copy below the device pool at most
            os.remove(self._block_file(h))
        self.tier_stats["to_host"] += 1
        self.tier_stats["bytes_to_host"] += k.nbytes + v.nbytes
        self.host[h] = (tokens, k, v)
        self.host.move_to_end(h)
        while len(self.host) > self.config.host_blocks:  # the least recently used goes down to disk
            h_old, (tokens_old, k_old, v_old) = self.host.popitem(last=False)
            self._to_disk(h_old, tokens_old, k_old, v_old)

    def _to_disk(self, h: int, tokens: tuple, k, v):
        if not self.config.disk_blocks:
            self.tier_stats["dropped"] += 1
            return
        save_file({"k": k.contiguous(), "v": v.contiguous()}, self._block_file(h),
                  metadata={"hash": str(h), "tokens": ",".join(map(str, tokens))})  # safetensors: no pickle
        self.tier_stats["to_disk"] += 1
        self.tier_stats["bytes_to_disk"] += k.nbytes + v.nbytes
        self.disk[h] = tokens
        while len(self.disk) > self.config.disk_blocks:  # the oldest file is deleted
            os.remove(self._block_file(self.disk.popitem(last=False)[0]))
            self.tier_stats["dropped"] += 1

    def _read_disk(self, h: int):
        """Take block h out of the disk tier: (k, v) on the CPU; its file is deleted."""
        path = self._block_file(h)
        with safe_open(path, framework="pt") as f:
            meta, k, v = f.metadata(), f.get_tensor("k"), f.get_tensor("v")
        if meta.get("hash") != str(h) or meta.get("tokens") != ",".join(map(str, self.disk[h])):
            raise RuntimeError(f"{path} does not hold the block the disk tier expects (hash {h})")
        del self.disk[h]
        os.remove(path)
        return k, v

    def _tier_lookup(self, r) -> list:
        """Go on with r's prefix lookup past the device pool's first miss, block by block on the chained
        hashes: the device pool again (a block after a host hit may still be there), host, disk. Returns
        [(tier, device block or None, hash, tokens)] in block order; device blocks found are shared at
        once (no eviction can take them) and are freed again if r is not admitted."""
        c, bs, tokens = self.cache, self.config.block_size, r.tokens
        hashes = chained_block_hashes(tokens, bs, (len(tokens) - 1) // bs)  # the last prompt token is computed
        plan = []
        for i in range(len(c.tables[r.id]), len(hashes)):  # past the blocks add_sequence shared
            block_tokens, h = tuple(tokens[i * bs: (i + 1) * bs]), hashes[i]
            if h in c.hash_to_block:
                b = c.hash_to_block[h]
                c.allocator.share(b)
                plan.append(("device", b, h, block_tokens))
            elif h in self.host and self.host[h][0] == block_tokens:
                plan.append(("host", None, h, block_tokens))
            elif self.disk.get(h) == block_tokens:
                plan.append(("disk", None, h, block_tokens))
            else:
                break
        return plan

    def _tier_fetch(self, r, plan):
        """Admit r's tier hits: take them out of host and disk, give each a device block (evicting,
        maybe demoting, retained ones), copy the K/V in and register the hash as the prefix cache does."""
        c, bs = self.cache, self.config.block_size
        fetched = {}
        try:  # first out of their tiers, so that the demotions below cannot push them out
            for tier, _, h, _ in plan:
                if tier == "disk":
                    fetched[h] = self._read_disk(h)
            for tier, _, h, _ in plan:
                if tier == "host":
                    fetched[h] = self.host.pop(h)[1:]
        except BaseException:  # e.g. an unreadable block file: r stays waiting, holding nothing
            for tier, b, *_ in plan:
                if tier == "device":
                    c.release_block(b)
            c.free_sequence(r.id)
            raise
        for tier, _, h, _ in plan:
            if tier != "device":
                self.tier_stats[f"{tier}_hits"] += 1
                self.tier_stats[f"bytes_from_{tier}"] += sum(t.nbytes for t in fetched[h])
        self._evict(c.allocator.num_free - len(fetched))
        fresh = c.allocator.allocate(len(fetched))
        for tier, b, h, block_tokens in plan:
            if tier != "device":
                b, (k, v) = fresh.pop(0), fetched[h]
                for layer, (pool_k, pool_v) in enumerate(zip(c.k, c.v)):
                    pool_k[b].copy_(k[layer], non_blocking=k.is_pinned())
                    pool_v[b].copy_(v[layer], non_blocking=v.is_pinned())
                c.block_hash[b] = h
                c.hash_to_block[h] = b
                if tier == "host":
                    r.cached_tokens_host += bs
                else:
                    r.cached_tokens_disk += bs
            c.tables[r.id].append(b)
            c.tokens[r.id] += list(block_tokens)
            c.lens[r.id] += bs
