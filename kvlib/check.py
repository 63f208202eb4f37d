"""Compare your result with the reference and say clearly what is wrong.

Used in the labs::

    from kvlib.check import check, check_fn

    check(my_scores, reference_scores, name="scores")          # prints a report, True if it passes
    check_fn(my_attention, reference_attention, q, k, v)       # calls both on the same inputs

The report shows the shapes, the dtypes, the largest absolute difference and, when it fails, where
the worst difference is and a few values of each side around it. A failed check raises
``AssertionError`` (so a wrong *solution* notebook fails the test suite); in a lab you simply read
the report. The printed text depends only on the inputs (no timings, no addresses, no devices),
because solution notebooks are committed with their outputs and compared by nbval.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["check", "check_fn"]


def check(yours, reference, *, name="result", atol=1e-5, rtol=1e-5, hint="") -> bool:
    """Check that ``yours`` matches ``reference``: same shape, same dtype, values close.

    Values are compared with ``torch.allclose(yours, reference, rtol, atol)`` on float64 copies,
    i.e. each element must satisfy ``|yours - reference| <= atol + rtol * |reference|``.
    Accepts tensors, numbers, numpy arrays, and lists/tuples of those (compared item by item).
    Prints a report; returns True on a pass, raises ``AssertionError(report)`` on a failure.
    """
    ok, lines = _compare(yours, reference, name, atol, rtol)
    lines.append("PASS ✓" if ok else "FAIL ✗" + (f"  Hint: {hint}" if hint else ""))
    report = "\n".join(lines)
    print(report)
    if not ok:
        raise AssertionError(report)
    return True


def check_fn(yours_fn, reference_fn, *args, name=None, atol=1e-5, rtol=1e-5, hint="", **kwargs):
    """Call ``yours_fn`` and ``reference_fn`` on the same arguments, then :func:`check` the results.

    Other keyword arguments go to both functions. Your function gets its own (deep) copy of the
    arguments, so if it changes them in place (a KV cache, say) the reference still sees the
    originals. ``name`` defaults to your function's name.
    """
    name = name or getattr(yours_fn, "__name__", "result")
    try:
        yours = yours_fn(*_copy(args), **_copy(kwargs))
    except NotImplementedError:
        print(f"{name}: not written yet — fill in the TODO")
        raise
    reference = reference_fn(*args, **kwargs)
    return check(yours, reference, name=name, atol=atol, rtol=rtol, hint=hint)


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


def _compare(yours, reference, name, atol, rtol) -> tuple[bool, list[str]]:
    if yours is None or yours is NotImplemented:
        return False, [f"{name}: not written yet — fill in the TODO (got {yours!r})"]

    # Several results, e.g. (keys, values): compare item by item.
    if _has_tensors(reference):
        is_seq = isinstance(yours, (list, tuple))
        if not is_seq or len(yours) != len(reference):
            got = f"{len(yours)} items" if is_seq else f"a {type(yours).__name__}"
            return False, [f"{name}: expected {len(reference)} items, got {got}"]
        ok, lines = True, []
        for i, (y, r) in enumerate(zip(yours, reference)):
            item_ok, item_lines = _compare(y, r, f"{name}[{i}]", atol, rtol)
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
    values_ok = torch.allclose(y64, r64, rtol=rtol, atol=atol)

    # |difference|, with equal values (including matching infinities) counted as 0 and NaN kept.
    diff = torch.where(y64 == r64, torch.zeros_like(y64), (y64 - r64).abs())
    nan = diff.isnan()
    flat = int(nan.flatten().nonzero()[0]) if nan.any() else int(diff.flatten().argmax())
    worst = _unravel(flat, tuple(y.shape))
    max_diff = diff.flatten()[flat].item()
    where = f" at index {list(worst)}" if worst and max_diff != 0 else ""
    lines.append(
        f"  max |difference| {max_diff:.3g}{where}  "
        f"(atol={atol:g}, rtol={rtol:g})  {_mark(values_ok)}"
    )
    if not values_ok:
        lines += _neighbourhood(y64, r64, worst, y.dtype.is_floating_point)
    if not dtype_ok:
        lines.append(f"  dtypes differ: convert yours with .to({r.dtype})")
    return shape_ok and dtype_ok and values_ok, lines


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
    fmt = (lambda v: f"{v:.4g}") if floating else (lambda v: str(int(v)))
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
