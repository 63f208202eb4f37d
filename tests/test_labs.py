"""Tests for the labs system (kvlib.course.labs) and the learners' checker (kvlib.course.check)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from kvlib.course import labs
from kvlib.course.check import check, check_fn
from kvlib.course.labs import Hints, LabEditedError, generate, lab_is_current, render_lab

REPO = Path(__file__).resolve().parent.parent
CAPSTONE_CHAPTERS = ["05", "06", "09a", "10"]  # lab 13 has no chapter of its own: it composes these
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}

SOLUTION_FN = """\
import torch

def softmax_rows(x):
    # BEGIN SOLUTION (hint: use torch.softmax)
    # subtracting the max is what torch does too
    z = x - x.max(dim=-1, keepdim=True).values

    e = z.exp()
    return e / e.sum(dim=-1, keepdim=True)
    # END SOLUTION

print("defined")"""


def notebook(*cells):
    return new_notebook(cells=list(cells), metadata={"kernelspec": KERNELSPEC})


def save(nb, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        nbformat.write(nb, f)
    return path


def load(path: Path):
    return nbformat.read(path, as_version=4)


def executed(cell, count=1, text="out\n"):
    """A code cell as if it had been run."""
    cell.execution_count = count
    cell.outputs = [new_output("stream", name="stdout", text=text)]
    return cell


@pytest.fixture
def course(tmp_path):
    """A tiny course: solutions/ with two notebooks, labs/ not generated yet."""
    solutions = tmp_path / "solutions"
    save(notebook(new_markdown_cell("# Softmax"), executed(new_code_cell(SOLUTION_FN))),
         solutions / "01_softmax.ipynb")
    save(notebook(new_code_cell("x = 1\n# BEGIN SOLUTION\ny = x + 1\n# END SOLUTION")),
         solutions / "02_add.ipynb")
    return solutions, tmp_path / "labs"


# ---------------------------------------------------------------- rendering (pure) -------------


def test_stub_keeps_indentation_counts_lines_and_includes_hint():
    lab = render_lab(notebook(new_code_cell(SOLUTION_FN)))
    src = lab.cells[0].source
    assert src == (
        "import torch\n"
        "\n"
        "def softmax_rows(x):\n"
        "    # TODO: your code here (about 3 lines)\n"
        '    raise NotImplementedError("Exercise: write this part (about 3 lines). '
        'Hint: use torch.softmax.")\n'
        "\n"
        'print("defined")'
    )
    # The lab still runs up to the exercise, and the exercise raises with the hint.
    namespace = {}
    exec(src, namespace)
    with pytest.raises(NotImplementedError, match="Hint: use torch.softmax"):
        namespace["softmax_rows"](torch.zeros(2))


def test_several_regions_per_cell_and_per_notebook_without_leaking():
    cell_a = new_code_cell(
        "a = 1\n# BEGIN SOLUTION\nb = a + 1\n# END SOLUTION\n"
        "for i in range(3):\n        # BEGIN SOLUTION (hint: a \"quoted\" hint)\n"
        "        b += i\n        # END SOLUTION\nprint(b)"
    )
    cell_b = new_code_cell("  # begin solution\n  secret = 42\n  # End Solution")  # any case
    lab = render_lab(notebook(cell_a, cell_b))
    a, b = lab.cells[0].source, lab.cells[1].source
    assert a.splitlines() == [
        "a = 1",
        "# TODO: your code here (about 1 line)",
        'raise NotImplementedError("Exercise: write this part (about 1 line).")',
        "for i in range(3):",
        "        # TODO: your code here (about 1 line)",
        '        raise NotImplementedError("Exercise: write this part (about 1 line). '
        'Hint: a \\"quoted\\" hint.")',
        "print(b)",
    ]
    compile(a, "lab", "exec")  # the quotes in the hint are escaped properly
    assert b.startswith("  # TODO: your code here (about 1 line)\n  raise NotImplementedError(")
    for text in (a, b):
        assert "SOLUTION" not in text and "b = a + 1" not in text and "secret" not in text


def test_outputs_cleared_markdown_copied_and_solution_only_dropped():
    markdown = new_markdown_cell("Text with `# BEGIN SOLUTION` is left alone in markdown.")
    plain = executed(new_code_cell("import torch\nprint('hello')"), count=3)
    assertion = new_code_cell("assert softmax_rows", metadata={"tags": ["solution-only"]})
    solution = notebook(markdown, plain, executed(new_code_cell(SOLUTION_FN), count=4), assertion)
    before = json.dumps(solution, sort_keys=True)

    lab = render_lab(solution, source="solutions/x.ipynb")

    assert json.dumps(solution, sort_keys=True) == before  # the input is not modified
    assert [c.cell_type for c in lab.cells] == ["markdown", "code", "code"]  # assertion dropped
    assert lab.cells[0].source == markdown.source
    assert lab.cells[1].source == plain.source
    for cell in lab.cells[1:]:
        assert cell.outputs == [] and cell.execution_count is None
    assert lab.metadata.kernelspec == KERNELSPEC
    meta = lab.metadata.kvlib_lab
    assert meta["source"] == "solutions/x.ipynb"
    assert len(meta["generated_hash"]) == 64


def test_hash_ignores_outputs_but_not_sources():
    lab = render_lab(notebook(new_code_cell(SOLUTION_FN)))
    ran = executed(lab.cells[0])
    assert labs._cells_hash([ran]) == lab.metadata.kvlib_lab["generated_hash"]
    ran.source += "\nprint('mine')"
    assert labs._cells_hash([ran]) != lab.metadata.kvlib_lab["generated_hash"]


@pytest.mark.parametrize(
    "source, problem",
    [
        ("x = 1\n# END SOLUTION", "without a '# BEGIN SOLUTION'"),
        ("# BEGIN SOLUTION\nx = 1", "has no '# END SOLUTION'"),
        ("# BEGIN SOLUTION\n# BEGIN SOLUTION\nx = 1\n# END SOLUTION\n# END SOLUTION", "nested"),
        ("# BEGIN SOLUTION: use softmax\nx = 1\n# END SOLUTION", "malformed"),
    ],
)
def test_unbalanced_markers_raise_naming_file_and_cell(tmp_path, source, problem):
    solutions = tmp_path / "solutions"
    save(notebook(new_markdown_cell("intro"), new_code_cell(source)), solutions / "bad.ipynb")
    with pytest.raises(ValueError) as err:
        generate(solutions, tmp_path / "labs")
    message = str(err.value)
    assert "solutions/bad.ipynb" in message and "cell 1" in message and problem in message
    assert not (tmp_path / "labs" / "bad.ipynb").exists()


def test_hints_cell_is_collapsed_and_later_stubs_point_at_it(capsys):
    hints = new_code_cell('hint = Hints("softmax_rows", "subtract the max", "use torch.softmax")',
                          metadata={"tags": ["hints"]})
    before = new_code_cell("x = 1\n# BEGIN SOLUTION\ny = x + 1\n# END SOLUTION")
    lab = render_lab(notebook(before, hints, new_code_cell(SOLUTION_FN)))
    first, hidden, stub = lab.cells
    assert "hint(1)" not in first.source  # no hints cell above it
    assert hidden.metadata["jupyter"]["source_hidden"] is True and hidden.source == hints.source
    assert "Stuck? hint(1) prints a first hint, hint(2) says more." in stub.source  # Hints(...) gives two
    assert "Hint: use torch.softmax." in stub.source  # the marker's own hint is kept
    compile(stub.source, "lab", "exec")

    # Expanding the collapsed cell changes metadata only: not an edit of the learner's lab.
    opened = copy.deepcopy(lab.cells)
    opened[1].metadata["jupyter"]["source_hidden"] = False
    assert labs._cells_hash(opened) == lab.metadata.kvlib_lab["generated_hash"]

    hint = Hints("softmax_rows", "subtract the max", "use torch.softmax")
    hint(1)
    assert capsys.readouterr().out == "softmax_rows, hint 1 of 2; hint(2) says more:\n  subtract the max\n"
    hint(2)
    assert "hint 2 of 2; after this, see the solutions/ notebook:\n  use torch.softmax" in capsys.readouterr().out
    hint(3)
    assert "there are 2 hints, hint(1) … hint(2)" in capsys.readouterr().out
    with pytest.raises(ValueError):
        Hints("empty")


@pytest.mark.parametrize("n_hints, sentence", [
    (1, "Stuck? hint(1) prints a hint."),
    (2, "Stuck? hint(1) prints a first hint, hint(2) says more."),
    (3, "Stuck? hint(1) prints a first hint, hint(2) and hint(3) say more."),
    (5, "Stuck? hint(1) prints a first hint, hint(2) … hint(5) say more."),
])
def test_stub_message_is_one_clear_line(n_hints, sentence):
    """Issue 24: the stub read "Hint: hint(1), hint(2), hint(3) Stuck? Run hint(1)…". A marker hint that only
    points at the tiered hints is dropped, the stub names how many hints the cell above gives, and the
    message is one line of whole sentences."""
    hints = new_code_cell("hint = Hints(\"f\", " + ", ".join(f'"hint {i}"' for i in range(n_hints)) + ")",
                          metadata={"tags": ["hints"]})
    pointer = new_code_cell("def f():\n    # BEGIN SOLUTION (hint: hint(1), hint(2), hint(3))\n    return 1\n"
                            "    # END SOLUTION")
    plain = new_code_cell("def g():\n    # BEGIN SOLUTION (hint: return 2)\n    return 2\n    # END SOLUTION")
    lab = render_lab(notebook(hints, pointer, plain))
    for cell, own in ((lab.cells[1], ""), (lab.cells[2], " Hint: return 2.")):
        raise_line = [line for line in cell.source.splitlines() if "raise NotImplementedError" in line]
        assert len(raise_line) == 1
        message = raise_line[0].strip()[len('raise NotImplementedError("'):-len('")')]
        assert message == f"Exercise: write this part (about 1 line).{own} {sentence}", message
        assert "Hint: hint(" not in message and message.count("Stuck?") == 1
        compile(cell.source, "lab", "exec")


def test_committed_stubs_say_one_sentence_about_the_hints():
    """Every committed stub's message: what to write, then one sentence about the hints above it."""
    for lab in sorted((REPO / "labs").glob("*.ipynb")):
        for cell in load(lab).cells:
            for message in re.findall(r'raise NotImplementedError\("(.*)"\)', cell.source):
                assert re.fullmatch(r"Exercise: write this part \(about \d+ lines?\)\.( Hint: [^\n]+\.)?"
                                    r" Stuck\? hint\(1\) prints (a hint|a first hint, hint\(2\)[^.]* says? more)\.",
                                    message), (lab.name, message)
                assert "Hint: hint(" not in message, (lab.name, message)


