"""``expect``: a check that protects a result without deciding what a learner may see.

A teaching cell measures something and shows it (a table, a plot, one printed line); the markdown
around it says what each outcome would mean. Below it, one line guards what the course relies on::

    expect(speedup > 1, "the cached loop is faster than the naive one",
           why="per-operator overhead can hide the saving on a very busy machine")

- When the condition holds, nothing is printed.
- When it does not, on a learner's machine, one plain paragraph says what did not hold here and why
  it can happen, and the notebook goes on: the numbers above are what this machine measured.
- Under the course's test command (``KVLIB_STRICT=1``, set by ``make test``) it raises
  :class:`ExpectationFailed`, so a regression fails the test run.

Unlike ``assert``, an ``expect`` never decides the lesson in advance: the cell above it already showed
the outcome, whatever it was.
"""

from __future__ import annotations

import os

__all__ = ["expect", "ExpectationFailed", "strict"]


class ExpectationFailed(AssertionError):
    """An ``expect(...)`` did not hold under the test command."""


def strict() -> bool:
    """True under the course's test command (environment variable ``KVLIB_STRICT=1``)."""
    return os.environ.get("KVLIB_STRICT", "") == "1"


def expect(condition, what: str, *, why: str = "", see: str = "the troubleshooting table at the end of this chapter") -> bool:
    """Check that ``what`` holds; return whether it did.

    condition: the property, already computed (a bool, or anything ``bool()`` accepts: a 0-d tensor too).
    what:      the property in words, as a sentence a learner can read ("the cache is token-identical").
    why:       optional: why it might not hold on some machine, or what it would mean if it did not.
    see:       where to look next (default: the chapter's troubleshooting table).
    """
    if not isinstance(what, str) or not what.strip():
        raise TypeError(f"expect: 'what' must be a sentence saying what should hold, got {what!r}")
    try:
        ok = bool(condition)
    except Exception as e:  # a tensor with several elements, say
        raise TypeError(f"expect: 'condition' must be one truth value (got {type(condition).__name__}: {e})") from None
    if ok:
        return True
    if strict():
        raise ExpectationFailed(f"expected: {what}" + (f" ({why})" if why else ""))
    lines = [f"Note: on this machine, this did not hold: {what}."]
    if why:
        lines.append(why[0].upper() + why[1:] + ("" if why.endswith(".") else "."))
    lines.append(f"The figures above are what this machine measured; see {see}.")
    print(" ".join(lines))
    return False
