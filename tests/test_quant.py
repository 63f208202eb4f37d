"""INT8 quantization and the int8 KV cache."""

import pytest
import torch

from kvlib import runtime
from kvlib.cache import decode_attention_ref
from kvlib.generate import generate, generate_naive
from kvlib.quant import (Int8KVCache, dequantize_int8, int8_decode_attention, int8_decode_attention_ref,
                         quality_report, quantize_int8, store_kv_int8, store_kv_int8_ref)


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(runtime.DEVICE)


@pytest.mark.parametrize("dim, scale_shape", [
    (None, (1, 1, 1)),  # per tensor
    (-1, (5, 4, 1)),  # per token and head (x is (T, H, D))
    ((1, 2), (5, 1, 1)),  # per token
    ((0, 2), (1, 4, 1)),  # per head
    (0, (1, 4, 32)),  # per channel
])
def test_every_granularity_round_trips_within_half_a_step(dim, scale_shape):
    x = rand(5, 4, 32, seed=1) * 3
    q, s = quantize_int8(x, dim)
    assert q.dtype == torch.int8 and s.shape == scale_shape and s.dtype == torch.float32
    assert q.abs().max() <= 127
    err = (dequantize_int8(q, s) - x).abs()
    assert (err <= s / 2 + 1e-6).all()


def test_all_zero_rows_give_finite_scales_and_exact_zeros():
    x = torch.zeros(3, 8)
    x[1] = torch.arange(8.0)
    q, s = quantize_int8(x, -1)
    assert torch.isfinite(s).all()
    assert torch.equal(dequantize_int8(q, s)[0], torch.zeros(8)) and torch.equal(q[2], torch.zeros(8, dtype=torch.int8))


def test_bad_inputs():
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_int8(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_int8(torch.ones(3, dtype=torch.int32))
    q, s = quantize_int8(torch.randn(4, 8), -1)
    with pytest.raises(TypeError, match="int8"):
        dequantize_int8(q.float(), s)
    with pytest.raises(ValueError, match="does not match"):
        dequantize_int8(q, torch.ones(8, 4))


def quantized_cache(B, H_KV, S, D, seed):
    k, v = rand(B, H_KV, S, D, seed=seed), rand(B, H_KV, S, D, seed=seed + 1)
    kq, ks = quantize_int8(k, -1)
    vq, vs = quantize_int8(v, -1)
    return k, v, kq, ks[..., 0].half().contiguous(), vq, vs[..., 0].half().contiguous()


@pytest.mark.parametrize("H, H_KV, num_splits", [(4, 4, 1), (8, 4, 2), (8, 2, 4), (8, 1, 1), (4, 1, 2), (16, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_int8_decode_kernel_matches_reference(H, H_KV, dtype, num_splits):
    B, S, D = 3, 90, 48  # S and D not powers of two
    k, v, kq, ks, vq, vs = quantized_cache(B, H_KV, S, D, seed=H)
    q = rand(B, H, D, seed=9, dtype=dtype)
    lens = torch.tensor([1, 45, 90], dtype=torch.int32, device=runtime.DEVICE)
    ref = int8_decode_attention_ref(q, kq, ks, vq, vs, lens)
    out = int8_decode_attention(q, kq, ks, vq, vs, lens, num_splits=num_splits)
    # bf16 keeps 8 bits: the kernel rounds p * scale to bf16 where the reference rounds the dequantized V,
    # and both round the output (an ulp is 1/64 between 2 and 4)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    scale = 1 + ref.float().abs() if dtype == torch.bfloat16 else 1.0  # bf16: relative to the value
    assert ((out.float() - ref.float()).abs() <= tol * scale).all()
    # and close to full precision: int8 error, not a bug
    assert (ref.float() - decode_attention_ref(q.float(), k, v, lens)).abs().max() < 0.05 + 4 * tol


def test_int8_decode_bad_scales():
    _, _, kq, ks, vq, vs = quantized_cache(1, 1, 16, 16, seed=0)
    q = torch.zeros(1, 1, 16, device=runtime.DEVICE)
    lens = torch.tensor([4], dtype=torch.int32, device=runtime.DEVICE)
    with pytest.raises(ValueError, match=r"k_scale must be fp16/fp32 of shape \(B, H_KV, S_max\)"):
        int8_decode_attention(q, kq, ks[..., :8], vq, vs, lens)
    with pytest.raises(ValueError, match="int8"):
        int8_decode_attention(q, kq.float(), ks, vq, vs, lens)


@pytest.mark.parametrize("T, D, strided", [(5, 24, False), (1, 24, True), (40, 64, True)])
def test_quantize_on_store_kernel_matches_reference(T, D, strided):
    """Tiles of new rows (one, several, the last one partial), D not a power of two, k_new/v_new views."""
    B, H_KV, S = 2, 3, 48
    caches = [torch.zeros(B, H_KV, S, D, dtype=torch.int8), torch.ones(B, H_KV, S, dtype=torch.float16),
              torch.zeros(B, H_KV, S, D, dtype=torch.int8), torch.ones(B, H_KV, S, dtype=torch.float16)]
    caches = [c.to(runtime.DEVICE) for c in caches]
    ref = [c.clone() for c in caches]
    k_new, v_new = rand(B, H_KV, T, D, seed=3), rand(B, H_KV, T, D, seed=4)
    if strided:  # (B, T, H_KV, D) memory seen as (B, H_KV, T, D), as a model's k after a transpose
        k_new, v_new = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k_new, v_new))
    start = torch.tensor([0, S - T], device=runtime.DEVICE)
    store_kv_int8(*caches, k_new, v_new, start)
    store_kv_int8_ref(*ref, k_new, v_new, start)
    for a, b in zip(caches, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_int8_generation_mostly_agrees_with_naive(model_for, kernels):
    model = model_for(kernels)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [11]]
    naive = generate_naive(model, prompts, 24)
    int8 = generate(model, prompts, 24, cache="int8", kernels=kernels)
    assert (naive == int8).float().mean() >= 0.9


def test_quality_report_and_bytes(model):
    r = quality_report(model, list(range(1, 60)), n_tokens=50)
    assert r["tokens"] == 50 and r["greedy_agreement"] >= 0.9 and abs(r["ppl_change"]) < 0.02
    D = model.config.head_dim
    assert r["bytes_int8"] / (r["bytes_full"] / 2) == pytest.approx((D + 2) / (2 * D))  # fp32 model -> fp16 equiv.
    cache = Int8KVCache(n_layers=1, batch=1, n_kv_heads=1, max_len=4, head_dim=8)
    assert cache.nbytes() == 2 * 4 * 8 + 2 * 4 * 2
