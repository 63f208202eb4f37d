"""Chapter 09's compressed caches: low rank, MLA, cross-layer sharing."""

import copy
import math

import pytest
import torch

from kvlib.attention import attention_ref
from kvlib.cache import CacheFullError, KVCache
from kvlib.compress import (MLA_CONFIGS, CrossLayerKVCache, LatentAttention, LatentKVCache, LowRankKVCache, MLAConfig,
                            SharedKVSeam, evaluate_shared, finetune_shared, fit_low_rank, low_rank_error,
                            mha_bytes_per_token, mla_bytes_per_token, mla_gqa_groups, record_kv)
from kvlib.generate import generate
from kvlib.gqa import finetune
from kvlib.model import ModelConfig, Transformer, load_tiny, rope_cos_sin, rope_frequencies, rotate
from kvlib.train import evaluate

TEXT = ("Return the number of items in a container. If the optional argument is given, it is used as the "
        "default value. This module provides access to the socket interface; the socket is closed when "
        "the object is garbage collected. class Foo: a class whose instances hold a name and a value. ") * 3


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_tiny(device="cpu")
    return model, tok, torch.tensor(tok.encode(TEXT))


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tok, _ = tiny
    return [tok.encode("Return the "), tok.encode("This module provides ")]  # two lengths: ragged decode


@pytest.fixture(scope="module")
def gqa_model():
    """A random model with 4 query heads on 2 K/V heads (D = 16)."""
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=32, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96)).eval()


def naive_shared(model, prompt, n, share):
    """The plain greedy loop, re-running the whole prefix through SharedKVSeam every step."""
    seq, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq, cache=SharedKVSeam(share))[:, -1].argmax(-1)
            out.append(nxt.item())
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    return out


# ---------------------------------------------------------------------------------------------
# low rank
# ---------------------------------------------------------------------------------------------


def test_record_kv_matches_the_models_own_keys(gqa_model):
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    ks, vs = record_kv(gqa_model, ids)
    assert len(ks) == 3 and ks[0].shape == vs[2].shape == (2, 2, 9, 16)
    cache = KVCache.for_model(gqa_model, batch=2, max_len=9)
    with torch.no_grad():
        gqa_model(ids, cache=cache)
    torch.testing.assert_close(ks[1], cache.k[1])  # the same K after RoPE as a real cache stores
    torch.testing.assert_close(vs[2], cache.v[2])


def test_fit_low_rank_gives_orthonormal_bases(tiny):
    model, _, ids = tiny
    bases = fit_low_rank(model, ids, 8)
    c = model.config
    assert len(bases) == c.n_layers
    for U_k, U_v in bases:
        assert U_k.shape == U_v.shape == (c.n_kv_heads, c.head_dim, 8)
        eye = torch.eye(8).expand(c.n_kv_heads, 8, 8)
        torch.testing.assert_close(U_k.transpose(1, 2) @ U_k, eye, atol=1e-5, rtol=0)
        torch.testing.assert_close(U_v.transpose(1, 2) @ U_v, eye, atol=1e-5, rtol=0)


def test_rank_d_is_token_identical_to_the_full_cache(tiny, prompts):
    model, _, ids = tiny
    D = model.config.head_dim
    cache = LowRankKVCache.for_model(model, batch=2, max_len=64, bases=fit_low_rank(model, ids, D))
    full = generate(model, prompts, 24)
    assert torch.equal(generate(model, prompts, 24, cache=cache), full)
    assert [cache.held(0), cache.held(1)] == [len(prompts[0]) + 23, len(prompts[1]) + 23]


def test_error_decreases_with_rank(tiny):
    model, _, ids = tiny
    err = low_rank_error(model, ids, [2, 8, 16, model.config.head_dim])
    for kind in ("k", "v"):
        assert err[2][kind] > err[8][kind] > err[16][kind] > 0
        assert err[model.config.head_dim][kind] < 1e-6
    held_out = low_rank_error(model, ids[:200], [8], fit_ids=ids[200:])  # bases fitted on other text: worse
    assert held_out[8]["k"] >= low_rank_error(model, ids[:200], [8])[8]["k"]


