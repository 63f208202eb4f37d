"""kvlib.serve over real HTTP on 127.0.0.1: the official `openai` client, httpx for raw bodies and streams.

Every server is started by a fixture whose finalizer stops it, every client call has a timeout, and every
wait polls with a deadline: a broken server fails a test, it never hangs the suite.
"""

import asyncio
import copy
import json
import re
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvlib.corpus import ByteTokenizer  # noqa: E402
from kvlib.generate import generate  # noqa: E402
from kvlib.model import load_pretrained, load_tiny  # noqa: E402
from kvlib.serve import Server, TextStream  # noqa: E402

TIMEOUT = 30  # seconds, for any one HTTP call
NUM_BLOCKS, BLOCK_SIZE = 56, 16  # 896 positions: less than the tiny model's context of 1,024
PROMPTS = ['def read(path):\n    """Return', "class Stack:\n    ", "import os\n\n", 'The file "', "x = [1, 2",
           "for i in range(", "# Compute the", "Return a new"]


@pytest.fixture(scope="module")
def tiny():
    return load_tiny(device="cpu")


def start(model, tok, name="tiny", **kw):
    kw = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=16, max_batched_tokens=256) | kw
    server = Server(model, tok, name, **kw)
    server.start("127.0.0.1", 0)
    return server


@pytest.fixture(scope="module")
def server(tiny):
    s = start(*tiny)
    yield s
    s.stop()


