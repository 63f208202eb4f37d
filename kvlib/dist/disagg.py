"""Prefill and decode on different workers (chapter 12b): K/V blocks shipped between processes.

What you will learn:
- *disaggregation*: one worker (rank 0) runs prompts (prefill), another (rank 1) runs the token-by-token decode.
  The prefill worker runs kvlib's ``Engine`` until a request's first token is sampled, reads that sequence's K/V
  blocks out of its paged pool (every layer, in the order of the block table), and sends them with
  ``torch.distributed.send``; it then drops the request (its full blocks stay in its own prefix cache);
- the message: a header (request, prompt length, first token, blocks, checksum, status, then the prompt's token ids
  and the sender's block table) on a control channel, and K and V stacked in one tensor (2, n_layers, n_blocks,
  block_size, H_KV, D) on the data channel. The sender's block
  ids mean nothing to the receiver: the decode worker copies the blocks into *its own* free blocks (a new block
  table: ``install_blocks``) — its engine admits the request as it admits a swapped-out one (chapter 08a) and
  continues decoding from the first token;
- a transfer can fail (the sender says so: status "failed") or arrive damaged (the checksum of the K/V bytes
  differs): the decode worker then *recomputes* the prompt itself, so no request is lost and the tokens are the same;
- the receiver keeps decoding while it waits: it polls for the next header between its steps (on the process group's
  key-value store, a control channel that can be asked without blocking) and receives the blocks only then. That
  receive blocks the decode worker between two steps (a simplification: vLLM's NIXL connector reads the blocks
  asynchronously to the decode steps).

Shapes: a pool (num_blocks, block_size, H_KV, D) per layer; a transfer's K and V (n_layers, n_blocks, block_size,
H_KV, D). The worker functions run under ``kvlib.dist.launch.run`` (one process per rank, gloo on a CPU).
"""

from __future__ import annotations

import bisect
import time
import zlib

import torch
import torch.distributed as dist

from ..cache import check_int
from ..engine import Engine
from ..paged import PagedKVCache

__all__ = ["HEADER", "OK", "FAILED", "DAMAGES", "gather_blocks", "install_blocks", "checksum", "adopt", "send_request",
           "recv_request", "post_header", "poll_header", "disagg_worker", "itl_worker", "itl_trials_worker",
           "bench_worker", "WHY_FAILED", "WHY_DAMAGED", "check_spec", "load_model", "block_bytes", "MODELS"]

HEADER = ("kind", "request", "n_prompt", "first_token", "max_new", "n_blocks", "checksum", "status")
MORE, DONE = 1, 0  # header kind: a request follows / no more requests
OK, FAILED = 0, 1  # header status: blocks follow / the transfer failed, nothing follows
DAMAGES = ("corrupt", "fail")
MODELS = ("tiny", "smollm2-135m-instruct")  # the names ``load_model`` knows
WHY_FAILED, WHY_DAMAGED = "the sender reported a failed transfer", "checksum mismatch: the blocks arrived damaged"  # injected faults: K/V changed in transit after the checksum / a failed transfer


def load_model(name: str):
    """The model a worker loads by name: "tiny" or a name ``kvlib.model.load_pretrained`` knows."""
    from ..model import load_pretrained, load_tiny

    if name == "tiny":
        return load_tiny()[0]
    return load_pretrained(name)[0]


def block_bytes(model, block_size: int) -> int:
    """Bytes of one block's K and V across every layer: what one transferred block costs on the wire."""
    c = model.config
    return 2 * c.n_layers * block_size * c.n_kv_heads * c.head_dim * torch.finfo(model.dtype).bits // 8


def gather_blocks(cache: PagedKVCache, seq_id):
    """seq_id's blocks out of the pool, in block-table order: (table, K, V), K and V (n_layers, n_blocks,
    block_size, H_KV, D), copies (the pool can change after)."""
    table = list(cache.tables[cache._known(seq_id, "gather_blocks")])
    idx = torch.tensor(table, dtype=torch.long, device=cache.device)
    return table, torch.stack([k[idx] for k in cache.k]), torch.stack([v[idx] for v in cache.v])


