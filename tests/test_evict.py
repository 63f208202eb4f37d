"""Budgeted caches (chapter 09): the index decode kernel, eviction rules, bounded memory, positions."""

import pytest
import torch

from kvlib import runtime
from kvlib.cache import KVCache
from kvlib.evict import (ExpectedAttentionCache, H2OCache, KnormCache, PagedWindowCache, PyramidKVCache, SinkCache,
                         SlidingWindowCache, SnapKVCache, TOVACache, _rotate, h2o_accumulate, index_decode_attention,
                         index_decode_attention_ref, keep_highest, sink_window_priority, snapkv_select)
from kvlib.footprint import held_bytes
from kvlib.generate import generate
from kvlib.model import ModelConfig, Transformer, apply_rope, load_tiny
from kvlib.paged import PagedKVCache

# the rules that hold their budget after every call (SnapKV's re-evicting variant, ours, among them)
METHODS = {
    "window": (SlidingWindowCache, {}),
    "sinks": (SinkCache, {"n_sink": 2}),
    "h2o": (H2OCache, {}),
    "h2o streamed (ours)": (H2OCache, {"prefill": "stream"}),
    "snapkv": (SnapKVCache, {"window": 4, "decode_evict": True}),
    "knorm": (KnormCache, {}),
    "tova": (TOVACache, {}),
    "expected attention": (ExpectedAttentionCache, {"n_sink": 2}),
}
# the rules as their papers define them: compress the prompt once, then keep every token
ONCE = {
    "snapkv paper": (SnapKVCache, {"window": 4}),
    "pyramidkv paper": (PyramidKVCache, {"window": 4}),
}


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_tiny()
    return model, tok


def gqa_model(seed=0, n_kv_heads=2):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                                       hidden_dim=128)).eval()


# ---- the kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize("H, H_KV", [(1, 1), (2, 2), (4, 2), (8, 8), (8, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_index_decode_matches_reference(H, H_KV, dtype):
    g = torch.Generator().manual_seed(H * 10 + H_KV)
    B, N_slots, D = 3, 77, 48  # slots and D not powers of two
    dev = runtime.DEVICE
    q = torch.randn(B, H, D, generator=g).to(dtype).to(dev)
    k = torch.randn(B, H_KV, N_slots, D, generator=g).to(dtype).to(dev)
    v = torch.randn(B, H_KV, N_slots, D, generator=g).to(dtype).to(dev)
    index = torch.stack([torch.stack([torch.randperm(N_slots, generator=g)[:70] for _ in range(H_KV)])
                         for _ in range(B)]).to(dev)  # (B, H_KV, 70): each head its own slots
    n = torch.tensor([70, 1, 33], device=dev)  # full, one entry, a partly filled last tile
    ref, p_ref = index_decode_attention_ref(q, k, v, index, n, return_probs=True)
    out, p = index_decode_attention(q, k, v, index, n, return_probs=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert out.dtype == dtype
    assert (out.float() - ref.float()).abs().max() <= tol
    assert (p - p_ref).abs().max() <= (1e-6 if dtype == torch.float32 else 1e-3)
    assert torch.allclose(p.sum(-1), torch.ones(B, H, device=dev), atol=1e-4)
    assert torch.equal(index_decode_attention(q, k, v, index, n), out)


def test_index_decode_equals_contiguous_decode_on_the_identity_index():
    from kvlib.cache import decode_attention_ref

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    n = torch.tensor([9, 4])
    index = torch.arange(9).expand(2, 2, 9)
    assert torch.allclose(index_decode_attention_ref(q, k, v, index, n), decode_attention_ref(q, k, v, n), atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(n=torch.tensor([0])), "n_held must lie in 1"),
    (dict(n=torch.tensor([5])), "n_held must lie in 1..4"),
    (dict(index=torch.tensor([[[0, 9, 1, 2]]])), "slot ids in 0..7"),
    (dict(index=torch.zeros(1, 2, 4, dtype=torch.int64)), "index must be a"),
    (dict(k=torch.zeros(1, 1, 8, 16, dtype=torch.float16)), "must be torch.float32 like q"),
    (dict(q=torch.zeros(1, 3, 16), k=torch.zeros(1, 2, 8, 16)), "must divide"),
])
def test_index_decode_refuses_bad_input(bad, match):
    args = dict(q=torch.zeros(1, 2, 16), k=torch.zeros(1, 1, 8, 16), v=torch.zeros(1, 1, 8, 16),
                index=torch.tensor([[[0, 3, 1, 2]]]), n=torch.tensor([2]))
    args.update(bad)
    v = args["v"] if "k" not in bad else args["k"]
    for fn in (index_decode_attention_ref, index_decode_attention):
        with pytest.raises((ValueError, TypeError), match=match):
            fn(args["q"], args["k"], v, args["index"], args["n"])


