"""Chapter 09b's harness (keeping fewer bits or fewer dimensions): the tables, the configurations and the chart the
notebook calls, so that its cells stay short. The protocol itself (passkey prompts, perplexity, memory measured
from the tensors held, Wilson intervals) is chapter 09's, shared with notebook 09a: ``kvlib.course.ch09``.

- ``record``: a model's keys before and after RoPE and its values on some text, one (H_KV, T, D) per layer;
- ``two_bit_table``: the round-trip error of 2-bit asymmetric codes with KIVI's groups and the other axis, at
  equal bytes;
- ``decode_args``: the arguments ``kivi_decode_attention`` and its reference take, read from a live cache;
- ``configurations``: the caches the chapter measures, each a ``(make_cache, grows)`` pair for
  ``ch09.evaluate``; ``SeenLengths`` lets the protocol's meter see SnapKV + KIVI's true length;
- ``run``: every configuration through the protocol, one row each, and how long it took;
- ``ppl_verdict``: one line per paired perplexity comparison, naming the lower cache only where the paired intervals
  over blocks of 16, 32 and 64 scored tokens all exclude 1 on the same side (``ppl_intervals``, ``robust_side``);
- ``mla_table``, ``cla_losses``, ``layer_sensitivity``, ``layer_plans``: sections 8-10;
- ``hf_kivi``: transformers' quantized cache (quanto, 2 bits, a residual window) beside ``KiviCache``;
- ``chart``: one quality-vs-memory chart, labelled points, time-averaged memory (dot) and peak (tick), the
  frontier dashed, Wilson intervals on the passkey; hollow points for formats whose bytes are counted by formula.
"""

from __future__ import annotations

import copy
import math
import time

import torch

from ..compress import MLA_CONFIGS, mha_bytes_per_token, mla_bytes_per_token, mla_gqa_groups, record_kv
from ..footprint import held_bytes
from ..lowbit import LayerQuantCache, dequantize_asym, plan_bits, quantize_asym
from . import ch09

__all__ = ["record", "two_bit_table", "decode_args", "SeenLengths", "configurations", "low_rank_configurations",
           "run", "summary", "headline", "pk", "ppl_verdict", "ppl_intervals", "robust_side", "BLOCKS",
           "low_rank_errors", "mla_table", "cla_losses",
           "layer_sensitivity", "layer_plans", "hf_kivi", "chart", "KIVI", "budget_evidence", "budget_reference", "check_budget_choice"]

KIVI = dict(group=32, flush="residual")  # G = 32 tokens per key group; keys leave the window R at a time (KIVI's code)


def record(model, ids):
    """(K before RoPE, K after RoPE, V): three lists, one (H_KV, T, D) tensor per layer, sequence 0 of ``ids``."""
    pre, post, v = _recorded(model, torch.as_tensor(ids).view(1, -1).to(model.device))
    return [x[0] for x in pre], [x[0] for x in post], [x[0] for x in v]


class _BothKeys:
    """A seam that keeps each layer's keys before and after RoPE and its values from one forward. It asks for the
    keys before RoPE and rotates them with the model's own ``apply_rope`` (the numbers ``record_kv(keys="post_rope")``
    keeps); ``same`` stays True while that rotation equals, bit for bit, the one ``record_kv(keys="pre_rope")``'s seam
    makes, so that this forward is the forward of both recordings."""

    keys_before_rope = True

    def __init__(self, model, T, device):
        from ..model import rope_cos_sin, rope_frequencies

        self.cos, self.sin = model.rope(torch.arange(T, device=device)[None], model.dtype)
        self.theirs = rope_cos_sin(torch.arange(T, device=device), rope_frequencies(model.config).to(device),
                                   model.dtype)
        self.pre, self.post, self.v, self.same = [], [], [], True

    def attend(self, layer_idx, q, k, v):
        from ..attention import attention_ref
        from ..model import apply_rope, rotate

        post = apply_rope(k, self.cos, self.sin)
        self.same = self.same and torch.equal(post, rotate(k, *self.theirs))
        self.pre.append(k.detach()), self.post.append(post.detach()), self.v.append(v.detach())
        return attention_ref(q, post, v, causal=True)


_RECORDED: dict = {}  # the last few recordings: {(weights, ids): (pre, post, v)}


@torch.no_grad()
def _recorded(model, ids: torch.Tensor):
    """``record_kv(model, ids, keys="pre_rope")``'s keys, ``record_kv(model, ids, keys="post_rope")``'s keys and the
    values, each a list of (B, H_KV, T, D), from one forward instead of two (``_BothKeys``; two when its check fails),
    remembered for the same weights and ids (sections 2 and 7 record the same texts more than once)."""
    key = (id(model), tuple((p.data_ptr(), p._version) for p in model.parameters()), tuple(ids.shape),
           tuple(ids.flatten().tolist()))
    if key not in _RECORDED:
        seam = _BothKeys(model, ids.shape[1], ids.device)
        model(ids, cache=seam, logits_to_keep=1)
        if seam.same:
            _RECORDED[key] = (seam.pre, seam.post, seam.v)
        else:  # the two rotations differ somewhere: record both ways, as record_kv does
            pre, _ = record_kv(model, ids, keys="pre_rope")
            post, v = record_kv(model, ids, keys="post_rope")
            _RECORDED[key] = (pre, post, v)
        while len(_RECORDED) > 3:
            _RECORDED.pop(next(iter(_RECORDED)))
    return _RECORDED[key]


