"""Chapter 09's protocol: how notebooks 09a (keeping fewer positions) and 09b (keeping fewer bits) measure a cache.

Both notebooks compare caches on the same two tasks, at memory measured the same way, so that a point of one
chart can stand beside a point of the other:

- **Passkey retrieval** (``passkey_prompts``, ``score_passkey``): ``N_PROMPTS`` prompts of exactly ``P_LEN``
  tokens, each with its *own* filler text (prose from the standard library's docstrings, ``kvlib.corpus``, the
  same on Python 3.10-3.13), its own five-digit key and its own depth, spread evenly from near the start to near
  the end. One metric: **full retrieval**, every token of the key right under teacher forcing (the prompt, then the
  answer's tokens fed one call later; a prediction that is right for every token is what greedy decoding writes).
  The rate comes with its 95% Wilson interval (``kvlib.stats.wilson``); two rates are called different only where
  their intervals do not overlap (``kvlib.stats.separated``, ``verdict``).
- **Perplexity on held-out text** (``text_ids``, ``perplexity``): the first ``N_TEXT`` tokens of the source of
  ``textwrap`` (code keeps names defined far back, so forgetting shows); the first half is the prompt, prefilled
  in one call (``logits_to_keep=1``), the second half is scored, teacher-forced, ``STEP`` tokens per call. Every
  method, SnapKV included, is scored on tokens that come after it compressed. ``ppl_interval`` gives a 95%
  bootstrap interval over blocks of scored tokens, and ``ppl_ratio_interval`` the paired interval of one
  method's perplexity against another's on the same tokens.
- **Memory** (``Meter``): the bytes of every tensor the cache holds (``kvlib.footprint.held_bytes``: K/V, scales,
  index, positions, scores, observation buffers), at a half-precision server's 2 bytes per number, sampled after
  every layer's call; reported as a fraction of a plain fp16 cache holding the same tokens
  (``kvlib.footprint.fp16_cache_bytes``), **time-averaged** over the scored calls (token-weighted) and at the
  **peak** (the most held at any sample, over the fp16 cache of the final length). A cache that grows with the
  sequence (the full cache, INT8, KIVI) is counted at the size it needs for the tokens it holds, as a paged
  allocator holds it: ``grows=`` gives the bytes of a cache built for exactly that length.
- ``evaluate``: one cache configuration on both tasks, one row of a table.
- ``frontier``: the points no other point beats at no more memory (the Pareto frontier).

The cost (measured on a 2-core laptop CPU, one torch thread, SmolLM2-135M at about 300 prefill tokens/s): one
perplexity run is about 3-4 s, one passkey configuration (24 prompts x ``P_LEN`` tokens) about 15-20 s; for the caches
that read a prompt whole (the full cache, H2O, SnapKV, PyramidKV) the prompt's forward is computed once and replayed
into each later cache (``prefill``): their later passkey configurations take about a quarter of that, their later
perplexity runs skip the prompt half's forward. Batching
the prompts (``batch=``) gives the same results (the caches are equal to batch-1 runs) and pays on a GPU; on one
CPU thread it does not (the prefill is compute-bound), so the notebooks use ``PASSKEY_BATCH``.

Nothing here prints a verdict: the notebooks show the numbers, their markdown says what they mean.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
import random
import re
import textwrap
import weakref

import torch
import torch.nn.functional as F

from .. import runtime
from ..footprint import fp16_cache_bytes, held_bytes
from ..stats import separated, wilson

__all__ = ["N_TEXT", "STEP", "P_LEN", "N_PROMPTS", "PASSKEY_BATCH", "INTRO", "QUESTION", "Passkey", "FILLER_BANK", "filler_sentences",
           "passkey_prompts", "text_ids", "prefill", "perplexity", "ppl_interval", "ppl_ratio_interval", "Meter",
           "score_passkey", "evaluate", "full_cache", "RULES", "budget_for", "sweep", "rate", "verdict", "frontier",
           "wilson", "separated", "label_of", "plot_quality_memory"]

N_TEXT = runtime.by_mode(cpu=1024, gpu=4096)  # tokens of held-out text: the first half prefilled, the second scored
STEP = 32  # scored tokens per call
P_LEN = 160  # tokens of every passkey prompt
N_PROMPTS = 24  # passkey prompts, each with its own filler, key and depth
PASSKEY_BATCH = runtime.by_mode(cpu=1, gpu=N_PROMPTS)  # prompts per call (one CPU thread gains nothing from more)
INTRO = "There is an important number hidden inside a lot of irrelevant text. Find it and memorize it.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


def _needle(key: int) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


# --------------------------------------------------------------------------------------------
# Passkey prompts
# --------------------------------------------------------------------------------------------


FILLER_BANK = {
    "countryside": [
        "The river keeps moving past the old mill.", "A farmer walks along the edge of the field.",
        "Birds rest on the fence near the road.", "The afternoon light is warm and even.",
        "Cows graze slowly on the far side of the hill.", "A narrow path leads down to the water.",
        "The wind turns the leaves of the poplars silver.", "Hay bales stand in rows across the meadow.",
        "A dog sleeps in the shade of the barn.", "Smoke rises straight up from a distant chimney.",
    ],
    "city": [
        "Buses stop at the corner every few minutes.", "A man sells newspapers outside the station.",
        "The café on the square opens early.", "Pigeons gather where people drop their crumbs.",
        "Traffic lights change from red to green and back.", "A cyclist weaves between the parked cars.",
        "Shop windows reflect the grey morning sky.", "Office workers hurry across the bridge.",
        "A street musician tunes his guitar.", "The smell of fresh bread drifts from the bakery.",
    ],
    "kitchen": [
        "Water comes to a boil in the blue pot.", "Someone chops onions on the wooden board.",
        "The oven hums quietly in the corner.", "A bowl of apples sits by the window.",
        "Steam fogs the glass above the sink.", "The kettle whistles and is taken off the stove.",
        "Flour dusts the edge of the table.", "A spoon stirs the soup in slow circles.",
        "Plates are stacked neatly on the shelf.", "The smell of garlic fills the small room.",
    ],
    "weather": [
        "Clouds drift slowly over the quiet hills.", "A light rain begins to fall in the evening.",
        "The sky clears after the storm has passed.", "Fog lies low in the valley until noon.",
        "Thunder rolls somewhere far to the west.", "Snow settles softly on the rooftops.",
        "The sun breaks through a gap in the clouds.", "A cold wind blows in from the north.",
        "Puddles shine on the empty pavement.", "The air smells of wet earth and grass.",
    ],
    "harbour": [
        "Fishing boats rock gently at the pier.", "Gulls circle above the nets drying in the sun.",
        "The tide slowly pulls back from the sand.", "A lighthouse stands at the end of the rocks.",
        "Ropes creak as the boats tug at their moorings.", "Waves break against the stone wall.",
        "A sailor coils a line on the deck.", "The ferry sounds its horn before leaving.",
        "Crates of fish are carried up the ramp.", "Salt spray hangs in the morning air.",
    ],
    "library": [
        "Rows of books line the tall wooden shelves.", "A reader turns the pages without a sound.",
        "The lamps cast small circles of yellow light.", "Someone returns a stack of novels to the desk.",
        "Dust floats in the light from the high windows.", "A student takes notes in a thick notebook.",
        "The clock on the wall ticks steadily.", "Maps and atlases rest on a low table.",
        "A librarian sorts cards into a drawer.", "Chairs scrape quietly on the polished floor.",
    ],
    "forest": [
        "Tall pines sway above the narrow trail.", "A squirrel runs up the trunk of an oak.",
        "Moss covers the stones beside the stream.", "Sunlight falls in patches on the ferns.",
        "An owl calls once from deep in the trees.", "Fallen leaves crunch under every step.",
        "A woodpecker taps on a dead branch.", "The trail bends around a large boulder.",
        "Mushrooms grow in a ring at the foot of a tree.", "The air is cool and smells of resin.",
    ],
    "train": [
        "The train leaves the platform on time.", "Fields and villages slide past the window.",
        "A conductor checks tickets in the next carriage.", "Passengers doze with their heads against the glass.",
        "The wheels click steadily over the rails.", "A child points at horses in a field.",
        "The carriage sways as it takes a long curve.", "Someone unwraps a sandwich and a paper napkin.",
        "The train slows down as it nears a small station.", "A tunnel turns the windows black for a moment.",
    ],
}


def filler_sentences(i: int, seed: int = 0, pick: int = 5) -> tuple[list[str], random.Random]:
    """Filler i's sentences: ``pick`` sentences of one theme of ``FILLER_BANK`` (theme i mod the number of themes),
    chosen per filler, and the filler's own random generator, which ``passkey_prompts`` draws them from in a
    random order. So no two fillers are the same text (three share each theme, with different sentences and
    orders), and each repeats a few plain sentences with no number in them, as the passkey test's filler does
    (Mohtashami & Jaggi, 2023)."""
    themes = list(FILLER_BANK)
    rng = random.Random(f"{seed}-{i}")
    return rng.sample(FILLER_BANK[themes[i % len(themes)]], pick), rng


def _fill_exactly(tok, sentences: list[str], rng: random.Random, n: int, spare: list[str] = ()) -> tuple:
    """(token ids, sentence boundaries): sentences drawn at random until exactly ``n`` tokens, ending on a whole
    sentence (the last few are chosen so that their lengths add up to what is left: a coin change). When the
    sentences' lengths cannot add up to ``n`` (all even, say), the ending may also use the ``spare`` ones."""
    for ending in (sentences, list(sentences) + [s for s in spare if s not in sentences]):
        found = _try_fill(tok, sentences, ending, rng, n)
        if found is not None:
            return found
    raise ValueError(f"no sentences of this filler add up to {n} tokens: choose another length")


