"""kvlib.footprint: bytes counted from the tensors a cache holds (chapter 09's memory axis)."""

import doctest

import pytest
import torch

import kvlib.footprint
from kvlib.cache import KVCache
from kvlib.compress import CrossLayerKVCache, LowRankKVCache
from kvlib.evict import H2OCache, SinkCache, SlidingWindowCache, SnapKVCache
from kvlib.footprint import MemoryMeter, cache_tensors, classify, fp16_cache_bytes, held_bytes
from kvlib.kivi import KiviCache
from kvlib.model import ModelConfig, Transformer
from kvlib.quant import Int8KVCache

CFG = dict(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128)  # D = 16


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(**CFG)).eval()


def feed(model, cache, ids, steps):
    """Run ``ids`` (a list) through the model in calls of the given sizes, positions counted from 0."""
    t = 0
    with torch.no_grad():
        for T in steps:
            model(torch.tensor([ids[t: t + T]]), positions=torch.arange(t, t + T)[None], cache=cache)
            t += T


def test_module_doctests_run():  # kvlib.footprint is not (yet) in tests/test_doctests.py's MODULES
    result = doctest.testmod(kvlib.footprint, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---- what is found, and how it is counted -------------------------------------------------------------


def test_kvcache_exact_bytes_and_half_precision():
    cache = KVCache(n_layers=3, batch=2, n_kv_heads=2, max_len=10, head_dim=8)  # fp32
    held = held_bytes(cache)
    per_buffer = 2 * 2 * 10 * 8 * 4
    assert held.payload == 3 * 2 * per_buffer == cache.nbytes()
    assert held.indices == 2 * 4  # seq_lens (B,) int32
    assert (held.scales, held.scores, held.other) == (0, 0, 0)
    assert held.total == cache.nbytes() + 8 and held.compute_dtype == torch.float32
    half = held_bytes(cache, float_bytes=2)
    assert half.payload == held.payload // 2 and half.indices == held.indices  # indices keep their real size
    fp16 = KVCache(n_layers=3, batch=2, n_kv_heads=2, max_len=10, head_dim=8, dtype=torch.float16)
    assert held_bytes(fp16).payload == held_bytes(fp16, float_bytes=2).payload == half.payload
    assert set(held.tensors) == {f"{n}[{i}]" for n in "kv" for i in range(3)} | {"seq_lens"}


def test_views_counted_once():
    cache = KVCache(n_layers=1, batch=2, n_kv_heads=1, max_len=4, head_dim=4)
    base = held_bytes(cache).total
    # a sequence(b) view shares the whole batch's storage: it holds (and is charged) that allocation
    assert held_bytes(cache.sequence(1)).total == base
    cache.extra = [cache.k[0][:1], cache.k[0].view(-1), {"again": cache.v[0].transpose(2, 3)}]  # views of held storage
    assert held_bytes(cache).total == base
    assert sorted(cache_tensors(cache)) == ["k[0]", "seq_lens", "v[0]"]
    cache.own = torch.zeros(5, dtype=torch.int64)  # a new storage counts
    assert held_bytes(cache).total == base + 40


def test_parameters_never_counted(model):
    cache = KVCache.for_model(model, batch=1, max_len=4)
    base = held_bytes(cache).total
    cache.model, cache.layers = model, [model.layers[0], torch.nn.Linear(4, 4)]
    assert held_bytes(cache).total == base
    assert not any("model" in p or "layers" in p for p in cache_tensors(cache))


def test_nested_objects_cycles_and_depth():
    class Allocator:
        def __init__(self):
            self.free = torch.arange(6)
            self.owner = None

    cache = KVCache(n_layers=1, batch=1, n_kv_heads=1, max_len=4, head_dim=4)
    cache.allocator = Allocator()
    cache.allocator.owner = cache  # a cycle
    found = cache_tensors(cache)
    assert "allocator.free" in found
    assert held_bytes(cache).tensors["allocator.free"] == ("indices", 48)
    cache.deep = [[[[[[torch.zeros(3)]]]]]]
    assert not any(p.startswith("deep") for p in cache_tensors(cache, max_depth=3))
    assert "deep[0][0][0][0][0][0]" in cache_tensors(cache, max_depth=8)
    cache.mystery = torch.zeros(7)  # no rule names it: counted as other, never dropped
    assert held_bytes(cache).tensors["mystery"] == ("other", 28)


def test_classify_rules():
    i64, f32, f16, u8 = (torch.zeros(2, dtype=d) for d in (torch.int64, torch.float32, torch.float16, torch.uint8))
    assert classify("k[0]", f32) == classify("v_packed[1]", u8) == classify("c_kv", f32) == "payload"
    assert classify("k_scale[0]", f16) == classify("v_zero[3]", f16) == "scales"
    assert all(classify(f"{n}[0]", i64) == "indices" for n in ("index", "pos", "rot", "n_held"))
    assert classify("evicted", i64) == classify("seq_lens", i64) == classify("allocator.free", i64) == "indices"
    assert classify("score[0]", f32) == classify("obs[1]", f32) == "scores"
    assert classify("pos[0]", f32) == "other"  # a float "pos" is not an index
    assert classify("U_k[0]", f32) == classify("rope[0]", f32) == "other"


# ---- the budgeted caches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, kw", [(SlidingWindowCache, {}), (SinkCache, {"n_sink": 2})], ids=["window", "sinks"])
def test_budget_cache_breakdown_and_mean_fraction(model, cls, kw):
    budget, chunk, S = 8, 1, 9  # S slots = budget + chunk
    cache = cls.for_model(model, batch=1, budget=budget, chunk=chunk, kernels="torch", **kw)
    held = held_bytes(cache, float_bytes=2)
    L, H_KV, D = 2, 2, 16
    assert held.payload == L * 2 * H_KV * S * D * 2
    assert held.indices == L * (3 * H_KV * S * 8 + 8) + 8 + 4  # index, pos, rot, n_held per layer; evicted; seq_lens
    assert held.scores == L * H_KV * S * 2  # fp32 scores, counted at 2 bytes
    assert {p for p, (c, _) in held.tensors.items() if c == "indices"} == {
        f"{n}[{i}]" for n in ("index", "pos", "rot", "n_held") for i in range(L)} | {"evicted", "seq_lens"}
    assert {p for p, (c, _) in held.tensors.items() if c == "other"} == {"inv_freq"}  # the model's RoPE table

    config = model.config
    with MemoryMeter(cache, config) as meter:
        feed(model, cache, list(range(24)), [12, 4, 4, 4])  # a 12-token prefill, then 3 calls of 4
    assert [(n, T) for n, T, _ in meter.records] == [(12, 12), (16, 4), (20, 4), (24, 4)]
    assert meter.final_bytes == meter.peak_bytes == held.total  # preallocated: it never changes
    per_token = fp16_cache_bytes(config, 1)
    assert per_token == 2 * L * H_KV * D * 2
    assert meter.mean_fraction(start=12, part="payload") == pytest.approx((S / 16 + S / 20 + S / 24) / 3)
    want = (12 * held.total / (12 * per_token) + sum(4 * held.total / (n * per_token) for n in (16, 20, 24))) / 24
    assert meter.mean_fraction() == pytest.approx(want)
    assert cache.held(0) == budget


def test_window_over_the_second_half_is_34_6_percent():
    """The expert's figure: 256 positions held while the scored length runs 512..1023, against a full fp16
    cache of each length, average to 34.6% (a "25%" budget at 1024 tokens)."""
    config = ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=1)  # D = 8, one K/V head

    class Window:  # holds exactly 256 positions in fp16, whatever the length
        def __init__(self):
            self.k, self.v = (torch.zeros(1, 1, 256, 8, dtype=torch.float16) for _ in range(2))
            self.seq_lens = [0]

        def attend(self, layer_idx, q, k, v):
            self.seq_lens[0] += q.shape[2]
            return q

    cache, x = Window(), torch.zeros(1, 1, 1, 8)
    with MemoryMeter(cache, config) as meter:
        for _ in range(1024):
            cache.attend(0, x, x, x)
    frac = meter.mean_fraction(start=512)
    assert frac == pytest.approx(sum(256 / n for n in range(513, 1025)) / 512)
    assert abs(frac - 0.346) < 1e-3
    assert meter.records[-1][0] == 1024 and held_bytes(cache).total / fp16_cache_bytes(config, 1024) == 0.25


