"""kvlib.dist.launch: real process groups (gloo, one thread per rank), bounded in time, nothing left running.

A spawn costs seconds, so each launch checks several things at once. The rank functions live at the top
level of this module: spawned processes import them by name.
"""

import os
import socket
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

from kvlib.dist import launch
from kvlib.dist.launch import RankFailed


def _sum_and_facts(rank, world_size, offset, pid_dir):
    (pid_dir / f"{rank}.pid").write_text(str(os.getpid()))
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "threads": torch.get_num_threads(), "backend": dist.get_backend(), "pid": os.getpid(),
            "tensor": torch.full((2,), float(rank))}


def _rank1_raises(rank, world_size, pid_dir):
    (pid_dir / f"{rank}.pid").write_text(str(os.getpid()))
    dist.barrier()  # both pids are written before rank 1 fails
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits here for a partner that never comes: the parent must stop it


def _rank0_hangs(rank, world_size, pid_dir):
    (pid_dir / f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 0:
        time.sleep(600)
    return rank


def _rank1_dies(rank, world_size):
    if rank == 1:
        os._exit(3)  # no exception, no message: a crash
    dist.barrier()


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's exit is reaped by whoever adopted it, maybe late)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return True


def _gone(pid_dir, n):
    """(the pids the ranks wrote, those of them still running)."""
    pids = [int((pid_dir / f"{r}.pid").read_text()) for r in range(n) if (pid_dir / f"{r}.pid").exists()]
    return pids, [pid for pid in pids if _running(pid)]


def test_run_returns_by_rank_with_one_thread_each(tmp_path):
    out = launch.run(_sum_and_facts, 3, 10, tmp_path, timeout_s=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert {o["world"] for o in out} == {3}
    assert [o["sum"] for o in out] == [33.0] * 3  # (0+10) + (1+10) + (2+10), reduced across the processes
    assert {o["threads"] for o in out} == {1}
    assert {o["backend"] for o in out} == {"gloo"}
    assert len({o["pid"] for o in out} | {os.getpid()}) == 4  # three processes, none of them this one
    assert [o["tensor"].tolist() for o in out] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    pids, alive = _gone(tmp_path, 3)
    assert len(pids) == 3 and alive == []


def test_a_rank_that_raises_stops_every_process(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch.run(_rank1_raises, 2, tmp_path, timeout_s=60)
    assert time.monotonic() - t0 < 50  # not the timeout: the failure itself ended the run
    err = info.value
    assert isinstance(err, RuntimeError) and err.rank == 1
    assert "rank 1 of 2" in str(err)
    assert "ValueError: rank one refuses" in err.traceback_text and "_rank1_raises" in err.traceback_text
    pids, alive = _gone(tmp_path, 2)
    assert len(pids) == 2 and alive == []


def test_timeout_names_the_running_rank_and_stops_it(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        launch.run(_rank0_hangs, 2, tmp_path, timeout_s=6)
    took = time.monotonic() - t0
    assert 6 <= took < 40  # the timeout, then the stop (terminate, join), on a possibly loaded machine
    msg = str(info.value)
    assert "still running" in msg and "rank(s) [0" in msg  # rank 0 sleeps; rank 1 too if it had not started
    pids, alive = _gone(tmp_path, 2)
    assert alive == []


def test_a_rank_that_dies_without_a_word():
    with pytest.raises(RankFailed) as info:
        launch.run(_rank1_dies, 2, timeout_s=60)
    assert info.value.rank == 1 and "exit code 3" in str(info.value)


def test_bad_arguments_name_the_argument(monkeypatch):
    with pytest.raises(TypeError, match="fn must be callable"):
        launch.run(3, 2)
    with pytest.raises(TypeError, match="world_size must be an int"):
        launch.run(_sum_and_facts, "2")
    for ws in (0, 9, -1):
        with pytest.raises(ValueError, match="world_size must be between 1 and 8"):
            launch.run(_sum_and_facts, ws)
    with pytest.raises(ValueError, match="timeout_s"):
        launch.run(_sum_and_facts, 2, timeout_s=0)
    with pytest.raises(ValueError, match="backend must be"):
        launch.run(_sum_and_facts, 2, backend="mpi")
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="backend='nccl' needs one CUDA GPU per rank"):
            launch.run(_sum_and_facts, 2, backend="nccl")
    with pytest.raises(ValueError, match="lambda"):
        launch.run(lambda rank, ws: rank, 2)

    def local(rank, ws):
        return rank

    with pytest.raises(ValueError, match="inside another function"):
        launch.run(local, 2)
    # a function defined in a notebook: its module is __main__, and that __main__ has no file
    notebook_main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", notebook_main)
    in_notebook = types.FunctionType(_sum_and_facts.__code__, notebook_main.__dict__, "in_notebook")
    in_notebook.__module__ = "__main__"
    with pytest.raises(ValueError, match="notebook"):
        launch.run(in_notebook, 2)
    notebook_main.__file__ = "<stdin>"  # `python - < script.py`: a __file__ spawn cannot re-import
    with pytest.raises(ValueError, match="read from <stdin>"):
        launch.run(in_notebook, 2)


def test_a_taken_port_is_reported(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setenv("KVLIB_DIST_PORT", str(port))
        with pytest.raises(RuntimeError, match=f"port {port} .* is taken"):
            launch.run(_sum_and_facts, 2)
    monkeypatch.setenv("KVLIB_DIST_PORT", "70000")
    with pytest.raises(ValueError, match="between 1 and 65535, got 70000"):
        launch.run(_sum_and_facts, 2)
    monkeypatch.setenv("KVLIB_DIST_PORT", "http")
    with pytest.raises(ValueError, match="KVLIB_DIST_PORT must be a port number"):
        launch.run(_sum_and_facts, 2)


def test_ranks_leave_when_the_parent_is_killed(tmp_path):
    """A parent killed outright (SIGKILL: no finally runs) must not leave its ranks waiting at a collective."""
    import signal
    import subprocess

    script = ("import sys; sys.path.insert(0, %r); import test_dist_launch as t; from kvlib.dist import launch; "
              "from pathlib import Path; launch.run(t._rank0_hangs, 2, Path(%r), timeout_s=120)"
              % (os.path.dirname(__file__), str(tmp_path)))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(_gone(tmp_path, 2)[0]) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.1)
        pids, alive = _gone(tmp_path, 2)
        assert len(pids) == 2 and len(alive) == 2, "both ranks should be running before the parent is killed"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20  # each rank's watcher checks twice a second
        while _gone(tmp_path, 2)[1] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(tmp_path, 2)[1] == []  # each rank noticed its parent was gone and left
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in _gone(tmp_path, 2)[1]:  # never leave one behind, even when the test fails
            os.kill(pid, signal.SIGKILL)


def test_a_rank_function_spawn_cannot_import_is_named(tmp_path):
    """A script's rank function defined under its `if __name__ == "__main__"`: the ranks die while spawn unpickles
    it, before they run anything; the error says so (not "killed, out of memory")."""
    import subprocess

    script = tmp_path / "under_guard.py"
    script.write_text("from kvlib.dist import launch\n"
                      "if __name__ == '__main__':\n"
                      "    def f(rank, ws):\n"
                      "        return rank\n"
                      "    try:\n"
                      "        launch.run(f, 2, timeout_s=60)\n"
                      "    except launch.RankFailed as e:\n"
                      "        print('RankFailed:', e)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "RankFailed:" in done.stdout, done.stdout + done.stderr
    assert "before it could run fn" in done.stdout and "out of memory" not in done.stdout


def test_rank_store_is_only_available_inside_a_rank():
    with pytest.raises(RuntimeError, match="only available inside a rank"):
        launch.rank_store()


def _sum_of(rank, world_size, tensors):
    return float(sum(t.sum() for t in tensors))


def test_arguments_with_hundreds_of_tensors_reach_every_rank():
    """torch shares each tensor's storage through a file descriptor; the fork server takes at most a few hundred
    with a process's arguments (SmolLM2 has 272 tensors), so fn and its arguments travel on the rank's pipe."""
    import torch

    tensors = [torch.full((3,), float(i)) for i in range(600)]
    assert launch.run(_sum_of, 2, tensors, timeout_s=120) == [3.0 * sum(range(600))] * 2
