"""Chapter 10's harness: the clients, timings, load trials, tables and plots the HTTP-serving notebook calls.

The notebook keeps what it teaches (the engine loop's source, the raw SSE bytes, the openai client, the bad
requests); what it measures with is here:
- ``StreamClient`` / ``moment``: streamed chats in threads against an in-process ``kvlib.serve.Server``, and one
  moment of that server (engine paused between two steps, a new request and a hang-up queued) for the picture;
- ``stream_chat``: one streamed chat through the official ``openai`` client, with each piece's arrival time;
- ``step_vs_gap`` / ``time_table``: the engine step timed inside the server against the gap the client sees
  between two tokens, token by token, beside a bare forward (``generate``) and the detokenizer's cost;
- ``leave_early``: a client that hangs up mid-answer, and how fast its blocks come back;
- ``big_prompt``: a prompt of megabytes sent while another client streams, and the stream's gaps meanwhile;
- ``load_trials``: GuideLLM runs (one per server, each rate repeated ``trials`` times) with the machine's load
  average (``os.getloadavg``) before and after each; ``attainment_table``, ``ratio_table``, ``plot_trials``;
- ``plot_watch`` / ``metrics_table``: what ``/metrics`` showed during the load;
- ``same_answers``: whether the two servers gave the same greedy text to the same prompts;
- ``summary``: what the chapter measured, as one table;
- lab 10: ``LabServerBase`` (kvlib.serve with the learner's streaming loop), ``lab_leave_early``, and its decision:
  ``VERDICT_RULE`` (the rule the chapter applies), ``verdict`` and ``check_verdicts``.

Nothing here prints a verdict sentence: the tables carry a column saying whether the trials separate, and the
notebook's markdown says what each outcome means.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

import numpy as np

from ..stats import wilson

__all__ = ["StreamClient", "moment", "stream_chat", "step_vs_gap", "forward_ms", "detok_us", "time_table",
           "median_interval", "leave_early", "big_prompt", "loadavg", "load_trials", "attainment_table", "ratio_table",
           "separation", "plot_trials", "plot_watch", "metrics_table", "same_answers", "summary", "GOAL",
           "VERDICT_RULE", "verdict", "check_verdicts", "LabServerBase", "lab_leave_early"]

GOAL = 0.9  # the share of requests that must meet both latency targets (p90 targets: 9 requests in 10)


def loadavg() -> float:
    """The machine's 1-minute load average (runnable processes, averaged): how busy the CPUs were."""
    return os.getloadavg()[0]


# --------------------------------------------------------------------------------------------
# Section 1: clients in threads, and one moment of a live server
# --------------------------------------------------------------------------------------------


class StreamClient(threading.Thread):
    """One streamed chat request (httpx, in a thread): ``pieces`` [(seconds since the send, text, token ids)].
    ``hang_up()`` closes the connection at the next event, as a closed browser tab does."""

    def __init__(self, url: str, model: str, content: str, max_tokens: int = 64, chat: bool = True):
        super().__init__(daemon=True)
        self.body = dict(model=model, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True,
                         return_token_ids=True)
        self.body.update({"messages": [{"role": "user", "content": content}]} if chat else {"prompt": content})
        self.path = "/chat/completions" if chat else "/completions"
        self.url, self.pieces, self.error, self.done = url, [], None, False
        self._leave, self._sock = threading.Event(), None

    def run(self):
        import httpx

        self.t0 = t0 = time.perf_counter()
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=120) as r:
                if r.status_code != 200:
                    self.error = RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                    return
                self._sock = r.extensions["network_stream"].get_extra_info("socket")
                if self._leave.is_set():
                    return
                for line in r.iter_lines():
                    if self._leave.is_set():
                        return  # leaving the with block closes the connection
                    if line.startswith("data: {"):
                        c = json.loads(line[6:])["choices"][0]
                        text = c["delta"].get("content") if "delta" in c else c.get("text")
                        self.pieces.append((time.perf_counter() - t0, text or "", c.get("token_ids") or []))
        except Exception as err:  # noqa: BLE001 - kept for the caller to show
            if not self._leave.is_set():  # (a hang-up ends the read with an error: that one is ours)
                self.error = err
        finally:
            self.done = True

    @property
    def tokens(self) -> int:
        return sum(len(ids) for _, _, ids in self.pieces)

    def hang_up(self):
        """Leave now: shut the connection's socket, even while the thread waits for the next event."""
        self._leave.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout:g} s for {what}")
        time.sleep(0.02)


