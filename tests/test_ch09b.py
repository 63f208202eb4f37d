"""kvlib.course.ch09b, chapter 09b's harness: its tables, configurations, verdict lines and chart compute what they say."""

import math
from pathlib import Path

import matplotlib
import pytest
import torch

from kvlib.attention import attention_ref
from kvlib.cache import KVCache
from kvlib.course import ch09, ch09b, figures
from kvlib.footprint import fp16_cache_bytes, held_bytes
from kvlib.kivi import KiviCache, SnapKiviCache, kivi_decode_attention, kivi_decode_attention_ref
from kvlib.lowbit import LayerQuantCache
from kvlib.model import ModelConfig, Transformer

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=128)).eval()


def test_two_bit_table_at_equal_bytes_finds_the_outlier_channel():
    g = torch.Generator().manual_seed(0)
    K = [torch.randn(2, 64, 32, generator=g) + torch.tensor([20.0] + [0.0] * 31) for _ in range(3)]  # one outlier channel
    V = [torch.randn(2, 64, 32, generator=g) * torch.linspace(0.2, 5, 64)[None, :, None] for _ in range(3)]  # loud tokens
    t = ch09b.two_bit_table(K, V, bits=2, group=32)
    ch, tok = "per channel (groups of G tokens)", "per token (groups of G channels)"
    assert t.loc[("K", ch), "relative error"] < 0.5 * t.loc[("K", tok), "relative error"]
    assert t.loc[("V", tok), "relative error"] < t.loc[("V", ch), "relative error"]
    assert set(t["bytes per number"]) == {2 / 8 + 4 / 32}  # both axes store the same bytes
    assert (t["worst layer"] >= t["relative error"] - 1e-12).all()


def test_two_bit_table_is_the_round_trip_it_names():
    from kvlib.lowbit import dequantize_asym, quantize_asym

    x = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(1))
    t = ch09b.two_bit_table([x], [x], bits=2, group=4)
    q, s, z = quantize_asym(x.reshape(1, 2, 4, 4), 2, dim=2)  # per channel over groups of 4 tokens
    err = ((dequantize_asym(q, s, z).reshape(1, 8, 4) - x).norm() / x.norm()).item()
    assert t.loc[("K", "per channel (groups of G tokens)"), "relative error"] == pytest.approx(err)


def test_decode_args_read_the_live_cache(model):
    cache = KiviCache.for_model(model, 1, 64, bits=2, group=8, residual=8, flush="residual")
    with torch.no_grad():
        model(torch.arange(29)[None] % 64, cache=cache)
    q = torch.randn(1, 4, model.config.head_dim, generator=torch.Generator().manual_seed(2))
    args = ch09b.decode_args(cache, layer=2, q=q)
    keys, values = cache._held_kv(2, 29, torch.float32)  # what the cache gives back, dequantized
    want = attention_ref(q[:, :, None], keys, values, causal=False)[:, :, 0]
    assert torch.allclose(kivi_decode_attention_ref(*args), want, atol=1e-5)
    assert torch.allclose(kivi_decode_attention(*args), want, atol=1e-4)


def test_seen_lengths_counts_what_snapkv_dropped(model):
    cache = SnapKiviCache.for_model(model, 1, 64, budget=12, window=4, bits=2, group=8, residual=8)
    view = ch09b.SeenLengths(cache)
    with ch09.Meter(view, model.config) as meter, torch.no_grad():
        model(torch.arange(40)[None] % 64, cache=view, logits_to_keep=1)
        model(torch.tensor([[5, 6]]), positions=view.next_positions() + torch.arange(2), cache=view)
    assert cache.held(0) == 14 and int(view.seq_lens[0]) == 42
    assert [n for n, _, _ in meter.records] == [40, 42]  # the true lengths, not the 12 and 14 held
    n, _, b = meter.records[-1]
    assert b == held_bytes(cache, float_bytes=2).total and meter.mean_fraction() < 1
    assert meter.mean_fraction(start=40) == pytest.approx(b / fp16_cache_bytes(model.config, 42))