@pytest.mark.parametrize("rank", [4, 16])
def test_bytes_are_rank_over_d_of_a_full_cache(tiny, rank):
    model, _, ids = tiny
    D = model.config.head_dim
    low = LowRankKVCache.for_model(model, batch=2, max_len=32, bases=fit_low_rank(model, ids, rank))
    full = KVCache.for_model(model, batch=2, max_len=32)
    assert low.nbytes() * D == full.nbytes() * rank
    assert low.bytes_per_token() == 2 * model.config.n_layers * model.config.n_kv_heads * rank * 4


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_low_rank_attention_equals_attention_over_reconstructed_keys(gqa_model, kernels):
    """Attending in the rank-r space (no key rebuilt) == attending over k U U^T, v U U^T; prefill and decode."""
    model, r = gqa_model, 5
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(2))
    bases = fit_low_rank(model, torch.randint(0, 32, (1, 40), generator=torch.Generator().manual_seed(3)), r)

    class Reconstructed:  # a seam object that keeps the projected K/V rows and attends over all of them
        def __init__(self):
            self.k, self.v = {}, {}

        def attend(self, i, q, k, v):
            U_k, U_v = bases[i]
            k, v = k @ U_k @ U_k.transpose(1, 2), v @ U_v @ U_v.transpose(1, 2)
            self.k[i] = torch.cat([self.k[i], k], 2) if i in self.k else k
            self.v[i] = torch.cat([self.v[i], v], 2) if i in self.v else v
            return attention_ref(q, self.k[i], self.v[i], causal=True)

    ref, cache = Reconstructed(), LowRankKVCache.for_model(model, 2, 10, bases, kernels=kernels)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, cache=cache), model(ids, cache=ref), atol=1e-4, rtol=1e-4)
        for step in range(2):
            nxt = torch.tensor([[3 + step], [9]])
            pos = cache.next_positions()
            torch.testing.assert_close(model(nxt, positions=pos, cache=cache), model(nxt, positions=pos, cache=ref),
                                       atol=1e-4, rtol=1e-4)


def test_low_rank_rejects_bad_rank_and_bases(tiny):
    model, _, ids = tiny
    D = model.config.head_dim
    for rank in (0, -1):
        with pytest.raises(ValueError, match="rank must be >= 1"):
            fit_low_rank(model, ids, rank)
    with pytest.raises(ValueError, match=f"rank must lie in 1..D={D}"):
        fit_low_rank(model, ids, D + 1)
    with pytest.raises(TypeError, match="rank must be an int"):
        low_rank_error(model, ids, [2.5])
    bases = fit_low_rank(model, ids, 4)
    with pytest.raises(ValueError, match="one \\(U_k, U_v\\) pair per layer"):
        LowRankKVCache.for_model(model, 1, 8, bases[:-1])
    wrong_d = [(u[:, :-1], w[:, :-1]) for u, w in bases]  # (H_KV, D - 1, r)
    with pytest.raises(ValueError, match=r"U_k must be a floating \(H_KV, D, r\) = \(8, 32, 4\)"):
        LowRankKVCache.for_model(model, 1, 8, wrong_d)
    mixed = [(u, w[..., :2]) for u, w in bases]  # U_v of another rank
    with pytest.raises(ValueError, match="U_v must be"):
        LowRankKVCache.for_model(model, 1, 8, mixed)
    with pytest.raises(ValueError, match="must be an \\(H_KV, D, r\\) tensor"):
        LowRankKVCache.for_model(model, 1, 8, [(u[0], w[0]) for u, w in bases])
    with pytest.raises(TypeError, match="list of \\(U_k, U_v\\) tensor pairs"):
        LowRankKVCache.for_model(model, 1, 8, bases[0][0])
    cache = LowRankKVCache.for_model(model, 1, 4, bases)
    with pytest.raises(CacheFullError):
        cache.reset(1, 5)
    with pytest.raises(ValueError, match="k and v must be"):  # coefficients are not what the seam hands over
        cache.attend(0, torch.zeros(1, 8, 1, D), torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, 4))


# ---------------------------------------------------------------------------------------------
# low rank before RoPE (Palu) and the K-only cache
# ---------------------------------------------------------------------------------------------


