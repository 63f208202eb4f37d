"""Every Triton kernel wrapper in kvlib, fed non-contiguous views (issue 42's fuzzing finding): the result equals
the wrapper's PyTorch reference on contiguous copies, or the wrapper refuses the layout with a ValueError; never a
silently wrong answer. On a CPU the kernels run in Triton's interpreter, as in the other kernel tests."""

import pytest
import torch

from kvlib import runtime
from kvlib.attention import attention_ref, flash_attention, flash_attention_minimal
from kvlib.cache import decode_attention, decode_attention_ref, store_kv, store_kv_ref
from kvlib.evict import index_decode_attention, index_decode_attention_ref
from kvlib.gqa import grouped_decode_attention, grouped_decode_attention_ref
from kvlib.kivi import _quantize_values, kivi_decode_attention, kivi_decode_attention_ref
from kvlib.lowbit import pack_2bit, quantize_keys_per_channel
from kvlib.paged import (paged_decode_attention, paged_decode_attention_ref, paged_decode_minimal, store_paged,
                         store_paged_ref)
from kvlib.quant import (int8_decode_attention, int8_decode_attention_ref, quantize_int8, store_kv_int8,
                         store_kv_int8_ref)
from kvlib.ragged import ragged_paged_attention, ragged_paged_attention_ref
from kvlib.sparse import (block_summaries, block_upper_bound, select_blocks, sparse_decode_attention,
                          sparse_decode_attention_ref)
from kvlib.vector_add import add, add_ref

DEV = runtime.DEVICE


def reversed_leading(t):
    """t's values with the leading dims laid out in reverse order (dense, the last dim innermost): the fuzz case
    q.transpose(0, 1) of a (H, B, D) tensor."""
    if t.dim() < 3:
        return t.t().contiguous().t() if t.dim() == 2 else t
    perm = list(range(t.dim() - 1))[::-1] + [t.dim() - 1]
    return t.permute(perm).contiguous().permute(perm)


def padded_rows(t):
    """t's values in rows of 3 more elements than the last dim holds (not dense)."""
    if t.dim() < 2:
        return t
    buf = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
    view = buf[..., : t.shape[-1]]
    view.copy_(t)
    return view