def test_configurations_measure_what_each_cache_holds(model):
    cfgs = ch09b.configurations(model, ["full cache", "KIVI 2-bit, R=32"])
    (make_full, grows_full), (make_kivi, grows_kivi) = cfgs.values()
    assert grows_full(100) == held_bytes(KVCache.for_model(model, 1, 100), float_bytes=2).total
    assert grows_full(100) == pytest.approx(fp16_cache_bytes(model.config, 100), rel=1e-3)  # + its lengths
    assert grows_kivi(100) == held_bytes(KiviCache.for_model(model, 1, 100, bits=2, residual=32, **ch09b.KIVI),
                                         float_bytes=2).total
    assert grows_kivi(100) < grows_full(100) and grows_kivi(2000) < 0.25 * grows_full(2000)  # the windows amortize
    assert isinstance(make_kivi(2, 50), KiviCache) and make_kivi(2, 50).bits == 2


def test_layer_plans_spend_equal_bytes_and_differ_only_in_where(model):
    sens = [0.5, 0.01, 0.2, 0.03]
    plans = ch09b.layer_plans(model, sens)
    most, least = plans["6 bits: INT8 on the most sensitive"], plans["6 bits: INT8 on the least sensitive"]
    assert sorted(most) == sorted(least) and most != least
    assert [most[i] for i in (0, 2)] == [8, 8] and [least[i] for i in (1, 3)] == [8, 8]
    probe = LayerQuantCache.for_model(model, 1, 32, [16] * 4)
    fp16 = plans["FP16 on the most sensitive, INT2 elsewhere"]
    assert sum(probe.layer_bytes(b) for b in fp16) <= 4 * probe.layer_bytes(4) + 1e-9  # uniform INT4's bytes
    assert set(fp16) <= {16, 2}
    cfgs = ch09b.configurations(model, list(plans))  # the plans join the configurations
    _, grows = cfgs["uniform INT4"]
    assert grows(64) == pytest.approx(LayerQuantCache.for_model(model, 1, 64, [4] * 4).bytes_per_token(length=64) * 64)


def _row(nll, **extra):
    ppl = math.exp(nll.mean().item())
    return {"nll": nll, "perplexity": ppl, "ppl low": 0.9 * ppl, "ppl high": 1.1 * ppl, "memory": 0.5, "peak": 0.6,
            **extra}


def test_ppl_verdict_speaks_only_where_the_interval_excludes_one():
    g = torch.Generator().manual_seed(3)
    base = torch.rand(256, generator=g) * 3
    noise = 0.01 * torch.randn(256, generator=g)
    assert ch09b.ppl_verdict("a", _row(base + noise), "b", _row(base)).endswith("not separated")
    line = ch09b.ppl_verdict("a", _row(base + 0.5), "b", _row(base))
    assert line.endswith(": b lower") and line.startswith("perplexity a / b: 1.649")
    assert ch09b.ppl_verdict("a", _row(base - 0.5), "b", _row(base)).endswith(": a lower")


def test_ppl_verdict_needs_every_block_size_to_separate():
    # the difference changes only every 64 tokens: blocks of 16 and 32 repeat the same 8 values and overstate how
    # many independent pieces the text holds, so their intervals are narrower and exclude 1; blocks of 64 do not
    base = torch.rand(512, generator=torch.Generator().manual_seed(6)) * 3
    shift = (-0.06 + 0.1 * torch.tensor([1.0, -1.0] * 4)).repeat_interleave(64)
    a, b = _row(base + shift), _row(base)
    ratio, iv = ch09b.ppl_intervals(a, b, (16, 32, 64))
    assert ratio == pytest.approx(math.exp(shift.mean().item()))
    assert iv[32] == pytest.approx(ch09.ppl_ratio_interval(a["nll"], b["nll"], block=32)[1:])
    assert iv[16][1] < 1 and iv[32][1] < 1 and iv[64][1] >= 1  # the case the helper exists for
    line = ch09b.ppl_verdict("a", a, "b", b)
    lo, hi = iv[32]
    assert line == f"perplexity a / b: {ratio:.3f} [{lo:.3f}, {hi:.3f}]: not separated"  # the README reads this format
    assert ch09b.ppl_verdict("a", a, "b", b, blocks=(16, 32)).endswith(": a lower")
    shown = ch09b.ppl_verdict("a", a, "b", b, show=True).split("\n")
    assert shown[0] == line and len(shown) == 2
    assert shown[1] == "  paired 95% intervals, blocks of " + ", ".join(
        f"{k} tokens [{iv[k][0]:.3f}, {iv[k][1]:.3f}]" for k in (16, 32, 64))


