"""Generate the learners' lab notebooks (``labs/``) from the solution notebooks (``solutions/``).

How it works, for a teacher
---------------------------
``solutions/*.ipynb`` are the single source of truth: complete, runnable notebooks (the test
suite executes them with nbval). Each ``labs/<name>.ipynb`` is generated from
``solutions/<name>.ipynb`` by cutting out the parts the learner should write. Never edit a lab by
hand: edit the solution and run ``make labs`` (or ``python -m kvlib.course.labs``).

Mark an exercise inside a *code cell* with two comment lines::

    def attention(q, k, v):
        # BEGIN SOLUTION (hint: scores = q @ k.T, then torch.softmax over the last dim)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        return torch.softmax(scores, dim=-1) @ v
        # END SOLUTION

The lab gets, at the indentation of the ``BEGIN`` line::

    def attention(q, k, v):
        # TODO: your code here (about 2 lines)
        raise NotImplementedError("Exercise: write this part (about 2 lines). Hint: scores = ...")

- The hint in ``(hint: ...)`` is optional. "About N lines" counts the non-blank, non-comment
  lines between the markers; an exercise's heading says the same N (``tests/test_labs.py``
  checks every lab).
- A cell may hold several regions, and a notebook several such cells. Regions cannot be nested
  and cannot span cells; a marker without its partner is an error (``ValueError`` naming the
  notebook and the cell index), so a typo can never leak a solution into a lab.
- Markdown cells and code cells without markers are copied as they are. Outputs and execution
  counts are cleared.
- A cell tagged ``solution-only`` (cell metadata ``"tags": ["solution-only"]``; in JupyterLab:
  right sidebar, "Common Tools", "Cell Tags") is left out of the lab, e.g. a cell that asserts
  the solution is right.
- A cell tagged ``hints`` is copied with its source collapsed (``"jupyter": {"source_hidden":
  true}``), so the hints it defines do not spoil the exercise: it runs as usual, and the learner
  asks for them one at a time.

Tiered hints
------------
Put each exercise's hints in a ``hints`` cell just above its stub, from a nudge to nearly the
answer::

    hint = Hints("decode_one",
                 "Which K/V head does query head h read? ...",
                 "scores = k_cache[b, g, :L] @ q[b, h] has shape (L,) ...")

``hint(1)`` prints the first one, ``hint(2)`` the second, and so on. A stub below a ``hints`` cell
ends its message with one sentence that says how many hints there are, e.g. "Stuck? hint(1) prints
a first hint, hint(2) and hint(3) say more." (the count is read from the ``Hints(...)`` call), so
the marker needs no ``(hint: ...)`` of its own there; one that only lists ``hint(1), hint(2) ...``
is dropped, as the stub's sentence already says it.

Protecting the learners' work
-----------------------------
A learner writes their answers into ``labs/*.ipynb``. Each generated lab stores, in its notebook
metadata, ``kvlib_lab = {"source": "solutions/<name>.ipynb", "generated_hash": ...}``: a SHA-256
of its cells' types and sources (not outputs, so *running* a lab does not count as editing it).
Before overwriting a lab, :func:`generate` recomputes that hash; if the cells changed, the
learner has edited the lab and generation stops with :class:`LabEditedError` before writing
*any* file. Move the lab aside and run again, or pass ``--force`` to overwrite it on purpose.

Command line (run from the repository root)::

    python -m kvlib.course.labs            # (re)generate labs/, one line per file
    python -m kvlib.course.labs --check    # exit 1 if a lab is missing or differs from a fresh generation
    python -m kvlib.course.labs --force    # overwrite labs even if they were edited

This module deliberately imports neither torch nor triton: it only moves text around.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import nbformat

__all__ = [
    "Hints",
    "LabEditedError",
    "render_lab",
    "lab_is_current",
    "generate",
    "check_labs",
    "main",
    "SOLUTION_ONLY_TAG",
    "HINTS_TAG",
]

SOLUTION_ONLY_TAG = "solution-only"
HINTS_TAG = "hints"
METADATA_KEY = "kvlib_lab"

# A marker line is a comment, alone on its line, at any indentation; case is ignored so that a
# "# Begin Solution" typo is still treated as a marker (and checked) rather than leaked.
_BEGIN = re.compile(r"^(?P<indent>[ \t]*)#\s*BEGIN\s+SOLUTION\b(?P<rest>.*)$", re.IGNORECASE)
_END = re.compile(r"^[ \t]*#\s*END\s+SOLUTION\b(?P<rest>.*)$", re.IGNORECASE)
_HINT = re.compile(r"^\(\s*hint\s*:\s*(?P<hint>.*?)\s*\)$", re.IGNORECASE)


class Hints:
    """An exercise's hints, revealed one at a time: ``hint = Hints("name", "first", "second")``,
    then ``hint(1)``, ``hint(2)``, ... (``hint()`` is ``hint(1)``)."""

    def __init__(self, exercise: str, *hints: str):
        if not hints:
            raise ValueError(f"Hints for {exercise!r}: give at least one hint")
        self.exercise = exercise
        self.hints = tuple(hints)

    def __call__(self, n: int = 1) -> None:
        total = len(self.hints)
        if not isinstance(n, int) or not 1 <= n <= total:
            print(f"{self.exercise}: there {'is' if total == 1 else 'are'} {total} hint{'s' * (total != 1)}, "
                  f"hint(1) … hint({total}); the complete answer is in the solutions/ notebook of the same name")
            return
        more = f"; hint({n + 1}) says more" if n < total else "; after this, see the solutions/ notebook"
        text = textwrap.fill(self.hints[n - 1], width=100, initial_indent="  ", subsequent_indent="  ",
                             break_long_words=False, break_on_hyphens=False)
        print(f"{self.exercise}, hint {n} of {total}{more}:\n{text}")

    def __repr__(self) -> str:
        return f"Hints({self.exercise!r}: {len(self.hints)} hints, call hint(1) … hint({len(self.hints)}))"


class LabEditedError(RuntimeError):
    """A lab was edited by a learner since it was generated; regenerating would lose their work.

    ``paths`` lists the edited labs. Raised before any file is written.
    """

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)
        names = ", ".join(str(p) for p in self.paths)
        one = len(self.paths) == 1
        example = self.paths[0] if one else "labs/NAME.ipynb"
        has, it_was = ("has", "it was") if one else ("have", "they were")
        super().__init__(
            f"{names} {has} been edited since {it_was} generated, "
            "so regenerating would overwrite your work. Nothing was written.\n"
            "To keep your work: move it aside, out of the labs folder, e.g. "
            f"`mkdir -p my_work && mv {example} my_work/`, then run again.\n"
            "To throw your edits away and overwrite deliberately: python -m kvlib.course.labs --force"
        )


# --------------------------------------------------------------------------------------------
# Rendering one notebook (pure functions, no files)
# --------------------------------------------------------------------------------------------


def _source(cell) -> str:
    """A cell's source as one string (on disk it may be a list of lines)."""
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _count_code_lines(lines: list[str]) -> int:
    """Lines a learner has to write: not blank, not a comment."""
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