def test_edited_lab_with_hints_is_still_protected(tmp_path):
    solutions = tmp_path / "solutions"
    hints = new_code_cell('hint = Hints("add", "one more")', metadata={"tags": ["hints"]})
    save(notebook(hints, new_code_cell("x = 1\n# BEGIN SOLUTION\ny = x + 1\n# END SOLUTION")),
         solutions / "01_add.ipynb")
    lab_dir = tmp_path / "labs"
    generate(solutions, lab_dir)
    lab = lab_dir / "01_add.ipynb"
    nb = load(lab)
    nb.cells[0].metadata["jupyter"]["source_hidden"] = False  # opened the hints: not an edit
    save(nb, lab)
    sol = load(solutions / "01_add.ipynb")
    sol.cells[0].source = 'hint = Hints("add", "one more", "y = x + 1")'
    save(sol, solutions / "01_add.ipynb")
    assert generate(solutions, lab_dir) == [lab]  # regenerated: nothing of the learner's was lost

    nb = load(lab)
    nb.cells[1].source = nb.cells[1].source.replace("raise NotImplementedError", "y = 2  #")  # an answer
    save(nb, lab)
    edited = lab.read_bytes()
    sol.cells.append(new_markdown_cell("More."))
    save(sol, solutions / "01_add.ipynb")
    with pytest.raises(LabEditedError):
        generate(solutions, lab_dir)
    assert lab.read_bytes() == edited


