"""The paged KV cache (chapter 05): K/V in fixed-size blocks, found through a block table.

What you will learn:
- why preallocating max-length rows wastes memory, and how paging (as in an operating system's
  virtual memory) fixes it: a sequence's cache is a list of *blocks* of ``block_size`` positions,
  taken from one shared pool only when needed;
- ``BlockAllocator``: hands out block ids, keeps a reference count per block, and refuses clearly
  (changing nothing) when the pool is empty;
- ``PagedKVCache``: per layer a pool of shape (num_blocks, block_size, H_KV, D); per sequence a
  *block table* (logical block i -> physical block id); the *slot mapping* of a new token is
  ``block_id * block_size + offset``. Sequences can be forked (parallel sampling shares the
  prompt's blocks) and freed; writing into a shared block copies it first (copy-on-write);
- prefix caching: full blocks are identified by a hash of their tokens chained with the hash of
  the block before, so identical prompt prefixes share blocks and skip their prefill;
- ``paged_decode_attention``: chapter 03's decode kernel with one change — a position's K/V are
  found through the block table (``_decode_kernel`` with ``PAGED=True``).

Shapes: q (B, H, D); k_blocks, v_blocks (num_blocks, block_size, H_KV, D); block_tables
(B, max_blocks) int32, -1 where unused; seq_lens (B,).
"""

from __future__ import annotations

import math

import torch

from . import runtime
from ._triton import tl, triton
from .attention import attention_ref, flash_attention
from .cache import launch_decode, pick_kernels

__all__ = ["BlockAllocator", "OutOfBlocksError", "PagedKVCache", "paged_decode_attention",
           "paged_decode_attention_ref", "store_paged", "store_paged_ref"]


class OutOfBlocksError(RuntimeError):
    """The block pool cannot satisfy a request; nothing was allocated."""