def _try_fill(tok, sentences, ending, rng, n):
    first = {s: tok.encode(s) for s in sentences}  # the filler's first sentence follows a newline
    rest = {s: tok.encode(" " + s) for s in ending}
    longest = max(len(t) for t in rest.values())
    for s0 in [rng.choice(sentences)] + rng.sample(sentences, len(sentences)):
        ids, bounds = list(first[s0]), [0, len(first[s0])]
        while n - len(ids) > 2 * longest:
            ids += rest[rng.choice(sentences)]
            bounds.append(len(ids))
        while len(ids) <= n:
            left = n - len(ids)
            reach = {0: None}  # reach[x]: a sentence that ends a sum of x tokens
            for x in range(1, left + 1):
                fits = [s for s in ending if x - len(rest[s]) in reach]
                if fits:
                    reach[x] = rng.choice(fits)
            if left in reach:
                found, x = [], left
                while x:
                    found.append(reach[x])
                    x -= len(rest[reach[x]])
                for s in found:
                    ids += rest[s]
                    bounds.append(len(ids))
                return ids, bounds
            if len(bounds) == 2:
                break  # only the first sentence is left: try another one first
            bounds.pop()  # one sentence fewer, and try again
            ids = ids[: bounds[-1]]
    return None


@dataclasses.dataclass
class Passkey:
    """One passkey prompt. ids: the prompt's tokens (exactly P_LEN); answer: the tokens of " {key}" (the space
    too); needle: the positions of the sentence that holds the key; depth: where the needle starts, as a share
    of the filler before it and after it (0: right after the instruction, 1: right before the question)."""

    ids: list
    key: int
    answer: list
    needle: range
    depth: float
    filler: int  # which filler (filler_sentences(filler))


