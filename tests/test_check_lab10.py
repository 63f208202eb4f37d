"""Lab 10's decision checker (kvlib.course.ch10.check_verdicts, kvlib.course.mistakes.lab10.verdict_rules): the
chapter's rule passes, and each usual wrong rule is named as itself and only itself, on the lab's own cases."""

import json
from pathlib import Path

import pytest

from kvlib.course import ch10, mistakes
from kvlib.course.check import CheckFailed

from _checks import diagnoses_in  # tests/_checks.py

ROOT = Path(__file__).resolve().parents[1]


def lab_cases() -> dict:
    """VERDICT_CASES as the solution notebook defines them."""
    nb = json.loads((ROOT / "solutions" / "10_http_serving_lab.ipynb").read_text(encoding="utf-8"))
    src = next("".join(c["source"]) for c in nb["cells"] if "VERDICT_CASES = " in "".join(c["source"]))
    namespace = {}
    exec(compile(src.split("\nfor name")[0], "lab10", "exec"), namespace)
    return namespace["VERDICT_CASES"]


def failure(call) -> str:
    with pytest.raises(CheckFailed) as err:
        call()
    return str(err.value)


def test_the_chapter_rule_passes(capsys):
    cases = lab_cases()
    right = {k: ch10.verdict(c) for k, c in cases.items()}
    assert ch10.check_verdicts(cases, right) is True
    assert "PASS" in capsys.readouterr().out
    assert list(right.values()) == ["no verdict", "A", "no verdict", "A", "no verdict", "no verdict"]


@pytest.mark.parametrize("how, words", [("means", "means"), ("first trial", "first trial"),
                                        ("best trials", "best trial"), ("higher is better", "lower is better"),
                                        ("lower is better", "higher is better")])
def test_each_wrong_rule_is_diagnosed(how, words):
    cases = lab_cases()
    wrong = {k: mistakes.lab10._rule(c, how) for k, c in cases.items()}
    found = diagnoses_in(failure(lambda: ch10.check_verdicts(cases, wrong)))
    assert len(found) == 1 and words in found[0], found


def test_every_wrong_rule_differs_from_the_right_one_and_from_the_others():
    cases = lab_cases()
    answers = [tuple(f()) for f in mistakes.verdict_rules(cases).values()]
    right = tuple(mistakes.verdict_lines(cases, {k: ch10.verdict(c) for k, c in cases.items()}))
    assert right not in answers and len(set(answers)) == len(answers)


def test_a_malformed_answer_says_what_is_expected():
    cases = lab_cases()
    assert "one answer per case" in failure(lambda: ch10.check_verdicts(cases, {"x": "A"}))
    bad = {k: "kvlib" for k in cases}
    assert "one of ('A', 'B', 'no verdict')" in failure(lambda: ch10.check_verdicts(cases, bad))
    some_wrong = {k: "B" for k in cases}  # not a known rule: a plain failure with the rule as the hint
    report = failure(lambda: ch10.check_verdicts(cases, some_wrong))
    assert "every one of its trials beats every trial" in report and not diagnoses_in(report)
