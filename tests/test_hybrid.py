"""Layers with different caches (chapter 11): the band, the hybrid cache, its bytes, the pool and prefix reuse."""

import pytest
import torch

from kvlib import runtime
from kvlib.cache import CacheFullError, KVCache
from kvlib.footprint import held_bytes
from kvlib.generate import generate
from kvlib.hybrid import (JAMBA_V01, HybridCache, aligned_block_size, banded_attention_ref, blocks_held,
                          hybrid_bytes, layer_plan, pool_blocks, prefix_hit, state_hybrid_bytes)
from kvlib.model import ModelConfig, Transformer, naive_attention


def band_model(n_layers=3, seed=0, n_heads=4, n_kv_heads=2):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=n_layers, n_heads=n_heads,
                                       n_kv_heads=n_kv_heads, hidden_dim=128)).eval()


def naive_band(q, k, v, window):
    """Full attention over the whole sequence, masked to the band: query i sees keys i - window + 1 .. i."""
    T = q.shape[2]
    i = torch.arange(T, device=q.device)
    d = i[:, None] - i[None, :]
    mask = (d >= 0) if window is None else (d >= 0) & (d < window)
    return naive_attention(q.float(), k.float(), v.float(), mask[None, None]).to(q.dtype)


class BandSeam:
    """The naive reference model: no cache, every layer attends over the whole sequence given, window layers
    through the band mask (built from full attention, as a model trained with a window computes it)."""

    def __init__(self, plan, window):
        self.plan, self.window = plan, window

    def attend(self, layer_idx, q, k, v):
        return naive_band(q, k, v, self.window if self.plan[layer_idx] == "window" else None)


# ---- the plan and the band ---------------------------------------------------------------------


def test_layer_plan_patterns_and_errors():
    assert layer_plan(12, "5:1") == (["window"] * 5 + ["full"]) * 2  # Gemma 3: layers 5, 11 global
    assert layer_plan(3, "1:1") == ["window", "full", "window"]  # Gemma 2 starts with a local layer
    assert set(layer_plan(5, "1:0")) == {"window"} and set(layer_plan(5, "0:1")) == {"full"}
    for bad in ("5", "a:b", "0:0", "-1:2", 5):
        with pytest.raises(ValueError, match="pattern"):
            layer_plan(4, bad)


@pytest.mark.parametrize("window", [1, 2, 5, 13, 40])
@pytest.mark.parametrize("H, H_KV", [(1, 1), (4, 2), (8, 1)])
def test_banded_reference_is_masked_full_attention(window, H, H_KV):
    g = torch.Generator().manual_seed(window * 10 + H)
    T, D = 13, 24  # not powers of two
    q = torch.randn(2, H, T, D, generator=g)
    k, v = torch.randn(2, H_KV, T, D, generator=g), torch.randn(2, H_KV, T, D, generator=g)
    pos = torch.arange(T).expand(2, T)
    want = naive_band(q, k, v, window)
    assert torch.allclose(banded_attention_ref(q, k, v, pos, pos, window), want, atol=1e-5)
    perm = torch.randperm(T, generator=g)  # the keys in any order: only their positions count
    got = banded_attention_ref(q, k[:, :, perm], v[:, :, perm], pos, pos[:, perm], window)
    assert torch.allclose(got, want, atol=1e-5)


def test_window_counts_the_token_itself():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 6, 8, generator=g) for _ in range(3))
    pos = torch.arange(6)[None]
    assert torch.allclose(banded_attention_ref(q, k, v, pos, pos, window=1), v)  # W = 1: itself only
    out = banded_attention_ref(q, k, v, pos, pos, window=2)  # W = 2: itself and the one before, no more
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 0], v2[:, :, 0] = 100.0, 100.0  # position 0 is outside the window of positions 2..5
    assert torch.allclose(banded_attention_ref(q, k2, v2, pos, pos, window=2)[:, :, 2:], out[:, :, 2:])
    assert not torch.allclose(banded_attention_ref(q, k2, v2, pos, pos, window=2)[:, :, 1], out[:, :, 1])


def written_ring(n, rows):
    """The ring a hand-written loop leaves after positions 0..n-1: position p in row p mod rows."""
    ring = [-1] * rows
    for p in range(n):
        ring[p % rows] = p
    return ring