# ---- the rules -------------------------------------------------------------------------------


def test_keep_highest_returns_position_order_and_keeps_all_when_under_budget():
    pri = torch.tensor([[[3.0, 9.0, 1.0, 7.0, 5.0]], [[1.0, 2.0, 0.0, 0.0, 0.0]]])  # (B=2, H_KV=1, N=5)
    keep = keep_highest(pri, torch.tensor([5, 2]), budget=3)
    assert keep[0, 0].tolist() == [1, 3, 4]
    assert keep[1, 0, :2].tolist() == [0, 1]  # only 2 held: both kept, first


def test_sink_window_priority_and_h2o_update():
    assert keep_highest(sink_window_priority(10, 3)[None, None], torch.tensor([10]), 6)[0, 0].tolist() == [0, 1, 2, 7, 8, 9]
    assert keep_highest(sink_window_priority(10, 0)[None, None], torch.tensor([10]), 4)[0, 0].tolist() == [6, 7, 8, 9]
    probs = torch.rand(2, 6, 3, 5)  # (B, H, T, N)
    ours = h2o_accumulate(torch.ones(2, 3, 5), probs, n_rep=2)
    ref = torch.ones(2, 3, 5) + torch.stack([probs[:, 2 * g: 2 * g + 2].sum(dim=(1, 2)) for g in range(3)], 1)
    assert torch.allclose(ours, ref)


def test_rotation_composes_and_matches_the_models_rope(tiny):
    model, _ = tiny
    dev = model.device  # load_tiny puts the model (and its inv_freq) on runtime.DEVICE: the inputs go there too
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, model.config.head_dim, generator=g).to(dev)
    inv = model.inv_freq
    a, b = torch.tensor([3, 40, 7, 0, 11], device=dev), torch.tensor([-3, 2, 100, 5, -11], device=dev)
    assert torch.allclose(_rotate(_rotate(x, a, inv), b, inv), _rotate(x, a + b, inv), atol=1e-4)
    cos, sin = model.rope(a[None], x.dtype)
    assert torch.allclose(_rotate(x, a, inv), apply_rope(x, cos, sin), atol=1e-5)


# ---- the caches through the model --------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(METHODS) + sorted(ONCE))
@pytest.mark.parametrize("positions", ["kept", "reassign"])
def test_budget_covering_the_sequence_gives_the_full_caches_tokens(tiny, method, positions):
    model, tok = tiny
    prompts = [tok.encode("def add(a, b):\n    return"), tok.encode("The cache")]
    cls, opts = {**METHODS, **ONCE}[method]
    if cls is PyramidKVCache:
        opts = {**opts, "beta": 1}  # every layer the same budget: 64 covers the sequence in each
    full = generate(model, prompts, 12)
    cache = cls.for_model(model, batch=2, budget=64, chunk=8, positions=positions, **opts)
    assert torch.equal(generate(model, prompts, 12, cache=cache), full)
    assert cache.held(0) == len(prompts[0]) + 11 and int(cache.evicted.sum()) == 0


@pytest.mark.parametrize("method", ["window", "h2o", "h2o streamed (ours)", "tova", "expected attention", "snapkv paper"])
def test_triton_decode_path_matches_torch_path(method):
    # both paths on the device model: in GPU mode the Triton kernel needs CUDA tensors, and on one model the
    # two runs differ only in the decode kernel (on a CPU this is the CPU model, the kernel interpreted)
    model = gqa_model().to(runtime.DEVICE)
    cls, opts = {**METHODS, **ONCE}[method]
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8]]
    outs = []
    for kernels in ("torch", "triton"):
        cache = cls.for_model(model, batch=2, budget=6, chunk=4, kernels=kernels, **opts)
        outs.append((generate(model, prompts, 10, cache=cache), [cache.held_positions(b).tolist() for b in (0, 1)]))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_never_more_than_the_budget(method):
    model = gqa_model(n_kv_heads=2)
    cls, opts = METHODS[method]
    budget = 9
    cache = cls.for_model(model, batch=1, budget=budget, chunk=4, **opts)
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    seen = 0
    with torch.no_grad():
        for t0, t1 in [(0, 13), (13, 14), (14, 15), (15, 26), (26, 30)]:
            pos = torch.arange(t0, t1)[None]
            model(ids[:, t0:t1], positions=pos, cache=cache)
            seen = t1
            assert cache.held(0) == min(budget, seen)
            for layer in range(2):
                held = cache.held_positions(0, layer)  # (H_KV, held)
                assert held.shape == (2, min(budget, seen))
                assert bool((held.diff(dim=-1) > 0).all()) and int(held.max()) == seen - 1  # newest always held
                assert bool((held >= 0).all())
                assert int((cache.pos[layer][0] >= 0).sum()) == 2 * min(budget, seen)  # freed slots are free
    assert int(cache.evicted[0]) == seen - budget


