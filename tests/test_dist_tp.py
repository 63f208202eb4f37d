"""kvlib.dist.tp: the engines' head-split rule, the bytes per rank, and real tensor-parallel decoding
(gloo, one thread per rank) token-identical to one process. A spawn costs seconds: one launch per tp size."""

import pytest
import torch

from kvlib.course.draw import cells_with
from kvlib.course.draw import shard as draw_shard
from kvlib.dist import launch, tp
from kvlib.generate import generate
from kvlib.model import ModelConfig

SMOLLM2 = ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536)


def test_plan_follows_vllms_rule_on_smollm2_heads():
    assert tp.plan(SMOLLM2, 3).kv_heads == ((0,), (1,), (2,))
    assert tp.plan(SMOLLM2, 3).q_heads[1] == (3, 4, 5)
    with pytest.raises(ValueError, match=r"hidden width \(1536\) must be divisible by tensor parallel size \(9\)"):
        tp.plan(SMOLLM2, 9)  # the heads allow 9, SmolLM2's MLP width does not
    p9 = tp.plan(SMOLLM2, 9, mlp=False)  # more ranks than K/V heads: each K/V head on 3 ranks (QKVParallelLinear)
    assert p9.kv_replicas == 3 and [h for (h,) in p9.kv_heads] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for bad in (2, 4, 5, 6, 7, 8):
        with pytest.raises(ValueError, match=rf"Total number of attention heads \(9\) must be divisible by "
                                             rf"tensor parallel size \({bad}\)\."):
            tp.plan(SMOLLM2, bad)
    with pytest.raises(ValueError, match="multiple of the K/V heads"):  # 24 query heads, 8 K/V heads, tp 12
        tp.plan(ModelConfig(n_heads=24, n_kv_heads=8, dim=768, hidden_dim=1536), 12)
    with pytest.raises(ValueError, match="tp must be an int"):
        tp.plan(SMOLLM2, 0)


def test_bytes_per_rank_stop_falling_once_tp_passes_the_kv_heads():
    one = tp.kv_bytes_per_rank(SMOLLM2, 1, 8192)
    assert one == 2 * 30 * 8192 * 3 * 64 * 4
    assert tp.kv_bytes_per_rank(SMOLLM2, 3, 8192) * 3 == one
    assert tp.kv_bytes_per_rank(SMOLLM2, 9, 8192) == tp.kv_bytes_per_rank(SMOLLM2, 3, 8192)  # replicated
    assert 9 * tp.kv_bytes_per_rank(SMOLLM2, 9, 8192) == 3 * one  # the group holds 3 copies


def test_shards_partition_every_weight(model):
    """The column and row slices of all ranks together are the full weights, each piece exactly once."""
    shards = [tp.shard_model(model, r, 2) for r in range(2)]
    full = model.layers[0]
    wq = torch.cat([s.layers[0].attn.wq.weight for s in shards], 0)
    wo = torch.cat([s.layers[0].attn.wo.weight for s in shards], 1)
    down = torch.cat([s.layers[0].mlp.w_down.weight for s in shards], 1)
    assert torch.equal(wq, full.attn.wq.weight) and torch.equal(wo, full.attn.wo.weight)
    assert torch.equal(down, full.mlp.w_down.weight)
    assert shards[1].layers[0].attn.wk.weight.shape == (model.config.head_dim, model.config.dim)  # 1 of 2 K/V heads
    assert torch.equal(shards[1].layers[0].attn.wk.weight, full.attn.wk.weight[model.config.head_dim:])


@pytest.fixture(scope="module")
def tiny():
    from kvlib.model import load_tiny

    return load_tiny(device="cpu")[0]


@pytest.mark.parametrize("which, size", [("tiny", 2), ("gqa", 4)])
def test_tp_decoding_is_token_identical_with_the_bytes_of_the_formula(which, size, tiny, model):
    """The tiny model (8 query and 8 K/V heads) at tp 2: 4 K/V heads per rank; the random GQA model (4 query,
    2 K/V heads) at tp 4: each K/V head replicated on 2 ranks."""
    model = tiny if which == "tiny" else model
    prompt, n = [7, 1, 8, 2, 8, 1, 8, 28], 10  # ids inside both vocabularies (64 and 256)
    ref = generate(model, [prompt], n)[0].tolist()
    out = launch.run(tp.generate_tp, size, model, prompt, n, timeout_s=90)
    assert [o["tokens"] for o in out] == [ref] * size
    expected = tp.kv_bytes_per_rank(model.config, size, len(prompt) + n)
    assert [o["cache_bytes"] for o in out] == [expected] * size
    p = tp.plan(model.config, size)
    assert [o["kv_heads"] for o in out] == list(p.kv_heads) and [o["q_heads"] for o in out] == list(p.q_heads)
    assert {o["all_reduces"] for o in out} == {2 * model.config.n_layers * n}  # one forward per new token
    # per decode step: 2 per layer, each of the one new token's (B=1, T=1, C) fp32 partial sums
    assert {o["all_reduce_bytes_per_step"] for o in out} == {2 * model.config.n_layers * model.config.dim * 4}
    assert all(0 < o["cpu_seconds"] and 0 <= o["collective_seconds"] <= o["seconds"] for o in out)
    assert out[0]["cache_shape"][1] == len(p.kv_heads[0])
    fig = draw_shard.tp_heads(out, model.config)  # the picture counts what the ranks' caches hold
    assert cells_with(fig, "filled") == sum(o["cache_shape"][1] for o in out) == sum(len(h) for h in p.kv_heads)
    assert cells_with(fig, "query") == model.config.n_heads
