"""The capstone (lab 13): the engine's cache_factory seam, the reference paged INT8 cache with block eviction, its
memory count, and the judge's report (kvlib.course.capstone, kvlib.engine.Engine(cache_factory=...))."""

import math

import pytest
import torch

from kvlib.course import capstone
from kvlib.engine import Engine
from kvlib.generate import generate
from kvlib.model import ModelConfig, Transformer, load_tiny
from kvlib.paged import PagedKVCache
from kvlib.quant import Int8KVCache

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 3, 7], [1, 2, 3, 4, 9, 9, 9, 2, 5, 6, 1, 2]]


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                       hidden_dim=64)).eval()


def _run(model, **kw):
    engine = Engine(model, num_blocks=12, block_size=4, max_num_seqs=2, max_batched_tokens=8, **kw)
    ids = [engine.add_request(p, max_new_tokens=6) for p in PROMPTS]
    out = engine.run()
    return engine, [out[i] for i in ids]


def test_the_default_path_is_bit_identical(model):
    plain, out = _run(model)
    explicit, out_none = _run(model, cache_factory=None)
    same = lambda m, n, b: PagedKVCache.for_model(m, n, b, prefix_caching=True, retain_freed=True)  # noqa: E731
    built, out_built = _run(model, cache_factory=same)
    assert type(plain.cache) is PagedKVCache and type(explicit.cache) is PagedKVCache
    assert out == out_none == out_built
    for e in (explicit, built):
        assert all(torch.equal(a, b) for a, b in zip(plain.cache.k + plain.cache.v, e.cache.k + e.cache.v))
        assert [ev["scheduled"] for ev in plain.events] == [ev["scheduled"] for ev in e.events]


@pytest.mark.parametrize("factory, kw, err, words", [
    ("not a function", {}, TypeError, "cache_factory must be a callable"),
    (lambda m, n, b: object(), {}, TypeError, "cache_factory must return a kvlib.paged.PagedKVCache"),
    (lambda m, n, b: PagedKVCache.for_model(m, n + 1, b), {}, ValueError, "num_blocks=12"),
    (lambda m, n, b: PagedKVCache.for_model(m, n, b * 2), {}, ValueError, "block_size=4"),
    (lambda m, n, b: PagedKVCache.for_model(m, n, b), {"preemption": "swap"}, ValueError, "cache_factory works with"),
    (lambda m, n, b: PagedKVCache.for_model(m, n, b), {"host_blocks": 4}, ValueError, "cache_factory works with"),
])
def test_a_bad_factory_is_refused_naming_the_argument(model, factory, kw, err, words):
    with pytest.raises(err, match=words):
        Engine(model, num_blocks=12, block_size=4, cache_factory=factory, **kw)


def test_the_factory_must_give_an_empty_cache(model):
    def used(m, n, b):
        c = PagedKVCache.for_model(m, n, b)
        c.add_sequence("x")
        return c

    with pytest.raises(ValueError, match="cache_factory must return an empty cache"):
        Engine(model, num_blocks=12, block_size=4, cache_factory=used)


def test_the_server_passes_the_factory_through():
    from kvlib.serve import Server

    model, tok = load_tiny(device="cpu")
    srv = Server(model, tok, "tiny", num_blocks=8, block_size=4,
                 cache_factory=capstone.factory(capstone.PagedInt8Cache, dict(block_size=4, budget=8, rule="window")))
    assert type(srv.engine.cache) is capstone.PagedInt8Cache and srv.engine.cache.budget == 8


def test_int8_without_eviction_matches_chapter_06s_cache(model):
    engine, out = _run(model, cache_factory=capstone.factory(capstone.PagedInt8Cache,
                                                             dict(block_size=4, budget=None, rule="none")))
    assert engine.cache.k[0].dtype == torch.int8 and engine.cache.k_scale[0].dtype == torch.float16
    for p, o in zip(PROMPTS, out):
        assert o == generate(model, [p], 6, cache=Int8KVCache.for_model(model, 1, 32))[0].tolist()
    assert engine.cache.allocator.num_free == 12


def test_eviction_under_the_engine_bounds_what_a_sequence_holds(model):
    cache_seen = []
    fac = capstone.factory(capstone.PagedInt8Cache, dict(block_size=4, budget=8, rule="sinks + window"))

    def spy(m, n, b):
        c = fac(m, n, b)
        cache_seen.append(c)
        return c

    engine = Engine(model, num_blocks=12, block_size=4, max_num_seqs=2, max_batched_tokens=8, cache_factory=spy)
    rid = engine.add_request(list(range(1, 15)), max_new_tokens=20)
    c = cache_seen[0]
    while engine.has_unfinished():
        engine.step()
        if rid in c.tables:
            assert 5 <= c.lens[rid] <= 8 or c.dropped[rid] == 0  # budget - block + 1 .. budget once it evicts
            assert c.lens[rid] + c.dropped[rid] == engine.requests[rid].computed
            assert c.tables[rid][0] == 0  # the sink block stays
    assert len(engine.requests[rid].output) == 20 and c.allocator.num_free == 12