def install_blocks(cache: PagedKVCache, seq_id, k, v, tokens) -> list[int]:
    """Register seq_id in ``cache`` holding received blocks: take len(blocks) of the receiver's own free blocks,
    copy block i of every layer into the i-th of them, and make them seq_id's block table (returned). ``tokens``:
    the token ids the blocks hold. All-or-nothing (an ``OutOfBlocksError`` changes nothing)."""
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError(f"k and v must be tensors, got {type(k).__name__} and {type(v).__name__}")
    want = (len(cache.k), -(-len(tokens) // cache.block_size)) + tuple(cache.k[0].shape[1:])
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"k and v must have shape (n_layers, n_blocks, block_size, H_KV, D) = {want} for "
                         f"{len(tokens)} tokens, got {tuple(k.shape)} and {tuple(v.shape)}")
    cache.swap_in(seq_id, [(k[layer], v[layer]) for layer in range(k.shape[0])], list(tokens))
    return list(cache.tables[seq_id])


def checksum(*tensors) -> int:
    """CRC-32 of the tensors' bytes, one after the other (zlib's; it catches any burst of changed bits up to 32
    long and almost every other change; it guards against damage, not against an attacker)."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return crc


def adopt(engine: Engine, prompt, first_token: int, max_new_tokens: int, k, v) -> int:
    """Hand a transferred request to the decode worker's engine: its prompt's K/V (``k``, ``v`` as received) and its
    first token. The engine admits it as it admits a swapped-out request (``install_blocks``'s ``swap_in``: into
    its own free blocks, when they fit) and decodes from there. Returns the engine's request id."""
    if max_new_tokens < 2:  # checked before the engine is touched
        raise ValueError("max_new_tokens must be >= 2 for a transferred request: the prefill worker made the first")
    rid = engine.add_request(prompt, max_new_tokens)  # the same checks as any request
    r = engine.requests[rid]
    engine.waiting.remove(r)
    r.output.append(int(first_token))
    r.computed, r.state = len(r.prompt), "swapped"
    r.host = [(k[layer], v[layer]) for layer in range(k.shape[0])]  # swap_in's format: per layer (k, v)
    r.first_token_step, r.first_token_time = engine.clock, time.perf_counter()
    bisect.insort(engine.swapped, r, key=lambda q: q.id)
    return rid


# --------------------------------------------------------------------------------------------
# The wire: a control channel for headers, torch.distributed for the data
# --------------------------------------------------------------------------------------------
# A decode worker must keep decoding while it waits for the next request, so it needs to *ask* whether a message is
# there without blocking. gloo's irecv cannot be polled (its is_completed() stays False until wait(), and a wait
# that times out breaks the connection), so headers go through the group's key-value store (launch.rank_store(), a TCPStore:
# ``check`` does not block), and the blocks through send/recv. Real connectors split the same way: NIXL exchanges
# metadata on a side channel and moves the bytes on its data plane; Mooncake keeps a metadata service.


def _store(channel: str = ""):
    from torch.distributed import PrefixStore

    from .launch import rank_store

    return PrefixStore("kvlib.disagg/" + channel, rank_store())


def post_header(seq: int, header, channel: str = "") -> None:
    """Put message ``seq``'s header (a list of ints, ``HEADER``'s fields) on the control channel (``channel``: a name
    that keeps one run's messages apart from another's in the same process group)."""
    _store(channel).set(str(seq), ",".join(str(int(x)) for x in header))


def poll_header(seq: int, channel: str = ""):
    """Message ``seq``'s header as an int64 tensor if it has arrived, else None (never blocks)."""
    store = _store(channel)
    if not store.check([str(seq)]):
        return None
    return torch.tensor([int(x) for x in store.get(str(seq)).decode().split(",")], dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# The wire: one request's message, and its receipt
# --------------------------------------------------------------------------------------------


def send_request(dst: int, seq: int, index: int, prompt, first_token: int, max_new: int, table, k, v,
                 damage=None, channel: str = "") -> dict:
    """Send one request's prefill to rank ``dst`` as message number ``seq``: the header on the control channel
    (``post_header``: the fields, the prompt, the sender's table), then K and V stacked in one tensor with
    ``torch.distributed.send``. ``damage``: None, "corrupt" (one value changed after the checksum was taken: damage
    in transit) or "fail" (the transfer fails: the header says so and no blocks follow).
    Returns {"bytes", "seconds", "n_blocks"} of what was sent."""
    if damage not in (None,) + DAMAGES:
        raise ValueError(f"damage must be None or one of {DAMAGES}, got {damage!r}")
    t0 = time.perf_counter()
    status = FAILED if damage == "fail" else OK
    header = [MORE, index, len(prompt), first_token, max_new, len(table), checksum(k, v), status]
    header += list(prompt) + (list(table) if status == OK else [])  # the receiver needs the prompt either way
    post_header(seq, header, channel)
    sent = 8 * len(header)
    if status == OK:
        kv = torch.stack([k, v])  # one message for both: every send is a hand-off between the two processes
        if damage == "corrupt":
            kv.view(-1)[0] += 1.0  # what a flipped bit on the way would do: the receiver's checksum differs
        dist.send(kv, dst)
        sent += kv.nbytes
    return {"bytes": sent, "seconds": time.perf_counter() - t0, "n_blocks": len(table)}


def recv_request(header, src: int, block_shape, dtype) -> dict:
    """The rest of a message whose ``header`` (int64 tensor: ``HEADER``'s fields, the prompt, and with status OK the
    sender's table) has arrived from ``src``: {"index", "prompt", "first_token", "max_new", "table" (the sender's),
    "k", "v", "ok" (status OK and checksum equal), "why"}."""
    ints = header.tolist()
    h = dict(zip(HEADER, ints))
    prompt = ints[len(HEADER): len(HEADER) + h["n_prompt"]]
    out = {"index": h["request"], "first_token": h["first_token"], "max_new": h["max_new"], "ok": False,
           "why": WHY_FAILED, "table": None, "k": None, "v": None, "prompt": prompt}
    if h["status"] != OK:
        return out
    n = h["n_blocks"]
    kv = torch.empty((2, block_shape[0], n) + tuple(block_shape[1:]), dtype=dtype)
    dist.recv(kv, src)
    good = checksum(kv[0], kv[1]) == h["checksum"]
    out.update(table=ints[len(HEADER) + h["n_prompt"]:], k=kv[0], v=kv[1], ok=good, why=None if good else WHY_DAMAGED)
    return out


def check_spec(spec: dict) -> dict:
    """The worker spec, checked in the parent before any process starts (clear errors naming the field): the model
    name, the engine's settings (a dict), each request (a dict: a non-empty list of int token ids >= 0, an int
    ``max_new``), the damage (a dict {request index: "corrupt" | "fail"}). A token id beyond the model's vocabulary
    is only caught by the engine inside the worker (the parent does not load the model)."""
    if not isinstance(spec, dict):
        raise TypeError(f"spec must be a dict, got {type(spec).__name__}")
    for key in ("model", "requests", "engine"):
        if key not in spec:
            raise ValueError(f"spec needs {key!r}")
    if spec["model"] not in MODELS:
        raise ValueError(f"spec['model'] must be one of {MODELS}, got {spec['model']!r}")
    if not isinstance(spec["engine"], dict):
        raise TypeError(f"spec['engine'] must be a dict of Engine settings, got {type(spec['engine']).__name__}")
    reqs = spec["requests"]
    if not isinstance(reqs, list) or not reqs:
        raise ValueError("spec['requests'] must be a non-empty list of {'prompt', 'max_new'} dicts")
    for i, r in enumerate(reqs):
        if not isinstance(r, dict):
            raise TypeError(f"spec['requests'][{i}] must be a dict with 'prompt' and 'max_new', got {type(r).__name__}")
        p = r.get("prompt")
        if not isinstance(p, list) or not p or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in p):
            raise TypeError(f"spec['requests'][{i}]['prompt'] must be a non-empty list of token ids (ints >= 0)")
        if isinstance(r.get("max_new"), bool):
            raise TypeError(f"spec['requests'][{i}]['max_new'] must be an int, got bool {r['max_new']!r}")
        check_int(f"spec['requests'][{i}]['max_new']", r.get("max_new"), minimum=2 if not r.get("local") else 1)
    damage = spec.get("damage", {})
    if not isinstance(damage, dict):
        raise TypeError(f"spec['damage'] must be a dict {{request index: one of {DAMAGES}}}, got {type(damage).__name__}")
    for i, how in damage.items():
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"spec['damage'] keys must be request indices (ints), got {i!r}")
        if how not in DAMAGES:
            raise ValueError(f"spec['damage'][{i}] must be one of {DAMAGES}, got {how!r}")
        if not 0 <= i < len(reqs):
            raise ValueError(f"spec['damage'] names request {i}, but there are {len(reqs)}")
    return spec


