"""GQA: repeat_kv, the grouped decode kernel, converting an MHA model."""

import pytest
import torch

from kvlib import runtime
from kvlib.attention import attention_ref
from kvlib.cache import decode_attention_ref
from kvlib.gqa import (_grouped_config, finetune, grouped_decode_attention, grouped_decode_partials, mha_to_gqa,
                       repeat_kv)
from kvlib.model import ModelConfig, Transformer


def test_repeat_kv_maps_each_kv_head_to_its_group():
    x = torch.arange(3.0).view(1, 3, 1, 1).expand(2, 3, 4, 5).contiguous()  # head j holds value j
    r = repeat_kv(x, 4)
    assert r.shape == (2, 12, 4, 5)
    assert [int(r[0, h, 0, 0]) for h in range(12)] == [h // 4 for h in range(12)]
    assert repeat_kv(x, 1) is x


@pytest.mark.parametrize("n_rep", [0, -1, 1.5])
def test_repeat_kv_rejects_bad_n_rep(n_rep):
    with pytest.raises(ValueError, match="n_rep"):
        repeat_kv(torch.zeros(1, 1, 1, 1), n_rep)


@pytest.mark.parametrize("H, H_KV", [(4, 4), (8, 4), (8, 2), (8, 1), (32, 8)])  # 1, 2, 4, 8 query heads per group
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_grouped_decode_matches_reference(H, H_KV, dtype, num_splits):
    g = torch.Generator().manual_seed(H * 10 + H_KV)
    B, S, D = 3, 70, 48  # S and D not powers of two
    q = torch.randn(B, H, D, generator=g).to(dtype).to(runtime.DEVICE)
    k = torch.randn(B, H_KV, S, D, generator=g).to(dtype).to(runtime.DEVICE)
    v = torch.randn(B, H_KV, S, D, generator=g).to(dtype).to(runtime.DEVICE)
    lens = torch.tensor([S, 9, 1], dtype=torch.int32, device=runtime.DEVICE)  # ragged, down to one position
    ref = decode_attention_ref(q, k, v, lens)
    out = grouped_decode_attention(q, k, v, lens, num_splits=num_splits)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out.float() - ref.float()).abs().max() <= tol
    # the baseline that copies K/V out to every query head gives the same answer
    rep = decode_attention_ref(q, repeat_kv(k, H // H_KV), repeat_kv(v, H // H_KV), lens)
    assert (rep.float() - ref.float()).abs().max() <= tol


def split_partials_ref(q, k, v, L, split_len, splits):
    """Reference (out, lse in log2 units) of each split [s * split_len, (s + 1) * split_len) of one sequence:
    q (H, D), k/v (H_KV, S_max, D) -> (H, splits, D), (H, splits)."""
    n_rep = q.shape[0] // k.shape[0]
    k, v = k.float().repeat_interleave(n_rep, 0), v.float().repeat_interleave(n_rep, 0)
    outs, lses = [], []
    for s in range(splits):
        lo, hi = s * split_len, min(L, (s + 1) * split_len)
        if lo >= hi:
            outs.append(torch.zeros(q.shape, device=q.device))
            lses.append(torch.full(q.shape[:1], float("-inf"), device=q.device))
            continue
        scores = (k[:, lo:hi] @ q.float()[:, :, None])[..., 0] / q.shape[1] ** 0.5  # (H, hi - lo)
        outs.append((torch.softmax(scores, -1)[:, None] @ v[:, lo:hi])[:, 0])
        lses.append(torch.logsumexp(scores, -1) / torch.log(torch.tensor(2.0)))
    return torch.stack(outs, 1), torch.stack(lses, 1)


def test_splits_are_sized_by_each_sequences_own_length():
    """Short sequences in a long cache still spread over the splits: split s of sequence b covers
    [s * split_len_b, (s + 1) * split_len_b) with split_len_b = cdiv(len_b, SPLITS) rounded up to whole tiles.
    (Sized by S_max = 512, the whole of a 60-position sequence would land in split 0.)"""
    g = torch.Generator().manual_seed(1)
    B, H, H_KV, S_max, D, splits = 2, 8, 2, 512, 64, 4
    q = torch.randn(B, H, D, generator=g).to(runtime.DEVICE)
    k, v = (torch.randn(B, H_KV, S_max, D, generator=g).to(runtime.DEVICE) for _ in range(2))
    lens = torch.tensor([60, 257], dtype=torch.int32, device=runtime.DEVICE)
    strides = (*k.stride()[:3], *v.stride()[:3])
    part, lse = grouped_decode_partials(q, k, v, lens, strides, H_KV, num_splits=splits)
    TILE_N = _grouped_config(D, 16, 4, False, runtime.INTERPRETER)[0]  # fp32: FMA tiles on a GPU
    for b, L in enumerate(lens.tolist()):
        split_len = -(-(-(-L // splits)) // TILE_N) * TILE_N
        rows = slice(b * H, (b + 1) * H)
        finite = torch.isfinite(lse[rows]).all(0).tolist()
        assert finite == [s * split_len < L for s in range(splits)]
        assert sum(finite) >= 2  # the work is spread
        out_ref, lse_ref = split_partials_ref(q[b], k[b], v[b], L, split_len, splits)
        torch.testing.assert_close(part[rows], out_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[rows], lse_ref, atol=1e-5, rtol=1e-5)
    out = grouped_decode_attention(q, k, v, lens, num_splits=splits)
    torch.testing.assert_close(out, decode_attention_ref(q, k, v, lens), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def mha():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=32, dim=64, n_layers=2, n_heads=8, hidden_dim=96)).eval()


def test_mha_to_gqa_mean_pools_each_group(mha):
    gqa = mha_to_gqa(mha, 2)
    assert gqa.config.n_kv_heads == 2 and mha.config.n_kv_heads == 8  # the original is untouched
    w = mha.layers[1].attn.wv.weight.view(2, 4, 8, 64)  # (H_KV, group, D, C)
    torch.testing.assert_close(gqa.layers[1].attn.wv.weight, w.mean(1).reshape(16, 64))
    torch.testing.assert_close(gqa.layers[1].attn.wq.weight, mha.layers[1].attn.wq.weight)
    ids = torch.randint(0, 32, (1, 20))
    assert gqa(ids).shape == (1, 20, 32)


def test_gqa_with_all_heads_is_the_same_model(mha):
    ids = torch.randint(0, 32, (2, 15))
    torch.testing.assert_close(mha_to_gqa(mha, 8)(ids), mha(ids))


@pytest.mark.parametrize("n", [3, 0, 16])
def test_mha_to_gqa_rejects_bad_head_counts(mha, n):
    with pytest.raises(ValueError, match="divisor of n_heads=8"):
        mha_to_gqa(mha, n)


def test_finetune_lowers_the_loss(mha):
    gqa = mha_to_gqa(mha, 1)
    data = torch.tensor([i % 7 for i in range(2000)])  # a trivially learnable sequence
    losses = finetune(gqa, data, steps=30, batch=4, seq_len=32, lr=3e-3)
    assert losses[-1] < 0.5 * losses[0]


def test_grouped_prefill_path_is_unchanged():
    q = torch.randn(1, 8, 10, 16)
    k = torch.randn(1, 2, 10, 16)
    out = attention_ref(q, k, k)
    torch.testing.assert_close(out, attention_ref(q, repeat_kv(k, 4), repeat_kv(k, 4)))
