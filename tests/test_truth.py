"""Checks that keep the course's words true (issue "truth pass"):

- no internal jargon for the source articles ("seed 000", "seed article"), no stale "chapter to come",
  no TODO in the chapters or the solutions (the labs' stubs keep their own marker);
- every hand-drawn %-of-bandwidth plot in a notebook draws its 100% line (the harness's own plots are
  tested in test_bench_sweeps.py);
- the README's results table is what the notebooks' committed outputs say (``python -m kvlib.course.readme``);
- words written for the people who maintain the course (the test tools, test ids, "session", the GPU
  script, "whoever maintains") appear neither in what learners read (chapters, labs, solutions, their
  printed outputs, README.md, GLOSSARY.md) nor in the messages kvlib prints; they belong in CONTRIBUTING.md;
- the README stays a learner's page: at most 15 KB, no course targets, a chapter map that lists every chapter
  and no chapter that does not exist, links that resolve; the GPU headline table lives in CONTRIBUTING.md,
  where ``python -m kvlib.bench --from-csv ... --update-readme CONTRIBUTING.md`` finds its markers;
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
    files = [ROOT / "README.md", ROOT / "GLOSSARY.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "kvlib").rglob("*.py"))]
    bad = [(f.name, m.group(0)) for f in files for m in JARGON.finditer(f.read_text())]
    assert not bad, bad


MAINTAINER = re.compile(r"\bnbval\b|\bpytest\b|tests/test_\w+\.py|\bsessions?\b|gpu_check|whoever maintains|"
                        r"run by hand|developed on|run by the tests|built without a\s+GPU|"
                        r"\b(?:course's )?tests (?:run|compare|check|do not)", re.I)


@pytest.mark.parametrize("nb", NOTEBOOKS + SOLUTIONS + LABS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_maintainer_words_in_what_learners_read(nb):
    bad = [(where, m.group(0)) for where, text in _texts(nb) for m in MAINTAINER.finditer(text)]
    assert not bad, f"say only what helps the learner (maintainer facts go to CONTRIBUTING.md): {bad}"


LEARNER_PAGES = ["README.md", "GLOSSARY.md"]  # CONTRIBUTING.md is the maintainers' page


@pytest.mark.parametrize("name", LEARNER_PAGES)
def test_no_maintainer_words_in_the_learners_pages(name):
    bad = [m.group(0) for m in MAINTAINER.finditer((ROOT / name).read_text())]
    assert not bad, f"{name} is for learners: move these to CONTRIBUTING.md: {bad}"


def test_maintainer_facts_live_in_contributing_not_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert (ROOT / "CONTRIBUTING.md").exists(), "CONTRIBUTING.md holds what maintainers need"
    assert not re.search(r"^#+ .*maintainer", readme, re.M | re.I), "no maintainers' section in the README"
    assert "CONTRIBUTING.md" in readme, "the README points maintainers to CONTRIBUTING.md"
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert "KVLIB_STRICT=1" in contributing and "GLOSSARY.md" in contributing


README_MAX_BYTES = 15_000  # issue 39: a learner's page of at most 15 KB
TARGETS = re.compile(r"\(targets? [≥≤<>]|target\W{0,6}(?:\*\*)?(?:met|missed)\b|target on a (?:cpu|gpu)|"
                     r"<!-- headline:start -->", re.I)


def test_readme_is_a_short_page_for_learners():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= README_MAX_BYTES, f"README.md is {len(text.encode())} bytes (at most {README_MAX_BYTES})"
    bad = [m.group(0) for m in TARGETS.finditer(text)]
    assert not bad, f"the course's targets belong in CONTRIBUTING.md and the benchmarks, not the README: {bad}"


def test_the_gpu_headline_table_is_where_the_bench_tool_writes_it():
    from kvlib.bench.__main__ import END, START

    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert text.count(START) == 1 and text.count(END) == 1 and text.index(START) < text.index(END)
    assert "--update-readme CONTRIBUTING.md" in text


CHAPTER_ROW = re.compile(r"^\| (\d\d[a-z]?) \| \[[^\]]+\]\((notebooks/[^)]+\.ipynb)\) \| ([^|]+) \|", re.M)


def test_readme_chapter_map_lists_every_chapter_and_only_those():
    text = (ROOT / "README.md").read_text()
    rows = CHAPTER_ROW.findall(text)
    chapters = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")
                      if "deep_dive" not in p.name)
    assert [path for _, path, _ in rows] == chapters, "one row per chapter notebook, in order"
    long = [num for num, _, line in rows if len(line.split()) > 25]
    assert not long, f"chapter-map lines over 25 words: {long}"


@pytest.mark.parametrize("name", ["README.md", "GLOSSARY.md", "CONTRIBUTING.md"])
def test_relative_links_resolve(name):
    text = re.sub(r"```.*?```|`[^`\n]*`", "", (ROOT / name).read_text(), flags=re.S)  # examples in code are not links
    targets = re.findall(r"\]\(((?!https?:|#|mailto:)[^)#\s]+)", text)
    missing = sorted({t for t in targets if not (ROOT / t).exists()})
    assert not missing, f"{name} links to files that do not exist: {missing}"


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
