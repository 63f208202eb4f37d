"""kvlib.course.draw.quant: chapter 06's picture shows the groups and scales quantize_int8 really uses."""

import pytest
import torch

from kvlib.course import figures
from kvlib.course.draw import cells_with
from kvlib.course.draw import quant as draw_quant
from kvlib.quant import quantize_int8


def _patches(fig, gid):
    return [p for ax in fig.axes for p in ax.patches if p.get_gid() == gid]


@pytest.mark.parametrize("T, D", [(1, 4), (5, 8), (12, 32), (3, 17)])
def test_groups_and_scales_match_quantize_int8(T, D):
    g = torch.Generator().manual_seed(T * 100 + D)
    x = torch.randn(T, D, generator=g)
    fig = draw_quant.groups(x)
    n_scales = sum(quantize_int8(x, dim)[1].numel() for dim in draw_quant.GRANULARITY.values())
    assert n_scales == T + D  # one per token, one per channel
    assert cells_with(fig, "scale") == n_scales
    assert cells_with(fig, "group") == n_scales
    assert cells_with(fig, "max") == n_scales  # one number sets each group's scale
    assert cells_with(fig, "value") == 2 * x.numel()  # every number, in each panel
    assert figures.figure_problems(fig) == []


def test_the_marked_number_is_the_one_that_sets_each_scale():
    x = torch.zeros(4, 6)
    x[:, 2] = torch.tensor([1.0, -3.0, 2.0, 0.5])  # channel 2 is each token's largest...
    x[1, 5] = 9.0  # ...except token 1, whose largest is channel 5
    fig = draw_quant.groups(x, {"per token": -1})
    size = draw_quant.SIZE
    x0 = min(p.get_x() for p in _patches(fig, "value"))
    cols = sorted(round((p.get_x() - 0.03 - x0) / size) for p in _patches(fig, "max"))
    assert cols == sorted([2, 5, 2, 2])
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    scales = quantize_int8(x, -1)[1].flatten().tolist()
    assert all(f"{s:.3f}" in texts for s in scales)  # the scales drawn are quantize_int8's


def test_the_per_channel_scales_are_written_too():
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(3))
    fig = draw_quant.groups(x, {"per channel": 0})
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    scales = quantize_int8(x, 0)[1].flatten().tolist()
    assert len(scales) == 7 and all(f"{s:.3f}" in texts for s in scales)


def test_the_drawing_changes_with_the_tensor():
    x = torch.randn(3, 8)
    before = cells_with(draw_quant.groups(x, {"per channel": 0}), "scale")
    after = cells_with(draw_quant.groups(torch.cat([x, x], dim=1), {"per channel": 0}), "scale")
    assert (before, after) == (8, 16)


@pytest.mark.parametrize("bad, dims", [(torch.randn(2, 3, 4), None), (torch.randn(3, 4), {"per head": (0, 1)})])
def test_refuses_what_it_cannot_draw(bad, dims):
    with pytest.raises(ValueError):
        draw_quant.groups(bad, dims)
