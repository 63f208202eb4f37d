"""Chapter 06's diagram, drawn from a live tensor and the scales ``kvlib.quant.quantize_int8`` returns for it.

- ``groups(x, dims)``: a (T, D) slice of a key or value tensor (tokens down, channels across), once per
  granularity. Each number is a cell shaded by its magnitude; every quantization group (the numbers that
  share one scale) is framed; the number that set the group's scale (its largest magnitude, which lands on
  ±127) is marked; the group's scale is written in a cell beside the grid, shaded by its value (per token: a
  column at the right, one per row; per channel: a row below, one per column, written vertically).

The scales come from ``quantize_int8(x, dim)`` itself, not from a second computation, so the picture is
what the cache would store. Gids: ``"value"`` (one per number), ``"group"`` (one frame per group),
``"scale"`` (one per scale), ``"max"`` (one per group), so a test can count them against
``quantize_int8``'s shapes.
"""

from __future__ import annotations

import torch

from . import COLORS, label, new_figure

__all__ = ["groups", "GRANULARITY"]

SIZE = 0.24  # inches per cell
# The two granularities the chapter draws, as ``quantize_int8``'s dim for a (T, D) slice.
GRANULARITY = {"per token (one scale per row)": -1, "per channel (one scale per column)": 0}


def _frame(ax, x, y, w, h, gid, color, lw=1.6):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor="none", edgecolor=color, linewidth=lw, gid=gid))


def _panel(ax, x0, top, x, dim, name):
    """One granularity: the cells, the group frames, the max markers and the scales. Returns the height used."""
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle

    from ...quant import quantize_int8

    T, D = x.shape
    _, scale = quantize_int8(x, dim)  # (T, 1) per token, (1, D) per channel
    mag = x.abs().float()
    cmap, vmax = colormaps["Greys"], float(mag.max()) or 1.0
    s_max = float(scale.max()) or 1.0
    label(ax, x0, top - 0.15, f"{name}: {scale.numel()} groups, {scale.numel()} scales", fontsize=9)
    y_top = top - 0.35
    for t in range(T):
        for d in range(D):
            shade = cmap(0.08 + 0.8 * float(mag[t, d]) / vmax)
            ax.add_patch(Rectangle((x0 + d * SIZE, y_top - (t + 1) * SIZE), SIZE, SIZE, facecolor=shade,
                                   edgecolor="white", linewidth=0.4, gid="value"))
    per_row = dim in (-1, 1)
    n_groups = T if per_row else D
    for g in range(n_groups):
        gx, gy = (x0, y_top - (g + 1) * SIZE) if per_row else (x0 + g * SIZE, y_top - T * SIZE)
        _frame(ax, gx, gy, D * SIZE if per_row else SIZE, SIZE if per_row else T * SIZE, "group", COLORS["key"])
        row = mag[g] if per_row else mag[:, g]
        i = int(row.argmax())  # the number that set this group's scale
        mx, my = (x0 + i * SIZE, gy) if per_row else (gx, y_top - (i + 1) * SIZE)
        _frame(ax, mx + 0.03, my + 0.03, SIZE - 0.06, SIZE - 0.06, "max", COLORS["new"], lw=1.4)
        s = float(scale.flatten()[g])
        w, h = (2.6 * SIZE, SIZE) if per_row else (SIZE, 2.6 * SIZE)
        sx, sy = (x0 + D * SIZE + 0.15, gy) if per_row else (gx, y_top - T * SIZE - 0.1 - h)
        level = s / s_max  # the scale cells are shaded by value too: a larger scale, a darker cell
        ax.add_patch(Rectangle((sx, sy), w, h, facecolor=colormaps["Blues"](0.15 + 0.8 * level),
                               edgecolor="white", linewidth=0.4, gid="scale"))
        ax.text(sx + w / 2, sy + h / 2, f"{s:.3f}", ha="center", va="center", fontsize=5.5 if per_row else 4.5,
                rotation=0 if per_row else 90, color="white" if level > 0.5 else "black")
    if per_row:
        label(ax, x0 + D * SIZE + 0.15, y_top + 0.1, "scale", fontsize=7)
    else:
        label(ax, x0 - 0.05, y_top - (T + 1.3) * SIZE - 0.1, "scale", ha="right", fontsize=7)
    return 0.35 + (T + 3.1) * SIZE + 0.25


def groups(x: torch.Tensor, dims: dict | None = None, *, title: str | None = None):
    """The (T, D) tensor ``x`` quantized at each granularity of ``dims`` ({name: quantize_int8's dim}, default
    ``GRANULARITY``: per token and per channel), one panel under the other. Returns the Figure."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a (T, D) tensor: one head's keys or values, got {getattr(x, 'shape', x)}")
    dims = GRANULARITY if dims is None else dims
    for dim in dims.values():
        if dim not in (-1, 0, 1):
            raise ValueError(f"groups draws per token (dim -1 or 1) or per channel (dim 0), got dim {dim}")
    T, D = x.shape
    panel_h = 0.35 + (T + 3.1) * SIZE + 0.25
    width = 0.6 + D * SIZE + 1.1
    fig, ax = new_figure(max(width, 6.0), 0.4 + len(dims) * panel_h + 0.3, title=title)
    top = 0.4 + len(dims) * panel_h
    for name, dim in dims.items():
        top -= _panel(ax, 0.5, top, x, dim, name)
    for d in range(0, D, 4):  # channel numbers under the last panel
        label(ax, 0.5 + (d + 0.5) * SIZE, 0.25, str(d), ha="center", fontsize=6)
    label(ax, 0.5, 0.05, "channel (dimension of the head); rows are tokens; a red frame marks the number "
          "that set its group's scale", fontsize=7)
    return fig
