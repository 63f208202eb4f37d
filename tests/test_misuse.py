"""Misuse of the kernels, caches, generators and the loader: each is a clear error or a correct result.

One test per class of misuse, parametrized over the calls it covers. A clear error is a TypeError or
ValueError (or a subclass: CacheFullError, OutOfBlocksError, CheckpointError) whose message names the
argument; a refused call leaves no trace (lengths, block tables and reference counts as they were).
"""

import json
import sys
import types

import pytest
import torch

from kvlib import runtime
from kvlib.attention import attention_ref, flash_attention
from kvlib.cache import CacheFullError, KVCache, decode_attention, decode_attention_ref, store_kv, store_kv_ref
from kvlib.generate import generate, generate_naive
from kvlib.gqa import grouped_decode_attention, grouped_decode_attention_ref
from kvlib.model import CheckpointError, ModelConfig, Transformer, load_hf, save_hf
from kvlib.paged import (BlockAllocator, OutOfBlocksError, PagedKVCache, paged_decode_attention,
                         paged_decode_attention_ref, store_paged, store_paged_ref)
from kvlib.quant import (Int8KVCache, int8_decode_attention, int8_decode_attention_ref, quantize_int8,
                         store_kv_int8, store_kv_int8_ref)
from kvlib.vector_add import add

DEV = runtime.DEVICE


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEV)


def ints(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEV)


# ---- one small valid input for every kernel wrapper; each misuse below changes one thing -----------------

B, H, H_KV, S, D = 2, 4, 2, 8, 16


def decode_inputs(dtype=torch.float32, B=B):
    return dict(q=rand(B, H, D, dtype=dtype, seed=1), k_cache=rand(B, H_KV, S, D, dtype=dtype, seed=2),
                v_cache=rand(B, H_KV, S, D, dtype=dtype, seed=3), seq_lens=ints(*[8, 3][:B]) if B else ints())


def paged_inputs(dtype=torch.float32, B=B):
    return dict(q=rand(B, H, D, dtype=dtype, seed=1), k_blocks=rand(4, 4, H_KV, D, dtype=dtype, seed=2),
                v_blocks=rand(4, 4, H_KV, D, dtype=dtype, seed=3),
                block_tables=torch.tensor([[3, 0], [1, -1]][:B], dtype=torch.int32, device=DEV).view(B, 2),
                seq_lens=ints(*[6, 2][:B]) if B else ints())


def int8_inputs(q_dtype=torch.float32, B=B):
    (kq, ks), (vq, vs) = quantize_int8(rand(B, H_KV, S, D, seed=2), -1), quantize_int8(rand(B, H_KV, S, D, seed=3), -1)
    return dict(q=rand(B, H, D, dtype=q_dtype, seed=1), k_q=kq, k_scale=ks, v_q=vq, v_scale=vs,
                seq_lens=ints(*[8, 3][:B]) if B else ints())


def attn_inputs(dtype=torch.float32, B=1):
    return dict(q=rand(B, H, 5, D, dtype=dtype, seed=1), k=rand(B, H_KV, 5, D, dtype=dtype, seed=2),
                v=rand(B, H_KV, 5, D, dtype=dtype, seed=3))


def store_inputs(dtype=torch.float32, B=B):
    return dict(k_cache=torch.zeros(B, H_KV, S, D, dtype=dtype, device=DEV),
                v_cache=torch.zeros(B, H_KV, S, D, dtype=dtype, device=DEV),
                k_new=rand(B, H_KV, 2, D, dtype=dtype, seed=4), v_new=rand(B, H_KV, 2, D, dtype=dtype, seed=5),
                start=ints(*[0, 5][:B]) if B else ints())


def store_paged_inputs(dtype=torch.float32, N=3):
    return dict(k_blocks=torch.zeros(4, 4, H_KV, D, dtype=dtype, device=DEV),
                v_blocks=torch.zeros(4, 4, H_KV, D, dtype=dtype, device=DEV),
                k_new=rand(N, H_KV, D, dtype=dtype, seed=4), v_new=rand(N, H_KV, D, dtype=dtype, seed=5),
                slots=ints(*[0, 7, 13][:N], dtype=torch.int64) if N else ints(dtype=torch.int64))


