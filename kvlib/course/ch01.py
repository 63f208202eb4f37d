"""Chapter 01's plumbing: the bookkeeping, tables and plotting style its cells call, kept out of the cells.

Nothing here teaches attention (``kvlib.attention`` does, and the notebook's own cells): these functions
measure what the tiny model's heads look at, draw their maps, count the key tiles a kernel visits and lay
out the prefill sweep's numbers.
"""

from __future__ import annotations

import torch

__all__ = ["head_stats", "uniform_share", "strongest", "heads_to_draw", "plot_heads", "word_starts",
           "word_start_table", "effective_weights", "running_max_raises", "key_tiles_visited", "prefill_table",
           "checked_table", "score_matrix_mib", "reference_summary", "sdpa_kernel", "ref_vs_sdpa", "survey",
           "show_prefill", "chunked_attention"]

STATS = ("previous char", "itself", "char 0")


def head_stats(weights: dict):
    """For every (layer, head): the mean weight a query puts on the previous character, on itself and on
    character 0 (rows 1 .. T-1). ``weights``: {layer: (1, H, T, T) attention weights}. A DataFrame."""
    import pandas as pd

    rows = []
    for layer, w in sorted(weights.items()):
        w = w[0]  # (H, T, T)
        T = w.shape[-1]
        i = torch.arange(1, T)
        prev, self_, first = w[:, i, i - 1].mean(-1), w[:, i, i].mean(-1), w[:, 1:, 0].mean(-1)  # (H,) each
        for h in range(w.shape[0]):
            rows.append({"layer": layer, "head": h, STATS[0]: prev[h].item(), STATS[1]: self_[h].item(),
                         STATS[2]: first[h].item()})
    return pd.DataFrame(rows)


def uniform_share(T: int) -> float:
    """The mean weight a uniform head gives any one key over rows 1 .. T-1: row i spreads 1/(i+1) on i+1 keys."""
    return sum(1 / (i + 1) for i in range(1, T)) / (T - 1)


def strongest(stats, column: str) -> tuple[int, int, float]:
    """(layer, head, value) of the head with the largest ``column``."""
    r = stats.loc[stats[column].idxmax()]
    return int(r["layer"]), int(r["head"]), float(r[column])


def heads_to_draw(stats) -> list[tuple[int, int, str]]:
    """The heads the table singles out, as (layer, head, what it was picked for): the strongest head of each
    pattern, then the head whose strongest pattern is the weakest (a head with no single favourite)."""
    picks = []
    for column in STATS:
        layer, head, _ = strongest(stats, column)
        if all((layer, head) != (p[0], p[1]) for p in picks):
            picks.append((layer, head, f"strongest on {column}"))
    plain = stats.loc[stats[list(STATS)].max(axis=1).idxmin()]
    picks.append((int(plain["layer"]), int(plain["head"]), "no single favourite"))
    return picks


def word_starts(prompt: str) -> tuple[list[int], list[str]]:
    """Positions of the first letter of each word, and the words (tick labels)."""
    starts = [i for i, c in enumerate(prompt) if c != " " and (i == 0 or prompt[i - 1] == " ")]
    return starts, [prompt[i:].split(" ")[0].rstrip(".") for i in starts]