# --------------------------------------------------------------------------------------------
# The workers
# --------------------------------------------------------------------------------------------


def _step_and_record(engine, ids_back, out, now, received=0):
    """One engine step; each emitted token's wall time (``now()``), this process's CPU time (``time.process_time``:
    what the worker computed, gloo's receiving thread included, which a busy machine does not stretch), the step's
    prefill tokens and the blocks received since the previous step go into its request's record."""
    ev = engine.step()
    t, cpu = now(), time.process_time()
    for rid, toks in ev["emitted"].items():
        i = ids_back[rid]
        n = len(toks)
        out[i]["times"] += [t] * n
        out[i].setdefault("cpu", []).extend([cpu] * n)
        out[i].setdefault("step_prefill", []).extend([ev["prefill_tokens"]] * n)
        out[i].setdefault("received", []).extend([received] * n)
        out[i]["tokens"] += toks
    return ev


def disagg_worker(rank: int, world_size: int, spec: dict):
    """Rank 0 prefills and sends, rank 1 receives and decodes (``spec``: see ``check_spec``; ``spec["requests"]``:
    [{"prompt", "max_new", "arrival" (seconds after the start, default 0), "local" (True: a decode-only request
    that starts on rank 1 and is never transferred)}], ``spec["damage"]``: {request index: "corrupt" | "fail"}).

    Returns, rank 0: {"sent": {index: {"bytes", "seconds", "n_blocks", "table"}}}; rank 1: {"out": {index: {"tokens",
    "times", "how" ("transfer", "recompute" or "local"), "table" (the receiver's), "recv_s" (wall), "recv_cpu"
    (process CPU: receive, checksum, hand-over), "why"}}}. Times are ``time.perf_counter()``, one clock for every process on a machine (CLOCK_MONOTONIC on Linux)."""
    if world_size != 2:
        raise ValueError(f"disagg_worker runs on 2 ranks (prefill, decode), got world_size={world_size}")
    model = load_model(spec["model"])
    engine = Engine(model, **spec["engine"])
    reqs, damage, channel = spec["requests"], dict(spec.get("damage", {})), spec.get("channel", "")
    t0 = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(t0, 0)  # one start for both ranks
    start = float(t0)
    arrivals = sorted((r.get("arrival", 0.0), i) for i, r in enumerate(reqs) if bool(r.get("local")) == (rank == 1))
    out = {i: {"tokens": [], "times": [], "arrival": start + reqs[i].get("arrival", 0.0)} for _, i in arrivals}
    ids_back = {}
    if rank == 0:
        sent = {}
        while arrivals or engine.has_unfinished():
            while arrivals and time.perf_counter() - start >= arrivals[0][0]:
                _, i = arrivals.pop(0)
                ids_back[engine.add_request(reqs[i]["prompt"], reqs[i]["max_new"])] = i
            if not engine.has_unfinished():
                time.sleep(1e-4)
                continue
            ev = _step_and_record(engine, ids_back, out, time.perf_counter)
            for rid in ev["emitted"]:
                i = ids_back[rid]
                table, k, v = gather_blocks(engine.cache, rid)
                sent[i] = send_request(1, len(sent), i, reqs[i]["prompt"], out[i]["tokens"][0], reqs[i]["max_new"], table, k, v,
                                       damage.get(i), channel) | {"table": table, "first_time": out[i]["times"][0],
                                                         "arrival": out[i]["arrival"]}
                engine.abort(rid)  # its blocks go back; full ones stay in this worker's prefix cache
        post_header(len(sent), [DONE] + [0] * (len(HEADER) - 1), channel)
        return {"sent": sent}
    c = model.config
    block_shape = (c.n_layers, engine.config.block_size, c.n_kv_heads, c.head_dim)
    seq, receiving, received = 0, True, 0
    while receiving or arrivals or engine.has_unfinished():
        while arrivals and time.perf_counter() - start >= arrivals[0][0]:
            _, i = arrivals.pop(0)
            ids_back[engine.add_request(reqs[i]["prompt"], reqs[i]["max_new"])] = i
            out[i].update(how="local", table=None, recv_s=None, why=None)
        header = poll_header(seq, channel) if receiving else None
        if header is not None:
            seq += 1
            if int(header[0]) == DONE:
                receiving = False
            else:
                t, c0 = time.perf_counter(), time.process_time()
                msg = recv_request(header, 0, block_shape, model.dtype)
                received += len(msg["table"] or [])
                i = msg["index"]
                out[i] = {"tokens": [], "times": [], "recv_s": time.perf_counter() - t, "why": msg["why"], "table": None}
                if msg["ok"]:
                    rid = adopt(engine, msg["prompt"], msg["first_token"], msg["max_new"], msg["k"], msg["v"])
                    out[i]["how"] = "transfer"
                else:  # recompute: the whole prompt again on this worker; no request is lost
                    rid = engine.add_request(msg["prompt"], msg["max_new"])
                    out[i]["how"] = "recompute"
                ids_back[rid] = i
                out[i]["recv_cpu"] = time.process_time() - c0  # receive, checksum, handing it to the engine
        if engine.has_unfinished():
            ev = _step_and_record(engine, ids_back, out, time.perf_counter, received)
            received = 0
            for rid in ev["swapped_in"] + ev["admitted"]:  # the receiver's own block table
                if rid in engine.cache.tables:
                    out[ids_back[rid]]["table"] = list(engine.cache.tables[rid])
        else:
            time.sleep(1e-4)
    for rid, i in ids_back.items():  # an adopted request's first token came from rank 0
        if out[i].get("how") == "transfer":
            out[i]["tokens"] = engine.requests[rid].output
    return {"out": out}