def test_markers_that_would_break_the_syntax_are_refused():
    source = "total = sum([\n    # BEGIN SOLUTION\n    1, 2,\n    # END SOLUTION\n])"
    with pytest.raises(ValueError, match="not valid Python"):
        render_lab(notebook(new_code_cell(source)), source="solutions/s.ipynb")


# ---------------------------------------------------------------- files ------------------------


def test_generate_writes_labs_and_is_byte_identical_when_repeated(course):
    solutions, lab_dir = course
    written = generate(solutions, lab_dir)
    assert sorted(p.name for p in written) == ["01_softmax.ipynb", "02_add.ipynb"]
    first = {p: p.read_bytes() for p in written}
    mtimes = {p: p.stat().st_mtime_ns for p in written}
    for path, data in first.items():
        assert data.endswith(b"\n")
        assert lab_is_current(solutions / path.name, path)
        assert load(path).metadata.kvlib_lab["source"] == f"solutions/{path.name}"

    assert generate(solutions, lab_dir) == []  # nothing changed: nothing written
    for path, data in first.items():
        assert path.read_bytes() == data
        assert path.stat().st_mtime_ns == mtimes[path]

    # Rendering from scratch in another folder gives the same bytes too.
    other = generate(solutions, lab_dir.parent / "labs_again")
    for path in other:
        assert path.read_bytes() == first[lab_dir / path.name]