def store_int8_inputs(dtype=torch.float32, B=B):
    return dict(k_q=torch.zeros(B, H_KV, S, D, dtype=torch.int8, device=DEV), k_scale=torch.ones(B, H_KV, S, device=DEV),
                v_q=torch.zeros(B, H_KV, S, D, dtype=torch.int8, device=DEV), v_scale=torch.ones(B, H_KV, S, device=DEV),
                k_new=rand(B, H_KV, 2, D, dtype=dtype, seed=4), v_new=rand(B, H_KV, 2, D, dtype=dtype, seed=5),
                start=ints(*[0, 5][:B]) if B else ints())


def add_inputs(dtype=torch.float32):
    return dict(x=rand(37, dtype=dtype, seed=1), y=rand(37, dtype=dtype, seed=2))


# name -> (function, builder of its valid keyword arguments given a dtype, name of the float argument checked)
WRAPPERS = {
    "flash_attention": (flash_attention, attn_inputs, "q"),
    "attention_ref": (attention_ref, attn_inputs, "q"),
    "decode_attention": (decode_attention, decode_inputs, "q"),
    "decode_attention_ref": (decode_attention_ref, decode_inputs, "q"),
    "grouped_decode_attention": (grouped_decode_attention, decode_inputs, "q"),
    "grouped_decode_attention_ref": (grouped_decode_attention_ref, decode_inputs, "q"),
    "paged_decode_attention": (paged_decode_attention, paged_inputs, "q"),
    "paged_decode_attention_ref": (paged_decode_attention_ref, paged_inputs, "q"),
    "int8_decode_attention": (int8_decode_attention, int8_inputs, "q"),
    "int8_decode_attention_ref": (int8_decode_attention_ref, int8_inputs, "q"),
    "store_kv": (store_kv, store_inputs, "k_new"),
    "store_kv_ref": (store_kv_ref, store_inputs, "k_new"),
    "store_paged": (store_paged, store_paged_inputs, "k_new"),
    "store_paged_ref": (store_paged_ref, store_paged_inputs, "k_new"),
    "store_kv_int8": (store_kv_int8, store_int8_inputs, "k_new"),
    "store_kv_int8_ref": (store_kv_int8_ref, store_int8_inputs, "k_new"),
    "add": (add, add_inputs, "x"),
}
KERNELS = [n for n in WRAPPERS if not n.endswith("_ref")]


def call(name, **kw):
    fn = WRAPPERS[name][0]
    return fn(**kw)


@pytest.mark.parametrize("name", WRAPPERS)
def test_the_valid_inputs_used_below_are_accepted(name):
    fn, build, _ = WRAPPERS[name]
    fn(**build())


