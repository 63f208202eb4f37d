"""Chapter 09's rules that need no attention probabilities (key norm, TOVA, expected attention), PyramidKV's
budgets per layer, SnapKV's pooling and H2O as its reference code runs it, each against a reference written from
the paper / kvpress / the reference code."""

import math

import pytest
import torch

from kvlib.evict import (BudgetCache, ExpectedAttentionCache, H2OCache, KnormCache, PyramidKVCache, SnapKVCache,
                         TOVACache, pool_votes, pyramid_budgets)
from kvlib.footprint import held_bytes
from kvlib.generate import generate
from kvlib.model import ModelConfig, Transformer, rope_cos_sin, rotate

D, H, H_KV = 8, 4, 2
INV = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)


def stream(cache, n, seed=0, T=1):
    """Feed n random (q, k, v) tokens, T per call, to layer 0 of a one-layer cache; q and k are rotated to
    their positions as the model's seam hands them over. Returns the raw (pre-RoPE) q, k and v."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h in (H, H_KV, H_KV))
    cos, sin = rope_cos_sin(torch.arange(n)[None], INV, torch.float32)
    qr, kr = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
    for t in range(0, n, T):
        cache.attend(0, qr[:, :, t:t + T], kr[:, :, t:t + T], v[:, :, t:t + T])  # the last layer advances it
    return q, k, v, qr, kr


def test_knorm_keeps_the_newest_and_the_smallest_key_norms():
    budget, n = 5, 23
    cache = KnormCache(1, 1, H_KV, budget, D, chunk=1, inv_freq=INV)
    _, _, _, _, kr = stream(cache, n)
    norms = kr[0].norm(dim=-1)  # (H_KV, n)
    for h in range(H_KV):  # streaming, one token at a time: drop the largest norm but the newest
        held = []
        for t in range(n):
            held.append(t)
            if len(held) > budget:
                held.remove(max(held[:-1], key=lambda j: norms[h, j]))
        assert cache.held_positions(0)[h].tolist() == held


def test_tova_keeps_what_the_last_query_attends_to_averaged_over_all_heads():
    budget, n = 6, 20
    cache = TOVACache(1, 1, H_KV, budget, D, chunk=1, inv_freq=INV)
    _, _, _, qr, kr = stream(cache, n, seed=1)
    held = []
    for t in range(n):  # the reference: TOVA's loop, one step at a time
        held.append(t)
        if len(held) > budget:
            keys = kr[0][:, held].repeat_interleave(H // H_KV, 0)  # (H, len, D)
            row = torch.softmax((qr[0, :, t, None] * keys).sum(-1) / math.sqrt(D), -1).mean(0)  # (len,)
            held.pop(int(row[:-1].argmin()))
    assert cache.held_positions(0).tolist() == [held] * H_KV  # one choice per layer


def kvpress_expected_scores(q_pre, keys, values, q_len, n_sink, n_future):
    """ExpectedAttentionPress.score as kvpress writes it, on one sequence: q_pre (1, H, S, D) queries before
    RoPE, keys / values (1, H_KV, N, D) as cached (keys rotated)."""
    h = q_pre[:, :, n_sink:]
    mu = h.mean(dim=2, keepdim=True)
    centered = h - mu
    cov = torch.einsum("bnsi,bnsj->bnij", centered, centered) / h.shape[2]
    mu = mu.squeeze(2)
    cos, sin = rope_cos_sin(torch.arange(q_len, q_len + n_future)[None], INV, torch.float32)
    cos, sin = cos[0], sin[0]
    Id, P = torch.eye(D), torch.zeros(D, D)
    P[D // 2:, : D // 2], P[: D // 2, D // 2:] = torch.eye(D // 2), -torch.eye(D // 2)
    R = (cos.unsqueeze(1) * Id + sin.unsqueeze(1) * P).mean(0)
    mu, cov = mu @ R.T, R @ cov @ R.T
    k = keys[:, :, n_sink:].repeat_interleave(H // H_KV, 1).transpose(2, 3)
    scores = (mu.unsqueeze(2) @ k).squeeze(2) / math.sqrt(D)
    scores = scores + torch.einsum("bhin,bhij,bhjn->bhn", k, cov, k) / D / 2
    scores = torch.softmax(scores, -1).view(1, H_KV, H // H_KV, -1).mean(2)
    return scores * values[:, :, n_sink:].norm(dim=-1)


def test_expected_attention_scores_equal_kvpress_formula():
    n, n_sink, n_future = 19, 3, 64
    cache = ExpectedAttentionCache(1, 1, H_KV, 32, D, chunk=8, inv_freq=INV, n_sink=n_sink, n_future=n_future,
                                   n_heads=H)
    q, k, v, _, kr = stream(cache, n, seed=2, T=8)  # nothing evicted: 19 < 32
    ours = cache.score_held(0, n)  # (1, H_KV, n)
    ref = kvpress_expected_scores(q, kr, v, n, n_sink, n_future)
    assert torch.isinf(ours[..., :n_sink]).all()
    assert torch.allclose(ours[..., n_sink:], ref, atol=1e-6)


def test_expected_attention_without_covariance_or_vnorm_changes_the_scores():
    scores = {}
    for cov, vnorm in [(True, True), (False, True), (True, False)]:
        cache = ExpectedAttentionCache(1, 1, H_KV, 32, D, chunk=4, inv_freq=INV, n_sink=1, n_heads=H,
                                       use_covariance=cov, use_vnorm=vnorm)
        stream(cache, 17, seed=3, T=4)
        scores[cov, vnorm] = cache.score_held(0, 17)[..., 1:]
    assert not torch.allclose(scores[True, True], scores[False, True])
    assert not torch.allclose(scores[True, True], scores[True, False])


def test_pool_votes_keeps_the_window_out_of_its_neighbours():
    votes = torch.tensor([[[0.0, 0.0, 0.0, 0.1, 0.0, 9.0, 9.0]]])
    window = torch.tensor([[[0, 0, 0, 0, 0, 1, 1]]]).bool()
    pooled = pool_votes(votes, window, kernel=3)
    assert pooled[0, 0, :5].tolist() == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.1])  # not 9: the window is cut off
    assert torch.isinf(pooled[0, 0, 5:]).all()
    avg = pool_votes(votes, window, kernel=3, pooling="avg")
    assert avg[0, 0, 4].item() == pytest.approx(0.1 / 3)  # zero padding and the cut-off window count as 0


def test_snapkv_reference_selection_after_a_prefill():
    """SnapKV's reference code on one prompt: the window's votes over the prefix, max-pooled, top-k + window."""
    budget, window, kernel, n = 9, 4, 3, 30
    cache = SnapKVCache(1, 1, H_KV, budget, D, window=window, kernel=kernel, chunk=64, inv_freq=INV)
    _, _, _, qr, kr = stream(cache, n, seed=4, T=n)
    logits = qr[0, :, -window:] @ kr[0].repeat_interleave(H // H_KV, 0).transpose(-1, -2) / math.sqrt(D)
    causal = torch.arange(n)[None] <= torch.arange(n - window, n)[:, None]
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # (H, window, n)
    votes = probs[:, :, :-window].sum(1).view(H_KV, H // H_KV, -1).sum(1)  # (H_KV, n - window)
    pooled = torch.nn.functional.max_pool1d(votes[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    for h in range(H_KV):  # the best budget - window by pooled votes (equal votes: the later position), + the window
        best = sorted(range(n - window), key=lambda j: (-float(pooled[h, j]), -j))[:budget - window]
        assert cache.held_positions(0)[h].tolist() == sorted(best) + list(range(n - window, n))


def h2o_by_hand(qr, kr, prompt, budget, recent):
    """H2O as FMInference/H2O's ``H2OKVCache_LayerWise`` runs it, on one sequence, per K/V head (its query heads'
    attention summed): the prompt attends fully, each position's score is the attention it received from every
    prompt query, the prompt is cut once to the top ``budget - recent`` scores before the recent window + the window;
    then each decoded token attends over what is held, every held score grows by the attention it got, and the
    lowest score outside the window goes. qr (H, n, D), kr (H_KV, n, D) rotated. Returns the held positions per
    K/V head after the prefill and after every decoded token."""
    n_rep, hh = H // H_KV, budget - recent
    logits = qr[:, :prompt] @ kr[:, :prompt].repeat_interleave(n_rep, 0).transpose(-1, -2) / math.sqrt(D)
    causal = torch.ones(prompt, prompt, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # (H, prompt, prompt)
    received = probs.sum(1).view(H_KV, n_rep, prompt).sum(1)  # (H_KV, prompt): summed over queries and heads
    held, score = [], []
    for g in range(H_KV):
        top = received[g, :prompt - recent].topk(hh).indices.sort().values.tolist()
        held.append(top + list(range(prompt - recent, prompt)))
        score.append([float(received[g, j]) for j in held[g]])
    history = [[list(h) for h in held]]
    for t in range(prompt, qr.shape[1]):  # one decoded token: attend over the held + itself, add, evict one
        for g in range(H_KV):
            held[g].append(t)
            score[g].append(0.0)
            keys = kr[g, held[g]]  # (n + 1, D)
            p = torch.softmax(qr[g * n_rep:(g + 1) * n_rep, t] @ keys.T / math.sqrt(D), -1).sum(0)
            score[g] = [s + float(x) for s, x in zip(score[g], p)]
            out = min(range(len(held[g]) - recent), key=lambda j: score[g][j])
            del held[g][out], score[g][out]
        history.append([list(h) for h in held])
    return history


def test_h2o_follows_its_reference_code_after_the_prefill_and_per_decoded_token():
    """H2OCache (default) against h2o_by_hand on random tensors, batch 2 (each row its own contents)."""
    budget, recent, prompt, n = 9, 4, 23, 29
    B = 2
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h in (H, H_KV, H_KV))
    q = 3 * q  # peaked attention: a position's score depends on its key, not only on how many queries follow it
    cos, sin = rope_cos_sin(torch.arange(n)[None], INV, torch.float32)
    qr, kr = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
    cache = H2OCache(1, B, H_KV, budget, D, recent=recent, chunk=4, inv_freq=INV, kernels="torch")
    out = cache.attend(0, qr[:, :, :prompt], kr[:, :, :prompt], v[:, :, :prompt])  # the prefill, one call
    full = torch.nn.functional.scaled_dot_product_attention(
        qr[:, :, :prompt], kr[:, :, :prompt].repeat_interleave(H // H_KV, 1),
        v[:, :, :prompt].repeat_interleave(H // H_KV, 1), is_causal=True)
    assert torch.allclose(out, full, atol=1e-5)  # the prompt attended fully: nothing was evicted while it ran
    got = [[cache.held_positions(b).tolist() for b in range(B)]]
    for t in range(prompt, n):
        cache.attend(0, qr[:, :, t:t + 1], kr[:, :, t:t + 1], v[:, :, t:t + 1])
        got.append([cache.held_positions(b).tolist() for b in range(B)])
    for b in range(B):
        want = h2o_by_hand(qr[b], kr[b], prompt, budget, recent)
        assert [step[b] for step in got] == want, b
    assert got[0][0] != got[0][1]  # the rows chose differently: a batch is not one choice
    assert any(heads[:budget - recent] != list(range(budget - recent)) for heads in got[0][0])  # not just the first
    assert cache.prefill_len.tolist() == [prompt] * B and cache.evicted.tolist() == [n - budget] * B
    assert cache.index[0].shape[2] == budget + 4  # no row for the whole prompt, and no growth while decoding


def test_h2o_streamed_is_ours_and_chooses_before_the_prompt_ends():
    """prefill="stream" evicts as the prompt streams in chunks: it keeps other positions than the reference rule,
    and equals the reference rule fed the prompt one chunk per call (its first call then fits the budget)."""
    budget, prompt = 8, 24
    caches = {mode: H2OCache(1, 1, H_KV, budget, D, chunk=4, inv_freq=INV, prefill=mode) for mode in ("whole", "stream")}
    held = {}
    for mode, cache in caches.items():
        stream(cache, prompt, seed=16, T=prompt)
        held[mode] = cache.held_positions(0).tolist()
    chunked = H2OCache(1, 1, H_KV, budget, D, chunk=4, inv_freq=INV)
    stream(chunked, prompt, seed=16, T=4)  # a first call of 4 <= budget: nothing to compress, then 4 per call
    assert held["stream"] == chunked.held_positions(0).tolist() and held["stream"] != held["whole"]
    assert caches["stream"].prefill == "stream" and not caches["stream"].prefill_whole
    with pytest.raises(ValueError, match="prefill must be"):
        H2OCache(1, 1, H_KV, budget, D, prefill="chunked")


def test_h2o_holds_snapkvs_bytes_after_the_prompt_and_never_grows():
    """Memory as a server pays it: after the prefill the reference H2O holds exactly what SnapKV's paper rule holds
    (budget + chunk rows, index, positions, scores, the prefill's length); no temporary of the prefill stays held; the
    streamed H2O holds the same but the prefill's length; decoding changes nothing (one in, one out)."""
    model = gqa_model(n_layers=2)
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(9))
    h2o, ours = H2OCache.for_model(model, 1, 12, chunk=8), H2OCache.for_model(model, 1, 12, chunk=8, prefill="stream")
    snap = SnapKVCache.for_model(model, 1, 12, window=4, chunk=8)
    with torch.no_grad():
        for cache in (h2o, ours, snap):
            model(ids[:, :40], cache=cache)
    after = {name: held_bytes(c) for name, c in (("h2o", h2o), ("ours", ours), ("snap", snap))}
    assert after["h2o"].total == after["snap"].total == h2o.nbytes()
    assert after["h2o"].total - after["ours"].total == 8  # prefill_len: one int64 per sequence
    assert not any("received" in path for path in after["h2o"].tensors) and getattr(h2o, "_received", None) is None
    with torch.no_grad():
        for t in range(40, 60):
            model(ids[:, t:t + 1], positions=torch.tensor([[t]]), cache=h2o)
    assert held_bytes(h2o).total == after["h2o"].total and h2o.held(0) == 12


