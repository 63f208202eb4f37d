"""Where evicted prefix blocks go (chapter 08): host memory, then disk, each a least-recently-used store.

What you will learn:
- a prefix-cache block evicted from the device pool is not lost if a copy of its K/V (every layer) goes
  one level down, with its chained hash and its tokens: **host memory** first (pinned on a GPU, so the
  copy back is fast and asynchronous), then **disk**, one safetensors file per block (no pickle);
- a lookup that reaches a tier compares the SHA-256 digest of the block's whole prefix
  (``paged.block_digest``), never the 64-bit hash alone;
- a tier is a cache: a failure in it costs a hit, never a request. A file that was deleted, truncated or
  overwritten between steps (also by another engine sharing the folder: each store names its files with
  its own random id and checks it) is a *miss*: its entry is dropped and counted in ``errors``, the reason
  is logged (logger ``kvlib.tiers``), and the prefix is computed instead. A copy or a write that fails (no
  memory left, a full disk) drops that one copy, so nothing is left half-moved. This is how LMCache and
  SGLang's HiCache treat their lower tiers.

``HostDiskTiers`` is owned by the paged cache (``PagedKVCache(tiers=...)``), which puts a block here when
it evicts it and asks here when a prompt's lookup misses on the device.

>>> import torch
>>> tiers = HostDiskTiers(host_blocks=1)
>>> k = v = torch.ones(2, 4, 1, 8)  # (n_layers, block_size, H_KV, D)
>>> from kvlib.paged import block_digest
>>> d1 = block_digest(None, (1, 2, 3, 4)); d2 = block_digest(d1, (5, 6, 7, 8))  # two blocks of one prefix
>>> tiers.put(11, d1, (k, v)); tiers.put(22, d2, (k, v))
>>> tiers.where(11, d1), tiers.where(22, d2)  # no disk: the oldest was dropped
(None, 'host')
>>> tiers.where(22, block_digest(d1, (5, 6, 7, 9)))  # the same hash with other tokens is a miss
>>> tiers.stats["dropped"], tiers.get(22, d2)[0].shape
(1, torch.Size([2, 4, 1, 8]))
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .cache import check_int

__all__ = ["HostDiskTiers", "TIER_COUNTERS"]

log = logging.getLogger("kvlib.tiers")

# What the tiers count (HostDiskTiers.stats; per engine step in event["tiers"]): blocks found in the host /
# disk tier, blocks moved down (device -> host, host -> disk) or dropped off the end (or by a failed write),
# the bytes each move copied, and errors (a block file that could not be written or read back: a miss).
TIER_COUNTERS = ("host_hits", "disk_hits", "to_host", "to_disk", "dropped",
                 "bytes_to_host", "bytes_to_disk", "bytes_from_host", "bytes_from_disk", "errors")


def _key_text(key) -> str:
    return key.hex() if isinstance(key, bytes) else repr(key)


class HostDiskTiers:
    """An LRU of evicted blocks in host memory (``host_blocks``), and below it up to ``disk_blocks`` files
    in ``disk_dir``. Blocks are named by their chained hash ``h`` and checked against ``key``, the digest of
    the block's whole prefix (``paged.block_digest``)."""

    def __init__(self, host_blocks: int = 0, disk_dir: str | None = None, disk_blocks: int = 0,
                 pin: bool = False):
        self.host_blocks = check_int("host_blocks", host_blocks, minimum=0)
        self.disk_blocks = check_int("disk_blocks", disk_blocks, minimum=0)
        self.disk_dir = None if disk_dir is None else os.fspath(disk_dir)
        if self.disk_blocks and self.disk_dir is None:
            raise ValueError(f"disk_blocks={self.disk_blocks} needs disk_dir, the folder for the block files")
        if self.disk_dir is not None and not self.disk_blocks:
            raise ValueError(f"disk_dir={self.disk_dir!r} is set but disk_blocks is 0: give disk_blocks >= 1 "
                             "(the most block files to keep), or leave disk_dir out")
        if self.disk_dir is not None:
            os.makedirs(self.disk_dir, exist_ok=True)
        self.pin = pin  # pinned host memory (a GPU pool): copies back are fast and asynchronous
        self.store_id = os.urandom(4).hex()  # in every file name and checked on reading: folders can be shared
        self.host: OrderedDict = OrderedDict()  # hash -> (key, k, v), least recently used first
        self.disk: OrderedDict = OrderedDict()  # hash -> key; the K/V are in the block's file (oldest first)
        self.stats = dict.fromkeys(TIER_COUNTERS, 0)

    def block_file(self, h: int) -> str:
        return os.path.join(self.disk_dir, f"block_{self.store_id}_{h & (2**64 - 1):016x}.safetensors")

    # ---- down: a block evicted from the device pool -------------------------------------

    def put(self, h: int, key, kv):
        """Keep a copy of an evicted block: kv = (k, v), each (n_layers, block_size, H_KV, D). A copy that
        fails (no host memory left) is dropped and counted in errors; nothing else changes."""
        try:
            k, v = (torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin).copy_(t) for t in kv)
        except Exception as err:
            log.warning("host tier: could not copy a block out (%s: %s); the block is dropped", type(err).__name__, err)
            self.stats["errors"] += 1
            self.stats["dropped"] += 1
            return
        if not self.host_blocks:
            self._to_disk(h, key, k, v)
            return
        self.stats["to_host"] += 1
        self.stats["bytes_to_host"] += k.nbytes + v.nbytes
        self._drop_file(h)  # one copy below the device pool at most
        self.host[h] = (key, k, v)
        self.host.move_to_end(h)
        while len(self.host) > self.host_blocks:  # the least recently used goes down to disk
            h_old, (key_old, k_old, v_old) = self.host.popitem(last=False)
            self._to_disk(h_old, key_old, k_old, v_old)

    def _to_disk(self, h: int, key, k, v):
        if not self.disk_blocks:
            self.stats["dropped"] += 1
            return
        path = self.block_file(h)
        tmp = path + ".tmp"
        try:  # write first, then rename: a block file is either whole or absent
            save_file({"k": k.contiguous(), "v": v.contiguous()}, tmp,
                      metadata={"hash": str(h), "key": _key_text(key), "store": self.store_id})
            os.replace(tmp, path)
        except BaseException as err:  # e.g. a full disk: this copy is lost, nothing else
            try:
                os.remove(tmp)
            except OSError:
                pass
            if not isinstance(err, Exception):  # KeyboardInterrupt: no half-written file, then up it goes
                raise
            log.warning("disk tier: could not write %s (%s); the block is dropped", path, err)
            self.stats["errors"] += 1
            self.stats["dropped"] += 1
            return
        self.stats["to_disk"] += 1
        self.stats["bytes_to_disk"] += k.nbytes + v.nbytes
        self.disk[h] = key
        self.disk.move_to_end(h)
        while len(self.disk) > self.disk_blocks:  # the oldest file is deleted
            self._drop_file(next(iter(self.disk)))
            self.stats["dropped"] += 1

    def _drop_file(self, h: int):
        if self.disk.pop(h, None) is not None:
            try:
                os.remove(self.block_file(h))
            except OSError:  # already gone: nothing to drop
                pass

    # ---- up: a prompt's lookup reached the tiers ----------------------------------------

    def where(self, h: int, key) -> str | None:
        """"host" or "disk" if a copy of block (h, key) is kept there (the disk's file is read only by get)."""
        if h in self.host and self.host[h][0] == key:
            return "host"
        if self.disk.get(h) == key:
            return "disk"
        return None

    def get(self, h: int, key):
        """Take block (h, key) out of its tier: (k, v) on the CPU, or None on a miss (also a block file that
        is missing, damaged or holds another block: its entry is dropped, counted in errors, logged)."""
        tier = self.where(h, key)
        if tier == "host":
            _, k, v = self.host.pop(h)
        elif tier == "disk":
            path = self.block_file(h)
            try:
                with safe_open(path, framework="pt") as f:
                    meta, k, v = f.metadata() or {}, f.get_tensor("k"), f.get_tensor("v")
                if meta.get("hash") != str(h) or meta.get("key") != _key_text(key) \
                        or meta.get("store") != self.store_id:
                    raise ValueError("it holds another block")
            except Exception as err:  # deleted, truncated, overwritten: a miss, never an error
                log.warning("disk tier: %s is unreadable (%s: %s); treated as a miss", path, type(err).__name__, err)
                self.stats["errors"] += 1
                self._drop_file(h)
                return None
            self._drop_file(h)
        else:
            return None
        self.stats[f"{tier}_hits"] += 1
        self.stats[f"bytes_from_{tier}"] += k.nbytes + v.nbytes
        return k, v

    def clear(self):
        """Forget every kept block (and delete the block files)."""
        self.host.clear()
        while self.disk:
            self._drop_file(next(iter(self.disk)))

    def __len__(self) -> int:
        return len(self.host) + len(self.disk)