def moment(srv, questions, *, max_tokens: int = 64, first_tokens: int = 3, chat: bool = True,
           timeout: float = 120.0):
    """Stream one chat per question from ``srv`` (more questions than its ``max_num_seqs``, so some wait), wait until
    a client has ``first_tokens`` tokens and every request is in the engine, pause the engine
    (``draw.serve.paused``), send one more request and hang up that client, wait until the add and the abort are
    queued, and return ``draw.serve.state`` read then. Every client has hung up when it returns."""
    from .draw import serve as draw_serve

    clients = [StreamClient(srv.url, srv.model_name, q, max_tokens, chat) for q in questions]
    for c in clients:
        c.start()
    try:
        _wait(lambda: any(c.tokens >= first_tokens or c.done for c in clients), timeout, "a client's first tokens")
        talking = next(c for c in clients if c.tokens >= first_tokens or c.done)
        if talking.error is not None or talking.tokens < first_tokens:
            raise RuntimeError(f"a client got no answer: {talking.error}")
        _wait(lambda: len(srv.loop.live) >= len(questions), timeout, "every request to reach the engine")
        with draw_serve.paused(srv, timeout):
            late = StreamClient(srv.url, srv.model_name, "And one more question, please.", max_tokens, chat)
            late.start()
            clients.append(late)
            talking.hang_up()
            kinds = lambda: [c[0] for c in list(srv.loop.commands.queue)]  # noqa: E731
            _wait(lambda: "add" in kinds() and "abort" in kinds(), timeout, "the add and the abort to be queued")
            return draw_serve.state(srv)
    finally:
        for c in clients:
            c.hang_up()
        for c in clients:
            c.join(timeout)


# --------------------------------------------------------------------------------------------
# Section 2: one answer, and where the time between two tokens goes
# --------------------------------------------------------------------------------------------


def stream_chat(client, model: str, messages, max_tokens: int):
    """One greedy streamed chat through the openai client: dict(ids, pieces, stamps (s since the send), finish,
    usage). The text is printed as it arrives."""
    ids, pieces, stamps, finish, usage = [], [], [], None, None
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
    for chunk in stream:
        if not chunk.choices:  # the last chunk: usage only
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        ids += (choice.model_extra or {}).get("token_ids") or []  # fields beyond OpenAI's are in model_extra
        if choice.delta.content:
            pieces.append(choice.delta.content)
            stamps.append(time.perf_counter() - t0)
            print(choice.delta.content, end="", flush=True)
        finish = choice.finish_reason or finish
    print()
    return dict(ids=ids, pieces=pieces, stamps=stamps, finish=finish, usage=usage)


def step_vs_gap(srv, content: str, n_tokens: int = 32, chat: bool = True, timeout: float = 120.0):
    """One streamed chat of ``n_tokens`` (end-of-text ignored), alone on the in-process server ``srv``, timed at
    both ends: per token after the first, the engine step that computed it (``wall_s`` of the engine's event, read
    from the live engine) and the gap the client saw since the previous token. A pandas DataFrame, one row per
    token: ``step_ms``, ``gap_ms``, ``overhead_ms`` (= gap - step: the engine loop, the hop to the event loop, the
    detokenizer, the SSE event and the client's read)."""
    import pandas as pd

    engine = srv.engine
    if engine.has_unfinished():
        raise RuntimeError("step_vs_gap needs the server to itself: requests are still running")
    first = engine.clock
    c = StreamClient(srv.url, srv.model_name, content, n_tokens, chat)
    c.start()
    c.join(timeout)
    if c.error is not None or c.tokens != n_tokens:
        raise RuntimeError(f"the timed request did not complete: {c.error or f'{c.tokens} tokens'}")
    steps = [ev for ev in list(engine.events) if ev["step"] >= first and ev["emitted"]]
    if len(steps) != n_tokens or any(len(ev["emitted"]) != 1 for ev in steps):
        raise RuntimeError(f"expected {n_tokens} steps emitting one request's token each, got {len(steps)}")
    arrivals = [t for t, _, ids in c.pieces if ids]  # one event per step that emitted a token
    gaps = np.diff(arrivals) * 1000
    step_ms = np.array([ev["wall_s"] for ev in steps[1:]]) * 1000  # the decode steps (the first was the prefill)
    return pd.DataFrame({"step_ms": step_ms, "gap_ms": gaps, "overhead_ms": gaps - step_ms})