def test_snapkv_buffers_hold_the_kept_rows_and_the_evicting_variant_its_voters(model):
    budget, chunk, window = 8, 4, 4
    row = 2 * 2 * 16 * 2  # one slot of one layer: K and V x 2 K/V heads x D = 16 x 2 bytes (fp32 counted at 2)
    paper = SnapKVCache.for_model(model, batch=1, budget=budget, window=window, chunk=chunk, kernels="torch")
    ours = SnapKVCache.for_model(model, batch=1, budget=budget, window=window, chunk=chunk, kernels="torch",
                                 decode_evict=True)
    for cache in (paper, ours):
        with MemoryMeter(cache, model.config) as meter:
            feed(model, cache, list(range(26)), [16] + [1] * 10)  # a 16-token prompt, then 10 decoded tokens
        held = held_bytes(cache, float_bytes=2)
        obs = {p: b for p, (c, b) in held.tensors.items() if p.startswith("obs")}
        assert set(obs) == {"obs[0]", "obs[1]"} and all(held.tensors[p][0] == "scores" for p in obs)
        assert meter.peak_bytes == max(meter.initial.total, max(h.total for _, _, h in meter.records))
        if cache is paper:  # compressed once to 8, then every token kept: 18 held, slots grown by chunks to 20
            assert cache.held(0) == budget + 10 and cache.index[0].shape[2] == 20
            assert held.payload == 2 * 20 * row and all(b == 0 for b in obs.values())  # no voters kept
            assert meter.peak_bytes == held.total > meter.initial.total  # it grew with what it kept
        else:  # evicts back to 8 at every step: budget + chunk slots and the window's votes per slot
            assert cache.held(0) == budget and cache.index[0].shape[2] == budget + chunk
            assert held.payload == 2 * (budget + chunk) * row
            assert all(b == 2 * window * (budget + chunk) * 2 for b in obs.values())  # (B, H_KV, window, slots)
            assert meter.peak_bytes == held.total == meter.initial.total  # preallocated: constant


