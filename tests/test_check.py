"""The labs' checkers (kvlib.course.check) and their diagnoses of known mistakes (kvlib.course.mistakes).

Each lab exercise's typical wrong answers are written here the way a learner would write them, run
on the inputs of the lab's own check, and the report must name the mistake.
"""

from __future__ import annotations

import json
import linecache
import math
import random
from pathlib import Path

import pytest
import torch

import kvlib  # noqa: F401  (sets the mode before Triton is imported)
from kvlib.course import mistakes
from kvlib.cache import decode_attention_ref, store_kv_ref
from kvlib.course.check import CheckFailed, check, check_lines, check_rows, check_tokens

REPO = Path(__file__).resolve().parent.parent


def failure(call) -> str:
    with pytest.raises(CheckFailed) as err:
        call()
    return str(err.value)


def diagnoses(call) -> list[str]:
    prefix = "Diagnosis: yours matches a known mistake: "
    return [line[len(prefix):] for line in failure(call).splitlines() if line.startswith(prefix)]


def diagnosed(call, words: str) -> str:
    """The one diagnosis of a failing check; it must contain ``words``."""
    found = diagnoses(call)
    assert len(found) == 1 and words in found[0], found
    return found[0]


# ---------------------------------------------------------------- the checkers -----------------


def test_failure_is_reported_once(capsys):
    with pytest.raises(CheckFailed) as err:
        check(torch.zeros(3), torch.ones(3), name="x", hint="add one")
    assert isinstance(err.value, AssertionError)  # a wrong solution notebook fails the suite
    report = str(err.value)
    assert report.startswith("x: yours vs reference") and report.endswith("FAIL ✗  Hint: add one")
    assert capsys.readouterr().out == ""  # not printed and then raised again
    # In IPython the report is all that is shown, without the checker's stack frames.
    assert err.value._render_traceback_() == report.split("\n")


def test_a_known_mistake_is_named_instead_of_the_hint():
    calls = []

    def wrong():
        calls.append(1)
        return torch.zeros(3)

    found = diagnoses(lambda: check(torch.zeros(3), torch.ones(3), hint="general hint",
                                    mistakes={"you forgot to add one": wrong, "doubled": torch.full((3,), 2.0)}))
    assert found == ["you forgot to add one"]
    assert "general hint" not in failure(lambda: check(torch.zeros(3), torch.ones(3), hint="general hint",
                                                       mistakes={"zeros": torch.zeros(3)}))
    # On a pass the variants are never computed; one that cannot be computed names nothing.
    calls.clear()
    assert check(torch.ones(3), torch.ones(3), mistakes={"never": wrong})
    assert calls == []
    report = failure(lambda: check(torch.zeros(3), torch.ones(3), hint="h", mistakes={"broken": lambda: 1 / 0}))
    assert report.endswith("FAIL ✗  Hint: h")


def test_nan_matches_a_nan_variant_and_is_pointed_out():
    ref = torch.ones(2, 3)
    yours = ref.clone()
    yours[0] = float("nan")
    report = failure(lambda: check(yours, ref, mistakes={"row 0 masked away": yours.clone()}))
    assert "yours has 3 NaN values (the reference 0)" in report
    assert "Diagnosis: yours matches a known mistake: row 0 masked away" in report


def test_a_constant_factor_or_offset_is_pointed_out():
    ref = torch.arange(1.0, 7.0)
    assert "every value of yours is 0.5 × the reference's" in failure(lambda: check(ref / 2, ref))
    assert "every value of yours is the reference's +1" in failure(lambda: check(ref + 1, ref))
    assert "2 of 6 values differ" in failure(lambda: check(torch.cat([ref[:4], ref[4:] * 3]), ref))


def test_check_tokens_shows_where_the_sequences_part(capsys):
    decode = lambda ids: bytes(ids).decode("latin-1")  # noqa: E731
    ref = list(b"the quick brown fox")
    assert check_tokens(ref, torch.tensor([ref]), decode=decode, name="greedy")
    assert "all 19 tokens agree" in capsys.readouterr().out

    yours = list(b"the quick red fox!!")
    report = failure(lambda: check_tokens(yours, ref, decode=decode, name="greedy"))
    assert "first difference at position 10 (positions 0..9 agree)" in report
    assert "token there: yours 114 'r', reference 98 'b'" in report
    assert "text before it:      'the quick '" in report
    assert "yours     continues: 'red fox!!'" in report and "reference continues: 'brown fox'" in report
    assert "max |difference|" not in report  # no arithmetic on token ids

    prompt = list(b"Q: ")
    found = diagnoses(lambda: check_tokens(prompt + ref, ref, decode=decode,
                                           mistakes={"the prompt is returned too": prompt + ref}))
    assert found == ["the prompt is returned too"]
    longer = failure(lambda: check_tokens(ref + [33], ref, decode=decode))
    assert "the first 19 tokens agree; then yours has 1 more" in longer
    assert "not written yet" in failure(lambda: check_tokens(None, ref))
    assert "not a 1-D sequence of token ids" in failure(lambda: check_tokens(torch.zeros(3), ref))


def test_check_rows_names_the_rows_and_who_wrote_them():
    before = torch.zeros(2, 3, 5, 4)  # (B, H_KV, S_max, D)
    ref = before.clone()
    ref[1, :, 2] = 1.0  # the reference writes (sequence 1, position 2)
    yours = before.clone()
    yours[1, :, 3] = 1.0  # yours writes one position further
    report = failure(lambda: check_rows(yours, ref, before=before, row_dims=(0, 2),
                                        row_names=("sequence", "position"), name="append"))
    assert report.startswith("append: yours vs reference, row by row")
    assert "rows that differ (sequence, position): 2 of 10" in report
    assert "(1, 2): yours left it as it was; the reference writes it" in report
    assert "(1, 3): yours wrote it; the reference leaves it as it was" in report


def test_check_lines_shows_the_first_line_that_differs(capsys):
    ref = ["sent a", "sent b", "sent [DONE]", "the generator ended"]
    assert check_lines(list(ref), tuple(ref), name="events")
    out = capsys.readouterr().out
    assert out.startswith("events: yours vs reference, line by line") and "all 4 lines agree" in out
    assert out.rstrip().endswith("PASS ✓")

    report = failure(lambda: check_lines(["sent a", "sent x", "sent [DONE]", "the generator ended"], ref,
                                         name="events", hint="look at b"))
    assert "first difference at line 1 (lines 0..0 agree)" in report
    assert "line 0, both:  'sent a'" in report
    assert "yours     from there: 'sent x'" in report and "reference from there: 'sent b'" in report
    assert "1 of 4 lines differ" in report and report.endswith("FAIL ✗  Hint: look at b")
    shorter = failure(lambda: check_lines(ref[:2], ref))
    assert "the first 2 lines agree; then the reference has 2 more" in shorter
    assert "yours     from there: (nothing more)" in shorter
    assert "then yours has 1 more" in failure(lambda: check_lines(ref + ["abort()"], ref))
    long = failure(lambda: check_lines(["x" * 500], ["y"], width=40))
    assert "'" + "x" * 38 + "…" in long and "x" * 41 not in long
    found = diagnoses(lambda: check_lines(ref[:3], ref, mistakes={"no end": ref[:3], "other": ["z"]}))
    assert found == ["no end"]
    assert "not written yet" in failure(lambda: check_lines(None, ref))
    assert "not a list of lines" in failure(lambda: check_lines("sent a", ref))
    assert "the lines are strings" in failure(lambda: check_lines([1, 2], ref))
    assert capsys.readouterr().out == ""  # a failure is reported once, in the error


# ---------------------------------------------------------------- lab 00 -----------------------