def forward_ms(model, prompt_ids, n_tokens: int = 8, runs: int = 5):
    """Milliseconds per decode step of ``generate`` alone (chapter 03's cached loop, no engine, no server), once per
    run: (time for n_tokens - time for 1) / (n_tokens - 1). A numpy array of ``runs`` values, so that the table can
    show their spread beside the server's steps."""
    from ..generate import generate

    def timed(n):
        t0 = time.perf_counter()
        generate(model, [prompt_ids], n)
        return time.perf_counter() - t0

    out = []
    for _ in range(runs):
        t1 = timed(1)
        out.append(1000 * (timed(n_tokens) - t1) / (n_tokens - 1))
    return np.array(out)


def detok_us(tokenizer, ids, repeat: int = 20) -> float:
    """Microseconds per token that ``kvlib.serve.TextStream`` takes to turn ``ids`` into text, one token at a time
    (it decodes the whole output each time: the cost grows with the answer's length)."""
    from ..serve import TextStream

    t0 = time.perf_counter()
    for _ in range(repeat):
        stream = TextStream(tokenizer)
        for t in ids:
            stream.add([t])
    return 1e6 * (time.perf_counter() - t0) / (repeat * len(ids))


def median_interval(x, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the median of ``x`` and a bootstrap interval for it (resampling the values)."""
    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(x, size=(n_boot, len(x)), replace=True), axis=1)
    a = (1 - level) / 2
    return float(np.median(x)), float(np.quantile(meds, a)), float(np.quantile(meds, 1 - a))


def time_table(timed, forward):
    """Where the time between two tokens goes: one row per stage, median with the 10th-90th percentile range.
    ``timed``: ``step_vs_gap``'s frame; ``forward``: ms per step of ``generate``, one value per run (``forward_ms``)."""
    import pandas as pd

    f = np.atleast_1d(np.asarray(forward, dtype=float))
    rows = [(f"a decode step of generate() alone (chapter 03), {len(f)} runs", float(np.median(f)),
             float(np.quantile(f, 0.1)), float(np.quantile(f, 0.9)))]
    for col, what in (("step_ms", "the engine's step, timed inside the server"),
                      ("gap_ms", "the gap between two tokens at the client"),
                      ("overhead_ms", "gap - step, token by token")):
        v = timed[col]
        rows.append((what, float(v.median()), float(v.quantile(0.1)), float(v.quantile(0.9))))
    return pd.DataFrame(rows, columns=["stage", "median ms", "p10 ms", "p90 ms"]).set_index("stage")


# --------------------------------------------------------------------------------------------
# Section 3: a client that leaves
# --------------------------------------------------------------------------------------------


def leave_early(base: str, url: str, model: str, messages, max_tokens: int = 256, read: int = 10,
                timeout: float = 10.0) -> dict:
    """Stream a long answer, read ``read`` events, hang up; poll ``/metrics`` until the request's blocks are back.
    Returns the blocks held while it streamed, the ms until they were free (None if not within ``timeout``),
    the pool's state then, and how many requests the server ended by ``abort`` meanwhile."""
    import httpx

    from ..bench import load

    abort = 'kvlib_requests_finished_total{finish_reason="abort"}'
    before = load.scrape_metrics(base)
    body = dict(model=model, messages=messages, max_tokens=max_tokens, ignore_eos=True, temperature=0, stream=True)
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=60) as r:
        for _ in zip(range(read), (line for line in r.iter_lines() if line)):
            pass
        during = load.scrape_metrics(base)
    t_closed = time.perf_counter()  # leaving the with block closed the connection
    freed_ms = None
    while time.perf_counter() - t_closed < timeout:
        after = load.scrape_metrics(base)
        if after["kvlib_kv_blocks_used"] == 0 and after["kvlib_num_requests_running"] == 0:
            freed_ms = 1000 * (time.perf_counter() - t_closed)
            break
        time.sleep(0.02)
    return dict(held=int(during["kvlib_kv_blocks_used"]), total=int(during["kvlib_kv_blocks_total"]),
                freed_ms=freed_ms, used_after=int(after["kvlib_kv_blocks_used"]),
                cached_after=int(after["kvlib_kv_blocks_cached"]), aborted=int(after[abort] - before.get(abort, 0)))


