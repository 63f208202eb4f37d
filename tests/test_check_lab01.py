"""Lab 01's decision exercises: combining per-chunk results (exercise 4) and counting what the causal mask hides
once a cache holds the past (exercise 5). The right answer passes, every typical wrong one is named by the checker,
and the references are computed from live objects (the combinations themselves, the chapter's diagram)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import kvlib  # noqa: E402,F401  (sets the mode before Triton is imported)
from kvlib.course import mistakes  # noqa: E402
from kvlib.course.check import CheckFailed, check  # noqa: E402
from kvlib.course.draw import attention as draw_attention  # noqa: E402
from kvlib.course.draw import cells_with  # noqa: E402

PREFIX = "Diagnosis: yours matches a known mistake: "


def _diagnoses(yours, reference, wrong) -> list[str]:
    with pytest.raises(CheckFailed) as err:
        check(yours, reference, name="decision", mistakes=wrong)
    return [line[len(PREFIX):] for line in str(err.value).splitlines() if line.startswith(PREFIX)]


@pytest.fixture
def row():
    """The lab's row: 37 scores with a standard normal spread, values of dim 8."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(37, generator=g), torch.randn(37, 8, generator=g)


# ---------------------------------------------------------------- exercise 4: combining chunks --------


def test_only_the_share_weighted_combination_is_the_softmax(row):
    scores, values = row
    true = torch.softmax(scores.double(), 0) @ values.double()
    combos = mistakes.chunk_combinations(scores, values, 8)
    assert torch.allclose(combos[2], true, atol=1e-12)
    assert (combos[1] - true).abs().max() > 0.05 and (combos[3] - true).abs().max() > 0.05
    assert mistakes.combine_chunks_reference(scores, values, 8) == (2, 2)


def test_the_share_weighted_combination_survives_scores_that_overflow_exp():
    """Scores around 1,000: e^1000 is inf in float64, but the shares are taken relative to the largest max."""
    g = torch.Generator().manual_seed(1)
    scores, values = 1000 + torch.randn(40, generator=g), torch.randn(40, 4, generator=g)
    true = torch.softmax(scores.double(), 0) @ values.double()
    assert torch.allclose(mistakes.chunk_combinations(scores, values, 8)[2], true, atol=1e-12)


def test_the_right_choice_passes(row, capsys):
    scores, values = row
    assert check((2, 2), mistakes.combine_chunks_reference(scores, values, 8),
                 mistakes=mistakes.combine_chunks(scores, values, 8))
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("yours, words", [
    ((1, 1), "first source article's mistake"),
    ((1, 2), "rules out option 1"),
    ((1, 3), "shrink it to 1/5"),
    ((3, 3), "other chunks still count"),
    ((3, 1), "leaves the other chunks out"),
    ((3, 2), "rules out option 3"),
    ((2, 1), "right combination for the wrong reason: softmax is not linear"),
    ((2, 3), "right combination for the wrong reason: no chunk is negligible"),
])
def test_each_wrong_choice_is_named(row, yours, words):
    scores, values = row
    found = _diagnoses(yours, mistakes.combine_chunks_reference(scores, values, 8),
                       mistakes.combine_chunks(scores, values, 8))
    assert len(found) == 1 and words in found[0], found


def test_every_wrong_choice_has_a_diagnosis(row):
    scores, values = row
    wrong = set(mistakes.combine_chunks(scores, values, 8).values())
    assert wrong == {(c, r) for c in (1, 2, 3) for r in (1, 2, 3)} - {(2, 2)}


# ---------------------------------------------------------------- exercise 5: what the mask hides -----

CASES = [(7, 7), (3, 7), (1, 7)]


def test_the_reference_is_what_the_chapters_diagram_shows():
    q, k, v = torch.randn(7, 8), torch.randn(7, 8), torch.randn(7, 8)
    drawn = tuple(cells_with(draw_attention.qkv(q[S - T:], k, v), "masked") for T, S in CASES)
    plt.close("all")
    assert drawn == mistakes.hidden_counts_reference(CASES) == (21, 3, 0)


def test_the_count_is_t_choose_2_whatever_s():
    cases = [(T, S) for S in range(1, 12) for T in range(1, S + 1)]
    assert mistakes.hidden_counts_reference(cases) == tuple(T * (T - 1) // 2 for T, S in cases)


@pytest.mark.parametrize("yours, words", [
    ((28, 6, 1), "the diagonal is hidden too"),
    ((21, 15, 6), "aligned to the start"),
    ((21, 0, 0), "new queries still hide each other's future"),
])
def test_each_wrong_count_is_named(yours, words):
    found = _diagnoses(yours, mistakes.hidden_counts_reference(CASES), mistakes.hidden_counts(CASES))
    assert len(found) == 1 and words in found[0], found


def test_the_right_count_passes(capsys):
    assert check((21, 3, 0), mistakes.hidden_counts_reference(CASES), mistakes=mistakes.hidden_counts(CASES))
    assert "PASS" in capsys.readouterr().out


# ---------------------------------------------------------------- exercise 3: masked keys ------------


def _masked(row):
    scores, values = row
    masked = scores.clone()
    masked[:9], masked[20:23] = float("-inf"), float("-inf")  # the lab's left padding and masked run
    return masked, values


def _notebook_update(scores, values, chunk):
    """Notebook 01's loop as written there: no test for a chunk of masked keys."""
    m, l, acc = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(values.shape[1])
    for start in range(0, scores.shape[0], chunk):
        s_c, v_c = scores[start:start + chunk], values[start:start + chunk]
        m_new = torch.maximum(m, s_c.max())
        alpha, p = torch.exp(m - m_new), torch.exp(s_c - m_new)
        l, acc, m = l * alpha + p.sum(), acc * alpha + p @ v_c, m_new
    return acc / l


def test_masked_chunks_break_the_notebooks_update_and_the_checker_says_why(row):
    masked, values = _masked(row)
    yours = _notebook_update(masked, values, 3)
    assert torch.isnan(yours).all()  # the exercise has something to decide
    found = _diagnoses(yours, torch.softmax(masked, 0) @ values, mistakes.online_softmax(masked, values, 3))
    assert len(found) == 1 and "exp(-inf - (-inf))" in found[0]


def test_the_guarded_update_passes_on_masked_keys_and_the_other_mistakes_stay_distinct(row, capsys):
    masked, values = _masked(row)
    reference = torch.softmax(masked, 0) @ values
    wrong = mistakes.online_softmax(masked, values, 3)
    guarded = mistakes.lab01._online(masked, values, 3)
    assert check(guarded, reference, name="guarded", mistakes=wrong)
    for what, fn in wrong.items():  # every known mistake fails on these inputs and is named as itself only
        assert _diagnoses(fn(), reference, wrong) == [what]
