"""Every @triton.jit kernel in kvlib builds for sm_75, sm_80 and sm_90 exactly as the JIT builds it at launch,
with no register spills, no more shared memory than a block may have there (a T4, sm_75, allows 64 KiB) and
no offset computed in 32 bits that can pass 2**31.

The interpreter (used everywhere else on CPU) never runs the real compiler and computes every offset without
overflow, so this is the only proof on a machine without a GPU that the kernels build and address memory
right at large sizes. It runs in a subprocess because this test process has Triton in interpreter mode.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, TRITON_INTERPRET="0", KVLIB_DEVICE="cpu")


def _background_result(folder: Path, timeout: float = 1800):
    """(stdout, stderr) of the build conftest.py started when the run started (at nice 19, so that it took only
    idle CPU), once it has exited; None when it was not started or ended unrecorded."""
    deadline = time.monotonic() + timeout
    while not (folder / "rc").exists():
        if not folder.is_dir() or time.monotonic() > deadline:
            return None
        time.sleep(1)
    return (folder / "out.json").read_text(), (folder / "err.txt").read_text()


@pytest.fixture(scope="module")
def compiled():
    folder = os.environ.get("KVLIB_COMPILE_RESULT")
    result = _background_result(Path(folder)) if folder else None
    if result is None:  # run on its own: build here, one process per architecture
        out = subprocess.run([sys.executable, "-m", "kvlib.course.compile_check", "--json", "--jobs", "3",
                              "--arch", "75", "80", "90"], capture_output=True, text=True, env=ENV, timeout=1200,
                             cwd=ROOT)
        result = out.stdout, out.stderr
    stdout, stderr = result
    assert stdout.strip(), f"compile_check printed nothing; stderr:\n{stderr[-3000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


def test_every_kernel_is_launched_by_a_spec_and_builds_cleanly(compiled):
    bad = [r for r in compiled if not r["ok"]]
    assert not bad, "\n".join(f"{r['kernel']} {r['arch']} [{r.get('spec')}]: {r.get('error')}" for r in bad)


def test_every_architecture_and_known_kernels_are_covered(compiled):
    kernels = {r["kernel"] for r in compiled}
    assert {"add_kernel", "_flash_attention_kernel", "_decode_kernel", "_grouped_decode_kernel",
            "_index_decode_kernel", "_kivi_decode_kernel", "_store_kv_kernel", "_sparse_decode_kernel"} <= kernels
    for k in kernels:
        assert {r["arch"] for r in compiled if r["kernel"] == k} >= {"sm_75", "sm_80", "sm_90"}, k


def test_builds_are_the_jits_specializations(compiled):
    """The JIT marks 16-divisible pointers and sizes; without that a build has scalar loads and twice the
    registers, which is what the old hand-written signatures compiled."""
    for r in compiled:
        assert r["registers"] > 0 and r["stack_bytes"] == 0 and r["local_bytes"] == 0, r
        assert r["shared_bytes"] <= {"sm_75": 65536, "sm_80": 166912, "sm_90": 232448}[r["arch"]], r
        assert r["i32_stride_products"] == [], r


def test_every_attention_kernel_has_a_predicted_ceiling(compiled):
    for r in compiled:
        if "decode" in r["kernel"] or "attention" in r["kernel"]:
            assert r.get("ceiling"), f"{r['kernel']} [{r['spec']}] {r['arch']}: no loop spec, no ceiling"
            c = r["ceiling"]
            assert c["loop_instructions"] > 10 and (c.get("issue_tbps", 0) > 0 or c.get("issue_tflops", 0) > 0), r


# The checks' own checks: the detectors on kernels whose answer is known, built in a fresh process.
SAMPLES = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def wraps(x_ptr, o_ptr, stride_b, n, TILE: tl.constexpr):
        b = tl.program_id(0)
        offs = tl.arange(0, TILE)
        x = tl.load(x_ptr + b * stride_b + offs, mask=offs < n)  # i32 * i32: wraps past 2**31
        tl.store(o_ptr + b * n + offs, x, mask=offs < n)  # a size standing in for a stride: wraps too

    @triton.jit
    def safe(x_ptr, o_ptr, stride_b, n, TILE: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, TILE)
        x = tl.load(x_ptr + b * stride_b + offs, mask=offs < n)
        tl.store(o_ptr + b * n + offs, x, mask=offs < n)

    @triton.jit
    def loaded_slot(x_ptr, o_ptr, slots_ptr, N, HD, TILE: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * 4 + tl.arange(0, 4)
        dst = tl.load(slots_ptr + rows, mask=rows < N, other=0) * HD  # a loaded int32 slot times a size
        offs = tl.arange(0, TILE)
        tl.store(o_ptr + dst[:, None] + offs[None, :], tl.zeros((4, TILE), tl.float32))

    @triton.jit
    def loop_var_times_size(x_ptr, o_ptr, n, D, TILE: tl.constexpr):
        offs = tl.arange(0, TILE)
        acc = tl.zeros((TILE,), tl.float32)
        for pos0 in range(0, n, 16):
            acc += tl.load(x_ptr + pos0 * D + offs)  # the loop variable times a size
        tl.store(o_ptr + offs, acc)

    @triton.jit
    def truncated(x_ptr, o_ptr, n, TILE: tl.constexpr):
        b = (tl.program_id(0).to(tl.int64) * 2).to(tl.int32)  # back to 32 bits
        offs = tl.arange(0, TILE)
        tl.store(o_ptr + b * n + offs, tl.load(x_ptr + offs))

    @triton.jit
    def tile_rows(x_ptr, o_ptr, stride_r, n_rows, TILE: tl.constexpr):
        rows = tl.arange(0, TILE)
        for r0 in range(0, n_rows, TILE):
            r = r0 + rows
            tl.store(o_ptr + r, tl.load(x_ptr + r * stride_r, mask=r < n_rows), mask=r < n_rows)
''')


def test_the_detectors_flag_32_bit_offsets_and_find_the_loop(tmp_path):
    (tmp_path / "samples.py").write_text(SAMPLES)
    script = textwrap.dedent('''
        import json, torch, samples
        from kvlib.course import compile_check as cc
        x, o = torch.zeros(4, 64), torch.zeros(4, 64)
        out = {}
        slots = torch.zeros(8, dtype=torch.int32)
        for k, args in ((samples.wraps, (x, o, 64, 48)), (samples.safe, (x, o, 64, 48)),
                        (samples.tile_rows, (x, o, 64, 200)), (samples.loaded_slot, (x, o, slots, 3, 128)),
                        (samples.loop_var_times_size, (x, o, 70, 128)), (samples.truncated, (x, o, 48))):
            c, _ = cc.jit_compile(k, args, dict(TILE=64), 90)
            out[k.fn.__name__] = dict(bad=cc.i32_stride_products(c.asm["ttir"]),
                                      loops=cc.sass_loops(cc._cuobjdump(c.asm["cubin"], "-sass")))
        print(json.dumps(out))
    ''')
    env = dict(ENV, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert any("%stride_b" in line for line in out["wraps"]["bad"]), out["wraps"]
    assert any("%n" in line for line in out["wraps"]["bad"]), out["wraps"]
    assert out["safe"]["bad"] == []
    for name in ("loaded_slot", "loop_var_times_size", "truncated"):
        assert len(out[name]["bad"]) == 1, (name, out[name])
    bad = out["tile_rows"]["bad"]  # r * stride_r, in the loop, on a tensor (the splat of stride_r may be unnamed)
    assert len(bad) == 1 and "arith.muli %r" in bad[0] and "xi32>" in bad[0], bad
    assert out["wraps"]["loops"] == [] and len(out["tile_rows"]["loops"]) == 1
    loop = out["tile_rows"]["loops"][0]
    assert 3 < loop["instructions"] < 200 and "LDG" in loop["opcodes"] and "STG" in loop["opcodes"], loop


def test_committed_predictions_are_current(compiled):
    """docs/results/predicted.md is generated from these builds; regenerate it when a kernel changes."""
    import triton

    from kvlib.course.compile_check import predicted_markdown

    path = ROOT / "docs" / "results" / "predicted.md"
    committed = path.read_text(encoding="utf-8")
    if f"Triton {triton.__version__}" not in committed:
        pytest.skip(f"predicted.md was generated with another Triton than {triton.__version__}")
    assert predicted_markdown(compiled) == committed, (
        "docs/results/predicted.md is stale: run TRITON_INTERPRET=0 KVLIB_DEVICE=cpu python -m kvlib.course.compile_check "
        "--predicted docs/results/predicted.md")
