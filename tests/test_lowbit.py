"""Chapter 09's low-bit building blocks (asymmetric quantization, 2-bit packing) and mixed precision by layer
(KIVI itself: tests/test_kivi.py)."""

import pytest
import torch

from kvlib.cache import KVCache
from kvlib.generate import generate
from kvlib.lowbit import (LayerQuantCache, dequantize_asym, kl_divergence, layer_sensitivity, pack_2bit, pack_bits,
                          plan_bits, quantize_asym, quantize_keys_per_channel, quantize_values_per_token, unpack_2bit,
                          unpack_bits)
from kvlib.model import load_tiny



def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny(device="cpu")


# --------------------------------------------------------------------------------------------
# quantize / dequantize / pack
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [-1, 0, (0, 2), None])
def test_round_trip_is_within_half_a_step(bits, dim):
    x = rand(5, 4, 32, seed=bits) * 3 + 1
    q, scale, zero = quantize_asym(x, bits, dim)
    assert q.dtype == torch.uint8 and int(q.max()) <= 2 ** bits - 1
    assert scale.dtype == zero.dtype == torch.float32 and scale.dim() == x.dim()
    err = (dequantize_asym(q, scale, zero) - x).abs()
    assert (err <= scale / 2 + 1e-5).all()


def test_constant_groups_come_back_exactly():
    x = torch.full((3, 8), -2.5)
    x[1] = torch.arange(8.0)
    q, scale, zero = quantize_asym(x, 2, dim=-1)
    assert scale[0].item() == 1.0 and torch.equal(q[0], torch.zeros(8, dtype=torch.uint8))
    back = dequantize_asym(q, scale, zero)
    assert torch.equal(back[0], x[0]) and torch.equal(back[2], x[2])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_are_inverse(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (3, 2, 5, 16), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 2, 5, 16 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, bits), codes)


def test_pack_2bit_layout_value_j_in_bits_2j():
    codes = torch.tensor([[3, 0, 0, 0, 0, 1, 2, 3]], dtype=torch.uint8)
    packed = pack_2bit(codes)
    assert packed.tolist() == [[3, 1 * 4 + 2 * 16 + 3 * 64]]
    assert torch.equal(unpack_2bit(packed), codes)


def test_keys_per_channel_and_values_per_token():
    k, v = rand(2, 3, 48, 16, seed=1), rand(2, 3, 48, 16, seed=2)
    k[..., 5] += 20  # an outlier channel: per channel, it costs the other channels nothing
    q, scale, zero = quantize_keys_per_channel(k, group=16)
    assert q.shape == k.shape and scale.shape == zero.shape == (2, 3, 3, 16)
    back = dequantize_asym(q, scale.repeat_interleave(16, 2), zero.repeat_interleave(16, 2))
    assert ((back - k).abs() <= scale.repeat_interleave(16, 2) / 2 + 1e-5).all()
    assert torch.allclose(zero[:, :, 1], k[:, :, 16:32].amin(2))  # the min over the group's 16 tokens
    q, scale, zero = quantize_values_per_token(v, bits=4)
    assert q.shape == v.shape and scale.shape == zero.shape == (2, 3, 48, 1) and int(q.max()) <= 15