# ---- 1. wrong dtype: integers, bool, float64 -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float64], ids=str)
@pytest.mark.parametrize("name", WRAPPERS)
def test_wrong_dtype_is_a_type_error_naming_the_argument(name, dtype):
    fn, build, arg = WRAPPERS[name]
    if dtype == torch.float64 and name.endswith("_ref"):  # the PyTorch references take float64: a correct result
        kw32 = build()
        cast = [arg, "v_new"] if name.startswith(("store_kv_int8", "int8")) else list(kw32)  # not the int8 scales
        kw64 = {k: (v.double() if v.is_floating_point() and k in cast else v.clone()) for k, v in kw32.items()}
        out32, out64 = fn(**kw32), fn(**kw64)
        if out32 is None:  # a store: compare what it wrote
            out32, out64 = [t for t in kw32.values() if t.dim() == 4 or t.dim() == 3][0], \
                [t for t in kw64.values() if t.dim() == 4 or t.dim() == 3][0]
        assert (out32.double() - out64.double()).abs().max() < 1e-3
        return
    if name.startswith(("store_kv_int8", "int8")):
        kw = build()  # int8 caches take float new rows / a float q: only that argument changes dtype
        kw[arg] = (kw[arg] * 3).to(dtype)
        if arg == "k_new":
            kw["v_new"] = kw["v_new"].to(dtype)
    else:
        kw = build(dtype=torch.float32)
        kw = {k: ((v * 3).to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    with pytest.raises(TypeError, match=rf"\b{arg}\b.*{str(dtype).split('.')[-1]}|{str(dtype).split('.')[-1]}.*\b{arg}\b"):
        fn(**kw)


# ---- 2. bfloat16 where this machine's kernel cannot compute it --------------------------------------------


DOT_KERNELS = ["flash_attention", "grouped_decode_attention", "add"]  # tl.dot (or bf16 arithmetic) in the kernel


@pytest.mark.parametrize("name", DOT_KERNELS)
def test_bf16_is_refused_in_the_interpreter_by_kernels_it_computes_wrongly(monkeypatch, name):
    pytest.importorskip("triton")
    monkeypatch.setattr(runtime, "mode", lambda: "interpreter")
    fn, build, arg = WRAPPERS[name]
    with pytest.raises(TypeError, match=rf"{arg} is torch.bfloat16.*interpreter \(CPU mode\)"):
        fn(**build(dtype=torch.bfloat16))


@pytest.mark.skipif(runtime.mode() != "interpreter", reason="checks the interpreter's own bf16 results")
@pytest.mark.parametrize("name", ["decode_attention", "paged_decode_attention"])
def test_bf16_in_the_interpreter_is_correct_where_it_is_accepted(name):
    fn, build, _ = WRAPPERS[name]
    ref = WRAPPERS[name + "_ref"][0]
    kw = build(dtype=torch.bfloat16)
    assert (fn(**kw).float() - ref(**kw).float()).abs().max() <= 2e-2


@pytest.mark.parametrize("name", KERNELS)
def test_bf16_is_refused_on_a_gpu_older_than_sm80(monkeypatch, name):
    pytest.importorskip("triton")
    monkeypatch.setattr(runtime, "mode", lambda: "gpu")  # a Colab T4: compute capability 7.5
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    fn, build, arg = WRAPPERS[name]
    kw = build(q_dtype=torch.bfloat16) if name.startswith("int8") else build(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=rf"{arg} is torch.bfloat16.*compute capability 8.0.*7\.5"):
        fn(**kw)


# ---- 3. an empty batch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WRAPPERS)
def test_an_empty_batch_is_a_value_error(name):
    fn, build, arg = WRAPPERS[name]
    if name == "add":  # elementwise: an empty tensor has an empty sum, as in torch
        assert add(torch.zeros(0, device=DEV), torch.zeros(0, device=DEV)).shape == (0,)
        return
    kw = build(N=0) if name.startswith("store_paged") else build(B=0)
    with pytest.raises(ValueError, match=rf"({'|'.join(kw)}).*(empty|at least one|>= 1)"):
        fn(**kw)


# ---- 4. an argument that is not a tensor ------------------------------------------------------------------


@pytest.mark.parametrize("name, arg", [
    ("flash_attention", "q"), ("attention_ref", "k"), ("decode_attention", "seq_lens"), ("decode_attention_ref", "v_cache"),
    ("grouped_decode_attention", "seq_lens"), ("paged_decode_attention", "block_tables"),
    ("paged_decode_attention_ref", "k_blocks"), ("int8_decode_attention", "k_scale"), ("int8_decode_attention_ref", "q"),
    ("store_kv", "start"), ("store_kv_ref", "start"), ("store_paged", "slots"), ("store_paged_ref", "k_new"),
    ("store_kv_int8", "start"), ("store_kv_int8_ref", "v_scale"), ("add", "y"),
])
def test_a_list_instead_of_a_tensor_is_a_type_error_naming_it(name, arg):
    fn, build, _ = WRAPPERS[name]
    kw = build()
    kw[arg] = kw[arg].tolist()
    with pytest.raises(TypeError, match=rf"\b{arg}\b|x and y"):
        fn(**kw)


# ---- 5. wrong rank or shape --------------------------------------------------------------------------------


def _set(name, arg, value_fn):
    def make():
        kw = WRAPPERS[name][1]()
        kw[arg] = value_fn(kw)
        return kw
    return make


SHAPE_MISUSE = [
    ("flash_attention", _set("flash_attention", "q", lambda kw: kw["q"][0]), r"q must have 4 dims"),
    ("flash_attention", lambda: {**attn_inputs(), "k": rand(1, H_KV, 5, 8), "v": rand(1, H_KV, 5, 8)}, r"k must have head dim D=16"),
    ("attention_ref", _set("attention_ref", "q", lambda kw: rand(1, 3, 5, D)), r"H_KV=2 heads, which must divide q's H=3"),
    ("decode_attention", _set("decode_attention", "q", lambda kw: kw["q"][:, None]), r"q must be \(B, H, D\)"),
    ("decode_attention", _set("decode_attention", "v_cache", lambda kw: kw["v_cache"][:, :, :4].contiguous()), r"v_cache must have k_cache's shape"),
    ("grouped_decode_attention", _set("grouped_decode_attention", "q", lambda kw: rand(B, 3, D)), r"H_KV=2 heads, which must divide q's H=3"),
    ("paged_decode_attention", _set("paged_decode_attention", "k_blocks", lambda kw: kw["k_blocks"][0]), r"k_blocks and v_blocks must both be"),
    ("paged_decode_attention", _set("paged_decode_attention", "block_tables", lambda kw: kw["block_tables"][0]), r"block_tables must be a \(B=2, max_blocks\)"),
    ("int8_decode_attention", _set("int8_decode_attention", "k_scale", lambda kw: kw["k_scale"][:, :, :4]), r"k_scale must be fp16/fp32 of shape \(B, H_KV, S_max\)"),
    ("store_kv", _set("store_kv", "k_new", lambda kw: kw["k_new"][0]), r"k_new must be a non-empty 4-d tensor"),
    ("store_kv", _set("store_kv", "start", lambda kw: ints(0)), r"start must be a \(B=2,\)"),
    ("store_paged", _set("store_paged", "k_new", lambda kw: rand(3, 1, D)), r"k_new/v_new must be \(N >= 1, H_KV=2, D=16\)"),
    ("store_kv_int8", _set("store_kv_int8", "v_scale", lambda kw: torch.ones(B, H_KV, 3, device=DEV)), r"v_scale must be fp16/fp32 of shape"),
    ("add", _set("add", "y", lambda kw: kw["y"][:5]), r"y must have x's shape"),
]


@pytest.mark.parametrize("name, make, match", SHAPE_MISUSE, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(SHAPE_MISUSE)])
def test_wrong_rank_or_shape_is_a_value_error_naming_the_argument(name, make, match):
    with pytest.raises(ValueError, match=match):
        call(name, **make())


# ---- 6. lengths, positions, slots and block ids outside what the cache holds --------------------------------


RANGE_MISUSE = [
    ("decode_attention", "seq_lens", ints(-1, 3), r"seq_lens must lie in 1..S_max=8, got values in -1..3"),
    ("decode_attention_ref", "seq_lens", ints(8, 9), r"seq_lens must lie in 1..S_max=8"),
    ("grouped_decode_attention", "seq_lens", ints(0, 3), r"seq_lens must lie in 1..S_max=8"),
    ("int8_decode_attention", "seq_lens", ints(3, 99), r"seq_lens must lie in 1..S_max=8"),
    ("paged_decode_attention", "seq_lens", ints(9, 2), r"seq_lens must lie in 1..max_blocks\*block_size=8"),
    ("paged_decode_attention", "block_tables", torch.tensor([[3, 4], [1, -1]], dtype=torch.int32, device=DEV),
     r"block_tables\[0\] points outside the pool 0..3"),
    ("paged_decode_attention_ref", "block_tables", torch.tensor([[3, 0], [-1, -1]], dtype=torch.int32, device=DEV),
     r"block_tables\[1\] points outside the pool"),
    ("store_kv", "start", ints(-1, 0), r"writing T=2 rows from start \[-1, 0\] runs past S_max=8"),
    ("store_kv_ref", "start", ints(0, 7), r"runs past S_max=8"),
    ("store_kv_int8", "start", ints(7, 0), r"runs past S_max=8"),
    ("store_paged", "slots", ints(0, 16, 2, dtype=torch.int64), r"slots must lie in 0..15"),
    ("store_paged_ref", "slots", ints(-1, 1, 2, dtype=torch.int64), r"slots must lie in 0..15"),
]


@pytest.mark.parametrize("name, arg, value, match", RANGE_MISUSE, ids=[f"{n}-{a}" for n, a, _, _ in RANGE_MISUSE])
def test_out_of_range_lengths_positions_and_blocks_are_value_errors(name, arg, value, match):
    kw = WRAPPERS[name][1]()
    before = {k: v.clone() for k, v in kw.items()}
    kw[arg] = value
    with pytest.raises(ValueError, match=match):
        call(name, **kw)
    assert all(torch.equal(kw[k], before[k]) for k in before if k != arg)  # nothing was written


# ---- 7. strides: handled correctly, or refused -------------------------------------------------------------


def test_strided_inputs_give_the_reference_answer_or_a_clear_error():
    kw = decode_inputs()
    strided_lens = ints(8, 0, 3, 0)[::2]  # a view with stride 2
    wide_q = rand(B, 2 * H, D, seed=9)[:, ::2]  # heads every other row
    ref = decode_attention_ref(wide_q, kw["k_cache"], kw["v_cache"], strided_lens.contiguous())
    for fn in (decode_attention, grouped_decode_attention):
        torch.testing.assert_close(fn(wide_q, kw["k_cache"], kw["v_cache"], strided_lens), ref, atol=1e-5, rtol=1e-5)
    pkw = paged_inputs()
    wide = torch.full((B, 4), 99, dtype=torch.int32, device=DEV)
    wide[:, ::2] = pkw["block_tables"]
    out = paged_decode_attention(pkw["q"], pkw["k_blocks"], pkw["v_blocks"], wide[:, ::2], pkw["seq_lens"])  # stride 2
    torch.testing.assert_close(out, paged_decode_attention_ref(**pkw), atol=1e-5, rtol=1e-5)
    ikw = int8_inputs()
    ikw["v_scale"] = ikw["v_scale"][..., 0].t().contiguous().t() if ikw["v_scale"].dim() == 2 else \
        ikw["v_scale"][..., 0].transpose(0, 1).contiguous().transpose(0, 1)  # other strides than k_scale
    torch.testing.assert_close(int8_decode_attention(**ikw), int8_decode_attention_ref(**ikw), atol=1e-5, rtol=1e-5)
    k_t = kw["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)  # D stride != 1
    with pytest.raises(ValueError, match="contiguous along the head dim"):
        decode_attention(kw["q"], k_t, k_t, kw["seq_lens"])
    skw = store_paged_inputs()
    with pytest.raises(ValueError, match="k_blocks and v_blocks must be contiguous"):
        store_paged(skw["k_blocks"].transpose(0, 1), skw["v_blocks"].transpose(0, 1), skw["k_new"], skw["v_new"],
                    ints(0, 1, 2, dtype=torch.int64))


# ---- 8. sizes and counts that are not positive ints ----------------------------------------------------


def small_model(max_seq_len=32):
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                   max_seq_len=max_seq_len)).eval()


