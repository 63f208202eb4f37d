"""Lab 05's checkers: the allocator replay, the slot read off the picture and the block-size decision diagnose
the known wrong answers (kvlib.course.ch05, kvlib.course.mistakes.lab05)."""

import pytest

from kvlib.course import ch05, mistakes
from kvlib.course.check import CheckFailed
from kvlib.paged import BlockAllocator, OutOfBlocksError, PagedKVCache


def failure(call) -> str:
    with pytest.raises(CheckFailed) as err:
        call()
    return str(err.value)


# ---------------------------------------------------------------- exercise 1 -------------------------


class FromTheFront(BlockAllocator):
    """Hands out the oldest free block (a queue) instead of the last one freed (a stack)."""

    def allocate(self, n=1):
        if n > len(self._free):
            raise OutOfBlocksError("too few")
        blocks = [self._free.pop(0) for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks


class TakesBeforeRefusing(BlockAllocator):
    """Pops what it can, then raises: a refused request changed the pool."""

    def allocate(self, n=1):
        blocks = []
        for _ in range(n):
            if not self._free:
                raise OutOfBlocksError(f"asked for {n} block(s) but only {len(blocks)} are free")
            blocks.append(self._free.pop())
            self.refcount[blocks[-1]] = 1
        return blocks


class NoCheck(BlockAllocator):
    def free(self, block):
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
        return self.refcount[block] == 0


def test_the_reference_allocator_passes_the_replay(capsys):
    assert ch05.replay_allocator(BlockAllocator) is True
    assert ch05.allocator_error_cases(BlockAllocator) is True
    assert "300 of 300 agree" in capsys.readouterr().out


@pytest.mark.parametrize("cls, words", [(FromTheFront, "stack"), (TakesBeforeRefusing, "a refused call changes nothing"),
                                        (NoCheck, "ValueError")])
def test_the_replay_names_the_mistake(cls, words):
    report = failure(lambda: ch05.replay_allocator(cls))
    assert "FAIL ✗" in report and "first difference at step" in report
    assert words in report


def test_a_silent_refusal_message_fails():
    class Quiet(BlockAllocator):
        def allocate(self, n=1):
            if n > self.num_free:
                raise OutOfBlocksError("no")
            return super().allocate(n)

    assert "asked for (6)" in failure(lambda: ch05.allocator_error_cases(Quiet))


# ---------------------------------------------------------------- exercise 2 -------------------------


@pytest.fixture()
def shuffled():
    cache = PagedKVCache(n_layers=1, num_blocks=10, block_size=4, n_kv_heads=1, head_dim=2, kernels="torch")
    cache.allocator.allocate(10)
    for b in [0, 2, 8, 4, 6, 1, 9, 3, 7, 5]:
        cache.allocator.free(b)
    for seq, n in [("A", 11), ("B", 5), ("C", 7)]:
        cache.add_sequence(seq)
        cache.reserve([seq], n)
        cache.lens[seq] += n
    return cache


def test_the_slot_guess_passes_with_the_caches_own_slot(shuffled, capsys):
    assert shuffled.tables["A"] == [5, 7, 3]
    assert ch05.check_slot_guess(shuffled, "A", 9, 13) is True
    assert "yours 13  reference 13  ✓" in capsys.readouterr().out


@pytest.mark.parametrize("guess, words", [
    (9, "the position itself"),
    (4, "its slots start at 3 × 4 = 12"),  # block 3 + offset 1, not times block_size
    (21, "global offset"),  # 3 * 4 + 9
    (2 * 4 + 1, "keeps it in physical block 3"),  # logical block 2's slot is the position itself: the table was skipped
])
def test_wrong_slot_guesses_are_diagnosed(shuffled, guess, words):
    report = failure(lambda: ch05.check_slot_guess(shuffled, "A", 9, guess))
    assert "FAIL ✗" in report and words in report


def test_logical_instead_of_physical_is_named():
    assert "physical block 7" in mistakes.slot_by_hand([5, 7, 3], 5, 4, 1 * 4 + 1)  # the table skipped
    assert "not 2" in mistakes.slot_by_hand([5, 7, 3], 5, 4, 3 * 4 + 1)  # the next table entry's block
    assert mistakes.slot_by_hand([5, 7, 3], 5, 4, 999) == ""


@pytest.mark.parametrize("guess, words", [
    (12, "slot 0 inside it is not"),  # right block (3), offset off by one
    (14, "slot 2 inside it is not"),
    (7 * 4 + 1, "table entry 1 (block 7)"),  # the neighbouring (previous) table entry
])
def test_near_misses_are_diagnosed(shuffled, guess, words):
    report = failure(lambda: ch05.check_slot_guess(shuffled, "A", 9, guess))
    assert "FAIL ✗" in report and words in report


# ---------------------------------------------------------------- exercise 5 -------------------------


@pytest.mark.parametrize("workload", list(ch05.WORKLOADS))
def test_the_policy_picks_the_largest_block_within_the_tolerance(workload):
    ev = ch05.block_size_evidence(workload)
    ref = ch05.block_size_answer(ev)
    assert ev.loc[ref, "vs fastest"] <= ch05.TOLERANCE
    assert all(ev.loc[bs, "vs fastest"] > ch05.TOLERANCE for bs in ev.index if bs > ref)
    assert ev["vs fastest"].min() == 0


def test_the_two_workloads_want_different_block_sizes():
    answers = {w: ch05.block_size_answer(ch05.block_size_evidence(w)) for w in ch05.WORKLOADS}
    assert answers["short chat"] < answers["long answers"]  # the lesson: no size fits every mix
    assert 16 in answers.values() and answers["long answers"] != 16  # vLLM's default fits one mix, not the other


@pytest.mark.parametrize("workload", list(ch05.WORKLOADS))
def test_the_decision_is_not_a_knife_edge(workload):
    """The answer stands on other draws of the same traffic (seeds 5-9), and the tolerance has room on both sides:
    every tolerance at least one percentage point either side of TOLERANCE gives the same block size."""
    ev = ch05.block_size_evidence(workload)
    ref = ch05.block_size_answer(ev)
    assert ch05.block_size_answer(ch05.block_size_evidence(workload, seeds=(5, 6, 7, 8, 9))) == ref
    lo, hi = ch05.tolerance_range(ev)
    assert lo <= ch05.TOLERANCE - 0.01 and hi >= ch05.TOLERANCE + 0.01
    assert ch05.block_size_answer(ev, lo) == ref and ch05.block_size_answer(ev, hi - 1e-9) == ref


def test_the_evidence_averages_the_seeds():
    from kvlib.pool_sim import sample_requests, simulate

    ev = ch05.block_size_evidence("short chat", block_sizes=(8, 32), seeds=(0, 1))
    w = ch05.WORKLOADS["short chat"]
    steps = [simulate(sample_requests(seed=s, **w["requests"]), w["capacity_tokens"], "paged", block_size=32,
                      max_len=w["max_len"], watermark=0.01).steps for s in (0, 1)]
    assert ev.loc[32, "steps to finish (mean)"] == sum(steps) / 2
    assert ev.loc[32, "vs fastest, seed min"] <= ev.loc[32, "vs fastest"] <= ev.loc[32, "vs fastest, seed max"]


def test_the_prediction_is_checked(capsys):
    assert ch05.check_prediction("long answers") is True
    assert "PASS ✓" in capsys.readouterr().out
    assert "unused tail" in failure(lambda: ch05.check_prediction("short chat"))
    assert "name one of" in failure(lambda: ch05.check_prediction("both"))


@pytest.mark.parametrize("workload", list(ch05.WORKLOADS))
def test_every_wrong_block_size_is_diagnosed(workload, capsys):
    ref = ch05.block_size_answer(ch05.block_size_evidence(workload))
    assert ch05.check_block_size_choice(workload, ref) is True
    assert "PASS ✓" in capsys.readouterr().out
    for bs in ch05.BLOCK_CHOICES:
        if bs == ref:
            continue
        report = failure(lambda: ch05.check_block_size_choice(workload, bs))
        assert "FAIL ✗" in report and "Diagnosis:" in report
        assert ("so is block" in report) if bs < ref else ("more steps than the fastest" in report)
        assert ("vLLM's default" in report) == (bs == 16)


def test_a_choice_outside_the_candidates_is_named():
    assert "not one of the candidates" in failure(lambda: ch05.check_block_size_choice("short chat", 24))
    assert "a block size is one of" in failure(lambda: ch05.check_block_size_choice("short chat", "big"))


def test_the_diagnoses_are_one_line_each():
    ev = ch05.block_size_evidence("short chat")
    for bs in ch05.BLOCK_CHOICES:
        why = mistakes.block_size_choice(ev, bs, 16, ch05.TOLERANCE)
        assert "\n" not in why and len(why.split()) <= 60


# ---------------------------------------------------------------- exercise 4 -------------------------


def test_an_unguarded_merge_of_an_empty_block_is_diagnosed():
    torch = pytest.importorskip("torch")
    from kvlib.course.check import check

    outs = torch.randn(3, 2, 4)
    lses = torch.randn(3, 2)
    outs_e = torch.cat([outs, torch.full((1, 2, 4), float("nan"))])
    lses_e = torch.cat([lses, torch.full((1, 2), float("-inf"))])
    w = torch.exp(lses - lses.max(0).values)[..., None]
    want = (w * outs).sum(0) / w.sum(0)
    unguarded = (torch.exp(lses_e - lses_e.max(0).values)[..., None] * outs_e).sum(0)
    assert unguarded.isnan().all()  # the plain formula spreads the NaN
    report = failure(lambda: check(unguarded / 1.0, want, name="x", mistakes=mistakes.combine_blocks(outs_e, lses_e)))
    assert "0 × NaN is NaN" in report
    assert len(mistakes.combine_blocks(outs, lses)) == 4  # without an empty block: the four earlier diagnoses
