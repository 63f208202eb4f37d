"""The README's table of CPU results, generated from the notebooks' committed outputs.

Every figure in that table is read from what a notebook printed when it was last executed (the
outputs committed with it), so the README cannot drift from the notebooks::

    python -m kvlib.course.readme            # rewrite the table between the README's markers
    python -m kvlib.course.readme --check    # exit 1 if the README differs (tests/test_readme.py does this)

Each row names the notebook and a regular expression over that notebook's printed text; a pattern
that no longer matches is an error naming the notebook, so rewording a printed sentence means
updating the row here too.
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
    pattern: str  # regex over the notebook's printed outputs; its named groups fill `measured`
    measured: str  # format string over the named groups


ROWS = [
    Row("naive decoding, tiny model: step time at position 512 vs 32, measured (FLOP model)", "02_naive_decoding.ipynb",
        r"Ratio (?P<x>[\d.]+)×, where the FLOP model predicts (?P<f>[\d.]+)×", "{x}× ({f}×)"),
    Row("cached vs naive generation of 256 tokens, tiny model (target ≥ 5×)", "03_kv_cache.ipynb",
        r"Measured \*\*(?P<x>[\d.]+)x\*\*: target \*\*(?P<met>met|missed)\*\*", "{x}× ({met})"),
    Row("SmolLM2-135M-Instruct, greedy tokens/s: kvlib naive loop / kvlib KV cache / transformers `generate`, "
        "same weights", "03_kv_cache.ipynb",
        r"kvlib, naive loop:\s+(?P<naive>[\d.]+) tokens/s.*?kvlib, KV cache:\s+(?P<cached>[\d.]+) tokens/s"
        r".*?transformers generate:\s+(?P<hf>[\d.]+) tokens/s", "{naive} / {cached} / {hf}"),
    Row("SmolLM2-135M-Instruct, fp32 decode step against its bound (bytes of weights + cache ÷ copy bandwidth)",
        "03_kv_cache.ipynb", r"In fp32 the decode step reaches \*\*(?P<pct>\d+%)\*\* of the bandwidth bound",
        "{pct} of the bound"),
    Row("LLaMA-7B, batch 4, 2048 tokens, fp16: the source article's formula vs correct", "04_kv_memory.ipynb",
        r"The first source article's formula overstates LLaMA-7B's cache 32× \((?P<bad>\d+ GiB) instead of (?P<good>\d+ GiB)",
        "{bad} vs {good}"),
    Row("SmolLM2-135M KV bytes per token, predicted = allocated by kvlib's caches: fp16 / fp32 / INT8 with scales",
        "04_kv_memory.ipynb",
        r"caches built for SmolLM2-135M: (?P<fp16>[\d,]+) bytes per token in fp16, (?P<fp32>[\d,]+) in fp32, "
        r"(?P<int8>[\d,]+) in INT8", "{fp16} / {fp32} / {int8}"),
    Row("the same caches measured independently (resident memory of a fresh process) vs the formula",
        "04_kv_memory.ipynb", r"grew by the formula's bytes within (?P<pct>[\d.]+%)", "within {pct}"),
    Row("1000 simulated requests, 64K-token pool: share of allocated KV memory holding tokens, max-length "
        "reservation vs paged (block 16); requests running at once", "05_paged_kv.ipynb",
        r"Contiguous reservation: (?P<c>[\d.]+%) of the allocated KV memory holds tokens.*?paged, block 16: "
        r"(?P<p>[\d.]+%).*?Requests running at once, on average: (?P<a>[\d.]+) → (?P<b>[\d.]+)",
        "{c} vs {p}; {a} vs {b}"),
    Row("the same, preemption by recompute: preemptions and tokens prefilled again, no watermark → watermark 0.01",
        "05_paged_kv.ipynb",
        r"watermark, 0\.01 \([^)]*\), cuts preemptions from (?P<p0>[\d,]+) to (?P<p1>[\d,]+) and tokens prefilled "
        r"again from (?P<r0>[\d,]+) to (?P<r1>[\d,]+)", "{p0} → {p1}; {r0} → {r1}"),
    Row("the source article's \"paging saves 30–50% when lengths differ > 4×\", batches of 8 with max/min > 4",
        "05_paged_kv.ipynb",
        r"saving from paging mean (?P<mean>\d+%), median \d+%, 10th–90th percentile (?P<lo>\d+%)–(?P<hi>\d+%); "
        r"(?P<inside>\d+%) of them inside", "mean saving {mean} ({lo}–{hi}); {inside} of batches in 30–50%"),
    Row("INT8 KV cache on the tiny model, 200 held-out tokens: greedy agreement, perplexity change, bytes vs fp16 "
        "(targets ≥ 95%, < 1%, ≤ 0.55×)", "06_int8_kv.ipynb",
        r"greedy agreement:\s+(?P<agree>[\d.]+%).*?perplexity:\s+[\d.]+ -> [\d.]+ \((?P<ppl>[-+\d.]+%).*?"
        r"KV bytes vs fp16:\s+(?P<bytes>[\d.]+x)", "{agree}, {ppl}, {bytes}"),
    Row("INT8 KV cache on SmolLM2-135M-Instruct, ~300 held-out tokens: perplexity change, teacher-forced top-1 "
        "agreement", "06_int8_kv.ipynb",
        r"The int8 cache changes it by \*\*(?P<ppl>[-+\d.]+%)\*\* ± (?P<se>[\d.]+%).*?agrees at "
        r"\*\*(?P<agree>[\d.]+%)\*\*", "{ppl} ± {se}, {agree}"),
    Row("SmolLM2-135M-Instruct keys, relative INT8 error per channel vs per token", "06_int8_kv.ipynb",
        r"on the real model, averaged over its 30 layers: on K, \*\*per-channel beats per-token\*\*: "
        r"(?P<c>[\d.]+) vs (?P<t>[\d.]+)", "{c} vs {t}"),
    Row("tiny model MHA → 4 / 2 / 1 K/V heads, loss after a 100-step fine-tune vs the MHA model fine-tuned the "
        "same way (nats/byte)", "07_gqa.ipynb",
        r"Control: the MHA model fine-tuned the same way goes from [\d.]+ to (?P<ctl>[\d.]+).*?"
        r"g = 4: .*?after the fine-tune (?P<g4>[\d.]+).*?g = 2: .*?after the fine-tune (?P<g2>[\d.]+).*?"
        r"g = 1: .*?after the fine-tune (?P<g1>[\d.]+)", "{g4} / {g2} / {g1} vs {ctl}"),
    Row("SmolLM2-135M-Instruct (9 query / 3 K/V heads), layer 15: the wrong head mapping h % 3 vs h // 3",
        "07_gqa.ipynb", r"the wrong mapping h % 3 is off by up to (?P<err>[\d.]+)", "off by up to {err} (h // 3: agrees)"),
    Row("serving 40 requests (Poisson arrivals, lengths 11× apart), same KV memory: static vs continuous batching, "
        "engine steps; TTFT p99 in steps", "08_serving.ipynb",
        r"Static batching in arrival order took (?P<s>\d+) steps for the trace, continuous batching (?P<c>\d+).*?"
        r"TTFT\*\* in steps, median / p99: static [\d.]+ / (?P<s99>\d+(?:\.\d+)?), continuous [\d.]+ / (?P<c99>\d+(?:\.\d+)?)",
        "{s} vs {c}; {s99} vs {c99}"),
    Row("RAG-like workload (30 requests, 3 shared documents): prompt tokens served from the prefix cache; "
        "prefill tokens computed, with vs without", "08_serving.ipynb",
        r"With prefix caching the engine served (?P<hit>[\d.]+%) of the prompt tokens from the cache and prefilled "
        r"(?P<a>[\d,]+) tokens instead of (?P<b>[\d,]+)", "{hit}; {a} vs {b}"),
    Row("SmolLM2-135M-Instruct, 5 chat requests: the engine vs one request at a time (tokens/s)", "08_serving.ipynb",
        r"served the \d+ requests at \*\*(?P<e>[\d.]+) tokens/s\*\* against \*\*(?P<o>[\d.]+) tokens/s\*\*",
        "{e} vs {o}"),
    Row("SmolLM2-135M-Instruct, 16 chat requests at once, 32 greedy tokens each (tokens/s): kvlib's engine / "
        "transformers `generate_batch` / transformers padded `generate`, outputs token-identical", "08_serving.ipynb",
        r"tokens/s: kvlib's engine \*\*(?P<k>[\d.]+)\*\*, transformers' `generate_batch` \*\*(?P<cb>[\d.]+)\*\*, "
        r"padded `generate` \*\*(?P<st>[\d.]+)\*\*", "{k} / {cb} / {st}"),
    Row("SmolLM2-135M-Instruct, perplexity on code (1024 tokens, the second half scored), cache budget 5%: sliding window vs "
        "sinks + window (full cache)", "09_keeping_less.ipynb",
        r"the sliding window's perplexity is (?P<w>[\d.]+) and sinks \+ window's (?P<s>[\d.]+) \(full (?P<f>[\d.]+)\)",
        "{w} vs {s} ({f})"),
    Row("the same model, passkey retrieval (5 depths, 411-token prompt) with half the cache: sliding window / "
        "sinks + window / H2O / SnapKV", "09_keeping_less.ipynb",
        r"\*\*Passkey at 50%\*\*: sliding window (?P<w>\d+%), sinks \+ window (?P<s>\d+%), H2O (?P<h>\d+%), "
        r"SnapKV (?P<k>\d+%)", "{w} / {s} / {h} / {k}"),
    Row("the same model, KV memory vs fp16 (time-averaged held bytes: scales, zero points and the exact window "
        "counted) and perplexity: INT8 / KIVI 2-bit, R = 32", "09_keeping_less.ipynb",
        r"- INT8 \(chapter 06\): (?P<m8>[\d.]+%) of the fp16 cache \(time-averaged\), perplexity (?P<p8>[\d.]+).*?"
        r"- KIVI 2-bit, R=32: (?P<m2>[\d.]+%) of the fp16 cache \(time-averaged\), perplexity (?P<p2>[\d.]+)",
        "{m8}, {p8} / {m2}, {p2}"),
    Row("the same model, mixed precision by layer at 6 bits on average (half INT8, half INT4): perplexity with "
        "INT8 on the most vs the least sensitive layers", "09_keeping_less.ipynb",
        r"\*\*6 bits on average\*\* .*?perplexity (?P<a>[\d.]+) with the wide format on the most sensitive layers, "
        r"(?P<b>[\d.]+) on the least", "{a} vs {b}"),
    Row("tiny model, cross-layer K/V sharing (CLA-2, half the cache) after a 100-step fine-tune vs the MHA model "
        "fine-tuned the same way (nats/byte)", "09_keeping_less.ipynb",
        r"shared \+ fine-tune\s+(?P<s>[\d.]+)\s+control \(no sharing\) \+ fine-tune\s+(?P<c>[\d.]+)", "{s} vs {c}"),
    Row("DeepSeek-V2 bytes per token (bf16): MLA vs MHA of the same heads", "09_keeping_less.ipynb",
        r"DeepSeek-V2 caches \*\*(?P<m>[\d,]+)\*\* bytes per token with MLA, against (?P<h>[\d,]+) with MHA",
        "{m} vs {h}"),
    Row("SmolLM2-135M-Instruct over HTTP under GuideLLM's Poisson load (64-token prompts, 16-token answers, one CPU "
        "thread per server, one trial each): highest output tokens/s measured (windows include the drain), and "
        "TTFT p90 / ITL p90 at the highest rate: kvlib.serve vs "
        "`transformers serve`", "10_http_serving.ipynb",
        r"kvlib\.serve's highest output rate was (?P<k>[\d.]+) tokens/s \([\d.]+ req/s at (?P<t>[\d.]+) offered, TTFT p90 "
        r"(?P<kt>\d+) ms, ITL p90 (?P<ki>\d+) ms\); transformers serve (?P<h>[\d.]+) \([\d.]+ req/s, TTFT p90 "
        r"(?P<ht>\d+) ms, ITL p90 (?P<hi>\d+) ms\)",
        "{k} vs {h} tokens/s; at {t} req/s {kt} / {ki} ms vs {ht} / {hi} ms"),
    Row("SmolLM2-135M-Instruct, greedy speculative decoding with prompt lookup (output token-identical to plain "
        "decoding): best speed-up in thread CPU time on code / on chat, with the share of drafts accepted",
        "11_beyond.ipynb",
        r"prompt lookup's best was (?P<c>[\d.]+)x on code \(k = (?P<ck>\d+), (?P<ca>\d+%) of drafts accepted\) and "
        r"(?P<h>[\d.]+)x on chat \(k = (?P<hk>\d+), (?P<ha>\d+%)\)", "{c}× (k = {ck}, {ca}) / {h}× (k = {hk}, {ha})"),
    Row("the same model, Quest with a 64-token budget: bytes read per step (perplexity / passkey) and kept, vs the "
        "full cache; perplexity (full cache); passkey with the question in the prompt / after the text was cached, "
        "Quest vs SnapKV at the same bytes read", "11_beyond.ipynb",
        r"Quest with 64 tokens read (?P<r1>\d+%) / (?P<r2>\d+%) of the full cache per step \(perplexity / passkey\) "
        r"and kept (?P<k>\d+%): perplexity (?P<p>[\d.]+) \(full (?P<f>[\d.]+)\), passkey (?P<a>\d+%) with the question in "
        r"the prompt and (?P<b>\d+%) with the question after the text was cached \(SnapKV at the same bytes read: "
        r"(?P<sa>\d+%) and (?P<sb>\d+%)\)", "{r1} / {r2} read, {k} kept; perplexity {p} ({f}); {a} / {b} vs {sa} / {sb}"),
    Row("the same model with a 5:1 window/full layer plan applied after training, W = 512: K/V kept at 1,023 tokens, "
        "perplexity, passkey", "11_beyond.ipynb",
        r"a 5:1 window plan with W = 512 kept (?P<k>\d+%) of SmolLM2's cache at \d+ tokens, at perplexity (?P<p>[\d.]+) "
        r"and passkey (?P<a>\d+%)", "{k}, {p}, {a}"),
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
    lines = ["| what | measured | where |", "|---|---|---|"]
    texts: dict[str, str] = {}
    for row in ROWS:
        if row.notebook not in texts:
            texts[row.notebook] = printed_text(root / "notebooks" / row.notebook)
        m = re.search(row.pattern, texts[row.notebook], flags=re.S)
        if m is None:
            raise ValueError(f"notebooks/{row.notebook}: no printed output matches {row.pattern!r} "
                             f"(row {row.what!r} in kvlib/course/readme.py)")
        link = f"[notebook {row.notebook[:2]}](notebooks/{row.notebook})"
        lines.append(f"| {row.what} | {row.measured.format(**m.groupdict())} | {link} |")
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
