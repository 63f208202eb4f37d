"""Quest's query-aware block selection (chapter 11): summaries, the bound, the selection, the kernel, the cache."""

import math

import pytest
import torch

from kvlib import runtime
from kvlib.cache import KVCache, decode_attention_ref
from kvlib.generate import generate
from kvlib.model import ModelConfig, Transformer
from kvlib.sparse import (QuestCache, block_summaries, block_upper_bound, select_blocks, sparse_decode_attention,
                          sparse_decode_attention_ref, update_block_summaries)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def rand(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


# ---- summaries and the bound ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_summaries_are_min_max_over_filled_rows(dtype):
    g = torch.Generator().manual_seed(0)
    B, H_KV, S, D, bs = 2, 3, 37, 8, 16
    k = rand(B, H_KV, S, D, g=g, dtype=DTYPES[dtype])
    lens = torch.tensor([37, 20])
    kmin, kmax = block_summaries(k, lens, bs)
    assert kmin.shape == (B, H_KV, 3, D) and kmin.dtype == k.dtype
    for b in range(B):
        for j in range(-(-int(lens[b]) // bs)):
            rows = k[b, :, j * bs: min(int(lens[b]), (j + 1) * bs)]  # (H_KV, filled, D)
            assert torch.equal(kmin[b, :, j], rows.amin(1)) and torch.equal(kmax[b, :, j], rows.amax(1))
    assert torch.equal(kmax[1, :, 1], k[1, :, 16:20].amax(1))  # partly filled: rows 20.. of k[1] not seen


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_incremental_update_equals_summaries_from_scratch(dtype):
    g = torch.Generator().manual_seed(1)
    B, H_KV, S, D, bs = 2, 2, 75, 4, 16
    k = rand(B, H_KV, S, D, g=g, dtype=DTYPES[dtype])
    kmin = torch.full((B, H_KV, 5, D), 7.0, dtype=k.dtype)  # stale values must not leak into new blocks
    kmax = kmin.clone()
    start = 0
    for T in (5, 1, 1, 13, 16, 1, 30):  # calls that start, cross and end mid-block
        update_block_summaries(kmin, kmax, k[:, :, start: start + T], torch.tensor([start] * B), bs)
        start += T
        ref_min, ref_max = block_summaries(k, torch.tensor([start] * B), bs)
        used = -(-start // bs)
        assert torch.equal(kmin[:, :, :used], ref_min[:, :, :used]), T
        assert torch.equal(kmax[:, :, :used], ref_max[:, :, :used]), T


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("seed", range(4))
def test_bound_is_at_least_every_score_of_its_block(dtype, seed):
    """The property the method rests on, on random data: max over a block's keys of q . k <= the bound,
    computed as the same fp32 sum over D (so rounding cannot reorder them)."""
    g = torch.Generator().manual_seed(seed)
    B, H, H_KV, S, D, bs = 2, 4, 2, 53, 16, 8
    q = rand(B, H, D, g=g, dtype=DTYPES[dtype]) * 3
    k = rand(B, H_KV, S, D, g=g, dtype=DTYPES[dtype]) * 3
    lens = torch.tensor([53, 30])
    kmin, kmax = block_summaries(k, lens, bs)
    bound = block_upper_bound(q, kmin, kmax)  # (B, H, n_blocks)
    scores = (q.float()[:, :, None] * k.float().repeat_interleave(H // H_KV, 1)).sum(-1)  # (B, H, S)
    for b in range(B):
        for j in range(-(-int(lens[b]) // bs)):
            true_max = scores[b, :, j * bs: min(int(lens[b]), (j + 1) * bs)].amax(-1)
            assert (bound[b, :, j] >= true_max).all(), (b, j)
    naive = (q.float()[:, :, None] * kmax.float().repeat_interleave(H // H_KV, 1)).sum(-1)  # q . kmax: no bound
    assert (naive[:, :, :4] < scores[:, :, :32].view(B, H, 4, 8).amax(-1)).any()  # (negative q_i need kmin_i)
    # a block holding one key: the bound is that key's score exactly (it is tight)
    one = block_summaries(k[:, :, :1], torch.tensor([1, 1]), bs)
    assert torch.allclose(block_upper_bound(q, *one)[:, :, 0], scores[:, :, 0], atol=1e-4)


def test_bound_of_several_queries_matches_one_at_a_time():
    g = torch.Generator().manual_seed(2)
    q, k = rand(1, 4, 5, 8, g=g), rand(1, 2, 40, 8, g=g)
    kmin, kmax = block_summaries(k, torch.tensor([40]), 16)
    many = block_upper_bound(q, kmin, kmax)  # (B, H, T, N)
    assert torch.equal(many[:, :, 3], block_upper_bound(q[:, :, 3], kmin, kmax))


# ---- the selection --------------------------------------------------------------------------------


def test_selection_keeps_the_current_block_and_the_best_earlier_ones():
    g = torch.Generator().manual_seed(3)
    B, H, N, bs = 2, 3, 9, 4
    bound = torch.randn(B, H, N, generator=g)
    lens = torch.tensor([33, 14])  # sequence 0: 9 blocks (the last holds 1 row); sequence 1: 4 blocks
    sel = select_blocks(bound, lens, bs, n_select=3)
    assert sel.shape == (B, H, 3) and sel.dtype == torch.int64
    for b, (L, n_used) in enumerate(((33, 9), (14, 4))):
        for h in range(H):
            want = set(bound[b, h, : n_used - 1].topk(2).indices.tolist()) | {n_used - 1}
            assert sel[b, h].tolist() == sorted(want), (b, h)
    assert not torch.equal(sel[0, 0], sel[0, 1]) or not torch.equal(sel[0, 1], sel[0, 2])  # heads choose apart


def test_selection_of_every_block_and_padding():
    bound = torch.zeros(2, 1, 5)
    sel = select_blocks(bound, torch.tensor([17, 6]), 4, n_select=10)  # 5 blocks, 2 blocks
    assert sel.tolist() == [[[0, 1, 2, 3, 4]], [[0, 1, -1, -1, -1]]]
    assert select_blocks(bound, torch.tensor([17, 6]), 4, n_select=1).tolist() == [[[4]], [[1]]]  # b = 1: current


def test_selection_per_query_is_causal():
    bound = torch.arange(6.0).expand(1, 1, 3, 6).contiguous()  # later blocks score higher
    sel = select_blocks(bound, torch.tensor([[9, 13, 24]]), 4, n_select=2)  # queries at positions 8, 12, 23
    assert sel.tolist() == [[[[1, 2], [2, 3], [4, 5]]]]  # never a block after the query's own


@pytest.mark.parametrize("bad, match", [
    (dict(n_select=0), "n_select must be >= 1"),
    (dict(lengths=torch.tensor([30])), "lengths must lie in 1..20"),
    (dict(lengths=torch.tensor([0])), "lengths must lie"),
    (dict(lengths=torch.tensor([[3]])), "lengths must be an integer tensor of shape"),
    (dict(bound=torch.zeros(1, 1, 5, dtype=torch.int64)), "bound must be a floating-point"),
])
def test_selection_refuses_bad_input(bad, match):
    args = dict(bound=torch.zeros(1, 1, 5), lengths=torch.tensor([7]), block_size=4, n_select=2) | bad
    with pytest.raises(ValueError, match=match):
        select_blocks(**args)


# ---- attention over the selected blocks -----------------------------------------------------------


def _case(B, H, H_KV, S, D, bs, dtype, seed, lens):
    g = torch.Generator().manual_seed(seed)
    q = rand(B, H, D, g=g, dtype=dtype)
    k, v = rand(B, H_KV, S, D, g=g, dtype=dtype), rand(B, H_KV, S, D, g=g, dtype=dtype)
    lens = torch.tensor(lens)
    return q, k, v, lens


def _paged(k, v, bs, lens, seed=0):
    """The same K/V in chapter 05's pools: every sequence's blocks at shuffled physical ids."""
    B, H_KV, S, D = k.shape
    n = -(-S // bs)
    perm = torch.randperm(B * n, generator=torch.Generator().manual_seed(seed)).view(B, n)
    pools = []
    for c in (k, v):
        pool = torch.zeros(B * n, bs, H_KV, D, dtype=c.dtype)
        padded = torch.cat([c, c.new_zeros(B, H_KV, n * bs - S, D)], 2)  # (B, H_KV, n*bs, D)
        pool[perm.flatten()] = padded.view(B, H_KV, n, bs, D).permute(0, 2, 3, 1, 4).reshape(B * n, bs, H_KV, D)
        pools.append(pool)
    return pools[0], pools[1], perm.int()


def test_every_block_selected_is_full_attention_exactly():
    q, k, v, lens = _case(2, 4, 2, 45, 16, 16, torch.float32, 4, [45, 17])
    sel = select_blocks(torch.zeros(2, 4, 3), lens, 16, n_select=3)  # all 3 (resp. 2) blocks
    full = decode_attention_ref(q, k, v, lens)
    assert torch.equal(sparse_decode_attention_ref(q, k, v, sel, lens, block_size=16), full)
    out = sparse_decode_attention(q, k, v, sel, lens, block_size=16)
    assert torch.allclose(out, full, atol=1e-5)


def test_reference_attends_only_the_selected_positions():
    q, k, v, lens = _case(1, 2, 1, 40, 8, 16, torch.float32, 5, [40])
    sel = torch.tensor([[[0, 2], [1, -1]]])  # head 0: positions 0..15 and 32..39; head 1: 16..31
    out = sparse_decode_attention_ref(q, k, v, sel, lens, block_size=16)
    for h, pos in ((0, list(range(16)) + list(range(32, 40))), (1, list(range(16, 32)))):
        p = torch.softmax(k[0, 0, pos] @ q[0, h] / math.sqrt(8), -1)
        assert torch.allclose(out[0, h], p @ v[0, 0, pos], atol=1e-6)


KERNEL_CASES = [  # (B, H, H_KV, S, D, block_size, lengths): S never a power of two, last blocks partly filled
    (2, 2, 2, 77, 16, 16, [77, 33]),
    (2, 4, 2, 70, 32, 32, [70, 5]),
    (1, 4, 1, 100, 16, 16, [99]),
    (2, 8, 1, 50, 16, 32, [50, 41]),
    (1, 8, 8, 45, 24, 16, [45]),  # D not a power of two
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[1]}/{c[2]} S={c[3]} bs={c[5]}")
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("n_select", [1, 2, 100])  # b = 1 (the current block only), 2, every block
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_kernel_matches_reference(case, dtype, n_select, layout):
    B, H, H_KV, S, D, bs, lens = case
    q, k, v, lens = _case(B, H, H_KV, S, D, bs, DTYPES[dtype], 6, lens)
    kmin, kmax = block_summaries(k, lens, bs)
    sel = select_blocks(block_upper_bound(q, kmin, kmax), lens, bs, n_select)
    if layout == "paged":
        k, v, tables = _paged(k, v, bs, lens)
        args = dict(block_tables=tables)
    else:
        args = dict(block_size=bs)
    ref = sparse_decode_attention_ref(q, k, v, sel, lens, **args)
    dev = runtime.DEVICE
    args = {n: t.to(dev) if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    out = sparse_decode_attention(q.to(dev), k.to(dev), v.to(dev), sel.to(dev), lens.to(dev), **args)
    tol = 1e-5 if dtype == "fp32" else 2e-3
    assert out.dtype == q.dtype and torch.allclose(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


def test_paged_and_contiguous_layouts_agree():
    q, k, v, lens = _case(2, 4, 2, 61, 16, 16, torch.float32, 7, [61, 30])
    sel = select_blocks(block_upper_bound(q, *block_summaries(k, lens, 16)), lens, 16, 2)
    kp, vp, tables = _paged(k, v, 16, lens)
    assert torch.equal(sparse_decode_attention_ref(q, kp, vp, sel, lens, block_tables=tables),
                       sparse_decode_attention_ref(q, k, v, sel, lens, block_size=16))


def sel_of(rows0, rows1):
    """A (2, 4, 2) selection: every head of sequence 0 picks rows0, every head of sequence 1 rows1."""
    return torch.tensor([rows0] * 4 + [rows1] * 4).view(2, 4, 2)


def _bad_inputs():
    q, k, v, lens = _case(2, 4, 2, 40, 8, 16, torch.float32, 8, [40, 20])
    sel = sel_of([0, 2], [0, 1])
    return dict(q=q, k_cache=k, v_cache=v, selection=sel, seq_lens=lens, block_size=16)


@pytest.mark.parametrize("change, error, match", [
    (dict(selection=sel_of([0, 3], [0, 1])), ValueError, r"selection\[0\] names a block past"),
    (dict(selection=sel_of([0, 2], [0, 2])), ValueError, r"selection\[1\] names a block past"),
    (dict(selection=sel_of([2, 0], [0, 1])), ValueError, "ascending"),
    (dict(selection=sel_of([1, 1], [0, 1])), ValueError, "ascending"),
    (dict(selection=sel_of([-1, 1], [0, 1])), ValueError, "ascending"),
    (dict(selection=sel_of([-1, -1], [0, 1])), ValueError, "at least one block"),
    (dict(selection=sel_of([-2, 1], [0, 1])), ValueError, "below -1"),
    (dict(selection=torch.zeros(2, 3, 2, dtype=torch.int64)), ValueError, r"selection must be a \(B=2, H=4"),
    (dict(selection=torch.zeros(2, 4, 2)), ValueError, "int32/int64"),
    (dict(selection=[[0]]), TypeError, "selection must be a torch.Tensor"),
    (dict(block_size=None), ValueError, "block_size is needed"),
    (dict(block_size=0), ValueError, "block_size must be >= 1"),
    (dict(q=torch.zeros(2, 4, 8, dtype=torch.float16)), ValueError, "must be torch.float16"),
    (dict(q=torch.zeros(2, 3, 8)), ValueError, "must divide q's H=3"),
    (dict(seq_lens=torch.tensor([41, 20])), ValueError, "seq_lens must lie in 1..S_max=40"),
    (dict(k_cache=torch.zeros(2, 2, 40, 4)), ValueError, "v_cache must have k_cache's shape"),
])
@pytest.mark.parametrize("fn", [sparse_decode_attention, sparse_decode_attention_ref])
def test_bad_input_is_refused_clearly(fn, change, error, match):
    with pytest.raises(error, match=match):
        fn(**(_bad_inputs() | change))


def test_bad_paged_input_is_refused_clearly():
    a = _bad_inputs()
    kp, vp, tables = _paged(a["k_cache"], a["v_cache"], 16, a["seq_lens"])
    with pytest.raises(ValueError, match="differs from the pools' block size 16"):
        sparse_decode_attention(a["q"], kp, vp, a["selection"], a["seq_lens"], block_size=32, block_tables=tables)
    with pytest.raises(ValueError, match="points outside the pool"):
        sparse_decode_attention(a["q"], kp, vp, a["selection"], a["seq_lens"], block_tables=tables * 0 - 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mixed_devices_are_refused():
    a = _bad_inputs()
    with pytest.raises(ValueError, match="one device"):
        sparse_decode_attention(**(a | dict(k_cache=a["k_cache"].cuda())))


def test_mixed_devices_are_refused_on_meta():
    a = _bad_inputs()
    with pytest.raises(ValueError, match="device"):
        sparse_decode_attention_ref(**(a | dict(selection=a["selection"].to("meta"))))


# ---- the cache --------------------------------------------------------------------------------


def gqa_model(seed=0, n_layers=3):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                       hidden_dim=128)).eval()


PROMPT = [list(range(3, 40))]  # 37 tokens: 4 blocks of 8 + 5


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_quest_with_every_block_generates_like_the_full_cache(kernels):
    model = gqa_model()
    full = generate(model, PROMPT, 12, cache=KVCache.for_model(model, 1, 64))
    quest = QuestCache.for_model(model, 1, 64, kernels=kernels, block_size=8, n_select=8, dense_layers=0)
    assert torch.equal(generate(model, PROMPT, 12, cache=quest), full)
    assert quest.read_fraction(0) > 1  # every row, and the summaries on top


def test_quest_reads_only_its_budget_and_keeps_everything():
    model = gqa_model()
    cache = QuestCache.for_model(model, 1, 64, block_size=8, token_budget=16, dense_layers=1)
    generate(model, PROMPT, 12, cache=cache)
    assert cache.held(0) == 48 and int(cache.read_steps[0]) == 11  # nothing evicted; 11 decode steps
    n_layers, row = 3, 2 * 2 * 16 * 4  # K and V of one position: 2 K/V heads x D=16 x fp32
    assert cache.bytes_kept(0) == n_layers * (48 + 6) * row  # 48 rows + 6 blocks' (kmin, kmax)
    # per step: layer 0 dense (L rows); layers 1-2 read at most 2 blocks per query head, at least the
    # current block and one full one per K/V head, plus the summaries of the blocks before the current one
    lens = range(38, 49)
    full = sum(n_layers * L * row for L in lens)
    assert int(cache.full_bytes[0]) == full
    least = sum(L * row + 2 * ((L - 1) % 8 + 1 + 8 + (L - 1) // 8) * row for L in lens)
    most = sum(L * row + 2 * ((L - 1) % 8 + 1 + 2 * 8 + (L - 1) // 8) * row for L in lens)  # heads pick apart
    assert least <= int(cache.read_bytes[0]) <= most
    assert cache.bytes_read_per_step(0) == pytest.approx(float(cache.read_bytes[0]) / 11)


def test_prefill_and_dense_layers_are_dense():
    model = gqa_model()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want = model(ids, cache=KVCache.for_model(model, 1, 64))
        got = model(ids, cache=QuestCache.for_model(model, 1, 64, block_size=8, n_select=1, dense_layers=0))
        assert torch.equal(got, want)  # the prefill attends densely whatever the budget
        step = torch.tensor([[5]])
        caches = [KVCache.for_model(model, 1, 64),
                  QuestCache.for_model(model, 1, 64, block_size=8, n_select=1, dense_layers=3),
                  QuestCache.for_model(model, 1, 64, block_size=8, n_select=1, dense_layers=0)]
        outs = []
        for c in caches:
            model(ids, cache=c)
            outs.append(model(step, positions=c.next_positions(), cache=c))
    assert torch.allclose(outs[1], outs[0], atol=1e-5)  # every layer dense: the full cache
    assert not torch.allclose(outs[2], outs[0], atol=1e-3)  # one block per head: a different answer


@pytest.mark.parametrize("dense", [False, True])
def test_a_multi_token_call_selects_per_query_like_single_steps(dense):
    """After the prefill, T tokens in one call = T decode steps (each query picks its own blocks among
    those before it); with dense_multi_token, Quest's rule, the call is the full cache's."""
    model = gqa_model()
    ids, more = torch.tensor(PROMPT), torch.tensor([[7, 9, 11, 13, 2, 4, 6, 8, 10, 12, 1]])
    kw = dict(block_size=8, n_select=2, dense_layers=0, dense_multi_token=dense)
    with torch.no_grad():
        one = QuestCache.for_model(model, 1, 64, **kw)
        model(ids, cache=one)
        together = model(more, positions=torch.arange(37, 48)[None], cache=one)
        two = QuestCache.for_model(model, 1, 64, **kw) if not dense else KVCache.for_model(model, 1, 64)
        model(ids, cache=two)
        steps = torch.cat([model(more[:, t:t + 1], positions=two.next_positions(), cache=two) for t in range(11)], 1)
    assert torch.allclose(together, steps, atol=1e-5)
    assert int(one.read_steps[0]) == 11
    if not dense:
        assert torch.equal(one.read_bytes, two.read_bytes) and torch.equal(one.full_bytes, two.full_bytes)


def test_batch_and_sequence_views_share_counters():
    model = gqa_model()
    cache = QuestCache.for_model(model, 2, 64, block_size=8, n_select=2, dense_layers=0)
    out = generate(model, [list(range(3, 40)), list(range(5, 20))], 6, cache=cache)
    alone = generate(model, [list(range(5, 20))], 6,
                     cache=QuestCache.for_model(model, 1, 64, block_size=8, n_select=2, dense_layers=0))
    assert torch.equal(out[1], alone[0])  # ragged batch: each sequence selects on its own
    assert cache.read_steps.tolist() == [5, 5] and cache.held(0) == 42 and cache.held(1) == 20
    assert cache.nbytes() == sum(t.nbytes for t in cache.k + cache.v + cache.kmin + cache.kmax)


@pytest.mark.parametrize("options, match", [
    (dict(), "exactly one of n_select"),
    (dict(n_select=2, token_budget=32), "exactly one of n_select"),
    (dict(token_budget=4), "token_budget must be at least one block"),
    (dict(n_select=0), "n_select must be >= 1"),
    (dict(n_select=2, dense_layers=-1), "dense_layers must be >= 0"),
])
def test_cache_refuses_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        QuestCache.for_model(gqa_model(), 1, 64, block_size=8, **options)


def test_cache_full_is_refused_and_leaves_the_cache_intact():
    from kvlib.cache import CacheFullError
    model = gqa_model()
    cache = QuestCache.for_model(model, 1, 40, block_size=8, n_select=2)
    with torch.no_grad():
        model(torch.tensor(PROMPT), cache=cache)
        kmax = [t.clone() for t in cache.kmax]
        with pytest.raises(CacheFullError):
            model(torch.tensor([[1, 2, 3, 4]]), positions=torch.arange(37, 41)[None], cache=cache)
    assert cache.held(0) == 37 and all(torch.equal(a, b) for a, b in zip(kmax, cache.kmax))


def test_bf16_and_wrong_dtypes():
    q, k, v, lens = _case(2, 4, 2, 40, 16, 16, torch.bfloat16, 9, [40, 20])
    sel = select_blocks(block_upper_bound(q, *block_summaries(k, lens, 16)), lens, 16, 2)
    ref = sparse_decode_attention_ref(q, k, v, sel, lens, block_size=16)
    assert torch.allclose(sparse_decode_attention(q, k, v, sel, lens, block_size=16).float(), ref.float(), atol=2e-2)
    with pytest.raises(TypeError, match="q must be a floating-point tensor"):
        sparse_decode_attention(q.long(), k, v, sel, lens, block_size=16)
    with pytest.raises(ValueError, match="k_cache and v_cache must be torch.bfloat16"):
        sparse_decode_attention(q, k.float(), v.float(), sel, lens, block_size=16)


def test_truncate_leaves_the_cache_a_cache_that_never_saw_the_cut_tokens():
    """Random accept/reject rounds (k drafted tokens in one call, keep a random prefix): K/V rows, lengths and
    summaries equal a cache fed only the accepted tokens, and a decode step reads the same blocks."""
    g = torch.Generator().manual_seed(11)
    kw = dict(block_size=4, n_select=2, dense_layers=0, kernels="torch")
    spec, plain = QuestCache(2, 1, 2, 64, 8, **kw), QuestCache(2, 1, 2, 64, 8, **kw)
    rows = lambda T: [torch.randn(1, 2, T, 8, generator=g) for _ in range(2)]  # noqa: E731

    def feed(cache, k, v):
        for layer in range(2):
            cache.attend(layer, torch.cat([k, k], 1), k, v)  # H = 4 query heads over H_KV = 2

    k, v = rows(7)
    feed(spec, k, v)
    feed(plain, k, v)
    for _ in range(6):
        T = int(torch.randint(2, 6, (1,), generator=g))
        k, v = rows(T)
        n = spec.held(0)
        feed(spec, k, v)
        keep = int(torch.randint(0, T + 1, (1,), generator=g))
        assert spec.truncate(0, n + keep)
        if keep:
            feed(plain, k[:, :, :keep], v[:, :, :keep])
        L = plain.held(0)
        assert spec.held(0) == L
        for layer in range(2):
            assert torch.equal(spec.k[layer][:, :, :L], plain.k[layer][:, :, :L])
            assert torch.equal(spec.kmin[layer], plain.kmin[layer]) and torch.equal(spec.kmax[layer], plain.kmax[layer])
    q, k, v = rows(1)[0].repeat(1, 2, 1, 1), *rows(1)
    for layer in range(2):
        assert torch.equal(spec.attend(layer, q, k, v), plain.attend(layer, q, k, v))
