"""Chapter 01's diagram: one head's Q, K, V and the attention weights they give, the causal mask drawn.

``qkv(q, k, v, causal)`` draws the live tensors of one attention head and what attention makes of them:

- Q (T rows, one per query token, D columns) on the left, its rows level with the rows of P;
- Kᵀ (D rows, S columns, one per key token) above P, its columns level with the columns of P;
- P = softmax(Q Kᵀ / √D + mask), the T × S attention weights, each cell printed (row i: how query i
  spreads its attention over the keys); cells the causal mask hides are drawn "masked";
- V (S rows, one per key token) and out = P V (T rows) on the right.

Every cell carries a gid: "query", "key", "value", "output", "visible" (a weight the mask lets through) and
"masked", so ``cells_with(fig, "masked")`` is the number of (query, key) pairs the mask hides:
T(T-1)/2 for a causal prefill of T tokens, 0 without the mask (``tests/test_draw_attention.py``).
"""

from __future__ import annotations

import math

import torch
from matplotlib import colormaps
from matplotlib.patches import Rectangle

from . import COLORS, cells, label, new_figure

__all__ = ["qkv", "attention_weights", "MAX_TOKENS", "MAX_DIM"]

MAX_TOKENS = 12  # query or key tokens a readable picture holds
MAX_DIM = 16  # head dims a readable picture holds


def _one_head(t: torch.Tensor, name: str, batch: int, head: int) -> torch.Tensor:
    """(T, D) of one head: a 2-D tensor as it is, a (B, H, T, D) one at [batch, head]."""
    if t.dim() == 2:
        return t.detach().float().cpu()
    if t.dim() == 4:
        return t[batch, head].detach().float().cpu()
    raise ValueError(f"qkv: {name} must be (T, D) or (B, H, T, D), got shape {tuple(t.shape)}")


def attention_weights(q: torch.Tensor, k: torch.Tensor, causal: bool = True):
    """(P, hidden) for one head, q (T, D) and k (S, D): the (T, S) weights and where the mask hides a key.

    The mask is aligned to the end, as in ``kvlib.attention.attention_ref``: query i sits at position
    S - T + i and sees keys 0 .. S - T + i."""
    T, S = q.shape[0], k.shape[0]
    scores = q @ k.T / math.sqrt(q.shape[1])  # (T, S)
    hidden = torch.zeros(T, S, dtype=torch.bool)
    if causal:
        hidden = torch.arange(S)[None, :] > torch.arange(T)[:, None] + (S - T)  # key j after query i
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1), hidden


def _one_decimal(v: float) -> str:
    return f"{v:.1f}".replace("-0.0", "0.0")


def _matrix(ax, x, y_top, values, kind, size, fontsize):
    """A matrix of cells of one kind, its first row on top at y_top, each cell showing its value."""
    rows = []
    for r in range(values.shape[0]):
        texts = [_one_decimal(v) for v in values[r].tolist()]
        rows += cells(ax, x, y_top - (r + 1) * size, [kind] * values.shape[1], size=size, texts=texts,
                      fontsize=fontsize)
    return rows


