"""Autoregressive generation: the naive loop (chapter 02) and the cached one (chapter 03).

``generate_naive`` is the plainest possible decoder: at every step it runs the model over the
*whole* sequence so far (prompt + everything generated), keeps only the last position's logits,
picks the next token and appends it. Step t therefore re-computes the keys and values of all t
earlier tokens, which never changed — chapter 03's KV cache removes exactly that waste.

Shared by every generator in the course (so they can be compared token for token):
- ``pad_prompts``: a batch of prompts of different lengths, left-padded, with an attention mask and
  each token's position (padding does not count as a position);
- ``sample_next``: greedy (temperature 0) or seeded temperature / top-k sampling.
"""

from __future__ import annotations

import torch

from .cache import check_int

__all__ = ["generate_naive", "generate", "pad_prompts", "sample_next"]


def prompt_lists(ids) -> list[list[int]]:
    """A (B, T) integer tensor or a list of token-id lists -> a list of B lists of ints (validated)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be a (B, T) integer tensor, got {tuple(ids.shape)} {ids.dtype}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") \
            or any(isinstance(p, (str, bytes)) or not hasattr(p, "__len__") for p in ids):
        raise TypeError(f"ids must be a (B, T) tensor or a list of token-id lists (e.g. [[1, 2, 3]]), got {ids!r:.60}")
    if not ids or any(len(p) == 0 for p in ids):
        raise ValueError("ids must hold at least one prompt, each with at least one token")
    try:
        return [[check_int("token id", t, minimum=0) for t in p] for p in ids]
    except (TypeError, ValueError) as e:
        raise type(e)(f"ids: {e}") from None


def _check_generate_args(model, ids, max_new_tokens, temperature, top_k) -> list[list[int]]:
    """The validated prompts; refuses what would fail deep inside the model or run past its context."""
    _check_sampling(temperature, top_k)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=0)
    prompts = prompt_lists(ids)
    for b, p in enumerate(prompts):
        check_prompt_fits(model, p, max_new_tokens, f"ids: prompt {b}")
    return prompts


def check_prompt_fits(model, prompt: list[int], max_new_tokens: int, what: str) -> None:
    """Refuse a prompt with a token outside the model's vocabulary, or one that with its new tokens
    would run past the model's context (``what`` names the prompt in the message)."""
    V, context = model.config.vocab_size, model.config.max_seq_len
    if max(prompt) >= V:
        raise ValueError(f"{what} holds token {max(prompt)}, outside the model's vocabulary 0..{V - 1}")
    if len(prompt) + max_new_tokens > context:
        raise ValueError(f"{what} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{len(prompt) + max_new_tokens} tokens exceeds the model's context of {context} "
                         "(config.max_seq_len)")


def pad_prompts(prompts, pad_id: int = 0, device=None):
    """Left-pad prompts to one length.

    prompts: a (B, T) LongTensor, or a list of B token-id lists (lengths may differ).
    Returns ids (B, T_max), attention_mask (B, T_max) with 1 for real tokens, positions (B, T_max)
    counting real tokens only (0 for the first real token of each prompt).

    >>> ids, mask, positions = pad_prompts([[7, 8, 9], [5]])
    >>> ids.tolist(), mask.tolist(), positions.tolist()
    ([[7, 8, 9], [0, 0, 5]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
    """
    prompts = prompt_lists(prompts)
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[b, T - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row of ``logits`` (B, V) -> (B,). Greedy when temperature == 0.

    >>> logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    >>> sample_next(logits).tolist()  # greedy: the argmax of each row
    [1, 0]
    >>> sample_next(logits, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0)).tolist()
    [1, 0]
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # sample on the CPU so that a seed gives the same tokens on every device
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _check_sampling(temperature, top_k):
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0 \
            or temperature == float("inf"):
        raise ValueError(f"temperature must be >= 0 and finite, got {temperature!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")


