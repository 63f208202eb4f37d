"""Known wrong answers to lab 10's exercises (HTTP serving: a stream's two ends): see kvlib.course.mistakes."""

from __future__ import annotations

import copy
import json
import random


__all__ = ['sse_transcript', 'sse_reference', 'read_sse', 'collect_transcript', 'collect_reference', 'collect',
           'stream_transcript', 'stream_reference', 'stream_events', 'verdict_lines', 'verdict_rules']

# --------------------------------------------------------------------------------------------
# Lab 10 · HTTP serving: a stream's two ends
# --------------------------------------------------------------------------------------------
# Results here are transcripts (lists of text lines) for kvlib.course.check.check_lines: what a parser read,
# what a stream generator sent and called. A learner's exception is part of the transcript ("raised
# KeyError"), except NotImplementedError (an exercise not written yet), which goes through.


def _sse_splits(raw: str) -> dict:
    """The network's ways of cutting a stream into chunks: whole, one character each, at random points."""
    rng = random.Random(len(raw))  # the same cuts on every run
    cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, max(1, len(raw) // 6))))
    return {"in one chunk": [raw], "a character at a time": list(raw),
            "cut at random points": [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]}


def _payload(obj) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False)


def sse_transcript(read_sse, cases) -> list[str]:
    """What ``read_sse`` reads from each case, cut three ways; cases: {name: (raw text, ...)}."""
    lines = []
    for name, (raw, *_) in cases.items():
        for split, chunks in _sse_splits(raw).items():
            where = f"{name}, {split}:"
            try:
                for event in read_sse(iter(chunks)):
                    lines.append(f"{where} {_payload(event)}")
                lines.append(f"{where} ended")
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - a wrong parser's error is part of its answer
                lines.append(f"{where} raised {_parser_error(err)}")
    return lines


def _parser_error(err) -> str:
    """RuntimeError (the spec's), JSONDecodeError (data that is not JSON), or any other, as one kind: which
    other error a wrong parser raises depends on how it was written, not on the mistake."""
    if isinstance(err, RuntimeError):
        return "RuntimeError"
    if isinstance(err, json.JSONDecodeError):
        return "JSONDecodeError"
    return "an error of its own (not RuntimeError)"


def sse_reference(cases) -> list[str]:
    """The transcript a right parser gives: cases {name: (raw text, expected payloads, "ended" or "raised ...")}."""
    lines = []
    for name, (raw, payloads, ending) in cases.items():
        for split in _sse_splits(raw):
            lines += [f"{name}, {split}: {_payload(p)}" for p in payloads] + [f"{name}, {split}: {ending}"]
    return lines


def _read_sse(chunks, *, buffered=True, per_line=False, space=False, done=True, error=True, cut=True, crlf=True,
              empty=False):
    """An SSE reader with one mistake switched on (the right one with none)."""
    buffer, data = "", []

    def lines_of(chunk):
        nonlocal buffer
        if not buffered:  # each chunk on its own, its last piece taken as a whole line
            return chunk.splitlines()
        buffer += chunk
        *whole, buffer = buffer.split("\n")
        return whole

    def dispatch(payload):
        if done and payload == "[DONE]":
            return "done"
        event = json.loads(payload)
        if error and "error" in event:
            raise RuntimeError(f"the server sent an error: {event['error']}")
        return event

    for chunk in chunks:
        for line in lines_of(chunk):
            if crlf:
                line = line.removesuffix("\r")
            if line == "":
                if data or empty:
                    out, data = dispatch("\n".join(data)), []
                    if out == "done":
                        return
                    yield out
            elif not line.startswith(":"):
                if space:
                    field, value = ("data", line[6:]) if line.startswith("data: ") else (None, "")
                else:
                    field, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                if field == "data":
                    if per_line:  # each data line taken as a whole event
                        out = dispatch(value)
                        if out == "done":
                            return
                        yield out
                    else:
                        data.append(value)
    if cut:
        raise RuntimeError("the stream ended before data: [DONE]")