def big_prompt(srv, megabytes: float = 10.0, before: int = 30, after: int = 30, timeout: float = 120.0) -> dict:
    """A client streams a completion from the in-process server ``srv`` (end-of-text ignored); once it has
    ``before`` tokens, another sends a prompt of about ``megabytes`` MB to ``/v1/completions`` and waits for the
    answer; the stream goes on for ``after`` more tokens. Returns the big request's size, status, error code and
    time to answer, the stream's median gap between two tokens before the send (``typical_ms``), and the
    largest gap of those that overlap the send, from the request to its answer (``largest_ms``, over ``overlapping``
    gaps)."""
    import httpx

    text = "cache the keys " * max(1, int(megabytes * 1e6 / 15))
    raw = json.dumps(dict(model=srv.model_name, prompt=text, max_tokens=4)).encode()
    c = StreamClient(srv.url, srv.model_name, "def f(x):", before + after + 2, chat=False)
    c.start()
    try:
        _wait(lambda: c.tokens >= before or c.done, timeout, "the stream's first tokens")
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=timeout)
        t1 = time.perf_counter()
        n = c.tokens
        _wait(lambda: c.tokens >= n + after or c.done, timeout, "the stream's tokens after the send")
    finally:
        c.hang_up()
        c.join(timeout)
    if c.error is not None:
        raise RuntimeError(f"the stream failed: {c.error}")
    stamps = np.array([c.t0 + t for t, _, ids in list(c.pieces) if ids])
    starts, ends = stamps[:-1], stamps[1:]
    gaps = 1000 * (ends - starts)
    overlap = (ends > t0) & (starts < t1)
    err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
    return dict(mb=len(raw) / 1e6, status=r.status_code, code=err.get("code"), answer_ms=1000 * (t1 - t0),
                typical_ms=float(np.median(gaps[ends <= t0])), largest_ms=float(gaps[overlap].max()),
                overlapping=int(overlap.sum()))


# --------------------------------------------------------------------------------------------
# Sections 4 and 6: load trials with GuideLLM
# --------------------------------------------------------------------------------------------


def load_trials(server, model_name: str, tokenizer_dir, out_dir, *, rates, requests, watch: bool = False, **load_kw):
    """One GuideLLM run against ``server`` over the schedule ``rates`` (a rate may repeat: each repeat is one more
    trial of it), ``requests[i]`` requests at ``rates[i]``. GuideLLM seeds every benchmark's Poisson clock alike, so
    the trials of a rate replay the same arrival times with new prompts: their spread is the server's and the
    machine's, not the luck of the arrivals. A run in which GuideLLM sent a burst is rerun (twice at most).

    Returns (report, frame, watch frame or None): the frame has ``load.summarize``'s columns plus ``trial`` (1, 2, ...
    per rate) and the machine's 1-minute load average before and after the run (``load_before``, ``load_after``)."""
    from ..bench import load

    for attempt in range(3):
        before = loadavg()
        with (load.MetricsWatcher(server.base, period=0.5) if watch else contextlib.nullcontext()) as w:
            report = load.run_guidellm(server.base, model_name, tokenizer_dir, out_dir=f"{out_dir}-{attempt}",
                                       rates=list(rates), max_requests=list(requests), **load_kw)
        after = loadavg()
        if not report["_bursts"]:
            break
    df = load.summarize(report)
    df.insert(0, "trial", df.groupby("target").cumcount() + 1)
    df["load_before"], df["load_after"], df["attempts"] = before, after, attempt + 1
    return report, df, (w.frame() if watch else None)


def _met(row) -> tuple[int, int]:
    """(requests that met both targets, requests sent) of one GuideLLM benchmark; errored ones count as misses."""
    n = int(row["ok"] + row["errored"])
    return round(row["slo_attainment_pct"] / 100 * row["ok"]), n


