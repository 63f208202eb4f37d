"""expect(): silent when it holds, a note for a learner when it does not, a failure under the test command;
and the old import paths of the course machinery still resolve (labs edited before the move keep running)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from kvlib.course.expect import ExpectationFailed, expect


def test_silent_when_it_holds(capsys, monkeypatch):
    monkeypatch.setenv("KVLIB_STRICT", "1")
    assert expect(True, "it holds") is True
    assert expect(torch.tensor(3) > 2, "a 0-d tensor counts") is True
    assert capsys.readouterr().out == ""


def test_a_learner_gets_a_note_and_the_notebook_goes_on(capsys, monkeypatch):
    monkeypatch.delenv("KVLIB_STRICT", raising=False)
    assert expect(False, "the cached loop is faster", why="a busy machine can hide it") is False
    out = capsys.readouterr().out
    assert "on this machine, this did not hold: the cached loop is faster." in out
    assert "A busy machine can hide it." in out and "troubleshooting" in out
    assert out.count("\n") == 1  # one line, not a paragraph


def test_the_test_command_fails(monkeypatch):
    monkeypatch.setenv("KVLIB_STRICT", "1")
    with pytest.raises(ExpectationFailed, match="the cache is token-identical"):
        expect(False, "the cache is token-identical")


@pytest.mark.parametrize("what", ["", "   ", None, 3])
def test_what_must_be_a_sentence(what):
    with pytest.raises(TypeError, match="'what' must be a sentence"):
        expect(True, what)


def test_condition_must_be_one_truth_value():
    with pytest.raises(TypeError, match="'condition' must be one truth value"):
        expect(torch.tensor([True, False]), "several values")


@pytest.mark.parametrize("old, new", [("kvlib.check", "kvlib.course.check"), ("kvlib.mistakes", "kvlib.course.mistakes"),
                                      ("kvlib.labs", "kvlib.course.labs"), ("kvlib.figures", "kvlib.course.figures")])
def test_old_import_paths_resolve_to_the_moved_modules(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_an_edited_lab_with_old_imports_still_runs():
    code = ("from kvlib import mistakes\nfrom kvlib.check import check\nimport torch\n"
            "print(check(torch.ones(2), torch.ones(2), name='x'), callable(mistakes.kv_bytes))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True True"