@torch.no_grad()
def generate_naive(model, ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                   seed: int | None = None, eos_id: int | None = None, progress: bool = False) -> torch.Tensor:
    """Generate up to ``max_new_tokens`` tokens per prompt by re-running the whole prefix each step.

    ids: a (B, T) LongTensor or a list of token-id lists of different lengths (left-padded).
    temperature 0 (default) is greedy; otherwise seeded sampling (``seed``), optionally top-k.
    A sequence that emits ``eos_id`` is finished: it gets ``eos_id`` from then on, and the loop stops
    when all are finished. Returns the new tokens only, (B, N) with N <= max_new_tokens.
    Every prompt's length + max_new_tokens must fit the model's context (``config.max_seq_len``).

    >>> from kvlib.model import ModelConfig, Transformer
    >>> with torch.random.fork_rng():  # seeded weights, without touching the global generator
    ...     _ = torch.manual_seed(0)
    ...     model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()
    >>> generate_naive(model, [[1, 2, 3], [4]], 5).shape  # two prompts of different lengths, 5 new tokens each
    torch.Size([2, 5])
    """
    prompts = _check_generate_args(model, ids, max_new_tokens, temperature, top_k)
    device = model.device
    seq, mask, positions = pad_prompts(prompts, pad_id=0, device=device)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    done = torch.zeros(seq.shape[0], dtype=torch.bool, device=device)
    new_tokens = []
    bar = _ProgressBar(progress, max_new_tokens, "naive decoding")
    for _ in range(max_new_tokens):
        logits = model(seq, positions=positions, attention_mask=mask)[:, -1]  # (B, V): only the last row is used
        nxt = sample_next(logits, temperature, top_k, generator)  # (B,)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        new_tokens.append(nxt)
        seq = torch.cat([seq, nxt[:, None]], dim=1)  # (B, T + 1): the whole prefix goes in again next step
        mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        bar.update(1)
        if eos_id is not None and bool(done.all()):
            break
    bar.finish()
    if not new_tokens:
        return torch.empty(seq.shape[0], 0, dtype=torch.long, device=device)
    return torch.stack(new_tokens, dim=1)


class _ProgressBar:
    """A tqdm bar counting generated tokens (or nothing when ``enabled`` is false). ``finish()`` after the
    loop: a run that stopped early at EOS has finished too, so the bar's total becomes what was done and it
    ends complete (tqdm marks a bar closed short of its total as failed, red in JupyterLab)."""

    def __init__(self, enabled: bool, total: int, desc: str):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, leave=False)

    def update(self, n: int):
        if self.bar is not None:
            self.bar.update(n)

    def finish(self):
        if self.bar is not None:
            self.bar.total = self.bar.n
            self.bar.refresh()
            self.bar.close()


