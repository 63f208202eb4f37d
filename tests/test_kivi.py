"""Chapter 09's KIVI cache: the 2/4-bit decode kernel against its reference and full precision, and KiviCache
(exact prefill, the two sliding windows, its bytes)."""

import math

import pytest
import torch

from kvlib import runtime
from kvlib.cache import CacheFullError, KVCache, decode_attention_ref
from kvlib.footprint import held_bytes
from kvlib.generate import generate
from kvlib.evict import SnapKVCache
from kvlib.kivi import KiviCache, SnapKiviCache, _quantize_values, kivi_decode_attention, kivi_decode_attention_ref
from kvlib.lowbit import pack_bits, quantize_keys_per_channel, unpack_bits
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


def kivi_inputs(B, H, H_KV, D, group, v_group, n_kq, n_vq, n, dtype=torch.float32, bits=2,
                scale_dtype=torch.float16, seed=0):
    """Random full-precision K/V for every position and the kernel's arguments built from them: sequence b's
    first n_kq[b] keys and n_vq[b] values quantized, the rest of its n[b] positions in the exact windows
    (buffers with spare capacity: S_kq, S_vq, R_k, R_v all larger than any sequence needs)."""
    S_kq, S_vq = max(n_kq) + group, max(n_vq) + 5
    R_k, R_v = max(a - b for a, b in zip(n, n_kq)) + 2, max(a - b for a, b in zip(n, n_vq)) + 1
    S = max(max(n), S_kq, S_vq)
    k = rand(B, H_KV, S, D, seed=seed) * 1.5
    v = rand(B, H_KV, S, D, seed=seed + 1)
    kq, ks, kz = quantize_keys_per_channel(k[:, :, :S_kq], group, bits)
    vq, vs, vz = _quantize_values(v[:, :, :S_vq], bits, v_group)
    ks, kz, vs, vz = (t.to(scale_dtype) for t in (ks, kz, vs, vz))
    k_res, v_res = torch.zeros(B, H_KV, R_k, D, dtype=dtype), torch.zeros(B, H_KV, R_v, D, dtype=dtype)
    for b in range(B):  # the windows of sequence b: row 0 holds its first exact position
        k_res[b, :, :n[b] - n_kq[b]] = k[b, :, n_kq[b]: n[b]].to(dtype)
        v_res[b, :, :n[b] - n_vq[b]] = v[b, :, n_vq[b]: n[b]].to(dtype)
    lens = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    args = [rand(B, H, D, seed=seed + 2, dtype=dtype), pack_bits(kq, bits), ks, kz, lens(n_kq), k_res,
            lens([a - b for a, b in zip(n, n_kq)]), pack_bits(vq, bits), vs, vz, lens(n_vq), v_res,
            lens([a - b for a, b in zip(n, n_vq)])]
    return [a.to(runtime.DEVICE) for a in args] + [group, bits], (k[:, :, :max(n)], v[:, :, :max(n)])