def test_h2o_scores_are_found(model):
    held = held_bytes(H2OCache.for_model(model, batch=1, budget=8, chunk=4, kernels="torch"))
    assert {p for p, (c, _) in held.tensors.items() if c == "scores"} == {"score[0]", "score[1]"}


# ---- low-bit and compressed caches ---------------------------------------------------------------


def test_kivi_codes_scales_and_residual(model):
    cache = KiviCache.for_model(model, batch=1, max_len=64, bits=2, group=4, residual=8, kernels="torch")
    feed(model, cache, list(range(20)), [11, 1, 4, 4])
    held = held_bytes(cache)
    assert held.payload + held.scales == cache.nbytes()
    assert held.indices == 4 and held.scores == held.other == 0  # seq_lens only
    cats = {p: c for p, (c, _) in held.tensors.items()}
    assert all(cats[f"{n}[{i}]"] == "scales" for n in ("k_scale", "k_zero", "v_scale", "v_zero") for i in range(2))
    assert all(cats[f"{n}[{i}]"] == "payload" for n in ("k_packed", "v_packed", "k", "v") for i in range(2))
    half = held_bytes(cache, float_bytes=2)  # only the fp32 residual shrinks: codes and fp16 scales are real
    residual = sum(t.nbytes for t in cache.k + cache.v)
    assert half.payload == held.payload - residual // 2 and half.scales == held.scales


def test_int8_values_and_scales(model):
    cache = Int8KVCache.for_model(model, batch=1, max_len=16, kernels="torch")
    feed(model, cache, list(range(6)), [5, 1])
    held, half = held_bytes(cache), held_bytes(cache, float_bytes=2)
    assert held.payload + held.scales == cache.nbytes() and held.compute_dtype is None
    assert held.scales == sum(t.nbytes for t in cache.k_scale + cache.v_scale)
    assert half.total == held.total  # nothing in an fp32 compute dtype to shrink


