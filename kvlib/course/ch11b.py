"""Chapter 11b's harness: reading part of the cache (Quest) and layers that keep different caches.

The notebook ``11b_sparse_reads_and_hybrid_layers`` calls these; they hold the loops, the bookkeeping of bytes
read and the tables, so that each cell of the notebook stays short. Nothing here prints a verdict: the notebook
prints the numbers and ``ch09.verdict`` lines, its markdown says what they mean.

The tasks are chapter 09's protocol (``kvlib.course.ch09``), unchanged: perplexity on the second half of
``ch09.N_TEXT`` tokens of ``textwrap``'s source, teacher-forced ``ch09.STEP`` tokens per call; passkey prompts of
exactly ``P_LEN`` tokens, each with its own filler, key and depth, full retrieval (every answer token right under
teacher forcing), Wilson 95% intervals. Two ways to ask:

- **question in the prompt** (chapter 09's): the prompt, question included, is prefilled, then the answer's tokens;
- **question after caching** (``late``): the text with the needle is fed first (a document cached before anyone
  asked about it), then the question and the answer's tokens in one call.

Bytes read are counted per query and layer, in positions (K and V of one position in one layer, all K/V heads):

- Quest (``QuestCache``'s counters): per K/V head the distinct rows its query heads selected, plus one position's
  worth per scored block (its min and max keys), and every row in its dense layers;
- the eviction rules: the positions they hold when the query attends (after the prefill, SnapKV as published
  keeps every token it is fed, so the i-th query of a call reads budget + i positions);
- the first answer token of the "question in the prompt" task is predicted by the *prefill's* last query, which
  reads the whole prompt densely in Quest and in SnapKV alike (both attend fully while prefilling): it is counted
  for both (``answer_read``).

``quest_passkey`` reuses prefill work: per prompt one dense prefill of the text, then three continuations cut back
with ``QuestCache.truncate`` (exact: the summaries are recomputed from the rows kept): the question densely (what
a one-call prefill of the whole prompt computes, up to rounding), then the answer densely (the full cache) or
sparsely (Quest, question in the prompt); and the question and the answer sparsely (question after caching, read
sparsely query by query: the course's own variant, "Quest late"). Quest's code attends densely to any call of more
than one token (``if q_len > 1 ...: flash_forward``), so a question that arrives after the text, in one call, is
read densely there: that is the "Quest" branch again (the text, then the question densely, then the answer sparsely).
"""

from __future__ import annotations

import torch

from ..cache import KVCache
from ..hybrid import HybridCache, blocks_held, hybrid_bytes, layer_plan, prefix_hit
from ..sparse import QuestCache, block_upper_bound
from ..stats import wilson
from . import ch09

__all__ = ["P_LEN", "N_PROMPTS", "BLOCK", "TOKEN_BUDGET", "DENSE_LAYERS", "split_prompt", "quest_for",
           "position_bytes", "quest_passkey", "score_late", "eviction_passkey", "answer_read", "bound_recall",
           "prefill_queries", "key_in_window", "split_hits", "window_rows", "hybrid_row", "spare_table", "prefix_table",
           "retention_demo", "passkey_bars",
           "perplexity_interval_line", "full_cache_perplexity", "window_evidence", "check_window_choice"]

P_LEN = 256  # tokens of every passkey prompt: longer than the window of section 3 (128)
N_PROMPTS = 20  # prompts per configuration (Wilson intervals)
BLOCK = 16  # Quest's page size (its code's default)
TOKEN_BUDGET = 64  # Quest's positions per query head: 4 blocks of 16, the current one included
DENSE_LAYERS = 2  # Quest's code skips its first two layers


def split_prompt(p: ch09.Passkey, n_question: int) -> tuple[list, list]:
    """(text with the needle, question): ``passkey_prompts`` ends every prompt with the ``n_question`` tokens of
    ``ch09.QUESTION``, encoded on their own (``len(tok.encode(ch09.QUESTION))``), so the split is exact."""
    if not 0 < n_question < len(p.ids) - p.needle.stop + 1:
        raise ValueError(f"n_question must count the question's tokens after the needle, got {n_question}")
    return p.ids[:-n_question], p.ids[-n_question:]