class BlockAllocator:
    """A pool of ``num_blocks`` block ids with reference counts.

    ``allocate(n)`` hands out n free blocks (count 1 each) or raises ``OutOfBlocksError`` leaving
    the pool exactly as it was; ``share(block)`` adds a reference (a fork); ``free(block)`` drops one
    and returns the block to the pool when none are left.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids come out first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} block(s) but only {len(self._free)} of {self.num_blocks} are free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def _check(self, block: int):
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"unknown block {block!r}: ids are 0..{self.num_blocks - 1}")
        if self.refcount[block] == 0:
            raise ValueError(f"block {block} is free: it cannot be shared or freed")

    def share(self, block: int):
        self._check(block)
        self.refcount[block] += 1

    def free(self, block: int) -> bool:
        """Drop one reference; True when the block went back to the pool."""
        self._check(block)
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
            return True
        return False


# --------------------------------------------------------------------------------------------
# paged decode attention: reference and wrapper (the kernel is cache._decode_kernel, PAGED=True)
# --------------------------------------------------------------------------------------------


def _check_paged_args(q, k_blocks, v_blocks, block_tables, seq_lens):
    if not all(isinstance(t, torch.Tensor) for t in (q, k_blocks, v_blocks, block_tables, seq_lens)):
        raise TypeError("q, k_blocks, v_blocks, block_tables and seq_lens must be torch tensors")
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, D), got shape {tuple(q.shape)}")
    if k_blocks.dim() != 4 or v_blocks.shape != k_blocks.shape:
        raise ValueError(f"k_blocks and v_blocks must both be (num_blocks, block_size, H_KV, D), got "
                         f"{tuple(k_blocks.shape)} and {tuple(v_blocks.shape)}")
    B, H, D = q.shape
    num_blocks, block_size, H_KV, Dk = k_blocks.shape
    if Dk != D:
        raise ValueError(f"k_blocks must have head dim D={D} like q, got {tuple(k_blocks.shape)}")
    if H % H_KV:
        raise ValueError(f"k_blocks has H_KV={H_KV} heads, which must divide q's H={H} heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be a (B={B}, max_blocks) int32 tensor, got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if seq_lens.shape != (B,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be a (B={B},) int32/int64 tensor, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if not (q.dtype == k_blocks.dtype == v_blocks.dtype):
        raise ValueError(f"q, k_blocks, v_blocks must share one dtype, got {q.dtype}, {k_blocks.dtype}, {v_blocks.dtype}")
    if len({t.device for t in (q, k_blocks, v_blocks, block_tables, seq_lens)}) != 1:
        raise ValueError("q, k_blocks, v_blocks, block_tables and seq_lens must be on one device")
    # every block a sequence uses must be a real block; all checks read back in one host transfer
    blocks_used = (seq_lens.long() + block_size - 1) // block_size  # (B,)
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < blocks_used[:, None]
    outside = (used & ((block_tables < 0) | (block_tables >= num_blocks))).any(1)  # (B,)
    lo, hi, *bad = torch.cat([torch.stack([seq_lens.min(), seq_lens.max()]).long(), outside.long()]).tolist()
    if lo < 1 or hi > block_tables.shape[1] * block_size:
        raise ValueError(f"seq_lens must lie in 1..max_blocks*block_size={block_tables.shape[1] * block_size}, "
                         f"got values in {lo}..{hi}")
    if any(bad):
        b = bad.index(1)
        raise ValueError(f"block_tables[{b}] points outside the pool 0..{num_blocks - 1} "
                         f"within its first {int(seq_lens[b])} positions")
    return hi


def paged_decode_attention_ref(q, k_blocks, v_blocks, block_tables, seq_lens):
    """Gather each sequence's K/V through its block table, then attend (fp32)."""
    _check_paged_args(q, k_blocks, v_blocks, block_tables, seq_lens)
    B, H, D = q.shape
    block_size, H_KV = k_blocks.shape[1], k_blocks.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        L = int(seq_lens[b])
        pos = torch.arange(L, device=q.device)
        blocks = block_tables[b].long()[pos // block_size]  # (L,) physical block of each position
        k = k_blocks[blocks, pos % block_size].float()  # (L, H_KV, D)
        v = v_blocks[blocks, pos % block_size].float()
        k = k.transpose(0, 1).repeat_interleave(H // H_KV, 0)  # (H, L, D)
        v = v.transpose(0, 1).repeat_interleave(H // H_KV, 0)
        scores = (k @ q[b].float()[:, :, None])[..., 0] / math.sqrt(D)  # (H, L)
        out[b] = (torch.softmax(scores, -1)[:, None] @ v)[:, 0].to(q.dtype)
    return out


def paged_decode_attention(q, k_blocks, v_blocks, block_tables, seq_lens, num_splits=None):
    """Decode attention reading K/V through block tables; same result as the reference."""
    longest = _check_paged_args(q, k_blocks, v_blocks, block_tables, seq_lens)
    if k_blocks.stride(3) != 1 or v_blocks.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q, k_blocks and v_blocks must be contiguous along the head dim D (stride 1)")
    if not runtime.require_triton("paged.paged_decode_attention", q=q, k_blocks=k_blocks,
                                  v_blocks=v_blocks, block_tables=block_tables, seq_lens=seq_lens):
        return paged_decode_attention_ref(q, k_blocks, v_blocks, block_tables, seq_lens)
    block_size, H_KV = k_blocks.shape[1], k_blocks.shape[2]
    kv_strides = (k_blocks.stride(0), k_blocks.stride(2), k_blocks.stride(1),  # per block, per head, per slot
                  v_blocks.stride(0), v_blocks.stride(2), v_blocks.stride(1))
    return launch_decode(q, k_blocks, v_blocks, seq_lens, kv_strides, q.shape[1] // H_KV,
                         block_tables.shape[1] * block_size, num_splits, block_table=block_tables,
                         block_size=block_size, longest=longest)


# --------------------------------------------------------------------------------------------
# store through the slot mapping: reference, kernel, wrapper
# --------------------------------------------------------------------------------------------


def store_paged_ref(k_blocks, v_blocks, k_new, v_new, slots):
    """k_new/v_new (N, H_KV, D) -> pool rows ``slots`` (N,) where slot = block * block_size + offset."""
    bs = k_blocks.shape[1]
    k_blocks[slots // bs, slots % bs] = k_new
    v_blocks[slots // bs, slots % bs] = v_new


@triton.jit
def _store_paged_kernel(
    k_new_ptr, v_new_ptr,  # new rows (N, H_KV, D), contiguous
    k_pool_ptr, v_pool_ptr,  # pools (num_blocks, block_size, H_KV, D), contiguous
    slots_ptr,  # (N,) destination slot of each new row: block * block_size + offset
    HD,  # H_KV * D: elements per slot
    TILE: tl.constexpr,  # elements copied per step (a power of two)
):
    row = tl.program_id(0)  # one program per new token
    slot = tl.load(slots_ptr + row).to(tl.int64)
    for start in range(0, HD, TILE):
        offs = start + tl.arange(0, TILE)
        mask = offs < HD
        tl.store(k_pool_ptr + slot * HD + offs, tl.load(k_new_ptr + row * HD + offs, mask=mask), mask=mask)
        tl.store(v_pool_ptr + slot * HD + offs, tl.load(v_new_ptr + row * HD + offs, mask=mask), mask=mask)


def store_paged(k_blocks, v_blocks, k_new, v_new, slots):
    """Write N new K/V rows (N, H_KV, D) into the pools at ``slots`` (Triton kernel)."""
    num_blocks, bs, H_KV, D = k_blocks.shape
    if k_new.shape != v_new.shape or k_new.dim() != 3 or k_new.shape[1:] != (H_KV, D):
        raise ValueError(f"k_new/v_new must be (N, H_KV={H_KV}, D={D}), got {tuple(k_new.shape)}, {tuple(v_new.shape)}")
    if slots.shape != (k_new.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be a (N={k_new.shape[0]},) int tensor, got {tuple(slots.shape)} {slots.dtype}")
    lo, hi = torch.stack([slots.min(), slots.max()]).tolist() if len(slots) else (0, 0)  # one host read
    if lo < 0 or hi >= num_blocks * bs:
        raise ValueError(f"slots must lie in 0..{num_blocks * bs - 1}")
    if not (k_blocks.is_contiguous() and v_blocks.is_contiguous()):
        raise ValueError("k_blocks and v_blocks must be contiguous")
    if not runtime.require_triton("paged.store_paged", k_blocks=k_blocks, v_blocks=v_blocks, k_new=k_new,
                                  v_new=v_new, slots=slots):
        return store_paged_ref(k_blocks, v_blocks, k_new, v_new, slots)
    k_new, v_new = k_new.contiguous(), v_new.contiguous()
    HD = H_KV * D
    _store_paged_kernel[(k_new.shape[0],)](k_new, v_new, k_blocks, v_blocks, slots, HD,
                                           TILE=min(1024, triton.next_power_of_2(HD)))


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class PagedKVCache:
    """A block pool per layer plus, per sequence, a block table and a length.

    Sequences are named by any hashable id. Use with the model's seam through ``batch(seq_ids)``:
    a view whose ``attend`` writes the new tokens of those sequences (in that order) and attends.
    """

    def __init__(self, n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype=torch.float32,
                 device="cpu", kernels=None, prefix_caching=True):
        self.kernels, self.block_size, self.device = pick_kernels(kernels, device), block_size, device
        shape = (num_blocks, block_size, n_kv_heads, head_dim)  # (num_blocks, block_size, H_KV, D)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict = {}  # seq id -> list of physical block ids
        self.lens: dict = {}  # seq id -> positions filled
        self.tokens: dict = {}  # seq id -> token ids stored (for prefix hashing)
        self.prefix_caching = prefix_caching
        self.hash_to_block: dict = {}  # chained hash of a full block's tokens -> block id
        self.block_hash: dict = {}  # block id -> its hash (only full, registered blocks)

    @classmethod
    def for_model(cls, model, num_blocks, block_size, **kw):
        c = model.config
        return cls(c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, model.dtype, model.device, **kw)

    # ---- sequences ----------------------------------------------------------------------

    def add_sequence(self, seq_id, prompt_tokens=()) -> int:
        """Register a sequence; with prefix caching, reuse the full blocks of an identical prefix.

        Returns how many prompt positions are already cached (a multiple of block_size, and always
        less than the prompt's length, so the last prompt token is computed and gives logits).
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self.tables[seq_id], self.lens[seq_id], self.tokens[seq_id] = [], 0, []
        if not self.prefix_caching:
            return 0
        tokens, bs, parent = list(prompt_tokens), self.block_size, None
        for i in range((len(tokens) - 1) // bs):  # full blocks, leaving at least one token to compute
            h = hash((parent, tuple(tokens[i * bs: (i + 1) * bs])))
            block = self.hash_to_block.get(h)
            if block is None:
                break
            self.allocator.share(block)
            self.tables[seq_id].append(block)
            self.tokens[seq_id] += tokens[i * bs: (i + 1) * bs]
            self.lens[seq_id] += bs
            parent = h
        return self.lens[seq_id]

    def fork(self, parent, child):
        """``child`` starts as a copy of ``parent`` sharing all its blocks (copy-on-write later)."""
        if child in self.tables:
            raise ValueError(f"sequence {child!r} already exists")
        for block in self.tables[parent]:
            self.allocator.share(block)
        self.tables[child] = list(self.tables[parent])
        self.lens[child] = self.lens[parent]
        self.tokens[child] = list(self.tokens[parent])

    def free_sequence(self, seq_id):
        for block in self.tables.pop(seq_id):
            if self.allocator.free(block):
                h = self.block_hash.pop(block, None)
                if h is not None and self.hash_to_block.get(h) == block:
                    del self.hash_to_block[h]
        del self.lens[seq_id], self.tokens[seq_id]

    def blocks_needed(self, seq_id, n_new: int) -> int:
        """New blocks that appending n_new tokens takes, counting a copy-on-write of a shared last block."""
        L, bs, table = self.lens[seq_id], self.block_size, self.tables[seq_id]
        fresh = -(-(L + n_new) // bs) - len(table)
        cow = 1 if (L % bs and table and self.allocator.refcount[table[-1]] > 1) else 0
        return max(0, fresh) + cow

    def reserve(self, seq_ids, n_new: int, new_tokens=None) -> torch.Tensor:
        """Make room for n_new tokens per sequence; return their slots (len(seq_ids) * n_new,).

        All-or-nothing: if the pool cannot hold everything, ``OutOfBlocksError`` is raised and no
        table, length or reference count has changed.
        """
        need = sum(self.blocks_needed(s, n_new) for s in seq_ids)
        if need > self.allocator.num_free:
            raise OutOfBlocksError(f"appending {n_new} token(s) to {len(seq_ids)} sequence(s) needs {need} "
                                   f"block(s); {self.allocator.num_free} of {self.allocator.num_blocks} are free")
        bs, slots = self.block_size, []
        for i, s in enumerate(seq_ids):
            table, L = self.tables[s], self.lens[s]
            if L % bs and self.allocator.refcount[table[-1]] > 1:  # copy-on-write of a shared partial block
                (new,) = self.allocator.allocate(1)
                for pool in self.k + self.v:
                    pool[new] = pool[table[-1]]
                self.allocator.free(table[-1])
                table[-1] = new
            while len(table) * bs < L + n_new:
                table += self.allocator.allocate(1)
            slots += [table[p // bs] * bs + p % bs for p in range(L, L + n_new)]
            if new_tokens is not None:
                self.tokens[s] += list(new_tokens[i])
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def _register_full_blocks(self, seq_id):
        """Give every newly completed block of seq_id its chained hash (prefix caching)."""
        bs, toks, table = self.block_size, self.tokens[seq_id], self.tables[seq_id]
        if not self.prefix_caching or len(toks) != self.lens[seq_id]:
            return
        parent = None
        for i in range(self.lens[seq_id] // bs):
            h = hash((parent, tuple(toks[i * bs: (i + 1) * bs])))
            if table[i] not in self.block_hash:
                self.block_hash[table[i]] = h
                self.hash_to_block.setdefault(h, table[i])
            parent = h

    def block_table_tensor(self, seq_ids) -> torch.Tensor:
        width = max(len(self.tables[s]) for s in seq_ids)
        bt = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for i, s in enumerate(seq_ids):
            bt[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        return bt.to(self.device)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    # The three calls kvlib.generate.generate makes on any cache (sequence ids are 0..B-1 there):
    def prefill_view(self, b: int, prompt):
        cached = self.add_sequence(b, prompt)
        return self.batch([b], [list(prompt[cached:])]), cached

    def decode_view(self, tokens):
        return self.batch(list(range(len(tokens))), [[int(t)] for t in tokens])

    def next_positions(self) -> torch.Tensor:
        return torch.tensor([[self.lens[b]] for b in range(len(self.lens))], device=self.device)

    def batch(self, seq_ids, new_tokens=None) -> "_PagedBatch":
        """A view for one model call on ``seq_ids`` (its batch rows, in order); ``new_tokens``
        (list of token lists) lets prefix caching hash the blocks they fill."""
        return _PagedBatch(self, list(seq_ids), new_tokens)


class _PagedBatch:
    """The model's seam for a PagedKVCache: ``attend(layer_idx, q, k, v)`` for one forward call."""

    def __init__(self, cache: PagedKVCache, seq_ids, new_tokens):
        self.cache, self.seq_ids, self.new_tokens = cache, seq_ids, new_tokens
        self.slots = None

    def attend(self, layer_idx, q, k, v):
        c, B, T = self.cache, q.shape[0], q.shape[2]
        if B != len(self.seq_ids):
            raise ValueError(f"the batch has {B} rows but the view names {len(self.seq_ids)} sequences")
        if layer_idx == 0:  # blocks for the new tokens, once per forward call (all-or-nothing)
            self.start = torch.tensor([c.lens[s] for s in self.seq_ids], dtype=torch.int32, device=c.device)
            self.slots = c.reserve(self.seq_ids, T, self.new_tokens)
            self.tables = c.block_table_tensor(self.seq_ids)
        triton_kernels = c.kernels == "triton"
        k_rows = k.permute(0, 2, 1, 3).reshape(B * T, k.shape[1], k.shape[3])  # (B*T, H_KV, D)
        v_rows = v.permute(0, 2, 1, 3).reshape(B * T, v.shape[1], v.shape[3])
        (store_paged if triton_kernels else store_paged_ref)(c.k[layer_idx], c.v[layer_idx], k_rows, v_rows, self.slots)
        if T == 1:
            decode = paged_decode_attention if triton_kernels else paged_decode_attention_ref
            out = decode(q[:, :, 0], c.k[layer_idx], c.v[layer_idx], self.tables, self.start + 1)[:, :, None]
        else:  # prefill of one sequence: gather its positions, then causal attention
            if B != 1:
                raise ValueError("prefill (T > 1) runs one sequence at a time")
            L = int(self.start[0]) + T
            pos = torch.arange(L, device=q.device)
            blocks = self.tables[0].long()[pos // c.block_size]
            k_all = c.k[layer_idx][blocks, pos % c.block_size].permute(1, 0, 2)[None]  # (1, H_KV, L, D)
            v_all = c.v[layer_idx][blocks, pos % c.block_size].permute(1, 0, 2)[None]
            out = (flash_attention if triton_kernels else attention_ref)(q, k_all, v_all, causal=True)
        if layer_idx == len(c.k) - 1:
            for s in self.seq_ids:
                c.lens[s] += T
                c._register_full_blocks(s)
        return out


# How tests/test_compile.py builds the store kernel (the decode kernel is cache._decode_kernel).
COMPILE_SPECS = [
    dict(kernel=_store_paged_kernel,
         signature={"k_new_ptr": "*fp16", "v_new_ptr": "*fp16", "k_pool_ptr": "*fp16", "v_pool_ptr": "*fp16",
                    "slots_ptr": "*i64", "HD": "i32", "TILE": "constexpr"},
         constexprs={"TILE": 1024}),
]
