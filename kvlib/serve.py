"""The engine behind an HTTP API (chapter 10): an OpenAI-compatible server over ``kvlib.engine``.

What you will learn:
- why a server runs **one engine loop in one thread**: ``Engine`` is a single-threaded object (its
  queues, block tables and generators change inside ``step()``), and continuous batching wants every
  request in the *same* step anyway. So HTTP handlers never touch it: they put commands (``add``,
  ``abort``) on a thread-safe ``queue.Queue``; the loop applies them *between* steps, steps while
  anything is unfinished, and sleeps on the queue when idle (no busy loop). This is vLLM's and SGLang's
  split too (an API process and an engine core that talk through queues);
- how tokens get back: each HTTP request owns an ``asyncio.Queue`` on the web server's event loop. After
  every step the engine thread hands each request its new tokens with ``loop.call_soon_threadsafe`` (the
  one thread-safe door into an asyncio loop), and the handler turns them into text;
- **server-sent events** (SSE), OpenAI's streaming format: ``data: {json}\\n\\n`` per chunk, a last
  chunk with ``finish_reason``, then ``data: [DONE]``;
- **incremental detokenization** (``TextStream``): a token is not a character. Decode the whole output,
  send only the new suffix, and hold back what is not decided yet: a trailing U+FFFD (half a UTF-8
  character: the byte-level tiny model emits one byte per token) and any tail that could be the start
  of a stop string, so text past a stop string never leaves the server;
- **abort on disconnect**: a client that goes away (a closed stream, a cancelled request) must not keep
  its blocks. The handler notices (the stream generator is cancelled, or ``request.is_disconnected()``)
  and sends ``abort``; the engine frees the blocks at once (full prefix blocks stay cached for reuse);
- what makes a server survive its clients: every malformed body or out-of-range parameter is an HTTP 400
  with an OpenAI-style error object whose ``code`` is set, decided *before* anything reaches the engine,
  and no error body echoes Python's exception text (the log has it); an exception inside ``step()`` (the
  engine leaves every request as it was) is retried, and only when the same step fails
  ``max_step_failures`` times in a row are the requests it scheduled failed with a 500. The loop never dies;
- that the event loop must never wait on one request: parsing, the chat template and tokenization run in
  a worker thread (as in vLLM and SGLang), a prompt whose *lower bound* on tokens (its bytes / the most
  bytes one token covers) is already past the context is refused before it is encoded, and the
  ``tokenizers`` encoder is called so that it releases the GIL (``kvlib.serve_limits``);
- ``/metrics`` in the Prometheus text format, written by hand: running / waiting requests, KV blocks
  used / cached / total, prefix-cache hit rate, preemptions, finish reasons, TTFT and inter-token
  latency histograms.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true``),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``. Extensions beyond OpenAI's
fields (vLLM spells them the same way): ``top_k``, ``ignore_eos``, ``stop_token_ids`` (a list of token ids),
``return_token_ids`` (the prompt's and the output's token ids in each choice, so a client can compare
tokens, not text). ``max_completion_tokens`` is honoured on both endpoints (over ``max_tokens`` when both
are set); chat roles are ``system``, ``user``, ``assistant`` and ``developer`` (given to the template as
``system``, as OpenAI defines it).

Not supported, refused with a 400 that says so: ``top_p`` other than 1 (the engine samples with
temperature and top-k only), ``n`` / ``best_of`` other than 1, ``logprobs``, ``echo``, ``suffix``,
penalties, ``logit_bias``, tools (and the ``tool`` role), ``response_format`` other than text, a list of
several prompts. Fields this server does not know at all are ignored with a warning in the log (logger
``kvlib.serve``; the names escaped, at most 16 of them, each cut to 40 characters), as vLLM does.
Temperatures below 1e-5 are greedy (as in vLLM): dividing logits by a smaller number overflows to inf, and
the step would fail. ``seed`` lies in 0..2**63-1 (vLLM bounds it to int64 too).

Limits (``Server(...)`` keywords, and the command line's options):

- ``api_key`` (``--api-key``, or the environment variable ``KVLIB_API_KEY``, as vLLM's ``--api-key`` /
  ``VLLM_API_KEY``): every request under ``/v1`` needs ``Authorization: Bearer <key>``, else 401;
  ``/health`` and ``/metrics`` stay open, as in vLLM. Default: none (anyone who reaches the port may use it);
- ``max_body_bytes`` (``--max-body-bytes``, default 4 MiB): a larger body is a 413, refused from its
  ``Content-Length`` before it is read, or as soon as a chunked body passes the limit;
- a body must say ``Content-Type: application/json`` (else 415): a web page can send a cross-origin
  "simple" POST (``text/plain``, or no type) to a server on the learner's machine without asking first,
  but not a JSON one;
- ``max_waiting`` (``--max-waiting``, default 256): requests accepted but not yet admitted to the engine;
  past it, a 503 with ``Retry-After: 1``. 503 rather than 429, because the server is busy for every client
  (429 says *this* client sent too many), and uvicorn's own concurrency limit answers 503 too; the openai
  client retries both;
- ``max_connections`` (``--max-connections``, default 512): uvicorn's ``limit_concurrency``; a request on
  a connection past it gets uvicorn's plain 503;
- ``read_timeout`` (``--read-timeout``, default 10 s): a connection must send its request's headers within
  this time of connecting (or of its previous response) and the body within this time of the headers, or
  it is closed: half-open connections cannot pile up (uvicorn itself only closes idle keep-alive ones).

From the command line (Ctrl+C stops it)::

    python -m kvlib.serve --model smollm2-135m-instruct --port 8000
    python -m kvlib.serve --model tiny --num-blocks 256 --max-num-seqs 16

and from Python, in the background (what the tests and the notebook do)::

    model, tok = load_tiny()
    with Server(model, tok, "tiny", num_blocks=256) as server:     # port=0: a free port
        client = openai.OpenAI(base_url=server.url, api_key="none")
        client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=0)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from . import serve_limits as limits
from .cache import check_int
from .engine import Engine
from .serve_limits import INT64_MAX, APIError

__all__ = ["Server", "TextStream", "APIError", "ServeMetrics", "main"]

log = logging.getLogger("kvlib.serve")

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_STOP_STRINGS = 4  # OpenAI's limit
KNOWN_FIELDS = {  # read (or refused when set) by the handlers; anything else is logged and ignored
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "best_of", "stop", "seed",
    "stream", "stream_options", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "ignore_eos", "stop_token_ids", "return_token_ids", "user",
    "response_format"}
COMPLETION_FIELDS = KNOWN_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = KNOWN_FIELDS | {"messages", "tools", "tool_choice"}
# a chat role as sent -> as given to the template (OpenAI's "developer" messages are its newer system messages)
CHAT_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "developer": "system"}


# --------------------------------------------------------------------------------------------
# Errors: OpenAI's error object (APIError, in kvlib.serve_limits) and the checks of each field
# --------------------------------------------------------------------------------------------


def _int(body, name, default=None, minimum=None, maximum=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(f"{name} must be an integer, got {_short(v)}", name, code="invalid_type")
    if minimum is not None and v < minimum:
        raise APIError(f"{name} must be >= {minimum}, got {v}", name)
    if maximum is not None and v > maximum:
        raise APIError(f"{name} must be <= {maximum}, got {_short(v)}", name)
    return v


def _short(v, width: int = 80) -> str:
    """repr(v), at most ``width`` characters, without building the repr of a huge value."""
    if isinstance(v, str):
        return repr(v[:width]) + ("…" if len(v) > width else "")
    if isinstance(v, (dict, list)):
        return f"{'an object' if isinstance(v, dict) else 'a list'} of {len(v)}"
    text = repr(v)
    return text[:width] + ("…" if len(text) > width else "")


def _number(body, name, default, lo, hi):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise APIError(f"{name} must be a number in [{lo}, {hi}], got {_short(v)}", name)
    return float(v)


def _bool(body, name, default=False):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(f"{name} must be true or false, got {_short(v)}", name, code="invalid_type")
    return v


def _unsupported(body, name, allowed, why):
    """Refuse a field we cannot honor unless it has one of its harmless values."""
    if name in body and body[name] not in allowed:
        raise APIError(f"{name}={_short(body[name])} is not supported: {why}", name, code="unsupported_value")


def _stop_strings(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(f"stop must be a non-empty string or a list of them, got {_short(body['stop'])}", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    return stop


# --------------------------------------------------------------------------------------------
# Incremental detokenization
# --------------------------------------------------------------------------------------------


class TextStream:
    r"""Text of a growing list of token ids, handed out as new suffixes that are safe to send.

    ``add(ids)`` decodes the whole output so far and returns the part not sent yet, holding back a
    trailing U+FFFD (a UTF-8 character or BPE piece whose bytes are not all there) and any tail that
    could still become a stop string (or is one: nothing from a stop string on is ever sent).
    ``finish(final)`` returns the rest of the final text (the engine's, cut before a stop string).
    Decoding everything each time costs O(n^2) over a request, negligible next to a forward.

    >>> from kvlib.corpus import ByteTokenizer
    >>> stream = TextStream(ByteTokenizer(), stop=["\n\n"])
    >>> [stream.add(list(piece.encode())) for piece in ("ab", "c\n", "d")]  # "\n" could start the stop string
    ['ab', 'c', '\nd']
    >>> euro = list("€".encode())  # three bytes, three tokens of the byte-level model
    >>> stream.add(euro[:1]), stream.add(euro[1:2]), stream.add(euro[2:])  # no half character leaves
    ('', '', '€')
    >>> stream.add(list(b"\n\nnot sent")), stream.text  # the stop string and what follows are never sent
    ('', 'abc\nd€')
    """

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # what has been sent

    def add(self, ids) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        safe = len(text)
        while safe and text[safe - 1] == "\ufffd":
            safe -= 1
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                safe = min(safe, i)
                continue
            for k in range(min(len(s) - 1, len(text)), 0, -1):  # the longest tail that starts s
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._advance(text, safe)

    def finish(self, final: str | None = None) -> str:
        if final is None:  # decode here, cut before the first stop string as the engine does
            final = self.tokenizer.decode(self.ids)
            final = final[: min((i for i in (final.find(s) for s in self.stop) if i >= 0), default=len(final))]
        return self._advance(final, len(final))

    def _advance(self, text: str, upto: int) -> str:
        if upto <= len(self.text) or not text.startswith(self.text):
            return ""  # nothing new (sent text is never taken back)
        new, self.text = text[len(self.text):upto], text[:upto]
        return new


# --------------------------------------------------------------------------------------------
# Metrics in the Prometheus text format
# --------------------------------------------------------------------------------------------

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)  # seconds, as vLLM's vllm:time_to_first_token_seconds
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)  # seconds between two tokens of one request
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, x: float):
        i = next((i for i, b in enumerate(self.buckets) if x <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += x
        self.count += 1

    def lines(self, name):
        out, acc = [], 0
        for b, c in zip(self.buckets + (math.inf,), self.counts):
            acc += c  # Prometheus buckets are cumulative: le="0.1" counts everything <= 0.1
            out.append(f'{name}_bucket{{le="{"+Inf" if b == math.inf else repr(b)}"}} {acc}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


class ServeMetrics:
    """Counters and histograms, written by the engine thread, read by ``/metrics`` (under one lock).

    ``render(gauges)`` writes the text format (``# HELP``, ``# TYPE``, one sample a line):

    >>> m = ServeMetrics()
    >>> m.ttft.observe(0.03); m.finished["stop"] += 1
    >>> text = m.render(dict(running=1, waiting=0, swapped=0, blocks_total=8, blocks_free=5, blocks_cached=1))
    >>> wanted = ("kvlib_kv_blocks_used ", 'kvlib_time_to_first_token_seconds_bucket{le="0.04"}')
    >>> [ln for ln in text.splitlines() if ln.startswith(wanted)]
    ['kvlib_kv_blocks_used 2', 'kvlib_time_to_first_token_seconds_bucket{le="0.04"} 1']
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.prompt_tokens = self.cached_prompt_tokens = self.generation_tokens = 0
        self.preemptions = self.step_errors = self.steps = 0

    def render(self, g: dict) -> str:
        used = g["blocks_total"] - g["blocks_free"] - g["blocks_cached"]  # held by requests
        rows = []

        def metric(name, kind, help_, samples):
            rows.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            rows.extend(samples if isinstance(samples, list) else [f"{name} {samples!r}"])

        with self.lock:
            metric("kvlib_num_requests_running", "gauge", "Requests holding blocks in the engine.", g["running"])
            metric("kvlib_num_requests_waiting", "gauge", "Requests queued, not yet admitted (or preempted).",
                   g["waiting"])
            metric("kvlib_num_requests_swapped", "gauge", "Requests swapped out to host memory.", g["swapped"])
            metric("kvlib_kv_blocks_total", "gauge", "Blocks in the paged KV pool.", g["blocks_total"])
            metric("kvlib_kv_blocks_used", "gauge", "Blocks held by requests.", used)
            metric("kvlib_kv_blocks_cached", "gauge", "Blocks no request holds, kept for prefix reuse.",
                   g["blocks_cached"])
            metric("kvlib_kv_blocks_free", "gauge", "Blocks in the free list.", g["blocks_free"])
            metric("kvlib_kv_cache_usage_ratio", "gauge", "Fraction of the pool held by requests.",
                   used / g["blocks_total"])
            metric("kvlib_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", self.prompt_tokens)
            metric("kvlib_prefix_cache_hit_tokens_total", "counter",
                   "Prompt tokens found in the prefix cache at admission.", self.cached_prompt_tokens)
            metric("kvlib_prefix_cache_hit_rate", "gauge", "Cached prompt tokens / prompt tokens, since start.",
                   self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0)
            metric("kvlib_generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
            metric("kvlib_num_preemptions_total", "counter", "Preemptions (recompute or swap).", self.preemptions)
            metric("kvlib_engine_steps_total", "counter", "Engine steps taken.", self.steps)
            metric("kvlib_engine_step_errors_total", "counter", "Engine steps that raised.", self.step_errors)
            metric("kvlib_requests_finished_total", "counter", "Requests ended, by finish reason.",
                   [f'kvlib_requests_finished_total{{finish_reason="{k}"}} {v}' for k, v in self.finished.items()])
            metric("kvlib_time_to_first_token_seconds", "histogram", "From the HTTP request's arrival to its "
                   "first token.", self.ttft.lines("kvlib_time_to_first_token_seconds"))
            metric("kvlib_inter_token_latency_seconds", "histogram", "Between two tokens of one request.",
                   self.itl.lines("kvlib_inter_token_latency_seconds"))
            metric("kvlib_e2e_request_latency_seconds", "histogram", "From arrival to the last token.",
                   self.e2e.lines("kvlib_e2e_request_latency_seconds"))
        return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------------------------
# The engine loop (one thread) and the per-request handle
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)  # compared and hashed by identity (the server keeps a set of the waiting ones)
class _Handle:
    """One HTTP request as the engine thread sees it. The handler reads only ``queue``."""
    loop: asyncio.AbstractEventLoop  # the web server's event loop
    queue: asyncio.Queue  # messages to the handler (see EngineLoop)
    kwargs: dict  # Engine.add_request's arguments
    arrival: float = field(default_factory=time.perf_counter)
    rid: int | None = None  # the engine's request id, once added
    first_token: float | None = None
    last_token: float | None = None
    n_out: int = 0  # tokens delivered
    admitted: bool = False  # set by the engine thread at the request's first admission (it no longer waits)
    done: bool = False
    check_at: float = 0.0  # handler side: when to ask next whether the client is still connected

    def post(self, *msg):
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, msg)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


class EngineLoop:
    """The one thread that owns the engine. Commands in (``submit``), messages out (to each handle):

    ``("added", id)``, ``("tokens", [ids])``, ``("finish", reason, text or None, usage)``, or
    ``("error", APIError)`` (refused at add, failed steps, shutdown).
    """

    def __init__(self, engine: Engine, metrics: ServeMetrics, max_step_failures: int = 3):
        self.engine, self.metrics, self.max_step_failures = engine, metrics, max_step_failures
        self.commands: queue.Queue = queue.Queue()
        self.live: dict[int, _Handle] = {}  # engine id -> handle, for requests not yet ended
        self.failures = 0  # consecutive failed steps
        self.gauges = engine_gauges(engine)  # replaced (never mutated) after each iteration: safe to read anywhere
        self.thread = threading.Thread(target=self._run, name="kvlib-engine-loop", daemon=True)

    def start(self):
        self.thread.start()

    def submit(self, *cmd):
        self.commands.put(cmd)

    def stop(self, timeout: float = 10.0):
        if self.thread.is_alive():
            self.submit("stop")
            self.thread.join(timeout)

    # ---- in the engine thread only -----------------------------------------------------------

    def _run(self):
        while True:
            try:
                busy = self.engine.has_unfinished()
                backoff = min(0.05 * self.failures, 0.5)
                for cmd in self._commands(None if not busy else backoff):
                    if cmd[0] == "stop":
                        self._shutdown()
                        return
                    self._apply(cmd)
                if self.engine.has_unfinished():
                    self._step()
                self.gauges = engine_gauges(self.engine)
            except Exception:  # a bug of ours: log it, never let the loop die
                log.exception("engine loop iteration failed")
                time.sleep(0.05)

    def _commands(self, timeout):
        """All queued commands; when idle (timeout None) sleep until one arrives."""
        out = []
        if timeout != 0:
            try:
                out.append(self.commands.get(timeout=timeout))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self.commands.get_nowait())
            except queue.Empty:
                return out

    def _apply(self, cmd):
        kind, h = cmd
        if kind == "add":
            try:
                h.rid = self.engine.add_request(**h.kwargs)
            except Exception as err:  # what the handler's checks did not catch: logged, never echoed
                ref = _log_error("add_request refused a request the handler had checked", err)
                h.done = True
                bad = isinstance(err, (ValueError, TypeError))
                h.post("error", APIError(f"the engine refused this request's parameters (error {ref} in the server "
                                         "log)" if bad else f"internal error (error {ref} in the server log)",
                                         status=400 if bad else 500,
                                         type="invalid_request_error" if bad else "server_error"))
                return
            self.live[h.rid] = h
            h.post("added", h.rid)
        elif kind == "abort":
            if h.rid is not None and self.live.pop(h.rid, None) is not None:
                self.engine.abort(h.rid)  # its blocks are free now
                self._ended(h, "abort")

    def _step(self):
        try:
            ev = self.engine.step()
        except Exception as err:
            self.failures += 1
            with self.metrics.lock:
                self.metrics.step_errors += 1
            log.exception("engine step failed (%d in a row)", self.failures)
            if self.failures >= self.max_step_failures:
                self._fail_step(err)
            return
        self.failures = 0
        now, m, live = time.perf_counter(), self.metrics, self.live
        with m.lock:
            m.steps += 1
            m.preemptions += len(ev["preempted"])
            for rid in ev["admitted"]:
                if rid in live:
                    live[rid].admitted = True
                r = self.engine.requests.get(rid)  # None: already dropped from the engine's bounded log
                if r is not None and r.preemptions == 0 and rid in live:  # first admission: what the prefix cache saved
                    m.prompt_tokens += len(r.prompt)
                    m.cached_prompt_tokens += min(r.cached_tokens, len(r.prompt))
            for rid, toks in ev["emitted"].items():
                h = live.get(rid)
                if h is None:
                    continue
                m.generation_tokens += len(toks)
                if h.first_token is None:
                    h.first_token = now
                    m.ttft.observe(now - h.arrival)
                else:
                    m.itl.observe(now - h.last_token)
                h.last_token = now
                h.n_out += len(toks)
                h.post("tokens", list(toks))
        for rid in ev["finished"]:
            h = live.pop(rid, None)
            if h is None:
                continue
            reason = ev["finish_reasons"].get(rid, "stop")
            if reason == "error":  # its own sampling kept failing (the engine ended it; the others went on)
                r = self.engine.requests.get(rid)
                h.done = True
                with self.metrics.lock:
                    self.metrics.finished["error"] += 1
                ref = _log_error(f"sampling failed for request {rid}: {r.error if r is not None else '?'}")
                h.post("error", APIError(f"sampling failed for this request (error {ref} in the server log)",
                                         status=500, type="server_error"))
            else:
                self._ended(h, reason)

    def _fail_step(self, err):
        """The same step failed max_step_failures times: end the requests it scheduled."""
        ev = self.engine.events[-1] if self.engine.events else {}
        ids = set(ev.get("scheduled") or ()) | set(ev.get("admitted") or ()) or set(self.live)
        self.failures = 0
        ref = _log_error(f"the same step failed {self.max_step_failures} times: aborting requests {sorted(ids)}", err)
        for rid in ids:
            h = self.live.pop(rid, None)
            if h is None:
                continue
            self.engine.abort(rid)
            h.done = True
            with self.metrics.lock:
                self.metrics.finished["error"] += 1
            h.post("error", APIError(f"the engine failed {self.max_step_failures} steps in a row on this request; "
                                     f"it was aborted (error {ref} in the server log)", status=500,
                                     type="server_error"))

    def _ended(self, h: _Handle, reason: str):
        r = self.engine.requests.get(h.rid)  # None only if the engine's log of ended requests is tiny
        h.done = True
        with self.metrics.lock:
            self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
            if h.last_token is not None:
                self.metrics.e2e.observe(h.last_token - h.arrival)
        n_prompt = len(h.kwargs["prompt_ids"])
        cached = min(r.cached_tokens, n_prompt) if r is not None else 0
        usage = dict(prompt_tokens=n_prompt, completion_tokens=h.n_out, total_tokens=n_prompt + h.n_out,
                     cached_tokens=cached)
        h.post("finish", reason, r.text if r is not None else None, usage)

    def _shutdown(self):
        for rid, h in list(self.live.items()):
            self.engine.abort(rid)
            h.done = True
            h.post("error", APIError("the server is shutting down", status=503, type="server_error"))
        self.live.clear()
        self.gauges = engine_gauges(self.engine)