def every_other(t):
    """t's values at every other entry of its first dim."""
    buf = torch.zeros(2 * t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
    view = buf[::2]
    view.copy_(t)
    return view


LAYOUTS = {"reversed": reversed_leading, "padded": padded_rows, "every other": every_other}


def views(args, layout, skip=()):
    """The tensor arguments in ``layout`` (positions in ``skip`` stay as they are)."""
    return [LAYOUTS[layout](a) if isinstance(a, torch.Tensor) and i not in skip else a for i, a in enumerate(args)]


def same_or_refused(fn, ref, args, layout, atol=1e-5, skip=()):
    """fn on the views of args equals ref on contiguous args, or fn raises a ValueError (a refused layout)."""
    want = ref(*args)
    try:
        got = fn(*views(args, layout, skip))
    except ValueError:
        return "refused"
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert a.shape == b.shape
        assert (a.float() - b.float()).abs().max() <= atol, layout
    return "same"


def rand(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def test_the_fuzzing_case_is_fixed():
    torch.manual_seed(0)
    q = torch.randn(2, 2, 16).transpose(0, 1).to(DEV)
    k = v = torch.randn(2, 1, 4, 16).to(DEV)
    idx, n = torch.arange(4).repeat(2, 1, 1).to(DEV), torch.tensor([4, 4], device=DEV)
    out = index_decode_attention(q, k, v, idx, n)
    assert (out - index_decode_attention_ref(q.contiguous(), k, v, idx, n)).abs().max() < 1e-5
    assert out.is_contiguous()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_index_decode_attention(layout):
    g = torch.Generator().manual_seed(1)
    q, k, v = rand(3, 4, 24, g=g), rand(3, 2, 11, 24, g=g), rand(3, 2, 11, 24, g=g)
    index = torch.stack([torch.randperm(11, generator=g)[:9].repeat(2, 1) for _ in range(3)]).to(DEV)
    n = torch.tensor([9, 1, 5], device=DEV)
    for probs in (False, True):
        fn = lambda *a: index_decode_attention(*a, return_probs=probs)  # noqa: E731
        ref = lambda *a: index_decode_attention_ref(*a, return_probs=probs)  # noqa: E731
        assert same_or_refused(fn, ref, [q, k, v, index, n], layout) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flash_attention(layout):
    g = torch.Generator().manual_seed(2)
    q, k, v = rand(2, 4, 7, 24, g=g), rand(2, 2, 9, 24, g=g), rand(2, 2, 9, 24, g=g)
    assert same_or_refused(flash_attention, attention_ref, [q, k, v], layout) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flash_attention_minimal(layout):
    g = torch.Generator().manual_seed(3)
    q, k, v = (rand(2, 3, 21, 16, g=g) for _ in range(3))
    assert same_or_refused(flash_attention_minimal, attention_ref, [q, k, v], layout) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decode_attention(layout):
    g = torch.Generator().manual_seed(4)
    q, k, v = rand(3, 4, 24, g=g), rand(3, 2, 13, 24, g=g), rand(3, 2, 13, 24, g=g)
    lens = torch.tensor([13, 2, 7], device=DEV)
    assert same_or_refused(decode_attention, decode_attention_ref, [q, k, v, lens], layout) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grouped_decode_attention(layout):
    g = torch.Generator().manual_seed(5)
    q, k, v = rand(3, 8, 16, g=g), rand(3, 2, 13, 16, g=g), rand(3, 2, 13, 16, g=g)
    lens = torch.tensor([13, 2, 7], device=DEV)
    assert same_or_refused(grouped_decode_attention, grouped_decode_attention_ref, [q, k, v, lens], layout) == "same"


def _paged_inputs(g):
    q = rand(2, 4, 16, g=g)
    k, v = rand(6, 4, 2, 16, g=g), rand(6, 4, 2, 16, g=g)  # 6 blocks of 4 positions, 2 K/V heads
    tables = torch.tensor([[3, 0, 5], [1, 4, -1]], dtype=torch.int32, device=DEV)
    return q, k, v, tables, torch.tensor([11, 6], device=DEV)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_paged_decode_attention(layout):
    args = list(_paged_inputs(torch.Generator().manual_seed(6)))
    assert same_or_refused(paged_decode_attention, paged_decode_attention_ref, args, layout) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_paged_decode_minimal(layout):
    args = list(_paged_inputs(torch.Generator().manual_seed(7)))
    # the minimal kernel wants q contiguous (a ValueError says so); its tables and lengths may be any views
    assert same_or_refused(paged_decode_minimal, paged_decode_attention_ref, args, layout) in ("same", "refused")
    assert same_or_refused(paged_decode_minimal, paged_decode_attention_ref, args, layout, skip=(0, 1, 2)) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_int8_decode_attention(layout):
    g = torch.Generator().manual_seed(8)
    q = rand(2, 4, 16, g=g)
    (k_q, k_s), (v_q, v_s) = (quantize_int8(rand(2, 2, 9, 16, g=g), dim=-1) for _ in range(2))
    args = [q, k_q, k_s, v_q, v_s, torch.tensor([9, 4], device=DEV)]
    assert same_or_refused(int8_decode_attention, int8_decode_attention_ref, args, layout) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kivi_decode_attention(layout):
    g = torch.Generator().manual_seed(9)
    k, v = rand(1, 2, 40, 16, g=g), rand(1, 2, 40, 16, g=g)
    kq, ks, kz = quantize_keys_per_channel(k[:, :, :32], group=16)
    vq, vs, vz = _quantize_values(v[:, :, :35], bits=2, v_group=8)
    n = lambda x: torch.tensor([x], device=DEV)  # noqa: E731
    args = [rand(1, 4, 16, g=g), pack_2bit(kq), ks.half(), kz.half(), n(32), k[:, :, 32:].contiguous(), n(8),
            pack_2bit(vq), vs.half(), vz.half(), n(35), v[:, :, 35:].contiguous(), n(5), 16]
    assert same_or_refused(kivi_decode_attention, kivi_decode_attention_ref, args, layout) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ragged_paged_attention(layout):
    g = torch.Generator().manual_seed(10)
    k, v = rand(6, 4, 1, 16, g=g), rand(6, 4, 1, 16, g=g)
    tables = torch.tensor([[3, 0, -1], [5, 1, 2]], dtype=torch.int32, device=DEV)
    cu, lens = torch.tensor([0, 1, 6], device=DEV), torch.tensor([7, 9], device=DEV)
    args = [rand(6, 2, 16, g=g), k, v, tables, cu, lens]
    assert same_or_refused(ragged_paged_attention, ragged_paged_attention_ref, args, layout) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sparse_decode_attention(layout):
    g = torch.Generator().manual_seed(11)
    q, k, v = rand(2, 4, 16, g=g), rand(2, 2, 40, 16, g=g), rand(2, 2, 40, 16, g=g)
    lens = torch.tensor([37, 12], device=DEV)
    kmin, kmax = block_summaries(k, lens, 8)
    sel = select_blocks(block_upper_bound(q, kmin, kmax), lens, 8, n_select=2)
    fn = lambda *a: sparse_decode_attention(*a, block_size=8)  # noqa: E731
    ref = lambda *a: sparse_decode_attention_ref(*a, block_size=8)  # noqa: E731
    assert same_or_refused(fn, ref, [q, k, v, sel, lens], layout) == "same"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_vector_add(layout):
    g = torch.Generator().manual_seed(12)
    x, y = rand(5, 37, g=g), rand(5, 37, g=g)
    assert same_or_refused(add, add_ref, [x, y], layout) == "same"


def _stored(fn, cache_args, rest, layout, n_cache):
    """Run a store on (views of) fresh caches; return the caches' values (as contiguous copies) or 'refused'."""
    caches = [LAYOUTS[layout](c.clone()) if layout else c.clone() for c in cache_args]
    try:
        fn(*caches, *(views(rest, layout) if layout else rest))
    except ValueError:
        return "refused"
    return [c.contiguous() for c in caches[:n_cache]]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_kv(layout):
    g = torch.Generator().manual_seed(13)
    caches = [rand(2, 2, 9, 16, g=g), rand(2, 2, 9, 16, g=g)]
    rest = [rand(2, 2, 3, 16, g=g), rand(2, 2, 3, 16, g=g), torch.tensor([0, 5], device=DEV)]
    want = _stored(store_kv_ref, caches, rest, None, 2)
    got = _stored(store_kv, caches, rest, layout, 2)
    assert got != "refused" and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_paged(layout):
    g = torch.Generator().manual_seed(14)
    caches = [rand(4, 4, 2, 16, g=g), rand(4, 4, 2, 16, g=g)]  # (num_blocks, block_size, H_KV, D)
    rest = [rand(3, 2, 16, g=g), rand(3, 2, 16, g=g), torch.tensor([5, 0, 14], device=DEV)]
    want = _stored(store_paged_ref, caches, rest, None, 2)
    got = _stored(store_paged, caches, rest, layout, 2)  # the pools must be contiguous: a ValueError says so
    assert got == "refused" or all(torch.equal(a, b) for a, b in zip(got, want))
    new_rows = _stored(store_paged, caches, views(rest, layout), None, 2)  # the new rows and slots may be any view
    assert all(torch.equal(a, b) for a, b in zip(new_rows, want))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_store_kv_int8(layout):
    g = torch.Generator().manual_seed(15)
    k_q = torch.zeros(2, 2, 9, 16, dtype=torch.int8, device=DEV)
    caches = [k_q, torch.ones(2, 2, 9, device=DEV), k_q.clone(), torch.ones(2, 2, 9, device=DEV)]
    rest = [rand(2, 2, 3, 16, g=g), rand(2, 2, 3, 16, g=g), torch.tensor([0, 5], device=DEV)]
    want = _stored(store_kv_int8_ref, caches, rest, None, 4)
    got = _stored(store_kv_int8, caches, rest, layout, 4)  # the int8 caches must be contiguous: refused
    assert got == "refused" or all(torch.equal(a, b) for a, b in zip(got, want))
    new_rows = _stored(store_kv_int8, caches, views(rest, layout), None, 4)  # the new rows may be any view
    assert all(torch.equal(a, b) for a, b in zip(new_rows, want))