def attainment_table(frames: dict):
    """Per server and rate: attainment in each trial, pooled over the trials with its 95% Wilson interval, the
    p90 TTFT / ITL range over the trials, the load average around the run, and whether the target breaks there
    (``breaks``: the whole interval lies below GOAL; ``holds``: the whole interval lies above it)."""
    import pandas as pd

    rows = []
    for name, df in frames.items():
        for rate, g in df.groupby("target", sort=True):
            met = [_met(r) for _, r in g.iterrows()]
            k, n = sum(m for m, _ in met), sum(t for _, t in met)
            lo, hi = wilson(k, n)
            rows.append({"server": name, "req/s": rate,
                         "attainment % per trial": " / ".join(f"{100 * m / t:.0f}" for m, t in met),
                         "met / sent": f"{k} / {n}", "pooled %": 100 * k / n,
                         "95% low %": 100 * lo, "95% high %": 100 * hi,
                         "TTFT p90 ms (min-max)": f"{g['ttft_p90_ms'].min():.0f}-{g['ttft_p90_ms'].max():.0f}",
                         "ITL p90 ms (min-max)": f"{g['itl_p90_ms'].min():.0f}-{g['itl_p90_ms'].max():.0f}",
                         "load avg before-after": f"{g['load_before'].iloc[0]:.1f}-{g['load_after'].iloc[0]:.1f}",
                         f"target ({GOAL:.0%} of requests)": ("breaks" if hi < GOAL else "holds" if lo >= GOAL
                                                              else "cannot tell")})
    return pd.DataFrame(rows).set_index(["server", "req/s"])


def separation(a, b, lower_is_better: bool) -> str:
    """Which of two sets of trials is better, only when their ranges do not overlap: "first", "second" or "overlap"."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if lower_is_better:
        a, b = -a, -b
    if a.min() > b.max():
        return "first"
    if b.min() > a.max():
        return "second"
    return "overlap"


RATIO_METRICS = (("out_tok_per_s", "output tokens/s", False), ("ttft_p50_ms", "TTFT p50 ms", True),
                 ("ttft_p90_ms", "TTFT p90 ms", True), ("itl_p50_ms", "ITL p50 ms", True),
                 ("itl_p90_ms", "ITL p90 ms", True))


def ratio_table(ours, theirs, names=("kvlib", "transformers")):
    """Per rate and metric: each server's trials (min-max), the per-trial ratio in kvlib's favour (>1: kvlib ahead;
    trial i of one server against trial i of the other), and which server is ahead where the trials separate."""
    import pandas as pd

    rows = []
    for rate in sorted(set(ours["target"])):
        a, b = ours[ours["target"] == rate].sort_values("trial"), theirs[theirs["target"] == rate].sort_values("trial")
        for col, what, lower in RATIO_METRICS:
            x, y = a[col].to_numpy(), b[col].to_numpy()
            ratio = (y / x) if lower else (x / y)
            side = separation(x, y, lower) if len(x) >= 3 and len(y) >= 3 else "few"
            rows.append({"req/s": rate, "metric": what, f"{names[0]} (min-max)": f"{x.min():.1f}-{x.max():.1f}",
                         f"{names[1]} (min-max)": f"{y.min():.1f}-{y.max():.1f}",
                         "ratio, kvlib's favour (min-max)": f"{ratio.min():.2f}-{ratio.max():.2f}",
                         "trials": len(x),
                         "ahead": {"first": names[0], "second": names[1], "overlap": "no verdict: overlap",
                                   "few": "no verdict: under 3 trials"}[side]})
    return pd.DataFrame(rows).set_index(["req/s", "metric"])


def plot_trials(frames: dict, slo_ttft_ms: float, slo_itl_ms: float, title: str):
    """Three panels against the offered rate: output tokens/s, TTFT p90 and ITL p90, every trial a dot (one colour
    per server) and the median of the trials a line; the targets in red."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = (("out_tok_per_s", "output tokens / s", None), ("ttft_p90_ms", "TTFT p90 (ms)", slo_ttft_ms),
              ("itl_p90_ms", "ITL p90 (ms)", slo_itl_ms))
    for (name, df), color in zip(frames.items(), ("tab:blue", "tab:orange")):
        med = df.groupby("target").median(numeric_only=True)
        for ax, (col, ylabel, target) in zip(axes, panels):
            ax.plot(df["target"], df[col], "o", color=color, alpha=0.5, ms=4)
            ax.plot(med.index, med[col], "-", color=color, label=f"{name} (median of trials)")
    rates = sorted({r for df in frames.values() for r in df["target"]})
    for ax, (col, ylabel, target) in zip(axes, panels):
        if target is not None:
            ax.axhline(target, color="red", lw=1, label=f"target {target:g} ms")
        ax.set(xlabel="requests / s offered (Poisson)", ylabel=ylabel, ylim=(0, None))
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------
# Section 5: /metrics during the load
# --------------------------------------------------------------------------------------------


