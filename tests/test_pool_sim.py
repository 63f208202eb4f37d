"""Block-pool simulator: seeded workload, hand-checked small runs, the chapter-05 headline numbers."""

import ast
import inspect
import statistics

import pytest

from kvlib import pool_sim
from kvlib.pool_sim import Request, padded_batch_savings, sample_requests, simulate

CAP = 64 * 1024  # the chapter's pool: 64K token slots


@pytest.fixture(scope="module")
def workload():
    return sample_requests(1000, seed=0)


@pytest.fixture(scope="module")
def runs(workload):
    out = {"contiguous": simulate(workload, CAP, "contiguous")}
    for bs in (1, 8, 16, 32, 128):
        out[bs] = simulate(workload, CAP, "paged", block_size=bs)
    return out


# ---- the workload ----------------------------------------------------------------------------


def test_sample_requests_is_seeded_and_within_bounds():
    a, b = sample_requests(500, seed=3), sample_requests(500, seed=3)
    assert a == b and a != sample_requests(500, seed=4)
    reqs = sample_requests(2000, seed=0, max_len=512)
    assert [r.rid for r in reqs] == list(range(2000)) and all(r.arrival == 0 for r in reqs)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= 512 for r in reqs)
    assert max(r.prompt_len + r.output_len for r in reqs) == 512  # the long tail reaches the clip


def test_sample_requests_means_tail_and_arrivals(workload):
    prompts = [r.prompt_len for r in workload]
    outputs = [r.output_len for r in workload]
    assert 140 < statistics.mean(prompts) < 175 and 215 < statistics.mean(outputs) < 260
    assert statistics.median(outputs) < 0.75 * statistics.mean(outputs)  # long-tailed: median well below mean
    arr = sample_requests(2000, seed=0, arrival_rate=0.5)
    steps = [r.arrival for r in arr]
    assert steps == sorted(steps) and steps[0] >= 0
    assert 0.8 * 4000 < steps[-1] < 1.2 * 4000  # 2000 requests at 0.5 per step


# ---- small runs checked by hand ----------------------------------------------------------------


def test_one_request_by_hand():
    # prompt 3, output 2, block 4. Step 0: prompt + 1st token = 4 tokens in 1 block (4/4).
    # Step 1: the 5th token crosses into a 2nd block (5/8). Then it finishes.
    r = [Request(rid=0, arrival=0, prompt_len=3, output_len=2)]
    p = simulate(r, 8, "paged", block_size=4, max_len=8)
    assert p.steps == 2 and p.utilization == pytest.approx((1 + 5 / 8) / 2)
    assert p.internal_fragmentation == pytest.approx((0 + 3 / 8) / 2) and p.reserved_waste == 0
    c = simulate(r, 8, "contiguous", max_len=8)  # reserves 8 slots: 4/8 then 5/8
    assert c.block_size is None and c.steps == 2 and c.utilization == pytest.approx((4 / 8 + 5 / 8) / 2)
    assert c.reserved_waste == pytest.approx(1 - c.utilization) and c.internal_fragmentation == 0


def test_preemption_by_hand():
    # 2 blocks of 2 slots; A and B each take 1 block at step 0. At step 1, A needs a 2nd block:
    # B (the most recently admitted) is preempted, losing its 1 generated token, and A takes B's
    # block. At step 2 the pool is still full, so B waits; A finishes and frees both blocks.
    # B is readmitted at step 3 and generates its 3 tokens again: steps 3, 4, 5.
    reqs = [Request(0, 0, 1, 3), Request(1, 0, 1, 3)]
    res = simulate(reqs, 4, "paged", block_size=2, max_len=4, record=True)
    assert res.preemptions == 1 and res.recomputed_tokens == 1 and res.steps == 6
    assert res.finished == 2 and res.generated_tokens == 6
    assert res.snapshots[:4] == [[0, 1], [0, 0], [0, 0], [1, -1]]
    assert res.snapshot_fill[:4] == [[2, 2], [2, 1], [2, 2], [2, 0]]


def test_admission_reserves_the_first_generated_token():
    # 2 blocks of 4. A (prompt 4) needs blocks for 5 tokens, i.e. both, at admission, so B waits
    # one step instead of being admitted and then preempted when A's first token arrives.
    reqs = [Request(0, 0, 4, 1), Request(1, 0, 1, 1)]
    res = simulate(reqs, 8, "paged", block_size=4, max_len=8, record=True)
    assert res.preemptions == 0 and res.max_running == 1 and res.steps == 2
    assert res.snapshots == [[0, 0], [1, -1]] and res.snapshot_fill == [[4, 1], [2, 0]]


# ---- invariants ---------------------------------------------------------------------------------


