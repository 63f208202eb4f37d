"""The serving engine (chapter 08): every request's tokens are the ones `generate` gives it alone,
whatever the mix; the block pool never leaks a block or hands one out twice."""

import copy
import doctest
import os

import pytest
import torch
from safetensors import safe_open

import kvlib.engine
from kvlib.engine import Engine
from kvlib.generate import generate

_REFERENCE = {}


def alone(model, prompt, n, temperature=0.0, seed=None, eos_id=None, top_k=None):
    """The request run by itself through `generate` (memoized: the property test repeats prompts)."""
    key = (id(model), tuple(prompt), n, temperature, seed, eos_id, top_k)
    if key not in _REFERENCE:
        out = generate(model, [prompt], n, temperature=temperature, seed=seed, eos_id=eos_id, top_k=top_k)
        _REFERENCE[key] = out[0].tolist()
    return _REFERENCE[key]


def check_pool(engine):
    """Every block is free xor referenced, with a reference count equal to its holders (the sequences, and
    the cache itself for each cached block); no block is in two places unless it is a full, hashed
    (prefix-shared) block; every hash names a block that holds its tokens; each live sequence matches its
    request."""
    c, a = engine.cache, engine.cache.allocator
    holders = [0] * a.num_blocks
    for table in c.tables.values():
        assert len(set(table)) == len(table)
        for b in table:
            holders[b] += 1
    for b in c.cached:
        holders[b] += 1
        assert b in c.block_hash and c.hash_to_block[c.block_hash[b]] == b, f"cached block {b} cannot be found"
        assert all(b not in t for t in c.tables.values()), f"cached block {b} is also in a table"
    assert holders == a.refcount
    free = a._free
    assert len(free) == len(set(free)) == a.num_free
    assert set(free) == {b for b in range(a.num_blocks) if holders[b] == 0}
    assert set(c.block_hash) == set(c.block_key) and not set(free) & set(c.block_hash)
    for h, b in c.hash_to_block.items():
        assert c.block_hash[b] == h
    for b, n in enumerate(holders):
        if n > 1:
            assert b in c.block_hash, f"block {b} is held {n} times but is not a shared prefix block"
    running = {r.id for r in engine.running}
    assert set(c.tables) == running
    bs = engine.config.block_size
    for r in engine.running:
        assert r.state == "running" and c.lens[r.id] == r.computed
        assert len(c.tables[r.id]) == -(-r.computed // bs)
        assert c.tokens[r.id] == r.tokens[: r.computed]
        digest = None
        for i, b in enumerate(c.tables[r.id][: r.computed // bs]):  # a hashed block holds its whole prefix
            digest = kvlib.paged.block_digest(digest, tuple(r.tokens[i * bs: (i + 1) * bs]))
            if b in c.block_key:
                assert c.block_key[b] == digest
    for r in engine.waiting + engine.swapped:
        assert r.id not in c.tables
    assert len(running) <= engine.config.max_num_seqs


def run_checked(engine, arrivals=(), max_steps=500):
    """Step to the end, adding (step, add_request kwargs) arrivals on time and checking the pool
    after each step; returns ({arrival index: request id}, outputs)."""
    ids = {}
    for step in range(max_steps):
        for i, (at, kw) in enumerate(arrivals):  # same-step arrivals in list order
            if at == step:
                ids[i] = engine.add_request(**kw)
        if not engine.has_unfinished() and step > max((a[0] for a in arrivals), default=0):
            break
        if engine.has_unfinished():
            ev = engine.step()
            check_pool(engine)
            assert ev["prefill_tokens"] + ev["decode_tokens"] <= engine.config.max_batched_tokens
            if ev["preempted"] and ev["scheduled"]:
                assert min(ev["preempted"]) > max(ev["scheduled"]), "the newest requests are preempted first"
    assert not engine.has_unfinished(), "the engine did not finish"
    return ids, {i: r.output for i, r in engine.requests.items()}


# ---- token identity -----------------------------------------------------------------------


def test_docstring_example_runs():
    result = doctest.testmod(kvlib.engine, optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed


def test_mixed_lengths_and_chunked_prefill_are_token_identical(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(64, (L,), generator=g).tolist() for L in (1, 3, 17, 9, 30)]
    news = [6, 4, 5, 8, 3]
    engine = Engine(model, num_blocks=40, block_size=4, max_num_seqs=4, max_batched_tokens=12)
    _, out = run_checked(engine, [(0, dict(prompt_ids=p, max_new_tokens=n)) for p, n in zip(prompts, news)])
    assert [out[i] for i in range(5)] == [alone(model, p, n) for p, n in zip(prompts, news)]
    ev = engine.events
    assert any(e["prefill_tokens"] and e["decode_tokens"] for e in ev), "prefill chunks ran beside decodes"
    assert max(e["prefill_tokens"] + e["decode_tokens"] for e in ev) == 12
    computed = sum(e["prefill_tokens"] + e["decode_tokens"] for e in ev)
    assert computed == sum(len(p) + n - 1 for p, n in zip(prompts, news))  # no prefix hits, no preemption: each once
    assert engine.cache.num_available == 40  # finished requests freed their blocks (full ones stay cached)


def test_arrivals_while_others_decode(model):
    g = torch.Generator().manual_seed(2)
    reqs = [(at, dict(prompt_ids=torch.randint(64, (L,), generator=g).tolist(), max_new_tokens=n))
            for at, L, n in ((0, 5, 10), (2, 7, 4), (3, 2, 6), (9, 12, 3))]
    engine = Engine(model, num_blocks=24, block_size=4, max_num_seqs=3, max_batched_tokens=8)
    ids, out = run_checked(engine, reqs)
    for i, (at, kw) in enumerate(reqs):
        assert out[ids[i]] == alone(model, kw["prompt_ids"], kw["max_new_tokens"])
        assert engine.requests[ids[i]].arrival_step == at
    assert engine.events[2]["admitted"] == [1] and engine.events[2]["decode_tokens"] == 1  # joins a decoding batch


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(model, preemption):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(64, (L,), generator=g).tolist() for L in (6, 5, 7)]
    # 3 requests of up to 16 positions (4 blocks of 4) in a pool of 7 blocks: someone must give way
    engine = Engine(model, num_blocks=7, block_size=4, max_num_seqs=3, max_batched_tokens=8, preemption=preemption,
                    watermark=0.0, prefix_caching=False)
    _, out = run_checked(engine, [(0, dict(prompt_ids=p, max_new_tokens=10)) for p in prompts])
    assert [out[i] for i in range(3)] == [alone(model, p, 10) for p in prompts]
    assert sum(engine.metrics(i)["preemptions"] for i in range(3)) > 0
    assert engine.metrics(0)["preemptions"] == 0  # the oldest is never preempted
    swapped_in = sum(len(e["swapped_in"]) for e in engine.events)
    assert (swapped_in > 0) == (preemption == "swap")
    assert engine.cache.allocator.num_free == 7


def test_swap_of_a_request_preempted_before_it_computed_anything(model):
    """Admitted, then preempted in the same step before any block was written: an empty swap."""
    engine = Engine(model, num_blocks=8, block_size=4, preemption="swap")
    r = engine.add_request([1, 2, 3, 4, 5], 3)
    engine._admit(dict(admitted=[], swapped_in=[]))
    engine._preempt(engine.requests[r], dict(preempted=[]))
    assert engine.requests[r].state == "swapped" and engine.requests[r].host[0][0].shape[0] == 0
    assert engine.run()[r] == alone(model, [1, 2, 3, 4, 5], 3)
    check_pool(engine)


# ---- prefix caching -----------------------------------------------------------------------


def test_prefix_hits_across_requests_including_the_whole_prompt(model):
    """nano-vllm #144: a prompt already cached in full still computes its last token (for logits)."""
    g = torch.Generator().manual_seed(4)
    doc = torch.randint(64, (10,), generator=g).tolist()
    engine = Engine(model, num_blocks=30, block_size=4, max_batched_tokens=16)
    a = engine.add_request(doc, 5)
    engine.run()  # finished: its full blocks stay in the pool, findable by hash
    full = doc + engine.requests[a].output[:4]  # prompt + generated tokens, 14 positions: 3 full blocks cached
    cases = {"same prompt": (doc, 8), "multiple of block_size": (doc[:8], 4), "prompt + generated": (full, 12),
             "shared prefix": (doc[:8] + [1, 2, 3], 8), "no hit": ([5] + doc, 0)}
    ids = {name: engine.add_request(p, 4) for name, (p, _) in cases.items()}
    engine.run()
    check_pool(engine)
    for name, (p, cached) in cases.items():
        assert engine.requests[ids[name]].output == alone(model, p, 4), name
        assert engine.metrics(ids[name])["cached_tokens"] == cached, name
    steps = engine.events[-1]["step"] - engine.events[0]["step"]
    assert steps > 0 and engine.drop_prefix_cache() > 0 and engine.cache.allocator.num_free == 30


def test_prefix_hit_on_a_running_request_and_compute_saved(model):
    doc = list(range(20, 36))  # 16 tokens
    engine = Engine(model, num_blocks=30, block_size=4, max_batched_tokens=32)
    a = engine.add_request(doc + [1], 6)
    engine.step()  # a's prompt is in the cache now, and a is still decoding
    b = engine.add_request(doc + [2], 6)
    ev = engine.step()
    assert ev["scheduled"] == {a: 1, b: 1}  # b computes only its last prompt token
    assert engine.metrics(b)["cached_tokens"] == 16
    out = engine.run()
    assert out[a] == alone(model, doc + [1], 6) and out[b] == alone(model, doc + [2], 6)


# ---- sampling, eos, metrics ---------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(model):
    p = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = alone(model, p, 8, temperature=0.9, seed=7, top_k=20)
    solo = Engine(model, num_blocks=20, block_size=4)
    r = solo.add_request(p, 8, temperature=0.9, seed=7, top_k=20)
    assert solo.run()[r] == ref
    mix = Engine(model, num_blocks=9, block_size=4, max_num_seqs=4, max_batched_tokens=6, preemption="recompute")
    others = [mix.add_request([7] * 9, 8, temperature=1.0, seed=1), mix.add_request([2, 2], 8)]
    r = mix.add_request(p, 8, temperature=0.9, seed=7, top_k=20)
    out = mix.run()
    assert out[r] == ref
    assert out[others[0]] == alone(model, [7] * 9, 8, temperature=1.0, seed=1)
    assert out[others[1]] == alone(model, [2, 2], 8)


def test_eos_stops_a_request(model):
    p = [9, 8, 7, 6]
    full = alone(model, p, 8)
    eos = full[2]
    engine = Engine(model, num_blocks=20, block_size=4)
    r = engine.add_request(p, 8, eos_id=eos)
    other = engine.add_request([1, 2, 3], 8)
    out = engine.run()
    assert out[r] == full[: full.index(eos) + 1] == alone(model, p, 8, eos_id=eos)
    assert out[other] == alone(model, [1, 2, 3], 8)


def test_metrics_use_the_step_clock(model):
    engine = Engine(model, num_blocks=20, block_size=4, max_num_seqs=1, max_batched_tokens=4)
    a = engine.add_request([1, 2, 3], 4)  # prefill in step 0 gives token 1, then one token per step
    b = engine.add_request([4, 5, 6, 7, 8, 9], 2)  # waits for a's slot, then a chunk of 4 and one of 2
    engine.run()
    ma, mb = engine.metrics(a), engine.metrics(b)
    assert (ma["queue_steps"], ma["ttft_steps"], ma["tpot_steps"]) == (0, 1, 1.0)
    assert (mb["queue_steps"], mb["ttft_steps"], mb["tpot_steps"]) == (4, 6, 1.0)
    assert ma["ttft_s"] > 0 and mb["state"] == "finished" and len(engine.events) == 7


def test_watermark_holds_back_admission_while_others_run(model):
    engine = Engine(model, num_blocks=10, block_size=4, max_num_seqs=4, watermark=0.3)  # keep 3 blocks free
    a = engine.add_request(list(range(16)), 4)  # 4 blocks (+ 1 to grow into)
    b = engine.add_request(list(range(30, 43)), 2)  # 4 more blocks would leave 10 - 4 - 4 < 3: it waits
    assert engine.step()["admitted"] == [a]
    admitted = {r for e in engine.events for r in e["admitted"]}
    while b not in admitted:
        admitted |= set(engine.step()["admitted"])
    assert engine.requests[a].state == "finished"
    big = Engine(model, num_blocks=4, block_size=4, watermark=0.5)  # alone, a request may use the watermark
    r = big.add_request(list(range(12)), 5)
    assert big.run()[r] == alone(model, list(range(12)), 5)


# ---- bad input and failures ---------------------------------------------------------------


def test_bad_requests_are_refused_and_the_others_served(model):
    engine = Engine(model, num_blocks=4, block_size=4)
    ok = engine.add_request([1, 2, 3], 3)
    ctx = model.config.max_seq_len
    with pytest.raises(ValueError, match=r"prompt_ids \(20 tokens\) \+ max_new_tokens \(1\) needs 5 blocks.*=4"):
        engine.add_request(list(range(20)), 1)
    with pytest.raises(ValueError, match=rf"max_new_tokens \(10\) = {ctx + 2} tokens exceeds.*of {ctx}"):
        engine.add_request([1] * (ctx - 8), 10)
    with pytest.raises(ValueError, match="prompt_ids must hold at least one token"):
        engine.add_request([], 3)
    with pytest.raises(ValueError, match="token 64, outside the model's vocabulary 0..63"):
        engine.add_request([1, 64], 3)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        engine.add_request([1], 0)
    with pytest.raises(TypeError, match="prompt_ids must be a list"):
        engine.add_request("hello", 3)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.add_request([1], 3, temperature=-1.0)
    with pytest.raises(ValueError, match="eos_id must lie in the vocabulary"):
        engine.add_request([1], 3, eos_id=99)
    ok2 = engine.add_request(torch.tensor([4, 5]), 2)
    out = engine.run()
    assert set(out) == {ok, ok2} and out[ok] == alone(model, [1, 2, 3], 3) and out[ok2] == alone(model, [4, 5], 2)


def test_bad_engine_settings_are_refused(model):
    with pytest.raises(ValueError, match="preemption must be 'recompute' or 'swap', got 'evict'"):
        Engine(model, 8, preemption="evict")
    with pytest.raises(ValueError, match=r"max_batched_tokens \(2\) must be >= max_num_seqs \(4\)"):
        Engine(model, 8, max_num_seqs=4, max_batched_tokens=2)
    with pytest.raises(ValueError, match="watermark must be a fraction"):
        Engine(model, 8, watermark=1.5)
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        Engine(model, 0)


def test_an_exception_inside_a_step_leaves_every_request_as_it_was(model):
    model = copy.deepcopy(model)
    layer, calls = model.layers[1], {"n": 0}
    forward = layer.forward

    def flaky(*args, **kw):  # the 4th forward call fails inside layer 1, after layer 0 stored its K/V
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return forward(*args, **kw)

    layer.forward = flaky
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14], [15, 16]]
    engine = Engine(model, num_blocks=20, block_size=4, max_num_seqs=3, max_batched_tokens=6)
    ids = [engine.add_request(p, 5) for p in prompts]
    for _ in range(3):
        engine.step()
    before = {r.id: (r.state, r.computed, list(r.output)) for r in engine.requests.values()}
    free = engine.cache.num_available
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    check_pool(engine)  # nothing half-written: the same requests, lengths, outputs and blocks as before
    assert {r.id: (r.state, r.computed, list(r.output)) for r in engine.requests.values()} == before
    assert engine.cache.num_available == free and "KeyboardInterrupt" in engine.events[-1]["error"]
    out = engine.run()
    assert [out[i] for i in ids] == [alone(model, p, 5) for p in prompts]


def test_triton_kernels_and_swap(model_for):
    """The same engine on the Triton kernels (compiled on a GPU, where swap uses pinned host memory)."""
    model = model_for("triton")
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]]
    engine = Engine(model, num_blocks=5, block_size=4, max_num_seqs=2, preemption="swap", watermark=0.0,
                    kernels="triton")
    ids = [engine.add_request(p, 8) for p in prompts]
    _, out = run_checked(engine)
    assert [out[i] for i in ids] == [alone(model, p, 8) for p in prompts]
    assert sum(len(e["swapped_in"]) for e in engine.events) > 0


