"""Layers with different caches (chapter 11): sliding-window and full attention in one model.

What you will learn:
- many current models do not give every layer the same attention. Gemma 2 alternates local
  (sliding-window) and global layers 1:1 with a 4096-token window (Gemma Team 2024, "Gemma 2:
  Improving Open Language Models at a Practical Size", arXiv:2408.00118); Gemma 3 has 5 local layers
  for every global one, window 1024 (Gemma Team 2025, "Gemma 3 Technical Report", arXiv:2503.19786);
  Mistral 7B uses a 4096-token window in every layer (Jiang et al. 2023, "Mistral 7B",
  arXiv:2310.06825). ``layer_plan`` writes such a plan down, one kind per layer;
- ``HybridCache``: one cache whose layers keep different amounts. A full layer is chapter 03's
  ``KVCache`` layer (every position); a window layer keeps a ring buffer of W rows (position p in
  row p mod W), so its memory stops growing at W positions. Keys keep their true RoPE positions, as
  in a model trained with a window;
- ``hybrid_bytes``: the bytes such a plan holds for n tokens, sum over layers of min(n, W) or n
  positions x 2 (K and V) x H_KV x D x bytes per element; ``HybridCache.stored_bytes`` equals it;
- ``pool_blocks``: why one paged pool with one allocator wastes memory here: a pool that keeps every
  layer's blocks for every position (as vLLM did before its hybrid allocator) holds blocks that a
  window layer will never read again; ``aligned_block_size``: what one page size costs once state
  layers share the pool (the attention block grows until its page holds a whole state);
- ``prefix_hit``: prefix caching per layer kind. A full layer can resume at any cached block boundary;
  a window layer only where the W - 1 positions before it are still cached; a state layer only where a
  snapshot of its state was kept. A request reuses the longest prefix every kind can resume at;
- ``state_hybrid_bytes``: layers with a fixed-size state instead of a cache (Mamba, linear attention),
  computed for Jamba's published configuration: the state is paid once per sequence, whatever its length.

The window, exactly. A window layer with window W lets the token at position p attend to positions
p - W + 1 .. p: itself and the W - 1 before it (W keys), in prefill as in decode. That is Gemma's
reference code (github.com/google/gemma_pytorch, ``gemma/model.py``: the local mask adds -inf below
``tril(..., diagonal=-sliding_window_size)``, so key j is kept iff j > i - W) and vLLM's
``SlidingWindowManager`` ("the input token itself is also included in the window": a decode needs the
W - 1 cached positions before it). Mistral's reference ``one_file_ref.py`` (github.com/mistralai/
mistral-inference) differs by one in prefill: ``torch.triu(mask, diagonal=-sliding_window)`` keeps
j >= i - W, W + 1 keys (the paper's text too: "positions between i - W and i"), while its decode reads a
rolling buffer of W rows (W keys with itself). Here W counts the token itself everywhere.

Applying the window post hoc (SmolLM2, trained with full attention in every layer) is not the same
as a model trained that way. A model trained with windows learns to carry what it needs from far back
through its global layers and through the stack (information moves up to W positions per window layer,
Mistral's paper section 2), and Gemma 3 gives its local layers their own RoPE base (10k, against 1M in
the global layers). SmolLM2 never learned either: its window layers lose attention they were trained
to use, including the first tokens of the text, which a full-attention model uses as an attention sink
(Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks", arXiv:2309.17453, and
chapter 09's SlidingWindowCache). So what the window costs SmolLM2 here overstates what it costs a model
trained with it (Gemma's 5:1 is trained in), for the same bytes saved.

Measured once on a CPU with chapter 09's protocol (SmolLM2-135M-Instruct, fp32; perplexity on the second
half of 1024 tokens of textwrap.py's source, passkey at 5 depths; ``evaluate_cache(lambda L:
HybridCache.for_model(model, 1, L, pattern="5:1", window=W))``): the full cache gives perplexity 15.72 and
5/5; 5:1 with W = 512 gives 37.91 and 5/5 (the passkey prompts, 411 tokens, fit in the window), W = 256
41.45 and 3/5, W = 128 63.27 and 1/5 (only at depth 0.9, the needle nearest the question); W = 1024 (no
position leaves a window) gives 15.72 again, W = 1000 15.94, W = 768 25.56 (perplexity only). At the 1023
positions of the perplexity run W = 512, 256, 128 keep 58.4%, 37.5% and 27.1% of the full cache's K/V bytes
(``hybrid_bytes``: 13758720, 8843520 and 6385920 bytes in fp16, against 23569920). Perplexity already
rises by 60% at W = 768, where window layers lose at most the first 255 positions, and only for the last
quarter of the text: consistent with a full-attention model leaning on the first tokens (the attention
sink above; a window that kept them was not measured here).

Kernels. A decode step of a window layer writes the new row into its ring, then attends over the ring
with chapter 03's ``decode_attention`` (the ring holds exactly the window, and softmax does not depend on
the order of the keys); a full layer is ``KVCache.attend`` unchanged. A call of T > 1 tokens through a
window layer runs ``banded_attention_ref`` in PyTorch (the course has no banded prefill kernel yet),
over the ring and the T new rows, then keeps the last min(T, W) of them (so does a decode step when the
ring has ``spare`` rows beyond the window, kept for ``truncate``).
"""

