"""GQA: repeat_kv, the grouped decode kernel, converting an MHA model."""

import pytest
import torch

from kvlib import runtime
from kvlib.attention import attention_ref
from kvlib.cache import decode_attention_ref
from kvlib.gqa import finetune, grouped_decode_attention, mha_to_gqa, repeat_kv
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


@pytest.mark.parametrize("H, H_KV", [(4, 4), (8, 2), (8, 1), (32, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_grouped_decode_matches_reference(H, H_KV, dtype, num_splits):
    g = torch.Generator().manual_seed(H * 10 + H_KV)
    B, S, D = 2, 70, 48
    q = torch.randn(B, H, D, generator=g).to(dtype).to(runtime.DEVICE)
    k = torch.randn(B, H_KV, S, D, generator=g).to(dtype).to(runtime.DEVICE)
    v = torch.randn(B, H_KV, S, D, generator=g).to(dtype).to(runtime.DEVICE)
    lens = torch.tensor([S, 9], dtype=torch.int32, device=runtime.DEVICE)
    ref = decode_attention_ref(q, k, v, lens)
    out = grouped_decode_attention(q, k, v, lens, num_splits=num_splits)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out.float() - ref.float()).abs().max() <= tol
    # the baseline that copies K/V out to every query head gives the same answer
    rep = decode_attention_ref(q, repeat_kv(k, H // H_KV), repeat_kv(v, H // H_KV), lens)
    assert (rep.float() - ref.float()).abs().max() <= tol


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