# ---- the cache, one layer at a time ------------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("H, H_KV", [(2, 1), (4, 4), (8, 2)])
def test_window_layer_in_chunks_equals_band_reference(kernels, dtype, H, H_KV):
    """Prefill, decodes, a chunk longer than the window, more decodes: each output equals the band over
    the whole sequence (the reference sees every key; the cache only its ring)."""
    g = torch.Generator().manual_seed(H * 7 + H_KV)
    W, D, B = 5, 24, 2
    chunks = [7, 1, 1, 9, 1, 3, 1, 1]  # 24 positions; 9 > W
    S = sum(chunks)
    dev = runtime.DEVICE
    q = torch.randn(B, H, S, D, generator=g).to(dtype).to(dev)
    k, v = (torch.randn(B, H_KV, S, D, generator=g).to(dtype).to(dev) for _ in range(2))
    want = naive_band(q, k, v, W)
    cache = HybridCache(["window"], B, H_KV, S, D, window=W, dtype=dtype, device=dev, kernels=kernels)
    t = 0
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for T in chunks:
        out = cache.attend(0, q[:, :, t:t + T], k[:, :, t:t + T], v[:, :, t:t + T])
        assert (out.float() - want[:, :, t:t + T].float()).abs().max() <= tol, (t, T)
        t += T
    assert cache.seq_lens.tolist() == [S, S] and cache.k[0].shape[2] == W  # only W rows were ever allocated
    assert cache.pos[0].tolist() == [written_ring(S, W)] * B


def test_ragged_decode_through_window_layer():
    """Sequences of different lengths decode together: each attends to its own last W positions."""
    g = torch.Generator().manual_seed(3)
    W, H, H_KV, D = 4, 4, 2, 16
    lens = [3, 9]
    qs = [torch.randn(1, H, n + 1, D, generator=g) for n in lens]
    ks = [torch.randn(1, H_KV, n + 1, D, generator=g) for n in lens]
    vs = [torch.randn(1, H_KV, n + 1, D, generator=g) for n in lens]
    cache = HybridCache(["window"], 2, H_KV, 16, D, window=W)
    for b, n in enumerate(lens):  # prefill each one alone through its view
        cache.sequence(b).attend(0, qs[b][:, :, :n], ks[b][:, :, :n], vs[b][:, :, :n])
    out = cache.attend(0, torch.cat([x[:, :, -1:] for x in qs]), torch.cat([x[:, :, -1:] for x in ks]),
                       torch.cat([x[:, :, -1:] for x in vs]))
    for b in range(2):
        assert torch.allclose(out[b:b + 1], naive_band(qs[b], ks[b], vs[b], W)[:, :, -1:], atol=1e-5)


# ---- the cache in the model ------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [("window", "full", "window"), ("full", "window", "full"), ("window",) * 3])
def test_model_with_hybrid_cache_equals_band_reference(plan):
    model, W = band_model(), 4
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (1, 21), generator=g)
    with torch.no_grad():
        want = model(ids, cache=BandSeam(plan, W))  # (1, 21, V) the whole sequence at once
        cache = HybridCache.for_model(model, 1, 21, plan=list(plan), window=W)
        got, t = [], 0
        for T in (6, 1, 1, 8, 1, 4):  # 8 > W: a chunk longer than the window
            got.append(model(ids[:, t:t + T], positions=torch.arange(t, t + T)[None], cache=cache))
            t += T
    assert torch.allclose(torch.cat(got, dim=1), want, atol=1e-4)
    assert [cache.held(0, layer) for layer in range(3)] == [W if kind == "window" else 21 for kind in plan]


def test_wide_window_is_token_identical_to_kvcache():
    model = band_model()
    prompts = [[5, 9, 2, 33, 7, 1, 40], [8, 8, 3]]
    plan = ["window", "full", "window"]
    want = generate(model, prompts, 12, cache=KVCache.for_model(model, 2, 19))
    wide = HybridCache.for_model(model, 2, 19, plan=plan, window=19)  # W >= every sequence's length
    assert torch.equal(generate(model, prompts, 12, cache=wide), want)
    with torch.no_grad():  # and the logits agree, not only their argmax
        ids = torch.tensor([prompts[0]])
        full, hyb = KVCache.for_model(model, 1, 8), HybridCache.for_model(model, 1, 8, plan=plan, window=8)
        assert torch.allclose(model(ids, cache=hyb), model(ids, cache=full), atol=1e-5)


