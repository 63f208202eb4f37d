"""Chapter 09's KIVI cache: the 2/4-bit decode kernel against its reference and full precision, and KiviCache."""

import math

import pytest
import torch

from kvlib import runtime
from kvlib.cache import CacheFullError, KVCache, decode_attention_ref
from kvlib.generate import generate
from kvlib.kivi import KiviCache, kivi_decode_attention, kivi_decode_attention_ref
from kvlib.lowbit import pack_bits, quantize_keys_per_channel, quantize_values_per_token, unpack_2bit
from kvlib.memory import kv_cache_bytes
from kvlib.model import load_tiny

FP16_U = 2.0 ** -11  # fp16's unit roundoff: the scales and zeros are stored in fp16


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny(device="cpu")

# --------------------------------------------------------------------------------------------
# the decode kernel against its reference, and against full precision within the stated bound
# --------------------------------------------------------------------------------------------


def kivi_inputs(B, H, H_KV, D, group, S_q, R, n_quant, n_res, dtype=torch.float32, bits=2,
                scale_dtype=torch.float16, seed=0):
    """Random full-precision K/V for every position and the kernel's arguments built from them."""
    k = rand(B, H_KV, S_q + R, D, seed=seed) * 1.5
    v = rand(B, H_KV, S_q + R, D, seed=seed + 1)
    kq, ks, kz = quantize_keys_per_channel(k[:, :, :S_q], group, bits)
    vq, vs, vz = quantize_values_per_token(v[:, :, :S_q], bits)
    ks, kz, vs, vz = (t.to(scale_dtype) for t in (ks, kz, vs, vz))
    # the residual of sequence b holds positions n_quant[b] ..: shift each row block to row 0
    k_res, v_res = torch.zeros(B, H_KV, R, D, dtype=dtype), torch.zeros(B, H_KV, R, D, dtype=dtype)
    for b in range(B):
        k_res[b, :, :n_res[b]] = k[b, :, n_quant[b]: n_quant[b] + n_res[b]].to(dtype)
        v_res[b, :, :n_res[b]] = v[b, :, n_quant[b]: n_quant[b] + n_res[b]].to(dtype)
    dev = runtime.DEVICE
    args = [rand(B, H, D, seed=seed + 2, dtype=dtype), pack_bits(kq, bits), ks, kz, pack_bits(vq, bits), vs, vz,
            torch.tensor(n_quant, dtype=torch.int32), k_res, v_res, torch.tensor(n_res, dtype=torch.int32)]
    return [a.to(dev) for a in args] + [group, bits], (k, v)


SHAPES = [  # B, H, H_KV, D, group, S_q, R, n_quant, n_res: S_q and R not powers of two; a partly filled
    # residual group; n_res 0; n_quant 0; a sequence longer than one tile of the loops
    (3, 8, 8, 16, 16, 48, 24, [0, 16, 48], [5, 0, 13]),
    (3, 8, 4, 64, 16, 48, 24, [48, 0, 32], [1, 24, 7]),
    (2, 8, 2, 16, 16, 80, 20, [80, 64], [17, 3]),
    (2, 8, 1, 64, 16, 48, 24, [16, 48], [0, 11]),
]


