"""kvlib.course.ch03: the harnesses chapter 03's cells call measure what they say they measure.

Timings are not checked (they depend on the machine); what each harness computes with them is."""

import matplotlib.pyplot as plt
import pytest
import torch

from kvlib.cache import KVCache
from kvlib.course import ch03
from kvlib.generate import generate
from kvlib.model import ModelConfig, Transformer, load_tiny


@pytest.fixture(scope="module")
def tiny():
    return load_tiny(device="cpu")


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)).eval()


def test_flop_counts_are_chapter_02s_model(tiny):
    model, _ = tiny
    naive, cached = ch03.flop_counts(model, 1, 512)
    assert round(naive / cached) == 268  # chapter 02 prints: "for 512 tokens the naive loop does 268x the FLOPs"
    c = model.config
    P = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "tok_emb" not in n)
    W = c.n_heads * c.head_dim
    f = lambda t_new, t_keys: 2 * P * t_new + 4 * c.n_layers * t_new * t_keys * W  # noqa: E731
    assert ch03.flop_counts(model, 3, 2) == (f(3, 3) + f(4, 4), f(3, 3) + f(1, 4))  # by hand: p = 3, n = 2
    assert ch03.flop_counts(model, 5, 1) == (f(5, 5), f(5, 5))  # one token: both loops run the same prefill


def test_static_cache_decode_step_is_the_model(small):
    prompt = [3, 1, 4, 1, 5]
    cache = ch03.StaticCache(small, 12)
    with torch.no_grad():
        logits = ch03.decode_step(small, cache, torch.tensor([prompt]), torch.arange(5))
        torch.testing.assert_close(logits, small(torch.tensor([prompt]))[:, -1:], atol=1e-5, rtol=1e-5)
    tokens, ms = ch03._greedy_static(ch03.decode_step, small, prompt, 7, 12)
    assert tokens == generate(small, [prompt], 7)[0].tolist() and ms >= 0
    assert all(t.shape == (1, 2, 12, 8) for t in cache.k)  # one fixed shape: (1, H_KV, S_max, D)


def test_compile_comparison_alternates_runs_on_one_cache_shape(small, monkeypatch):
    calls = []

    def fake_compile(fn, mode=None, fullgraph=False):  # the harness's logic, without the minutes of compiling
        calls.append((mode, fullgraph))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    out = ch03.compile_comparison(small, [2, 7, 1], n=6, runs=3, mode="reduce-overhead")
    assert calls == [("reduce-overhead", True)]
    assert len(out["eager"]) == len(out["compiled"]) == 3 and out["same_tokens"] is True and out["compile_s"] >= 0


def test_step_costs_count_more_operators_in_a_cached_step(tiny):
    model, tok = tiny
    out = ch03.step_costs(model, tok.encode("Return "), steps=5, budget_s=0.05)
    assert len(out["tpot"]) == len(out["forward1"]) == 5 and len(out["ttft"]) == len(out["naive"]) >= 3
    assert out["ops_cached"] > out["ops_forward1"] > 0
    assert ch03.count_ops(lambda: torch.ones(3) + 1) == 2  # ones, add


def test_forward_vs_tokens_and_the_plots(tiny):
    model, tok = tiny
    runs = ch03.forward_vs_tokens(model, [1, 2, 4], budget_s=0.01)
    assert [len(r) for r in runs] == [len(runs[0])] * 3 and len(runs[0]) >= 5  # one call per T per round
    ch03.plot_forward_vs_tokens([1, 2, 4], runs)
    ch03.plot_speedup([4, 8, 16], [[3.0, 3.1], [6.0], [12.0]], [[1.0], [1.5], [2.0]])
    from kvlib.course import figures

    assert all(figures.figure_problems(plt.figure(n)) == [] for n in plt.get_fignums())