@pytest.fixture(scope="module")
def model():
    return small_model()


COUNT_MISUSE = [
    (lambda m: KVCache(1, 1, 1, -3, 16), ValueError, r"max_len must be >= 1, got -3"),
    (lambda m: KVCache(1, 0, 1, 8, 16), ValueError, r"batch must be >= 1, got 0"),
    (lambda m: KVCache(1, 1, 1, 2.5, 16), TypeError, r"max_len must be an int, got float 2.5"),
    (lambda m: Int8KVCache(0, 1, 1, 8, 16), ValueError, r"n_layers must be >= 1, got 0"),
    (lambda m: PagedKVCache(1, 4, 0, 1, 16), ValueError, r"block_size must be >= 1, got 0"),
    (lambda m: PagedKVCache(1, -4, 4, 1, 16), ValueError, r"num_blocks must be >= 1, got -4"),
    (lambda m: BlockAllocator(0), ValueError, r"num_blocks must be a positive int, got 0"),
    (lambda m: BlockAllocator(4).allocate(-2), ValueError, r"n must be >= 0, got -2"),
    (lambda m: BlockAllocator(4).allocate(1.5), TypeError, r"n must be an int, got float 1.5"),
    (lambda m: generate_naive(m, [[1, 2]], -2), ValueError, r"max_new_tokens must be >= 0, got -2"),
    (lambda m: generate(m, [[1, 2]], -2), ValueError, r"max_new_tokens must be >= 0, got -2"),
    (lambda m: generate(m, [[1, 2]], 2.5), TypeError, r"max_new_tokens must be an int, got float 2.5"),
    (lambda m: generate(m, [[1, 2]], 2, max_len=0), ValueError, r"max_len must be >= 1, got 0"),
    (lambda m: decode_attention(**decode_inputs(), num_splits=3), ValueError, r"num_splits must be a power of two"),
    (lambda m: add(**add_inputs(), tile=100), ValueError, r"tile must be a power of two >= 16, got 100"),
]


