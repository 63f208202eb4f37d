"""Start a small process group on this machine, run one function in every rank, collect what each returns.

    results = launch.run(fn, world_size, *args, backend=None, timeout_s=60.0)

``fn`` is a module-level function (each rank is a fresh process that imports it by name) called as
``fn(rank, world_size, *args)`` in each of ``world_size`` processes, after ``torch.distributed`` has
joined them into one group: gloo on a CPU, NCCL when ``backend="nccl"`` or when every rank can have its
own GPU and ``backend`` is None. Each process runs one torch thread. ``run`` returns fn's return values
as a list indexed by rank.

Bounded in time, and nothing left behind: on a rank's exception, on the timeout and on Ctrl-C every
process is stopped (terminated, then killed). A rank's exception comes back as :class:`RankFailed`
(naming the rank, carrying its traceback text); a timeout as ``TimeoutError`` naming the ranks still
running.

Ranks are started by multiprocessing's *fork server*: one helper process, started at the first launch, imports
torch once and forks a copy of itself for each rank. Like the *spawn* method (a fresh interpreter per rank) it
shares nothing with the caller but what is sent, so ``fn`` and its arguments travel by name and by pickle; unlike
it, a rank does not pay torch's import again (about 1.5 s of CPU per rank, most of a short launch).

The rendezvous store (a ``torch.distributed.TCPStore``) is opened here in the parent on a port the
operating system picks, so two launches never race for one port. ``KVLIB_DIST_PORT=N`` asks for a fixed
port instead (a taken one is reported, not silently replaced).
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import time
import traceback

__all__ = ["run", "RankFailed", "pick_backend", "rank_device", "rank_store", "MAX_WORLD_SIZE"]

MAX_WORLD_SIZE = 8  # this launcher is for one machine: a handful of processes
HOST = "127.0.0.1"  # every rank is on this machine: the loopback interface


class RankFailed(RuntimeError):
    """A rank raised (or died) inside ``launch.run``: ``.rank`` says which, ``.traceback_text`` what it printed."""

    def __init__(self, rank: int, world_size: int, fn_name: str, traceback_text: str):
        self.rank = rank
        self.world_size = world_size
        self.traceback_text = traceback_text
        super().__init__(f"rank {rank} of {world_size} failed in {fn_name}; every process was stopped. "
                         f"The rank's traceback:\n{traceback_text}")


def pick_backend(backend: str | None, world_size: int) -> str:
    """gloo or nccl: NCCL when asked, or (backend None) when there is a GPU for every rank."""
    import torch
    import torch.distributed as dist

    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be None, 'gloo' or 'nccl', got {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl":
        if gpus < world_size or not dist.is_nccl_available():
            raise ValueError(f"backend='nccl' needs one CUDA GPU per rank and a torch built with NCCL: "
                             f"world_size={world_size}, GPUs visible={gpus}, NCCL available={dist.is_nccl_available()}")
        return "nccl"
    if backend is None and gpus >= world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rank_device():
    """Inside a rank: where its tensors must live for the group's collectives (its GPU under NCCL, else the CPU)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_RANK_STORE = None  # inside a rank: the rendezvous store it joined (set by the rank's bootstrap)


def rank_store():
    """Inside a rank: the group's key-value store (the TCPStore it joined at the rendezvous), for small control
    messages a rank must be able to look for without blocking (``check``), as chapter 12b's transfer headers do."""
    if _RANK_STORE is None:
        raise RuntimeError("rank_store() is only available inside a rank started by kvlib.dist.launch.run")
    return _RANK_STORE


def _check_importable(fn) -> None:
    """Raise ValueError unless a fresh interpreter can import ``fn`` by its module and qualified name."""
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if name is None or module is None:  # a partial or a callable object: pickling it is the test
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise ValueError(f"fn={fn!r} cannot be sent to a new process (pickling failed: {e}); "
                             f"pass a function defined at the top level of a .py module") from None
        return
    if "<locals>" in name or "<lambda>" in name:
        raise ValueError(f"fn={module}.{name} is a lambda or a function defined inside another function: a "
                         f"new process cannot import it; define it at the top level of a .py module")
    if module == "__main__":
        import sys

        main = sys.modules.get("__main__")
        main_file = getattr(main, "__file__", None)
        if main_file is not None and not os.path.isfile(main_file):  # `python - < script.py`: __file__ is "<stdin>"
            raise ValueError(f"fn={name} is defined in a script read from {main_file} (module __main__): each rank "
                             f"re-imports the script from its file, and there is none. Save it "
                             f"as a .py file and run that, or put fn in an importable module")
        if main_file is None:
            raise ValueError(f"fn={name} is defined in a notebook or an interactive session (module __main__): "
                             f"a new process cannot import it. Put it in a .py module "
                             f"(the chapter's are in kvlib/course/) and import it from there")
        return  # a script: each new process re-imports it as __mp_main__ (its work sits under `if __name__ == ...`)
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        raise ValueError(f"fn={module}.{name} cannot be imported by name ({type(e).__name__}: {e}); "
                         f"a new process needs a function at the top level of an importable module") from None
    if obj is not fn:
        raise ValueError(f"fn={module}.{name} is not the object that name imports (redefined or decorated?); "
                         f"a new process would run the other one")


