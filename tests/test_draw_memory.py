"""Chapter 04's drawings show the object's real state: the factors drawn multiply to kv_cache_bytes, a different
config (or cache) draws differently, and the KV-vs-context lines are the formula's values. Also chapter 04's
plumbing (kvlib.course.ch04) where its arithmetic is the lesson (vLLM's capacity, the fit table's verdicts)."""

import math
from types import SimpleNamespace

import pytest
import torch

from kvlib.cache import KVCache
from kvlib.course import ch04, figures
from kvlib.course.draw import cells_with
from kvlib.course.draw import memory as dm
from kvlib.memory import GiB, REAL_MODELS, kv_cache_bytes, max_context, spec
from kvlib.model import ModelConfig
from kvlib.quant import Int8KVCache


def drawn_values(fig) -> list[int]:
    """The numbers written inside the factor blocks, in drawing order."""
    return [int(t.get_text().replace(",", "")) for ax in fig.axes for t in ax.texts if t.get_gid() == "value"]


def drawn_products(fig) -> list[int]:
    return [int(t.get_text().split(" bytes")[0].replace(",", "")) for ax in fig.axes for t in ax.texts
            if t.get_gid() == "product"]


def widths(fig) -> list[float]:
    return [p.get_width() for ax in fig.axes for p in ax.patches if p.get_gid() == "factor"]


@pytest.mark.parametrize("name, seq_len, batch, dtype", [("LLaMA-7B", 2048, 4, "fp16"), ("Llama-3-8B", 8192, 1, "fp16"),
                                                         ("SmolLM2-135M", 8192, 16, "int8")])
def test_the_factors_drawn_multiply_to_kv_cache_bytes(name, seq_len, batch, dtype):
    m = spec(name)
    fig = dm.formula(m, seq_len=seq_len, batch=batch, dtype=dtype)
    want = kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, seq_len, batch, dtype)
    values = drawn_values(fig)
    assert cells_with(fig, "factor") == len(values) == 7
    assert math.prod(values) == want == drawn_products(fig)[0]
    assert values == [2, m.n_layers, m.n_kv_heads, m.head_dim, {"fp16": 2, "int8": 1}[dtype], seq_len, batch]
    assert cells_with(fig, "absent") == 2  # query heads and model width, greyed out: not factors
    assert figures.figure_problems(fig) == []


def test_changing_the_config_changes_the_drawing():
    a = dm.formula(spec("LLaMA-7B"), seq_len=2048, batch=4)
    b = dm.formula(spec("Llama-3-8B"), seq_len=2048, batch=4)
    va, vb = drawn_values(a), drawn_values(b)
    assert [i for i, (x, y) in enumerate(zip(va, vb)) if x != y] == [2]  # only the K/V heads: 32 vs 8
    assert widths(a)[2] > widths(b)[2]  # the block shrinks with its value
    assert drawn_products(a)[0] == 4 * drawn_products(b)[0]
    both = dm.formula([spec("LLaMA-7B"), spec("Llama-3-8B")], seq_len=2048, batch=4)
    assert cells_with(both, "factor") == 14 and drawn_products(both) == drawn_products(a) + drawn_products(b)


def test_a_live_cache_draws_its_own_shape_and_dtype():
    cache = KVCache(n_layers=3, batch=2, n_kv_heads=4, max_len=37, head_dim=24, dtype=torch.float16)
    fig = dm.formula(cache)
    assert drawn_values(fig) == [2, 3, 4, 24, 2, 37, 2]
    assert math.prod(drawn_values(fig)) == cache.nbytes() == sum(t.nbytes for t in cache.k + cache.v)
    assert cells_with(fig, "absent") == 0
    bigger = KVCache(n_layers=3, batch=5, n_kv_heads=4, max_len=37, head_dim=24, dtype=torch.float32)
    assert drawn_values(dm.formula(bigger)) == [2, 3, 4, 24, 4, 37, 5]
    assert drawn_products(dm.formula(bigger))[0] == bigger.nbytes()
    with pytest.raises(ValueError, match="scales"):
        dm.formula(Int8KVCache(n_layers=2, batch=1, n_kv_heads=2, max_len=8, head_dim=16))