@pytest.mark.parametrize("make, exc, match", COUNT_MISUSE, ids=[m for _, _, m in COUNT_MISUSE])
def test_sizes_and_counts_must_be_positive_ints(model, make, exc, match):
    with pytest.raises(exc, match=match):
        make(model)


def test_max_new_tokens_zero_is_an_empty_result(model):
    assert generate(model, [[1, 2], [3]], 0).shape == (2, 0) == generate_naive(model, [[1, 2], [3]], 0).shape


# ---- 9. unknown, freed and repeated sequence ids in a paged cache --------------------------------------


def paged_state(c):
    return ({s: list(t) for s, t in c.tables.items()}, dict(c.lens), list(c.allocator.refcount), c.allocator.num_free)


def seq_cache(with_b=True):
    c = PagedKVCache(1, num_blocks=6, block_size=2, n_kv_heads=1, head_dim=2, kernels="torch")
    for s, n in (("a", 3), ("b", 1))[: 2 if with_b else 1]:
        c.add_sequence(s)
        c.reserve([s], n)
        c.lens[s] += n
    return c


SEQ_ID_MISUSE = [  # (misuse of a cache holding "a" and "b", message); a double free is refused after the first
    (lambda c: c.free_sequence(7), r"free_sequence: unknown sequence 7 \(never added, or already freed\); live: 'a', 'b'"),
    (lambda c: (c.free_sequence("b"), c.free_sequence("b")), r"free_sequence: unknown sequence 'b' .*live: 'a'$"),
    (lambda c: c.fork(7, "c"), r"fork: unknown sequence 7"),
    (lambda c: c.fork("a", "b"), r"sequence 'b' already exists"),
    (lambda c: c.add_sequence("a"), r"sequence 'a' already exists"),
    (lambda c: c.reserve(["a", 7], 1), r"reserve: unknown sequence 7"),
    (lambda c: c.reserve(["a", "a"], 1), r"reserve: seq_ids must be distinct, got \['a', 'a'\]"),
    (lambda c: c.reserve(["a"], -1), r"n_new must be >= 0, got -1"),
    (lambda c: c.blocks_needed("zz", 1), r"blocks_needed: unknown sequence 'zz'"),
    (lambda c: c.batch(["a", "a"]), r"batch: seq_ids must be distinct, got \['a', 'a'\]"),
    (lambda c: c.batch([]), r"batch: seq_ids must name at least one sequence"),
    (lambda c: c.batch([["a"]]), r"batch: unknown sequence \['a'\]"),
]