def test_time_generators_reports_agreement(tiny):
    model, tok = tiny
    t_naive, t_cached, same = ch03.time_generators(model, tok.encode("a"), [2, 3], budget_s=0.01, max_rep=3)
    assert same is True and len(t_naive) == len(t_cached) == 2
    assert all(len(a) == len(b) >= 3 for a, b in zip(t_naive, t_cached))  # alternating runs


def test_time_generators_compares_its_first_timed_runs(tiny, monkeypatch):
    model, tok = tiny
    calls = []
    real_generate = ch03.generate

    def other_tokens(*args, **kw):  # the cached loop made to disagree: the comparison must see it
        calls.append(1)
        return real_generate(*args, **kw) + 1

    monkeypatch.setattr(ch03, "generate", other_tokens)
    t_naive, t_cached, same = ch03.time_generators(model, tok.encode("a"), [2], budget_s=0.0, max_rep=3)
    assert same is False
    assert len(calls) == len(t_cached[0]) == 3  # every cached run is timed: none spent on the check alone


def test_timed_returns_the_result_and_its_time():
    out, ms = ch03.timed(lambda: sum(range(1000)))
    assert out == 499500 and ms >= 0


def test_with_dtype_is_the_checkpoint_read_in_that_dtype(small, tmp_path):
    from kvlib.model import load_hf, save_hf

    save_hf(small, tmp_path)
    fp32 = load_hf(tmp_path)
    read, copied = load_hf(tmp_path, dtype=torch.bfloat16), ch03.with_dtype(fp32, torch.bfloat16)
    a, b = read.state_dict(), copied.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(read(ids), copied(ids))
    assert fp32.dtype == torch.float32  # the original is untouched


def test_store_is_a_copy():
    same, n = ch03.store_is_a_copy()
    assert same is True and n == 2 * 2 * (2 * 2 * 100 * 48)  # two dtypes x (k, v) caches


def test_gpu_reference_draws_the_committed_curves_without_targets(capsys):
    from kvlib import runtime
    from kvlib.bench import results

    if runtime.mode() == "gpu":
        pytest.skip("in GPU mode the harness runs the sweep itself")
    label, rows = results.reference("store")
    lines = ch03.gpu_reference("store", keep=lambda k: k in ("store_kv", "torch slice copy"))
    if not rows:
        assert lines == [results.NO_REFERENCE]
        return
    assert lines and all("store_kv:" in line and "of copy bandwidth" in line for line in lines)
    assert label.split(",")[0] in lines[0] and "target" not in capsys.readouterr().out
    assert plt.get_fignums()  # the curves were drawn


def test_gpu_reference_detail_names_the_conditions_and_ranges(monkeypatch):
    """The detailed lines say which points they pool (the headline rule, dtype, D, B, lengths), give one line per
    head layout with the min–max range, and the ratio's range below the headline sizes: computed from the rows."""
    from kvlib import runtime
    from kvlib.bench import results

    if runtime.mode() == "gpu":
        pytest.skip("CPU mode only")

    def row(kernel, H, S, pct, ratio, headline):
        return {"sweep": "decode", "kernel": kernel, "B": 8, "H": H, "H_KV": 8, "S": S, "D": 128, "dtype": "float16",
                "time_ms": 1.0, "pct_copy_bw": pct, "vs_baseline": ratio, "baseline": "SDPA", "headline": headline,
                "device": "GPU X"}

    rows = [row("decode (no split)", 32, 65536, 10.0, 0.1, 1), row("decode (no split)", 32, 131072, 30.0, 0.3, 1),
            row("decode (no split)", 64, 65536, 5.0, 0.05, 1), row("decode (no split)", 32, 1024, 2.0, 0.02, 0),
            row("SDPA", 32, 65536, 104.0, None, 1), row("SDPA", 32, 131072, 111.0, None, 1)]
    monkeypatch.setattr(results, "reference", lambda sweep, root=None: ("GPU X, driver 1, 2026-01-01", rows))
    lines = ch03.gpu_reference("decode", keep=lambda k: True, detail=True)
    assert lines[0].startswith("GPU X, 2026-01-01, headline points (K/V read ≥ 256 MB)")
    assert "float16, D=128, B 8, S 65,536–131,072" in lines[0]
    assert "decode (no split), 32/8 heads: 20% of copy bandwidth (10–30%), 0.20x SDPA (0.10–0.30x), 2 points" in lines
    assert "decode (no split), 64/8 heads: 5% of copy bandwidth (5–5%), 0.05x SDPA (0.05–0.05x), 1 points" in lines
    assert "SDPA, 32/8 heads: 108% of copy bandwidth (104–111%), 2 points" in lines
    assert lines[-1] == "decode (no split) below the headline sizes (S 1,024): 0.02–0.02x SDPA, 1 points"