def test_window_and_sinks_keep_exactly_their_positions():
    model = gqa_model()
    ids = torch.arange(1, 21)[None]
    w = SlidingWindowCache.for_model(model, 1, budget=8, chunk=1)
    s = SinkCache.for_model(model, 1, budget=8, n_sink=3, chunk=1)
    with torch.no_grad():
        model(ids, cache=w)
        model(ids, cache=s)
    assert w.held_positions(0)[0].tolist() == list(range(12, 20))
    assert s.held_positions(0)[1].tolist() == [0, 1, 2] + list(range(15, 20))


def test_streaming_inside_one_call_equals_separate_calls():
    """A long call runs chunk by chunk inside every layer: the same as feeding the chunks one call at a time."""
    model = gqa_model()
    ids = torch.randint(0, 64, (1, 23), generator=torch.Generator().manual_seed(3))
    for cls, opts in METHODS.values():
        one = cls.for_model(model, 1, budget=7, chunk=5, **opts)
        if one.prefill_whole:  # H2O, SnapKV: the first call (the prefill) attends fully however long, by definition
            continue
        many = cls.for_model(model, 1, budget=7, chunk=5, **opts)
        with torch.no_grad():
            a = model(ids, cache=one)
            b = torch.cat([model(ids[:, t: t + 5], positions=torch.arange(t, min(t + 5, 23))[None], cache=many)
                           for t in range(0, 23, 5)], dim=1)
        assert torch.allclose(a, b, atol=1e-5), cls.__name__
        assert one.held_positions(0).tolist() == many.held_positions(0).tolist()


def test_reassigned_positions_differ_from_kept_ones_only_after_an_eviction():
    model = gqa_model()
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(4))
    out = {}
    for mode in ("kept", "reassign"):
        for offset in (0, 500):
            cache = SinkCache.for_model(model, 1, budget=8, n_sink=2, chunk=1, positions=mode)
            with torch.no_grad():
                out[mode, offset] = model(ids, positions=torch.arange(20)[None] + offset, cache=cache)
            if mode == "reassign":
                rot = cache.rot[0][0].gather(1, cache.index[0][0, :, :8])
                assert rot.tolist() == [list(range(8))] * 2  # held keys sit at ranks 0..7
    assert torch.allclose(out["reassign", 0], out["reassign", 500], atol=2e-4)  # RoPE is relative: both
    assert torch.allclose(out["kept", 0], out["kept", 500], atol=2e-4)  # modes ignore a common offset
    # before the first eviction ranks are positions; after it, a sink's distance to the query differs
    assert torch.allclose(out["kept", 0][:, :9], out["reassign", 0][:, :9], atol=1e-5)
    assert (out["kept", 0][:, 10:] - out["reassign", 0][:, 10:]).abs().max() > 1e-3


@pytest.mark.parametrize("prefill", ["whole", "stream"])
def test_h2o_keeps_the_position_that_received_the_most_attention(prefill):
    model = gqa_model()
    cache = H2OCache.for_model(model, 1, budget=6, recent=2, chunk=1, prefill=prefill)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 15), generator=torch.Generator().manual_seed(5)), cache=cache)
    for layer in range(2):
        held = cache.held_positions(0, layer)
        score = cache.score[layer][0].gather(1, cache.index[layer][0, :, :6])  # (H_KV, 6)
        heavy = score[:, :4]  # the non-recent entries were chosen by score: every one beats any evicted slot
        assert held[:, -2:].tolist() == [[13, 14]] * 2
        assert bool((heavy > 0).all())