def test_lab00_mistakes():
    cases = [(1, 4), (4, 4), (5, 4), (10, 4), (98_765, 1024), (2**40 + 1, 1024), (2**53 + 1, 1024)]
    ref = torch.tensor([-(-n // t) for n, t in cases])
    m = mistakes.n_programs(cases)
    diagnosed(lambda: check(torch.tensor([n // t for n, t in cases]), ref, mistakes=m), "rounds down")
    diagnosed(lambda: check(torch.tensor([math.ceil(n / t) for n, t in cases]), ref, mistakes=m), "float")

    pid, n, tile = 2, 10, 4
    offsets = pid * tile + torch.arange(tile)
    diagnosed(lambda: check([offsets, offsets <= n], [offsets, offsets < n],
                            mistakes=mistakes.offsets_and_mask(pid, n, tile)), "<= instead of <")

    x, y = torch.randn(1000), torch.randn(1000)
    diagnosed(lambda: check(x + y, 0.5 * x + y, mistakes=mistakes.axpy(0.5, x, y)), "alpha is missing")


# ---------------------------------------------------------------- lab 01 -----------------------


def _attention_wrong(q, k, v, scale=True, diagonal=1, after=False, dim=-1):
    T, D = q.shape
    scores = q @ k.T / (math.sqrt(D) if scale else 1.0)
    future = torch.ones(T, k.shape[0], dtype=torch.bool).triu(diagonal)
    if after:
        return torch.softmax(scores, dim=dim).masked_fill(future, 0.0) @ v
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=dim) @ v


@pytest.mark.parametrize("kwargs, words", [
    (dict(scale=False), "not divided by √D"),
    (dict(diagonal=0), "hides the diagonal too"),
    (dict(after=True), "after the softmax"),
    (dict(dim=0), "down each column"),
])
def test_lab01_attention_mistakes(kwargs, words):
    from kvlib.attention import attention_ref

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 7, 16)
    ref = attention_ref(q[None, None], k[None, None], v[None, None], causal=True)[0, 0]
    diagnosed(lambda: check(_attention_wrong(q, k, v, **kwargs), ref,
                            mistakes=mistakes.attention_one_head(q, k, v, True)), words)


def test_lab01_kv_head_and_online_softmax_mistakes():
    H, H_KV = 8, 2
    ref = torch.arange(H_KV).repeat_interleave(H // H_KV)
    diagnosed(lambda: check(torch.tensor([h % H_KV for h in range(H)]), ref,
                            mistakes=mistakes.kv_head_for([(H, H_KV)])), "h % H_KV")

    torch.manual_seed(0)
    scores, values = torch.randn(37), torch.randn(37, 8)

    def no_rescaling(chunk):  # what a learner writes who forgets alpha
        m, l, acc = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(8)
        for start in range(0, 37, chunk):
            s_c, v_c = scores[start:start + chunk], values[start:start + chunk]
            m = torch.maximum(m, s_c.max())
            p = torch.exp(s_c - m)
            l = l + p.sum()
            acc = acc + p @ v_c
        return acc / l

    diagnosed(lambda: check(no_rescaling(3), torch.softmax(scores, 0) @ values,
                            mistakes=mistakes.online_softmax(scores, values, 3)), "never rescaled")


# ---------------------------------------------------------------- lab 02 -----------------------


@pytest.fixture(scope="module")
def tiny():
    from kvlib.model import load_tiny

    return load_tiny(device="cpu")


@torch.no_grad()
def test_lab02_greedy_mistakes(tiny):
    from kvlib.generate import generate_naive

    model, tok = tiny
    prompt_ids, n = tok.encode("Return a new list"), 6
    reference = generate_naive(model, torch.tensor([prompt_ids]), n)[0]
    ids = list(prompt_ids)
    for _ in range(n):  # the learner's loop, reading the first position's logits
        ids.append(int(model(torch.tensor([ids]))[0, 0].argmax()))
    m = mistakes.greedy_naive(model, prompt_ids, n, reference)
    diagnosed(lambda: check_tokens(ids[len(prompt_ids):], reference, decode=tok.decode, mistakes=m), "logits[0, 0]")
    diagnosed(lambda: check_tokens(ids[:len(prompt_ids)] + reference.tolist(), reference, mistakes=m), "prompt")


def test_lab02_count_and_sampling_mistakes():
    from kvlib.generate import sample_next

    cases = [(1, 1), (5, 1), (1, 5), (28, 40), (100, 1000), (1024, 1024)]
    ref = torch.tensor([[n * p + n * (n - 1) // 2, p + n - 1] for p, n in cases])
    diagnosed(lambda: check(torch.tensor([[n * p + n * (n - 1) // 2, p + n] for p, n in cases]), ref,
                            mistakes=mistakes.recomputed_kv_rows(cases)), "last new token")

    torch.manual_seed(0)
    logits = 3 * torch.randn(4, 256)
    k, t = 5, 0.7

    def draws(temperature):
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(20):
            kth = torch.topk(logits, k, dim=-1).values[:, -1:]
            probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")) * temperature, dim=-1)
            out.append(torch.multinomial(probs, 1, generator=g).squeeze(-1))
        return torch.stack(out)

    g = torch.Generator().manual_seed(1)
    ref = torch.stack([sample_next(logits, t, top_k=k, generator=g) for _ in range(20)])
    diagnosed(lambda: check(draws(t), ref, mistakes=mistakes.top_k_sample(logits, k, t, seed=1, draws=20)),
              "multiplied by the temperature")


# ---------------------------------------------------------------- lab 03 -----------------------


def _lab03_cache():
    torch.manual_seed(0)
    B, H_KV, S_max, D = 3, 2, 48, 16
    seq_lens = torch.tensor([0, 5, 47], dtype=torch.int32)
    k_cache = torch.randn(B, H_KV, S_max, D)
    k_new = torch.randn(B, H_KV, 1, D)
    ref = k_cache.clone()
    store_kv_ref(ref, ref.clone(), k_new, k_new, seq_lens)
    return k_cache, k_new, seq_lens, ref


@pytest.mark.parametrize("where, words", [
    (lambda s: slice(s - 1, s), "seq_lens[b] - 1"),
    (lambda s: slice(s, None), "to the end"),
])
def test_lab03_append_kv_mistakes(where, words):
    k_cache, k_new, seq_lens, ref = _lab03_cache()
    mine = k_cache.clone()
    for b in range(3):
        s = int(seq_lens[b])
        rows = where(s)
        if rows.start == -1:  # the learner's k_cache[b, :, s - 1] for s = 0 is row -1
            mine[b, :, -1] = k_new[b, :, 0]
        else:
            mine[b, :, rows] = k_new[b]
    report = failure(lambda: check_rows(mine, ref, before=k_cache, row_dims=(0, 2),
                                        row_names=("sequence", "position"),
                                        mistakes=mistakes.append_kv(k_cache, k_new, seq_lens)))
    assert words in report and "rows that differ (sequence, position)" in report


def _decode_inputs(H_KV=2):
    torch.manual_seed(0)
    B, H, S_max, D = 3, 4, 48, 16
    seq_lens = torch.tensor([1, 17, 40], dtype=torch.int32)
    q = torch.randn(B, H, D)
    k_cache, v_cache = torch.randn(2, B, H_KV, S_max, D)
    return q, k_cache, v_cache, seq_lens


def _decode_one_wrong(q, k_cache, v_cache, seq_lens, scale=True, head=None, extra=0):
    B, H, D = q.shape
    n_rep = H // k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        L = int(seq_lens[b]) + extra
        for h in range(H):
            g = head(h) if head else h // n_rep
            scores = k_cache[b, g, :L] @ q[b, h] / (math.sqrt(D) if scale else 1)
            out[b, h] = torch.softmax(scores, dim=-1) @ v_cache[b, g, :L]
    return out


@pytest.mark.parametrize("kwargs, words", [
    (dict(scale=False), "not divided by √D"),
    (dict(head=lambda h: h % 2), "h % H_KV"),
    (dict(extra=1), "one row too many"),
])
def test_lab03_decode_one_mistakes(kwargs, words):
    q, k, v, seq_lens = _decode_inputs()
    found = diagnosed(lambda: check(_decode_one_wrong(q, k, v, seq_lens, **kwargs),
                                    decode_attention_ref(q, k, v, seq_lens), hint="read only seq_lens[b] rows",
                                    mistakes=mistakes.decode_one(q, k, v, seq_lens)), words)
    if "√D" in words:  # the example: a missing 1/√D used to get a hint about seq_lens
        assert "seq_lens" not in found


def _lab03_kernel_source() -> str:
    nb = json.loads((REPO / "solutions" / "03_kv_cache_lab.ipynb").read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    return next(c for c in cells if "def decode_loop_kernel(" in c)


KERNEL_MISTAKES = {  # the learner's loop body, changed the way a learner gets it wrong
    "no scale": ([("* sm_scale", "")], "not divided by √D"),
    "no alpha": ([("l_i = l_i * alpha", "l_i = l_i"), ("acc = acc * alpha", "acc = acc")], "never rescaled"),
    "no alpha on acc": ([("acc = acc * alpha", "acc = acc")], "acc is not rescaled by alpha (l_i is)"),  # issue 24
    "no alpha on l": ([("l_i = l_i * alpha", "l_i = l_i")], "l_i is not rescaled by alpha (acc is)"),
    "scores unmasked": ([('s = tl.where(ok, tl.sum(k * q[None, :], axis=1) * sm_scale, float("-inf"))',
                          's = tl.sum(k * q[None, :], axis=1) * sm_scale')], "scores are not"),
    "<=": ([("ok = pos < L ", "ok = pos <= L ")], "pos <= L"),
    "no mask": ([("ok = pos < L ", "ok = pos < S_max ")], "are not masked"),
    "m not updated": ([("        m_i = m_new\n", "\n")], "m_i is never updated"),
    "kv head h % H_KV": ([("h // n_rep) * S_max", "h % (H // n_rep)) * S_max")], "h % H_KV"),
}


@pytest.mark.parametrize("mistake", ["correct", *KERNEL_MISTAKES])
def test_lab03_triton_exercise_diagnoses(mistake):
    """Lab 03's Triton exercise, run in the interpreter (or compiled on a GPU) with typical bugs."""
    from kvlib import runtime

    src = _lab03_kernel_source()
    edits, words = KERNEL_MISTAKES.get(mistake, ([], None))
    for old, new in edits:
        assert old in src, old
        src = src.replace(old, new)
    name = f"<lab03 kernel, {mistake}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # Triton reads the source back
    namespace = {}
    exec(compile("import math, torch\nfrom kvlib import runtime\nfrom kvlib._triton import tl, triton\n"
                 "from kvlib.cache import decode_attention_ref\n", name + " imports", "exec"), namespace)
    exec(compile(src, name, "exec"), namespace)
    q, k, v, seq_lens = (t.to(runtime.DEVICE) for t in _decode_inputs())
    run = lambda: check(namespace["decode_triton"](q, k, v, seq_lens, 16), decode_attention_ref(q, k, v, seq_lens),  # noqa: E731
                        mistakes=mistakes.decode_kernel(q, k, v, seq_lens, 16))
    if words is None:
        assert run()
    else:
        diagnosed(run, words)


def test_lab03_merge_and_cached_greedy_mistakes(tiny):
    torch.manual_seed(0)
    x, v = torch.randn(4, 40), torch.randn(4, 40, 16)

    def partial(s, vv):
        return (torch.softmax(s, -1)[:, None, :] @ vv)[:, 0], torch.logsumexp(s, -1)

    o1, lse1 = partial(x[:, :20], v[:, :20])
    o2, lse2 = partial(x[:, 20:], v[:, 20:])
    full, _ = partial(x, v)
    diagnosed(lambda: check((o1 + o2) / 2, full, mistakes=mistakes.merge_partials(o1, lse1, o2, lse2)), "averaged")
    big1, big2 = lse1.double() + 1000, lse2.double() + 1000  # exp(lse) overflows
    naive = (torch.exp(big1)[:, None] * o1.double() + torch.exp(big2)[:, None] * o2.double()) / (
        torch.exp(big1) + torch.exp(big2))[:, None]
    diagnosed(lambda: check(naive, full.double(), mistakes=mistakes.merge_partials(o1.double(), big1, o2.double(), big2)),
              "overflows")

    from kvlib.cache import KVCache
    from kvlib.generate import generate_naive

    model, tok = tiny
    prompt_ids, n = tok.encode("Return a new list"), 8
    reference = generate_naive(model, [prompt_ids], n)[0]
    with torch.no_grad():  # the learner's loop, without positions= for the new tokens
        cache = KVCache.for_model(model, 1, len(prompt_ids) + n)
        logits = model(torch.tensor([prompt_ids]), cache=cache)[:, -1]
        mine = []
        for _ in range(n):
            nxt = logits.argmax(dim=-1)
            mine.append(int(nxt))
            logits = model(nxt[:, None], cache=cache)[:, -1]
    diagnosed(lambda: check_tokens(mine, reference, decode=tok.decode,
                                   mistakes=mistakes.cached_greedy(model, prompt_ids, n, reference)),
              "no positions=")


# ---------------------------------------------------------------- lab 04 -----------------------


def test_lab04_mistakes():
    from kvlib.memory import GiB, REAL_MODELS, kv_cache_bytes, max_batch, spec

    cases = [(m.n_layers, m.n_kv_heads, m.head_dim, m.max_context, b, 2) for m in REAL_MODELS for b in (1, 4)]
    ref = torch.tensor([kv_cache_bytes(*c[:5], "fp16") for c in cases])
    mine = torch.tensor([L * h * d * s * b * e for L, h, d, s, b, e in cases])
    report = failure(lambda: check(mine, ref, mistakes=mistakes.kv_bytes(cases)))
    assert "factor 2 is missing" in report and "every value of yours is 0.5 × the reference's" in report

    combos = [("Llama-2-7B", 24, 4096), ("Llama-2-70B", 80, 4096), ("SmolLM2-135M", 16, 8192)]
    fit = [(g * GiB, spec(n).weight_bytes("fp16"), kv_cache_bytes(spec(n).n_layers, spec(n).n_kv_heads,
                                                                   spec(n).head_dim, c, 1, "fp16"))
           for n, g, c in combos]
    ref = torch.tensor([max_batch(spec(n), g * GiB, c, reserve_bytes=0) for n, g, c in combos])
    diagnosed(lambda: check(torch.tensor([(g - w) // s for g, w, s in fit]), ref,
                            mistakes=mistakes.sequences_that_fit(fit)), "no max(0, ...)")

    kv_of = lambda m, c, b: kv_cache_bytes(m.n_layers, m.n_kv_heads, m.head_dim, c, b, "fp16")  # noqa: E731
    cases = [(spec("Llama-2-7B"), 32, 4096, 3.35e12), (spec("Llama-3-8B"), 8, 8192, 2e12)]
    ref = torch.tensor([(m.weight_bytes("fp16") + kv_of(m, c, b)) / bw for m, b, c, bw in cases], dtype=torch.float64)
    mine = torch.tensor([(m.weight_bytes("fp16") + kv_of(m, c, 1)) / bw for m, b, c, bw in cases], dtype=torch.float64)
    diagnosed(lambda: check(mine, ref, atol=0, rtol=1e-9, mistakes=mistakes.decode_step_time_floor(cases, kv_of)),
              "one sequence only")


# ---------------------------------------------------------------- lab 05 -----------------------


def test_lab05_allocator_diagnoses():
    assert "stack" in mistakes.allocator_step("allocate(2)", "[7, 6]", "[0, 1]")
    assert "wrong order" in mistakes.allocator_step("allocate(2)", "[1, 0]", "[0, 1]")
    assert "ValueError" in mistakes.allocator_step("free(8)", "False", "ValueError")
    assert "OutOfBlocksError" in mistakes.allocator_step("allocate(4)", "[5, 6, 7]", "OutOfBlocksError")
    assert "True" in mistakes.allocator_step("free(2)", "None", "True")


def test_lab05_paged_mistakes():
    from kvlib.paged import paged_decode_attention_ref

    table = [3, 4, 1, 6, 7, 9, 0, 5, 10, 8]
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(37)])
    diagnosed(lambda: check(torch.tensor([table[p // 4] * 4 + p for p in range(37)]), slots,
                            mistakes=mistakes.slot_of(table, 37, 4)), "source article's mistake")

    torch.manual_seed(0)
    k_blocks, v_blocks = torch.randn(2, 12, 4, 2, 16)
    block_table = torch.randperm(12)[:6].to(torch.int32)
    pos = torch.arange(23)
    ref = k_blocks[block_table.long()[pos // 4], pos % 4]
    diagnosed(lambda: check(k_blocks.reshape(-1, 2, 16)[:23], ref,
                            mistakes=mistakes.gather_kv(k_blocks, block_table, 23)), "block table is not used")

    q = torch.randn(4, 16)
    k = ref.transpose(0, 1).repeat(2, 1, 1)  # (H, L, D) with heads 0, 1, 0, 1: the learner's .repeat
    v = v_blocks[block_table.long()[pos // 4], pos % 4].transpose(0, 1).repeat(2, 1, 1)
    mine = (torch.softmax((k @ q[:, :, None])[..., 0] / 4, -1)[:, None, :] @ v)[:, 0]
    reference = paged_decode_attention_ref(q[None], k_blocks, v_blocks, block_table[None], torch.tensor([23]))[0]
    diagnosed(lambda: check(mine, reference, mistakes=mistakes.paged_attention_one(
        q, k_blocks, v_blocks, block_table, 23)), "h % H_KV")

    outs, lses = torch.randn(6, 4, 16), torch.randn(6, 4)
    w = torch.exp(lses - lses.max(0).values)[..., None]
    diagnosed(lambda: check(outs.mean(0), (w * outs).sum(0) / w.sum(0), mistakes=mistakes.combine_blocks(outs, lses)),
              "averaged")


# ---------------------------------------------------------------- lab 06 -----------------------


def test_lab06_quant_mistakes():
    from kvlib.quant import int8_decode_attention_ref, quantize_int8

    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, 0.0])
    q_ref = quantize_int8(ties, None)[0]
    diagnosed(lambda: check(torch.round(ties).to(torch.int8), q_ref, atol=0, rtol=0,
                            mistakes=mistakes.quantized_values(ties, None)), "torch.round")

    torch.manual_seed(0)
    x = torch.randn(6, 4, 16)
    x[2] = 0.0
    q_ref, s_ref = quantize_int8(x, -1)
    amax = x.abs().amax(-1, keepdim=True)
    diagnosed(lambda: check((x / (amax / 127)).to(torch.int8), q_ref, atol=0, rtol=0,
                            mistakes=mistakes.quantized_values(x, -1)), "truncates")
    diagnosed(lambda: check(amax / 127, s_ref, rtol=1e-6, atol=0, mistakes=mistakes.quant_scales(x, -1)),
              "all-zero group got scale 0")

    k, v = torch.randn(2, 24, 32)
    qv = torch.randn(32)
    k_q, k_scale = quantize_int8(k, -1)
    v_q, v_scale = quantize_int8(v, -1)
    k_scale, v_scale = k_scale[:, 0], v_scale[:, 0]
    L = 19
    one = lambda t: t[None, None]  # noqa: E731
    ref = int8_decode_attention_ref(one(qv), one(k_q), one(k_scale), one(v_q), one(v_scale), torch.tensor([L]))[0, 0]
    p = torch.softmax((k_q[:L].float() @ qv) * k_scale[:L] / math.sqrt(32), -1)
    diagnosed(lambda: check(p @ v_q[:L].float(), ref, mistakes=mistakes.int8_attention_one(
        qv, k_q, k_scale, v_q, v_scale, L)), "V's scale is missing")


# ---------------------------------------------------------------- lab 07 -----------------------


def test_lab07_gqa_mistakes():
    from kvlib.attention import attention_ref
    from kvlib.gqa import repeat_kv

    torch.manual_seed(0)
    x = torch.randn(2, 2, 5, 8)
    diagnosed(lambda: check(x[:, None].expand(2, 4, 2, 5, 8).reshape(2, 8, 5, 8), repeat_kv(x, 4), atol=0, rtol=0,
                            mistakes=mistakes.repeat_kv(x, 4)), "interleaved")

    q = torch.randn(8, 6, 16)
    k, v = torch.randn(2, 2, 6, 16)
    mine = torch.stack([_attention_wrong(q[h], k[h % 2], v[h % 2]) for h in range(8)])
    diagnosed(lambda: check(mine, attention_ref(q[None], k[None], v[None])[0], mistakes=mistakes.gqa_attention(q, k, v)),
              "h % H_KV")

    w = torch.randn(64, 32)
    ref = w.view(2, 4, 8, 32).mean(1).reshape(16, 32)
    diagnosed(lambda: check(w.view(4, 2, 8, 32).mean(0).reshape(16, 32), ref,
                            mistakes=mistakes.mean_pool_kv(w, 8, 2, 8)), "interleaved")


# ---------------------------------------------------------------- every variant ----------------


def _variant_sets():
    """(label, reference, mistakes) on inputs like the labs' checks use."""
    from kvlib.attention import attention_ref
    from kvlib.gqa import repeat_kv
    from kvlib.quant import quantize_int8

    torch.manual_seed(0)
    random.seed(0)
    out = []
    q, k, v = torch.randn(3, 7, 16)
    out.append(("attention", attention_ref(q[None, None], k[None, None], v[None, None])[0, 0],
                mistakes.attention_one_head(q, k, v, True)))
    scores, values = torch.randn(37), torch.randn(37, 8)
    out.append(("online", torch.softmax(scores, 0) @ values, mistakes.online_softmax(scores, values, 3)))
    qd, kd, vd, lens = _decode_inputs()
    out.append(("decode_one", decode_attention_ref(qd, kd, vd, lens), mistakes.decode_one(qd, kd, vd, lens)))
    out.append(("decode_kernel", decode_attention_ref(qd, kd, vd, lens), mistakes.decode_kernel(qd, kd, vd, lens, 16)))
    k_cache, k_new, seq_lens, ref = _lab03_cache()
    out.append(("append_kv", ref, mistakes.append_kv(k_cache, k_new, seq_lens)))
    x = torch.randn(6, 4, 16)
    x[2] = 0.0
    for dim in (None, (1, 2), -1, (0, 2), 0):
        qx, sx = quantize_int8(x, dim)
        out.append((f"values {dim}", qx, mistakes.quantized_values(x, dim)))
        out.append((f"scales {dim}", sx, mistakes.quant_scales(x, dim)))
    xr = torch.randn(2, 2, 5, 8)
    out.append(("repeat_kv", repeat_kv(xr, 2), mistakes.repeat_kv(xr, 2)))
    qg = torch.randn(8, 6, 16)
    kg, vg = torch.randn(2, 2, 6, 16)
    out.append(("gqa", attention_ref(qg[None], kg[None], vg[None])[0], mistakes.gqa_attention(qg, kg, vg)))
    from kvlib.evict import h2o_accumulate
    from kvlib.lowbit import quantize_asym

    for n, b, s in [(12, 6, 2), (5, 8, 2)]:
        out.append((f"sink_window {n} {b} {s}", _ref_keep(n, b, s), mistakes.sink_window_keep(n, b, s)))
    scores, probs = torch.rand(2, 10), torch.softmax(torch.randn(8, 3, 10), dim=-1)
    out.append(("h2o", h2o_accumulate(scores[None], probs[None], 4)[0], mistakes.h2o_update(scores, probs)))
    x2 = torch.randn(3, 4, 32) + 0.5
    x2[1, 2] = 0.7  # a constant group, as in the lab
    out.append(("quantize_2bit", quantize_asym(x2.reshape(3, 4, 4, 8), bits=2, dim=-1), mistakes.quantize_2bit(x2, 8)))
    from kvlib.lowbit import quantize_keys_per_channel

    for H, H_KV, window, N, kernel in [(4, 4, 4, 20, 5), (8, 2, 6, 30, 7), (9, 3, 5, 17, 3), (6, 1, 3, 9, 7)]:
        probs = _window_probs(H, window, N, H)
        out.append((f"snapkv {H} {H_KV}", _snapkv_ref(probs, H_KV, kernel), mistakes.snapkv_priority(probs, H_KV, kernel)))
    k = torch.randn(3, 24, 16) * torch.linspace(0.5, 4.0, 16)
    k[1, 8:16, 5] = -0.3  # a constant (group, channel), as in the lab
    for group in (4, 8):
        out.append((f"quantize_keys {group}", tuple(t[0] for t in quantize_keys_per_channel(k[None], group)),
                    mistakes.quantize_keys_2bit(k, group)))
    args = _mla_inputs(torch.float32)
    out.append(("absorbed_attention", _mla_materialized(*args), mistakes.absorbed_attention(*args)))
    return out


def test_every_variant_is_named_as_itself_and_only_itself():
    """Each wrong variant, fed to the checker as if it were the learner's answer, is diagnosed as itself,
    so no two mistakes of one exercise give the same result on the lab's inputs."""
    missed, ambiguous = [], []
    for label, reference, variants in _variant_sets():
        for what, wrong in variants.items():
            value = wrong()
            try:
                check(value, reference)
            except CheckFailed:
                pass
            else:
                continue  # this input cannot show the mistake (the lab's other cases do)
            found = diagnoses(lambda: check(value, reference, mistakes=variants))
            if what not in found:
                missed.append((label, what))
            elif len(found) > 1:
                ambiguous.append((label, found))
    assert not missed and not ambiguous, (missed, ambiguous)


# ---------------------------------------------------------------- lab 08 -----------------------


@pytest.fixture(scope="module")
def lab08():
    """The lab's trace recorders, run (kvlib.course.ch08: the code lab 08a's cells call)."""
    from kvlib.course import ch08

    model = ch08.toy_model()
    return {"adm_trace": ch08.admission_trace(model)[0], "pre_trace": ch08.preemption_trace(model)[0],
            "chunk_case": ch08.chunk_case}


def test_lab08_reference_rules_are_the_engines(lab08):
    adm, pre = lab08["adm_trace"], lab08["pre_trace"]
    assert all(mistakes.lab08._admit(s) == s["admitted"] for s in adm)
    assert all(mistakes.lab08._preempt(s) == s["preempted"] for s in pre)
    # the traces hold the cases the diagnoses need
    assert any(not s["running_needs"] and s["admitted"] for s in adm)  # an idle engine admits a big request
    assert any(c for s in adm for _, c in s["waiting"])  # cached prefixes
    assert any(len(s["waiting"]) > len(s["admitted"]) + 1 for s in adm)  # a misfit with requests behind it
    assert sum(bool(s["preempted"]) for s in pre) >= 5


def _admit_wrong(free_blocks, num_blocks, watermark, block_size, running_needs, waiting, *, skip=False,
                 ignore_watermark=False, always_watermark=False, count_cached=False, floor=False, plus_one=False,
                 forget_admitted=False):
    """admit() as a learner might write it, with one mistake switched on."""
    reserve = 0 if ignore_watermark else int(watermark * num_blocks)
    used = sum(running_needs)
    out = []
    for i, (n, cached) in enumerate(waiting):
        n = n + 1 if plus_one else n
        blocks = n // block_size if floor else math.ceil(n / block_size)
        if not count_cached:
            blocks -= cached // block_size
        keep = reserve if (running_needs or out or always_watermark) else 0
        if blocks <= free_blocks - used - keep:
            out.append(i)
            if not forget_admitted:
                used += blocks
        elif not skip:
            break
    return out


@pytest.mark.parametrize("mistake, words", [
    (dict(skip=True), "skips a request"),
    (dict(ignore_watermark=True), "watermark is ignored"),
    (dict(always_watermark=True), "even when nothing runs"),
    (dict(count_cached=True), "cached tokens are counted"),
    (dict(floor=True), "rounded down"),
    (dict(plus_one=True), "n_tokens + 1"),
    (dict(forget_admitted=True), "admitted request's blocks are not added"),
])
def test_lab08_admission_mistakes(lab08, mistake, words):
    trace = lab08["adm_trace"]
    args = ("free_blocks", "num_blocks", "watermark", "block_size", "running_needs", "waiting")
    width = max(len(s["waiting"]) for s in trace)
    ref = mistakes.admission_flags([s["admitted"] for s in trace], width)
    assert check(mistakes.admission_flags([_admit_wrong(**{k: s[k] for k in args}) for s in trace], width), ref)
    mine = mistakes.admission_flags([_admit_wrong(**{k: s[k] for k in args}, **mistake) for s in trace], width)
    diagnosed(lambda: check(mine, ref, mistakes=mistakes.admission(trace)), words)


def _preempt_wrong(free_blocks, running, *, pick="newest", give_back=True, promise=True):
    """preempt() as a learner might write it, with one mistake switched on."""
    victims, taken = [], 0
    for rid, held, need in running:
        if rid in victims:
            continue
        while need > free_blocks - (taken if promise else 0):
            left = [r for r in running if r[0] not in victims]
            if pick == "oldest":
                v = next((r for r in left if r[0] != rid), (rid, held, need))
            elif pick == "first":  # alive.pop(0) in the hints' loop: the oldest still running, maybe rid itself
                v = left[0]
            elif pick == "self":
                v = (rid, held, need)
            elif pick == "longest":
                v = sorted(left, key=lambda r: (r[1], r[0]))[-1]
            else:
                v = left[-1]
            victims.append(v[0])
            if give_back:
                free_blocks += v[1]
            if v[0] == rid:
                break
        else:
            taken += need
    return victims


@pytest.mark.parametrize("mistake, words", [
    (dict(pick="oldest"), "oldest request"),
    (dict(pick="first"), "alive.pop(0)"),  # issue 24: the oldest, as the hints' loop would pick it
    (dict(pick="self"), "preempted itself"),
    (dict(pick="longest"), "most blocks"),
    (dict(give_back=False), "not given back"),
    (dict(promise=False), "promised to older"),
])
def test_lab08_preemption_mistakes(lab08, mistake, words):
    trace = lab08["pre_trace"]
    ref = mistakes.preemption_flags([s["preempted"] for s in trace], trace)
    assert check(mistakes.preemption_flags([_preempt_wrong(s["free_blocks"], s["running"]) for s in trace], trace), ref)
    mine = mistakes.preemption_flags([_preempt_wrong(s["free_blocks"], s["running"], **mistake) for s in trace], trace)
    diagnosed(lambda: check(mine, ref, mistakes=mistakes.preemption(trace)), words)


def _lab08_chunks(lab08):
    shapes = [(4, 0, 7), (4, 5, 6), (4, 8, 4), (16, 13, 20), (1, 3, 4), (8, 24, 1)]
    cases, ref = [], []
    for n, (bs, L, T) in enumerate(shapes):
        table, slots = lab08["chunk_case"](bs, L, T, seed=n)
        cases.append((table, bs, L, T))
        ref.append(slots)
    return cases, torch.cat(ref)


@pytest.mark.parametrize("slot, words", [
    (lambda t, bs, p, i: t[p // bs] * bs + p, "global offset"),
    (lambda t, bs, p, i: t[i // bs] * bs + i % bs, "start at 0"),
    (lambda t, bs, p, i: p, "block table is not used"),
    (lambda t, bs, p, i: t[p // bs] + p % bs, "not multiplied"),
])
def test_lab08_chunk_slot_mistakes(lab08, slot, words):
    cases, ref = _lab08_chunks(lab08)
    assert check(torch.tensor([t[p // bs] * bs + p % bs for t, bs, L, T in cases for p in range(L, L + T)]), ref)
    mine = torch.tensor([slot(t, bs, L + i, i) for t, bs, L, T in cases for i in range(T)])
    diagnosed(lambda: check(mine, ref, mistakes=mistakes.chunk_slots(cases)), words)


def _lab08_costs():
    prefill_s = lambda n: n * (1.5e-6 + 2.1e-9 * n)  # noqa: E731  (the lab's round numbers)
    cases = [(100, 20), (300, 40), (900, 100), (1100, 30), (1000, 300), (50, 1200), (2000, 10), (1, 1)]
    return prefill_s, 23040, 12e9, cases


@pytest.mark.parametrize("choose, words", [
    (lambda p, g, f, b, bw: n_swap(p + g, b, bw, 1) < f(p + g), "one way only"),
    (lambda p, g, f, b, bw: n_swap(p + g, b, bw) < f(p), "prompt only"),
    (lambda p, g, f, b, bw: n_swap(p + g, b, bw) < f(p + g) / (p + g), "per token is compared with swap's total"),
    (lambda p, g, f, b, bw: n_swap(p + g, b, bw) / (p + g) < f(p + g), "swap's time per token"),
])
def test_lab08_swap_or_recompute_mistakes(choose, words):
    prefill_s, b, bw, cases = _lab08_costs()
    ref = torch.tensor([n_swap(p + g, b, bw) < prefill_s(p + g) for p, g in cases])
    assert ref.any() and not ref.all()
    mine = torch.tensor([choose(p, g, prefill_s, b, bw) for p, g in cases])
    diagnosed(lambda: check(mine, ref, mistakes=mistakes.swap_or_recompute(cases, prefill_s, b, bw)), words)


def n_swap(n, bytes_per_token, bandwidth, ways=2):
    return ways * n * bytes_per_token / bandwidth


def test_lab08_crossover_mistakes():
    prefill_s, b, bw, _ = _lab08_costs()
    right = next(n for n in range(1, 4097) if n_swap(n, b, bw) < prefill_s(n))
    assert right == 1115  # the number the lab's check expects
    m = mistakes.crossover(prefill_s, b, bw, 4096)
    one_way = next(n for n in range(1, 4097) if n_swap(n, b, bw, 1) < prefill_s(n))
    diagnosed(lambda: check(one_way, right, mistakes=m), "one way only")
    last_recompute = max(n for n in range(1, 4097) if n_swap(n, b, bw) >= prefill_s(n))
    diagnosed(lambda: check(last_recompute, right, mistakes=m), "one too few")
    per_token = next(n for n in range(1, 4097) if n_swap(n, b, bw) / n < prefill_s(n))
    diagnosed(lambda: check(per_token, right, mistakes=m), "swap's time per token")


def test_lab08_every_variant_is_named_as_itself_and_only_itself(lab08):
    adm, pre = lab08["adm_trace"], lab08["pre_trace"]
    width = max(len(s["waiting"]) for s in adm)
    cases, slots = _lab08_chunks(lab08)
    prefill_s, b, bw, costs = _lab08_costs()
    sets = [
        (mistakes.admission_flags([s["admitted"] for s in adm], width), mistakes.admission(adm)),
        (mistakes.preemption_flags([s["preempted"] for s in pre], pre), mistakes.preemption(pre)),
        (slots, mistakes.chunk_slots(cases)),
        (torch.tensor([n_swap(p + g, b, bw) < prefill_s(p + g) for p, g in costs]),
         mistakes.swap_or_recompute(costs, prefill_s, b, bw)),
        (1115, mistakes.crossover(prefill_s, b, bw, 4096)),
    ]
    problems = []
    for reference, variants in sets:
        for what, wrong in variants.items():
            value = wrong()
            if value is None:  # "never": a learner's None is reported as not written, not diagnosed
                continue
            found = diagnoses(lambda: check(value, reference, mistakes=variants))
            if found != [what]:
                problems.append((what, found))
    assert not problems, problems


# ---------------------------------------------------------------- lab 09 -----------------------


def _ref_keep(n, budget, n_sink):
    from kvlib.evict import keep_highest, sink_window_priority

    return keep_highest(sink_window_priority(n, n_sink)[None, None], torch.tensor([n]), budget)[0, 0][: min(n, budget)].tolist()


@pytest.mark.parametrize("wrong, words", [
    (lambda n, b, s: list(range(max(0, n - b), n)), "no sinks"),
    (lambda n, b, s: sorted(set(range(s)) | set(range(n - b, n))), "sinks count toward the budget"),
    (lambda n, b, s: list(range(s)) + list(range(n - (b - s) - 1, n)), "one position too many"),
    (lambda n, b, s: list(range(s)) + list(range(n - (b - s) + 1, n)), "one position too few"),
])
def test_lab09_sink_window_mistakes(wrong, words):
    n, b, s = 12, 6, 2
    diagnosed(lambda: check(wrong(n, b, s), _ref_keep(n, b, s), mistakes=mistakes.sink_window_keep(n, b, s)), words)


def test_lab09_sink_window_under_budget_mistake():
    n, b, s = 5, 8, 2
    wrong = list(range(s)) + list(range(max(0, n - (b - s)), n))  # no special case: 0, 1 repeated
    diagnosed(lambda: check(wrong, _ref_keep(n, b, s), mistakes=mistakes.sink_window_keep(n, b, s)), "each once")


@pytest.mark.parametrize("n, budget, n_sink", [(5, 8, 2), (8, 8, 4), (12, 6, 2), (20, 8, 4), (30, 7, 0)])
def test_lab09_sink_window_without_the_under_budget_case(n, budget, n_sink):
    """Issue 24: the over-budget formula alone (the hints' last line without its `if`), as a learner writes it.
    It is right over the budget and at it; under it, the check names the missing case."""
    def no_case(n, budget, n_sink):
        return list(range(n_sink)) + list(range(n - (budget - n_sink), n))

    def as_a_set(n, budget, n_sink):
        return sorted(set(range(n_sink)) | set(range(n - (budget - n_sink), n)))

    ref = _ref_keep(n, budget, n_sink)
    m = mistakes.sink_window_keep(n, budget, n_sink)
    for wrong in (no_case, as_a_set):
        mine = wrong(n, budget, n_sink)
        if n >= budget:
            assert check(mine, ref)  # nothing to diagnose: the formula is right there
        else:
            found = diagnosed(lambda: check(mine, ref, mistakes=m), "there is no case for n <= budget")
            assert "return list(range(n))" in found and f"= {n - (budget - n_sink)}" in found


@pytest.mark.parametrize("wrong, words", [
    (lambda s, p, H_KV, n_rep: s + torch.stack([p[g::H_KV].sum(dim=(0, 1)) for g in range(H_KV)]), "h % H_KV"),
    (lambda s, p, H_KV, n_rep: p.view(H_KV, n_rep, *p.shape[1:]).sum(dim=(1, 2)), "replaced"),
    (lambda s, p, H_KV, n_rep: s + p.view(H_KV, n_rep, *p.shape[1:])[:, :, -1].sum(1), "last query"),
    (lambda s, p, H_KV, n_rep: s + p.view(H_KV, n_rep, *p.shape[1:]).mean(2).sum(1), "averaged over the T"),
    (lambda s, p, H_KV, n_rep: s + p.view(H_KV, n_rep, *p.shape[1:]).sum(2).mean(1), "averaged over the group"),
    (lambda s, p, H_KV, n_rep: s + p.view(H_KV, n_rep, *p.shape[1:])[:, 0].sum(1), "first query head"),
])
def test_lab09_h2o_mistakes(wrong, words):
    from kvlib.evict import h2o_accumulate

    g = torch.Generator().manual_seed(2)
    H, H_KV, T, N = 8, 2, 3, 10
    scores, probs = torch.rand(H_KV, N, generator=g), torch.softmax(torch.randn(H, T, N, generator=g), dim=-1)
    ref = h2o_accumulate(scores[None], probs[None], H // H_KV)[0]
    mine = wrong(scores, probs, H_KV, H // H_KV)
    diagnosed(lambda: check(mine, ref, mistakes=mistakes.h2o_update(scores, probs)), words)


@pytest.mark.parametrize("mistake, words", [
    (dict(levels=4), "(max - min) / 3"),
    (dict(rounding=torch.floor), "truncated with floor"),
    (dict(zero_at="max"), "zero point is the group's max"),
    (dict(grouped=False), "one group per row"),
    (dict(constant="none"), "a constant group (max = min) got scale 0"),  # issue 24
    (dict(constant="eps"), "a constant group (max = min) got scale 0"),
])
def test_lab09_quantize_2bit_mistakes(mistake, words):
    from kvlib.lowbit import quantize_asym

    x = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(0)) + 0.5
    x[1, 2] = 0.7  # the lab's constant row
    group = 8

    def learner(levels=3, rounding=torch.round, zero_at="min", grouped=True, constant="one"):  # as a learner writes it
        t = x.reshape(3, 4, 4, 8) if grouped else x.reshape(3, 4, 1, 32)
        lo, hi = t.amin(-1, keepdim=True), t.amax(-1, keepdim=True)
        zero = lo if zero_at == "min" else hi
        scale = (hi - lo) / levels
        if constant == "one":
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        elif constant == "eps":  # no 0/0, but not the scale 1 the spec asks for
            scale = scale.clamp_min(1e-8)
        q = rounding((t - zero) / scale).clamp(0, 3).to(torch.uint8)
        return q.reshape(3, 4, 4, 8), scale.expand(3, 4, 4, 1) if not grouped else scale, \
            zero.expand(3, 4, 4, 1) if not grouped else zero

    ref = quantize_asym(x.reshape(3, 4, 4, 8), bits=2, dim=-1)
    assert check(learner(), ref)
    diagnosed(lambda: check(learner(**mistake), ref, mistakes=mistakes.quantize_2bit(x, group)), words)


def _window_probs(H, window, N, seed):
    """The last `window` queries' causal attention over N + window positions, cut to the N before the window."""
    g = torch.Generator().manual_seed(seed)
    L = N + window
    future = torch.arange(L)[None] > torch.arange(N, L)[:, None]
    return torch.softmax((2 * torch.randn(H, window, L, generator=g)).masked_fill(future, float("-inf")), -1)[..., :N]


def _snapkv_ref(probs, n_kv_heads, kernel):
    """The lab's reference: SnapKVCache's own priority on these probabilities (the window without votes)."""
    from kvlib.evict import SnapKVCache

    H, window, N = probs.shape
    L = N + window
    cache = SnapKVCache(1, 1, n_kv_heads, L, 8, window=window, kernel=kernel, chunk=1)
    cache.index[0][:] = torch.arange(L + 1)
    cache.n_held[0][:] = L
    cache.observe(0, torch.cat([probs, torch.zeros(H, window, window)], dim=-1)[None], L)
    return cache.priority(0, L)[0]


def _snapkv_learner(probs, n_kv_heads, kernel, *, pool=torch.nn.functional.max_pool1d, pad=True, group_mean=False,
                    queries="sum", modulo=False, pool_first=False, window="inf"):
    """snapkv_priority as a learner writes it, with one mistake switched on."""
    H, w, N = probs.shape
    n_rep = H // n_kv_heads
    per_head = probs.sum(1) if queries == "sum" else probs.mean(1) if queries == "mean" else probs[:, -1]

    def pooled(x):
        if pool is None:
            return x
        return pool(x[:, None], kernel, stride=1, padding=kernel // 2 if pad else 0)[:, 0]

    if pool_first:
        per_head = pooled(per_head)
    if modulo:
        votes = torch.stack([per_head[g::n_kv_heads].sum(0) for g in range(n_kv_heads)])
    else:
        grouped = per_head.view(n_kv_heads, n_rep, N)
        votes = grouped.mean(1) if group_mean else grouped.sum(1)
    if not pool_first:
        votes = pooled(votes)
    if window == "missing":
        return votes
    return torch.cat([votes, torch.full((n_kv_heads, w), float("inf") if window == "inf" else 0.0)], dim=1)


@pytest.mark.parametrize("mistake, words", [
    (dict(pool=torch.nn.functional.avg_pool1d), "average pooling"),
    (dict(pool=None), "no pooling"),
    (dict(pad=False), "no padding"),
    (dict(queries="last"), "last query"),
    (dict(queries="mean"), "window's queries were averaged"),
    (dict(window="missing"), "window's positions are missing"),
    (dict(window="zero"), "priority 0"),
    (dict(group_mean=True), "query heads were averaged"),
    (dict(pool_first=True), "pooled before"),
    (dict(modulo=True), "h % H_KV"),
])
def test_lab09_snapkv_mistakes(mistake, words):
    H, H_KV, window, N, kernel = 8, 2, 6, 30, 7  # a case of the lab's check
    probs = _window_probs(H, window, N, 3)
    ref = _snapkv_ref(probs, H_KV, kernel)
    assert check(_snapkv_learner(probs, H_KV, kernel), ref)
    diagnosed(lambda: check(_snapkv_learner(probs, H_KV, kernel, **mistake), ref,
                            mistakes=mistakes.snapkv_priority(probs, H_KV, kernel)), words)


def test_lab09_snapkv_reference_is_snapkvs_code_where_the_window_has_no_votes():
    """SnapKV's code (snapkv_utils.py: votes summed over the window, max-pooled over the positions before it)
    equals SnapKVCache's priority on those positions when the window's own columns carry no votes."""
    H, window, N, kernel = 4, 4, 20, 5
    probs = _window_probs(H, window, N, 1)
    code = torch.nn.functional.max_pool1d(probs.sum(dim=-2)[None], kernel, padding=kernel // 2, stride=1)[0]
    ref = _snapkv_ref(probs, H, kernel)
    assert torch.allclose(ref[:, :N], code, atol=1e-6) and torch.isinf(ref[:, N:]).all()


def _keys_learner(k, group, *, levels=3, rounding=torch.round, layout="channel", constant=True):
    """quantize_keys_2bit as a learner writes it, with one mistake switched on."""
    H_KV, S, D = k.shape
    if layout == "channel":
        g, dim = k.reshape(H_KV, S // group, group, D), 2
    elif layout == "over_channels":
        g, dim = k.reshape(H_KV, S // group, group, D), -1
    elif layout == "token":
        g, dim = k.reshape(H_KV, S, D // group, group), -1
    elif layout == "all_tokens":
        g, dim = k, 1
    else:  # "transposed": exercise 4's layout on k.transpose(1, 2)
        g, dim = k.transpose(1, 2).reshape(H_KV, D, S // group, group), -1
    zero = g.amin(dim=dim, keepdim=True)
    scale = (g.amax(dim=dim, keepdim=True) - zero) / levels
    if constant:
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = rounding((g - zero) / scale).clamp(0, 3).to(torch.uint8)
    if layout == "all_tokens":
        return q, scale, zero
    if layout == "transposed":
        return q.reshape(H_KV, D, S).transpose(1, 2), scale[..., 0], zero[..., 0]
    if layout == "token":
        return q.reshape(H_KV, S, D), scale[..., 0], zero[..., 0]
    return q.reshape(H_KV, S, D), scale[:, :, 0], zero[:, :, 0]


@pytest.mark.parametrize("mistake, words", [
    (dict(layout="token"), "groups of `group` channels inside each token"),
    (dict(layout="all_tokens"), "over all S tokens"),
    (dict(layout="over_channels"), "ran over the channels"),
    (dict(layout="transposed"), "transpose them back"),
    (dict(levels=4), "(max - min) / 3"),
    (dict(rounding=torch.floor), "truncated with floor"),
    (dict(constant=False), "a constant (group, channel), max = min, got scale 0"),  # issue 24
])
def test_lab09_quantize_keys_mistakes(mistake, words):
    from kvlib.lowbit import quantize_keys_per_channel

    k = torch.randn(3, 24, 16, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.5, 4.0, 16)
    k[1, 8:16, 5] = -0.3
    group = 8
    ref = tuple(t[0] for t in quantize_keys_per_channel(k[None], group))
    assert check(_keys_learner(k, group), ref)
    diagnosed(lambda: check(_keys_learner(k, group, **mistake), ref, mistakes=mistakes.quantize_keys_2bit(k, group)),
              words)


def _mla_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(6)
    H, D, D_v, d_c, S = 4, 16, 16, 32, 10
    q, c = torch.randn(H, D, generator=g, dtype=torch.float64), torch.randn(S, d_c, generator=g, dtype=torch.float64)
    w_uk = torch.randn(d_c, H * D, generator=g, dtype=torch.float64) / math.sqrt(d_c)
    w_uv = torch.randn(d_c, H * D_v, generator=g, dtype=torch.float64) / math.sqrt(d_c)
    return [t.to(dtype) for t in (q, c, w_uk, w_uv)]


def _mla_materialized(q, c, w_uk, w_uv):
    H, D = q.shape
    S = c.shape[0]
    k = (c @ w_uk).view(S, H, D).transpose(0, 1)
    v = (c @ w_uv).view(S, H, -1).transpose(0, 1)
    scores = (k @ q[:, :, None])[..., 0] / math.sqrt(D)
    return scores, (torch.softmax(scores, dim=-1)[:, None] @ v)[:, 0]


def _mla_learner(q, c, w_uk, w_uv, *, scale="D", uk="hd", uv="hd", softmax_dim=-1, values="uv"):
    """absorbed_attention as a learner writes it, per head in a loop, with one mistake switched on."""
    H, D = q.shape
    d_c = c.shape[1]
    w_v = w_uv if values == "uv" else w_uk
    D_v = w_v.shape[1] // H
    scores, o_lats = [], []
    for h in range(H):
        w_h = w_uk[:, h * D:(h + 1) * D] if uk == "hd" else w_uk[:, h::H]  # (d_c, D)
        scores.append((q[h] @ w_h.T) @ c.T / {"D": math.sqrt(D), "d_c": math.sqrt(d_c), "none": 1.0}[scale])
    scores = torch.stack(scores)  # (H, S)
    p = torch.softmax(scores, dim=softmax_dim)
    out = []
    for h in range(H):
        wv_h = w_v[:, h * D_v:(h + 1) * D_v] if uv == "hd" else w_v[:, h::H]
        out.append((p[h] @ c) @ wv_h)
    return scores, torch.stack(out)


@pytest.mark.parametrize("mistake, words", [
    (dict(scale="d_c"), "√d_c"),
    (dict(scale="none"), "not divided by √D"),
    (dict(softmax_dim=0), "over the heads"),
    (dict(uk="interleaved"), "W_uk's heads were read interleaved"),
    (dict(uv="interleaved"), "W_uv's heads were read interleaved"),
    (dict(values="uk"), "rebuilt with W_uk"),
])
def test_lab09_absorbed_attention_mistakes(mistake, words):
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-5)):
        args = _mla_inputs(dtype)
        ref = _mla_materialized(*args)
        assert check(_mla_learner(*args), ref, atol=tol, rtol=tol)
        diagnosed(lambda: check(_mla_learner(*args, **mistake), ref, atol=tol, rtol=tol,
                                mistakes=mistakes.absorbed_attention(*args)), words)



# ---------------------------------------------------------------- lab 10 -----------------------


@pytest.fixture(scope="module")
def lab10():
    """The solution notebook's cases and its LabServer / leave_early, run: {name: value} of its namespace."""
    for module in ("httpx", "openai", "fastapi", "uvicorn"):
        pytest.importorskip(module)
    nb = json.loads((REPO / "solutions" / "10_http_serving_lab.ipynb").read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    namespace = {}
    for src in cells:
        if src.startswith("import kvlib") or any(f in src for f in ("SSE_CASES = ", "COLLECT_CASES = ",
                                                                    "STREAM_SCENARIOS = ")):
            exec(compile(src, "lab10", "exec"), namespace)
        elif "def metrics" in src:  # its helpers, without the server it starts
            exec(compile(src[:src.index("\n\nwith Server(")], "lab10", "exec"), namespace)
        elif "class LabServer" in src or "def leave_early" in src:  # the definitions, not the checks
            exec(compile(src[:src.index("\n\nwith LabServer")], "lab10", "exec"), namespace)
    return namespace


def _learner_read_sse(chunks, mistake=""):
    """read_sse as a learner might write it, with one mistake switched on."""
    pending, data = "", []
    for chunk in chunks:
        if mistake == "per chunk":
            lines = chunk.splitlines()
        else:
            pending += chunk
            *lines, pending = pending.split("\n")
        for line in lines:
            if mistake != "keep CR" and line.endswith("\r"):
                line = line[:-1]
            if line.startswith(":"):
                continue
            if line:
                if mistake == "space required":
                    name, value = ("data", line[len("data: "):]) if line.startswith("data: ") else ("", "")
                else:
                    name, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                if name != "data":
                    continue
                data.append(value)
                if mistake != "per line":
                    continue
            elif not data and mistake != "empty event":
                continue
            payload, data = "\n".join(data), []
            if payload == "[DONE]" and mistake != "DONE as JSON":
                return
            obj = json.loads(payload)
            if obj.get("error") and mistake != "error passed on":
                raise RuntimeError(obj["error"]["message"])
            yield obj
    if mistake != "quiet cut":
        raise RuntimeError("cut off")


@pytest.mark.parametrize("mistake, words", [
    ("per chunk", "split into lines on its own"),
    ("per line", "each data: line was taken as a whole event"),
    ("space required", "the space after the colon is optional"),
    ("DONE as JSON", "[DONE] was read as JSON"),
    ("error passed on", "an error event was passed on"),
    ("quiet cut", "ended quietly"),
    ("keep CR", "CRLF"),
    ("empty event", "keep-alive blank lines"),
])
def test_lab10_read_sse_mistakes(lab10, mistake, words):
    cases = lab10["SSE_CASES"]
    ref = mistakes.sse_reference(cases)
    assert check_lines(mistakes.sse_transcript(_learner_read_sse, cases), ref)
    mine = mistakes.sse_transcript(lambda chunks: _learner_read_sse(chunks, mistake), cases)
    diagnosed(lambda: check_lines(mine, ref, mistakes=mistakes.read_sse(cases)), words)


def _learner_collect(events, mistake=""):
    out = {"text": "", "token_ids": [], "finish_reason": None}
    for event in events:
        for c in [event["choices"][0]] if mistake == "choices[0]" else event["choices"]:
            if mistake == "text only":
                text = c.get("text") or ""
            elif mistake == "content key":
                text = c["delta"]["content"] if "delta" in c else c["text"]
            else:
                text = (c["delta"].get("content") if "delta" in c else c["text"]) or ""
            if mistake == "skip empty" and not text:
                continue
            out["text"] = text if mistake == "replace" else out["text"] + text
            out["token_ids"].extend(c.get("token_ids", []))
            if c["finish_reason"] is not None:
                out["finish_reason"] = c["finish_reason"]
    return out


@pytest.mark.parametrize("mistake, words", [
    ("text only", "looked for in choice[\"text\"]"),
    ("content key", "the last chat chunk's delta is {}"),
    ("choices[0]", "usage chunk"),
    ("skip empty", "their token ids with them"),
    ("replace", "join them"),
])
def test_lab10_collect_mistakes(lab10, mistake, words):
    cases = lab10["COLLECT_CASES"]
    ref = mistakes.collect_reference(cases)
    assert check_lines(mistakes.collect_transcript(_learner_collect, cases), ref)
    mine = mistakes.collect_transcript(lambda events: _learner_collect(events, mistake), cases)
    diagnosed(lambda: check_lines(mine, ref, mistakes=mistakes.collect(cases)), words)


def _learner_stream(mistake=""):
    """stream_events as a learner might write it, with one mistake switched on."""
    async def stream_events(next_message, detok, make_chunk, abort):
        ended = False
        try:
            if mistake != "no opening":
                yield "data: " + json.dumps(make_chunk(first=True)) + "\n\n"
            while not ended:
                msg = await next_message()
                if msg is None:
                    if mistake == "abort on None only":
                        abort()
                    return
                kind = msg[0]
                if kind == "tokens":
                    text = detok.add(msg[1])
                    if text or mistake != "skip empty":
                        yield "data: " + json.dumps(make_chunk(text=text, ids=msg[1])) + "\n\n"
                elif kind == "finish":
                    ended = True
                    rest = "" if mistake == "no rest" else detok.finish(msg[2])
                    if rest or mistake == "empty rest":
                        yield "data: " + json.dumps(make_chunk(text=rest)) + "\n\n"
                    yield "data: " + json.dumps(make_chunk(finish=msg[1])) + "\n\n"
                else:
                    ended = True
                    if mistake != "swallow error":
                        yield "data: " + json.dumps(msg[1].body()) + "\n\n"
            if mistake != "no DONE":
                yield "data: [DONE]\n\n"
        finally:
            if mistake == "abort always" or (not ended and mistake not in ("abort on None only", "never abort")):
                abort()

    return stream_events


@pytest.fixture(scope="module")
def lab10_stream(lab10):
    """The stream_events reference and each known wrong generator's transcript, computed once for the module
    (a wrong generator that stops sending waits out stream_transcript's timeout, 2 s, each time it runs):
    (reference, {diagnosis: transcript}), the same values check_lines would compute from the lambdas."""
    scenarios, detok = lab10["STREAM_SCENARIOS"], lab10["make_detok"]
    variants = mistakes.stream_events(scenarios, detok)
    return mistakes.stream_reference(scenarios, detok), {what: wrong() for what, wrong in variants.items()}


@pytest.mark.parametrize("mistake, words", [
    ("abort on None only", "not in a finally: block"),
    ("never abort", "abort() is never called"),
    ("abort always", "after the request finished"),
    ("no rest", "is never sent"),
    ("no DONE", "no data: [DONE]"),
    ("swallow error", "an error message is not sent on"),
    ("no opening", "no opening chunk"),
    ("skip empty", "whose text is empty was not sent"),
    ("empty rest", "the rest was sent even when it was empty"),
])
def test_lab10_stream_events_mistakes(lab10, lab10_stream, mistake, words):
    scenarios, detok = lab10["STREAM_SCENARIOS"], lab10["make_detok"]
    ref, variants = lab10_stream
    assert ref == mistakes.stream_reference(scenarios, detok)  # the reference is the same on every run
    assert check_lines(mistakes.stream_transcript(_learner_stream(), scenarios, detok), ref)
    mine = mistakes.stream_transcript(_learner_stream(mistake), scenarios, detok)
    diagnosed(lambda: check_lines(mine, ref, mistakes=variants), words)


def test_lab10_an_unwritten_exercise_stops_at_its_stub(lab10):
    """The lab's stubs raise NotImplementedError: the transcripts let it through (the learner sees the stub's
    message), whereas a learner's other errors are part of the transcript."""
    def stub(*args):
        raise NotImplementedError("Exercise: write this part")

    async def async_stub(*args):  # `async def` without a yield: a coroutine function, as the lab's stub is
        raise NotImplementedError("Exercise: write this part")

    with pytest.raises(NotImplementedError):
        mistakes.sse_transcript(stub, lab10["SSE_CASES"])
    with pytest.raises(NotImplementedError):
        mistakes.collect_transcript(stub, lab10["COLLECT_CASES"])
    with pytest.raises(NotImplementedError):
        mistakes.stream_transcript(async_stub, lab10["STREAM_SCENARIOS"], lab10["make_detok"])
    assert "raised KeyError" in mistakes.collect_transcript(lambda events: {}["x"], lab10["COLLECT_CASES"])[0]


def test_lab10_every_variant_is_named_as_itself_and_only_itself(lab10, lab10_stream):
    sse, coll = lab10["SSE_CASES"], lab10["COLLECT_CASES"]
    values = lambda variants: {what: wrong() for what, wrong in variants.items()}  # noqa: E731 - each run once
    sets = [(mistakes.sse_reference(sse), values(mistakes.read_sse(sse))),
            (mistakes.collect_reference(coll), values(mistakes.collect(coll))),
            lab10_stream]
    problems = []
    for reference, variants in sets:
        for what, value in variants.items():
            found = diagnoses(lambda: check_lines(value, reference, mistakes=variants))
            if found != [what]:
                problems.append((what, found))
    assert not problems, problems
    # the right readers give the references (the mistakes' own switches, all off)
    assert mistakes.sse_transcript(mistakes.lab10._read_sse, sse) == mistakes.sse_reference(sse)
    assert mistakes.collect_transcript(mistakes.lab10._collect, coll) == mistakes.collect_reference(coll)


def test_lab10_the_server_check_catches_a_request_left_running(lab10):
    """Through the real server: a loop that aborts in finally gives the blocks back; one that aborts only on
    None, or never, leaves the request running after the client has gone, and the check says so."""
    # wait_s is how long the check waits at most for the abort: the right loop ends the wait as soon as its
    # abort lands (2 s of slack); a loop that never aborts is reported whatever the wait, so it waits 0.5 s.
    for mistake, passes in [("", True), ("abort on None only", False), ("never abort", False)]:
        lab10["stream_events"] = _learner_stream(mistake)
        with lab10["LabServer"](lab10["model"], lab10["tok"], "tiny", **lab10["SERVE_KW"]) as server:
            yours, reference, hint = lab10["leave_early"](server, wait_s=2.0 if passes else 0.5)
        if passes:
            assert check_lines(yours, reference, hint=hint)
        else:
            report = failure(lambda: check_lines(yours, reference, hint=hint))
            assert "the request: still running" in report or "the request: ran to max_tokens" in report, report
            assert "abort() in a finally: block" in report


# ---------------------------------------------------------------- lab 11a ----------------------
# (lab 11a's other checks: tests/test_check_lab11a.py; lab 11b's: tests/test_check_lab11b.py)


@pytest.fixture(scope="module")
def lab11a():
    """Lab 11a's solution cells that define its pool and its rollback (checks and long runs left out)."""
    nb = json.loads((REPO / "solutions" / "11a_speculative_decoding_lab.ipynb").read_text(encoding="utf-8"))
    namespace = {"display": lambda *a, **k: None}
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and ("def small_pool" in src or "def truncate_seq" in src
                                            or src.lstrip().startswith(("import", "from"))):
            exec(compile(src, "lab11a", "exec"), namespace)
    return namespace


def test_lab11a_the_lab_cache_with_the_right_rollback_is_the_courses(lab11a):
    """MyPagedCache with the solution's rollback keeps every map of the prefix cache as PagedKVCache.truncate does
    (not only what the check prints): random prompts sharing prefixes, forks, appends and rollbacks, then the same
    lookups, and the same state after each operation."""
    small_pool, truncate_seq = lab11a["small_pool"], lab11a["truncate_seq"]
    rng = random.Random(3)
    base = [rng.randrange(256) for _ in range(40)]
    for trial in range(8):
        mine, ref = small_pool(truncate_seq), small_pool()
        held = {}
        for step in range(60):
            op = rng.choice(["prompt", "append", "append", "truncate", "truncate", "fork", "free"])
            live = sorted(held)
            if op == "prompt" or not live:
                seq, cut = f"s{step}", rng.randint(1, 20)
                prompt = base[:cut] + [rng.randrange(256) for _ in range(rng.randint(0, 6))]
                call = ("prompt", seq, prompt)
                held[seq] = len(prompt)
            elif op == "append":
                seq = rng.choice(live)
                new = [rng.randrange(256) for _ in range(rng.randint(1, 5))]
                call = ("append", seq, new)
                held[seq] += len(new)
            elif op == "truncate":
                seq = rng.choice(live)
                held[seq] = rng.randint(max(0, held[seq] - 9), held[seq])
                call = ("truncate", seq, held[seq])
            elif op == "fork":
                seq = rng.choice(live)
                call = ("fork", seq, f"s{step}")
                held[f"s{step}"] = held[seq]
            else:
                seq = rng.choice(live)
                call = ("free", seq, None)
                del held[seq]
            outcomes = []
            for cache in (mine, ref):
                try:
                    if call[0] == "prompt":
                        cached = cache.add_sequence(call[1], call[2])
                        mistakes.lab11a._append(cache, call[1], call[2][cached:])
                    elif call[0] == "append":
                        mistakes.lab11a._append(cache, call[1], call[2])
                    elif call[0] == "truncate":
                        cache.truncate(call[1], call[2])
                    elif call[0] == "fork":
                        cache.fork(call[1], call[2])
                    else:
                        cache.free_sequence(call[1])
                    outcomes.append("ok")
                except Exception as err:  # noqa: BLE001 - a full pool refuses on both sides alike
                    outcomes.append(type(err).__name__)
            assert outcomes[0] == outcomes[1], (trial, step, call, outcomes)
            if outcomes[0] != "ok":
                held = {s: mine.lens[s] for s in mine.tables}
            for name in ("tables", "lens", "tokens", "block_hash", "hash_to_block", "block_key"):
                assert getattr(mine, name) == getattr(ref, name), (trial, step, call, name)
            assert mine.allocator.refcount == ref.allocator.refcount and mine.allocator._free == ref.allocator._free
            probe = base[:rng.randint(1, 40)]
            assert mine.lookup(probe) == ref.lookup(probe)