def plot_watch(frame, report, engine_kw: dict, title: str):
    """``/metrics`` sampled during a load: requests running / waiting, KV blocks held and cached, prefix-cache hits
    and preemptions; the shaded bands are GuideLLM's benchmarks (each rate of each trial)."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    t0 = frame["unix_s"].iloc[0]
    t = frame["unix_s"] - t0
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    axes[0].plot(t, frame["kvlib_num_requests_running"], label="running")
    axes[0].plot(t, frame["kvlib_num_requests_waiting"], label="waiting")
    axes[0].axhline(engine_kw["max_num_seqs"], color="grey", lw=0.8, ls=":", label="max_num_seqs")
    axes[0].set(title="requests (chapter 08: scheduling)", ylabel="requests")
    axes[0].yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[1].plot(t, frame["kvlib_kv_blocks_used"], label="held by running requests")
    axes[1].plot(t, frame["kvlib_kv_blocks_cached"], label="cached prefix blocks")
    axes[1].axhline(engine_kw["num_blocks"], color="grey", lw=0.8, ls=":", label="pool")
    axes[1].set(title="KV blocks (chapter 05: the paged pool)", ylabel="blocks")
    hits = frame["kvlib_prefix_cache_hit_tokens_total"] - frame["kvlib_prefix_cache_hit_tokens_total"].iloc[0]
    prompts = frame["kvlib_prompt_tokens_total"] - frame["kvlib_prompt_tokens_total"].iloc[0]
    axes[2].plot(t, 100 * hits / prompts.where(prompts > 0), label="prefix-cache hits")
    axes[2].set(title="prefix cache and preemptions (chapter 08)", ylabel="hits per 100 prompt tokens of the load")
    twin = axes[2].twinx()  # a count, on its own axis
    twin.plot(t, frame["kvlib_num_preemptions_total"], color="C3", ls="--", label="preemptions so far (right)")
    twin.set_ylabel("preemptions so far")
    twin.set_ylim(-0.5, max(1, frame["kvlib_num_preemptions_total"].max()) + 0.5)
    axes[2].set_ylim(0, 100)
    twin.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    twin.legend(fontsize=7, loc="lower right")
    for b in report["benchmarks"]:
        rate = b["config"]["strategy"]["rate"]
        for ax in axes:
            ax.axvspan(b["start_time"] - t0, b["end_time"] - t0, color="C2" if rate == min(
                x["config"]["strategy"]["rate"] for x in report["benchmarks"]) else "C3", alpha=0.08)
    for ax in axes:
        ax.set_xlabel("seconds")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def metrics_table(frame, engine_kw: dict, tok, prompt_tokens: float):
    """What the /metrics samples say, tied to earlier chapters: one row per quantity."""
    import pandas as pd

    peak = frame.loc[frame["kvlib_kv_blocks_used"].idxmax()]
    first, last = frame.iloc[0], frame.iloc[-1]
    hits = last["kvlib_prefix_cache_hit_tokens_total"] - first["kvlib_prefix_cache_hit_tokens_total"]
    prompt = last["kvlib_prompt_tokens_total"] - first["kvlib_prompt_tokens_total"]
    a, b = tok.chat([{"role": "user", "content": "alpha beta"}]), tok.chat([{"role": "user", "content": "gamma delta"}])
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the chat template's shared prefix
    bs, running = engine_kw["block_size"], max(peak["kvlib_num_requests_running"], 1)
    preempted = last["kvlib_num_preemptions_total"] - first["kvlib_num_preemptions_total"]
    rows = [
        ("KV blocks held at the peak (chapter 05)", f"{peak['kvlib_kv_blocks_used']:.0f} of {engine_kw['num_blocks']}"),
        ("requests running at that peak", f"{peak['kvlib_num_requests_running']:.0f}"),
        ("blocks per running request there", f"{peak['kvlib_kv_blocks_used'] / running:.1f}"),
        ("most requests running at once (chapter 08)", f"{frame['kvlib_num_requests_running'].max():.0f} "
                                                       f"(max_num_seqs {engine_kw['max_num_seqs']})"),
        ("most requests waiting at once", f"{frame['kvlib_num_requests_waiting'].max():.0f}"),
        ("preemptions during the load", f"{preempted:.0f}"),
        ("prompt tokens served from the prefix cache", f"{100 * hits / prompt:.0f}% of {prompt:,.0f}"),
        ("chat-template tokens every prompt shares", f"{common} ({common // bs} full block(s) of {bs}: "
                                                     f"{100 * (common // bs * bs) / prompt_tokens:.0f}% of a "
                                                     f"{prompt_tokens:.0f}-token prompt)"),
    ]
    return pd.DataFrame(rows, columns=["what /metrics showed", "value"]).set_index("what /metrics showed")


# --------------------------------------------------------------------------------------------
# Section 6: the same answers?
# --------------------------------------------------------------------------------------------


def _answers(report) -> dict:
    """{prompt text: answer text} of every successful request of a GuideLLM report."""
    out = {}
    for bench in report["benchmarks"]:
        for req in bench["requests"]["successful"]:
            body = json.loads(req["request_args"])["body"]
            content = body["messages"][0]["content"]
            out[content[0]["text"] if isinstance(content, list) else content] = req["output"]
    return out


def same_answers(report_a, report_b) -> tuple[int, int]:
    """(prompts both servers answered, of which the greedy answers are the same text)."""
    a, b = _answers(report_a), _answers(report_b)
    common = sorted(set(a) & set(b))
    return len(common), sum(a[p] == b[p] for p in common)


# --------------------------------------------------------------------------------------------
# What the chapter measured
# --------------------------------------------------------------------------------------------


def summary(answer, timed, forward, left, attainment, ratios, big=None):
    """The chapter's measurements with their conditions, one row each (a DataFrame). ``big``: ``big_prompt``'s
    results (a list, one per send), when the chapter sent a prompt of megabytes during a stream."""
    import pandas as pd

    o = timed["overhead_ms"]
    med, lo, hi = median_interval(o)
    rows = [("streamed answer, token-identical to generate()", f"{len(answer['ids'])} tokens, "
             f"TTFT {1000 * answer['stamps'][0]:.0f} ms"),
            ("engine step / client gap / forward alone (median ms)",
             f"{timed['step_ms'].median():.1f} / {timed['gap_ms'].median():.1f} / {np.median(forward):.1f}"),
            ("gap - step per token (median, 95% interval)", f"{med:.2f} ms ({lo:.2f} to {hi:.2f})"),
            ("blocks back after a client hung up", "not within the wait" if left["freed_ms"] is None
             else f"{left['freed_ms']:.0f} ms")]
    if big:
        typ, top = [b["typical_ms"] for b in big], [b["largest_ms"] for b in big]
        rows.append((f"a stream's gaps while a {big[0]['mb']:.0f} MB prompt was sent (tiny model, {len(big)} sends): "
                     "typical / largest", f"{min(typ):.1f}-{max(typ):.1f} / {min(top):.0f}-{max(top):.0f} ms"))
    for (server, rate), r in attainment.iterrows():
        rows.append((f"{server} at {rate:g} req/s: attainment (95% interval), load", f"{r['pooled %']:.0f}% "
                     f"({r['95% low %']:.0f}-{r['95% high %']:.0f}%), load {r['load avg before-after']}"))
    ahead = ratios[~ratios["ahead"].str.startswith("no verdict")]
    rows.append(("metrics where every trial of one server beat every trial of the other",
                 f"{len(ahead)} of {len(ratios)}"))
    return pd.DataFrame(rows, columns=["what", "measured on this machine"]).set_index("what")


# --------------------------------------------------------------------------------------------
# Lab 10's decision: is a difference real?
# --------------------------------------------------------------------------------------------

VERDICT_RULE = ("a server is ahead on a metric only if every one of its trials beats every trial of the other "
                "(the ranges do not overlap); otherwise: no verdict")
ANSWERS = ("A", "B", "no verdict")


def verdict(case) -> str:
    """The chapter's rule on one case: (values of A, values of B, lower_is_better) -> "A", "B" or "no verdict"."""
    a, b, lower = case
    return {"first": "A", "second": "B", "overlap": "no verdict"}[separation(a, b, lower)]


