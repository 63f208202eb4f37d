"""Chapter 10's diagram, drawn from a live ``kvlib.serve.Server``: who holds a request, and a token's way out.

A server is three kinds of thread around one engine: the HTTP event loop (one handler per open request),
the tokenizer pool (parses and encodes bodies), and **one engine thread** that owns the ``Engine``. They talk
through two kinds of queue: the handlers put commands (``add``, ``abort``) on one thread-safe ``queue.Queue``
that the engine thread empties between steps; after each step the engine thread puts each request's new
tokens on that request's own ``asyncio.Queue``, through ``loop.call_soon_threadsafe``.

- ``paused(server)``: holds the engine thread at the start of its next step, so that what a drawing reads
  is one moment (commands sent meanwhile wait in the queue, as they would during a long step);
- ``state(server)``: that moment as plain data (the threads, the queued commands, each handle's request
  id, tokens delivered and messages waiting, the engine's running / waiting / swapped requests, the last
  step's tokens);
- ``server(state_or_server)``: the picture. Every drawn item is a patch with a gid, so a test counts what
  the figure shows and compares it with the server: ``"handler"`` and ``"client"`` (one each per request the
  server holds: added, or still in the command queue), ``"message"`` (one per message waiting in a handle's queue),
  ``"command"`` (one per command in the engine's queue), ``"running"`` / ``"waiting"`` / ``"swapped"`` (one
  per engine request in that state), ``"thread"`` (the engine thread, the event loop, each tokenizer
  thread), and ``"path"`` (the five stations of a token's way, drawn when the last step emitted a token).
"""

from __future__ import annotations

import contextlib
import json
import threading

from . import COLORS, label, new_figure

__all__ = ["paused", "state", "server", "PATH_STATIONS"]

PATH_STATIONS = ("engine.step()", "call_soon_threadsafe", "asyncio.Queue", "TextStream.add", "SSE event")


@contextlib.contextmanager
def paused(srv, timeout: float = 60.0):
    """Hold ``srv``'s engine thread at the start of its next step until the block ends.

    While anything is unfinished the engine thread steps without a pause, so this waits (at most ``timeout``
    seconds) until it reaches the next step and parks it there; an idle engine (nothing to run) is left asleep
    on its command queue, which is a pause too. The step is the server's own: the block only delays it."""
    engine, loop = srv.engine, srv.loop
    if loop is None or not loop.thread.is_alive():
        raise RuntimeError("the server is not running: start it first (Server.start() or a with block)")
    real = engine.step
    gate, parked = threading.Event(), threading.Event()

    def step():
        if threading.current_thread() is loop.thread and not gate.is_set():
            parked.set()
            gate.wait()
        return real()

    engine.step = step  # an instance attribute over the class's method, removed when the block ends
    try:
        if engine.has_unfinished() and not parked.wait(timeout):
            raise RuntimeError(f"the engine thread did not reach a step within {timeout:g} s")
        yield srv
    finally:
        with contextlib.suppress(AttributeError):
            del engine.step
        gate.set()


def state(srv) -> dict:
    """One moment of ``srv`` as plain data (read it inside ``paused(srv)`` for a consistent picture)."""
    loop, engine = srv.loop, srv.engine
    with loop.commands.mutex:
        commands = [(cmd[0], getattr(cmd[1], "rid", None) if len(cmd) > 1 else None) for cmd in loop.commands.queue]
    handles = {rid: dict(n_out=h.n_out, admitted=h.admitted, pending=h.queue.qsize())
               for rid, h in list(loop.live.items())}
    reqs = {r.id: dict(state=r.state, out=len(r.output), prompt=len(r.prompt),
                       blocks=len(engine.cache.tables.get(r.id, ())))
            for r in engine.running + engine.waiting + engine.swapped}
    last = engine.events[-1] if engine.events else None
    pool = srv._pool
    return dict(
        model=srv.model_name,
        threads={"engine": loop.thread.is_alive(), "http": srv._thread is not None and srv._thread.is_alive(),
                 "tokenizer": 0 if pool is None else pool._max_workers},
        commands=commands, handles=handles,
        running=[r.id for r in engine.running], waiting=[r.id for r in engine.waiting],
        swapped=[r.id for r in engine.swapped], requests=reqs,
        blocks=(engine.config.num_blocks, engine.cache.allocator.num_free),
        max_num_seqs=engine.config.max_num_seqs,
        last_step=None if last is None else dict(step=last["step"], wall_s=last.get("wall_s"),
                                                 emitted={k: list(v) for k, v in last["emitted"].items()}),
        decode=srv.tokenizer.decode,
    )


def _box(ax, x, y, w, h, face, gid, *, edge="0.35", lw=0.8, text=None, fontsize=7.5, color=None):
    from matplotlib.patches import FancyBboxPatch

    p = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.06", facecolor=face, edgecolor=edge,
                       linewidth=lw, gid=gid)
    ax.add_patch(p)
    if text is not None:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
                color=color or COLORS["text"])
    return p


def _cell(ax, x, y, size, face, gid, text=None):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), size, size, facecolor=face, edgecolor="white", linewidth=1.0, gid=gid))
    if text:
        ax.text(x + size / 2, y + size / 2, text, ha="center", va="center", fontsize=6, color="white")


def _arrow(ax, x0, y0, x1, y1, text=None, color="0.3", **kw):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", color=color, lw=1.0, **kw))
    if text:
        label(ax, (x0 + x1) / 2, (y0 + y1) / 2 + 0.13, text, ha="center", fontsize=6.5, color=color)


def _piece(decode, ids) -> str:
    text = decode(list(ids))
    return text if len(text) <= 14 else text[:13] + "…"


