"""Ragged paged attention: the Triton kernel (the interpreter on CPU) and the batched reference against a naive
per-token loop, on mixed batches of decodes and prefill chunks; the chapter's own functions as cross-checks;
misuse."""

import math

import pytest
import torch

from kvlib import runtime
from kvlib.attention import attention_ref
from kvlib.paged import paged_decode_attention_ref
from kvlib.ragged import ragged_paged_attention, ragged_paged_attention_ref

import _pools  # tests/_pools.py

DEV = runtime.DEVICE


def make_batch(batch, H, H_KV, D, block_size, dtype=torch.float32, seed=0, spare_blocks=3, int64=False):
    """batch: [(n_new, seq_len), ...]. Pools whose blocks are handed out in a scrambled order (as after many
    allocations and frees), -1 past each sequence's blocks; q and the pools filled with random values."""
    k, v, tables, g = _pools.scattered_pool([L for _, L in batch], block_size, H_KV, D, dtype, seed,
                                            spare=spare_blocks, extra_columns=1)  # one unused column too
    N = sum(n for n, _ in batch)
    q = torch.randn(N, H, D, generator=g).to(dtype)
    it = torch.int64 if int64 else torch.int32
    cu = torch.tensor([0] + torch.tensor([n for n, _ in batch]).cumsum(0).tolist(), dtype=it)
    lens = torch.tensor([L for _, L in batch], dtype=it)
    return [t.to(DEV) for t in (q, k, v, tables.to(it), cu, lens)]


