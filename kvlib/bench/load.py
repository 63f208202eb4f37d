"""Load an OpenAI-compatible server with GuideLLM, watch its ``/metrics``, and read the report (chapter 10).

A server is measured from the outside, the way an operator measures vLLM: a load generator sends
requests at a chosen rate over HTTP, streams every answer, and reports per request the time to first
token (TTFT), the inter-token latency (ITL), the whole latency, and over the run the requests and
tokens per second, and the share of requests that met a latency target (SLO attainment). This module does
not generate load itself: it drives **GuideLLM** (the vLLM project's load tool, ``pip install guidellm``),
so the command it prints works unchanged against vLLM, SGLang, ``transformers serve`` or kvlib.

- ``ServerProcess``: a server in a subprocess of its own (``kvlib_server``, ``transformers_server``),
  up once ``GET /health`` answers, stopped (SIGINT, then SIGTERM, then SIGKILL) by ``stop()`` or at the
  end of a ``with`` block, its log kept in a file.
- ``write_tokenizer_dir``: the model's tokenizer in the Hugging Face layout. GuideLLM needs one to build
  prompts of a given number of tokens; it never reaches the Hub for it.
- ``guidellm_command`` / ``run_guidellm``: one GuideLLM run (a profile, its rates, a time and request
  bound per rate), its JSON report read back by ``summarize`` into one row per rate.
- ``MetricsWatcher``: samples a server's ``/metrics`` (Prometheus text) in a thread during a run.

Every run here is bounded and local: ``run_guidellm`` refuses a target that is not this machine's
loopback address (127.0.0.1, ::1, localhost) unless ``allow_remote=True``, refuses a run with no time
bound, and kills GuideLLM if it outlives its own bounds by ``grace_s``.

What GuideLLM 0.8.1 does that matters here (read from its source and checked on this machine):
- the command is ``guidellm run`` with ``kind=...,key=value`` options (older documents show
  ``guidellm benchmark --target ...``, which 0.8 no longer has);
- requests stream (``stream: true`` with ``stream_options.include_usage``) and token counts come from
  the server's ``usage``, so a chat prompt counts the chat template's tokens too;
- it asks for exactly ``output_tokens`` tokens with ``ignore_eos: true`` (a vLLM extension, which
  kvlib.serve honours); ``transformers serve`` rejects unknown fields with a 422, so the backend gets
  ``extras.body.ignore_eos=null`` there (a null field is dropped before sending);
- with several worker processes every worker seeds the same Poisson generator, so arrivals come in
  bursts of identical gaps; ``GUIDELLM__MAX_WORKER_PROCESSES=1`` (set here, ``GUIDELLM_ENV``) gives true
  exponential gaps and starts each rate in a second instead of ten on a small machine;
- each rate's schedule starts ``GUIDELLM__SCHEDULER_START_DELAY_NON_DISTRIBUTED`` seconds (1 by default)
  after it is set; a worker that is not ready by then sends the arrivals it missed at once, a burst. Here
  the delay is 5 s (with 3 s, bursts still came through on a 2-core machine), and ``report["_bursts"]`` names any rate whose
  requests still went out too close together.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

__all__ = ["ServerProcess", "kvlib_server", "transformers_server", "write_tokenizer_dir", "write_model_dir",
           "guidellm_command", "run_guidellm", "summarize", "scrape_metrics", "MetricsWatcher", "free_port",
           "check_loopback", "slo_break"]

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1"}
# GuideLLM 0.8.1's settings for a small machine: one worker process (several seed the same Poisson
# generator); each rate's schedule starts 3 s after it is set instead of 1 s, so that a worker spawned on a
# busy machine is ready before the first arrival instead of catching up on missed ones in a burst
GUIDELLM_ENV = {**OFFLINE_ENV, "GUIDELLM__MAX_WORKER_PROCESSES": "1",
                "GUIDELLM__SCHEDULER_START_DELAY_NON_DISTRIBUTED": "5"}
PROFILES = ("synchronous", "concurrent", "constant", "poisson", "sweep", "throughput")


# --------------------------------------------------------------------------------------------
# Where a load may go
# --------------------------------------------------------------------------------------------


def check_loopback(url: str) -> str:
    """``url``'s host if it is this machine's loopback address; a ValueError otherwise."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a string like 'http://127.0.0.1:8000', got {type(url).__name__}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must look like 'http://127.0.0.1:8000', got {url!r}")
    host = parts.hostname
    try:
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = False
    if not loop:
        raise ValueError(f"{url!r} is not this machine's loopback address (127.0.0.1, ::1 or localhost): a load "
                         "run from the course only targets a server on this machine. Pass allow_remote=True to "
                         "load a server you run elsewhere.")
    return host


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _command(name: str, install: str) -> str:
    """The path of command ``name``, from this Python's environment first; a RuntimeError saying how to
    install it otherwise."""
    exe = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if exe is None:
        raise RuntimeError(f"the `{name}` command was not found: {install}")
    return exe


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"User-Agent": "kvlib.bench.load"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback URLs only
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")