def read_sse(cases):
    """cases: {name: (raw text, ...)}; the transcripts of the usual wrong SSE readers."""
    def each(**mistake):
        return lambda: sse_transcript(lambda chunks: _read_sse(chunks, **mistake), cases)

    return {
        "each network chunk was split into lines on its own: a chunk can end in the middle of a line or an event, "
        "so keep what is left after the last newline and put the next chunk after it": each(buffered=False),
        "each data: line was taken as a whole event: an event ends at a blank line, and its data lines join with "
        "\"\\n\" between them": each(per_line=True),
        "only \"data: \" with a space was read: the space after the colon is optional (\"data:x\" is data x)": each(
            space=True),
        "data: [DONE] was read as JSON: it is not an event but the end of the stream; stop there": each(done=False),
        "an error event was passed on as a chunk: {\"error\": ...} means the server gave up on the request; raise "
        "RuntimeError with its message": each(error=False),
        "a stream cut off before [DONE] ended quietly: without [DONE] the answer is incomplete; raise RuntimeError "
        "when the chunks run out": each(cut=False),
        "the \\r of a CRLF line end was kept: a line \"\\r\" is blank too, strip one \\r before the \\n": each(
            crlf=False),
        "a blank line with no data before it was taken as an event: keep-alive blank lines dispatch nothing": each(
            empty=True),
    }


def collect_transcript(collect, cases) -> list[str]:
    """What ``collect`` makes of each case's events; cases: {name: (events, ...)}."""
    lines = []
    for name, (events, *_) in cases.items():
        try:
            out = collect(copy.deepcopy(events))
        except NotImplementedError:
            raise
        except Exception as err:  # noqa: BLE001
            lines.append(f"{name}: raised {type(err).__name__}")
            continue
        if not isinstance(out, dict):
            lines.append(f"{name}: returned a {type(out).__name__}, not a dict")
            continue
        lines += [f"{name}: {key} {out.get(key)!r}" for key in ("text", "token_ids", "finish_reason")]
    return lines


def collect_reference(cases) -> list[str]:
    """cases: {name: (events, {"text": ..., "token_ids": ..., "finish_reason": ...})}."""
    return [f"{name}: {key} {want[key]!r}" for name, (_, want) in cases.items()
            for key in ("text", "token_ids", "finish_reason")]


def _collect(events, *, chat=True, first=False, content_key=False, skip_empty=False, join=True):
    text, ids, finish = "", [], None
    for event in events:
        for choice in [event["choices"][0]] if first else event["choices"]:
            if "delta" in choice and chat:
                piece = choice["delta"]["content"] if content_key else choice["delta"].get("content")
            else:
                piece = choice.get("text")
            piece = piece or ""
            if skip_empty and not piece:
                continue
            text = text + piece if join else piece
            ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
    return {"text": text, "token_ids": ids, "finish_reason": finish}


def collect(cases):
    """cases: {name: (events, expected)}; the transcripts of the usual wrong ways to put an answer together."""
    def each(**mistake):
        return lambda: collect_transcript(lambda events: _collect(events, **mistake), cases)

    return {
        "a chat chunk's text was looked for in choice[\"text\"]: chat chunks carry it in "
        "choice[\"delta\"][\"content\"]": each(chat=False),
        "choice[\"delta\"][\"content\"] was read on a chunk without it: the last chat chunk's delta is {}, use "
        ".get(\"content\")": each(content_key=True),
        "event[\"choices\"][0] was read on the usage chunk, whose choices are []: loop over the choices": each(
            first=True),
        "the chunks without text were skipped, and their token ids with them: a piece of a character has ids but "
        "no text yet": each(skip_empty=True),
        "each piece replaced the text so far: the pieces are deltas, join them": each(join=False),
    }


# The scenarios of stream_events: (name, engine messages, reader). A message None means "the client left";
# after the last message the engine sends nothing more (next_message waits). The reader takes every event
# ("all"), or ("close", n): n events, then aclose() (the server stopped iterating), or ("cancel", n): n
# events, then the task is cancelled while the generator waits (what Starlette does on a disconnect).


