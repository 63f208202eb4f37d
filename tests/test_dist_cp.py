"""kvlib.dist.cp: the stripes, chapter 03's merge across ranks, and real decode context parallelism (gloo, one
thread per rank) token-identical to one process, with the bytes and the all-gather volume of the formulas."""

import math

import torch

from kvlib.cache import decode_attention_ref
from kvlib.course.draw import cells_with
from kvlib.course.draw import shard as draw_shard
from kvlib.dist import cp, launch
from kvlib.generate import generate


def test_stripes_are_round_robin_and_cover_every_position_once():
    S, n = 23, 3
    stripes = [cp.stripe(r, n, S) for r in range(n)]
    assert sorted(p for s in stripes for p in s) == list(range(S))
    assert all(cp.owner(p, n) == r for r, s in enumerate(stripes) for p in s)
    assert [len(s) for s in stripes] == [8, 8, 7]


def test_merge_ref_equals_chapter_03s_kernel_with_an_empty_split_and_three_ranks():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 16, generator=g)
    part, lse = torch.randn(2, 3, 3, 16, generator=g), torch.randn(2, 3, 3, generator=g) * 5
    lse[0, 0, 1] = float("-inf")  # a rank that holds no position yet
    part[0, 0, 1] = 0
    ref = cp.merge(q, part, lse, "torch")
    kernel = cp.merge(q, part, lse, "triton")  # kvlib.cache.merge_splits, three splits padded to four
    assert torch.allclose(ref, kernel, atol=1e-6) and torch.isfinite(ref).all()


def test_partials_over_stripes_merge_to_attention_over_every_position():
    g = torch.Generator().manual_seed(1)
    B, H, H_KV, S, D, n = 2, 4, 2, 19, 16, 3
    q, k, v = torch.randn(B, H, D, generator=g), torch.randn(B, H_KV, S, D, generator=g), torch.randn(B, H_KV, S, D, generator=g)
    k[:, :, 5] += 30  # one position dominates: the merge must weigh by each stripe's softmax sum
    full = decode_attention_ref(q, k, v, torch.full((B,), S, dtype=torch.int32))
    parts = [cp.local_attention(q, k[:, :, cp.stripe(r, n, S)], v[:, :, cp.stripe(r, n, S)]) for r in range(n)]
    out = cp.merge(q, torch.stack([p for p, _ in parts], 2), torch.stack([l for _, l in parts], 2), "torch")
    assert torch.allclose(out, full, atol=1e-5)
    naive = torch.stack([p for p, _ in parts]).mean(0)  # averaging the partials is not attention
    assert not torch.allclose(naive, full, atol=1e-2)


def test_one_rank_striped_cache_is_the_plain_cache(model):
    prompt, n = [3, 1, 4, 1, 5], 8
    cache = cp.StripedCache(model, batch=1, max_len=len(prompt) + n, rank=0, cp=1)
    assert cp.greedy(model, prompt, n, cache) == generate(model, [prompt], n)[0].tolist()


def _cp_both_merges(rank, world_size, model, prompt, n):
    return [cp.generate_cp(rank, world_size, model, prompt, n, kernels=k) for k in ("torch", "triton")]


def test_cp_decoding_is_token_identical_with_the_bytes_of_the_formulas():
    from kvlib.model import load_tiny

    model = load_tiny(device="cpu")[0]  # the course's tiny model: 4 layers, 8 heads of dim 32
    prompt, n, size = [72, 101, 108, 108, 111, 44, 32], 10, 3
    ref = generate(model, [prompt], n)[0].tolist()
    out = launch.run(_cp_both_merges, size, model, prompt, n, timeout_s=90)
    for merged_by in range(2):  # PyTorch's merge, then chapter 03's Triton kernel
        runs = [o[merged_by] for o in out]
        assert [r["tokens"] for r in runs] == [ref] * size
        held = len(prompt) + n - 1  # the last new token is never stored
        assert [r["positions"] for r in runs] == [cp.stripe(r, size, held) for r in range(size)]
        assert {r["cache_bytes"] for r in runs} == {cp.kv_bytes_per_rank(model.config, size, len(prompt) + n)}
        assert {r["gathered_bytes_per_step"] for r in runs} == {cp.allgather_bytes_per_step(model.config, size)}
        assert {r["gathers_per_step"] for r in runs} == {model.config.n_layers}
        assert all(0 < r["cpu_seconds"] and 0 <= r["collective_seconds"] <= r["seconds"] for r in runs)
    fig = draw_shard.cp_stripes([o[0] for o in out])  # one filled cell per held position, on its rank's row
    assert cells_with(fig, "filled") == held and cells_with(fig, "empty") == (size - 1) * held
    c = model.config
    assert cp.allgather_bytes_per_step(c, size) == c.n_layers * 2 * c.n_heads * (c.head_dim + 1) * 4  # 2 = cp - 1
    assert cp.kv_bytes_per_rank(c, size, 17) == 2 * c.n_layers * math.ceil(17 / 3) * c.n_kv_heads * c.head_dim * 4