def test_robust_side_is_one_side_for_all_or_none():
    assert ch09b.robust_side({16: (0.9, 0.99), 32: (0.92, 0.98)}) == -1
    assert ch09b.robust_side({16: (1.01, 1.2), 32: (1.02, 1.1)}) == 1
    assert ch09b.robust_side({16: (0.9, 0.99), 32: (0.95, 1.001)}) == 0
    assert ch09b.robust_side({16: (0.9, 0.99), 32: (1.01, 1.1)}) == 0  # opposite sides: no direction


def test_summary_and_chart_name_every_row_and_the_frontier():
    g = torch.Generator().manual_seed(4)
    base = torch.rand(64, generator=g) * 3
    pk = dict(**{"passkey k": 12, "passkey n": 24, "passkey low": 0.3, "passkey high": 0.7, "passkey memory": 0.5,
                 "passkey peak": 0.55})
    rows = {"full cache": _row(base, **{**pk, "passkey": 0.5, "memory": 1.0, "peak": 1.0, "passkey memory": 1.0}),
            "small": _row(base + 0.2, **{**pk, "passkey": 0.5, "memory": 0.2, "peak": 0.25, "passkey memory": 0.2}),
            "worse": _row(base + 0.4, memory=0.6)}  # perplexity only: left panel alone
    table = ch09b.summary(rows)
    assert list(table.index) == list(rows) and table.loc["worse", "passkey"] == "-"
    assert table.loc["full cache", "÷ full cache (95%)"].startswith("1.000")
    fig, fronts = ch09b.chart(rows, {"small": "S"})
    assert fronts["perplexity"] == ["small", "full cache"]  # "worse" holds more than "small" and does worse
    assert fronts["passkey"] == ["small"]
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sorted(texts) == sorted(["full cache", "S", "worse"]) and len(fig.axes[1].texts) == 2
    assert figures.figure_problems(fig) == []
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert not any("counted by formula" in t for t in legend)
    fig, _ = ch09b.chart(rows, {"small": "S"}, counted={"worse"})  # a simulated format's row: drawn hollow, named
    dots = [a for a in fig.axes[0].lines if a.get_marker() == "o" and len(a.get_xdata())]  # the drawn points
    hollow = [a for a in dots if a.get_markerfacecolor() == "white"]
    assert len(dots) == 3 and len(hollow) == 1 and list(hollow[0].get_xdata()) == [60.0]  # "worse", at its memory
    assert any("counted by formula" in t.get_text() for t in fig.axes[0].get_legend().get_texts())
    assert not any("counted by formula" in t.get_text() for t in fig.axes[1].get_legend().get_texts())  # not on it
    assert figures.figure_problems(fig) == []


def test_mla_table_counts_the_cited_bytes():
    t = ch09b.mla_table()
    v2 = t.loc["DeepSeek-V2"]
    assert int(v2["MLA bytes/token"]) == 60 * (512 + 64) * 2  # 60 layers, latent 512 + RoPE key 64, bf16
    assert int(v2["MHA bytes/token (materialized)"]) == 60 * 128 * ((128 + 64) + 128) * 2  # keys 192 wide, values 128
    assert int(v2["MHA bytes/token (paper: 2 n_h d_h l)"]) == 2 * 128 * 128 * 60 * 2  # the paper's table 1, d_h = 128
    assert v2["MLA / MHA % (paper)"] == pytest.approx(100 * 69120 / 3932160)
    assert v2["as GQA groups (paper's d_h)"] == pytest.approx(2.25)  # the paper's comparison


def test_quanto_bytes_count_every_float_at_two_bytes():
    class Q:  # the parts of a quanto tensor _quanto_bytes reads
        def __init__(self, codes, groups):
            self._data = torch.zeros(codes, dtype=torch.uint8)
            self._scale, self._shift = torch.zeros(groups), torch.zeros(groups)  # fp32, as quanto keeps them

    class Layer:
        _quantized_keys, _quantized_values = Q(64, 8), Q(64, 8)
        keys, values = torch.zeros(0), torch.zeros(2, 3)  # no exact key; six exact values

    assert ch09b._quanto_bytes(Layer()) == 2 * (64 + 2 * 2 * 8) + 2 * 6
    assert ch09b._quanto_bytes(Layer(), float_bytes=4) == 2 * (64 + 4 * 2 * 8) + 4 * 6


