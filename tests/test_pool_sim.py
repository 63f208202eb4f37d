"""Block-pool simulator: seeded workload, hand-checked small runs, recompute and watermark, the chapter-05
headline numbers."""

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


@pytest.fixture(scope="module")
def watermarked(workload):
    return {w: simulate(workload, CAP, "paged", block_size=16, watermark=w) for w in (0.0, 0.01, 0.02, 0.2)}


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
    p = simulate(r, 8, "paged", block_size=4, max_len=8, prefill_tokens_per_step=None)
    assert p.steps == p.iterations == 2 and p.utilization == pytest.approx((1 + 5 / 8) / 2)
    assert p.pool_usage == pytest.approx((4 / 8 + 5 / 8) / 2)
    assert p.internal_fragmentation == pytest.approx((0 + 3 / 8) / 2) and p.reserved_waste == 0
    c = simulate(r, 8, "contiguous", max_len=8, prefill_tokens_per_step=None)  # reserves 8 slots: 4/8 then 5/8
    assert c.block_size is None and c.steps == 2 and c.utilization == pytest.approx((4 / 8 + 5 / 8) / 2)
    assert c.reserved_waste == pytest.approx(1 - c.utilization) and c.internal_fragmentation == 0


def test_preemption_by_hand():
    # 2 blocks of 2 slots; A and B (prompt 1, output 3 each) take 1 block each at iteration 0. At
    # iteration 1, A needs a 2nd block: B (the most recently admitted) is preempted, keeping the 1 token
    # it generated, and A takes B's block. At iteration 2 the pool is still full, so B waits; A finishes.
    # At iteration 3 B is admitted again: its prompt and its kept token (2 tokens) are prefilled again,
    # then it generates tokens 2 and 3 at iterations 3 and 4.
    reqs = [Request(0, 0, 1, 3), Request(1, 0, 1, 3)]
    res = simulate(reqs, 4, "paged", block_size=2, max_len=4, record=True, prefill_tokens_per_step=None)
    assert res.preemptions == 1 and res.recomputed_tokens == 2 and res.prefill_tokens == 2 + 2
    assert res.iterations == res.steps == 5 and res.prefill_steps == 0
    assert res.finished == 2 and res.generated_tokens == 6
    assert res.snapshots == [[0, 1], [0, 0], [0, 0], [1, 1], [1, 1]]
    assert res.snapshot_fill == [[2, 2], [2, 1], [2, 2], [2, 1], [2, 2]]


def test_recompute_is_charged_as_prefill():
    # the same run with prefill charged: iteration 0 prefills 2 prompt tokens, iteration 3 re-prefills
    # B's 2 tokens. At 1 token per step that is 2 + 2 extra steps, at 2 tokens per step 1 + 1, and
    # a pass holds at most prefill_tokens_per_step tokens (ceil per iteration).
    reqs = [Request(0, 0, 1, 3), Request(1, 0, 1, 3)]
    for per_step, prefill_steps in ((1, 4), (2, 2), (256, 2)):
        res = simulate(reqs, 4, "paged", block_size=2, max_len=4, prefill_tokens_per_step=per_step)
        assert res.iterations == 5 and res.prefill_steps == prefill_steps
        assert res.steps == 5 + prefill_steps and res.tokens_per_step == pytest.approx(6 / res.steps)
    # without the preemption (a pool big enough), only the 2 prompt tokens are prefilled
    res = simulate(reqs, 16, "paged", block_size=2, max_len=4, prefill_tokens_per_step=1)
    assert res.preemptions == 0 and res.recomputed_tokens == 0 and res.prefill_tokens == 2
    assert res.iterations == 3 and res.prefill_steps == 2 and res.steps == 5


def test_watermark_holds_admission_back_by_hand():
    # 4 blocks of 4. A (prompt 4) takes 2 blocks, B (prompt 3) 1, C (prompt 1) 1: all fit at once.
    # watermark 0.25 keeps int(0.25 * 4) = 1 block free at admission, so C waits for A and B.
    reqs = [Request(0, 0, 4, 1), Request(1, 0, 3, 1), Request(2, 0, 1, 1)]
    free = simulate(reqs, 16, "paged", block_size=4, max_len=8, record=True, prefill_tokens_per_step=None)
    assert free.max_running == 3 and free.iterations == 1 and free.snapshots[0].count(-1) == 0
    held = simulate(reqs, 16, "paged", block_size=4, max_len=8, record=True, watermark=0.25,
                    prefill_tokens_per_step=None)
    assert held.watermark == 0.25 and held.max_running == 2 and held.iterations == 2
    assert held.snapshots == [[0, 0, 1, -1], [-1, -1, 2, -1]]
    # a watermark below one block (int(0.2 * 4) = 0) keeps nothing free, as in vLLM
    assert simulate(reqs, 16, "paged", block_size=4, max_len=8, watermark=0.2).max_running == 3


