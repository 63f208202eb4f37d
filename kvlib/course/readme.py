"""The README's table of CPU results, generated from the notebooks' committed outputs.

Every figure in that table is read from what a notebook printed when it was last executed (the
outputs committed with it), so the README cannot drift from the notebooks::

    python -m kvlib.course.readme            # rewrite the table between the README's markers
    python -m kvlib.course.readme --check    # exit 1 if the README differs (tests/test_truth.py does this too)

Each row names the notebook and one or more regular expressions over that notebook's printed text
(each searched on its own; their named groups fill ``measured``); a pattern that no longer matches is
an error naming the notebook, so rewording a printed sentence means updating the row here too.

Every row states the fair measure: methods compared at the memory each really holds, both throughputs
where one of them flatters a side, and what a timing includes (page faults). The course's own targets
stay out of the rows (CONTRIBUTING.md lists them). ``measured`` may round a number with a format spec
(``{x:.1f}``, ``{p:.0%}``); without one a group is copied as printed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- cpu-results:start -->", "<!-- cpu-results:end -->"


@dataclass(frozen=True)
class Row:
    what: str  # the first column
    notebook: str  # file in notebooks/
    pattern: str | tuple[str, ...]  # regex(es) over the notebook's printed outputs; named groups fill `measured`
    measured: str  # format string over the named groups


class _Num(str):
    """A printed figure: copied as printed, or rounded when the format string gives a spec (``{x:.1f}``)."""

    def __format__(self, spec: str) -> str:
        return format(float(self.replace(",", "")), spec) if spec else str(self)


ROWS = [
    Row("tiny model, naive loop (warm allocator): step time at position 512 vs 32, measured vs FLOPs", "02_naive_decoding.ipynb",
        (r"step time at t = 512 vs t = 32, warmed allocator: (?P<x>[\d.]+)× measured, (?P<f>[\d.]+)× by the FLOP model",
         r"allocator kept warm: True; page faults per step: (?P<pf>[\d,]+)"),
        "{x}× vs {f}× ({pf} page faults/step)"),
    Row("tiny model: cached vs naive, 256 tokens", "03_kv_cache.ipynb",
        r"cached vs naive generation, 256 new tokens: (?P<x>[\d.]+)x faster", "{x}×"),
    Row("SmolLM2 tokens/s: naive / KV cache / transformers `generate`", "03_kv_cache.ipynb",
        r"kvlib, naive loop:\s+(?P<naive>[\d.]+) tokens/s.*?kvlib, KV cache:\s+(?P<cached>[\d.]+) tokens/s"
        r".*?transformers generate:\s+(?P<hf>[\d.]+) tokens/s", "{naive} / {cached} / {hf}"),
    Row("SmolLM2 fp32 decode step vs its bandwidth bound (weights + cache)",
        "03_kv_cache.ipynb", r"In fp32 the decode step reaches (?P<pct>\d+%) of the bandwidth bound",
        "{pct} of the bound"),
    Row("LLaMA-7B KV, batch 4 × 2048, fp16: first source article vs correct",
        "04_kv_memory.ipynb",
        r"The first source article's formula overstates LLaMA-7B's cache 32× \((?P<bad>\d+ GiB) instead of (?P<good>\d+ GiB)",
        "{bad} vs {good}"),
    Row("SmolLM2 KV bytes/token, predicted = allocated: fp16 / fp32 / INT8; resident memory vs formula",
        "04_kv_memory.ipynb",
        (r"caches built for SmolLM2-135M: (?P<fp16>[\d,]+) bytes per token in fp16, (?P<fp32>[\d,]+) in fp32, "
         r"(?P<int8>[\d,]+) in INT8", r"grew by the formula's bytes within (?P<pct>[\d.]+%)"),
        "{fp16} / {fp32} / {int8}; within {pct}"),
    Row("1000 simulated requests: memory holding tokens; requests at once (reservation vs paged)", "05_paged_kv.ipynb",
        r"Contiguous reservation: (?P<c>[\d.]+%) of the allocated KV memory holds tokens.*?paged, block 16: "
        r"(?P<p>[\d.]+%).*?Requests running at once, on average: (?P<a>[\d.]+) → (?P<b>[\d.]+)",
        "{c} vs {p}; {a} vs {b}"),
    Row("the same: preemptions; tokens re-prefilled (no watermark → 0.01)",
        "05_paged_kv.ipynb",
        r"watermark, 0\.01 \([^)]*\), cuts preemptions from (?P<p0>[\d,]+) to (?P<p1>[\d,]+) and tokens prefilled "
        r"again from (?P<r0>[\d,]+) to (?P<r1>[\d,]+)", "{p0} → {p1}; {r0} → {r1}"),
    Row("first source article: \"paging saves 30–50% at > 4× length spread\" (batches of 8)",
        "05_paged_kv.ipynb",
        r"saving from paging mean (?P<mean>\d+%), median \d+%, 10th–90th percentile (?P<lo>\d+%)–(?P<hi>\d+%); "
        r"(?P<inside>\d+%) of them inside", "mean {mean} ({lo}–{hi}); {inside} of batches in 30–50%"),
    Row("SmolLM2 INT8 KV, 3,066 held-out tokens: perplexity change (95% CI); greedy agreement", "06_int8_kv.ipynb",
        r"int8 cache \(per token and head\): perplexity (?P<ppl>[-+\d.]+%) \(95% interval (?P<lo>[-+\d.]+%) to "
        r"(?P<hi>[-+\d.]+%): [^)]*\), greedy agreement (?P<agree>[\d.]+%)", "{ppl} ({lo} to {hi}), {agree}"),
    Row("first source article's INT8, one K+V scale per token: perplexity change (claim: < 1%)", "06_int8_kv.ipynb",
        r"source article, one K\+V scale per stored token: perplexity (?P<ppl>[-+\d.]+%) \(95% interval "
        r"(?P<lo>[-+\d.]+%) to (?P<hi>[-+\d.]+%): (?P<where>[^)]*)\)", "{ppl} ({lo} to {hi}; {where})"),
    Row("the same, one K+V scale per 512-token window", "06_int8_kv.ipynb",
        r"source article, one K\+V scale per 512-token window: perplexity (?P<ppl>[-+\d.]+%) \(95% interval "
        r"(?P<lo>[-+\d.]+%) to (?P<hi>[-+\d.]+%): (?P<where>[^)]*)\)", "{ppl} ({lo} to {hi}; {where})"),
    Row("SmolLM2 keys, INT8 relative error: per channel vs per token", "06_int8_kv.ipynb",
        r"SmolLM2 at 300 tokens, mean over 30 layers, K relative error: per-channel (?P<c>[\d.]+) vs "
        r"per-token (?P<t>[\d.]+)", "{c} vs {t}"),
    Row("tiny model, MHA → 4 / 1 K/V heads, 100 fine-tune steps, vs MHA fine-tuned alike (nats/byte)", "07_gqa.ipynb",
        r"= (?P<share>[\d.]+%) of the pre-training bytes.*?control \(MHA, fine-tuned alike\): (?P<ctl>[\d.]+) "
        r"nats/byte, original (?P<orig>[\d.]+).*?vs the control: H_KV = 4: (?P<g4>[\d.]+) \((?P<p4>[-+\d.]+%)\), "
        r"H_KV = 1: (?P<g1>[\d.]+) \((?P<p1>[-+\d.]+%)\)",
        "{g4} / {g1} vs {ctl} ({p4} / {p1})"),
    Row("SmolLM2 layer 15: wrong head mapping h % 3 vs h // 3",
        "07_gqa.ipynb", r"the wrong mapping h % 3 is off by up to (?P<err>[\d.]+)", "off by up to {err} (h // 3 agrees)"),
    Row("tiny model, 40 requests: steps; TTFT p99 in steps (static vs continuous batching)", "08a_serving_many_requests.ipynb",
        r"steps: static (?P<s>\d+), continuous (?P<c>\d+); TTFT p99 in steps: static (?P<s99>\d+), continuous (?P<c99>\d+)",
        "{s} vs {c}; {s99} vs {c99}"),
    Row("tiny model, RAG-like load: prompt tokens from the prefix cache; prefilled with vs without", "08b_prefix_cache.ipynb",
        r"With prefix caching the engine served (?P<hit>[\d.]+%) of the prompt tokens from the cache and prefilled "
        r"(?P<a>[\d,]+) tokens instead of (?P<b>[\d,]+)", "{hit}; {a} vs {b}"),
    Row("SmolLM2, 8 requests, 3 trials, median tok/s: kvlib / `generate_batch` / padded `generate`",
        "08b_prefix_cache.ipynb",
        (r"serving only, tokens/s: kvlib (?P<ks>[\d.]+), generate_batch (?P<cbs>[\d.]+), padded generate (?P<sts>[\d.]+)",
         r"whole call, tokens/s: kvlib (?P<k>[\d.]+), generate_batch (?P<cb>[\d.]+), padded generate (?P<st>[\d.]+)",
         r"serving only, min-max over \d+ trials: kvlib (?P<ksr>[\d.]+-[\d.]+), generate_batch (?P<cbsr>[\d.]+-[\d.]+), "
         r"padded generate (?P<stsr>[\d.]+-[\d.]+); separated: (?P<seps>[^\n]+)",
         r"whole call, min-max over \d+ trials: kvlib (?P<kr>[\d.]+-[\d.]+), generate_batch (?P<cbr>[\d.]+-[\d.]+), "
         r"padded generate (?P<stwr>[\d.]+-[\d.]+); separated: (?P<sepw>[^\n]+)"),
        "serving {ks} / {cbs} / {sts} (separated: {seps}); whole call {k} / {cb} / {st} (separated: {sepw})"),
    Row("SmolLM2 full cache: perplexity on code; passkey, 24 prompts of 160 tokens (95% CI)", "09a_keeping_fewer_positions.ipynb",
        r"full cache: perplexity (?P<p>[\d.]+) \[[\d.]+, [\d.]+\], passkey (?P<k>\d+/\d+ = \d+% \[\d+, \d+\])",
        "{p}; {k}"),
    Row("10% of the text kept: perplexity, window vs sinks + window at equal memory held; full", "09a_keeping_fewer_positions.ipynb",
        (r"10% of the text: window perplexity (?P<w>[\d.]+), sinks \+ window (?P<s>[\d.]+), full (?P<f>[\d.]+)",
         r"sinks \+ window\s+0\.10\s+102\.0\s+(?P<m>[\d.]+)"),
        "{w} vs {s} at {m:.0%}; full {f}"),
    Row("passkey, 160 tokens, 50% kept, equal memory: SnapKV vs H2O as their code runs them",
        "09a_keeping_fewer_positions.ipynb",
        r"SnapKV 50% (?P<s>\d+/\d+ = \d+% \[\d+, \d+\]) vs H2O 50% (?P<h>\d+/\d+ = \d+% \[\d+, \d+\]): (?P<v>not separated|\S+ \S+ higher)",
        "{s} vs {h}: {v}"),
    Row("the same at 320 tokens",
        "09a_keeping_fewer_positions.ipynb",
        r"SnapKV 50% at 320 tokens (?P<s>\d+/\d+ = \d+% \[\d+, \d+\]) vs H2O 50% at 320 tokens "
        r"(?P<h>\d+/\d+ = \d+% \[\d+, \d+\]): (?P<v>not separated|SnapKV 50% at 320 tokens higher|H2O 50% at 320 tokens higher)",
        "{s} vs {h}: {v}"),
    Row("SnapKV as published vs re-evicting (ours), 25%: perplexity ratio [95% CI], memory held",
        "09a_keeping_fewer_positions.ipynb",
        r"25%: perplexity paper / ours (?P<r>[\d.]+) \[(?P<lo>[\d.]+), (?P<hi>[\d.]+)\]; memory (?P<mp>[\d.]+) vs (?P<mo>[\d.]+) of fp16",
        "{r} [{lo}, {hi}] at {mp:.0%} vs {mo:.0%}"),
    Row("INT8 / KIVI 2-bit: memory held (% of fp16), perplexity, passkey (95% CI)", "09b_keeping_fewer_bits.ipynb",
        (r"INT8 \(chapter 06\): held (?P<m8>[\d.]+%) of fp16 \(peak [\d.]+%\), perplexity (?P<p8>[\d.]+) \[[\d., ]+\]; "
         r"passkey (?P<k8>\d+/\d+ = \d+% \[\d+, \d+\])",
         r"KIVI 2-bit, R=32: held (?P<m2>[\d.]+%) of fp16 \(peak [\d.]+%\), perplexity (?P<p2>[\d.]+) \[[\d., ]+\]; "
         r"passkey (?P<k2>\d+/\d+ = \d+% \[\d+, \d+\])"),
        "{m8}, {p8}, {k8} / {m2}, {p2}, {k2}"),
    Row("6 bits by layer: INT8 on the most vs least sensitive layers, perplexity ratio [95% CI]", "09b_keeping_fewer_bits.ipynb",
        r"perplexity 6 bits: INT8 on the most sensitive / 6 bits: INT8 on the least sensitive: (?P<r>[\d.]+) "
        r"\[(?P<lo>[\d.]+), (?P<hi>[\d.]+)\]: (?P<v>not separated|6 bits: INT8 on the (?:most|least) sensitive lower)",
        "{r} [{lo}, {hi}]: {v}"),
    Row("DeepSeek-V2 bytes/token (bf16): MLA vs MHA", "09b_keeping_fewer_bits.ipynb",
        r"DeepSeek-V2 caches (?P<m>[\d,]+) bytes per token with MLA, against (?P<h>[\d,]+) with MHA", "{m} vs {h}"),
    Row("GuideLLM, 3 trials: requests meeting the latency target (95% CI): kvlib.serve vs `transformers serve`",
        "10_http_serving.ipynb",
        (r"kvlib\.serve at (?P<r>[\d.]+) req/s: (?P<k>\d+ / \d+) requests met the target \(95% interval "
         r"(?P<kl>\d+)-(?P<kh>\d+%)\), load average (?P<kload>[\d.]+-[\d.]+)",
         r"transformers serve at [\d.]+ req/s: (?P<t>\d+ / \d+) requests met the target \(95% interval "
         r"(?P<tl>\d+)-(?P<th>\d+%)\), load average (?P<tload>[\d.]+-[\d.]+)"),
        "at {r} req/s: {k} ({kl}–{kh}) vs {t} ({tl}–{th})"),
    Row("speculation by prompt lookup, k = 8, on code: CPU ms/token (range); α (95% CI)", "11a_speculative_decoding.ipynb",
        (r"code, k = 8: (?P<s>[\d.]+–[\d.]+) vs plain (?P<p>[\d.]+–[\d.]+) ms/token: (?P<v>[a-z ]+)",
         r"code, k = 8: \d+ steps, alpha (?P<a>[\d.]+) (?P<ai>\[[\d.]+, [\d.]+\])"),
        "{s} vs plain {p} ({v}); α {a} {ai}"),
    Row("passkey, 256 tokens: Quest vs the best eviction at equal bytes read; question in prompt / after", "11b_sparse_reads_and_hybrid_layers.ipynb",
        (r"Quest, question in the prompt (?P<q>\d+/\d+ = \d+% \[\d+, \d+\]) vs SnapKV (?P<s>\d+/\d+ = \d+% \[\d+, \d+\]): "
         r"(?P<v1>[^\n]+)",
         r"Quest, question after caching (?P<ql>\d+/\d+ = \d+% \[\d+, \d+\]) vs (?P<e>[a-zA-Z +]+?) "
         r"(?P<el>\d+/\d+ = \d+% \[\d+, \d+\]): (?P<v2>[^\n]+)"),
        "{q} vs SnapKV {s} ({v1}); {ql} vs {e} {el} ({v2})"),
    Row("5:1 window/full layers (W = 128): perplexity without / with 4 sinks (full)", "11b_sparse_reads_and_hybrid_layers.ipynb",
        r"5:1, W = 128: perplexity (?P<a>[\d.]+) without sinks, (?P<b>[\d.]+) with 4 sinks, full cache (?P<f>[\d.]+)",
        "{a} / {b} ({f})"),
    Row("SmolLM2 on 3 processes: tp = 3 / cp = 3 token-identical to one", "12a_sharding_the_cache.ipynb",
        (r"tp = 3 token-identical on every rank: (?P<tp>True|False)",
         r"cp = 3 token-identical on every rank: (?P<cp>True|False)"), "{tp} / {cp}"),
    Row("tiny model, 2 replicas: prefix hit rate, round-robin / prefix router",
        "12b_moving_the_cache.ipynb",
        r"prefix hit rate: round-robin (?P<rr>[\d.]+%), prefix router (?P<p>[\d.]+%)", "{rr} / {p}"),
]


def printed_text(notebook: Path) -> str:
    """Everything a notebook's committed outputs show as text (stdout, markdown, plain results)."""
    nb = json.loads(notebook.read_text())
    parts = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append("".join(out["text"]))
            for mime in ("text/markdown", "text/plain"):
                if mime in out.get("data", {}):
                    parts.append("".join(out["data"][mime]))
    return "\n".join(parts)


