"""Lab 08b's checkers: the prefix-cache lookup's known wrong answers and the host-tier decision's wrong sizes are
diagnosed (kvlib.course.ch08, kvlib.course.mistakes.lab08)."""

import pytest
import torch

from kvlib.course import ch08, mistakes
from kvlib.course.check import CheckFailed, check
from kvlib.course.mistakes import lab08

from _checks import diagnoses  # tests/_checks.py


@pytest.fixture(scope="module")
def cases():
    cache, prompts = ch08.prefix_cases()
    return cache, prompts, set(cache.hash_to_block)


def learner(prompt, cached, bs, *, chain=True, last_rule=True, blocks=False):
    """cached_tokens as a learner would write it, with one of the usual mistakes."""
    parent, hits = None, 0
    for i in range(((len(prompt) - 1) if last_rule else len(prompt)) // bs):
        key = hash((parent if chain else None, tuple(prompt[i * bs: (i + 1) * bs])))
        if key not in cached:
            break
        hits, parent = hits + 1, key
    return hits if blocks else hits * bs


def test_the_right_lookup_is_the_engine_s(cases):
    cache, prompts, cached = cases
    assert [learner(p, cached, 4) for p in prompts] == [ch08.reference_cached(cache, p) for p in prompts]


@pytest.mark.parametrize("mistake, words", [
    (dict(chain=False), "does not chain"), (dict(last_rule=False), "last token must be computed"),
    (dict(blocks=True), "blocks were counted"),
])
def test_each_lookup_mistake_is_diagnosed(cases, mistake, words):
    cache, prompts, cached = cases
    ref = torch.tensor([ch08.reference_cached(cache, p) for p in prompts])
    mine = torch.tensor([learner(p, cached, 4, **mistake) for p in prompts])
    found = diagnoses(lambda: check(mine, ref, name="cached tokens", mistakes=mistakes.cached_tokens(prompts, cached, 4)))
    assert len(found) == 1 and words in found[0], found


@pytest.fixture(scope="module")
def table():
    rag, _ = ch08.rag_lab_workload()
    return ch08.host_tier_runs(ch08.toy_model(), rag)


def test_the_host_tier_decision(table, capsys):
    right = ch08.host_tier_answer(table)
    assert ch08.check_host_tier_choice(right, table) is None and "PASS ✓" in capsys.readouterr().out
    for wrong in table.index:
        if wrong == right:
            continue
        with pytest.raises(CheckFailed) as err:
            ch08.check_host_tier_choice(int(wrong), table)
        why = lab08.host_tier_choice(int(wrong), right, table)
        assert why in str(err.value)
        assert ("too small" in why or "no host tier" in why) if wrong < right else "so does a smaller one" in why


@pytest.mark.parametrize("bad", [5, "32", 32.0, True, None])
def test_a_size_not_measured_says_so(table, bad):
    with pytest.raises(CheckFailed) as err:
        ch08.check_host_tier_choice(bad, table)
    assert "choose one of the sizes measured" in str(err.value)