def make_cache(kind, model, batch: int, max_len: int, kernels=None, block_size: int = 16):
    """The cache object for ``generate(cache=kind)``: a name, or a ready-made cache (returned as is).

    "contiguous": chapter 03's KVCache, max_len positions per sequence. "paged": chapter 05's
    PagedKVCache with a pool just large enough for batch sequences of max_len tokens. "int8":
    chapter 06's Int8KVCache (quantize on store, per token and head).
    """
    if not isinstance(kind, str):
        needs = ("reset", "prefill_view", "decode_view", "next_positions")
        if not all(hasattr(kind, n) for n in needs):
            raise TypeError(f"cache must be 'contiguous', 'paged', 'int8' or a cache object with {', '.join(needs)}, "
                            f"got {type(kind).__name__}")
        return kind
    if kind == "contiguous":
        from .cache import KVCache

        return KVCache.for_model(model, batch, max_len, kernels)
    if kind == "paged":
        from .paged import PagedKVCache

        num_blocks = batch * -(-max_len // block_size)
        return PagedKVCache.for_model(model, num_blocks, block_size, kernels=kernels)
    if kind == "int8":
        from .quant import Int8KVCache

        return Int8KVCache.for_model(model, batch, max_len, kernels)
    raise ValueError(f"cache must be 'contiguous', 'paged', 'int8' or a cache object, got {kind!r}")


@torch.no_grad()
def generate(model, ids, max_new_tokens: int, *, cache="contiguous", temperature: float = 0.0,
             top_k: int | None = None, seed: int | None = None, eos_id: int | None = None,
             max_len: int | None = None, kernels: str | None = None, progress: bool = False) -> torch.Tensor:
    """Generate with a KV cache: prefill each prompt once, then feed one token per step.

    Same arguments and same tokens as ``generate_naive``. ``cache`` names the cache ("contiguous",
    "paged", "int8") or is a cache object; ``max_len`` is its capacity per sequence (default: longest
    prompt + max_new_tokens). A cache object you pass is *reset* first (emptied: its earlier
    contents are dropped, never attended to), must hold one sequence per prompt, and keeps this
    call's K/V afterwards. A capacity too small is refused up front (``CacheFullError``); a call
    that fails midway (e.g. a paged pool that runs out of blocks) leaves the cache empty.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> from kvlib.cache import KVCache
    >>> with torch.random.fork_rng():  # seeded weights, without touching the global generator
    ...     _ = torch.manual_seed(0)
    ...     model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, hidden_dim=64)).eval()
    >>> prompts = [[1, 2, 3], [4]]
    >>> torch.equal(generate(model, prompts, 5), generate_naive(model, prompts, 5))  # token-identical
    True
    >>> cache = KVCache.for_model(model, batch=2, max_len=16)
    >>> a = generate(model, prompts, 5, cache=cache)
    >>> b = generate(model, prompts, 5, cache=cache)  # reset first, so the same answer again
    >>> torch.equal(a, b), cache.seq_lens.tolist()  # prompt + 4 fed-back tokens per sequence
    (True, [7, 5])
    """
    prompts = _check_generate_args(model, ids, max_new_tokens, temperature, top_k)
    device = model.device
    B, longest = len(prompts), max(len(p) for p in prompts)
    if max_len is not None:
        max_len = check_int("max_len", max_len)
    kv = make_cache(cache, model, B, max_len or longest + max_new_tokens, kernels)
    if max_new_tokens == 0:
        return torch.empty(B, 0, dtype=torch.long, device=device)
    kv.reset(B, longest + max_new_tokens - 1)  # checks the fit first; the last new token is never stored
    try:
        return _generate_cached(model, prompts, max_new_tokens, kv, temperature, top_k, seed, eos_id, progress)
    except BaseException:
        kv.reset()  # a failed call leaves no half-filled cache behind (no sequence stays registered)
        raise


def _generate_cached(model, prompts, max_new_tokens, kv, temperature, top_k, seed, eos_id, progress):
    device, B = model.device, len(prompts)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None

    # prefill: each prompt once, through a batch-1 view of the cache (prompts may differ in length);
    # a paged cache with prefix caching may already hold the prompt's first blocks
    last = []
    for b, p in enumerate(prompts):
        view, cached = kv.prefill_view(b, p)
        x = torch.tensor([p[cached:]], device=device)  # (1, T_b - cached)
        positions = torch.arange(cached, len(p), device=device)[None]  # (1, T_b - cached)
        last.append(model(x, positions=positions, cache=view)[:, -1])  # (1, V)
    logits = torch.cat(last)  # (B, V)

    done = torch.zeros(B, dtype=torch.bool, device=device)
    new_tokens = []
    bar = _ProgressBar(progress, max_new_tokens, f"cached decoding ({type(kv).__name__})")
    for step in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)  # (B,)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        new_tokens.append(nxt)
        bar.update(1)
        if step == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
            break
        positions = kv.next_positions()  # (B, 1): each sequence's next position
        logits = model(nxt[:, None], positions=positions, cache=kv.decode_view(nxt.tolist()))[:, -1]  # (B, V)
    bar.finish()
    if not new_tokens:
        return torch.empty(B, 0, dtype=torch.long, device=device)
    return torch.stack(new_tokens, dim=1)