def server(s, *, title: str | None = None):
    """The picture of one moment: ``s`` is ``state(server)``'s dict, or a live Server (read at once)."""
    st = s if isinstance(s, dict) else state(s)
    adds = [c for c in st["commands"] if c[0] == "add"]
    leaving = {rid for kind, rid in st["commands"] if kind == "abort"}
    rows = sorted(st["handles"]) + [None] * len(adds)  # a request still in the command queue has no engine id yet
    n = max(len(rows), 1)
    row_h = 0.5
    height = 1.6 + n * row_h + 2.0
    fig, ax = new_figure(13.0, height, title=title or (
        f"kvlib.serve ({st['model']}) at one moment: {len(st['running'])} running, {len(st['waiting'])} waiting, "
        f"{len(st['commands'])} command(s) queued; {st['blocks'][0] - st['blocks'][1]} of {st['blocks'][0]} KV blocks "
        "in use"))
    y0 = height - 0.5
    # the threads and the command queue between them
    label(ax, 0.15, y0, "HTTP clients", fontsize=9, weight="bold")
    _box(ax, 2.0, y0 - 0.2, 3.0, 0.38, "#dfe8f5", "thread", text="event loop thread: a handler per request")
    _box(ax, 8.2, y0 - 0.2, 4.6, 0.38, "#e8e2f3", "thread",
         text=f"engine thread: Engine (max_num_seqs {st['max_num_seqs']})")
    label(ax, 5.3, y0 + 0.05, "commands (queue.Queue), applied", fontsize=7)
    label(ax, 5.3, y0 - 0.13, "between two steps:" + ("" if st["commands"] else " none"), fontsize=7)
    for j, (kind, rid) in enumerate(st["commands"]):
        cx, cy = 5.3 + (j % 5) * 0.56, y0 - 0.62 - (j // 5) * 0.34
        _box(ax, cx, cy, 0.5, 0.28, COLORS["key"], "command", text=kind if rid is None else f"{kind} {rid}",
             fontsize=6, color="white")
    _arrow(ax, 5.0, y0 - 0.48, 5.28, y0 - 0.48, color="0.4")
    _arrow(ax, 5.3 + min(len(st["commands"]), 5) * 0.56, y0 - 0.48, 8.2, y0 - 0.48, text="applied", color="0.4")
    for i in range(st["threads"]["tokenizer"]):
        _box(ax, 0.15 + i * 1.1, 0.15, 1.0, 0.3, "#f7efe0", "thread", text=f"tokenizer {i}", fontsize=6.5)
    if st["threads"]["tokenizer"]:
        label(ax, 0.15 + st["threads"]["tokenizer"] * 1.1, 0.3, "worker threads: parse the JSON body, apply the chat "
              "template, encode the prompt (off the event loop)", fontsize=6.5)
    # one row per request: client, handler (with its waiting messages), engine state
    where = {rid: ("running" if rid in st["running"] else "waiting" if rid in st["waiting"] else
                   "swapped" if rid in st["swapped"] else None) for rid in st["handles"]}
    top = y0 - 0.65 - (max(len(st["commands"]) - 1, 0) // 5) * 0.34
    for k, rid in enumerate(rows):
        y = top - 0.6 - k * row_h
        h = st["handles"].get(rid)
        who = "new client" if rid is None else "client (hung up)" if rid in leaving else "client"
        _box(ax, 0.15, y, 1.45, 0.34, "white", "client", text=who, fontsize=7)
        what = f"request {rid}: {h['n_out']} tokens delivered" if rid is not None else "request: not added yet"
        _box(ax, 2.0, y, 2.5, 0.34, "#dfe8f5", "handler", text=what, fontsize=7)
        _arrow(ax, 2.0, y + 0.17, 1.6, y + 0.17, color=COLORS["query"])  # SSE events out
        for j in range(h["pending"] if h else 0):
            _cell(ax, 4.6 + j * 0.2, y + 0.08, 0.18, COLORS["new"], "message")
        kind = where.get(rid)
        if kind is None:
            continue
        r = st["requests"][rid]
        face = {"running": COLORS["filled"], "waiting": COLORS["masked"], "swapped": COLORS["key"]}[kind]
        _box(ax, 8.2, y, 4.6, 0.34, face, kind, color="white" if kind != "waiting" else COLORS["text"],
             text=f"request {rid} {kind}: prompt {r['prompt']}, output {r['out']}, {r['blocks']} block(s)", fontsize=7)
        _arrow(ax, 8.2, y + 0.17, 4.6 + 0.2 * h["pending"] + 0.05, y + 0.17, color=COLORS["new"])
    label(ax, 4.7, top - 0.14, "new tokens: loop.call_soon_threadsafe -> the handler's asyncio.Queue",
          fontsize=6.5, color=COLORS["new"])
    # a token's way, from the last step
    last = st["last_step"]
    if last and last["emitted"]:
        rid, ids = max(last["emitted"].items(), key=lambda kv: (kv[0] in st["handles"], kv[0]))
        piece = _piece(st["decode"], ids)
        event = json.dumps({"choices": [{"delta": {"content": piece}}]}, ensure_ascii=False)
        texts = [f"step {last['step']}: token {ids[-1]}\nfor request {rid}", "h.post(\"tokens\", ids)",
                 "the handler's queue", f"-> {piece!r}", f"data: {event[:22]}…"]
        yb = 0.75
        label(ax, 0.15, yb + 0.8, "a token's way out (the last step):", fontsize=8, weight="bold")
        for i, (station, text) in enumerate(zip(PATH_STATIONS, texts)):
            x = 0.15 + i * 2.55
            _box(ax, x, yb, 2.2, 0.55, "#fff6d8", "path", text=f"{station}\n{text}", fontsize=6.5)
            if i:
                _arrow(ax, x - 0.35, yb + 0.27, x, yb + 0.27)
    return fig