SHAPES = [  # B, H, H_KV, D, group, v_group, n_kq, n_vq, n: lengths not powers of two; windows partly filled;
    # values quantized further than keys and the other way round; nothing quantized; nothing exact; longer
    # than one tile of the loops
    (3, 8, 8, 16, 16, 8, [0, 16, 48], [0, 10, 40], [5, 16, 61]),
    (3, 8, 4, 64, 16, 32, [48, 0, 32], [45, 0, 30], [49, 24, 39]),
    (2, 8, 2, 16, 16, 16, [80, 64], [75, 66], [97, 67]),
    (2, 8, 1, 64, 16, 64, [16, 48], [16, 37], [16, 59]),
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


@pytest.mark.parametrize("bits, D, group, v_group, scale_dtype", [(4, 16, 16, 16, torch.float16),
                                                                  (2, 48, 24, 16, torch.float32),
                                                                  (8, 32, 32, 8, torch.float16)])
def test_kivi_kernel_other_widths_groups_and_fp32_scales(bits, D, group, v_group, scale_dtype):
    n_kq, n_vq = [group, group * 2], [group + 3, group * 2 - 5]
    args, _ = kivi_inputs(2, 4, 2, D, group, v_group, n_kq, n_vq, [group + 9, group * 2], bits=bits,
                          scale_dtype=scale_dtype)
    assert (kivi_decode_attention(*args) - kivi_decode_attention_ref(*args)).abs().max().item() <= 1e-5


def attention_error_bound(args, k, v):
    """KiviCache's stated bound, per (sequence, query head, channel), from the quantization steps."""
    q, _, ks, kz, n_kq, _, n_kr, _, vs, vz, n_vq, _, _, group, bits = args
    qmax = 2 ** bits - 1
    B, H, D = q.shape
    H_KV, n_rep, v_group = k.shape[1], H // k.shape[1], D // vs.shape[3]
    bound = torch.zeros(B, H, D)
    for b in range(B):
        nk, nv, n = int(n_kq[b]), int(n_vq[b]), int(n_kq[b] + n_kr[b])
        sk = ks[b].float().repeat_interleave(group, 1)[:, :nk]  # (H_KV, nk, D) step of each key element
        dk = torch.zeros(H_KV, n, D)
        dk[:, :nk] = sk / 2 + 2 * FP16_U * (qmax * sk + kz[b].float().repeat_interleave(group, 1)[:, :nk].abs())
        sv = vs[b].float().repeat_interleave(v_group, 2)[:, :nv]  # (H_KV, nv, D)
        dv = torch.zeros(H_KV, n, D)
        dv[:, :nv] = sv / 2 + 2 * FP16_U * (qmax * sv + vz[b].float().repeat_interleave(v_group, 2)[:, :nv].abs())
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
    q, lens = args[0], (args[4] + args[6]).long()
    full = torch.zeros_like(q)
    for b in range(q.shape[0]):  # full precision over the same positions, in order
        full[b: b + 1] = decode_attention_ref(q[b: b + 1], k[b: b + 1].to(q.device), v[b: b + 1].to(q.device),
                                              lens[b: b + 1])
    err = (kivi_decode_attention_ref(*args) - full).abs().cpu()
    bound = attention_error_bound([a.cpu() if isinstance(a, torch.Tensor) else a for a in args], k, v)
    assert (err <= bound + 1e-5).all(), (err - bound).max()
    assert err.max() > 0  # quantization did change something: the test is not vacuous


def test_kivi_kernel_bad_inputs():
    args, _ = kivi_inputs(2, 4, 2, 16, 16, 8, [16, 0], [16, 0], [19, 8])
    (q, kp, ks, kz, nkq, kr, nkr, vp, vs, vz, nvq, vr, nvr, group, bits) = args
    dev = q.device

    def call(**change):
        named = dict(q=q, k_packed=kp, k_scale=ks, k_zero=kz, n_kq=nkq, k_res=kr, n_kr=nkr, v_packed=vp, v_scale=vs,
                     v_zero=vz, n_vq=nvq, v_res=vr, n_vr=nvr, group=group, bits=bits)
        named.update(change)
        return kivi_decode_attention(**named)

    lens = lambda *x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    with pytest.raises(TypeError, match="k_packed must be torch.uint8"):
        call(k_packed=kp.to(torch.int8))
    with pytest.raises(ValueError, match=r"v_packed must be \(B=2, H_KV, S_vq, D \* bits / 8 = 4\)"):
        call(v_packed=unpack_bits(vp, 2))
    with pytest.raises(ValueError, match="head dim D=18 must be a multiple of 4"):
        call(q=torch.zeros(2, 4, 18, device=dev))
    with pytest.raises(ValueError, match="bits must be one of"):
        call(bits=3)
    with pytest.raises(ValueError, match=r"k_scale must be of shape \(2, 2, 2, 16\)"):
        call(k_scale=ks[:, :, :1])
    with pytest.raises(ValueError, match=r"v_zero must be of shape \(2, 2, 21, 2\), one per \(token, group"):
        call(v_zero=vz[..., :1])
    with pytest.raises(ValueError, match="v_scale must be .* with v_group dividing D=16"):
        call(v_scale=torch.ones(2, 2, 21, 3, device=dev))
    with pytest.raises(TypeError, match="v_zero must be fp16 or fp32"):
        call(v_zero=vz.to(torch.int32))
    with pytest.raises(TypeError, match="k_res must be q's dtype torch.float32"):
        call(k_res=kr.half())
    with pytest.raises(ValueError, match=r"v_res must be \(B=2, H_KV=2, R, D=16\)"):
        call(v_res=vr[:, :1])
    with pytest.raises(ValueError, match="n_kq must be multiples of group=16"):
        call(n_kq=lens(8, 0), n_kr=lens(11, 8))
    with pytest.raises(ValueError, match=r"n_vq must lie in 0..S_vq=21"):
        call(n_vq=lens(22, 0))
    with pytest.raises(ValueError, match=r"n_kr must lie in 0..R=10"):
        call(n_kr=lens(3, 11))
    with pytest.raises(ValueError, match="keys and values must cover the same positions"):
        call(n_vr=lens(4, 8))
    with pytest.raises(ValueError, match="at least one cached position"):
        call(n_kr=lens(3, 0), n_vr=lens(3, 0))
    with pytest.raises(ValueError, match=r"n_vr must be a \(B=2,\) int32/int64 tensor"):
        call(n_vr=nvr.float())
    with pytest.raises(ValueError, match="which must divide q's H=3"):
        call(q=torch.zeros(2, 3, 16, device=dev))
    with pytest.raises(ValueError, match="S_kq=32 positions, which must be a multiple of group=24"):
        call(group=24)
    with pytest.raises(TypeError, match="n_kq must be a torch.Tensor"):
        call(n_kq=[16, 0])


# --------------------------------------------------------------------------------------------
# the KIVI cache
# --------------------------------------------------------------------------------------------


def test_kivi_cache_with_a_long_residual_is_the_contiguous_cache(model, tiny):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 9]]
    full = generate(model, prompts, 12, cache=KVCache.for_model(model, 2, 19, kernels="torch"))
    kivi = KiviCache.for_model(model, 2, 19, bits=2, group=16, residual=32, kernels="torch")
    assert torch.equal(generate(model, prompts, 12, cache=kivi), full)
    assert kivi.n_quantized(0) == (0, 0) and kivi.seq_lens.tolist() == [18, 13]
    tiny_model, tok = tiny
    ids = [tok.encode("Return the number of items in a container.")]
    new = 24
    full = generate(tiny_model, ids, new, cache="contiguous", kernels="torch")
    kivi = KiviCache.for_model(tiny_model, 1, len(ids[0]) + new, group=32, residual=96, kernels="torch")
    assert torch.equal(generate(tiny_model, ids, new, cache=kivi), full)


