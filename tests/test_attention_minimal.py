"""The minimal flash-attention kernel (``kvlib.attention.flash_attention_minimal``): the same answer as
``attention_ref`` on awkward shapes, in fp32 and fp16 (in the interpreter on a CPU, compiled on a GPU); the
limits it states are refused with a clear error; it stays small enough to read in one screen."""

import inspect

import pytest
import torch

from kvlib import attention, runtime
from kvlib.attention import attention_ref, flash_attention_minimal

DEV = runtime.DEVICE
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B, H, S, D", [
    (1, 2, 37, 16),  # S not a power of two, not a multiple of any tile
    (2, 3, 45, 32),  # several batches and heads, the last query tile part full
    (1, 1, 1, 16),  # one token: it sees only itself
    (1, 2, 64, 64),  # S a multiple of the tiles: no partial tile at all
    (1, 1, 33, 128),  # one row past a tile boundary
])
def test_minimal_kernel_matches_the_reference(B, H, S, D, dtype):
    g = torch.Generator().manual_seed(S * 1000 + D)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(DEV, dtype) for _ in range(3))
    out = flash_attention_minimal(q, k, v)
    ref = attention_ref(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype]


def test_large_scores_do_not_overflow():
    """Scores around 100 overflow a plain exp in fp32; the running maximum keeps every exponent <= 0."""
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(1, 1, 50, 16, generator=g) * 10).to(DEV)
    k = (torch.randn(1, 1, 50, 16, generator=g) * 10).to(DEV)
    v = torch.randn(1, 1, 50, 16, generator=g).to(DEV)
    out = flash_attention_minimal(q, k, v)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, attention_ref(q, k, v), atol=1e-4)


def test_strided_views_are_read_correctly():
    """q, k, v as views of (B, S, H, D) buffers, as a model makes them: the wrapper makes them contiguous."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 29, 4, 32, generator=g).to(DEV).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    assert torch.allclose(flash_attention_minimal(q, k, v), attention_ref(q, k, v), atol=1e-5)


@pytest.mark.parametrize("q_shape, kv_shape, words", [
    ((1, 4, 8, 16), (1, 2, 8, 16), "one shape"),  # grouped K/V heads: flash_attention's job
    ((1, 2, 4, 16), (1, 2, 8, 16), "one shape"),  # T < S
    ((1, 2, 8, 48), (1, 2, 8, 48), "power of two"),  # D = 48
    ((1, 2, 8, 8), (1, 2, 8, 8), "power of two"),  # D below tl.dot's minimum
])
def test_limits_are_refused_with_a_clear_error(q_shape, kv_shape, words):
    q, k = torch.zeros(q_shape, device=DEV), torch.zeros(kv_shape, device=DEV)
    with pytest.raises(ValueError, match=words):
        flash_attention_minimal(q, k, k.clone())


def test_the_minimal_kernel_stays_minimal():
    """About twenty lines of body: one query tile, one loop over key tiles, the online softmax."""
    src = inspect.getsource(attention._flash_attention_minimal_kernel.fn)
    body = src.split("):\n", 1)[1]
    code = [line for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(code) <= 25, len(code)
    assert src.count("for ") == 1 and "tl.dot" in src and "tl.exp(" in src


def test_every_dtype_and_architecture_is_in_the_compile_specs():
    specs = [s for s in attention.COMPILE_SPECS if "_flash_attention_minimal_kernel" in s.get("loops", {})]
    assert {a for s in specs for a in s["archs"]} == {75, 80, 90}
    assert any("fp16" in s["name"] for s in specs) and any("fp32" in s["name"] for s in specs)
    assert any("S=1001" in s["name"] for s in specs)  # a length that is no multiple of 16