@pytest.mark.parametrize("decode_evict", [False, True])
def test_snapkv_compresses_once_after_a_full_prefill(decode_evict):
    model = gqa_model()
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(6))
    cache = SnapKVCache.for_model(model, 1, budget=10, window=4, chunk=3, decode_evict=decode_evict)
    with torch.no_grad():
        full = model(ids, cache=KVCache.for_model(model, 1, 40))
        out = model(ids, cache=cache)
    assert torch.allclose(out, full, atol=1e-5)  # the prompt attended fully (chunk plays no part); compression after
    assert cache.held(0) == 10 and cache.held_positions(0)[:, -4:].tolist() == [list(range(36, 40))] * 2
    assert cache.prefill_len.tolist() == [40] and int(cache.evicted[0]) == 30
    assert all(cache.index[layer].shape[2] == 10 + 3 for layer in range(2))  # never a row for the whole prompt


class _Recorder(KVCache):
    """A full cache that also keeps each layer's queries of the last call: the prompt's q and k as attended."""

    def attend(self, layer_idx, q, k, v):
        self.q = getattr(self, "q", {})
        self.q[layer_idx] = q
        return super().attend(layer_idx, q, k, v)


@pytest.mark.parametrize("cls", [SnapKVCache, PyramidKVCache])
@pytest.mark.parametrize("pooling, kernel", [("max", 7), ("avg", 5)])
def test_the_default_keeps_what_snapkv_select_chooses_on_the_prompt(tiny, cls, pooling, kernel):
    model, _ = tiny
    T, budget, window = 61, 20, 6  # an odd prompt length; Pyramid: every layer its own budget
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(11))
    ids = ids.to(model.device)
    rec = _Recorder.for_model(model, 2, T)
    cache = cls.for_model(model, 2, budget, window=window, kernel=kernel, pooling=pooling, kernels="torch")
    with torch.no_grad():
        model(ids, cache=rec)
        model(ids, cache=cache)
    for layer in range(model.config.n_layers):
        want = snapkv_select(rec.q[layer], rec.k[layer][:, :, :T], cache.budgets[layer], window, kernel, pooling)
        for b in range(2):
            assert torch.equal(cache.held_positions(b, layer), want[b]), (layer, b)


@pytest.mark.parametrize("method", sorted(ONCE))
def test_the_default_keeps_every_decoded_token_and_decode_evict_keeps_the_budget(method):
    model = gqa_model(n_kv_heads=2)
    cls, opts = ONCE[method]
    ids = torch.randint(0, 64, (1, 37), generator=torch.Generator().manual_seed(2))
    paper = cls.for_model(model, 1, budget=9, chunk=4, **opts)
    ours = cls.for_model(model, 1, budget=9, chunk=4, decode_evict=True, **opts)
    with torch.no_grad():
        for cache in (paper, ours):
            model(ids[:, :25], cache=cache)  # the prefill: 25 positions compressed to each layer's budget
            for t in range(25, 37):  # 12 decoded tokens (more than the 4 spare rows: the paper's buffers grow)
                model(ids[:, t:t + 1], positions=torch.tensor([[t]]), cache=cache)
    for layer, budget in enumerate(paper.budgets):
        kept = paper.held_positions(0, layer)
        assert kept.shape == (2, min(25, budget) + 12)
        assert kept[:, -12:].tolist() == [list(range(25, 37))] * 2  # every decoded token is held
        assert kept[:, :min(25, budget)].max() < 25
        assert ours.held(0, layer) == budget and int(ours.held_positions(0, layer).max()) == 36
    assert int(paper.evicted[0]) == 25 - paper.budgets[0] and int(ours.evicted[0]) == 37 - ours.budgets[0]
    grown = paper.index[0].shape[2]
    assert grown >= paper.budgets[0] + 12 and (grown - paper.budgets[0]) % 4 == 0  # grown by whole chunks
    paper.reset()
    assert [paper.index[layer].shape[2] for layer in range(2)] == [b + 4 for b in paper.budgets]


