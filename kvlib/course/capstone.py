"""The capstone (lab 13): a paged INT8 cache with an eviction rule, behind the server, judged by the course's instruments.

What it composes:
- chapter 05's paged cache (``kvlib.paged.PagedKVCache``: a block pool per layer, block tables, the allocator);
- chapter 06's INT8 storage: each stored row (one token, one K/V head) as int8 codes with its own absmax scale
  (per token and head), kept in fp16 beside the codes, one scale per slot: pools (num_blocks, block_size, H_KV, D)
  int8 and scales (num_blocks, block_size, H_KV) fp16;
- chapter 09a's eviction on whole blocks (``kvlib.evict.PagedWindowCache``): after each forward, blocks that fell
  out of the last ``budget`` positions go back to the pool; the first ``sink_blocks`` stay (attention sinks). A key
  keeps its RoPE position (``dropped`` counts what went, so the next token's position is held + dropped);
- chapter 08/10's engine and server: the cache stands behind ``kvlib.engine.Engine`` / ``kvlib.serve.Server`` through
  their ``cache_factory`` argument, on the same ragged forward the engine runs for its own cache.

``PagedInt8Cache`` calls three static methods, which lab 13 asks for: ``store`` (quantize rows into their slots),
``load`` (dequantize the blocks a forward reads) and ``drop`` (which blocks a sequence gives back). The reference
versions are here (``store_int8``, ``load_int8``, ``drop_blocks``); a learner's class overrides them.

The judge (``judge``): memory as the server pays it (blocks held x bytes per block of every pool: codes and scales,
plus the block table, per sequence, counted during every forward, after the new tokens' blocks are reserved and before
eviction gives any back: the peak during decode, the time average while decoding, the peak during a chunked
prefill), quality on chapter 09's protocol (perplexity on held-out text with its block-bootstrap interval, passkey
k/n with Wilson 95% intervals), latency under a short GuideLLM run against
``kvlib.serve.Server`` with the cache (TTFT and ITL p50 / p90 over the requests, each with a bootstrap interval).
``report`` prints each figure beside the reference build's: memory is exact (a ratio), every measured figure says
"separated" or "not separated" from its intervals (a latency row that comes out apart in its one run says so
and gives no verdict: that needs repeated trials), never a bare pass on a timing.
"""

from __future__ import annotations

import operator
import time

import torch

from ..paged import PagedKVCache, RaggedBatch
from ..quant import quantize_int8
from ..ragged import RaggedPlan, ragged_paged_attention_ref
from ..stats import separated, wilson

__all__ = ["store_int8", "load_int8", "drop_blocks", "PagedInt8Cache", "RULES", "factory", "OneSequence",
           "bytes_per_block", "server_bytes", "serve_one", "held_bytes", "memory_at", "served_memory", "quality",
           "quality_pair", "reference_perplexity", "latency", "judge", "report", "rule_evidence",
           "best_rules", "budget_evidence", "best_budget", "held_while_decoding", "block_evidence", "best_block",
           "check_decision"]

RULES = ("none", "window", "sinks + window")  # what eviction keeps: everything, the last budget, or + one sink block


# --------------------------------------------------------------------------------------------
# The three pieces (reference versions; lab 13's exercises)
# --------------------------------------------------------------------------------------------


def store_int8(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor):
    """Quantize ``rows`` (N, H_KV, D) per token and head (absmax / 127) and write them at ``slots`` (N,):
    codes (num_blocks, block_size, H_KV, D) int8, scales (num_blocks, block_size, H_KV) fp16; slot = block *
    block_size + offset, so a pool viewed as (num_blocks * block_size, ...) is indexed by slot directly."""
    q, s = quantize_int8(rows, dim=-1)  # (N, H_KV, D) int8, (N, H_KV, 1) fp32
    H_KV, D = codes.shape[2], codes.shape[3]
    codes.view(-1, H_KV, D)[slots] = q
    scales.view(-1, H_KV)[slots] = s[..., 0].to(scales.dtype)