def plot_heads(weights: dict, picks, prompt: str, device: str):
    """Heat maps of the picked heads' weights, one colour scale for all (square root, to spread out small
    weights), ticks at the first letter of each word. Returns the Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import PowerNorm

    starts, words = word_starts(prompt)
    norm = PowerNorm(gamma=0.5, vmin=0, vmax=1)
    fig, axes = plt.subplots(1, len(picks), figsize=(4.6 * len(picks) + 1.2, 5.6), constrained_layout=True)
    for ax, (layer, head, why) in zip(axes, picks):
        im = ax.imshow(weights[layer][0, head], cmap="viridis", norm=norm)
        ax.set_title(f"layer {layer}, head {head}\n({why})", fontsize=10)
        ax.set_xticks(starts, words, rotation=90, fontsize=7)
        ax.set_yticks(starts, words, fontsize=7)
        ax.set_xlabel("key (earlier character)", fontsize=9)
        ax.set_ylabel("query (character)", fontsize=9)
    cb = fig.colorbar(im, ax=axes, shrink=0.8, ticks=[0, 0.01, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1])
    cb.set_label("attention weight, square-root colour scale", fontsize=9)
    fig.suptitle(f"Attention weights of the tiny model on a real prompt ({device})", fontsize=11)
    return fig


def _start_of_word(prompt: str) -> list:
    """The position of the first letter of the word each character belongs to (None for a space)."""
    start_of_word = []
    for i, c in enumerate(prompt):
        start_of_word.append(None if c == " " else (i if i == 0 or prompt[i - 1] == " " else start_of_word[-1]))
    return start_of_word


def word_start_table(weights: dict, prompt: str, top: int = 5):
    """For every head and every character at least two into its word, the first word left out (its start is
    character 0, the landmark, so it would mix the two patterns): the mean weight on the word's first letter,
    against what the same head gives, on average over the prompt, to any character at that distance.
    Returns (number of such characters, DataFrame of the ``top`` heads by ratio)."""
    import pandas as pd

    start_of_word = _start_of_word(prompt)
    inside = [i for i, s in enumerate(start_of_word) if s is not None and s > 0 and i - s >= 2]
    T = len(prompt)
    rows = []
    for layer, w in sorted(weights.items()):
        w = w[0]  # (H, T, T)
        by_distance = torch.stack([torch.stack([w[:, j, j - d] for j in range(d, T)], -1).mean(-1)
                                   for d in range(T)])  # (T, H): mean weight on the key d characters back
        on_start = torch.stack([w[:, i, start_of_word[i]] for i in inside], -1).mean(-1)  # (H,)
        expected = torch.stack([by_distance[i - start_of_word[i]] for i in inside], -1).mean(-1)  # (H,)
        for h in range(w.shape[0]):
            rows.append({"layer": layer, "head": h, "on the word start": on_start[h].item(),
                         "any char at that distance": expected[h].item(),
                         "ratio": on_start[h].item() / expected[h].item()})
    table = pd.DataFrame(rows).sort_values("ratio", ascending=False).head(top).reset_index(drop=True)
    return len(inside), table


def survey(model, tok, prompts, recorder):
    """The measurements of section 5 on several prompts, one row each: the strongest previous-character head
    (with RoPE, and with every token at position 0, so RoPE adds no angle between tokens), the strongest
    character-0 head, and the head with the highest word-start ratio (first word left out). ``recorder``: a
    class whose instances record ``weights`` {layer: (1, H, T, T)} through the model's seam. A DataFrame."""
    import pandas as pd

    def head(stats, column, u):
        layer, h, value = strongest(stats, column)
        return f"L{layer}H{h} {value:.2f} ({value / u:.1f}x)"

    rows = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt)], device=model.device)
        rec, flat = recorder(), recorder()
        with torch.no_grad():
            model(ids, cache=rec)
            model(ids, positions=torch.zeros_like(ids), cache=flat)  # every token at position 0
        stats, u = head_stats(rec.weights), uniform_share(ids.shape[1])
        _, ws = word_start_table(rec.weights, prompt, top=1)
        best = ws.iloc[0]
        rows.append({"prompt": " ".join(prompt.split()[:3]) + " ...",
                     "previous char": head(stats, "previous char", u),
                     "prev. char, no RoPE": head(head_stats(flat.weights), "previous char", u),
                     "char 0": head(stats, "char 0", u),
                     "word start": f"L{int(best['layer'])}H{int(best['head'])} {best['on the word start']:.2f}"
                                   f" (ratio {best['ratio']:.2f})"})
    return pd.DataFrame(rows)


