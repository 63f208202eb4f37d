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


def test_layer_cache_stores_the_dequantized_values_and_counts_the_real_bytes(tiny):
    model, _ = tiny
    c = model.config
    cache = LayerQuantCache.for_model(model, 1, 16, [16, 8, 4, 2])
    with torch.no_grad():
        model(torch.tensor([list(range(65, 81))]), cache=cache)
    for layer, bits in enumerate([8, 4, 2], start=1):
        rows = cache.k[layer][0].reshape(-1, c.head_dim)
        assert max(r.unique().numel() for r in rows) <= 2 ** bits
    H_KV, D = c.n_kv_heads, c.head_dim
    assert cache.bytes_per_token() == 2 * H_KV * (D * 2 + (D + 4) + (D / 2 + 4) + (D / 4 + 4))
    assert cache.nbytes() == KVCache.for_model(model, 1, 16).nbytes()  # a simulation: nothing is saved


def test_layer_cache_bad_bits(model):
    with pytest.raises(ValueError, match=r"one entry per layer \(2\)"):
        LayerQuantCache.for_model(model, 1, 8, [16])
    with pytest.raises(ValueError, match=r"bits must be one of \(16, 8, 4, 2\), got 3"):
        LayerQuantCache.for_model(model, 1, 8, [16, 3])
    with pytest.raises(ValueError, match="one entry per layer"):
        LayerQuantCache.for_model(model, 1, 8, 16)


def test_sensitivity_is_positive_and_grows_as_bits_shrink(tiny):
    model, tok = tiny
    ids = tok.encode("Compute the running median of a stream of numbers and return it as a float.")
    s2 = layer_sensitivity(model, ids, bits=2)
    s8 = layer_sensitivity(model, torch.tensor(ids), bits=8)
    assert len(s2) == len(s8) == model.config.n_layers
    assert all(a >= 0 and b >= 0 for a, b in zip(s2, s8))
    assert all(a > b for a, b in zip(s2, s8)), (s2, s8)
    assert layer_sensitivity(model, ids, bits=16) == [0.0] * model.config.n_layers
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


def test_kl_divergence():
    p = rand(5, 11, seed=7)
    assert kl_divergence(p, p) == 0.0
    assert kl_divergence(p, p + 3.0) == pytest.approx(0.0, abs=1e-12)  # a shift changes no probability
    assert kl_divergence(p, rand(5, 11, seed=8)) > 0
    with pytest.raises(ValueError, match="one shape"):
        kl_divergence(p, p[:4])