def naive(q, k_blocks, v_blocks, block_tables, cu_seqlens_q, seq_lens):
    """The definition, one query token at a time (fp32): token j of sequence i at position p = L - n + j
    attends positions 0..p of its sequence, query head h reading K/V head h // n_rep."""
    q, k_blocks, v_blocks = q.cpu().double(), k_blocks.cpu().double(), v_blocks.cpu().double()
    tables, cu, lens = block_tables.cpu().long(), cu_seqlens_q.cpu().tolist(), seq_lens.cpu().tolist()
    N, H, D = q.shape
    bs, H_KV = k_blocks.shape[1], k_blocks.shape[2]
    out = torch.zeros(N, H, D, dtype=torch.float64)
    for i, L in enumerate(lens):
        n = cu[i + 1] - cu[i]
        for j in range(n):
            p = L - n + j
            pos = torch.arange(p + 1)
            k = k_blocks[tables[i, pos // bs], pos % bs]  # (p + 1, H_KV, D)
            v = v_blocks[tables[i, pos // bs], pos % bs]
            for h in range(H):
                kv_h = h // (H // H_KV)
                w = torch.softmax(k[:, kv_h] @ q[cu[i] + j, h] / math.sqrt(D), dim=0)  # (p + 1,)
                out[cu[i] + j, h] = w @ v[:, kv_h]
    return out


# (block_size, H, H_KV, D, batch [(new tokens, length incl. them)]): block sizes 1, 4, 5 (no power of two),
# 16 and 64 (a whole key tile inside one block); groups of 1, 2, 3, 4, 8; D 16, 48 (no power of two), 64, 128;
# lengths that end mid-block; decodes at position 0 and deep in a sequence; prefill from position 0; a chunk
# after a cached prefix; decode-only, prefill-only and mixed batches.
CASES = {
    "mixed bs=1 mha": (1, 4, 4, 16, [(1, 5), (7, 7), (3, 10)]),
    "mixed bs=4 gqa4": (4, 8, 2, 64, [(1, 1), (1, 37), (13, 13), (9, 30)]),
    "mixed bs=5 gqa2": (5, 4, 2, 16, [(6, 23), (1, 12), (2, 2)]),
    "mixed bs=16 mqa8 D=128": (16, 8, 1, 128, [(1, 50), (20, 45)]),
    "smollm2 9/3 bs=16": (16, 9, 3, 64, [(1, 33), (1, 17), (40, 70)]),
    "decode-only bs=4 gqa2": (4, 2, 1, 16, [(1, 3), (1, 9), (1, 16), (1, 1)]),
    "prefill-only bs=16 D=48": (16, 4, 2, 48, [(30, 30), (17, 60)]),
    "chunk after prefix bs=64": (64, 4, 1, 32, [(37, 100)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_and_reference_match_the_naive_loop(case, dtype):
    block_size, H, H_KV, D, batch = CASES[case]
    args = make_batch(batch, H, H_KV, D, block_size, dtype, seed=len(case))
    expected = naive(*args)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for fn in (ragged_paged_attention_ref, ragged_paged_attention):
        out = fn(*args)
        assert out.shape == args[0].shape and out.dtype == dtype and out.device == args[0].device
        err = (out.cpu().double() - expected).abs().max().item()
        assert err <= tol, f"{fn.__name__}: max error {err:.2e} > {tol}"


def test_reference_matches_the_naive_loop_on_random_batches():
    """The reference alone (cheap) on 40 random batches: any mix of decodes and chunks, any group size."""
    g = torch.Generator().manual_seed(1)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    for seed in range(40):
        H_KV = draw(1, 3)
        H, D, bs = H_KV * draw(1, 4), draw(1, 3) * 8, [1, 2, 3, 8, 16][draw(0, 4)]
        batch = []
        for _ in range(draw(1, 5)):
            n = 1 if draw(0, 1) else draw(1, 12)
            batch.append((n, n + draw(0, 20)))
        args = make_batch(batch, H, H_KV, D, bs, seed=seed, int64=bool(seed % 2))
        err = (ragged_paged_attention_ref(*args).cpu().double() - naive(*args)).abs().max().item()
        assert err <= 1e-5, (seed, batch, H, H_KV, D, bs, err)


def test_kernel_on_a_random_mixed_batch():
    args = make_batch([(1, 40), (11, 11), (1, 2), (26, 33), (1, 19)], 6, 2, 32, 8, seed=7, int64=True)
    torch.testing.assert_close(ragged_paged_attention(*args).cpu().double(), naive(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiles", [(128, 64, 8, 2), (128, 32, 8, 2), (16, 64, 4, 2), (32, 16, 8, 2), (16, 16, 4, 2)],
                         ids=["128x64", "128x32", "16x64", "32x16", "16x16"])
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_kernel_with_the_gpu_tiles(monkeypatch, tiles, block_size):
    """The tiles the wrapper picks on a GPU (see ragged._ragged_config), run in the interpreter: key tiles larger
    and smaller than a block (one table entry per row or per tile), up to 128 rows (42 tokens of 9/3 heads)."""
    import kvlib.ragged as ragged

    monkeypatch.setattr(ragged, "_ragged_config", lambda *a, **k: tiles)
    n_rep = 3 if tiles[0] >= 64 else 1  # 16 rows hold one token's heads when n_rep <= 16
    H_KV = 1 if tiles[0] >= 64 else 2
    args = make_batch([(1, 70), (50, 150), (1, 3)], H_KV * n_rep, H_KV, 16, block_size, seed=block_size)
    torch.testing.assert_close(ragged_paged_attention(*args).cpu().double(), naive(*args), atol=1e-5, rtol=1e-5)


# ---- the chapter's own functions agree -----------------------------------------------------------------


def test_decode_only_batch_is_paged_decode_attention():
    q, k, v, tables, cu, lens = make_batch([(1, 30), (1, 1), (1, 17)], 8, 2, 32, 4, seed=3)
    expected = paged_decode_attention_ref(q, k, v, tables, lens)
    for fn in (ragged_paged_attention_ref, ragged_paged_attention):
        torch.testing.assert_close(fn(q, k, v, tables, cu, lens), expected, atol=1e-5, rtol=1e-5)


def test_entries_past_a_sequences_own_blocks_are_never_read():
    """Found by fuzzing: the reference gathered a shorter sequence's table out to the longest one's blocks, so an unused
    entry >= num_blocks (which the validator, the kernel and paged_decode_attention_ref all accept) raised IndexError."""
    g = torch.Generator().manual_seed(0)
    kb, vb, q = torch.randn(6, 4, 1, 16, generator=g), torch.randn(6, 4, 1, 16, generator=g), torch.randn(2, 2, 16, generator=g)
    cu, lens = torch.tensor([0, 1, 2]), torch.tensor([7, 9])  # 2 and 3 blocks of 4
    junk = torch.tensor([[3, 0, 999], [5, 1, 2]], dtype=torch.int32)
    clean = torch.tensor([[3, 0, -1], [5, 1, 2]], dtype=torch.int32)
    expected = paged_decode_attention_ref(q, kb, vb, clean, lens)
    for fn in (ragged_paged_attention_ref, ragged_paged_attention):
        torch.testing.assert_close(fn(q, kb, vb, junk, cu, lens), expected, atol=1e-5, rtol=1e-5)


def test_one_chunk_is_causal_attention_aligned_to_the_end():
    """A chunk of T tokens after S - T cached ones is chapter 01's attention over all S keys (end-aligned mask)."""
    T, S, bs = 12, 29, 4
    q, k, v, tables, cu, lens = make_batch([(T, S)], 4, 2, 16, bs, seed=4)
    pos = torch.arange(S, device=DEV)
    blocks = tables[0].long()[pos // bs]
    k_seq = k[blocks, pos % bs].transpose(0, 1)[None]  # (1, H_KV, S, D)
    v_seq = v[blocks, pos % bs].transpose(0, 1)[None]
    expected = attention_ref(q.transpose(0, 1)[None], k_seq, v_seq, causal=True)[0].transpose(0, 1)  # (T, H, D)
    for fn in (ragged_paged_attention_ref, ragged_paged_attention):
        torch.testing.assert_close(fn(q, k, v, tables, cu, lens), expected, atol=1e-5, rtol=1e-5)


def test_views_as_the_engine_passes_them():
    """q a view of an (H, N, D) buffer (heads outermost); pools that are every other block of a larger pool, V
    with its slots not outermost: strides are taken as they come."""
    q, k, v, tables, cu, lens = make_batch([(1, 21), (9, 14)], 4, 2, 16, 4, seed=5)
    expected = ragged_paged_attention_ref(q, k, v, tables, cu, lens)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)  # (N, H, D) with strides (D, N*D, 1)
    assert q_view.stride(0) == q.shape[2] and torch.equal(q_view, q)
    wide_k = torch.zeros(2 * k.shape[0], *k.shape[1:], device=DEV)
    wide_k[::2] = k
    v_t = v.transpose(1, 2).contiguous().transpose(1, 2)
    for fn in (ragged_paged_attention_ref, ragged_paged_attention):
        torch.testing.assert_close(fn(q_view, wide_k[::2], v_t, tables, cu, lens), expected, atol=1e-5, rtol=1e-5)


def test_falls_back_to_the_reference_without_triton(monkeypatch):
    args = make_batch([(1, 9), (4, 6)], 4, 2, 16, 4, seed=6)
    monkeypatch.setattr(runtime, "require_triton", lambda what, **tensors: False)
    assert torch.equal(ragged_paged_attention(*args), ragged_paged_attention_ref(*args))


@pytest.mark.skipif(runtime.mode() != "interpreter", reason="bf16 is refused only in Triton's interpreter")
def test_bf16_is_refused_by_the_kernel_in_the_interpreter_but_not_by_the_reference():
    q, k, v, tables, cu, lens = make_batch([(1, 9), (4, 6)], 4, 2, 16, 4, dtype=torch.bfloat16, seed=8)
    with pytest.raises(TypeError, match="bfloat16"):
        ragged_paged_attention(q, k, v, tables, cu, lens)
    expected = naive(q, k, v, tables, cu, lens)
    assert (ragged_paged_attention_ref(q, k, v, tables, cu, lens).double() - expected).abs().max() < 2e-2


# ---- misuse: a clear error naming the argument, from the reference and the kernel alike ----------------------


def _good():
    """Two sequences (a decode after 5 cached positions, a 3-token prefill) over a pool of 4 blocks of 4."""
    return dict(q=torch.zeros(4, 4, 16), k_blocks=torch.zeros(4, 4, 2, 16), v_blocks=torch.zeros(4, 4, 2, 16),
                block_tables=torch.tensor([[0, 2], [3, -1]], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
                seq_lens=torch.tensor([6, 3], dtype=torch.int32))


def _with(**changes):
    kw = _good()
    kw.update({k: (f(kw) if callable(f) else f) for k, f in changes.items()})
    return kw


MISUSE = {
    "q not a tensor": (_with(q=[[0.0]]), TypeError, "q must be a torch.Tensor"),
    "q 2-d": (_with(q=torch.zeros(4, 16)), ValueError, r"q must be a non-empty \(N, H, D\)"),
    "q empty": (_with(q=torch.zeros(0, 4, 16)), ValueError, r"q must be a non-empty \(N, H, D\)"),
    "q integer": (_with(q=torch.zeros(4, 4, 16, dtype=torch.int64)), TypeError, "q must be a floating-point"),
    "pool 3-d": (_with(k_blocks=torch.zeros(4, 4, 16)), ValueError, r"k_blocks must be a non-empty \(num_blocks, "
                 r"block_size, H_KV, D\)"),
    "v shape": (_with(v_blocks=torch.zeros(4, 2, 2, 16)), ValueError,
                r"v_blocks must have k_blocks' shape \(4, 4, 2, 16\)"),
    "head dim": (_with(k_blocks=torch.zeros(4, 4, 2, 8), v_blocks=torch.zeros(4, 4, 2, 8)), ValueError, "D=16"),
    "H % H_KV": (_with(k_blocks=torch.zeros(4, 4, 3, 16), v_blocks=torch.zeros(4, 4, 3, 16)), ValueError,
                 "H_KV=3 heads, which must divide q's H=4"),
    "dtype mismatch": (_with(k_blocks=torch.zeros(4, 4, 2, 16, dtype=torch.float16)), TypeError,
                       "must have q's dtype torch.float32"),
    "seq_lens 2-d": (_with(seq_lens=torch.tensor([[6, 3]])), ValueError, r"seq_lens must be a \(B,\) tensor"),
    "seq_lens float": (_with(seq_lens=torch.tensor([6.0, 3.0])), TypeError, "seq_lens must be an int32 or int64"),
    "tables rows": (_with(block_tables=torch.tensor([[0, 2]], dtype=torch.int32)), ValueError,
                    r"block_tables must be \(B=2, max_blocks\)"),
    "tables float": (_with(block_tables=torch.tensor([[0.0, 2.0], [3.0, -1.0]])), TypeError,
                     "block_tables must be an int32 or int64"),
    "cu shape": (_with(cu_seqlens_q=torch.tensor([1, 4], dtype=torch.int32)), ValueError,
                 r"cu_seqlens_q must be \(B\+1=3,\)"),
    "cu float": (_with(cu_seqlens_q=torch.tensor([0.0, 1.0, 4.0])), TypeError,
                 "cu_seqlens_q must be an int32 or int64"),
    "cu not from 0": (_with(cu_seqlens_q=torch.tensor([1, 2, 4])), ValueError, "cu_seqlens_q must start at 0, got 1"),
    "cu not increasing": (_with(cu_seqlens_q=torch.tensor([0, 0, 4])), ValueError,
                          "cu_seqlens_q must increase by >= 1 per sequence.*at sequence 0"),
    "cu decreasing": (_with(cu_seqlens_q=torch.tensor([0, 5, 4])), ValueError,
                      "cu_seqlens_q must increase by >= 1 per sequence.*at sequence 1"),
    "cu last != N": (_with(cu_seqlens_q=torch.tensor([0, 1, 3])), ValueError, "cu_seqlens_q must end at N=4"),
    "more new tokens than length": (_with(seq_lens=torch.tensor([6, 2])), ValueError,
                                    r"seq_lens\[1\]=2 is shorter than its 3 new tokens"),
    "past the table": (_with(seq_lens=torch.tensor([9, 3])), ValueError,
                       r"seq_lens\[0\]=9 is past max_blocks\*block_size=8"),
    "block past the pool": (_with(block_tables=torch.tensor([[0, 4], [3, -1]], dtype=torch.int32)), ValueError,
                            r"block_tables\[0\] points outside the pool 0..3 within its first 2 block"),
    "unused block within length": (_with(block_tables=torch.tensor([[0, -1], [3, -1]], dtype=torch.int32)),
                                   ValueError, r"block_tables\[0\] points outside the pool"),
    "devices differ": (_with(seq_lens=lambda kw: kw["seq_lens"].to("meta")), ValueError,
                       "must be on one device, got .*seq_lens on meta"),
}


@pytest.mark.parametrize("fn", [ragged_paged_attention_ref, ragged_paged_attention], ids=["ref", "kernel"])
@pytest.mark.parametrize("name", list(MISUSE))
def test_misuse_names_the_argument(fn, name):
    kw, error, match = MISUSE[name]
    with pytest.raises(error, match=match):
        fn(**kw)


def test_good_inputs_of_the_misuse_table_pass():
    kw = _good()
    kw["q"] = torch.randn(4, 4, 16)
    assert ragged_paged_attention(**kw).shape == (4, 4, 16)  # the -1 of a sequence past its blocks is fine


def test_head_dim_past_256_is_refused_by_the_kernel():
    kw = _with(q=torch.zeros(4, 4, 272), k_blocks=torch.zeros(4, 4, 2, 272), v_blocks=torch.zeros(4, 4, 2, 272))
    with pytest.raises(ValueError, match="head dim D=272 is outside the kernel's range 1..256"):
        ragged_paged_attention(**kw)
    assert ragged_paged_attention_ref(**kw).shape == (4, 4, 272)


def test_head_dim_not_contiguous_is_refused_by_the_kernel():
    kw = _with(q=torch.zeros(4, 16, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="contiguous along the head dim"):
        ragged_paged_attention(**kw)
    assert ragged_paged_attention_ref(**kw).shape == (4, 4, 16)  # the reference takes any strides


def test_a_plan_made_once_serves_every_layer():
    """RaggedPlan: the checks and layout of one forward, reused by every layer (new q and pools each time) with
    the same results as a call without a plan; a call it was not made for is refused, not answered wrongly."""
    from kvlib.ragged import RaggedPlan

    q, k, v, tables, cu, lens = make_batch([(1, 33), (1, 17), (40, 70)], 9, 3, 64, 16, seed=7)
    plan = RaggedPlan(q, k, v, tables, cu, lens)
    for layer in range(3):  # other values in the same shapes, as the next layer's
        g = torch.Generator().manual_seed(layer)
        ql, kl, vl = (torch.randn(t.shape, generator=g).to(DEV) for t in (q, k, v))
        for fn in (ragged_paged_attention_ref, ragged_paged_attention):
            torch.testing.assert_close(fn(ql, kl, vl, tables, cu, lens, plan=plan), fn(ql, kl, vl, tables, cu, lens))
    with pytest.raises(ValueError, match="tensors the plan was made from"):
        ragged_paged_attention_ref(q, k, v, tables.clone(), cu, lens, plan=plan)
    with pytest.raises(ValueError, match="must match what the plan was made for"):
        ragged_paged_attention_ref(q[:, :3].contiguous(), k, v, tables, cu, lens, plan=plan)
    with pytest.raises(ValueError, match="must match what the plan was made for"):
        ragged_paged_attention(q.half(), k.half(), v.half(), tables, cu, lens, plan=plan)
    with pytest.raises(TypeError, match="plan must be a kvlib.ragged.RaggedPlan"):
        ragged_paged_attention_ref(q, k, v, tables, cu, lens, plan="once")
