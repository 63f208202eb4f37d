"""kvlib.course.ch11a: the chapter's harnesses compute what the notebook says they compute."""

import time

import pytest
import torch

import kvlib  # noqa: F401  (sets the mode before Triton is imported)
from kvlib import runtime
from kvlib.course import ch11a


def test_the_clock_is_this_thread_s_cpu_time():
    if runtime.DEVICE == "cuda":
        pytest.skip("on a GPU the clock is wall time")
    _, s = ch11a.timed(lambda: time.sleep(0.2))  # sleeping uses no CPU
    assert s < 0.05


def test_rollback_table_equal_except_the_evicting_cache():
    table = ch11a.rollback_table(seeds=(0,))
    assert (table.iloc[:-1]["seed 0"] == "equal").all() and table.iloc[:-1]["truncate says exact"].all()
    assert table.iloc[-1]["seed 0"] == "DIFFERENT" and not table.iloc[-1]["truncate says exact"]


def test_a_wrong_rollback_is_caught():
    """The twin comparison is not blind: a truncate that keeps one row too many differs from the twin."""
    from kvlib.cache import KVCache

    class OffByOne(KVCache):
        def truncate(self, b, length):
            return super().truncate(b, min(length + 1, int(self.seq_lens[b])))

    equal, _ = ch11a.accept_reject(lambda: OffByOne(2, 1, ch11a.HKV_, 128, ch11a.D_, kernels="torch"), seed=0)
    assert not equal


def test_leviathan_and_the_simulation_agree():
    assert ch11a.leviathan(0.5, 2) == pytest.approx(1.75) and ch11a.leviathan(1.0, 8) == 9.0
    assert ch11a.iid_spread(1.0, [8, 8, 3])[0] == pytest.approx((9 + 9 + 4) / 3)
    assert ch11a.iid_spread(0.0, [8, 8])[0] == 1.0
    mean, lo, hi = ch11a.iid_spread(0.8, [4] * 2000, n_sims=200)
    assert mean == pytest.approx(ch11a.leviathan(0.8, 4), rel=0.02) and lo < mean < hi


def _run(task, k, n, drafted, accepted, seconds):
    return ch11a.SpeedRun(task, k, list(range(n)), drafted, accepted, seconds, 10)


def test_the_prediction_charges_each_step_its_actual_draft_length():
    cost = {T: float(T) for T in range(1, 10)}  # a forward over T costs T
    run = _run("chat", 4, 11, [0, 0, 4, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [1.0])
    p = ch11a.predicted(run, cost, prefill_ms=10.0)
    assert p["predicted (actual draft lengths)"] == pytest.approx((10 + 10 * 1) / (10 + 6 * 1 + 5))
    assert p["old prediction (k + 1 every step)"] == pytest.approx((10 / 7) * 1 / 5)


def test_verdicts_only_where_the_ranges_separate():
    runs = [_run("t", 0, 10, [], [], [1.0, 1.1, 1.2, 1.05, 1.15]),
            _run("t", 1, 10, [1] * 5, [1] * 5, [0.5, 0.6, 0.7, 0.55, 0.65]),
            _run("t", 2, 10, [2] * 5, [0] * 5, [1.15, 1.3, 1.4, 1.25, 1.35]),
            _run("t", 4, 10, [4] * 3, [0] * 3, [1.5, 1.6, 1.7, 1.55, 1.65])]
    lines = ch11a.speed_verdicts(runs)
    assert lines[0].endswith("faster than plain") and lines[1].endswith("not separated")
    assert lines[2].endswith("slower than plain")
    few = [_run(r.task, r.k, 10, r.drafted, r.accepted, r.seconds[:3]) for r in runs]  # 3 against 3: never a call
    assert all("fewer than 5 runs" in line for line in ch11a.speed_verdicts(few))
    assert ch11a.chance_separation(3, 3) == pytest.approx(0.1) and ch11a.chance_separation(5, 5) == pytest.approx(2 / 252)


def test_zero_steps_tells_all_or_nothing_from_independence():
    drafted, accepted = [7] + [8] * 10, [0, 8, 8, 8, 8, 4, 0, 6, 0, 0, 0]  # the code run's shape
    z = ch11a.zero_steps(drafted, accepted, n_sims=4000)
    assert z["accepting nothing"] == 5 and z["expected"] == pytest.approx(11 * 7 / 49)
    assert z["exact"] == pytest.approx(0.01295, abs=1e-4) and z["simulated"] < 0.01
    spread = ch11a.zero_steps([4] * 12, [4, 3, 4, 2, 4, 4, 1, 4, 3, 4, 0, 4], n_sims=4000)  # one empty step
    assert spread["exact"] > 0.2 and spread["simulated"] > 0.05


def test_alpha_counts_checked_drafts():
    table = ch11a.alpha_table([_run("t", 4, 9, [4, 4, 2], [4, 1, 0], [1.0])])
    row = table.iloc[0]
    assert (row.accepted, row.checked, row.drafted) == (5, 7, 10) and row.alpha == pytest.approx(5 / 7)
    assert row["alpha 95% low"] < row.alpha < row["alpha 95% high"]


def test_the_rejection_rule_is_within_noise_and_the_wrong_rules_are_not():
    p = torch.tensor([0.05, 0.40, 0.25, 0.15, 0.10, 0.05])
    q = torch.tensor([0.30, 0.05, 0.05, 0.30, 0.20, 0.10])
    tv = ch11a.rule_distances(p, q, n_draws=4000, n_null=50)
    assert tv["speculative_accept (sampled)"] <= tv["noise limit"]
    assert tv["accept iff p >= q (exact)"] == pytest.approx(0.35, abs=1e-6)  # computed by hand from p and q
    assert tv["draw from p after a rejection (exact)"] > 5 * tv["noise limit"]


def test_k_evidence_counts_the_steps_by_tokens_fed():
    runs = [_run("t", 0, 11, [], [], [1.0]), _run("t", 2, 11, [0, 2, 2, 0, 1], [0, 2, 1, 0, 1], [1.0])]
    ev = ch11a.k_evidence(runs, {T: 1 + 0.5 * (T - 1) for T in range(1, 10)})
    row = ev.iloc[0]
    assert row["steps by tokens fed (T: steps)"] == {1: 2, 2: 1, 3: 2}
    assert row["cost of the steps (forwards over 1)"] == pytest.approx(2 + 1.5 + 2 * 2)