def stream_transcript(stream_events, scenarios, make_detok, timeout=2.0) -> list[str]:
    """What ``stream_events`` sends and calls in each scenario (run in a thread with its own event loop)."""
    import asyncio
    import concurrent.futures
    import inspect

    def framed(event):
        if not isinstance(event, str) or not event.startswith("data: ") or not event.endswith("\n\n") \
                or "\n" in event[:-2]:
            return (f"sent {event!r:.120}, not an event: send \"data: \" + the JSON + a blank line "
                    "(\"\\n\\n\"), on one line")
        payload = event[len("data: "):-2]
        if payload == "[DONE]":
            return "sent [DONE]"
        try:
            return f"sent {_payload(json.loads(payload))}"
        except ValueError:
            return f"sent {event!r:.120}, whose data is not JSON"

    async def run(messages, reader):
        log, queue = [], list(messages)

        async def next_message():
            await asyncio.sleep(0)  # a real await: the loop (and a timeout) can run
            if queue and queue[0] is None:
                return None  # the client left, and stays gone
            if queue:
                return queue.pop(0)
            await asyncio.Event().wait()  # the engine has nothing more: wait until cancelled

        def make_chunk(text=None, ids=None, finish=None, first=False):  # its arguments, those that are given
            given = dict(text=text, ids=ids, finish=finish, first=first)
            return {k: v for k, v in given.items() if v is not None and v is not False}

        gen = stream_events(next_message, make_detok(), make_chunk, lambda: log.append("abort()"))
        if inspect.iscoroutine(gen):  # no yield in it: the stub, or a coroutine by mistake
            await gen
            return log + ["returned without sending anything: stream_events must be an async generator (yield)"]
        kind, n = (reader, None) if reader == "all" else reader
        got = asyncio.Event()

        async def consume():
            async for event in gen:
                log.append(framed(event))
                if n is not None and sum(line.startswith("sent") for line in log) >= n:
                    got.set()
                    if kind == "close":
                        return
            log.append("the generator ended")

        task, waiter = asyncio.ensure_future(consume()), asyncio.ensure_future(got.wait())
        await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            err = task.exception()
            if isinstance(err, NotImplementedError):
                raise err
            if err is not None:
                log.append(f"raised {type(err).__name__}")
            elif kind == "close" and got.is_set():
                await gen.aclose()  # the server stopped iterating: the generator is closed at its yield
                log.append("closed by the reader")
        elif kind == "cancel" and got.is_set():
            await asyncio.sleep(0.01)  # let it wait for the engine again
            task.cancel()  # what Starlette does to the response task when the client disconnects
            try:
                await task
            except asyncio.CancelledError:
                log.append("cancelled while waiting")
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001
                log.append(f"raised {type(err).__name__}")
        else:
            task.cancel()
            log.append(f"still running after {timeout:g} s")
        return log

    lines = []
    for name, messages, reader in scenarios:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # Jupyter's own loop is running in this thread
            log = pool.submit(asyncio.run, run(messages, reader)).result()
        lines += [f"{name}: {line}" for line in log]
    return lines


async def _stream_events(next_message, detok, make_chunk, abort, *, in_finally=True, on_none=True, always=False,
                         rest=True, done=True, error=True, opening=True, empty=True, empty_rest=False):
    """stream_events with one mistake switched on (the right one with none)."""
    finished = False

    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"

    try:
        if opening:
            yield sse(make_chunk(first=True))
        while True:
            msg = await next_message()
            if msg is None:
                if on_none and not in_finally:
                    abort()
                return
            if msg[0] == "tokens":
                piece = detok.add(msg[1])
                if piece or empty:
                    yield sse(make_chunk(text=piece, ids=msg[1]))
            elif msg[0] == "finish":
                finished = True
                _, reason, final, _ = msg
                tail = detok.finish(final)
                if rest and (tail or empty_rest):
                    yield sse(make_chunk(text=tail))
                yield sse(make_chunk(finish=reason))
                break
            elif msg[0] == "error":
                finished = True
                if error:
                    yield sse(msg[1].body())
                break
        if done:
            yield "data: [DONE]\n\n"
    finally:
        if in_finally and (always or not finished):
            abort()