def test_gpu_reference_without_results_says_so(monkeypatch):
    from kvlib import runtime
    from kvlib.bench import results

    if runtime.mode() == "gpu":
        pytest.skip("CPU mode only")
    monkeypatch.setattr(results, "reference", lambda sweep, root=None: (None, []))
    assert ch03.gpu_reference("decode", keep=lambda k: True) == [results.NO_REFERENCE]


def test_cache_table_beside_transformers(tiny):
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from kvlib.bench import peers

    model, tok = tiny
    hf = peers.hf_model_from_kvlib(model)
    prompt, n = tok.encode("Return the "), 6
    ids = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
              pad_token_id=0, return_dict_in_generate=True)
    dyn = hf.generate(ids, cache=DynamicCache(config=hf.config), **kw)
    sta = hf.generate(ids, cache_implementation="static", **kw)
    ours = KVCache.for_model(model, 1, len(prompt) + n)
    mine = generate(model, [prompt], n, cache=ours)[0].tolist()
    assert dyn.sequences[0, len(prompt):].tolist() == mine == sta.sequences[0, len(prompt):].tolist()
    table = ch03.cache_table(ours, [dyn.past_key_values, sta.past_key_values])
    assert list(table.index) == ["kvlib KVCache", "transformers DynamicCache", "transformers StaticCache"]
    assert (table["held"] == len(prompt) + n - 1).all() and (table["layers"] == model.config.n_layers).all()
    assert table.loc["kvlib KVCache", "allocated"] == len(prompt) + n
    assert table.loc["transformers DynamicCache", "allocated"] == len(prompt) + n - 1  # exactly what it holds
    c = model.config
    assert table.loc["kvlib KVCache", "K buffer, one layer"] == str((1, c.n_kv_heads, len(prompt) + n, c.head_dim))


def test_tokens_per_s_and_decode_step_bytes(small):
    tps, runs = ch03.tokens_per_s(lambda: None, 10, budget_s=0.01, max_rep=3)
    assert len(runs) == 3 and tps > 0
    times, nbytes = ch03.decode_step_bytes(small, 8, [1, 2, 3])
    c = small.config
    weights = sum(p.numel() * 4 for p in small.parameters())
    mean_depth = 8 + (1 + len(times)) / 2
    assert nbytes == weights + 2 * c.n_layers * c.n_kv_heads * c.head_dim * mean_depth * 4


def test_matvec_stream_and_cpu_flags():
    out = ch03.matvec_stream((64, 32), total_bytes=64 * 32 * 4 * 3, budget_s=0.01)
    assert set(out) == {torch.float32, torch.bfloat16} and all(g > 0 and len(r) >= 3 for g, r in out.values())
    flags = ch03.cpu_flags()
    assert flags == {} or set(flags) == {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def test_lab_decode_checks_its_inputs():
    launch = ch03.lab_decode(kernel=None)  # the checks come before any launch
    q = torch.zeros(1, 2, 16, dtype=torch.float16)
    k = torch.zeros(1, 1, 8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp32 tensors, a power-of-two D"):
        launch(q, k, k, torch.tensor([3]))
    with pytest.raises(ValueError, match="H_KV dividing H"):
        launch(torch.zeros(1, 3, 16), torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), torch.tensor([3]))