def test_kivi_prefill_attends_exactly(model):
    """The prompt's call gives KVCache's output although most of it is stored in 2 bits; prefill="quantized"
    (the contrast) attends through the codes and does not."""
    prompt = torch.tensor([list(range(3, 40))])  # 37 positions: 24 keys and 29 values quantized
    with torch.no_grad():
        full = model(prompt, cache=KVCache.for_model(model, 1, 40, kernels="torch"))
        kivi = KiviCache.for_model(model, 1, 40, bits=2, group=4, residual=8, kernels="torch")
        exact = model(prompt, cache=kivi)
        contrast = model(prompt, cache=KiviCache.for_model(model, 1, 40, bits=2, group=4, residual=8,
                                                           kernels="torch", prefill="quantized"))
    assert kivi.n_quantized(0) == (32, 29)
    assert torch.equal(exact, full)
    assert (contrast - full).abs().max().item() > 1e-3


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
            for _ in range(6):  # sequence 0 goes 10 -> 16 positions, sequence 1 3 -> 9: both windows slide
                out.append(model(tokens, positions=cache.next_positions(), cache=cache)[:, -1].cpu())
        logits[kernels] = torch.cat(out)
        assert [cache.n_quantized(b) for b in range(2)] == [(8, 8), (4, 1)] and cache.seq_lens.tolist() == [16, 9]
    assert torch.isfinite(logits["torch"]).all()
    assert (logits["torch"] - logits["triton"]).abs().max().item() < 1e-4


