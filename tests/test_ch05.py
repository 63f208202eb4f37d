"""kvlib.course.ch05: chapter 05's harnesses compute what the notebook says they compute."""

import numpy as np
import pytest
import torch

from kvlib.course import ch05
from kvlib.paged import PagedKVCache, paged_decode_attention_ref
from kvlib.pool_sim import padded_batch_savings, sample_requests, simulate


@pytest.mark.parametrize("block_size, lens, H, H_KV, D", [
    (16, [1, 40, 100], 8, 2, 32),  # the notebook's shapes
    (5, [7, 23], 4, 4, 48),  # a block size that is no power of two, a head dim that is none either
    (1, [3, 17], 6, 1, 16),  # one position per block, MQA
    (32, [70], 2, 2, 64),  # a block larger than a tile
])
def test_the_minimal_kernel_matches_the_reference(block_size, lens, H, H_KV, D):
    q, k, v, tables, seq_lens = ch05.scattered_inputs(lens, block_size, H=H, H_KV=H_KV, D=D)
    ref = paged_decode_attention_ref(q, k, v, tables, seq_lens)
    torch.testing.assert_close(ch05.paged_decode_minimal(q, k, v, tables, seq_lens), ref, atol=1e-5, rtol=1e-5)


def test_the_minimal_kernel_reads_only_through_the_table():
    """Blocks the table does not name hold NaN: the output stays finite, so no position outside the table is read."""
    q, k, v, tables, seq_lens = ch05.scattered_inputs([9, 30], 8, spare=6)
    unused = sorted(set(range(k.shape[0])) - set(tables[tables >= 0].tolist()))
    k[unused], v[unused] = float("nan"), float("nan")
    last = [(int(n) - 1) // 8 for n in seq_lens]  # the partial last block's unused slots hold NaN too
    for b, i in enumerate(last):
        k[tables[b, i], int(seq_lens[b]) % 8 or 8:] = float("nan")
    out = ch05.paged_decode_minimal(q, k, v, tables, seq_lens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k, v, tables, seq_lens), atol=1e-5, rtol=1e-5)


def test_scattered_inputs_scatter_and_mark_unused_entries():
    q, k, v, tables, seq_lens = ch05.scattered_inputs([1, 40, 100], 16)
    used = tables[tables >= 0].tolist()
    assert len(used) == len(set(used)) == 1 + 3 + 7 and k.shape[0] == len(used) + 4
    assert (tables >= 0).sum(1).tolist() == [1, 3, 7] and seq_lens.tolist() == [1, 40, 100]


def test_kernel_checks_compare_every_block_size_split_and_dtype():
    table = ch05.kernel_checks(lens=(3, 20), block_sizes=(1, 5), splits=(1, 2), fp16_block_sizes=(5,))
    assert list(table.index) == [("float32", 1, 1), ("float32", 1, 2), ("float32", 5, 1), ("float32", 5, 2),
                                 ("float16", 5, 1), ("float16", 5, 2)]
    assert (table["max |kernel - reference|"] <= table["tolerance"]).all()
    fp16 = table.index.get_level_values("dtype") == "float16"
    assert (table["max |kernel - reference|"][fp16] > 0).all()  # fp16 really ran in fp16


def test_batch_savings_are_the_padded_batches_of_the_loop():
    lengths = np.array([r.prompt_len + r.output_len for r in sample_requests(200, seed=0)])
    got = ch05.batch_savings(lengths, batch=8, draws=50, min_ratio=4)
    rng, want = np.random.default_rng(0), []
    for _ in range(50):
        s = padded_batch_savings(rng.choice(lengths, size=8, replace=False).tolist(), block_size=16)
        if s["max_over_min"] > 4:
            want.append(s["saving"])
    assert got.tolist() == want and len(want) > 10