# --------------------------------------------------------------------------------------------
# Servers in subprocesses
# --------------------------------------------------------------------------------------------


def _die_with_parent():
    """In the child, before exec (Linux): SIGTERM when the process that started it dies, even by SIGKILL
    (a notebook kernel restarted, a test run interrupted), so no server outlives its notebook. Elsewhere,
    and if the call fails, only the ``atexit`` stop below covers it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


_LIVE: set = set()  # the ServerProcess objects started and not yet stopped


@atexit.register
def _stop_all():
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(timeout=5.0)


class ServerProcess:
    """A server started as ``cmd`` in a process group of its own, ready once ``GET base + health`` is 200.

    ``start()`` waits up to ``startup_timeout`` seconds and raises a RuntimeError with the end of the
    server's log if it exits or never answers. ``stop()`` sends SIGINT (a graceful shutdown), then
    SIGTERM, then SIGKILL, to the whole group. A server never outlives the Python process that started it:
    it is stopped at interpreter exit, and on Linux it gets SIGTERM if that process dies (start it from the
    main thread: Linux ties that signal to the starting thread). ``base`` is e.g. ``http://127.0.0.1:8000`` and ``url``
    the OpenAI base URL (``base + "/v1"``) for ``openai.OpenAI(base_url=...)``.
    """

    def __init__(self, cmd: list[str], base: str, *, name: str = "server", env: dict | None = None,
                 health: str = "/health", startup_timeout: float = 300.0, log_path: str | Path | None = None):
        if not isinstance(cmd, (list, tuple)) or not cmd or not all(isinstance(c, str) for c in cmd):
            raise TypeError(f"cmd must be a non-empty list of strings, got {cmd!r}")
        check_loopback(base)
        self.cmd, self.base, self.name = list(cmd), base.rstrip("/"), name
        self.url = self.base + "/v1"
        self.env = {**os.environ, **(env or {})}
        self.health, self.startup_timeout = health, float(startup_timeout)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"kvlib-{name.replace(' ', '-')}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def command(self) -> str:
        return shlex.join(self.cmd)

    def start(self) -> "ServerProcess":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True, preexec_fn=_die_with_parent)
        _LIVE.add(self)  # stopped at interpreter exit if nobody stopped it (a cell that raised, a test that failed)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it answered "
                                   f"{self.health}: {self.command}\n--- the end of its log ---\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if _get(self.base + self.health, timeout=2.0)[0] == 200:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not answer {self.base + self.health} within "
                                   f"{self.startup_timeout:.0f} s\n--- the end of its log ---\n{self.log_tail()}")
            time.sleep(0.25)
        self.startup_s = time.perf_counter() - t0
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int | None:
        """End the server's process group; returns its exit code (None if it was never started)."""
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # children left in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        _LIVE.discard(self)
        return self.proc.returncode

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self):
        return self.start() if not self.running() else self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self):
        state = "running" if self.running() else "stopped"
        return f"ServerProcess({self.name!r}, {self.base}, {state})"