def _check_args(fn, world_size, timeout_s) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}: {world_size!r}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be between 1 and {MAX_WORLD_SIZE} (processes on this machine), got {world_size}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    _check_importable(fn)


def _open_store(world_size: int, timeout_s: float):
    """The rendezvous store, held by the parent: on the port KVLIB_DIST_PORT names, else one the OS picks."""
    import torch.distributed as dist

    wanted = os.environ.get("KVLIB_DIST_PORT", "").strip()
    timeout = datetime.timedelta(seconds=timeout_s)
    if wanted:
        try:
            port = int(wanted)
        except ValueError:
            raise ValueError(f"KVLIB_DIST_PORT must be a port number, got {wanted!r}") from None
        if not 1 <= port <= 65535:
            raise ValueError(f"KVLIB_DIST_PORT must be a port number between 1 and 65535, got {port}")
        try:
            return dist.TCPStore(HOST, port, world_size + 1, True, timeout=timeout, wait_for_workers=False)
        except Exception as e:
            raise RuntimeError(f"port {port} on {HOST} (from KVLIB_DIST_PORT) is taken or refused ({e}); "
                               f"pick another port or unset KVLIB_DIST_PORT to let the OS choose a free one") from e
    last = None
    for _ in range(3):  # port 0: the OS picks a free port; retried in case a socket cannot be opened at once
        try:
            return dist.TCPStore(HOST, 0, world_size + 1, True, timeout=timeout, wait_for_workers=False)
        except Exception as e:  # pragma: no cover - depends on the machine's sockets
            last = e
            time.sleep(0.2)
    raise RuntimeError(f"could not open a local port on {HOST} for the process group's rendezvous: {last}")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process reused the number
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:  # no /proc (macOS): kill(pid, 0) is all we have
        return True


def _exit_with_parent(parent: int) -> None:
    """A daemon thread: leave at once if the process that called ``run`` goes away (killed before it could stop us),
    instead of waiting at a collective until the group's timeout. Ranks are forked by multiprocessing's fork server,
    which outlives that process while a rank holds its pipe: so the caller's pid is watched, not our parent's."""
    import threading

    def watch():
        while _alive(parent):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="kvlib-parent-watch").start()


def _worker(rank, world_size, backend, port, timeout_s, conn, parent):
    """One rank: receive (fn, args), say it started, join the group, run fn, send back ("ok", pickled result) or
    ("error", traceback text); ("unpickled", traceback text) if fn or its arguments could not be received.

    fn and args come through the pipe, not as the process's arguments: the fork server passes those with at most
    a few hundred file descriptors, and torch shares each tensor's storage through one (SmolLM2 has 272 tensors);
    sent on a pipe, they go through multiprocessing's resource sharer, which has no such limit."""
    global _RANK_STORE
    try:
        fn, args = conn.recv()
    except BaseException:
        conn.send(("unpickled", traceback.format_exc()))
        conn.close()
        os._exit(1)
    conn.send(("started", None))  # the rank got this far: it imported fn and the parent's script (if any)
    _exit_with_parent(parent)
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (the fork server never ran torch code, so it cannot; harmless)
        pass
    import torch.distributed as dist

    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(HOST, port, world_size + 1, False, timeout=timeout)
        _RANK_STORE = store
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        out = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(out)
        except Exception as e:
            raise TypeError(f"fn's return value cannot be pickled back to the parent: {e}") from e
        conn.send(("ok", payload))  # synchronous: in the pipe before this rank leaves the group
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        conn.close()
        os._exit(1)  # leave at once: the parent stops the others
    try:
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
    finally:
        conn.close()


_CONTEXT = None


def _context():
    """The fork server's context, its preload set once: torch and this module are imported in the server, so a rank
    starts with them (the environment is the server's too: it starts at the first launch of a process)."""
    global _CONTEXT
    if _CONTEXT is None:
        import torch.multiprocessing as mp

        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "kvlib.dist.launch"])
    return _CONTEXT


