"""Lab 12a's checks: the cross-rank merge (kvlib.course.ch12a.check_merge) and the tensor-parallel decision
(check_tp_choice), with the diagnosis of every known wrong answer (kvlib.course.mistakes.lab12a)."""

import pytest
import torch

from kvlib.course import ch12a
from kvlib.course.check import CheckFailed
from kvlib.course.mistakes import lab12a
from kvlib.dist import cp


def _right(part, lse):
    m = lse.amax(dim=2, keepdim=True)
    w = torch.exp(lse - m)
    return (w[..., None] * part).sum(2) / w.sum(2)[..., None]


def test_the_right_merge_passes(capsys):
    assert ch12a.check_merge(_right) is True
    assert "PASS ✓" in capsys.readouterr().out


def test_the_inputs_need_a_stable_and_empty_aware_merge():
    part, lse = ch12a.lab_merge_inputs()
    assert torch.isinf(torch.exp(lse)).any()  # exp(lse) alone overflows fp32 on one head
    assert torch.isneginf(lse).sum() == 1  # and one rank is empty on another
    B, H, R, D = part.shape
    ref = cp.merge_ref(part.reshape(B * H, R, D), lse.reshape(B * H, R)).view(B, H, D)
    assert torch.isfinite(ref).all() and torch.allclose(_right(part, lse), ref, atol=1e-6)


@pytest.mark.parametrize("wrong, says", [
    (lambda part, lse: part.mean(2), "partials are averaged"),
    (lambda part, lse: part.sum(2), "partials are added"),
    (lambda part, lse: (torch.exp(lse - lse.amax(2, keepdim=True))[..., None] * part).sum(2), "not divided by the sum"),
    (lambda part, lse: (torch.exp(lse)[..., None] * part).sum(2) / torch.exp(lse).sum(2)[..., None], "overflows"),
])
def test_every_known_wrong_merge_is_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        ch12a.check_merge(wrong)
    assert "FAIL ✗" in str(err.value) and says in str(err.value)


def test_every_mistake_differs_from_the_reference():
    part, lse = ch12a.lab_merge_inputs()
    ref = _right(part, lse)
    for what, fn in lab12a.merge_across_ranks(part, lse).items():
        out = fn()
        assert not (torch.isfinite(out).all() and torch.allclose(out, ref, atol=1e-5)), what


def test_the_evidence_follows_the_head_rule():
    ev = ch12a.tp_choice_evidence()
    assert ev[1] == 40 and ev[2] == 20 and ev[4] == 10 and ev[8] == 5  # 2 x 80 x 131072 x 8 x 128 x 2 B = 40 GiB
    assert ev[6] is None  # 64 query heads do not divide by 6
    assert ev[16] == ev[32] == ev[64] == 5  # replicated: one K/V head per rank


def test_the_right_choices_pass(capsys):
    assert ch12a.check_tp_choice(8, 6) is True
    assert ch12a.check_tp_choice(None, 4) is True
    out = capsys.readouterr().out
    assert "yours 8  reference 8  ✓" in out and "yours None  reference None  ✓" in out


@pytest.mark.parametrize("choice, budget, says", [
    (16, 6, "tp = 8 already does"),
    (4, 6, "10.0 GiB, over the 6 GiB budget"),
    (6, 6, "tp = 6 is refused"),
    (16, 4, "the same as tp = 8"),
    (64, 4, "no tp fits 4 GiB"),
    (None, 6, "tp = 8 fits"),
    (3, 6, "not one of the candidates"),
])
def test_every_wrong_choice_is_diagnosed(choice, budget, says):
    with pytest.raises(CheckFailed) as err:
        ch12a.check_tp_choice(choice, budget)
    assert "FAIL ✗" in str(err.value) and says in str(err.value)