def test_low_rank_bases_and_cross_layer(model):
    eye = torch.eye(16)[:, :4].expand(2, 16, 4).contiguous()  # (H_KV, D, r)
    cache = LowRankKVCache.for_model(model, batch=1, max_len=8, bases=[(eye.clone(), eye.clone()) for _ in range(2)])
    held = held_bytes(cache)
    assert held.payload == cache.nbytes() and held.other == 4 * eye.nbytes  # U_k, U_v per layer: weights, in other
    shared_bases = LowRankKVCache.for_model(model, batch=1, max_len=8, bases=[(eye, eye)] * 2)
    assert held_bytes(shared_bases).other == eye.nbytes  # one basis tensor everywhere: one storage
    shared = CrossLayerKVCache.for_model(model, batch=1, max_len=8, share=2)
    with MemoryMeter(shared, model.config) as meter:
        feed(model, shared, list(range(4)), [3, 1])
    assert [n for n, _, _ in meter.records] == [3, 4]  # once per forward, on the model's last layer


# ---- the meter ---------------------------------------------------------------------------------------


def test_meter_restores_attend_after_errors(model):
    cache = KVCache.for_model(model, batch=1, max_len=8)
    with pytest.raises(RuntimeError, match="boom"):
        with MemoryMeter(cache, model.config):
            assert "attend" in vars(cache)
            raise RuntimeError("boom")
    assert "attend" not in vars(cache) and cache.attend.__func__ is KVCache.attend
    with pytest.raises(ValueError, match="layer_idx"):
        with MemoryMeter(cache, model.config):
            cache.attend(7, *(torch.zeros(1, 2, 1, 16) for _ in range(3)))
    assert "attend" not in vars(cache)
    with MemoryMeter(cache, model.config) as outer:  # nested meters: the inner puts the outer's wrapper back
        wrapper = cache.attend
        with MemoryMeter(cache, model.config) as inner:
            feed(model, cache, [1, 2], [2])
        assert cache.attend is wrapper
    assert len(outer.records) == len(inner.records) == 1 and "attend" not in vars(cache)


def test_bad_input_names_the_argument(model):
    cache, config = KVCache.for_model(model, batch=1, max_len=8), model.config
    for bad in (5, None, torch.zeros(2), model):
        with pytest.raises(TypeError, match="cache"):
            cache_tensors(bad)
    with pytest.raises(ValueError, match="float_bytes"):
        held_bytes(cache, float_bytes=3)
    with pytest.raises(TypeError, match="float_bytes"):
        held_bytes(cache, float_bytes="2")
    with pytest.raises(TypeError, match="config"):
        fp16_cache_bytes(None, 4)
    with pytest.raises(ValueError, match="n_tokens"):
        fp16_cache_bytes(config, -1)
    with pytest.raises(TypeError, match="n_tokens"):
        fp16_cache_bytes(config, 1.5)
    with pytest.raises(TypeError, match="cache"):
        MemoryMeter(object(), config)
    with pytest.raises(TypeError, match="config"):
        MemoryMeter(cache, {"n_layers": 2})
    with pytest.raises(ValueError, match="float_bytes"):
        MemoryMeter(cache, config, float_bytes=0)
    meter = MemoryMeter(cache, config)
    with pytest.raises(ValueError, match="entered"):
        meter.peak_bytes
    with meter:
        pass
    with pytest.raises(ValueError, match="start"):
        meter.mean_fraction()  # nothing recorded
    feed(model, cache, [1, 2, 3], [3])  # outside the meter: not recorded
    with meter:
        feed(model, cache, [4], [1])  # positions are only for the model here
    with pytest.raises(ValueError, match="start"):
        meter.mean_fraction(start=-1)
    with pytest.raises(ValueError, match="part"):
        meter.mean_fraction(part="bogus")
    assert meter.mean_fraction(start=3) == pytest.approx(held_bytes(cache, 2).total / fp16_cache_bytes(config, 4))
