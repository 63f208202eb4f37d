"""kvlib.course.draw.cache: chapter 03's diagrams show the live cache's real state."""

import math
from collections import Counter

import pytest
import torch

from kvlib.cache import KVCache
from kvlib.course import figures
from kvlib.course.draw import cache as draw_cache
from kvlib.course.draw import cells_with
from kvlib.model import ModelConfig, Transformer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)).eval()


def run(model, p, k, max_len=16):
    """A prefill of p tokens and k greedy decode steps through a Recorder; returns (recorder, cache)."""
    cache = KVCache.for_model(model, 1, max_len)
    rec = draw_cache.Recorder(cache)
    with torch.no_grad():
        logits = model(torch.arange(1, p + 1)[None], cache=rec)
        for _ in range(k):
            logits = model(logits[:, -1].argmax(-1, keepdim=True), positions=cache.next_positions(), cache=rec)
    return rec, cache


def rows_of(fig, gid):
    """Cells of this gid per drawn row (rows told apart by their height), top row first."""
    ys = Counter(round(p.get_y(), 3) for ax in fig.axes for p in ax.patches if p.get_gid() == gid)
    return [ys[y] for y in sorted(ys, reverse=True)]


@pytest.mark.parametrize("p, k", [(1, 1), (5, 3), (9, 0), (3, 7)])
def test_filling_shows_the_cache_after_each_call(model, p, k):
    rec, cache = run(model, p, k)
    fig = draw_cache.filling(rec)
    assert rec.calls == [([0], p)] + [([p + i], 1) for i in range(k)]
    filled = rows_of(fig, "filled")
    assert filled == [p + i for i in range(k + 1)]  # one row per call, each the lengths after it
    assert filled[-1] == cache.held(0) == int(cache.seq_lens[0])  # the last row is the live cache
    assert cells_with(fig, "new") == p + k  # the rows each call wrote: T for the prefill, 1 per step
    assert cells_with(fig, "filled") + cells_with(fig, "empty") == (k + 1) * cache.max_len
    assert figures.figure_problems(fig) == []


def test_slots_follow_the_live_cache_and_change_with_it(model):
    cache = KVCache(n_layers=1, batch=2, n_kv_heads=1, max_len=6, head_dim=4)
    for b, T in ((0, 3), (1, 1)):
        kv = torch.ones(1, 1, T, 4)
        cache.sequence(b).attend(0, kv, kv, kv)
    fig = draw_cache.slots(cache, new=[3, 1])
    assert rows_of(fig, "filled") == cache.seq_lens.tolist() == [3, 1]
    assert cells_with(fig, "new") == 4 and cells_with(fig, "empty") == 2 * 6 - 4
    new = torch.ones(2, 1, 1, 4)
    cache.attend(0, new, new, new)  # one decode step: the drawing changes with the cache
    fig2 = draw_cache.slots(cache, new=1)
    assert rows_of(fig2, "filled") == [4, 2] and cells_with(fig2, "new") == 2


def test_prefill_vs_decode_draws_the_scores_each_call_computes(model):
    rec, cache = run(model, 6, 2)
    fig = draw_cache.prefill_vs_decode(rec)
    T, L = 6, cache.held(0)
    assert cells_with(fig, "query") == T * (T + 1) // 2 + L  # causal T x T block, then one row of L scores
    assert cells_with(fig, "masked") == T * (T - 1) // 2
    assert cells_with(fig, "new") == T + 1 and cells_with(fig, "filled") == T + L


def test_the_recorder_changes_nothing(model):
    plain = KVCache.for_model(model, 1, 8)
    rec, cache = run(model, 4, 2, max_len=8)
    with torch.no_grad():
        logits = model(torch.arange(1, 5)[None], cache=plain)
        for _ in range(2):
            logits = model(logits[:, -1].argmax(-1, keepdim=True), positions=plain.next_positions(), cache=plain)
    assert torch.equal(plain.k[1], cache.k[1]) and plain.seq_lens.tolist() == cache.seq_lens.tolist()


def test_drawings_refuse_a_stale_or_empty_record(model):
    cache = KVCache.for_model(model, 1, 8)
    with pytest.raises(ValueError, match="no call"):
        draw_cache.filling(draw_cache.Recorder(cache))
    rec, cache = run(model, 3, 0)
    with pytest.raises(ValueError, match="decode step"):
        draw_cache.prefill_vs_decode(rec)
    cache.reset()
    with pytest.raises(ValueError, match="changed"):
        draw_cache.filling(rec)


@pytest.mark.parametrize("S, N", [(103, 4), (20, 4), (1, 1), (16, 2), (257, 8), (5, 64)])
def test_kernel_splits_cover_exactly_S_positions(S, N):
    ranges = draw_cache.kernel_splits(S, N)
    assert len(ranges) == N and ranges[0][0] == 0 and ranges[-1][1] == S
    assert all(a <= e and e == a2 for (a, e), (a2, _) in zip(ranges, ranges[1:]))  # contiguous, in order
    assert sum(e - a for a, e in ranges) == S
    assert all((e - a) % 16 == 0 for a, e in ranges[:-1] if e < S)  # whole 16-position tiles but the last
    fig = draw_cache.split_k(S, N)
    assert cells_with(fig, "position") == S
    drawn = Counter(p.get_label() for p in fig.axes[0].patches if p.get_gid() == "position")
    assert drawn == Counter({f"split {i}": e - a for i, (a, e) in enumerate(ranges) if e > a})


@pytest.mark.parametrize("S, N", [(103, 4), (20, 4), (40, 2)])
def test_kernel_splits_are_the_kernels_own(S, N):
    """The decode kernel's per-split log-sum-exp equals the logsumexp of the scores over kernel_splits' ranges
    (an empty split: -inf), so the drawing shows the partition the kernel uses."""
    from kvlib._triton import triton  # noqa: F401  (the interpreter on a CPU)
    from kvlib.cache import _decode_kernel

    g = torch.Generator().manual_seed(0)
    D, H = 16, 1
    q, k, v = torch.randn(1, H, D, generator=g), torch.randn(1, 1, S, D, generator=g), torch.randn(1, 1, S, D, generator=g)
    part = torch.empty(H, N, D)
    lse = torch.empty(H, N)
    _decode_kernel[(H, N)](q, k, v, part, lse, torch.tensor([S], dtype=torch.int32), q.stride(0), q.stride(1),
                           k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), H, D, 1,
                           (1 / math.sqrt(D)) * 1.4426950408889634, SPLITS=N, TILE_N=16, TILE_D=16)
    scores = (k[0, 0] @ q[0, 0]) / math.sqrt(D)
    for s, (a, e) in enumerate(draw_cache.kernel_splits(S, N)):
        want = torch.logsumexp(scores[a:e], 0) / math.log(2) if e > a else torch.tensor(float("-inf"))
        assert torch.allclose(lse[0, s], want, atol=1e-4) or (e == a and lse[0, s] == float("-inf")), (s, a, e)


def test_split_k_weights_come_from_the_lse_given():
    lse = torch.tensor([0.0, math.log(3.0)])
    fig = draw_cache.split_k(40, 2, lse)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any("weight 0.25" in t for t in texts) and any("weight 0.75" in t for t in texts)
    fig = draw_cache.split_k(20, 4, torch.tensor([1.0, 2.0, float("-inf"), float("-inf")]))
    assert sum("empty" in t.get_text() for t in fig.axes[0].texts) == 2