def test_pyramid_budgets_fall_linearly_and_average_the_budget():
    b = pyramid_budgets(200, 30, window=16, beta=20)
    assert len(b) == 30 and sum(b) == 200 * 30
    assert all(x > y for x, y in zip(b, b[1:])) and b[-1] == 16 + round(184 / 20)
    assert pyramid_budgets(50, 1, window=8) == [50]
    with pytest.raises(ValueError, match="beta"):
        pyramid_budgets(50, 4, window=8, beta=0.5)


def gqa_model(n_layers=4):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                       hidden_dim=128)).eval()


def test_pyramid_holds_each_layers_budget_in_the_bytes_of_a_uniform_one():
    model = gqa_model()
    pyr = PyramidKVCache.for_model(model, 1, 12, window=2, chunk=8, decode_evict=True)  # every call evicts
    snap = SnapKVCache.for_model(model, 1, 12, window=2, chunk=8, decode_evict=True)
    assert pyr.nbytes() == snap.nbytes() and pyr.budgets != snap.budgets
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        for t in range(0, 40, 8):
            model(ids[:, t:t + 8], positions=torch.arange(t, t + 8)[None], cache=pyr)
            for layer, budget in enumerate(pyr.budgets):
                held = pyr.held_positions(0, layer)
                assert held.shape == (2, min(budget, t + 8)) and int(held.max()) == t + 7
    assert generate(model, [[1, 2, 3]], 20, cache=pyr).shape == (1, 20)


