"""Compare your result with the reference and say clearly what is wrong.

Used in the labs::

    from kvlib.course.check import check, check_fn, check_lines, check_rows, check_tokens

    check(my_scores, reference_scores, name="scores")          # prints a report, True if it passes
    check_fn(my_attention, reference_attention, q, k, v)       # calls both on the same inputs
    check_tokens(my_ids, reference_ids, decode=tok.decode)      # token sequences: where they part
    check_rows(my_cache, reference_cache, before=old_cache,     # cache writes: which rows differ
               row_dims=(0, 2), row_names=("sequence", "position"))
    check_lines(my_transcript, reference_transcript)           # lines of text: the first that differs

Every checker prints *yours vs reference*: shapes, dtypes, and the largest difference (or, for
tokens, the first position where the sequences part, with the decoded text around it; for cache
writes, which rows differ; for lines of text, the first line that differs). A passing check prints
its report and returns True.

A failing check raises :class:`CheckFailed` (an ``AssertionError``, so a wrong *solution* notebook
fails the test suite) whose message is the report, printed once: in Jupyter the report is all you
see, without a traceback through the checker's own code.

Learning from the mistake: ``mistakes={"what went wrong": wrong_value, ...}`` lists the results
that typical wrong answers give on the same inputs (a value, or a function of no arguments that
computes it, called only when the check fails). When yours fails and equals one of them, the report
names it::

    FAIL ✗
    Diagnosis: yours matches a known mistake: the scores are not divided by √D ...

The printed text depends only on the inputs (no timings, no addresses, no devices), because
solution notebooks are committed with their outputs and compared by nbval.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["check", "check_fn", "check_tokens", "check_rows", "check_lines", "check_choice", "CheckFailed"]


class CheckFailed(AssertionError):
    """A check failed. The message is the whole report.

    In IPython/Jupyter, ``_render_traceback_`` makes the report the only thing shown for the error
    (the checker's own stack frames would tell a learner nothing about their code).
    """

    def _render_traceback_(self):
        return str(self).split("\n")


def check(yours, reference, *, name="result", atol=1e-5, rtol=1e-5, hint="", mistakes=None) -> bool:
    """Check that ``yours`` matches ``reference``: same shape, same dtype, values close.

    Values are compared with ``torch.allclose(yours, reference, rtol, atol)`` on float64 copies,
    i.e. each element must satisfy ``|yours - reference| <= atol + rtol * |reference|``; integer
    and boolean results (token ids, counts, masks) must be equal, exactly.
    Accepts tensors, numbers, numpy arrays, and lists/tuples of those (compared item by item).

    ``mistakes`` maps a description of a typical wrong answer to the result it gives on these
    inputs (or to a function of no arguments that computes it; called only on a failure). If yours
    fails and matches one, the report names it instead of giving the general ``hint``.

    Prints the report and returns True on a pass; raises :class:`CheckFailed` (report as its
    message, not printed separately) on a failure.
    """
    ok, lines = _compare(yours, reference, name, atol, rtol)
    return _finish(ok, lines, yours, hint, mistakes, _same_values(yours, name, atol, rtol))


def check_fn(yours_fn, reference_fn, *args, name=None, atol=1e-5, rtol=1e-5, hint="", mistakes=None, **kwargs):
    """Call ``yours_fn`` and ``reference_fn`` on the same arguments, then :func:`check` the results.

    Other keyword arguments go to both functions. Your function gets its own (deep) copy of the
    arguments, so if it changes them in place (a KV cache, say) the reference still sees the
    originals. ``name`` defaults to your function's name.
    """
    name = name or getattr(yours_fn, "__name__", "result")
    try:
        yours = yours_fn(*_copy(args), **_copy(kwargs))
    except NotImplementedError:
        print(f"{name}: not written yet — fill in the stub")
        raise
    reference = reference_fn(*args, **kwargs)
    return check(yours, reference, name=name, atol=atol, rtol=rtol, hint=hint, mistakes=mistakes)


def check_tokens(yours, reference, *, decode=None, name="tokens", hint="", mistakes=None, context=16) -> bool:
    """Check that two token sequences are identical, and show where they part if they are not.

    ``yours`` and ``reference`` are lists of ints or 1-D integer tensors (a (1, n) tensor is taken
    as its single row). ``decode(ids) -> str`` (a tokenizer's ``decode``) turns ids into text, so a
    failure shows the text before the first difference and how each side continues from there;
    ``context`` is how many tokens of text to show on each side of it.
    """
    lines = [f"{name}: yours vs reference, token by token"]
    y, y_problem = _as_ids(yours)
    r, _ = _as_ids(reference)
    if y is None:
        ok = False
        lines.append(f"  {y_problem}")
    else:
        ok = y == r
        lines.append(f"  length  yours {len(y)}  reference {len(r)}  {_mark(len(y) == len(r))}")
        first = next((i for i, (a, b) in enumerate(zip(y, r)) if a != b), min(len(y), len(r)))
        if ok:
            lines.append(f"  all {len(r)} tokens agree  ✓")
        else:
            lines += _token_difference(y, r, first, decode, context)

    def matches(wrong):
        w, _ = _as_ids(wrong)
        return y is not None and w is not None and y == w

    return _finish(ok, lines, yours, hint, mistakes, matches)


def check_rows(yours, reference, *, before=None, row_dims=None, row_names=None, name="result",
               atol=1e-5, rtol=1e-5, hint="", mistakes=None, show=6) -> bool:
    """Check a tensor written row by row (a KV cache, say) and name the rows that differ.

    A *row* is one index along ``row_dims`` (default: every dim but the last) with everything along
    the other dims; e.g. ``row_dims=(0, 2), row_names=("sequence", "position")`` for a (B, H_KV,
    S_max, D) cache. A row differs if any of its values is not close. With ``before`` (the tensor
    as it was before the write), each differing row also says which side changed it, e.g. "yours
    wrote it; the reference leaves it as it was".
    """
    ok, lines = _compare(yours, reference, name, atol, rtol)
    if lines[0] == f"{name}: yours vs reference":
        lines[0] += ", row by row"
    if not ok and isinstance(yours, torch.Tensor) and tuple(yours.shape) == tuple(reference.shape):
        dims = tuple(d % reference.dim() for d in row_dims) if row_dims is not None else tuple(range(reference.dim() - 1))
        names = tuple(row_names) if row_names is not None else tuple(f"dim {d}" for d in dims)
        lines += _row_report(yours, reference, before, dims, names, atol, rtol, show)
    return _finish(ok, lines, yours, hint, mistakes, _same_values(yours, name, atol, rtol))


def check_lines(yours, reference, *, name="lines", hint="", mistakes=None, context=2, width=160) -> bool:
    """Check that two sequences of text lines are identical, and show where they part if they are not.

    For results that are text, not numbers: a transcript of what a function sent and called, the events
    a parser read, the fields of an answer. ``yours`` and ``reference`` are lists (or tuples) of strings.
    A failure shows the first line that differs, the ``context`` lines before it, and how each side goes
    on from there; a line longer than ``width`` characters is cut, with "…".
    """
    lines = [f"{name}: yours vs reference, line by line"]
    y, y_problem = _as_lines(yours)
    r, _ = _as_lines(reference)
    if y is None:
        ok = False
        lines.append(f"  {y_problem}")
    else:
        ok = y == r
        lines.append(f"  length  yours {len(y)}  reference {len(r)}  {_mark(len(y) == len(r))}")
        if ok:
            lines.append(f"  all {len(r)} lines agree  ✓")
        else:
            lines += _line_difference(y, r, context, width)

    def matches(wrong):
        w, _ = _as_lines(wrong)
        return y is not None and w is not None and y == w

    return _finish(ok, lines, yours, hint, mistakes, matches)


def _as_lines(value):
    """(list of str, None) or (None, what is wrong with it)."""
    if _not_written(value):
        return None, f"got {value!r}: not written yet, or a `return` is missing"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        return None, f"yours is a {type(value).__name__}, not a list of lines"
    bad = next((v for v in value if not isinstance(v, str)), None)
    if bad is not None:
        return None, f"yours holds a {type(bad).__name__} ({bad!r:.60}); the lines are strings"
    return list(value), None


def _line_difference(y, r, context, width) -> list[str]:
    def show(line):
        text = repr(line)
        return text if len(text) <= width else text[: width - 1] + "…"

    first = next((i for i, (a, b) in enumerate(zip(y, r)) if a != b), min(len(y), len(r)))
    shorter = min(len(y), len(r))
    if first == shorter:  # one is a prefix of the other
        longer, who = (y, "yours") if len(y) > len(r) else (r, "the reference")
        out = [f"  the first {shorter} lines agree; then {who} has {len(longer) - shorter} more  ✗"]
    else:
        out = [f"  first difference at line {first} (lines 0..{first - 1} agree)  ✗" if first
               else "  first difference at line 0  ✗"]
    for i in range(max(0, first - context), first):
        out.append(f"    line {i}, both:  {show(r[i])}")
    for who, seq in (("yours    ", y), ("reference", r)):
        rest = seq[first:first + context + 1]
        out.append(f"  {who} from there: " + ("(nothing more)" if not rest else show(rest[0])))
        out += [f"  {' ' * len(who)}             {show(line)}" for line in rest[1:]]
    if first < shorter:
        n_diff = sum(a != b for a, b in zip(y, r)) + abs(len(y) - len(r))
        out.append(f"  {n_diff} of {max(len(y), len(r))} lines differ")
    return out


def check_choice(what: str, yours, reference, why, shown: tuple[str, str] | None = None) -> bool:
    """A decision exercise's check: prints ``what: yours Y  reference R  ✓/✗``, then PASS, or raises CheckFailed
    with the diagnosis lines that ``why()`` returns (called only for a wrong choice). ``shown``: how to print
    (yours, reference) when their plain ``str`` is not the way to read them.

    >>> check_choice("block size", 16, 16, why=lambda: [])
    block size: yours 16  reference 16  ✓
    PASS ✓
    True
    """
    ok = yours == reference
    y, r = shown if shown is not None else (yours, reference)
    report = f"{what}: yours {y}  reference {r}  {_mark(ok)}"
    if ok:
        print(report + "\nPASS ✓")
        return True
    raise CheckFailed(report + "\nFAIL ✗\n" + "\n".join(f"  {line}" for line in why()))


# --------------------------------------------------------------------------------------------
# Ending a report: PASS, or FAIL with a diagnosis or a hint
# --------------------------------------------------------------------------------------------


def _finish(ok, lines, yours, hint, mistakes, matches) -> bool:
    if ok:
        lines.append("PASS ✓")
        print("\n".join(lines))
        return True
    found = [] if _not_written(yours) else _diagnose(mistakes, matches)
    if found:
        lines.append("FAIL ✗")
        lines += [f"Diagnosis: yours matches a known mistake: {what}" for what in found]
    else:
        lines.append("FAIL ✗" + (f"  Hint: {hint}" if hint else ""))
    raise CheckFailed("\n".join(lines))


def _diagnose(mistakes, matches) -> list[str]:
    """The descriptions of the known wrong answers that ``matches(wrong value)`` accepts."""
    found = []
    for what, wrong in (mistakes or {}).items():
        try:
            value = wrong() if callable(wrong) else wrong
            if matches(value):
                found.append(what)
        except Exception:  # a variant that cannot be computed on these inputs names nothing
            continue
    return found


def _same_values(yours, name, atol, rtol):
    """A test of whether a known wrong value is what yours is (NaN where it has NaN counts as equal)."""
    return lambda wrong: _compare(yours, wrong, name, atol, rtol, equal_nan=True)[0]


def _not_written(value) -> bool:
    return value is None or value is NotImplemented


# --------------------------------------------------------------------------------------------
# The comparison itself: returns (passed, report lines), prints nothing.
# --------------------------------------------------------------------------------------------


def _copy(value):
    try:
        return copy.deepcopy(value)
    except Exception:  # e.g. a non-leaf tensor that requires grad: share it rather than fail
        return value


def _has_tensors(value) -> bool:
    return isinstance(value, (list, tuple)) and any(
        isinstance(item, torch.Tensor) or _has_tensors(item) for item in value
    )


def _compare(yours, reference, name, atol, rtol, equal_nan=False) -> tuple[bool, list[str]]:
    if _not_written(yours):
        return False, [f"{name}: got {yours!r}: not written yet, or a `return` is missing"]

    # Several results, e.g. (keys, values): compare item by item.
    if _has_tensors(reference):
        is_seq = isinstance(yours, (list, tuple))
        if not is_seq or len(yours) != len(reference):
            got = f"{len(yours)} items" if is_seq else f"a {type(yours).__name__}"
            return False, [f"{name}: expected {len(reference)} items, got {got}"]
        ok, lines = True, []
        for i, (y, r) in enumerate(zip(yours, reference)):
            item_ok, item_lines = _compare(y, r, f"{name}[{i}]", atol, rtol, equal_nan)
            ok, lines = ok and item_ok, lines + item_lines
        return ok, lines

    lines = [f"{name}: yours vs reference"]
    try:
        y = torch.as_tensor(yours)
    except Exception as err:
        return False, lines + [f"  yours is a {type(yours).__name__}, not a tensor ({err})"]
    r = torch.as_tensor(reference)

    shape_ok = y.shape == r.shape
    dtype_ok = y.dtype == r.dtype
    lines.append(f"  shape  yours {tuple(y.shape)}  reference {tuple(r.shape)}  {_mark(shape_ok)}")
    lines.append(f"  dtype  yours {y.dtype}  reference {r.dtype}  {_mark(dtype_ok)}")
    if not shape_ok:
        return False, lines + ["  shapes differ, so values were not compared"]
    if y.numel() == 0:
        return dtype_ok, lines + ["  (empty: no values to compare)"]

    y64, r64 = y.detach().cpu().to(torch.float64), r.detach().cpu().to(torch.float64)
    integers = not (_floating(y) or _floating(r))  # ids, counts, masks: exact, and in int64 (float64 has 53 bits)
    if integers:
        yi, ri = y.detach().cpu().long(), r.detach().cpu().long()
        values_ok = torch.equal(yi, ri)
        diff = (yi - ri).abs().to(torch.float64)
    else:
        values_ok = torch.allclose(y64, r64, rtol=rtol, atol=atol, equal_nan=equal_nan)
        # |difference|, with equal values (including matching infinities) counted as 0 and NaN kept.
        diff = torch.where(y64 == r64, torch.zeros_like(y64), (y64 - r64).abs())
    nan = diff.isnan()
    flat = int(nan.flatten().nonzero()[0]) if nan.any() else int(diff.flatten().argmax())
    worst = _unravel(flat, tuple(y.shape))
    max_diff = diff.flatten()[flat].item()
    where = f" at index {list(worst)}" if worst and max_diff != 0 else ""
    tolerance = "integers: exact" if integers else f"atol={atol:g}, rtol={rtol:g}"
    lines.append(f"  max |difference| {max_diff:.3g}{where}  ({tolerance})  {_mark(values_ok)}")
    if not values_ok:
        lines += _neighbourhood(y64, r64, worst, y.dtype.is_floating_point)
        lines += _patterns(y64, r64, 0.0 if integers else atol, 0.0 if integers else rtol)
    if not dtype_ok:
        lines.append(f"  dtypes differ: convert yours with .to({r.dtype})")
    return shape_ok and dtype_ok and values_ok, lines


def _floating(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.is_complex()


def _mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Flat position -> index, e.g. 5 in shape (2, 3) -> (1, 2)."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def _neighbourhood(y64, r64, worst, floating) -> list[str]:
    """A few values of each side along the last dimension, around the worst index."""
    fmt = (lambda v: f"{v:.4g}") if floating else (lambda v: str(int(v)) if v == v else "nan")
    if not worst:  # a single number
        return [f"  yours     {fmt(y64.item())}", f"  reference {fmt(r64.item())}"]
    *rows, col = worst
    size = y64.shape[-1]
    start = max(0, min(col - 2, size - 5))
    stop = min(size, start + 5)
    label = "[" + ", ".join([str(i) for i in rows] + [f"{start}:{stop}"]) + "]"
    out = []
    for who, t in (("yours    ", y64), ("reference", r64)):
        values = t[tuple(rows)][start:stop].tolist()
        out.append(f"  {who} {label}: " + "  ".join(fmt(v) for v in values))
    return out


def _patterns(y64, r64, atol, rtol) -> list[str]:
    """Shapes of wrongness that point at a cause: NaN/inf, a constant factor or offset, a few elements."""
    out = []
    for what, bad in (("NaN", torch.isnan), ("inf", torch.isinf)):
        n_y, n_r = int(bad(y64).sum()), int(bad(r64).sum())
        if n_y > n_r:
            cause = "a 0/0, or inf - inf, e.g. exp(-inf - -inf)?" if what == "NaN" else "an exp that overflowed?"
            out.append(f"  yours has {n_y} {what} value{'s' if n_y != 1 else ''} "
                       f"(the reference {n_r}): {cause}")
    if out or y64.numel() < 2:
        return out
    ok = (y64 - r64).abs() <= atol + rtol * r64.abs()
    nonzero = r64 != 0
    if nonzero.all():
        ratio = y64 / r64
        if torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio), rtol=1e-6, atol=0):
            out.append(f"  every value of yours is {ratio.flatten()[0].item():.6g} × the reference's")
            return out
    offset = y64 - r64
    if torch.allclose(offset, offset.flatten()[0].expand_as(offset), rtol=0, atol=max(atol, 1e-12)):
        out.append(f"  every value of yours is the reference's {offset.flatten()[0].item():+.6g}")
        return out
    n_bad = int((~ok).sum())
    out.append(f"  {n_bad} of {ok.numel()} values differ")
    return out


# --------------------------------------------------------------------------------------------
# Token sequences and rows
# --------------------------------------------------------------------------------------------


def _as_ids(value):
    """(list of ints, None) or (None, what is wrong with it)."""
    if _not_written(value):
        return None, f"got {value!r}: not written yet, or a `return` is missing"
    if isinstance(value, torch.Tensor):
        if value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        if value.dim() != 1 or value.dtype.is_floating_point or value.is_complex():
            return None, f"yours is a {value.dtype} tensor of shape {tuple(value.shape)}, not a 1-D sequence of token ids"
        return [int(t) for t in value.tolist()], None
    try:
        ids = list(value)
    except TypeError:
        return None, f"yours is a {type(value).__name__}, not a sequence of token ids"
    out = []
    for t in ids:
        if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.dtype.is_floating_point:
            t = int(t)
        if isinstance(t, bool) or not isinstance(t, int):
            return None, f"yours holds a {type(t).__name__} ({t!r}); token ids are ints"
        out.append(t)
    return out, None


def _token_difference(y, r, first, decode, context) -> list[str]:
    shorter = min(len(y), len(r))
    if first == shorter:  # one is a prefix of the other
        longer, who = (y, "yours") if len(y) > len(r) else (r, "the reference")
        lines = [f"  the first {shorter} tokens agree; then {who} has {len(longer) - shorter} more  ✗"]
    else:
        n_diff = sum(a != b for a, b in zip(y, r)) + abs(len(y) - len(r))
        lines = [f"  first difference at position {first} (positions 0..{first - 1} agree)  ✗"
                 if first else "  first difference at position 0  ✗"]
        tok = (lambda t: f"{t} {decode([t])!r}") if decode else str
        lines.append(f"    token there: yours {tok(y[first])}, reference {tok(r[first])}")
    if decode:
        before = decode(r[max(0, first - context):first])
        lines.append(f"  text before it:      {('…' if first > context else '') + before!r}")
        for who, ids in (("yours    ", y), ("reference", r)):
            lines.append(f"  {who} continues: {decode(ids[first:first + context])!r}")
    else:
        for who, ids in (("yours    ", y), ("reference", r)):
            lines.append(f"  {who} from there: {ids[first:first + context]}")
    if first < shorter:
        lines.append(f"  {n_diff} of {max(len(y), len(r))} positions differ")
    return lines


def _row_report(yours, reference, before, dims, names, atol, rtol, show) -> list[str]:
    y64, r64 = yours.detach().cpu().double(), reference.detach().cpu().double()
    other = tuple(d for d in range(r64.dim()) if d not in dims)
    order = dims + other

    def rows(t):  # (rows along dims..., everything else flattened)
        return t.permute(order).reshape(*[r64.shape[d] for d in dims], -1)

    def same(a, b):
        return ((a - b).abs() <= atol + rtol * b.abs()).all(dim=-1) | (a == b).all(dim=-1)

    yr, rr = rows(y64), rows(r64)
    differs = ~same(yr, rr)
    index = differs.nonzero().tolist()
    if not index:  # e.g. only the dtype differs
        return []
    label = ", ".join(names)
    lines = [f"  rows that differ ({label}): {len(index)} of {differs.numel()}"]
    br = rows(before.detach().cpu().double()) if before is not None and before.shape == reference.shape else None
    for idx in index[:show]:
        where = "(" + ", ".join(str(i) for i in idx) + ")"
        if br is None:
            lines.append(f"    {where}")
            continue
        y_kept, r_kept = bool(same(yr[tuple(idx)], br[tuple(idx)])), bool(same(rr[tuple(idx)], br[tuple(idx)]))
        if y_kept:
            what = "yours left it as it was; the reference writes it"
        elif r_kept:
            what = "yours wrote it; the reference leaves it as it was"
        else:
            what = "both wrote it, with different values"
        lines.append(f"    {where}: {what}")
    if len(index) > show:
        lines.append(f"    … and {len(index) - show} more")
    return lines
