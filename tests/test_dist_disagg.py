"""kvlib.dist.disagg: a prefill worker and a decode worker as two real processes (gloo, one thread each).

One launch carries several checks (spawning costs seconds): token identity against one colocated engine, a damaged
and a failed transfer recovered by recompute, a decode-only request that runs while transfers arrive, the receiver's
own block tables, the bytes sent. The remap and the bad inputs are checked in this process.
"""

import random

import pytest
import torch

from kvlib.dist import disagg, launch
from kvlib.engine import Engine
from kvlib.model import load_tiny
from kvlib.paged import OutOfBlocksError, PagedKVCache

ENGINE = dict(num_blocks=48, block_size=16, max_num_seqs=8, max_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()[0]


def _spec(damage):
    rng = random.Random(3)
    reqs = [dict(prompt=[rng.randrange(256) for _ in range(n)], max_new=6) for n in (40, 17, 64, 33, 16)]
    reqs[4].update(local=True, max_new=20)  # decodes on rank 1 from the start, while the others arrive
    return disagg.check_spec(dict(model="tiny", requests=reqs, engine=dict(ENGINE), damage=damage))


@pytest.fixture(scope="module")
def launched():
    spec = _spec({1: "corrupt", 3: "fail"})
    sent, got = launch.run(disagg.disagg_worker, 2, spec, timeout_s=90)
    return spec, sent, got


def test_disaggregated_is_token_identical_and_damage_is_recomputed(tiny, launched):
    spec, sent, got = launched
    e = Engine(tiny, **ENGINE)
    ids = [e.add_request(r["prompt"], r["max_new"]) for r in spec["requests"]]
    ref = e.run()
    out = got["out"]
    assert [out[i]["tokens"] for i in range(5)] == [ref[i] for i in ids]
    assert [out[i]["how"] for i in range(5)] == ["transfer", "recompute", "transfer", "recompute", "local"]
    assert out[1]["why"] == disagg.WHY_DAMAGED and out[3]["why"] == disagg.WHY_FAILED
    assert out[0]["why"] is None and out[2]["why"] is None


def test_what_was_sent_and_where_it_went(tiny, launched):
    spec, sent, got = launched
    per_block = disagg.block_bytes(tiny, 16)
    assert per_block == 2 * 4 * 16 * 8 * 32 * 4
    for i in (0, 1, 2):  # K/V went: the header, prompt, table and both tensors in one
        s = sent["sent"][i]
        n = -(-len(spec["requests"][i]["prompt"]) // 16)
        assert s["n_blocks"] == n == len(s["table"])
        assert s["bytes"] == 8 * len(disagg.HEADER) + 8 * len(spec["requests"][i]["prompt"]) + 8 * n + n * per_block
    n3 = len(spec["requests"][3]["prompt"])
    assert sent["sent"][3]["bytes"] == 8 * (len(disagg.HEADER) + n3)  # a failed transfer: the prompt, no blocks
    assert 4 not in sent["sent"]  # the local request never left rank 1
    tables = [got["out"][i]["table"] for i in (0, 2)]
    assert all(t is not None and len(set(t)) == len(t) for t in tables)
    assert all(0 <= b < ENGINE["num_blocks"] for t in tables for b in t)


@torch.no_grad()
def test_install_blocks_remaps_into_the_receivers_free_blocks(tiny):
    from kvlib.course import ch12b

    case = ch12b.remap_case(tiny)
    assert case["equal"] and case["untouched"]
    assert not set(case["table"]) & set(case["busy"])
    # all-or-nothing: a receiver without room changes nothing
    full = PagedKVCache.for_model(tiny, 2, 16)
    _, k, v = _gathered(tiny)
    with pytest.raises(OutOfBlocksError):
        disagg.install_blocks(full, "x", k, v, list(range(40)))
    assert full.allocator.num_free == 2 and "x" not in full.tables


@torch.no_grad()
def _gathered(model):
    c = PagedKVCache.for_model(model, 8, 16)
    c.add_sequence("s")
    prompt = list(range(40))
    model(torch.tensor([prompt]), cache=c.batch(["s"], [prompt]))
    return disagg.gather_blocks(c, "s")


def test_checksum_sees_one_changed_value(tiny):
    _, k, v = _gathered(tiny)
    k2 = k.clone()
    k2.view(-1)[5] += 1e-6
    assert disagg.checksum(k, v) == disagg.checksum(k.clone(), v.clone())
    assert disagg.checksum(k2, v) != disagg.checksum(k, v)


def test_bad_inputs_name_the_argument(tiny):
    with pytest.raises(TypeError, match="spec must be a dict"):
        disagg.check_spec([1, 2])
    with pytest.raises(ValueError, match="spec needs 'engine'"):
        disagg.check_spec(dict(model="tiny", requests=[dict(prompt=[1], max_new=2)]))
    with pytest.raises(ValueError, match="max_new"):
        disagg.check_spec(dict(model="tiny", engine={}, requests=[dict(prompt=[1, 2], max_new=1)]))
    with pytest.raises(TypeError, match=r"\['prompt'\]"):
        disagg.check_spec(dict(model="tiny", engine={}, requests=[dict(prompt="hello", max_new=2)]))
    with pytest.raises(ValueError, match=r"spec\['damage'\]\[0\]"):
        disagg.check_spec(dict(model="tiny", engine={}, requests=[dict(prompt=[1], max_new=2)], damage={0: "lost"}))
    with pytest.raises(ValueError, match="names request 7"):
        disagg.check_spec(dict(model="tiny", engine={}, requests=[dict(prompt=[1], max_new=2)], damage={7: "fail"}))
    ok = dict(model="tiny", engine={}, requests=[dict(prompt=[1], max_new=2)])
    for bad, err, what in [(dict(ok, damage={"0": "fail"}), TypeError, "keys must be request indices"),
                           (dict(ok, damage=[0]), TypeError, r"spec\['damage'\] must be a dict"),
                           (dict(ok, requests=[[1, 2]]), TypeError, r"spec\['requests'\]\[0\] must be a dict"),
                           (dict(ok, engine=None), TypeError, r"spec\['engine'\]"),
                           (dict(ok, model="gpt-9"), ValueError, r"spec\['model'\]"),
                           (dict(ok, requests=[dict(prompt=[1], max_new=True)]), TypeError, "got bool"),
                           (dict(ok, requests=[dict(prompt=[1, -2], max_new=2)]), TypeError, r"ints >= 0")]:
        with pytest.raises(err, match=what):
            disagg.check_spec(bad)
    with pytest.raises(ValueError, match="damage must be"):
        disagg.send_request(1, 0, 0, [1], 1, 2, [0], torch.zeros(1), torch.zeros(1), damage="lost")
    _, k, v = _gathered(tiny)
    cache = PagedKVCache.for_model(tiny, 8, 16)
    with pytest.raises(ValueError, match="k and v must have shape"):
        disagg.install_blocks(cache, "x", k, v, list(range(17)))  # 17 tokens fit 2 blocks, k holds 3
    with pytest.raises(TypeError, match="k and v must be tensors"):
        disagg.install_blocks(cache, "x", k.tolist(), v, list(range(40)))
    with pytest.raises(ValueError, match="unknown sequence"):
        disagg.gather_blocks(cache, "nobody")


def test_the_transfer_picture_counts_the_real_blocks(launched):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlib.course.draw import cells_with
    from kvlib.course.draw import transfer as draw_transfer

    spec, sent, got = launched
    fig = draw_transfer.transfer(spec, sent, got, max_blocks=ENGINE["num_blocks"])
    moved = [i for i in sent["sent"] if got["out"][i]["how"] == "transfer"]
    redone = [i for i in sent["sent"] if got["out"][i]["how"] == "recompute"]
    recv = lambda i: got["out"][i]["table"][: sent["sent"][i]["n_blocks"]]  # noqa: E731 - the receiver's blocks
    # the decode pool too is reused once a request ends: every block any drawn request held shows once
    assert cells_with(fig, "new") + cells_with(fig, "masked") == len({b for i in moved + redone for b in recv(i)})
    assert cells_with(fig, "new") >= max(len(recv(i)) for i in moved) and cells_with(fig, "masked") >= 1
    # the prefill pool is reused by later requests: a block shows the last transferred request that held it
    assert cells_with(fig, "filled") == len({b for i in moved for b in sent["sent"][i]["table"]})
    plt.close(fig)


def test_itl_rows_count_each_step_once_and_verdicts_need_separated_ranges():
    from kvlib.course import ch12b

    # two decodes that emit in the same steps (one gap per step), one long prompt
    dec = dict(kind="decode", arrival=0.0, times=[1.0, 1.1, 1.5], cpu=[0.0, 0.01, 0.03], step_prefill=[0, 0, 128],
               received=[0, 0, 0])
    recs = [dec, dict(dec), dict(kind="long", arrival=0.2, times=[0.5, 0.9], cpu=[], step_prefill=[], received=[])]
    row = ch12b.itl_trial_row(recs)
    assert row["step gaps"] == 2 and row["CPU gap worst ms"] == pytest.approx(20.0)
    assert row["wall gap worst ms"] == pytest.approx(400.0) and row["gaps with prefill in the step"] == 0.5
    assert row["long TTFT median ms"] == pytest.approx(300.0)
    assert row["long first -> next token median ms"] == pytest.approx(400.0)
    assert ch12b.verdict({"colocated": (3, 4), "disaggregated": (1, 2)}) == "colocated higher"
    assert ch12b.verdict({"colocated": (1, 2), "disaggregated": (3, 4)}) == "disaggregated higher"
    assert ch12b.verdict({"colocated": (1, 3), "disaggregated": (2, 4)}) == "not separated"
