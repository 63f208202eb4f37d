"""Readable figures, checked: what every plot of the course must satisfy.

What you will learn: two ways a chart silently stops saying anything — a logarithmic axis that
shows one or two labelled ticks (the reader cannot tell 20 from 200), and a legend so long that
colours repeat — and a check that catches both on a drawn figure.

``figure_problems(fig)`` draws the figure and lists what is wrong: an axis on a log scale with
fewer than ``MIN_LOG_LABELS`` labelled ticks inside its view (an axis whose tick labels are all
hidden, such as the inner panel of shared axes, is left alone), or a legend with more than
``MAX_LEGEND`` entries. With the environment variable ``KVLIB_CHECK_FIGURES=1`` (the course's test
command sets it) importing kvlib wraps ``matplotlib.pyplot.show`` so that every figure shown is
checked first and a bad one raises ``ValueError`` in the cell that drew it.

>>> import matplotlib
>>> matplotlib.use("Agg")
>>> import matplotlib.pyplot as plt
>>> fig, ax = plt.subplots()
>>> _ = ax.plot([1, 2, 3], [15, 60, 240])
>>> ax.set_yscale("log")
>>> ax.minorticks_off()  # e.g. to hide the "2×10^1"-style labels: then only 10^2 is labelled
>>> figure_problems(fig)
["axes 1 (''): the y axis is logarithmic with 1 labelled tick(s) in view (10^2); set at least 3 (ax.set_yticks(values, labels))"]
>>> _ = ax.set_yticks([20, 50, 100, 200], ["20", "50", "100", "200"])
>>> figure_problems(fig)
[]
>>> plt.close(fig)
"""

from __future__ import annotations

import os

__all__ = ["MIN_LOG_LABELS", "MAX_LEGEND", "figure_problems", "check_figure", "install"]

MIN_LOG_LABELS = 3
MAX_LEGEND = 10


def _labelled(axis) -> tuple[list[str], bool]:
    """(texts of the labelled ticks inside the view, whether the axis shows any tick label at all)."""
    lo, hi = sorted(axis.get_view_interval())
    eps = 1e-9 * max(abs(lo), abs(hi), 1e-300)
    texts, any_visible = [], False
    for tick in axis.get_major_ticks() + axis.get_minor_ticks():
        for label in (tick.label1, tick.label2):
            if not label.get_visible():
                continue
            any_visible = True
            text = label.get_text().strip()
            if text and lo - eps <= tick.get_loc() <= hi + eps:
                texts.append(text)
    return texts, any_visible


def _plain(text: str) -> str:
    return text.replace("$", "").replace("\\mathdefault{", "").replace("}", "").replace("{", "")


def figure_problems(fig) -> list[str]:
    """What makes ``fig`` hard to read (see the module docstring); an empty list if nothing."""
    fig.canvas.draw()  # tick labels exist only once the figure is drawn
    problems = []
    for n, ax in enumerate(fig.axes, 1):
        if not ax.get_visible():
            continue
        where = f"axes {n} ({ax.get_title()!r})"
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            if axis.get_scale() != "log":
                continue
            texts, shown = _labelled(axis)
            if shown and len(set(texts)) < MIN_LOG_LABELS:
                problems.append(f"{where}: the {name} axis is logarithmic with {len(set(texts))} labelled tick(s) in "
                                f"view ({', '.join(_plain(t) for t in dict.fromkeys(texts))}); set at least "
                                f"{MIN_LOG_LABELS} (ax.set_{name}ticks(values, labels))")
        legend = ax.get_legend()
        if legend is not None and len(legend.get_texts()) > MAX_LEGEND:
            problems.append(f"{where}: the legend has {len(legend.get_texts())} entries (at most {MAX_LEGEND}: "
                            "group them, or label the lines directly)")
    for legend in fig.legends:
        if len(legend.get_texts()) > MAX_LEGEND:
            problems.append(f"figure legend: {len(legend.get_texts())} entries (at most {MAX_LEGEND})")
    return problems


def check_figure(fig) -> None:
    """Raise ``ValueError`` listing ``figure_problems(fig)``, if there are any."""
    problems = figure_problems(fig)
    if problems:
        title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) is not None else ""
        raise ValueError(f"figure {title!r} is hard to read:\n  " + "\n  ".join(problems))


def install() -> None:
    """Wrap ``matplotlib.pyplot.show``: every open figure is checked before it is shown (idempotent)."""
    import matplotlib.pyplot as plt

    if getattr(plt.show, "_kvlib_checked", False):
        return
    show = plt.show

    def checked_show(*args, **kwargs):
        for num in plt.get_fignums():
            check_figure(plt.figure(num))
        return show(*args, **kwargs)

    checked_show._kvlib_checked = True
    plt.show = checked_show


if os.environ.get("KVLIB_CHECK_FIGURES") == "1":  # pragma: no cover - set by the course's test command
    install()
