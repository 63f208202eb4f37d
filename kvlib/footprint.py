"""What a cache really holds (chapter 09): bytes counted from the tensors a cache object owns.

What you will learn:
- a cache's memory is every tensor it allocates, not only its K/V payload: eviction rules keep an
  index, positions and scores per slot, SnapKV an observation window (when it evicts while decoding),
  KIVI a full-precision residual and fp16 scales, and a budgeted cache preallocates ``budget + chunk``
  slots (the paper's SnapKV grows them by ``chunk`` as it keeps decoded tokens);
- ``cache_tensors``: every tensor found by walking the cache object's attributes (lists, tuples,
  dicts and the plain objects it owns), each storage once, named by its path ("k[3]", "allocator.free");
- ``held_bytes``: those bytes split into payload, scales/zeros, indices/positions, scores/statistics
  and other, optionally counted at a half-precision server's 2 bytes per compute-dtype number;
- ``MemoryMeter``: held bytes after every model forward, so a chart can show the bytes held at the
  end, their time average over a generation (against a plain fp16 cache of the same length at each
  step) and the peak.

What is not counted: model parameters (any ``torch.nn.Module`` the cache refers to is skipped) and
the temporaries a cache's ``attend`` creates and frees inside one call (gathered K/V, score matrices).
Model *buffers* a cache keeps a reference to (the RoPE ``inv_freq`` of a budgeted cache) are tensors
it holds, and land in "other".
"""

import dataclasses
import operator

import torch

__all__ = ["cache_tensors", "classify", "held_bytes", "HeldBytes", "fp16_cache_bytes", "MemoryMeter", "CATEGORIES"]

CATEGORIES = ("payload", "scales", "indices", "scores", "other")

# Attribute names (the last name on a tensor's path, indices stripped) and what they are. The kvlib caches:
# KVCache / Int8KVCache / CrossLayerKVCache / LowRankKVCache k, v (LowRank: coefficients); KiviCache
# k_packed, v_packed (codes) and k, v (the full-precision residual); LatentKVCache c_kv, k_rope; PagedKVCache
# its block pools k, v.
PAYLOAD_NAMES = {"k", "v", "k_packed", "v_packed", "c_kv", "k_rope", "k_res", "v_res", "k_cache", "v_cache"}
# Integer bookkeeping: BudgetCache index, pos, rot, n_held, evicted; every cache's seq_lens.
INDEX_NAMES = {"index", "pos", "rot", "n_held", "evicted", "seq_lens", "lens", "positions", "slots", "tables",
               "block_table", "block_tables", "free", "refcount", "start", "cu_seqlens"}
INDEX_HINTS = ("index", "pos", "len", "table", "slot", "block")
# Per-slot statistics: BudgetCache score (H2O's accumulated attention), SnapKVCache obs (the observation window).
SCORE_HINTS = ("score", "obs", "vote", "stat")


def _check_float_bytes(float_bytes):
    if float_bytes is None:
        return None
    if isinstance(float_bytes, bool) or not isinstance(float_bytes, int):
        try:
            float_bytes = operator.index(float_bytes)
        except TypeError:
            raise TypeError(f"float_bytes must be None or an int, got {type(float_bytes).__name__} "
                            f"{float_bytes!r}") from None
    if float_bytes not in (1, 2, 4, 8):
        raise ValueError(f"float_bytes must be 1, 2, 4 or 8 (bytes per number), got {float_bytes}")
    return float_bytes


def _is_plain_object(value) -> bool:
    """An object whose attributes may hold tensors the cache owns (an allocator, a tier): not a class, a
    module, a function or a torch.nn.Module."""
    if isinstance(value, (type, torch.nn.Module)) or callable(value):
        return False
    return hasattr(value, "__dict__") and not type(value).__module__.startswith(("builtins", "torch"))


