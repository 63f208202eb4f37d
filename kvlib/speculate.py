"""Speculative decoding (chapter 11): guess k tokens cheaply, check them in one forward, roll the cache back.

A decoding step reads the whole KV cache to produce one token; on a GPU it is bound by that read, not by
arithmetic, so one forward over k + 1 tokens costs about what a forward over one costs. Speculative decoding
spends that slack: a cheap *drafter* proposes k tokens, the target model scores all of them in one forward
over its cache (a multi-token decode), keeps the longest prefix it agrees with plus one token of its own,
and *truncates* its cache back to what it kept. The output is the target model's own: token for token under
greedy decoding, in distribution under sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", arXiv:2211.17192; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling", arXiv:2302.01318).

What you will learn:
- two drafters: ``prompt_lookup`` (no model: the last n tokens are searched for earlier in the prompt and
  the text so far, and what followed them there is proposed; "prompt lookup decoding", Saxena 2023,
  github.com/apoorvumang/prompt-lookup-decoding) and ``LayerSkipDrafter`` (the target model itself with
  layers skipped, a self-speculative drafter with its own, smaller cache that is rolled back too);
- verification: positions from ``cache.next_positions()``, T = k + 1 tokens (the last accepted token first,
  then the drafts), one forward; ``greedy_accept`` and ``speculative_accept`` (the rejection rule);
- the invariant that keeps it exact: after every step the cache holds the prompt and every emitted token
  but the last, which is fed first in the next step — the same invariant ``kvlib.generate.generate`` keeps.
  Rewinding one token too many or too few is the classic bug (``SpeculativeResult.held`` records it);
- ``truncate`` on every cache kind (``KVCache``, ``Int8KVCache``, ``KiviCache``, ``PagedKVCache``,
  ``BudgetCache``): what a rollback must restore (KIVI: the full-precision rows of a key group the call
  quantized and the cut reopens), and why an eviction cannot be rolled back;
- why a quantized cache needs its own verification (``KiviVerifySeam``): plain decoding reads the call's
  older tokens through their codes once they leave the exact window, KIVI's multi-token call reads them exact.

Batch 1 only here (one prompt): batched speculation has sequences accepting different numbers of tokens,
which the paged cache's ragged batches (chapter 08) can carry; it is left out of this teaching version.
"""

from __future__ import annotations

import numbers

import time
from dataclasses import dataclass, field

import torch

from .cache import KVCache, check_int
from .generate import _check_sampling, check_prompt_fits, make_cache, prompt_lists

__all__ = ["prompt_lookup", "PromptLookupDrafter", "LayerSkipDrafter", "greedy_accept", "speculative_accept",
           "speculative_generate", "SpeculativeResult", "truncate_cache", "KiviVerifySeam"]


# --------------------------------------------------------------------------------------------
# Drafters
# --------------------------------------------------------------------------------------------