def test_bad_quantization_inputs():
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8\), got 3"):
        quantize_asym(torch.ones(4), 3)
    with pytest.raises(TypeError, match="floating-point"):
        quantize_asym(torch.ones(4, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_asym(torch.tensor([1.0, float("inf")]), 2)
    q, s, z = quantize_asym(torch.randn(4, 8), 2)
    with pytest.raises(TypeError, match="q must be a uint8 tensor"):
        dequantize_asym(q.to(torch.int8), s, z)
    with pytest.raises(ValueError, match="zero of shape"):
        dequantize_asym(q, s, torch.zeros(8, 4))
    with pytest.raises(ValueError, match="multiple of 4 to pack 4 2-bit codes"):
        pack_2bit(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"2-bit codes \(0..3\), got a 4"):
        pack_2bit(torch.full((1, 4), 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pack_2bit(torch.zeros(1, 4, dtype=torch.int8))
    with pytest.raises(TypeError, match="uint8"):
        unpack_2bit(torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="S=40 tokens, which must be a multiple of group=16"):
        quantize_keys_per_channel(torch.randn(1, 1, 40, 8), group=16)
    with pytest.raises(ValueError, match=r"k must be a \(B, H_KV, S, D\) tensor"):
        quantize_keys_per_channel(torch.randn(40, 8), group=8)


# --------------------------------------------------------------------------------------------
# mixed precision by layer
# --------------------------------------------------------------------------------------------


def test_layer_cache_at_16_bits_is_the_contiguous_cache(model):
    prompts = [[5, 6, 7, 8], [3, 9]]
    full = generate(model, prompts, 10, cache=KVCache.for_model(model, 2, 14, kernels="torch"))
    assert torch.equal(generate(model, prompts, 10, cache=LayerQuantCache.for_model(model, 2, 14, [16, 16],
                                                                                     kernels="torch")), full)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        a = model(ids, cache=KVCache.for_model(model, 1, 5, kernels="torch"))
        b = model(ids, cache=LayerQuantCache.for_model(model, 1, 5, [16, 16], kernels="torch"))
        c = model(ids, cache=LayerQuantCache.for_model(model, 1, 5, [16, 2], kernels="torch"))
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.isfinite(c).all()


def test_layer_cache_per_token_keys_store_the_dequantized_values_and_count_the_real_bytes(tiny):
    model, _ = tiny
    c = model.config
    cache = LayerQuantCache.for_model(model, 1, 16, [16, 8, 4, 2], keys="per_token")
    with torch.no_grad():
        model(torch.tensor([list(range(65, 81))]), cache=cache)
    for layer, bits in enumerate([8, 4, 2], start=1):
        rows = cache.k[layer][0].reshape(-1, c.head_dim)
        assert max(r.unique().numel() for r in rows) <= 2 ** bits
    H_KV, D = c.n_kv_heads, c.head_dim
    assert cache.bytes_per_token() == 2 * H_KV * (D * 2 + (D + 4) + (D / 2 + 4) + (D / 4 + 4))
    assert cache.bytes_per_token(length=5) == cache.bytes_per_token()  # per token: no partial group
    assert cache.nbytes() == KVCache.for_model(model, 1, 16).nbytes()  # a simulation: nothing is saved


def full_precision_kv(model, ids):
    cache = KVCache.for_model(model, 1, len(ids), kernels="torch")
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache)
    return cache


@pytest.mark.parametrize("bits", [2, 4])
def test_layer_cache_keys_per_channel_quantize_complete_groups_and_keep_the_newest_exact(tiny, bits):
    """Layer 0's K/V do not depend on the cache: its keys must be quantize_keys_per_channel of the exact keys
    over the complete groups of 8, exact in the partial group; its values quantized per token."""
    model, _ = tiny
    ids, G = list(range(65, 85)), 8  # 20 tokens: groups 0..7, 8..15 complete, 16..19 exact
    full = full_precision_kv(model, ids)
    cache = LayerQuantCache.for_model(model, 1, 20, [bits, 16, 16, 16], kernels="torch", group=G)
    with torch.no_grad():
        model(torch.tensor([ids[:13]]), cache=cache)  # group 1 still partial after this call ...
        for t in range(13, 20):  # ... completed by decode step 15
            model(torch.tensor([[ids[t]]]), positions=torch.tensor([[t]]), cache=cache)
    k, k_exact = cache.k[0][:, :, :20], full.k[0]
    q, scale, zero = quantize_keys_per_channel(k_exact[:, :, :16], group=G, bits=bits)
    want = dequantize_asym(q, scale.half().repeat_interleave(G, 2), zero.half().repeat_interleave(G, 2))
    torch.testing.assert_close(k[:, :, :16], want, atol=1e-6, rtol=0)
    torch.testing.assert_close(k[:, :, 16:], k_exact[:, :, 16:], atol=1e-5, rtol=0)  # the partial group: exact
    assert (k[:, :, :16] - k_exact[:, :, :16]).abs().max() > 1e-3  # (and the complete ones are not)
    assert max(k[0, h, :8, d].unique().numel() for h in range(2) for d in range(8)) <= 2 ** bits  # per channel
    assert max(cache.v[0][0, h, t].unique().numel() for h in range(2) for t in range(20)) <= 2 ** bits  # per token
    with torch.no_grad():
        one_call = LayerQuantCache.for_model(model, 1, 20, [bits, 16, 16, 16], kernels="torch", group=G)
        model(torch.tensor([ids]), cache=one_call)
    torch.testing.assert_close(one_call.k[0], cache.k[0], atol=1e-5, rtol=0)  # the same groups, however fed


def test_layer_cache_per_channel_keys_with_ragged_sequences(model):
    """Each sequence completes its own groups at its own length: a batch of two ragged prompts gives each
    prompt's tokens and layer-0 keys alone."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 9]]
    batch = LayerQuantCache.for_model(model, 2, 20, [2, 2], kernels="torch", group=4)
    out = generate(model, prompts, 9, cache=batch)
    for b, p in enumerate(prompts):
        alone = LayerQuantCache.for_model(model, 1, 20, [2, 2], kernels="torch", group=4)
        assert out[b].tolist() == generate(model, [p], 9, cache=alone)[0].tolist()
        n = len(p) + 8
        torch.testing.assert_close(batch.k[0][b, :, :n], alone.k[0][0, :, :n], atol=1e-5, rtol=0)


def test_layer_cache_per_channel_bytes_count_scales_zeros_and_the_exact_residual(tiny):
    model, _ = tiny
    c = model.config
    H_KV, D, G = c.n_kv_heads, c.head_dim, 8
    cache = LayerQuantCache.for_model(model, 1, 16, [16, 8, 4, 2], group=G)
    layer = {16: 2 * H_KV * D * 2}
    for b in (8, 4, 2):  # keys: codes + fp16 scale and zero per channel per group; values: codes + 4 B per token
        layer[b] = H_KV * (D * b / 8 + 4 * D / G) + H_KV * (D * b / 8 + 4)
        assert cache.layer_bytes(b) == layer[b]
    assert cache.layer_bytes(16) == layer[16]
    assert cache.bytes_per_token() == sum(layer.values())
    exact_keys = H_KV * D * 2  # one fp16 key row per K/V head
    for n in (8, 16, 21):
        want = sum(layer.values()) + sum((n % G) * (exact_keys - H_KV * (D * b / 8 + 4 * D / G)) / n for b in (8, 4, 2))
        assert cache.bytes_per_token(length=n) == pytest.approx(want)
    assert cache.bytes_per_token(length=21) > cache.bytes_per_token()  # 5 exact keys cost more than codes


def test_layer_cache_bad_bits(model):
    with pytest.raises(ValueError, match=r"one entry per layer \(2\)"):
        LayerQuantCache.for_model(model, 1, 8, [16])
    with pytest.raises(ValueError, match=r"bits must be one of \(16, 8, 4, 2\), got 3"):
        LayerQuantCache.for_model(model, 1, 8, [16, 3])
    with pytest.raises(ValueError, match="one entry per layer"):
        LayerQuantCache.for_model(model, 1, 8, 16)
    with pytest.raises(ValueError, match=r"keys must be one of \('per_channel', 'per_token'\)"):
        LayerQuantCache.for_model(model, 1, 8, [16, 2], keys="per_row")
    with pytest.raises(ValueError, match="group must be >= 1"):
        LayerQuantCache.for_model(model, 1, 8, [16, 2], group=0)
    with pytest.raises(ValueError, match="length must be >= 1"):
        LayerQuantCache.for_model(model, 1, 8, [16, 2]).bytes_per_token(length=0)
    with pytest.raises(ValueError, match="bits must be one of"):
        LayerQuantCache.for_model(model, 1, 8, [16, 2]).layer_bytes(3)


def test_sensitivity_is_positive_and_grows_as_bits_shrink(tiny):
    model, tok = tiny
    ids = tok.encode("Compute the running median of a stream of numbers and return it as a float.")
    s2 = layer_sensitivity(model, ids, bits=2)
    s8 = layer_sensitivity(model, torch.tensor(ids), bits=8)
    assert len(s2) == len(s8) == model.config.n_layers
    assert all(a >= 0 and b >= 0 for a, b in zip(s2, s8))
    assert all(a > b for a, b in zip(s2, s8)), (s2, s8)
    assert layer_sensitivity(model, ids, bits=16) == [0.0] * model.config.n_layers
    per_token = layer_sensitivity(model, ids, bits=2, keys="per_token")
    assert per_token != s2 and all(s > 0 for s in per_token)  # the key layout reaches the cache
    with pytest.raises(ValueError, match="1-D list or tensor of token ids"):
        layer_sensitivity(model, [[1, 2]])


def test_plan_bits_respects_the_budget_and_prefers_sensitive_layers():
    sens = [0.3, 0.01, 0.9, 0.05, 0.2, 0.02]
    for budget in (2, 2.5, 3, 4, 5, 6.7, 8):
        plan = plan_bits(sens, budget)
        assert sum(plan) / len(plan) <= budget and set(plan) <= {8, 4, 2}
        order = sorted(range(len(sens)), key=lambda i: -sens[i])
        assert all(plan[a] >= plan[b] for a, b in zip(order, order[1:]))  # more sensitive: never fewer bits
    assert plan_bits(sens, 8) == [8] * 6 and plan_bits(sens, 2) == [2] * 6
    assert plan_bits(sens, 3) == [4, 2, 4, 2, 4, 2]  # 18 bits: the three most sensitive layers get 4
    assert plan_bits(sens, 3.5) == [4, 2, 4, 4, 4, 2]  # 20 of 21 bits: no step of 2 or 4 fits the last one
    assert plan_bits(sens, 5) == [4, 4, 8, 4, 4, 4]  # 28 of 30 bits: everyone 4, then 8 for the most sensitive
    assert plan_bits([1.0, 2.0], 12, choices=(16, 8)) == [8, 16]
    with pytest.raises(ValueError, match="budget_bits must be a number >= the narrowest choice 2"):
        plan_bits(sens, 1)
    with pytest.raises(ValueError, match="bits must be one of"):
        plan_bits(sens, 4, choices=(8, 3))
    with pytest.raises(ValueError, match="sensitivity must be a non-empty list"):
        plan_bits([], 4)


def test_plan_bits_by_bytes_can_choose_16_and_spends_no_more_than_the_budget(model):
    cache = LayerQuantCache.for_model(model, 1, 8, [4, 4])  # D = 16, H_KV = 2, groups of 32
    cost = {b: cache.layer_bytes(b) for b in (16, 8, 4, 2)}
    assert cost == {16: 128.0, 8: 76.0, 4: 44.0, 2: 28.0}  # e.g. 2 bits: 2 x (4 + 2) keys + 2 x (4 + 4) values
    sens = [0.3, 0.01, 0.9, 0.05, 0.2, 0.02]
    int4, int8 = 6 * cost[4], 6 * cost[8]  # uniform INT4's and INT8's bytes per token
    assert plan_bits(sens, choices=(16, 2), budget_bytes=int8, layer_bytes=cost) == [16, 2, 16, 2, 2, 2]  # 368 B
    assert plan_bits(sens, choices=(16, 2), budget_bytes=int4, layer_bytes=cost) == [2] * 6  # one FP16 layer: 268
    assert plan_bits(sens, choices=(16, 8, 4, 2), budget_bytes=int4, layer_bytes=cost) == [4] * 6  # exactly 264
    assert plan_bits(sens, choices=(8, 2), budget_bytes=int4, layer_bytes=cost) == [8, 2, 8, 2, 2, 2]
    order = sorted(range(6), key=lambda i: -sens[i])
    for choices in ((16, 2), (16, 8, 4, 2), (8, 4, 2), (16, 4)):
        for budget in (6 * cost[min(choices)], 200.0, int4, 300.0, int8, 6 * 128.0):
            if budget < 6 * cost[min(choices)]:
                continue
            plan = plan_bits(sens, choices=choices, budget_bytes=budget, layer_bytes=cost)
            assert sum(cost[b] for b in plan) <= budget and set(plan) <= set(choices)
            assert all(plan[a] >= plan[b] for a, b in zip(order, order[1:]))
    assert plan_bits(sens, choices=(16, 2), budget_bytes=6 * 128.0, layer_bytes=cost) == [16] * 6


def test_plan_bits_rejects_bad_budgets():
    sens, cost = [0.3, 0.1], {16: 128.0, 4: 44.0, 2: 28.0}
    with pytest.raises(ValueError, match="give one budget"):
        plan_bits(sens)
    with pytest.raises(ValueError, match="give one budget"):
        plan_bits(sens, 4, budget_bytes=100.0, layer_bytes=cost)
    with pytest.raises(ValueError, match="budget_bytes needs layer_bytes"):
        plan_bits(sens, choices=(4, 2), budget_bytes=100.0)
    with pytest.raises(ValueError, match=r"for every choice \(2, 8\)"):
        plan_bits(sens, choices=(8, 2), budget_bytes=100.0, layer_bytes=cost)
    with pytest.raises(ValueError, match="grow with the bits"):
        plan_bits(sens, choices=(4, 2), budget_bytes=100.0, layer_bytes={4: 20.0, 2: 28.0})
    with pytest.raises(ValueError, match="budget_bytes must be a number >= 56"):
        plan_bits(sens, choices=(4, 2), budget_bytes=50.0, layer_bytes=cost)
    with pytest.raises(ValueError, match="layer_bytes goes with budget_bytes"):
        plan_bits(sens, 4, layer_bytes=cost)


def test_kl_divergence():
    p = rand(5, 11, seed=7)
    assert kl_divergence(p, p) == 0.0
    assert kl_divergence(p, p + 3.0) == pytest.approx(0.0, abs=1e-12)  # a shift changes no probability
    assert kl_divergence(p, rand(5, 11, seed=8)) > 0
    with pytest.raises(ValueError, match="one shape"):
        kl_divergence(p, p[:4])