# A marker hint that only points at the tiered hints, "hint(1), hint(2), hint(3)" or "hint(1) ...".
_POINTER = re.compile(r"^hint\(\d+\)(\s*(,|…|\.\.\.|and|then)\s*(hint\(\d+\))?)*[\s.,…]*$")


def _tiered_sentence(n_hints: int | bool) -> str:
    """How a stub points at the hints cell above it; ``True``: a hints cell whose count is unknown."""
    if n_hints is True or n_hints < 1:
        return "Stuck? hint(1) prints a first hint, hint(2) the next, and so on."
    if n_hints == 1:
        return "Stuck? hint(1) prints a hint."
    more = "hint(2)" if n_hints == 2 else "hint(2) and hint(3)" if n_hints == 3 else f"hint(2) … hint({n_hints})"
    return f"Stuck? hint(1) prints a first hint, {more} say{'s' if n_hints == 2 else ''} more."


def _count_hints(source: str) -> int | bool:
    """The number of hints a ``hints`` cell's ``Hints(name, *hints)`` call gives (True if it cannot tell)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Hints":
            if any(isinstance(a, ast.Starred) for a in node.args):
                return True
            return max(len(node.args) - 1, 0) or True
    return True


def _stub(indent: str, n_lines: int, hint: str, tiered: int | bool = False) -> list[str]:
    """The two lines that replace a solution region.

    ``tiered``: a ``hints`` cell comes before it, with that many hints (``True``: a number not known).
    The message is one line: what to write, the marker's own hint, and where the hints are.
    """
    about = f"about {n_lines} line{'' if n_lines == 1 else 's'}"
    message = f"Exercise: write this part ({about})."
    if hint and not (tiered and _POINTER.match(hint)):
        message += f" Hint: {hint}" + ("" if hint.endswith((".", "!", "?", "…")) else ".")
    if tiered:
        message += " " + _tiered_sentence(tiered)
    # json.dumps gives a valid Python string literal, whatever quotes the hint contains.
    return [
        f"{indent}# TODO: your code here ({about})",
        f"{indent}raise NotImplementedError({json.dumps(message, ensure_ascii=False)})",
    ]


def _stub_cell_source(source: str, where: str, tiered: int | bool = False) -> str:
    """Replace every BEGIN/END SOLUTION region of one code cell's source by a stub.

    ``where`` ("solutions/x.ipynb, cell 3") names the cell in error messages; ``tiered``: the
    notebook has a ``hints`` cell above this one (with that many hints), so the stub points at ``hint(1)``.
    """
    out: list[str] = []
    region: list[str] | None = None  # lines of the region being read, None outside a region
    indent = hint = ""
    begin_line = 0
    for number, line in enumerate(source.split("\n"), start=1):
        begin, end = _BEGIN.match(line), _END.match(line)
        if begin:
            if region is not None:
                raise ValueError(
                    f"{where}: nested '# BEGIN SOLUTION' on line {number} "
                    f"(the region opened on line {begin_line} has no '# END SOLUTION' yet)"
                )
            rest = begin["rest"].strip()
            hint_match = _HINT.match(rest)
            if rest and not hint_match:
                raise ValueError(
                    f"{where}, line {number}: malformed marker {line.strip()!r}; write "
                    "'# BEGIN SOLUTION' or '# BEGIN SOLUTION (hint: ...)'"
                )
            region, indent, begin_line = [], begin["indent"], number
            hint = hint_match["hint"] if hint_match else ""
        elif end:
            if end["rest"].strip():
                raise ValueError(
                    f"{where}, line {number}: malformed marker {line.strip()!r}; "
                    "write '# END SOLUTION' alone on its line"
                )
            if region is None:
                raise ValueError(
                    f"{where}: '# END SOLUTION' on line {number} without a '# BEGIN SOLUTION'"
                )
            out.extend(_stub(indent, _count_code_lines(region), hint, tiered))
            region = None
        elif region is not None:
            region.append(line)
        else:
            out.append(line)
    if region is not None:
        raise ValueError(
            f"{where}: '# BEGIN SOLUTION' on line {begin_line} has no '# END SOLUTION' "
            "(a region must end in the cell where it starts)"
        )
    return "\n".join(out)


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
        return True
    except SyntaxError:  # also cells with IPython magics (%timeit, !pip): not checked
        return False


def _cells_hash(cells) -> str:
    """SHA-256 of the cells' types and sources, nothing else (not outputs, not metadata)."""
    canonical = json.dumps(
        [[cell["cell_type"], _source(cell)] for cell in cells],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def render_lab(solution_nb, source: str | None = None) -> nbformat.NotebookNode:
    """Return the lab notebook for a solution notebook (the input is not modified).

    ``source`` is the solution's path as stored in the lab's metadata, e.g.
    ``"solutions/01_attention.ipynb"``; it also names the notebook in error messages.
    Raises ``ValueError`` for unbalanced or malformed markers.
    """
    name = source or "notebook"
    lab = copy.deepcopy(nbformat.from_dict(solution_nb))
    # Widget state is output too; everything else (kernelspec, language_info...) is kept.
    lab.metadata.pop("widgets", None)
    cells = []
    tiered: int | bool = False  # a hints cell came before (its number of hints): stubs from here point at hint(1)
    for index, cell in enumerate(lab.cells):
        if SOLUTION_ONLY_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        cell.setdefault("metadata", {}).pop("execution", None)  # run timings
        # nbformat >= 4.5 wants cell ids; make missing ones deterministic (never random).
        if (lab.nbformat, lab.nbformat_minor) >= (4, 5) and "id" not in cell:
            cell["id"] = f"cell-{index}"
        if HINTS_TAG in cell.get("metadata", {}).get("tags", []):
            cell.setdefault("metadata", {}).setdefault("jupyter", {})["source_hidden"] = True
            tiered = _count_hints(_source(cell))
        if cell.cell_type == "code":
            original = _source(cell)
            where = f"{name}, cell {index}"
            cell.source = _stub_cell_source(original, where, tiered)
            if cell.source != original and _parses(original) and not _parses(cell.source):
                raise ValueError(
                    f"{where}: the lab's code is not valid Python once the solution is cut out; "
                    "put the markers around whole statements"
                )
            cell.outputs = []
            cell.execution_count = None
        cells.append(cell)
    lab.cells = cells
    lab.metadata[METADATA_KEY] = {"source": source, "generated_hash": _cells_hash(cells)}
    return lab


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _read(path: Path) -> nbformat.NotebookNode:
    """Read a notebook without letting nbformat invent random cell ids (keeps output stable)."""
    nb = nbformat.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
    if nb.get("nbformat") != 4:
        nb = nbformat.convert(nb, 4)
    return nb


def _text(nb) -> str:
    """The exact text a notebook is written as (sorted keys, one-space indent, final newline)."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def _same_content(path: Path, nb) -> bool:
    """True if the file at ``path`` already holds ``nb`` (compared as JSON, not bytes)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")) == json.loads(_text(nb))
    except (OSError, ValueError):
        return False


def _is_edited(lab_path: Path, fresh) -> bool:
    """True if the lab on disk has cells a learner changed since it was generated.

    A lab whose cells are exactly the fresh ones is never "edited": overwriting it loses nothing.
    An unreadable lab, or one without our metadata, counts as edited (we can't prove otherwise).
    """
    try:
        lab = _read(lab_path)
    except (OSError, ValueError):
        return True
    current = _cells_hash(lab.cells)
    if current == fresh.metadata[METADATA_KEY]["generated_hash"]:
        return False
    stored = lab.metadata.get(METADATA_KEY, {}).get("generated_hash")
    return current != stored


def _source_name(solution_path: Path) -> str:
    return f"{solution_path.parent.name}/{solution_path.name}"


def lab_is_current(solution_path, lab_path) -> bool:
    """True if ``lab_path`` exists and equals a fresh render of ``solution_path``."""
    solution_path, lab_path = Path(solution_path), Path(lab_path)
    fresh = render_lab(_read(solution_path), source=_source_name(solution_path))
    return lab_path.exists() and _same_content(lab_path, fresh)


def generate(solutions_dir="solutions", labs_dir="labs", force=False) -> list[Path]:
    """Write ``labs_dir/<name>.ipynb`` for every ``solutions_dir/*.ipynb``.

    Returns the labs actually written; a lab whose content would not change is left untouched.
    Every solution is rendered and every existing lab checked *before* anything is written: a
    marker error (``ValueError``) or an edited lab (:class:`LabEditedError`, unless ``force``)
    leaves all files as they were.
    """
    solutions_dir, labs_dir = Path(solutions_dir), Path(labs_dir)
    plan = []  # (lab path, fresh lab notebook)
    for solution_path in sorted(solutions_dir.glob("*.ipynb")):
        fresh = render_lab(_read(solution_path), source=_source_name(solution_path))
        plan.append((labs_dir / solution_path.name, fresh))

    to_write = [(path, nb) for path, nb in plan if not _same_content(path, nb)]
    edited = [path for path, nb in to_write if path.exists() and _is_edited(path, nb)]
    if edited and not force:
        raise LabEditedError(edited)

    labs_dir.mkdir(parents=True, exist_ok=True)
    for path, nb in to_write:
        # Write to a temporary file, then rename: a crash never leaves a half-written lab.
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            nbformat.write(nb, f)
        os.replace(tmp, path)
    return [path for path, _ in to_write]


def check_labs(solutions_dir="solutions", labs_dir="labs") -> list[tuple[str, Path]]:
    """Compare labs with a fresh generation, writing nothing.

    Returns ``(status, lab path)`` pairs, status one of "ok", "missing", "stale" (differs from a
    fresh generation) or "no solution" (a lab without a solution notebook).
    """
    solutions_dir, labs_dir = Path(solutions_dir), Path(labs_dir)
    results = []
    names = set()
    for solution_path in sorted(solutions_dir.glob("*.ipynb")):
        lab_path = labs_dir / solution_path.name
        names.add(solution_path.name)
        if not lab_path.exists():
            results.append(("missing", lab_path))
        else:
            results.append(("ok" if lab_is_current(solution_path, lab_path) else "stale", lab_path))
    for lab_path in sorted(labs_dir.glob("*.ipynb")):
        if lab_path.name not in names:
            results.append(("no solution", lab_path))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvlib.course.labs",
        description="Generate labs/*.ipynb from solutions/*.ipynb (run from the repository root).",
    )
    parser.add_argument(
        "--check", action="store_true", help="only compare, write nothing; exit 1 if a lab differs"
    )
    parser.add_argument("--force", action="store_true", help="overwrite labs even if edited")
    args = parser.parse_args(argv)
    solutions_dir, labs_dir = Path("solutions"), Path("labs")

    if not any(solutions_dir.glob("*.ipynb")):
        print(f"no solution notebooks in {solutions_dir.resolve()} (run from the repository root)")
        return 1

    try:
        if args.check:
            results = check_labs(solutions_dir, labs_dir)
            for status, path in results:
                print(f"{status:<11} {path}")
            return 0 if all(status == "ok" for status, _ in results) else 1

        written = generate(solutions_dir, labs_dir, force=args.force)
    except LabEditedError as err:
        for path in err.paths:
            print(f"{'refused':<11} {path}")
        print(f"\n{err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    for solution_path in sorted(solutions_dir.glob("*.ipynb")):
        lab_path = labs_dir / solution_path.name
        print(f"{'written' if lab_path in written else 'unchanged':<11} {lab_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
