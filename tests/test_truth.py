"""Checks that keep the course's words true (issue "truth pass"):

- no internal jargon for the source articles ("seed 000", "seed article"), no stale "chapter to come",
  no TODO in the chapters or the solutions (the labs' stubs keep their own marker);
- every hand-drawn %-of-bandwidth plot in a notebook draws its 100% line (the harness's own plots are
  tested in test_bench_sweeps.py);
- the README's results table is what the notebooks' committed outputs say (``python -m kvlib.course.readme``);
- words written for the people who maintain the course (the test tools, test ids, "session", the GPU
  script, "whoever maintains") appear neither in what learners read (chapters, labs, solutions, their
  printed outputs, the README outside its maintainers' section) nor in the messages kvlib prints;
- no committed notebook holds a frozen progress bar (``scripts/strip_progress.py``).
"""

import json
import re
import runpy
from pathlib import Path

import pytest

from kvlib.course import readme

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
LABS = sorted((ROOT / "labs").glob("*.ipynb"))

JARGON = re.compile(r"seed[ -](article|0\d\d\b)|the seed article|chapter to come", re.I)


def _texts(nb: Path):
    """(where, text) for every cell source and every textual output (images are not text)."""
    d = json.loads(nb.read_text())
    for i, cell in enumerate(d["cells"]):
        yield f"{nb.name} cell {i}", "".join(cell["source"])
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                yield f"{nb.name} cell {i} output", "".join(out["text"])
            for mime in ("text/markdown", "text/plain", "text/html"):
                if mime in out.get("data", {}):
                    yield f"{nb.name} cell {i} output", "".join(out["data"][mime])


@pytest.mark.parametrize("nb", NOTEBOOKS + SOLUTIONS + LABS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_jargon_or_stale_promises(nb):
    bad = [(where, m.group(0)) for where, text in _texts(nb) for m in JARGON.finditer(text)]
    assert not bad, f"say 'the source article' (named by title in notebook 00) and link existing chapters: {bad}"


def test_no_jargon_in_readme_and_package():
    files = [ROOT / "README.md", *sorted((ROOT / "kvlib").rglob("*.py"))]
    bad = [(f.name, m.group(0)) for f in files for m in JARGON.finditer(f.read_text())]
    assert not bad, bad


MAINTAINER = re.compile(r"\bnbval\b|\bpytest\b|tests/test_\w+\.py|\bsessions?\b|gpu_check|whoever maintains|"
                        r"run by hand|developed on|run by the tests|built without a\s+GPU|"
                        r"\b(?:course's )?tests (?:run|compare|check|do not)", re.I)


@pytest.mark.parametrize("nb", NOTEBOOKS + SOLUTIONS + LABS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_maintainer_words_in_what_learners_read(nb):
    bad = [(where, m.group(0)) for where, text in _texts(nb) for m in MAINTAINER.finditer(text)]
    assert not bad, f"say only what helps the learner (maintainer facts go to the README's maintainers' section): {bad}"


def _readme_for_learners() -> str:
    text = (ROOT / "README.md").read_text()
    head, sep, rest = text.partition("\n## For maintainers")
    assert sep, "the README needs a '## For maintainers' section (the last one) for facts learners do not need"
    assert "\n## " not in rest, "'## For maintainers' must be the README's last section"
    return head


def test_no_maintainer_words_in_the_readme_outside_its_maintainers_section():
    bad = [m.group(0) for m in MAINTAINER.finditer(_readme_for_learners())]
    assert not bad, bad


def test_messages_kvlib_prints_to_learners_have_no_maintainer_words():
    from kvlib.bench import results

    assert not MAINTAINER.search(results.NO_REFERENCE), results.NO_REFERENCE


IS_PROGRESS = runpy.run_path(str(ROOT / "scripts" / "strip_progress.py"))["is_progress"]


@pytest.mark.parametrize("nb", NOTEBOOKS + SOLUTIONS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_frozen_progress_bars_are_committed(nb):
    d = json.loads(nb.read_text())
    bad = [i for i, cell in enumerate(d["cells"]) for o in cell.get("outputs", []) if IS_PROGRESS(o)]
    assert not bad, f"{nb.name}: progress bars in cells {bad}: run scripts/strip_progress.py on it"


@pytest.mark.parametrize("nb", NOTEBOOKS + SOLUTIONS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_todo_in_chapters_and_solutions(nb):
    d = json.loads(nb.read_text())
    bad = [i for i, cell in enumerate(d["cells"]) if "TODO" in "".join(cell["source"])]
    assert not bad, f"{nb.name}: TODO in cells {bad}"


PCT_AXIS = re.compile(r"""(ylabel\s*=\s*|set_ylabel\(\s*)f?["'][^"']*%[^"']*["']""")


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_percent_of_bandwidth_plots_draw_their_100_percent_line(nb):
    d = json.loads(nb.read_text())
    for i, cell in enumerate(d["cells"]):
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and PCT_AXIS.search(src):
            assert re.search(r"axhline\(\s*100", src), f"{nb.name} cell {i}: a % axis without axhline(100, ...)"


def test_readme_results_table_matches_the_notebooks():
    text = (ROOT / "README.md").read_text()
    assert readme.render(text) == text, "the README's results table is stale: run `python -m kvlib.course.readme`"


def test_readme_generator_fails_loudly_on_a_reworded_output(tmp_path):
    (tmp_path / "notebooks").mkdir()
    for row in readme.ROWS:
        nb = {"cells": [{"cell_type": "code", "source": [], "outputs": [{"output_type": "stream", "text": ["x"]}]}]}
        (tmp_path / "notebooks" / row.notebook).write_text(json.dumps(nb))
    with pytest.raises(ValueError, match="no printed output matches"):
        readme.table(tmp_path)
