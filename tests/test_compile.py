"""Every @triton.jit kernel in kvlib compiles for sm_75, sm_80 and sm_90, with no register spills and no
more shared memory than a block may have there (a T4, sm_75, allows 64 KiB).

The interpreter (used everywhere else on CPU) never runs the real compiler, so this is the only
proof on a machine without a GPU that the kernels build. It runs in a subprocess because this
test process has Triton in interpreter mode.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0", KVLIB_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-m", "kvlib.compile_check", "--json", "--arch", "75", "80", "90"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.stdout.strip(), f"compile_check printed nothing; stderr:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_kernel_has_a_compile_spec_and_compiles(compiled):
    bad = [r for r in compiled if not r["ok"]]
    assert not bad, "\n".join(f"{r['kernel']} {r['arch']}: {r.get('error')}" for r in bad)


def test_every_architecture_and_known_kernels_are_covered(compiled):
    kernels = {r["kernel"] for r in compiled}
    assert {"add_kernel", "_flash_attention_kernel", "_decode_kernel", "_grouped_decode_kernel"} <= kernels
    for k in kernels:
        assert {r["arch"] for r in compiled if r["kernel"] == k} >= {"sm_75", "sm_80", "sm_90"}, k


def test_resource_usage_is_reported(compiled):
    for r in compiled:
        assert r["registers"] > 0 and r["stack_bytes"] == 0 and r["local_bytes"] == 0, r
        assert r["shared_bytes"] <= {"sm_75": 65536, "sm_80": 166912, "sm_90": 232448}[r["arch"]], r
