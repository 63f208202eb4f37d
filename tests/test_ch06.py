"""kvlib.course.ch06: the harnesses chapter 06's cells call measure what they say they measure."""

import math

import pytest
import torch

from kvlib.course import ch06
from kvlib.model import ModelConfig, Transformer, load_tiny
from kvlib.quant import Int8KVCache, dequantize_int8, quantize_int8


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)).eval()


def test_record_kv_keeps_what_the_cache_is_given_and_changes_nothing(small):
    ids = torch.arange(1, 12)[None]
    rec = ch06.RecordKV()
    with torch.no_grad():
        out, ref = small(ids, cache=rec), small(ids)
    ks, vs = rec.layers()
    assert len(ks) == 2 and ks[0].shape == vs[1].shape == (2, 11, 8)  # (H_KV, T, D)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # a full-precision pass


def test_record_real_gives_the_keys_the_cache_stores(small):
    ids = list(range(3, 20))
    rec = ch06.RecordKV()
    with torch.no_grad():
        logits = small(torch.tensor([ids]), cache=rec)[0]
    k_pre, k_post, v, full = ch06.record_real(small, ids)
    for i in range(2):
        torch.testing.assert_close(k_post[i], rec.k[i], atol=1e-5, rtol=1e-5)  # hooks + apply_rope = the cached K
        torch.testing.assert_close(v[i], rec.v[i])
        assert not torch.allclose(k_pre[i], k_post[i])  # RoPE turned them
    torch.testing.assert_close(full, logits, atol=1e-5, rtol=1e-5)
    assert all(len(layer._forward_hooks) == 0 for blk in small.layers for layer in (blk.attn.wk, blk.attn.wv))


def test_error_table_orders_granularities_on_an_outlier_channel():
    g = torch.Generator().manual_seed(0)
    K = torch.randn(2, 64, 16, generator=g)
    K[:, :, 3] *= 20  # one channel large in every token
    V = torch.randn(2, 64, 16, generator=g) * torch.rand(1, 64, 1, generator=g) * 5  # tokens of different size
    table, per_layer = ch06.error_table([K], [V])
    assert table.loc["per-channel", "K"] < table.loc["per-token", "K"]
    assert table.loc["per-token", "V"] < table.loc["per-channel", "V"]
    k_hat, v_hat = ch06.kivi_groups(K, V)  # K per channel over groups of G = 32 tokens, V per token (D = 16 < G)
    assert table.loc[ch06.KIVI, "K"] == pytest.approx(ch06.rel_error(K, k_hat))
    assert table.loc[ch06.KIVI, "V"] == pytest.approx(table.loc["per-token", "V"])
    assert table.loc[ch06.KIVI, "K"] <= table.loc["per-channel", "K"] + 1e-9  # a smaller group never has a larger step
    b = table["scale bytes per number"]
    assert b["per-token"] == pytest.approx(2 / 16) and b["per-channel"] == pytest.approx(2 / 64)
    assert b[ch06.KIVI] == pytest.approx((2 / 32 + 2 / 16) / 2)
    assert table.loc[ch06.SHARED, "V"] > table.loc["per-tensor", "V"]  # V pays for K's larger max
    q, s = quantize_int8(torch.stack([K, V]), None)
    assert table.loc[ch06.SHARED, "K"] == pytest.approx(ch06.rel_error(K, dequantize_int8(q, s)[0]))


