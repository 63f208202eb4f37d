"""Budgeted caches that store keys before RoPE (``rope="before"``, StreamingLLM's way of renumbering)."""

import pytest
import torch

from kvlib.evict import SinkCache, SlidingWindowCache
from kvlib.generate import generate

PROMPTS = [[5, 9, 2, 33, 17, 8, 41, 3, 12], [7, 1, 60, 22]]


def feed(model, cache, ids, steps):
    """Logits of ``ids`` (1, S) run through the model in calls of the given sizes, positions from 0."""
    outs, t = [], 0
    with torch.no_grad():
        for T in steps:
            outs.append(model(ids[:, t: t + T], positions=torch.arange(t, t + T)[None], cache=cache))
            t += T
    return torch.cat(outs, dim=1)


def test_kept_positions_before_rope_give_the_same_tokens(model):
    full = generate(model, PROMPTS, 16)  # the plain contiguous KVCache
    toks = {}
    for budget in (64, 8):  # 64: nothing is evicted; 8: the window slides
        for rope in ("after", "before"):
            cache = SinkCache.for_model(model, batch=2, budget=budget, n_sink=2, chunk=4, kernels="torch",
                                        positions="kept", rope=rope)
            assert cache.keys_before_rope == (rope == "before")
            toks[budget, rope] = generate(model, PROMPTS, 16, cache=cache)
            seen = [len(p) + 15 for p in PROMPTS]  # the last new token is never fed back
            assert cache.evicted.tolist() == [max(0, n - budget) for n in seen]
    assert torch.equal(toks[64, "before"], full) and torch.equal(toks[64, "after"], full)
    assert torch.equal(toks[8, "before"], toks[8, "after"])


@pytest.mark.parametrize("cls, kw", [(SinkCache, {"n_sink": 2}), (SlidingWindowCache, {})], ids=["sinks", "window"])
def test_reassigned_positions_before_rope_match_after_rope_in_fp32(model, cls, kw):
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    steps = [11] + [1] * 20 + [5, 4]  # a prefill in chunks of 4, single tokens, then short calls
    out, caches = {}, {}
    for rope in ("after", "before"):
        caches[rope] = cls.for_model(model, 1, budget=8, chunk=4, kernels="torch", positions="reassign",
                                     rope=rope, **kw)
        out[rope] = feed(model, caches[rope], ids, steps)
    assert int(caches["before"].evicted[0]) == 32
    before, after = caches["before"], caches["after"]
    for layer in range(2):
        assert torch.equal(before.held_positions(0, layer), after.held_positions(0, layer))
        ranks = before.rot[layer][0].gather(1, before.index[layer][0, :, :8])
        assert ranks.tolist() == [list(range(8))] * 2  # renumbered 0..7; the stored keys stay unrotated
        assert torch.allclose(before.rotated_keys(layer), after.rotated_keys(layer), atol=1e-4)
    assert torch.allclose(out["before"], out["after"], atol=1e-4)
    # the two caches hold different things: unrotated keys in one, keys rotated to their ranks in the other
    assert (before.k[0] - after.k[0]).abs().max() > 1e-2