def check_verdicts(cases: dict, yours: dict) -> bool:
    """Lab 10's decision: for each case {name: (trials of A, trials of B, lower is better)}, yours must be the
    chapter's verdict. Prints yours vs the reference case by case; a wrong set fails with a diagnosis when it is
    what a known wrong rule gives."""
    from . import mistakes
    from .check import CheckFailed, check_lines

    if not isinstance(yours, dict) or set(yours) != set(cases):
        raise CheckFailed(f"FAIL ✗ give one answer per case: a dict with the keys {list(cases)}, got {yours!r}")
    bad = {k: v for k, v in yours.items() if v not in ANSWERS}
    if bad:
        raise CheckFailed(f"FAIL ✗ each answer is one of {ANSWERS}, got {bad!r}")
    return check_lines(mistakes.verdict_lines(cases, yours), mistakes.verdict_lines(cases, {k: verdict(c) for k, c
                                                                                           in cases.items()}),
                       name="which server is ahead, case by case", hint=VERDICT_RULE,
                       mistakes=mistakes.verdict_rules(cases))


# --------------------------------------------------------------------------------------------
# Lab 10's server: kvlib.serve with the learner's streaming loop
# --------------------------------------------------------------------------------------------


def _lab_server_base():
    from ..serve import Server

    class LabServerBase(Server):
        """``kvlib.serve.Server`` whose streaming loop is ``self.stream_events(next_message, detok, make_chunk,
        abort)`` (the lab's exercise 3), with two safety nets of the stock server taken out so that only the
        learner's loop counts: ``next_message`` never asks whether the client is still there (the stock ``_next``
        does, every 0.25 s, and aborts itself), and the background task that aborts a request still live after
        its response has ended does nothing."""

        @staticmethod
        def _abort_if_live(h, loop):
            pass  # the stock server's backup abort, after the response: off

        def stream_events(self, next_message, detok, make_chunk, abort):
            raise NotImplementedError("a LabServer gives its stream_events")

        def _sse(self, h, request, loop, meta, text, chat, include_usage, token_ids, prompt):
            async def next_message():  # Server._next without its disconnect check (and the abort that follows it)
                return await h.queue.get()

            def make_chunk(text=None, ids=None, finish=None, first=False):  # the stock server's chunk, as a dict
                choice = {"index": 0, "logprobs": None, "finish_reason": finish}
                if chat:
                    choice["delta"] = ({"role": "assistant", "content": ""} if first else
                                       {} if text is None else {"content": text})
                else:
                    choice["text"] = text or ""
                if token_ids:
                    choice["token_ids"] = list(ids or [])
                    if first:
                        choice["prompt_token_ids"] = list(prompt)
                obj = "chat.completion.chunk" if chat else "text_completion"
                return {**meta, "object": obj, "choices": [choice]}

            return self.stream_events(next_message, text, make_chunk, lambda: loop.submit("abort", h))

    return LabServerBase