def test_edited_lab_is_refused_and_nothing_is_written(course):
    solutions, lab_dir = course
    generate(solutions, lab_dir)
    softmax_lab, add_lab = lab_dir / "01_softmax.ipynb", lab_dir / "02_add.ipynb"

    # A learner fills in the softmax exercise...
    nb = load(softmax_lab)
    nb.cells[1].source = nb.cells[1].source.replace("raise NotImplementedError", "return x  #")
    save(nb, softmax_lab)
    edited_bytes, add_bytes = softmax_lab.read_bytes(), add_lab.read_bytes()
    # ...and the teacher changes both solutions.
    for path in solutions.glob("*.ipynb"):
        sol = load(path)
        sol.cells.append(new_markdown_cell("New paragraph."))
        save(sol, path)

    with pytest.raises(LabEditedError) as err:
        generate(solutions, lab_dir)
    assert isinstance(err.value, RuntimeError)
    assert err.value.paths == [softmax_lab]
    message = str(err.value)
    assert str(softmax_lab) in message and "--force" in message and "move" in message
    assert softmax_lab.read_bytes() == edited_bytes  # the learner's work is untouched
    assert add_lab.read_bytes() == add_bytes  # and the other lab was not written either
    assert not lab_is_current(solutions / "02_add.ipynb", add_lab)

    written = generate(solutions, lab_dir, force=True)
    assert sorted(written) == [softmax_lab, add_lab]
    assert lab_is_current(solutions / "01_softmax.ipynb", softmax_lab)
    assert lab_is_current(solutions / "02_add.ipynb", add_lab)


def test_lab_without_metadata_counts_as_edited(course):
    solutions, lab_dir = course
    generate(solutions, lab_dir)
    lab = lab_dir / "02_add.ipynb"
    nb = load(lab)
    nb.cells.append(new_code_cell("my_own = 1"))
    del nb.metadata["kvlib_lab"]
    save(nb, lab)
    with pytest.raises(LabEditedError, match="02_add.ipynb"):
        generate(solutions, lab_dir)


