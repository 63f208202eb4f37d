"""Routing by cached prefix (chapter 12b): send a request to the replica that already holds its prefix.

What you will learn:
- a serving deployment runs several engine *replicas*; each has its own prefix cache (chapter 08b), so a document
  computed on replica 0 is a hit only for the requests that go to replica 0;
- the replicas report *KV events* (vLLM's ``--kv-events-config`` publishes ``BlockStored`` / ``BlockRemoved``):
  here ``Replica.events()`` diffs the chained block hashes its paged cache holds since the last call, so the
  router's index is what the engines really store, one step late, as a published event stream is;
- the router's score of a replica for a prompt is the length of the longest run of the prompt's chained block
  hashes, from the first block, that the replica holds (``prefix_score``): because block i's hash chains every
  block before it, a hash found past a miss would be a different prefix's block, never a usable hit;
- round-robin ignores the caches and spreads the load; the prefix score concentrates each document on one
  replica, and a popular document would pile every request on one replica: the load-aware fallback
  (``max_load``) sends a request elsewhere when its best replica already has that many requests
  (llm-d's scheduler and NVIDIA Dynamo's KV router weigh a prefix score against load in the same spirit).

Simplification (named where results are shown): the replicas are ``Engine`` objects in one process, stepped in
lockstep, one tick each per step, so TTFT is counted in engine steps; hit rates and prefill tokens come from the
engines' own prefix caches.
"""

from __future__ import annotations

import random

from ..cache import check_int
from ..engine import Engine
from ..paged import chained_block_hashes

__all__ = ["Replica", "Router", "prefix_score", "rag_trace", "documents", "simulate", "POLICIES"]

POLICIES = ("round_robin", "prefix")


def prefix_score(hashes, held) -> int:
    """How many of ``hashes`` (a prompt's chained block hashes, in order) ``held`` holds as one run from the first.

    >>> prefix_score([11, 12, 13], {11, 13})  # 13 past the miss is another prefix's block
    1
    """
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class Replica:
    """One engine replica and the KV events it reports: ("stored", hash) and ("removed", hash) since the last call."""

    def __init__(self, name: str, engine: Engine):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be a kvlib.engine.Engine, got {type(engine).__name__}")
        self.name, self.engine = name, engine
        self._reported: set = set()

    def events(self) -> list:
        """The blocks stored and removed since the last call, read from the paged cache's hash index (running
        sequences' full blocks and the cached ones alike)."""
        now = set(self.engine.cache.hash_to_block)
        ev = [("stored", h) for h in now - self._reported] + [("removed", h) for h in self._reported - now]
        self._reported = now
        return ev

    @property
    def load(self) -> int:
        """Requests this replica holds: running, waiting, swapped."""
        e = self.engine
        return len(e.running) + len(e.waiting) + len(e.swapped)