def quest_for(model, batch: int, length: int, token_budget: int = TOKEN_BUDGET, **kw) -> QuestCache:
    """Quest as its code runs it: blocks of 16, ``token_budget`` positions per query head, 2 dense layers."""
    return QuestCache.for_model(model, batch, length, block_size=BLOCK, token_budget=token_budget,
                                dense_layers=DENSE_LAYERS, **kw)


def position_bytes(model) -> int:
    """Bytes of one position's K and V in every layer (the unit bytes read are counted in)."""
    c = model.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * model.dtype.itemsize


def _zero_counters(cache: QuestCache):
    for t in (cache.read_bytes, cache.full_bytes, cache.read_steps):
        t.zero_()


def _hits(logits: torch.Tensor, answers: torch.Tensor) -> list:
    """logits (B, A, V), answers (B, A) -> per sequence: every answer token is the argmax."""
    return (logits.argmax(-1).cpu() == answers.cpu()).all(-1).tolist()


def _batches(prompts: list, n_question: int, batch: int | None):
    """The prompts in groups of ``batch`` (all of them by default) -> (texts (B, n), questions (B, nq), answers
    (B, A)) tensors on the CPU. Every prompt has the same length, question and answer length (``passkey_prompts``),
    so a group is one rectangular call: the decode-sized calls after the text (a few tokens each) cost about one
    read of the weights per group instead of one per prompt."""
    batch = len(prompts) if batch is None else batch
    for i in range(0, len(prompts), batch):
        part = prompts[i: i + batch]
        docs, questions = zip(*(split_prompt(p, n_question) for p in part))
        if len({len(d) for d in docs}) != 1 or len({len(p.answer) for p in part}) != 1:
            raise ValueError("the prompts of one batch must have one length and one answer length")
        yield torch.tensor(docs), torch.tensor(questions), torch.tensor([list(p.answer) for p in part])