from __future__ import annotations

import math
import numbers

import torch

from .attention import check_attention_inputs
from .cache import KVCache, check_int, decode_attention, decode_attention_ref, pick_kernels, store_kv, store_kv_ref
from .pool_sim import _blocks_for

__all__ = ["layer_plan", "band_mask", "banded_attention_ref", "HybridCache", "hybrid_bytes", "blocks_held",
           "pool_blocks", "aligned_block_size", "prefix_hit", "JAMBA_V01", "state_hybrid_bytes", "LAYER_KINDS"]

LAYER_KINDS = ("full", "window", "state")  # "state": a fixed-size state (Mamba, linear attention); bytes only


def layer_plan(n_layers: int, pattern: str = "5:1") -> list[str]:
    """One kind per layer: ``pattern`` "a:b" repeats a window layers, then b full layers.

    "5:1" is Gemma 3's order (layers 5, 11, 17, ... are global), "1:1" Gemma 2's (window first),
    "1:0" Mistral 7B's (a window in every layer), "0:1" a plain model (full everywhere).

    >>> layer_plan(8, "5:1")
    ['window', 'window', 'window', 'window', 'window', 'full', 'window', 'window']
    >>> plan = layer_plan(30, "5:1"); plan.count("full"), plan.count("window")  # SmolLM2's 30 layers
    (5, 25)
    >>> layer_plan(4, "1:1"), layer_plan(2, "1:0")
    (['window', 'full', 'window', 'full'], ['window', 'window'])
    """
    n_layers = check_int("n_layers", n_layers)
    try:
        a, b = (int(x) for x in pattern.split(":"))
    except (AttributeError, ValueError):
        raise ValueError(f"pattern must be 'a:b' (a window layers, then b full layers), got {pattern!r}") from None
    if a < 0 or b < 0 or a + b == 0:
        raise ValueError(f"pattern 'a:b' needs a, b >= 0 and a + b >= 1, got {pattern!r}")
    period = ["window"] * a + ["full"] * b
    return [period[i % len(period)] for i in range(n_layers)]


def _check_plan(plan, allowed=LAYER_KINDS) -> tuple[str, ...]:
    if isinstance(plan, str) or not hasattr(plan, "__len__") or len(plan) == 0:
        raise ValueError(f"plan must be a non-empty list of layer kinds (see layer_plan), got {plan!r:.60}")
    bad = sorted({p for p in plan if p not in allowed}, key=str)
    if bad:
        raise ValueError(f"plan holds {bad!r}; each layer must be one of {', '.join(map(repr, allowed))}")
    return tuple(plan)


def _check_window(plan, window) -> int | None:
    if "window" not in plan:
        return None if window is None else check_int("window", window)
    if window is None:
        raise ValueError("the plan has window layers: pass window (W, the positions a window layer attends to)")
    return check_int("window", window)


# --------------------------------------------------------------------------------------------
# The band: which keys a window layer's query sees, and the reference attention over it
# --------------------------------------------------------------------------------------------