def passkey_prompts(tok, n: int = N_PROMPTS, length: int = P_LEN, seed: int = 0,
                    depths: list[float] | None = None) -> list[Passkey]:
    """``n`` passkey prompts of exactly ``length`` tokens: prompt i hides a random five-digit key in filler i
    (``filler_sentences(i, seed)``), at the sentence boundary nearest depth i (default: evenly spaced from 0.05 to
    0.95, so that no two prompts share a filler or a depth). The instruction, the needle and the question are the
    same words in every prompt; the filler fills the tokens left exactly, in whole sentences."""
    depths = [0.05 + 0.9 * i / max(1, n - 1) for i in range(n)] if depths is None else list(depths)
    if len(depths) != n:
        raise ValueError(f"need {n} depths, got {len(depths)}")
    rng = random.Random(seed)
    keys = [rng.randint(10000, 99999) for _ in range(n)]
    intro, question = tok.encode(INTRO), tok.encode(QUESTION)
    out = []
    for i, (key, depth) in enumerate(zip(keys, depths)):
        needle = tok.encode(_needle(key))
        n_fill = length - len(intro) - len(needle) - len(question)
        if n_fill < 8:
            raise ValueError(f"length {length} leaves {n_fill} tokens of filler: make it longer")
        chosen, own = filler_sentences(i, seed)
        theme = FILLER_BANK[list(FILLER_BANK)[i % len(FILLER_BANK)]]
        fill, bounds = _fill_exactly(tok, chosen, own, n_fill, spare=theme)
        at = min(bounds, key=lambda b: abs(b - depth * n_fill))
        ids = intro + fill[:at] + needle + fill[at:] + question
        start = len(intro) + at
        out.append(Passkey(ids=ids, key=key, answer=tok.encode(f" {key}"), needle=range(start, start + len(needle)),
                           depth=at / n_fill, filler=i))
    if len({len(p.answer) for p in out}) != 1:
        raise ValueError("the keys' answers tokenize to different lengths: they cannot be scored in one batch")
    return out


# --------------------------------------------------------------------------------------------
# Memory: the tensors a cache holds
# --------------------------------------------------------------------------------------------


class Meter:
    """Held bytes of a cache (``held_bytes``, 2 bytes per number) sampled after every layer's ``attend``.

    ``with Meter(cache, config) as m: ...`` records, after each forward (the last layer's call), (length of
    sequence 0 after the call, the call's new tokens, held bytes); and after every layer's call the held bytes
    for the peak (a cache that grows a layer at a time is seen as it grows). The K/V a call computes before the
    cache stores or drops them is not counted: every method has the same. ``grows``: a function n -> bytes held by
    a cache built for exactly n tokens (the full cache, counted as a paged allocator holds it), used instead of
    the object's own preallocated buffers. Per sequence: the bytes of a batch are divided by its size.
    """

    def __init__(self, cache, config, grows=None, float_bytes: int = 2):
        self.cache, self.config, self.grows, self.float_bytes = cache, config, grows, float_bytes
        self.records: list = []  # (n after the call, T, bytes per sequence)
        self.samples: list = []  # bytes per sequence after every layer's call (and at entry)

    def _bytes(self, n: int) -> float:
        if self.grows is not None:
            return float(self.grows(n))
        return held_bytes(self.cache, float_bytes=self.float_bytes).total / self.cache.seq_lens.shape[0]

    def __enter__(self):
        cache, last = self.cache, self.config.n_layers - 1
        if self.grows is None:
            self.samples.append(self._bytes(0))
        original = cache.attend
        own = vars(cache).get("attend")

        def attend(layer_idx, q, k, v):
            out = original(layer_idx, q, k, v)
            n = int(cache.seq_lens[0]) + (0 if layer_idx == last else q.shape[2])  # seq_lens moves after the last
            if self.grows is None or layer_idx == last:
                b = self._bytes(n)
                self.samples.append(b)
                if layer_idx == last:
                    self.records.append((n, int(q.shape[2]), b))
            return out

        self._saved = own
        cache.attend = attend
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            self.cache.attend = self._saved
        else:
            del self.cache.attend
        return False

    def _scored(self, start: int):
        chosen = [(n, T, b) for n, T, b in self.records if n - T >= start]
        if not chosen:
            raise ValueError(f"no recorded call starts at or after {start}")
        return chosen

    def mean_bytes(self, start: int = 0) -> float:
        """Held bytes per sequence averaged over the calls whose tokens sit at or after ``start``, each call
        weighted by its tokens (the time a server holds them, in tokens produced)."""
        chosen = self._scored(start)
        return sum(T * b for _, T, b in chosen) / sum(T for _, T, _ in chosen)

    def mean_fraction(self, start: int = 0) -> float:
        """``mean_bytes`` over the same average for a plain fp16 cache of the same tokens (time-averaged memory)."""
        chosen = self._scored(start)
        return self.mean_bytes(start) * sum(T for _, T, _ in chosen) / sum(
            T * fp16_cache_bytes(self.config, n) for n, T, _ in chosen)

    def peak_bytes(self) -> float:
        """The most held per sequence at any sample."""
        return max(self.samples)

    def peak_fraction(self) -> float:
        """``peak_bytes`` over a plain fp16 cache of the final length (the full cache's peak)."""
        return self.peak_bytes() / fp16_cache_bytes(self.config, self.records[-1][0])


# --------------------------------------------------------------------------------------------
# One prompt's prefill, read by every cache that attends the whole prompt
# --------------------------------------------------------------------------------------------

#: bytes of recorded prefills kept per model (the least recently used go first); 0 turns the sharing off
PREFILL_MEMORY = 2**30
_PREFILLS = weakref.WeakKeyDictionary()  # model -> OrderedDict {key: (per-layer (q, k, v, out), logits, bytes)}


def _reads_prompt_whole(cache) -> bool:
    """Whether a cache's first call attends over the whole prompt before it keeps anything: the full cache, and
    the rules that compress once after attending (H2O as its reference code runs it, SnapKV, PyramidKV). For
    all of them that call's output is the prompt's full causal attention, whatever they keep afterwards."""
    from ..cache import KVCache

    return type(cache) is KVCache or bool(getattr(cache, "prefill_whole", False))


class _Recorder:
    """The cache a recorded prefill runs through: ``cache.attend``, each layer's (q, k, v, output) kept."""

    def __init__(self, cache):
        self.cache, self.calls = cache, []
        self.keys_before_rope = getattr(cache, "keys_before_rope", False)

    def attend(self, layer_idx, q, k, v):
        out = self.cache.attend(layer_idx, q, k, v)
        self.calls.append((q, k, v, out))
        return out