def test_generate_with_sliding_window_equals_band_reference():
    """Greedy decoding through the cache with W smaller than the text equals re-running the whole sequence
    through the band reference at every step."""
    model, W, plan = band_model(seed=1), 3, ["window", "full", "window"]
    prompt, n_new = [3, 17, 22, 5, 9, 41, 2, 60], 10
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            seq.append(int(model(torch.tensor([seq]), cache=BandSeam(plan, W))[0, -1].argmax()))
    cache = HybridCache.for_model(model, 1, len(seq), plan=plan, window=W)
    assert generate(model, [prompt], n_new, cache=cache)[0].tolist() == seq[len(prompt):]
    plain = generate(model, [prompt], n_new)[0].tolist()
    assert plain != seq[len(prompt):]  # the window changed the answer: the test can tell them apart


def test_refusals_leave_the_cache_intact():
    with pytest.raises(ValueError, match="one of 'full', 'window'"):
        HybridCache(["state", "full"], 1, 1, 8, 4, window=2)
    with pytest.raises(ValueError, match="pass window"):
        HybridCache(["window", "full"], 1, 1, 8, 4)
    with pytest.raises(ValueError, match="one kind per layer"):
        HybridCache.for_model(band_model(), 1, 8, plan=["full"], window=2)
    cache = HybridCache(["window", "full"], 1, 2, 6, 8, window=3)
    x = torch.randn(1, 2, 5, 8)
    for layer in (0, 1):
        cache.attend(layer, x, x, x)
    before = [t.clone() for t in cache.k + cache.v]
    with pytest.raises(CacheFullError):
        cache.attend(0, torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    assert cache.seq_lens.tolist() == [5] and all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))
    with pytest.raises(ValueError, match="layer_idx"):
        cache.attend(2, x, x, x)


# ---- bytes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 6, 7, 17])  # below W, at W, past W (W = 6)
def test_stored_bytes_equal_the_formula(n):
    plan, W, H_KV, D = layer_plan(6, "2:1"), 6, 3, 8
    cache = HybridCache(plan, 2, H_KV, 20, D, window=W, dtype=torch.float16)
    x = torch.randn(2, H_KV, n, D).half()
    for layer in range(len(plan)):
        cache.attend(layer, x, x, x)
    formula = hybrid_bytes(n, plan, W, H_KV, D, bytes_per_element=2)
    assert cache.stored_bytes() == 2 * formula  # two sequences
    assert formula == (4 * min(n, W) + 2 * n) * 2 * H_KV * D * 2
    sized = HybridCache(plan, 1, H_KV, n, D, window=W, dtype=torch.float16)  # allocated for exactly n positions
    assert sized.nbytes() == held_bytes(sized).payload == formula


def test_hybrid_bytes_smollm2_figures():
    gemma, full = layer_plan(30, "5:1"), layer_plan(30, "0:1")
    per_position = 2 * 3 * 64 * 2  # K and V, 3 K/V heads of 64, fp16
    assert hybrid_bytes(8192, full, None, 3, 64) == 30 * 8192 * per_position
    assert hybrid_bytes(8192, gemma, 1024, 3, 64) == (5 * 8192 + 25 * 1024) * per_position
    assert hybrid_bytes(512, gemma, 1024, 3, 64) == hybrid_bytes(512, full, None, 3, 64)  # inside the window


# ---- the pool and prefix reuse ---------------------------------------------------------------------


def test_blocks_held_hand_counts():
    # block_size 4, W = 6. After n stored positions the next token (position n) reads n - 5 .. n - 1.
    assert blocks_held("window", 0, 6, 4) == []
    assert blocks_held("window", 5, 6, 4) == [0, 1]  # nothing has left the window yet
    assert blocks_held("window", 9, 6, 4) == [1, 2]  # reads 4..8: block 0 (0-3) is free
    assert blocks_held("window", 12, 6, 4) == [1, 2]  # reads 7..11: block 1 (4-7) still holds position 7
    assert blocks_held("window", 13, 6, 4) == [2, 3]  # reads 8..12
    assert blocks_held("window", 13, 6, 4, free_window=False) == [0, 1, 2, 3]
    assert blocks_held("full", 13, None, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="kind"):
        blocks_held("state", 4, None, 4)