def test_growth_may_use_the_watermark_blocks():
    # 4 blocks of 2, watermark 0.25 (1 block kept free at admission). A (prompt 1, output 3) takes 1
    # block, B (prompt 2, output 2) 2 blocks, leaving exactly the watermark's block free. At iteration 1
    # A's 3rd token needs a 2nd block: it takes the kept-free one; nothing is preempted.
    reqs = [Request(0, 0, 1, 3), Request(1, 0, 2, 2)]
    res = simulate(reqs, 8, "paged", block_size=2, max_len=8, watermark=0.25, record=True)
    assert res.preemptions == 0 and res.snapshots[:2] == [[0, 1, 1, -1], [0, 1, 1, 0]]


def test_the_newest_request_preempts_itself():
    # 2 blocks of 4. A (prompt 2, output 3) and B (prompt 3, output 2) take 1 block each. At iteration 1
    # A still fits, B (the newest) needs a 2nd block and none is free: B preempts itself (vLLM's rule),
    # not the older A. At iteration 2 A takes B's old block and finishes; at iteration 3 B comes back,
    # its prompt and its 1 kept token (4 tokens) prefilled again, and finishes.
    reqs = [Request(0, 0, 2, 3), Request(1, 0, 3, 2)]
    res = simulate(reqs, 8, "paged", block_size=4, max_len=8, record=True, prefill_tokens_per_step=None)
    assert res.preemptions == 1 and res.recomputed_tokens == 4 and res.iterations == 4
    assert res.snapshots == [[0, 1], [0, -1], [0, 0], [1, 1]]
    assert res.snapshot_fill == [[3, 4], [4, 0], [4, 1], [4, 1]]


def test_admission_reserves_the_first_generated_token():
    # 2 blocks of 4. A (prompt 4) needs blocks for 5 tokens, i.e. both, at admission, so B waits
    # one step instead of being admitted and then preempted when A's first token arrives.
    reqs = [Request(0, 0, 4, 1), Request(1, 0, 1, 1)]
    res = simulate(reqs, 8, "paged", block_size=4, max_len=8, record=True, prefill_tokens_per_step=None)
    assert res.preemptions == 0 and res.max_running == 1 and res.steps == 2
    assert res.snapshots == [[0, 0], [1, -1]] and res.snapshot_fill == [[4, 1], [2, 0]]


# ---- invariants ---------------------------------------------------------------------------------