def test_drop_blocks():
    f = capstone.drop_blocks
    assert f([0, 1, 2, 3, 4], 70, 48, 16, 1) == 2  # 70 -> 54 -> 38
    assert f([0, 1, 2, 3], 64, 64, 16, 1) == 0  # at the budget: nothing
    assert f([1, 2], 30, 8, 16, 1) == 0  # only the sink and the last block
    assert f([5, 6, 7], 40, 16, 16, 0) == 2  # no sink: the last block alone stays
    assert f([0, 1, 2], 33, None, 16, 1) == 0


def test_store_and_load_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    codes, scales = torch.zeros(3, 4, 2, 8, dtype=torch.int8), torch.ones(3, 4, 2, dtype=torch.float16)
    rows = torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([11, 0, 1, 5, 4])
    capstone.store_int8(codes, scales, rows, slots)
    back = capstone.load_int8(codes, scales, torch.arange(3)).reshape(12, 2, 8)[slots]
    step = rows.abs().amax(-1, keepdim=True) / 127
    assert ((back - rows).abs() <= step * 0.5 + 1e-3 * step).all()


def test_server_bytes_count_codes_scales_and_the_table(model):
    cache = capstone.PagedInt8Cache.for_model(model, 6, 4, budget=8, sink_blocks=1)
    seq = capstone.OneSequence(cache)
    with torch.no_grad():
        model(torch.arange(1, 12)[None], cache=seq)
    cfg = model.config
    per_block = cfg.n_layers * 2 * (4 * cfg.n_kv_heads * cfg.head_dim * 1 + 4 * cfg.n_kv_heads * 2)
    assert capstone.bytes_per_block(cache) == per_block
    assert capstone.server_bytes(cache, 0) == len(cache.tables[0]) * (per_block + 4)
    assert cache.lens[0] + cache.dropped[0] == 11 and int(seq.seq_lens[0]) == 11


def _fake(ppl_nll, k, ttft, itl, mem):
    nll = torch.full((64,), math.log(ppl_nll)) + torch.linspace(-0.5, 0.5, 64)
    return {"decisions": dict(block_size=16, budget=96, rule="sinks + window"),
            "memory": {256: {"decode peak": mem, "decode mean": 0.9 * mem, "prefill peak": 2 * mem},
                       "fp16": {256: 4 * mem}}, "perplexity": math.exp(nll.mean().item()),
            "ppl_low": 1.0, "ppl_high": 2.0, "nll": nll, "passkey_k": k, "passkey_n": 24,
            "latency": {"ttft_ms": ttft, "itl_ms": itl}}


def test_the_report_says_separated_only_where_intervals_separate():
    same = _fake(20, 12, [100, 110, 120, 105], [30, 31, 32, 33], 1000)
    worse = _fake(60, 1, [400, 410, 420, 405], [30, 31, 32, 33], 2000)
    rows = {r["figure"].split(" [")[0]: r["comparison"] for r in capstone.report_rows({"yours": worse, "reference": same})}
    assert rows["memory per sequence, 256-token prompt: peak during decode"] == "exact: yours / reference = 2.000"
    assert rows["memory per sequence, 256-token prompt: time-averaged while decoding"].endswith("= 2.000")
    assert rows["perplexity"].startswith("separated: yours higher")
    assert rows["passkey retrieved"] == "separated: yours lower"
    assert rows["TTFT p50 ms"] == "apart in this one run: no verdict without repeated trials"
    assert rows["ITL p50 ms"] == "not separated"
    rows = capstone.report_rows({"yours": same, "reference": same})
    assert all(r["comparison"] in ("same", "not separated") or r["comparison"].startswith(("exact", "not separated"))
               for r in rows)
    few = _fake(20, 12, [100], [30], 1000)
    assert "too few requests" in capstone.report_rows({"yours": few, "reference": same})[-1]["comparison"]
    assert not any("pass" in r["comparison"].lower() for r in rows)


def test_held_while_decoding_saws_between_budget_minus_a_block_and_budget():
    held = capstone.held_while_decoding(24, 8, n_tokens=60)
    after = held[20:]
    assert min(after) == 24 - 8 + 1 and max(after) == 24