def test_pool_blocks_hand_count_and_rfc_figures():
    # 3 window + 1 full layers, W = 6, block 4, 13 positions: full 4 blocks, each window 2 -> 10 of 16
    got = pool_blocks(["window", "window", "full", "window"], 13, window=6, block_size=4)
    assert got["kept_all"] == 16 and got["freed"] == 10 and got["waste"] == 6 / 16
    assert got["window_slack"] == 3 * (8 - 5)  # each window layer's 2 blocks hold 8 slots for 5 positions
    assert pool_blocks(layer_plan(4, "0:1"), 100, None)["waste"] == 0.0  # nothing to free without windows
    assert pool_blocks(layer_plan(42, "1:1"), 8192, window=4096)["waste"] == 0.25  # RFC #11382: Gemma-2
    assert pool_blocks(layer_plan(36, "3:1"), 131072, window=32768)["waste"] == 0.5625  # RFC: Ministral


@pytest.mark.parametrize("per_token, state, kernel_block", [(4096, 327680, 16), (768, 10000, 16), (100, 99, 1),
                                                             (64, 64 * 33, 32)])
def test_aligned_block_size_is_the_smallest_page_that_holds_a_state(per_token, state, kernel_block):
    got = aligned_block_size(per_token, state, kernel_block)
    assert got["block_size"] % kernel_block == 0 and got["page_bytes"] == got["block_size"] * per_token
    assert got["page_bytes"] >= state > (got["block_size"] - kernel_block) * per_token  # smallest such block
    assert got["state_padding"] == got["page_bytes"] - state


def test_aligned_block_size_for_jamba():
    c = JAMBA_V01
    per_token = 2 * c["n_kv_heads"] * c["head_dim"] * 2  # one attention layer, fp16
    state = state_hybrid_bytes(1)["state"] // 28  # one of the 28 Mamba layers
    assert aligned_block_size(per_token, state) == {"block_size": 80, "page_bytes": state, "state_padding": 0}


def test_prefix_hit_full_hits_window_misses():
    plan, W, bs = ["window", "full"], 8, 4
    old = {kind: blocks_held(kind, 32, W, bs) for kind in ("window", "full")}  # an earlier 32-token request
    shared = {kind: [b for b in held if b < 5] for kind, held in old.items()}  # the new one shares 20 tokens
    assert prefix_hit(plan, 30, W, bs, shared) == {"window": 0, "full": 20, "request": 0}
    assert prefix_hit(["full"], 30, None, bs, shared) == {"full": 20, "request": 20}  # a plain model hits
    kept = {kind: blocks_held(kind, 32, W, bs, free_window=False) for kind in ("window", "full")}
    assert prefix_hit(plan, 30, W, bs, {k: [b for b in h if b < 5] for k, h in kept.items()})["request"] == 20
    assert prefix_hit(plan, 40, W, bs, old)["request"] == 32  # the whole old prompt: its window is cached


def test_prefix_hit_is_the_largest_common_point_not_the_minimum():
    # full layers can resume at 0..16; window layers (W = 8, bs = 4, blocks 3-4 cached) only at 0 or 20
    got = prefix_hit(["window", "full"], 30, 8, 4, {"full": range(4), "window": [3, 4]})
    assert got == {"window": 20, "full": 16, "request": 0}
    assert prefix_hit(["window", "full"], 30, 8, 4, {"full": range(5), "window": [3, 4]})["request"] == 20


def test_prefix_hit_state_layers_need_a_saved_state():
    plan = ["state", "state", "full"]
    cached = {"full": range(8)}
    assert prefix_hit(plan, 40, None, 4, cached) == {"state": 0, "full": 32, "request": 0}  # cf. vLLM #51250
    assert prefix_hit(plan, 40, None, 4, {**cached, "state": [32]})["request"] == 32
    assert prefix_hit(plan, 40, None, 4, {**cached, "state": [16, 36]})["request"] == 16  # 36 > full's 32
    with pytest.raises(ValueError, match="cached"):
        prefix_hit(plan, 40, None, 4, {"mamba": [4]})


