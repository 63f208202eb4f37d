"""kvlib.course.figures: the readability check every figure of the course passes (the test command sets
KVLIB_CHECK_FIGURES=1, so each figure a notebook shows is checked in the cell that draws it)."""

import matplotlib.pyplot as plt
import pytest

from kvlib.course import figures


def test_a_log_axis_with_too_few_labels_is_named_and_fixed_by_explicit_ticks():
    fig, (a, b) = plt.subplots(1, 2)
    a.plot([1, 2], [15, 240])
    a.set(yscale="log", title="left")
    a.minorticks_off()
    b.plot([1, 2], [1, 1000])
    b.set_yscale("log")  # four decades: 10^0 .. 10^3 labelled
    problems = figures.figure_problems(fig)
    assert len(problems) == 1 and "axes 1 ('left'): the y axis" in problems[0] and "10^2" in problems[0]
    a.set_yticks([20, 50, 100, 200], ["20", "50", "100", "200"])
    assert figures.figure_problems(fig) == []


def test_hidden_labels_of_a_shared_axis_are_not_a_problem():
    fig, (a, b) = plt.subplots(1, 2, sharey=True)
    for ax in (a, b):
        ax.plot([1, 2], [1, 1000])
        ax.set_yscale("log")
    assert figures.figure_problems(fig) == []  # b's y labels are hidden on purpose; a's has four


def test_a_legend_over_ten_entries_is_a_problem():
    fig, ax = plt.subplots()
    for i in range(11):
        ax.plot([0, 1], [i, i], label=f"line {i}")
    ax.legend()
    assert any("legend has 11 entries" in p for p in figures.figure_problems(fig))
    ax.legend(handles=ax.lines[:10])
    assert figures.figure_problems(fig) == []


def test_install_makes_show_refuse_a_bad_figure(monkeypatch):
    monkeypatch.setattr(plt, "show", lambda *a, **k: None)  # installed on a stand-in, restored after the test
    figures.install()
    figures.install()  # idempotent: one wrapper
    fig, ax = plt.subplots()
    ax.plot([1, 2], [15, 240])
    ax.set_yscale("log")
    ax.minorticks_off()
    fig.suptitle("bad")
    with pytest.raises(ValueError, match="figure 'bad' is hard to read"):
        plt.show()
    ax.set_yticks([20, 50, 100, 200], ["20", "50", "100", "200"])
    plt.show()  # now it passes