def prompt_lookup(tokens, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens (n from
    ``max_ngram`` down to ``min_ngram``, the longest match first); [] when none occurs.

    ``tokens``: the prompt and everything generated so far. The match must end before the last token (the
    n-gram itself always occurs at the end). Simplification named: Hugging Face's
    ``PromptLookupCandidateGenerator`` and the original code take the *first* match in the text; here the
    most recent one, which on edited code is usually the version being edited.

    >>> text = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6]
    >>> prompt_lookup(text, k=3)  # "5 6" last came before 7 2 3 (the longest n = 3 "3 5 6" never occurs before)
    [7, 2, 3]
    >>> prompt_lookup(text, k=3, min_ngram=3), prompt_lookup([1, 2, 3], k=2)
    ([], [])
    """
    k = check_int("k", k, minimum=0)
    max_ngram, min_ngram = check_int("max_ngram", max_ngram), check_int("min_ngram", min_ngram)
    if min_ngram > max_ngram:
        raise ValueError(f"min_ngram must be <= max_ngram, got {min_ngram} > {max_ngram}")
    tokens = list(tokens)
    L = len(tokens)
    if k == 0:
        return []
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        pattern = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):  # most recent first; start + n <= L - 1: something follows
            if tokens[start: start + n] == pattern:
                return tokens[start + n: start + n + k]
    return []


class PromptLookupDrafter:
    """``prompt_lookup`` as a drafter: deterministic proposals (the draft distribution q is one-hot), no model,
    no cache, nothing to roll back.

    >>> drafter = PromptLookupDrafter(max_ngram=2)
    >>> drafter.propose([1, 2, 3, 9, 1, 2], k=2)
    ([3, 9], None)
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        prompt_lookup([], 0, max_ngram, min_ngram)  # checks the two sizes
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.forwards = 0  # model forwards spent drafting (none)

    def reset(self, max_len: int):
        """Start a new generation (nothing to do)."""

    def propose(self, context, k, temperature=0.0, top_k=None, generator=None):
        """(up to k draft tokens following ``context``, their draft probabilities: None = one-hot)."""
        return prompt_lookup(context, k, self.max_ngram, self.min_ngram), None


class _LayerSubset:
    """The model's seam over a cache of len(layers) layers: layer ``layers[j]`` uses the cache's layer j."""

    def __init__(self, cache, layers):
        self.cache, self.slot = cache, {layer: j for j, layer in enumerate(layers)}

    def attend(self, layer_idx, q, k, v):
        return self.cache.attend(self.slot[layer_idx], q, k, v)


def forward_layers(model, ids: torch.Tensor, positions: torch.Tensor, layers, cache=None) -> torch.Tensor:
    """The model run through ``layers`` only (the others skipped: the residual stream passes them unchanged),
    with a cache of len(layers) layers; the last position's logits (B, V) in fp32."""
    x = model.tok_emb(ids)
    cos, sin = model.rope(positions, x.dtype)
    seam = None if cache is None else _LayerSubset(cache, layers)
    mask = None
    if cache is None:
        T = ids.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()[None, None]
    for i in layers:
        x = model.layers[i](x, cos, sin, mask, seam)
    return model.lm_head(model.norm(x[:, -1])).float()