def test_state_hybrid_bytes_jamba():
    lengths = (1, 1024, 65536, 262144)
    got = [state_hybrid_bytes(n) for n in lengths]
    assert got[-1]["kv"] == 4 * 2**30  # Jamba's paper, Table 1: 4GB of KV cache at 256K tokens, 16 bit
    assert len({b["state"] for b in got}) == 1  # per sequence, not per token
    assert got[0]["state"] == 28 * 8192 * (4 + 16) * 2  # 28 Mamba layers, d_inner 8192, conv 4 + state 16
    per_token = [b["per_token"] for b in got]
    assert per_token == sorted(per_token, reverse=True) and per_token[-1] - 4 * 2 * 8 * 128 * 2 < 40
    assert got[-1]["all_attention"] == 8 * got[-1]["kv"]  # 32 attention layers instead of 4
    assert state_hybrid_bytes(1024, bytes_per_element=4)["state"] == 2 * got[0]["state"]
    with pytest.raises(ValueError, match="lacks"):
        state_hybrid_bytes(8, {"n_layers": 4})


# ---- rewinding (speculative decoding) ---------------------------------------------------------------


def test_truncate_property_random_accept_reject():
    """Feed k + 1 tokens, keep a random number of them (the rest were rejected drafts, here random tokens),
    repeat: with spare = k - 1 ring rows every kept position's logits equal the band reference over the
    accepted text, and the cache then continues exactly."""
    model, W, k, plan = band_model(seed=2), 4, 3, ["window", "full", "window"]
    g = torch.Generator().manual_seed(7)
    text = torch.randint(0, 64, (1, 40), generator=g)
    with torch.no_grad():
        want = model(text, cache=BandSeam(plan, W))[0]  # (40, V)
        cache = HybridCache.for_model(model, 1, 48, plan=plan, window=W, spare=k - 1)
        t = 6
        assert torch.allclose(model(text[:, :t], cache=cache)[0], want[:t], atol=1e-4)
        cuts = 0
        while t + k + 1 <= 40:
            keep = int(torch.randint(1, k + 2, (1,), generator=g))  # 1 .. k + 1 of the k + 1 fed
            fed = text[:, t:t + k + 1].clone()
            fed[:, keep:] = torch.randint(0, 64, (1, k + 1 - keep), generator=g)  # rejected drafts
            out = model(fed, positions=torch.arange(t, t + k + 1)[None], cache=cache)[0]
            assert torch.allclose(out[:keep], want[t:t + keep], atol=1e-4)
            assert cache.truncate(0, t + keep) is True
            cuts += keep < k + 1
            t += keep
        assert cuts >= 3  # the loop did rewind
        rest = model(text[:, t:], positions=torch.arange(t, 40)[None], cache=cache)[0]
        assert torch.allclose(rest, want[t:], atol=1e-4)


def test_truncate_refuses_what_the_ring_lost_and_changes_nothing():
    cache = HybridCache(["window", "full"], 1, 1, 16, 4, window=3)  # no spare rows
    x = torch.randn(1, 1, 9, 4)
    for layer in (0, 1):
        cache.attend(layer, x, x, x)
    before = ([p.clone() for p in cache.pos], cache.seq_lens.clone())
    with pytest.raises(ValueError, match=r"no longer holds positions \[5\]"):
        cache.truncate(0, 7)  # the ring holds 6, 7, 8: position 8's row replaced 5's, which position 7 reads
    assert all(torch.equal(a, b) for a, b in zip(before[0], cache.pos)) and torch.equal(before[1], cache.seq_lens)
    assert cache.truncate(0, 8) and cache.held_positions(0, 0).tolist() == [6, 7]  # one token: exact
    assert cache.truncate(0, 0) is True  # back to empty is always exact: nothing is attended any more
    assert cache.held(0, 0) == 0 and cache.held(0, 1) == 0


def test_reset_forgets_the_ring():
    model, plan = band_model(seed=3), ["window", "full", "window"]
    cache = HybridCache.for_model(model, 1, 24, plan=plan, window=3)
    a = generate(model, [[1, 2, 3, 4, 5, 6]], 8, cache=cache)
    assert torch.equal(generate(model, [[1, 2, 3, 4, 5, 6]], 8, cache=cache), a)
    assert cache.held_positions(0, 0).tolist() == [12, 10, 11]  # 13 positions stored: 10, 11, 12
    generate(model, [[1, 2]], 1, cache=cache)  # a shorter one: 2 positions stored, nothing left of the last
    assert cache.held_positions(0, 0).tolist() == [0, 1] and cache.held(0, 0) == 2