def test_pre_rope_keys_rotated_are_the_post_rope_keys(gqa_model):
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(4))
    post, v_post = record_kv(gqa_model, ids)
    pre, v_pre = record_kv(gqa_model, ids, keys="pre_rope")
    cos, sin = rope_cos_sin(torch.arange(9), rope_frequencies(gqa_model.config), torch.float32)
    for layer in range(3):
        torch.testing.assert_close(rotate(pre[layer], cos, sin), post[layer])  # the same forward, keys before RoPE
        torch.testing.assert_close(v_pre[layer], v_post[layer])
    assert not torch.allclose(pre[1][:, :, 1:], post[1][:, :, 1:])  # positions > 0 are rotated


def test_pre_rope_bases_are_orthonormal_tagged_and_fit_keys_better(tiny):
    model, _, ids = tiny
    c = model.config
    bases = fit_low_rank(model, ids, 8, keys="pre_rope")
    assert bases.fitted_keys == "pre_rope" and fit_low_rank(model, ids, 8).fitted_keys == "post_rope"
    eye = torch.eye(8).expand(c.n_kv_heads, 8, 8)
    for U_k, U_v in bases:
        assert U_k.shape == U_v.shape == (c.n_kv_heads, c.head_dim, 8)
        torch.testing.assert_close(U_k.transpose(1, 2) @ U_k, eye, atol=1e-5, rtol=0)
        torch.testing.assert_close(U_v.transpose(1, 2) @ U_v, eye, atol=1e-5, rtol=0)
    pre = low_rank_error(model, ids[:200], [8], fit_ids=ids[200:], keys="pre_rope")[8]
    post = low_rank_error(model, ids[:200], [8], fit_ids=ids[200:])[8]
    assert pre["k"] < 0.7 * post["k"]  # one basis per head instead of one for every rotated copy (0.22 vs 0.55)
    assert pre["v"] == pytest.approx(post["v"])  # values are not rotated: the same fit


