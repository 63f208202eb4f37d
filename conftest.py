# Imported by pytest before any test module: kvlib must decide the mode (and set
# TRITON_INTERPRET=1 on a machine without a GPU) before anything else imports triton —
# transformers, for one, imports triton when it loads.
import os
import runpy
import subprocess
import sys
import threading
from pathlib import Path

import kvlib  # noqa: F401

import torch  # noqa: E402

from kvlib import runtime  # noqa: E402

if not torch.cuda.is_available():
    # One CPU thread per test process unless KVLIB_THREADS says otherwise (runtime.cpu_threads): on a
    # 2-core machine the two pytest-xdist workers already take both cores.
    torch.set_num_threads(runtime.cpu_threads())


# The longest scopes first: pytest-xdist (--dist loadscope) hands out whole notebooks (and whole test modules) in
# collection order, so the ones that take longest must start at once or the run waits for them at the end (06 and
# the two 60-second test modules were collected after every test module, and one worker ran them alone at the end).
# Rough CPU seconds in the last fresh-clone run, longest first; keep it current when a chapter grows.
LONGEST_FIRST = ["notebooks/09a_keeping_fewer_positions.ipynb", "notebooks/09b_keeping_fewer_bits.ipynb",
                 "notebooks/10_http_serving.ipynb", "notebooks/11a_speculative_decoding.ipynb",
                 "notebooks/11b_sparse_reads_and_hybrid_layers.ipynb", "notebooks/03_kv_cache.ipynb",
                 "notebooks/07_gqa.ipynb", "notebooks/06_int8_kv.ipynb", "solutions/13_capstone_lab.ipynb",
                 "notebooks/08b_prefix_cache.ipynb", "notebooks/08a_serving_many_requests.ipynb",
                 "notebooks/12a_sharding_the_cache.ipynb", "notebooks/12b_moving_the_cache.ipynb",
                 "notebooks/02_deep_dive_page_faults.ipynb", "tests/test_bench_sweeps.py", "tests/test_load.py",
                 "tests/test_gpu_check.py", "tests/test_labs.py", "tests/test_pretrained.py",
                 "tests/test_dist_launch.py", "tests/test_serve_hardening.py",
                 "solutions/09a_keeping_fewer_positions_lab.ipynb"]


# Last: the compile check only reads what its background build (below) wrote, and waits for it to finish.
LAST = ["tests/test_compile.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    rank.update({name: len(LONGEST_FIRST) + 1 + i for i, name in enumerate(LAST)})

    def key(item):
        path = item.path.relative_to(config.rootpath).as_posix() if item.path.is_relative_to(config.rootpath) else ""
        return rank.get(path, len(LONGEST_FIRST))

    items.sort(key=key)  # stable: everything else keeps its order
    for item in items:
        # nbval waits 5 s for a cell's outputs after the kernel says the cell is done; on a loaded 2-core
        # machine a cell that printed many progress updates can take longer to deliver them (seen once:
        # notebook 07's fine-tune cell failed "waiting for output" while another job ran)
        if hasattr(item, "output_timeout"):
            item.output_timeout = max(item.output_timeout, 60)
        if hasattr(item, "compare_outputs"):
            _skip_progress_bars(item)


# The compile check (tests/test_compile.py: every kernel built for sm_75/80/90, about 3 minutes of CPU with an empty
# Triton cache) starts when the run starts, in the background at the lowest priority (nice 19), one process per
# architecture: it takes only the CPU the tests leave idle (a notebook waiting for its server, the first download of
# the model), and the test reads its result at the end. Only the main process starts it (not each xdist worker),
# only when tests/test_compile.py is in the run's paths, and KVLIB_COMPILE_BACKGROUND=0 turns it off.
_COMPILE = {}


def _runs_compile_check(config) -> bool:
    target = (config.rootpath / "tests" / "test_compile.py").resolve()
    paths = [Path(a.split("::")[0]) for a in config.args] or [config.rootpath / "tests"]
    return any(p.resolve() == target or (p.is_dir() and target.is_relative_to(p.resolve())) for p in paths)


def pytest_configure(config):
    if (hasattr(config, "workerinput") or os.environ.get("KVLIB_COMPILE_BACKGROUND", "1") == "0"
            or os.name != "posix" or not _runs_compile_check(config)):  # elsewhere the test builds for itself
        return
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="kvlib-compile-"))
    cmd = [sys.executable, "-m", "kvlib.course.compile_check", "--json", "--jobs", "3", "--arch", "75", "80", "90"]
    env = dict(os.environ, TRITON_INTERPRET="0", KVLIB_DEVICE="cpu")
    with open(folder / "out.json", "w") as out, open(folder / "err.txt", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=config.rootpath, start_new_session=True,
                                preexec_fn=_lowest_priority)
    _COMPILE.update(proc=proc, folder=folder)
    # the workers (started after this hook) inherit it: the test waits for this process's exit code there
    os.environ["KVLIB_COMPILE_RESULT"] = str(folder)
    threading.Thread(target=_record_exit, args=(proc, folder), daemon=True).start()


def _lowest_priority():
    """nice 19, for this process and its session. Linux schedules each session (autogroup) against the others first:
    a notebook's kernel runs in a session of its own, and a nice value counts only inside a session, so the new
    session's own nice is set too (without it the build took half a core from the notebooks)."""
    os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # no autogroups (another kernel, another OS): nice alone is what counts there
        pass


def _record_exit(proc, folder):
    code = proc.wait()
    (folder / "rc.part").write_text(str(code))
    (folder / "rc.part").rename(folder / "rc")  # whole or absent: a reader never sees half a file


def pytest_unconfigure(config):
    proc = _COMPILE.get("proc")
    if proc is None:
        return
    if proc.poll() is None:  # a run that ended early (Ctrl-C, -x, a subset): stop the build and its processes
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    import shutil

    shutil.rmtree(_COMPILE["folder"], ignore_errors=True)


is_progress = runpy.run_path(str(Path(__file__).parent / "scripts" / "strip_progress.py"))["is_progress"]


def _skip_progress_bars(item):
    # A progress bar is not a result: nbval compares a cell's outputs without its tqdm bars, on both sides
    # (scripts/strip_progress.py removes them from the committed notebooks; a fresh run still draws them).
    compare = item.compare_outputs

    def without_bars(test, ref, skip_compare=None):
        return compare([o for o in test if not is_progress(o)], [o for o in ref if not is_progress(o)], skip_compare)

    item.compare_outputs = without_bars
