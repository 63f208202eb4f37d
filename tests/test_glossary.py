"""GLOSSARY.md: every term the course uses, defined once, where chapters can link to it.

- the anchors the chapters link to exist (GitHub's slug of each ``### term`` heading, as ``glossary_anchors()``
  in tests/test_form.py computes it), and no two terms share one;
- each term has a definition of a few sentences and says where it is first used (a chapter that exists, or
  "not yet in a chapter");
- the A–Z index at the top lists every term, and every ``#anchor`` link in the file resolves;
- perplexity tells the tiny model's per-byte scale from SmolLM2's per-token scale.
"""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "GLOSSARY.md").read_text(encoding="utf-8")

_spec = importlib.util.spec_from_file_location("_form_guard", Path(__file__).with_name("test_form.py"))
_form = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_form)
ANCHORS = _form.glossary_anchors()

# The anchors chapters link to (issue 39's list); a chapter may add terms, never remove these.
REQUIRED = """attention query-key-value causal-mask softmax online-softmax log-sum-exp multi-head-attention flash-attention
triton program-triton triton-interpreter token tokenizer logits greedy-decoding sampling autoregressive-decoding
prefill decode kv-cache rope ttft tpot itl split-k memory-bandwidth copy-bandwidth arithmetic-intensity roofline
ridge-point flop launch-overhead page-fault fp32-fp16-bf16 block-paged-kv block-table slot fragmentation
quantization int8 absmax mha-gqa-mqa continuous-batching chunked-prefill preemption prefix-cache slo goodput nats
perplexity bits-per-byte eviction sparse-attention speculative-decoding tensor-parallelism cuda-graphs torchcompile
sdpa gguf safetensors smollm2-135m tiny-model""".split()


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def terms() -> dict[str, str]:
    """{heading: body} for every ``### term``."""
    parts = re.split(r"^### (.+)$", TEXT, flags=re.M)
    return {parts[i].strip(): re.split(r"^#{1,3} ", parts[i + 1], flags=re.M)[0].strip()
            for i in range(1, len(parts), 2)}


def test_the_anchors_chapters_link_to_exist():
    missing = [a for a in REQUIRED if a not in ANCHORS]
    assert not missing, f"GLOSSARY.md lacks these terms (### headings): {missing}"


def test_each_term_has_its_own_anchor():
    # GitHub numbers a repeated slug (#quantization-1), so a topic heading must not share a term's slug either
    slugs = [slug(h) for h in re.findall(r"^#{1,6} (.+)$", TEXT, flags=re.M)]
    assert len(slugs) == len(set(slugs)), sorted({s for s in slugs if slugs.count(s) > 1})
    assert {slug(t) for t in terms()} <= ANCHORS


@pytest.mark.parametrize("term", sorted(terms()))
def test_each_term_is_defined_and_says_where_it_is_first_used(term):
    body = terms()[term]
    definition, _, rest = body.partition("\nFirst used:")
    assert rest, f"{term}: a 'First used:' line after the definition"
    sentences = re.findall(r"[.!?](?:\s|$)", definition)
    assert 1 <= len(sentences) <= 5, f"{term}: a definition of a few sentences in plain words ({len(sentences)})"
    where = rest.splitlines()[0]
    chapters = re.findall(r"\]\((notebooks/[^)]+\.ipynb)\)", where)
    assert chapters or "not yet in a chapter" in where, f"{term}: link the chapter where it is first used"
    assert all((ROOT / c).exists() for c in chapters), f"{term}: {chapters}"


def test_the_index_lists_every_term_and_every_link_resolves():
    index = next(line for line in TEXT.splitlines() if line.startswith("**All terms, A–Z:**"))
    listed = re.findall(r"\]\(#([\w-]+)\)", index)
    assert sorted(listed) == sorted(slug(t) for t in terms()), "the A–Z index lists each term once"
    bad = [a for a in re.findall(r"\]\(#([\w-]+)\)", TEXT) if a not in ANCHORS]
    assert not bad, f"links to anchors GLOSSARY.md does not have: {bad}"


def test_perplexity_tells_the_two_scales_apart():
    body = terms()["Perplexity"].lower()
    assert "exp" in body and "per byte" in body and "per token" in body and "not comparable" in body
