"""What ``kvlib.serve`` checks before a request costs it anything: the limits that let a server survive its
clients (chapter 10).

- **The body**: JSON in UTF-8, an object, nested at most ``MAX_JSON_DEPTH`` deep, no lone surrogate
  (``"\\ud800"`` is valid JSON but no valid text: it cannot be encoded, tokenized or sent back);
  ``parse_json_object`` answers each with a 400 that names what is wrong, never with Python's own
  exception text.
- **A cheap bound on the prompt's length**, before encoding it: a byte-level tokenizer's token never
  covers more than ``max_token_bytes(tokenizer)`` bytes of the text, so a text of ``n`` bytes holds at
  least ``ceil(n / that)`` tokens (``min_tokens``). When even that lower bound is past the context the
  request is refused without tokenizing it; the exact count comes after encoding.
- **Encoding off the event loop and off the GIL**: ``encode`` runs in a worker thread, and for the
  ``tokenizers``-backed SmolLM2 tokenizer it calls ``encode_batch``, which releases the GIL while the
  Rust code works (``encode`` keeps it: a 1 MB prompt held every other Python thread for half a second).
  ``encode_bounded`` stops counting a long text's slices once they pass twice the context, so the work a
  prompt can cost is bounded by the context, not by the body (two 600 kB prompts no longer hold the pool).
- **Connections**: ``timed_protocol`` adds to uvicorn's HTTP protocol the two deadlines uvicorn lacks (the
  request's headers within ``read_timeout`` s of the connection or of the previous response, its body
  within ``read_timeout`` s of its headers); a connection that misses one is closed.
- **The log**: ``unknown_fields_note`` writes the names of ignored fields escaped (``repr``) and bounded,
  so a key with a newline cannot forge a log line and 800,000 keys cannot write an 8 MB one.

>>> from kvlib.corpus import ByteTokenizer
>>> max_token_bytes(ByteTokenizer()), min_tokens("héllo", 1)  # one byte a token: the bound is exact
(1, 6)
>>> unknown_fields_note(["a\\nWARNING forged", "x" * 100], limit=8, width=12)
"'a\\\\nWARNING fo…', 'xxxxxxxxxxxx…'"
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import threading
from itertools import islice

__all__ = ["APIError", "MAX_JSON_DEPTH", "INT64_MAX", "DEFAULT_MAX_BODY_BYTES", "parse_json_object",
           "max_token_bytes", "min_tokens", "encode", "encode_bounded", "unknown_fields_note", "timed_protocol", "APIKeyGuard"]

MAX_JSON_DEPTH = 32  # an OpenAI body nests 5 deep (messages[i].content[j].text); 32 leaves room, not 1,000
INT64_MAX = 2 ** 63 - 1  # seed's bound, as vLLM's (torch.Generator.manual_seed takes 64 bits)
DEFAULT_MAX_BODY_BYTES = 4 * 2 ** 20  # 4 MiB: a full 8,192-token prompt is tens of kB, even JSON-escaped
MAX_LOGGED_FIELDS, MAX_LOGGED_NAME = 16, 40  # unknown fields named in one log line, characters per name

_DEFAULT_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                  408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type",
                  429: "too_many_requests", 500: "internal_error", 503: "server_busy"}


class APIError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``.

    ``code`` is always set (a default per status when not given: ``invalid_value`` for a 400), so a client
    can branch on it without parsing the message. ``headers`` go on the response (``Retry-After``).
    """

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.code = code or _DEFAULT_CODES.get(status, "error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self):
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# --------------------------------------------------------------------------------------------
# The body
# --------------------------------------------------------------------------------------------


def _reject_constant(name):
    raise ValueError(name)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate, paired or not


def parse_json_object(raw: bytes) -> dict:
    """The request body as a dict, or an APIError (400) saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(f"the request body is not valid UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})",
                       code="invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)  # NaN / Infinity are not JSON
    except json.JSONDecodeError as err:  # where the client's text stops being JSON, in json's own words
        raise APIError(f"the request body is not valid JSON: {err.msg}: line {err.lineno} column {err.colno} "
                       f"(char {err.pos})", code="invalid_json") from None
    except ValueError as err:
        raise APIError(f"the request body is not valid JSON: {err.args[0]} is not a number (numbers must be "
                       "finite)", code="invalid_json") from None
    except RecursionError:
        raise APIError(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") \
            from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    _check_tree(body, surrogates=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _json_type(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def _check_tree(body: dict, surrogates: bool):
    """Depth at most MAX_JSON_DEPTH; with ``surrogates`` (the raw body escapes one), no string holds a lone one.
    Iterative: a recursive walk (or repr) of a deep body is what would fail."""
    stack = [(body, 1, None)]
    while stack:
        node, depth, top = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels", top,
                           code="invalid_json")
        if isinstance(node, dict):
            if surrogates:
                for k, v in node.items():
                    if _lone_surrogate(k) or _lone_surrogate(v):
                        _surrogate_error(top if top is not None else k)
            stack.extend((v, depth + 1, k if top is None else top) for k, v in node.items() if type(v) in _TREES)
        else:
            if surrogates and any(_lone_surrogate(v) for v in node if type(v) is str):
                _surrogate_error(top)
            stack.extend((v, depth + 1, top) for v in node if type(v) in _TREES)


_TREES = (dict, list)


def _surrogate_error(name):
    raise APIError("the request holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair): that "
                   "is not text", name if not _lone_surrogate(name) else None, code="invalid_unicode")


def _lone_surrogate(s) -> bool:
    if not isinstance(s, str):
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# --------------------------------------------------------------------------------------------
# Tokens: a cheap lower bound, and encoding without holding the GIL
# --------------------------------------------------------------------------------------------


def max_token_bytes(tokenizer) -> int | None:
    """The most bytes of text one token can stand for, or None when this tokenizer's tokens are not known
    to be byte strings of the text (then no cheap bound is used).

    The byte-level tokenizer: 1. A byte-level BPE (``tokenizers`` with the ByteLevel decoder and no
    normalizer, as SmolLM2's): each character of a vocabulary entry stands for one byte; added (special)
    tokens are matched as their own text."""
    from .corpus import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return 1
    backend = getattr(tokenizer, "backend", None)
    try:
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders
    except ImportError:  # pragma: no cover - tokenizers is installed with the course
        return None
    if not isinstance(backend, Backend) or backend.normalizer is not None \
            or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    added = backend.get_added_tokens_decoder()  # {id: AddedToken}, matched in the text as their content
    longest = max((len(t) for t, i in backend.get_vocab(with_added_tokens=True).items() if i not in added), default=0)
    return max([longest] + [len(t.content.encode("utf-8")) for t in added.values()]) or None


def min_tokens(text: str, token_bytes: int) -> int:
    """A lower bound on the tokens of ``text`` when no token covers more than ``token_bytes`` bytes."""
    return -(-len(text.encode("utf-8", "surrogatepass")) // token_bytes)


def encode(tokenizer, text: str) -> list[int]:
    """``tokenizer.encode(text)``; for kvlib's ``tokenizers``-backed Tokenizer, the same ids through
    ``encode_batch``, which releases the GIL while it works (so the event loop and the engine thread
    keep running during a long prompt's encoding)."""
    from .pretrained import Tokenizer  # the class itself (defined there, or re-exported), not a subclass

    if type(tokenizer) is Tokenizer:
        ids = tokenizer.backend.encode_batch([text], add_special_tokens=False)[0].ids
        return ([tokenizer.bos_id] + ids) if tokenizer.add_bos and tokenizer.bos_id is not None else ids
    return tokenizer.encode(text)


SLICE_CHARS = 32_768  # how much of a long text ``encode_bounded`` encodes at a time


def _cut(text: str, start: int, end: int) -> int:
    """Where to end a slice ``text[start:end]``: before a single space between two non-space characters in its
    last kilobyte (a word boundary, where byte-level BPE pre-tokenizers split anyway), else at ``end``."""
    if end >= len(text):
        return len(text)
    j = text.rfind(" ", max(start + 1, end - 1024), end)
    while j > start and (text[j - 1].isspace() or text[j + 1].isspace()):
        j = text.rfind(" ", max(start + 1, end - 1024), j)
    return j if j > start else end


def encode_bounded(tokenizer, text: str, limit: int) -> tuple[list[int], bool]:
    """The token ids of ``text`` with the work bounded by ``limit`` tokens, not by the text's length.

    A text up to ``SLICE_CHARS`` characters is encoded whole. A longer one is first counted slice by slice (cut at
    word boundaries) and given up as soon as the count passes ``2 * limit``: then ``(ids of the slices so far,
    False)``, a text that is certainly over ``limit`` (the slices' count errs by a few tokens per cut, far less
    than the factor 2). Otherwise it is encoded whole, exactly: ``(ids, True)``. So a 600 kB prompt for an
    8,192-token model costs about 64 kB of encoding before it is refused, not 600 kB (which held a tokenizer
    thread for seconds, and two of them every other request queued behind)."""
    if len(text) <= SLICE_CHARS:
        return encode(tokenizer, text), True
    counted, start = [], 0
    while start < len(text):
        end = _cut(text, start, start + SLICE_CHARS)
        counted += encode(tokenizer, text[start:end])
        if len(counted) > 2 * limit:
            return counted, False
        start = end
    return encode(tokenizer, text), True


# --------------------------------------------------------------------------------------------
# The log
# --------------------------------------------------------------------------------------------


def unknown_fields_note(names, limit: int = MAX_LOGGED_FIELDS, width: int = MAX_LOGGED_NAME) -> str:
    """The names, each escaped (``repr``: a newline is written ``\\n``) and cut to ``width`` characters, at
    most ``limit`` of them, then how many more there were."""
    names = list(names) if not isinstance(names, list) else names
    shown = [repr(n[:width] + "…" if len(n) > width else n) for n in islice(names, limit)]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more:,} more" if more > 0 else "")


# --------------------------------------------------------------------------------------------
# Connections: header and body deadlines on uvicorn's protocol
# --------------------------------------------------------------------------------------------


def timed_protocol(base: type, read_timeout: float) -> type:
    """A subclass of uvicorn's HTTP protocol class ``base`` that closes a connection whose request headers
    have not all arrived ``read_timeout`` s after it connected (or after its previous response ended), or
    whose body has not all arrived ``read_timeout`` s after its headers. Uvicorn only closes idle keep-alive
    connections; one that sends half a request line and then nothing is held forever without this."""

    class TimedProtocol(base):
        _deadline = None  # the armed timer
        _timed_cycle = None  # the request cycle the body deadline belongs to

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm("headers")

        def data_received(self, data):
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            if cycle is None or cycle is self._timed_cycle:
                if cycle is not None and not cycle.more_body:
                    self._disarm()  # the body is complete: the request is the app's now, however long it runs
                return
            self._timed_cycle = cycle  # a new request's headers are complete
            if cycle.more_body and not cycle.response_complete:
                self._arm("body")
            else:
                self._disarm()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm("headers")  # the next request's headers, on a kept-alive connection

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, what):
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout, self._expire, what)

        def _disarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self, what):
            self._deadline = None
            cycle = getattr(self, "cycle", None)
            waiting_headers = cycle is None or cycle is self._timed_cycle and cycle.response_complete
            if (what == "headers" and waiting_headers) or (what == "body" and cycle is not None and cycle.more_body):
                self.logger.info("closing a connection that sent no complete request %s within %s s", what,
                                 read_timeout)
                if not self.transport.is_closing():
                    self.transport.close()

    TimedProtocol.__name__ = TimedProtocol.__qualname__ = f"Timed{base.__name__}"
    return TimedProtocol