def test_rope_partners_are_i_and_i_plus_half():
    model, _ = load_tiny(device="cpu")
    D = model.config.head_dim
    partners = ch06.rope_partners(model, range(D))
    assert all(partners[i] == [i % (D // 2), i % (D // 2) + D // 2] for i in range(D))


def test_outlier_table_and_its_ratios(small):
    k_pre, k_post, v, _ = ch06.record_real(small, list(range(2, 30)))
    k_pre[1][0, :, 5] *= 50  # a planted outlier: layer 1, head 0, channel 5
    table, ratios, top = ch06.outlier_table(k_pre, k_post, v)
    assert ratios["K before RoPE"].shape == (2, 2) and int(top["K before RoPE"][1, 0]) == 5
    assert table.loc["K before RoPE", "layer of the max"] == 1
    assert table.loc["K before RoPE", "max over (layer, head)"] == pytest.approx(ratios["K before RoPE"].max().item())
    assert (table["median over (layer, head)"] >= 1).all()


def test_kivi_groups_are_per_channel_over_g_tokens_and_per_token_over_g_channels():
    g = torch.Generator().manual_seed(2)
    K, V = torch.randn(2, 70, 40, generator=g), torch.randn(2, 70, 40, generator=g)
    k_hat, v_hat = ch06.kivi_groups(K, V, G=32)
    torch.testing.assert_close(k_hat[:, 32:64], ch06.roundtrip(K[:, 32:64], 1))  # the second group of tokens alone
    torch.testing.assert_close(k_hat[:, 64:], ch06.roundtrip(K[:, 64:], 1))  # the short last group
    torch.testing.assert_close(v_hat[..., 32:], ch06.roundtrip(V[..., 32:], -1))  # channels 32..39 of each token
    bytes_ = ch06.scale_bytes(2, 70, 40, G=32)
    assert bytes_[ch06.KIVI] == pytest.approx((2 * 2 * 3 * 40 + 2 * 2 * 70 * 2) / (2 * 2 * 70 * 40))


def test_shared_scale_per_token_is_one_max_per_token_over_k_v_and_heads():
    k, v = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    v[0, 1, 2] *= 100  # token 2 of sequence 0 is large in V, head 1: only that token's scale changes
    k_hat, v_hat = ch06.shared_scale_per_token(k, v)
    for b, t in ((0, 2), (0, 3), (1, 2)):
        both = torch.stack([k[b, :, t], v[b, :, t]])
        q, s = quantize_int8(both, None)
        torch.testing.assert_close(k_hat[b, :, t], dequantize_int8(q, s)[0])
        torch.testing.assert_close(v_hat[b, :, t], dequantize_int8(q, s)[1])


def test_wilson_interval():
    lo, hi = ch06.wilson(197, 200)
    assert lo == pytest.approx(0.9568, abs=1e-4) and hi == pytest.approx(0.9949, abs=1e-4)
    assert ch06.wilson(0, 10)[0] == pytest.approx(0, abs=1e-12) and ch06.wilson(10, 10)[1] == pytest.approx(1)


def test_static_scales_from_the_same_text_never_clip():
    model, tok = load_tiny(device="cpu")
    rec = ch06.RecordKV()
    with torch.no_grad():
        model(torch.tensor([tok.encode("def f(x):\n    return x + 1\n")]), cache=rec)
    table = ch06.static_vs_dynamic(rec, rec)
    assert len(table) == 2 * model.config.n_layers and (table["share clipped"] == 0).all()


def test_cache_bytes_are_the_tensors_and_the_formula(small):
    table = ch06.cache_bytes(small, [8, 32])
    D, L, H_KV = 8, 2, 2  # head dim 32 / 4 heads
    assert table.loc[32, "fp16 bytes"] == 2 * L * H_KV * 32 * D * 2
    assert table.loc[32, "int8 + scales bytes"] == 2 * L * H_KV * 32 * (D + 2)
    assert table.loc[8, "int8 / fp16"] == pytest.approx((D + 2) / (2 * D))


def test_fake_quant_seam_with_no_quantization_is_the_model(small):
    ids = torch.arange(1, 10)[None]
    with torch.no_grad():
        out = small(ids, cache=ch06.FakeQuantKV(lambda k, v: (k, v)))
    torch.testing.assert_close(out, small(ids), atol=1e-5, rtol=1e-5)


def test_shared_scale_is_one_max_over_k_and_v_per_sequence():
    k, v = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    v[1] *= 100  # sequence 1's V is large: it must not change sequence 0's scale
    k_hat, v_hat = ch06.shared_scale(k, v)
    q, s = quantize_int8(torch.stack([k[0], v[0]]), None)
    torch.testing.assert_close(k_hat[0], dequantize_int8(q, s)[0])
    assert s.item() == pytest.approx(torch.stack([k[0], v[0]]).abs().max().item() / 127)


def test_perplexity_change_scores_every_scheme_on_the_same_tokens(small):
    ids = torch.randint(0, 40, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    names = [ch06.INT8_CACHE, ch06.SOURCE_TOKEN, ch06.SOURCE_WINDOW]
    table, ppl = ch06.perplexity_change(small, ids, window=49, windows=[0, 2], schemes=names, block=8,
                                        paired=[(ch06.SOURCE_WINDOW, ch06.INT8_CACHE)], n_boot=200)
    assert list(table.index) == names + [f"{ch06.SOURCE_WINDOW} vs {ch06.INT8_CACHE}"]
    assert (table["tokens scored"] == 2 * 48).all()  # every scheme, and the paired row, on the same tokens
    lo, mid, hi = table["95% low %"].astype(float), table["ppl change %"].astype(float), table["95% high %"].astype(float)
    assert ((lo <= mid + 1e-9) & (mid <= hi + 1e-9)).all()
    assert set(table["interval vs"]) <= {"below 1%", "above 1%", "contains 1%", "below 0%", "above 0%", "contains 0%"}
    assert 1 < ppl < 40 * 2 and (table.loc[names, "greedy agreement %"].astype(float) <= 100).all()
    one, _ = ch06.perplexity_change(small, ids, window=49, windows=[2], schemes=[ch06.SOURCE_WINDOW], block=8)
    alone, _ = ch06.perplexity_change(small, ids[98:147], window=49, windows=[0], schemes=[ch06.SOURCE_WINDOW], block=8)
    assert one.iloc[0]["ppl change %"] == pytest.approx(alone.iloc[0]["ppl change %"])  # window 2 is ids[98:147]
    pair = table.iloc[-1]["ppl change %"]
    a, b = table.loc[ch06.SOURCE_WINDOW, "ppl change %"], table.loc[ch06.INT8_CACHE, "ppl change %"]
    assert pair == pytest.approx(100 * ((1 + a / 100) / (1 + b / 100) - 1))  # a paired ratio of perplexities
    with pytest.raises(ValueError, match="tile"):
        ch06.perplexity_change(small, ids, window=48, windows=[0], schemes=names, block=8)  # 47 scored: no tiling


def test_our_side_of_the_tools_table_holds_the_quantized_prefix(small):
    prefix, chunk = list(range(1, 21)), list(range(21, 29))
    ours, chunk_exact, exact, held = ch06._ours(small, prefix, chunk)
    assert ours.shape == chunk_exact.shape == exact.shape == (8, 40)
    assert held == 2 * 2 * 2 * 20 * (8 + 2)  # K and V, 2 layers, 2 K/V heads, 20 positions, D int8 + an fp16 scale
    assert (ours - exact).abs().max() > 0 and (chunk_exact - exact).abs().max() > 0  # the prefix was quantized
    assert (ours - chunk_exact).abs().max() > 0  # and the chunk's own rows only in the first


def test_prefix_then_chunk_with_an_exact_prefix_is_the_model(small):
    from kvlib.cache import KVCache
    ids = list(range(1, 21))
    full = KVCache.for_model(small, 1, 20)
    with torch.no_grad():
        ref = small(torch.tensor([ids]))[0, 12:]
        small(torch.tensor([ids[:12]]), cache=full)
        seam = ch06._PrefixThenChunk([k[:, :, :12] for k in full.k], [v[:, :, :12] for v in full.v])
        out = small(torch.tensor([ids[12:]]), positions=torch.arange(12, 20)[None], cache=seam)[0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # causal over the chunk, all of the prefix


def test_gpu_reference_names_the_points_of_its_medians():
    from kvlib.bench import results

    lines = ch06.gpu_reference("int8")
    if lines in ([], [results.NO_REFERENCE]):
        pytest.skip("no committed int8 results")
    assert any("float16 decode" in line and "copy bandwidth" in line for line in lines)  # fp16's own share
    assert lines[-1].startswith("headline points (B, S): ")
    n = int(next(line for line in lines if line.startswith("int8 decode")).rsplit(", ", 1)[-1].split()[0])
    assert lines[-1].count("(") - 1 == n  # as many named points as the median uses


def test_hf_bytes_count_the_stored_tensors():
    cache_utils = pytest.importorskip("transformers.cache_utils")
    layer = cache_utils.Fp8QuantizedLayer()
    k = torch.randn(1, 2, 10, 8)
    layer.update(k, k)
    assert ch06._hf_bytes(layer) == 2 * (k.numel() * 1 + 4)  # one fp8 byte per number, one fp32 scale per tensor


def test_fp8_roundtrip_scales():
    x = torch.tensor([[1.0, -3.0, 0.1], [100.0, 2.0, 0.0]])
    assert ch06.fp8_roundtrip(x)[:, :2].abs().amax(dim=1).tolist() == pytest.approx([3.0, 100.0])  # the max survives
    torch.testing.assert_close(ch06.fp8_roundtrip(x, "none"), x.to(torch.float8_e4m3fn).float())
    assert ch06.fp8_roundtrip(torch.tensor([1000.0]), "none").item() == 448  # clamped to e4m3's range
    table = ch06.fp8_table({("m", "K"): [torch.randn(2, 16, 32)]})
    assert table.loc[("m", "K"), "fp8 / int8"] > 1 and math.isfinite(table.loc[("m", "K"), "row max / rms"])


def test_stats_wilson_refuses_bad_counts_and_separates_only_disjoint_intervals():
    from kvlib.stats import separated, wilson

    for bad in [(5, 4), (-1, 4), (0, 0)]:
        with pytest.raises(ValueError, match="k <= n"):
            wilson(*bad)
    with pytest.raises(TypeError, match="ints"):
        wilson(0.5, 4)
    assert wilson(0, 24)[0] == pytest.approx(0) and wilson(24, 24)[1] == pytest.approx(1) and wilson(0, 24)[1] > 0.1
    assert separated((0.1, 0.3), (0.4, 0.9)) and not separated((0.1, 0.5), (0.4, 0.9))


def test_hf_side_by_side_with_a_shared_prefix_is_the_table_of_one_prefix_forward_per_cache():
    pytest.importorskip("transformers")
    from kvlib.bench.peers import hf_model_from_kvlib

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=40, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=96)).eval()
    hf = hf_model_from_kvlib(model)
    backends = {"fp8": dict(backend="fp8")}  # as the notebook: each backend whose package imports
    for name, package, kw in (("hqq", "hqq", dict(backend="hqq", nbits=8, axis_key=1, axis_value=1, q_group_size=64)),
                              ("quanto", "optimum.quanto", dict(backend="quanto", nbits=4))):
        try:
            __import__(package)
            backends[name] = kw
        except ImportError:
            pass
    ids = torch.randint(0, 40, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    kw = dict(starts=[0, 40], backends=backends, prefix=64, chunk=8)
    shared = ch06.hf_side_by_side(hf, model, ids, share_prefix=True, **kw)
    separate = ch06.hf_side_by_side(hf, model, ids, share_prefix=False, **kw)
    assert list(shared.index) == [ch06.OURS_QUANT, ch06.OURS_EXACT, *backends]
    assert shared.equals(separate)  # bit for bit: every KL, agreement and byte count
    assert shared.loc["fp8", "mean KL (nats)"] > 0  # the prefix was stored quantized, not passed on exact
