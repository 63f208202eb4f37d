"""The naive decoding loop: greedy by hand, ragged batches, seeded sampling, EOS."""

import pytest
import torch

from kvlib.generate import generate_naive, pad_prompts, sample_next




def greedy_by_hand(model, prompt, n):
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_greedy_matches_a_hand_written_loop(model):
    prompt = [5, 9, 1, 33, 7]
    out = generate_naive(model, torch.tensor([prompt]), 12)
    assert out.shape == (1, 12)
    assert out[0].tolist() == greedy_by_hand(model, prompt, 12)


def test_ragged_batch_gives_each_prompt_its_own_answer(model):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    out = generate_naive(model, prompts, 10)
    for b, p in enumerate(prompts):
        assert out[b].tolist() == greedy_by_hand(model, p, 10), f"prompt {b}"


def test_seeded_sampling_is_reproducible_and_differs_across_seeds(model):
    prompts = [[1, 2, 3], [7, 8]]
    a = generate_naive(model, prompts, 20, temperature=1.0, top_k=20, seed=1)
    b = generate_naive(model, prompts, 20, temperature=1.0, top_k=20, seed=1)
    c = generate_naive(model, prompts, 20, temperature=1.0, top_k=20, seed=2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_1_is_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, 0.7, top_k=1, generator=g), logits.argmax(-1))


def test_top_k_never_samples_outside_the_top_k():
    logits = torch.arange(10.0).repeat(200, 1)
    tokens = sample_next(logits, 5.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= {7, 8, 9}


def test_stops_at_eos(model):
    prompt = [3, 4, 5]
    free = generate_naive(model, [prompt], 15)[0].tolist()
    eos = free[4]  # pretend the 5th generated token is end-of-text
    stopped = generate_naive(model, [prompt], 15, eos_id=eos)[0].tolist()
    first = free.index(eos)
    assert stopped == free[: first + 1]


def test_finished_sequences_are_padded_with_eos_while_others_continue(model):
    prompts = [[3, 4, 5], [9, 9, 9, 2]]
    free = generate_naive(model, prompts, 12)
    eos = free[0, 2].item()
    out = generate_naive(model, prompts, 12, eos_id=eos)
    first = free[0].tolist().index(eos)
    assert (out[0, first:] == eos).all()


def test_pad_prompts_positions_ignore_padding():
    ids, mask, pos = pad_prompts([[7, 8, 9], [5]])
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize("kw, match", [({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k")])
def test_bad_sampling_arguments(model, kw, match):
    with pytest.raises(ValueError, match=match):
        generate_naive(model, [[1]], 2, **kw)


def test_bad_prompts(model):
    with pytest.raises(ValueError, match="at least one token"):
        generate_naive(model, [[1, 2], []], 2)
    with pytest.raises(ValueError, match=r"\(B, T\) integer tensor"):
        generate_naive(model, torch.zeros(2, 3), 2)


# ---- the cached generator (chapter 03) must give exactly the naive loop's tokens ----

from kvlib.cache import CacheFullError, KVCache  # noqa: E402
from kvlib.generate import generate  # noqa: E402


@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("prompts", [[[1, 2, 3, 4]], [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]], ids=["one", "ragged3"])
def test_cached_greedy_is_token_identical_to_naive(model_for, prompts, kernels):
    model = model_for(kernels)
    naive = generate_naive(model, prompts, 24)
    cached = generate(model, prompts, 24, cache="contiguous", kernels=kernels)
    assert torch.equal(naive, cached)


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_cached_seeded_sampling_is_token_identical_to_naive(model_for, kernels):
    model = model_for(kernels)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    kw = dict(temperature=0.9, top_k=30, seed=7)
    assert torch.equal(generate_naive(model, prompts, 24, **kw), generate(model, prompts, 24, kernels=kernels, **kw))


def test_cached_eos_behaviour_matches_naive(model):
    prompts = [[3, 4, 5], [9, 9, 9, 2]]
    eos = generate_naive(model, prompts, 12)[0, 2].item()
    assert torch.equal(generate_naive(model, prompts, 12, eos_id=eos), generate(model, prompts, 12, eos_id=eos))


def test_cache_capacity_overflow_is_a_clear_error(model):
    with pytest.raises(CacheFullError, match="holds 10 positions"):
        generate(model, [[1, 2, 3, 4]], 20, max_len=10)


def test_a_ready_made_cache_object_can_be_passed(model):
    cache = KVCache.for_model(model, batch=1, max_len=64)
    out = generate(model, [[1, 2, 3]], 10, cache=cache)
    assert torch.equal(out, generate_naive(model, [[1, 2, 3]], 10))
    assert int(cache.seq_lens[0]) == 3 + 9  # the last sampled token is never fed back


def test_unknown_cache_name(model):
    with pytest.raises(ValueError, match="cache must be"):
        generate(model, [[1]], 2, cache="magic")


@pytest.mark.parametrize("cache", [None, "contiguous"])
def test_a_finished_run_ends_its_progress_bar_complete(model, monkeypatch, cache):
    # tqdm marks a bar closed before its total as failed (red in JupyterLab): the bar must reach its total,
    # also when the cached loop skips the last forward and when every sequence stopped early at EOS
    import tqdm.auto

    from kvlib.generate import generate

    closed = []

    class Recorder(tqdm.auto.tqdm):
        def close(self):
            closed.append((self.n, self.total))
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    prompt = [[5, 6, 7]]
    run = (lambda **kw: generate_naive(model, prompt, **kw)) if cache is None else (
        lambda **kw: generate(model, prompt, cache=cache, **kw))
    out = run(max_new_tokens=6, progress=True)
    assert out.shape == (1, 6) and closed[-1] == (6, 6)
    eos = int(out[0, 2])  # the third greedy token: stop there
    out = run(max_new_tokens=6, progress=True, eos_id=eos)
    stopped = int((out[0] == eos).nonzero()[0]) + 1
    assert stopped < 6 and closed[-1] == (stopped, stopped)