def stream_events(scenarios, make_detok):
    """The transcripts of the usual wrong stream generators over the lab's scenarios."""
    def each(**mistake):
        def wrong(next_message, detok, make_chunk, abort):
            return _stream_events(next_message, detok, make_chunk, abort, **mistake)

        return lambda: stream_transcript(wrong, scenarios, make_detok)

    return {
        "abort() is called only when next_message() returns None, not in a finally: block: a client that leaves "
        "while the generator waits or yields cancels or closes it there, and the request keeps its blocks": each(
            in_finally=False),
        "abort() is never called: when the client leaves, the engine goes on computing tokens nobody reads, "
        "and the request holds its blocks until max_tokens": each(in_finally=False, on_none=False),
        "abort() is called after the request finished: a finished (or failed) request has already left the "
        "engine; abort only one that is still running": each(always=True),
        "the rest of the text (detok.finish(final)) is never sent: what detok held back, e.g. the start of a "
        "stop string that never came, is lost": each(rest=False),
        "no data: [DONE] at the end: a client cannot tell a finished stream from one cut off": each(done=False),
        "an error message is not sent on: the client must get the error event (err.body()), then [DONE]": each(
            error=False),
        "no opening chunk: first send make_chunk(first=True) (in a chat it carries the role)": each(opening=False),
        "a tokens message whose text is empty was not sent: its chunk still carries the token ids": each(
            empty=False),
        "the rest was sent even when it was empty: send detok.finish(final) only when there is some": each(
            empty_rest=True),
    }


def stream_reference(scenarios, make_detok) -> list[str]:
    """The transcript of a right stream_events over the lab's scenarios."""
    return stream_transcript(_stream_events, scenarios, make_detok)




# --------------------------------------------------------------------------------------------
# Exercise 4, the decision: is a difference between two servers real?
# --------------------------------------------------------------------------------------------
# A case is (trials of server A, trials of server B, lower_is_better). The chapter's rule: a server is ahead only
# if every one of its trials beats every trial of the other; otherwise no verdict. The usual wrong rules below each
# give their own set of answers; the checker names the rule whose answers are the learner's.


def verdict_lines(cases, answers) -> list[str]:
    """One line per case: its name and the answer ("A", "B" or "no verdict")."""
    return [f"{name}: {answers[name]}" for name in cases]


def _better(x: float, y: float, lower: bool) -> str:
    if x == y:
        return "no verdict"
    return "A" if (x < y) == lower else "B"


def _rule(case, how: str) -> str:
    a, b, lower = case
    if how == "means":
        return _better(sum(a) / len(a), sum(b) / len(b), lower)
    if how == "first trial":
        return _better(a[0], b[0], lower)
    if how == "best trials":
        best = min if lower else max
        return _better(best(a), best(b), lower)
    if how == "higher is better":
        lower = False
    elif how == "lower is better":
        lower = True
    sa, sb = ([-x for x in a], [-x for x in b]) if lower else (list(a), list(b))
    if min(sa) > max(sb):
        return "A"
    if min(sb) > max(sa):
        return "B"
    return "no verdict"


def verdict_rules(cases):
    """The answers of the usual wrong rules over the cases, as check_lines' mistakes."""
    def each(how):
        return lambda: verdict_lines(cases, {name: _rule(c, how) for name, c in cases.items()})

    return {
        "you compared the means of the trials: a mean always picks a side, even when the trials of the two servers "
        "interleave and another run could flip it": each("means"),
        "you compared the first trial of each server only: one trial cannot tell a difference from the noise "
        "between runs": each("first trial"),
        "you compared each server's best trial: the best run of each says nothing about the runs in between, "
        "which overlap": each("best trials"),
        "you read every metric as higher-is-better: for a latency (TTFT, ITL), lower is better": each(
            "higher is better"),
        "you read every metric as lower-is-better: for a throughput (tokens/s), higher is better": each(
            "lower is better"),
    }