class LayerSkipDrafter:
    """The target model with only ``layers`` run: a self-speculative draft model sharing the tokenizer,
    with its own contiguous cache over those layers (Zhang et al. 2023, "Draft & Verify: Lossless Large
    Language Model Acceleration via Self-Speculative Decoding", arXiv:2309.08168, skips intermediate
    layers; LayerSkip, Elhoushi et al. 2024, arXiv:2404.16710, exits early after the first E layers and
    trains the model for it). Simplifications named: the layers are chosen by hand, not searched
    (Draft & Verify uses Bayesian optimisation), and the model is not trained to be skipped.

    The drafter's cache is rolled back too: it remembers the tokens its cache holds, and each ``propose``
    truncates it to the prefix it shares with the real text (rejected drafts are cut), feeds the new
    tokens in one call, then drafts one token per call.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> with torch.random.fork_rng():
    ...     _ = torch.manual_seed(0)
    ...     model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=4, n_heads=2, hidden_dim=64)).eval()
    >>> drafter = LayerSkipDrafter(model, layers=[0, 1])
    >>> drafter.reset(max_len=16)
    >>> draft, q = drafter.propose([1, 2, 3], k=3)
    >>> len(draft), drafter.cache.held(0)  # prompt + the first 2 drafts are cached; the 3rd is never fed
    (3, 5)
    """

    def __init__(self, model, layers, kernels=None):
        n = model.config.n_layers
        layers = [check_int("layers[i]", i, minimum=0) for i in layers]
        if not layers or any(i >= n for i in layers) or layers != sorted(set(layers)):
            raise ValueError(f"layers must be distinct, ascending layer indices in 0..{n - 1}, got {layers}")
        self.model, self.layers, self.kernels = model, layers, kernels
        self.cache, self.tokens, self.forwards = None, [], 0

    def reset(self, max_len: int):
        """A fresh cache of ``max_len`` positions over the kept layers."""
        c = self.model.config
        self.cache = KVCache(len(self.layers), 1, c.n_kv_heads, check_int("max_len", max_len), c.head_dim,
                             self.model.dtype, self.model.device, self.kernels)
        self.tokens = []

    @torch.no_grad()
    def _next(self, ids, start, temperature, top_k, generator):
        positions = torch.arange(start, start + len(ids), device=self.model.device)[None]
        logits = forward_layers(self.model, torch.tensor([ids], device=self.model.device), positions, self.layers,
                                self.cache)[0]
        self.forwards += 1
        self.tokens += ids
        if temperature == 0:
            return int(logits.argmax()), None
        probs = target_probs(logits[None], temperature, top_k)[0]
        return int(torch.multinomial(probs.cpu(), 1, generator=generator)), probs

    def propose(self, context, k, temperature=0.0, top_k=None, generator=None):
        """(k draft tokens following ``context``, their draft distributions (k, V), or None when greedy)."""
        if self.cache is None:
            raise RuntimeError("call reset(max_len) before propose")
        context = list(context)
        keep = 0
        for a, b in zip(self.tokens, context[:-1]):  # the cache's tokens that are still the real text
            if a != b:
                break
            keep += 1
        self.cache.truncate(0, keep)  # the rollback: rejected drafts leave the drafter's cache
        del self.tokens[keep:]
        draft, dists = [], []
        feed = context[keep:]
        for i in range(k):
            tok, probs = self._next(feed, len(self.tokens), temperature, top_k, generator)
            draft.append(tok)
            dists.append(probs)
            feed = [tok]
            if i == k - 1:  # the last draft is not fed: the target's verification decides what follows
                break
        return draft, (None if temperature == 0 or not draft else torch.stack(dists))


# --------------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------------


def target_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None) -> torch.Tensor:
    """(T, V) logits -> (T, V) sampling probabilities, the distribution ``kvlib.generate.sample_next`` draws from."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _check_draft(draft, vocab: int) -> list[int]:
    """The draft as a list of token ids in [0, vocab), or a ValueError naming the first one that is not."""
    ids = draft.tolist() if isinstance(draft, torch.Tensor) else list(draft)
    for i, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x < vocab:
            raise ValueError(f"draft[{i}] must be a token id in [0, {vocab}) (the vocabulary of the target's rows), "
                             f"got {x!r}")
    return ids


def _check_distribution(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` if each row is a probability distribution (finite, >= 0, sums to 1 within 1e-3), else a ValueError:
    the rejection rule's guarantee holds only for distributions (pass probabilities, not logits)."""
    sums = t.sum(dim=-1)
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()) or not bool(((sums - 1).abs() <= 1e-3).all()):
        raise ValueError(f"{name} must hold probabilities, each row >= 0 and summing to 1 (softmax of the logits, "
                         f"e.g. target_probs), got row sums {[round(float(x), 4) for x in sums[:4]]}"
                         f"{' ...' if len(sums) > 4 else ''}")
    return t


