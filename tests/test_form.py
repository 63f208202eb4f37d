"""The form guard: the notebooks listed as "in the form" read as COURSE.md's "How a chapter reads" says.

For each notebook in FORM (chapters and their labs/solutions, as they move into the form), it fails on:
- a code cell over MAX_CELL_LINES lines (plumbing belongs in the module);
- generated prose: a markdown/HTML output longer than two lines, or an output line of more than
  MAX_OUTPUT_WORDS words (a printed verdict is one short line, not a paragraph built with f-strings);
- a bare ``assert`` in a cell (``expect(...)`` protects a result without deciding it);
- the course's acceptance targets shown as lessons ("target met", "Target on a CPU");
- a measured number in markdown: a decimal with a unit of time, speed, ratio or share (``3.08 ms``,
  ``6.0×``, ``82.5%``). Markdown holds cited constants and values exact by construction; a line that
  holds one of those on purpose ends with ``<!-- cited -->`` or ``<!-- exact -->``;
- a chapter without its reading time in the first cell, without a diagram from ``kvlib.course.draw``
  in its first half, or without Back/Next links in its last cell;
- a link to GLOSSARY.md whose anchor is not a term there.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_CELL_LINES = 25
MAX_OUTPUT_WORDS = 30

# The chapters in the form: all of them.
FORM_CHAPTERS = ["00_setup", "01_attention", "02_naive_decoding", "03_kv_cache", "04_kv_memory", "05_paged_kv", "06_int8_kv",
                 "07_gqa", "08a_serving_many_requests", "08b_prefix_cache",
                 "09a_keeping_fewer_positions", "09b_keeping_fewer_bits", "10_http_serving", "11a_speculative_decoding",
                 "11b_sparse_reads_and_hybrid_layers", "12a_sharding_the_cache", "12b_moving_the_cache"]
# A chapter being moved into the form can be checked before it joins the list:
#   KVLIB_FORM_EXTRA=05_paged_kv pytest tests/test_form.py
FORM_CHAPTERS += [s for s in os.environ.get("KVLIB_FORM_EXTRA", "").split(",") if s and s not in FORM_CHAPTERS]


def _chapters() -> list[str]:
    """Every chapter notebook, in reading order (deep dives excluded)."""
    return sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]*.ipynb") if "deep_dive" not in p.stem)


def _form_files() -> list[str]:
    files = []
    for stem in FORM_CHAPTERS:
        files.append(f"notebooks/{stem}.ipynb")
        files += [f"{d}/{stem}_lab.ipynb" for d in ("labs", "solutions")]
        # a chapter's deep dives: 02_deep_dive_* for 02; 08_deep_dive_* for both sittings 08a and 08b, listed once
        files += sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").glob(f"{stem[:2]}_deep_dive*.ipynb"))
    return list(dict.fromkeys(files))


def _load(rel: str) -> dict:
    return json.loads((ROOT / rel).read_text(encoding="utf-8"))


def _src(cell) -> str:
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


def _python(source: str) -> str:
    """The cell without IPython magics and shell lines, so ast can read it."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _output_texts(cell):
    """(mime, text) of each output, leaving out tables and source code shown with IPython's Code (not prose)."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            yield "text/plain", "".join(out.get("text", ""))
        html = out.get("data", {}).get("text/html", "")
        html = "".join(html) if isinstance(html, list) else html
        if "<table" in html or 'class="highlight"' in html:
            continue
        for mime, data in out.get("data", {}).items():
            if mime in ("text/plain", "text/markdown", "text/html"):
                yield mime, "".join(data) if isinstance(data, list) else data


UNIT = r"(?:ms|µs|us|ns|s|min|GB/s|TB/s|MB/s|GiB/s|tokens/s|tok/s|×|x|%)"
MEASURED = re.compile(rf"(?<![\w.])\d+\.\d+\s?{UNIT}(?![\w/])")
TARGET = re.compile(r"target\W{0,6}(?:\*\*)?(?:met|missed)\b|target on a (?:cpu|gpu)", re.IGNORECASE)
GLOSSARY_LINK = re.compile(r"GLOSSARY\.md#([\w-]+)")


def glossary_anchors() -> set[str]:
    path = ROOT / "GLOSSARY.md"
    if not path.exists():
        return set()
    anchors = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:  # GitHub's slug: lower case, punctuation dropped except - and _, spaces to -
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def form_problems(rel: str, nb: dict, anchors: set[str]) -> list[str]:
    """Everything in this notebook that breaks the form, one line each (cell numbers from 0)."""
    problems = []
    cells = nb["cells"]
    for i, cell in enumerate(cells):
        src = _src(cell)
        if cell["cell_type"] == "markdown":
            for line in src.splitlines():
                if "<!-- cited -->" in line or "<!-- exact -->" in line:
                    continue
                for m in MEASURED.finditer(line):
                    problems.append(f"cell {i}: a measured number in markdown ({m.group(0)!r}): print it from the "
                                    f"cell that measures it, or mark a cited/exact value with <!-- cited -->")
            if TARGET.search(src):
                problems.append(f"cell {i}: a course target shown as a lesson")
            if re.search(r"\]\(\{\w+\}", src):  # a link whose target is still a template placeholder: [x]({G}term)
                problems.append(f"cell {i}: an unrendered template placeholder in a link")
            for anchor in GLOSSARY_LINK.findall(src):
                if anchor not in anchors:
                    problems.append(f"cell {i}: GLOSSARY.md#{anchor} is not a term in GLOSSARY.md")
            continue
        if cell["cell_type"] != "code":
            continue
        lines = src.rstrip().splitlines()
        if len(lines) > MAX_CELL_LINES:
            problems.append(f"cell {i}: {len(lines)} lines (at most {MAX_CELL_LINES}): move the plumbing to the module")
        try:
            tree = ast.parse(_python(src))
        except SyntaxError:
            tree = None
        if tree is not None and any(isinstance(n, ast.Assert) for n in ast.walk(tree)):
            problems.append(f"cell {i}: a bare assert: use expect(condition, what) so every outcome can show")
        for mime, text in _output_texts(cell):
            if mime in ("text/markdown", "text/html") and len(text.strip().splitlines()) > 2:
                problems.append(f"cell {i}: generated {mime} of {len(text.strip().splitlines())} lines: write prose in markdown")
            for line in text.splitlines():
                if len(line.split()) > MAX_OUTPUT_WORDS and "|" not in line:
                    problems.append(f"cell {i}: an output line of {len(line.split())} words: a printed verdict is one short line")
                    break
            if TARGET.search(text):
                problems.append(f"cell {i}: a course target shown as a lesson in the output")
    return problems


def chapter_problems(stem: str, nb: dict) -> list[str]:
    problems = []
    cells = nb["cells"]
    first_md = next((_src(c) for c in cells if c["cell_type"] == "markdown"), "")
    if not re.search(r"reading time", first_md, re.IGNORECASE):
        problems.append("the first markdown cell does not state the reading time")
    half = cells[: max(1, len(cells) // 2)]
    if not any(c["cell_type"] == "code" and "kvlib.course.draw" in _src(c) or "from kvlib.course import draw" in _src(c)
               for c in half):
        problems.append("no diagram from kvlib.course.draw in the first half of the notebook")
    order = _chapters()
    k = order.index(stem)
    last = next((_src(c) for c in reversed(cells) if c["cell_type"] == "markdown"), "")
    if k > 0 and not re.search(rf"Back[^\n]*\]\({re.escape(order[k - 1])}\.ipynb\)", last):
        problems.append(f"the last markdown cell has no 'Back' link to {order[k - 1]}.ipynb")
    if k + 1 < len(order) and not re.search(rf"Next[^\n]*\]\({re.escape(order[k + 1])}\.ipynb\)", last):
        problems.append(f"the last markdown cell has no 'Next' link to {order[k + 1]}.ipynb")
    return problems


@pytest.fixture(scope="module")
def anchors():
    return glossary_anchors()


@pytest.mark.parametrize("rel", _form_files())
def test_notebook_is_in_the_form(rel, anchors):
    problems = form_problems(rel, _load(rel), anchors)
    stem = Path(rel).stem
    if rel.startswith("notebooks/") and stem in FORM_CHAPTERS:
        problems += chapter_problems(stem, _load(rel))
    assert not problems, f"{rel} is not in the form:\n  " + "\n  ".join(problems)


def test_glossary_links_everywhere_resolve(anchors):
    """Every GLOSSARY.md#anchor link in the README, notebooks, labs and the glossary itself names a term."""
    assert anchors, "GLOSSARY.md is missing or has no terms"
    bad = []
    for path in [ROOT / "README.md", ROOT / "GLOSSARY.md", *sorted((ROOT / "notebooks").glob("*.ipynb")),
                 *sorted((ROOT / "solutions").glob("*.ipynb"))]:
        text = path.read_text(encoding="utf-8")
        bad += [f"{path.name}: #{a}" for a in GLOSSARY_LINK.findall(text) if a not in anchors]
    assert not bad, "links to terms GLOSSARY.md does not define:\n  " + "\n  ".join(bad)