def test_memory_counts_the_blocks_a_forward_holds_before_eviction(model):
    """Budget 8, blocks of 4, one sink: between steps a sequence holds 2 blocks, but a decode step that opens a block
    takes it before the forward and gives one back only after: 3 blocks held. A 32-token prompt in one call holds 8
    blocks; in chunks of 4, with eviction after each, 3."""
    fac = capstone.factory(capstone.PagedInt8Cache, dict(block_size=4, budget=8, rule="sinks + window"))
    cache = fac(model, 12, 4)
    seq = capstone.serve_one(model, cache, 16, chunk=4, n_tokens=8)
    decode = seq.blocks[4:]
    assert max(b for b, _ in seq.after[4:]) == 2 and max(decode) == 3 and decode.count(3) == 2  # 2 of 8 steps open one
    per_block = capstone.bytes_per_block(cache) + 4
    m = capstone.held_bytes(seq.blocks, per_block, 16, 4)
    assert m["decode peak"] == 3 * per_block and m["decode mean"] == (2 * 3 + 6 * 2) / 8 * per_block
    whole = capstone.memory_at(model, fac, lengths=(32,), block_size=4, chunk=32)[32]
    chunked = capstone.memory_at(model, fac, lengths=(32,), block_size=4, chunk=4)[32]
    assert whole["prefill peak"] == 8 * per_block and chunked["prefill peak"] == 3 * per_block
    assert whole["decode peak"] == chunked["decode peak"] == 3 * per_block


class _OnceFails(capstone.PagedInt8Cache):
    calls = 0

    @staticmethod
    def drop(*args):
        _OnceFails.calls += 1
        if _OnceFails.calls == 3:
            raise RuntimeError("drop failed")
        return capstone.drop_blocks(*args)


def _engine(model, cls):
    engine = Engine(model, num_blocks=8, block_size=4,
                    cache_factory=lambda m, n, b: cls.for_model(m, n, b, budget=8, sink_blocks=1))
    return engine, engine.add_request(list(range(1, 12)), max_new_tokens=10)


def test_a_drop_that_raises_leaves_the_cache_as_before_the_forward(model):
    engine, rid = _engine(model, capstone.PagedInt8Cache)
    clean = engine.run()[rid]
    _OnceFails.calls = 0
    engine, rid = _engine(model, _OnceFails)
    with pytest.raises(RuntimeError, match="drop failed"):
        engine.run()
    c, r = engine.cache, engine.requests[rid]
    assert c.lens[rid] + c.dropped[rid] == r.computed  # not a position ahead of the request
    assert c.allocator.num_free == 8 - len(c.tables[rid])  # the reservation went back
    assert engine.run()[rid] == clean  # the retried step gives the clean run's tokens


@pytest.mark.parametrize("bad", [lambda table, *a: len(table), lambda *a: -1, lambda *a: 0.5])
def test_a_drop_out_of_range_is_refused_by_name(model, bad):
    cls = type("Bad", (capstone.PagedInt8Cache,), {"drop": staticmethod(bad)})
    engine, rid = _engine(model, cls)
    with pytest.raises(ValueError, match="drop must return an int"):
        engine.run()
    assert engine.cache.lens[rid] == engine.requests[rid].computed