@pytest.mark.parametrize("misuse, match", SEQ_ID_MISUSE, ids=[m.split(":")[0][:40] for _, m in SEQ_ID_MISUSE])
def test_unknown_freed_or_repeated_sequence_ids_are_value_errors_that_change_nothing(misuse, match):
    c = seq_cache()
    double_free = match.startswith("free_sequence: unknown sequence 'b'")
    before = paged_state(seq_cache(with_b=not double_free))  # after a double free: the state after the first
    with pytest.raises(ValueError, match=match):
        misuse(c)
    assert paged_state(c) == before


def test_out_of_blocks_is_a_clear_error_that_leaves_the_allocator_intact():
    c = PagedKVCache(1, num_blocks=3, block_size=2, n_kv_heads=1, head_dim=2, kernels="torch")
    c.add_sequence("a")
    before = paged_state(c)
    for misuse in (lambda: c.reserve(["a"], 7), lambda: c.allocator.allocate(4)):
        with pytest.raises(OutOfBlocksError, match=r"only 3 of 3 are free|needs 4 block\(s\); 3 of 3 are free"):
            misuse()
        assert paged_state(c) == before


# ---- 10. the model's seam: attend() with a layer, batch, heads or dtype the cache does not have --------------


def seam_caches():
    kv = KVCache(2, 2, H_KV, 8, D, kernels="torch")
    i8 = Int8KVCache(2, 2, H_KV, 8, D, kernels="torch")
    paged = PagedKVCache(2, num_blocks=8, block_size=4, n_kv_heads=H_KV, head_dim=D, kernels="torch")
    for s in (0, 1):
        paged.add_sequence(s)
    return {"KVCache": (kv, kv), "Int8KVCache": (i8, i8), "PagedKVCache": (paged, paged.batch([0, 1]))}


def good_qkv(B=2, T=1):
    return rand(B, H, T, D, seed=1), rand(B, H_KV, T, D, seed=2), rand(B, H_KV, T, D, seed=3)


