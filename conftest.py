# Imported by pytest before any test module: kvlib must decide the mode (and set
# TRITON_INTERPRET=1 on a machine without a GPU) before anything else imports triton —
# transformers, for one, imports triton when it loads.
import runpy
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
                 "tests/test_compile.py",  # about 200 s of CPU with an empty Triton cache, as on a CI host
                 "notebooks/10_http_serving.ipynb", "notebooks/11a_speculative_decoding.ipynb",
                 "notebooks/11b_sparse_reads_and_hybrid_layers.ipynb", "notebooks/03_kv_cache.ipynb",
                 "notebooks/07_gqa.ipynb", "notebooks/06_int8_kv.ipynb", "solutions/13_capstone_lab.ipynb",
                 "notebooks/08b_prefix_cache.ipynb", "notebooks/08a_serving_many_requests.ipynb",
                 "notebooks/12a_sharding_the_cache.ipynb", "notebooks/12b_moving_the_cache.ipynb",
                 "notebooks/02_deep_dive_page_faults.ipynb", "tests/test_bench_sweeps.py", "tests/test_load.py",
                 "tests/test_gpu_check.py", "tests/test_labs.py", "tests/test_pretrained.py",
                 "tests/test_dist_launch.py", "tests/test_serve_hardening.py",
                 "solutions/09a_keeping_fewer_positions_lab.ipynb"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.path.relative_to(config.rootpath).as_posix() if item.path.is_relative_to(config.rootpath) else ""
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: everything else keeps its order
    for item in items:
        # nbval waits 5 s for a cell's outputs after the kernel says the cell is done; on a loaded 2-core
        # machine a cell that printed many progress updates can take longer to deliver them (seen once:
        # notebook 07's fine-tune cell failed "waiting for output" while another job ran)
        if hasattr(item, "output_timeout"):
            item.output_timeout = max(item.output_timeout, 60)
        if hasattr(item, "compare_outputs"):
            _skip_progress_bars(item)


is_progress = runpy.run_path(str(Path(__file__).parent / "scripts" / "strip_progress.py"))["is_progress"]


def _skip_progress_bars(item):
    # A progress bar is not a result: nbval compares a cell's outputs without its tqdm bars, on both sides
    # (scripts/strip_progress.py removes them from the committed notebooks; a fresh run still draws them).
    compare = item.compare_outputs

    def without_bars(test, ref, skip_compare=None):
        return compare([o for o in test if not is_progress(o)], [o for o in ref if not is_progress(o)], skip_compare)

    item.compare_outputs = without_bars