@pytest.fixture
def fresh(tiny, request):
    """A server of its own on a copy of the model (the test may break its forward)."""
    model, tok = tiny
    servers = []

    def make(**kw):
        servers.append(start(copy.deepcopy(model), tok, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=TIMEOUT)


def root(server):
    return server.url.removesuffix("/v1")


def metrics(server) -> dict:
    """/metrics as {name or name{labels}: value}."""
    text = httpx.get(root(server) + "/metrics", timeout=TIMEOUT).text
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")}


def wait_idle(server, timeout=10.0) -> dict:
    """Poll /metrics until no request runs or waits and no block is held by one (cached ones are fine)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["kvlib_kv_blocks_used"] == 0 and m["kvlib_num_requests_running"] == 0 \
                and m["kvlib_num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"the pool still holds blocks after {timeout} s: {m}"
        time.sleep(0.02)


_solo = {}


def solo(model, tok, prompt_ids, n):
    """The greedy answer of kvlib.generate.generate alone, cut after the end-of-text token as the server stops."""
    key = (id(model), tuple(prompt_ids), n)
    if key not in _solo:
        out = generate(model, [prompt_ids], n, eos_id=tok.eos_id)[0].tolist()
        _solo[key] = out[: out.index(tok.eos_id) + 1] if tok.eos_id in out else out
    return _solo[key]


def sse_events(response) -> list:
    """The `data:` payloads of a server-sent-event stream, checking the framing on the way."""
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: ") and "\n" not in block, repr(block)
            events.append(block[len("data: "):])
    return events


# ---- the endpoints ------------------------------------------------------------------------


def test_models_health_and_metrics_format(server):
    prometheus_parser = pytest.importorskip("prometheus_client.parser")
    assert httpx.get(root(server) + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    r = httpx.get(root(server) + "/metrics", timeout=TIMEOUT)
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(r.text)}
    for name in ("kvlib_num_requests_running", "kvlib_num_requests_waiting", "kvlib_kv_blocks_used",
                 "kvlib_kv_blocks_total", "kvlib_kv_blocks_cached", "kvlib_prefix_cache_hit_rate",
                 "kvlib_num_preemptions", "kvlib_requests_finished", "kvlib_time_to_first_token_seconds",
                 "kvlib_inter_token_latency_seconds"):
        assert name in families, name
    assert families["kvlib_time_to_first_token_seconds"].type == "histogram"
    assert metrics(server)["kvlib_kv_blocks_total"] == NUM_BLOCKS


def test_completion_is_token_identical_to_generate(server, tiny):
    model, tok = tiny
    ids = tok.encode(PROMPTS[0])
    want = solo(model, tok, ids, 24)
    r = client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                          extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.token_ids == want and c.prompt_token_ids == ids
    assert c.text == tok.decode(want) and c.finish_reason == ("stop" if want[-1] == tok.eos_id else "length")
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny" and r.created > 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(ids), len(want), len(ids) + len(want))
    # the prompt as token ids gives the same answer
    r2 = client(server).completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert r2.choices[0].text == c.text
    wait_idle(server)


def test_streamed_completion_is_token_identical_and_in_openai_format(server, tiny):
    model, tok = tiny
    ids = tok.encode(PROMPTS[1])
    want = solo(model, tok, ids, 20)
    chunks = list(client(server).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                                    stream=True, extra_body={"return_token_ids": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == tok.decode(want)
    assert [t for ch in chunks for t in (ch.choices[0].token_ids or [])] == want
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].choices[0].text == ""
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("cmpl-")

    # the raw bytes: data: {json} blocks, then data: [DONE]; usage last with include_usage
    body = dict(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True,
                stream_options={"include_usage": True})
    r = httpx.post(server.url + "/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert all(o["object"] == "text_completion" and o["model"] == "tiny" for o in objs)
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == len(want)
    assert objs[-2]["choices"][0]["finish_reason"] is not None
    assert "".join(o["choices"][0]["text"] for o in objs[:-1]) == tok.decode(want)
    wait_idle(server)


def test_32_concurrent_clients_each_get_their_solo_answer(fresh, tiny):
    model, tok = tiny
    server = fresh(num_blocks=10)  # room for 2 or 3 of the 16 running requests at their longest: preemptions
    jobs = [(PROMPTS[i % len(PROMPTS)] + "abcdefgh"[: i // len(PROMPTS)], 8 + (i * 5) % 17, i % 2 == 0)
            for i in range(32)]
    c = client(server)

    def ask(job):
        prompt, n, stream = job
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=stream,
                                 extra_body={"return_token_ids": True})
        if stream:
            return [t for ch in r for t in (ch.choices[0].token_ids or [])]
        return r.choices[0].token_ids

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, jobs, timeout=60))
    for (prompt, n, _), out in zip(jobs, got):
        assert out == solo(model, tok, tok.encode(prompt), n), prompt
    m = wait_idle(server)
    assert m["kvlib_num_preemptions_total"] > 0 and m["kvlib_kv_blocks_total"] == 10


def test_stop_strings_cut_the_text_streamed_or_not(server, tiny):
    model, tok = tiny
    prompt = PROMPTS[0]
    full = tok.decode(solo(model, tok, tok.encode(prompt), 40))
    stop = full[6:9]  # a piece from the middle of the greedy answer
    want = full[: full.find(stop)]
    c = client(server)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x01never"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    pieces = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=40,
                                                                 temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == want  # nothing past the stop string ever left the server
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop="\x01never")
    assert r.choices[0].text == tok.decode(solo(model, tok, tok.encode(prompt), 12))
    wait_idle(server)


def test_seeded_sampling_is_reproducible(server):
    c = client(server)
    kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0.9, seed=123, extra_body={"top_k": 40})
    a, b = (c.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    # a temperature too small to divide by (logits / 1e-30 overflows to inf, then NaN probabilities, which
    # would fail the whole engine step) is greedy, as in vLLM
    tiny_t = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=1e-30)
    greedy = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=0)
    assert tiny_t.choices[0].text == greedy.choices[0].text


# ---- disconnects free the blocks ------------------------------------------------------------


def test_a_disconnect_mid_stream_frees_the_blocks(server):
    before = wait_idle(server)
    body = dict(model="tiny", prompt=PROMPTS[3], max_tokens=700, temperature=0, stream=True, ignore_eos=True)
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", server.url + "/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    assert metrics(server)["kvlib_kv_blocks_used"] > 0  # it runs while we read
                    break  # leaving the line iterator closes the connection mid-stream (httpx)
    after = wait_idle(server)
    assert after['kvlib_requests_finished_total{finish_reason="abort"}'] \
        == before['kvlib_requests_finished_total{finish_reason="abort"}'] + 1


def test_a_client_that_gives_up_on_a_non_streamed_request_frees_the_blocks(server):
    before = wait_idle(server)
    body = dict(model="tiny", prompt=PROMPTS[4], max_tokens=800, temperature=0, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=0.5))
    after = wait_idle(server)
    assert after['kvlib_requests_finished_total{finish_reason="abort"}'] \
        == before['kvlib_requests_finished_total{finish_reason="abort"}'] + 1


# ---- bad requests ----------------------------------------------------------------------------

GOOD = dict(model="tiny", prompt="def f(x):", max_tokens=4, temperature=0)
BAD = {  # name: (path, body or raw bytes, the param the error names)
    "not JSON": ("completions", b"{not json", None),
    "NaN is not JSON": ("completions", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', None),
    "not an object": ("completions", b"[1, 2]", None),
    "no model": ("completions", {"prompt": "a"}, "model"),
    # an unknown model is a 404 as in vLLM (tests/test_serve_hardening.py)
    "no prompt": ("completions", {"model": "tiny"}, "prompt"),
    "empty prompt": ("completions", GOOD | {"prompt": ""}, "prompt"),
    "empty id list": ("completions", GOOD | {"prompt": []}, "prompt"),
    "id outside vocab": ("completions", GOOD | {"prompt": [1, 2, 256]}, "prompt"),
    "two prompts": ("completions", GOOD | {"prompt": ["a", "b"]}, "prompt"),
    "past the context": ("completions", GOOD | {"prompt": [65] * 1020, "max_tokens": 16}, "max_tokens"),
    "prompt alone past the context": ("completions", GOOD | {"prompt": [65] * 1100}, "prompt"),
    "past the pool": ("completions", GOOD | {"prompt": [65] * 850, "max_tokens": 60}, "max_tokens"),
    "max_tokens 0": ("completions", GOOD | {"max_tokens": 0}, "max_tokens"),
    "max_tokens a string": ("completions", GOOD | {"max_tokens": "5"}, "max_tokens"),
    "max_tokens a float": ("completions", GOOD | {"max_tokens": 4.5}, "max_tokens"),
    "negative temperature": ("completions", GOOD | {"temperature": -0.5}, "temperature"),
    "temperature above 2": ("completions", GOOD | {"temperature": 2.5}, "temperature"),
    "n 2": ("completions", GOOD | {"n": 2}, "n"),
    "best_of 3": ("completions", GOOD | {"best_of": 3}, "best_of"),
    "top_p": ("completions", GOOD | {"top_p": 0.9}, "top_p"),
    "top_k 0": ("completions", GOOD | {"top_k": 0}, "top_k"),
    "negative seed": ("completions", GOOD | {"seed": -1}, "seed"),
    "logprobs": ("completions", GOOD | {"logprobs": 2}, "logprobs"),
    "echo": ("completions", GOOD | {"echo": True}, "echo"),
    "penalty": ("completions", GOOD | {"presence_penalty": 0.5}, "presence_penalty"),
    "empty stop": ("completions", GOOD | {"stop": [""]}, "stop"),
    "five stops": ("completions", GOOD | {"stop": list("abcde")}, "stop"),
    "stream not a bool": ("completions", GOOD | {"stream": "yes"}, "stream"),
    "stream_options without stream": ("completions", GOOD | {"stream_options": {"include_usage": True}},
                                      "stream_options"),
    "no chat template": ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                         "messages"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_requests_are_400_and_the_next_good_one_succeeds(server, name):
    path, body, param = BAD[name]
    raw = isinstance(body, bytes)
    kw = dict(content=body, headers={"content-type": "application/json"}) if raw else dict(json=body)
    r = httpx.post(f"{server.url}/{path}", timeout=TIMEOUT, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and len(err["message"]) > 10
    ok = httpx.post(server.url + "/completions", json=GOOD, timeout=TIMEOUT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_openai_client_sees_bad_requests_as_bad_request_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        c.completions.create(model="tiny", prompt="a" * 1000, max_tokens=100)
    assert httpx.get(root(server) + "/nowhere", timeout=TIMEOUT).json()["error"]["type"] == "not_found_error"
    wait_idle(server)


# ---- a load run --------------------------------------------------------------------------------


def test_a_load_run_ends_with_the_pool_empty_and_no_error(server):
    n_requests, concurrency = 300, 48
    before = wait_idle(server)

    async def run():
        c = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=TIMEOUT)
        gate = asyncio.Semaphore(concurrency)

        async def one(i):
            async with gate:
                kw = dict(model="tiny", prompt=PROMPTS[i % len(PROMPTS)] + str(i), max_tokens=1 + i % 6,
                          temperature=(i % 3) * 0.5, seed=i)
                if i % 2:
                    return "".join([ch.choices[0].text async for ch in await c.completions.create(**kw, stream=True)
                                    if ch.choices])
                return (await c.completions.create(**kw)).choices[0].text

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n_requests))), 90)
        finally:
            await c.close()

    t0 = time.perf_counter()
    texts = asyncio.run(run())
    assert len(texts) == n_requests and time.perf_counter() - t0 < 90
    after = wait_idle(server)
    ended = [f'kvlib_requests_finished_total{{finish_reason="{k}"}}' for k in ("stop", "length")]
    finished = sum(after[k] - before[k] for k in ended)
    assert finished == n_requests
    assert after["kvlib_engine_step_errors_total"] == before["kvlib_engine_step_errors_total"]
    assert after['kvlib_requests_finished_total{finish_reason="error"}'] == 0
    assert after["kvlib_time_to_first_token_seconds_count"] - before["kvlib_time_to_first_token_seconds_count"] \
        == n_requests
    assert after["kvlib_prefix_cache_hit_rate"] > 0  # the prompts share their beginnings


# ---- failures inside the engine --------------------------------------------------------------


def test_a_failing_step_is_retried_then_fails_only_its_requests(fresh, tiny, monkeypatch):
    model, tok = tiny
    s = fresh(max_step_failures=3)
    m = s.engine.model
    forward, fails = m.forward, {"left": 0}

    def flaky(*a, **kw):
        if fails["left"]:
            fails["left"] -= 1
            raise RuntimeError("injected fault")
        return forward(*a, **kw)

    monkeypatch.setattr(m, "forward", flaky)
    c = client(s)
    ids = tok.encode(PROMPTS[5])
    fails["left"] = 2  # twice in a row: retried, the request never notices
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                             extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == solo(model, tok, ids, 10)
    fails["left"] = 10 ** 6  # the same step keeps failing: a 500, the request aborted (the exception's text
    # stays in the server's log: an error body never echoes it)
    with pytest.raises(openai.InternalServerError, match="failed 3 steps in a row") as err:
        c.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert "injected fault" not in str(err.value)
    stream = c.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, stream=True)
    with pytest.raises(openai.APIError, match="failed 3 steps in a row"):
        list(stream)
    fails["left"] = 0
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                             extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == solo(model, tok, ids, 10)  # and it keeps serving
    after = wait_idle(s)
    assert after["kvlib_engine_step_errors_total"] >= 2 + 3 + 3  # retried twice, then 3 failures each for two
    assert after['kvlib_requests_finished_total{finish_reason="error"}'] == 2
    assert httpx.get(root(s) + "/health", timeout=TIMEOUT).status_code == 200


def test_stop_aborts_what_is_running_and_frees_the_pool(fresh):
    s = fresh()
    url, engine = s.url, s.engine
    body = dict(model="tiny", prompt=PROMPTS[6], max_tokens=800, temperature=0, ignore_eos=True)
    result = {}

    def ask():
        try:
            result["r"] = httpx.post(url + "/completions", json=body, timeout=TIMEOUT)
        except httpx.HTTPError as err:
            result["r"] = err

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.monotonic() + 10
    while not metrics(s)["kvlib_num_requests_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s.stop()
    t.join(TIMEOUT)
    assert not t.is_alive()
    r = result["r"]
    assert isinstance(r, httpx.HTTPError) or (r.status_code == 503 and r.json()["error"]["type"] == "server_error")
    assert not engine.has_unfinished() and engine.cache.num_available == NUM_BLOCKS
    assert s.port is None  # and a second stop is harmless
    s.stop()


# ---- text streaming ---------------------------------------------------------------------------


def test_text_stream_never_splits_a_character_nor_passes_a_stop_string():
    tok = ByteTokenizer()
    text = "héllo 🙂 wörld, END here"
    stream = TextStream(tok, stop=["END", "🙂x"])
    out = [stream.add([b]) for b in text.encode()]
    assert "".join(out) == "héllo 🙂 wörld, " and all("\ufffd" not in o for o in out)
    assert stream.finish("héllo 🙂 wörld, ") == ""
    s2 = TextStream(tok)
    assert "".join(s2.add([b]) for b in "€€".encode()) + s2.finish() == "€€"
    s3 = TextStream(tok, stop=["\n\n"])
    assert s3.add(list(b"a\n")) == "a" and s3.finish("a\n") == "\n"  # the tail is sent when nothing stopped


# ---- chat on a real chat model ----------------------------------------------------------------


def test_chat_completions_on_smollm2():
    model, tok = load_pretrained("smollm2-135m-instruct", device="cpu")
    s = start(model, tok, "smollm2", num_blocks=16, max_num_seqs=2, max_batched_tokens=64)
    try:
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tok.chat(msgs)
        want = solo(model, tok, ids, 8)
        c = client(s)
        r = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.choices[0].message.role == "assistant" and r.choices[0].token_ids == want
        assert r.choices[0].message.content == tok.decode(want) and r.usage.prompt_tokens == len(ids)
        chunks = list(c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0,
                                                stream=True))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == tok.decode(want)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError, match="messages"):
            c.chat.completions.create(model="smollm2", messages="hi", max_tokens=4)
        wait_idle(s)
    finally:
        s.stop()


# ---- the command line ----------------------------------------------------------------------------


def test_the_command_line_serves_until_ctrl_c():
    cmd = [sys.executable, "-m", "kvlib.serve", "--model", "tiny", "--port", "0", "--num-blocks", "32",
           "--max-num-seqs", "4", "--max-batched-tokens", "64", "--log-level", "warning", "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, url, seen = time.monotonic() + 60, None, []
        while url is None:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, f"no server line from {' '.join(cmd)}: {seen}"
            if select.select([proc.stdout], [], [], left)[0]:
                seen.append(proc.stdout.readline())
                m = re.search(r"on (http://\S+/v1)", seen[-1])
                url = m and m.group(1)
        r = httpx.post(url + "/completions", json=GOOD, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
