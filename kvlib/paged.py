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
- ``paged_decode_attention``: decode attention with one change — a position's K/V are found through
  the block table. It runs chapter 07's grouped kernel (``gqa._grouped_decode_kernel`` with
  ``PAGED=True``; one program per sequence and K/V head, for all the query heads that share it), where
  ``gqa._kv_offsets`` is the whole change; the block size is a compile-time constant there.

Shapes: q (B, H, D); k_blocks, v_blocks (num_blocks, block_size, H_KV, D); block_tables
(B, max_blocks) int32, -1 where unused; seq_lens (B,).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict

import torch

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .attention import attention_ref, flash_attention
from .cache import _DTYPES, _compile_inputs, check_attend_args, check_int, pick_kernels
from .gqa import DECODE_LOOPS, grouped_decode_launch
from .ragged import RaggedPlan, ragged_paged_attention, ragged_paged_attention_ref

__all__ = ["BlockAllocator", "OutOfBlocksError", "PagedKVCache", "RaggedBatch", "paged_decode_attention",
           "paged_decode_attention_ref", "paged_decode_minimal", "store_paged", "store_paged_ref", "block_digest"]


class OutOfBlocksError(RuntimeError):
    """The block pool cannot satisfy a request; nothing was allocated."""


class BlockAllocator:
    """A pool of ``num_blocks`` block ids with reference counts.

    ``allocate(n)`` hands out n free blocks (count 1 each) or raises ``OutOfBlocksError`` leaving
    the pool exactly as it was; ``share(block)`` adds a reference (a fork); ``free(block)`` drops one
    and returns the block to the pool when none are left.

    >>> a = BlockAllocator(4)
    >>> a.allocate(3)
    [0, 1, 2]
    >>> a.share(0); a.refcount
    [2, 1, 1, 0]
    >>> a.allocate(2)
    Traceback (most recent call last):
    ...
    kvlib.paged.OutOfBlocksError: asked for 2 block(s) but only 1 of 4 are free
    >>> a.free(1), a.num_free
    (True, 2)
    """

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids come out first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        """n free block ids (reference count 1 each); n = 0 gives []."""
        n = check_int("n", n, minimum=0)
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} block(s) but only {len(self._free)} of {self.num_blocks} are free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def _check(self, block: int):
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
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
# paged decode attention: reference and wrapper (the kernel is gqa._grouped_decode_kernel, PAGED=True)
# --------------------------------------------------------------------------------------------


