"""kvlib.course.draw.serve: chapter 10's picture shows the live server's real state (tiny model, in-process)."""

import time

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from kvlib.course import ch10, figures  # noqa: E402
from kvlib.course.draw import cells_with  # noqa: E402
from kvlib.course.draw import serve as draw_serve  # noqa: E402
from kvlib.model import load_tiny  # noqa: E402
from kvlib.serve import Server  # noqa: E402

KW = dict(num_blocks=32, block_size=16, max_num_seqs=2, max_batched_tokens=64)
GIDS = ("client", "handler", "message", "command", "running", "waiting", "swapped", "thread", "path")


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def counts(fig):
    return {g: cells_with(fig, g) for g in GIDS}


def test_the_picture_counts_what_the_server_holds(tiny):
    model, tok = tiny
    with Server(model, tok, "tiny", **KW) as srv:
        st = ch10.moment(srv, ["def f(x):", "class A:", "import os"], max_tokens=200, chat=False)
    c = counts(draw_serve.server(st))
    adds = sum(1 for kind, _ in st["commands"] if kind == "add")
    assert st["running"] and st["waiting"] and adds == 1  # two run (max_num_seqs 2), one waits, one not added yet
    assert any(kind == "abort" for kind, _ in st["commands"])  # the client that hung up
    assert c["handler"] == c["client"] == len(st["handles"]) + adds
    assert c["command"] == len(st["commands"])
    assert (c["running"], c["waiting"], c["swapped"]) == (len(st["running"]), len(st["waiting"]), len(st["swapped"]))
    assert c["message"] == sum(h["pending"] for h in st["handles"].values())
    assert c["thread"] == 2 + st["threads"]["tokenizer"]  # the event loop, the engine, the tokenizer pool's threads
    assert c["path"] == len(draw_serve.PATH_STATIONS)  # the last step emitted a token: its way is drawn


def test_paused_holds_the_engine_and_state_reads_it(tiny):
    model, tok = tiny
    with Server(model, tok, "tiny", **KW) as srv:
        clients = [ch10.StreamClient(srv.url, "tiny", p, 200, chat=False) for p in ("ab", "cd", "ef")]
        for c in clients:
            c.start()
        ch10._wait(lambda: clients[0].tokens >= 2, 60, "tokens")
        with draw_serve.paused(srv):
            clock = srv.engine.clock
            time.sleep(0.3)
            st = draw_serve.state(srv)
            assert srv.engine.clock == clock  # no step while paused
            assert st["running"] == [r.id for r in srv.engine.running]
            assert st["waiting"] == [r.id for r in srv.engine.waiting]
            assert set(st["handles"]) == set(srv.loop.live)
            for rid, h in st["handles"].items():
                assert h["n_out"] == srv.loop.live[rid].n_out == len(srv.engine.requests[rid].output)
            assert st["last_step"]["step"] == clock - 1
        ch10._wait(lambda: srv.engine.clock > clock, 30, "a step after the pause")  # it steps again
        for c in clients:
            c.hang_up()
        for c in clients:
            c.join(30)
        ch10._wait(lambda: not srv.engine.has_unfinished(), 30, "the aborts")
        with draw_serve.paused(srv):  # an idle engine: nothing to hold, nothing drawn in the engine
            c = counts(draw_serve.server(srv))
        assert c["running"] == c["waiting"] == c["handler"] == 0


def test_paused_needs_a_running_server(tiny):
    model, tok = tiny
    srv = Server(model, tok, "tiny", **KW)
    with pytest.raises(RuntimeError, match="not running"):
        with draw_serve.paused(srv):
            pass


def test_the_server_figure_passes_the_figure_check(tiny):
    model, tok = tiny
    with Server(model, tok, "tiny", **KW) as srv:
        st = ch10.moment(srv, ["x = 1", "y = 2", "z = 3"], max_tokens=100, chat=False)
    assert figures.figure_problems(draw_serve.server(st, title="one moment")) == []
