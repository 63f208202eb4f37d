"""Paged KV cache: the allocator, kernels against references, generation."""

import pytest
import torch

from kvlib import runtime
from kvlib.cache import decode_attention_ref
from kvlib.generate import generate, generate_naive
from kvlib.paged import (BlockAllocator, OutOfBlocksError, PagedKVCache, paged_decode_attention,
                         paged_decode_attention_ref, store_paged, store_paged_ref)

import _pools  # tests/_pools.py

# ---- the allocator ------------------------------------------------------------------------


def test_allocator_counts_and_refuses_cleanly():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and a.num_free == 1
    with pytest.raises(OutOfBlocksError, match="asked for 2 block.*only 1 of 4"):
        a.allocate(2)
    assert a.num_free == 1 and a.refcount == [1, 1, 1, 0]
    a.share(0)
    assert a.free(0) is False and a.free(0) is True and a.num_free == 2
    with pytest.raises(ValueError, match="block 0 is free"):
        a.free(0)
    with pytest.raises(ValueError, match="unknown block 9"):
        a.free(9)


# The property-based allocator machine lives in test_paged_machine.py (it needs hypothesis, a dev
# extra that scripts/gpu_check.sh does not require).


def test_full_pool_refuses_then_recovers():
    cache = PagedKVCache(1, num_blocks=3, block_size=4, n_kv_heads=1, head_dim=2, kernels="torch")
    cache.add_sequence("a")
    cache.reserve(["a"], 12)
    cache.lens["a"] = 12
    cache.add_sequence("b")
    with pytest.raises(OutOfBlocksError, match="needs 1 block.*0 of 3 are free"):
        cache.reserve(["b"], 1)
    cache.free_sequence("a")
    assert cache.allocator.num_free == 3
    assert len(cache.reserve(["b"], 5)) == 5


# ---- kernels ------------------------------------------------------------------------------


def scattered_pool(B, H_KV, D, lens, block_size, dtype, seed):
    """A pool whose blocks are handed out in a shuffled order, as after many allocations/frees."""
    k, v, tables, _ = _pools.scattered_pool(lens, block_size, H_KV, D, dtype, seed)
    return k.to(runtime.DEVICE), v.to(runtime.DEVICE), tables.to(runtime.DEVICE)