def effective_weights(scores: torch.Tensor) -> float:
    """e^entropy of softmax(scores): how many keys share the attention (1 for one-hot, n for uniform)."""
    p = torch.softmax(scores.double(), 0)
    return torch.exp(-(p * p.clamp_min(1e-300).log()).sum()).item()


def running_max_raises(scores: torch.Tensor, tile: int) -> tuple[int, int]:
    """(tiles, how many tiles raised the running maximum) when ``scores`` are streamed ``tile`` at a time."""
    tile_max = torch.stack([scores[i:i + tile].max() for i in range(0, scores.numel(), tile)])
    raised = int((tile_max[1:] > torch.cummax(tile_max, 0).values[:-1]).sum())
    return len(tile_max), raised


def key_tiles_visited(S: int, TILE_M: int, TILE_N: int) -> dict:
    """Key tiles one (batch, head) of a causal prefill (T = S) loads, summed over its query tiles: the minimal
    kernel visits every tile; the full kernel stops at the last row's position (``hi``) and masks only the
    tiles from ``lo`` on, exactly as ``kvlib.attention._flash_attention_kernel`` computes them."""
    minimal = full = masked = 0
    for start_m in range(0, S, TILE_M):
        minimal += -(-S // TILE_N)
        lo = (start_m + 1) // TILE_N * TILE_N
        hi = min(S, start_m + TILE_M)
        full += lo // TILE_N + len(range(lo, hi, TILE_N))
        masked += len(range(lo, hi, TILE_N))
    return {"minimal kernel": minimal, "full kernel": full, "of which masked": masked}


def prefill_table(rows) -> str:
    """The timed rows of the prefill sweep: time, TFLOP/s and speed relative to SDPA, per length."""
    import pandas as pd

    timed = pd.DataFrame([r for r in rows if r.get("time_ms") is not None])
    table = timed.pivot_table(index=["H", "H_KV", "D", "dtype", "S"], columns="kernel",
                              values=["time_ms", "tflops", "vs_baseline"])
    return table.to_string(float_format=lambda v: f"{v:.3g}")


def checked_table(rows) -> str:
    """Each kernel's largest difference from SDPA, over the points where it was checked."""
    import pandas as pd

    checked = pd.DataFrame([r for r in rows if r.get("max_abs_err") is not None])
    return (checked.groupby(["kernel", "dtype", "status"])["max_abs_err"]
            .agg(points="count", max_abs_err_vs_SDPA="max").to_string(float_format=lambda v: f"{v:.1e}"))


def score_matrix_mib(rows) -> str:
    """What attention_ref stores at each timed point: the (B, H, S, S) fp32 score matrix, in MiB."""
    sizes = sorted({(r["B"], r["H"], r["S"]) for r in rows if r.get("kernel") == "attention_ref"
                    and r.get("time_ms") is not None})
    return ", ".join(f"S={S}: {B * H * S * S * 4 / 2**20:g} MiB" for B, H, S in sizes)


def reference_summary(label: str, ref_rows) -> list[str]:
    """One line per kernel of a committed GPU run: its speed relative to SDPA, median and range."""
    lines = [f"reference GPU (dashed): {label}"] if ref_rows else []
    for kernel in sorted({r["kernel"] for r in ref_rows if r.get("vs_baseline") is not None}):
        ratios = sorted(r["vs_baseline"] for r in ref_rows if r["kernel"] == kernel and r.get("vs_baseline") is not None)
        lines.append(f"{kernel} / SDPA speed on the reference GPU: median {ratios[len(ratios) // 2]:.2f}x, "
                     f"{ratios[0]:.2f}x to {ratios[-1]:.2f}x over {len(ratios)} points")
    return lines


def sdpa_kernel(q, k, v, **kwargs) -> list[str]:
    """The aten operators that ``scaled_dot_product_attention`` dispatched to here (read with a dispatch mode,
    which sees every operator PyTorch runs, below the Python API)."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    names = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func) and str(func) not in names:
                names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        F.scaled_dot_product_attention(q, k, v, **kwargs)
    return names


def chunked_attention(q, k, v, chunk: int = 64):
    """attention_ref's computation (explicit scores, causal mask, softmax, P V, T == S) done ``chunk`` query rows
    at a time: the same arithmetic, but the score block in memory is (chunk, S), small enough to stay in the
    CPU's caches, instead of the whole (S, S) matrix. The control of ``ref_vs_sdpa``."""
    import math

    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    S = k.shape[2]
    keys = torch.arange(S, device=q.device)
    out = []
    for a in range(0, q.shape[2], chunk):
        s = q[:, :, a:a + chunk] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, chunk, S)
        rows = torch.arange(a, min(a + chunk, q.shape[2]), device=q.device)[:, None]
        out.append(torch.softmax(s.masked_fill(keys[None, :] > rows, float("-inf")), -1) @ v)
    return torch.cat(out, 2)