def greedy_accept(logits: torch.Tensor, draft) -> tuple[int, int]:
    """(drafts accepted, the target's next token) under greedy decoding: accept while each draft equals the
    target's argmax at its position, then take the target's own token there.

    logits (d + 1, V): row i is the target's prediction after the last accepted token and drafts 0..i-1.

    >>> logits = torch.tensor([[0., 5, 0], [0, 0, 5], [5, 0, 0]])  # the target wants 1, then 2, then 0
    >>> greedy_accept(logits, [1, 2]), greedy_accept(logits, [1, 0]), greedy_accept(logits, [])
    ((2, 0), (1, 2), (0, 1))
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a (d + 1, V) tensor, one row per draft position and one past them, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    draft = _check_draft(draft, logits.shape[1])
    if logits.shape[0] < len(draft) + 1:
        raise ValueError(f"logits has {logits.shape[0]} row(s) for {len(draft)} draft token(s): it needs d + 1 = "
                         f"{len(draft) + 1} (the target's prediction at every draft position and one past them)")
    target = logits.argmax(dim=-1).tolist()
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return a, target[a]


def speculative_accept(p: torch.Tensor, q: torch.Tensor | None, draft, generator=None) -> tuple[int, int]:
    """The rejection rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): (drafts accepted, next token).

    p (d + 1, V): the target's probabilities at the d draft positions and one past them; q (d, V): the
    drafter's, or None for a deterministic drafter (q one-hot on its draft). Draft x_i is accepted with
    probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the next token is drawn from
    norm(max(0, p_i - q_i)); if all d are accepted, a bonus token is drawn from p_d. Every emitted token
    is then distributed exactly as the target alone would sample it.

    >>> p = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # the target is sure: 1, then 0
    >>> speculative_accept(p, None, [1]), speculative_accept(p, None, [0])  # p(0) = 0: rejected, resample
    ((1, 0), (0, 1))
    """
    d = len(draft)
    if not isinstance(p, torch.Tensor) or p.dim() != 2 or p.shape[0] != d + 1:
        raise ValueError(f"p must be (d + 1, V) = ({d + 1}, V) for {d} draft token(s), got "
                         f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}")
    if q is not None and (not isinstance(q, torch.Tensor) or tuple(q.shape) != (d, p.shape[1])):
        raise ValueError(f"q must be (d, V) = ({d}, {p.shape[1]}) or None, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    draft = _check_draft(draft, p.shape[1])
    p = _check_distribution("p", p.float().cpu())
    q = None if q is None else _check_distribution("q", q.float().cpu())
    for i, x in enumerate(draft):
        qx = 1.0 if q is None else float(q[i, x])
        if float(torch.rand((), generator=generator)) * qx < float(p[i, x]):  # u < p/q, without dividing by 0
            continue
        q_i = torch.zeros_like(p[i]).index_fill_(0, torch.tensor([x]), 1.0) if q is None else q[i]
        residual = (p[i] - q_i).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q: a rejection has probability 0; never reached in exact arithmetic
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return d, int(torch.multinomial(p[d], 1, generator=generator))


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


@dataclass
class SpeculativeResult:
    """What one speculative generation did. ``tokens``: the new tokens; per verification step ``drafted`` /
    ``accepted`` counts and ``held`` (the cache's next position after the step's truncate, always prompt +
    tokens so far - 1); ``target_forwards`` (prefill included) and ``draft_forwards``; ``exact``: whether every
    truncate was exact (False only with an evicting cache); ``seconds``: wall time of the whole call.

    >>> res = SpeculativeResult(tokens=[5, 6, 7, 8, 9], drafted=[4, 4], accepted=[3, 0], target_forwards=3)
    >>> res.acceptance_rate, res.tokens_per_forward  # 3 of 8 drafts taken; 4 tokens after the first in 2 steps
    (0.375, 2.0)
    """

    tokens: list = field(default_factory=list)
    drafted: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    held: list = field(default_factory=list)
    target_forwards: int = 0
    draft_forwards: int = 0
    exact: bool = True
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens (nan when nothing was drafted). Drafts after a step's first
        rejection are never checked and count as not accepted, so this share falls as k grows even when
        each checked draft is as likely to pass; ``alpha`` is the per-draft rate."""
        n = sum(self.drafted)
        return sum(self.accepted) / n if n else float("nan")

    @property
    def alpha(self) -> float:
        """The chance that a checked draft is accepted: accepted / (accepted + rejections), a rejection being
        a step that accepted fewer drafts than it drafted. This is Leviathan et al.'s alpha (section 3.1), for
        which k independent drafts give (1 - alpha^(k+1)) / (1 - alpha) tokens per forward.

        >>> SpeculativeResult(drafted=[4, 4, 2], accepted=[4, 1, 0]).alpha  # 5 accepted, 2 rejected
        0.7142857142857143
        """
        accepted = sum(self.accepted)
        checked = accepted + sum(a < d for a, d in zip(self.accepted, self.drafted))
        return accepted / checked if checked else float("nan")

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target forward after the prefill (1.0 for plain decoding)."""
        steps = self.target_forwards - 1
        return (len(self.tokens) - 1) / steps if steps else float("nan")


def _is_paged(cache) -> bool:
    from .paged import PagedKVCache

    return isinstance(cache, PagedKVCache)


class KiviVerifySeam:
    """The seam for verifying T drafted tokens over a ``KiviCache`` (batch 1) as T single-token steps would see it.

    ``KiviCache`` attends a multi-token call over what it holds plus the call's own tokens *exact* (KIVI's
    prefill rule). Single-token decoding does not: by the time it reaches the call's j-th token, keys may have
    left the exact window a group at a time and values one at a time, so it reads them through their codes.
    A verification that must match plain decoding token for token therefore attends query j over the layout
    the cache has at length n + j: codes for the first ``n_kq(n + j)`` keys and ``n_vq(n + j)`` values, exact
    rows after them. The cache stores the T tokens as usual (its own attend; its output is not used), the
    codes are read back from it and the exact rows are the window's plus the call's own.

    Cost named: T separate attention reads plus the cache's own, where a fused kernel would do one pass with
    a per-query boundary; the course's KIVI kernel has no such mode, so this runs in PyTorch (fp32, as
    ``kivi_decode_attention_ref``).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> from kvlib.kivi import KiviCache
    >>> from kvlib.generate import generate
    >>> with torch.random.fork_rng():
    ...     _ = torch.manual_seed(0)
    ...     model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> kivi = lambda: KiviCache.for_model(model, 1, 64, bits=2, group=4, residual=4, kernels="torch")
    >>> prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    >>> res = speculative_generate(model, prompt, 20, k=4, cache=kivi())  # verifies through this seam
    >>> res.tokens == generate(model, [prompt], 20, cache=kivi())[0].tolist()
    True
    """

    def __init__(self, cache):
        if cache.seq_lens.shape[0] != 1:
            raise ValueError("KiviVerifySeam verifies one sequence (a batch-1 cache)")
        self.cache = cache

    def attend(self, layer_idx, q, k, v):
        from .cache import decode_attention_ref
        from .kivi import _dequantize_keys, _dequantize_values

        c, T = self.cache, q.shape[2]
        if T == 1:
            return c.attend(layer_idx, q, k, v)
        n = int(c.seq_lens[0])
        nk0, nv0 = int(c._n_kq(n)), int(c._n_vq(n))
        exact_k = torch.cat([c.k[layer_idx][:, :, :n - nk0], k], dim=2)  # positions nk0 .. n + T - 1
        exact_v = torch.cat([c.v[layer_idx][:, :, :n - nv0], v], dim=2)  # positions nv0 .. n + T - 1
        c.attend(layer_idx, q, k, v)  # stores the T tokens (and slides the windows) as the cache always does
        i, out = layer_idx, torch.empty_like(q)
        for j in range(T):
            nk, nv = int(c._n_kq(n + j)), int(c._n_vq(n + j))  # the layout when plain decoding reads token n + j
            keys = torch.cat([_dequantize_keys(c.k_packed[i], c.k_scale[i], c.k_zero[i], nk, c.group, c.bits,
                                               torch.float32), exact_k[:, :, nk - nk0: n + j + 1 - nk0].float()], 2)
            values = torch.cat([_dequantize_values(c.v_packed[i], c.v_scale[i], c.v_zero[i], nv, c.bits,
                                                   torch.float32), exact_v[:, :, nv - nv0: n + j + 1 - nv0].float()], 2)
            lens = torch.tensor([n + j + 1], device=q.device)
            out[:, :, j] = decode_attention_ref(q[:, :, j].float(), keys, values, lens).to(q.dtype)
        return out


def truncate_cache(cache, length: int) -> bool:
    """Cut sequence 0 of any course cache back to ``length`` positions; whether that was exact (see each
    cache's ``truncate``; the paged cache's is always exact). A cache without ``truncate`` raises TypeError.

    >>> cache = KVCache(n_layers=1, batch=1, n_kv_heads=1, max_len=8, head_dim=4)
    >>> _ = cache.attend(0, *(torch.ones(1, 1, 4, 4) for _ in range(3)))
    >>> truncate_cache(cache, 2), cache.held(0)
    (True, 2)
    """
    _check_truncatable(cache)
    exact = cache.truncate(0, length)
    return True if exact is None else bool(exact)


def _check_truncatable(cache):
    """A TypeError unless ``cache`` can be rolled back: it has ``truncate``, and a paged cache is no subclass
    that changes its blocks behind PagedKVCache's truncate (``PagedWindowCache`` evicts them)."""
    from .paged import PagedKVCache

    if not hasattr(cache, "truncate"):
        raise TypeError(f"{type(cache).__name__} has no truncate: speculative decoding cannot roll it back")
    if isinstance(cache, PagedKVCache) and type(cache) is not PagedKVCache \
            and type(cache).truncate is PagedKVCache.truncate:
        raise TypeError(f"{type(cache).__name__} changes its blocks beyond PagedKVCache (it evicts them): "
                        "PagedKVCache.truncate cannot say whether its rollback is exact")


