"""kvlib.course.draw.paged: chapter 05's diagrams show the live paged cache's real state."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kvlib.course import figures  # noqa: E402
from kvlib.course.draw import cells_with  # noqa: E402
from kvlib.course.draw import paged as draw_paged  # noqa: E402
from kvlib.model import ModelConfig, Transformer  # noqa: E402
from kvlib.paged import PagedKVCache  # noqa: E402
from kvlib.pool_sim import sample_requests, simulate  # noqa: E402


def grow(cache, seq, n):
    """Append n positions to seq without a model (as the notebook's first cells do); returns their slots."""
    if seq not in cache.tables:
        cache.add_sequence(seq)
    slots = cache.reserve([seq], n)
    cache.lens[seq] += n
    return slots.tolist()


def counts(fig):
    return {g: cells_with(fig, g) for g in ("table", "filled", "empty", "free", "shared", "new")}


@pytest.mark.parametrize("block_size, lens", [(4, [6, 3, 9]), (1, [2, 5]), (16, [1, 17, 40]), (5, [5, 10, 3])])
def test_the_pool_drawing_counts_what_the_cache_holds(block_size, lens):
    nb = sum(-(-n // block_size) for n in lens) + 3
    cache = PagedKVCache(n_layers=1, num_blocks=nb, block_size=block_size, n_kv_heads=1, head_dim=2, kernels="torch")
    new = []
    for i, n in enumerate(lens):
        new += grow(cache, f"s{i}", n)
    c = counts(draw_paged.pool(cache, new=new))
    used_blocks = sum(len(t) for t in cache.tables.values())
    assert c["table"] == used_blocks  # one drawn entry per block-table entry
    assert c["filled"] == sum(lens) == sum(cache.lens.values())  # one coloured slot per token held
    assert c["empty"] == used_blocks * block_size - sum(lens)  # the tails of the last blocks
    assert c["free"] == cache.allocator.num_free * block_size
    assert c["new"] == len(new) and c["shared"] == 0
    assert c["filled"] + c["empty"] + c["free"] == nb * block_size


def test_the_drawing_changes_with_the_cache():
    cache = PagedKVCache(n_layers=1, num_blocks=12, block_size=4, n_kv_heads=1, head_dim=2, kernels="torch")
    for seq, n in [("A", 6), ("B", 3), ("C", 9)]:
        grow(cache, seq, n)
    before = counts(draw_paged.pool(cache))
    cache.free_sequence("B")
    new = grow(cache, "A", 4)
    after = counts(draw_paged.pool(cache, new=new))
    assert before["filled"] == 18 and after["filled"] == 19  # B's 3 tokens gone, A's 4 added
    assert after["free"] == 4 * cache.allocator.num_free == before["free"]  # B's block freed, A took one
    assert after["new"] == 4 and cache.tables["A"] == [0, 1, 2]


def test_forks_are_drawn_shared_once_and_copy_on_write_as_it_happens():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)).eval()
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4, kernels="torch")
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks and a partial one
    with torch.no_grad():
        cache.add_sequence("a", prompt)
        model(torch.tensor([prompt]), cache=cache.batch(["a"], [prompt]))
        cache.fork("a", "b")
        forked = counts(draw_paged.pool(cache))
        step = cache.batch(["a", "b"], [[3], [4]])
        model(torch.tensor([[3], [4]]), positions=torch.tensor([[10], [10]]), cache=step)
    written = counts(draw_paged.pool(cache, new=step.slots.tolist()))
    assert forked["shared"] == 3 and forked["table"] == 6 and forked["filled"] == 10  # a shared slot counts once
    shared = [b for b in set(cache.tables["a"] + cache.tables["b"]) if cache.allocator.refcount[b] > 1]
    assert written["shared"] == len(shared) == 2  # the full blocks stay shared; the partial one was copied
    assert written["filled"] == 8 + 2 * 3 and written["new"] == 2  # two full blocks, two private partial ones


def test_the_pool_figure_passes_the_figure_check():
    cache = PagedKVCache(n_layers=1, num_blocks=6, block_size=4, n_kv_heads=1, head_dim=2, kernels="torch")
    grow(cache, "A", 7)
    assert figures.figure_problems(draw_paged.pool(cache)) == []


def test_simulator_pictures_follow_the_record():
    small = sample_requests(12, seed=1, arrival_rate=0.5, mean_prompt=30, mean_output=40, max_len=256)
    run = simulate(small, capacity_tokens=24 * 16, policy="paged", block_size=16, record=True)
    fig = draw_paged.sim_moments(run)
    titles = [ax.get_title() for ax in fig.axes]
    step = int(0.1 * (len(run.snapshots) - 1))
    in_use = sum(1 for r in run.snapshots[step] if r >= 0)
    assert titles[0].startswith(f"iteration {step}: {in_use} of {len(run.snapshots[step])} blocks in use")
    fig = draw_paged.sim_timeline(run)
    image = fig.axes[0].get_images()[0].get_array()
    assert image.shape == (len(run.snapshots[0]), len(run.snapshots))  # blocks down, iterations across
    line = fig.axes[1].get_lines()[0].get_ydata()
    assert list(line) == [sum(1 for r in s if r >= 0) for s in run.snapshots]
