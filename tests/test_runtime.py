"""Mode detection: CPU machines get the Triton interpreter, machines without Triton still work."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kvlib
from kvlib import runtime


def run_python(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=300)


def test_mode_is_consistent():
    assert runtime.DEVICE in ("cuda", "cpu")
    assert runtime.DEVICE == ("cuda" if torch.cuda.is_available() else "cpu")
    if runtime.DEVICE == "cpu" and runtime.HAS_TRITON:
        assert runtime.INTERPRETER and os.environ["TRITON_INTERPRET"] == "1"
    assert kvlib.DEVICE == runtime.DEVICE


def test_describe_reports_the_facts(capsys):
    info = runtime.describe()
    for key in ("mode", "device", "device_name", "torch", "triton", "python"):
        assert key in info
    assert info["torch"] == torch.__version__
    if runtime.DEVICE == "cuda":
        assert "compute_capability" in info and info["gpu_memory_GiB"] > 0
    out = capsys.readouterr().out
    assert "mode" in out and info["mode"] in out


def test_by_mode_picks_small_sizes_without_a_gpu():
    expected = "big" if runtime.DEVICE == "cuda" and not runtime.INTERPRETER else "small"
    assert runtime.by_mode(cpu="small", gpu="big") == expected


def test_cpu_mode_sets_interpreter_before_triton_and_says_so_once():
    r = run_python("""
        import os, sys, kvlib, kvlib.runtime as rt
        import kvlib.vector_add
        print(os.environ.get("TRITON_INTERPRET"), rt.INTERPRETER, rt.DEVICE)
    """, KVLIB_DEVICE="cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "True", "cpu"]
    assert r.stderr.count("CPU mode") == 1


def test_warns_when_triton_was_imported_first():
    r = run_python("""
        import warnings, triton
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import kvlib
        print(any("imported before kvlib" in str(x.message) for x in w))
    """, KVLIB_DEVICE="cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_without_triton_kvlib_imports_and_falls_back_to_references():
    # Simulate macOS: make `import triton` impossible in a fresh interpreter.
    r = run_python("""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        import torch, kvlib
        from kvlib import runtime
        from kvlib.vector_add import add
        x = torch.arange(10.0)
        assert torch.equal(add(x, x), 2 * x)
        add(x, x)
        print(runtime.mode(), runtime.HAS_TRITON, "triton" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["reference", "False", "False"]
    assert "Triton is not installed" in r.stderr
    assert r.stderr.count("vector_add.add") == 1  # the fallback message is printed once


def test_detection_survives_a_broken_cuda_driver():
    r = run_python("""
        import torch
        def broken(): raise RuntimeError("CUDA driver initialization failed")
        torch.cuda.is_available = broken
        import kvlib
        print(kvlib.DEVICE)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "cpu"


def test_fp32_dots_default_to_full_precision_unless_the_user_chose():
    """GPUs run fp32 tl.dot as TF32 unless told otherwise; the course's fp32 checks need IEEE."""
    code = "import os, kvlib; print(os.environ['TRITON_F32_DEFAULT'])"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_F32_DEFAULT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "ieee", out.stderr
    env["TRITON_F32_DEFAULT"] = "tf32"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "tf32", out.stderr


def test_cpu_threads_is_one_unless_kvlib_threads_says_otherwise(monkeypatch):
    monkeypatch.delenv("KVLIB_THREADS", raising=False)
    assert runtime.cpu_threads() == 1
    monkeypatch.setenv("KVLIB_THREADS", "2")
    assert runtime.cpu_threads() == 2
    for bad in ("0", "two", "-1", ""):
        monkeypatch.setenv("KVLIB_THREADS", bad)
        with pytest.raises(ValueError, match="KVLIB_THREADS"):
            runtime.cpu_threads()