def cache_tensors(cache, max_depth: int = 4) -> dict:
    """Every tensor ``cache`` holds, by attribute path, each underlying storage once.

    Walks the object's attributes: tensors, lists / tuples / dicts of them (per-layer lists give
    "k[0]", "k[1]", ...), and plain objects it owns ("allocator.free"), down to ``max_depth`` levels,
    visiting each object once (a cycle guard). A view and its base share a storage and are listed
    once, under the first path found. ``torch.nn.Module`` attributes are skipped: model parameters
    (and whatever else a module holds) are never a cache's memory. Callables (methods, functions,
    a ``MemoryMeter``'s wrapper) are skipped too.

    >>> from kvlib.cache import KVCache
    >>> cache = KVCache(n_layers=2, batch=1, n_kv_heads=2, max_len=8, head_dim=4)
    >>> cache.alias = cache.k[0][:, :, :4]  # a view: the same storage as k[0]
    >>> sorted(cache_tensors(cache))
    ['k[0]', 'k[1]', 'seq_lens', 'v[0]', 'v[1]']
    """
    if isinstance(cache, (torch.Tensor, torch.nn.Module, type)) or not hasattr(cache, "__dict__"):
        raise TypeError(f"cache must be a cache object with attributes (a KVCache, ...), got {type(cache).__name__}")
    max_depth = int(max_depth)
    found, storages, seen = {}, set(), {id(cache)}

    def key_of(t):
        s = t.untyped_storage()
        return (t.device, s.data_ptr()) if s.nbytes() else ("empty", id(s))

    def visit(value, path, depth):
        if isinstance(value, torch.Tensor):
            k = key_of(value)
            if k not in storages:
                storages.add(k)
                found[path] = value
            return
        if depth > max_depth or isinstance(value, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            return
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            if id(value) in seen:
                return
            seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                visit(item, f"{path}[{key if isinstance(key, int) else repr(key)}]", depth + 1)
        elif _is_plain_object(value):
            if id(value) in seen:
                return
            seen.add(id(value))
            for name, item in vars(value).items():
                visit(item, f"{path}.{name}", depth + 1)

    for name, value in vars(cache).items():
        visit(value, name, 1)
    return found


def _leaf_name(path: str) -> str:
    """"allocator.free" -> "free", "k_scale[3]" -> "k_scale"."""
    return path.rsplit(".", 1)[-1].split("[", 1)[0]


def classify(path: str, t: torch.Tensor) -> str:
    """A tensor's category from its attribute name and dtype (rules in order; "other" when none fits):

    - "scales": the name has "scale" or "zero" (KIVI's k_scale/k_zero/v_scale/v_zero, int8 scales);
    - "indices": an integer or bool tensor named like bookkeeping (index, pos, rot, n_held, evicted,
      seq_lens, or a name with index/pos/len/table/slot/block);
    - "scores": a floating-point tensor with score/obs/vote/stat in its name (H2O's scores, SnapKV's
      observation window);
    - "payload": K/V values or codes (k, v, k_packed, v_packed, c_kv, k_rope, ...);
    - "other": everything else (LowRankKVCache's bases, a referenced RoPE table), never dropped.

    >>> classify("k_scale[0]", torch.ones(2, dtype=torch.half)), classify("pos[1]", torch.zeros(2, dtype=torch.long))
    ('scales', 'indices')
    >>> classify("obs[0]", torch.zeros(2)), classify("k[0]", torch.zeros(2)), classify("U_k[0]", torch.zeros(2))
    ('scores', 'payload', 'other')
    """
    name = _leaf_name(path).lower()
    if "scale" in name or "zero" in name:
        return "scales"
    integer = not (t.is_floating_point() or t.is_complex())
    if integer and (name in INDEX_NAMES or any(h in name for h in INDEX_HINTS)):
        return "indices"
    if t.is_floating_point() and any(h in name for h in SCORE_HINTS):
        return "scores"
    if name in PAYLOAD_NAMES:
        return "payload"
    return "other"


@dataclasses.dataclass
class HeldBytes:
    """Bytes a cache holds, by category (see ``classify``), and per tensor.

    payload: K/V values or codes (for KIVI also its full-precision residual); scales: quantization
    scales and zeros; indices: integer bookkeeping (slot index, positions, lengths; int64 here, often
    int32 in a server, so they are kept apart where their share is visible); scores: per-slot statistics
    (H2O scores, SnapKV observations); other: any tensor no rule names. ``tensors``: path -> (category,
    bytes). ``compute_dtype``: the dtype of the floating-point payload (None when it is not floating).
    """

    payload: int = 0
    scales: int = 0
    indices: int = 0
    scores: int = 0
    other: int = 0
    compute_dtype: torch.dtype | None = None
    tensors: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return self.payload + self.scales + self.indices + self.scores + self.other

    def mib(self) -> dict:
        """The breakdown and total in MiB."""
        return {c: getattr(self, c) / 2**20 for c in CATEGORIES + ("total",)}


def held_bytes(cache, float_bytes=None) -> HeldBytes:
    """Bytes of every tensor ``cache`` holds (``cache_tensors``), by category (``classify``).

    Each storage counts its whole allocation (``untyped_storage().nbytes()``) once: a preallocated
    buffer is paid whether it is filled or not. With ``float_bytes`` (e.g. 2), floating-point tensors
    in the cache's compute dtype (the dtype of its floating-point K/V payload: fp32 on a CPU) count
    ``float_bytes`` per element, what a half-precision server would pay (this includes fp32
    statistics kept in that dtype, such as H2O's scores or SnapKV's observation window, which a server
    might keep in fp32: compare ``held.tensors`` with and without it); fp16 scales, integer codes
    and index tensors count at their real size (int64 indices would often be int32 in a server: the
    ``indices`` field shows their share).

    >>> from kvlib.cache import KVCache
    >>> cache = KVCache(n_layers=2, batch=1, n_kv_heads=2, max_len=8, head_dim=4)  # fp32
    >>> held = held_bytes(cache)
    >>> held.payload, held.indices, held.total  # 2 layers x K,V x 2 heads x 8 x 4 x 4 B; seq_lens int32
    (1024, 4, 1028)
    >>> held_bytes(cache, float_bytes=2).payload  # as an fp16 server would store it
    512
    """
    float_bytes = _check_float_bytes(float_bytes)
    tensors = cache_tensors(cache)
    cats = {path: classify(path, t) for path, t in tensors.items()}
    compute = next((t.dtype for p, t in tensors.items() if cats[p] == "payload" and t.is_floating_point()), None)
    out = HeldBytes(compute_dtype=compute)
    for path, t in tensors.items():
        n = t.untyped_storage().nbytes()
        if float_bytes is not None and compute is not None and t.dtype == compute:
            n = n // t.element_size() * float_bytes
        out.tensors[path] = (cats[path], n)
        setattr(out, cats[path], getattr(out, cats[path]) + n)
    return out


def _check_config(config):
    for name in ("n_layers", "n_kv_heads", "head_dim"):
        value = getattr(config, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TypeError(f"config must be a kvlib.model.ModelConfig (with int n_layers, n_kv_heads, head_dim), "
                            f"got {type(config).__name__} with {name}={value!r}")
    return config


def fp16_cache_bytes(config, n_tokens: int) -> int:
    """Bytes of a plain fp16 cache holding ``n_tokens`` positions of one sequence:
    2 (K and V) x n_layers x n_kv_heads x head_dim x 2 bytes x n_tokens.

    >>> from kvlib.model import ModelConfig
    >>> fp16_cache_bytes(ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3), 1024)  # SmolLM2-135M: 22.5 MiB
    23592960
    """
    _check_config(config)
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int):
        try:
            n_tokens = operator.index(n_tokens)
        except TypeError:
            raise TypeError(f"n_tokens must be an int, got {type(n_tokens).__name__} {n_tokens!r}") from None
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * 2 * n_tokens


class MemoryMeter:
    """Held bytes after every model forward: ``with MemoryMeter(cache, config) as meter: ...``.

    Wraps the instance's ``attend`` (restored on exit, also after an error); after each call on the
    last layer (once per forward) it records (the length of sequence 0 after the call, the call's new
    tokens T from q (B, H, T, D), ``held_bytes(cache, float_bytes)``). ``peak_bytes`` also counts what
    the cache held when the meter was entered (its construction). The cache must have ``attend`` and
    ``seq_lens`` (every kvlib cache the model calls directly; a paged cache attends through batch
    objects and is measured with ``held_bytes`` instead).

    ``mean_fraction(start)``: the token-weighted mean, over the recorded calls whose tokens all sit at
    or after position ``start``, of held bytes / ``fp16_cache_bytes(config, n)``, n the length after
    the call: what the cache costs over a generation against a plain fp16 cache of the same sequence.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> from kvlib.evict import SlidingWindowCache
    >>> model = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, hidden_dim=64)).eval()
    >>> cache = SlidingWindowCache.for_model(model, batch=1, budget=4, chunk=1)
    >>> with MemoryMeter(cache, model.config) as meter, torch.no_grad():
    ...     for t in range(8):
    ...         _ = model(torch.tensor([[t]]), positions=torch.tensor([[t]]), cache=cache)
    >>> [n for n, T, _ in meter.records][-3:], meter.final_bytes == meter.peak_bytes  # preallocated: constant
    ([6, 7, 8], True)
    >>> round(meter.mean_fraction(start=4, part="payload"), 4)  # mean of 5/n, n = 5..8 (budget + chunk slots)
    0.7932
    """

    def __init__(self, cache, config, float_bytes=2):
        if not callable(getattr(cache, "attend", None)) or not hasattr(cache, "__dict__"):
            raise TypeError(f"cache must be an object with an attend(layer_idx, q, k, v) method, got "
                            f"{type(cache).__name__}")
        if getattr(cache, "seq_lens", None) is None:
            raise TypeError(f"cache must have seq_lens (its sequences' lengths), got {type(cache).__name__}")
        self.cache, self.config = cache, _check_config(config)
        self.float_bytes = _check_float_bytes(float_bytes)
        self.records: list = []  # (length after the call, new tokens T, HeldBytes)
        self.initial = None
        self._saved = None

    def __enter__(self):
        cache, last = self.cache, self.config.n_layers - 1
        self.initial = held_bytes(cache, self.float_bytes)
        own = vars(cache).get("attend")  # an instance attribute to put back, else the class's method
        original = cache.attend

        def attend(layer_idx, q, k, v):
            out = original(layer_idx, q, k, v)
            if layer_idx == last:
                self.records.append((int(cache.seq_lens[0]), int(q.shape[2]), held_bytes(cache, self.float_bytes)))
            return out

        self._saved = (own is not None, own)
        cache.attend = attend
        return self

    def __exit__(self, *exc):
        had_own, own = self._saved
        if had_own:
            self.cache.attend = own
        else:
            del self.cache.attend
        return False

    @property
    def final_bytes(self) -> int:
        """Total held after the last recorded call (at entry when nothing was recorded)."""
        return (self.records[-1][2] if self.records else self._initial()).total

    @property
    def peak_bytes(self) -> int:
        """The largest total seen: at entry or after any recorded call."""
        return max([self._initial().total] + [h.total for _, _, h in self.records])

    def _initial(self) -> HeldBytes:
        if self.initial is None:
            raise ValueError("the meter has not been entered: use `with MemoryMeter(cache, config) as meter:`")
        return self.initial

    def mean_fraction(self, start=None, part: str = "total") -> float:
        """Token-weighted mean of held bytes / fp16_cache_bytes(n) over the recorded calls whose tokens
        are at or after position ``start`` (all calls when None); ``part``: "total" or one category."""
        if part not in CATEGORIES + ("total",):
            raise ValueError(f"part must be 'total' or one of {CATEGORIES}, got {part!r}")
        if start is not None:
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ValueError(f"start must be None or an int >= 0, got {start!r}")
        chosen = [(n, T, h) for n, T, h in self.records if start is None or n - T >= start]
        if not chosen:
            raise ValueError(f"no recorded call has its tokens at or after start={start} "
                             f"({len(self.records)} calls recorded)")
        weighted = sum(T * getattr(h, part) / fp16_cache_bytes(self.config, n) for n, T, h in chosen)
        return weighted / sum(T for _, T, _ in chosen)
