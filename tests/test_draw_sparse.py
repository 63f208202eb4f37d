"""kvlib.course.draw.sparse: Quest's bounds and selected blocks, drawn from a live QuestCache."""

import pytest
import torch

from kvlib.course import figures
from kvlib.course.draw import cells_with
from kvlib.course.draw import sparse as draw_sparse
from kvlib.sparse import QuestCache, block_summaries, block_upper_bound, select_blocks


def _cache(n=45, bs=8, n_select=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = QuestCache(2, 1, 2, 64, 8, block_size=bs, n_select=n_select, dense_layers=0)
    for layer in range(2):
        q, k, v = torch.randn(1, 4, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
        cache.attend(layer, q, k, v)
    return cache, torch.randn(1, 4, 8, generator=g)


def test_selection_is_what_select_blocks_picks_from_the_cache():
    cache, q = _cache()
    bound, true_max, sel = draw_sparse.selection_of(cache, q, 1)
    n = cache.held(0)
    kmin, kmax = block_summaries(cache.k[1][:, :, :n], torch.tensor([n]), 8)
    want = block_upper_bound(q, kmin, kmax)
    assert torch.allclose(bound, want[0])
    assert torch.equal(sel, select_blocks(want, torch.tensor([n]), 8, 3)[0])
    assert (bound >= true_max - 1e-5).all()  # the bound is a bound
    keys = cache.k[1][0, :, :n].repeat_interleave(2, 0)  # (H, n, D)
    assert torch.allclose(true_max[:, 0], (keys[:, :8] @ q[0][..., None])[..., 0].amax(-1))


@pytest.mark.parametrize("head", [0, 3])
def test_filled_bars_are_the_selected_blocks(head):
    cache, q = _cache(seed=head)
    fig = draw_sparse.quest_selection(cache, q, 0, head, needle=range(10, 20))
    _, _, sel = draw_sparse.selection_of(cache, q, 0)
    chosen = sorted(sel[head][sel[head] >= 0].tolist())
    assert cells_with(fig, "selected") == len(chosen) == 3
    assert cells_with(fig, "skipped") == 6 - 3  # 45 positions: 6 blocks of 8
    assert cells_with(fig, "needle") == 1
    drawn = sorted(round(p.get_x() + 0.4) for p in fig.axes[0].patches if p.get_gid() == "selected")
    assert drawn == chosen and 5 in chosen  # the current, partly filled block is always read
    assert figures.figure_problems(fig) == []
