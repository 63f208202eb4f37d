import pytest
import torch

from kvlib.cache import KVCache
from kvlib.memory import GiB, REAL_MODELS, dtype_bytes, kv_cache_bytes, kv_table, max_batch, max_context, spec


def test_llama_7b_batch_4_2048_tokens_fp16_is_exactly_4_gib():
    m = spec("LLaMA-7B")
    assert kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, 2048, 4, torch.float16) == 4 * GiB


def test_formula_equals_the_bytes_a_real_cache_allocates():
    for dtype in (torch.float32, torch.float16):
        cache = KVCache(n_layers=3, batch=2, n_kv_heads=4, max_len=37, head_dim=24, dtype=dtype)
        assert cache.nbytes() == kv_cache_bytes(3, 4, 24, 37, 2, dtype)


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


def test_what_fits():
    m = spec("Llama-2-7B")
    gpu = 80 * GiB
    b = max_batch(m, gpu, 4096)
    free = gpu - m.weight_bytes("fp16")
    per_seq = m.kv_bytes_per_token("fp16") * 4096
    assert b == free // per_seq and b * per_seq <= free < (b + 1) * per_seq
    assert max_context(m, gpu, batch=b) >= 4096
    assert max_batch(spec("Llama-2-70B"), 24 * GiB, 4096) == 0  # the weights alone do not fit


@pytest.mark.parametrize("bad", [dict(seq_len=-1), dict(batch=2.5), dict(n_layers="32")])
def test_bad_arguments(bad):
    args = dict(n_layers=32, n_kv_heads=8, head_dim=128, seq_len=10, batch=1, dtype="fp16")
    args.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        kv_cache_bytes(**args)


def test_dtype_names():
    assert dtype_bytes("bf16") == 2 and dtype_bytes(torch.int8) == 1 and dtype_bytes("fp8") == 1
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("fp12")
