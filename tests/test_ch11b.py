"""kvlib.course.ch11b (chapter 11b's harness) and the sinks of kvlib.hybrid.HybridCache that it measures."""

import dataclasses

import pytest
import torch

from kvlib.cache import KVCache
from kvlib.course import ch09, ch11b
from kvlib.hybrid import HybridCache, banded_attention_ref, hybrid_bytes
from kvlib.generate import generate
from kvlib.model import ModelConfig, Transformer, load_tiny


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def _feed(cache, q, k, v, sizes):
    """Feed (1, H, T, D) q/k/v through one layer in calls of ``sizes`` tokens -> outputs (1, H, T, D)."""
    outs, t = [], 0
    for n in sizes:
        outs.append(cache.attend(0, q[:, :, t:t + n], k[:, :, t:t + n], v[:, :, t:t + n]))
        t += n
    return torch.cat(outs, 2)


@pytest.mark.parametrize("window, n_sink, spare", [(5, 2, 0), (5, 2, 2), (4, 3, 1), (6, 1, 0), (3, 4, 0)])
@pytest.mark.parametrize("sizes", [[23], [1] * 23, [7, 1, 1, 6, 8], [2, 9, 12]])
def test_window_layer_with_sinks_is_the_band_plus_the_sinks(window, n_sink, spare, sizes):
    g = torch.Generator().manual_seed(window * 10 + n_sink)
    q, k, v = torch.randn(1, 4, 23, 8, generator=g), torch.randn(1, 2, 23, 8, generator=g), torch.randn(1, 2, 23, 8, generator=g)
    pos = torch.arange(23)[None]
    ref = banded_attention_ref(q, k, v, pos, pos, window, n_sink)
    cache = HybridCache(["window"], 1, 2, 30, 8, window=window, spare=spare, n_sink=n_sink)
    assert torch.allclose(_feed(cache, q, k, v, sizes), ref, atol=1e-5)
    held = cache.held_positions(0, 0).tolist()
    assert set(range(min(n_sink, 23))) <= set(held) and set(range(23 - window, 23)) <= set(held)
    assert cache.held(0, 0) == min(23, n_sink + window + spare)


def test_sinks_change_what_a_window_layer_sees():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(3))
    pos = torch.arange(12)[None]
    with_sinks, without = (banded_attention_ref(q, k, v, pos, pos, 4, s) for s in (2, 0))
    assert torch.allclose(with_sinks[:, :, :4], without[:, :, :4], atol=1e-6)  # the sinks are still in the window
    assert all(not torch.allclose(with_sinks[:, :, p], without[:, :, p], atol=1e-3) for p in range(4, 12))


def test_stored_bytes_with_sinks_is_the_formula():
    model = Transformer(ModelConfig(vocab_size=32, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, hidden_dim=64)).eval()
    for n in (3, 9, 40):
        cache = HybridCache.for_model(model, 1, 48, pattern="2:1", window=6, n_sink=3)
        with torch.no_grad():
            model(torch.randint(0, 32, (1, n)), cache=cache)
        assert cache.stored_bytes() == hybrid_bytes(n, cache.plan, 6, 2, 8, 4, n_sink=3)
    assert hybrid_bytes(100, ["window", "full"], 10, 1, 1, 1, n_sink=4) == 2 * (14 + 100)


def test_truncate_with_sinks_is_exact_or_refused():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 20, 4, generator=g) for _ in range(3))
    cut = HybridCache(["window"], 1, 1, 24, 4, window=4, spare=2, n_sink=2)
    _feed(cut, q, k, v, [17])
    assert cut.truncate(0, 14)  # 3 = spare + 1 tokens
    never = HybridCache(["window"], 1, 1, 24, 4, window=4, spare=2, n_sink=2)
    _feed(never, q, k, v, [14])
    a, b = _feed(cut, q[:, :, 14:], k[:, :, 14:], v[:, :, 14:], [6]), _feed(never, q[:, :, 14:], k[:, :, 14:], v[:, :, 14:], [6])
    assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="ring no longer holds"):
        cut.truncate(0, 15)


