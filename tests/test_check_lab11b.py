"""Lab 11b's checkers: Quest's bound (exercise 1, lab 11's exercise 2 moved here) and the window decision (exercise 2)."""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from kvlib.course import ch11b
from kvlib.course.check import CheckFailed, check
from kvlib.course.mistakes import lab11b
from kvlib.sparse import block_summaries, block_upper_bound

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def lab():
    """The solution's bound and its QUEST_CASES (the definitions, not the checks)."""
    nb = json.loads((REPO / "solutions" / "11b_sparse_reads_and_hybrid_layers_lab.ipynb").read_text(encoding="utf-8"))
    namespace = {"torch": torch}
    for c in nb["cells"]:
        src = "".join(c["source"])
        if c["cell_type"] != "code":
            continue
        if src.startswith("def block_upper_bound(") or src.startswith("def choose_plan("):
            exec(compile(src, "lab11b", "exec"), namespace)
        elif "QUEST_CASES = []" in src:
            exec(compile("import torch\nimport torch.nn.functional as F\n" + src[:src.index("for q, k, S, bs in QUEST_CASES:")],
                         "lab11b", "exec"), namespace)
    return namespace


def _learner_bound(q, kmin, kmax, mistake=""):
    """block_upper_bound as a learner might write it, one head at a time, with one mistake switched on."""
    H, H_KV = q.shape[0], kmin.shape[0]
    out = []
    for h in range(H):
        g = {"modulo": h % H_KV, "// H_KV": h // H_KV}.get(mistake, h // (H // H_KV))
        lo, hi, qh = kmin[g], kmax[g], q[h]
        if mistake == "kmax":
            out.append(hi @ qh)
        elif mistake == "after":
            out.append(torch.maximum(hi @ qh, lo @ qh))
        elif mistake == "abs":
            out.append(torch.maximum(lo.abs(), hi.abs()) @ qh.abs())
        elif mistake == "min":
            out.append(torch.where(qh >= 0, lo, hi) @ qh)
        else:
            out.append(torch.where(qh >= 0, hi, lo) @ qh)
    return torch.stack(out)


def _diagnoses(call):
    with pytest.raises(CheckFailed) as err:
        call()
    prefix = "Diagnosis: yours matches a known mistake: "
    return [line[len(prefix):] for line in str(err.value).splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("mistake, words", [
    ("kmax", "only kmax was used"), ("after", "the max was taken after the sums"), ("abs", "a looser one than Quest's"),
    ("min", "lower bound"), ("modulo", "h % H_KV"), ("// H_KV", "h // H_KV: the group size"),
])
def test_bound_mistakes_are_named(lab, mistake, words):
    for q, k, S, bs in lab["QUEST_CASES"]:
        (H, _), H_KV = q.shape, k.shape[0]
        kmin, kmax = (t[0] for t in block_summaries(k[None], torch.tensor([S]), bs))
        ref = block_upper_bound(q[None], kmin[None], kmax[None])[0]
        assert check(lab["block_upper_bound"](q, kmin, kmax), ref)
        assert check(_learner_bound(q, kmin, kmax), ref)
        if mistake in ("modulo", "// H_KV") and not (1 < H_KV < H and (H - 1) // H_KV < H_KV):
            continue
        mine = _learner_bound(q, kmin, kmax, mistake)
        found = _diagnoses(lambda: check(mine, ref, mistakes=lab11b.block_upper_bound(q, kmin, kmax)))
        assert len(found) == 1 and words in found[0], found


def _evidence(sinks_ppl, window_ppl):
    return pd.DataFrame.from_dict({"window of 132": {"perplexity": window_ppl, "vs full cache": 2.0, "low": 1.8, "high": 2.2},
                                   "window of 128 + 4 sinks": {"perplexity": sinks_ppl, "vs full cache": 1.2,
                                                               "low": 1.1, "high": 1.3},
                                   "full cache": {"perplexity": 15.0, "vs full cache": 1.0, "low": 1.0, "high": 1.0}},
                                  orient="index")


def test_the_solution_passes_and_each_wrong_plan_is_diagnosed(lab, capsys):
    assert ch11b.check_window_choice(lab["choose_plan"](), _evidence(18.0, 60.0))
    assert "PASS" in capsys.readouterr().out
    with pytest.raises(CheckFailed) as err:
        ch11b.check_window_choice("window of 132", _evidence(18.0, 60.0))
    assert "attention sink" in str(err.value) and "60.00" in str(err.value) and "18.00" in str(err.value)
    with pytest.raises(CheckFailed) as err:  # the reference follows the measurement, not a fixed answer
        ch11b.check_window_choice("window of 128 + 4 sinks", _evidence(30.0, 20.0))
    assert "4 more recent positions mattered more" in str(err.value)
    with pytest.raises(CheckFailed) as err:
        ch11b.check_window_choice("a window of 1000", _evidence(18.0, 60.0))
    assert "is not one of the plans measured" in str(err.value)
    assert set(lab11b.WINDOW_CHOICES) <= set(_evidence(1, 2).index)