def _stop(procs, grace_s: float) -> None:
    """Wait ``grace_s`` for every process to exit, then terminate, then kill what is left."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


# why a rank could not get as far as running fn, and what to do about it
_IMPORT_HINT = ("it could not import fn, or re-ran your script's top level. Define fn at the top level of an "
                "importable module (not under `if __name__ == '__main__'`) and put the launch under "
                "`if __name__ == '__main__'`")


def _died(rank: int, proc, started: bool, world_size: int, fn_name: str) -> RankFailed:
    """The error for a rank whose process ended without a word (its pipe closed)."""
    proc.join(1.0)
    if not started:  # before _worker ran: the process's own start-up failed
        return RankFailed(rank, world_size, fn_name, f"the process ended (exit code {proc.exitcode}) before it could "
                                                     f"run fn: {_IMPORT_HINT}; the rank's stderr above shows the cause")
    return RankFailed(rank, world_size, fn_name,  # killed, segfault, os._exit
                      f"the process exited (exit code {proc.exitcode}) without returning or raising: killed, out of "
                      f"memory, or a crash in native code")


def _crashed(pending: dict, started: set, grace_s: float) -> int | None:
    """The first of the ``pending`` ranks (reader -> rank) whose process ends without a word within ``grace_s``, or
    None. Whatever else they send in that time is dropped: the run is failing."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + grace_s
    pending = dict(pending)
    while pending and (left := deadline - time.monotonic()) > 0:
        for reader in wait(list(pending), timeout=left):
            rank = pending.pop(reader)
            try:
                status, _ = reader.recv()
            except (EOFError, OSError):
                return rank
            if status == "started":
                started.add(rank)
                pending[reader] = rank
    return None


def run(fn, world_size: int, *args, backend: str | None = None, timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes joined by torch.distributed;
    return fn's return values by rank. See the module docstring for what is stopped and raised when."""
    _check_args(fn, world_size, timeout_s)
    backend = pick_backend(backend, world_size)
    from multiprocessing.connection import wait

    fn_name = getattr(fn, "__qualname__", repr(fn))
    ctx = _context()
    store = _open_store(world_size, timeout_s)
    procs, readers = [], {}
    results: dict[int, object] = {}
    ok = False
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe()  # duplex: (fn, args) to the rank, its status back
            p = ctx.Process(target=_worker, daemon=True, name=f"kvlib-rank{rank}",
                            args=(rank, world_size, backend, store.port, timeout_s, writer, os.getpid()))
            p.start()
            writer.close()  # the child holds its own copy
            procs.append(p)
            readers[reader] = rank
        for reader, rank in readers.items():
            try:
                reader.send((fn, args))
            except (BrokenPipeError, EOFError, OSError):  # the rank already died: its status (EOF) says so below
                pass
        deadline = time.monotonic() + timeout_s
        pending = dict(readers)  # reader -> rank, for the ranks that have not answered
        started: set[int] = set()  # ranks whose process got as far as running _worker
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                running = sorted(pending.values())
                raise TimeoutError(f"launch.run({fn_name}): rank(s) {running} of {world_size} still running after "
                                   f"{timeout_s:g} s; every process was stopped")
            for reader in wait(list(pending), timeout=left):
                rank = pending.pop(reader)
                try:
                    status, payload = reader.recv()
                except (EOFError, OSError):  # the process died without a word
                    raise _died(rank, procs[rank], rank in started, world_size, fn_name) from None
                if status == "started":
                    started.add(rank)
                    pending[reader] = rank  # wait for its answer
                    continue
                if status == "error":
                    # a rank whose peer crashed fails too (gloo: "connection closed by peer"), often first: the
                    # crash is the cause, so the other ranks get a moment to show one before this error is raised
                    crashed = _crashed(pending, started, grace_s=2.0)
                    if crashed is not None:
                        raise _died(crashed, procs[crashed], crashed in started, world_size, fn_name)
                    raise RankFailed(rank, world_size, fn_name, payload)
                if status == "unpickled":
                    raise RankFailed(rank, world_size, fn_name, f"the rank could not receive fn and its arguments, "
                                     f"before it could run fn: {_IMPORT_HINT}. The rank's traceback:\n{payload}")
                results[rank] = pickle.loads(payload)
        ok = True
    finally:
        _stop(procs, grace_s=10.0 if ok else 0.0)
        for reader in readers:
            reader.close()
        del store
    return [results[r] for r in range(world_size)]
