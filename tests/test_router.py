"""kvlib.dist.router: the prefix score, the KV events, the index, the load cap, and the simulated replicas.

The replicas are Engine objects in this process (the simplification the chapter names); hit rates and prefill
tokens come from the engines' own prefix caches.
"""

import pytest
import torch

from kvlib.dist import router
from kvlib.engine import Engine
from kvlib.model import ModelConfig, Transformer
from kvlib.paged import chained_block_hashes

KW = dict(num_blocks=30, block_size=16, max_num_seqs=4, max_batched_tokens=64)


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(ModelConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()


def test_prefix_score_is_a_run_from_the_first_block():
    assert router.prefix_score([1, 2, 3], {1, 2, 3}) == 3
    assert router.prefix_score([1, 2, 3], {2, 3}) == 0  # no first block: nothing usable
    assert router.prefix_score([1, 2, 3], {1, 3}) == 1
    assert router.prefix_score([], {1}) == 0


def test_events_follow_the_engines_cache(model):
    e = Engine(model, **KW)
    rep = router.Replica("r", e)
    prompt = list(range(50))  # 3 full blocks (the last token is never cached)
    e.add_request(prompt, 2)
    e.run()
    ev = rep.events()
    assert sorted(h for k, h in ev if k == "stored") == sorted(e.cache.hash_to_block)
    assert set(chained_block_hashes(prompt, 16, 3)) <= {h for _, h in ev}
    assert rep.events() == []  # nothing new
    e.drop_prefix_cache()
    assert sorted(h for k, h in rep.events() if k == "removed") == sorted(h for _, h in ev)
    r = router.Router(1, 16)
    r.apply(0, ev)
    assert r.scores(prompt + [1, 2]) == [3]


def test_route_picks_the_longest_run_then_the_least_loaded_and_the_cap():
    r = router.Router(2, 4, "prefix", max_load=3)
    p = list(range(13))
    hs = r.hashes(p)
    assert len(hs) == 3
    r.apply(1, [("stored", h) for h in hs[:2]])
    assert r.route(p, [0, 0]) == 1
    assert r.route([9] * 13, [2, 1]) == 1  # no hit anywhere: the least loaded
    assert r.route(p, [0, 3]) == 0 and r.fallbacks == 1  # its best replica is at the cap
    assert r.route(p, [3, 3]) == 0  # every replica at the cap: the least loaded (ties: the lowest index)
    rr = router.Router(2, 4, "round_robin")
    assert [rr.route(p, [0, 0]) for _ in range(4)] == [0, 1, 0, 1]


def test_prefix_routing_beats_round_robin_and_the_cap_spreads_a_hot_document(model):
    trace = router.rag_trace(n_requests=32, n_docs=6, doc_len=96, max_new=2, seed=0)
    runs = {p: router.simulate(model, trace, p, **KW) for p in router.POLICIES}
    prompt = sum(len(t["prompt"]) for t in trace)
    hit = {p: sum(o["cached"]) / prompt for p, o in runs.items()}
    assert hit["prefix"] > hit["round_robin"]
    for o in runs.values():  # the counts come from the engines
        assert sum(p["requests"] for p in o["per_replica"]) == len(trace)
        assert sum(p["cached tokens"] for p in o["per_replica"]) == sum(o["cached"])
        assert all(len(x) == 2 for x in o["outputs"])
    assert runs["prefix"]["outputs"] == runs["round_robin"]["outputs"]
    hot = router.rag_trace(n_requests=24, n_docs=1, doc_len=96, max_new=6, seed=0)
    piled = router.simulate(model, hot, "prefix", **KW)
    capped = router.simulate(model, hot, "prefix", max_load=3, **KW)
    assert [p["requests"] for p in piled["per_replica"]] == [24, 0]
    assert min(p["requests"] for p in capped["per_replica"]) > 0 and capped["router"].fallbacks > 0
    assert max(capped["ttft"]) < max(piled["ttft"])


def test_bad_inputs_name_the_argument(model):
    with pytest.raises(ValueError, match="policy must be one of"):
        router.Router(2, 16, "random")
    with pytest.raises(ValueError, match="n_replicas"):
        router.Router(0, 16)
    with pytest.raises(TypeError, match="block_size"):
        router.Router(2, 16.0)
    with pytest.raises(ValueError, match="max_load"):
        router.Router(2, 16, max_load=0)
    with pytest.raises(ValueError, match="loads must give one number per replica"):
        router.Router(2, 16).route([1, 2], [0])
    with pytest.raises(ValueError, match="unknown KV event kind"):
        router.Router(2, 16).apply(0, [("evicted", 1)])
    with pytest.raises(TypeError, match="engine must be a kvlib.engine.Engine"):
        router.Replica("r", object())
    with pytest.raises(ValueError, match="trace must hold"):
        router.simulate(model, [], "prefix", **KW)


def test_the_hash_run_picture_counts_the_router_index(model):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlib.course.draw import cells_with
    from kvlib.course.draw import transfer as draw_transfer

    trace = router.rag_trace(n_requests=12, n_docs=3, doc_len=64, max_new=2, seed=1)
    out = router.simulate(model, trace, "prefix", **KW)
    docs = router.documents(trace, 64)
    fig = draw_transfer.hash_runs(out["router"], docs, 16)
    held = sum(h in out["router"].index[k] for k in range(2) for d in docs.values() for h in chained_block_hashes(d, 16, 4))
    assert cells_with(fig, "filled") == held > 0
    assert cells_with(fig, "filled") + cells_with(fig, "empty") == 2 * len(docs) * 4
    plt.close(fig)
