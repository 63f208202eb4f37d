"""``python -m kvlib.bench [--quick | --smoke] [--only NAME ...] [--out DIR] [--budget-s S]``

Runs the benchmark sweeps (see ``kvlib.bench.sweeps``) and writes to DIR (default ``bench-out``):
- ``results.csv``: one row per measurement, stamped (device, driver, CUDA, torch, triton, date);
- ``stamp.json``: the same stamp plus the measured copy bandwidth and the command line;
- ``summary.md``: the headline table (each kernel against its target);
- ``<sweep>.png``: one figure per sweep, log axes, units, the device in the title.

Exit status 1 when any kernel's output disagrees with its baseline (a row whose status starts with
MISMATCH), so a GPU check run fails loudly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .. import runtime
from . import copy_bandwidth_gbps
from .results import STAMP_KEYS, headline_markdown, plot_sweep, read_csv, reference, stamp, write_csv
from .sweeps import SWEEPS, run


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
                    help="with --from-csv: put the headline table between the README's headline markers")
    args = ap.parse_args(argv)
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
    rows = run(names, quick=args.quick, smoke=args.smoke, budget_s=args.budget_s)
    st = stamp()
    st.update(copy_bandwidth_gbps=round(copy_bandwidth_gbps(), 1), quick=args.quick, smoke=args.smoke, sweeps=names,
              command=" ".join(["python -m kvlib.bench", *(argv if argv is not None else sys.argv[1:])]),
              seconds=round(time.perf_counter() - t0, 1))
    write_csv(rows, out / "results.csv")
    (out / "stamp.json").write_text(json.dumps(st, indent=2) + "\n")
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