def _rel(x, x_hat):
    return ((x_hat - x).norm() / x.norm()).item()


def _per_channel(x, bits, group):
    """(H, T, D) -> round trip, one (scale, zero) per channel over each group of ``group`` tokens."""
    H, T, D = x.shape
    g = x[:, : T // group * group].reshape(H, T // group, group, D)
    q, s, z = quantize_asym(g, bits, dim=2)
    return dequantize_asym(q, s, z).reshape(H, -1, D), x[:, : T // group * group]


def _per_token(x, bits, group):
    """(H, T, D) -> round trip, one (scale, zero) per token over each group of ``group`` channels."""
    H, T, D = x.shape
    q, s, z = quantize_asym(x.reshape(H, T, D // group, group), bits, dim=-1)
    return dequantize_asym(q, s, z).reshape(H, T, D), x


def two_bit_table(K, V, bits: int = 2, group: int = 32):
    """Relative error ‖x̂ − x‖ / ‖x‖ of K and V (lists of (H_KV, T, D)), mean over layers, with ``bits``-bit
    asymmetric codes along each axis in groups of ``group`` numbers (so both axes store the same bytes: codes
    plus an fp16 scale and zero per group). KIVI's choice is keys per channel and values per token."""
    import pandas as pd

    rows = {}
    for name, xs in (("K", K), ("V", V)):
        for axis, fn in (("per channel (groups of G tokens)", _per_channel),
                         ("per token (groups of G channels)", _per_token)):
            errs = [_rel(x.float(), fn(x.float(), bits, group)[0]) if fn is _per_token else
                    _rel(fn(x.float(), bits, group)[1], fn(x.float(), bits, group)[0]) for x in xs]
            rows[(name, axis)] = {"relative error": sum(errs) / len(errs),
                                  "worst layer": max(errs),
                                  "bytes per number": bits / 8 + 4 / group}
    return pd.DataFrame(rows).T


def decode_args(cache, layer: int, q: torch.Tensor):
    """The arguments of ``kivi_decode_attention(q, ...)`` (and of its reference) for a query q (B, H, D) over
    what a live ``KiviCache`` holds in ``layer``: its packed codes, scales, zeros and exact windows with their
    counts, as ``KiviCache.attend`` passes them (without a new token)."""
    n = cache.seq_lens.long()
    n_kq, n_vq = cache._n_kq(n), cache._n_vq(n)
    i = layer
    return (q, cache.k_packed[i], cache.k_scale[i], cache.k_zero[i], n_kq, cache.k[i], n - n_kq,
            cache.v_packed[i], cache.v_scale[i], cache.v_zero[i], n_vq, cache.v[i], n - n_vq, cache.group, cache.bits)


class SeenLengths:
    """A view of a ``SnapKiviCache`` for the protocol's meter: ``seq_lens`` is the positions each sequence has
    *seen* (held + dropped by SnapKV), as the other caches count them, so memory is compared with an fp16 cache of
    the true length. Everything else is the cache's own; the model calls ``attend`` through this view."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def prefill_whole(self):
        return getattr(self.cache, "prefill_whole", False)

    def attend(self, layer_idx, q, k, v):
        return self.cache.attend(layer_idx, q, k, v)

    def next_positions(self):
        return self.cache.next_positions()

    @property
    def seq_lens(self):
        return self.cache.seq_lens + self.cache.dropped


def configurations(model, names=None, *, snap_share: float = 0.5, text_len: int = ch09.N_TEXT):
    """{name: (make_cache(batch, length), grows)} for ``ch09.evaluate``; ``names`` picks some (default all).
    ``length`` is the task's (``ch09.evaluate`` passes the text's N or the prompts' P_LEN); a growing cache gets 8
    spare rows for the answer tokens fed after a prompt, as ``ch09.full_cache`` does. ``grows(n)``: the bytes a cache
    holding n tokens needs, counted from the tensors of one built for n (as a paged allocator would hold it);
    ``None``: the object is measured as it is (SnapKV keeps what it allocates). SnapKV's budget is ``snap_share`` of
    the *prompt* (the text's first half, or a whole passkey prompt), with 09a's voting window (``ch09.RULES``): at
    half the prompt these are 09a's points "SnapKV 25%" on the text and "SnapKV 50%" on the passkey."""
    from ..kivi import KiviCache, SnapKiviCache
    from ..quant import Int8KVCache

    def bytes_of(build):
        return lambda n: held_bytes(build(max(n, 1)), float_bytes=2).total

    def budget(length):  # a share of the prompt that is compressed: the text's first half, or a passkey prompt
        return ch09.budget_for(snap_share, length // 2 if length == text_len else length)

    def kivi(bits, R, **kw):
        build = lambda n: KiviCache.for_model(model, 1, n, bits=bits, residual=R, **KIVI, **kw)  # noqa: E731
        return (lambda b, L: _whole(KiviCache.for_model(model, b, L + 8, bits=bits, residual=R, **KIVI, **kw))), \
            bytes_of(build)

    def snap_kivi(b, L):
        live = SnapKiviCache.for_model(model, b, L + 8, budget(L), window=ch09._snap_window(budget(L)), bits=2,
                                       residual=32, **KIVI)
        _LIVE["snap"] = live
        return SeenLengths(_whole(live))

    def snap_kivi_bytes(n):  # KIVI's tensors for the positions the live cache holds (n counts the dropped ones too)
        held = int(_LIVE["snap"].seq_lens[0])
        return held_bytes(KiviCache.for_model(model, 1, max(held, 1), bits=2, residual=32, **KIVI), float_bytes=2).total

    def layers(bits):
        layout = LayerQuantCache.for_model(model, 1, 32, bits)  # the real format's bytes: the cache only simulates it
        return (lambda b, L: LayerQuantCache.for_model(model, b, L + 8, bits)), \
            (lambda n: layout.bytes_per_token(length=max(n, 1)) * n)

    int8 = lambda n: Int8KVCache.for_model(model, 1, n)  # noqa: E731
    share = f"{snap_share:.0%} of prompt"
    out = {
        "full cache": ch09.full_cache(model),
        "INT8 (chapter 06)": ((lambda b, L: Int8KVCache.for_model(model, b, L + 8)), bytes_of(int8)),
        "KIVI 4-bit, R=32": kivi(4, 32),
        "KIVI 2-bit, R=32": kivi(2, 32),
        "KIVI 2-bit, R=128": kivi(2, 128),
        "2-bit, prompt through the codes (not KIVI), R=32": kivi(2, 32, prefill="quantized"),
        f"SnapKV {share} + KIVI 2-bit": (snap_kivi, snap_kivi_bytes),
        f"SnapKV {share} (09a)": ((lambda b, L: ch09.RULES["SnapKV"](model, b, budget(L))), None),
    }
    for name, bits in (layer_plans.last or {}).items():
        out[name] = layers(bits)
    return out if names is None else {n: out[n] for n in names}


_LIVE: dict = {}


def _whole(cache):
    """Mark a KIVI cache whose prompt attends exactly over its own K/V before anything is stored (``prefill="exact"``,
    KIVI's rule; SnapKV then KIVI too) as reading the prompt whole, as ``kvlib.evict`` marks H2O and SnapKV: the
    protocol (``ch09.prefill``) then hands it the full cache's recorded prefill of the same prompt, layer by layer,
    and keeps it only where every layer's output is bit for bit the recorded one (the same numbers, fewer matrix
    products). ``prefill="quantized"`` (the prompt through its codes) is left unmarked."""
    cache.prefill_whole = getattr(cache, "prefill", "exact") == "exact"
    return cache


def low_rank_configurations(model, fit_ids, specs: dict):
    """{name: (make_cache, grows)} for low-rank caches: ``specs`` {name: (rank, keys, values)} with keys
    "pre_rope" / "post_rope" (where the key bases are fitted) and values "low_rank" / "exact"; the bases are
    fitted once on ``fit_ids``, another text than the one measured. Memory leaves out the bases, which a server holds
    once for all sequences (``_low_rank_bytes``)."""
    from ..compress import LowRankKVCache

    out = {}
    for name, (rank, keys, values) in specs.items():
        bases = _fit_low_rank(model, fit_ids, rank, keys)

        def build(b, n, bases=bases, values=values):
            return LowRankKVCache.for_model(model, b, n, bases, values=values)

        out[name] = ((lambda b, L, build=build: build(b, L + 8)),
                     (lambda n, build=build: _low_rank_bytes(build(1, max(n, 1)))))
    return out


def _low_rank_bytes(cache) -> int:
    """What a ``LowRankKVCache`` holds per sequence: every tensor (``held_bytes``, 2 bytes per floating-point number)
    but the projection bases U_k, U_v (and RoPE's frequencies), which are weights a server keeps once for all
    sequences, like the model's own."""
    shared = [*cache.U_k, *(cache.U_v or []), *([cache.inv_freq] if cache.inv_freq is not None else [])]
    return held_bytes(cache, float_bytes=2).total - sum(2 * t.numel() for t in shared)


def run(model, configs: dict, text, prompts, *, passkey=True, progress: bool = True):
    """Every configuration through ``ch09.evaluate`` -> ({name: row}, seconds). ``passkey``: True for all, False
    for none, or a set of names that get the passkey (the others perplexity only)."""
    rows, t0 = {}, time.perf_counter()
    items = list(configs.items())
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="caches", leave=False)
    for name, (make, grows) in items:
        with_pk = passkey is True or (passkey is not False and name in passkey)
        rows[name] = ch09.evaluate(model, make, text, prompts if with_pk else None, grows=grows)
    return rows, time.perf_counter() - t0


def summary(rows: dict, reference: str = "full cache"):
    """A table of the rows: memory (time-averaged and peak, % of fp16), perplexity with its interval and its ratio
    to the reference's on the same tokens (paired interval), passkey k/n with its Wilson interval."""
    import pandas as pd

    ref = rows[reference]["nll"]
    out = {}
    for name, r in rows.items():
        ratio, lo, hi = ch09.ppl_ratio_interval(r["nll"], ref)
        out[name] = {"memory %": 100 * r["memory"], "peak %": 100 * r["peak"], "perplexity": r["perplexity"],
                     "ppl 95%": f"[{r['ppl low']:.2f}, {r['ppl high']:.2f}]",
                     f"÷ {reference} (95%)": f"{ratio:.3f} [{lo:.3f}, {hi:.3f}]",
                     "passkey": ch09.rate(r["passkey k"], r["passkey n"]) if "passkey k" in r else "-",
                     "passkey memory %": 100 * r["passkey memory"] if "passkey memory" in r else float("nan")}
    return pd.DataFrame(out).T


def headline(name: str, row: dict) -> str:
    """One line per cache: memory held (time-averaged and peak, % of fp16), perplexity with its 95% interval, and the
    passkey with its Wilson interval and the memory held on the prompts, where it was run."""
    line = (f"{name}: held {100 * row['memory']:.1f}% of fp16 (peak {100 * row['peak']:.1f}%), perplexity "
            f"{row['perplexity']:.2f} [{row['ppl low']:.2f}, {row['ppl high']:.2f}]")
    if "passkey k" in row:
        line += f"; passkey {ch09.rate(*pk(row))} at {100 * row['passkey memory']:.1f}%"
    return line


def pk(row: dict) -> tuple[int, int]:
    """(k, n) of a row's passkey result, for ``ch09.verdict``."""
    return row["passkey k"], row["passkey n"]


BLOCKS = (16, 32, 64)  # scored tokens per bootstrap block: a perplexity verdict must hold under all three


def ppl_intervals(a: dict, b: dict, blocks=BLOCKS) -> tuple[float, dict]:
    """(ratio, {block: (low, high)}): perplexity of a over b on the same tokens, and its paired 95% bootstrap
    interval for each block size (``ch09.ppl_ratio_interval``; the protocol's own is 32 tokens, one scored call)."""
    out = {}
    for block in blocks:
        ratio, lo, hi = ch09.ppl_ratio_interval(a["nll"], b["nll"], block=block)
        out[block] = (lo, hi)
    return ratio, out


def robust_side(intervals: dict) -> int:
    """-1 if every interval lies below 1, +1 if every one lies above 1, 0 otherwise (not separated): a direction
    that one block size shows and another does not is not a finding."""
    if all(hi < 1 for _, hi in intervals.values()):
        return -1
    if all(lo > 1 for lo, _ in intervals.values()):
        return 1
    return 0


def ppl_verdict(name_a: str, a: dict, name_b: str, b: dict, *, blocks=BLOCKS, show: bool = False) -> str:
    """One line comparing two rows' perplexities on the same tokens: the ratio a / b with its paired 95% bootstrap
    interval over blocks of 32 scored tokens (the protocol's), and which is lower only where the paired intervals
    over blocks of 16, 32 *and* 64 tokens all exclude 1 on the same side ("not separated" otherwise). ``show``:
    a second line with the interval for each block size."""
    ratio, iv = ppl_intervals(a, b, sorted({*blocks, ch09.STEP}))
    lo, hi = iv[ch09.STEP]
    side = robust_side({k: iv[k] for k in blocks})
    line = f"perplexity {name_a} / {name_b}: {ratio:.3f} [{lo:.3f}, {hi:.3f}]: " + \
        ("not separated" if side == 0 else f"{name_a if side < 0 else name_b} lower")
    if show:
        line += "\n  paired 95% intervals, blocks of " + ", ".join(
            f"{k} tokens [{iv[k][0]:.3f}, {iv[k][1]:.3f}]" for k in blocks)
    return line


def low_rank_errors(model, ids, fit_ids, ranks):
    """Relative reconstruction error of K (after and before RoPE) and V on ``ids``, all layers and heads, with bases
    fitted on ``fit_ids`` (``kvlib.compress.low_rank_error``), one row per rank."""
    import pandas as pd

    D = model.config.head_dim
    post = _low_rank_error(model, ids, ranks, fit_ids, "post_rope")
    pre = _low_rank_error(model, ids, ranks, fit_ids, "pre_rope")
    return pd.DataFrame({f"rank {r} of {D}": {"K after RoPE": post[r]["k"], "K before RoPE": pre[r]["k"],
                                              "V": post[r]["v"]} for r in ranks}).T


def _low_rank_error(model, ids, ranks, fit_ids, keys):
    """``kvlib.compress.low_rank_error(model, ids, ranks, fit_ids=fit_ids, keys=keys)``, the same sums on the same
    recordings, read from ``_recorded`` (one forward per text for both key positions, none for a text seen before)."""
    from ..compress import _rank_errors

    def kv(x):
        pre, post, v = _recorded(model, torch.as_tensor(x).view(1, -1).to(model.device))
        return (pre if keys == "pre_rope" else post), v

    (fit_k, fit_v), (ks, vs) = kv(fit_ids), kv(ids)
    return _rank_errors(fit_k, fit_v, ks, vs, ranks)


def _fit_low_rank(model, fit_ids, rank: int, keys: str):
    """``kvlib.compress.fit_low_rank(model, fit_ids, rank, keys)``: the same bases from the same recording, read from
    ``_recorded`` (section 7 fits three caches on one text, already recorded for the table)."""
    from ..compress import _directions, _FittedBases

    pre, post, vs = _recorded(model, torch.as_tensor(fit_ids).view(1, -1).to(model.device))
    cast = dict(dtype=model.dtype, device=model.device)
    return _FittedBases([(_directions(k)[..., :rank].to(**cast).contiguous(),
                          _directions(v)[..., :rank].to(**cast).contiguous())
                         for k, v in zip(pre if keys == "pre_rope" else post, vs)], keys)


def mla_table():
    """Bytes per token (bf16) of each model of ``MLA_CONFIGS``: MLA's latent + RoPE key; MHA with the same heads
    counted two ways: K and V as MLA materializes them (keys qk_nope + qk_rope wide, 192 in DeepSeek-V2) and as the
    paper's table 1 counts it, 2 n_h d_h l with d_h = qk_nope_head_dim (128); GQA-8 at the materialized widths; and
    how many GQA groups of the paper's d_h MLA's cache equals (the paper's 2.25)."""
    import pandas as pd

    rows = {}
    for name, entry in MLA_CONFIGS.items():
        c, L = entry["config"], entry["n_layers"]
        mla, mha = mla_bytes_per_token(c, L), mha_bytes_per_token(c, L)
        paper = mha_bytes_per_token(c, L, head_dim=c.qk_nope_head_dim)
        rows[name] = {"layers": L, "heads": c.n_heads, "latent d_c": c.kv_lora_rank, "RoPE key": c.qk_rope_head_dim,
                      "MLA bytes/token": mla, "MHA bytes/token (materialized)": mha,
                      "MHA bytes/token (paper: 2 n_h d_h l)": paper,
                      "GQA-8 bytes/token (materialized)": mha_bytes_per_token(c, L, n_kv_heads=8),
                      "MLA / MHA % (materialized)": 100 * mla / mha, "MLA / MHA % (paper)": 100 * mla / paper,
                      "as GQA groups (paper's d_h)": mla_gqa_groups(c)}
    return pd.DataFrame(rows).T


def cla_losses(steps: int, *, eval_windows: int = 16, seq_len: int = 128, progress: bool = False):
    """CLA-2 on the tiny model: held-out loss (nats/byte) of the original, shared without training, shared after
    ``steps`` fine-tuning steps, and the control fine-tuned the same steps without sharing; and the bytes per
    token of the shared and the plain cache (fp32)."""
    from ..cache import KVCache
    from ..compress import CrossLayerKVCache, evaluate_shared, finetune_shared
    from ..corpus import course_texts
    from ..gqa import finetune
    from ..model import load_tiny
    from ..train import evaluate

    tiny, tok = load_tiny(device="cpu")
    train_text, val_text = course_texts()
    train_ids, val_ids = torch.tensor(tok.encode(train_text)), torch.tensor(tok.encode(val_text))
    ev = dict(seq_len=seq_len, max_windows=eval_windows)
    out = {"original": evaluate(tiny, val_ids, **ev),
           "shared, no fine-tune": evaluate_shared(tiny, val_ids, share=2, **ev)}
    # the two fine-tuned models start from copies of the loaded one (the same weights, bit for bit, without reading
    # the file again); the fine-tune draws its windows from its own seeded generator
    torch.manual_seed(0)
    shared = copy.deepcopy(tiny)
    finetune_shared(shared, train_ids, steps=steps, share=2, batch=8, seq_len=seq_len, progress=progress)
    out["shared + fine-tune"] = evaluate_shared(shared, val_ids, share=2, **ev)
    torch.manual_seed(0)
    control = copy.deepcopy(tiny)
    finetune(control, train_ids, steps=steps, batch=8, seq_len=seq_len, progress=progress)
    out["control (no sharing) + fine-tune"] = evaluate(control, val_ids, **ev)
    sizes = {"CLA-2 cache": CrossLayerKVCache.for_model(shared, 1, 64, share=2).bytes_per_token(),
             "plain cache": KVCache.for_model(tiny, 1, 64).nbytes() // 64}
    return out, sizes


@torch.no_grad()
def layer_sensitivity(model, ids, bits: int = 2, *, keys: str = "per_channel", group: int = 32) -> list[float]:
    """``kvlib.lowbit.layer_sensitivity``'s numbers (each layer's K/V alone at ``bits`` in a ``LayerQuantCache``,
    KL from the all-16-bit run over every position of ``ids``), computed with fewer matrix products: layers before
    layer i run at 16 bits in both runs, so layer i's run starts from the reference run's input to layer i instead
    of repeating layers 0..i-1 (about half the work). The last layer's run is also made whole, as the library
    makes it, and must give the same logits bit for bit (``torch.equal``); if it does not, every layer is run whole
    (``kvlib.lowbit.layer_sensitivity``)."""
    from ..lowbit import kl_divergence
    from ..lowbit import layer_sensitivity as whole

    x = torch.as_tensor(ids).long()[None].to(model.device)  # (1, T)
    n, T = model.config.n_layers, x.shape[1]

    def cache_for(layer):  # layer `layer` at `bits`, every other at 16 (None: all at 16)
        return LayerQuantCache.for_model(model, 1, T, [bits if i == layer else 16 for i in range(n)], keys=keys,
                                         group=group)

    h = model.tok_emb(x)
    cos, sin = model.rope(torch.arange(T, device=x.device)[None], h.dtype)
    inputs, cache = [], cache_for(None)
    for block in model.layers:  # the reference run, keeping each layer's input
        inputs.append(h)
        h = block(h, cos, sin, None, cache)
    full = model.lm_head(model.norm(h)).float()[0]  # (T, V)
    logits = []
    for layer in range(n):
        h, cache = inputs[layer], cache_for(layer)
        for block in model.layers[layer:]:
            h = block(h, cos, sin, None, cache)
        logits.append(model.lm_head(model.norm(h)).float()[0])
    if not torch.equal(model(x, cache=cache_for(n - 1))[0], logits[-1]):
        return whole(model, ids, bits, keys=keys, group=group)
    return [kl_divergence(full, q) for q in logits]


def layer_plans(model, sensitivity) -> dict:
    """The per-layer formats section 8 measures: 6 bits on average as INT8 + INT4, the wide format on the most
    sensitive layers and, as a control, on the least sensitive ones; uniform INT4; and FP16 on the most sensitive
    layers with INT2 elsewhere at uniform INT4's bytes. Remembered for ``configurations``."""
    inverse = [1 / max(s, 1e-12) for s in sensitivity]
    probe = LayerQuantCache.for_model(model, 1, 32, [16] * model.config.n_layers)
    n = model.config.n_layers
    plans = {"uniform INT4": [4] * n,
             "6 bits: INT8 on the most sensitive": plan_bits(sensitivity, budget_bits=6, choices=(8, 4)),
             "6 bits: INT8 on the least sensitive": plan_bits(inverse, budget_bits=6, choices=(8, 4)),
             "FP16 on the most sensitive, INT2 elsewhere": plan_bits(
                 sensitivity, choices=(16, 2), budget_bytes=n * probe.layer_bytes(4),
                 layer_bytes={b: probe.layer_bytes(b) for b in (16, 2)})}
    layer_plans.last = plans
    return plans


layer_plans.last = None


def hf_kivi(hf, model, ids, starts, *, prefix: int = 256, chunk: int = 64, nbits: int = 2, residual: int = 32):
    """transformers' ``QuantizedCache`` (quanto backend, ``nbits``, groups of 32, ``residual_length``) beside
    ``KiviCache`` (same bits, G = 32, R = ``residual``) under one protocol: at each start, a ``prefix``-token
    prefix stored, then the next ``chunk`` tokens scored in one forward over it. Rows: bytes the stored prefix
    holds per cached number (scales and zero points included; exact windows at 2 bytes a number), the mean KL
    divergence from the same model's exact cache (nats per token), the greedy agreement, the tokens scored."""
    import warnings

    import pandas as pd
    import torch.nn.functional as F
    from transformers import DynamicCache, QuantizedCache

    from ..bench.peers import quanto_unpack_in_pytorch
    from ..cache import KVCache
    from ..kivi import KiviCache

    quanto_unpack_in_pytorch()  # no C++ build at first use (a minute in a new environment); the same bytes
    cfg = hf.config
    n_numbers = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * prefix
    acc = {}

    def add(name, lg, ex, held):
        r = acc.setdefault(name, {"held": held, "kl": 0.0, "same": 0, "n": 0})
        r["kl"] += F.kl_div(lg.log_softmax(-1), ex.log_softmax(-1), log_target=True, reduction="sum").item()
        r["same"] += (lg.argmax(-1) == ex.argmax(-1)).sum().item()
        r["n"] += len(lg)

    for s0 in starts:
        p, c = ids[s0:s0 + prefix], ids[s0 + prefix:s0 + prefix + chunk]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            P, C = torch.tensor([p]), torch.tensor([c])
            pos = torch.arange(prefix, prefix + chunk)[None]
            ours = f"kvlib KiviCache {nbits}-bit, G=32, R={residual}"
            outs = {}
            for name, cache in (("exact", KVCache.for_model(model, 1, prefix + chunk)),
                                (ours, KiviCache.for_model(model, 1, prefix + chunk, bits=nbits, residual=residual,
                                                           **KIVI))):
                model(P, cache=cache, logits_to_keep=1)
                outs[name] = model(C, positions=pos, cache=cache)[0].float()
            held = held_bytes(KiviCache.for_model(model, 1, prefix, bits=nbits, residual=residual, **KIVI),
                              float_bytes=2).total  # the stored prefix, as a cache of exactly that length holds it
            add(ours, outs[ours], outs["exact"], held)
            hf_exact = DynamicCache(config=cfg)
            hf(P, past_key_values=hf_exact, use_cache=True)
            ex = hf(C, past_key_values=hf_exact, use_cache=True).logits[0].float()
            q = QuantizedCache(config=cfg, backend="quanto", nbits=nbits, q_group_size=32, residual_length=residual,
                               axis_key=0, axis_value=0)
            hf(P, past_key_values=q, use_cache=True)
            held = sum(_quanto_bytes(layer) for layer in q.layers)
            add(f"transformers QuantizedCache quanto {nbits}-bit, groups of 32, residual {residual}",
                hf(C, past_key_values=q, use_cache=True).logits[0].float(), ex, held)
    return pd.DataFrame({name: {"bytes per cached number": r["held"] / n_numbers, "mean KL (nats)": r["kl"] / r["n"],
                                "greedy agreement %": 100 * r["same"] / r["n"], "tokens scored": r["n"]}
                         for name, r in acc.items()}).T


def _quanto_bytes(layer, float_bytes: int = 2) -> int:
    """What a transformers ``QuantizedLayer`` (quanto backend) holds for its quantized keys and values: the packed
    codes as stored, and every scale and shift at ``float_bytes`` per number (the rule ``KiviCache`` is counted by;
    quanto keeps them in the model's dtype, fp32 here); plus any full-precision residual it holds, at the same."""
    total = 0
    for q in (layer._quantized_keys, layer._quantized_values):
        data = q._data._data if hasattr(q._data, "_data") else q._data
        total += data.nbytes + float_bytes * (q._scale.numel() + q._shift.numel())
    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
        if isinstance(t, torch.Tensor):
            total += float_bytes * t.numel()
    return total


def chart(rows: dict, labels: dict | None = None, *, title: str = "", counted=()):
    """One quality-vs-memory chart: perplexity (left) and passkey retrieval (right) against the memory each cache
    held (% of an fp16 cache of the same tokens): the dot is the time average, a thin line runs to the peak (tick).
    Perplexity carries its bootstrap interval, the passkey its Wilson interval; every point is labelled with
    ``labels[name]`` (default: the name); the frontier (``ch09.frontier`` on the time-averaged memory) is dashed.
    ``counted``: the names whose memory is not measured from tensors but counted by formula for a format the cache
    only simulates (``LayerQuantCache``): drawn hollow, with a legend entry saying so.
    Returns (fig, {panel: [names on its frontier]})."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    labels = labels or {}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    fronts = {}
    panels = ((axes[0], "perplexity", "memory", "peak", "ppl low", "ppl high", True),
              (axes[1], "passkey", "passkey memory", "passkey peak", "passkey low", "passkey high", False))
    for ax, y, mem, peak, lo, hi, lower in panels:
        names = [n for n, r in rows.items() if y in r]
        scale = 1 if y == "perplexity" else 100
        placed = []
        for n in names:
            r = rows[n]
            x, yv = 100 * r[mem], scale * r[y]
            color = "black" if n == "full cache" else "tab:red"
            hollow = n in counted
            ax.errorbar(x, yv, yerr=[[max(0.0, yv - scale * r[lo])], [max(0.0, scale * r[hi] - yv)]], fmt="o", ms=5,
                        capsize=2, color=color, mfc="white" if hollow else color, lw=0.8,
                        gid="point counted" if hollow else "point")
            ax.plot([x, 100 * r[peak]], [yv, yv], color="grey", lw=0.7)
            ax.plot([100 * r[peak]], [yv], "|", color="grey", ms=8)
            near = sum(1 for m, pv in placed if abs(m - x) < 4 and abs(math.log(pv / yv) if lower else pv - yv) <
                       (0.04 if lower else 4))  # labels already placed close by: move this one up a line each
            placed.append((x, yv))
            ax.annotate(labels.get(n, n), (x, yv), xytext=(4, 4 + 9 * near), textcoords="offset points", fontsize=7)
        idx = ch09.frontier([(100 * rows[n][mem], scale * rows[n][y]) for n in names], lower)
        fronts[y] = [names[i] for i in idx]
        ax.plot([100 * rows[names[i]][mem] for i in idx], [scale * rows[names[i]][y] for i in idx], "k--", lw=0.8,
                drawstyle="steps-post", label="frontier: no point holds less and does better")
        ax.plot([], [], "o", color="tab:red", ms=5, label="memory measured from the tensors the cache holds")
        if any(n in counted for n in names):
            ax.plot([], [], "o", color="tab:red", mfc="white", ms=5,
                    label="memory counted by formula for a simulated format (per-layer plans)")
        ax.set_xlabel("KV memory held, % of an fp16 cache of the same tokens (dot: time average, tick: peak)")
        ax.legend(fontsize=8, loc="upper right" if lower else "lower right")
    axes[0].set_yscale("log")
    lo_all = min(r["ppl low"] for r in rows.values()) / 1.1
    hi_all = max(r["ppl high"] for r in rows.values()) * 1.1
    nice = [1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20, 25, 30, 40, 50, 60, 80, 100, 150, 200, 300, 500, 1000]
    ticks = [t for t in nice if lo_all <= t <= hi_all]
    ticks = ticks[:: max(1, len(ticks) // 8)]
    axes[0].set_ylim(lo_all, hi_all)
    axes[0].set_yticks(ticks, [f"{t:g}" for t in ticks])
    axes[0].yaxis.set_minor_formatter(NullFormatter())
    axes[0].set(ylabel="perplexity on held-out code (log; lower is better)")
    axes[1].set(ylabel="passkey retrieved (%; 95% Wilson interval)", ylim=(-3, 103))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig, fronts


# --------------------------------------------------------------------------------------------
# Lab 09b's decision: which cache fits a memory budget best
# --------------------------------------------------------------------------------------------

BUDGET_CANDIDATES = {  # name: (bits, R, prefill) of a KiviCache, or "int8"
    "INT8 (chapter 06)": "int8",
    "KIVI 4-bit, R=32": (4, 32, "exact"),
    "KIVI 2-bit, R=32": (2, 32, "exact"),
    "KIVI 2-bit, R=128": (2, 128, "exact"),
    "2-bit, prompt through the codes (not KIVI), R=32": (2, 32, "quantized"),
}


def _candidate(model, spec, length):
    from ..kivi import KiviCache
    from ..quant import Int8KVCache

    if spec == "int8":
        return Int8KVCache.for_model(model, 1, length)
    bits, R, prefill = spec
    return KiviCache.for_model(model, 1, length, bits=bits, residual=R, prefill=prefill, **KIVI)


@torch.no_grad()
def budget_evidence(model, ids, candidates: dict | None = None, step: int = 16):
    """What lab 09b's decision is made from, for a sequence of len(ids) tokens: per candidate cache, its nominal
    share of an fp16 cache (bits / 16), the share it holds, measured from its tensors (``held_bytes``, 2 bytes per
    floating-point number), and its mean KL divergence from the full cache's next-token distributions on the second
    half of ``ids`` (the first half prefilled in one call, the rest teacher-forced ``step`` tokens per call)."""
    import pandas as pd

    from ..cache import KVCache
    from ..footprint import fp16_cache_bytes
    from ..lowbit import kl_divergence

    candidates = BUDGET_CANDIDATES if candidates is None else candidates
    x = torch.as_tensor(ids).view(1, -1).to(model.device)
    n, half = x.shape[1], x.shape[1] // 2

    def logits(cache):
        model(x[:, :half], cache=cache, logits_to_keep=1)
        out = [model(x[:, t:t + step], positions=torch.arange(t, min(t + step, n), device=x.device)[None],
                     cache=cache)[0] for t in range(half, n, step)]
        return torch.cat(out)

    ref = logits(KVCache.for_model(model, 1, n))
    rows = {}
    for name, spec in candidates.items():
        bits = 8 if spec == "int8" else spec[0]
        rows[name] = {"nominal % of fp16": 100 * bits / 16,
                      "held % of fp16 (measured)": 100 * held_bytes(_candidate(model, spec, n), float_bytes=2).total
                      / fp16_cache_bytes(model.config, n),
                      "KL from the full cache (nats/token)": kl_divergence(ref, logits(_candidate(model, spec, n)))}
    return pd.DataFrame(rows).T


def budget_reference(evidence, budget_pct: float) -> str | None:
    """The candidate with the lowest KL among those whose *measured* share is within the budget (None if none)."""
    fits = evidence[evidence["held % of fp16 (measured)"] <= budget_pct]
    return None if fits.empty else str(fits["KL from the full cache (nats/token)"].idxmin())


def check_budget_choice(choice: str, evidence, budget_pct: float) -> bool:
    """Lab 09b's decision: the cache to deploy within ``budget_pct`` % of an fp16 cache's memory, given
    ``budget_evidence``. Prints yours vs the reference; a wrong choice fails with its diagnosis."""
    from .check import check_choice
    from .mistakes import lab09b

    ref = budget_reference(evidence, budget_pct)
    yours = str(choice).strip()
    print(evidence.round(4).to_string() + f"\n\nbudget: {budget_pct:g}% of an fp16 cache of the same tokens\n")
    return check_choice("cache within the budget", yours, ref,
                        lambda: lab09b.budget_choice(yours, ref, evidence, budget_pct), shown=(repr(yours), repr(ref)))
