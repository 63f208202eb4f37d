"""kvlib.course.draw.serving: chapter 08's diagrams show the live engine's real state."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvlib.course import ch08, figures  # noqa: E402
from kvlib.course.draw import cells_with  # noqa: E402
from kvlib.course.draw import serving as draw_serving  # noqa: E402
from kvlib.model import ModelConfig, Transformer  # noqa: E402


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=128, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()


@pytest.fixture(scope="module")
def run(model):
    trace = ch08.make_trace(12, 0.5, seed=3, prompt_median=20, output_median=8)
    return ch08.replay(model, trace, record=True, num_blocks=24, block_size=4, max_num_seqs=4, max_batched_tokens=24,
                       prefix_caching=True)


def counts(fig):
    return {g: cells_with(fig, g) for g in ("prefill", "decode", "sampled", "touched", "held", "cached", "free")}


def test_every_step_drawn_counts_what_the_engine_did(run):
    engine = run["engine"]
    mixed = 0
    for ev in engine.events:
        if not ev["scheduled"]:
            assert ev["step"] not in run["views"]
            continue
        view = run["views"][ev["step"]]
        assert dict(zip(view["seq_ids"], view["counts"])) == ev["scheduled"]  # the forward is the step's schedule
        c = counts(draw_serving.step(view))
        plt.close("all")
        assert c["prefill"] == ev["prefill_tokens"] and c["decode"] == ev["decode_tokens"]
        assert c["sampled"] == ev["sampled"]  # the output head's rows
        touched = {s // view["block_size"] for s in view["slots"]}
        assert c["touched"] == len(touched)
        held = {b for t in view["held"].values() for b in t} - touched
        assert c["held"] == len(held)
        assert c["touched"] + c["held"] + c["cached"] + c["free"] == view["num_blocks"]
        mixed += bool(ev["prefill_tokens"] and ev["decode_tokens"])
    assert mixed > 0  # the trace has steps that carry prefill chunks and decodes in one forward


def test_a_step_s_blocks_are_the_cache_s(model):
    """The blocks a step writes are those its slots name, and they are in the writer's block table."""
    trace = ch08.make_trace(6, 1.0, seed=1, prompt_median=10, output_median=6)
    run = ch08.replay(model, trace, record=True, num_blocks=16, block_size=4, max_num_seqs=3, max_batched_tokens=12)
    for view in run["views"].values():
        i = 0
        for rid, n in zip(view["seq_ids"], view["counts"]):
            blocks = {s // view["block_size"] for s in view["slots"][i: i + n]}
            assert blocks <= set(view["held"][rid])
            i += n


def test_timelines_are_the_engine_s_events(run):
    engine = run["engine"]
    grid = ch08.engine_grid(engine, run["views"])
    fig = draw_serving.timelines([(grid, "continuous")])
    image = fig.axes[0].get_images()[0].get_array()
    assert image.shape == (len(engine.requests), len(engine.events))
    assert np.array_equal(np.asarray(image), grid)
    assert [int((grid[:, s] == ch08.DECODE).sum()) for s in range(grid.shape[1])] == \
        [ev["decode_tokens"] for ev in engine.events]
    assert [int((grid[:, s] == ch08.PREFILL).sum()) for s in range(grid.shape[1])] == \
        [len(ev["scheduled"]) - ev["decode_tokens"] for ev in engine.events]


def test_prefix_picture_counts_the_hits(model):
    rag, docs = ch08.rag_workload(n=8, n_docs=2, doc_len=16, rate=0.5, popularity=(0.7, 0.3), seed=2)
    run = ch08.replay(model, rag, num_blocks=40, block_size=4, max_num_seqs=2, max_batched_tokens=16,
                      prefix_caching=True)
    cached = [run["engine"].requests[run["ids"][i]].cached_tokens for i in range(len(rag))]
    prompts = [r["prompt"] for r in rag]
    fig = draw_serving.prefix_blocks(prompts, cached, 4)
    assert cells_with(fig, "hit") == sum(c // 4 for c in cached) > 0
    assert cells_with(fig, "hit") + cells_with(fig, "computed") == sum(len(p) // 4 for p in prompts)
    assert cells_with(fig, "tail") == sum(len(p) % 4 > 0 for p in prompts)


def test_the_figures_pass_the_figure_check(run):
    view = next(iter(run["views"].values()))
    assert figures.figure_problems(draw_serving.step(view)) == []
    assert figures.figure_problems(draw_serving.timelines([(ch08.engine_grid(run["engine"], run["views"]), "x")])) == []


def test_the_grid_without_views_agrees_where_nothing_is_found_cached(model):
    trace = ch08.make_trace(10, 1.0, seed=4, prompt_median=8, output_median=16, sigma=0.3)
    run = ch08.replay(model, trace, record=True, num_blocks=16, block_size=4, max_num_seqs=4, max_batched_tokens=16,
                      prefix_caching=False)
    assert sum(len(ev["preempted"]) for ev in run["engine"].events) > 0  # recompute preemption happened
    assert np.array_equal(ch08.engine_grid(run["engine"]), ch08.engine_grid(run["engine"], run["views"]))
