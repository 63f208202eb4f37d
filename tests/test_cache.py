"""Contiguous KV cache: store kernel, decode kernel (plain and split-K) against the references."""

import pytest
import torch

from kvlib import runtime
from kvlib.cache import CacheFullError, KVCache, decode_attention, decode_attention_ref, store_kv, store_kv_ref

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=runtime.DEVICE)


def sdpa_per_sequence(q, k_cache, v_cache, seq_lens):
    out = []
    n_rep = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        L = int(seq_lens[b])
        k = k_cache[b:b + 1, :, :L].float().repeat_interleave(n_rep, 1)
        v = v_cache[b:b + 1, :, :L].float().repeat_interleave(n_rep, 1)
        out.append(torch.nn.functional.scaled_dot_product_attention(q[b:b + 1, :, None].float(), k, v)[:, :, 0])
    return torch.cat(out)


# (B, H, H_KV, S_max, D, seq_lens): ragged, lengths 1 and S_max, partly filled tiles, D not a power of two
CASES = [
    (1, 1, 1, 50, 16, [50]),
    (3, 4, 2, 100, 32, [1, 37, 100]),
    (2, 8, 1, 70, 48, [65, 3]),
    (2, 8, 8, 40, 64, [40, 17]),
    (1, 4, 4, 300, 128, [257]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}KV{}S{}D{}".format(*c[:5]))
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference_and_sdpa(case, dtype, num_splits):
    B, H, H_KV, S_max, D, lens = case
    q = rand(B, H, D, dtype=dtype, seed=1)
    k = rand(B, H_KV, S_max, D, dtype=dtype, seed=2)
    v = rand(B, H_KV, S_max, D, dtype=dtype, seed=3)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=runtime.DEVICE)
    expected = sdpa_per_sequence(q, k, v, seq_lens)
    ref = decode_attention_ref(q, k, v, seq_lens)
    out = decode_attention(q, k, v, seq_lens, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == (B, H, D)
    assert (ref.float() - expected).abs().max() <= TOL[dtype]
    assert (out.float() - expected).abs().max() <= TOL[dtype]


def test_split_k_spreads_each_sequence_over_the_splits(monkeypatch):
    """Splits are sized by each sequence's own length (in multiples of 16 positions), not by S_max: a
    60-position sequence in a 256-slot cache gives work to all 4 splits (by S_max it would be 64-position
    splits, all of it in split 0)."""
    from kvlib import cache

    seen, merge = {}, cache.merge_splits

    def recording_merge(q, part, lse):  # the per-split log-sum-exps, before they are merged
        seen["lse"] = lse.clone()
        return merge(q, part, lse)

    monkeypatch.setattr(cache, "merge_splits", recording_merge)
    q, k, v = rand(2, 4, 16, seed=7), rand(2, 2, 256, 16, seed=8), rand(2, 2, 256, 16, seed=9)
    lens = torch.tensor([60, 17], dtype=torch.int32, device=runtime.DEVICE)
    out = decode_attention(q, k, v, lens, num_splits=4)
    lse = seen["lse"].view(2, 4, 4)  # (B, H, splits)
    assert torch.isfinite(lse[0]).all(), lse[0]  # 16 + 16 + 16 + 12 positions
    assert torch.isfinite(lse[1, :, :2]).all() and torch.isneginf(lse[1, :, 2:]).all(), lse[1]  # 16 + 1, then none
    assert (out - decode_attention_ref(q, k, v, lens)).abs().max() <= 1e-5


def test_positions_beyond_seq_len_are_never_read():
    q = rand(2, 2, 16, seed=4)
    k = rand(2, 2, 64, 16, seed=5)
    v = rand(2, 2, 64, 16, seed=6)
    lens = torch.tensor([10, 33], dtype=torch.int32, device=runtime.DEVICE)
    before = decode_attention(q, k, v, lens, num_splits=2)
    k[:, :, 40:] = float("nan")
    v[0, :, 10:] = float("inf")
    after = decode_attention(q, k, v, lens, num_splits=2)
    assert torch.equal(before, after)


@pytest.mark.parametrize("T", [1, 5, 17])
def test_store_kv_writes_each_sequence_at_its_own_position(T):
    B, H_KV, S_max, D = 3, 2, 40, 24
    kc, vc = rand(B, H_KV, S_max, D, seed=7), rand(B, H_KV, S_max, D, seed=8)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k_new, v_new = rand(B, H_KV, T, D, seed=9), rand(B, H_KV, T, D, seed=10)
    start = torch.tensor([0, 11, S_max - T], dtype=torch.int64, device=runtime.DEVICE)
    store_kv(kc, vc, k_new, v_new, start)
    store_kv_ref(kc_ref, vc_ref, k_new, v_new, start)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_store_kv_refuses_to_write_past_the_end():
    kc = torch.zeros(1, 1, 8, 16, device=runtime.DEVICE)
    new = torch.ones(1, 1, 3, 16, device=runtime.DEVICE)
    with pytest.raises(ValueError, match="runs past S_max=8"):
        store_kv(kc, kc.clone(), new, new, torch.tensor([6], device=runtime.DEVICE))
    assert kc.abs().sum() == 0


def test_cache_full_is_a_clear_error_and_leaves_the_cache_intact():
    cache = KVCache(n_layers=2, batch=1, n_kv_heads=1, max_len=4, head_dim=16, device=runtime.DEVICE)
    q = rand(1, 1, 3, 16, seed=11)
    for layer in range(2):
        cache.attend(layer, q, q, q)
    snapshot = [t.clone() for t in cache.k], cache.seq_lens.clone()
    with pytest.raises(CacheFullError, match="holds 4 positions"):
        cache.attend(0, q[:, :, :2], q[:, :, :2], q[:, :, :2])
    assert all(torch.equal(a, b) for a, b in zip(cache.k, snapshot[0]))
    assert torch.equal(cache.seq_lens, snapshot[1])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(seq_lens=[0, 5]), r"seq_lens must lie in 1..S_max=32"),
        (dict(seq_lens=[5, 33]), r"seq_lens must lie in 1..S_max=32"),
        (dict(seq_lens_dtype=torch.float32), "int32/int64"),
        (dict(q_heads=3), "must divide"),
        (dict(q_dim=8), "D=8"),
    ],
)
def test_decode_bad_input(kw, match):
    q = torch.zeros(2, kw.get("q_heads", 4), kw.get("q_dim", 16))
    k = torch.zeros(2, 2, 32, 16)
    lens = torch.tensor(kw.get("seq_lens", [3, 4]), dtype=kw.get("seq_lens_dtype", torch.int32))
    with pytest.raises(ValueError, match=match):
        decode_attention(q, k, k.clone(), lens)