def default_http_protocol() -> type:
    """uvicorn's choice for ``http="auto"``: httptools when installed, else h11."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


# --------------------------------------------------------------------------------------------
# The API key
# --------------------------------------------------------------------------------------------


class APIKeyGuard:
    """Pure ASGI middleware: with a key set, every request under ``/v1`` needs ``Authorization: Bearer <key>``
    (401 otherwise); ``/health`` and ``/metrics`` stay open, as in vLLM (probes and scrapers carry no key),
    and so do CORS preflights (``OPTIONS``). Keys are compared as SHA-256 digests in constant time."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.digest = hashlib.sha256(api_key.encode("utf-8")).digest() if api_key else None

    def authorized(self, headers) -> bool:
        value = dict(headers).get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.strip()).digest(), self.digest)

    async def __call__(self, scope, receive, send):
        if self.digest is None or scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if (path == "/v1" or path.startswith("/v1/")) and not self.authorized(scope["headers"]):
            err = APIError("a valid API key is required: send 'Authorization: Bearer <key>' (the key the server "
                           "was started with, --api-key or KVLIB_API_KEY)", status=401, code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            return await err.response()(scope, receive, send)
        return await self.app(scope, receive, send)


def lower_thread_priority(niceness: int = 10):
    """Lower the calling thread's CPU priority (Linux: a thread is a task with its own nice value): the
    threads that parse and tokenize requests yield the cores to the engine thread when both want one, so
    a long prompt being encoded slows the running streams' steps as little as possible. Elsewhere: nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


async def run_in(pool, fn, *args):
    """``fn(*args)`` in the thread pool ``pool``, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