def table(root: Path = ROOT) -> str:
    lines = ["| what | measured | chapter |", "|---|---|---|"]
    texts: dict[str, str] = {}
    for row in ROWS:
        if row.notebook not in texts:
            texts[row.notebook] = printed_text(root / "notebooks" / row.notebook)
        groups: dict[str, _Num] = {}
        for pattern in (row.pattern,) if isinstance(row.pattern, str) else row.pattern:
            m = re.search(pattern, texts[row.notebook], flags=re.S)
            if m is None:
                raise ValueError(f"notebooks/{row.notebook}: no printed output matches {pattern!r} "
                                 f"(row {row.what!r} in kvlib/course/readme.py)")
            groups.update({k: _Num(v) for k, v in m.groupdict().items()})
        link = f"[{row.notebook.split('_')[0]}](notebooks/{row.notebook})"
        lines.append(f"| {row.what} | {row.measured.format(**groups)} | {link} |")
    return "\n".join(lines)


def render(readme: str, root: Path = ROOT) -> str:
    if START not in readme or END not in readme:
        raise ValueError(f"README.md has no {START} ... {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table(root)}\n{END}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md differs from the notebooks")
    args = ap.parse_args(argv)
    path = ROOT / "README.md"
    old = path.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print("README.md's results table differs from the notebooks' outputs; run `python -m kvlib.course.readme`")
            return 1
        print("README.md's results table matches the notebooks' outputs")
        return 0
    path.write_text(new)
    print(f"wrote the results table into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