def _check_paged_args(q, k_blocks, v_blocks, block_tables, seq_lens):
    for name, t in (("q", q), ("k_blocks", k_blocks), ("v_blocks", v_blocks), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, D), got shape {tuple(q.shape)}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    if q.numel() == 0:
        raise ValueError(f"q must hold at least one sequence, head and dim (B, H, D >= 1), got shape {tuple(q.shape)}")
    if k_blocks.dim() != 4 or v_blocks.shape != k_blocks.shape or k_blocks.numel() == 0:
        raise ValueError(f"k_blocks and v_blocks must both be non-empty (num_blocks, block_size, H_KV, D), got "
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
    """Gather each sequence's K/V through its block table, then attend (fp32).

    >>> k_blocks = torch.zeros(3, 2, 1, 4)  # (num_blocks, block_size, H_KV, D): equal scores everywhere
    >>> v_blocks = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 2, 1, 4)  # block i holds the value i
    >>> tables = torch.tensor([[2, 0]], dtype=torch.int32)  # logical block 0 -> block 2, block 1 -> block 0
    >>> out = paged_decode_attention_ref(torch.zeros(1, 1, 4), k_blocks, v_blocks, tables, torch.tensor([3]))
    >>> round(out[0, 0, 0].item(), 4)  # the mean over positions 0, 1 (value 2) and 2 (value 0)
    1.3333
    """
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
    """Decode attention reading K/V through block tables; same result as the reference.

    q, k_blocks, v_blocks: fp32, fp16 or bf16 (bf16 needs a GPU of compute capability >= 8.0).

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(2, 2, 8, generator=g).to(DEVICE)  # (B, H, D)
    >>> k, v = (torch.randn(4, 4, 1, 8, generator=g).to(DEVICE) for _ in range(2))  # 4 blocks of 4 positions
    >>> tables = torch.tensor([[3, 0], [1, -1]], dtype=torch.int32, device=DEVICE)  # -1: unused
    >>> lens = torch.tensor([6, 2], device=DEVICE)
    >>> out = paged_decode_attention(q, k, v, tables, lens)
    >>> torch.allclose(out, paged_decode_attention_ref(q, k, v, tables, lens), atol=1e-5)
    True
    """
    longest = _check_paged_args(q, k_blocks, v_blocks, block_tables, seq_lens)
    check_kernel_dtype("paged.paged_decode_attention", "q", q)
    if k_blocks.stride(3) != 1 or v_blocks.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q, k_blocks and v_blocks must be contiguous along the head dim D (stride 1)")
    if not runtime.require_triton("paged.paged_decode_attention", q=q, k_blocks=k_blocks,
                                  v_blocks=v_blocks, block_tables=block_tables, seq_lens=seq_lens):
        return paged_decode_attention_ref(q, k_blocks, v_blocks, block_tables, seq_lens)
    block_size, H_KV = k_blocks.shape[1], k_blocks.shape[2]
    kv_strides = (k_blocks.stride(0), k_blocks.stride(2), k_blocks.stride(1),  # per block, per head, per slot
                  v_blocks.stride(0), v_blocks.stride(2), v_blocks.stride(1))
    return grouped_decode_launch(q, k_blocks, v_blocks, seq_lens, kv_strides, H_KV, num_splits, longest,
                                 block_table=block_tables, block_size=block_size)


# --------------------------------------------------------------------------------------------
# store through the slot mapping: reference, kernel, wrapper
# --------------------------------------------------------------------------------------------


def _check_store_paged_args(k_blocks, v_blocks, k_new, v_new, slots):
    for name, t in (("k_blocks", k_blocks), ("v_blocks", v_blocks), ("k_new", k_new), ("v_new", v_new),
                    ("slots", slots)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k_blocks.dim() != 4 or v_blocks.shape != k_blocks.shape or k_blocks.numel() == 0:
        raise ValueError(f"k_blocks and v_blocks must both be non-empty (num_blocks, block_size, H_KV, D), got "
                         f"{tuple(k_blocks.shape)} and {tuple(v_blocks.shape)}")
    num_blocks, bs, H_KV, D = k_blocks.shape
    if k_new.shape != v_new.shape or k_new.dim() != 3 or k_new.shape[1:] != (H_KV, D) or k_new.shape[0] < 1:
        raise ValueError(f"k_new/v_new must be (N >= 1, H_KV={H_KV}, D={D}), got {tuple(k_new.shape)}, {tuple(v_new.shape)}")
    if not k_new.is_floating_point():
        raise TypeError(f"k_new must be a floating-point tensor, got {k_new.dtype}")
    if not (k_new.dtype == v_new.dtype == k_blocks.dtype == v_blocks.dtype):
        raise TypeError(f"k_new, v_new must have the pools' dtype {k_blocks.dtype}, got {k_new.dtype}, {v_new.dtype} "
                        f"(pools {k_blocks.dtype}, {v_blocks.dtype})")
    if slots.shape != (k_new.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be a (N={k_new.shape[0]},) int tensor, got {tuple(slots.shape)} {slots.dtype}")
    if len({t.device for t in (k_blocks, v_blocks, k_new, v_new, slots)}) != 1:
        raise ValueError("k_blocks, v_blocks, k_new, v_new and slots must be on one device")
    lo, hi = torch.stack([slots.min(), slots.max()]).tolist()  # one host read
    if lo < 0 or hi >= num_blocks * bs:
        raise ValueError(f"slots must lie in 0..{num_blocks * bs - 1} (num_blocks * block_size - 1), got {lo}..{hi}")


def store_paged_ref(k_blocks, v_blocks, k_new, v_new, slots):
    """k_new/v_new (N, H_KV, D) -> pool rows ``slots`` (N,) where slot = block * block_size + offset.

    >>> k_blocks, v_blocks = torch.zeros(2, 2, 1, 1), torch.zeros(2, 2, 1, 1)  # 2 blocks of 2 slots
    >>> new = torch.tensor([5.0, 7.0]).view(2, 1, 1)
    >>> store_paged_ref(k_blocks, v_blocks, new, new, torch.tensor([3, 0]))  # slot 3 = block 1, offset 1
    >>> k_blocks.flatten().tolist()
    [7.0, 0.0, 0.0, 5.0]
    """
    _check_store_paged_args(k_blocks, v_blocks, k_new, v_new, slots)
    bs = k_blocks.shape[1]
    k_blocks[slots // bs, slots % bs] = k_new
    v_blocks[slots // bs, slots % bs] = v_new


@triton.jit
def _store_paged_kernel(
    k_new_ptr, v_new_ptr,  # new rows (N, H_KV, D), contiguous: row i at i * HD
    k_pool_ptr, v_pool_ptr,  # pools (num_blocks, block_size, H_KV, D), contiguous: slot s at s * HD
    slots_ptr,  # (N,) destination slot of each new row: block * block_size + offset
    N, HD,  # new rows, H_KV * D elements per row (and per slot)
    TILE_R: tl.constexpr,  # new rows per program
    TILE: tl.constexpr,  # elements of a row copied per step (a power of two)
):
    rows = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)  # (TILE_R,) which new rows
    row_ok = rows < N
    # 64-bit offsets: a pool of 2**31 fp16 elements (4 GB) is common
    src = rows.to(tl.int64) * HD
    dst = tl.load(slots_ptr + rows, mask=row_ok, other=0).to(tl.int64) * HD
    for start in range(0, HD, TILE):
        offs = start + tl.arange(0, TILE)
        mask = row_ok[:, None] & (offs < HD)[None, :]
        k = tl.load(k_new_ptr + src[:, None] + offs[None, :], mask=mask)  # (TILE_R, TILE)
        tl.store(k_pool_ptr + dst[:, None] + offs[None, :], k, mask=mask)
        v = tl.load(v_new_ptr + src[:, None] + offs[None, :], mask=mask)
        tl.store(v_pool_ptr + dst[:, None] + offs[None, :], v, mask=mask)


def _store_paged_tiles(HD: int) -> tuple[int, int]:
    """(TILE_R, TILE): up to 1024 elements of a row per step, about 4096 per tile: 4 rows of H_KV * D = 8 * 128
    (32 registers on sm_80 and sm_90, 83 / 76 instructions per step copying 16 KB of K and V; one row per
    program: 60 instructions for 4 KB; 8 rows: 64 registers and 152 instructions)."""
    TILE = min(1024, triton.next_power_of_2(HD))
    return max(1, 4096 // TILE), TILE


def store_paged(k_blocks, v_blocks, k_new, v_new, slots):
    """Write N new K/V rows (N, H_KV, D) into the pools at ``slots`` (Triton kernel).

    >>> from kvlib.runtime import DEVICE
    >>> k_blocks, v_blocks = torch.zeros(2, 2, 1, 1, device=DEVICE), torch.zeros(2, 2, 1, 1, device=DEVICE)
    >>> new = torch.tensor([5.0, 7.0], device=DEVICE).view(2, 1, 1)
    >>> store_paged(k_blocks, v_blocks, new, new, torch.tensor([3, 0], device=DEVICE))
    >>> k_blocks.flatten().tolist()
    [7.0, 0.0, 0.0, 5.0]
    """
    _check_store_paged_args(k_blocks, v_blocks, k_new, v_new, slots)
    num_blocks, bs, H_KV, D = k_blocks.shape
    check_kernel_dtype("paged.store_paged", "k_new", k_new)
    if not (k_blocks.is_contiguous() and v_blocks.is_contiguous()):
        raise ValueError("k_blocks and v_blocks must be contiguous")
    slots = slots.contiguous()
    if not runtime.require_triton("paged.store_paged", k_blocks=k_blocks, v_blocks=v_blocks, k_new=k_new,
                                  v_new=v_new, slots=slots):
        return store_paged_ref(k_blocks, v_blocks, k_new, v_new, slots)
    k_new, v_new = k_new.contiguous(), v_new.contiguous()
    N, HD = k_new.shape[0], H_KV * D
    TILE_R, TILE = _store_paged_tiles(HD)
    _store_paged_kernel[(triton.cdiv(N, TILE_R),)](k_new, v_new, k_blocks, v_blocks, slots, N, HD, TILE_R=TILE_R,
                                                   TILE=TILE)


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


def chained_block_hashes(tokens, block_size: int, n_blocks: int) -> list[int]:
    """The prefix-cache key of each of the first ``n_blocks`` full blocks of ``tokens``: block i's hash
    chains block i - 1's, so equal hashes mean equal *prefixes*, not only equal blocks."""
    hashes, parent = [], None
    for i in range(n_blocks):
        parent = hash((parent, tuple(tokens[i * block_size: (i + 1) * block_size])))
        hashes.append(parent)
    return hashes


def block_digest(parent, block_tokens) -> bytes:
    """SHA-256 of a block's tokens chained with its parent's digest (None for the first block): equal
    digests mean equal whole prefixes, with a collision chance no workload will meet. The prefix cache
    finds blocks by the fast 64-bit chained hash and accepts a hit only when the digests agree (vLLM
    made SHA-256 its default for the same reason: a 64-bit hash collision is a wrong answer)."""
    return hashlib.sha256((parent or b"") + array("q", block_tokens).tobytes()).digest()


class PagedKVCache:
    """A block pool per layer plus, per sequence, a block table and a length.

    Sequences are named by any hashable id. Use with the model's seam through ``batch(seq_ids)``:
    a view whose ``attend`` writes the new tokens of those sequences (in that order) and attends.
    A call that fails (an unknown id, a pool too small) raises and changes nothing.

    The cache is the one owner of its blocks: reference counts (``allocator``), prefix hashes, and with
    ``retain_freed=True`` (the serving engine, chapter 08) the *cached* blocks: a full, hashed block whose
    last sequence let go stays findable, least recently used first in ``cached``, until a fresh block is
    needed and it is evicted (vLLM and nano-vllm do the same). ``num_available`` counts free + cached.
    With ``tiers`` (``kvlib.tiers.HostDiskTiers``) an evicted block goes down to host memory and disk.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = PagedKVCache.for_model(model, num_blocks=4, block_size=2)
    >>> cache.add_sequence("a")
    0
    >>> with torch.no_grad():
    ...     logits = model(torch.tensor([[1, 2, 3]]), cache=cache.batch(["a"]))  # 3 positions: 2 blocks
    >>> cache.tables["a"], cache.lens["a"], cache.allocator.num_free
    ([0, 1], 3, 2)
    >>> cache.free_sequence("a"); cache.allocator.num_free
    4
    """

    def __init__(self, n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype=torch.float32,
                 device="cpu", kernels=None, prefix_caching=True, retain_freed=False, tiers=None):
        n_layers, num_blocks = check_int("n_layers", n_layers), check_int("num_blocks", num_blocks)
        block_size, n_kv_heads = check_int("block_size", block_size), check_int("n_kv_heads", n_kv_heads)
        head_dim = check_int("head_dim", head_dim)
        if (retain_freed or tiers is not None) and not prefix_caching:
            raise ValueError("retain_freed and tiers keep prefix-cache blocks: they need prefix_caching=True")
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
        self.block_key: dict = {}  # block id -> block_digest of its whole prefix: what a hit compares
        self.retain_freed = retain_freed
        self.cached: OrderedDict = OrderedDict()  # hashed blocks no sequence holds (the cache's own reference), LRU first
        self.tiers = tiers  # None, or where evicted cached blocks go (host memory, disk)
        self._hashed: dict = {}  # seq id -> (blocks registered, hash and digest of the last one): incremental

    @classmethod
    def for_model(cls, model, num_blocks, block_size, **kw):
        c = model.config
        return cls(c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, model.dtype, model.device, **kw)

    # ---- sequences ----------------------------------------------------------------------

    def _known(self, seq_id, what: str):
        """seq_id, or a ValueError when no such sequence is registered (never added, or freed)."""
        try:
            known = seq_id in self.tables
        except TypeError:  # unhashable
            known = False
        if not known:
            live = sorted(map(repr, self.tables))
            raise ValueError(f"{what}: unknown sequence {seq_id!r} (never added, or already freed); live: "
                             f"{', '.join(live[:8]) + (' ...' if len(live) > 8 else '') or 'none'}")
        return seq_id

    def _distinct(self, seq_ids, what: str) -> list:
        seq_ids = list(seq_ids)
        if not seq_ids:
            raise ValueError(f"{what}: seq_ids must name at least one sequence")
        for s in seq_ids:
            self._known(s, what)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"{what}: seq_ids must be distinct, got {seq_ids!r}")
        return seq_ids

    @property
    def num_available(self) -> int:
        """Blocks a new allocation can get: free ones plus cached ones (evicted on demand)."""
        return self.allocator.num_free + len(self.cached)

    def _find(self, h, digest):
        """The device block registered under hash h if its whole prefix has this digest, else None: the
        64-bit hash finds a candidate, the SHA-256 digest of the prefix's tokens decides (as vLLM does)."""
        b = self.hash_to_block.get(h)
        if b is not None and self.block_key.get(b) == digest:
            return b
        return None

    def _take(self, block: int):
        """A new holder for a registered block: a cached one is revived (the cache's reference passes on)."""
        if block in self.cached:
            del self.cached[block]
        else:
            self.allocator.share(block)

    def lookup(self, tokens) -> list:
        """The device pool's blocks for ``tokens``' full prefix blocks, in order, stopping at the first miss
        (at most ``(len(tokens) - 1) // block_size``: the last token is computed, its logits give the first
        new token). Changes nothing."""
        return [b for tier, b, *_ in self.plan_prefix(tokens, tiers=False)]

    def add_sequence(self, seq_id, prompt_tokens=()) -> int:
        """Register a sequence; with prefix caching, reuse the full blocks of an identical prefix.

        Returns how many prompt positions are already cached (a multiple of block_size, and always
        less than the prompt's length, so the last prompt token is computed and gives logits).
        """
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens, bs = list(prompt_tokens), self.block_size
        blocks = self.lookup(tokens)
        for b in blocks:
            self._take(b)
        n = len(blocks) * bs
        self.tables[seq_id], self.lens[seq_id], self.tokens[seq_id] = blocks, n, tokens[:n]
        self._hashed[seq_id] = ((len(blocks), self.block_hash[blocks[-1]], self.block_key[blocks[-1]]) if blocks
                                else (0, None, None))
        return n

    def plan_prefix(self, tokens, tiers: bool = True) -> list:
        """Where each of ``tokens``' full prefix blocks is kept, in order, up to the first block kept
        nowhere: [(tier, device block or None, hash, digest, block tokens)], tier "device", "host" or
        "disk" (only "device" with ``tiers=False``). As ``lookup`` it leaves the last token to compute.
        Changes nothing."""
        if not self.prefix_caching:
            return []
        tokens, bs, plan, digest = list(tokens), self.block_size, [], None
        for i, h in enumerate(chained_block_hashes(tokens, bs, (len(tokens) - 1) // bs)):
            block_tokens = tuple(tokens[i * bs: (i + 1) * bs])
            digest = block_digest(digest, block_tokens)
            b = self._find(h, digest)
            tier = ("device" if b is not None else
                    self.tiers.where(h, digest) if tiers and self.tiers is not None else None)
            if tier is None:
                break
            plan.append((tier, b, h, digest, block_tokens))
        return plan

    def plan_cost(self, plan, n_tokens: int) -> int:
        """How much of ``num_available`` admitting ``n_tokens`` positions on ``plan`` takes: a fresh block
        for every block the device does not hold (a tier hit is copied into one), plus each cached block
        it revives (cached blocks count as available)."""
        device = [b for tier, b, *_ in plan if tier == "device"]
        return -(-n_tokens // self.block_size) - len(device) + sum(b in self.cached for b in device)

    def attach_prefix(self, seq_id, plan) -> dict:
        """Register seq_id holding ``plan``'s blocks (from ``plan_prefix``): device blocks are shared, tier
        copies go into fresh blocks (evicting cached ones if needed). A tier copy that turns out unreadable
        ends the prefix there (a miss). Returns the positions found per tier {"device", "host", "disk"}.
        All-or-nothing: an exception leaves no sequence and every block as it was."""
        self.add_sequence(seq_id)
        pinned = [b for tier, b, *_ in plan if tier == "device"]
        for b in pinned:  # held before any fresh block is allocated, so that no eviction takes them
            self._take(b)
        got, bs, attached = dict(device=0, host=0, disk=0), self.block_size, 0
        try:
            for tier, b, h, digest, block_tokens in plan:
                if tier == "device":
                    self.tables[seq_id].append(b)
                    self.tokens[seq_id] += list(block_tokens)
                    self.lens[seq_id] += bs
                    self._hashed[seq_id] = (self._hashed[seq_id][0] + 1, h, digest)
                    attached += 1
                elif not self.fill_block(seq_id, block_tokens, h, digest):
                    break  # the tier's copy was unreadable after all: a miss, the prefix ends here
                got[tier] += bs
        except BaseException:
            for b in pinned[attached:]:
                self.release_block(b)
            self.free_sequence(seq_id)
            raise
        for b in pinned[attached:]:  # past a miss: not part of this prefix after all
            self.release_block(b)
        return got

    def fork(self, parent, child):
        """``child`` starts as a copy of ``parent`` sharing all its blocks (copy-on-write later)."""
        self._known(parent, "fork")
        if child in self.tables:
            raise ValueError(f"sequence {child!r} already exists")
        for block in self.tables[parent]:
            self.allocator.share(block)
        self.tables[child] = list(self.tables[parent])
        self.lens[child] = self.lens[parent]
        self.tokens[child] = list(self.tokens[parent])
        self._hashed[child] = self._hashed[parent]

    def free_sequence(self, seq_id):
        """Drop the sequence and its references to its blocks (blocks no one else holds go back to the pool,
        or, with ``retain_freed``, hashed ones to ``cached``: the last block first, so it is evicted first)."""
        self._known(seq_id, "free_sequence")
        for block in reversed(self.tables.pop(seq_id)):
            self.release_block(block)
        del self.lens[seq_id], self.tokens[seq_id], self._hashed[seq_id]

    def release_block(self, block: int) -> bool:
        """Drop one reference to ``block``. On the last one a hashed block is kept in ``cached`` when
        ``retain_freed`` is on; otherwise it goes back to the pool and its prefix hash is forgotten (so no
        later lookup finds a free block). True if it left every sequence (freed or cached)."""
        if self.retain_freed and self.allocator.refcount[block] == 1 and block not in self.cached \
                and self.hash_to_block.get(self.block_hash.get(block)) == block:  # findable: worth keeping
            self.cached[block] = None  # the last holder's reference becomes the cache's own
            return True
        if not self.allocator.free(block):
            return False
        self._forget(block)
        return True

    def _forget(self, block: int):
        h = self.block_hash.pop(block, None)
        self.block_key.pop(block, None)
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]

    def _allocate(self, n: int) -> list[int]:
        """n fresh blocks, evicting cached ones (least recently used first; down to the tiers if any) when
        the free list is short. All-or-nothing: ``OutOfBlocksError`` when even free + cached is too few."""
        if n > self.num_available:
            raise OutOfBlocksError(f"asked for {n} block(s) but only {self.allocator.num_free} of "
                                   f"{self.allocator.num_blocks} are free and {len(self.cached)} cached")
        self.evict_cached(n - self.allocator.num_free)
        return self.allocator.allocate(n)

    def evict_cached(self, n: int, demote: bool = True) -> int:
        """Evict up to n cached blocks, least recently used first: each goes down to the tiers (if any and
        ``demote``; a failed write there only loses that copy), then its hash is forgotten and it is free.
        Returns how many were evicted. Each eviction is whole: an exception leaves the block cached."""
        done = 0
        while done < n and self.cached:
            b = next(iter(self.cached))
            if self.tiers is not None and demote:
                self.tiers.put(self.block_hash[b], self.block_key[b], self._block_kv(b))  # never raises an Exception
            del self.cached[b]
            self.allocator.free(b)
            self._forget(b)
            done += 1
        return done

    def _block_kv(self, b: int):
        """Block b's K and V of every layer: two (n_layers, block_size, H_KV, D) tensors (views stacked)."""
        return torch.stack([k[b] for k in self.k]), torch.stack([v[b] for v in self.v])

    def blocks_needed(self, seq_id, n_new: int) -> int:
        """New blocks that appending n_new tokens takes, counting a copy-on-write of a shared last block."""
        self._known(seq_id, "blocks_needed")
        n_new = check_int("n_new", n_new, minimum=0)
        L, bs, table = self.lens[seq_id], self.block_size, self.tables[seq_id]
        fresh = -(-(L + n_new) // bs) - len(table)
        cow = 1 if (L % bs and table and self.allocator.refcount[table[-1]] > 1) else 0
        return max(0, fresh) + cow

    def tokens_that_fit(self, seq_id, n_blocks: int) -> int:
        """The most tokens appending to seq_id can take with n_blocks new blocks (the inverse of blocks_needed)."""
        L, bs, table = self.lens[seq_id], self.block_size, self.tables[seq_id]
        cow = 1 if (L % bs and table and self.allocator.refcount[table[-1]] > 1) else 0
        return max(0, (len(table) + n_blocks - cow) * bs - L) if n_blocks >= cow else 0

    def reserve(self, seq_ids, n_new, new_tokens=None) -> torch.Tensor:
        """Make room for n_new tokens per sequence (an int, or one count per sequence); return their slots
        (sum of the counts,), sequence after sequence.

        All-or-nothing: if the pool cannot hold everything, ``OutOfBlocksError`` is raised and no
        table, length or reference count has changed.
        """
        seq_ids = self._distinct(seq_ids, "reserve")
        counts = [n_new] * len(seq_ids) if isinstance(n_new, int) and not isinstance(n_new, bool) else list(n_new)
        if len(counts) != len(seq_ids):
            raise ValueError(f"reserve: n_new must be an int or one count per sequence ({len(seq_ids)}), got {n_new!r}")
        counts = [check_int("n_new", n, minimum=0) for n in counts]
        if new_tokens is not None and (len(new_tokens) != len(seq_ids)
                                       or any(len(t) != n for t, n in zip(new_tokens, counts))):
            raise ValueError(f"reserve: new_tokens must hold {counts} token(s) for the {len(seq_ids)} "
                             f"sequence(s), got lengths {[len(t) for t in new_tokens]}")
        bs = self.block_size
        need = sum(max(0, -(-(self.lens[s] + n) // bs) - len(self.tables[s])) for s, n in zip(seq_ids, counts))
        # copy-on-write: k sharers of one partial last block (reference count r) growing in this call copy it
        # min(k, r - 1) times, since the last holder left writes in place
        sharers: dict[int, int] = {}
        for s, n in zip(seq_ids, counts):
            last = self.tables[s][-1] if self.tables[s] else None
            if n and self.lens[s] % bs and self.allocator.refcount[last] > 1:
                sharers[last] = sharers.get(last, 0) + 1
        need += sum(min(k, self.allocator.refcount[b] - 1) for b, k in sharers.items())
        if need > self.num_available:
            what = counts[0] if len(set(counts)) == 1 else counts  # one count for all: say it once
            raise OutOfBlocksError(f"appending {what} token(s) to {len(seq_ids)} sequence(s) needs {need} "
                                   f"block(s); {self.allocator.num_free} of {self.allocator.num_blocks} are free"
                                   + (f" and {len(self.cached)} cached" if self.cached else ""))
        self.evict_cached(need - self.allocator.num_free)  # room first (each eviction whole): then nothing can fail
        slots = []
        for i, (s, n) in enumerate(zip(seq_ids, counts)):
            table, L = self.tables[s], self.lens[s]
            if n and L % bs and self.allocator.refcount[table[-1]] > 1:  # copy-on-write of a shared partial block
                (new,) = self.allocator.allocate(1)
                for pool in self.k + self.v:
                    pool[new] = pool[table[-1]]
                self.release_block(table[-1])
                table[-1] = new
            grow = -(-(L + n) // bs) - len(table)
            if grow > 0:
                table += self.allocator.allocate(grow)
            slots += [table[p // bs] * bs + p % bs for p in range(L, L + n)]
            if new_tokens is not None:
                self.tokens[s] += list(new_tokens[i])
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def truncate(self, seq_id, length: int):
        """Cut seq_id back to its first ``length`` positions: blocks past them are released, and a block no
        longer full loses its hash if this sequence alone holds it. (Rolls back a reservation whose forward
        failed; chapter 11 rewinds rejected draft tokens with it.)"""
        self._known(seq_id, "truncate")
        length = check_int("length", length, minimum=0)
        if length > max(self.lens[seq_id], len(self.tokens[seq_id])):
            raise ValueError(f"truncate: length {length} is past sequence {seq_id!r}'s "
                             f"{max(self.lens[seq_id], len(self.tokens[seq_id]))} positions")
        bs, table = self.block_size, self.tables[seq_id]
        keep = -(-length // bs)
        for b in reversed(table[keep:]):
            self.release_block(b)
        del table[keep:]
        if length % bs and table and table[-1] in self.block_hash and self.allocator.refcount[table[-1]] == 1:
            self._forget(table[-1])
        self.lens[seq_id] = min(self.lens[seq_id], length)
        del self.tokens[seq_id][length:]
        n_hashed, last, digest = self._hashed[seq_id]
        if n_hashed > length // bs:
            n_hashed = length // bs
            last = self.block_hash.get(table[n_hashed - 1]) if n_hashed else None
            digest = self.block_key.get(table[n_hashed - 1]) if n_hashed else None
            if n_hashed and last is None:  # a block we registered was forgotten: hash again from the start
                n_hashed, digest = 0, None
        self._hashed[seq_id] = (n_hashed, last, digest)

    def _register_full_blocks(self, seq_id):
        """Give every newly completed block of seq_id its chained hash (prefix caching); only blocks not
        hashed before are hashed (the chain goes on from the last one)."""
        if not self.prefix_caching:
            return
        bs, toks, table, L = self.block_size, self.tokens[seq_id], self.tables[seq_id], self.lens[seq_id]
        if len(toks) < L:
            return
        n, parent, digest = self._hashed[seq_id]
        for i in range(n, L // bs):
            block_tokens = tuple(toks[i * bs: (i + 1) * bs])
            h, digest = hash((parent, block_tokens)), block_digest(digest, block_tokens)
            b = table[i]
            if b not in self.block_hash:
                self.block_hash[b], self.block_key[b] = h, digest
                self.hash_to_block.setdefault(h, b)
            parent = h
        self._hashed[seq_id] = (max(n, L // bs), parent, digest)

    def block_table_tensor(self, seq_ids) -> torch.Tensor:
        width = max(1, max(len(self.tables[s]) for s in seq_ids))
        bt = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for i, s in enumerate(seq_ids):
            if self.tables[s]:
                bt[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        return bt.to(self.device)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    # ---- swapping a sequence out to host memory and back (chapter 08) -------------------

    def swap_out(self, seq_id) -> list:
        """Copy seq_id's blocks (every layer's K and V) to host memory, then free the sequence; returns
        the copies, per layer (k, v) of shape (n_blocks, block_size, H_KV, D). Pinned on a GPU."""
        self._known(seq_id, "swap_out")
        idx = torch.tensor(self.tables[seq_id], dtype=torch.long, device=self.device)
        pin = torch.device(self.device).type == "cuda"  # pinned host memory copies fast, asynchronously
        host = []
        for k, v in zip(self.k, self.v):  # copies first: an exception here leaves the sequence as it was
            host.append(tuple(torch.empty((len(idx),) + pool.shape[1:], dtype=pool.dtype, pin_memory=pin)
                              .copy_(pool[idx]) for pool in (k, v)))
        self.free_sequence(seq_id)
        return host

    def swap_in(self, seq_id, host, tokens):
        """Register seq_id again from ``swap_out``'s copies; ``tokens``: the token ids they hold (one per
        position). Its full blocks get their prefix hashes again. All-or-nothing."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        n = host[0][0].shape[0] if host else 0
        if -(-len(tokens) // self.block_size) != n:
            raise ValueError(f"swap_in: {len(tokens)} tokens need {-(-len(tokens) // self.block_size)} blocks, "
                             f"the copies hold {n}")
        blocks = self._allocate(n)
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for (hk, hv), k, v in zip(host, self.k, self.v):
            k[idx] = hk.to(self.device, non_blocking=True)
            v[idx] = hv.to(self.device, non_blocking=True)
        self.tables[seq_id], self.lens[seq_id], self.tokens[seq_id] = blocks, len(tokens), list(tokens)
        self._hashed[seq_id] = (0, None, None)
        self._register_full_blocks(seq_id)

    def fill_block(self, seq_id, block_tokens, h, digest) -> bool:
        """Append one full block to seq_id from the tiers' copy of block (h, digest), registered under its
        hash; False (nothing changed) if the copy is gone or unreadable. The fresh block is taken before
        the copy leaves its tier, so a failed allocation loses no copy. Needs seq_id's length to be a
        multiple of block_size."""
        bs = self.block_size
        if self.lens[seq_id] % bs or len(block_tokens) != bs:
            raise ValueError("fill_block appends one whole block after whole blocks")
        (b,) = self._allocate(1)
        try:
            kv = self.tiers.get(h, digest)
        except BaseException:
            self.allocator.free(b)
            raise
        if kv is None:
            self.allocator.free(b)
            return False
        k, v = kv
        for layer, (pool_k, pool_v) in enumerate(zip(self.k, self.v)):
            pool_k[b].copy_(k[layer], non_blocking=k.is_pinned())
            pool_v[b].copy_(v[layer], non_blocking=v.is_pinned())
        self.block_hash[b], self.block_key[b] = h, digest
        self.hash_to_block.setdefault(h, b)
        self.tables[seq_id].append(b)
        self.tokens[seq_id] += list(block_tokens)
        self.lens[seq_id] += bs
        self._hashed[seq_id] = (self._hashed[seq_id][0] + 1, h, digest)
        return True

    # The four calls kvlib.generate.generate makes on any cache (sequence ids are 0..B-1 there):
    def reset(self, batch: int | None = None, length: int | None = None):
        """Free every sequence (their blocks go back to the pool, prefix hashes with them).

        With ``length``, first check that one sequence of ``length`` positions fits in the pool;
        if not, raise ``OutOfBlocksError`` and change nothing (``batch`` is accepted for the protocol:
        prefix sharing makes the blocks a batch needs unknown in advance).
        """
        if length is not None and -(-length // self.block_size) > self.allocator.num_blocks:
            raise OutOfBlocksError(f"a sequence of {length} positions needs {-(-length // self.block_size)} blocks "
                                   f"of {self.block_size}; the pool has {self.allocator.num_blocks}")
        for s in list(self.tables):
            self.free_sequence(s)

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
        return _PagedBatch(self, self._distinct(seq_ids, "batch"), new_tokens)

    def ragged(self, seq_ids, new_tokens) -> "RaggedBatch":
        """One forward over several sequences' new tokens laid end to end (chapter 08's fused step):
        slots are reserved now (all-or-nothing); the model gets ids (1, N); ``commit()`` after the forward
        makes the tokens part of the sequences, ``rollback()`` after a failure gives the slots back."""
        return RaggedBatch(self, self._distinct(seq_ids, "ragged"), [list(t) for t in new_tokens])


class _PagedBatch:
    """The model's seam for a PagedKVCache: ``attend(layer_idx, q, k, v)`` for one forward call."""

    def __init__(self, cache: PagedKVCache, seq_ids, new_tokens):
        self.cache, self.seq_ids, self.new_tokens = cache, seq_ids, new_tokens
        self.slots = None

    def _check(self, layer_idx, q, k, v):
        c = self.cache
        _, _, H_KV, D = c.k[0].shape
        B = len(self.seq_ids)
        check_attend_args(layer_idx, q, k, v, n_layers=len(c.k), batch=B, n_kv_heads=H_KV, head_dim=D,
                          kv_dtype=c.k[0].dtype, batch_is=f"the view names {B} sequence(s)")
        T = q.shape[2]
        if T > 1 and B != 1:
            raise ValueError("prefill (T > 1) runs one sequence at a time")

    def attend(self, layer_idx, q, k, v):
        self._check(layer_idx, q, k, v)
        c, B, T = self.cache, q.shape[0], q.shape[2]
        if layer_idx == 0:  # blocks for the new tokens, once per forward call (all-or-nothing)
            c._distinct(self.seq_ids, "attend")  # a sequence freed since this view was made
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


class RaggedBatch:
    """The seam for one fused forward: ``attend`` gets q (1, H, N, D) and k, v (1, H_KV, N, D) for the new
    tokens of ``seq_ids`` laid end to end, stores K/V through the reserved slots and runs ragged paged
    attention (each token attends its own sequence's positions up to itself). Nothing about the sequences
    changes until ``commit()``; ``rollback()`` releases the reservation."""

    def __init__(self, cache: PagedKVCache, seq_ids, new_tokens):
        self.cache, self.seq_ids = cache, seq_ids
        self.counts = [len(t) for t in new_tokens]
        if min(self.counts) < 1:
            raise ValueError(f"ragged: every sequence needs at least one new token, got counts {self.counts}")
        self.start = [cache.lens[s] for s in seq_ids]
        self._plan = None  # the ragged attention's per-forward plan, made by the first layer
        self.state = "reserved"
        self.slots = cache.reserve(seq_ids, self.counts, new_tokens)  # all-or-nothing
        try:
            self._layout()
        except BaseException:
            self.rollback()
            raise

    def _layout(self):
        cache, seq_ids = self.cache, self.seq_ids
        dev = cache.device
        self.positions = torch.tensor([p for L, n in zip(self.start, self.counts) for p in range(L, L + n)],
                                      device=dev)[None]  # (1, N)
        self.tables = cache.block_table_tensor(seq_ids)
        self.seq_lens = torch.tensor([L + n for L, n in zip(self.start, self.counts)], dtype=torch.int32, device=dev)
        cu = [0]
        for n in self.counts:
            cu.append(cu[-1] + n)
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=dev)

    def attend(self, layer_idx, q, k, v):
        c = self.cache
        if self.state != "reserved":
            raise ValueError(f"this ragged view was already {self.state}: make a new one per forward")
        _, _, H_KV, D = c.k[0].shape
        check_attend_args(layer_idx, q, k, v, n_layers=len(c.k), batch=1, n_kv_heads=H_KV, head_dim=D,
                          kv_dtype=c.k[0].dtype, batch_is="a ragged view lays its sequences end to end in one row")
        N = q.shape[2]
        if N != sum(self.counts):
            raise ValueError(f"the ragged view holds {sum(self.counts)} new tokens, q has T={N}")
        triton_kernels = c.kernels == "triton"
        k_rows = k[0].transpose(0, 1)  # (N, H_KV, D)
        v_rows = v[0].transpose(0, 1)
        (store_paged if triton_kernels else store_paged_ref)(c.k[layer_idx], c.v[layer_idx], k_rows, v_rows, self.slots)
        attn = ragged_paged_attention if triton_kernels else ragged_paged_attention_ref
        q_rows = q[0].transpose(0, 1)  # (N, H, D)
        args = (q_rows, c.k[layer_idx], c.v[layer_idx], self.tables, self.cu_seqlens, self.seq_lens)
        if self._plan is None:  # checked and laid out once per forward, not once per layer
            self._plan = RaggedPlan(*args)
        out = attn(*args, plan=self._plan)
        return out.transpose(0, 1)[None]  # (1, H, N, D)

    def commit(self):
        """The forward succeeded: the new tokens become part of their sequences (and full blocks get hashes)."""
        c = self.cache
        for s, n in zip(self.seq_ids, self.counts):
            c.lens[s] += n
            c._register_full_blocks(s)
        self.state = "committed"

    def rollback(self):
        """The forward (or what came after it) failed: give back the reserved blocks and tokens. (A
        copy-on-write the reservation made is kept: the copy holds the same K/V; the engine never forks.)"""
        if self.state != "reserved":
            return
        c = self.cache
        for s, L in zip(self.seq_ids, self.start):
            if s in c.tables:
                c.truncate(s, L)
        self.state = "rolled back"


# --------------------------------------------------------------------------------------------
# The smallest paged decode kernel (chapter 05 shows it before the library's grouped one)
# --------------------------------------------------------------------------------------------


@triton.jit
def _paged_decode_minimal_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # q, o (B, H, D); pools (num_blocks, block_size, H_KV, D), K and V alike
    table_ptr, seq_lens_ptr,  # block tables (B, max_blocks) int32; lengths (B,)
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,  # strides (D's is 1)
    H, D, n_rep, qk_scale,  # query heads, head dim, query heads per K/V head, 1/sqrt(D) * log2(e)
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, TILE_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # 64-bit, so offsets = index * stride cannot overflow in a large pool
    b, h = pid // H, pid % H  # one program per (sequence, query head)
    kv_h = h // n_rep
    seq_len = tl.load(seq_lens_ptr + b)
    dims = tl.arange(0, TILE_D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + dims, mask=dims < D, other=0.0).to(tl.float32)
    m_i, l_i, acc = -1.0e30, 0.0, tl.zeros((TILE_D,), dtype=tl.float32)
    for pos0 in range(0, seq_len, TILE_N):
        pos = pos0 + tl.arange(0, TILE_N)  # (TILE_N,) the positions of this step
        ok = pos < seq_len
        blk = tl.load(table_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)  # the lookup
        row = blk * stride_kb + (pos % BLOCK_SIZE).to(tl.int64) * stride_ks + kv_h * stride_kh  # (TILE_N,) its slot
        mask = ok[:, None] & (dims < D)[None, :]
        k = tl.load(k_ptr + row[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)  # (TILE_N, TILE_D)
        s = tl.where(ok, tl.sum(k * q[None, :], axis=1) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))  # chapter 01's online softmax, as in chapter 03's kernel
        p, alpha = tl.exp2(s - m_new), tl.exp2(m_i - m_new)
        v = tl.load(v_ptr + row[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i, m_i = l_i * alpha + tl.sum(p, axis=0), m_new
    tl.store(o_ptr + b * stride_qb + h * stride_qh + dims, (acc / l_i).to(o_ptr.dtype.element_ty), mask=dims < D)


def paged_decode_minimal(q, k_blocks, v_blocks, block_tables, seq_lens, tile_n: int = 16):
    """Decode attention through block tables with the minimal kernel (no split-K, one program per (sequence,
    query head)): the same result as ``paged_decode_attention_ref``."""
    _check_paged_args(q, k_blocks, v_blocks, block_tables, seq_lens)
    if k_blocks.stride() != v_blocks.stride() or k_blocks.stride(3) != 1 or not q.is_contiguous():
        raise ValueError("the minimal kernel wants q contiguous and K/V pools of one layout, D innermost")
    B, H, D = q.shape
    block_size, H_KV = k_blocks.shape[1], k_blocks.shape[2]
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.contiguous()  # the kernel reads seq_lens[b] with a unit stride
    _paged_decode_minimal_kernel[(B * H,)](
        q, k_blocks, v_blocks, out, tables, seq_lens, q.stride(0), q.stride(1), k_blocks.stride(0),
        k_blocks.stride(1), k_blocks.stride(2), tables.stride(0), H, D, H // H_KV, math.log2(math.e) / math.sqrt(D),
        BLOCK_SIZE=block_size, TILE_N=tile_n, TILE_D=triton.next_power_of_2(D))
    return out



# --------------------------------------------------------------------------------------------
# How kvlib.course.compile_check builds the kernels: the wrappers' own launches at a realistic shape
# --------------------------------------------------------------------------------------------


def _paged_inputs(dtype="fp16", H=32, block_size=16, B=2, H_KV=8, S_max=1024, D=128):
    """q, pools, block tables, seq_lens on the CPU: two ragged sequences of up to S_max positions in blocks
    handed out in reverse order."""
    q, k, v, lens = _compile_inputs(dtype, B=B, H=H, H_KV=H_KV, S_max=S_max, D=D)
    n_blocks = B * S_max // block_size
    pools = [torch.zeros(n_blocks, block_size, H_KV, D, dtype=q.dtype) for _ in range(2)]
    tables = torch.arange(n_blocks, dtype=torch.int32).flip(0).view(B, -1).contiguous()
    return q, pools[0], pools[1], tables, lens


def _store_inputs(N, dtype="fp16", block_size=16, H_KV=8, D=128, num_blocks=512):
    """N new rows scattered over a pool of num_blocks blocks."""
    pools = [torch.zeros(num_blocks, block_size, H_KV, D, dtype=_DTYPES[dtype]) for _ in range(2)]
    new = torch.zeros(N, H_KV, D, dtype=_DTYPES[dtype])
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(0))[:N]
    return pools[0], pools[1], new, new, slots


def _minimal_decode_loop(a):
    """What one program of the minimal kernel loads per step: a K and a V tile for its one query head, so the
    n_rep query heads of a K/V head read the same tiles n_rep times (the grouped kernel reads them once)."""
    return dict(bytes=2 * a["TILE_N"] * a["TILE_D"] * a["k_ptr"].element_size(), reread=a["n_rep"])


COMPILE_SPECS = [
    *(dict(name=f"paged {dt} {H}/8 bs={bs} splits={n}", archs=(80, 90) if dt == "bf16" else (75, 80, 90),
           loops=DECODE_LOOPS, launch=lambda dt=dt, H=H, bs=bs, n=n: paged_decode_attention(
               *_paged_inputs(dt, H=H, block_size=bs), num_splits=n))
      for dt, H, bs, n in (("fp16", 32, 16, 1), ("fp16", 32, 16, 8), ("fp16", 32, 128, 1), ("fp16", 32, 128, 8),
                           ("fp16", 64, 16, 8), ("fp16", 32, 1, 8), ("bf16", 32, 16, 8), ("fp32", 32, 16, 8))),
    dict(name="paged minimal fp16 32/8 bs=16", launch=lambda: paged_decode_minimal(*_paged_inputs("fp16", H=32, block_size=16)),
         loops={"_paged_decode_minimal_kernel": _minimal_decode_loop}),
    dict(name="store_paged 16 tokens", launch=lambda: store_paged(*_store_inputs(16))),
    dict(name="store_paged 4096 tokens", launch=lambda: store_paged(*_store_inputs(4096))),
    dict(name="store_paged 37 tokens", launch=lambda: store_paged(*_store_inputs(37))),  # not 16-divisible
]
