"""kvlib.course.draw.gqa: chapter 07's diagrams show the config's real head mapping and each schedule's loads."""

from types import SimpleNamespace

import pytest
import torch

from kvlib.course import ch07, figures
from kvlib.course.draw import cells_with
from kvlib.course.draw import gqa as draw_gqa
from kvlib.model import ModelConfig, Transformer


def config(H, H_KV):
    return ModelConfig(vocab_size=16, dim=8 * H, n_layers=1, n_heads=H, n_kv_heads=H_KV, hidden_dim=32)


def drawn_map(fig):
    """The mapping the figure draws, read back from its geometry: for each "read" line, the query cell under its
    lower end and the K/V cell under its upper end (cells numbered left to right)."""
    ax = fig.axes[0]
    centre = lambda p: p.get_x() + p.get_width() / 2  # noqa: E731
    queries = sorted((p for p in ax.patches if p.get_gid() == "query"), key=centre)
    kvs = sorted((p for p in ax.patches if p.get_gid() == "kv"), key=centre)
    pairs = []
    for line in (ln for ln in ax.lines if ln.get_gid() == "read"):
        (xq, xk) = line.get_xdata()
        h = min(range(len(queries)), key=lambda i: abs(centre(queries[i]) - xq))
        j = min(range(len(kvs)), key=lambda i: abs(centre(kvs[i]) - xk))
        assert abs(centre(queries[h]) - xq) < 1e-9 and abs(centre(kvs[j]) - xk) < 1e-9  # the line ends on the cells
        pairs.append((h, j))
    return dict(sorted(pairs))


@pytest.mark.parametrize("H, H_KV", [(9, 3), (8, 8), (8, 1), (32, 8), (4, 2)])
def test_head_map_draws_every_query_head_reading_h_div_n_rep(H, H_KV):
    fig = draw_gqa.head_map(config(H, H_KV))
    assert cells_with(fig, "query") == H and cells_with(fig, "kv") == H_KV
    mapping = drawn_map(fig)
    assert len(mapping) == H  # one line per query head
    assert mapping == {h: h // (H // H_KV) for h in range(H)}
    if 1 < H_KV < H:
        assert mapping != {h: h % H_KV for h in range(H)}  # consecutive groups, not interleaved
    assert figures.figure_problems(fig) == []


def test_head_map_reads_a_live_model_and_a_transformers_config():
    model = Transformer(config(6, 2)).eval()
    assert draw_gqa.head_counts(model) == (6, 2)
    assert drawn_map(draw_gqa.head_map(model)) == {h: h // 3 for h in range(6)}
    hf = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)  # SmolLM2's config.json keys
    assert draw_gqa.head_counts(hf) == (9, 3)
    assert draw_gqa.head_counts(SimpleNamespace(num_attention_heads=12)) == (12, 12)  # no key: MHA
    with pytest.raises(ValueError, match="must divide"):
        draw_gqa.head_counts(SimpleNamespace(num_attention_heads=9, num_key_value_heads=2))


@pytest.mark.parametrize("H, H_KV", [(9, 3), (8, 2), (8, 1), (4, 4)])
def test_schedules_draw_what_each_schedule_loads(H, H_KV):
    fig = draw_gqa.schedules(config(H, H_KV))
    assert len(fig.axes) == 3
    loads, copies = draw_gqa.panel_counts(fig, "load"), draw_gqa.panel_counts(fig, "copy")
    assert loads == [H_KV + H, H, H_KV] and copies == [H, 0, 0]
    assert list(zip(loads, copies)) == list(ch07.schedule_loads(H, H_KV).values())
    assert draw_gqa.panel_counts(fig, "query") == [H, H, H]  # every schedule computes every query head once
    assert figures.figure_problems(fig) == []


def test_grouped_rows_hold_each_group():
    fig = draw_gqa.schedules(config(9, 3))
    grouped = fig.axes[2]
    rows = {}
    for p in grouped.patches:
        if p.get_gid() == "query":
            rows.setdefault(round(p.get_y(), 6), []).append(p)
    assert sorted(len(r) for r in rows.values()) == [3, 3, 3]  # one program per K/V head, 3 query heads each
    assert torch.tensor([len(r) for r in rows.values()]).sum().item() == 9