def qkv(q, k, v, causal: bool = True, *, batch: int = 0, head: int = 0, title: str | None = None):
    """Draw one head's Q, Kᵀ, the weights P (masked cells greyed out), V and out = P V.

    q: (T, D) or (B, H, T, D); k, v: (S, D) or (B, H_KV, S, D) with T <= S (a 4-D k with fewer heads is read
    at the K/V head that query head ``head`` shares, as in grouped-query attention). Returns the Figure.
    Raises ValueError for more than MAX_TOKENS tokens or MAX_DIM head dims: draw a smaller case.
    """
    qh = _one_head(q, "q", batch, head)
    kv_head = head // (q.shape[1] // k.shape[1]) if q.dim() == 4 and k.dim() == 4 else head
    kh, vh = _one_head(k, "k", batch, kv_head), _one_head(v, "v", batch, kv_head)
    (T, D), S = qh.shape, kh.shape[0]
    if kh.shape != vh.shape or kh.shape[1] != D or T > S:
        raise ValueError(f"qkv: need q (T, D), k and v (S, D) with T <= S; got {tuple(qh.shape)}, "
                         f"{tuple(kh.shape)}, {tuple(vh.shape)}")
    if max(T, S) > MAX_TOKENS or D > MAX_DIM:
        raise ValueError(f"qkv: {max(T, S)} tokens of dim {D} is too many to draw; pick at most {MAX_TOKENS} tokens "
                         f"and {MAX_DIM} dims (the picture is the same at any size)")
    P, hidden = attention_weights(qh, kh, causal)
    out = P @ vh  # (T, D)

    size = 0.36 if max(D, S) <= 8 else 0.28
    fs = 6 if size < 0.36 else 6.5
    gap, left, bottom = 0.55, 0.75, 0.75
    x_q, x_p = left, left + D * size + gap
    x_v = x_p + S * size + gap
    x_o = x_v + D * size + gap
    y_p = bottom + max(T, S) * size  # top of P, Q, V and out
    y_k = y_p + gap + D * size  # top of Kᵀ
    height = y_k + 0.45
    fig, ax = new_figure(x_o + D * size + 0.3, height)

    _matrix(ax, x_q, y_p, qh, "query", size, fs)
    _matrix(ax, x_p, y_k, kh.T, "key", size, fs)  # Kᵀ: column j is key j
    _matrix(ax, x_v, y_p, vh, "value", size, fs)
    cmap = colormaps["Purples"]
    for i in range(T):  # P: visible weights coloured by their value, masked ones grey
        for j in range(S):
            x, y = x_p + j * size, y_p - (i + 1) * size
            if hidden[i, j]:
                cells(ax, x, y, ["masked"], size=size)
                continue
            w = P[i, j].item()
            ax.add_patch(Rectangle((x, y), size, size, facecolor=cmap(0.15 + 0.85 * w), edgecolor="white",
                                   linewidth=1.0, gid="visible"))
            ax.text(x + size / 2, y + size / 2, f"{w:.2f}".lstrip("0") if w < 1 else "1", ha="center", va="center",
                    fontsize=fs, color="white" if w > 0.45 else COLORS["text"])
    for i in range(T):  # out = P V
        for j in range(D):
            x, y = x_o + j * size, y_p - (i + 1) * size
            ax.add_patch(Rectangle((x, y), size, size, facecolor="#6F6F6F", edgecolor="white", linewidth=1.0,
                                   gid="output"))
            ax.text(x + size / 2, y + size / 2, _one_decimal(out[i, j].item()), ha="center", va="center", fontsize=fs,
                    color="white")

    for i in range(T):  # row and column names
        label(ax, x_q - 0.08, y_p - (i + 0.5) * size, f"q{S - T + i}", ha="right", fontsize=7)
    for j in range(S):
        label(ax, x_p + (j + 0.5) * size, y_p - T * size - 0.12, f"k{j}", ha="center", va="top", fontsize=7)
        label(ax, x_v - 0.08, y_p - (j + 0.5) * size, f"v{j}", ha="right", fontsize=7)
    head_note = "" if q.dim() == 2 else f" (batch {batch}, head {head})"
    label(ax, x_q, y_p + 0.15, f"Q: {T} queries × D={D}", va="bottom", fontsize=8)
    label(ax, x_p, y_k + 0.1, f"Kᵀ: D={D} × {S} keys (column j is key j)", va="bottom", fontsize=8)
    label(ax, x_p, y_p + 0.15, "P = softmax(Q Kᵀ / √D" + (" + mask)" if causal else ")"), va="bottom", fontsize=8)
    label(ax, x_v, y_p + 0.15, f"V: {S} keys × D", va="bottom", fontsize=8)
    label(ax, x_o, y_p + 0.15, "out = P V", va="bottom", fontsize=8)
    n_hidden = int(hidden.sum())
    legend_y = 0.18
    ax.add_patch(Rectangle((x_q, legend_y), 0.2, 0.2, facecolor=COLORS["masked"], edgecolor="white"))
    label(ax, x_q + 0.28, legend_y + 0.1, f"hidden by the causal mask: weight exactly 0 ({n_hidden} of {T * S} pairs)"
          if causal else f"no mask: every query sees all {S} keys", fontsize=8)
    ax.set_title(title or f"One attention head{head_note}: {T} query tokens, {S} keys, head dim {D}; "
                 "each row of P sums to 1", fontsize=10)
    return fig
