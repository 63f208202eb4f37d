"""kvlib.bench.peers: kvlib's engine and transformers' two engines agree token for token (tiny model).

The figures are not checked here (they depend on the machine); the CLI measures them on SmolLM2.
"""

import subprocess
import sys

import pytest
import torch

from kvlib.bench import peers
from kvlib.generate import generate
from kvlib.model import load_tiny

N = 6  # new tokens per request


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_tiny(device="cpu")
    return model


@pytest.fixture(scope="module")
def hf(tiny):
    pytest.importorskip("transformers")
    return peers.hf_model_from_kvlib(tiny)


@pytest.fixture(scope="module")
def prompts():
    """Lengths 3 (shorter than a block), 16 (exactly one), 37 and 70 (ragged, several blocks)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in (3, 16, 37, 70)]


def test_hf_twin_has_the_same_logits(tiny, hf, prompts):
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        err = (hf(ids).logits - tiny(ids)).abs().max().item()
    assert err <= 1e-4, f"max |transformers logits - kvlib logits| = {err:.3g}"


def test_three_runners_are_token_identical(tiny, hf, prompts):
    ref = [generate(tiny, [p], N)[0].tolist() for p in prompts]  # one request at a time, no batching
    kv, kv_stats = peers.run_kvlib_engine(tiny, prompts, N, block_size=16, max_batched_tokens=32)
    cb, cb_stats = peers.run_hf_continuous(hf, prompts, N, page_size=16, max_batch_tokens=32)
    st, st_stats = peers.run_hf_static(hf, prompts, N)
    st2, _ = peers.run_hf_static(hf, prompts, N, batch_size=3)  # two batches: 3 prompts, then 1
    for name, outs in [("kvlib Engine", kv), ("generate_batch", cb), ("generate", st), ("generate bs=3", st2)]:
        assert outs == ref, f"{name}: first mismatch per request " + str(
            [peers.first_mismatch(r, o) for r, o in zip(ref, outs)])
    for s in (kv_stats, cb_stats, st_stats):
        assert s["new_tokens"] == N * len(prompts) and s["wall_s"] > 0 and s["tokens_per_s"] > 0
        assert 0 < s["serve_s"] <= s["wall_s"] + 1e-9
        assert len(s["ttft_s"]) == len(prompts) and all(t is not None and t > 0 for t in s["ttft_s"])


def test_side_by_side_table_and_threads_restored(tiny, hf, prompts):
    before = torch.get_num_threads()
    df = peers.side_by_side(tiny, prompts[:3], 4, threads=1, hf_model=hf, warmup=False,
                            engine_kw=dict(max_batched_tokens=32))
    assert torch.get_num_threads() == before
    assert list(df.index) == list(peers.RUNNERS.values())
    assert (df["identical"] == "3/3").all() and (df["first_mismatch"] == "-").all()
    assert df.loc["kvlib Engine", "kvlib_x"] == 1.0
    for col in ("tokens_per_s", "wall_s", "serve_tokens_per_s", "ttft_median_s", "ttft_p99_s", "kvlib_x",
                "ttft_median_ratio"):
        assert (df[col] > 0).all(), col
    assert df.attrs["threads"] == 1 and df.attrs["mismatches"] == {k: {} for k in peers.RUNNERS}


def test_first_mismatch():
    assert peers.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert peers.first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert peers.first_mismatch([1, 2, 3], [1, 2]) == 2


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="non-empty list"):
        peers.run_kvlib_engine(tiny, [], 4)
    with pytest.raises(TypeError, match=r"prompts\[0\]"):
        peers.run_kvlib_engine(tiny, ["hello"], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        peers.run_kvlib_engine(tiny, [[1, 2]], 0)


def test_without_transformers_imports_and_says_how_to_install():
    """kvlib never needs transformers: the module imports without it; its runners say what is missing."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import kvlib.bench.peers as p\n"
            "try:\n    p.hf_model_from_kvlib(None)\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError: kvlib.bench.peers compares kvlib with Hugging Face transformers" in out.stdout
    assert "pip install transformers" in out.stdout