def test_conservation_and_shares_add_up(workload, runs, watermarked):
    total = sum(r.output_len for r in workload)
    prompts = sum(r.prompt_len for r in workload)
    for res in [*runs.values(), *watermarked.values()]:
        assert res.finished == len(workload) and res.generated_tokens == total
        assert res.tokens_per_step * res.steps == pytest.approx(total)
        assert res.steps == res.iterations + res.prefill_steps
        assert res.prefill_tokens == prompts + res.recomputed_tokens
        assert res.prefill_steps >= -(-res.prefill_tokens // pool_sim.PREFILL_TOKENS_PER_STEP)
        assert res.utilization + res.internal_fragmentation + res.reserved_waste == pytest.approx(1)
        assert res.max_running >= res.mean_running > 0 and 0 < res.pool_usage <= res.utilization
        assert (res.preemptions == 0) == (res.recomputed_tokens == 0)
    assert runs["contiguous"].preemptions == 0 and runs["contiguous"].recomputed_tokens == 0
    assert runs["contiguous"].max_running == CAP // 2048  # 32 rows of max_len


def test_block_size_one_wastes_nothing():
    reqs = sample_requests(200, seed=1)
    res = simulate(reqs, 1 << 20, "paged", block_size=1)  # a big pool: no preemption
    assert res.preemptions == 0 and res.utilization == 1.0 and res.internal_fragmentation == 0


def test_paged_beats_contiguous_on_the_default_workload(runs):
    # measured (seed 0, 1000 requests, 64K slots): contiguous 0.267, paged/16 0.988
    assert runs[16].utilization > 0.95 and runs["contiguous"].utilization < 0.35
    assert runs[16].mean_running > 2.5 * runs["contiguous"].mean_running  # measured 88.2 vs 28.1
    assert runs[16].steps < 0.5 * runs["contiguous"].steps  # measured 4269 vs 9710 (prefill charged)


def test_without_a_watermark_the_default_workload_thrashes(workload, runs):
    # every request arrives at once: admission fills the pool, growth then preempts over and over.
    # measured: 1102 preemptions, 180,302 tokens re-prefilled > the 157,248 prompt tokens of the workload
    p16 = runs[16]
    assert p16.preemptions > len(workload) * 0.8
    assert p16.recomputed_tokens > sum(r.prompt_len for r in workload)
    assert p16.prefill_steps > 0.3 * p16.steps  # measured 1549 of 4269 steps


def test_watermark_cuts_preemption_and_time(watermarked):
    # measured: watermark 0 / 0.01 / 0.02 / 0.2: preemptions 1102 / 159 / 49 / 0,
    # re-prefilled 180,302 / 24,238 / 7,211 / 0 tokens, steps 4269 / 3559 / 3493 / 3809
    w0, w1, w2, w20 = (watermarked[w] for w in (0.0, 0.01, 0.02, 0.2))
    assert w1.preemptions < 0.25 * w0.preemptions and w2.recomputed_tokens < 0.1 * w0.recomputed_tokens
    assert w20.preemptions == 0 and w20.recomputed_tokens == 0
    # fewer re-prefills: less time, although fewer requests run at once ...
    assert w2.steps < 0.9 * w0.steps and w2.mean_running < w0.mean_running
    # ... which holds only because recomputation is charged (see the next test)
    # too high a watermark leaves blocks idle: the pool holds fewer tokens and the run takes longer
    assert w20.pool_usage < w2.pool_usage and w20.steps > w2.steps


def test_with_free_prefill_the_watermark_only_costs(workload):
    kw = dict(block_size=16, prefill_tokens_per_step=None)
    w0 = simulate(workload, CAP, "paged", watermark=0.0, **kw)
    w2 = simulate(workload, CAP, "paged", watermark=0.02, **kw)
    assert w0.steps == w0.iterations and w2.steps <= w0.steps * 1.02  # (measured 2720 vs 2741)
    assert w2.steps >= w0.steps  # so the gain in test_watermark_cuts_preemption_and_time comes from prefill


def test_internal_fragmentation_shrinks_with_smaller_blocks(runs):
    frags = [runs[bs].internal_fragmentation for bs in (1, 8, 16, 32, 128)]
    assert frags[0] == 0 and frags == sorted(frags) and len(set(frags)) == 5
    assert frags[-1] > 0.05  # 128-slot blocks: measured 0.094


def test_tiny_pool_preempts_and_everything_finishes():
    reqs = sample_requests(40, seed=1, mean_prompt=20, mean_output=30, max_len=128)
    res = simulate(reqs, 256, "paged", block_size=8, max_len=128)
    assert res.preemptions > 10 and res.recomputed_tokens > 0
    assert res.finished == 40 and res.generated_tokens == sum(r.output_len for r in reqs)


def test_snapshots_match_the_pool():
    reqs = sample_requests(30, seed=2, mean_prompt=20, mean_output=30, max_len=128)
    res = simulate(reqs, 512, "paged", block_size=8, max_len=128, record=True)
    assert len(res.snapshots) == len(res.snapshot_fill) == res.iterations < res.steps
    for owner, fill in zip(res.snapshots, res.snapshot_fill):
        assert len(owner) == 512 // 8
        assert all((o == -1) == (f == 0) and 0 <= f <= 8 for o, f in zip(owner, fill))
    c = simulate(reqs, 512, "contiguous", max_len=128, record=True)
    assert len(c.snapshots[0]) == 512 // 16 and c.snapshots[0].count(-1) == 0  # 4 rows, all reserved


def test_arrivals_leave_idle_steps_out_of_utilization():
    reqs = [Request(0, 0, 4, 4), Request(1, 100, 4, 4)]
    res = simulate(reqs, 64, "paged", block_size=1, max_len=16)
    assert res.iterations == 104 and res.utilization == 1.0 and res.mean_running == pytest.approx(8 / 104)
    assert res.prefill_steps == 2 and res.steps == 106  # one prefill pass for each prompt


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
    with pytest.raises(ValueError, match="request 0.*watermark=0.5"):  # 5 blocks, 2 kept free: 3 < 5 needed
        simulate(reqs, 20, "paged", block_size=4, watermark=0.5)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="watermark"):
            simulate(reqs, 1024, "paged", watermark=bad)
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="prefill_tokens_per_step"):
            simulate(reqs, 1024, "paged", prefill_tokens_per_step=bad)
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