def test_conservation_and_shares_add_up(workload, runs):
    total = sum(r.output_len for r in workload)
    for res in runs.values():
        assert res.finished == len(workload) and res.generated_tokens == total
        assert res.tokens_per_step * res.steps == pytest.approx(total)
        assert res.utilization + res.internal_fragmentation + res.reserved_waste == pytest.approx(1)
        assert res.max_running >= res.mean_running > 0
    assert runs["contiguous"].preemptions == 0 and runs["contiguous"].recomputed_tokens == 0
    assert runs["contiguous"].max_running == CAP // 2048  # 32 rows of max_len


def test_block_size_one_wastes_nothing():
    reqs = sample_requests(200, seed=1)
    res = simulate(reqs, 1 << 20, "paged", block_size=1)  # a big pool: no preemption
    assert res.preemptions == 0 and res.utilization == 1.0 and res.internal_fragmentation == 0


def test_paged_beats_contiguous_on_the_default_workload(runs):
    # measured (seed 0, 1000 requests, 64K slots): contiguous 0.267, paged/16 0.988
    assert runs[16].utilization > 0.95 and runs["contiguous"].utilization < 0.35
    assert runs[16].mean_running > 2.5 * runs["contiguous"].mean_running  # measured 89.0 vs 28.1
    assert runs[16].steps < 0.4 * runs["contiguous"].steps  # measured 2725 vs 8527


def test_internal_fragmentation_shrinks_with_smaller_blocks(runs):
    frags = [runs[bs].internal_fragmentation for bs in (1, 8, 16, 32, 128)]
    assert frags[0] == 0 and frags == sorted(frags) and len(set(frags)) == 5
    assert frags[-1] > 0.05  # 128-slot blocks: measured 0.095


def test_tiny_pool_preempts_and_everything_finishes():
    reqs = sample_requests(40, seed=1, mean_prompt=20, mean_output=30, max_len=128)
    res = simulate(reqs, 256, "paged", block_size=8, max_len=128)
    assert res.preemptions > 10 and res.recomputed_tokens > 0
    assert res.finished == 40 and res.generated_tokens == sum(r.output_len for r in reqs)


def test_snapshots_match_the_pool():
    reqs = sample_requests(30, seed=2, mean_prompt=20, mean_output=30, max_len=128)
    res = simulate(reqs, 512, "paged", block_size=8, max_len=128, record=True)
    assert len(res.snapshots) == len(res.snapshot_fill) == res.steps
    for owner, fill in zip(res.snapshots, res.snapshot_fill):
        assert len(owner) == 512 // 8
        assert all((o == -1) == (f == 0) and 0 <= f <= 8 for o, f in zip(owner, fill))
    c = simulate(reqs, 512, "contiguous", max_len=128, record=True)
    assert len(c.snapshots[0]) == 512 // 16 and c.snapshots[0].count(-1) == 0  # 4 rows, all reserved


def test_arrivals_leave_idle_steps_out_of_utilization():
    reqs = [Request(0, 0, 4, 4), Request(1, 100, 4, 4)]
    res = simulate(reqs, 64, "paged", block_size=1, max_len=16)
    assert res.steps == 104 and res.utilization == 1.0 and res.mean_running == pytest.approx(8 / 104)


# ---- one batch, padded vs paged ----------------------------------------------------------------


def test_padded_batch_savings_by_hand():
    s = padded_batch_savings([100, 400], block_size=16)
    assert s == {"padded_slots": 800, "paged_slots": 112 + 400, "saving": 1 - 512 / 800, "max_over_min": 4.0}
    s = padded_batch_savings([1, 16, 17], block_size=16)
    assert s["padded_slots"] == 51 and s["paged_slots"] == 16 + 16 + 32
    assert s["saving"] < 0  # rounding up to blocks can cost more than padding short, equal-ish rows
    assert padded_batch_savings([5, 5], block_size=1)["saving"] == 0


# ---- errors and purity --------------------------------------------------------------------------


def test_errors_name_the_argument():
    reqs = [Request(0, 0, 10, 10)]
    with pytest.raises(ValueError, match="policy"):
        simulate(reqs, 1024, "buddy")
    with pytest.raises(ValueError, match="block_size"):
        simulate(reqs, 1024, "paged", block_size=0)
    with pytest.raises(ValueError, match="capacity_tokens=1000.*max_len=2048"):
        simulate(reqs, 1000, "contiguous")
    with pytest.raises(ValueError, match="request 0.*capacity_tokens=16"):
        simulate(reqs, 16, "paged", block_size=4)
    with pytest.raises(ValueError, match="request 0.*max_len=8"):
        simulate(reqs, 1024, "paged", max_len=8)
    with pytest.raises(ValueError, match="block_size"):
        padded_batch_savings([1, 2], block_size=0)
    with pytest.raises(ValueError, match="lengths"):
        padded_batch_savings([])


def test_simulator_does_not_use_torch():
    tree = ast.parse(inspect.getsource(pool_sim))
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert "torch" not in imported and "triton" not in imported