class _Resumed:
    """The cache a forward runs through when a replay parted from its recording at layer j: layers 0..j give
    what ``cache`` already gave them (their keys and values are stored), the later layers attend for real."""

    def __init__(self, cache, outs):
        self.cache, self.outs = cache, outs
        self.keys_before_rope = getattr(cache, "keys_before_rope", False)

    def attend(self, layer_idx, q, k, v):
        return self.outs[layer_idx] if layer_idx < len(self.outs) else self.cache.attend(layer_idx, q, k, v)


@torch.no_grad()
def prefill(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """``model(ids, cache=cache, logits_to_keep=1)``, the prompt's first call, computed once per prompt for the
    caches that read it whole (``_reads_prompt_whole``). The first such call records every layer's q, k, v and
    the cache's output; a later one on the same prompt and weights hands the recorded q, k, v to its own
    ``cache.attend``, layer by layer, and keeps the recorded logits only if every layer's output is bit for bit
    the recorded one (``torch.equal``): the model's input to each next layer, and so its q, k, v, is then what was
    recorded. At the first layer that differs, the forward is run for real from there (``_Resumed``). The
    cache ends as the plain call leaves it and the logits are the same numbers; only the model's matrix
    products are skipped. Recordings are kept up to ``PREFILL_MEMORY`` bytes per model."""
    from ..model import Transformer

    if PREFILL_MEMORY <= 0 or type(model) is not Transformer or not _reads_prompt_whole(cache):
        return model(ids, cache=cache, logits_to_keep=1)
    store = _PREFILLS.setdefault(model, collections.OrderedDict())
    key = (tuple((p.data_ptr(), p._version) for p in model.parameters()),  # the same weights, unchanged
           bool(getattr(cache, "keys_before_rope", False)), tuple(ids.shape), tuple(ids.flatten().tolist()))
    if key not in store:
        recorder = _Recorder(cache)
        logits = model(ids, cache=recorder, logits_to_keep=1)
        size = sum(t.untyped_storage().nbytes() for call in recorder.calls for t in call)
        store[key] = (recorder.calls, logits.clone(), size)
        while sum(entry[2] for entry in store.values()) > PREFILL_MEMORY:
            store.popitem(last=False)
        return logits
    store.move_to_end(key)
    calls, logits, _ = store[key]
    for layer, (q, k, v, out) in enumerate(calls):
        mine = cache.attend(layer, q, k, v)
        if not torch.equal(mine, out):
            outs = [call[3] for call in calls[:layer]] + [mine]
            return model(ids, cache=_Resumed(cache, outs), logits_to_keep=1)
    return logits.clone()


def _forget_prefill(model, ids: torch.Tensor):
    """Drop the recorded prefills of ``ids`` (a prompt no later call will read again)."""
    store, tokens = _PREFILLS.get(model, {}), (tuple(ids.shape), tuple(ids.flatten().tolist()))
    for key in [key for key in store if key[2:] == tokens]:
        del store[key]


# --------------------------------------------------------------------------------------------
# The two tasks
# --------------------------------------------------------------------------------------------


def text_ids(tok, n: int = N_TEXT, device="cpu") -> torch.Tensor:
    """(1, n) the first ``n`` tokens of ``textwrap``'s source (read from this machine's Python)."""
    ids = tok.encode(inspect.getsource(textwrap))[:n]
    if len(ids) < n:
        raise ValueError(f"textwrap's source has {len(ids)} tokens, {n} asked for")
    return torch.tensor([ids], device=device)


@torch.no_grad()
def perplexity(model, cache, ids: torch.Tensor, step: int = STEP):
    """Prefill the first half of ``ids`` (1, N) in one call, then score the second half teacher-forced ``step``
    tokens per call -> (perplexity, per-token NLL (N - N // 2,) in nats, CPU)."""
    N = ids.shape[1]
    half = N // 2
    logits = [prefill(model, cache, ids[:, :half])[0]]  # predicts token `half`
    for t in range(half, N - 1, step):
        e = min(t + step, N - 1)
        positions = torch.arange(t, e, device=ids.device)[None]
        logits.append(model(ids[:, t:e], positions=positions, cache=cache)[0])  # predicts t+1 .. e
    nll = F.cross_entropy(torch.cat(logits).float(), ids[0, half:], reduction="none").cpu()
    return math.exp(nll.mean().item()), nll


def ppl_interval(nll: torch.Tensor, block: int = STEP, n_boot: int = 2000, seed: int = 0) -> tuple:
    """95% bootstrap interval of exp(mean NLL), resampling blocks of ``block`` consecutive scored tokens (nearby
    tokens are not independent; a block is one scored call)."""
    means = nll[: len(nll) // block * block].reshape(-1, block).mean(1)
    pick = torch.randint(len(means), (n_boot, len(means)), generator=torch.Generator().manual_seed(seed))
    boot = means[pick].mean(1).exp()
    return boot.quantile(0.025).item(), boot.quantile(0.975).item()


def ppl_ratio_interval(nll_a: torch.Tensor, nll_b: torch.Tensor, block: int = STEP, n_boot: int = 2000,
                       seed: int = 0) -> tuple:
    """(ratio, low, high): perplexity of a over perplexity of b on the same tokens, and its paired 95% bootstrap
    interval over blocks; a ratio whose interval excludes 1 is a difference the text supports."""
    d = nll_a - nll_b
    lo, hi = ppl_interval(d, block, n_boot, seed)
    return math.exp(d.mean().item()), lo, hi


@torch.no_grad()
def _score_batch(model, cache, batch: list[Passkey]):
    """Prefill the prompts (B, P), feed the answers' tokens but the last: (B,) bool, every answer token right."""
    dev = model.device
    ids = torch.tensor([p.ids for p in batch], device=dev)
    answers = torch.tensor([p.answer for p in batch], device=dev)  # (B, A)
    B, P = ids.shape
    first = prefill(model, cache, ids)[:, -1]  # (B, V): predicts answer token 0
    rest = model(answers[:, :-1], positions=torch.arange(P, P + answers.shape[1] - 1, device=dev).expand(B, -1),
                 cache=cache)  # (B, A - 1, V): predicts answer tokens 1..
    pred = torch.cat([first[:, None], rest], dim=1).argmax(-1)
    return (pred == answers).all(dim=1).cpu()


def score_passkey(model, make_cache, prompts: list[Passkey], batch: int = PASSKEY_BATCH, grows=None) -> dict:
    """Every prompt through a fresh cache ``make_cache(batch)``, ``batch`` prompts per call (all prompts have the
    same length). Returns retrieved (list of bool, per prompt), k, n, the Wilson interval (low, high), and the
    memory of the first call's cache (a ``Meter``: the prompts have one length, so every cache holds the same
    bytes): time-averaged over the two scored calls (the prompt and the answer) and the peak, each as a share of
    a plain fp16 cache's and in MiB per sequence. ``grows``: see ``Meter``."""
    retrieved, meter = [], None
    for i in range(0, len(prompts), batch):
        part = prompts[i: i + batch]
        cache = make_cache(len(part))
        if meter is None:
            with Meter(cache, model.config, grows) as meter:
                retrieved += _score_batch(model, cache, part).tolist()
        else:
            retrieved += _score_batch(model, cache, part).tolist()
    k = sum(retrieved)
    return {"retrieved": retrieved, "k": k, "n": len(retrieved), "interval": wilson(k, len(retrieved)),
            "memory": meter.mean_fraction(), "peak": meter.peak_fraction(), "MiB": meter.mean_bytes() / 2**20,
            "peak MiB": meter.peak_bytes() / 2**20}


def evaluate(model, make_cache, text: torch.Tensor | None = None, prompts: list[Passkey] | None = None,
             grows=None, batch: int = PASSKEY_BATCH) -> dict:
    """One configuration on the tasks given -> a row (a dict). With ``text``: perplexity, its 95% block-bootstrap
    interval and the per-token NLL (for paired comparisons, ``ppl_ratio_interval``), memory on the text
    (time-averaged over the scored calls and peak, shares of fp16 and MiB per sequence). With ``prompts``: passkey
    retrieved k of n, the Wilson interval, and the memory on the prompts. ``make_cache(batch, length)``: a fresh
    cache for ``batch`` sequences of a task of ``length`` tokens (the text's N, or the prompts' length: a budget is
    a share of it); ``grows(n)``: the bytes of a cache that grows, built for n tokens (None: the cache measured as
    it is)."""
    row = {}
    if text is not None:
        cache = make_cache(1, text.shape[1])
        with Meter(cache, model.config, grows) as meter:
            ppl, nll = perplexity(model, cache, text)
        lo, hi = ppl_interval(nll)
        start = text.shape[1] // 2
        row.update({"perplexity": ppl, "ppl low": lo, "ppl high": hi, "memory": meter.mean_fraction(start),
                    "peak": meter.peak_fraction(), "MiB": meter.mean_bytes(start) / 2**20,
                    "peak MiB": meter.peak_bytes() / 2**20, "nll": nll})
    if prompts:
        pk = score_passkey(model, lambda b: make_cache(b, len(prompts[0].ids)), prompts, batch, grows)
        row.update({"passkey": pk["k"] / pk["n"], "passkey k": pk["k"], "passkey n": pk["n"],
                    "passkey low": pk["interval"][0], "passkey high": pk["interval"][1],
                    "passkey memory": pk["memory"], "passkey peak": pk["peak"], "passkey MiB": pk["MiB"],
                    "passkey peak MiB": pk["peak MiB"], "retrieved": pk["retrieved"]})
    return row


def full_cache(model):
    """(make_cache, grows) of the full fp16 cache: the reference every share is taken of. Its preallocated
    buffers are not what a server pays: ``grows`` counts a cache built for exactly the tokens held."""
    from ..cache import KVCache

    def grows(n):
        return held_bytes(KVCache.for_model(model, 1, max(1, n)), float_bytes=2).total

    return (lambda batch, length: KVCache.for_model(model, batch, length + 8)), grows


# Chapter 09a's rules: name -> build(model, batch, budget). A budget is a number of positions per sequence (and
# per layer; PyramidKV's is the mean over layers). SnapKV-like rules vote with a window of min(16, budget // 2).
# "H2O" is H2O as its reference code runs it (the prompt attends whole and is cut once, then one eviction per
# token); "H2O, streamed (ours)" is the same score chosen as the prompt streams in, before its end is read.
def _snap_window(budget):
    return min(16, budget // 2)


def _rules():
    from .. import evict

    return {
        "sliding window": lambda m, B, b: evict.SlidingWindowCache.for_model(m, B, b),
        "sinks + window": lambda m, B, b: evict.SinkCache.for_model(m, B, b, n_sink=4),
        "H2O": lambda m, B, b: evict.H2OCache.for_model(m, B, b),  # as its reference code: the prompt read whole
        "H2O, streamed (ours)": lambda m, B, b: evict.H2OCache.for_model(m, B, b, prefill="stream"),
        "SnapKV": lambda m, B, b: evict.SnapKVCache.for_model(m, B, b, window=_snap_window(b)),
        "SnapKV, re-evicting (ours)": lambda m, B, b: evict.SnapKVCache.for_model(
            m, B, b, window=_snap_window(b), decode_evict=True),
        "PyramidKV": lambda m, B, b: evict.PyramidKVCache.for_model(m, B, b, window=_snap_window(b)),
        "TOVA": lambda m, B, b: evict.TOVACache.for_model(m, B, b),
        "key norm": lambda m, B, b: evict.KnormCache.for_model(m, B, b),
        "expected attention": lambda m, B, b: evict.ExpectedAttentionCache.for_model(m, B, b),
    }


RULES = _rules()


def budget_for(frac: float, length: int) -> int:
    """A budget of ``frac`` of a task's ``length`` tokens, at least 8 positions."""
    return max(8, round(frac * length))


def sweep(model, rules, text_fracs, passkey_fracs, text: torch.Tensor | None, prompts: list[Passkey] | None,
          progress: bool = False):
    """Each rule of ``rules`` (names in ``RULES``) at each budget share: perplexity on ``text`` at the shares in
    ``text_fracs``, the passkey on ``prompts`` at those in ``passkey_fracs`` (a share in both runs both tasks on
    their own caches) -> a DataFrame, one row per (rule, share), with evaluate's columns (NaN for a task not run),
    the method, the share and the positions kept on each task."""
    import pandas as pd

    rows = []
    for name in rules:
        build = RULES[name]
        for frac in sorted(set(text_fracs) | set(passkey_fracs)):
            row = evaluate(model, lambda B, L: build(model, B, budget_for(frac, L)),
                           text if frac in text_fracs else None, prompts if frac in passkey_fracs else None)
            rows.append({"method": name, "budget": frac,
                         "kept (text)": budget_for(frac, text.shape[1]) if frac in text_fracs else None,
                         "kept (passkey)": budget_for(frac, len(prompts[0].ids)) if frac in passkey_fracs else None,
                         **row})
            if progress:
                print(f"{name} at {frac:.0%} done", flush=True)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# Reading the results
# --------------------------------------------------------------------------------------------


def rate(k: int, n: int) -> str:
    """"17/24 = 71% [51, 85]": a rate with its 95% Wilson interval in percent (k and n: counts, also as floats of a
    table column)."""
    k, n = int(k), int(n)
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {100 * k / n:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def verdict(name_a: str, a: tuple, name_b: str, b: tuple) -> str:
    """One line comparing two passkey results (k, n): which is higher where their Wilson intervals separate,
    "not separated" otherwise."""
    a, b = (int(a[0]), int(a[1])), (int(b[0]), int(b[1]))
    ia, ib = wilson(*a), wilson(*b)
    if not separated(ia, ib):
        return f"{name_a} {rate(*a)} vs {name_b} {rate(*b)}: not separated"
    hi_name, lo_name = (name_a, name_b) if a[0] / a[1] > b[0] / b[1] else (name_b, name_a)
    return f"{name_a} {rate(*a)} vs {name_b} {rate(*b)}: {hi_name} higher"


def frontier(points: list[tuple], lower_is_better: bool) -> list[int]:
    """Indices of the points (memory, quality) that no other point beats: none holds no more memory and is at
    least as good with one of the two strictly better. Sorted by memory."""
    def better_or_equal(q1, q2):
        return q1 <= q2 if lower_is_better else q1 >= q2

    keep = []
    for i, (m, q) in enumerate(points):
        dominated = any(
            m2 <= m and better_or_equal(q2, q) and (m2 < m or q2 != q)
            for j, (m2, q2) in enumerate(points) if j != i)
        if not dominated:
            keep.append(i)
    return sorted(keep, key=lambda i: points[i][0])


def label_of(row) -> str:
    """"H2O 25%", or the method alone for a row without a budget share (the full cache, INT8, ...)."""
    b = row.get("budget") if hasattr(row, "get") else None
    return row["method"] if b is None or b != b else f"{row['method']} {b:.0%}"


def plot_quality_memory(table, title: str = ""):
    """The chapter's chart: perplexity against memory on the text (left, log scale) and passkey retrieval against
    memory on the prompts (right), every row of ``table`` (``sweep``/``evaluate`` rows with a ``method`` column) a
    point: one colour and marker per method (the legend), the budget share written beside it, the dot at the
    time-averaged memory and a thin line to the tick at the peak; the passkey with its Wilson interval; the frontier
    (``frontier``, on the time-averaged memory) dashed. Returns (Figure, {task: labels of the frontier's points})."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.2))
    methods = list(dict.fromkeys(table["method"]))
    style = {m: (plt.get_cmap("tab10")(i % 10), "osD^v<>pPX*"[i % 11]) for i, m in enumerate(methods)}
    on_frontier = {}
    tasks = [("perplexity", "memory", "peak", True), ("passkey", "passkey memory", "passkey peak", False)]
    for ax, (col, mem, peak, lower) in zip(axes, tasks):
        part = table[table[col].notna()] if col in table else table.iloc[:0]
        pts = [(float(r[mem]), float(r[col])) for _, r in part.iterrows()]
        scale = 100 if col == "passkey" else 1
        for (_, r), (m, q) in zip(part.iterrows(), pts):
            color, marker = style[r["method"]]
            y = scale * q
            ax.plot([100 * m, 100 * float(r[peak])], [y, y], color=color, lw=0.8, alpha=0.6)
            ax.plot(100 * float(r[peak]), y, "|", color=color, ms=9)
            yerr = [[y - 100 * r["passkey low"]], [100 * r["passkey high"] - y]] if col == "passkey" else None
            ax.errorbar(100 * m, y, yerr=yerr, fmt=marker, color=color, ms=6, capsize=2, lw=0.8)
            b = r.get("budget")
            if b == b and b is not None:
                ax.annotate(f"{b:.0%}", (100 * m, y), fontsize=7, xytext=(4, 2), textcoords="offset points",
                            color=color)
        idx = frontier(pts, lower_is_better=lower)
        on_frontier[col] = [label_of(part.iloc[i]) for i in idx]
        if idx:
            fx = [100 * pts[i][0] for i in idx]
            fy = [scale * pts[i][1] for i in idx]
            ax.step(fx, fy, where="post", ls="--", color="k", lw=1)
        ax.set_xlabel("memory held, % of fp16 for the same tokens (marker: time-averaged, tick: peak)")
    handles = [plt.Line2D([], [], color=c, marker=mk, ls="", label=m) for m, (c, mk) in style.items()]
    axes[1].legend(handles=handles, fontsize=7.5, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes[0].set_yscale("log")
    ppl = table["perplexity"].dropna() if "perplexity" in table else []
    if len(ppl):
        ticks = [t for t in (10, 12, 15, 20, 25, 30, 40, 50, 80, 100, 200, 500, 1000)
                 if 0.9 * ppl.min() <= t <= 1.1 * ppl.max()]
        axes[0].set_yticks(ticks, [str(t) for t in ticks])
        axes[0].yaxis.set_minor_formatter(NullFormatter())
    axes[0].set(ylabel="perplexity (log; lower is better)", title="held-out text: perplexity (dashed: the frontier)")
    axes[1].set(ylabel="passkeys fully retrieved, % (95% Wilson interval)", ylim=(-5, 105),
                title="passkey retrieval (dashed: the frontier)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig, on_frontier


# --------------------------------------------------------------------------------------------
# Chapter 09a's harness (keeping fewer positions)
# --------------------------------------------------------------------------------------------


PICTURE_RULES = ["sliding window", "sinks + window", "H2O", "H2O, streamed (ours)", "SnapKV", "PyramidKV", "TOVA",
                 "key norm", "expected attention"]


@torch.no_grad()
def prefilled(model, ids: list, budget: int, rules=PICTURE_RULES) -> dict:
    """{rule: its cache after prefilling ``ids`` at ``budget`` positions} (batch 1): what the rules hold when the
    prompt ends, before any answer token."""
    out = {}
    for name in rules:
        cache = RULES[name](model, 1, budget)
        prefill(model, cache, torch.tensor([ids], device=model.device))
        out[name] = cache
    return out


def needle_held(cache, needle: range) -> float:
    """Share of the needle's positions held, over every (layer, K/V head) of sequence 0."""
    shares = []
    for layer in range(len(cache.k)):
        pos = cache.held_positions(0, layer).cpu()
        shares += [sum(int(j in set(row.tolist())) for j in needle) / len(needle) for row in pos]
    return sum(shares) / len(shares)


def failure_table(model, tok, prompt: Passkey, caches: dict, n_new: int = 7):
    """Per rule: what greedy decoding answers after ``prompt`` with a fresh cache of the same rule and budget
    (``caches``: the prefilled ones, whose budget and class are reused), whether the key is in it, and how much of
    the needle the prefilled cache holds (mean over layers and K/V heads) -> DataFrame."""
    import pandas as pd

    from ..generate import generate

    rows = []
    for name, cache in caches.items():
        fresh = RULES[name](model, 1, cache.budget)
        answer = tok.decode(generate(model, [prompt.ids], n_new, cache=fresh)[0].tolist())
        rows.append({"rule": name, "answer": repr(answer), "key in the answer": str(prompt.key) in answer.replace(" ", ""),
                     "needle held": round(100 * needle_held(cache, prompt.needle))})
    return pd.DataFrame(rows).rename(columns={"needle held": "needle held (% of layers x K/V heads)"})


def rope_drift(model, moves=(100, 500, 2000), seed: int = 3):
    """Relative error of 192 random keys after n in-place re-rotations by one position (stored back in the dtype
    each time), against one rotation by n of the stored key, per dtype -> DataFrame."""
    import pandas as pd

    from ..model import rope_cos_sin, rotate

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.n_kv_heads, 64, cfg.head_dim, generator=g, dtype=torch.float64)
    inv_freq = model.inv_freq.double().cpu()
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        y, by_one = x.to(dtype), rope_cos_sin(torch.tensor(1), inv_freq, dtype)
        for n in range(1, max(moves) + 1):
            y = rotate(y, *by_one)  # moved down one rank: re-rotated in place, stored back in `dtype`
            if n in moves:
                exact = rotate(x, *rope_cos_sin(torch.tensor(n), inv_freq, torch.float64))
                once = rotate(x.to(dtype), *rope_cos_sin(torch.tensor(n), inv_freq, dtype)).double()
                rows.append({"dtype": str(dtype).removeprefix("torch."), "moves": n,
                             "re-rotated in place": ((y.double() - exact).norm() / exact.norm()).item(),
                             "rotated once from the stored key": ((once - exact).norm() / exact.norm()).item()})
    return pd.DataFrame(rows)


def kept_vs_reassigned(model, text: torch.Tensor, budget: int, kept=None):
    """Perplexity of sinks + window at ``budget`` with kept and with reassigned positions, and their paired ratio
    (reassigned / kept) with its 95% block-bootstrap interval -> dict. ``kept``: the row of a ``sweep`` that ran
    ``RULES["sinks + window"]`` at this budget on ``text`` (kept positions are its default: the same cache, the
    same numbers), so that the kept run is not made twice; None runs it."""
    from ..evict import SinkCache

    out = {} if kept is None else {"kept": (float(kept["perplexity"]), kept["nll"])}
    for mode in ("kept", "reassign"):
        if mode not in out:
            out[mode] = perplexity(model, SinkCache.for_model(model, 1, budget, n_sink=4, positions=mode), text)
    ratio = ppl_ratio_interval(out["reassign"][1], out["kept"][1])
    return {"kept": out["kept"][0], "reassigned": out["reassign"][0], "ratio": ratio}


def paged_window_run(model, tok, n_new: int = 96, budget: int = 64, block: int = 16):
    """A chat prompt, then ``n_new`` greedy tokens, through chapter 05's paged cache and through the paged window
    (``PagedWindowCache``, one sink block) -> (blocks in use after each call without the window (computed:
    ceil(positions / block), checked against the pool at the end), with it (the pool's trace), the tokens the two
    agree on before they first differ, the window cache)."""
    from ..evict import PagedWindowCache
    from ..generate import generate
    from ..paged import PagedKVCache

    chat = tok.chat([{"role": "user", "content": "Write a short story about a lighthouse keeper."}])
    plain = PagedKVCache.for_model(model, num_blocks=64, block_size=block, prefix_caching=False)
    window = PagedWindowCache.for_model(model, batch=1, budget=budget, block_size=block, sink_blocks=1)
    a = generate(model, [chat], n_new, cache=plain)[0].tolist()
    b = generate(model, [chat], n_new, cache=window)[0].tolist()
    trace_plain = [-(-(len(chat) + i) // block) for i in range(n_new)]
    if trace_plain[-1] != plain.allocator.num_blocks - plain.allocator.num_free:
        raise RuntimeError("the computed block count does not match the pool")
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n_new)
    return trace_plain, window.pool_trace, same, window


def kvpress_line() -> str:
    """One line: kvpress's installed version, or why it is not run here."""
    try:
        from importlib.metadata import version

        return f"kvpress {version('kvpress')} is installed"
    except Exception:  # PackageNotFoundError
        return "kvpress is not installed here (pip install kvpress: 0.5.5 pins transformers < 5.3)"


# --------------------------------------------------------------------------------------------
# Lab 09a's decision: whose attention holds the needle when the question has been read
# --------------------------------------------------------------------------------------------

CHOICES = ("H2O", "H2O, streamed (ours)", "SnapKV")  # three rules that choose by attention: whose, and when


def needle_evidence(model, prompts: list[Passkey], frac: float = 0.25, rules=CHOICES):
    """Per rule, at a budget of ``frac`` of the prompt: the share of the needle its cache holds after the prompt
    (mean over the prompts and every layer and K/V head), on how many prompts it holds any of it, and the share on
    each prompt (for ``needle_lead``'s paired interval) -> DataFrame indexed by rule."""
    import pandas as pd

    rows = {}
    for name in rules:
        shares = []
        for p in prompts:
            cache = prefilled(model, p.ids, budget_for(frac, len(p.ids)), [name])[name]
            shares.append(needle_held(cache, p.needle))
        rows[name] = {"needle held (mean %)": 100 * sum(shares) / len(shares),
                      "prompts holding any of it": sum(s > 0 for s in shares), "prompts": len(shares),
                      "per prompt (%)": [100 * s for s in shares]}
    return pd.DataFrame.from_dict(rows, orient="index")


def needle_lead(evidence, n_boot: int = 4000, seed: int = 0) -> list[tuple]:
    """[(best, other, lead, low, high), ...]: the rule with the highest mean share of the needle in ``evidence``
    (``needle_evidence``), and its lead over each other rule in points of the needle, with the 95% paired bootstrap
    interval over the prompts (each prompt went through both rules; one resampling of the prompts for all pairs),
    the others in order of their mean. A lead whose interval lies above 0 is one these prompts support; one that
    contains 0 is not separated."""
    mean = evidence["needle held (mean %)"].astype(float).sort_values(ascending=False, kind="stable")
    best = mean.index[0]
    mine = torch.tensor(evidence.loc[best, "per prompt (%)"], dtype=torch.float64)
    pick = torch.randint(len(mine), (n_boot, len(mine)), generator=torch.Generator().manual_seed(seed))
    out = []
    for other in mean.index[1:]:
        d = mine - torch.tensor(evidence.loc[other, "per prompt (%)"], dtype=torch.float64)
        boot = d[pick].mean(1)
        out.append((best, other, d.mean().item(), boot.quantile(0.025).item(), boot.quantile(0.975).item()))
    return out


def check_needle_choice(choice: str, evidence) -> bool:
    """Lab 09a's decision: the rule (one of ``CHOICES``) that holds the most of the needle once the question has
    been read. Prints the evidence (and, where it has the per-prompt shares, the best rule's lead over each other
    rule with its paired interval, ``needle_lead``) and yours vs the reference (the rule with the highest measured
    share); a wrong choice fails with its diagnosis (``kvlib.course.mistakes.lab09.needle_choice``)."""
    from .check import check_choice
    from .mistakes import lab09

    yours = str(choice).strip()
    ref = evidence["needle held (mean %)"].astype(float).idxmax()
    shown = [c for c in evidence.columns if c != "per prompt (%)"]
    print(evidence[shown].round(1).to_string())
    if "per prompt (%)" in evidence:
        for best, other, lead, lo, hi in needle_lead(evidence):
            print(f"{best} - {other}: {lead:+.1f} points of the needle [{lo:+.1f}, {hi:+.1f}] "
                  f"(95% paired bootstrap over {int(evidence.loc[best, 'prompts'])} prompts)")
    print()
    return check_choice("rule that holds the most of the needle", yours, ref,
                        lambda: lab09.needle_choice(yours, ref, evidence))


def passkey_at_length(model, tok, rules=("SnapKV", "H2O", "sinks + window"), length: int = 320, frac: float = 0.5,
                      n: int = N_PROMPTS) -> dict:
    """The passkey of section 5 on ``n`` prompts of ``length`` tokens, each rule of ``rules`` at ``frac`` of the
    prompt -> {rule: (k, n)}, the counts that ``rate`` and ``verdict`` read (the same as ``sweep``'s). Each prompt
    goes through every rule before the next, so the rules that read it whole share its prefill (``prefill``),
    whose recording is then dropped."""
    prompts = passkey_prompts(tok, n=n, length=length)
    budget = budget_for(frac, len(prompts[0].ids))
    retrieved = {name: [] for name in rules}
    for i in range(0, len(prompts), PASSKEY_BATCH):  # prompt by prompt through every rule: each prefill read once
        part = prompts[i: i + PASSKEY_BATCH]
        for name in rules:
            retrieved[name] += _score_batch(model, RULES[name](model, len(part), budget), part).tolist()
        _forget_prefill(model, torch.tensor([p.ids for p in part], device=model.device))
    return {name: (sum(r), len(r)) for name, r in retrieved.items()}


def ratio_line(name_a: str, row_a, name_b: str, row_b) -> str:
    """One line: the paired perplexity ratio of two sweep rows, its 95% block-bootstrap interval and both memories
    (no verdict words: read whether the interval excludes 1)."""
    r, lo, hi = ppl_ratio_interval(row_a.nll, row_b.nll)
    return (f"{name_a} / {name_b} perplexity {r:.3f} [{lo:.3f}, {hi:.3f}] at memory {row_a.memory:.2f} vs "
            f"{row_b.memory:.2f}")
