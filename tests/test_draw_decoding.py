"""Chapter 02's diagram shows what the loop really computed (kvlib.course.draw.decoding).

The counts come from a counter on the model's key projection (``kvlib.course.ch02.count_rows``), i.e. from
the shapes the loop actually fed the model, and the figure must show exactly those: one "filled" cell per
K/V row computed again, one "new" cell per position computed for the first time.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvlib.course import ch02  # noqa: E402
from kvlib.course.draw import cells_with, decoding  # noqa: E402
from kvlib.course.figures import figure_problems  # noqa: E402
from kvlib.model import ModelConfig, Transformer  # noqa: E402


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()


@pytest.mark.parametrize("p, n", [(1, 1), (1, 6), (5, 1), (5, 8), (3, 12)])
def test_the_triangle_counts_what_the_loop_computed(model, p, n):
    trace = ch02.trace_naive(model, list(range(1, p + 1)), n)
    assert trace.rows == [p + i for i in range(n)]  # the counter saw the whole prefix fed at every step
    assert trace.computed == n * p + n * (n - 1) // 2
    assert trace.needed == p + n - 1  # the last new token is never fed back
    assert trace.recomputed == (n - 1) * p + (n - 1) * (n - 2) // 2
    fig = decoding.recomputed(trace)
    assert cells_with(fig, "filled") == trace.recomputed
    assert cells_with(fig, "new") == trace.needed
    assert cells_with(fig, "empty") == 0
    assert figure_problems(fig) == []
    plt.close(fig)


def test_the_drawing_changes_with_the_loop(model):
    short, longer = ch02.trace_naive(model, [1, 2, 3], 4), ch02.trace_naive(model, [1, 2, 3], 5)
    a, b = decoding.recomputed(short), decoding.recomputed(longer)
    assert cells_with(b, "filled") - cells_with(a, "filled") == 3 + 4 - 1  # step 4 recomputes all 7 earlier positions
    assert cells_with(b, "new") - cells_with(a, "new") == 1
    plt.close("all")


def test_a_loop_with_a_cache_draws_no_recomputation():
    # what a cached loop's counter sees (chapter 03): the prompt once, then one row per step
    trace = ch02.NaiveTrace(prompt_len=4, tokens=list(range(10)), rows=[4, 1, 1, 1, 1])
    fig = decoding.recomputed(trace)
    assert cells_with(fig, "filled") == 0 == trace.recomputed
    assert cells_with(fig, "new") == 4 + 4 == trace.needed
    assert cells_with(fig, "empty") == sum(4 + i - 1 for i in range(1, 5))  # earlier positions, not computed
    plt.close(fig)


def test_the_counter_counts_a_padded_batch_and_transformers_style_layers(model):
    with ch02.count_rows(model.layers[0].attn.wk) as rows:
        model(torch.zeros(3, 7, dtype=torch.long))
        model(torch.zeros(1, 2, dtype=torch.long))
    assert rows == [21, 2]
    with ch02.count_rows(model.layers[0].attn.wk) as rows:
        pass
    model(torch.zeros(1, 2, dtype=torch.long))
    assert rows == []  # the hook is gone after the block


def test_tokens_are_written_in_the_cells(model):
    trace = ch02.trace_naive(model, [1, 2], 3)
    fig = decoding.recomputed(trace, decode=lambda ids: "ab"[ids[0] % 2])
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count("a") + texts.count("b") >= trace.computed
    plt.close(fig)


def test_too_large_a_trace_is_refused_with_a_reason(model):
    trace = ch02.NaiveTrace(prompt_len=30, tokens=list(range(60)), rows=[30 + i for i in range(20)])
    with pytest.raises(ValueError, match="too many to draw"):
        decoding.recomputed(trace)


def test_paired_ratio_times_each_length_right_after_a_call_of_the_same_length():
    """ch02.paired_ratio: per round, an untimed call then a timed one at t = hi, the same at t = lo, so neither
    step is timed in the caches the other length left behind."""
    calls = []

    def model(x):
        calls.append(x.shape[1])
        sum(range(2000 * x.shape[1]))  # some CPU time, more for the longer call
        return x

    seq = torch.zeros(1, 40, dtype=torch.long)
    median, low, high = ch02.paired_ratio(model, seq, lo=8, hi=32, rounds=3)
    assert calls == [32, 32, 8, 8] * 3
    assert low <= median <= high
