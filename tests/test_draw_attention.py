"""Chapter 01's diagram (kvlib.course.draw.attention) shows the tensors it is given: T x D query cells, S x D key and
value cells, T(T-1)/2 masked weights for a causal prefill of T tokens (0 without the mask), each visible weight the
softmax's value; changing the tensors or the mask changes the drawing; the figure passes the readability check."""

from __future__ import annotations

import pytest
import torch

import kvlib  # noqa: F401  (sets the mode before Triton is imported)
from kvlib.attention import attention_ref
from kvlib.course import figures
from kvlib.course.draw import attention as draw
from kvlib.course.draw import cells_with


def qkv_tensors(T, D, S=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = S or T
    return torch.randn(T, D, generator=g), torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)


def counts(fig):
    return {kind: cells_with(fig, kind) for kind in ("query", "key", "value", "visible", "masked", "output")}


@pytest.mark.parametrize("T, D", [(1, 4), (3, 8), (6, 8), (12, 16)])
def test_the_causal_mask_hides_exactly_the_future(T, D):
    fig = draw.qkv(*qkv_tensors(T, D), causal=True)
    hidden = T * (T - 1) // 2
    assert counts(fig) == dict(query=T * D, key=T * D, value=T * D, visible=T * T - hidden, masked=hidden,
                               output=T * D)
    assert figures.figure_problems(fig) == []


def test_changing_causal_changes_the_drawing():
    q, k, v = qkv_tensors(6, 8)
    with_mask, without = draw.qkv(q, k, v, causal=True), draw.qkv(q, k, v, causal=False)
    assert cells_with(with_mask, "masked") == 15 and cells_with(without, "masked") == 0
    assert cells_with(without, "visible") == 36
    assert "+ mask" in _all_text(with_mask) and "+ mask" not in _all_text(without)


def _all_text(fig):
    return " ".join(t.get_text() for t in fig.axes[0].texts)


def _weights_shown(fig, kind="visible"):
    """The texts printed in the cells of this kind, row by row (visible weights, or the output's values)."""
    ax = fig.axes[0]
    visible = [p for p in ax.patches if p.get_gid() == kind]
    texts = {(round(t.get_position()[0], 6), round(t.get_position()[1], 6)): t.get_text() for t in ax.texts}
    shown = []
    for p in visible:
        x, y = p.get_x() + p.get_width() / 2, p.get_y() + p.get_height() / 2
        shown.append(texts[(round(x, 6), round(y, 6))])
    return shown


def test_each_visible_cell_shows_the_softmax_weight_of_the_live_tensors():
    q, k, v = qkv_tensors(5, 8, seed=3)
    P, hidden = draw.attention_weights(q, k, causal=True)
    expected = [f"{w:.2f}".lstrip("0") if w < 1 else "1" for w in P[~hidden].tolist()]
    assert _weights_shown(draw.qkv(q, k, v)) == expected
    # the row a mask leaves one key is that key's value exactly: out row 0 = v row 0
    assert P[0, 0] == 1 and torch.allclose((P @ v)[0], v[0])
    # other tensors, another picture
    assert _weights_shown(draw.qkv(*qkv_tensors(5, 8, seed=4))) != expected


def test_four_d_tensors_draw_the_named_head_and_its_shared_kv_head():
    """(B, H, T, D) tensors, grouped K/V heads: query head 3 of 4 reads K/V head 1 of 2."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 4, 4, 8, generator=g), torch.randn(2, 2, 4, 8, generator=g), torch.randn(2, 2, 4, 8, generator=g)
    fig = draw.qkv(q, k, v, batch=1, head=3)
    P, hidden = draw.attention_weights(q[1, 3], k[1, 1], causal=True)
    expected = [f"{w:.2f}".lstrip("0") if w < 1 else "1" for w in P[~hidden].tolist()]
    assert _weights_shown(fig) == expected
    out = attention_ref(q, k, v)[1, 3]  # (T, D): what the drawn "out" cells show, to one decimal
    shown = [float(t) for t in _weights_shown(fig, "output")]
    assert len(shown) == 32 and torch.allclose(torch.tensor(shown), out.flatten(), atol=0.051)


def test_fewer_queries_than_keys_mask_from_the_end():
    """T < S (queries at the end of the sequence): query i sees keys 0 .. S - T + i."""
    q, k, v = qkv_tensors(2, 4, S=5)
    fig = draw.qkv(q, k, v)
    assert cells_with(fig, "masked") == 1 + 0  # query 3 cannot see key 4; query 4 sees all
    assert cells_with(fig, "visible") == 2 * 5 - 1


@pytest.mark.parametrize("T, D", [(13, 8), (6, 17)])
def test_too_large_to_draw_is_refused(T, D):
    with pytest.raises(ValueError, match="too many to draw"):
        draw.qkv(*qkv_tensors(T, D))
