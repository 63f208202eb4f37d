"""``python -m kvlib.bench [--quick | --smoke] [--only NAME ...] [--out DIR] [--budget-s S]``

Runs the benchmark sweeps (see ``kvlib.bench.sweeps``) and writes to DIR (default ``bench-out``):
- ``results.csv``: one row per measurement, stamped (device, driver, CUDA, torch, triton, date);
  rewritten after every point, so a process that dies (a CUDA fault, a kill) leaves the rows measured so far;
- ``stamp.json``: the same stamp plus the measured copy bandwidth and the command line (``complete``:
  false until the run has ended);
- ``summary.md``: the headline table (each kernel against its target);
- ``<sweep>.png``: one figure per sweep, log axes, units, the device in the title.

Measuring nothing:
- ``--from-csv RESULTS_CSV``: redraw the figures and summary.md of an existing results.csv into DIR;
- ``--merge PATH ...``: join the results.csv files of several runs (each PATH a results.csv, a folder
  holding one, or a folder of such folders, e.g. one per sweep) into DIR's results.csv, stamp.json,
  summary.md and figures (scripts/gpu_check.sh runs each sweep in its own process, then merges them);
- ``--plan``: print each sweep's name and number of points for this machine, one per line.

Exit status 1 when any kernel's output disagrees with its baseline (a row whose status starts with
MISMATCH), so a GPU check run fails loudly; an error in a point (other than out of memory) is raised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .. import runtime
from . import copy_bandwidth_gbps
from .results import STAMP_KEYS, headline_markdown, plot_sweep, read_csv, reference, stamp, write_csv
from .sweeps import SWEEPS, plan, run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlib.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer points (CPU: PyTorch paths at small sizes + interpreter correctness, < 3 min)")
    ap.add_argument("--smoke", action="store_true",
                    help="one point per sweep, the smallest: the whole harness end to end in well under a minute")
    ap.add_argument("--only", action="append", metavar="NAME", choices=list(SWEEPS),
                    help=f"run only this sweep (repeatable): {', '.join(SWEEPS)}")
    ap.add_argument("--out", default="bench-out", help="folder for results.csv, summary.md and the PNGs")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new points after this many seconds (the rest are listed as skipped)")
    ap.add_argument("--no-plots", action="store_true", help="write the CSV and summary only")
    ap.add_argument("--from-csv", metavar="RESULTS_CSV",
                    help="measure nothing: redraw the plots and the summary of an existing results.csv into --out")
    ap.add_argument("--update-readme", metavar="README",
                    help="with --from-csv: put the headline table between the headline markers of this file (CONTRIBUTING.md)")
    ap.add_argument("--merge", nargs="+", metavar="PATH",
                    help="measure nothing: join these results.csv files (or folders holding them, or folders of "
                         "such folders) into --out: results.csv, stamp.json, summary.md and the plots")
    ap.add_argument("--plan", action="store_true",
                    help="measure nothing: print 'NAME POINTS' for each sweep (--only, --quick, --smoke apply)")
    args = ap.parse_args(argv)
    if args.plan:
        for name, n in plan(args.only, quick=args.quick, smoke=args.smoke):
            print(name, n)
        return 0
    if args.merge:
        return merge([Path(p) for p in args.merge], Path(args.out), plots=not args.no_plots,
                     command=_command(argv))
    if args.from_csv:
        rc = redraw(Path(args.from_csv), Path(args.out), args.only)
        if args.update_readme:
            update_readme(Path(args.update_readme), Path(args.out) / "summary.md", Path(args.from_csv))
        return rc

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(SWEEPS)
    t0 = time.perf_counter()
    print(f"kvlib.bench: {runtime.mode()} mode on {runtime.device_name()}; sweeps {', '.join(names)}"
          f"{' (quick)' if args.quick else ''}{' (smoke)' if args.smoke else ''}", flush=True)
    st = stamp()
    st.update(copy_bandwidth_gbps=round(copy_bandwidth_gbps(), 1), quick=args.quick, smoke=args.smoke, sweeps=names,
              command=_command(argv), seconds=None, complete=False)
    _write_json(st, out / "stamp.json")  # complete: false until the sweeps have ended
    _write_csv_atomic([], out / "results.csv")  # no rows yet: an older run's must not pass for this one's
    rows = run(names, quick=args.quick, smoke=args.smoke, budget_s=args.budget_s,
               on_rows=lambda rows: _write_csv_atomic(rows, out / "results.csv"))
    st.update(seconds=round(time.perf_counter() - t0, 1), complete=True)
    _write_csv_atomic(rows, out / "results.csv")
    _write_json(st, out / "stamp.json")
    summary = headline_markdown(rows, st)
    (out / "summary.md").write_text(summary)
    if not args.no_plots:
        for name in names:
            ref_label, ref_rows = (None, []) if runtime.mode() == "gpu" else reference(name)
            plot_sweep(rows, name, out / f"{name}.png", reference_rows=ref_rows, reference_label=ref_label)

    bad = [r for r in rows if str(r.get("status", "")).startswith("MISMATCH")]
    counts = {}
    for r in rows:
        key = str(r.get("status", "")).split(":")[0].split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    print(f"\n{len(rows)} rows in {out / 'results.csv'} ({', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))}); "
          f"copy bandwidth {st['copy_bandwidth_gbps']} GB/s; {st['seconds']} s")
    print(summary)
    for r in bad:
        print(f"MISMATCH: {r['sweep']} {r['kernel']} {r}", file=sys.stderr)
    return 1 if bad else 0


def _command(argv) -> str:
    return " ".join(["python -m kvlib.bench", *(argv if argv is not None else sys.argv[1:])])


def _write_csv_atomic(rows, path: Path):
    """write_csv into a temporary file, then rename it over ``path``: a process killed while writing
    leaves the previous complete file, never half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write_csv(rows, tmp)
    os.replace(tmp, path)


