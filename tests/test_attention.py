"""attention_ref and the Triton flash-attention kernel against torch's SDPA (interpreter on CPU)."""

import pytest
import torch
import torch.nn.functional as F

from kvlib import runtime
from kvlib.attention import attention_ref, flash_attention

TOL = {torch.float32: 1e-4, torch.float16: 1e-2}


def sdpa(q, k, v, causal):
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=runtime.DEVICE)


# (B, H, H_KV, T, D): T not a power of two, heads 1/2/4/8 and groups, head dims 16..256 incl. 48 and 80
SHAPES = [
    (1, 1, 1, 1, 16),
    (2, 2, 1, 37, 64),
    (1, 4, 4, 50, 32),
    (1, 8, 2, 45, 48),
    (2, 4, 1, 33, 80),
    (1, 8, 8, 20, 128),
    (1, 2, 1, 70, 16),
    (1, 1, 1, 17, 256),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}KV{}T{}D{}".format(*s))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_and_ref_match_sdpa(shape, dtype, causal):
    B, H, H_KV, T, D = shape
    q, k, v = (rand(B, h, T, D, dtype=dtype, seed=i) for i, h in enumerate((H, H_KV, H_KV)))
    expected = sdpa(q, k, v, causal)
    for fn in (attention_ref, flash_attention):
        out = fn(q, k, v, causal=causal)
        assert out.shape == q.shape and out.dtype == dtype
        err = (out.float() - expected).abs().max().item()
        assert err <= TOL[dtype], f"{fn.__name__}: max error {err:.2e}"