def test_kvlib_and_hugging_face_configs_draw_the_same_factors():
    smol = spec("SmolLM2-135M")
    ours = ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536)
    hf = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    drawn = [drawn_values(dm.formula(x, seq_len=100, batch=2, dtype="fp16")) for x in (smol, ours, hf)]
    assert drawn[0] == drawn[1] == drawn[2] == [2, 30, 3, 64, 2, 100, 2]
    with pytest.raises(ValueError, match="seq_len"):
        dm.factors(ours)  # a config alone does not say how many tokens


def test_kv_vs_context_lines_are_the_formula():
    models = [spec("Llama-2-7B"), spec("Llama-3.1-8B"), spec("SmolLM2-135M")]
    gpus = {"A": 16, "B": 80}
    fig = dm.kv_vs_context(models, batches=(1, 16), gpus=gpus, weights_of=spec("Llama-3.1-8B"))
    lines = {ln.get_gid(): ln for ax in fig.axes for ln in ax.lines if (ln.get_gid() or "").startswith("kv:")}
    assert len(lines) == 6
    for m in models:
        for batch in (1, 16):
            ln = lines[f"kv:{m.name}:{batch}"]
            xs, ys = [int(x) for x in ln.get_xdata()], list(ln.get_ydata())
            assert xs[-1] == m.max_context and all(x <= m.max_context for x in xs)  # stops at the model's maximum
            assert ys == pytest.approx([kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, x, batch, "fp16") / GiB
                                        for x in xs], rel=1e-12)
    gids = [ln.get_gid() for ax in fig.axes for ln in ax.lines]
    assert gids.count("gpu:A") == gids.count("gpu:B") == 2  # one per panel
    left = [ln for ax in fig.axes[:1] for ln in ax.lines if ln.get_gid() == "left:B"][0]
    assert left.get_ydata()[0] == pytest.approx((80 * GiB - spec("Llama-3.1-8B").weight_bytes()) / GiB)
    assert figures.figure_problems(fig) == []


def test_longest_context_frame_reads_max_context():
    m = spec("Llama-3.1-8B")
    table = ch04.longest_context_frame(m, batches=(1, 16))
    for gpu, gib in ch04.GPUS.items():
        assert table.loc[gpu, "batch 16: max context"] == max_context(m, gib * GiB, 16)


def test_vllm_capacity_is_vllms_arithmetic():
    m = spec("Llama-3.1-8B")
    tokens, concurrency = ch04.vllm_capacity(m, 80 * GiB, 0.9, 32768, "bf16", "bf16")
    budget = int(0.9 * 80 * GiB) - m.weight_bytes("bf16")
    assert tokens == budget // (m.kv_bytes_per_token("bf16") * 16) * 16 and tokens % 16 == 0
    assert concurrency == tokens / 32768
    assert ch04.vllm_capacity(m, 80 * GiB, 0.9, 32768, "fp8", "bf16")[0] >= 2 * tokens
    assert ch04.vllm_capacity(m, 16 * GiB, 0.9, 32768)[0] == 0  # the weights alone take more than 90% of 16 GiB


def test_fit_frame_says_why_a_setting_does_not_fit():
    table = ch04.fit_frame([("Llama-3-8B", 80, 4096, 32), ("Llama-3-8B", 24, 8192, 32), ("Llama-2-7B", 80, 16384, 1),
                            ("Llama-2-70B", 80, 4096, 1)], reserve_gib=2)
    verdicts = table["verdict"].tolist()
    assert verdicts[0].startswith("fits") and verdicts[1].startswith("cache")
    assert verdicts[2] == "beyond the model's max context" and verdicts[3] == "weights alone too big"


def test_hf_cache_tensors_reads_both_layouts():
    k, v = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
    new = SimpleNamespace(layers=[SimpleNamespace(keys=k, values=v)] * 2)
    old = SimpleNamespace(key_cache=[k, k], value_cache=[v, v])
    assert len(ch04.hf_cache_tensors(new)) == len(ch04.hf_cache_tensors(old)) == 4


def test_model_table_bytes_per_token():
    table = ch04.model_table("fp16")
    for m in REAL_MODELS:
        assert table.loc[m.name, "kv_per_token_KiB"] * 1024 == m.kv_bytes_per_token("fp16")