def check_layout(cache, b, k_all, v_all):
    """Sequence b of a one-layer cache stores its keys / values as the rule says, from the K/V it was given."""
    n, G, R = cache.held(b), cache.group, cache.residual
    nk, nv = cache.n_quantized(b)
    kq, ks, kz = quantize_keys_per_channel(k_all[b: b + 1, :, :nk], G)
    vq, vs, vz = _quantize_values(v_all[b: b + 1, :, :nv], 2, cache.v_group)
    assert torch.equal(unpack_bits(cache.k_packed[0][b, :, :nk], 2), kq[0])
    assert torch.equal(cache.k_scale[0][b, :, :nk // G], ks[0].half())
    assert torch.equal(cache.k_zero[0][b, :, :nk // G], kz[0].half())
    assert torch.equal(unpack_bits(cache.v_packed[0][b, :, :nv], 2), vq[0])
    assert torch.equal(cache.v_scale[0][b, :, :nv], vs[0].half())
    assert torch.equal(cache.v_zero[0][b, :, :nv], vz[0].half())
    assert torch.equal(cache.k[0][b, :, :n - nk], k_all[b, :, nk:n])  # the windows: exact, in order
    assert torch.equal(cache.v[0][b, :, :n - nv], v_all[b, :, nv:n])


@pytest.mark.parametrize("flush", ["group", "residual"])
def test_kivi_windows_slide(flush):
    """After every call (prompts, ragged decode steps, then multi-token calls): the V window holds exactly the
    min(n, R) newest values, the K window the newest n - G ceil((n - R) / G), in (R - G, R] once n > R (flush=
    "group"), or n mod R (flush="residual", the reference code's rule); what left them is quantized as the
    primitives quantize it."""
    B, H_KV, D, G, R = 2, 2, 16, 4, 12
    cache = KiviCache(1, B, H_KV, 80, D, bits=2, group=G, residual=R, v_group=8, flush=flush)
    k_all, v_all = rand(B, H_KV, 80, D, seed=3), rand(B, H_KV, 80, D, seed=4)
    q = torch.zeros(B, 2, 1, D)
    for b, n in enumerate([11, 3]):  # prompts of 11 and 3 positions
        cache.sequence(b).attend(0, q[:1].expand(1, 2, n, D), k_all[b: b + 1, :, :n], v_all[b: b + 1, :, :n])
    seen = set()

    def check():
        for b in range(B):
            n = cache.held(b)
            nk, nv = cache.n_quantized(b)
            assert n - nv == min(n, R)
            if flush == "group":
                assert nk == G * math.ceil(max(0, n - R) / G) and (n <= R or R - G < n - nk <= R)
            else:
                assert nk == n // R * R
            seen.add((n - nk, n - nv))
            check_layout(cache, b, k_all, v_all)

    check()
    for _ in range(30):  # ragged decode: sequence 0 reaches 41, sequence 1 33
        lens = cache.seq_lens.tolist()
        cache.attend(0, q, torch.stack([k_all[b, :, n] for b, n in enumerate(lens)])[:, :, None],
                     torch.stack([v_all[b, :, n] for b, n in enumerate(lens)])[:, :, None])
        check()
    cache.sequence(1).attend(0, q[:1].expand(1, 2, 8, D), k_all[1:, :, 33:41], v_all[1:, :, 33:41])  # 33 -> 41
    for T in (5, 7, 13):  # multi-token calls of both sequences: 41 -> 46 -> 53 -> 66
        n = cache.held(0)
        cache.attend(0, q.expand(B, 2, T, D), k_all[:, :, n: n + T], v_all[:, :, n: n + T])
        check()
    assert cache.seq_lens.tolist() == [66, 66]
    assert len({k for k, _ in seen}) >= G  # the key window took every size it can, not just one


def test_kivi_layout_is_the_same_token_by_token_or_at_once(model):
    """On one layer fed the same K/V, tokens stored one at a time, in chunks or all at once give the same codes
    and windows (the layout depends only on n). Through a model it does not hold: an exact prefill attends
    over exact K/V where token-by-token decode attends through the codes, so layer 1's K/V already differ."""
    H_KV, D, n = 2, 16, 37
    k_all, v_all = rand(1, H_KV, n, D, seed=5), rand(1, H_KV, n, D, seed=6)
    caches = []
    for chunks in ([n], [1] * n, [9, 1, 1, 6, 20]):
        cache = KiviCache(1, 1, H_KV, 40, D, bits=2, group=4, residual=8)
        start = 0
        for T in chunks:
            cache.attend(0, torch.zeros(1, 4, T, D), k_all[:, :, start: start + T], v_all[:, :, start: start + T])
            start += T
        check_layout(cache, 0, k_all, v_all)
        caches.append(cache)
    nk, nv = caches[0].n_quantized(0)
    used = dict(k=n - nk, v=n - nv, k_packed=nk, k_scale=nk // 4, k_zero=nk // 4, v_packed=nv, v_scale=nv, v_zero=nv)
    for other in caches[1:]:
        assert other.n_quantized(0) == (nk, nv)
        for name, rows in used.items():  # the rows in use (a window's rows past its end are stale)
            assert torch.equal(getattr(caches[0], name)[0][:, :, :rows], getattr(other, name)[0][:, :, :rows]), name
    ids = list(range(3, 40))
    at_once = KiviCache.for_model(model, 1, 40, bits=2, group=4, residual=8, kernels="torch")
    one_by_one = KiviCache.for_model(model, 1, 40, bits=2, group=4, residual=8, kernels="torch")
    with torch.no_grad():
        model(torch.tensor([ids]), cache=at_once)
        for t, i in enumerate(ids):
            model(torch.tensor([[i]]), positions=torch.tensor([[t]]), cache=one_by_one)
    assert torch.equal(at_once.k_packed[0], one_by_one.k_packed[0])  # layer 0 sees only the embeddings
    assert torch.allclose(at_once.v[0][:, :, :8], one_by_one.v[0][:, :, :8], atol=1e-6)
    assert not torch.allclose(at_once.v[1][:, :, :8], one_by_one.v[1][:, :, :8], atol=1e-4)  # layer 1: attention differed


def kivi_bytes(L, B, H_KV, D, max_len, bits, G, R, v_group, float_bytes):
    """Every buffer KiviCache holds, from the rules: codes, fp16 scales and zeros, the windows."""
    S_kq, S_vq = G * math.ceil(max(0, max_len - R) / G), max(0, max_len - R)
    codes = (S_kq + S_vq) * D * bits // 8
    scales = 2 * 2 * (S_kq // G * D + S_vq * D // v_group)
    window = 2 * (R + 1) * D * float_bytes  # R rows + the one a decode step writes before the window slides
    return L * B * H_KV * (codes + scales + window)


@pytest.mark.parametrize("bits, G, R, v_group", [(2, 32, 32, 32), (2, 32, 128, 32), (4, 32, 128, 16)])
def test_kivi_bytes_follow_the_formula(tiny, bits, G, R, v_group):
    model, _ = tiny
    c = model.config
    L, H_KV, D = c.n_layers, c.n_kv_heads, c.head_dim
    cache = KiviCache.for_model(model, batch=2, max_len=300, bits=bits, group=G, residual=R, v_group=v_group)
    assert cache.nbytes() == kivi_bytes(L, 2, H_KV, D, 300, bits, G, R, v_group, 4)
    held, half = held_bytes(cache), held_bytes(cache, float_bytes=2)  # kvlib.footprint counts the same bytes
    assert held.payload + held.scales == cache.nbytes() and held.other == held.scores == 0
    assert half.payload + half.scales == kivi_bytes(L, 2, H_KV, D, 300, bits, G, R, v_group, 2)
    per_token = L * H_KV * (2 * D * bits / 8 + 4 * D / G + 4 * D / v_group)
    assert cache.bytes_per_token() == per_token
    longer = KiviCache.for_model(model, batch=2, max_len=300 + 2 * G, bits=bits, group=G, residual=R,
                                 v_group=v_group)
    assert (longer.nbytes() - cache.nbytes()) / (2 * G * 2) == per_token  # what one more token really costs
    if (bits, v_group) == (2, 32):
        assert kv_cache_bytes(L, H_KV, D, 1, 1, torch.float16) / per_token == pytest.approx(16 / 3)  # 2 B vs 3/8


def test_kivi_cache_bad_arguments(model):
    with pytest.raises(ValueError, match="residual=48 must be a multiple of group=32"):
        KiviCache.for_model(model, 1, 64, group=32, residual=48)
    with pytest.raises(ValueError, match="residual=16 must be a multiple of group=32"):
        KiviCache.for_model(model, 1, 64, group=32, residual=16)
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8\), got 3"):
        KiviCache.for_model(model, 1, 64, bits=3)
    with pytest.raises(ValueError, match="head_dim=18 must be a multiple of 4"):
        KiviCache(1, 1, 1, 64, 18, bits=2, group=8, residual=8)
    with pytest.raises(ValueError, match="v_group=6 must divide head_dim=16"):
        KiviCache.for_model(model, 1, 64, v_group=6)
    with pytest.raises(ValueError, match="prefill must be one of"):
        KiviCache.for_model(model, 1, 64, prefill="fp16")
    with pytest.raises(ValueError, match="flush must be one of"):
        KiviCache.for_model(model, 1, 64, flush="token")
    with pytest.raises(ValueError, match="kernels must be"):
        KiviCache.for_model(model, 1, 64, kernels="cuda")
    with pytest.raises(ValueError, match="group must be >= 1"):
        KiviCache.for_model(model, 1, 64, group=0)
    assert KiviCache.for_model(model, 1, 64, group=8, residual=8).v_group == 16  # D = 16: 32 does not divide it
    cache = KiviCache.for_model(model, 1, 12, group=4, residual=8, kernels="torch")
    with pytest.raises(CacheFullError):
        generate(model, [[1, 2, 3]], 11, cache=cache)
    with pytest.raises(ValueError, match="holds batch=1"):
        cache.reset(batch=2)
    with torch.no_grad():
        model(torch.tensor([list(range(10))]), cache=cache)
        before = [t.clone() for t in cache.k + cache.v_packed]
        with pytest.raises(CacheFullError):
            model(torch.tensor([[1, 2, 3]]), positions=torch.tensor([[10, 11, 12]]), cache=cache)
    assert cache.seq_lens.tolist() == [10]  # the refusal changed nothing
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v_packed))
    with pytest.raises(TypeError, match="k and v must be torch.float32"):
        cache.attend(0, torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 1, 16).half(), torch.zeros(1, 2, 1, 16).half())


# ---- SnapKV + KIVI --------------------------------------------------------------------------------


def test_snap_kivi_without_compression_is_kivi():
    model, tok = load_tiny()
    prompts = [tok.encode("def add(a, b):\n    return")]
    kivi = KiviCache.for_model(model, 1, 64, group=8, residual=8)
    both = SnapKiviCache.for_model(model, 1, 64, budget=40, window=4, group=8, residual=8)  # the prompt fits
    assert torch.equal(generate(model, prompts, 12, cache=both), generate(model, prompts, 12, cache=kivi))
    assert int(both.dropped[0]) == 0


def test_snap_kivi_keeps_snapkvs_choice_and_attends_as_snapkv_before_it_grows():
    """With nothing quantized yet (8 bits, a window as long as the cache), the composition keeps the positions
    SnapKVCache keeps after the same prompt, and the first decode step attends over exactly those."""
    model, _ = load_tiny()  # on runtime.DEVICE: the ids go there too
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    snap = SnapKVCache.for_model(model, 1, 12, window=4, kernel=3)
    both = SnapKiviCache.for_model(model, 1, 48, budget=12, window=4, kernel=3, bits=8, group=16, residual=32)
    with torch.no_grad():
        a, b = model(ids, cache=snap), model(ids, cache=both)
        # the prompt attends fully in both; in GPU mode through two kernels (KIVI's flash_attention, SnapKV's
        # PyTorch path: 1.2e-5 apart where the interpreter stood in for the GPU), on a CPU through the same one
        assert torch.allclose(a, b, atol=1e-4 if both.kernels == "triton" else 1e-5)
        nxt = torch.tensor([[5]], device=model.device)
        assert both.next_positions().tolist() == [[30]] and both.held(0) == 12
        a = model(nxt, positions=snap.next_positions(), cache=snap)
        b = model(nxt, positions=both.next_positions(), cache=both)
    assert torch.allclose(a, b, atol=1e-4)
    assert both.held(0) == 13 and snap.held(0) == 13  # both keep every new token (SnapKV's rule)


def test_snap_kivi_quantizes_what_it_kept_and_refuses_what_does_not_fit():
    model, tok = load_tiny()  # on runtime.DEVICE: the ids go there too
    cache = SnapKiviCache.for_model(model, 1, 24, budget=16, window=4, group=4, residual=4)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    ids = ids.to(model.device)
    with torch.no_grad():
        model(ids, cache=cache)
    assert cache.held(0) == 16 and cache.n_quantized(0) == (12, 12) and int(cache.dropped[0]) == 24
    out = generate(model, [ids[0].tolist()], 8, cache=cache)  # 16 kept + 7 decoded fit in 24
    assert out.shape == (1, 8) and cache.held(0) == 23
    with pytest.raises(ValueError, match="window must be below"):
        SnapKiviCache.for_model(model, 1, 24, budget=4, window=4)
    with pytest.raises(ValueError, match="pooling"):
        SnapKiviCache.for_model(model, 1, 24, budget=8, window=4, pooling="median")
    small = SnapKiviCache.for_model(model, 1, 8, budget=12, window=4, group=4, residual=4)
    with pytest.raises(CacheFullError), torch.no_grad():
        model(ids, cache=small)
    assert small.held(0) == 0 and int(small.dropped[0]) == 0