def test_executed_but_unedited_lab_is_regenerated(course):
    solutions, lab_dir = course
    generate(solutions, lab_dir)
    lab = lab_dir / "01_softmax.ipynb"
    nb = load(lab)
    executed(nb.cells[1], count=7, text="defined\n")
    save(nb, lab)
    assert not lab_is_current(solutions / lab.name, lab)  # outputs make it differ...

    sol = load(solutions / lab.name)
    sol.cells[0].source = "# Softmax, revised"
    save(sol, solutions / lab.name)
    assert generate(solutions, lab_dir) == [lab]  # ...but running it is not editing it
    assert lab_is_current(solutions / lab.name, lab)
    assert load(lab).cells[0].source == "# Softmax, revised"


def test_cli_check_and_generate(course, monkeypatch, capsys):
    solutions, lab_dir = course
    monkeypatch.chdir(solutions.parent)
    assert labs.main(["--check"]) == 1
    assert "missing" in capsys.readouterr().out

    assert labs.main([]) == 0
    assert capsys.readouterr().out.count("written") == 2
    assert labs.main([]) == 0
    assert capsys.readouterr().out.count("unchanged") == 2
    assert labs.main(["--check"]) == 0

    save(notebook(new_code_cell("raise NotImplementedError")), lab_dir / "99_orphan.ipynb")
    assert labs.main(["--check"]) == 1
    assert "no solution" in capsys.readouterr().out


# ---------------------------------------------------------------- the committed course --------


def test_committed_labs_are_current():
    solutions = sorted((REPO / "solutions").glob("*.ipynb"))
    assert solutions, (
        "solutions/ has no notebooks, but the course ships at least one lab "
        "(e.g. solutions/00_setup_lab.ipynb)"
    )
    stale = [
        s.name for s in solutions if not lab_is_current(s, REPO / "labs" / s.name)
    ]
    assert not stale, f"labs out of date or missing: {stale}; run `make labs` and commit labs/"


def test_committed_labs_are_clean_and_have_solutions():
    for lab in sorted((REPO / "labs").glob("*.ipynb")):
        assert (REPO / "solutions" / lab.name).exists(), f"{lab.name} has no solution notebook"
        nb = load(lab)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{lab.name} has outputs"
        assert any(
            "raise NotImplementedError(" in cell.source for cell in nb.cells
        ), f"{lab.name} has no exercise stub"


def test_committed_labs_teach_from_the_mistake():
    """Every exercise has tiered hints (a collapsed hints cell above its stub, and the stub points at
    hint(1)); every lab links back to its chapter notebook; the source articles are never 'seeds'."""
    # a chapter's key is what precedes the first underscore: "05", or "09a" for a chapter in two sittings
    chapters = {p.name.split("_")[0]: p.name for p in (REPO / "notebooks").glob("*.ipynb") if "deep_dive" not in p.name}
    for lab in sorted((REPO / "labs").glob("*.ipynb")):
        nb = load(lab)
        text = "\n".join(cell.source for cell in nb.cells)
        key = lab.name.split("_")[0]
        for chapter in CAPSTONE_CHAPTERS if key == "13" else [key]:  # the capstone links every chapter it composes
            assert f"(../notebooks/{chapters[chapter]})" in text, f"{lab.name}: no link to chapter {chapter}'s notebook"
        assert not re.search(r"\bseed (article|formula|000|001)|seed article", text, re.IGNORECASE), lab.name
        hints_seen = False
        for cell in nb.cells:
            if "hints" in cell.metadata.get("tags", []):
                assert cell.metadata["jupyter"]["source_hidden"] is True
                assert "Hints(" in cell.source
                hints_seen = True
            elif cell.cell_type == "code" and "raise NotImplementedError(" in cell.source:
                assert hints_seen, f"{lab.name}: a stub without a hints cell above it"
                assert "hint(1)" in cell.source
                hints_seen = False
        assert "TODO" not in text.replace("# TODO: your code here", ""), f"{lab.name}: a TODO outside the stubs"


# ---------------------------------------------------------------- the checker ------------------


def test_check_pass_prints_report(capsys):
    x = torch.arange(6.0).reshape(2, 3)
    assert check(x, x.clone(), name="scores") is True
    out = capsys.readouterr().out
    assert out.startswith("scores: yours vs reference")
    assert "(2, 3)" in out and "torch.float32" in out and "max |difference| 0" in out
    assert "PASS ✓" in out