class Router:
    """Picks a replica for each request. ``policy``: "round_robin" or "prefix" (longest held run of block hashes;
    ties go to the least loaded, then the lowest index). ``max_load``: with "prefix", a replica holding that many
    requests is passed over while another is below it (the load-aware fallback); None: never."""

    def __init__(self, n_replicas: int, block_size: int, policy: str = "prefix", max_load: int | None = None):
        self.n = check_int("n_replicas", n_replicas)
        self.block_size = check_int("block_size", block_size)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.max_load = None if max_load is None else check_int("max_load", max_load)
        self.index = [set() for _ in range(self.n)]  # replica -> block hashes it reported stored
        self._next = 0
        self.fallbacks = 0  # requests the load-aware fallback moved off their best-scoring replica

    def apply(self, replica: int, events) -> None:
        """Update the index from one replica's KV events."""
        held = self.index[replica]
        for kind, h in events:
            if kind == "stored":
                held.add(h)
            elif kind == "removed":
                held.discard(h)
            else:
                raise ValueError(f"unknown KV event kind {kind!r} (expected 'stored' or 'removed')")

    def hashes(self, prompt) -> list:
        """The prompt's chained block hashes, as the engines compute them (the last token is never cached)."""
        return chained_block_hashes(list(prompt), self.block_size, (len(prompt) - 1) // self.block_size)

    def scores(self, prompt) -> list[int]:
        hs = self.hashes(prompt)
        return [prefix_score(hs, held) for held in self.index]

    def route(self, prompt, loads) -> int:
        """The replica for ``prompt``; ``loads``: each replica's current load (requests held)."""
        loads = list(loads)
        if len(loads) != self.n:
            raise ValueError(f"loads must give one number per replica ({self.n}), got {loads!r}")
        if self.policy == "round_robin":
            i, self._next = self._next, (self._next + 1) % self.n
            return i
        scores = self.scores(prompt)
        order = sorted(range(self.n), key=lambda i: (-scores[i], loads[i], i))
        if self.max_load is not None and loads[order[0]] >= self.max_load:
            below = [i for i in order if loads[i] < self.max_load]
            pick = below[0] if below else min(range(self.n), key=lambda i: (loads[i], i))
            self.fallbacks += pick != order[0]
            return pick
        return order[0]


def rag_trace(n_requests=48, n_docs=6, doc_len=96, question_len=8, max_new=6, every=1, zipf=1.0, seed=0,
              vocab=256):
    """A RAG-like trace: [{arrival, doc, prompt, max_new}]; each prompt is one of ``n_docs`` documents (popularity
    ~ 1 / rank**zipf) followed by its own question; a request arrives every ``every`` ticks."""
    rng = random.Random(seed)
    docs = [[rng.randrange(vocab) for _ in range(doc_len)] for _ in range(n_docs)]
    weights = [1 / (r + 1) ** zipf for r in range(n_docs)]
    trace = []
    for i in range(n_requests):
        d = rng.choices(range(n_docs), weights)[0]
        question = [rng.randrange(vocab) for _ in range(question_len)]
        trace.append(dict(arrival=i * every, doc=d, prompt=docs[d] + question, max_new=max_new))
    return trace


def documents(trace, doc_len: int) -> dict:
    """{document number: its tokens} for the documents ``trace`` uses, in number order."""
    return {d: next(r["prompt"][:doc_len] for r in trace if r["doc"] == d) for d in sorted({r["doc"] for r in trace})}


def simulate(model, trace, policy="prefix", n_replicas=2, max_load=None, **engine_kw) -> dict:
    """Serve ``trace`` with ``n_replicas`` engines behind a Router; every replica steps once per tick.

    Returns {"replica": per request, "cached": cached tokens per request, "ttft": TTFT in steps per request,
    "outputs", "engines", "router", "per_replica": [{requests, prompt tokens, cached tokens, prefill computed}]}."""
    if not trace:
        raise ValueError("trace must hold at least one request")
    reps = [Replica(f"replica {i}", Engine(model, **engine_kw)) for i in range(n_replicas)]
    router = Router(n_replicas, reps[0].engine.config.block_size, policy, max_load)
    pending = sorted(range(len(trace)), key=lambda i: trace[i]["arrival"])
    where, ids, tick = [None] * len(trace), [None] * len(trace), 0
    while pending or any(r.engine.has_unfinished() for r in reps):
        while pending and trace[pending[0]]["arrival"] <= tick:
            i = pending.pop(0)
            k = router.route(trace[i]["prompt"], [r.load for r in reps])
            where[i], ids[i] = k, reps[k].engine.add_request(trace[i]["prompt"], trace[i]["max_new"])
        for k, r in enumerate(reps):
            r.engine.step()  # an idle replica's step does nothing but keeps the clocks equal
            router.apply(k, r.events())
        tick += 1
        if tick > 100_000:
            raise RuntimeError("simulate: no end after 100000 ticks")
    ms = [reps[k].engine.metrics(ids[i]) for i, k in enumerate(where)]
    outs = [reps[k].engine.requests[ids[i]].output for i, k in enumerate(where)]
    per = []
    for k in range(n_replicas):
        mine = [i for i, w in enumerate(where) if w == k]
        per.append({"requests": len(mine), "prompt tokens": sum(len(trace[i]["prompt"]) for i in mine),
                    "cached tokens": sum(ms[i]["cached_tokens"] for i in mine),
                    "prefill computed": sum(ev["prefill_tokens"] for ev in reps[k].engine.events),
                    "busy steps": sum(ev["forwards"] for ev in reps[k].engine.events)})
    return dict(replica=where, cached=[m["cached_tokens"] for m in ms], ttft=[m["ttft_steps"] for m in ms],
                outputs=outs, engines=[r.engine for r in reps], router=router, per_replica=per, ticks=tick)