def _log_error(what: str, err: BaseException | None = None) -> str:
    """Log ``what`` (with the exception's traceback) under a short reference, and return the reference: the
    client's error body names it, the log holds what happened."""
    ref = uuid.uuid4().hex[:12]
    log.error("[error %s] %s", ref, what, exc_info=(type(err), err, err.__traceback__) if err is not None else None)
    return ref


def engine_gauges(engine: Engine) -> dict:
    """What /metrics shows of the engine's state (read in the engine thread, between steps)."""
    c = engine.cache
    return dict(running=len(engine.running), waiting=len(engine.waiting), swapped=len(engine.swapped),
                blocks_total=engine.config.num_blocks, blocks_free=c.allocator.num_free, blocks_cached=len(c.cached))


# --------------------------------------------------------------------------------------------
# The HTTP server
# --------------------------------------------------------------------------------------------

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class _Prepared:
    """A request checked and tokenized (in a worker thread): what the handler needs to run it."""
    prompt: list[int]
    kwargs: dict  # Engine.add_request's arguments
    stream: bool
    include_usage: bool
    token_ids: bool


def _guarded(handler):
    """Run a route so that no exception leaves it: an APIError is its response; anything else is logged and
    answered with a 500 that does not echo it. (An exception that reached Starlette's outermost middleware
    would be answered, re-raised, and the keep-alive connection closed under the client's next request.)"""
    @functools.wraps(handler)
    async def run(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except APIError as err:
            return err.response()
        except ClientDisconnect:
            return JSONResponse({}, status_code=499)  # the client left while sending its body: nobody reads this
        except Exception as err:
            ref = _log_error("a handler failed", err)
            return APIError(f"internal error (error {ref} in the server log)", status=500,
                            type="server_error").response()
    return run


class Server:
    """An OpenAI-compatible HTTP server over one ``Engine`` (built here from ``engine_kw``).

    ``start(host, port=0)`` runs uvicorn in a background thread and returns the bound port (0: a free
    one); ``stop()`` ends it (requests still running are aborted with a 503). ``with Server(...) as s``
    does both; ``s.url`` is the base URL for ``openai.OpenAI(base_url=...)``. ``serve(host, port)``
    blocks in the calling thread (the command line). Engine defaults here: 1,024 events and finished
    requests kept (a server runs for days; the engine's own default keeps 100,000 of each).

    The limits (see the module's docstring): ``api_key`` (None: no key needed), ``max_body_bytes``,
    ``max_waiting`` (None: no bound), ``max_connections`` (None: no bound), ``read_timeout`` (seconds, None:
    none), ``tokenizer_threads`` (the worker threads that parse and tokenize requests).
    """

    def __init__(self, model, tokenizer, model_name: str, *, num_blocks: int = 512, block_size: int = 16,
                 max_step_failures: int = 3, api_key: str | None = None,
                 max_body_bytes: int = limits.DEFAULT_MAX_BODY_BYTES, max_waiting: int | None = 256,
                 max_connections: int | None = 512, read_timeout: float | None = 10.0, tokenizer_threads: int = 2,
                 **engine_kw):
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
        if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(f"tokenizer must have encode(text) and decode(ids), got {type(tokenizer).__name__}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty string, or None for no key")
        max_step_failures = check_int("max_step_failures", max_step_failures)
        self.max_body_bytes = check_int("max_body_bytes", max_body_bytes)
        self.max_waiting = None if max_waiting is None else check_int("max_waiting", max_waiting)
        self.max_connections = None if max_connections is None else check_int("max_connections", max_connections)
        if read_timeout is not None and not (isinstance(read_timeout, (int, float)) and read_timeout > 0):
            raise ValueError(f"read_timeout must be a positive number of seconds or None, got {read_timeout!r}")
        self.read_timeout = read_timeout
        self.tokenizer_threads = check_int("tokenizer_threads", tokenizer_threads)
        engine_kw.setdefault("max_events", 1024)
        engine_kw.setdefault("max_finished", 1024)
        self.engine = Engine(model, num_blocks, block_size, tokenizer=tokenizer, **engine_kw)
        self.tokenizer, self.model_name = tokenizer, model_name
        cfg = model.config  # read-only facts the handlers may use (never the engine itself)
        self.context, self.vocab_size = cfg.max_seq_len, cfg.vocab_size
        self.pool_positions = num_blocks * block_size
        self.eos_id = getattr(tokenizer, "eos_id", None)
        self.token_bytes = limits.max_token_bytes(tokenizer)  # None: no cheap bound on a text's tokens
        self.metrics = ServeMetrics()
        self.max_step_failures = max_step_failures
        self.created = int(time.time())
        self.loop: EngineLoop | None = None
        self._uvicorn = self._thread = self._sock = None
        self._pool: ThreadPoolExecutor | None = None
        self._queued: set[_Handle] = set()  # handles submitted and not yet admitted (event loop thread only)
        self.port: int | None = None
        self.api_key = api_key
        self.app = self._build_app()

    # ---- lifecycle -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server is not running: call start() first")
        return f"http://{self._host_for_url}:{self.port}/v1"

    def _prepare(self, host: str, port: int, log_level: str):
        import uvicorn

        if self.loop is not None:
            raise RuntimeError(f"the server is already running on port {self.port}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {err}") from None
        sock.listen(2048)  # accept from now on: a client that connects before uvicorn runs waits in the backlog
        self._sock, self.port = sock, sock.getsockname()[1]
        self._host_for_url = f"[{host}]" if family == socket.AF_INET6 else host
        self._pool = ThreadPoolExecutor(self.tokenizer_threads, thread_name_prefix="kvlib-tokenize",
                                        initializer=limits.lower_thread_priority)
        self._queued = set()
        self.loop = EngineLoop(self.engine, self.metrics, self.max_step_failures)
        self.loop.start()
        http = limits.default_http_protocol()
        if self.read_timeout is not None:
            http = limits.timed_protocol(http, self.read_timeout)
        config = uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="off",
                                http=http, limit_concurrency=self.max_connections)
        self._uvicorn = uvicorn.Server(config)

    def start(self, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
              timeout: float = 30.0) -> int:
        """Serve in a background thread; returns the port once the server accepts connections."""
        self._prepare(host, port, log_level)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs=dict(sockets=[self._sock]),
                                        name="kvlib-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start within {timeout} s (see the log above)")
            time.sleep(0.01)
        return self.port

    def serve(self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
        """Serve in this thread until Ctrl+C (uvicorn handles the signal), then stop the engine loop."""
        self._prepare(host, port, log_level)
        print(f"kvlib.serve: {self.model_name!r} on {self.url} ({self.engine.config.num_blocks} blocks of "
              f"{self.engine.config.block_size} positions; API key {'required' if self.api_key else 'not set'}); "
              "Ctrl+C stops", flush=True)
        try:
            self._uvicorn.run(sockets=[self._sock])
        finally:
            self.stop()

    def stop(self, timeout: float = 10.0):
        """Stop accepting, abort what is still running (503), and join both threads."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self.loop is not None:
            self.loop.stop(timeout)  # running handlers get their 503 and end
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._uvicorn.force_exit = True
                self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # a tokenization under way ends by itself
        self.loop = self._uvicorn = self._thread = self._sock = self._pool = None
        self.port = None

    def __enter__(self):
        if self.loop is None:
            self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---- the app -------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="kvlib.serve", docs_url=None, redoc_url=None)
        app.add_middleware(limits.APIKeyGuard, api_key=self.api_key)

        @app.exception_handler(APIError)
        async def _api_error(request, err: APIError):
            return err.response()

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request, err):
            kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
            return APIError(f"{request.method} {request.url.path[:200]}: {err.detail}", status=err.status_code,
                            type=kind).response()

        @app.exception_handler(Exception)
        async def _crash(request, err):  # the routes outside _guarded (their bodies cannot fail on input)
            ref = _log_error("handler failed", err)
            return APIError(f"internal error (error {ref} in the server log)", status=500,
                            type="server_error").response()

        @app.get("/health")
        async def health():
            ok = self.loop is not None and self.loop.thread.is_alive()
            return JSONResponse({"status": "ok" if ok else "engine loop not running"}, status_code=200 if ok else 503)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            if model_id != self.model_name:
                raise self._no_such_model(model_id)
            return self._model_card()

        @app.get("/metrics")
        async def metrics():
            gauges = self.loop.gauges if self.loop is not None else engine_gauges(self.engine)
            return PlainTextResponse(self.metrics.render(gauges), media_type="text/plain; version=0.0.4")

        @app.post("/v1/completions")
        @_guarded
        async def completions(request: Request):
            raw = await self._read_body(request)
            prep = await limits.run_in(self._pool, self._prepare_request, raw, request.url.path, False)
            return await self._generate(request, prep, chat=False)

        @app.post("/v1/chat/completions")
        @_guarded
        async def chat_completions(request: Request):
            raw = await self._read_body(request)
            prep = await limits.run_in(self._pool, self._prepare_request, raw, request.url.path, True)
            return await self._generate(request, prep, chat=True)

        return app

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvlib",
                "max_model_len": self.context}

    def _no_such_model(self, name) -> APIError:  # a 404, as in OpenAI's API and vLLM
        return APIError(f"the model {_short(name)} does not exist: this server serves {self.model_name!r} "
                        "(GET /v1/models)", "model", status=404, code="model_not_found")

    # ---- the body: read on the event loop, with its limits -------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The raw body: JSON by its Content-Type (415 otherwise), at most max_body_bytes (413 otherwise,
        from Content-Length before reading a byte). A slow body is cut by the connection's read_timeout."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if not (ctype == "application/json" or ctype.startswith("application/") and ctype.endswith("+json")):
            raise APIError(f"the body must be JSON, sent with 'Content-Type: application/json' (got "
                           f"{_short(ctype) if ctype else 'no Content-Type'})", status=415)
        too_big = APIError(f"the request body is larger than this server's limit of {self.max_body_bytes:,} bytes "
                           "(--max-body-bytes)", status=413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    # ---- request parsing and tokenization (in a worker thread; no engine involved) ---------------

    def _prepare_request(self, raw: bytes, path: str, chat: bool) -> _Prepared:
        body = limits.parse_json_object(raw)
        self._check_model(body)
        known = CHAT_FIELDS if chat else COMPLETION_FIELDS
        unknown = [k for k in body if k not in known]
        if unknown:
            log.warning("%s: ignoring %s field(s) this server does not know: %s", path, f"{len(unknown):,}",
                        limits.unknown_fields_note(unknown))
        prompt = self._chat_ids(body) if chat else self._prompt_ids(body)
        kwargs = self._sampling(body, prompt, chat)
        stream = _bool(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not stream):
            raise APIError("stream_options needs stream=true and must be an object like {\"include_usage\": true}",
                           "stream_options")
        return _Prepared(prompt, kwargs, stream, _bool(opts or {}, "include_usage"), _bool(body, "return_token_ids"))

    def _check_model(self, body):
        name = body.get("model")
        if not isinstance(name, str):
            raise APIError(f"model is required: a string, here {self.model_name!r}", "model",
                           code="missing_required_parameter" if name is None else "invalid_type")
        if name != self.model_name:
            raise self._no_such_model(name)

    def _encode_text(self, text: str, param: str) -> list[int]:
        """Token ids of ``text``; refused unencoded when even a lower bound on its tokens passes the context, and
        refused part-encoded once a count of its slices passes twice the context (``limits.encode_bounded``)."""
        if self.token_bytes is not None:
            at_least = limits.min_tokens(text, self.token_bytes)
            if at_least > self.context:
                raise APIError(f"this model's maximum context length is {self.context} tokens; this {param} has at "
                               f"least {at_least:,} ({len(text.encode('utf-8')):,} bytes, at most "
                               f"{self.token_bytes} per token)", param, code="context_length_exceeded")
        ids, whole = limits.encode_bounded(self.tokenizer, text, self.context)
        if not whole:  # given up early: the work stays bounded by the context, not by the body
            raise APIError(f"this model's maximum context length is {self.context} tokens; this {param} has more "
                           f"than {2 * self.context:,} ({len(text.encode('utf-8', 'surrogatepass')):,} bytes)", param,
                           code="context_length_exceeded")
        return ids

    def _prompt_ids(self, body) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise APIError("prompt must not be empty", "prompt")
            return self._encode_text(p, "prompt")
        if isinstance(p, list) and len(p) > self.context and all(type(t) is int for t in p[:8]):
            raise APIError(f"this model's maximum context length is {self.context} tokens; the prompt alone has "
                           f"{len(p):,}", "prompt", code="context_length_exceeded")
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(f"prompt holds token ids outside the vocabulary 0..{self.vocab_size - 1}: "
                               f"{[_short(t, 24) for t in bad[:5]]}", "prompt")
            return list(p)
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise APIError(f"one prompt per request: got a list of {len(p)} prompts (send them as separate "
                           "requests; they are batched in the engine anyway)", "prompt")
        if p is None:
            raise APIError("prompt is required: a string or a non-empty list of token ids", "prompt",
                           code="missing_required_parameter")
        raise APIError(f"prompt must be a string or a non-empty list of token ids, got {_short(p)}", "prompt")

    def _chat_ids(self, body) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None) or not hasattr(self.tokenizer, "chat"):
            raise APIError(f"the model {self.model_name!r} has no chat template "
                           f"({type(self.tokenizer).__name__}), so messages cannot be formatted: "
                           "use /v1/completions with a plain prompt", "messages", code="no_chat_template")
        _unsupported(body, "tools", (None, []), "this server has no tool calling")
        _unsupported(body, "tool_choice", (None, "none"), "this server has no tool calling")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError("messages must be a non-empty list of {'role': ..., 'content': ...}", "messages")
        flat = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(f"messages[{i}] must be an object with a string 'role', got {_short(m)}", "messages")
            if m["role"] not in CHAT_ROLES:
                raise APIError(f"messages[{i}].role {_short(m['role'], 40)} is not supported: one of "
                               f"{', '.join(CHAT_ROLES)}" + (" (this server has no tool calling)"
                                                               if m["role"] == "tool" else ""),
                               "messages", code="unsupported_value")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                           for c in content):
                    raise APIError(f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(c["text"] for c in content)
            if not isinstance(content, str):
                raise APIError(f"messages[{i}].content must be a string, got {_short(content)}", "messages")
            flat.append({"role": CHAT_ROLES[m["role"]], "content": content})
        if callable(getattr(self.tokenizer, "chat_text", None)):  # the template, then the bounded encoding
            return self._encode_text(self._template(self.tokenizer.chat_text, flat), "messages")
        return self._template(self.tokenizer.chat, flat)

    @staticmethod
    def _template(fn, flat):
        try:
            return fn(flat)
        except Exception as err:  # the template refused (raise_exception), or failed
            from jinja2 import TemplateError

            if isinstance(err, TemplateError):
                msg = str(err)[:200]  # the template author's words about these messages
            else:
                msg = f"error {_log_error('the chat template failed', err)} in the server log"
            raise APIError(f"the chat template could not format these messages: {msg}", "messages") from None

    def _sampling(self, body, prompt, chat: bool) -> dict:
        """Engine.add_request's arguments, checked here so that a bad request never reaches the engine."""
        _unsupported(body, "n", (None, 1), "one choice per request (n=1)")
        _unsupported(body, "best_of", (None, 1), "one choice per request (best_of=1)")
        _unsupported(body, "echo", (None, False), "the prompt is not echoed")
        _unsupported(body, "suffix", (None, ""), "no insertion (suffix)")
        _unsupported(body, "logprobs", (None, False, 0) if chat else (None, 0),
                     "log probabilities are not returned")
        _unsupported(body, "top_logprobs", (None, 0), "log probabilities are not returned")
        _unsupported(body, "presence_penalty", (None, 0, 0.0), "no penalties in this engine")
        _unsupported(body, "frequency_penalty", (None, 0, 0.0), "no penalties in this engine")
        _unsupported(body, "repetition_penalty", (None, 1, 1.0), "no penalties in this engine")
        _unsupported(body, "logit_bias", (None, {}), "no logit bias in this engine")
        _unsupported(body, "top_p", (None, 1, 1.0), "the engine samples with temperature and top_k only "
                                                    "(nucleus sampling is not implemented)")
        _unsupported(body, "response_format", (None, {"type": "text"}), "only plain text output (no structured "
                                                                        "output)")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise APIError(f"user must be a string, got {_short(body['user'])}", "user", code="invalid_type")
        room = min(self.context, self.pool_positions + 1) - len(prompt)
        if body.get("max_completion_tokens") is not None:  # OpenAI's newer name, over max_tokens (as vLLM's chat)
            max_tokens = _int(body, "max_completion_tokens", None, minimum=1)
            param = "max_completion_tokens"
        else:
            max_tokens = _int(body, "max_tokens", None, minimum=1)
            param = "max_tokens"
        if max_tokens is None:
            max_tokens = max(room, 1) if chat else 16  # OpenAI: chat runs to the context, completions 16
        if len(prompt) + max_tokens > self.context:
            raise APIError(f"this model's maximum context length is {self.context} tokens; you requested "
                           f"{len(prompt) + max_tokens} ({len(prompt)} in the prompt, {max_tokens} for the "
                           "completion)", param if len(prompt) < self.context else ("messages" if chat else "prompt"),
                           code="context_length_exceeded")
        if len(prompt) + max_tokens - 1 > self.pool_positions:
            raise APIError(f"the prompt ({len(prompt)} tokens) + {param} ({max_tokens}) needs more KV blocks than "
                           f"the whole pool holds ({self.pool_positions} positions): ask for fewer tokens, or "
                           "start the server with more --num-blocks", param, code="context_length_exceeded")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)  # OpenAI's default is 1
        top_k = _int(body, "top_k", None, minimum=-1, maximum=INT64_MAX)
        if top_k == 0:
            raise APIError("top_k must be >= 1, or -1 / null for no top-k", "top_k")
        seed = _int(body, "seed", None, minimum=0, maximum=INT64_MAX)
        stop_ids = body.get("stop_token_ids")
        stop_ids = [] if stop_ids is None else stop_ids
        if not isinstance(stop_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in stop_ids):
            raise APIError(f"stop_token_ids must be a list of token ids in 0..{self.vocab_size - 1}, got "
                           f"{_short(stop_ids)}", "stop_token_ids")
        ignore_eos = _bool(body, "ignore_eos")
        return dict(prompt_ids=prompt, max_new_tokens=max_tokens,
                    temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                    top_k=None if top_k in (None, -1) else top_k, seed=seed,
                    eos_id=None if ignore_eos else self.eos_id, stop_token_ids=stop_ids, stop=_stop_strings(body))

    # ---- the generation, non-streamed or streamed ----------------------------------------------

    def _check_queue(self):
        """Past max_waiting requests submitted and not yet admitted: a 503 with Retry-After."""
        if self.max_waiting is None:
            return
        self._queued = {h for h in self._queued if not (h.admitted or h.done)}
        if len(self._queued) >= self.max_waiting:
            raise APIError(f"the server is busy: {len(self._queued)} requests are waiting for the engine "
                           f"(--max-waiting {self.max_waiting}); retry in a moment", status=503, type="server_error",
                           code="server_busy", headers={"Retry-After": "1"})

    async def _generate(self, request: Request, prep: _Prepared, chat: bool):
        loop = self.loop
        if loop is None or not loop.thread.is_alive():
            raise APIError("the engine loop is not running", status=503, type="server_error")
        self._check_queue()
        kwargs, prompt = prep.kwargs, prep.prompt
        h = _Handle(asyncio.get_running_loop(), asyncio.Queue(), kwargs)
        self._queued.add(h)
        loop.submit("add", h)
        streaming = False
        try:
            first = await self._next(h, request, loop)
            if first is None:  # the client left before its request was even added
                return JSONResponse({}, status_code=499)
            if first[0] == "error":
                return first[1].response()
            meta = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                        model=self.model_name)
            text = TextStream(self.tokenizer, kwargs["stop"])
            if prep.stream:
                events = self._sse(h, request, loop, meta, text, chat, prep.include_usage, prep.token_ids, prompt)
                # the generator aborts the request when it is cancelled or closed; the background task
                # covers a stream that never started (the client left before its first byte)
                response = StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS,
                                             background=BackgroundTask(self._abort_if_live, h, loop))
                streaming = True
                return response
            while True:
                msg = await self._next(h, request, loop)
                if msg is None:
                    return JSONResponse({}, status_code=499)  # nobody reads it
                if msg[0] == "error":
                    return msg[1].response()
                if msg[0] == "tokens":
                    text.ids.extend(msg[1])
                elif msg[0] == "finish":
                    _, reason, final, usage = msg
                    return self._full_response(meta, chat, text.finish(final), reason, usage, prep.token_ids,
                                               prompt, text.ids)
        finally:
            if not streaming:
                self._abort_if_live(h, loop)  # a cancelled handler, or a client that left

    @staticmethod
    def _abort_if_live(h: _Handle, loop: EngineLoop):
        if not h.done:
            loop.submit("abort", h)  # the engine thread ignores it if the request has ended meanwhile

    async def _next(self, h: _Handle, request: Request, loop: EngineLoop, poll: float = 0.25):
        """The handle's next message; None if the client disconnected (then the request is aborted).
        Every ``poll`` seconds, even while tokens keep coming, it asks whether the client is still there."""
        while True:
            now = time.monotonic()
            if now >= h.check_at:
                h.check_at = now + poll
                if await request.is_disconnected():
                    loop.submit("abort", h)
                    return None
                if not loop.thread.is_alive():
                    return ("error", APIError("the engine loop stopped", status=503, type="server_error"))
            if not h.queue.empty():
                return h.queue.get_nowait()
            try:
                return await asyncio.wait_for(h.queue.get(), max(h.check_at - now, 0.001))
            except asyncio.TimeoutError:
                continue

    def _full_response(self, meta, chat, text, reason, usage, token_ids, prompt, out_ids):
        choice = {"index": 0, "logprobs": None, "finish_reason": reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if token_ids:
            choice.update(prompt_token_ids=list(prompt), token_ids=list(out_ids))
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": self._usage(usage)}

    @staticmethod
    def _usage(u):
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"], "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    async def _sse(self, h, request, loop, meta, text: TextStream, chat, include_usage, token_ids, prompt):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece=None, finish=None, ids=None, role=False, extra=None):
            c = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                c["delta"] = ({"role": "assistant", "content": ""} if role else
                              {} if piece is None else {"content": piece})
            else:
                c["text"] = piece or ""
            if ids is not None:
                c["token_ids"] = ids
            c.update(extra or {})
            out = {**meta, "object": obj, "choices": [c]}
            if include_usage:
                out["usage"] = None
            return _sse(out)

        try:
            prompt_ids = dict(prompt_token_ids=list(prompt)) if token_ids else None
            if chat:
                yield chunk(role=True, ids=[] if token_ids else None, extra=prompt_ids)
            elif token_ids:
                yield chunk("", ids=[], extra=prompt_ids)
            while True:
                msg = await self._next(h, request, loop)
                if msg is None:
                    return  # the client left; the request is aborted
                if msg[0] == "error":
                    yield _sse(msg[1].body())
                    break
                if msg[0] == "tokens":
                    piece = text.add(msg[1])
                    if piece or token_ids:
                        yield chunk(piece, ids=msg[1] if token_ids else None)
                elif msg[0] == "finish":
                    _, reason, final, usage = msg
                    rest = text.finish(final)
                    if rest:
                        yield chunk(rest, ids=[] if token_ids else None)
                    yield chunk(finish=reason, ids=[] if token_ids else None)
                    if include_usage:
                        yield _sse({**meta, "object": obj, "choices": [], "usage": self._usage(usage)})
                    break
            yield "data: [DONE]\n\n"
        finally:  # normal end, an error, or the generator cancelled / closed by a disconnect
            if not h.done:
                loop.submit("abort", h)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