def test_check_accepts_numbers_lists_and_numpy(capsys):
    np = pytest.importorskip("numpy")
    assert check(3, 3)
    assert check(np.ones(3, dtype=np.float32), torch.ones(3))
    assert check((torch.ones(2), torch.zeros(1)), [torch.ones(2), torch.zeros(1)])


def test_check_shape_mismatch(capsys):
    with pytest.raises(AssertionError) as err:
        check(torch.zeros(3, 2), torch.zeros(2, 3), hint="transpose?")
    report = str(err.value)
    assert "(3, 2)" in report and "(2, 3)" in report and "FAIL ✗" in report
    assert "Hint: transpose?" in report
    assert capsys.readouterr().out == ""  # the report is in the error only: shown once, not twice


def test_check_value_mismatch_reports_worst_index():
    ref = torch.zeros(2, 8)
    yours = ref.clone()
    yours[1, 6] = 0.5
    with pytest.raises(AssertionError) as err:
        check(yours, ref, name="out")
    report = str(err.value)
    assert "max |difference| 0.5 at index [1, 6]" in report
    assert "[1, 3:8]" in report  # a few values of each side around the worst one
    assert report.endswith("FAIL ✗")


def test_check_dtype_mismatch_fails_even_if_values_match():
    with pytest.raises(AssertionError, match="dtype") as err:
        check(torch.ones(4, dtype=torch.float16), torch.ones(4))
    assert "max |difference|" in str(err.value)


def test_check_within_tolerance_passes_and_report_is_deterministic(capsys):
    ref = torch.linspace(0, 1, 10)
    check(ref + 1e-7, ref)
    first = capsys.readouterr().out
    check(ref + 1e-7, ref)
    assert capsys.readouterr().out == first
    assert "0x" not in first  # no addresses


@pytest.mark.parametrize("missing", [None, NotImplemented])
def test_check_not_written_yet(missing):
    with pytest.raises(AssertionError, match="not written yet"):
        check(missing, torch.zeros(1))


def test_check_fn(capsys):
    def mine(x):
        raise NotImplementedError("Exercise: write this part (about 1 line).")

    with pytest.raises(NotImplementedError):
        check_fn(mine, torch.exp, torch.zeros(3))
    assert "mine: not written yet — fill in the stub" in capsys.readouterr().out

    def my_exp(x):
        return x.exp()

    assert check_fn(my_exp, torch.exp, torch.zeros(3))
    assert "my_exp: yours vs reference" in capsys.readouterr().out


def test_check_fn_gives_each_side_its_own_arguments():
    def mine(cache, x):  # appends in place, as a KV cache does
        cache.append(x)
        return torch.stack(cache)

    def reference(cache, x):
        return torch.stack(cache + [x])

    cache = [torch.zeros(2)]
    assert check_fn(mine, reference, cache, torch.ones(2))


