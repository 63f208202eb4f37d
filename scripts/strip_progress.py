"""Remove progress-bar outputs from executed notebooks before they are committed.

A notebook executed outside a browser (``jupyter nbconvert --execute``) stores each tqdm bar as a
widget output whose text fallback is the bar's *first* state, ``0%| | 0/N``: opened later in
JupyterLab it reads as a run that stalled, beside the finished results. The bars mean nothing once a
cell has finished, so they are removed; nbval leaves them out of its comparison too (conftest.py), and
tests/test_truth.py fails on a committed notebook that still holds one.

    python scripts/strip_progress.py notebooks/09a_keeping_fewer_positions.ipynb [more.ipynb ...]
    python scripts/strip_progress.py            # every notebook under notebooks/ and solutions/
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

WIDGET = "application/vnd.jupyter.widget-view+json"
ROOT = Path(__file__).resolve().parent.parent


BAR = re.compile(r"\d+%\|.*\|\s*[\d.]+[kMG]?/[\d.?]+[kMG]?")  # tqdm's "  40%|####      | 2/5 [...]"


def is_progress(output: dict) -> bool:
    """A tqdm bar: a widget output (tqdm.auto in a notebook) whose text is a bar, or a bar written to
    stderr. Other widgets (an interactive calculator) are kept."""
    data = output.get("data", {})
    if WIDGET in data:
        return bool(BAR.search("".join(data.get("text/plain", ""))))
    text = "".join(output.get("text", "")) if output.get("name") == "stderr" else ""
    return bool(text) and all(BAR.search(line) for line in text.replace("\r", "\n").splitlines() if line.strip())


def strip(path: Path) -> int:
    """Remove the progress outputs of one notebook in place; returns how many were removed."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    removed = 0
    for cell in nb["cells"]:
        outs = cell.get("outputs")
        if outs:
            kept = [o for o in outs if not is_progress(o)]
            removed += len(outs) - len(kept)
            cell["outputs"] = kept
    if removed:
        nb.get("metadata", {}).pop("widgets", None)  # the widgets' saved state, if any
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return removed


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted(
        (ROOT / "solutions").glob("*.ipynb"))
    for p in paths:
        n = strip(p)
        if n:
            print(f"{p}: {n} progress output(s) removed")