def _rel_error(cache, originals, inv_freq):
    """Largest relative error over the held keys between what attention reads and a fresh fp64 rotation of
    the original keys (fp64, per position) to their ranks."""
    used = cache.rotated_keys(0).double()[0]  # (H_KV, N, D)
    held = cache.held_positions(0)  # (H_KV, N)
    H_KV, N, D = used.shape
    orig = torch.stack([originals[held[g]][:, g] for g in range(H_KV)])  # (H_KV, N, D)
    angles = torch.arange(N, dtype=torch.float64)[:, None] * inv_freq.double()  # ranks 0..N-1
    angles = torch.cat((angles, angles), dim=-1)
    x1, x2 = orig.chunk(2, dim=-1)
    ref = orig * angles.cos() + torch.cat((-x2, x1), dim=-1) * angles.sin()
    return float(((used - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def _stream(dtype, rope, steps=2000):
    D, H_KV, H = 16, 2, 4
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    cache = SinkCache(n_layers=1, batch=1, n_kv_heads=H_KV, budget=32, head_dim=D, dtype=dtype, kernels="torch",
                      positions="reassign", rope=rope, inv_freq=inv)
    g = torch.Generator().manual_seed(0)
    q_all = torch.randn(steps, 1, H, 1, D, generator=g).to(dtype)
    k_all = torch.randn(steps, 1, H_KV, 1, D, generator=g).to(dtype)  # the keys before RoPE
    v_all = torch.randn(steps, 1, H_KV, 1, D, generator=g).to(dtype)
    if rope == "after":  # what the model hands such a cache: keys rotated at their true position, in dtype
        cos, sin = (c.to(dtype) for c in _cos_sin(torch.arange(steps), inv))
        x1, x2 = k_all.chunk(2, dim=-1)
        k_in = k_all * cos[:, None, None, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None, None, None]
    else:
        k_in = k_all
    for t in range(steps):
        # q arrives rotated at its true position (the cache re-rotates it to its rank); here q is random anyway
        cache.attend(0, q_all[t], k_in[t], v_all[t])
    assert cache.held(0) == 32 and int(cache.evicted[0]) == steps - 32
    return _rel_error(cache, k_all.double()[:, 0, :, 0], inv)  # originals (steps, H_KV, D)


def _cos_sin(pos, inv):
    angles = pos.float()[:, None] * inv
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype, bound", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)], ids=["fp16", "bf16"])
def test_keys_before_rope_do_not_drift_when_renumbered(dtype, bound):
    before, after = _stream(dtype, "before"), _stream(dtype, "after")
    assert before < bound  # rounded once (the fp32 rotation of the stored half-precision key)
    assert after > 5 * before  # re-rotated in place at every eviction: rounded again each time
    assert after > bound / 2  # and not merely a little worse: the drift is of the order of the bound


def test_bad_rope_arguments():
    inv = torch.ones(4)
    with pytest.raises(ValueError, match="rope.*'sideways'"):
        SinkCache(1, 1, 1, 8, 8, rope="sideways", inv_freq=inv)
    with pytest.raises(ValueError, match="rope='before'.*inv_freq"):
        SinkCache(1, 1, 1, 8, 8, rope="before")
    with pytest.raises(ValueError, match="rope='before'.*inv_freq"):
        SlidingWindowCache(1, 1, 1, 8, 8, positions="kept", rope="before")


def test_triton_kernels_option_decodes_unrotated_keys_through_pytorch(model_for):
    """The index kernel does not rotate: with rope='before' a kernels='triton' cache must not hand it raw keys."""
    toks = []
    for kernels in ("torch", "triton"):
        model = model_for(kernels)
        cache = SinkCache.for_model(model, batch=2, budget=6, n_sink=1, chunk=4, kernels=kernels,
                                    positions="reassign", rope="before")
        toks.append(generate(model, PROMPTS, 12, cache=cache).cpu())
    ref = SinkCache.for_model(model_for("torch"), batch=2, budget=6, n_sink=1, chunk=4, kernels="torch",
                              positions="reassign", rope="after")
    assert torch.equal(toks[0], toks[1])
    assert torch.equal(toks[0], generate(model_for("torch"), PROMPTS, 12, cache=ref))


@pytest.mark.parametrize("positions", ["kept", "reassign"])
def test_snapkvs_compressed_prefill_stores_keys_before_rope_as_after(model, positions):
    """SnapKV's prefill (compressed once, only the kept rows stored) with unrotated keys: the same choice, the
    same keys as attention reads them and the same logits as with rotated ones, then every decoded token kept."""
    from kvlib.evict import SnapKVCache

    ids = torch.randint(0, 64, (1, 31), generator=torch.Generator().manual_seed(2))
    out, caches = {}, {}
    for rope in ("after", "before"):
        caches[rope] = SnapKVCache.for_model(model, 1, budget=9, window=3, chunk=2, kernels="torch",
                                             positions=positions, rope=rope)
        out[rope] = feed(model, caches[rope], ids, [23] + [1] * 8)
    before, after = caches["before"], caches["after"]
    assert before.held(0) == 9 + 8 and int(before.evicted[0]) == 23 - 9
    for layer in range(2):
        assert torch.equal(before.held_positions(0, layer), after.held_positions(0, layer))
        assert torch.allclose(before.rotated_keys(layer), after.rotated_keys(layer), atol=1e-4)
        if positions == "reassign":
            assert before.rot[layer][0].gather(1, before.index[layer][0, :, :17]).tolist() == [list(range(17))] * 2
    assert torch.allclose(out["before"], out["after"], atol=1e-4)
