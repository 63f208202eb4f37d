"""Chapter 11's speculative decoding: truncate on every cache kind (property tests against a cache that only
saw the accepted tokens), the drafters, greedy identity with plain decoding, the rejection rule's
distribution, and the cache invariant (prompt + emitted - 1 after every step)."""

import random

import pytest
import torch

import kvlib.speculate as spec
from kvlib.cache import KVCache
from kvlib.evict import H2OCache, SlidingWindowCache
from kvlib.generate import generate
from kvlib.kivi import KiviCache
from kvlib.lowbit import LayerQuantCache
from kvlib.model import ModelConfig, Transformer, load_tiny
from kvlib.paged import PagedKVCache
from kvlib.quant import Int8KVCache
from kvlib.speculate import (LayerSkipDrafter, PromptLookupDrafter, greedy_accept, prompt_lookup,
                             speculative_accept, speculative_generate)

H_KV, H, D = 2, 4, 16


def rows(g, T, n_layers=2):
    """Random q, k, v for T new tokens, per layer: [(q (1, H, T, D), k, v (1, H_KV, T, D))]."""
    return [(torch.randn(1, H, T, D, generator=g), torch.randn(1, H_KV, T, D, generator=g),
             torch.randn(1, H_KV, T, D, generator=g)) for _ in range(n_layers)]


def feed(cache, layers, upto=None):
    """One call of every layer with the first ``upto`` tokens of ``layers`` (all of them by default)."""
    for i, (q, k, v) in enumerate(layers):
        cache.attend(i, q[:, :, :upto], k[:, :, :upto], v[:, :, :upto])


def accept_reject_run(make, seed, steps=12, prompt=5, max_k=6, check=None):
    """Random speculation steps on two caches from ``make()``: ``spec_cache`` gets k + 1 tokens per call and
    is truncated to a random kept prefix; ``ref`` only ever sees the kept tokens (one call per step). After
    every step ``check(spec_cache, ref)``. Returns the truncates' results."""
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    spec_cache, ref = make(), make()
    first = rows(g, prompt)
    feed(spec_cache, first)
    feed(ref, first)
    results = []
    for _ in range(steps):
        k = rng.randint(0, max_k)
        step = rows(g, k + 1)
        keep = rng.randint(1, k + 1)  # the last accepted token + a accepted drafts
        n0 = int(spec_cache.seq_lens[0])
        feed(spec_cache, step)
        results.append(spec_cache.truncate(0, n0 + keep))
        feed(ref, step, keep)
        check(spec_cache, ref)
    return results


def check_contiguous(a, b):
    n = int(b.seq_lens[0])
    assert a.seq_lens.tolist() == b.seq_lens.tolist()
    for name in ("k", "v", "k_scale", "v_scale"):
        for x, y in zip(getattr(a, name, []), getattr(b, name, [])):
            assert torch.equal(x[:, :, :n], y[:, :, :n]), name


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cls", [KVCache, Int8KVCache])
def test_truncate_contiguous_and_int8_equal_a_cache_that_never_saw_the_rejected(cls, seed):
    make = (lambda: KVCache(2, 1, H_KV, 128, D, kernels="torch")) if cls is KVCache else \
        (lambda: Int8KVCache(2, 1, H_KV, 128, D, kernels="torch"))
    assert all(accept_reject_run(make, seed, check=check_contiguous))