def band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, n_sink: int = 0) -> torch.Tensor:
    """(B, T, S) True where query i may attend key j: 0 <= q_pos[i] - k_pos[j] < window, or key j is one of
    the first ``n_sink`` positions (an attention sink, StreamingLLM's, kept by every query after it).

    q_pos (B, T), k_pos (B, S) true positions (-1 marks an empty key row); window None: causal only.
    The token itself counts in its window (module docstring).

    >>> band_mask(torch.arange(5)[None], torch.arange(5)[None], window=2)[0].int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 1, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1]], dtype=torch.int32)
    >>> band_mask(torch.arange(5)[None], torch.arange(5)[None], window=2, n_sink=1)[0, -1].int()  # + position 0
    tensor([1, 0, 0, 1, 1], dtype=torch.int32)
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"window must be a positive int (the token itself counts, so 1 sees only itself) or None "
                         f"for causal only, got {window!r}")
    n_sink = check_int("n_sink", n_sink, minimum=0)
    d = q_pos[:, :, None] - k_pos[:, None, :]  # (B, T, S) how far back each key is
    visible = (k_pos[:, None, :] >= 0) & (d >= 0)
    if window is not None:
        visible &= (d < window) | (k_pos[:, None, :] < n_sink)
    return visible


def banded_attention_ref(q, k, v, q_pos, k_pos, window, n_sink: int = 0):
    """softmax(q k^T / sqrt(D) over the band) v in fp32: each query sees the keys of ``band_mask``.

    q (B, H, T, D); k, v (B, H_KV, S, D) in any order of positions; q_pos (B, T), k_pos (B, S) integer
    positions (-1: an empty row). Every query must see at least itself (its own position among k_pos).
    ``n_sink``: the first n_sink positions stay visible to every later query (``band_mask``).

    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    >>> pos = torch.arange(4)[None]
    >>> out = banded_attention_ref(q, k, v, pos, pos, window=1)  # W = 1: a token sees only itself
    >>> torch.allclose(out, v)
    True
    """
    check_attention_inputs(q, k, v)
    B, H, T, D = q.shape
    S = k.shape[2]
    for name, pos, n in (("q_pos", q_pos, T), ("k_pos", k_pos, S)):
        if not isinstance(pos, torch.Tensor) or pos.shape != (B, n) or pos.is_floating_point():
            raise ValueError(f"{name} must be a (B={B}, {n}) integer tensor of positions, got "
                             f"{getattr(pos, 'shape', type(pos).__name__)} {getattr(pos, 'dtype', '')}")
    visible = band_mask(q_pos.to(q.device), k_pos.to(q.device), window, n_sink)  # (B, T, S)
    if not bool(visible.any(-1).all()):
        raise ValueError("every query must see at least one key (its own position must be among k_pos)")
    n_rep = H // k.shape[1]
    kf = k.float().repeat_interleave(n_rep, dim=1)  # (B, H, S, D)
    vf = v.float().repeat_interleave(n_rep, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(D)  # (B, H, T, S)
    probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
    return (probs @ vf).to(q.dtype)  # (B, H, T, D)


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class HybridCache(KVCache):
    """Per layer its own cache: "full" layers keep every position (chapter 03's KVCache layer), "window"
    layers a ring of min(window + spare, max_len) rows, attending to the last ``window`` positions only.

    ``max_len`` bounds every sequence (the full layers' capacity). Lengths (``seq_lens``) count every
    position a sequence has seen; ``held(b, layer)`` what a layer stores. Plugs into
    ``Transformer.forward(..., cache=...)`` and ``generate(..., cache=obj)`` like a KVCache, multi-token
    calls included (also calls longer than the window: its band runs through the call's own rows).

    ``spare``: extra ring rows, so that ``truncate`` (rewinding rejected draft tokens, chapter 11) can cut
    up to spare + 1 tokens exactly: a ring of exactly W rows overwrote, with every new token, the row a
    rewound sequence would need again (vLLM keeps extra window tokens for speculative decoding the same
    way). With spare rows every window layer's call runs ``banded_attention_ref`` (the ring then holds
    more than the window).

    ``n_sink``: a window layer also keeps the sequence's first ``n_sink`` positions, in rows of their own
    before the ring (never overwritten), and every query attends to them besides its window: StreamingLLM's
    attention sinks (Xiao et al. 2023, arXiv:2309.17453; chapter 09's SinkCache) inside a window layer. A
    model trained with full attention parks attention on its first tokens; without them a window layer
    applied after the fact loses that sink. Each window layer then holds min(n, n_sink + window) positions.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=3, n_heads=2, hidden_dim=64)).eval()
    >>> cache = HybridCache.for_model(model, batch=1, max_len=12, pattern="2:1", window=4)
    >>> cache.plan
    ('window', 'window', 'full')
    >>> with torch.no_grad():
    ...     _ = model(torch.arange(10)[None], cache=cache)  # a 10-token prefill
    >>> [cache.held(0, layer) for layer in range(3)], cache.next_positions().tolist()
    ([4, 4, 10], [[10]])
    >>> cache.held_positions(0, 0).tolist()  # the ring rows of a window layer: positions 6..9
    [8, 9, 6, 7]
    >>> cache.stored_bytes() == hybrid_bytes(10, cache.plan, 4, n_kv_heads=2, head_dim=16, bytes_per_element=4)
    True
    """

    shared_attrs = ("plan",)

    def __init__(self, plan, batch, n_kv_heads, max_len, head_dim, window=None, dtype=torch.float32, device="cpu",
                 kernels=None, spare=0, n_sink=0):
        self.plan = _check_plan(plan, allowed=("full", "window"))  # a tuple: sequence(b) passes it on whole
        self.window = _check_window(self.plan, window)
        self.spare = check_int("spare", spare, minimum=0)
        self.n_sink = check_int("n_sink", n_sink, minimum=0)
        batch, max_len = check_int("batch", batch), check_int("max_len", max_len)
        n_kv_heads, head_dim = check_int("n_kv_heads", n_kv_heads), check_int("head_dim", head_dim)
        # KVCache's attributes, with each layer's rows: max_len for a full layer, the ring for a window layer
        self.kernels = pick_kernels(kernels, device)
        rows = [max_len if kind == "full" else min(self.n_sink + self.window + self.spare, max_len)
                for kind in self.plan]
        self.k = [torch.zeros(batch, n_kv_heads, r, head_dim, dtype=dtype, device=device) for r in rows]
        self.v = [torch.zeros(batch, n_kv_heads, r, head_dim, dtype=dtype, device=device) for r in rows]
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)  # (B,) positions seen
        self.max_len = max_len
        # per layer (B, rows): the position each ring row holds, -1 if none (a full layer: (B, 0), unused);
        # with n_sink, rows 0 .. n_sink - 1 hold positions 0 .. n_sink - 1 and the ring is the rows after them
        self.pos = [torch.full((batch, r if kind == "window" else 0), -1, dtype=torch.int64, device=device)
                    for kind, r in zip(self.plan, rows)]

    @classmethod
    def for_model(cls, model, batch, max_len, kernels=None, *, pattern="5:1", window=1024, plan=None, spare=0,
                  n_sink=0):
        """A cache for ``model``: ``plan`` (a list of kinds), or ``layer_plan(n_layers, pattern)``."""
        c = model.config
        plan = layer_plan(c.n_layers, pattern) if plan is None else plan
        if len(plan) != c.n_layers:
            raise ValueError(f"plan must give one kind per layer ({c.n_layers}), got {len(plan)}")
        return cls(plan, batch, c.n_kv_heads, max_len, c.head_dim, window, model.dtype, model.device, kernels,
                   spare, n_sink)

    def held(self, b: int, layer: int | None = None) -> int:
        """Positions stored for sequence b: in ``layer`` (a window layer holds at most its ring), or, with
        ``layer=None``, the positions seen (what a full layer holds)."""
        n = super().held(b)
        if layer is None:
            return n
        if check_int("layer", layer, minimum=0) >= len(self.plan):
            raise ValueError(f"layer must be in 0..{len(self.plan) - 1}, got {layer}")
        return n if self.plan[layer] == "full" else int((self.pos[layer][b] >= 0).sum())

    def held_positions(self, b: int, layer: int) -> torch.Tensor:
        """The positions stored for sequence b in ``layer``, row by row (a window layer's ring is in row
        order: position p sits in row p mod its rows)."""
        if self.plan[layer] == "full":
            return torch.arange(super().held(b))
        row = self.pos[layer][b].cpu()
        return row[row >= 0]

    def reset(self, batch: int | None = None, length: int | None = None):
        super().reset(batch, length)
        for p in self.pos:
            p.fill_(-1)

    def stored_bytes(self) -> int:
        """Bytes of the K/V rows that hold a position now (the allocation is ``nbytes()``): ``hybrid_bytes``
        of the positions seen, for each sequence (with ``spare`` rows, of window + spare)."""
        B = self.seq_lens.shape[0]
        return sum(self.held(b, layer) * self.k[layer][0, :, 0].nbytes * 2
                   for b in range(B) for layer in range(len(self.plan)))

    def attend(self, layer_idx, q, k, v):
        """q (B, H, T, D), k/v (B, H_KV, T, D) for the new tokens -> attention output (B, H, T, D)."""
        if isinstance(layer_idx, int) and not isinstance(layer_idx, bool) and 0 <= layer_idx < len(self.plan) \
                and self.plan[layer_idx] == "full":
            return super().attend(layer_idx, q, k, v)
        self._check_attend(layer_idx, q, k, v, self.k[0].dtype)
        T = q.shape[2]
        self._make_room(T)  # refuses before anything is written
        kb, vb = self.k[layer_idx], self.v[layer_idx]
        rows = kb.shape[2]
        n = self.seq_lens.long()  # (B,) positions seen before this call
        triton_kernels = self.kernels == "triton"
        pos = self.pos[layer_idx]  # (B, rows)
        new_pos = n[:, None] + torch.arange(T, device=n.device)  # (B, T)
        s = self.n_sink
        if s:  # position p < s in sink row p, a later one in ring row s + (p - s) mod (rows - s)
            return self._attend_with_sinks(layer_idx, q, k, v, n, new_pos)
        if T == 1 and rows <= self.window:  # the new row replaces the one leaving the window: the ring is the window
            (store_kv if triton_kernels else store_kv_ref)(kb, vb, k, v, n % rows)
            pos.scatter_(1, new_pos % rows, new_pos)
            decode = decode_attention if triton_kernels else decode_attention_ref
            out = decode(q[:, :, 0], kb, vb, (n + 1).clamp(max=rows))[:, :, None]  # (B, H, 1, D)
        else:  # the ring's rows and the T new ones, each query on its band; then keep the last rows
            out = banded_attention_ref(q, torch.cat([kb, k], dim=2), torch.cat([vb, v], dim=2), new_pos,
                                       torch.cat([pos, new_pos], dim=1), self.window)
            m = min(T, rows)  # distinct rows: m <= rows consecutive positions of each sequence
            slots = new_pos[:, T - m:] % rows  # (B, m)
            rows_idx = slots[:, None, :, None].expand(-1, kb.shape[1], -1, kb.shape[3])
            kb.scatter_(2, rows_idx, k[:, :, T - m:])
            vb.scatter_(2, rows_idx, v[:, :, T - m:])
            pos.scatter_(1, slots, new_pos[:, T - m:])
        self._advance(layer_idx, T)
        return out

    def _slots(self, p: torch.Tensor, rows: int) -> torch.Tensor:
        """The row of position(s) p in a window layer of ``rows`` rows with ``n_sink`` sink rows first."""
        s = self.n_sink
        return torch.where(p < s, p, s + (p - s).clamp(min=0) % max(1, rows - s))

    def _attend_with_sinks(self, layer_idx, q, k, v, n, new_pos):
        """A window layer's call with sink rows: decode straight over every row when the ring is exactly the
        window (sinks + window are then all the query sees); otherwise the band (sinks included) over the rows
        and the call's own keys, then keep the sinks among the new rows and the last rows - n_sink of the rest."""
        kb, vb, pos = self.k[layer_idx], self.v[layer_idx], self.pos[layer_idx]
        B, T, rows = q.shape[0], q.shape[2], kb.shape[2]
        triton_kernels = self.kernels == "triton"
        if T == 1 and rows - self.n_sink <= self.window:  # rows fill in order: 0 .. min(n + 1, rows) - 1 are held
            (store_kv if triton_kernels else store_kv_ref)(kb, vb, k, v, self._slots(n, rows))
            pos.scatter_(1, self._slots(new_pos, rows), new_pos)
            decode = decode_attention if triton_kernels else decode_attention_ref
            out = decode(q[:, :, 0], kb, vb, (n + 1).clamp(max=rows))[:, :, None]  # (B, H, 1, D)
        else:
            out = banded_attention_ref(q, torch.cat([kb, k], dim=2), torch.cat([vb, v], dim=2), new_pos,
                                       torch.cat([pos, new_pos], dim=1), self.window, self.n_sink)
            keep = (new_pos < self.n_sink) | (new_pos >= (n + T)[:, None] - (rows - self.n_sink))  # (B, T)
            slots = self._slots(new_pos, rows)
            for b in range(B):  # distinct rows per sequence: the kept positions never share one
                kb[b][:, slots[b][keep[b]]] = k[b][:, keep[b]]
                vb[b][:, slots[b][keep[b]]] = v[b][:, keep[b]]
                pos[b][slots[b][keep[b]]] = new_pos[b][keep[b]]
        self._advance(layer_idx, T)
        return out

    def truncate(self, b: int, length: int) -> bool:
        """Cut sequence b back to its first ``length`` positions, exactly as if it had never seen the rest.

        Full layers only change their length (``KVCache.truncate``). A window layer's ring has no room to
        undo: each cut token overwrote the row of the position R before it (R = the ring's rows). The cut is
        exact when the ring still holds every position the shortened sequence attends to next (length - W + 1
        .. length - 1); the cut tokens' rows are then marked empty. Otherwise it raises ValueError and changes
        nothing. With R = W rows (``spare=0``) that allows cutting one token once a sequence is longer than R;
        ``spare`` rows allow spare + 1. Returns True.

        >>> cache = HybridCache(["window"], 1, 1, 16, 4, window=3, spare=1)
        >>> _ = cache.attend(0, *(torch.randn(1, 1, 8, 4) for _ in range(3)))
        >>> cache.truncate(0, 6), cache.held_positions(0, 0).tolist()  # 2 = spare + 1 tokens cut
        (True, [4, 5])
        >>> cache.truncate(0, 4)
        Traceback (most recent call last):
        ...
        ValueError: cannot cut sequence 0 from 6 to 4 positions exactly: layer 0's ring no longer holds positions [2, 3]
        """
        b, m = self._check_truncate(b, length)
        n = int(self.seq_lens[b])
        needed = torch.arange(max(0, m - (self.window or 0) + 1), m)  # what the next token attends to
        needed = torch.cat([torch.arange(min(self.n_sink, m)), needed]).unique()  # and the sinks
        for layer, kind in enumerate(self.plan):
            if kind == "window":
                missing = needed[~torch.isin(needed, self.pos[layer][b].cpu())]
                if len(missing):  # a cut token (or one before it) overwrote that row
                    raise ValueError(f"cannot cut sequence {b} from {n} to {m} positions exactly: layer {layer}'s "
                                     f"ring no longer holds positions {missing.tolist()}")
        for layer, kind in enumerate(self.plan):
            if kind == "window":
                self.pos[layer][b].masked_fill_(self.pos[layer][b] >= m, -1)
        self.seq_lens[b] = m
        return True


# --------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------


def hybrid_bytes(n_tokens: int, plan, window: int | None, n_kv_heads: int, head_dim: int,
                 bytes_per_element: int = 2, n_sink: int = 0) -> int:
    """K/V bytes one sequence of ``n_tokens`` holds: sum over layers of min(n, W + n_sink) (window, with its
    sinks) or n (full) positions x 2 (K and V) x n_kv_heads x head_dim x bytes_per_element.

    SmolLM2-135M (30 layers, 3 K/V heads of 64, fp16), all full against Gemma 3's 5:1 with W = 1024:

    >>> full, gemma = layer_plan(30, "0:1"), layer_plan(30, "5:1")
    >>> [hybrid_bytes(n, full, None, 3, 64) for n in (8192, 32768)]  # 180 MiB, 720 MiB
    [188743680, 754974720]
    >>> [hybrid_bytes(n, gemma, 1024, 3, 64) for n in (8192, 32768)]  # 48.75 MiB, 138.75 MiB
    [51118080, 145489920]
    """
    n = check_int("n_tokens", n_tokens, minimum=0)
    plan = _check_plan(plan, allowed=("full", "window"))
    window = _check_window(plan, window)
    per_position = 2 * check_int("n_kv_heads", n_kv_heads) * check_int("head_dim", head_dim) \
        * check_int("bytes_per_element", bytes_per_element)
    n_sink = check_int("n_sink", n_sink, minimum=0)
    return sum(min(n, window + n_sink) if kind == "window" else n for kind in plan) * per_position


# --------------------------------------------------------------------------------------------
# The paged pool: one block size, one allocator
# --------------------------------------------------------------------------------------------


def blocks_held(kind: str, n_tokens: int, window: int | None, block_size: int, free_window: bool = True) -> list[int]:
    """Which logical blocks of one layer a sequence of ``n_tokens`` stored positions still holds in a paged
    pool, waiting for its next token (position n_tokens).

    "full": every block. "window" with ``free_window``: vLLM's ``SlidingWindowManager`` rule — the next token
    attends to positions n - W + 1 .. n, so the first max(0, n - W + 1) positions are skipped and every block
    that lies wholly among them is freed (``remove_skipped_blocks``); the blocks from
    ``(n - W + 1) // block_size`` on are kept. Without ``free_window`` a window layer keeps every block, as a
    pool that treats every layer alike does.

    >>> blocks_held("window", 11, window=6, block_size=4)  # positions 6..10 are needed: blocks 1 and 2
    [1, 2]
    >>> blocks_held("full", 11, window=None, block_size=4)
    [0, 1, 2]
    """
    if kind not in ("full", "window"):
        raise ValueError(f"kind must be 'full' or 'window' (a state layer keeps no blocks per position), got {kind!r}")
    n, bs = check_int("n_tokens", n_tokens, minimum=0), check_int("block_size", block_size)
    first = 0
    if kind == "window" and free_window:
        first = max(0, n - check_int("window", window) + 1) // bs
    return list(range(first, _blocks_for(n, bs)))


def pool_blocks(plan, n_tokens: int, window: int | None, block_size: int = 16) -> dict:
    """Blocks a sequence of ``n_tokens`` takes from one shared pool, summed over the plan's layers, two ways.

    "kept_all": every layer keeps a block for every position (one allocator for every layer: what vLLM did
    before its hybrid allocator, the RFC's figure 1); "freed": window layers free the blocks that slid out of
    their window (``blocks_held``); "waste": the share of "kept_all" that "freed" does not need.
    "window_slack": slots the window layers' kept blocks hold outside the W - 1 positions the next token
    needs: a window rarely starts on a block boundary, so one block size costs up to a block per layer.

    The vLLM RFC "Hybrid Memory Allocator" (github.com/vllm-project/vllm issue #11382) gives the waste as 25%
    for Gemma-2 and 56.25% for Ministral. Gemma 2's 1:1 plan with W = 4096 at its 8192-token context gives
    the 25% exactly; 56.25% = 9/16 is what 3 window layers per full one with W = a quarter of the context give
    (we did not check it against Ministral's configuration):

    >>> pool_blocks(layer_plan(42, "1:1"), 8192, window=4096)["waste"]
    0.25
    >>> pool_blocks(layer_plan(36, "3:1"), 131072, window=32768)["waste"]
    0.5625
    >>> pool_blocks(["window", "full"], 11, window=6, block_size=4)  # the hand count of blocks_held
    {'kept_all': 6, 'freed': 5, 'waste': 0.16666666666666666, 'window_slack': 3}
    """
    plan = _check_plan(plan, allowed=("full", "window"))
    window = _check_window(plan, window)
    n, bs = check_int("n_tokens", n_tokens, minimum=0), check_int("block_size", block_size)
    kept_all = len(plan) * _blocks_for(n, bs)
    held = [blocks_held(kind, n, window, bs) for kind in plan]
    freed = sum(map(len, held))
    need = min(n, window - 1) if window is not None else 0  # positions the next token reads in a window layer
    slack = sum(len(h) * bs - need for kind, h in zip(plan, held) if kind == "window") if n else 0
    return {"kept_all": kept_all, "freed": freed, "waste": (kept_all - freed) / kept_all if kept_all else 0.0,
            "window_slack": slack}


def aligned_block_size(attention_bytes_per_token: int, state_bytes: int, kernel_block: int = 16) -> dict:
    """One page size for attention and state layers: the attention block, in tokens, whose page holds a state.

    A pool with one allocator hands out pages of one size. A state layer (Mamba) needs one page per sequence
    for its whole state; an attention layer's page holds ``block_size`` positions. vLLM's first step in the
    hybrid allocator RFC (github.com/vllm-project/vllm issue #11382: "tune block_size to align the page size
    of different types") grows the attention block until its page is at least a state: the smallest
    multiple of ``kernel_block`` tokens with block_size x ``attention_bytes_per_token`` >= ``state_bytes``
    (both per layer). The cost: every attention layer's last block is that many tokens wide (up to
    block_size - 1 empty slots per sequence and layer), prefix caching reuses whole blocks only, and a
    state page may keep ``state_padding`` bytes empty. (vLLM issue #53749 is titled "enable_prefix_caching=True
    but zero hits for any shared prefix shorter than one attention block on hybrid checkpoints (2096 /
    1920 tokens)".)

    Jamba (``JAMBA_V01``, 16-bit): an attention layer stores 2 x 8 x 128 x 2 = 4096 bytes per position, a
    Mamba layer 8192 x (4 + 16) x 2 = 327680 bytes per sequence, so blocks of 80 tokens:

    >>> aligned_block_size(4096, 327680)
    {'block_size': 80, 'page_bytes': 327680, 'state_padding': 0}
    >>> aligned_block_size(4096, 327680 + 2)  # two bytes more: a whole kernel block more
    {'block_size': 96, 'page_bytes': 393216, 'state_padding': 65534}
    """
    per_token = check_int("attention_bytes_per_token", attention_bytes_per_token)
    state, kb = check_int("state_bytes", state_bytes), check_int("kernel_block", kernel_block)
    block = _blocks_for(_blocks_for(state, per_token), kb) * kb
    page = block * per_token
    return {"block_size": block, "page_bytes": page, "state_padding": page - state}


# --------------------------------------------------------------------------------------------
# Prefix caching per layer kind
# --------------------------------------------------------------------------------------------


def prefix_hit(plan, n_tokens: int, window: int | None, block_size: int, cached: dict) -> dict:
    """The longest cached prefix a new request of ``n_tokens`` can reuse, per layer kind and for the request.

    ``cached`` says what the pool still holds of this request's prefix (blocks whose chained hash matches):
    ``cached["full"]`` and ``cached["window"]`` the indices of cached blocks, ``cached["state"]`` the
    lengths (multiples of block_size) at which a state layer's state was saved. A reuse point R is a block
    boundary, at most ``(n_tokens - 1) // block_size`` blocks (the last token is computed, as in
    ``PagedKVCache.lookup``), and a kind can resume at R when:

    - full: blocks 0 .. R/bs - 1 are all cached;
    - window: the blocks holding positions R - W + 1 .. R - 1 are cached (the token at R reads the W - 1
      before it; vLLM's ``SlidingWindowManager.find_longest_cache_hit`` asks for cdiv(W - 1, block_size)
      contiguous cached blocks ending at R) — a window layer that freed them cannot resume there, even where
      the full layers could;
    - state: a state was saved at exactly R (a recurrent state summarises the whole prefix: it cannot be
      cut back to an earlier length). Without saved states a state layer never hits, which is what vLLM
      issue #51250 ("Prefix caching is ineffective on Mamba-2/GDN hybrid") reports: 0% hits, because
      the recurrent state is not in the prefix cache.

    R = 0 always works. The request reuses the largest R at which *every* kind of its plan can resume: at
    most the minimum of the kinds' own longest hits, and less when a window layer's valid points are not
    the full layers'. Returns ``{kind: that kind's longest hit, ..., "request": the request's}`` in tokens.

    A 32-token request ran before with W = 8 (bs = 4): its full layers kept blocks 0-7, its window layers
    only 6-7 (``blocks_held``). A new request that shares its first 20 tokens (blocks 0-4) finds its full
    layers' prefix but not its window layers' one; a request that shares all 32 tokens finds both:

    >>> plan, old = ["window", "full"], {kind: blocks_held(kind, 32, 8, 4) for kind in ("window", "full")}
    >>> old
    {'window': [6, 7], 'full': [0, 1, 2, 3, 4, 5, 6, 7]}
    >>> prefix_hit(plan, 30, 8, 4, cached={kind: [b for b in held if b < 5] for kind, held in old.items()})
    {'window': 0, 'full': 20, 'request': 0}
    >>> prefix_hit(plan, 40, 8, 4, cached=old)
    {'window': 32, 'full': 32, 'request': 32}
    """
    plan = _check_plan(plan)
    window = _check_window(plan, window)
    n, bs = check_int("n_tokens", n_tokens), check_int("block_size", block_size)
    if not isinstance(cached, dict) or any(k not in LAYER_KINDS for k in cached):
        raise ValueError(f"cached must be a dict with keys among {LAYER_KINDS}, got {cached!r:.80}")
    sets = {kind: set(cached.get(kind, ())) for kind in LAYER_KINDS}
    points = [k * bs for k in range((n - 1) // bs + 1)]  # candidate reuse points, in tokens

    def resumes(kind, R):
        if R == 0:
            return True
        if kind == "full":
            return all(b in sets["full"] for b in range(R // bs))
        if kind == "window":
            return all(b in sets["window"] for b in range(max(0, R - window + 1) // bs, R // bs))
        return R in sets["state"]

    kinds = list(dict.fromkeys(plan))  # the kinds present, in plan order
    out = {kind: max(R for R in points if resumes(kind, R)) for kind in kinds}
    out["request"] = max(R for R in points if all(resumes(kind, R) for kind in kinds))
    return out


# --------------------------------------------------------------------------------------------
# Layers with a fixed-size state
# --------------------------------------------------------------------------------------------

#: Jamba (Lieber et al. 2024, "Jamba: A Hybrid Transformer-Mamba Language Model", arXiv:2403.19887): one
#: attention layer per 8 (a : m = 1 : 7), Mamba layers otherwise. The sizes are those of the released
#: checkpoint's config.json (huggingface.co/ai21labs/Jamba-v0.1): 32 layers (attn_layer_period 8, so 4
#: attention layers), hidden_size 4096, 32 query / 8 K/V heads (head dim 4096 / 32 = 128), mamba_expand 2,
#: mamba_d_state 16, mamba_d_conv 4. The state shapes are the Mamba reference code's
#: (github.com/state-spaces/mamba, ``mamba_ssm/modules/mamba_simple.py``, ``allocate_inference_cache``):
#: a conv state (d_inner, d_conv) and an SSM state (d_inner, d_state) per layer and sequence, d_inner =
#: expand x hidden_size, both in the weights' dtype there.
JAMBA_V01 = dict(n_layers=32, attention_every=8, n_kv_heads=8, head_dim=128, d_model=4096, mamba_expand=2,
                 mamba_d_state=16, mamba_d_conv=4)


def state_hybrid_bytes(n_tokens: int, config: dict = JAMBA_V01, bytes_per_element: int = 2) -> dict:
    """Bytes one sequence of ``n_tokens`` holds in a model of attention + fixed-state (Mamba) layers.

    Returns kv (the attention layers' cache, grows with n), state (the Mamba layers' conv + SSM states,
    the same at every length), total, per_token (total / n: the state's share shrinks as n grows) and
    all_attention (the cache if every layer were attention, for comparison). ``bytes_per_element`` is used
    for both (a server may keep the SSM state in fp32: pass 4 and compare).

    Jamba's paper gives its KV cache at 256K tokens in 16 bits as 4GB (Table 1); the config gives it too:

    >>> b = state_hybrid_bytes(256 * 1024)
    >>> b["kv"] / 2**30, b["state"] / 2**20  # GiB of K/V; MiB of state (28 Mamba layers), per sequence
    (4.0, 8.75)
    >>> [round(state_hybrid_bytes(n)["per_token"]) for n in (1024, 8192, 65536)]  # vs 131072 all-attention
    [25344, 17504, 16524]
    """
    n = check_int("n_tokens", n_tokens)
    c = dict(config)
    missing = sorted(set(JAMBA_V01) - set(c))
    if missing:
        raise ValueError(f"config lacks {missing} (see JAMBA_V01 for the keys)")
    bpe = check_int("bytes_per_element", bytes_per_element)
    n_layers, every = check_int("n_layers", c["n_layers"]), check_int("attention_every", c["attention_every"])
    n_attn = n_layers // every
    per_position = 2 * c["n_kv_heads"] * c["head_dim"] * bpe  # one attention layer, K and V
    d_inner = c["mamba_expand"] * c["d_model"]
    state = (n_layers - n_attn) * d_inner * (c["mamba_d_conv"] + c["mamba_d_state"]) * bpe
    kv = n_attn * per_position * n
    return {"kv": kv, "state": state, "total": kv + state, "per_token": (kv + state) / n,
            "all_attention": n_layers * per_position * n}
