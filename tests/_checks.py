"""Helpers the checker tests share: the diagnoses a failing check names (``kvlib.course.check``)."""

import pytest

from kvlib.course.check import CheckFailed

PREFIX = "Diagnosis: yours matches a known mistake: "


def diagnoses_in(report: str) -> list[str]:
    """The diagnoses named in a checker's report."""
    return [line[len(PREFIX):] for line in report.splitlines() if line.startswith(PREFIX)]


def diagnoses(call) -> list[str]:
    """The diagnoses of a check that must fail: ``call()`` raises CheckFailed, and its report names them."""
    with pytest.raises(CheckFailed) as err:
        call()
    return diagnoses_in(str(err.value))