def load_int8(codes: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The blocks ``blocks`` (n,) dequantized: (n, block_size, H_KV, D) in ``dtype`` (codes x their row's scale)."""
    return (codes[blocks].float() * scales[blocks].float()[..., None]).to(dtype)


def drop_blocks(table: list, held: int, budget: int | None, block_size: int, sink_blocks: int) -> int:
    """How many whole blocks a sequence holding ``held`` positions in ``table`` gives back, from just after its
    ``sink_blocks`` first blocks: while it holds more than ``budget`` positions and has a block to spare (the sinks
    and the last, partial, block stay). ``budget`` None: no eviction (0)."""
    if budget is None:
        return 0
    n = 0
    while held - n * block_size > budget and len(table) - n > sink_blocks + 1:
        n += 1
    return n


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class PagedInt8Cache(PagedKVCache):
    """Chapter 05's paged cache holding int8 codes + one fp16 scale per (slot, K/V head), with whole-block eviction.

    ``budget``: positions a sequence keeps (None: all); ``sink_blocks``: its first blocks never dropped. Prefix
    caching is off (a dropped block would break the hash chain). Every forward goes through ``ragged`` (the engine's
    fused step); ``OneSequence`` drives one sequence through the same path for chapter 09's protocol.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = PagedInt8Cache.for_model(model, num_blocks=4, block_size=4, budget=8, sink_blocks=1)
    >>> seq = OneSequence(cache)
    >>> with torch.no_grad():
    ...     _ = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]), cache=seq)
    >>> cache.k[0].dtype, cache.tables[0], cache.lens[0], cache.dropped[0]  # 13 seen: the sink block + the last 1
    (torch.int8, [0, 3], 5, 8)
    """

    store, load, drop = staticmethod(store_int8), staticmethod(load_int8), staticmethod(drop_blocks)

    def __init__(self, n_layers, num_blocks, block_size, n_kv_heads, head_dim, device="cpu", *, budget=None,
                 sink_blocks=1, dtype=torch.float32):
        super().__init__(n_layers, num_blocks, block_size, n_kv_heads, head_dim, torch.int8, device, "torch",
                         prefix_caching=False)
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < (sink_blocks + 1) * block_size):
            raise ValueError(f"budget must be None or an int covering the {sink_blocks} sink block(s) and one more "
                             f"block of {block_size}, got {budget!r}")
        self.budget, self.sink_blocks, self.compute_dtype = budget, sink_blocks, dtype
        shape = (num_blocks, block_size, n_kv_heads)  # one scale per slot and K/V head
        self.k_scale = [torch.ones(shape, dtype=torch.float16, device=device) for _ in range(n_layers)]
        self.v_scale = [torch.ones(shape, dtype=torch.float16, device=device) for _ in range(n_layers)]
        self.dropped: dict = {}  # seq id -> positions dropped from after the sinks so far

    @classmethod
    def for_model(cls, model, num_blocks, block_size, budget=None, sink_blocks=1):
        c = model.config
        return cls(c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, model.device, budget=budget,
                   sink_blocks=sink_blocks, dtype=model.dtype)

    def add_sequence(self, seq_id, prompt_tokens=()) -> int:
        n = super().add_sequence(seq_id, prompt_tokens)
        self.dropped[seq_id] = 0
        return n

    def free_sequence(self, seq_id):
        super().free_sequence(seq_id)
        self.dropped.pop(seq_id, None)

    def ragged(self, seq_ids, new_tokens) -> "_Int8Ragged":
        return _Int8Ragged(self, self._distinct(seq_ids, "ragged"), [list(t) for t in new_tokens])

    def batch(self, seq_ids, new_tokens=None):
        raise NotImplementedError("PagedInt8Cache runs every forward through ragged() (the engine's step), or "
                                  "OneSequence(cache) for model(ids, cache=...)")

    def to_drop(self, seq_id, held: int) -> int:
        """How many blocks ``drop`` gives back for ``seq_id`` holding ``held`` positions, checked; changes nothing."""
        table = self.tables[seq_id]
        n = self.drop(list(table), held, self.budget, self.block_size, self.sink_blocks)
        most = max(0, len(table) - self.sink_blocks - 1)
        try:
            n = n if isinstance(n, bool) else operator.index(n)
        except TypeError:
            pass
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= most:
            raise ValueError(f"drop must return an int from 0 to {most} (the blocks besides the {self.sink_blocks} "
                             f"sink block(s) and the last), got {n!r} for a table of {len(table)} blocks")
        return n

    def evict(self, seq_id, n: int | None = None):
        """Give back ``n`` blocks (default: what ``drop`` names) from just after the sinks, once a forward is
        committed."""
        bs, table = self.block_size, self.tables[seq_id]
        n = self.to_drop(seq_id, self.lens[seq_id]) if n is None else n
        s = self.sink_blocks
        for b in table[s: s + n]:
            self.release_block(b)
        del table[s: s + n]
        self.lens[seq_id] -= n * bs
        self.dropped[seq_id] += n * bs
        del self.tokens[seq_id][s * bs: (s + n) * bs]


class _Int8Ragged(RaggedBatch):
    """The engine's ragged step on int8 pools: store quantizes, attention reads the blocks dequantized; positions
    are the tokens' true positions (held + dropped), so RoPE sees where each token really is."""

    def _layout(self):
        super()._layout()
        c = self.cache
        shift = torch.tensor([c.dropped[s] for s, n in zip(self.seq_ids, self.counts) for _ in range(n)],
                             device=self.positions.device)
        self.positions = self.positions + shift[None]
        # the blocks a forward reads and its tables renumbered over them: the same for every layer, so worked out
        # once per forward (with the attention's plan, made by the first layer), not once per layer
        used, local = torch.unique(self.tables.clamp(min=0).long(), return_inverse=True)
        self.used, self.local_tables = used, torch.where(self.tables >= 0, local, -1).to(torch.int32)

    def attend(self, layer_idx, q, k, v):
        c = self.cache
        if self.state != "reserved":
            raise ValueError(f"this ragged view was already {self.state}: make a new one per forward")
        c.store(c.k[layer_idx], c.k_scale[layer_idx], k[0].transpose(0, 1), self.slots)  # rows (N, H_KV, D)
        c.store(c.v[layer_idx], c.v_scale[layer_idx], v[0].transpose(0, 1), self.slots)
        k_blocks = c.load(c.k[layer_idx], c.k_scale[layer_idx], self.used, q.dtype)  # (n, block_size, H_KV, D)
        v_blocks = c.load(c.v[layer_idx], c.v_scale[layer_idx], self.used, q.dtype)
        args = (q[0].transpose(0, 1), k_blocks, v_blocks, self.local_tables, self.cu_seqlens, self.seq_lens)
        if self._plan is None:  # checked and laid out by the first layer (a load of another shape is refused)
            self._plan = RaggedPlan(*args)
        out = ragged_paged_attention_ref(*args, plan=self._plan)
        return out.transpose(0, 1)[None]  # (1, H, N, D)

    def commit(self):
        """Commit, then evict: every ``drop`` is asked (and checked) before anything changes, so one that raises
        leaves the cache as it was before the forward (the reservation given back), and the engine can retry."""
        c = self.cache
        try:
            drops = [c.to_drop(s, c.lens[s] + n) for s, n in zip(self.seq_ids, self.counts)]
        except BaseException:
            self.rollback()
            raise
        super().commit()
        for s, n in zip(self.seq_ids, drops):
            c.evict(s, n)


def factory(cls, decisions: dict):
    """``cache_factory`` for ``Engine`` / ``Server``: (model, num_blocks, block_size) -> ``cls`` with the
    ``decisions`` {"block_size", "budget", "rule"} (rule in ``RULES``)."""
    rule = decisions["rule"]
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    budget = None if rule == "none" else int(decisions["budget"])
    sinks = 1 if rule == "sinks + window" else 0
    return lambda model, num_blocks, block_size: cls.for_model(model, num_blocks, block_size, budget=budget,
                                                               sink_blocks=sinks)


class OneSequence:
    """One sequence of a paged cache as chapter 03's cache protocol (``attend``, ``seq_lens``), so that
    ``model(ids, positions=..., cache=OneSequence(cache))`` (chapter 09's perplexity and passkey) runs through the
    same ragged step the engine runs. Batch 1; the caller passes true positions (the model's default 0..T-1 for
    the first call)."""

    #: whether chapter 09's ``prefill`` may share this sequence's first call with other caches on the same prompt
    #: (``ch09._reads_prompt_whole``): set by ``_quality`` for the text's sequence. True of every cache this class
    #: drives, since a forward attends before ``commit`` evicts; the replay checks every layer's output bit for bit
    prefill_whole = False

    def __init__(self, cache: PagedKVCache, seq_id=0):
        self.cache, self.seq_id, self.view = cache, seq_id, None
        cache.add_sequence(seq_id)
        self.trace: list = []  # (positions seen, bytes held) after every forward
        self.blocks: list = []  # blocks held during every forward: after its reservation, before eviction
        self.after: list = []  # (blocks, positions) held after every forward, once eviction ran

    @property
    def seq_lens(self) -> torch.Tensor:
        c = self.cache
        return torch.tensor([c.lens[self.seq_id] + getattr(c, "dropped", {}).get(self.seq_id, 0)])

    def attend(self, layer_idx, q, k, v):
        if q.shape[0] != 1:
            raise ValueError(f"OneSequence drives batch 1, got B={q.shape[0]}")
        if layer_idx == 0:
            self.view = self.cache.ragged([self.seq_id], [[0] * q.shape[2]])
            self.blocks.append(len(self.cache.tables[self.seq_id]))  # the new tokens' blocks are already taken
        try:
            out = self.view.attend(layer_idx, q, k, v)
        except BaseException:
            self.view.rollback()
            raise
        if layer_idx == len(self.cache.k) - 1:
            self.view.commit()
            self.trace.append((int(self.seq_lens[0]), server_bytes(self.cache, self.seq_id)))
            self.after.append((len(self.cache.tables[self.seq_id]), self.cache.lens[self.seq_id]))
        return out


# --------------------------------------------------------------------------------------------
# Memory as the server holds it
# --------------------------------------------------------------------------------------------


def bytes_per_block(cache: PagedKVCache, float_bytes: int = 2) -> int:
    """Bytes one block holds over every layer: every tensor of the cache whose first dim is the pool's blocks
    (codes, values, scales, K and V), found on the live object (``kvlib.footprint.cache_tensors``); a float tensor
    in the model's compute dtype counts ``float_bytes`` per number (what an fp16 server stores)."""
    from ..footprint import cache_tensors

    n, total = cache.allocator.num_blocks, 0
    for t in cache_tensors(cache).values():
        if t.dim() >= 2 and t.shape[0] == n:
            size = float_bytes if t.dtype in (torch.float32, torch.float64) else t.element_size()
            total += t.numel() * size // n
    return total


def server_bytes(cache: PagedKVCache, seq_id) -> int:
    """Bytes the server holds for one sequence: its blocks x ``bytes_per_block`` + its block table (int32 per
    entry, as the kernels read it)."""
    return len(cache.tables[seq_id]) * (bytes_per_block(cache) + 4)


@torch.no_grad()
def serve_one(model, cache, prompt_len: int, chunk: int = 128, n_tokens: int = 16) -> OneSequence:
    """One sequence through ``cache`` as the engine serves it: a prompt of ``prompt_len`` tokens prefilled in chunks of
    ``chunk`` (the server's ``max_batched_tokens``) with eviction after each chunk, then ``n_tokens`` decode steps, at
    their true positions. -> the ``OneSequence``: ``.blocks`` has the blocks held during every forward (the chunks'
    first), ``.trace`` the positions and bytes held after each."""
    seq, dev = OneSequence(cache), model.device
    for a in range(0, prompt_len, chunk):
        e = min(a + chunk, prompt_len)
        model(torch.zeros(1, e - a, dtype=torch.long, device=dev), positions=torch.arange(a, e, device=dev)[None],
              cache=seq, logits_to_keep=1)
    for t in range(prompt_len, prompt_len + n_tokens):
        model(torch.zeros(1, 1, dtype=torch.long, device=dev), positions=torch.tensor([[t]], device=dev), cache=seq,
              logits_to_keep=1)
    return seq


def held_bytes(blocks: list, per_block: int, prompt_len: int, chunk: int) -> dict:
    """Bytes per sequence from the blocks held during each forward of ``serve_one``: the most during prefill, the
    most during decode, and the mean over the decode steps (each step one forward: the time average while decoding)."""
    n_pre = -(-prompt_len // chunk)
    pre, dec = blocks[:n_pre], blocks[n_pre:]
    return {"prefill peak": max(pre) * per_block, "decode peak": max(dec) * per_block,
            "decode mean": sum(dec) / len(dec) * per_block}


def memory_at(model, cache_factory, lengths=(256, 1024), block_size: int = 16, chunk: int = 128,
              n_tokens: int | None = None) -> dict:
    """{length: {"prefill peak", "decode peak", "decode mean"} bytes per sequence} for a prompt of that many tokens
    served as the engine serves it (``serve_one``: chunks of ``chunk``, then ``n_tokens`` decode steps, default one
    block's worth, so the mean covers whole cycles of eviction), counted during every forward, after the new tokens'
    blocks are reserved and before eviction gives any back: what the server's pool must hold. ``"fp16"``: {length: a
    plain fp16 cache's bytes}, for scale.

    The blocks held are counted on the cache ``cache_factory`` builds for a small random model (as ``served_memory``
    does: which blocks a sequence holds depends on its positions, not on the K/V values, for every rule of
    ``RULES``), and priced at the bytes per block of the cache ``cache_factory`` builds for ``model`` (every pool of
    the live object, + the block table entry). ``tests/test_capstone.py`` checks that the counts equal those of a
    run on another model."""
    from ..footprint import fp16_cache_bytes

    n_tokens = n_tokens or block_size
    tiny = _tiny_model()
    out, fp16 = {}, {}
    for L in lengths:
        n_blocks = -(-(L + n_tokens) // block_size) + 2
        seq = serve_one(tiny, cache_factory(tiny, n_blocks, block_size), L, chunk, n_tokens)
        out[L] = held_bytes(seq.blocks, bytes_per_block(cache_factory(model, n_blocks, block_size)) + 4, L, chunk)
        fp16[L] = fp16_cache_bytes(model.config, L)
    out["fp16"] = fp16
    return out


# --------------------------------------------------------------------------------------------
# Quality on chapter 09's protocol
# --------------------------------------------------------------------------------------------


def quality(model, cache_factory, text, prompts, block_size: int) -> dict:
    """Perplexity of ``text`` (1, N) with its block-bootstrap interval and per-token NLL, and passkey k / n on
    ``prompts`` with the Wilson interval, each through a fresh cache (chapter 09's ``perplexity``, ``score_passkey``,
    batch 1), the pool sized for the task."""
    return _quality(model, lambda n_blocks: OneSequence(cache_factory(model, n_blocks, block_size)), text, prompts,
                    block_size)


def _quality(model, make_seq, text, prompts, block_size: int) -> dict:
    """``quality`` with ``make_seq(num_blocks)`` -> a fresh cache for one sequence. The text's prefill is chapter 09's
    ``prefill``: computed once per text and weights, then replayed through each later cache's own ``attend`` and kept
    only where every layer's output equals the recorded one bit for bit (the passkey prompts, each read once, are not
    recorded)."""
    from . import ch09

    row = {}
    if text is not None:
        seq = make_seq(-(-text.shape[1] // block_size) + 2)
        seq.prefill_whole = True  # its first call attends the whole first half; eviction comes after (commit)
        ppl, nll = ch09.perplexity(model, seq, text)
        lo, hi = ch09.ppl_interval(nll)
        row.update(perplexity=ppl, ppl_low=lo, ppl_high=hi, nll=nll)
    if prompts:
        n_blocks = -(-(len(prompts[0].ids) + len(prompts[0].answer)) // block_size) + 2
        pk = ch09.score_passkey(model, lambda b: make_seq(n_blocks), prompts, batch=1, grows=lambda n: 0.0)
        row.update(passkey_k=pk["k"], passkey_n=pk["n"], passkey_low=pk["interval"][0],
                   passkey_high=pk["interval"][1], retrieved=pk["retrieved"])
    return row


class _Twin:
    """Your build and the reference build in one run: every forward goes through your cache, and, while they agree,
    through the reference's too, with the same q, k, v. If every attention output of every layer and forward is equal
    bit for bit (``torch.equal``), and so are the blocks and positions held after each forward, then a run of the
    reference alone would have fed the model the very same numbers at every step: its perplexity and passkey answers
    are yours. Any difference (or an error in the reference's step) sets ``same`` to False, and the reference is
    measured on its own."""

    prefill_whole = False  # as OneSequence's

    def __init__(self, yours: OneSequence, reference: OneSequence):
        self.yours, self.reference, self.same = yours, reference, True

    @property
    def seq_lens(self):
        return self.yours.seq_lens

    def attend(self, layer_idx, q, k, v):
        out = self.yours.attend(layer_idx, q, k, v)
        if self.same:
            try:
                self.same = torch.equal(out, self.reference.attend(layer_idx, q, k, v))
            except Exception:  # noqa: BLE001 - the reference refused what yours took: not the same build
                self.same = False
            y, r = self.yours, self.reference
            if self.same and layer_idx == len(y.cache.k) - 1:
                self.same = (len(y.cache.tables[y.seq_id]), y.cache.lens[y.seq_id], int(y.seq_lens[0])) == (
                    len(r.cache.tables[r.seq_id]), r.cache.lens[r.seq_id], int(r.seq_lens[0]))
        return out


def quality_pair(model, cache_factory, reference_factory, text, prompts, block_size: int) -> tuple:
    """``quality`` of your build, and of the reference build where it is provably the same run -> (yours, reference
    or None). Your run drives the reference's cache beside yours (``_Twin``); where every attention output agreed bit
    for bit, the reference's figures are that run's; otherwise None: measure the reference on its own."""
    twins = []

    def make_seq(n_blocks):
        twins.append(_Twin(OneSequence(cache_factory(model, n_blocks, block_size)),
                           OneSequence(reference_factory(model, n_blocks, block_size))))
        return twins[-1]

    yours = _quality(model, make_seq, text, prompts, block_size)
    return yours, dict(yours) if twins and all(t.same for t in twins) else None


def reference_perplexity(model, text, decisions: dict) -> dict:
    """``quality(model, factory(PagedInt8Cache, decisions), text, None, block_size)``: the text's perplexity through the
    reference build. Chapter 09's perplexity prefills the first half of the text in one call and the reference cache
    evicts only after a forward, so every build of one block size attends that call alike: ``ch09.prefill`` computes
    it once per text and weights and replays it through each later build's cache (``_quality``).
    ``tests/test_capstone.py`` checks the figures against fresh runs, bit for bit."""
    bs = int(decisions["block_size"])
    return quality(model, factory(PagedInt8Cache, decisions), text, None, bs)


# --------------------------------------------------------------------------------------------
# Latency under load: GuideLLM against kvlib.serve with the cache
# --------------------------------------------------------------------------------------------


def _quantile_interval(x, q: float, n_boot: int = 2000, seed: int = 0) -> tuple:
    """(quantile q of x, its 95% bootstrap interval over the values)."""
    import numpy as np

    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    boot = np.quantile(rng.choice(x, size=(n_boot, len(x)), replace=True), q, axis=1)
    return float(np.quantile(x, q)), float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


def _per_request(report) -> dict:
    """{"ttft_ms": [...], "itl_ms": [...]} per successful request of a GuideLLM report."""
    out = {"ttft_ms": [], "itl_ms": []}
    for bench in report["benchmarks"]:
        for req in bench["requests"]["successful"]:
            ttft = req.get("time_to_first_token_ms")
            itl = req.get("inter_token_latency_ms")
            if ttft is not None and itl is not None:
                out["ttft_ms"].append(float(ttft))
                out["itl_ms"].append(float(itl))
    return out


def latency(model, tok, builds: dict, *, requests: int = 4, rate: float = 0.5, prompt_tokens: int = 64,
            output_tokens: int = 8, num_blocks: int = 64) -> dict:
    """Latency under load of several builds at once: ``builds`` {name: (cache_factory, decisions)}; each gets its own
    ``kvlib.serve.Server`` (the same model), all up together, and one GuideLLM run per server (a constant ``rate``
    req/s, ``requests`` requests of ``prompt_tokens`` -> ``output_tokens``), the runs side by side, so that whatever else
    loads the machine loads every build alike. -> {name: {"ttft_ms": [...], "itl_ms": [...] per request, "tool",
    "command"}}. Without the ``guidellm`` command, chapter 10's ``StreamClient`` threads send the same requests to every
    server in turn, and ``tool`` says so."""
    import tempfile
    import threading

    from ..bench import load
    from ..serve import Server

    servers = {name: Server(model, tok, "capstone", num_blocks=num_blocks, block_size=int(d["block_size"]),
                            cache_factory=fac, max_num_seqs=4, max_batched_tokens=128)
               for name, (fac, d) in builds.items()}
    try:
        for srv in servers.values():
            srv.start()
        try:
            load._command("guidellm", "")
        except RuntimeError:
            return _threads_load(servers, requests, rate, prompt_tokens, output_tokens)
        tok_dir = load.write_tokenizer_dir(tok, tempfile.mkdtemp(prefix="kvlib-capstone-tok-"))
        reports, errors = {}, []

        def run(name, srv):
            try:
                reports[name] = load.run_guidellm(srv.url.removesuffix("/v1"), "capstone", tok_dir, profile="constant",
                                                  rates=[rate], max_requests=requests, seconds=120,
                                                  prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                                                  body={"temperature": 0})
            except Exception as err:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(err)

        for attempt in range(3):  # a run in which GuideLLM sent a burst is rerun, twice at most (as chapter 10 does)
            threads = [threading.Thread(target=run, args=item) for item in servers.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            bursts = {name: rep["_bursts"] for name, rep in reports.items() if rep["_bursts"]}
            if not bursts:
                break
        return {name: {**_per_request(rep), "tool": "GuideLLM", "command": rep["_command"], "attempts": attempt + 1,
                       "bursts": bursts.get(name, []), **_load_seen(servers[name])}
                for name, rep in reports.items()}
    finally:
        for srv in servers.values():
            srv.stop()


def _load_seen(server) -> dict:
    """How loaded the server's engine was: its forwards and the sequences each one carried (mean, max)."""
    per = [len(ev["scheduled"]) for ev in server.engine.events if ev.get("forwards")]
    return {"forwards": len(per), "seqs_per_forward": sum(per) / max(1, len(per)), "seqs_per_forward_max": max(per,
                                                                                                             default=0)}


def _threads_load(servers: dict, requests, rate, prompt_tokens, output_tokens) -> dict:
    from .ch10 import StreamClient

    words = " ".join(["cache"] * prompt_tokens)
    clients = {name: [] for name in servers}
    for i in range(requests):
        for name, srv in servers.items():
            c = StreamClient(srv.url, srv.model_name, f"{i} {words}", max_tokens=output_tokens, chat=False)
            c.start()
            clients[name].append(c)
        time.sleep(1 / rate)
    out = {}
    for name, cs in clients.items():
        for c in cs:
            c.join(120)
        ok = [c for c in cs if c.error is None and len(c.pieces) > 1]
        out[name] = {"ttft_ms": [1e3 * c.pieces[0][0] for c in ok],
                     "itl_ms": [1e3 * (c.pieces[-1][0] - c.pieces[0][0]) / (len(c.pieces) - 1) for c in ok],
                     "tool": "threads (the guidellm command was not found)", "command": "", "attempts": 1,
                     "bursts": [], **_load_seen(servers[name])}
    return out


# --------------------------------------------------------------------------------------------
# The judge and its report
# --------------------------------------------------------------------------------------------


def judge(model, tok, cache_factory, decisions: dict, *, reference_factory=None, reference_decisions=None,
          text=None, prompts=None, lengths=(256, 1024), load_kw=None) -> dict:
    """Measure your build (``cache_factory`` with ``decisions``) and the reference build (``PagedInt8Cache`` with
    ``reference_decisions``, default yours) on the same instruments -> {"yours": ..., "reference": ...} for
    ``report``: memory of each (``memory_at``), quality (``quality_pair``: where the decisions are the same, your run
    drives the reference's cache beside yours and its figures are the reference's if every attention output agreed
    bit for bit; otherwise the reference is measured on its own, its perplexity through ``reference_perplexity`` when
    it is the default reference build), latency for both at once (``latency``). ``result["reference"]["quality from"]``
    says which. ``text``: (1, N) token ids for perplexity; ``prompts``: chapter 09 passkey prompts; ``load_kw``:
    ``latency``'s options."""
    reference_decisions = dict(reference_decisions or decisions)
    default_reference = reference_factory is None
    reference_factory = reference_factory or factory(PagedInt8Cache, reference_decisions)
    bs, ref_bs = int(decisions["block_size"]), int(reference_decisions["block_size"])
    out = {"yours": {"decisions": dict(decisions), "memory": memory_at(model, cache_factory, lengths, bs)},
           "reference": {"decisions": dict(reference_decisions),
                         "memory": memory_at(model, reference_factory, lengths, ref_bs)}}
    if dict(decisions) == reference_decisions:
        yours, ref = quality_pair(model, cache_factory, reference_factory, text, prompts, bs)
    else:
        yours, ref = quality(model, cache_factory, text, prompts, bs), None
    how = "your run: every attention output equal to the reference build's, bit for bit"
    if ref is None and default_reference and text is not None:
        ref, how = ({**reference_perplexity(model, text, reference_decisions),
                     **quality(model, reference_factory, None, prompts, ref_bs)}, "its own run")
    elif ref is None:
        ref, how = quality(model, reference_factory, text, prompts, ref_bs), "its own run"
    out["yours"].update(yours)
    out["reference"].update(ref, **{"quality from": how})
    lat = latency(model, tok, {"yours": (cache_factory, decisions), "reference": (reference_factory,
                                                                               reference_decisions)}, **(load_kw or {}))
    for name in out:
        out[name]["latency"] = lat[name]
    return out


def _mib(b) -> str:
    return f"{b / 2**20:.2f} MiB"


def report_rows(result) -> list[dict]:
    """One row per figure: what, yours, reference, and how they compare ("exact ratio", "separated: ... lower",
    "not separated")."""
    y, r = result["yours"], result["reference"]
    rows = [{"figure": "decisions", "yours": _decisions(y["decisions"]), "reference": _decisions(r["decisions"]),
             "comparison": "same" if y["decisions"] == r["decisions"] else "different"}]
    for L in (k for k in y["memory"] if k != "fp16"):
        for what, label in (("decode peak", "peak during decode"), ("decode mean", "time-averaged while decoding"),
                            ("prefill peak", "peak during the chunked prefill")):
            a, b, f = y["memory"][L][what], r["memory"][L][what], y["memory"]["fp16"][L]
            rows.append({"figure": f"memory per sequence, {L}-token prompt: {label}",
                         "yours": f"{_mib(a)} ({a / f:.1%} of fp16)", "reference": f"{_mib(b)} ({b / f:.1%} of fp16)",
                         "comparison": f"exact: yours / reference = {a / b:.3f}"})
    if "perplexity" in y and "perplexity" in r:
        from . import ch09

        ratio, lo, hi = ch09.ppl_ratio_interval(y["nll"], r["nll"])
        side = "not separated" if lo <= 1 <= hi else "separated: " + ("yours lower" if hi < 1 else "yours higher")
        rows.append({"figure": "perplexity [95% block bootstrap]",
                     "yours": f"{y['perplexity']:.2f} [{y['ppl_low']:.2f}, {y['ppl_high']:.2f}]",
                     "reference": f"{r['perplexity']:.2f} [{r['ppl_low']:.2f}, {r['ppl_high']:.2f}]",
                     "comparison": f"{side} (paired ratio {ratio:.3f} [{lo:.3f}, {hi:.3f}])"})
    if "passkey_k" in y and "passkey_k" in r:
        a, b = (y["passkey_k"], y["passkey_n"]), (r["passkey_k"], r["passkey_n"])
        ia, ib = wilson(*a), wilson(*b)
        side = ("not separated" if not separated(ia, ib) else
                "separated: " + ("yours higher" if a[0] / a[1] > b[0] / b[1] else "yours lower"))
        rows.append({"figure": "passkey retrieved [95% Wilson]", "yours": _rate(*a), "reference": _rate(*b),
                     "comparison": side})
    for name, col in (("TTFT", "ttft_ms"), ("ITL", "itl_ms")):
        for q in (0.5, 0.9):
            a, b = y["latency"][col], r["latency"][col]
            if len(a) < 2 or len(b) < 2:
                rows.append({"figure": f"{name} p{q * 100:.0f} ms", "yours": f"{len(a)} requests",
                             "reference": f"{len(b)} requests", "comparison": "too few requests for an interval"})
                continue
            (va, la, ha), (vb, lb, hb) = _quantile_interval(a, q), _quantile_interval(b, q)
            # one run per build: the bootstrap resamples its requests and cannot see what differs between the two
            # runs, so two runs of the same code can come out apart; a timing verdict needs repeated trials (ch. 10)
            side = ("not separated" if not separated((la, ha), (lb, hb)) else
                    "apart in this one run: no verdict without repeated trials")
            rows.append({"figure": f"{name} p{q * 100:.0f} ms [95% bootstrap, {len(a)} / {len(b)} requests]",
                         "yours": f"{va:.0f} [{la:.0f}, {ha:.0f}]", "reference": f"{vb:.0f} [{lb:.0f}, {hb:.0f}]",
                         "comparison": side})
    return rows


def _rate(k, n) -> str:
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {100 * k / n:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def _decisions(d) -> str:
    return f"block {d['block_size']}, budget {d['budget']}, {d['rule']}"


def report(result):
    """The judge's table (a DataFrame indexed by figure): yours, the reference build's, and the comparison."""
    import pandas as pd

    return pd.DataFrame(report_rows(result)).set_index("figure")


# --------------------------------------------------------------------------------------------
# Lab 13's decisions: the evidence each one is taken from, and the rule that takes it
# --------------------------------------------------------------------------------------------


def _tiny_model():
    from ..model import ModelConfig, Transformer

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()


def served_memory(model, decisions: dict, prompt_len: int = 1024, chunk: int = 128, n_tokens: int = 96) -> dict:
    """The reference cache with ``decisions`` serving one sequence as the engine does (``serve_one``: the prompt in
    chunks of ``chunk``, then ``n_tokens`` decode steps), run on a small random model (which blocks a sequence holds
    depends on its positions, not on the weights) and priced at ``model``'s bytes per block (every pool + the table
    entry) -> ``held_bytes``'s figures, "between steps" (the most held after a decode step, once eviction ran) and
    "held" (the positions held after each decode step)."""
    bs = int(decisions["block_size"])
    tiny = _tiny_model()
    cache = factory(PagedInt8Cache, decisions)(tiny, -(-(prompt_len + n_tokens) // bs) + 2, bs)
    seq = serve_one(tiny, cache, prompt_len, chunk, n_tokens)
    per_block = bytes_per_block(PagedInt8Cache.for_model(model, 1, bs)) + 4
    out = held_bytes(seq.blocks, per_block, prompt_len, chunk)
    decode = seq.after[-n_tokens:]
    out.update({"between steps": max(b for b, _ in decode) * per_block, "held": [h for _, h in decode]})
    return out


def _memory_columns(m: dict) -> dict:
    return {"between steps KiB": m["between steps"] / 1024, "decode peak KiB": m["decode peak"] / 1024,
            "decode mean KiB": m["decode mean"] / 1024, "prefill peak KiB": m["prefill peak"] / 1024}


def rule_evidence(model, text, target_bytes: int, budget: int = 64, block_size: int = 16, chunk: int = 128):
    """Each rule of ``RULES`` at ``budget`` positions, blocks of ``block_size``: bytes per sequence as the server holds
    them for a 1,024-token prompt (``served_memory``: prefill in chunks of ``chunk``, then decode; the most during a
    decode step is what ``target_bytes`` applies to), and perplexity on ``text`` through the reference cache with its
    interval (and the NLL, for paired intervals; ``reference_perplexity``: one prefill for every build) -> DataFrame
    indexed by rule."""
    import pandas as pd

    rows = {}
    for rule in RULES:
        d = dict(block_size=block_size, budget=budget, rule=rule)
        m = served_memory(model, d, chunk=chunk)
        q = reference_perplexity(model, text, d)
        rows[rule] = {**_memory_columns(m), "meets target": m["decode peak"] <= target_bytes,
                      "perplexity": q["perplexity"], "ppl low": q["ppl_low"], "ppl high": q["ppl_high"], "nll": q["nll"]}
    return pd.DataFrame.from_dict(rows, orient="index")


def best_rules(evidence) -> list:
    """The rules a decision may pick: those meeting the target whose perplexity is the lowest, or not separated from
    the lowest (paired ratio interval containing 1)."""
    from . import ch09

    ok = evidence[evidence["meets target"].astype(bool)]
    best = ok["perplexity"].astype(float).idxmin()
    return [r for r in ok.index if r == best or ch09.ppl_ratio_interval(ok.loc[r, "nll"], ok.loc[best, "nll"])[1] <= 1]


def budget_evidence(model, target_bytes: int, budgets=(48, 64, 80, 96), block_size: int = 16, chunk: int = 128,
                    text=None):
    """Sinks + window at each budget: bytes per sequence as the server holds them (``served_memory``: after a decode
    step, the most during one, the mean over the steps, the most during the prefill in chunks of ``chunk``), what a
    count of the budget's positions at fp16 and at int8 codes alone would say, and whether the decode peak meets
    ``target_bytes`` (the budget decision reads memory only) -> DataFrame indexed by budget. With ``text``, each
    budget's perplexity too (``reference_perplexity``: the text's prefill shared with every build of that block
    size)."""
    import pandas as pd

    from ..footprint import fp16_cache_bytes

    rows = {}
    for b in budgets:
        d = dict(block_size=block_size, budget=b, rule="sinks + window")
        m = served_memory(model, d, chunk=chunk)
        rows[b] = {**_memory_columns(m), "fp16 count KiB": fp16_cache_bytes(model.config, b) / 1024,
                   "int8 codes count KiB": fp16_cache_bytes(model.config, b) / 2 / 1024,
                   "meets target": m["decode peak"] <= target_bytes}
        if text is not None:
            q = reference_perplexity(model, text, d)
            rows[b].update({"perplexity": q["perplexity"], "ppl low": q["ppl_low"], "ppl high": q["ppl_high"]})
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("budget")


def best_budget(evidence):
    """The largest budget whose decode peak meets the target (a window with more budget holds a superset of a
    smaller one's positions), or None when none does."""
    ok = evidence[evidence["meets target"].astype(bool)]
    return int(ok.index.max()) if len(ok) else None


@torch.no_grad()
def held_while_decoding(budget: int, block_size: int, n_tokens: int = 256, rule: str = "sinks + window") -> list:
    """Positions held after every step of a greedy decode of ``n_tokens`` tokens after an 8-token prompt, through the
    reference cache on a small random model (what is held does not depend on the model's weights)."""
    from ..model import ModelConfig, Transformer

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()
    cache = factory(PagedInt8Cache, dict(block_size=block_size, budget=budget, rule=rule))(
        model, -(-budget // block_size) + 2, block_size)
    seq, held = OneSequence(cache), []
    logits = model(torch.arange(8)[None], cache=seq, logits_to_keep=1)
    for _ in range(n_tokens):
        logits = model(logits[:, -1:].argmax(-1), positions=seq.seq_lens[None], cache=seq)  # the next true position
        held.append(cache.lens[0])
    return held


def block_evidence(model, budget: int, block_sizes=(8, 16, 32), target_bytes: int | None = None,
                   n_tokens: int = 96):
    """Per block size, sinks + window at ``budget`` (``served_memory``, ``n_tokens`` decode steps after a 1,024-token
    prompt: whole cycles of eviction for blocks up to 32): the positions held after each step (mean, min), that mean
    as a share of the budget, the sink block, bytes per sequence (the most during a decode step, the mean) and, with
    ``target_bytes``, whether that peak meets it -> DataFrame indexed by block size."""
    import pandas as pd

    rows = {}
    for bs in block_sizes:
        m = served_memory(model, dict(block_size=bs, budget=budget, rule="sinks + window"), n_tokens=n_tokens)
        held = m["held"]
        rows[bs] = {"held (mean)": sum(held) / len(held), "held (min)": min(held),
                    "held % of budget": 100 * sum(held) / len(held) / budget, "sink positions": bs,
                    "decode peak KiB": m["decode peak"] / 1024, "decode mean KiB": m["decode mean"] / 1024}
        if target_bytes is not None:
            rows[bs]["meets target"] = m["decode peak"] <= target_bytes
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("block_size")


def best_block(evidence, keep_pct: float = 90.0):
    """The largest block size whose mean positions held stay at ``keep_pct``% of the budget or more and, where the
    evidence has the column, whose decode peak meets the target (fewer, larger blocks: shorter block tables; but the
    block a step opens is a whole block more to hold), or None."""
    ok = evidence[evidence["held % of budget"] >= keep_pct]
    if "meets target" in evidence:
        ok = ok[ok["meets target"].astype(bool)]
    return int(ok.index.max()) if len(ok) else None


def check_decision(what: str, yours, evidence, **kw) -> bool:
    """Lab 13's decisions: ``what`` is "rule", "budget" or "block_size"; prints yours vs the reference taken from
    ``evidence`` by the stated rule, and the diagnosis of a wrong choice (``kvlib.course.mistakes.lab13``)."""
    from .check import check_choice
    from .mistakes import lab13

    if what == "rule":
        accepted = best_rules(evidence)
        ref = yours if yours in accepted else accepted[0]
        return check_choice("rule", yours, ref, lambda: lab13.rule_choice(yours, accepted, evidence))
    if what == "budget":
        ref = best_budget(evidence)
        return check_choice("budget", yours, ref, lambda: lab13.budget_choice(yours, ref, evidence, kw["target_bytes"]))
    if what == "block_size":
        ref = best_block(evidence, kw.get("keep_pct", 90.0))
        return check_choice("block size", yours, ref,
                            lambda: lab13.block_choice(yours, ref, evidence, kw.get("keep_pct", 90.0)))
    raise ValueError(f"what must be 'rule', 'budget' or 'block_size', got {what!r}")