def _thread_env(threads: int | None) -> dict:
    if threads is None:
        return {}
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
    return {"KVLIB_THREADS": str(threads), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def kvlib_server(model: str = "smollm2-135m-instruct", port: int | None = None, *, threads: int | None = 1,
                 host: str = "127.0.0.1", log_level: str = "warning", **flags) -> ServerProcess:
    """``python -m kvlib.serve`` in a subprocess. ``flags`` are its options with underscores
    (``num_blocks=512, max_num_seqs=16, max_batched_tokens=256, prefix_caching=False``...)."""
    port = free_port(host) if port is None else port
    cmd = [sys.executable, "-m", "kvlib.serve", "--model", model, "--host", host, "--port", str(port),
           "--log-level", log_level]
    for key, value in flags.items():
        opt = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(opt if value else "--no-" + key.replace("_", "-"))
        else:
            cmd += [opt, str(value)]
    return ServerProcess(cmd, f"http://{host}:{port}", name=f"kvlib.serve {model}", env=_thread_env(threads))


def transformers_server(model_dir: str | Path, port: int | None = None, *, threads: int | None = 1,
                        host: str = "127.0.0.1", continuous_batching: bool = True, block_size: int | None = 16,
                        num_blocks: int | None = None, max_batch_tokens: int | None = 256,
                        dtype: str = "float32", seed: int | None = 0) -> ServerProcess:
    """``transformers serve`` (transformers' own OpenAI-compatible server) on a local model folder
    (``write_model_dir``), on the CPU, with its continuous batching (``--continuous-batching`` and the
    ``--cb-*`` knobs named like kvlib's: block size, blocks, tokens per forward)."""
    exe = _command("transformers", "`pip install transformers` (5.x has `serve`)")
    port = free_port(host) if port is None else port
    cmd = [exe, "serve", str(model_dir), "--host", host, "--port", str(port), "--device", "cpu", "--dtype", dtype,
           "--log-level", "warning"]
    if continuous_batching:
        cmd.append("--continuous-batching")
        for opt, value in (("--cb-block-size", block_size), ("--cb-num-blocks", num_blocks),
                           ("--cb-max-batch-tokens", max_batch_tokens)):
            if value is not None:
                cmd += [opt, str(value)]
    if seed is not None:
        cmd += ["--default-seed", str(seed)]
    return ServerProcess(cmd, f"http://{host}:{port}", name="transformers serve",
                         env={**_thread_env(threads), **OFFLINE_ENV})


# --------------------------------------------------------------------------------------------
# The model and tokenizer in the Hugging Face layout
# --------------------------------------------------------------------------------------------


def _byte_level_unicode() -> dict[int, str]:
    """GPT-2's bytes -> printable characters map, so that a byte-level vocabulary has byte value = id."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _hf_tokenizer(tok):
    """A transformers ``PreTrainedTokenizerFast`` that encodes exactly as ``tok`` does."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tok, "backend", None)
    if backend is not None:  # kvlib.pretrained.Tokenizer: the same tokenizers.Tokenizer object
        names = {i: backend.id_to_token(i) for i in (tok.bos_id, tok.eos_id) if i is not None}
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=names.get(tok.bos_id),
                                     eos_token=names.get(tok.eos_id), pad_token=names.get(tok.eos_id))
        if tok.chat_template:
            hf.chat_template = tok.chat_template
        return hf
    if type(tok).__name__ == "ByteTokenizer":  # the tiny model's: id = UTF-8 byte value, 0 ends a text
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        chars = _byte_level_unicode()
        backend = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=chars[0], pad_token=chars[0])
    raise TypeError(f"tok must be kvlib's pretrained Tokenizer or ByteTokenizer, got {type(tok).__name__}")


