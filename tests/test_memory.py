import pytest
import torch

from kvlib.cache import KVCache
from kvlib.memory import (GiB, INT8_SCALE_BYTES, REAL_MODELS, dtype_bytes, fit, kv_cache_bytes, kv_table, max_batch,
                          max_context, measure_allocation, resident_bytes, scale_bytes_for, spec)
from kvlib.model import ModelConfig
from kvlib.paged import PagedKVCache
from kvlib.quant import Int8KVCache

SMOL = ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536,
                   max_seq_len=8192)  # SmolLM2-135M-Instruct's sizes (no weights needed)


def test_llama_7b_batch_4_2048_tokens_fp16_is_exactly_4_gib():
    m = spec("LLaMA-7B")
    assert kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, 2048, 4, torch.float16) == 4 * GiB


def test_formula_equals_the_bytes_a_real_cache_allocates():
    for dtype in (torch.float32, torch.float16):
        cache = KVCache(n_layers=3, batch=2, n_kv_heads=4, max_len=37, head_dim=24, dtype=dtype)
        assert cache.nbytes() == kv_cache_bytes(3, 4, 24, 37, 2, dtype)


def test_int8_formula_counts_the_scales_int8kvcache_allocates():
    cache = Int8KVCache(n_layers=3, batch=2, n_kv_heads=4, max_len=37, head_dim=24)
    tensors = cache.k + cache.v + cache.k_scale + cache.v_scale
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert allocated == cache.nbytes() == kv_cache_bytes(3, 4, 24, 37, 2, "int8", scale_bytes=INT8_SCALE_BYTES)
    assert cache.k_scale[0].element_size() == INT8_SCALE_BYTES  # one fp16 scale per (sequence, head, position)
    assert allocated - kv_cache_bytes(3, 4, 24, 37, 2, "int8") == 2 * 3 * 4 * 37 * 2 * INT8_SCALE_BYTES
    assert scale_bytes_for("int8") == scale_bytes_for(torch.int8) == 2 and scale_bytes_for("fp16") == 0


def test_smollm2_bytes_per_token_predicted_equal_allocated():
    m = spec("SmolLM2-135M-Instruct")
    assert (m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.max_context) == (30, 9, 3, 64, 8192)
    assert (SMOL.n_layers, SMOL.n_kv_heads, SMOL.head_dim) == (m.n_layers, m.n_kv_heads, m.head_dim)
    S, c = 64, SMOL
    caches = {"fp32": KVCache(c.n_layers, 1, c.n_kv_heads, S, c.head_dim, dtype=torch.float32),
              "fp16": KVCache(c.n_layers, 1, c.n_kv_heads, S, c.head_dim, dtype=torch.float16),
              "int8": Int8KVCache(c.n_layers, 1, c.n_kv_heads, S, c.head_dim)}
    for dtype, cache in caches.items():
        assert cache.nbytes() == m.kv_bytes_per_token(dtype) * S
    paged = PagedKVCache(c.n_layers, 4, 16, c.n_kv_heads, c.head_dim, dtype=torch.float16)
    assert sum(t.nbytes for t in paged.k + paged.v) == m.kv_bytes_per_token("fp16") * 4 * 16
    assert [m.kv_bytes_per_token(d) for d in ("fp32", "fp16", "int8")] == [46_080, 23_040, 11_880]
    assert kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, 1, 1, "int8") == 11_520  # values alone


def test_gqa_models_store_fewer_bytes_per_token_than_their_width_suggests():
    for m in REAL_MODELS:
        assert m.n_heads % m.n_kv_heads == 0
        assert m.kv_bytes_per_token("fp16") == 2 * m.n_layers * m.n_kv_heads * m.head_dim * 2
        if m.n_kv_heads < m.n_heads:
            assert m.kv_bytes_per_token("fp16") < 2 * m.n_layers * m.hidden_size * 2


def test_known_values():
    assert spec("Llama-2-7B").kv_bytes_per_token("fp16") == 512 * 2**10  # 0.5 MiB per token
    assert spec("Llama-3-8B").kv_bytes_per_token("fp16") == 128 * 2**10  # GQA 32/8: a quarter
    rows = {r["name"]: r for r in kv_table()}
    assert rows["Llama-2-7B"]["kv_full_context_GiB"] == 2.0
    assert rows["Llama-3-8B"]["config_url"] == "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json"
    assert spec("SmolLM2-135M") is spec("HuggingFaceTB/SmolLM2-135M-Instruct") is spec("smollm2-135m-instruct")