def _is_kivi(cache) -> bool:
    from .kivi import KiviCache

    return isinstance(cache, KiviCache)


def _held(cache) -> int:
    """Positions sequence 0 holds: what ``truncate`` counts."""
    return cache.lens[0] if _is_paged(cache) else int(cache.seq_lens[0])


def _next_position(cache) -> int:
    """Sequence 0's next position (positions a compressing cache dropped included)."""
    return int(cache.next_positions()[0, 0])


def _first_prompt(ids) -> list[int]:
    prompts = prompt_lists(ids if not (isinstance(ids, list) and ids and isinstance(ids[0], int)) else [ids])
    if len(prompts) != 1:
        raise ValueError(f"ids must hold one prompt (speculative decoding here is batch 1), got {len(prompts)}")
    return prompts[0]


@torch.no_grad()
def speculative_generate(model, ids, max_new_tokens: int, *, drafter=None, k: int = 4, cache="contiguous",
                         temperature: float = 0.0, top_k: int | None = None, seed: int | None = None,
                         eos_id: int | None = None, max_len: int | None = None,
                         kernels: str | None = None) -> SpeculativeResult:
    """Generate like ``kvlib.generate.generate``, k drafted tokens verified per target forward.

    ids: one prompt (a list of token ids, [[...]] or a (1, T) tensor). drafter: None (``PromptLookupDrafter()``)
    or an object with ``reset(max_len)`` and ``propose(context, k, temperature, top_k, generator)``.
    cache: "contiguous", "paged", "int8" or a cache object with ``truncate`` (a ``KiviCache`` gets
    ``enable_rollback()`` and is verified through ``KiviVerifySeam``); it is reset first, as in ``generate``.
    Greedy (temperature 0): the tokens are ``generate``'s on the same kind of cache (contiguous, int8, paged,
    KIVI), since one forward over T tokens computes what T single-token forwards compute, up to rounding in
    the sums (a batched matrix product, the prefill attention instead of the decode kernel), which could
    only matter at a near-tie of the two best logits. A budgeted (evicting) cache runs too, but its output
    is its own (``SpeculativeResult.exact`` is False once an eviction saw drafted tokens). Sampling: the
    rejection rule, the same distribution as ``generate`` (not the same tokens for a seed).

    Each step: d = min(k, tokens still to make - 1) drafts; the last emitted token and the drafts go through
    the model in one call at positions ``cache.next_positions()`` + 0..d; a tokens are accepted and one
    more comes from the target; the cache is truncated to prompt + emitted - 1.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> from kvlib.generate import generate
    >>> with torch.random.fork_rng():
    ...     _ = torch.manual_seed(0)
    ...     model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    >>> res = speculative_generate(model, prompt, 12, k=4)
    >>> res.tokens == generate(model, [prompt], 12)[0].tolist(), res.held[-1] == len(prompt) + 12 - 1
    (True, True)
    """
    _check_sampling(temperature, top_k)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=0)
    k = check_int("k", k, minimum=0)
    prompt = _first_prompt(ids)
    check_prompt_fits(model, prompt, max_new_tokens, "ids")
    t0 = time.perf_counter()
    res = SpeculativeResult()
    if max_new_tokens == 0:
        return res
    P, device = len(prompt), model.device
    drafter = PromptLookupDrafter() if drafter is None else drafter
    kv = make_cache(cache, model, 1, max_len or P + max_new_tokens, kernels)
    _check_truncatable(kv)
    if getattr(kv, "rollback_rows", None) == 0:  # KIVI: keep what each call quantizes, for truncate
        kv.enable_rollback()
    kv.reset(1, P + max_new_tokens - 1)
    drafter.reset(P + max_new_tokens)
    forwards0 = drafter.forwards
    generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def pick(logits):  # logits (V,) -> one token, as generate's sample_next
        if temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(target_probs(logits[None], temperature, top_k)[0].cpu(), 1, generator=generator))

    try:
        view, cached = kv.prefill_view(0, prompt)
        x = torch.tensor([prompt[cached:]], device=device)
        logits = model(x, positions=torch.arange(cached, P, device=device)[None], cache=view)  # as generate does
        res.target_forwards = 1
        out = [pick(logits[0, -1])]
        while len(out) < max_new_tokens and not (eos_id is not None and eos_id in out):
            n0, at = _held(kv), _next_position(kv)
            if at != P + len(out) - 1:  # the invariant every step keeps (an off-by-one rewind breaks it)
                raise AssertionError(f"the cache's next position is {at}, expected prompt + emitted - 1 = "
                                     f"{P + len(out) - 1}")
            d = min(k, max_new_tokens - len(out) - 1)
            draft, q = drafter.propose(prompt + out, d, temperature, top_k, generator) if d else ([], None)
            draft = [int(t) for t in draft[:d]]
            q = None if q is None else q[:len(draft)]
            step = [out[-1]] + draft  # T = d + 1: the last emitted token first
            positions = kv.next_positions()[:1, :1].to(device) + torch.arange(len(step), device=device)[None]
            view = kv.batch([0], [step]) if _is_paged(kv) else KiviVerifySeam(kv) if _is_kivi(kv) else kv
            logits = model(torch.tensor([step], device=device), positions=positions, cache=view)[0]  # (T, V)
            res.target_forwards += 1
            if temperature == 0:
                a, nxt = greedy_accept(logits, draft)
            else:
                a, nxt = speculative_accept(target_probs(logits, temperature, top_k), q, draft, generator)
            res.exact &= truncate_cache(kv, n0 + 1 + a)  # keep the last token and the accepted drafts
            out += draft[:a] + [nxt]
            res.drafted.append(len(draft))
            res.accepted.append(a)
            res.held.append(_next_position(kv))
    except BaseException:
        kv.reset()
        raise
    if eos_id is not None and eos_id in out:
        out = out[: out.index(eos_id) + 1]
    res.tokens = out
    res.draft_forwards = drafter.forwards - forwards0
    res.seconds = time.perf_counter() - t0
    return res