ATTEND_MISUSE = [
    (lambda: (2, *good_qkv()), ValueError, r"layer_idx must be an int in 0..1 \(the cache has 2 layers\), got 2"),
    (lambda: (-1, *good_qkv()), ValueError, r"layer_idx must be an int in 0..1"),
    (lambda: (0, *good_qkv(B=3)), ValueError, r"q has batch 3, but (the cache holds B=2|the view names 2)"),
    (lambda: (0, good_qkv()[0], rand(2, 4, 1, D), rand(2, 4, 1, D)), ValueError, r"k and v must be \(B, H_KV, T, D\) = \(2, 2, 1, 16\)"),
    (lambda: (0, rand(2, 3, 1, D), *good_qkv()[1:]), ValueError, r"q must be \(B=2, H, T >= 1, D=16\) with H a multiple"),
    (lambda: (0, *good_qkv()[:2], rand(2, H_KV, 1, 8)), ValueError, r"k and v must be"),
    (lambda: (0, *(t.double() for t in good_qkv())), TypeError, r"(k and v must be torch.float32 like the cache|k_new and v_new must share one floating-point|q is torch.float64)"),
    (lambda: (0, good_qkv()[0][0], *good_qkv()[1:]), ValueError, r"q must be a 4-d tensor"),
]


@pytest.mark.parametrize("kind", ["KVCache", "Int8KVCache", "PagedKVCache"])
@pytest.mark.parametrize("make, exc, match", ATTEND_MISUSE, ids=[str(i) for i in range(len(ATTEND_MISUSE))])
def test_attend_with_what_the_cache_does_not_hold_is_a_clear_error(kind, make, exc, match):
    cache, seam = seam_caches()[kind]
    args = make()
    if kind == "Int8KVCache" and exc is TypeError:  # an int8 cache quantizes any float K/V: a correct result
        out = seam.attend(*args)
        assert out.shape == args[1].shape and torch.isfinite(out).all()
        return
    before = cache.seq_lens.clone() if kind != "PagedKVCache" else paged_state(cache)
    with pytest.raises(exc, match=match):
        seam.attend(*args)
    assert (torch.equal(cache.seq_lens, before) if kind != "PagedKVCache" else paged_state(cache) == before)


# ---- 11. generation: prompts the model or the cache cannot take -----------------------------------------


GENERATE_MISUSE = [
    (lambda m: generate(m, [list(range(1, 41))], 2), ValueError,
     r"prompt 0 \(40 tokens\) \+ max_new_tokens \(2\) = 42 tokens exceeds the model's context of 32"),
    (lambda m: generate_naive(m, [[1], list(range(1, 31))], 5), ValueError, r"prompt 1 \(30 tokens\).*context of 32"),
    (lambda m: generate(m, [[1, 2, 99]], 2), ValueError, r"ids: prompt 0 holds token 99, outside the model's vocabulary 0..63"),
    (lambda m: generate_naive(m, [[1, -2]], 2), ValueError, r"ids: token id must be >= 0, got -2"),
    (lambda m: m(torch.tensor([[1, 64]])), ValueError, r"ids must lie in the vocabulary 0..63, got values in 1..64"),
    (lambda m: m(torch.tensor([[1.0, 2.0]])), TypeError, r"ids must be an integer tensor"),
    (lambda m: generate(m, [1, 2, 3], 2), TypeError, r"ids must be a \(B, T\) tensor or a list of token-id lists"),
    (lambda m: generate(m, [[1], [2], [3]], 2, cache=KVCache.for_model(m, 2, 16)), ValueError,
     r"the cache holds batch=2 sequence\(s\), got 3 prompt\(s\)"),
    (lambda m: generate(m, [[1, 2, 3]], 10, cache=KVCache.for_model(m, 1, 8)), CacheFullError,
     r"the cache holds 8 positions per sequence; this call needs 12"),
    (lambda m: generate(m, [list(range(1, 14))], 2, cache=PagedKVCache.for_model(m, 3, 4)), OutOfBlocksError,
     r"a sequence of 14 positions needs 4 blocks of 4; the pool has 3"),
    (lambda m: generate(m, [[1]], 2, cache=object()), TypeError, r"cache must be 'contiguous', 'paged', 'int8' or a cache object"),
]


@pytest.mark.parametrize("make, exc, match", GENERATE_MISUSE, ids=[str(i) for i in range(len(GENERATE_MISUSE))])
def test_generation_refuses_what_the_model_or_the_cache_cannot_take(model, make, exc, match):
    with pytest.raises(exc, match=match):
        make(model)


def test_the_tiny_models_context_is_enforced():
    from kvlib.model import load_tiny

    tiny, tok = load_tiny(device="cpu")
    assert tiny.config.max_seq_len == 1024
    with pytest.raises(ValueError, match=r"1170 tokens.*context of 1024"):
        generate(tiny, [[65] * 1170], 1)


