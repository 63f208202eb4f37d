"""kvlib.course.draw.evict: chapter 09a's heat strips show the positions the live caches hold."""

import pytest
import torch

from kvlib.course import figures
from kvlib.course.draw import cells_with
from kvlib.course.draw import evict as draw_evict
from kvlib.evict import H2OCache, PyramidKVCache, SinkCache, SlidingWindowCache, SnapKVCache
from kvlib.model import ModelConfig, Transformer


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=64)).eval()


def _after(model, cache, n=40, seed=0):
    with torch.no_grad():
        model(torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(seed)), cache=cache)
    return cache


def _patches(fig, gid):
    return [p for ax in fig.axes for p in ax.patches if p.get_gid() == gid]


def test_the_share_is_read_from_held_positions(small):
    cache = _after(small, H2OCache.for_model(small, 1, 12, chunk=4))
    share = draw_evict.held_share(cache, 40)
    for j in range(40):
        holders = sum(int((cache.held_positions(0, layer)[h] == j).any()) for layer in range(3) for h in range(2))
        assert share[j] == holders / 6
    assert share[-6:].eq(1).all() and abs(share.sum().item() - 12) < 1e-6  # H2O keeps its 6 most recent everywhere


@pytest.mark.parametrize("make", [
    lambda m: SlidingWindowCache.for_model(m, 1, 10, chunk=4),
    lambda m: SinkCache.for_model(m, 1, 10, n_sink=3, chunk=4),
    lambda m: H2OCache.for_model(m, 1, 10, chunk=4),
    lambda m: H2OCache.for_model(m, 1, 10, chunk=4, prefill="stream"),
    lambda m: SnapKVCache.for_model(m, 1, 10, window=4),
    lambda m: PyramidKVCache.for_model(m, 1, 10, window=4),
])
def test_held_cells_are_the_positions_some_layer_holds(small, make):
    cache = _after(small, make(small))
    fig = draw_evict.strips({"rule": cache}, 40)
    held = set()
    for layer in range(3):
        held |= set(cache.held_positions(0, layer).flatten().tolist())
    assert cells_with(fig, "held") == len(held)
    assert cells_with(fig, "evicted") == 40 - len(held)
    x0 = min(p.get_x() for p in _patches(fig, "held") + _patches(fig, "evicted"))
    drawn = {round((p.get_x() - x0) / draw_evict.CELL_W) for p in _patches(fig, "held")}
    assert drawn == held
    assert figures.figure_problems(fig) == []


def test_the_window_and_the_sinks_look_as_their_rules_say(small):
    window = _after(small, SlidingWindowCache.for_model(small, 1, 10, chunk=4))
    sinks = _after(small, SinkCache.for_model(small, 1, 10, n_sink=3, chunk=4))
    assert draw_evict.held_share(window, 40).nonzero().flatten().tolist() == list(range(30, 40))
    assert draw_evict.held_share(sinks, 40).nonzero().flatten().tolist() == [0, 1, 2] + list(range(33, 40))


def test_one_strip_per_cache_and_the_needle_framed(small):
    caches = {name: _after(small, make) for name, make in [("window", SlidingWindowCache.for_model(small, 1, 10)),
                                                          ("sinks", SinkCache.for_model(small, 1, 10, n_sink=2))]}
    fig = draw_evict.strips(caches, 40, needle=range(5, 9))
    assert cells_with(fig, "held") + cells_with(fig, "evicted") == 2 * 40
    assert cells_with(fig, "needle") == 1
    frame = _patches(fig, "needle")[0]
    assert abs(frame.get_width() - 4 * draw_evict.CELL_W) < 1e-9
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "window" in texts and "sinks" in texts


def test_refuses_nothing_to_draw():
    with pytest.raises(ValueError):
        draw_evict.strips({}, 10)
