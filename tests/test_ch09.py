"""kvlib.course.ch09: the protocol chapters 09a and 09b measure caches with measures what it says it measures."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvlib.cache import KVCache
from kvlib.corpus import ByteTokenizer
from kvlib.course import ch09
from kvlib.evict import H2OCache, SinkCache, SlidingWindowCache, SnapKVCache
from kvlib.footprint import fp16_cache_bytes, held_bytes
from kvlib.generate import generate
from kvlib.model import ModelConfig, Transformer
from kvlib.stats import wilson

TOK = ByteTokenizer()  # one token per character: the key's five digits are five tokens, as with SmolLM2
P = 418  # a byte-level prompt needs more tokens than a word-level one (and a length its sentences can fill)


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                   max_seq_len=1024)).eval()


@pytest.fixture(scope="module")
def prompts():
    return ch09.passkey_prompts(TOK, n=8, length=P)


def test_prompts_have_one_length_and_hide_their_own_key(prompts):
    assert [len(p.ids) for p in prompts] == [P] * 8
    for p in prompts:
        text = TOK.decode(p.ids)
        assert text.startswith(ch09.INTRO) and text.endswith(ch09.QUESTION)
        assert TOK.decode(p.ids[p.needle.start: p.needle.stop]) == ch09._needle(p.key)
        assert text.count(str(p.key)) == 2 and sum(c.isdigit() for c in text) == 10  # no other digit anywhere
        assert p.answer == TOK.encode(f" {p.key}") and 10000 <= p.key <= 99999


def test_every_prompt_has_its_own_filler_and_depth(prompts):
    fillers = []
    for p in prompts:
        body = p.ids[len(TOK.encode(ch09.INTRO)): -len(TOK.encode(ch09.QUESTION))]
        fillers.append(tuple(body[: p.needle.start - len(TOK.encode(ch09.INTRO))] + body[p.needle.stop - len(
            TOK.encode(ch09.INTRO)):]))
    assert len(set(fillers)) == len(prompts)  # no two fillers are the same text
    depths = [p.depth for p in prompts]
    assert depths == sorted(depths) and depths[0] < 0.2 and depths[-1] > 0.8
    assert len({p.key for p in prompts}) == len(prompts)
    themes = {ch09.filler_sentences(p.filler)[0][0] for p in prompts}  # a sentence of each filler's theme
    assert len(themes) == len(prompts)


def test_fillers_end_on_a_whole_sentence_before_the_question(prompts):
    for p in prompts:
        text = TOK.decode(p.ids)
        assert text[: -len(ch09.QUESTION)].endswith(".")
        assert TOK.decode(p.ids[p.needle.start - 1: p.needle.start]) in (".", "\n")  # the needle follows a sentence


def test_prompts_are_reproducible_and_the_seed_changes_them():
    a, b = ch09.passkey_prompts(TOK, n=3, length=P), ch09.passkey_prompts(TOK, n=3, length=P)
    c = ch09.passkey_prompts(TOK, n=3, length=P, seed=1)
    assert [p.ids for p in a] == [p.ids for p in b]
    assert [p.key for p in a] != [p.key for p in c]


@pytest.mark.parametrize("length", [180, 200, 20])
def test_a_length_that_leaves_no_filler_is_refused(length):
    with pytest.raises(ValueError):
        ch09.passkey_prompts(TOK, n=2, length=length)


def test_perplexity_through_the_full_cache_is_the_teacher_forced_one(small):
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(1))
    ppl, nll = ch09.perplexity(small, KVCache.for_model(small, 1, 80), ids, step=7)
    with torch.no_grad():
        logits = small(ids)[0]
    ref = F.cross_entropy(logits[39:79], ids[0, 40:], reduction="none")
    torch.testing.assert_close(nll, ref, atol=1e-4, rtol=1e-4)
    assert nll.shape == (40,) and math.isclose(ppl, math.exp(ref.mean().item()), rel_tol=1e-4)


def test_passkey_scores_are_greedy_decoding(small, prompts):
    res = ch09.score_passkey(small, lambda b: KVCache.for_model(small, b, P + 8), prompts, batch=1)
    for p, got in zip(prompts, res["retrieved"]):
        out = generate(small, [p.ids], len(p.answer))[0].tolist()
        assert got == (out == p.answer)
    assert res["k"] == sum(res["retrieved"]) and res["n"] == len(prompts)
    assert res["interval"] == wilson(res["k"], res["n"])


def test_the_metric_says_yes_when_every_answer_token_is_predicted(small, prompts):
    """A stand-in model that predicts the answer's tokens (after the prompt, then after each answer token) is
    scored as retrieving; one wrong token anywhere is not."""
    p = prompts[0]

    class Oracle(torch.nn.Module):
        config, device = small.config, torch.device("cpu")

        def __init__(self, wrong_at=None):
            super().__init__()
            self.wrong_at = wrong_at

        def forward(self, ids, positions=None, cache=None, logits_to_keep=0):
            B, T = ids.shape
            nxt = [p.answer[0]] if T == len(p.ids) else p.answer[1:]  # the prompt, or the answer's tokens but the last
            small(ids, positions=positions, cache=cache, logits_to_keep=logits_to_keep)  # the cache sees the call
            out = torch.zeros(B, len(nxt), 256)
            for t, token in enumerate(nxt):
                out[:, t, token if t + (T != len(p.ids)) != self.wrong_at else (token + 1) % 256] = 1.0
            return out

    def score(model):
        return ch09.score_passkey(model, lambda b: KVCache.for_model(small, b, P + 8), [p], batch=1)["retrieved"]

    assert score(Oracle()) == [True]
    assert score(Oracle(wrong_at=0)) == [False] and score(Oracle(wrong_at=3)) == [False]


@pytest.mark.parametrize("make", [
    lambda m, B: KVCache.for_model(m, B, P + 8),
    lambda m, B: SinkCache.for_model(m, B, 64, n_sink=4),
    lambda m, B: H2OCache.for_model(m, B, 64),
    lambda m, B: SnapKVCache.for_model(m, B, 64, window=8),
])
def test_batched_scoring_equals_one_prompt_at_a_time(small, prompts, make):
    one = ch09.score_passkey(small, lambda b: make(small, b), prompts[:4], batch=1)
    four = ch09.score_passkey(small, lambda b: make(small, b), prompts[:4], batch=4)
    assert one["retrieved"] == four["retrieved"]
    assert math.isclose(one["memory"], four["memory"], rel_tol=1e-3)  # per sequence (shared RoPE tables split)


def test_the_meter_counts_what_the_cache_holds(small):
    cache = SlidingWindowCache.for_model(small, 1, 16)  # fixed buffers: the same bytes after every call
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(2))
    with ch09.Meter(cache, small.config) as meter:
        ch09.perplexity(small, cache, ids, step=8)
    assert "attend" not in vars(cache)  # the wrapper is gone
    held = held_bytes(cache, float_bytes=2).total
    assert meter.peak_bytes() == held and all(b == held for _, _, b in meter.records)
    calls = [(n, T) for n, T, _ in meter.records if n - T >= 32]
    expect = held * sum(T for _, T in calls) / sum(T * fp16_cache_bytes(small.config, n) for n, T in calls)
    assert math.isclose(meter.mean_fraction(32), expect, rel_tol=1e-12)
    assert meter.records[-1][0] == 63  # the last token is scored, never fed
    assert math.isclose(meter.peak_fraction(), held / fp16_cache_bytes(small.config, 63))


def test_the_meter_sees_a_cache_grow_and_counts_a_growing_cache_at_its_size(small):
    ids = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(3))
    snap = SnapKVCache.for_model(small, 1, 16, window=4)  # the paper's rule: keeps every token after the prefill
    with ch09.Meter(snap, small.config) as meter:
        ch09.perplexity(small, snap, ids, step=8)
    sizes = [b for _, _, b in meter.records]
    assert sizes[-1] > sizes[0] and meter.peak_bytes() == max(meter.samples) >= sizes[-1]
    make, grows = ch09.full_cache(small)
    full = make(1, 96)
    with ch09.Meter(full, small.config, grows) as meter:
        ch09.perplexity(small, full, ids, step=8)
    assert all(abs(b / fp16_cache_bytes(small.config, n) - 1) < 0.01 for n, _, b in meter.records)  # + lengths
    assert abs(meter.mean_fraction(48) - 1) < 0.01 and abs(meter.peak_fraction() - 1) < 0.01


def test_evaluate_and_sweep_give_one_row_per_configuration(small, prompts):
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    table = ch09.sweep(small, ["sliding window", "H2O"], [0.25, 0.5], [0.25], ids, prompts[:2])
    assert list(table.method) == ["sliding window"] * 2 + ["H2O"] * 2 and list(table["kept (text)"]) == [16, 32] * 2
    assert table["kept (passkey)"].iloc[0] == ch09.budget_for(0.25, P) and table["passkey n"].iloc[0] == 2
    assert math.isnan(table["passkey n"].iloc[1]) and table["perplexity"].notna().all()  # 50%: perplexity only
    only = ch09.sweep(small, ["TOVA"], [], [0.5], ids, prompts[:2])
    assert "perplexity" not in only and only["passkey n"].iloc[0] == 2  # passkey only
    r = table.iloc[0]
    assert r["ppl low"] <= r["perplexity"] * (1 + 1e-6) and r["perplexity"] <= r["ppl high"] * (1 + 1e-6)
    assert r["memory"] > 0 and r["passkey memory"] > 0 and r["peak MiB"] >= r["MiB"] > 0  # a toy model: D = 8,
    # so its index and positions (int64 per slot) can outweigh its K/V; SmolLM2's D = 64 is another matter


@pytest.mark.parametrize("name", list(ch09.RULES))
def test_every_rule_of_the_chapter_runs_and_keeps_its_budget(small, name):
    cache = ch09.RULES[name](small, 2, 24)
    with torch.no_grad():
        small(torch.randint(0, 256, (2, 60), generator=torch.Generator().manual_seed(5)), cache=cache)
    held = [cache.held(b, layer) for b in range(2) for layer in range(small.config.n_layers)]
    assert max(held) <= 2 * 24 and min(held) >= 1  # PyramidKV's first layer holds up to twice the mean


def test_intervals_for_perplexity():
    nll = torch.linspace(1.0, 3.0, 64)
    lo, hi = ch09.ppl_interval(nll, block=8)
    assert lo < math.exp(nll.mean().item()) < hi
    assert ch09.ppl_ratio_interval(nll, nll, block=8) == (1.0, 1.0, 1.0)
    ratio, lo, hi = ch09.ppl_ratio_interval(nll + 0.1, nll, block=8)
    assert math.isclose(ratio, math.exp(0.1), rel_tol=1e-6) and lo > 1


def test_a_verdict_only_where_the_intervals_separate():
    assert ch09.verdict("A", (24, 24), "B", (5, 24)).endswith("A higher")
    assert ch09.verdict("A", (5, 24), "B", (24, 24)).endswith("B higher")
    assert ch09.verdict("A", (12, 24), "B", (9, 24)).endswith("not separated")
    assert ch09.rate(17, 24) == "17/24 = 71% [51, 85]"


def test_the_frontier():
    pts = [(0.1, 30.0), (0.2, 20.0), (0.3, 25.0), (0.2, 22.0), (1.0, 15.0)]  # (memory, perplexity)
    assert ch09.frontier(pts, lower_is_better=True) == [0, 1, 4]
    pk = [(0.1, 0.2), (0.5, 0.9), (0.4, 0.9), (1.0, 1.0)]  # (memory, passkey)
    assert ch09.frontier(pk, lower_is_better=False) == [0, 2, 3]


# ---- chapter 09a's harness ----------------------------------------------------------------------


def test_prefilled_caches_hold_their_budget_after_the_prompt(small, prompts):
    caches = ch09.prefilled(small, prompts[0].ids, 40, ["sliding window", "SnapKV", "TOVA"])
    assert list(caches) == ["sliding window", "SnapKV", "TOVA"]
    for c in caches.values():
        assert int(c.seq_lens[0]) == P and c.held(0) == 40
    assert caches["sliding window"].held_positions(0)[0].tolist() == list(range(P - 40, P))


def test_needle_held_counts_every_layer_and_head(small, prompts):
    p = prompts[-1]  # its needle is near the end
    window = ch09.prefilled(small, p.ids, P - p.needle.start, ["sliding window"])["sliding window"]
    assert ch09.needle_held(window, p.needle) == 1.0  # the window reaches back exactly to the needle
    short = ch09.prefilled(small, p.ids, P - p.needle.stop + 1, ["sliding window"])["sliding window"]
    assert ch09.needle_held(short, p.needle) == 1 / len(p.needle)  # only its last token


def test_failure_table_answers_with_a_fresh_cache_of_the_same_rule(small, prompts):
    caches = ch09.prefilled(small, prompts[0].ids, 64, ["sinks + window", "H2O"])
    table = ch09.failure_table(small, TOK, prompts[0], caches, n_new=3)
    assert list(table.rule) == ["sinks + window", "H2O"] and table.shape[1] == 4
    out = generate(small, [prompts[0].ids], 3, cache=SinkCache.for_model(small, 1, 64, n_sink=4))[0].tolist()
    assert table.answer.iloc[0] == repr(TOK.decode(out))


def test_rope_drift_grows_in_place_and_not_from_the_stored_key(small):
    drift = ch09.rope_drift(small, moves=(10, 200))
    assert len(drift) == 6
    bf = drift[drift.dtype == "bfloat16"].set_index("moves")
    assert bf.loc[200, "re-rotated in place"] > bf.loc[10, "re-rotated in place"]
    assert bf.loc[200, "re-rotated in place"] > 5 * bf.loc[200, "rotated once from the stored key"]


def test_kept_vs_reassigned_inside_the_budget_is_the_same_cache(small):
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(6))
    same = ch09.kept_vs_reassigned(small, ids, 64)  # nothing is evicted: the two numberings coincide
    assert math.isclose(same["kept"], same["reassigned"], rel_tol=1e-4)
    differ = ch09.kept_vs_reassigned(small, ids, 12)
    assert differ["kept"] != differ["reassigned"] and len(differ["ratio"]) == 3


def test_the_paged_window_gives_blocks_back(small):
    class ChatTok(ByteTokenizer):
        def chat(self, messages):
            return self.encode(messages[0]["content"])

    plain, window, same, cache = ch09.paged_window_run(small, ChatTok(), n_new=60, budget=48, block=8)  # a 46-token prompt
    assert plain[-1] == -(-(46 + 59) // 8)
    assert max(window[1:]) <= 48 // 8 + 1 < plain[-1] and 0 <= same <= 60 and cache.dropped[0] > 0


def test_the_chart_labels_every_point_and_names_the_frontier():
    import pandas as pd

    rows = pd.DataFrame([  # three methods; a legend of ten is the most the course's figures show
        {"method": "full cache", "budget": float("nan"), "perplexity": 10.0, "memory": 1.0, "peak": 1.0, "passkey": 0.9,
         "passkey memory": 1.0, "passkey peak": 1.0, "passkey low": 0.7, "passkey high": 0.97},
        {"method": "H2O", "budget": 0.25, "perplexity": 11.0, "memory": 0.4, "peak": 0.3, "passkey": 0.2,
         "passkey memory": 0.5, "passkey peak": 0.45, "passkey low": 0.1, "passkey high": 0.4},
        {"method": "key norm", "budget": 0.25, "perplexity": 20.0, "memory": 0.45, "peak": 0.3, "passkey": float("nan"),
         "passkey memory": float("nan"), "passkey peak": float("nan"), "passkey low": float("nan"),
         "passkey high": float("nan")}])
    fig, front = ch09.plot_quality_memory(rows)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts.count("25%") == 3  # H2O on both panels, key norm on the text only; the full cache has no share
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert legend == ["full cache", "H2O", "key norm"] and "frontier" in fig.axes[1].get_title()
    assert front == {"perplexity": ["H2O 25%", "full cache"], "passkey": ["H2O 25%", "full cache"]}
    from kvlib.course import figures

    assert figures.figure_problems(fig) == []


def test_kvpress_is_named_with_its_version_or_why_not():
    line = ch09.kvpress_line()
    assert line.startswith("kvpress ") and ("installed" in line)


def test_counts_from_a_table_column_are_accepted():
    import numpy as np

    assert ch09.rate(np.float64(17), 24.0) == "17/24 = 71% [51, 85]"
    assert ch09.verdict("A", (np.float64(24), 24), "B", (np.float64(5), 24)).endswith("A higher")


def test_passkey_at_length_counts_what_the_sweep_counts_on_prompts_of_that_length(small):
    got = ch09.passkey_at_length(small, TOK, ("H2O", "SnapKV"), length=P, frac=0.5, n=2)
    table = ch09.sweep(small, ["H2O", "SnapKV"], [], [0.5], None, ch09.passkey_prompts(TOK, n=2, length=P))
    assert list(got) == ["H2O", "SnapKV"]
    assert got == {r.method: (int(r["passkey k"]), int(r["passkey n"])) for _, r in table.iterrows()}
    assert all(n == 2 for _, n in got.values())


def test_ratio_line_prints_the_paired_ratio_and_both_memories(small):
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    table = ch09.sweep(small, ["sliding window", "H2O"], [0.25], [], ids, None)
    a, b = table.iloc[0], table.iloc[1]
    r, lo, hi = ch09.ppl_ratio_interval(a.nll, b.nll)
    line = ch09.ratio_line("window 25%", a, "H2O 25%", b)
    assert line == (f"window 25% / H2O 25% perplexity {r:.3f} [{lo:.3f}, {hi:.3f}] at memory {a.memory:.2f} vs "
                    f"{b.memory:.2f}")
    assert ch09.ratio_line("a", a, "a", a).startswith("a / a perplexity 1.000 [1.000, 1.000]")
    assert "higher" not in line and "separated" not in line


def _state(cache):
    names = ("k", "v", "index", "pos", "rot", "score", "n_held") if hasattr(cache, "index") else ("k", "v")
    return [t.clone() for name in names for t in getattr(cache, name)] + [cache.seq_lens.clone()]


@pytest.mark.parametrize("make", [lambda m: KVCache.for_model(m, 1, P + 8), lambda m: ch09.RULES["H2O"](m, 1, 40),
                                  lambda m: ch09.RULES["SnapKV"](m, 1, 60), lambda m: ch09.RULES["PyramidKV"](m, 1, 50),
                                  lambda m: ch09.RULES["SnapKV, re-evicting (ours)"](m, 1, 30)])
def test_a_replayed_prefill_is_the_plain_call_bit_for_bit(small, prompts, make):
    ids = torch.tensor([prompts[3].ids])
    ch09.prefill(small, ch09.RULES["H2O"](small, 1, 100), ids)  # recorded through another rule and budget
    plain, replayed = make(small), make(small)
    with torch.no_grad():
        want = small(ids, cache=plain, logits_to_keep=1)
    runs = []
    hook = small.lm_head.register_forward_hook(lambda *_: runs.append(1))
    try:
        got = ch09.prefill(small, replayed, ids)
    finally:
        hook.remove()
    assert torch.equal(got, want) and runs == []  # the same numbers, and the model was not run
    assert all(torch.equal(a, b) for a, b in zip(_state(replayed), _state(plain)))


def test_a_prefill_that_parts_from_its_recording_resumes_the_real_forward(small, prompts):
    class Parting(H2OCache):  # reads the prompt whole, but answers layer 1 differently
        def attend(self, layer_idx, q, k, v):
            out = super().attend(layer_idx, q, k, v)
            return out * 1.5 if layer_idx == 1 else out

    ids = torch.tensor([prompts[4].ids])
    ch09.prefill(small, ch09.RULES["SnapKV"](small, 1, 40), ids)
    plain, replayed = Parting.for_model(small, 1, 40), Parting.for_model(small, 1, 40)
    with torch.no_grad():
        want = small(ids, cache=plain, logits_to_keep=1)
    runs = []
    hook = small.lm_head.register_forward_hook(lambda *_: runs.append(1))
    try:
        assert torch.equal(ch09.prefill(small, replayed, ids), want)
    finally:
        hook.remove()
    assert runs == [1]  # resumed: the model ran once
    assert all(torch.equal(a, b) for a, b in zip(_state(replayed), _state(plain)))


def test_a_prefill_is_not_replayed_once_the_weights_change(prompts):
    torch.manual_seed(1)
    model = Transformer(ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                                    max_seq_len=1024)).eval()
    ids = torch.tensor([prompts[0].ids])
    before = ch09.prefill(model, ch09.RULES["H2O"](model, 1, 40), ids)
    with torch.no_grad():
        model.layers[1].mlp.w_down.weight.mul_(2.0)  # in place: the same tensors, new values
        want = model(ids, cache=ch09.RULES["H2O"](model, 1, 40), logits_to_keep=1)
    got = ch09.prefill(model, ch09.RULES["H2O"](model, 1, 40), ids)
    assert torch.equal(got, want) and not torch.equal(got, before)


def test_kept_vs_reassigned_reuses_the_sweeps_kept_run(small):
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(6))
    row = ch09.sweep(small, ["sinks + window"], [0.25], [], ids, None).iloc[0]
    alone = ch09.kept_vs_reassigned(small, ids, ch09.budget_for(0.25, 64))
    reused = ch09.kept_vs_reassigned(small, ids, ch09.budget_for(0.25, 64), kept=row)
    assert alone == reused
