"""Chapter 12a's checks over NCCL: the notebook's first group (``ch12a.hello``, one all-reduce of a tensor on each
rank's GPU), then tensor-parallel and context-parallel greedy decoding against one process, on the course's tiny
model and on SmolLM2-135M (when its converted copy is on this machine).

    python scripts/dist_check.py            # needs 2 or more CUDA GPUs; skips (exit 0) with a message otherwise

The same rank functions run over gloo on a CPU in tests/test_dist_tp.py and tests/test_dist_cp.py; this script
switches the backend to NCCL (each rank on its own GPU). Exit status 1 if any run differs from one process or
allocates other bytes than the formula.
"""

from __future__ import annotations

import sys
import time


def _runs(model, name, prompt, n, sizes_tp, size_cp):
    import torch

    from kvlib.dist import cp, launch, tp
    from kvlib.generate import generate

    with torch.no_grad():
        ref = generate(model.to("cuda"), [prompt], n)[0].tolist()
    model = model.to("cpu")  # the ranks move their own shard (tp) or copy (cp) to their GPU
    ok = True
    for size in sizes_tp:
        t0 = time.perf_counter()
        out = launch.run(tp.generate_tp, size, model, prompt, n, backend="nccl", timeout_s=300)
        same = all(r["tokens"] == ref for r in out)
        bytes_ok = all(r["cache_bytes"] == tp.kv_bytes_per_rank(model.config, size, r["max_len"]) for r in out)
        ok &= same and bytes_ok
        print(f"{name} tp={size} nccl: token-identical {same} | cache bytes = formula {bytes_ok} | "
              f"{max(r['seconds'] for r in out) / n * 1e3:.1f} ms/token | launch {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    out = launch.run(cp.generate_cp, size_cp, model, prompt, n, backend="nccl", timeout_s=300)
    same = all(r["tokens"] == ref for r in out)
    bytes_ok = all(r["cache_bytes"] == cp.kv_bytes_per_rank(model.config, size_cp, r["max_len"])
                   and r["gathered_bytes_per_step"] == cp.allgather_bytes_per_step(model.config, size_cp) for r in out)
    ok &= same and bytes_ok
    print(f"{name} cp={size_cp} nccl: token-identical {same} | cache and all-gather bytes = formulas {bytes_ok} | "
          f"{max(r['seconds'] for r in out) / n * 1e3:.1f} ms/token | launch {time.perf_counter() - t0:.1f} s")
    return ok


def main() -> int:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(f"dist_check: SKIP: tp/cp over NCCL needs 2 or more CUDA GPUs, found {gpus} "
              "(the CPU tests run the same rank functions over gloo)")
        return 0
    import kvlib  # noqa: F401  (decides the mode first)
    from kvlib.model import load_pretrained, load_tiny

    from kvlib.course import ch12a
    from kvlib.dist import launch

    ok = True
    n = min(gpus, 3)  # the notebook's first group: one all-reduce of rank + 1 on every rank's GPU
    hello = launch.run(ch12a.hello, n, backend="nccl", timeout_s=120)
    same = all(h["sum of rank + 1"] == n * (n + 1) // 2 and h["backend"] == "nccl" for h in hello)
    ok &= same
    print(f"hello nccl x{n}: every rank holds the sum {n * (n + 1) // 2}: {same}")
    tiny, tok = load_tiny(device="cpu")
    sizes = [s for s in (2, 4, 8) if s <= gpus]  # the tiny model's 8 heads
    ok &= _runs(tiny, "tiny", tok.encode("The cache holds the keys"), 24, sizes, min(gpus, 4))
    try:
        smol, stok = load_pretrained("smollm2-135m-instruct", device="cpu")
    except Exception as e:  # no network and no converted copy on this machine
        print(f"dist_check: SmolLM2 skipped: {type(e).__name__}: {str(e).splitlines()[0]}")
    else:
        sizes = [3] if gpus >= 3 else []  # 9 query heads: tp 3 (tp 9 fails the MLP width 1536)
        if not sizes:
            print("dist_check: SmolLM2 tp skipped: tp must divide its 9 query heads; 3 needs 3 GPUs")
        ok &= _runs(smol, "SmolLM2-135M", stok.encode("The key-value cache of a transformer stores"), 24, sizes,
                    min(gpus, 3))
    print("dist_check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