def _write_json(obj, path: Path):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _results_files(path: Path) -> list[Path]:
    """The results.csv files a --merge PATH names: the file itself, a folder's results.csv, or else the
    results.csv of each of the folder's subfolders (sorted by name; the rows are put in run order later)."""
    if path.is_file():
        return [path]
    if (path / "results.csv").is_file():
        return [path / "results.csv"]
    if path.is_dir():
        return sorted(path.glob("*/results.csv"))
    raise SystemExit(f"--merge {path}: no such file or folder")


def merge(paths: list[Path], out: Path, *, plots: bool = True, command: str | None = None) -> int:
    """Join the rows of several results.csv files (e.g. one per sweep, each measured in its own process)
    into ``out``: results.csv (rows in the sweeps' run order, each file's rows in their own order),
    stamp.json, summary.md and one figure per sweep. The stamp is the first part's (device, versions,
    copy bandwidth), with ``parts``: each file's rows, sweeps and seconds, and whether its run completed
    (a part without a stamp.json, or whose stamp says complete: false, ended early: a crash or a kill).
    Exit status 0 when something was merged (a MISMATCH row is reported, as in the rows themselves)."""
    files = [f for p in paths for f in _results_files(p)]
    if not files:
        raise SystemExit(f"nothing to merge: no results.csv in {', '.join(map(str, paths))}")
    rows, parts, stamps = [], [], []
    for f in files:
        part_rows = read_csv(f)
        rows += part_rows
        st_path = f.parent / "stamp.json"
        st = json.loads(st_path.read_text()) if st_path.is_file() else None
        if st:
            stamps.append(st)
        parts.append({"results": str(f), "rows": len(part_rows),
                      "sweeps": list(dict.fromkeys(r["sweep"] for r in part_rows)),
                      "command": st.get("command") if st else None, "seconds": st.get("seconds") if st else None,
                      "complete": bool(st and st.get("complete", True))})
    if not rows:
        raise SystemExit(f"nothing to merge: {len(files)} results.csv file(s) without rows")
    order = {name: i for i, name in enumerate(SWEEPS)}
    rows.sort(key=lambda r: order.get(r["sweep"], len(order)))  # stable: each file keeps its order
    out.mkdir(parents=True, exist_ok=True)
    _write_csv_atomic(rows, out / "results.csv")
    first = stamps[0] if stamps else {}
    st = {**{k: first.get(k, rows[0].get(k)) for k in STAMP_KEYS}, "python": first.get("python"),
          "copy_bandwidth_gbps": first.get("copy_bandwidth_gbps"), "quick": first.get("quick"),
          "smoke": first.get("smoke"), "sweeps": list(dict.fromkeys(r["sweep"] for r in rows)),
          "command": command or "python -m kvlib.bench --merge", "complete": all(p["complete"] for p in parts),
          "seconds": round(sum(p["seconds"] or 0 for p in parts), 1), "parts": parts}
    _write_json(st, out / "stamp.json")
    (out / "summary.md").write_text(headline_markdown(rows, st))
    if plots:
        for name in st["sweeps"]:
            if name in SWEEPS:
                plot_sweep(rows, name, out / f"{name}.png")
    bad = [r for r in rows if str(r.get("status", "")).startswith("MISMATCH")]
    errors = [r for r in rows if str(r.get("status", "")).startswith("error")]
    incomplete = [p["results"] for p in parts if not p["complete"]]
    print(f"merged {len(rows)} rows of {len(files)} file(s) into {out / 'results.csv'}; sweeps "
          f"{', '.join(st['sweeps'])}" + (f"; {len(bad)} MISMATCH row(s)" if bad else "")
          + (f"; {len(errors)} error row(s)" if errors else "")
          + (f"; ended early: {', '.join(incomplete)}" if incomplete else ""))
    return 0


def redraw(csv_path: Path, out: Path, only=None) -> int:
    """Plots and summary.md from a results.csv measured elsewhere (e.g. a GPU run's)."""
    rows = read_csv(csv_path)
    if not rows:
        raise SystemExit(f"{csv_path} has no rows")
    out.mkdir(parents=True, exist_ok=True)
    st = {k: rows[0].get(k) for k in STAMP_KEYS}
    (out / "summary.md").write_text(headline_markdown(rows, st))
    for name in only or sorted({r["sweep"] for r in rows}, key=list(SWEEPS).index):
        plot_sweep(rows, name, out / f"{name}.png")
    print(f"redrew {out} from {csv_path}")
    return 0


START, END = "<!-- headline:start -->", "<!-- headline:end -->"


def update_readme(readme: Path, summary: Path, csv_path: Path):
    """Replace what lies between the README's headline markers with ``summary`` and a link to the CSV."""
    text = readme.read_text()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"{readme} needs exactly one {START} ... {END} section")
    try:
        link = csv_path.resolve().relative_to(readme.resolve().parent)
    except ValueError:
        link = csv_path
    body = summary.read_text().strip() + f"\n\nAll rows: [{link}]({link}).\n"
    head, rest = text.split(START)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{START}\n{body}{END}{tail}")
    print(f"updated the headline table in {readme}")


if __name__ == "__main__":
    raise SystemExit(main())