def test_cla_losses_compare_against_a_fine_tuned_control():
    losses, sizes = ch09b.cla_losses(steps=1, eval_windows=2, seq_len=32)
    assert list(losses) == ["original", "shared, no fine-tune", "shared + fine-tune", "control (no sharing) + fine-tune"]
    assert losses["shared, no fine-tune"] > losses["original"]
    assert sizes["plain cache"] == 2 * sizes["CLA-2 cache"]


def test_snapkv_points_are_09as_and_share_its_budget(model):
    cfgs = ch09b.configurations(model, ["SnapKV 50% of prompt + KIVI 2-bit", "SnapKV 50% of prompt (09a)"])
    (make_sk, grows_sk), (make_s, grows_s) = cfgs.values()
    assert grows_s is None  # an eviction cache is measured as it is
    for length, kept in ((ch09.N_TEXT, ch09.budget_for(0.25, ch09.N_TEXT)), (ch09.P_LEN, ch09.budget_for(0.5, ch09.P_LEN))):
        assert make_s(1, length).budget == kept  # 09a's "SnapKV 25%" on the text, "SnapKV 50%" on the passkey
        view = make_sk(1, length)
        assert isinstance(view, ch09b.SeenLengths) and view.cache.budget == kept
    with torch.no_grad():  # grows reads the live cache's held positions, not the length seen
        model(torch.arange(ch09.P_LEN)[None] % 64, cache=view, logits_to_keep=1)
    kept = ch09.budget_for(0.5, ch09.P_LEN)
    assert grows_sk(ch09.P_LEN) == held_bytes(KiviCache.for_model(model, 1, kept, bits=2, residual=32, **ch09b.KIVI),
                                              float_bytes=2).total


def test_headline_is_one_short_line():
    g = torch.Generator().manual_seed(5)
    row = _row(torch.rand(64, generator=g), **{"passkey k": 20, "passkey n": 24, "passkey memory": 0.344})
    line = ch09b.headline("6 bits: INT8 on the most sensitive", row)
    assert line.startswith("6 bits: INT8 on the most sensitive: held 50.0% of fp16 (peak 60.0%), perplexity ")
    assert line.endswith("; passkey 20/24 = 83% [64, 93] at 34.4%") and len(line.split()) <= 30
    assert "passkey" not in ch09b.headline("x", _row(torch.rand(64, generator=g)))


def test_low_rank_memory_leaves_the_shared_bases_out(model):
    specs = {"r": (8, "pre_rope", "low_rank")}
    (make, grows), = ch09b.low_rank_configurations(model, torch.arange(48)[None] % 64, specs).values()
    cache = make(1, 100)
    coeffs = sum(2 * t.numel() for t in cache.k + cache.v)  # (B, H_KV, S, r) coefficients, 2 bytes each
    assert grows(100) < held_bytes(make(1, 92), float_bytes=2).total  # the bases are not counted
    assert grows(100) == pytest.approx(coeffs * 100 / 108, rel=0.02)  # what is left: the coefficients (+ lengths)


def test_layer_sensitivity_is_the_librarys_bit_for_bit(model):
    from kvlib.lowbit import layer_sensitivity

    ids = torch.arange(40) * 7 % 64
    assert ch09b.layer_sensitivity(model, ids, bits=2, group=8) == layer_sensitivity(model, ids, bits=2, group=8)


def test_one_recording_gives_both_keys_and_the_librarys_fits(model):
    from kvlib.compress import fit_low_rank, low_rank_error, record_kv

    ids, fit_ids = torch.arange(48)[None] * 5 % 64, torch.arange(48)[None] * 3 % 64
    ch09b._RECORDED.clear()
    pre, post, v = ch09b.record(model, ids)
    for mine, keys in ((pre, "pre_rope"), (post, "post_rope")):
        ks, vs = record_kv(model, ids, keys=keys)
        assert all(torch.equal(a, b[0]) for a, b in zip(mine, ks)) and all(torch.equal(a, b[0]) for a, b in zip(v, vs))
        want = low_rank_error(model, ids, [4, 8], fit_ids=fit_ids, keys=keys)
        assert ch09b._low_rank_error(model, ids, [4, 8], fit_ids, keys) == want
        mine_bases, lib = ch09b._fit_low_rank(model, fit_ids, 8, keys), fit_low_rank(model, fit_ids, 8, keys=keys)
        assert mine_bases.fitted_keys == keys and all(torch.equal(a, b) for p, q in zip(mine_bases, lib) for a, b in zip(p, q))
    assert len(ch09b._RECORDED) == 2  # ids and fit_ids, each recorded once