def test_memory_at_counts_on_a_stand_in_the_blocks_the_model_itself_holds(model):
    """The judge counts blocks on a small random model (which blocks are held depends on positions only) and prices
    them at the model's bytes per block: the same figures as serving the prompt through the model itself."""
    for d in (dict(block_size=4, budget=12, rule="sinks + window"), dict(block_size=4, budget=8, rule="window"),
              dict(block_size=4, budget=None, rule="none")):
        fac = capstone.factory(capstone.PagedInt8Cache, d)
        got = capstone.memory_at(model, fac, lengths=(10, 37), block_size=4, chunk=8)
        for L in (10, 37):
            cache = fac(model, -(-(L + 4) // 4) + 2, 4)
            seq = capstone.serve_one(model, cache, L, 8, 4)
            assert got[L] == capstone.held_bytes(seq.blocks, capstone.bytes_per_block(cache) + 4, L, 8)


def _text_and_prompts(model, seed=0):
    from kvlib.course.ch09 import Passkey

    g, V = torch.Generator().manual_seed(seed), model.config.vocab_size
    text = torch.randint(0, V, (1, 96), generator=g)
    prompts = [Passkey(ids=torch.randint(0, V, (20,), generator=g).tolist(), key=i, answer=[i % V, (i + 1) % V],
                       needle=range(2, 4), depth=0.1, filler=i) for i in range(5)]
    return text, prompts


def _unshared(model, text, d):
    """``reference_perplexity`` computed with chapter 09's prefill sharing turned off: every prefill a real forward."""
    from kvlib.course import ch09

    keep, ch09.PREFILL_MEMORY = ch09.PREFILL_MEMORY, 0
    try:
        return capstone.quality(model, capstone.factory(capstone.PagedInt8Cache, d), text, None, 4)
    finally:
        ch09.PREFILL_MEMORY = keep


def test_one_prefill_serves_every_reference_build_bit_for_bit(model, monkeypatch):
    from kvlib.course import ch09

    text, prompts = _text_and_prompts(model)
    ch09._PREFILLS.pop(model, None)
    builds = (dict(block_size=4, budget=None, rule="none"), dict(block_size=4, budget=12, rule="window"),
              dict(block_size=4, budget=12, rule="sinks + window"),
              dict(block_size=4, budget=20, rule="sinks + window"))
    fresh = [_unshared(model, text, d) for d in builds]
    forwards = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, **kw: forwards.append(ids.shape[1]) or forward(ids, **kw))
    for d, f in zip(builds, fresh):
        shared = capstone.reference_perplexity(model, text, d)
        assert torch.equal(shared["nll"], f["nll"]) and shared["perplexity"] == f["perplexity"]
    assert forwards.count(text.shape[1] // 2) == 1  # the first half prefilled once for the four builds
    assert len(ch09._PREFILLS[model]) == 1
    capstone.quality(model, capstone.factory(capstone.PagedInt8Cache, builds[2]), None, prompts, 4)
    assert len(ch09._PREFILLS[model]) == 1  # the passkey prompts, each read once, are not recorded
    with torch.no_grad():
        model.norm.weight.mul_(1.0)  # an in-place change of the weights: the prefill is made again
    again = _unshared(model, text, builds[1])
    made = forwards.count(text.shape[1] // 2)
    assert torch.equal(capstone.reference_perplexity(model, text, builds[1])["nll"], again["nll"])
    assert forwards.count(text.shape[1] // 2) == made + 1


class _PerTensor(capstone.PagedInt8Cache):
    @staticmethod
    def store(codes, scales, rows, slots):  # one scale for everything: not the reference's codes
        from kvlib.quant import quantize_int8

        q, s = quantize_int8(rows, dim=None)
        H_KV, D = codes.shape[2:]
        codes.view(-1, H_KV, D)[slots] = q
        scales.view(-1, H_KV)[slots] = s.reshape(1, 1).to(scales.dtype).expand(len(slots), H_KV)


def test_the_reference_shares_your_run_only_when_every_attention_output_is_equal(model):
    text, prompts = _text_and_prompts(model)
    d = dict(block_size=4, budget=12, rule="sinks + window")
    ref_fac = capstone.factory(capstone.PagedInt8Cache, d)
    alone = capstone.quality(model, ref_fac, text, prompts, 4)
    same = type("Same", (capstone.PagedInt8Cache,), {"store": staticmethod(capstone.store_int8)})
    yours, ref = capstone.quality_pair(model, capstone.factory(same, d), ref_fac, text, prompts, 4)
    assert ref is not None and torch.equal(ref["nll"], alone["nll"]) and ref["retrieved"] == alone["retrieved"]
    assert ref["passkey_k"] == alone["passkey_k"] and torch.equal(yours["nll"], alone["nll"])
    yours, ref = capstone.quality_pair(model, capstone.factory(_PerTensor, d), ref_fac, text, prompts, 4)
    assert ref is None and not torch.equal(yours["nll"], alone["nll"])


def test_the_judge_measures_the_reference_on_its_own_when_the_builds_differ(model, monkeypatch):
    text, prompts = _text_and_prompts(model)
    d = dict(block_size=4, budget=12, rule="sinks + window")
    fake = lambda m, t, builds, **kw: {n: {"ttft_ms": [1.0, 2.0], "itl_ms": [1.0, 2.0]} for n in builds}  # noqa: E731
    monkeypatch.setattr(capstone, "latency", fake)
    alone = capstone.quality(model, capstone.factory(capstone.PagedInt8Cache, d), text, prompts, 4)
    for cls, how in ((capstone.PagedInt8Cache, "your run"), (_PerTensor, "its own run")):
        out = capstone.judge(model, None, capstone.factory(cls, d), d, text=text, prompts=prompts, lengths=(20,))
        assert out["reference"]["quality from"].startswith(how)
        assert torch.equal(out["reference"]["nll"], alone["nll"]) and out["reference"]["retrieved"] == alone["retrieved"]
        assert out["yours"]["memory"] == out["reference"]["memory"]