MODELS = ("tiny", "smollm2-135m-instruct")


def load_model(name: str, device=None):
    """(model, tokenizer) by name: "tiny" (the course's model) or a ``load_pretrained`` name."""
    from .model import load_pretrained, load_tiny

    if name == "tiny":
        return load_tiny(device=device)
    return load_pretrained(name, device=device)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kvlib.serve",
                                description="An OpenAI-compatible server over kvlib.engine")
    p.add_argument("--model", default="smollm2-135m-instruct", choices=MODELS)
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines (set --api-key then)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cuda / cpu (default: kvlib.runtime.DEVICE)")
    p.add_argument("--num-blocks", type=int, default=512, help="blocks in the paged KV pool")
    p.add_argument("--block-size", type=int, default=16, help="positions per block")
    p.add_argument("--max-num-seqs", type=int, default=16, help="most requests running at once")
    p.add_argument("--max-batched-tokens", type=int, default=256, help="most tokens computed per step")
    p.add_argument("--preemption", default="recompute", choices=("recompute", "swap"))
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every /v1 request (401 otherwise; /health and "
                        "/metrics stay open, as in vLLM). Default: the environment variable KVLIB_API_KEY, else none")
    p.add_argument("--max-body-bytes", type=int, default=limits.DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted; a larger one is a 413 (default: %(default)s, 4 MiB)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests accepted but not yet admitted to the engine; past it a 503 with Retry-After "
                        "(default: %(default)s)")
    p.add_argument("--max-connections", type=int, default=512,
                   help="open connections (uvicorn's limit_concurrency); past it a 503 (default: %(default)s)")
    p.add_argument("--read-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers, and then its body, before it is "
                        "closed (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model, tok = load_model(a.model, a.device)
    server = Server(model, tok, a.served_model_name or a.model, num_blocks=a.num_blocks, block_size=a.block_size,
                    max_num_seqs=a.max_num_seqs, max_batched_tokens=a.max_batched_tokens, preemption=a.preemption,
                    prefix_caching=a.prefix_caching, api_key=a.api_key or os.environ.get("KVLIB_API_KEY") or None,
                    max_body_bytes=a.max_body_bytes, max_waiting=a.max_waiting, max_connections=a.max_connections,
                    read_timeout=a.read_timeout)
    try:
        server.serve(a.host, a.port, a.log_level)
    except KeyboardInterrupt:  # uvicorn shut down gracefully on Ctrl+C, then re-raised the signal
        pass


if __name__ == "__main__":
    main()
