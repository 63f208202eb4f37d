"""Paged KV cache: allocator and block-table invariants under random operation sequences (hypothesis).

Separate from test_paged.py so that the kernel tests there run where hypothesis (a dev extra) is missing,
as on a bare GPU image (scripts/gpu_check.sh)."""

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from kvlib.paged import OutOfBlocksError, PagedKVCache  # noqa: E402


class CacheMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / write / free sequences over a small pool."""

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(n_layers=1, num_blocks=12, block_size=4, n_kv_heads=1, head_dim=2,
                                  kernels="torch", prefix_caching=False)
        self.next_id = 0

    @rule()
    def add(self):
        self.cache.add_sequence(self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.cache.tables)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        ids = sorted(self.cache.tables)
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True))
        before = ({s: list(t) for s, t in self.cache.tables.items()}, dict(self.cache.lens),
                  list(self.cache.allocator.refcount))
        try:
            slots = self.cache.reserve(chosen, n)
        except OutOfBlocksError:  # refused: nothing changed
            assert before == ({s: list(t) for s, t in self.cache.tables.items()}, dict(self.cache.lens),
                              list(self.cache.allocator.refcount))
            return
        assert len(set(slots.tolist())) == len(slots)  # no two new tokens share a slot
        for s in chosen:  # written slots belong to blocks this sequence owns alone (copy-on-write)
            self.cache.lens[s] += n
        for slot in slots.tolist():
            assert self.cache.allocator.refcount[slot // 4] == 1

    @precondition(lambda self: self.cache.tables)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.cache.tables)))
        self.cache.fork(parent, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.cache.tables)
    @rule(data=st.data())
    def free(self, data):
        self.cache.free_sequence(data.draw(st.sampled_from(sorted(self.cache.tables))))

    @invariant()
    def refcounts_match_tables(self):
        a = self.cache.allocator
        holders = [0] * a.num_blocks
        for table in self.cache.tables.values():
            for b in table:
                holders[b] += 1
        assert holders == a.refcount
        free = a._free
        assert len(set(free)) == len(free) and all(a.refcount[b] == 0 for b in free)
        assert len(free) + sum(1 for c in a.refcount if c) == a.num_blocks  # nothing leaked
        for s, table in self.cache.tables.items():
            assert len(table) == -(-self.cache.lens[s] // 4)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