# ---- 12. a cache reused across generate calls ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["contiguous", "paged", "int8"])
def test_a_reused_cache_gives_the_same_tokens_as_a_fresh_one(model, kind):
    prompts, other = [[1, 2, 3, 4, 5], [6, 7]], [[9, 8, 7], [6, 5, 4, 3, 2, 1]]
    cache = {"contiguous": lambda: KVCache.for_model(model, 2, 24),
             "paged": lambda: PagedKVCache.for_model(model, 12, 4),
             "int8": lambda: Int8KVCache.for_model(model, 2, 24)}[kind]()
    first = generate(model, prompts, 8, cache=cache)
    assert torch.equal(generate(model, other, 8, cache=cache), generate(model, other, 8, cache=kind))
    assert torch.equal(generate(model, prompts, 8, cache=cache), first)


def test_a_generation_that_runs_out_of_blocks_leaves_the_cache_empty_and_a_retry_works(model):
    cache = PagedKVCache.for_model(model, num_blocks=4, block_size=4)
    with pytest.raises(OutOfBlocksError):  # each prompt fits alone; the second runs the pool dry
        generate(model, [list(range(1, 11)), list(range(11, 21))], 2, cache=cache)
    assert cache.tables == {} and cache.allocator.num_free == 4
    out = generate(model, [list(range(1, 11))], 2, cache=cache)  # no "sequence 0 already exists"
    assert torch.equal(out, generate_naive(model, [list(range(1, 11))], 2))


# ---- 13. pieces that compose: quantize_int8 output straight into the int8 kernels ------------------------


def test_quantize_int8_scales_go_straight_into_the_int8_kernels():
    k, v, q = rand(1, H_KV, S, D, seed=2), rand(1, H_KV, S, D, seed=3), rand(1, H, D, seed=1)
    (kq, ks), (vq, vs) = quantize_int8(k, dim=-1), quantize_int8(v, dim=-1)
    assert ks.shape == (1, H_KV, S, 1)
    lens = ints(S)
    out = int8_decode_attention(q, kq, ks, vq, vs, lens)
    torch.testing.assert_close(out, int8_decode_attention_ref(q, kq, ks[..., 0], vq, vs[..., 0], lens), atol=1e-5, rtol=1e-5)
    assert (out - decode_attention_ref(q, k, v, lens)).abs().max() < 0.05
    cq, cs = torch.zeros(1, H_KV, S, D, dtype=torch.int8, device=DEV), torch.ones(1, H_KV, S, 1, device=DEV)
    store_kv_int8(cq, cs, cq.clone(), cs.clone(), k, v, ints(0))
    assert torch.equal(cq, kq) and torch.allclose(cs, ks)


# ---- 14. checkpoints that cannot be loaded: the error names the file, the id or the key --------------------


@pytest.fixture
def checkpoint(tmp_path):
    save_hf(Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, hidden_dim=64)), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _offline_hub(monkeypatch):
    def snapshot_download(repo_id, **kw):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))


CHECKPOINT_MISUSE = [
    (lambda f, mp: (f / "config.json").write_text("{\"vocab_size\": 16,"), r"config\.json: not valid JSON"),
    (lambda f, mp: (f / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": garbage"),
     r"model\.safetensors: not a readable safetensors file"),
    (lambda f, mp: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-100]),
     r"model\.safetensors"),
    (lambda f, mp: _edit_config(f, architectures=["FalconForCausalLM"]), r"architectures \['FalconForCausalLM'\] is not a Llama-family"),
    (lambda f, mp: _edit_config(f, model_type="falcon"), r"model_type 'falcon' is not a Llama-family"),
]


@pytest.mark.parametrize("damage, match", CHECKPOINT_MISUSE, ids=["json", "header", "truncated", "architecture", "model_type"])
def test_a_damaged_checkpoint_is_a_checkpoint_error_naming_the_file(checkpoint, monkeypatch, damage, match):
    damage(checkpoint, monkeypatch)
    with pytest.raises(CheckpointError, match=match):
        load_hf(checkpoint)


@pytest.mark.parametrize("path, match", [
    ("owner/some-model", r"'owner/some-model' is not a local folder .*downloading it from the Hugging Face hub failed: "
                         r"OSError: We couldn't connect"),
    ("tests/no-such-folder", r"tests/no-such-folder: no such folder"),  # tests/ exists: a local path, not a hub id
])
def test_a_path_that_is_not_there_names_the_path_or_the_hub_id(monkeypatch, path, match):
    _offline_hub(monkeypatch)
    with pytest.raises(CheckpointError, match=match):
        load_hf(path)