@pytest.mark.parametrize("shape", SHAPES, ids=["H_KV=8", "H_KV=4", "H_KV=2", "H_KV=1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kivi_kernel_matches_reference(shape, dtype):
    args, _ = kivi_inputs(*shape, dtype=dtype)
    out = kivi_decode_attention(*args)
    ref = kivi_decode_attention_ref(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("bits, group, scale_dtype", [(4, 16, torch.float16), (2, 24, torch.float32),
                                                      (8, 32, torch.float16)])
def test_kivi_kernel_other_widths_groups_and_fp32_scales(bits, group, scale_dtype):
    args, _ = kivi_inputs(2, 4, 2, 32, group, group * 2, 9, [group, group * 2], [9, 0], bits=bits,
                          scale_dtype=scale_dtype)
    assert (kivi_decode_attention(*args) - kivi_decode_attention_ref(*args)).abs().max().item() <= 1e-5


def attention_error_bound(args, k, v):
    """KiviCache's stated bound, per (sequence, query head, channel), from the quantization steps."""
    q, _, ks, kz, _, vs, vz, n_quant, _, _, n_res, group, bits = args
    qmax = 2 ** bits - 1
    B, H, D = q.shape
    n_rep = H // k.shape[1]
    bound = torch.zeros(B, H, D)
    for b in range(B):
        nq, n = int(n_quant[b]), int(n_quant[b] + n_res[b])
        sk = ks[b].float().repeat_interleave(group, 1)[:, :nq]  # (H_KV, nq, D) step of each key element
        dk = torch.zeros(k.shape[1], n, D)
        dk[:, :nq] = sk / 2 + 2 * FP16_U * (qmax * sk + kz[b].float().repeat_interleave(group, 1)[:, :nq].abs())
        sv = vs[b].float().flatten(1)[:, :nq, None]  # (H_KV, nq, 1)
        dv = torch.zeros(k.shape[1], n, 1)
        dv[:, :nq] = sv / 2 + 2 * FP16_U * (qmax * sv + vz[b].float().flatten(1)[:, :nq, None].abs())
        for h in range(H):
            kv_h = h // n_rep
            eps = (q[b, h].float().abs() * dk[kv_h]).sum(-1).max() / math.sqrt(D)
            spread = v[b, kv_h, :n].amax(0) - v[b, kv_h, :n].amin(0)  # (D,)
            bound[b, h] = dv[kv_h].max() + math.tanh(eps / 2) * spread
    return bound


@pytest.mark.parametrize("shape", SHAPES[:2], ids=["MHA", "GQA"])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_attention_error_stays_within_the_stated_bound(shape, bits):
    args, (k, v) = kivi_inputs(*shape, bits=bits)
    B = args[0].shape[0]
    lens = (args[7] + args[10]).long()
    full = torch.zeros_like(args[0])
    for b in range(B):  # full precision over the same positions, in order
        full[b: b + 1] = decode_attention_ref(args[0][b: b + 1], k[b: b + 1].to(args[0].device),
                                              v[b: b + 1].to(args[0].device), lens[b: b + 1])
    err = (kivi_decode_attention_ref(*args) - full).abs().cpu()
    bound = attention_error_bound([a.cpu() if isinstance(a, torch.Tensor) else a for a in args], k, v)
    assert (err <= bound + 1e-5).all(), (err - bound).max()
    assert err.max() > 0  # quantization did change something: the test is not vacuous


def test_kivi_kernel_bad_inputs():
    args, _ = kivi_inputs(2, 4, 2, 16, 16, 32, 8, [16, 0], [3, 8])
    (q, kp, ks, kz, vp, vs, vz, nq, kr, vr, nr, group, bits) = args

    def call(**change):
        named = dict(q=q, k_packed=kp, k_scale=ks, k_zero=kz, v_packed=vp, v_scale=vs, v_zero=vz, n_quant=nq,
                     k_res=kr, v_res=vr, n_res=nr, group=group, bits=bits)
        named.update(change)
        return kivi_decode_attention(**named)

    with pytest.raises(TypeError, match="k_packed must be torch.uint8"):
        call(k_packed=kp.to(torch.int8))
    with pytest.raises(ValueError, match=r"v_packed must be \(B=2, H_KV, S_q, D \* bits / 8 = 4\)"):
        call(v_packed=unpack_2bit(vp))
    with pytest.raises(ValueError, match="head dim D=18 must be a multiple of 4"):
        call(q=torch.zeros(2, 4, 18, device=q.device))
    with pytest.raises(ValueError, match="bits must be one of"):
        call(bits=3)
    with pytest.raises(ValueError, match=r"k_scale must be of shape \(2, 2, 2, 16\)"):
        call(k_scale=ks[:, :, :1])
    with pytest.raises(TypeError, match="v_zero must be fp16 or fp32"):
        call(v_zero=vz.to(torch.int32))
    with pytest.raises(TypeError, match="k_res must be q's dtype torch.float32"):
        call(k_res=kr.half())
    with pytest.raises(ValueError, match="n_quant must be multiples of group=16"):
        call(n_quant=torch.tensor([8, 0], dtype=torch.int32, device=q.device))
    with pytest.raises(ValueError, match="at least one cached position"):
        call(n_res=torch.tensor([3, 0], dtype=torch.int32, device=q.device))
    with pytest.raises(ValueError, match=r"n_res must lie in 0..R=8"):
        call(n_res=torch.tensor([9, 0], dtype=torch.int32, device=q.device))
    with pytest.raises(ValueError, match="which must divide q's H=3"):
        call(q=torch.zeros(2, 3, 16, device=q.device))
    with pytest.raises(ValueError, match="S_q=32 positions, which must be a multiple of group=24"):
        call(group=24)


# --------------------------------------------------------------------------------------------
# the KIVI cache
# --------------------------------------------------------------------------------------------


def test_kivi_cache_with_a_long_residual_is_the_contiguous_cache(model, tiny):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 9]]
    full = generate(model, prompts, 12, cache=KVCache.for_model(model, 2, 19, kernels="torch"))
    kivi = KiviCache.for_model(model, 2, 19, bits=2, group=16, residual=32, kernels="torch")
    assert torch.equal(generate(model, prompts, 12, cache=kivi), full)
    assert kivi.n_quantized(0) == 0 and kivi.seq_lens.tolist() == [18, 13]
    tiny_model, tok = tiny
    ids = [tok.encode("Return the number of items in a container.")]
    new = 24
    full = generate(tiny_model, ids, new, cache="contiguous", kernels="torch")
    kivi = KiviCache.for_model(tiny_model, 1, len(ids[0]) + new, group=32, residual=96, kernels="torch")
    assert torch.equal(generate(tiny_model, ids, new, cache=kivi), full)


def test_kivi_cache_2bit_runs_and_its_kernel_path_matches_its_reference(model_for):
    """Quantization happens (group 4, residual 8); the Triton decode path gives the reference's logits."""
    prompts = [list(range(1, 11)), [3, 9, 4]]
    logits = {}
    for kernels in ("torch", "triton"):
        model = model_for(kernels)
        cache = KiviCache.for_model(model, 2, 24, bits=2, group=4, residual=8, kernels=kernels)
        out = []
        with torch.no_grad():
            for b, p in enumerate(prompts):
                out.append(model(torch.tensor([p], device=model.device), cache=cache.sequence(b))[:, -1].cpu())
            tokens = torch.tensor([[1], [2]], device=model.device)
            for _ in range(6):  # a group is flushed when sequence 0 reaches 13 positions and sequence 1 reaches 9
                out.append(model(tokens, positions=cache.next_positions(), cache=cache)[:, -1].cpu())
        logits[kernels] = torch.cat(out)
        assert [cache.n_quantized(b) for b in range(2)] == [8, 4] and cache.seq_lens.tolist() == [16, 9]
    assert torch.isfinite(logits["torch"]).all()
    assert (logits["torch"] - logits["triton"]).abs().max().item() < 1e-4


def test_kivi_cache_layout_follows_the_rule():
    """Prefill, sequence views and ragged decode steps: the oldest n_quant(n) positions are stored as
    quantize_keys_per_channel / quantize_values_per_token make them, the rest exactly, in order."""
    B, H_KV, D, G, R = 2, 2, 8, 4, 8
    cache = KiviCache(1, B, H_KV, 40, D, bits=2, group=G, residual=R)
    k_all, v_all = rand(B, H_KV, 40, D, seed=3), rand(B, H_KV, 40, D, seed=4)
    q = torch.zeros(B, 2, 1, D)
    cache.sequence(0).attend(0, q[:1].expand(1, 2, 11, D), k_all[:1, :, :11], v_all[:1, :, :11])  # prefill 11
    cache.sequence(1).attend(0, q[:1].expand(1, 2, 3, D), k_all[1:, :, :3], v_all[1:, :, :3])  # prefill 3
    lens = [11, 3]
    for _ in range(14):  # decode steps: sequence 0 reaches 25, sequence 1 reaches 17
        cache.attend(0, q, torch.stack([k_all[b, :, n] for b, n in enumerate(lens)])[:, :, None],
                     torch.stack([v_all[b, :, n] for b, n in enumerate(lens)])[:, :, None])
        lens = [n + 1 for n in lens]
    assert cache.seq_lens.tolist() == lens == [25, 17]
    for b, n in enumerate(lens):
        nq = cache.n_quantized(b)
        assert nq == G * math.ceil(max(0, n - R) / G) and 0 < n - nq <= R
        kq, ks, kz = quantize_keys_per_channel(k_all[b: b + 1, :, :nq], G)
        vq, vs, vz = quantize_values_per_token(v_all[b: b + 1, :, :nq])
        assert torch.equal(unpack_2bit(cache.k_packed[0][b, :, :nq]), kq[0])
        assert torch.equal(unpack_2bit(cache.v_packed[0][b, :, :nq]), vq[0])
        assert torch.equal(cache.k_scale[0][b, :, :nq // G], ks[0].half())
        assert torch.equal(cache.v_zero[0][b, :, :nq], vz[0, :, :, 0].half())
        assert torch.equal(cache.k[0][b, :, :n - nq], k_all[b, :, nq:n])  # the residual: exact, in order
        assert torch.equal(cache.v[0][b, :, :n - nq], v_all[b, :, nq:n])
        assert cache.held(b) == n


def test_kivi_bytes_follow_the_formula(tiny):
    model, _ = tiny
    c = model.config
    L, H_KV, D = c.n_layers, c.n_kv_heads, c.head_dim
    cache = KiviCache.for_model(model, batch=2, max_len=100, bits=2, group=32, residual=32)
    S_q = 96  # 100 - 32 = 68 positions over the residual -> 3 whole groups
    per_layer = 2 * (2 * H_KV * S_q * D // 4)  # packed K and V
    per_layer += 2 * (2 * H_KV * (S_q // 32) * D * 2)  # fp16 key scale and zero per (group, channel)
    per_layer += 2 * (2 * H_KV * S_q * 2)  # fp16 value scale and zero per token
    per_layer += 2 * (2 * H_KV * 32 * D * 4)  # the fp32 residual
    assert cache.nbytes() == L * per_layer
    per_token = L * H_KV * (2 * D * 2 / 8 + 4 * D / 32 + 4)
    assert cache.bytes_per_token() == per_token == 768.0
    longer = KiviCache.for_model(model, batch=2, max_len=100 + 64, bits=2, group=32, residual=32)
    assert (longer.nbytes() - cache.nbytes()) / (64 * 2) == per_token  # what one more token really costs
    fp16 = kv_cache_bytes(L, H_KV, D, 1, 1, torch.float16)
    assert fp16 / cache.bytes_per_token() == pytest.approx(16 / 3)
    assert KiviCache.for_model(model, 1, 64, bits=4, group=32, residual=32).bytes_per_token() == \
        L * H_KV * (2 * D * 4 / 8 + 4 * D / 32 + 4)


def test_kivi_cache_bad_arguments(model):
    with pytest.raises(ValueError, match="residual=48 must be a multiple of group=32"):
        KiviCache.for_model(model, 1, 64, group=32, residual=48)
    with pytest.raises(ValueError, match="residual=16 must be a multiple of group=32"):
        KiviCache.for_model(model, 1, 64, group=32, residual=16)
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8\), got 3"):
        KiviCache.for_model(model, 1, 64, bits=3)
    with pytest.raises(ValueError, match="head_dim=18 must be a multiple of 4"):
        KiviCache(1, 1, 1, 64, 18, bits=2, group=8, residual=8)
    with pytest.raises(ValueError, match="kernels must be"):
        KiviCache.for_model(model, 1, 64, kernels="cuda")
    with pytest.raises(ValueError, match="group must be >= 1"):
        KiviCache.for_model(model, 1, 64, group=0)
    cache = KiviCache.for_model(model, 1, 12, group=4, residual=8, kernels="torch")
    with pytest.raises(CacheFullError):
        generate(model, [[1, 2, 3]], 11, cache=cache)
    with pytest.raises(ValueError, match="holds batch=1"):
        cache.reset(batch=2)
    with torch.no_grad():
        model(torch.tensor([list(range(10))]), cache=cache)
        with pytest.raises(CacheFullError):
            model(torch.tensor([[1, 2, 3]]), positions=torch.tensor([[10, 11, 12]]), cache=cache)
    assert cache.seq_lens.tolist() == [10]  # the refusal changed nothing
    with pytest.raises(TypeError, match="k and v must be torch.float32"):
        cache.attend(0, torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 1, 16).half(), torch.zeros(1, 2, 1, 16).half())