@pytest.mark.parametrize("keys, values", [("pre_rope", "low_rank"), ("pre_rope", "exact"), ("post_rope", "exact")])
def test_rank_d_variants_are_token_identical_to_the_full_cache(tiny, prompts, keys, values):
    model, _, ids = tiny
    bases = fit_low_rank(model, ids, model.config.head_dim, keys=keys)
    cache = LowRankKVCache.for_model(model, batch=2, max_len=64, bases=bases, values=values)
    assert cache.keys_before_rope == (keys == "pre_rope")
    assert torch.equal(generate(model, prompts, 24, cache=cache), generate(model, prompts, 24))  # ragged prompts


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("values", ["low_rank", "exact"])
def test_pre_rope_attention_equals_attention_over_rebuilt_rotated_keys(gqa_model, kernels, values):
    """r < D: the cache == a seam that keeps k U U^T before RoPE, rotates every key at its position and
    attends (values v U_v U_v^T, or v itself for the K-only cache); prefill and decode."""
    model, r = gqa_model, 5
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(2))
    bases = fit_low_rank(model, torch.randint(0, 32, (1, 40), generator=torch.Generator().manual_seed(3)), r,
                         keys="pre_rope")
    inv_freq = rope_frequencies(model.config)

    class Rebuilt:  # keys arrive before RoPE; rotate the kept rows at positions 0 .. S-1 on every call
        keys_before_rope = True

        def __init__(self):
            self.k, self.v = {}, {}

        def attend(self, i, q, k, v):
            U_k, U_v = bases[i]
            k = k @ U_k @ U_k.transpose(1, 2)
            v = v if values == "exact" else v @ U_v @ U_v.transpose(1, 2)
            self.k[i] = torch.cat([self.k[i], k], 2) if i in self.k else k
            self.v[i] = torch.cat([self.v[i], v], 2) if i in self.v else v
            cos, sin = rope_cos_sin(torch.arange(self.k[i].shape[2]), inv_freq, torch.float32)
            return attention_ref(q, rotate(self.k[i], cos, sin), self.v[i], causal=True)

    ref = Rebuilt()
    cache = LowRankKVCache.for_model(model, 2, 10, bases, kernels=kernels, values=values)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, cache=cache), model(ids, cache=ref), atol=1e-4, rtol=1e-4)
        for step in range(2):
            nxt = torch.tensor([[3 + step], [9]])
            pos = cache.next_positions()
            torch.testing.assert_close(model(nxt, positions=pos, cache=cache), model(nxt, positions=pos, cache=ref),
                                       atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rank", [4, 16])
def test_bytes_of_the_pre_rope_and_k_only_caches(tiny, rank):
    model, _, ids = tiny
    c, B, S = model.config, 2, 32
    bases = fit_low_rank(model, ids, rank, keys="pre_rope")
    palu = LowRankKVCache.for_model(model, batch=B, max_len=S, bases=bases)
    k_only = LowRankKVCache.for_model(model, batch=B, max_len=S, bases=bases, values="exact")
    assert palu.bytes_per_token() == c.n_layers * c.n_kv_heads * (rank + rank) * 4  # fp32 coefficients
    assert k_only.bytes_per_token() == c.n_layers * c.n_kv_heads * (rank + c.head_dim) * 4  # V whole
    assert k_only.nbytes() == k_only.bytes_per_token() * B * S and palu.nbytes() == palu.bytes_per_token() * B * S
    assert tuple(k_only.k[0].shape) == (B, c.n_kv_heads, S, rank) and tuple(k_only.v[0].shape)[-1] == c.head_dim
    assert k_only.U_v is None  # no value basis kept


def test_pre_rope_and_k_only_reject_bad_arguments(tiny):
    model, _, ids = tiny
    D = model.config.head_dim
    with pytest.raises(ValueError, match=r"keys must be one of \('post_rope', 'pre_rope'\)"):
        fit_low_rank(model, ids, 4, keys="before")
    with pytest.raises(ValueError, match="keys must be one of"):
        record_kv(model, ids, keys=None)
    pre, post = fit_low_rank(model, ids, 4, keys="pre_rope"), fit_low_rank(model, ids, 4)
    with pytest.raises(ValueError, match="fitted on keys pre rope"):
        LowRankKVCache.for_model(model, 1, 8, pre, keys="post_rope")
    with pytest.raises(ValueError, match="fitted on keys post rope"):
        LowRankKVCache.for_model(model, 1, 8, post, keys="pre_rope")
    with pytest.raises(ValueError, match=r"values must be one of \('low_rank', 'exact'\)"):
        LowRankKVCache.for_model(model, 1, 8, pre, values="full")
    with pytest.raises(ValueError, match=r"keys='pre_rope' needs inv_freq.*\(16,\)"):
        LowRankKVCache(list(pre), batch=1, max_len=8, keys="pre_rope")  # a plain list: no tag, no frequencies
    with pytest.raises(ValueError, match="needs inv_freq"):
        LowRankKVCache(list(pre), 1, 8, keys="pre_rope", inv_freq=torch.ones(D))
    assert LowRankKVCache(list(pre), 1, 8, keys="pre_rope", inv_freq=rope_frequencies(model.config)).keys_before_rope
    k_only = LowRankKVCache.for_model(model, 1, 4, pre, values="exact")
    with pytest.raises(CacheFullError):
        with torch.no_grad():
            model(torch.zeros(1, 5, dtype=torch.long), cache=k_only)
    assert k_only.held(0) == 0
    with pytest.raises(ValueError, match="k and v must be"):
        k_only.attend(0, torch.zeros(1, 8, 1, D), torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, D))


# ---------------------------------------------------------------------------------------------
# MLA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_absorbed_decode_equals_the_plain_forward(q_lora_rank):
    cfg = MLAConfig(dim=48, n_heads=6, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
                    q_lora_rank=q_lora_rank)
    torch.manual_seed(0)
    attn = LatentAttention(cfg).eval()
    x = torch.randn(3, 11, 48)
    cache = LatentKVCache.for_layer(attn, batch=3, max_len=11)
    steps = torch.cat([attn.decode_absorbed(x[:, t: t + 1], cache) for t in range(11)], dim=1)
    with torch.no_grad():
        plain = attn(x)
    torch.testing.assert_close(steps, plain, atol=1e-5, rtol=1e-5)
    assert cache.held(2) == 11 and cache.nbytes() == 3 * 11 * (16 + 6) * 4  # nothing per head is cached
    with pytest.raises(CacheFullError):
        attn.decode_absorbed(x[:, :1], cache)