def test_what_fits():
    m = spec("Llama-2-7B")
    gpu = 80 * GiB
    b = max_batch(m, gpu, 4096)
    free = gpu - m.weight_bytes("fp16")
    per_seq = m.kv_bytes_per_token("fp16") * 4096
    assert b == free // per_seq and b * per_seq <= free < (b + 1) * per_seq
    assert max_context(m, gpu, batch=b) == 4096  # memory would allow a little more; the model does not
    assert max_batch(spec("Llama-2-70B"), 24 * GiB, 4096) == 0  # the weights alone do not fit


def test_max_context_never_exceeds_the_models():
    for m in REAL_MODELS:
        assert max_context(m, 1000 * GiB, 1) == m.max_context
    m = spec("Llama-3-8B")
    memory_bound = (80 * GiB - m.weight_bytes() - 2 * GiB) // (32 * m.kv_bytes_per_token())
    assert memory_bound > m.max_context  # 16,138 tokens of memory, but the model stops at 8,192
    assert max_context(m, 80 * GiB, 32, reserve_bytes=2 * GiB) == 8192
    assert max_context(m, 24 * GiB, 32, reserve_bytes=2 * GiB) < 8192  # here memory binds
    with pytest.raises(ValueError, match="at most 8,192 tokens"):
        max_batch(m, 80 * GiB, 16384)


def test_int8_budget_counts_the_scales():
    m = spec("Llama-3-8B")
    gpu, ctx = 80 * GiB, 8192
    free = gpu - m.weight_bytes("fp16")
    assert max_batch(m, gpu, ctx, "int8") == free // (ctx * m.n_layers * 2 * m.n_kv_heads * (m.head_dim + 2))
    values_only = free // kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, ctx, 1, "int8")
    assert max_batch(m, gpu, ctx, "int8") < values_only


def test_fit_says_does_not_fit_in_words():
    m = spec("Llama-3-8B")
    ok = fit(m, 80 * GiB, 8, 4096, reserve_bytes=2 * GiB)
    assert ok.fits and ok.reason.startswith("fits") and ok.kv_bytes == 8 * 4096 * m.kv_bytes_per_token()
    too_big = fit(m, 24 * GiB, 64, 8192, reserve_bytes=2 * GiB)
    assert not too_big.fits and "does not fit" in too_big.reason and too_big.kv_bytes > too_big.free_bytes
    too_long = fit(m, 80 * GiB, 1, 16384)
    assert not too_long.fits and "8,192" in too_long.reason and too_long.max_batch == 0
    assert too_long.max_context == 8192 and too_long.context_limit == "model"
    weights = fit(spec("Llama-2-70B"), 24 * GiB, 1, 1024)
    assert not weights.fits and "weights" in weights.reason and weights.max_batch == weights.max_context == 0


@pytest.mark.parametrize("bad", [dict(seq_len=-1), dict(batch=2.5), dict(n_layers="32"), dict(scale_bytes=-2)])
def test_bad_arguments(bad):
    args = dict(n_layers=32, n_kv_heads=8, head_dim=128, seq_len=10, batch=1, dtype="fp16")
    args.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        kv_cache_bytes(**args)
    with pytest.raises(ValueError, match="batch"):
        max_context(spec("Llama-3-8B"), 80 * GiB, 0)


def test_dtype_names():
    assert dtype_bytes("bf16") == 2 and dtype_bytes(torch.int8) == 1 and dtype_bytes("fp8") == 1
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("fp12")


def test_measured_allocation_matches_the_formula():
    """RSS growth of a fresh process (CPU) or memory_allocated (GPU) around building real caches."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    S, c = 2048, SMOL
    builds = [(KVCache, (c.n_layers, 1, c.n_kv_heads, S, c.head_dim), dict(dtype=torch.float16, device=device)),
              (Int8KVCache, (c.n_layers, 1, c.n_kv_heads, S, c.head_dim), dict(device=device))]
    if device == "cpu" and resident_bytes() is None:
        pytest.skip("resident memory cannot be read on this system")
    grown = measure_allocation(builds, device)
    m = spec("SmolLM2-135M")
    for got, dtype, n_tensors in zip(grown, ("fp16", "int8"), (60, 120)):
        predicted = m.kv_bytes_per_token(dtype) * S
        assert abs(got - predicted) <= n_tensors * 8192 + 2**20, (dtype, got, predicted)


def test_measure_allocation_reports_progress_per_build():
    if resident_bytes() is None:
        pytest.skip("resident memory cannot be read on this system")
    seen = []

    def progress(it, total):
        for x in it:
            seen.append(total)
            yield x

    builds = [(KVCache, (2, 1, 2, 4096, 32), dict(dtype=torch.float16))] * 2
    grown = measure_allocation(builds, "cpu", progress=progress)
    assert seen == [2, 2]
    predicted = kv_cache_bytes(2, 2, 32, 4096, 1, "fp16")
    assert all(abs(g - predicted) <= 4 * 8192 + 2**20 for g in grown), (grown, predicted)