def test_policy_and_watermark_tables_hold_the_runs():
    requests = sample_requests(60, seed=0)
    results = {"contiguous": ch05.server_view(requests, 8192, "contiguous"),
               "paged, block 16": ch05.server_view(requests, 8192, "paged", block_size=16)}
    table = ch05.policy_table(results)
    assert table.loc["paged, block 16", "preemptions"] == results["paged, block 16"][0].preemptions
    assert table.loc["contiguous", "steps to finish"] == results["contiguous"][0].steps
    runs, free = ch05.watermark_runs(requests, 8192, (0.0, 0.1))
    wt = ch05.watermark_table(runs, free, sum(r.prompt_len for r in requests), 8192 // 16)
    assert wt.loc[0.1, "blocks kept free"] == 51 and wt.loc[0.0, "steps, prefill free"] == free[0.0].steps
    assert free[0.0].steps == free[0.0].iterations  # prefill free: steps are iterations


@pytest.mark.parametrize("policy, kw", [("contiguous", {}), ("contiguous", dict(max_len=4096)),
                                        ("paged", dict(block_size=16)), ("paged", dict(block_size=8, watermark=0.05))])
def test_server_view_changes_no_result_and_splits_the_reservation(policy, kw):
    requests = sample_requests(150, seed=3, arrival_rate=1.0)
    r, x = ch05.server_view(requests, 16384, policy, **kw)
    plain = simulate(requests, 16384, policy, **kw)
    assert (r.steps, r.preemptions, r.recomputed_tokens, r.utilization) == (
        plain.steps, plain.preemptions, plain.recomputed_tokens, plain.utilization)
    assert x["pool mean"] == pytest.approx(plain.pool_usage)  # the time-average is pool_sim's own pool_usage
    assert plain.pool_usage < x["pool peak"] <= 1
    # the paper's split of a reservation's waste adds up to pool_sim's reserved_waste; paged reserves nothing
    assert x["reserved"] + x["never written"] == pytest.approx(plain.reserved_waste)
    assert (x["reserved"] > 0 and x["never written"] > 0) == (policy == "contiguous")
    assert x["waiting"] >= 0
    from kvlib import pool_sim
    assert pool_sim._snapshot.__name__ == "_snapshot"  # the counter was put back


def test_server_view_peak_and_waiting_by_hand():
    """Two requests, a pool that holds one at a time: the second waits while the first runs."""
    from kvlib.pool_sim import Request

    reqs = [Request(0, 0, 3, 2), Request(1, 0, 2, 2)]
    r, x = ch05.server_view(reqs, 8, "contiguous", max_len=8)  # one row of 8 slots
    # iterations: (req 0: 4, 5 stored) then (req 1: 3, 4 stored); waiting 1, 1, 0, 0
    assert r.iterations == 4 and x["pool peak"] == 5 / 8 and x["pool mean"] == (4 + 5 + 3 + 4) / 8 / 4
    assert x["waiting"] == 2 / 4
    assert x["never written"] == pytest.approx((3 + 3 + 4 + 4) / 8 / 4)  # max_len - final length, per iteration
    assert x["reserved"] == pytest.approx((1 + 0 + 1 + 0) / 8 / 4)  # tokens still to come


def test_thrashing_follows_the_queue_not_the_burst():
    table = ch05.arrival_table(8192, (0.05, 2.0, None), n=120)
    assert table.loc[0.05, "requests waiting, mean"] < table.loc[2.0, "requests waiting, mean"]
    assert table.loc[0.05, "preemptions"] <= table.loc[2.0, "preemptions"]
    assert table.index[-1] == "all at step 0"


def test_watermark_seeds_divides_by_no_watermark():
    table = ch05.watermark_seeds(8192, (0.0, 0.05), seeds=(0, 1), n=80)
    assert (table[0.0] == 1).all() and list(table.index) == [0, 1]
    reqs = sample_requests(80, seed=1)
    want = simulate(reqs, 8192, "paged", block_size=16, watermark=0.05).steps / simulate(reqs, 8192, "paged").steps
    assert table.loc[1, 0.05] == round(want, 3)


def test_state_copies_what_a_refused_call_must_keep():
    cache = PagedKVCache(n_layers=1, num_blocks=4, block_size=2, n_kv_heads=1, head_dim=2, kernels="torch")
    cache.add_sequence("a")
    before = ch05.state(cache)
    cache.reserve(["a"], 3)
    assert ch05.state(cache) != before and before == ({"a": 0}, {"a": []}, [0, 0, 0, 0])


def test_hf_paged_says_why_it_skips(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.0"))  # no continuous batching
    table, why = ch05.hf_paged(None, [[1, 2]], 2)
    assert table is None and "no ContinuousBatchingConfig" in why and "skipped" in why
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed: import raises ImportError
    table, why = ch05.hf_paged(None, [[1, 2]], 2)
    assert table is None and "not installed" in why


def test_hf_paged_runs_transformers_paged_cache_beside_ours():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "ContinuousBatchingConfig"):
        pytest.skip("this transformers has no continuous batching")
    from kvlib.model import load_tiny

    model, tok = load_tiny(device="cpu")
    prompts = [tok.encode("def add(a, b):"), tok.encode("class Stack:")]
    table, why = ch05.hf_paged(model, prompts, n=6, page_size=16)
    assert why is None
    assert table["same tokens as kvlib"].tolist() == ["1/1", "2/2"] and (table["page_size"] == 16).all()