def check_kivi(a, b):
    n = int(b.seq_lens[0])
    assert a.seq_lens.tolist() == b.seq_lens.tolist()
    nk, nv = a.n_quantized(0)
    G = a.group
    for i in range(len(a.k)):
        for name, upto in (("k_packed", nk), ("k_scale", nk // G), ("k_zero", nk // G), ("v_packed", nv),
                           ("v_scale", nv), ("v_zero", nv)):
            assert torch.equal(getattr(a, name)[i][:, :, :upto], getattr(b, name)[i][:, :, :upto]), name
        assert torch.equal(a.k[i][:, :, :n - nk], b.k[i][:, :, :n - nk])  # the exact windows
        assert torch.equal(a.v[i][:, :, :n - nv], b.v[i][:, :, :n - nv])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("flush,bits", [("group", 2), ("residual", 4)])
def test_truncate_kivi_equals_a_cache_that_never_saw_the_rejected(flush, bits, seed):
    def make():
        cache = KiviCache(2, 1, H_KV, 160, D, bits=bits, group=4, residual=8, kernels="torch", flush=flush)
        cache.enable_rollback()
        return cache

    assert all(accept_reject_run(make, seed, steps=16, check=check_kivi))


def test_truncate_kivi_restores_a_group_the_call_quantized():
    g = torch.Generator().manual_seed(1)
    a, b = (KiviCache(2, 1, H_KV, 64, D, bits=2, group=4, residual=8, kernels="torch") for _ in range(2))
    a.enable_rollback()
    prompt, step = rows(g, 10), rows(g, 7)
    feed(a, prompt), feed(b, prompt)
    assert a.n_quantized(0) == (4, 2)
    feed(a, step)  # 17 positions: keys 4..11 quantized by this call (two groups), values 2..8
    assert a.n_quantized(0) == (12, 9)
    assert a.truncate(0, 13)  # keep 3 of the 7: cuts into the group 8..11 the call quantized
    feed(b, step, 3)
    assert a.n_quantized(0) == b.n_quantized(0) == (8, 5)
    check_kivi(a, b)
    with pytest.raises(ValueError, match="cannot be exact"):  # back into positions an earlier call quantized
        a.truncate(0, 3)
    plain = KiviCache(1, 1, H_KV, 64, D, group=4, residual=8, kernels="torch")  # no rollback rows kept
    feed(plain, rows(g, 14, 1))
    with pytest.raises(ValueError, match="enable_rollback"):
        plain.truncate(0, 12)
    assert plain.held(0) == 14  # refused: nothing changed


def paged_state(c, seq_id, other):
    """Everything attention reads for seq_id, independent of physical block ids: lengths, tokens, the K/V of
    every position, which table entries it shares with ``other``, reference counts, registered hashes."""
    L, bs, table = c.lens[seq_id], c.block_size, c.tables[seq_id]
    pos = torch.arange(L)
    blocks = torch.tensor(table, dtype=torch.long)[pos // bs] if table else pos
    kv = [(k[blocks, pos % bs], v[blocks, pos % bs]) for k, v in zip(c.k, c.v)]
    return dict(L=L, tokens=list(c.tokens[seq_id]), n_blocks=len(table), kv=kv,
                shared=[b in c.tables[other] for b in table], refs=[c.allocator.refcount[b] for b in table],
                hashes=[c.block_hash.get(b) for b in table], registered=sorted(c.hash_to_block),
                free=c.allocator.num_free)


@pytest.mark.parametrize("seed", range(3))
def test_truncate_paged_with_a_shared_prefix(seed):
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    prompt = [rng.randrange(50) for _ in range(11)]

    def make():
        c = PagedKVCache(2, 40, 4, H_KV, D, kernels="torch", prefix_caching=True)
        return c

    spec_cache, ref = make(), make()
    first, second = rows(g, 11), rows(g, 3)
    for c in (spec_cache, ref):
        view, cached = c.prefill_view(0, prompt)
        feed(view, first)
        view, cached = c.prefill_view(1, prompt)  # sequence 1 shares the two full prompt blocks
        assert cached == 8
        feed(view, second)
    assert spec_cache.tables[0][:2] == spec_cache.tables[1][:2]
    for _ in range(14):
        k = rng.randint(0, 6)
        toks = [rng.randrange(50) for _ in range(k + 1)]
        keep = rng.randint(1, k + 1)
        step = rows(g, k + 1)
        n0 = spec_cache.lens[0]
        feed(spec_cache.batch([0], [toks]), step)
        spec_cache.truncate(0, n0 + keep)
        feed(ref.batch([0], [toks[:keep]]), step, keep)
        for s, other in ((0, 1), (1, 0)):
            got, want = paged_state(spec_cache, s, other), paged_state(ref, s, other)
            kv_got, kv_want = got.pop("kv"), want.pop("kv")
            assert got == want
            assert all(torch.equal(x, y) for xs, ys in zip(kv_got, kv_want) for x, y in zip(xs, ys))


def budget_state(c):
    out = [c.seq_lens.tolist(), [n.tolist() for n in c.n_held]]
    for i in range(len(c.k)):
        n = int(c.n_held[i][0])
        idx = c.index[i][0, :, :n]
        out += [c.pos[i][0].gather(1, idx).tolist(), c.k[i][0].gather(1, idx[..., None].expand(-1, -1, D)),
                c.v[i][0].gather(1, idx[..., None].expand(-1, -1, D))]
    return out


def same_budget(a, b):
    for x, y in zip(budget_state(a), budget_state(b)):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_truncate_budget_exact_until_an_eviction_then_says_so():
    make = lambda: SlidingWindowCache(2, 1, H_KV, 200, D, kernels="torch", chunk=8)  # never full here
    assert all(accept_reject_run(make, 0, check=same_budget))
    # budget 8: the run fills it; once the drafted tokens make it evict, truncate returns False
    g = torch.Generator().manual_seed(0)
    a, b = (SlidingWindowCache(2, 1, H_KV, 8, D, kernels="torch", chunk=8) for _ in range(2))
    prompt, step = rows(g, 5), rows(g, 5)
    feed(a, prompt), feed(b, prompt)
    feed(a, step)  # 10 positions seen: the 2 oldest evicted, with 4 drafted tokens present
    assert a.truncate(0, 6) is False  # keep 1 of the 5
    feed(b, step, 1)
    assert b.held_positions(0)[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert a.held_positions(0)[0].tolist() == [2, 3, 4, 5]  # positions 0, 1 cannot come back
    h2o = H2OCache(1, 1, H_KV, 50, D, kernels="torch", chunk=8)
    feed(h2o, rows(g, 6, 1))
    assert h2o.truncate(0, 4) is False  # its scores summed the cut tokens' attention: not exact
    assert h2o.held(0) == 4 and h2o.truncate(0, 4) is True  # cutting nothing is exact


def test_truncate_refuses_bad_arguments():
    c = KVCache(1, 2, H_KV, 8, D)
    feed(c.sequence(0), rows(torch.Generator().manual_seed(0), 3, 1))
    with pytest.raises(ValueError, match="length must lie in 0..3"):
        c.truncate(0, 4)
    with pytest.raises(ValueError, match="b must be a sequence index in 0..1"):
        c.truncate(2, 0)
    with pytest.raises(ValueError, match="length"):
        SlidingWindowCache(1, 1, H_KV, 8, D).truncate(0, 1)
    with pytest.raises(ValueError, match="length 5 is past"):
        p = PagedKVCache(1, 4, 4, H_KV, D)
        p.add_sequence(0)
        p.truncate(0, 5)
    with pytest.raises(NotImplementedError, match="LayerQuantCache"):  # it rewrites rows: lengths are not enough
        LayerQuantCache(1, 1, H_KV, 8, D, bits=[2]).truncate(0, 0)
    assert c.held(0) == 3


# --------------------------------------------------------------------------------------------
# drafters and acceptance
# --------------------------------------------------------------------------------------------


def test_prompt_lookup_longest_and_most_recent_match():
    text = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert prompt_lookup(text, 2) == [4, 9]  # "1 2 3" (n = 3) beats the more recent "2 3" (n = 2)
    assert prompt_lookup(text, 2, max_ngram=2) == [5, 6]  # n = 2: the most recent "2 3"
    assert prompt_lookup(text, 10) == [4, 9, 2, 3, 5, 6, 1, 2, 3]  # up to k, as far as the text goes
    assert prompt_lookup([7, 8, 9], 3) == [] and prompt_lookup(text, 0) == []
    with pytest.raises(ValueError, match="min_ngram"):
        prompt_lookup(text, 2, max_ngram=1, min_ngram=2)


def test_greedy_accept_counts():
    logits = torch.eye(4)[[2, 3, 0, 1]] * 5  # the target wants 2, 3, 0, 1
    assert greedy_accept(logits, [2, 3, 0]) == (3, 1)
    assert greedy_accept(logits, [2, 1, 0]) == (1, 3)
    assert greedy_accept(logits, [0, 3, 0]) == (0, 2)


P_TARGET = torch.tensor([[0.40, 0.25, 0.15, 0.15, 0.05], [0.10, 0.10, 0.20, 0.30, 0.30]])
Q_DRAFT = torch.tensor([[0.05, 0.15, 0.50, 0.10, 0.20], [0.40, 0.30, 0.10, 0.10, 0.10]])


def wrong_no_max(p, q, draft, generator=None):
    """Rejection resampled from |p - q| (p - q without the max at 0 taken as a magnitude)."""
    for i, x in enumerate(draft):
        if float(torch.rand((), generator=generator)) * float(q[i, x]) < float(p[i, x]):
            continue
        return i, int(torch.multinomial((p[i] - q[i]).abs(), 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def wrong_resample_p(p, q, draft, generator=None):
    """Rejection resampled from p itself (a common bug: counts the accepted mass twice)."""
    for i, x in enumerate(draft):
        if float(torch.rand((), generator=generator)) * float(q[i, x]) < float(p[i, x]):
            continue
        return i, int(torch.multinomial(p[i], 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def always_accept(p, q, draft, generator=None):
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def two_tokens(rule, trials, seed=0):
    """Empirical joint distribution (5 x 5) of the first two emitted tokens when a 'model' samples position t
    from P_TARGET[t] and the drafter proposes 2 tokens from Q_DRAFT (the rows of the steps' positions)."""
    g = torch.Generator().manual_seed(seed)
    p_all = torch.cat([P_TARGET, P_TARGET.mean(0, keepdim=True).expand(2, 5)])  # positions 2, 3: never counted
    counts = torch.zeros(5, 5)
    for _ in range(trials):
        out = []
        while len(out) < 2:
            t = len(out)
            q = torch.cat([Q_DRAFT, Q_DRAFT])[t: t + 2]
            draft = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
            a, nxt = rule(p_all[t: t + 3], q, draft, g)
            out += draft[:a] + [nxt]
        counts[out[0], out[1]] += 1
    return counts / trials


def test_rejection_rule_preserves_the_target_distribution():
    """20k seeded trials: the joint of two emitted tokens is P_TARGET[0] x P_TARGET[1] within total variation
    0.03 (the sampling noise is about 0.013 here); the three wrong rules are all further than 0.06."""
    want = P_TARGET[0][:, None] * P_TARGET[1][None, :]
    tv = lambda got: 0.5 * float((got - want).abs().sum())
    assert tv(two_tokens(speculative_accept, 20000)) < 0.03
    for wrong in (wrong_no_max, wrong_resample_p, always_accept):
        assert tv(two_tokens(wrong, 4000, seed=1)) > 0.06, wrong.__name__


def test_deterministic_draft_is_one_hot_q():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.2, 0.5, 0.3], [1 / 3, 1 / 3, 1 / 3]])
    first = torch.zeros(3)
    for _ in range(6000):
        a, nxt = speculative_accept(p, None, [1], g)
        first[1 if a else nxt] += 1
    assert 0.5 * float((first / 6000 - p[0]).abs().sum()) < 0.03


# --------------------------------------------------------------------------------------------
# the loop: greedy identity, the invariant, the drafter's rollback
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return load_tiny(device="cpu")


def random_model(seed, V=24):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Transformer(ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                       hidden_dim=64)).eval()


def make(kind, model, n=160):
    return dict(paged=lambda: PagedKVCache.for_model(model, n // 4, 4, kernels="torch"),
                contiguous=lambda: KVCache.for_model(model, 1, n, kernels="torch"),
                int8=lambda: Int8KVCache.for_model(model, 1, n, kernels="torch"),
                kivi=lambda: KiviCache.for_model(model, 1, n, bits=2, group=4, residual=8, kernels="torch"))[kind]()


@pytest.mark.parametrize("kind", ["contiguous", "int8", "paged", "kivi"])
def test_greedy_speculation_is_token_identical(kind, tiny):
    model, tok = tiny
    code = tok.encode("def area(w, h):\n    return w * h\n\ndef area(w, h):\n")
    chat = tok.encode("User: hello, how are you?\nAssistant:")
    for prompt in (code, chat):
        want = generate(model, [prompt], 40, cache=make(kind, model))[0].tolist()
        for k in (1, 3, 6):
            res = speculative_generate(model, prompt, 40, k=k, cache=make(kind, model))
            assert res.tokens == want, (k, prompt[:5])
    assert sum(res.accepted) > 0  # the code prompt repeats itself: some drafts were taken
    for seed in range(4):  # random models, prompts with and without repeated n-grams
        model = random_model(seed)
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(0, 24, (6,), generator=g).tolist()
        for prompt in (base * 3 + base[:2], torch.randint(0, 24, (15,), generator=g).tolist()):
            want = generate(model, [prompt], 30, cache=make(kind, model))[0].tolist()
            for k in (2, 5):
                assert speculative_generate(model, prompt, 30, k=k, cache=make(kind, model)).tokens == want


def test_kivi_verification_reads_the_layout_plain_decoding_reads(monkeypatch):
    """KiviCache's own multi-token call attends its tokens exact; plain decoding reads some of them through
    their codes. On this model and prompt that flips a token unless verification uses KiviVerifySeam."""
    with torch.random.fork_rng():
        torch.manual_seed(10)
        model = Transformer(ModelConfig(vocab_size=12, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                        hidden_dim=64)).eval()
    base = torch.randint(0, 12, (6,), generator=torch.Generator().manual_seed(10)).tolist()
    prompt = base * 3 + base[:2]
    kivi = lambda flush="group": KiviCache.for_model(model, 1, 100, bits=2, group=4, residual=4, kernels="torch",
                                                     flush=flush)
    want = generate(model, [prompt], 40, cache=kivi())[0].tolist()
    assert speculative_generate(model, prompt, 40, k=5, cache=kivi()).tokens == want
    for flush in ("group", "residual"):
        for k in (2, 4):
            want_f = generate(model, [prompt], 40, cache=kivi(flush))[0].tolist()
            assert speculative_generate(model, prompt, 40, k=k, cache=kivi(flush)).tokens == want_f
    monkeypatch.setattr(spec, "_is_kivi", lambda cache: False)  # verify through KiviCache.attend instead
    assert speculative_generate(model, prompt, 40, k=5, cache=kivi()).tokens != want


def test_cache_after_each_step_holds_prompt_plus_emitted_minus_one(tiny, monkeypatch):
    model, tok = tiny
    prompt = tok.encode("abc abc abc abc ab")
    cache = KVCache.for_model(model, 1, 64, kernels="torch")
    res = speculative_generate(model, prompt, 24, k=4, cache=cache)
    emitted = [a + 1 for a in res.accepted]
    assert res.held == [len(prompt) + 1 + sum(emitted[: i + 1]) - 1 for i in range(len(emitted))]
    assert res.target_forwards == 1 + len(res.drafted) and len(res.tokens) == 24
    assert res.held[-1] == len(prompt) + 24 - 1
    ref = KVCache.for_model(model, 1, 64, kernels="torch")
    generate(model, [prompt], 24, cache=ref)
    assert ref.held(0) == cache.held(0)
    for a, b in zip(cache.k + cache.v, ref.k + ref.v):  # the same K/V (one forward over T vs T forwards)
        torch.testing.assert_close(a[:, :, :cache.held(0)], b[:, :, :ref.held(0)], atol=1e-4, rtol=1e-4)
    # a rewind one token too far (the bug) breaks the invariant, and the loop says so
    real = spec.truncate_cache
    monkeypatch.setattr(spec, "truncate_cache", lambda c, n: real(c, n - 1))
    with pytest.raises(AssertionError, match="prompt \\+ emitted - 1"):
        speculative_generate(model, prompt, 24, k=4, cache=cache)


def test_layer_skip_drafter_is_rolled_back_and_changes_no_token():
    model = random_model(3)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    want = generate(model, [prompt], 20)[0].tolist()
    drafter = LayerSkipDrafter(model, layers=[0])
    res = speculative_generate(model, prompt, 20, k=3, drafter=drafter)
    assert res.tokens == want and res.draft_forwards > 0
    text = prompt + res.tokens
    n = drafter.cache.held(0)
    assert drafter.tokens == text[:n]  # what the drafter's cache holds is real text, never a rejected draft
    fresh = LayerSkipDrafter(model, layers=[0])
    fresh.reset(64)
    fresh.propose(text[:n + 1], 1)  # caches text[:n] in one call
    torch.testing.assert_close(fresh.cache.k[0][:, :, :n], drafter.cache.k[0][:, :, :n], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="layers must be"):
        LayerSkipDrafter(model, layers=[1, 0])


def test_speculation_over_an_evicting_cache_says_it_is_not_exact():
    model = random_model(2)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    roomy = speculative_generate(model, prompt, 12, k=3, cache=SlidingWindowCache.for_model(model, 1, 64, chunk=8))
    assert roomy.exact and roomy.tokens == generate(model, [prompt], 12)[0].tolist()  # never full: exact
    tight = speculative_generate(model, prompt, 12, k=3, cache=SlidingWindowCache.for_model(model, 1, 8, chunk=8))
    assert not tight.exact  # the drafted tokens took part in evictions
    from kvlib.evict import PagedWindowCache
    with pytest.raises(TypeError, match="PagedWindowCache"):
        speculative_generate(model, prompt, 4, cache=PagedWindowCache.for_model(model, 1, 8, block_size=4))


def test_sampled_speculation_runs_and_validates():
    model = random_model(1)
    res = speculative_generate(model, [1, 2, 3, 1, 2], 16, k=3, temperature=1.0, seed=0,
                               drafter=LayerSkipDrafter(model, layers=[1]))
    assert len(res.tokens) == 16 and 0 <= res.acceptance_rate <= 1
    again = speculative_generate(model, [1, 2, 3, 1, 2], 16, k=3, temperature=1.0, seed=0,
                                 drafter=LayerSkipDrafter(model, layers=[1]))
    assert again.tokens == res.tokens  # seeded
    greedy = generate(model, [[1, 2, 3, 1, 2]], 16)[0].tolist()
    eos = greedy[4]  # stops at its first eos_id, as generate does (which then pads with it)
    with_eos = speculative_generate(model, [1, 2, 3, 1, 2], 16, k=3, eos_id=eos).tokens
    assert with_eos == greedy[: greedy.index(eos) + 1]
    with pytest.raises(ValueError, match="one prompt"):
        speculative_generate(model, [[1, 2], [3, 4]], 4)
    with pytest.raises(TypeError, match="no truncate"):
        speculative_generate(model, [1, 2], 4, cache=type("NoTruncate", (), dict(
            reset=lambda *a: None, prefill_view=None, decode_view=None, next_positions=None))())
    assert PromptLookupDrafter().propose([1, 2, 1], 2) == ([2, 1], None)


def test_alpha_counts_only_the_drafts_that_were_checked():
    res = spec.SpeculativeResult(drafted=[8, 8, 3, 0], accepted=[8, 2, 0, 0])
    assert res.acceptance_rate == 10 / 19  # drafts after a rejection count as not accepted
    assert res.alpha == 10 / 12  # 10 accepted, 2 rejections (steps 2 and 3); the empty step checks nothing
    assert spec.SpeculativeResult().alpha != spec.SpeculativeResult().alpha  # nan: nothing drafted


# ---- bad inputs: a clear error naming the argument (issue: 6 of 121 bad calls were not) --------------------


@pytest.mark.parametrize("p, draft, words", [
    (torch.tensor([[0.5, 0.7], [1.0, 0.0]]), [1], "p must hold probabilities"),     # rows do not sum to 1
    (torch.tensor([[2.0, -1.0], [1.0, 0.0]]), [1], "p must hold probabilities"),    # negative entry
    (torch.tensor([[3.0, 1.0], [0.0, 9.0]]), [1], "p must hold probabilities"),     # logits, not probabilities
    (torch.tensor([[0.5, 0.5], [1.0, 0.0]]), [2], r"draft\[0\] must be a token id in \[0, 2\)"),
    (torch.tensor([[0.5, 0.5], [1.0, 0.0]]), [-1], r"draft\[0\]"),
    (torch.tensor([[0.5, 0.5], [1.0, 0.0]]), [0.5], r"draft\[0\]"),
])
def test_speculative_accept_refuses_what_is_not_a_distribution_or_a_token(p, draft, words):
    with pytest.raises(ValueError, match=words):
        speculative_accept(p, None, draft)


def test_speculative_accept_checks_q_too():
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    with pytest.raises(ValueError, match="q must hold probabilities"):
        speculative_accept(p, torch.tensor([[0.9, 0.9]]), [0])
    assert speculative_accept(p, torch.tensor([[0.5, 0.5]]), [0], torch.Generator().manual_seed(0))[0] in (0, 1)


@pytest.mark.parametrize("logits, draft, words", [
    (torch.zeros(2, 4), [1, 2, 3], r"2 row\(s\) for 3 draft token\(s\)"),
    (torch.zeros(4), [1], r"logits must be a \(d \+ 1, V\) tensor"),
    (torch.zeros(3, 4), [1, 9], r"draft\[1\] must be a token id in \[0, 4\)"),
])
def test_greedy_accept_refuses_too_few_rows_1d_logits_and_foreign_ids(logits, draft, words):
    with pytest.raises(ValueError, match=words):
        greedy_accept(logits, draft)


@pytest.mark.parametrize("window", [0, -3, 1.5, True])
def test_band_mask_refuses_a_window_that_sees_nothing(window):
    from kvlib.hybrid import band_mask

    with pytest.raises(ValueError, match="window must be a positive int"):
        band_mask(torch.arange(4)[None], torch.arange(4)[None], window)