def ref_vs_sdpa(lengths=(256, 1024), rounds: int = 5, budget_s: float = 1.5, B: int = 1, H: int = 8, H_KV: int = 2,
                D: int = 64) -> dict:
    """attention_ref's speed as a fraction of SDPA's (SDPA's time / attention_ref's) at each length, fp32 on this
    device, and the same fraction for ``chunked_attention`` (the same arithmetic, 64 query rows at a time, so
    no S x S matrix is stored): {S: (attention_ref, chunked)}. The three are timed in turn, at least ``rounds``
    times and for at least ``budget_s`` seconds per length, and each keeps its fastest call: a burst of other
    work on a busy machine slows some calls, not the fastest."""
    import time

    import torch.nn.functional as F

    from kvlib.attention import attention_ref

    out = {}
    for S in lengths:
        g = torch.Generator().manual_seed(S)
        q = torch.randn(B, H, S, D, generator=g)
        k, v = torch.randn(B, H_KV, S, D, generator=g), torch.randn(B, H_KV, S, D, generator=g)
        kr, vr = k.repeat_interleave(H // H_KV, 1), v.repeat_interleave(H // H_KV, 1)
        calls = {"ref": lambda: attention_ref(q, k, v), "chunked": lambda: chunked_attention(q, k, v),
                 "sdpa": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True)}
        best = {name: float("inf") for name in calls}
        for fn in calls.values():
            fn()  # warm-up
        start, n = time.perf_counter(), 0
        while n < rounds or time.perf_counter() - start < budget_s:
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
            n += 1
        out[S] = (best["sdpa"] / best["ref"], best["sdpa"] / best["chunked"])
    return out


def show_prefill(rows):
    """Draw the prefill sweep as ``results.show`` does (this machine's rows, the committed GPU run dashed), with
    a title that names both shapes: the dashed curves are another dtype, head dim and head layouts. Checks
    every row first. Returns (reference label, reference rows)."""
    import matplotlib.pyplot as plt

    from kvlib import runtime
    from kvlib.bench import results

    results._refuse_mismatches(rows)
    label, ref_rows = (None, []) if runtime.mode() == "gpu" else results.reference("prefill")
    fig = results.plot_sweep(rows, "prefill", reference_rows=ref_rows, reference_label=label)
    timed = [r for r in rows if r.get("time_ms") is not None]

    def shape(rs, what):
        return ", ".join(f"{k}={'/'.join(str(x) for x in sorted({r[k] for r in rs if r.get(k) is not None}))}"
                         for k in ("B", "D", "dtype")) + f" ({what})"

    title = "prefill: " + shape(timed, "here")
    if ref_rows:
        title += "\ndashed: " + shape([r for r in ref_rows if r.get("time_ms") is not None], label.split(",")[0])
    for ax in fig.axes:
        ax.set_title(title, fontsize=9)
    plt.show()
    return label, ref_rows