def itl_worker(rank: int, world_size: int, spec: dict):
    """One rank of the inter-token-latency experiment. ``spec["mode"]``: "disaggregated" runs ``disagg_worker``;
    "colocated": every rank serves its own share of the requests (request i on rank i % world_size: the same two
    cores, each running prefill chunks and decodes in the same steps). Returns {"out": {index: {"tokens", "times",
    "arrival"}}} (and rank 0's "sent" when disaggregated)."""
    if spec.get("mode") == "disaggregated":
        return disagg_worker(rank, world_size, spec)
    if spec.get("mode") != "colocated":
        raise ValueError(f"spec['mode'] must be 'colocated' or 'disaggregated', got {spec.get('mode')!r}")
    model = load_model(spec["model"])
    engine = Engine(model, **spec["engine"])
    reqs = spec["requests"]
    t0 = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(t0, 0)
    start = float(t0)
    arrivals = sorted((r.get("arrival", 0.0), i) for i, r in enumerate(reqs) if i % world_size == rank)
    out = {i: {"tokens": [], "times": [], "arrival": start + reqs[i].get("arrival", 0.0)} for _, i in arrivals}
    ids_back = {}
    while arrivals or engine.has_unfinished():
        while arrivals and time.perf_counter() - start >= arrivals[0][0]:
            _, i = arrivals.pop(0)
            ids_back[engine.add_request(reqs[i]["prompt"], reqs[i]["max_new"])] = i
        if engine.has_unfinished():
            _step_and_record(engine, ids_back, out, time.perf_counter)
        else:
            time.sleep(1e-4)
    return {"out": out}