def write_tokenizer_dir(tok, folder: str | Path) -> Path:
    """``tok`` as a Hugging Face tokenizer folder (``tokenizer.json``, ``tokenizer_config.json`` with the
    chat template): what GuideLLM's ``--tokenizer`` and ``transformers serve`` read. Checked: the folder
    encodes a test text to the same ids as ``tok``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = _hf_tokenizer(tok)
    hf.save_pretrained(str(folder))
    probe = "Why does ice float? 42 + 7 = 49, déjà vu."
    if hf.encode(probe, add_special_tokens=False) != tok.encode(probe):
        raise RuntimeError(f"the tokenizer written to {folder} does not encode like {tok!r}")
    return folder


def write_model_dir(model, tok, folder: str | Path) -> Path:
    """The model (``config.json`` + ``model.safetensors``, via ``kvlib.model.save_hf``) and its tokenizer
    in one folder: what ``transformers serve`` loads, offline, as a local model."""
    from ..model import save_hf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_hf(model, str(folder))
    write_tokenizer_dir(tok, folder)
    eos = getattr(tok, "eos_id", None)
    gen = {"do_sample": False, "eos_token_id": eos, "bos_token_id": getattr(tok, "bos_id", None)}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    return folder


# --------------------------------------------------------------------------------------------
# GuideLLM
# --------------------------------------------------------------------------------------------


def _kv(kind: str, **fields) -> str:
    parts = [f"kind={kind}"]
    for k, v in fields.items():
        if v is None:
            continue
        if "," in str(v) or "=" in str(v):
            raise ValueError(f"{k}={v!r}: GuideLLM's key=value options cannot hold ',' or '='")
        parts.append(f"{k}={v}")
    return ",".join(parts)


def guidellm_command(target: str, model: str, tokenizer_dir: str | Path, *, profile: str = "poisson",
                     rates: list[float] | None = None, seconds: float = 20.0,
                     max_requests: int | list[int] | None = None,
                     prompt_tokens: int = 64, output_tokens: int = 32, chat: bool = True,
                     slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None, sweep_size: int = 5,
                     max_concurrency: int | None = None, drop_ignore_eos: bool = False, body: dict | None = None,
                     seed: int = 0, json_path: str | Path = "guidellm.json", extra_outputs: tuple = ()) -> list[str]:
    """The ``guidellm run`` command line for one load run (a list, for ``subprocess``; ``shlex.join`` it
    to paste into a shell). ``target``: the server's base URL without ``/v1``.

    ``profile``: ``"synchronous"`` (one request at a time), ``"concurrent"`` (``rates`` = numbers of
    streams), ``"constant"`` / ``"poisson"`` (``rates`` = requests per second, evenly or exponentially
    spaced), ``"sweep"`` (GuideLLM finds the range itself: synchronous, throughput, then ``sweep_size - 2``
    rates between; ``max_concurrency`` caps its throughput step), ``"throughput"`` (everything at once).
    Each rate runs for ``seconds`` or ``max_requests``, whichever comes first: GuideLLM cancels what is still
    running when the time is up (``incomplete``), while after the last of ``max_requests`` it waits for every
    answer. ``max_requests`` may be one count per rate (e.g. ``[round(r * 10) for r in rates]``: about ten
    seconds of arrivals at each rate, every answer complete). ``slo_ttft_ms`` /
    ``slo_itl_ms`` make GuideLLM count SLO attainment: the share of requests whose TTFT and inter-token
    latency both met the targets (GuideLLM 0.8.1 compares ``slo.tpot_ms`` with each request's
    ``inter_token_latency_ms``: its mean gap between tokens, the first token excluded). ``body``: fields added to
    every request body (``{"temperature": 0}`` for greedy answers; numbers and booleans only, None drops
    the field); ``drop_ignore_eos`` is ``body={"ignore_eos": None}``.
    """
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    if profile in ("concurrent", "constant", "poisson"):
        if not rates or not all(isinstance(r, (int, float)) and r > 0 for r in rates):
            raise ValueError(f"profile {profile!r} needs rates: a list of positive numbers, got {rates!r}")
    elif rates:
        raise ValueError(f"profile {profile!r} takes no rates (got {rates!r})")
    if not (isinstance(seconds, (int, float)) and 0 < seconds <= 3600):
        raise ValueError(f"seconds must be a time bound in (0, 3600], got {seconds!r}")
    for name, v in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    backend = dict(target=target, model=model)
    if not chat:
        backend["request_format"] = "/v1/completions"
    backend_s = _kv("openai_http", **backend)
    fields = {**({"ignore_eos": None} if drop_ignore_eos else {}), **(body or {})}
    for key, value in fields.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(key)):
            raise ValueError(f"body keys must be plain field names, got {key!r}")
        if value is not None and (not isinstance(value, (bool, int, float)) or
                                  (isinstance(value, float) and not math.isfinite(value))):
            raise ValueError(f"body[{key!r}] must be a finite number, a bool or None, got {value!r}")
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else f"{value:g}"
        backend_s += f",extras.body.{key}={text}"
    prof = dict(sweep_size=sweep_size, max_concurrency=max_concurrency) if profile == "sweep" else {}
    cmd = ["guidellm", "run", "--backend", backend_s,
           "--tokenizer", _kv("huggingface_auto", model=str(tokenizer_dir)),
           "--data", _kv("synthetic_text", prompt_tokens=prompt_tokens, output_tokens=output_tokens),
           "--profile", _kv(profile, **prof),
           "--constraint", _kv("max_duration", seconds=seconds)]
    counts = None
    if max_requests is not None:
        counts = list(max_requests) if isinstance(max_requests, (list, tuple)) else [max_requests]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
            raise ValueError(f"max_requests must be an int >= 1 or a list of them, got {max_requests!r}")
        if len(counts) > 1 and len(counts) != len(rates or []):
            raise ValueError(f"max_requests has {len(counts)} counts for {len(rates or [])} rates: give one per rate")
        cmd += ["--constraint", _kv("max_requests", count=counts[0])]
    if rates:
        cmd += ["--override", "profile.streams" if profile == "concurrent" else "profile.rate",
                ",".join(f"{r:g}" for r in rates)]
    if counts and len(counts) > 1:  # constraints[1] is max_requests (constraints[0] is the time bound)
        cmd += ["--override", "constraints[1].count", ",".join(str(n) for n in counts)]
    if slo_ttft_ms is not None or slo_itl_ms is not None:
        cmd += ["--metrics", _kv("generative", **{"slo.ttft_ms": slo_ttft_ms, "slo.tpot_ms": slo_itl_ms})]
    cmd += ["--seed", _kv("static", value=seed), "--output", _kv("json", path=str(json_path))]
    for kind, path in extra_outputs:
        cmd += ["--output", _kv(kind, path=str(path))]
    return cmd + ["--disable-progress"]


_DONE_LINE = re.compile(r"Benchmark \d+ \(([^)]*)\): completed")


def run_guidellm(target: str, model: str, tokenizer_dir: str | Path, *, out_dir: str | Path | None = None,
                 allow_remote: bool = False, grace_s: float = 120.0, progress: bool = False, **kw) -> dict:
    """Run GuideLLM once (``guidellm_command``'s arguments) and return its JSON report (a dict).

    Bounded: the run ends after ``seconds`` per rate (GuideLLM stops it); this process kills GuideLLM
    if it is still alive ``grace_s`` seconds later. The report's path is ``report["_path"]`` and the exact
    command ``report["_command"]``. ``progress=True``: a ``tqdm.auto`` bar that moves as each rate ends.
    """
    if not allow_remote:
        check_loopback(target)
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="kvlib-guidellm-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    cmd = guidellm_command(target, model, tokenizer_dir, json_path=json_path, **kw)
    cmd[0] = _command("guidellm", "`pip install 'guidellm>=0.8.1,<0.9'` (it comes with `pip install -e '.[dev]'`, "
                               "which `make setup` runs)")
    rates = kw.get("rates") or [None] * (kw.get("sweep_size", 5) if kw.get("profile") == "sweep" else 1)
    budget = len(rates) * (kw.get("seconds", 20.0) + 15.0) + grace_s  # each rate: its window + start-up
    env = {**os.environ, **GUIDELLM_ENV}
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rates), desc=f"GuideLLM {kw.get('profile', 'poisson')}", unit="rate")
    lines: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            stdin=subprocess.DEVNULL, cwd=out_dir, errors="replace")
    killer = threading.Timer(budget, proc.kill)  # the bound holds even if GuideLLM stops printing
    killer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            m = _DONE_LINE.search(line)
            if bar is not None and m:
                bar.set_postfix_str(m.group(1))
                bar.update(1)
        proc.wait()
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if bar is not None:
            bar.close()
    log = "".join(lines)
    (out_dir / "guidellm.log").write_text(log)
    if time.perf_counter() - t0 >= budget:
        raise RuntimeError(f"GuideLLM ran past its budget of {budget:.0f} s and was killed: {shlex.join(cmd)}")
    if proc.returncode != 0 or not json_path.exists():
        tail = "\n".join(log.splitlines()[-30:])
        raise RuntimeError(f"GuideLLM failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}")
    report = json.loads(json_path.read_text())
    report["_bursts"] = _bursts(report)
    report["_path"], report["_command"], report["_wall_s"] = str(json_path), shlex.join(cmd), time.perf_counter() - t0
    return report


def _bursts(report: dict) -> list[float]:
    """Rates of a constant / Poisson run at which GuideLLM sent its requests far faster than asked.

    Seen with GuideLLM 0.8.1 on a loaded machine (several requests sent within milliseconds at 0.5 req/s).
    Its worker sends any request whose scheduled time has passed at once, so a worker that falls behind
    the schedule (it starts 1 s after it is set by default; ``GUIDELLM_ENV`` gives it 3) catches up in a
    burst. Two signs: more requests than the rate allows in the window (a time-bounded run), or, with a request
    count, the sends spread over less than a fifth of the time that count takes at that rate (for n >= 4
    Poisson arrivals that happens by chance less than 1% of the time). ``run_guidellm`` reports such rates
    in ``report["_bursts"]``; rerun them rather than plot them."""
    out = []
    for b in report.get("benchmarks", []):
        s = b["config"]["strategy"]
        if s.get("type_") not in ("constant", "poisson") or not s.get("rate"):
            continue
        rate = float(s["rate"])
        totals = b["metrics"].get("request_totals", {})
        sent = sum(int(totals.get(k, 0)) for k in ("successful", "errored", "incomplete"))
        starts = sorted(float(t) for t in _request_starts(b))
        too_many = sent > 1.5 * rate * float(b.get("duration") or 0) + 5
        too_close = len(starts) >= 4 and starts[-1] - starts[0] < 0.2 * (len(starts) - 1) / rate
        if too_many or too_close:
            out.append(rate)
    return out


def _request_starts(bench: dict):
    for kind in ("successful", "errored", "incomplete"):
        for req in (bench.get("requests") or {}).get(kind) or []:
            t = ((req.get("info") or {}).get("timings") or {}).get("request_start")
            if t is not None:
                yield t


def _pct(metrics: dict, name: str, q: str) -> float:
    try:
        return float(metrics[name]["successful"]["percentiles"][q])
    except (KeyError, TypeError, ValueError):
        return math.nan


def _mean(metrics: dict, name: str) -> float:
    try:
        return float(metrics[name]["successful"]["mean"])
    except (KeyError, TypeError, ValueError):
        return math.nan


def summarize(report: dict, server: str | None = None):
    """One row per benchmark (per rate) of a GuideLLM report, as a pandas DataFrame.

    Columns: ``strategy``, ``target`` (the rate asked for, req/s, or the streams), ``req_per_s`` and
    ``out_tok_per_s`` (achieved), ``concurrency`` (mean requests in flight), TTFT and ITL p50/p90/p99 in ms,
    ``latency_p50_s``, ``prompt_tokens`` and ``output_tokens`` (mean per successful request, as the server's
    ``usage`` counted them), the request counts (``ok``, ``errored``, ``incomplete``: cut off at the end of the
    window), ``arrival_per_s`` (the rate the requests were actually sent at: (n - 1) / the span of their
    send times), and ``slo_attainment_pct`` (GuideLLM's ``slo_attainment``: the share of requests that met
    the SLO, when one was set; errored ones count as misses). GuideLLM's ITL is per request (its mean gap
    between tokens); the percentiles are over those means, so a single long stall is averaged away
    (``vllm bench serve`` takes percentiles over every gap)."""
    import pandas as pd

    rows = []
    for b in report.get("benchmarks", []):
        s, m = b["config"]["strategy"], b["metrics"]
        totals = m.get("request_totals", {})
        target = s.get("rate") if s.get("rate") is not None else s.get("streams")
        row = dict(strategy=s.get("type_"), target=float(target) if target is not None else math.nan,
                   req_per_s=_mean(m, "requests_per_second"), out_tok_per_s=_mean(m, "output_tokens_per_second"),
                   concurrency=_mean(m, "request_concurrency"))
        for name, key in (("ttft", "time_to_first_token_ms"), ("itl", "inter_token_latency_ms")):
            for q in ("p50", "p90", "p99"):
                row[f"{name}_{q}_ms"] = _pct(m, key, q)
        row["latency_p50_s"] = _pct(m, "request_latency", "p50")
        row.update(prompt_tokens=_mean(m, "prompt_token_count"), output_tokens=_mean(m, "output_token_count"))
        row.update(ok=int(totals.get("successful", 0)), errored=int(totals.get("errored", 0)),
                   incomplete=int(totals.get("incomplete", 0)))
        starts = sorted(float(t) for t in _request_starts(b))
        row["arrival_per_s"] = (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 and \
            starts[-1] > starts[0] else math.nan
        row["slo_attainment_pct"] = _attainment(m.get("slo_attainment"))
        rows.append(row)
    df = pd.DataFrame(rows)
    if server is not None:
        df.insert(0, "server", server)
    return df


def _attainment(att) -> float:
    """GuideLLM's ``slo_attainment`` (the share of successful requests that met every target, 0..1) in %."""
    return 100.0 * float(att) if isinstance(att, (int, float)) else math.nan