def test_the_defaults_growing_buffers_give_the_tokens_of_roomy_ones_also_through_views():
    """generate prefills ragged prompts through cache.sequence(b) views; decoding then grows the buffers."""
    model = gqa_model()
    prompts = [list(range(1, 30)), list(range(40, 51))]
    outs, caches = [], []
    for chunk in (2, 64):
        cache = SnapKVCache.for_model(model, 2, budget=8, window=3, chunk=chunk)
        outs.append(generate(model, prompts, 20, cache=cache))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    small, roomy = caches
    assert [small.held(b) for b in (0, 1)] == [8 + 19] * 2 and small.prefill_len.tolist() == [29, 11]
    for layer in range(2):
        assert torch.equal(small.held_positions(0, layer), roomy.held_positions(0, layer))
    assert small.index[0].shape[2] == 28 and small.k[0].shape[2] == 28  # 8 + 2, then nine growths of 2
    view = small.sequence(1)  # a view that must grow makes its cache grow: every sequence's rows
    with torch.no_grad():
        model(torch.arange(5)[None], positions=torch.arange(30, 35)[None], cache=view)
    assert small.held(1) == 27 + 5 and small.index[0].shape[2] == 32 and small.k[1].shape[2] == 32


def test_snapkv_and_pyramidkv_hold_what_their_kept_rows_need(tiny):
    """After a 256-token prompt at budget 32 on the tiny model: at most 1.5x the bytes H2O holds (issue 42; the old
    chunk=4096 buffer held 79x), every tensor counted, and nbytes() counts what held_bytes counts."""
    model, _ = tiny
    ids = torch.randint(0, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    budget = 32
    caches = {"h2o": H2OCache.for_model(model, 1, budget)}
    for name, cls in (("snapkv", SnapKVCache), ("pyramidkv", PyramidKVCache)):
        for ev in (False, True):
            caches[name, ev] = cls.for_model(model, 1, budget, window=16, decode_evict=ev)
    held = {}
    with torch.no_grad():
        for name, cache in caches.items():
            model(ids, cache=cache)
            held[name] = held_bytes(cache).total
            assert cache.nbytes() == held[name]
    for name in held:
        assert held[name] <= 1.5 * held["h2o"], (name, held[name] / held["h2o"])
    assert held["snapkv", False] < held["snapkv", True]  # the evicting variant keeps its voters (obs)
    assert {"obs[0]"} <= set(held_bytes(caches["snapkv", True]).tensors)


def test_truncating_tokens_after_the_compressed_prompt_is_exact_and_into_it_is_not():
    model = gqa_model()
    ids = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(8))
    caches = [SnapKVCache.for_model(model, 1, budget=8, window=3, chunk=4) for _ in range(2)]
    with torch.no_grad():
        for cache, end in zip(caches, (32, 26)):
            model(ids[:, :20], cache=cache)  # the prompt: 20 positions compressed to 8
            for t in range(20, end):
                model(ids[:, t:t + 1], positions=torch.tensor([[t]]), cache=cache)
    long, short = caches
    assert long.truncate(0, 26) is True  # the cut tokens were kept and never voted: exact
    for layer in range(2):
        assert torch.equal(long.held_positions(0, layer), short.held_positions(0, layer))
    with torch.no_grad():
        a = model(ids[:, 26:27], positions=torch.tensor([[26]]), cache=long)
        b = model(ids[:, 26:27], positions=torch.tensor([[26]]), cache=short)
    assert torch.allclose(a, b, atol=1e-6)
    assert long.truncate(0, 15) is False and long.prefill_len.tolist() == [15]  # the compression saw the cut tokens


BATCH = {**METHODS, **ONCE, "pyramidkv": (PyramidKVCache, {"window": 4, "decode_evict": True})}


@pytest.mark.parametrize("method", sorted(BATCH))
def test_a_batch_of_equal_lengths_equals_batch_one_runs(tiny, method):
    """Three different prompts of one length in one batch: each row keeps its own positions, and the logits and
    the held positions are those of three batch-1 runs (fp32). Tokens never repeat within a row: the key norm of
    a repeated token ties exactly in layer 0 (RoPE keeps norms), and a tie is decided by rounding."""
    model, _ = tiny
    cls, opts = BATCH[method]
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(model.config.vocab_size, generator=g)[:33] for _ in range(3)]).to(model.device)

    def run(rows):
        cache = cls.for_model(model, len(rows), 12, chunk=4, kernels="torch", **opts)
        with torch.no_grad():
            outs = [model(ids[rows, :27], cache=cache)]  # the prefill, then 6 single steps
            for t in range(27, 33):
                outs.append(model(ids[rows, t:t + 1], positions=cache.next_positions(), cache=cache))
        return torch.cat(outs, dim=1), cache

    logits, batch = run([0, 1, 2])
    for b in range(3):
        one, single = run([b])
        assert torch.allclose(logits[b], one[0], atol=1e-5)
        assert batch.held(b) == single.held(0)
        for layer in range(model.config.n_layers):
            assert torch.equal(batch.held_positions(b, layer), single.held_positions(0, layer)), (b, layer)
    assert not torch.equal(batch.held_positions(0, 0), batch.held_positions(1, 0)) or method in ("window", "sinks")