def contiguous_copy(k_blocks, tables, lens, S_max):
    B = tables.shape[0]
    bs, H_KV, D = k_blocks.shape[1:]
    out = torch.zeros(B, H_KV, S_max, D, dtype=k_blocks.dtype, device=k_blocks.device)
    for b, L in enumerate(lens):
        pos = torch.arange(L)
        out[b, :, :L] = k_blocks[tables[b].long().cpu()[pos // bs], pos % bs].transpose(0, 1)
    return out


# (block_size, H, H_KV, num_splits): block sizes below a tile (1, 2: one table entry per position, the
# slots' offsets fixed), not dividing it (5, 48), a multiple of it (64: one entry per tile); groups of 1, 2, 4, 8
PAGED_CASES = [(1, 4, 4, 1), (1, 8, 1, 4), (2, 8, 4, 2), (2, 8, 2, 1), (5, 4, 1, 4), (5, 8, 2, 2),
               (16, 8, 2, 4), (16, 8, 8, 1), (16, 16, 2, 2), (48, 8, 4, 2), (64, 8, 2, 1), (64, 8, 1, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size, H, H_KV, num_splits", PAGED_CASES)
def test_paged_decode_matches_contiguous_reference(dtype, block_size, H, H_KV, num_splits):
    B, D, lens = 3, 48, [1, 37, 130]  # ragged: one position, a partly filled last block; D not a power of two
    S_max = max(lens)
    k, v, tables = scattered_pool(B, H_KV, D, lens, block_size, dtype, seed=block_size)
    q = torch.randn(B, H, D, generator=torch.Generator().manual_seed(0)).to(dtype).to(runtime.DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=runtime.DEVICE)
    expected = decode_attention_ref(q, contiguous_copy(k, tables, lens, S_max), contiguous_copy(v, tables, lens, S_max),
                                    seq_lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    ref = paged_decode_attention_ref(q, k, v, tables, seq_lens)
    out = paged_decode_attention(q, k, v, tables, seq_lens, num_splits=num_splits)
    assert (ref.float() - expected.float()).abs().max() <= tol
    assert (out.float() - expected.float()).abs().max() <= tol


def test_paged_decode_reads_strided_pools():
    """Pools that are views (every other block of a larger pool, K and V with different strides) give the
    same answer: the kernel takes each pool's own block, slot and head strides."""
    B, H, H_KV, D, lens, bs = 2, 8, 2, 32, [50, 17], 16
    k, v, tables = scattered_pool(B, H_KV, D, lens, bs, torch.float32, seed=3)
    wide_k = torch.zeros(2 * k.shape[0], bs, H_KV, D, device=runtime.DEVICE)
    wide_k[::2] = k
    v_t = v.transpose(1, 2).contiguous().transpose(1, 2)  # (num_blocks, bs, H_KV, D) with slots not outermost
    q = torch.randn(B, H, D, generator=torch.Generator().manual_seed(1)).to(runtime.DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=runtime.DEVICE)
    out = paged_decode_attention(q, wide_k[::2], v_t, tables, seq_lens, num_splits=2)
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, tables, seq_lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H_KV, D, N", [(2, 8, 5), (4, 64, 37), (2, 600, 3)])  # one tile; 3 tiles, the last partial;
def test_store_paged_matches_reference(H_KV, D, N):  # rows longer than a step (H_KV * D = 1200 > 1024)
    g = torch.Generator().manual_seed(N)
    k = torch.zeros(12, 4, H_KV, D, device=runtime.DEVICE)
    v = torch.zeros_like(k)
    k2, v2 = k.clone(), v.clone()
    new_k = torch.randn(N, H_KV, D, generator=g).to(runtime.DEVICE)
    new_v = torch.randn(N, H_KV, D, generator=g).to(runtime.DEVICE)
    slots = torch.randperm(48, generator=g)[:N].to(runtime.DEVICE)
    store_paged(k, v, new_k, new_v, slots)
    store_paged_ref(k2, v2, new_k, new_v, slots)
    assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("bad, match", [
    (dict(tables=torch.tensor([[0, 99]], dtype=torch.int32)), "points outside the pool"),
    (dict(lens=[9]), r"seq_lens must lie in 1..max_blocks\*block_size=8"),
    (dict(tables=torch.tensor([[0, 1]], dtype=torch.float32)), "int32"),
])
def test_paged_decode_bad_input(bad, match):
    k = torch.zeros(4, 4, 1, 16)
    tables = bad.get("tables", torch.tensor([[0, 1]], dtype=torch.int32))
    lens = torch.tensor(bad.get("lens", [6]), dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(torch.zeros(1, 1, 16), k, k.clone(), tables, lens)


# ---- generation ---------------------------------------------------------------------------




@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_paged_generation_is_token_identical_to_naive(model_for, kernels):
    model = model_for(kernels)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [11]]
    for kw in (dict(), dict(temperature=0.9, top_k=20, seed=5)):
        assert torch.equal(generate_naive(model, prompts, 20, **kw),
                           generate(model, prompts, 20, cache="paged", kernels=kernels, **kw))


@torch.no_grad()
def test_forked_sequences_share_blocks_and_copy_on_write(model):
    prompt = list(range(1, 11))  # 10 tokens: two full blocks of 4 and a partial one
    cache = PagedKVCache.for_model(model, num_blocks=16, block_size=4, kernels="torch")
    cache.add_sequence("a", prompt)
    model(torch.tensor([prompt]), cache=cache.batch(["a"], [prompt]))
    cache.fork("a", "b")
    assert [cache.allocator.refcount[b] for b in cache.tables["a"]] == [2, 2, 2]
    # the two continue with different tokens: the shared partial block is copied first
    logits = model(torch.tensor([[30], [40]]), positions=torch.tensor([[10], [10]]),
                   cache=cache.batch(["a", "b"], [[30], [40]]))[:, -1]
    assert cache.tables["a"][:2] == cache.tables["b"][:2] and cache.tables["a"][2] != cache.tables["b"][2]
    for row, tok in ((0, 30), (1, 40)):
        naive = model(torch.tensor([prompt + [tok]]))[:, -1]
        torch.testing.assert_close(logits[row:row + 1], naive, atol=1e-5, rtol=1e-5)
    cache.free_sequence("a")
    cache.free_sequence("b")
    assert cache.allocator.num_free == 16


def test_sharers_growing_together_need_one_copy_less_than_there_are_sharers():
    """a and b share a partial last block (reference count 2): growing both in one call copies it once, since the
    second writer then holds it alone. One free block is enough, as it is one sequence at a time."""
    cache = PagedKVCache(1, num_blocks=4, block_size=4, n_kv_heads=1, head_dim=2, kernels="torch")
    cache.add_sequence("a", [1, 2, 3, 4, 5, 6])
    cache.reserve(["a"], 6)
    cache.lens["a"] = 6  # as after a forward
    cache.fork("a", "b")
    cache.allocator.allocate(1)  # leave one block free
    assert cache.allocator.num_free == 1
    slots = cache.reserve(["a", "b"], 1)
    assert len(slots) == 2 and cache.tables["a"][1] != cache.tables["b"][1] and cache.allocator.num_free == 0
    assert [cache.allocator.refcount[b] for b in (cache.tables["a"][1], cache.tables["b"][1])] == [1, 1]
    cache.fork("a", "c")  # a's last block now shared by a and c, and nothing is free: a refusal that changes nothing
    before = ({s: list(t) for s, t in cache.tables.items()}, cache.allocator.num_free)
    with pytest.raises(OutOfBlocksError):
        cache.reserve(["a", "c", "b"], 1)
    assert ({s: list(t) for s, t in cache.tables.items()}, cache.allocator.num_free) == before


@torch.no_grad()
@pytest.mark.parametrize("prompt_len", [8, 9, 13])  # ends on a block boundary, one past it, mid-block
def test_prefix_caching_reuses_full_blocks(model, prompt_len):
    prompt = [(7 * i) % 60 + 1 for i in range(prompt_len)]
    cache = PagedKVCache.for_model(model, num_blocks=16, block_size=4, kernels="torch")
    cache.add_sequence(0, prompt)
    model(torch.tensor([prompt]), cache=cache.batch([0], [prompt]))
    cached = cache.add_sequence(1, prompt)  # the same prompt again: a 100% prefix hit
    assert cached == 4 * ((prompt_len - 1) // 4)  # full blocks only, at least one token left to compute
    assert cache.tables[1] == cache.tables[0][: cached // 4]
    rest = prompt[cached:]
    logits = model(torch.tensor([rest]), positions=torch.arange(cached, prompt_len)[None],
                   cache=cache.batch([1], [rest]))[:, -1]
    torch.testing.assert_close(logits, model(torch.tensor([prompt]))[:, -1], atol=1e-5, rtol=1e-5)


def test_generation_with_a_shared_prompt_uses_fewer_blocks(model):
    prompt = list(range(1, 40))
    cache = PagedKVCache.for_model(model, num_blocks=64, block_size=8, kernels="torch")
    out = generate(model, [prompt, prompt], 5, cache=cache)
    assert torch.equal(out, generate_naive(model, [prompt, prompt], 5))
    shared = set(cache.tables[0]) & set(cache.tables[1])
    assert len(shared) == (len(prompt) - 1) // 8
