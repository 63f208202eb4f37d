"""kvlib.course.draw.speculate: the picture of one verification step counts what the live cache holds."""

import pytest

import kvlib  # noqa: F401  (sets the mode before Triton is imported)
from kvlib.course import ch11a, figures
from kvlib.course.draw import cells_with
from kvlib.course.draw import speculate as draw_speculate
from kvlib.model import load_tiny


@pytest.fixture(scope="module")
def tiny():
    return load_tiny(device="cpu")


@pytest.mark.parametrize("k, partial", [(4, True), (2, False)])
def test_the_cells_are_the_cache_s_rows(tiny, k, partial):
    model, tok = tiny
    prompt = tok.encode("the cache keeps the keys and the values; the cache keeps the keys and the values; the cache")
    trace = ch11a.capture_step(model, prompt, k=k, max_new_tokens=60, partial=partial)
    held = int(trace.cache.seq_lens[0])
    d = len(trace.fed) - 1
    assert held == trace.n0 + 1 + trace.accepted and trace.written == trace.n0 + d + 1
    if partial:
        assert 0 < trace.accepted < d
    fig = draw_speculate.verification(trace, tok, context=5)
    shown = trace.written - max(0, trace.n0 - 5)
    assert cells_with(fig, "fed") == d + 1
    assert cells_with(fig, "rolled") == trace.written - held  # written by the forward, now past the length
    assert cells_with(fig, "written") == d + 1
    assert cells_with(fig, "held") == 2 * shown - (d + 1) - (trace.written - held)  # rows 3 and 4's kept rows
    accepted = cells_with(fig, "accepted")
    assert accepted == trace.accepted + (trace.accepted == d)  # every draft taken: the bonus row is green too
    assert cells_with(fig, "rejected") == (1 if trace.accepted < d else 0)
    assert cells_with(fig, "unchecked") == d + 1 - accepted - cells_with(fig, "rejected")
    assert figures.figure_problems(fig) == []
    # the rolled-back rows are really in memory past the length, and nothing is written after them
    k0 = trace.cache.k[0][0, 0]
    assert bool(k0[held:trace.written].abs().sum(-1).gt(0).all()) and bool(k0[trace.written:].eq(0).all())
