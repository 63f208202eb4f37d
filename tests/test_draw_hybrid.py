"""kvlib.course.draw.hybrid: a window layer's ring beside a full layer, drawn from a live HybridCache."""

import pytest
import torch

from kvlib.course import figures
from kvlib.course.draw import cells_with
from kvlib.course.draw import hybrid as draw_hybrid
from kvlib.hybrid import HybridCache


def _fed(n, window=5, n_sink=0, spare=0):
    cache = HybridCache(["window", "full"], 1, 1, 24, 4, window=window, n_sink=n_sink, spare=spare)
    g = torch.Generator().manual_seed(n)
    for layer in range(2):
        cache.attend(layer, *(torch.randn(1, 1, n, 4, generator=g) for _ in range(3)))
    return cache


@pytest.mark.parametrize("n, n_sink, spare", [(3, 0, 0), (13, 0, 0), (13, 2, 0), (17, 3, 2)])
def test_cells_are_the_rows_each_layer_holds(n, n_sink, spare):
    cache = _fed(n, n_sink=n_sink, spare=spare)
    fig = draw_hybrid.ring_and_full(cache, 0, 1)
    held = cache.held(0, 0) + cache.held(0, 1)
    assert sum(cells_with(fig, k) for k in ("filled", "sink", "new")) == held
    assert cells_with(fig, "new") == 2  # the newest position, in both layers
    assert cells_with(fig, "sink") == min(n_sink, n)
    assert cells_with(fig, "empty") == cache.k[0].shape[2] - cache.held(0, 0)
    texts = [t.get_text() for t in fig.axes[0].texts]
    ring = [p for p in cache.pos[0][0].tolist() if p >= 0]
    assert all(str(p) in texts for p in ring)
    assert figures.figure_problems(fig) == []


def test_the_ring_shows_positions_in_row_order():
    cache = _fed(13)
    kinds, positions = draw_hybrid.row_kinds(cache, 0)
    assert positions == [10, 11, 12, 8, 9] and kinds == ["filled", "filled", "new", "filled", "filled"]
    with pytest.raises(ValueError, match="window layer"):
        draw_hybrid.ring_and_full(cache, 1, 0)