# The guard itself: each rule catches what it is for, and passes what it must allow.
def _nb(*cells):
    return {"cells": list(cells)}


def _code(src, outputs=()):
    return {"cell_type": "code", "source": src, "outputs": list(outputs), "metadata": {}}


def _md(src):
    return {"cell_type": "markdown", "source": src, "metadata": {}}


@pytest.mark.parametrize("cell, catches", [
    (_code("\n".join(f"x{i} = {i}" for i in range(26))), "26 lines"),
    (_code("assert x < 3"), "bare assert"),
    (_code("%time y = 1\nassert y"), "bare assert"),
    (_code("y = 1", [{"output_type": "display_data", "data": {"text/markdown": "a\nb\nc\n"}}]), "generated text/markdown"),
    (_code("print(s)", [{"output_type": "stream", "name": "stdout", "text": " ".join(["word"] * 31)}]), "words"),
    (_md("The cached loop took 3.08 ms per token."), "measured number"),
    (_md("a 6.0× speed-up"), "measured number"),
    (_md("Target on a CPU: 5x"), "target"),
    (_md("see [perplexity](../GLOSSARY.md#no-such-term)"), "not a term"),
    (_md("see [FLOPs]({G}flop)"), "placeholder"),
])
def test_the_guard_catches(cell, catches):
    problems = form_problems("x.ipynb", _nb(cell), {"perplexity"})
    assert any(catches in p for p in problems), problems


@pytest.mark.parametrize("cell", [
    _code("\n".join(f"x{i} = {i}" for i in range(25))),
    _code("expect(x < 3, 'x stays below 3')"),
    _code("print(t)", [{"output_type": "stream", "name": "stdout", "text": "| a | b |\n|---|---|\n| 1 | 2 |\n"}]),
    _md("LLaMA-7B at 2,048 tokens holds 1.0 GiB per sequence. <!-- exact -->"),
    _md("Decoding reads every weight once per step; [perplexity](../GLOSSARY.md#perplexity)."),
    _md("Run the cell: if the ratio printed above is below 1, the copy did not pay for itself."),
    _md("$$P = \\text{softmax}(Q K^\\top / \\sqrt{D})$$"),
])
def test_the_guard_allows(cell):
    assert form_problems("x.ipynb", _nb(cell), {"perplexity"}) == []