# ---- random traces (hypothesis) -----------------------------------------------------------

# hypothesis is a dev extra (scripts/gpu_check.sh does not install it): without it only this test skips
try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    st = None

BASES = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 40, 41], [30]]  # shared prefixes make prefix hits likely

if st is None:
    @pytest.mark.skip(reason="needs hypothesis (pip install -e .[dev])")
    def test_random_traces_leak_no_block_and_match_generate():
        pass
else:
    request_st = st.tuples(st.integers(0, 6), st.sampled_from(BASES), st.lists(st.integers(0, 63), max_size=6),
                           st.integers(1, 6), st.sampled_from([0.0, 0.0, 1.0]))

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(block_size=st.sampled_from([2, 4]), num_blocks=st.integers(3, 12), max_num_seqs=st.integers(1, 4),
           extra_tokens=st.integers(0, 8), preemption=st.sampled_from(["recompute", "swap"]),
           watermark=st.sampled_from([0.0, 0.2]), prefix_caching=st.booleans(),
           requests=st.lists(request_st, min_size=1, max_size=5))
    def test_random_traces_leak_no_block_and_match_generate(model, block_size, num_blocks, max_num_seqs,
                                                            extra_tokens, preemption, watermark, prefix_caching,
                                                            requests):
        """Random pools, settings and arrivals (shared prefixes, greedy and seeded sampling): after every
        step no block leaks or is held twice (check_pool), every request finishes with the tokens it gets
        alone, and once the prefix cache is dropped the whole pool is free again."""
        engine = Engine(model, num_blocks, block_size, max_num_seqs=max_num_seqs,
                        max_batched_tokens=max_num_seqs + extra_tokens, preemption=preemption, watermark=watermark,
                        prefix_caching=prefix_caching)
        arrivals, expected = [], {}
        for i, (at, base, tail, n, temperature) in enumerate(requests):
            prompt = base + tail
            if -(-(len(prompt) + n - 1) // block_size) > num_blocks:
                with pytest.raises(ValueError, match="more than the whole pool"):
                    engine.add_request(prompt, n)
                continue
            arrivals.append((at, dict(prompt_ids=prompt, max_new_tokens=n, temperature=temperature, seed=i)))
            expected[len(arrivals) - 1] = alone(model, prompt, n, temperature=temperature,
                                                seed=i if temperature else None)
        ids, out = run_checked(engine, arrivals)
        for k, want in expected.items():
            assert out[ids[k]] == want
        engine.drop_prefix_cache()
        assert engine.cache.allocator.num_free == num_blocks and not engine.cache.cached


# ---- the tiered prefix store: host memory, then disk --------------------------------------


def check_tiers(engine):
    """The host tier holds at most host_blocks blocks, the disk tier exactly its files (at most
    disk_blocks of them); a block lives in at most one of the two, each under its prefix digest."""
    cfg, t = engine.config, engine.cache.tiers
    assert len(t.host) <= cfg.host_blocks and len(t.disk) <= cfg.disk_blocks
    assert not set(t.host) & set(t.disk)
    for key, k, v in t.host.values():
        assert len(key) == 32 and k.shape == v.shape == (len(engine.cache.k),) + engine.cache.k[0].shape[1:]  # a digest
    if cfg.disk_dir is not None:
        files = {f for f in os.listdir(cfg.disk_dir) if f.endswith(".safetensors")}
        assert files == {os.path.basename(t.block_file(h)) for h in t.disk}
        assert all(len(key) == 32 for key in t.disk.values())


def push_down(engine):
    """Evict every cached device block (down to the tiers), as a busier pool would."""
    engine.cache.evict_cached(len(engine.cache.cached))


def rag_workload(seed=15):
    """3 documents of 6 blocks (block_size 4), 9 requests cycling through them with a short question
    each: a pool of 12 blocks cannot keep a document until it comes back."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(64, (24,), generator=g).tolist() for _ in range(3)]
    return docs, [docs[i % 3] + torch.randint(64, (3 + i % 4,), generator=g).tolist() for i in range(9)]


def run_rag(model, prompts, **kw):
    engine = Engine(model, num_blocks=12, block_size=4, max_num_seqs=2, max_batched_tokens=16, **kw)
    ids = [engine.add_request(p, 4) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        check_pool(engine)
        if engine.config.tiered:
            check_tiers(engine)
    return engine, ids


def tier_sums(engine, ids):
    return {t: sum(engine.metrics(i)[f"cached_tokens_{t}"] for i in ids) for t in ("device", "host", "disk")}


def test_host_tier_brings_evicted_prefix_blocks_back(model):
    docs, prompts = rag_workload()
    want = [alone(model, p, 4) for p in prompts]
    plain, ids0 = run_rag(model, prompts)
    tiered, ids = run_rag(model, prompts, host_blocks=24)
    assert [tiered.requests[i].output for i in ids] == want == [plain.requests[i].output for i in ids0]
    assert all("tiers" not in ev for ev in plain.events) and plain.cache.tiers is None  # off by default
    hits = tier_sums(tiered, ids)
    assert hits["host"] > 0 and hits["disk"] == 0 and tiered.tier_stats["host_hits"] * 4 == hits["host"]
    assert sum(tiered.metrics(i)["cached_tokens"] for i in ids) == sum(hits.values())
    computed = [sum(ev["prefill_tokens"] for ev in e.events) for e in (plain, tiered)]
    assert computed[1] < computed[0] - hits["host"] // 2, computed
    stats, per_step = tiered.tier_stats, [ev["tiers"] for ev in tiered.events]
    for key in stats:
        assert sum(s[key] for s in per_step) == stats[key], key
    block_bytes = 2 * len(tiered.cache.k) * tiered.cache.k[0][0].nbytes  # K and V of every layer
    assert stats["bytes_to_host"] == stats["to_host"] * block_bytes
    assert stats["bytes_from_host"] == stats["host_hits"] * block_bytes
    # a document alone as the prompt, all 6 blocks in the host tier: its last block is still computed
    tiered.drop_prefix_cache()
    r = tiered.add_request(docs[0] + [7], 2)
    tiered.run()
    push_down(tiered)  # demote its blocks to the host tier
    assert not tiered.cache.cached and len(tiered.cache.tiers.host) == 6
    r = tiered.add_request(docs[0], 3)
    assert tiered.run()[r] == alone(model, docs[0], 3)
    assert tiered.metrics(r)["cached_tokens_host"] == 20 and tiered.metrics(r)["cached_tokens_device"] == 0
    check_pool(tiered)


def test_disk_tier_round_trips_blocks_through_safetensors_files(model, tmp_path):
    _, prompts = rag_workload()
    want = [alone(model, p, 4) for p in prompts]
    host_only, _ = run_rag(model, prompts, host_blocks=4)
    engine, ids = run_rag(model, prompts, host_blocks=4, disk_dir=tmp_path / "kv", disk_blocks=10)
    assert [engine.requests[i].output for i in ids] == want
    hits, stats = tier_sums(engine, ids), engine.tier_stats
    assert hits["disk"] > 0 and stats["disk_hits"] > 0 and stats["to_disk"] > 0
    assert stats["dropped"] > 0  # the oldest files were deleted to stay within disk_blocks
    files = sorted((tmp_path / "kv").iterdir())
    assert 0 < len(files) <= 10 and all(f.suffix == ".safetensors" for f in files)
    assert max(ev["tiers"]["disk_blocks"] for ev in engine.events) == 10
    assert tier_sums(host_only, ids)["host"] < hits["host"] + hits["disk"]  # the disk kept what host had to drop
    with safe_open(str(files[0]), framework="pt") as f:  # a plain safetensors file: K and V, hash and tokens
        assert set(f.keys()) == {"k", "v"} and set(f.metadata()) == {"hash", "key", "store"}
        assert f.get_tensor("k").shape == (len(engine.cache.k),) + engine.cache.k[0].shape[1:]
    engine.drop_prefix_cache()
    assert not list((tmp_path / "kv").iterdir()) and not len(engine.cache.tiers)


def test_admission_counts_the_blocks_a_tier_hit_needs(model):
    doc = list(range(20, 36))  # 4 blocks of 4
    engine = Engine(model, num_blocks=8, block_size=4, watermark=0.0, host_blocks=8)
    engine.add_request(doc + [1], 2)
    engine.run()
    push_down(engine)  # the document's 4 blocks: device -> host
    assert len(engine.cache.tiers.host) == 4 and engine.cache.allocator.num_free == 8
    b = engine.add_request(list(range(40, 57)), 3)  # 17 tokens: 5 blocks, leaving 3
    assert engine.step()["admitted"] == [b]
    c = engine.add_request(doc + [2], 3)  # 4 blocks from the host + 1: does not fit beside b
    while engine.requests[b].state != "finished":
        assert c not in engine.step()["admitted"]
        check_pool(engine)
        check_tiers(engine)
    out = engine.run()
    assert out[c] == alone(model, doc + [2], 3) and engine.metrics(c)["cached_tokens_host"] == 16
    check_pool(engine)


def test_bad_tier_settings_are_refused(model, tmp_path):
    with pytest.raises(ValueError, match="host_blocks must be >= 0, got -1"):
        Engine(model, 8, host_blocks=-1)
    with pytest.raises(ValueError, match="disk_blocks must be >= 0, got -2"):
        Engine(model, 8, disk_blocks=-2, disk_dir=tmp_path)
    with pytest.raises(ValueError, match="disk_blocks=4 needs disk_dir"):
        Engine(model, 8, disk_blocks=4)
    with pytest.raises(ValueError, match="disk_blocks is 0"):
        Engine(model, 8, disk_dir=tmp_path)
    with pytest.raises(ValueError, match="need prefix_caching=True"):
        Engine(model, 8, host_blocks=4, prefix_caching=False)
    with pytest.raises(TypeError, match="host_blocks must be an int"):
        Engine(model, 8, host_blocks=2.5)


def expected_outputs(model, requests, num_blocks, block_size=2):
    """{index: tokens alone} for the (arrival, base, tail, n, temperature) requests that fit the pool."""
    return {i: alone(model, base + tail, n, temperature=temperature, seed=i if temperature else None)
            for i, (at, base, tail, n, temperature) in enumerate(requests)
            if -(-(len(base + tail) + n - 1) // block_size) <= num_blocks}


def add_arrivals(engine, requests, expected, ids, step):
    """Add the requests arriving at ``step`` (seeded by their index), noting their ids."""
    for i, (at, base, tail, n, temperature) in enumerate(requests):
        if at == step and i in expected:
            ids[i] = engine.add_request(base + tail, n, temperature, seed=i)


if st is not None:
    # requests spread over time, so that finished ones leave blocks to evict and later ones to find
    tier_request_st = st.tuples(st.integers(0, 24), st.sampled_from(BASES), st.lists(st.integers(0, 63), max_size=3),
                                st.integers(1, 4), st.sampled_from([0.0, 1.0]))

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(num_blocks=st.integers(4, 8), max_num_seqs=st.integers(1, 3),
           preemption=st.sampled_from(["recompute", "swap"]),
           host_blocks=st.integers(0, 6), disk_blocks=st.integers(0, 4), push_every=st.integers(1, 4),
           requests=st.lists(tier_request_st, min_size=3, max_size=8))
    def test_random_traces_with_tiers_match_generate(model, tmp_path_factory, num_blocks, max_num_seqs, preemption,
                                                     host_blocks, disk_blocks, push_every, requests):
        """Random small pools with host and disk tiers, and every few steps all evictable device blocks
        pushed down a tier (as a busier pool would): the pool and tier invariants hold after every step
        and every request gets the tokens it gets alone."""
        disk_dir = tmp_path_factory.mktemp("kv") if disk_blocks else None
        engine = Engine(model, num_blocks, 2, max_num_seqs=max_num_seqs, max_batched_tokens=max_num_seqs + 4,
                        preemption=preemption, watermark=0.0, disk_dir=disk_dir, disk_blocks=disk_blocks,
                        host_blocks=host_blocks if host_blocks or disk_blocks else 1)  # some tier, always
        expected, ids = expected_outputs(model, requests, num_blocks), {}
        for step in range(300):
            add_arrivals(engine, requests, expected, ids, step)
            if not engine.has_unfinished() and step > 24:
                break
            if step % push_every == 0:
                push_down(engine)  # device -> host (-> disk)
            engine.step()
            check_pool(engine)
            check_tiers(engine)
        assert not engine.has_unfinished()
        for i, want in expected.items():
            assert engine.requests[ids[i]].output == want


# ---- one forward per step, logits only where a token is drawn -----------------------------


def count_forwards(model):
    """(calls, rows): model forwards, and the rows the output head computed in each."""
    calls, rows = [], []
    model.register_forward_hook(lambda m, args, kw_out=None: calls.append(1))
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    return calls, rows


def test_one_forward_per_step_and_logits_only_where_a_token_is_drawn(model):
    model = copy.deepcopy(model)
    calls, rows = count_forwards(model)
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(64, (L,), generator=g).tolist() for L in (3, 17, 9, 30, 2)]
    want = [alone(model, p, 5) for p in prompts]
    calls.clear(), rows.clear()
    engine = Engine(model, num_blocks=40, block_size=4, max_num_seqs=4, max_batched_tokens=12)
    arrivals = [(2 * i, dict(prompt_ids=p, max_new_tokens=5)) for i, p in enumerate(prompts)]
    ids, out = run_checked(engine, arrivals)
    assert [out[ids[i]] for i in range(5)] == want
    computing = [ev for ev in engine.events if ev["scheduled"]]
    assert len(calls) == engine.forwards == len(computing) == sum(ev["forwards"] for ev in engine.events)
    assert any(ev["prefill_tokens"] and ev["decode_tokens"] for ev in computing), "no fused step was tried"
    assert rows == [ev["sampled"] for ev in computing]  # the head ran once per token drawn, not per position
    assert sum(rows) == 5 * 5 and sum(ev["prefill_tokens"] + ev["decode_tokens"] for ev in computing) > sum(rows)


# ---- faults: compute first, commit after ---------------------------------------------------


def snapshot(engine):
    return {r.id: (r.state, r.computed, list(r.output), r.preemptions) for r in engine.requests.values()}


def test_an_exception_while_sampling_moves_no_request(model, monkeypatch):
    """Fault 1 of the review: a sampling error (NaN probabilities) after the forward. Seeded generators
    are put back, so the retried step draws the same numbers and every output stays as it is alone."""
    import kvlib.engine as eng

    real, calls = eng.sample_next, {"n": 0}

    def flaky(*args, **kw):  # the 3rd draw of a sampled token fails, after two generators moved on
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(*args, **kw)

    monkeypatch.setattr(eng, "sample_next", flaky)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [1]]
    engine = Engine(model, num_blocks=24, block_size=4, max_num_seqs=4, max_batched_tokens=8)
    ids = [engine.add_request(p, 6, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    with pytest.raises(RuntimeError, match="nan"):
        for _ in range(20):
            before, avail = snapshot(engine), engine.cache.num_available
            engine.step()
    assert snapshot(engine) == before and engine.cache.num_available == avail
    check_pool(engine)
    out = engine.run()
    assert [out[i] for i in ids] == [alone(model, p, 6, temperature=1.0, seed=i) for i, p in enumerate(prompts)]


def damage(paths, how):
    """Delete, truncate, or overwrite each file with another one's bytes (a rotation: none keeps its own)."""
    paths = [p for p in paths if os.path.exists(p)]
    if how == "overwritten":
        data = [open(p, "rb").read() for p in paths]
        for p, d in zip(paths, data[1:] + data[:1] if len(paths) > 1 else [b"not a safetensors file"]):
            with open(p, "wb") as f:
                f.write(d)
    for p in paths:
        if how == "deleted":
            os.remove(p)
        elif how == "truncated":
            with open(p, "r+b") as f:
                f.truncate(5)
    return len(paths)


@pytest.mark.parametrize("how", ["deleted", "truncated", "overwritten"])
def test_a_damaged_disk_tier_file_is_a_miss(model, tmp_path, how, caplog):
    """Fault 2: a disk-tier file deleted, truncated or overwritten between steps: the block is computed
    again (a miss, logged and counted), the entry is dropped, and no step raises."""
    docs, prompts = rag_workload()
    engine = Engine(model, num_blocks=12, block_size=4, max_num_seqs=2, max_batched_tokens=16, host_blocks=2,
                    disk_dir=tmp_path, disk_blocks=30)
    ids = [engine.add_request(p, 4) for p in prompts]
    damaged = 0
    with caplog.at_level("WARNING", logger="kvlib.tiers"):
        while engine.has_unfinished():
            engine.step()
            damaged += damage([engine.cache.tiers.block_file(h) for h in engine.cache.tiers.disk], how)  # all, each step
            check_pool(engine)
    assert damaged and engine.tier_stats["errors"] > 0 and engine.tier_stats["disk_hits"] == 0
    assert caplog.text.count("treated as a miss") == engine.tier_stats["errors"]
    assert [engine.requests[i].output for i in ids] == [alone(model, p, 4) for p in prompts]


def test_a_failed_block_write_loses_that_copy_only(model, tmp_path, monkeypatch):
    """Fault 3: save_file fails once (a full disk) while a block goes down to disk: that copy is dropped,
    every device block stays accounted for, and the outputs are unchanged."""
    import kvlib.tiers

    real, calls = kvlib.tiers.save_file, {"n": 0}

    def full_disk(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(kvlib.tiers, "save_file", full_disk)
    _, prompts = rag_workload()
    engine, ids = run_rag(model, prompts, host_blocks=1, disk_dir=tmp_path, disk_blocks=20)
    assert calls["n"] > 2 and engine.tier_stats["errors"] == 1
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # no half-written file left
    assert [engine.requests[i].output for i in ids] == [alone(model, p, 4) for p in prompts]
    engine.drop_prefix_cache()
    assert engine.cache.allocator.num_free == 12  # no block lost


def test_a_recompute_preempted_request_finds_its_own_blocks_again(model):
    """Freed blocks keep their hash until reused (vLLM, nano-vllm): a preempted request's prompt blocks are
    still in the pool when it comes back, so its re-prefill starts past them."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(64, (12,), generator=g).tolist() for _ in range(2)]
    prefilled = {}
    for caching in (True, False):
        engine = Engine(model, num_blocks=9, block_size=4, max_num_seqs=2, max_batched_tokens=16, watermark=0.0,
                        prefix_caching=caching)
        ids = [engine.add_request(p, 14) for p in prompts]
        _, out = run_checked(engine)
        assert [out[i] for i in ids] == [alone(model, p, 14) for p in prompts]
        r = engine.requests[ids[1]]
        assert r.preemptions > 0 and (r.cached_tokens > 0) == caching, (r.preemptions, r.cached_tokens)
        prefilled[caching] = sum(ev["prefill_tokens"] for ev in engine.events)
    assert prefilled[True] < prefilled[False]


def test_a_prefix_hit_compares_tokens_not_only_hashes(model):
    engine = Engine(model, num_blocks=12, block_size=4)
    a = engine.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], 2)
    engine.run()
    c = engine.cache
    other = [11, 12, 13, 14, 15]
    (h,) = kvlib.paged.chained_block_hashes(other, 4, 1)
    c.hash_to_block[h] = c.hash_to_block[kvlib.paged.chained_block_hashes([1, 2, 3, 4], 4, 1)[0]]  # a collision
    assert c.plan_prefix(other) == [] and c.lookup(other) == []
    del c.hash_to_block[h]
    b = engine.add_request(other, 3)
    assert engine.run()[b] == alone(model, other, 3) and engine.metrics(b)["cached_tokens"] == 0
    assert engine.metrics(a)["state"] == "finished"


# ---- abort, streaming, stop tokens and strings, bounded logs -------------------------------


def test_abort_frees_blocks_in_every_state(model):
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13], [14, 15]]
    engine = Engine(model, num_blocks=6, block_size=4, max_num_seqs=2, max_batched_tokens=8, preemption="swap",
                    watermark=0.0)
    ids = [engine.add_request(p, 8) for p in prompts]
    assert not engine.abort(ids[3]) or engine.requests[ids[3]].finish_reason == "abort"  # waiting
    for _ in range(6):
        engine.step()
    states = {engine.requests[i].state for i in ids[:3]}
    victim = next(i for i in ids[:3] if engine.requests[i].state in ("running", "swapped"))
    assert engine.abort(victim) and not engine.abort(victim)
    assert engine.requests[victim].state == "aborted" and victim not in engine.cache.tables
    check_pool(engine)
    out = engine.run()
    for i, p in zip(ids, prompts):
        if i not in (victim, ids[3]):
            assert out[i] == alone(model, p, 8)
    assert engine.metrics(ids[3])["finish_reason"] == "abort" and out[ids[3]] == []
    assert "running" in states
    engine.drop_prefix_cache()
    assert engine.cache.allocator.num_free == 6
    with pytest.raises(ValueError, match="unknown request"):
        engine.abort(99)


def test_stream_yields_each_token_once_in_order(model):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    engine = Engine(model, num_blocks=20, block_size=4, max_num_seqs=2, max_batched_tokens=6)
    ids = [engine.add_request(p, n) for p, n in zip(prompts, (4, 2, 5))]
    got, reasons = {i: [] for i in ids}, {}
    for rid, toks, reason in engine.stream():
        assert rid not in reasons, "a token after the request finished"
        got[rid] += toks
        if reason is not None:
            reasons[rid] = reason
    assert [got[i] for i in ids] == [alone(model, p, n) for p, n in zip(prompts, (4, 2, 5))]
    assert reasons == {i: "length" for i in ids}


class CharTokenizer:
    """Token t decodes to one letter: enough to test stop strings on the tiny model."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)


def test_stop_tokens_and_stop_strings_end_a_request(model):
    p = [9, 8, 7, 6]
    full = alone(model, p, 10)
    tok = CharTokenizer()
    engine = Engine(model, num_blocks=20, block_size=4, tokenizer=tok)
    r_tok = engine.add_request(p, 10, stop_token_ids=[full[3]])
    stop = tok.decode(full[4:6])  # a string that the output completes at its 6th token (or earlier)
    r_str = engine.add_request(p, 10, stop=[stop, "never-there"])
    other = engine.add_request([1, 2, 3], 10)
    out = engine.run()
    assert out[r_tok] == full[: full.index(full[3]) + 1]
    assert engine.metrics(r_tok)["finish_reason"] == "stop" and engine.metrics(other)["finish_reason"] == "length"
    text = tok.decode(full)
    end = text.index(stop) + len(stop)  # the token that completes the stop string is the last one
    assert out[r_str] == full[:end] and engine.requests[r_str].text == text[: text.index(stop)]
    assert out[other] == alone(model, [1, 2, 3], 10)
    with pytest.raises(ValueError, match="need a tokenizer"):
        Engine(model, num_blocks=4, block_size=4).add_request(p, 3, stop=["x"])
    with pytest.raises(TypeError, match="not one value"):
        engine.add_request(p, 3, stop="x")
    with pytest.raises(ValueError, match="stop_token_ids must lie in the vocabulary"):
        engine.add_request(p, 3, stop_token_ids=[64])


def test_logs_stay_bounded(model):
    engine = Engine(model, num_blocks=20, block_size=4, max_num_seqs=1, max_events=5, max_finished=2)
    ids = [engine.add_request([i + 1, i + 2], 3) for i in range(6)]
    engine.run()
    assert len(engine.events) == 5 and engine.events[-1]["step"] == engine.clock - 1
    assert sorted(engine.requests) == ids[-2:]
    assert engine.add_request([1], 1) == 6  # ids keep counting


if st is not None:
    fault_st = st.lists(st.tuples(st.sampled_from(["forward", "sample", "write", "file"]), st.integers(0, 12)),
                        min_size=1, max_size=6)

    @settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(num_blocks=st.integers(5, 10), max_num_seqs=st.integers(1, 3),
           preemption=st.sampled_from(["recompute", "swap"]), faults=fault_st,
           requests=st.lists(tier_request_st, min_size=2, max_size=6))
    def test_random_faults_leave_no_request_wrong_stuck_or_leaked(model, tmp_path_factory, num_blocks, max_num_seqs,
                                                                  preemption, faults, requests):
        """Random traces with faults injected at random points: a layer's forward or a sampled draw raising
        (the step raises, the test carries on stepping), a block write failing, a block file damaged. After
        every step the pool and tier invariants hold; at the end every request has the tokens it gets alone
        and the pool is whole."""
        from unittest import mock

        import kvlib.engine as eng
        import kvlib.tiers

        flaky_model = copy.deepcopy(model)
        counters = dict.fromkeys(["forward", "sample", "write"], 0)
        due = {kind: {at for k, at in faults if k == kind} for kind in counters}

        def fault(kind):
            counters[kind] += 1
            if counters[kind] - 1 in due[kind]:
                raise (OSError(28, "No space left on device") if kind == "write" else RuntimeError(f"{kind} fault"))

        layer_forward = flaky_model.layers[0].forward
        real_sample, real_save = eng.sample_next, kvlib.tiers.save_file
        flaky_model.layers[0].forward = lambda *a, **k: (fault("forward"), layer_forward(*a, **k))[1]
        disk_dir = tmp_path_factory.mktemp("kv")
        engine = Engine(flaky_model, num_blocks, 2, max_num_seqs=max_num_seqs, max_batched_tokens=max_num_seqs + 4,
                        preemption=preemption, watermark=0.0, host_blocks=1, disk_dir=disk_dir, disk_blocks=6)
        expected, ids, raised = expected_outputs(model, requests, num_blocks), {}, 0
        with mock.patch.object(eng, "sample_next", lambda *a, **k: (fault("sample"), real_sample(*a, **k))[1]), \
                mock.patch.object(kvlib.tiers, "save_file", lambda *a, **k: (fault("write"), real_save(*a, **k))[1]):
            for step in range(400):
                add_arrivals(engine, requests, expected, ids, step)
                if not engine.has_unfinished() and step > 24:
                    break
                if step % 3 == 0:
                    push_down(engine)
                if ("file", step) in faults:
                    damage([engine.cache.tiers.block_file(h) for h in engine.cache.tiers.disk], "truncated")
                try:
                    engine.step()
                except RuntimeError as err:
                    assert "fault" in str(err)
                    raised += 1
                check_pool(engine)
                check_tiers(engine)
        assert not engine.has_unfinished() and raised <= len(faults)
        for i, want in expected.items():
            assert engine.requests[ids[i]].output == want
        engine.drop_prefix_cache()
        assert engine.cache.allocator.num_free == num_blocks


# ---- the second review's faults ------------------------------------------------------------


def test_a_failed_eviction_inside_a_reservation_changes_no_sequence(model):
    """Reserving a step's blocks may evict cached ones down to a tier; if that raises, no table, length or
    token has moved yet (room is made before any sequence grows), and the retried step is right."""
    engine = Engine(model, num_blocks=7, block_size=2, max_num_seqs=4, max_batched_tokens=16, watermark=0.0,
                    host_blocks=4)
    engine.add_request([1, 2, 3, 4, 5], 1)
    engine.run()  # 2 cached blocks, 5 free
    a = engine.add_request([10, 11, 12, 13], 4)
    b = engine.add_request([20, 21, 22, 23], 4)
    engine.step()
    before = snapshot(engine), {s: (list(t), engine.cache.lens[s], list(engine.cache.tokens[s]))
                                for s, t in engine.cache.tables.items()}
    real_put = engine.cache.tiers.put
    engine.cache.tiers.put = lambda *args: (_ for _ in ()).throw(MemoryError("no pinned memory"))
    with pytest.raises(MemoryError):
        while True:
            engine.step()
            before = snapshot(engine), {s: (list(t), engine.cache.lens[s], list(engine.cache.tokens[s]))
                                        for s, t in engine.cache.tables.items()}
    assert (snapshot(engine), {s: (list(t), engine.cache.lens[s], list(engine.cache.tokens[s]))
                               for s, t in engine.cache.tables.items()}) == before
    check_pool(engine)
    engine.cache.tiers.put = real_put
    out = engine.run()
    assert out[a] == alone(model, [10, 11, 12, 13], 4) and out[b] == alone(model, [20, 21, 22, 23], 4)


class FlakyTokenizer(CharTokenizer):
    def __init__(self, fail_at):
        self.calls, self.fail_at = 0, fail_at

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        if self.calls == self.fail_at:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken byte")
        return super().decode(ids)


def test_a_stop_string_decode_that_fails_moves_no_request(model):
    engine = Engine(model, num_blocks=40, block_size=4, max_num_seqs=3, max_batched_tokens=32,
                    tokenizer=FlakyTokenizer(fail_at=3))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    ids = [engine.add_request(p, 6, stop=["zzz"]) for p in prompts]
    with pytest.raises(UnicodeDecodeError):
        for _ in range(10):
            before = snapshot(engine)
            engine.step()
    assert snapshot(engine) == before
    check_pool(engine)
    out = engine.run()
    assert [out[i] for i in ids] == [alone(model, p, 6) for p in prompts]


def test_a_request_whose_sampling_keeps_failing_ends_with_an_error_and_frees_the_others(model, monkeypatch):
    import kvlib.engine as eng

    real = eng.sample_next

    def poisoned(logits, temperature, top_k, generator):  # this request's draws always fail (NaN logits)
        if temperature == 0.7:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, temperature, top_k, generator)

    monkeypatch.setattr(eng, "sample_next", poisoned)
    engine = Engine(model, num_blocks=40, block_size=4, max_num_seqs=3, max_batched_tokens=32)
    bad = engine.add_request([1, 2, 3], 5, temperature=0.7, seed=1)
    good = [engine.add_request(p, 5, temperature=1.0, seed=2) for p in ([4, 5], [6, 7, 8])]
    raised = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except RuntimeError:
            raised += 1
        check_pool(engine)
    assert raised == eng.MAX_SAMPLE_FAILURES - 1
    r = engine.requests[bad]
    assert r.finish_reason == "error" and "nan" in r.error and r.output == []
    assert [engine.requests[i].output for i in good] == [alone(model, p, 5, temperature=1.0, seed=2)
                                                          for p in ([4, 5], [6, 7, 8])]
    with pytest.raises(ValueError, match="finite"):
        engine.add_request([1], 2, temperature=float("nan"))


def test_two_engines_sharing_a_disk_folder_never_read_each_others_blocks(tmp_path):
    from kvlib.model import ModelConfig, Transformer

    _, prompts = rag_workload()
    models = []
    for seed in (0, 1):  # same shapes, different weights
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            models.append(Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                                  hidden_dim=128)).eval())
    engines = [Engine(m, num_blocks=12, block_size=4, max_num_seqs=2, max_batched_tokens=16, host_blocks=1,
                      disk_dir=tmp_path, disk_blocks=30) for m in models]
    ids = [[e.add_request(p, 4) for p in prompts] for e in engines]
    while any(e.has_unfinished() for e in engines):
        for e in engines:  # interleaved: each writes and reads block files in the same folder
            if e.has_unfinished():
                e.step()
    for m, e, rid in zip(models, engines, ids):
        assert [e.requests[i].output for i in rid] == [alone(m, p, 4) for p in prompts]
        assert e.tier_stats["disk_hits"] > 0
    assert len({e.cache.tiers.store_id for e in engines}) == 2


def test_stream_reports_aborts_and_reasons_even_with_a_short_log(model):
    engine = Engine(model, num_blocks=20, block_size=4, max_finished=1)
    a, b = engine.add_request([1, 2], 3), engine.add_request([3, 4], 3)
    c = engine.add_request([5, 6], 3)
    seen = []
    for rid, toks, reason in engine.stream():
        seen.append((rid, len(toks), reason))
        if rid == c and reason is None and engine.requests[c].state == "running":
            engine.abort(c)
    assert (c, 0, "abort") in seen
    assert [s for s in seen if s[0] in (a, b) and s[2] is not None] == [(a, 1, "length"), (b, 1, "length")]
    assert not engine.abort(a)  # ended, and dropped from the log by max_finished: False, not unknown