@pytest.mark.parametrize("T, S", [(1, 40), (5, 70), (33, 33)])
def test_causal_queries_aligned_to_the_end_of_the_keys(T, S):
    q = rand(1, 4, T, 32, dtype=torch.float32, seed=1)
    k = rand(1, 2, S, 32, dtype=torch.float32, seed=2)
    v = rand(1, 2, S, 32, dtype=torch.float32, seed=3)
    # the last T rows of a full causal attention over S queries
    full_q = torch.cat([rand(1, 4, S - T, 32, dtype=torch.float32, seed=4), q], dim=2)
    expected = sdpa(full_q, k, v, causal=True)[:, :, S - T:]
    torch.testing.assert_close(flash_attention(q, k, v), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(attention_ref(q, k, v), expected, atol=1e-4, rtol=1e-4)


# The kernel's two loops: key tiles entirely below the causal diagonal (no mask), then the tiles that
# straddle the diagonal or the end of S (masked). These shapes put the boundaries everywhere: T < S (a
# cached past of S - T keys, queries at positions S - T .. S - 1), T = 1 (one new token), T and S off
# the tile size (32 in the interpreter) by one either way or exact multiples of it, and S = 1; query heads
# per K/V head 1, 2, 4 and 8.
CACHED = [  # (T, S, H, H_KV, dtype)
    (1, 1, 2, 2, torch.float32),
    (1, 31, 4, 1, torch.float16),
    (1, 257, 8, 1, torch.float32),
    (31, 33, 4, 2, torch.float32),
    (33, 100, 8, 8, torch.float16),
    (64, 64, 2, 1, torch.float32),
    (100, 257, 2, 2, torch.float16),
    (257, 257, 1, 1, torch.float32),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("T, S, H, H_KV, dtype", CACHED,
                         ids=lambda x: str(x).replace("torch.float", "fp") if not isinstance(x, int) else str(x))
def test_cached_past_and_awkward_lengths(T, S, H, H_KV, dtype, causal):
    q = rand(1, H, T, 32, dtype=dtype, seed=T)
    k = rand(1, H_KV, S, 32, dtype=dtype, seed=S)
    v = rand(1, H_KV, S, 32, dtype=dtype, seed=S + 1)
    expected = attention_ref(q.float(), k.float(), v.float(), causal=causal)
    torch.testing.assert_close(flash_attention(q, k, v, causal=causal).float(), expected,
                               atol=TOL[dtype], rtol=TOL[dtype])


# GPU tiles are rarely square (e.g. 128 query rows x 64 keys): then the diagonal crosses several key tiles,
# or a key tile holds several query tiles' diagonals. The interpreter's own tiles are 32 x 32, so these
# force other shapes (the smallest tl.dot tile is 16).
@pytest.mark.parametrize("tiles", [(16, 32), (64, 16), (32, 64)], ids=lambda t: "M{}N{}".format(*t))
@pytest.mark.parametrize("T, S, causal", [(37, 37, True), (20, 83, True), (1, 50, True), (45, 70, False)])
def test_tile_m_and_tile_n_may_differ(monkeypatch, tiles, T, S, causal):
    from kvlib import attention

    monkeypatch.setattr(attention, "_tiles", lambda *args, **kwargs: (*tiles, 4, 1))
    q = rand(1, 4, T, 16, dtype=torch.float32, seed=10)
    k = rand(1, 2, S, 16, dtype=torch.float32, seed=11)
    v = rand(1, 2, S, 16, dtype=torch.float32, seed=12)
    torch.testing.assert_close(flash_attention(q, k, v, causal=causal), attention_ref(q, k, v, causal=causal),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(runtime.mode() != "interpreter", reason="counts Python calls: the interpreter's kernel only")
@pytest.mark.parametrize(
    "T, S, causal, tiles, unmasked, masked",
    [
        (128, 128, True, (32, 32), 6, 4),  # program m: m full tiles below the diagonal, 1 on it
        (100, 100, True, (32, 32), 6, 4),  # the last program's diagonal tile is also the end of S
        (100, 100, False, (32, 32), 12, 4),  # full attention: 3 full tiles + the partial last one, each
        (100, 128, False, (32, 32), 16, 0),  # S a multiple of the tile: nothing to mask
        (1, 257, True, (32, 32), 8, 1),  # one new token after 256 cached ones
        (1, 256, True, (32, 32), 8, 0),  # ... after 255: it sees every key, so no tile is masked
        (128, 128, True, (64, 32), 2, 4),  # TILE_M = 2 TILE_N: the diagonal crosses 2 key tiles
        (64, 64, True, (16, 32), 2, 4),  # TILE_N = 2 TILE_M: 2 programs share each diagonal tile
    ],
)
def test_only_tiles_on_the_diagonal_or_at_the_end_of_s_are_masked(monkeypatch, T, S, causal, tiles, unmasked,
                                                                   masked):
    # Count the kernel's calls of its loop body by their MASK flag (possible in the interpreter only, where
    # the kernel is Python calling Python), for one (batch, head): all programs together.
    from kvlib import attention

    calls = {False: 0, True: 0}
    step = attention._online_softmax_step

    def counting_step(*args, MASK, **kwargs):
        calls[bool(MASK)] += 1
        return step(*args, MASK=MASK, **kwargs)

    monkeypatch.setattr(attention, "_online_softmax_step", counting_step)
    monkeypatch.setattr(attention, "_tiles", lambda *args, **kwargs: (*tiles, 4, 1))
    q = rand(1, 1, T, 16, dtype=torch.float32, seed=13)
    k = rand(1, 1, S, 16, dtype=torch.float32, seed=14)
    out = flash_attention(q, k, k, causal=causal)
    assert calls == {False: unmasked, True: masked}
    torch.testing.assert_close(out, attention_ref(q, k, k, causal=causal), atol=1e-4, rtol=1e-4)


def test_non_contiguous_inputs():
    # (B, T, H, D) tensors viewed as (B, H, T, D), as a model produces them before .contiguous()
    q = rand(2, 29, 4, 32, dtype=torch.float32, seed=5).transpose(1, 2)
    k = rand(2, 29, 2, 32, dtype=torch.float32, seed=6).transpose(1, 2)
    v = rand(2, 29, 2, 32, dtype=torch.float32, seed=7).transpose(1, 2)
    assert not q.is_contiguous()
    torch.testing.assert_close(flash_attention(q, k, v), sdpa(q, k, v, True), atol=1e-4, rtol=1e-4)


def test_the_kernel_skips_fully_masked_tiles_without_nan():
    q = rand(1, 1, 100, 16, dtype=torch.float16, seed=8) * 30  # large scores: overflow would show
    out = flash_attention(q, q, q)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "q_shape, k_shape, kw, match",
    [
        ((1, 4, 8, 32), (1, 4, 8, 16), {}, "head dim D=32"),
        ((1, 4, 8, 32), (1, 3, 8, 32), {}, "H_KV=3 heads, which must divide"),
        ((4, 8, 32), (1, 4, 8, 32), {}, r"q must have 4 dims \(B, H, T, D\)"),
        ((1, 4, 8, 32), (2, 4, 8, 32), {}, "batch"),
        ((1, 4, 9, 32), (1, 4, 8, 32), {}, "T <= S"),
        ((1, 4, 8, 32), (1, 4, 8, 32), {"v_dtype": torch.float16}, "one dtype"),
        ((1, 1, 8, 300), (1, 1, 8, 300), {}, "outside the kernel's range"),
    ],
)
def test_bad_input_is_a_clear_error(q_shape, k_shape, kw, match):
    q = torch.zeros(q_shape)
    k = torch.zeros(k_shape)
    v = torch.zeros(k_shape, dtype=kw.get("v_dtype", torch.float32))
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v)


def test_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        attention_ref(torch.zeros(1, 1, 2, 4), [[0.0]], torch.zeros(1, 1, 2, 4))