def _call(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """ids (B, T) at positions start .. start + T - 1 -> logits (B, T, V)."""
    B, T = ids.shape
    dev = model.device
    return model(ids.to(dev), positions=torch.arange(start, start + T, device=dev).expand(B, -1), cache=cache)


@torch.no_grad()
def quest_passkey(model, prompts: list, n_question: int, token_budget: int = TOKEN_BUDGET,
                  batch: int | None = None) -> dict:
    """The full cache, Quest with the question in the prompt and Quest with the question after caching, on every
    prompt (module docstring: one dense prefill of the text per prompt, three continuations), ``batch`` prompts per
    call (all by default). Returns {"full", "Quest", "Quest late"}: lists of bool (retrieved), and "read",
    "read late": Quest's mean positions read per sparse query and layer (the answer's tokens after the first; the
    question's and the answer's tokens), averaged over the prompts.
    "Quest" is also Quest's code on a question that arrives after the text (its multi-token call read densely);
    "Quest late" is the course's variant, every query after the text read sparsely."""
    pos_b = position_bytes(model)
    out = {"full": [], "Quest": [], "Quest late": [], "read": [], "read late": []}
    for docs, questions, ans in _batches(prompts, n_question, batch):
        (B, n), nq = docs.shape, questions.shape[1]
        cache = quest_for(model, B, n + nq + ans.shape[1], token_budget)
        cache.prefill_whole = True  # its first call attends the whole text densely: chapter 09's prefill records it
        ch09.prefill(model, cache, docs.to(model.device))  # dense prefill of the text

        def cut(length):
            for b in range(B):
                cache.truncate(b, length)
            _zero_counters(cache)

        cache.dense_multi_token = True  # the question densely: what a one-call prefill of the prompt computes
        first = _call(model, cache, questions, n)[:, -1:]  # predicts the first answer token
        out["full"] += _hits(torch.cat([first, _call(model, cache, ans[:, :-1], n + nq)], 1), ans)  # answer dense
        cut(n + nq)
        cache.dense_multi_token = False
        out["Quest"] += _hits(torch.cat([first, _call(model, cache, ans[:, :-1], n + nq)], 1), ans)  # sparse
        out["read"] += [cache.bytes_read_per_step(b) / pos_b for b in range(B)]
        cut(n)
        late = _call(model, cache, torch.cat([questions, ans[:, :-1]], 1), n)[:, nq - 1:]  # the question sparse too
        out["Quest late"] += _hits(late, ans)
        out["read late"] += [cache.bytes_read_per_step(b) / pos_b for b in range(B)]
    out["read"] = sum(out["read"]) / len(prompts)
    out["read late"] = sum(out["read late"]) / len(prompts)
    return out


@torch.no_grad()
def score_late(model, make_cache, prompts: list, n_question: int, batch: int | None = None) -> list:
    """The question after caching, through a fresh ``make_cache(B)`` per group of ``batch`` prompts (all by
    default): the text first (one call), then the question and the answer's tokens but the last (one call)
    -> list of bool, every answer token right."""
    hits = []
    for docs, questions, ans in _batches(prompts, n_question, batch):
        cache = make_cache(docs.shape[0])
        ch09.prefill(model, cache, docs.to(model.device))  # a cache that attends the text whole replays its record
        logits = _call(model, cache, torch.cat([questions, ans[:, :-1]], 1), docs.shape[1])
        hits += _hits(logits[:, questions.shape[1] - 1:], ans)
    return hits


def eviction_passkey(model, prompts: list, n_question: int, b_in: int, b_late: int) -> dict:
    """Section 2's eviction rules at Quest's reads: SnapKV with the question in the prompt (chapter 09's scorer, one
    prompt per call: its prefill is the cost, and a batch saves nothing there) at ``b_in`` positions; SnapKV and
    sinks + window with the question after caching (``score_late``, every prompt in one call) at ``b_late``
    -> {"SnapKV", "SnapKV late", "sinks + window late"}: lists of bool. SnapKV as
    published, its window min(16, b // 2) (chapter 09a's ``RULES``). The late SnapKV attends the text whole, so it
    reads the text's prefill that ``quest_passkey`` recorded (``ch09.prefill``: kept only where each layer's output
    is bit for bit the recorded one, else computed); that record is dropped before the in-prompt run records its own."""
    snapkv, sinks = ch09.RULES["SnapKV"], ch09.RULES["sinks + window"]
    late = {"SnapKV late": score_late(model, lambda B: snapkv(model, B, b_late), prompts, n_question),
            "sinks + window late": score_late(model, lambda B: sinks(model, B, b_late), prompts, n_question)}
    for docs, _, _ in _batches(prompts, n_question, None):
        ch09._forget_prefill(model, docs.to(model.device))
    return {"SnapKV": ch09.score_passkey(model, lambda B: snapkv(model, B, b_in), prompts, batch=1)["retrieved"],
            **late}


def answer_read(method: str, P: int, n_answer: int, per_query: float) -> float:
    """Mean positions read per layer by the queries that predict the ``n_answer`` answer tokens, question in the
    prompt: the first is the prefill's last query (the whole prompt, ``P``, for the full cache, Quest and SnapKV
    alike); the others read ``per_query`` (Quest: measured; an eviction budget b: b + i for the i-th answer token
    fed, as SnapKV keeps what it is fed; the full cache: P + i)."""
    if method == "Quest":
        rest = [per_query] * (n_answer - 1)
    else:
        rest = [per_query + i for i in range(1, n_answer)]
    return (P + sum(rest)) / n_answer


# --------------------------------------------------------------------------------------------
# The bound on real keys, and Quest on perplexity
# --------------------------------------------------------------------------------------------


def bound_recall(cache: QuestCache, last_q: dict, n_top: int = 8) -> dict:
    """For the last query of every layer and query head: is Quest's bound at least the true maximum of q . k over
    each block, and how many of the ``n_top`` blocks with the highest true maximum are among the bound's top
    ``n_top`` -> {"holds", "recall" (list of shares, one per layer and head), "blocks"}."""
    n = cache.held(0)
    n_blk = n // cache.block_size  # whole blocks only
    H_KV = cache.k[0].shape[1]
    holds, recall = True, []
    for layer, q in last_q.items():
        H = q.shape[1]
        bound = block_upper_bound(q, cache.kmin[layer][:, :, :n_blk], cache.kmax[layer][:, :, :n_blk])  # (1, H, N)
        keys = cache.k[layer][:, :, : n_blk * cache.block_size].repeat_interleave(H // H_KV, 1)  # (1, H, S, D)
        true_max = (keys.float() @ q.float()[..., None])[..., 0].view(1, H, n_blk, cache.block_size).amax(-1)
        holds &= bool((bound >= true_max - 1e-4 * true_max.abs().clamp(min=1)).all())
        top_b, top_t = bound.topk(n_top, -1).indices[0], true_max.topk(n_top, -1).indices[0]
        recall += [len(set(a.tolist()) & set(b.tolist())) / n_top for a, b in zip(top_b, top_t)]
    return {"holds": holds, "recall": recall, "blocks": n_blk}


# --------------------------------------------------------------------------------------------
# Layers that keep different caches
# --------------------------------------------------------------------------------------------


def window_rows(model, text: torch.Tensor, prompts: list, window: int = 128, sinks=(0, 4), passkey_sinks: int = 4):
    """The 5:1 plan applied to the model after the fact, its window layers with and without sinks: perplexity on
    ``text`` for each number of sinks, the passkey on ``prompts`` (longer than the window) with ``passkey_sinks``
    -> list of rows (dicts) with the share of the full cache's K/V kept at the text's length."""
    n = text.shape[1] - 1
    plan, full = layer_plan(model.config.n_layers, "5:1"), layer_plan(model.config.n_layers, "0:1")
    rows = []
    for s in sinks:
        def make(B, L, s=s):
            return HybridCache.for_model(model, B, L + 8, pattern="5:1", window=window, n_sink=s)
        row = hybrid_row(model, make, text, prompts if s == passkey_sinks else None)
        kept = hybrid_bytes(n, plan, window, 1, 1, 1, n_sink=s) / hybrid_bytes(n, full, None, 1, 1, 1)
        rows.append({"plan": "5:1", "W": window, "sinks": s, "kept": kept, **row})
    return rows


def hybrid_row(model, make, text, prompts) -> dict:
    """perplexity (and its per-token NLL) and, with ``prompts``, passkey k of n, for caches from make(B, L)."""
    ppl, nll = ch09.perplexity(model, make(1, text.shape[1]), text)
    row = {"perplexity": ppl, "nll": nll}
    if prompts:
        pk = ch09.score_passkey(model, lambda B: make(B, len(prompts[0].ids)), prompts, batch=1)
        row.update({"passkey k": pk["k"], "passkey n": pk["n"], "passkey hits": pk["retrieved"]})
    return row


def key_in_window(prompts: list, window: int) -> list:
    """Per prompt: is the key's first mention in the needle (the answer's tokens, space included) within the last
    ``window`` positions of the prompt, the part a window layer of ``window`` positions still shows the prompt's
    last query? -> list of bool."""
    out = []
    for p in prompts:
        n = len(p.answer)
        first = next((i for i in p.needle if p.ids[i:i + n] == list(p.answer)), None)
        if first is None:
            raise ValueError("the answer's tokens do not appear in the needle")
        out.append(first >= len(p.ids) - window)
    return out


def split_hits(hits: list, inside: list) -> tuple:
    """(k, n) of the hits where ``inside`` is True, and (k, n) where it is False."""
    a = [h for h, i in zip(hits, inside) if i]
    b = [h for h, i in zip(hits, inside) if not i]
    return (sum(a), len(a)), (sum(b), len(b))


def spare_table(spares=(0, 1, 2, 3), cuts=(1, 2, 3, 4, 5), window: int = 8, n: int = 20) -> dict:
    """Which cuts ``HybridCache.truncate`` can make exactly: one window layer (W = ``window``), ``n`` random tokens
    fed, then a cut of d tokens, for each number of spare rows -> {spare: {d: True (exact) / False (refused)}}."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for s in spares:
        out[s] = {}
        for d in cuts:
            cache = HybridCache(["window"], 1, 1, n + 1, 4, window=window, spare=s)
            cache.attend(0, *(torch.randn(1, 1, n, 4, generator=g) for _ in range(3)))
            try:
                out[s][d] = cache.truncate(0, n - d)
            except ValueError:
                out[s][d] = False
    return out


def prefix_table(plan, n_old: int = 4000, n_shared: int = 3000, n_new: int = 3500, window: int = 1024,
                 block: int = 16) -> list:
    """A request of ``n_old`` tokens ran before; a new one of ``n_new`` shares its first ``n_shared``. How much
    each layer kind, and the request, can reuse: once the freed window blocks went to other requests, and while
    they are still in the pool -> rows (dicts)."""
    old = {kind: blocks_held(kind, n_old, window, block) for kind in ("window", "full")}
    shared = list(range(n_shared // block))
    cases = {"freed window blocks since reused": {k: [b for b in v if b in shared] for k, v in old.items()},
             "freed window blocks still in the pool": {"window": shared, "full": shared}}
    rows = []
    for name, cached in cases.items():
        hit = prefix_hit(plan, n_new, window, block, cached)
        rows.append({"pool": name, "window layers resume at": hit["window"], "full layers resume at": hit["full"],
                     "the request reuses": hit["request"]})
    return rows


def retention_demo(retain: bool) -> dict:
    """Chapter 08's retention, on a small paged cache: a 3-block prompt is freed, then the same prompt comes
    back -> {"cached tokens found", "free blocks after the free"}; with ``retain_freed`` the freed, hashed blocks
    stay findable (the cache keeps its own reference), without it they go back to the free list and lose their
    hashes (lab 11a's pool)."""
    from ..paged import PagedKVCache

    cache = PagedKVCache(1, 8, 4, 1, 4, retain_freed=retain)
    prompt = list(range(13))
    cache.add_sequence("a", prompt)
    view = cache.batch(["a"], [prompt])
    x = torch.zeros(1, 1, len(prompt), 4)
    view.attend(0, x, x, x)
    cache.free_sequence("a")
    free_after = cache.allocator.num_free
    return {"cached tokens found": cache.add_sequence("b", prompt), "free blocks after the free": free_after}


# --------------------------------------------------------------------------------------------
# The passkey panel: grouped bars with intervals
# --------------------------------------------------------------------------------------------


def passkey_bars(results: dict, title: str = ""):
    """Grouped bars: for each task (the outer keys, e.g. "question in the prompt"), one bar per method with its
    Wilson 95% interval. ``results``: {task: {method: (k, n)}}. Returns the Figure."""
    import matplotlib.pyplot as plt

    tasks = list(results)
    methods = list(dict.fromkeys(m for t in tasks for m in results[t]))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(methods)
    colors = plt.get_cmap("tab10")
    for j, m in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for i, t in enumerate(tasks):
            if m not in results[t]:
                continue
            k, n = (int(v) for v in results[t][m])
            a, b = wilson(k, n)
            xs.append(i + (j - (len(methods) - 1) / 2) * width)
            ys.append(100 * k / n)
            lo.append(100 * (k / n - a))
            hi.append(100 * (b - k / n))
        ax.bar(xs, ys, width * 0.9, yerr=[lo, hi], capsize=3, color=colors(j), label=m)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set(ylabel="passkeys fully retrieved, % (95% Wilson)", ylim=(0, 105), title=title)
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7.5, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def perplexity_interval_line(name_a: str, nll_a, name_b: str, nll_b) -> str:
    """One line: paired perplexity ratio a / b with its 95% block-bootstrap interval (chapter 09's)."""
    r, lo, hi = ch09.ppl_ratio_interval(nll_a, nll_b)
    return f"{name_a} / {name_b} perplexity {r:.3f} [{lo:.3f}, {hi:.3f}]"


def full_cache_perplexity(model, text):
    """The full cache on the perplexity task -> (perplexity, NLL)."""
    return ch09.perplexity(model, KVCache.for_model(model, 1, text.shape[1]), text)




@torch.no_grad()
def prefill_queries(model, cache, ids: list, start: int = 0) -> dict:
    """Feed ``ids`` (one sequence, at positions ``start``, ``start + 1``, ...) through ``cache`` and return
    {layer: the last position's query (1, H, D), after RoPE}: the query a picture or a bound check needs. On an
    empty cache this is the prefill's last query; one token fed after a prefill is a decode step's query (the one
    Quest reads sparsely)."""
    last_q, original = {}, cache.attend

    def attend(layer_idx, q, k, v):
        last_q[layer_idx] = q[:, :, -1]
        return original(layer_idx, q, k, v)

    cache.attend = attend
    try:
        model(torch.tensor([ids], device=model.device), cache=cache, logits_to_keep=1,
              positions=torch.arange(start, start + len(ids), device=model.device)[None])
    finally:
        del cache.attend
    return last_q


# --------------------------------------------------------------------------------------------
# Lab 11b's decision: 4 more rows per window layer, for sinks or for a longer window?
# --------------------------------------------------------------------------------------------


def window_evidence(model, text: torch.Tensor, window: int = 128, n_sink: int = 4):
    """Perplexity on ``text`` of the 5:1 plan with a window of ``window + n_sink`` and with ``window`` + ``n_sink``
    sinks (the same rows per window layer, the same bytes), and the full cache -> DataFrame indexed by plan, with
    the paired ratio of each to the full cache and its 95% interval."""
    import pandas as pd

    from .mistakes.lab11b import WINDOW_CHOICES

    full_ppl, full_nll = full_cache_perplexity(model, text)
    plans = {WINDOW_CHOICES[0]: dict(window=window + n_sink, n_sink=0),
             WINDOW_CHOICES[1]: dict(window=window, n_sink=n_sink)}
    rows = {}
    for name, kw in plans.items():
        cache = HybridCache.for_model(model, 1, text.shape[1] + 8, pattern="5:1", **kw)
        ppl, nll = ch09.perplexity(model, cache, text)
        r, lo, hi = ch09.ppl_ratio_interval(nll, full_nll)
        rows[name] = {"perplexity": ppl, "vs full cache": r, "low": lo, "high": hi,
                      "rows per window layer": cache.k[0].shape[2]}
    rows["full cache"] = {"perplexity": full_ppl, "vs full cache": 1.0, "low": 1.0, "high": 1.0,
                          "rows per window layer": text.shape[1] + 8}
    return pd.DataFrame.from_dict(rows, orient="index")


def check_window_choice(choice: str, evidence) -> bool:
    """Lab 11b's decision: which of ``WINDOW_CHOICES`` predicts the text better at the same bytes. Prints the
    evidence and yours vs the reference (the plan with the lower measured perplexity); a wrong choice fails with its
    diagnosis (``kvlib.course.mistakes.lab11b.window_choice``)."""
    from .mistakes import lab11b
    from .check import check_choice

    yours = str(choice).strip()
    plans = evidence.drop(index="full cache")
    ref = plans["perplexity"].astype(float).idxmin()
    print(evidence.round(3).to_string() + "\n")
    return check_choice("plan that predicts the text better at the same bytes", yours, ref,
                        lambda: lab11b.window_choice(yours, ref, plans))