def test_split_prompt_and_answer_read(tiny):
    _, tok = tiny
    n_q = len(tok.encode(ch09.QUESTION))
    for p in ch09.passkey_prompts(tok, n=3, length=280):
        doc, question = ch11b.split_prompt(p, n_q)
        assert doc + question == p.ids and question == tok.encode(ch09.QUESTION) and p.needle.stop <= len(doc)
    with pytest.raises(ValueError):
        ch11b.split_prompt(p, 0)
    assert ch11b.answer_read("Quest", 100, 4, 10) == (100 + 30) / 4
    assert ch11b.answer_read("SnapKV", 100, 4, 10) == (100 + 11 + 12 + 13) / 4


def test_quest_passkey_branches_are_the_caches_they_stand_for(tiny):
    """The full-cache branch scores as chapter 09's scorer with a KVCache; Quest with every block selected scores as
    the full cache; the late scorer with a KVCache scores as the prompt fed at once."""
    model, tok = tiny
    n_q = len(tok.encode(ch09.QUESTION))
    prompts = ch09.passkey_prompts(tok, n=3, length=280)
    # the "key" each prompt asks for: the full cache's own greedy continuation, so the full cache retrieves it
    prompts = [dataclasses.replace(p, answer=generate(model, [p.ids], 4, cache=KVCache.for_model(model, 1, 300))[0].tolist())
               for p in prompts]
    full = ch09.score_passkey(model, lambda B: KVCache.for_model(model, B, 300), prompts, batch=1)["retrieved"]
    wide = ch11b.quest_passkey(model, prompts, n_q, token_budget=304)  # 19 blocks of 16 cover the prompt and the answer
    assert full == [True] * 3
    assert wide["full"] == full and wide["Quest"] == full and wide["Quest late"] == full
    late = ch11b.score_late(model, lambda B: KVCache.for_model(model, B, 300), prompts, n_q)
    assert late == full
    narrow = ch11b.quest_passkey(model, prompts, n_q, token_budget=32)
    assert wide["read"] > narrow["read"] > 0 and narrow["read late"] > 0


def test_batched_runs_score_as_one_prompt_at_a_time(tiny):
    """Every prompt in one call gives what one prompt per call gives (hits and Quest's mean reads), and SnapKV after
    caching reads the text's prefill Quest recorded (ch09.prefill) without changing a hit."""
    model, tok = tiny
    n_q = len(tok.encode(ch09.QUESTION))
    prompts = ch09.passkey_prompts(tok, n=3, length=280)
    one = ch11b.quest_passkey(model, prompts, n_q, token_budget=32, batch=1)
    ch09._PREFILLS.pop(model, None)
    every = ch11b.quest_passkey(model, prompts, n_q, token_budget=32)  # records the texts' prefill, one batch
    assert {k: every[k] for k in ("full", "Quest", "Quest late")} == {k: one[k] for k in ("full", "Quest", "Quest late")}
    assert every["read"] == pytest.approx(one["read"], rel=1e-9) and every["read late"] == pytest.approx(one["read late"], rel=1e-9)
    assert len(ch09._PREFILLS[model]) == 1
    ev = ch11b.eviction_passkey(model, prompts, n_q, 40, 48)
    assert list(ev) == ["SnapKV", "SnapKV late", "sinks + window late"] and all(len(h) == 3 for h in ev.values())
    ch09._PREFILLS.pop(model, None)
    fresh = [ch11b.score_late(model, lambda B: ch09.RULES[name](model, B, 48), prompts, n_q, batch=1)
             for name in ("SnapKV", "sinks + window")]
    assert [ev["SnapKV late"], ev["sinks + window late"]] == fresh


def test_bound_recall_holds_on_a_real_prefill(tiny):
    model, tok = tiny
    ids = tok.encode("def area(width, height):\n    return width * height\n" * 4)[:96]
    cache = ch11b.quest_for(model, 1, len(ids))
    rec = ch11b.bound_recall(cache, ch11b.prefill_queries(model, cache, ids), n_top=2)
    assert rec["holds"] and rec["blocks"] == len(ids) // 16
    assert len(rec["recall"]) == model.config.n_layers * model.config.n_heads and all(0 <= r <= 1 for r in rec["recall"])


def test_spare_rows_allow_cuts_of_one_more_token():
    table = ch11b.spare_table(spares=(0, 1, 3), cuts=(1, 2, 3, 4, 5))
    assert {s: max(d for d, ok in c.items() if ok) for s, c in table.items()} == {0: 1, 1: 2, 3: 4}