def test_kivi_caches_that_attend_the_prompt_exactly_share_its_prefill(model):
    cfgs = ch09b.configurations(model, ["KIVI 2-bit, R=32", "2-bit, prompt through the codes (not KIVI), R=32",
                                        "SnapKV 50% of prompt + KIVI 2-bit", "INT8 (chapter 06)"])
    made = {name: make(1, 64) for name, (make, _) in cfgs.items()}
    assert made["KIVI 2-bit, R=32"].prefill_whole and made["SnapKV 50% of prompt + KIVI 2-bit"].prefill_whole
    assert not made["2-bit, prompt through the codes (not KIVI), R=32"].prefill_whole  # the prompt reads its codes
    assert not getattr(made["INT8 (chapter 06)"], "prefill_whole", False)  # INT8 attends through its codes too
    if not hasattr(ch09, "prefill"):
        pytest.skip("kvlib.course.ch09 has no shared prefill (ch09.prefill)")
    prompt = torch.arange(40)[None] * 3 % 64
    with torch.no_grad():
        ch09.prefill(model, ch09.full_cache(model)[0](1, 64), prompt)  # the full cache records the prompt
    for name in ("KIVI 2-bit, R=32", "SnapKV 50% of prompt + KIVI 2-bit"):  # the replayed prefill is the plain one
        plain, shared = cfgs[name][0](1, 64), cfgs[name][0](1, 64)
        with torch.no_grad():
            want, got = model(prompt, cache=plain, logits_to_keep=1), ch09.prefill(model, shared, prompt)
        assert torch.equal(got, want)
        plain, shared = getattr(plain, "cache", plain), getattr(shared, "cache", shared)  # SeenLengths: its cache
        assert torch.equal(plain.seq_lens, shared.seq_lens)
        assert all(torch.equal(a, b) for a, b in zip(plain.k_packed + plain.k, shared.k_packed + shared.k))


def test_quanto_unpacks_in_pytorch_the_bytes_its_cpp_extension_gives():
    """kvlib.bench.peers.quanto_unpack_in_pytorch spares quanto's C++ build: the PyTorch unpack must undo quanto's
    own packing exactly, and equal the C++ unpack wherever that build already exists (it is never built here)."""
    pytest.importorskip("optimum.quanto")
    from optimum.quanto.library.extensions import get_extension
    from optimum.quanto.tensor.packed import pack_weights

    from kvlib.bench.peers import quanto_unpack_in_pytorch, unpack_codes

    g = torch.Generator().manual_seed(0)
    for bits in (2, 4):
        for shape in ((37, 129), (8, 3, 5), (4,)):
            codes = torch.randint(0, 2 ** bits, shape, dtype=torch.uint8, generator=g)
            packed = pack_weights(codes, bits)
            assert torch.equal(unpack_codes(packed, bits)[:shape[0]], codes), (bits, shape)
    ext = get_extension("quanto_cpp")
    assert quanto_unpack_in_pytorch() and quanto_unpack_in_pytorch()  # idempotent
    if (Path(ext.build_directory) / f"{ext.name}.so").exists():  # built by an earlier run: compare with it
        from torch.utils.cpp_extension import load

        lib = load(name=ext.name, sources=ext.sources, extra_cflags=ext.extra_cflags, build_directory=ext.build_directory)
        packed = torch.randint(0, 256, (33, 65), dtype=torch.uint8, generator=g)
        for bits in (2, 4):
            assert torch.equal(lib.unpack(packed, bits), unpack_codes(packed, bits))
    packed = pack_weights(torch.tensor([[3, 1], [0, 2]], dtype=torch.uint8), 2)  # through quanto's own op now
    assert torch.ops.quanto.unpack(packed, 2)[:2].tolist() == [[3, 1], [0, 2]]