@pytest.mark.parametrize("make, match", [
    (lambda: KnormCache(1, 1, 2, 4, D, recent=4), "recent must be below"),
    (lambda: ExpectedAttentionCache(1, 1, 2, 6, D, inv_freq=INV, n_sink=5), "n_sink \\+ recent"),
    (lambda: ExpectedAttentionCache(1, 1, 2, 6, D), "inv_freq"),
    (lambda: SnapKVCache(1, 1, 2, 8, D, window=2, pooling="mean"), "pooling must be"),
    (lambda: BudgetCache(2, 1, 2, 8, D, layer_budgets=[8]), "one budget per layer"),
    (lambda: PyramidKVCache(2, 1, 2, 8, D, window=2, layer_budgets=[8, 8]), "computes its layer budgets"),
    (lambda: PyramidKVCache(2, 1, 2, 8, D, window=8), "window must be below"),
])
def test_bad_options_are_refused(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_expected_attention_refuses_queries_of_another_head_count():
    cache = ExpectedAttentionCache(1, 1, H_KV, 8, D, inv_freq=INV, n_heads=H)
    with pytest.raises(ValueError, match="n_heads"):
        cache.attend(0, torch.randn(1, 2, 1, D), torch.randn(1, H_KV, 1, D), torch.randn(1, H_KV, 1, D))