def test_retention_keeps_freed_prefix_blocks_findable():
    assert ch11b.retention_demo(True) == {"cached tokens found": 12, "free blocks after the free": 5}
    assert ch11b.retention_demo(False) == {"cached tokens found": 0, "free blocks after the free": 8}


def test_prefix_table_reads_prefix_hit():
    rows = ch11b.prefix_table(["window"] * 5 + ["full"])
    assert [r["the request reuses"] for r in rows] == [0, 2992]
    assert rows[0]["full layers resume at"] == 2992


def test_passkey_bars_draw_one_bar_per_result():
    fig = ch11b.passkey_bars({"a": {"x": (3, 5), "y": (1, 5)}, "b": {"x": (5, 5)}})
    assert len(fig.axes[0].patches) == 3


def test_quest_branch_is_quests_code_on_a_question_after_caching():
    """qp["Quest"] is what Quest's code computes when the question arrives after the text: the text, then the
    question in one call (more than one token: read densely), then the answer one decode step at a time (sparse).
    The answer is that rule's own greedy continuation, so the "Quest" branch must retrieve it on every prompt; on
    this random model the full cache and the sparse-question variant do not, so the check can tell them apart."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=64)).eval()
    g, n_q = torch.Generator().manual_seed(1), 6

    @torch.no_grad()
    def quests_code(ids, n_new=6):
        doc, question = ids[:-n_q], ids[-n_q:]
        cache = ch11b.quest_for(model, 1, 200, token_budget=16, dense_multi_token=True)
        model(torch.tensor([doc]), cache=cache, logits_to_keep=1)
        seq, out, start = question, [], len(doc)
        for _ in range(n_new):
            logits = model(torch.tensor([seq]), cache=cache, positions=torch.arange(start, start + len(seq))[None])
            start += len(seq)
            out.append(int(logits[0, -1].argmax()))
            seq = [out[-1]]
        return out

    prompts = []
    for _ in range(6):
        ids = torch.randint(0, 64, (120,), generator=g).tolist()
        prompts.append(ch09.Passkey(ids=ids, key=0, answer=quests_code(ids), needle=range(30, 40), depth=0.3, filler=0))
    qp = ch11b.quest_passkey(model, prompts, n_q, token_budget=16)
    assert qp["Quest"] == [True] * 6
    assert qp["full"] != [True] * 6 and qp["Quest late"] != [True] * 6


def test_prefill_queries_of_a_decode_step_sit_at_their_position(tiny):
    model, tok = tiny
    ids = tok.encode("def area(width, height):\n    return width * height\n" * 2)[:40]
    one = ch11b.prefill_queries(model, KVCache.for_model(model, 1, 41), ids + [ids[3]])
    cache = KVCache.for_model(model, 1, 41)
    ch11b.prefill_queries(model, cache, ids)
    step = ch11b.prefill_queries(model, cache, [ids[3]], start=len(ids))
    assert all(torch.allclose(step[layer], one[layer], atol=1e-4) for layer in one)
    wrong = ch11b.prefill_queries(model, KVCache.for_model(model, 1, 1), [ids[3]])  # at position 0: another RoPE angle
    assert not torch.allclose(wrong[1], one[1], atol=1e-3)


def test_key_in_window_and_split_hits():
    import types
    key = [9, 1, 2]
    prompts = []
    for s in (100, 120, 125, 200):  # the key's first mention 4 tokens into the needle, a second one later
        ids = [0] * 256
        ids[s + 4: s + 7] = key
        ids[s + 12: s + 15] = key
        prompts.append(types.SimpleNamespace(ids=ids, answer=key, needle=range(s, s + 20)))
    inside = ch11b.key_in_window(prompts, 128)
    assert inside == [False, False, True, True]  # first mentions at 104, 124, 129, 204; the window: 128 .. 255
    assert ch11b.split_hits([True, False, True, False], inside) == ((1, 2), (1, 2))
    assert ch11b.split_hits([True, True, False, False], inside) == ((0, 2), (2, 2))
    with pytest.raises(ValueError):
        ch11b.key_in_window([types.SimpleNamespace(ids=[0] * 256, answer=key, needle=range(5, 25))], 128)