def test_absorbed_decode_with_ragged_lengths():
    """Sequence 1 starts two steps later (its own positions): each attends over its own length only."""
    cfg = MLAConfig(dim=32, n_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    torch.manual_seed(1)
    attn = LatentAttention(cfg).eval()
    x = torch.randn(2, 6, 32)
    cache = LatentKVCache.for_layer(attn, batch=2, max_len=8)
    solo = LatentKVCache.for_layer(attn, batch=1, max_len=8)
    for t in range(2):  # sequence 0 alone first, through a second cache, then copied over
        attn.decode_absorbed(x[:1, t: t + 1], solo)
    cache.c_kv[0], cache.k_rope[0], cache.seq_lens[0] = solo.c_kv[0], solo.k_rope[0], 2
    outs = [attn.decode_absorbed(torch.stack([x[0, t + 2], x[1, t]])[:, None], cache) for t in range(4)]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat([o[0] for o in outs]), attn(x[:1])[0, 2:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat([o[1] for o in outs]), attn(x[1:, :4])[0], atol=1e-5, rtol=1e-5)


def test_mla_bytes_and_the_papers_groups():
    v2, lite, v3 = (MLA_CONFIGS[n] for n in ("DeepSeek-V2", "DeepSeek-V2-Lite", "DeepSeek-V3"))
    assert mla_bytes_per_token(v2["config"], v2["n_layers"]) == 60 * 576 * 2
    assert mla_bytes_per_token(v3["config"], v3["n_layers"], dtype="fp32") == 61 * 576 * 4
    assert mla_bytes_per_token(lite["config"], lite["n_layers"]) == 27 * 576 * 2
    assert mha_bytes_per_token(v2["config"], 60) == 60 * 128 * (192 + 128) * 2
    assert mha_bytes_per_token(v2["config"], 60, n_kv_heads=8) == 60 * 8 * 320 * 2
    assert mla_gqa_groups(v2["config"]) == 2.25  # DeepSeek-V2 section 2.1.4: 4.5 d_h = GQA with 2.25 groups
    assert all(m["source"].endswith("/config.json") for m in MLA_CONFIGS.values())


def test_mla_rejects_bad_config_and_input():
    good = dict(dim=32, n_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match="MLAConfig.n_heads must be >= 1"):
        MLAConfig(**{**good, "n_heads": 0})
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLAConfig(**{**good, "qk_rope_head_dim": 3})
    with pytest.raises(ValueError, match="q_lora_rank must be >= 1"):
        MLAConfig(**good, q_lora_rank=0)
    with pytest.raises(TypeError, match="kv_lora_rank must be an int"):
        MLAConfig(**{**good, "kv_lora_rank": 8.0})
    with pytest.raises(TypeError, match="config must be an MLAConfig"):
        LatentAttention(dict(good))
    with pytest.raises(TypeError, match="config must be an MLAConfig"):
        mla_bytes_per_token(ModelConfig(), 4)
    attn = LatentAttention(MLAConfig(**good))
    with pytest.raises(ValueError, match=r"x must be \(B, T, C=32\)"):
        attn(torch.zeros(1, 3, 16))
    cache = LatentKVCache.for_layer(attn, batch=2, max_len=4)
    with pytest.raises(ValueError, match=r"x_t must be \(B=2, 1, C=32\)"):
        attn.decode_absorbed(torch.zeros(2, 3, 32), cache)
    other = LatentKVCache(MLAConfig(**{**good, "kv_lora_rank": 6}), batch=2, max_len=4)
    with pytest.raises(ValueError, match="cache holds \\(d_c, d_rope\\)"):
        attn.decode_absorbed(torch.zeros(2, 1, 32), other)
    with pytest.raises(TypeError, match="cache must be a LatentKVCache"):
        attn.decode_absorbed(torch.zeros(2, 1, 32), KVCache(1, 2, 1, 4, 8))


# ---------------------------------------------------------------------------------------------
# cross-layer sharing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("share", [2, 3])
def test_cla_cache_matches_the_naive_loop_through_the_seam(tiny, prompts, share):
    model, _, _ = tiny
    cache = CrossLayerKVCache.for_model(model, batch=2, max_len=64, share=share)
    out = generate(model, prompts, 16, cache=cache)
    for b, p in enumerate(prompts):
        assert out[b].tolist() == naive_shared(model, p, 16, share)
    assert len(cache.k) == math.ceil(model.config.n_layers / share)  # 4 layers, share 3: groups (0, 1, 2), (3)


def test_cla_cache_on_gqa_with_an_odd_layer_count(gqa_model):
    ids = [[1, 2, 3, 4, 5], [7, 8]]
    cache = CrossLayerKVCache.for_model(gqa_model, batch=2, max_len=16, share=2)
    out = generate(gqa_model, ids, 6, cache=cache)
    assert all(out[b].tolist() == naive_shared(gqa_model, p, 6, 2) for b, p in enumerate(ids))
    assert len(cache.k) == 2  # layers (0, 1) and (2)


@pytest.mark.parametrize("share", [1, 2, 4])
def test_cla_bytes_are_one_over_share(tiny, share):
    model, _, _ = tiny
    cla = CrossLayerKVCache.for_model(model, batch=2, max_len=32, share=share)
    full = KVCache.for_model(model, batch=2, max_len=32)
    assert cla.nbytes() * share == full.nbytes()
    assert cla.bytes_per_token() * share == full.nbytes() // (2 * 32)


def test_share_one_is_the_plain_model(tiny, prompts):
    model, _, ids = tiny
    x = ids[None, :64]
    with torch.no_grad():
        torch.testing.assert_close(model(x, cache=SharedKVSeam(1)), model(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(generate(model, prompts, 8, cache=CrossLayerKVCache.for_model(model, 2, 32, share=1)),
                       generate(model, prompts, 8))


def test_cla_rejects_bad_share(tiny):
    model, _, ids = tiny
    for share in (0, -2):
        with pytest.raises(ValueError, match="share must be >= 1"):
            SharedKVSeam(share)
        with pytest.raises(ValueError, match="share must be >= 1"):
            CrossLayerKVCache.for_model(model, 1, 8, share=share)
    with pytest.raises(ValueError, match="share must lie in 1..n_layers=4"):
        CrossLayerKVCache.for_model(model, 1, 8, share=5)
    with pytest.raises(ValueError, match="share must lie in 1..n_layers=4"):
        evaluate_shared(model, ids, 32, share=5)
    with pytest.raises(TypeError, match="share must be an int"):
        SharedKVSeam(1.5)
    seam, q = SharedKVSeam(2), torch.zeros(1, 8, 3, 32)
    with pytest.raises(ValueError, match="layer 1 reuses layer 0's K/V"):
        seam.attend(1, q, q, q)
    cache = CrossLayerKVCache.for_model(model, 1, 8, share=2)
    with pytest.raises(ValueError, match="layer_idx must be an int in 0..3"):
        cache.attend(4, q, q, q)


def test_seam_gradients_flow_to_the_groups_first_layer(tiny):
    model, _, ids = tiny
    m = copy.deepcopy(model).train()
    m(ids[None, :32], cache=SharedKVSeam(2)).sum().backward()
    assert m.layers[0].attn.wk.weight.grad.abs().sum() > 0  # layer 0's K serves layers 0 and 1
    assert m.layers[1].attn.wk.weight.grad is None or m.layers[1].attn.wk.weight.grad.abs().sum() == 0  # unused
    assert m.layers[1].attn.wq.weight.grad.abs().sum() > 0  # layer 1 still has its own queries


def test_finetune_shared_uses_finetunes_windows(tiny):
    """share=1: the same model and windows as kvlib.gqa.finetune, so the same losses."""
    model, _, ids = tiny
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    la = finetune_shared(a, ids, steps=2, share=1, batch=2, seq_len=32, seed=3)
    lb = finetune(b, ids, steps=2, batch=2, seq_len=32, seed=3)
    assert la == pytest.approx(lb, abs=1e-4)


def test_a_few_finetune_steps_help_the_shared_model(tiny):
    model, _, ids = tiny
    shared = copy.deepcopy(model)
    before = evaluate_shared(shared, ids, 64, share=2, max_windows=8)
    assert before > evaluate(model, ids, 64, max_windows=8)  # sharing costs quality before any training
    finetune_shared(shared, ids, steps=5, share=2, batch=2, seq_len=64)
    assert evaluate_shared(shared, ids, 64, share=2, max_windows=8) < before