def test_decode_rejects_a_cache_not_contiguous_along_d():
    k = torch.zeros(1, 1, 16, 32).transpose(2, 3)  # (1, 1, 32, 16) with D stride 32
    q = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="contiguous along the head dim"):
        decode_attention(q, k, k, torch.tensor([4], dtype=torch.int32))


def test_gpu_mode_names_a_cpu_input_instead_of_crashing_in_triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(runtime, "mode", lambda: "gpu")  # as on a GPU machine, with CPU tensors
    q, k, lens = torch.zeros(1, 2, 16), torch.zeros(1, 1, 8, 16), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache.decode_attention: q is on cpu, but in GPU mode"):
        decode_attention(q, k, k.clone(), lens)


def test_caches_pick_triton_only_for_cuda_tensors_in_gpu_mode(monkeypatch):
    from kvlib.cache import pick_kernels

    assert pick_kernels(None, "cpu") == "torch"
    assert pick_kernels(None, "cuda") == ("triton" if runtime.mode() == "gpu" else "torch")
    monkeypatch.setattr(runtime, "mode", lambda: "gpu")
    assert pick_kernels(None, "cuda") == "triton" and pick_kernels(None, torch.device("cpu")) == "torch"
    assert pick_kernels("triton", "cpu") == "triton"  # an explicit choice is kept
    with pytest.raises(ValueError, match="'triton' or 'torch'"):
        pick_kernels("cuda", "cuda")


def test_sequence_view_slices_per_sequence_buffers_and_shares_what_shared_attrs_name():
    from kvlib.compress import LowRankKVCache
    from kvlib.evict import SinkCache
    from kvlib.lowbit import LayerQuantCache

    inv_freq = torch.rand(4)
    sink = SinkCache(2, 3, 2, 8, 8, inv_freq=inv_freq, positions="reassign")
    bases = [(torch.eye(8)[:, :4].expand(2, 8, 4).clone(), torch.eye(8)[:, :4].expand(2, 8, 4).clone())] * 2
    low = LowRankKVCache(bases, batch=3, max_len=8)
    mixed = LayerQuantCache(2, 3, 2, 8, 8, bits=[16, 4])
    for cache, shared in ((sink, ["inv_freq"]), (low, ["U_k", "U_v"]), (mixed, ["bits"])):
        view = cache.sequence(2)
        assert view.k[0].shape[0] == 1 and view.k[0].data_ptr() == cache.k[0][2].data_ptr()  # a view of row 2
        for name in shared:  # passed on whole: the same object
            assert getattr(view, name) is getattr(cache, name), name