def slo_break(df, column: str, limit: float, by: str = "target"):
    """The first ``by`` value (in increasing order) at which ``column`` exceeds ``limit``; None if never."""
    rows = df.sort_values(by)
    over = rows[rows[column] > limit]
    return None if over.empty else float(over[by].iloc[0])


# --------------------------------------------------------------------------------------------
# /metrics
# --------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {``name`` or ``name{labels}``: value}. Comments are skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def scrape_metrics(base: str, timeout: float = 2.0) -> dict[str, float]:
    """``GET base/metrics``, parsed."""
    status, body = _get(base.rstrip("/") + "/metrics", timeout)
    if status != 200:
        raise RuntimeError(f"{base}/metrics answered {status}: {body[:200]}")
    return parse_metrics(body)


class MetricsWatcher:
    """Samples ``base/metrics`` every ``period`` seconds in a daemon thread while the ``with`` block runs.

    ``frame()`` gives a DataFrame: ``t_s`` (seconds since the start), ``unix_s`` (the wall clock, to line
    samples up with a GuideLLM report's ``start_time`` / ``end_time``) and one column per metric in ``keep``
    (all ``kvlib_*`` gauges and counters by default; histogram buckets are left out)."""

    def __init__(self, base: str, period: float = 0.5, keep: tuple[str, ...] | None = None):
        check_loopback(base)
        self.base, self.period, self.keep = base, float(period), keep
        self.samples: list[dict] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self):
        t0 = time.perf_counter()
        while not self._stop.is_set():
            try:
                m = scrape_metrics(self.base)
            except (OSError, RuntimeError):
                self.errors += 1
            else:
                row = {"t_s": time.perf_counter() - t0, "unix_s": time.time()}
                for k, v in m.items():
                    if (self.keep is None and "_bucket{" not in k) or (self.keep and k in self.keep):
                        row[k] = v
                self.samples.append(row)
            self._stop.wait(self.period)

    def __enter__(self):
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvlib-metrics-watcher", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.samples)