@pytest.mark.parametrize("make, match", [
    (lambda m: SnapKVCache.for_model(m, 1, budget=8, window=2, decode_evict="yes"), "decode_evict must be a bool"),
    (lambda m: PyramidKVCache.for_model(m, 1, budget=8, window=2, decode_evict=1), "decode_evict must be a bool"),
    (lambda m: SlidingWindowCache.for_model(m, 1, budget=0), "budget"),
    (lambda m: SlidingWindowCache.for_model(m, 1, budget=4, positions="absolute"), "positions must be"),
    (lambda m: SinkCache.for_model(m, 1, budget=4, n_sink=4), "n_sink must be below"),
    (lambda m: SnapKVCache.for_model(m, 1, budget=4, window=4), "window must be below"),
    (lambda m: SnapKVCache.for_model(m, 1, budget=8, window=2, kernel=4), "kernel must be odd"),
    (lambda m: H2OCache.for_model(m, 1, budget=4, recent=5), "recent must be at most"),
    (lambda m: H2OCache.for_model(m, 1, budget=4, prefill=True), "prefill must be 'whole'"),
    (lambda m: PagedWindowCache.for_model(m, 1, budget=4, block_size=4, sink_blocks=1), "sink blocks"),
])
def test_bad_options_are_refused(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make(gqa_model())


def test_wrong_batch_is_refused_and_changes_nothing():
    model = gqa_model()
    cache = SlidingWindowCache.for_model(model, batch=2, budget=4)
    with pytest.raises(ValueError, match="batch=2"):
        generate(model, [[1, 2, 3]], 3, cache=cache)


# ---- the paged window ----------------------------------------------------------------------------


def test_paged_window_frees_blocks_and_matches_the_full_cache_under_budget():
    model = gqa_model()
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    full = generate(model, prompts, 20, cache="paged")
    roomy = PagedWindowCache.for_model(model, batch=2, budget=64, block_size=4)
    assert torch.equal(generate(model, prompts, 20, cache=roomy), full)

    cache = PagedWindowCache.for_model(model, batch=2, budget=8, block_size=4)
    generate(model, prompts, 40, cache=cache)
    assert max(cache.pool_trace) <= cache.allocator.num_blocks and cache.allocator.num_blocks == 6
    assert all(4 < cache.held(b) <= 8 for b in (0, 1))
    assert cache.next_positions().tolist() == [[5 + 39], [2 + 39]]
    plain = PagedKVCache.for_model(model, num_blocks=64, block_size=4)
    generate(model, prompts, 40, cache=plain)
    assert plain.allocator.num_free < 64 - 20  # without the window the pool keeps growing


def test_paged_window_keeps_sink_blocks():
    model = gqa_model()
    cache = PagedWindowCache.for_model(model, batch=1, budget=12, block_size=4, sink_blocks=1)
    generate(model, [[1, 2, 3, 4, 5, 6]], 30, cache=cache)
    table = cache.tables[0]
    assert cache.dropped[0] > 0 and len(table) <= 3
    assert cache.held(0) <= 12


def test_paged_window_prompt_larger_than_the_pool_is_a_clear_error_and_leaves_the_pool_intact():
    from kvlib.paged import OutOfBlocksError

    model = gqa_model()
    cache = PagedWindowCache.for_model(model, batch=1, budget=8, block_size=4)  # 3 blocks
    with pytest.raises(OutOfBlocksError, match="needs 5 block"):
        generate(model, [list(range(1, 20))], 4, cache=cache)
    assert cache.allocator.num_free == cache.allocator.num_blocks and not cache.tables


def test_every_budgeted_cache_follows_the_contract():
    """for_model(model, batch, budget, **options), generate(..., cache=...), held(b) <= budget afterwards."""
    model = gqa_model()
    for cls, opts in list(METHODS.values()) + [(PagedWindowCache, {"block_size": 4})]:
        cache = cls.for_model(model, 2, 12, **opts)
        out = generate(model, [[1, 2, 3, 4, 5], [6, 7]], 30, cache=cache)
        assert out.shape == (2, 30)
        assert all(0 < cache.held(b) <= 12 for b in (0, 1)), cls.__name__