def test_each_lab_runs_until_its_first_exercise_stub(tmp_path):
    """A lab must work up to its first TODO: the first error a learner meets is the stub's
    NotImplementedError, never an import error or a broken cell before it.

    One kernel runs every lab, its namespace emptied (``%reset -f``) and its figures closed before each, so a
    lab that forgot an import still fails; what is shared is the modules already imported (a kernel start and
    ``import torch, kvlib`` per lab were most of this test's 75 s)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    labs = sorted((REPO / "labs").glob("*.ipynb"))
    assert labs, "no labs to run"
    client = NotebookClient(nbformat.v4.new_notebook(), timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    fresh = nbformat.v4.new_code_cell("%reset -f\nimport matplotlib.pyplot as _plt; _plt.close('all'); del _plt\n"
                                      f"import os as _os; _os.chdir({str(tmp_path)!r}); del _os")
    with client.setup_kernel():
        for lab in labs:
            nb = nbformat.read(lab, as_version=4)
            client.nb = nb
            client.execute_cell(fresh, 0)
            with pytest.raises(CellExecutionError) as err:
                for i, cell in enumerate(nb.cells):
                    client.execute_cell(cell, i)
            assert err.value.ename == "NotImplementedError", f"{lab.name}: first error is {err.value.ename}"
            # Where it stops (what the labs' intros tell the learner, issue 24): the first stub's cell only defines
            # a function and runs; the first error comes from a later cell that calls it, a check.
            failed = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                      and any(o.get("output_type") == "error" for o in c.get("outputs", []))]
            first_stub = next(i for i, c in enumerate(nb.cells) if "raise NotImplementedError(" in c.source)
            assert len(failed) == 1 and failed[0] > first_stub, (lab.name, failed, first_stub)
            assert "raise NotImplementedError(" not in nb.cells[failed[0]].source, lab.name
            assert nb.cells[first_stub].get("execution_count") is not None, f"{lab.name}: the stub's cell did not run"


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "labs").glob("*.ipynb")))
def test_intro_says_where_an_unwritten_exercise_stops(name):
    """Issue 24: the intro said a cell holding the `raise` "stops there"; the stub's cell runs (it defines a
    function) and the check cell after it stops (test_each_lab_runs_until_its_first_exercise_stub checks that)."""
    intro = load(REPO / "labs" / name).cells[0].source
    assert "stops there" not in intro
    assert "runs without an error" in intro and "the check cell after it" in intro


WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}
STUB = re.compile(r"# TODO: your code here \(about (\d+) lines?\)")


def _solution_regions(cell_source: str) -> list[int]:
    """Lines a learner writes in each BEGIN/END SOLUTION region of a cell, counted as kvlib.course.labs counts them."""
    counts, region = [], None
    for line in cell_source.split("\n"):
        if labs._BEGIN.match(line):
            region = []
        elif labs._END.match(line):
            counts.append(labs._count_code_lines(region))
            region = None
        elif region is not None:
            region.append(line)
    return counts


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "labs").glob("*.ipynb")))
def test_headings_stubs_and_solutions_give_the_same_line_counts(name):
    """Issues 21 and 24: an exercise's heading says "(about 4 lines)", "(2 lines)" or "(about 1 + 7 lines)"
    (or "(five short method bodies)"); its stubs, in order, say the same counts, and each stub's count is the
    solution's (its non-blank, non-comment lines between the markers: the rule kvlib.course.labs uses)."""
    lab = load(REPO / "labs" / name)
    solution = load(REPO / "solutions" / name)
    sol_counts = [n for c in solution.cells if c.cell_type == "code" for n in _solution_regions(c.source)]
    stub_counts = [int(n) for c in lab.cells if c.cell_type == "code" for n in STUB.findall(c.source)]
    assert stub_counts == sol_counts, (stub_counts, sol_counts)

    sections, current = [], None  # (heading, [stub counts]) per exercise
    for cell in lab.cells:
        heading = re.search(r"^#+ Exercise \d+ · .*$", cell.source, re.M) if cell.cell_type == "markdown" else None
        if heading:
            current = (heading[0], [])
            sections.append(current)
        elif cell.cell_type == "markdown" and re.match(r"^#{1,2} ", cell.source):
            current = None  # "## Going further" and other sections hold no exercise
        elif cell.cell_type == "code":
            found = [int(n) for n in STUB.findall(cell.source)]
            assert not found or current is not None, f"{name}: a stub outside an exercise: {cell.source[:80]!r}"
            if found:
                current[1].extend(found)
    assert sections and sum(len(s) for _, s in sections) == len(stub_counts), name
    for heading, stubs in sections:
        lines = re.search(r"\((?:about )?(\d+(?: \+ \d+)*) lines?\)\s*$", heading)
        bodies = re.search(r"\((\w+) short method bodies\)\s*$", heading)
        assert lines or bodies, f"{name}: {heading!r} does not say how many lines the exercise takes"
        said = [int(n) for n in lines[1].split(" + ")] if lines else [1] * WORDS[bodies[1]]
        assert len(said) == len(stubs), (heading, stubs)
        if lines:
            assert said == stubs, (heading, stubs)