def itl_trials_worker(rank: int, world_size: int, spec: dict):
    """Several ``itl_worker`` runs in one launch (no process start between them): ``spec["trials"]``, a list of
    ``itl_worker`` specs (modes interleaved by the caller), run in order, the ranks meeting at a barrier before each;
    each trial's headers on a channel of its own. Returns this rank's results, one per trial."""
    results = []
    for t, sub in enumerate(spec["trials"]):
        dist.barrier()
        results.append(itl_worker(rank, world_size, dict(sub, channel=f"trial{t}/")))
    return results


def bench_worker(rank: int, world_size: int, spec: dict):
    """Time the wire alone: ``spec["repeats"]`` rounds; in each, for every n in ``spec["blocks"]`` (the sizes
    interleaved, so a busy moment of the machine falls on all of them), both ranks meet at a barrier, then rank 0
    sends K and V of n blocks stacked in one tensor, as ``send_request`` does (every layer of ``spec["model"]``'s
    shape), and rank 1 receives it. Returns, rank 1: {n: (bytes, [seconds per repeat, as rank 1 waited for them])};
    rank 0: None."""
    model = load_model(spec["model"])
    c, bs = model.config, check_int("block_size", spec["block_size"])
    sizes = [check_int("blocks entry", n) for n in spec["blocks"]]
    kvs = {n: torch.randn(2, c.n_layers, n, bs, c.n_kv_heads, c.head_dim, dtype=model.dtype) for n in sizes}
    times = {n: (kvs[n].nbytes, []) for n in sizes}
    for _ in range(check_int("repeats", spec["repeats"])):
        for n in sizes:
            dist.barrier()
            t = time.perf_counter()
            dist.send(kvs[n], 1) if rank == 0 else dist.recv(kvs[n], 0)
            times[n][1].append(time.perf_counter() - t)
    return times if rank == 1 else None