def __getattr__(name):  # LabServerBase is built on first use: importing ch10 does not import the web stack
    if name == "LabServerBase":
        return _lab_server_base()
    raise AttributeError(name)


def lab_leave_early(server, prompt: str, *, max_tokens: int = 500, read: int = 3, wait_s: float = 5.0):
    """Lab 10: stream a long completion of ``prompt`` from ``server``, read ``read`` events, hang up, and watch
    ``/metrics`` for ``wait_s`` seconds at most. Returns (what happened, what should, a hint) as lines."""
    import httpx

    from ..bench import load

    def metrics():
        return load.parse_metrics(httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=10).text)

    ended = lambda m, why: m[f'kvlib_requests_finished_total{{finish_reason="{why}"}}']  # noqa: E731
    before, held = metrics(), 0
    body = dict(model=server.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                stream=True)
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == read:
                held = metrics()["kvlib_kv_blocks_used"]
                break  # leaving the `with` closes the connection: the client has gone
    t0 = time.monotonic()
    while True:
        m = metrics()
        if (m["kvlib_kv_blocks_used"] == 0 and m["kvlib_num_requests_running"] == 0) or time.monotonic() - t0 > wait_s:
            break
        time.sleep(0.02)
    how = ("aborted" if ended(m, "abort") > ended(before, "abort") else
           "ran to max_tokens" if ended(m, "length") > ended(before, "length") else "still running")
    yours = [f"blocks held while it streamed: {'some' if held > 0 else 'none'}",
             f"blocks held after the client left: {int(m['kvlib_kv_blocks_used'])}",
             f"requests running after the client left: {int(m['kvlib_num_requests_running'])}",
             f"the request: {how}"]
    reference = ["blocks held while it streamed: some", "blocks held after the client left: 0",
                 "requests running after the client left: 0", "the request: aborted"]
    hint = ("" if how == "aborted" else
            f"the request kept {int(m['kvlib_kv_blocks_used'])} blocks for {wait_s:g} s after the client left"
            if how == "still running" else "the request ran on to max_tokens after the client left")
    return yours, reference, hint + ": your generator must call abort() in a finally: block" if hint else ""
