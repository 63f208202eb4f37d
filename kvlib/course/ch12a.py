"""Chapter 12a's harnesses: the rank functions the notebook launches (each rank is a new process that imports them
from here, since a function defined in a notebook cannot be imported by another process) and the tables it prints.

- ``hello`` / ``fails_on_rank``: a first process group, and what a failing rank looks like;
- ``mlp_split``: Megatron's column/row split of one MLP, in one process, against the whole MLP;
- ``tp_rule_table`` / ``tp_bytes_table``: which tensor-parallel sizes a model's heads allow (vLLM's rule) and the
  cache bytes each rank holds, measured against the formula;
- ``merge_demo`` / ``cp_bytes_table`` / ``cp_scaling_table``: decode context parallelism's merge, its bytes and
  its all-gather volume;
- ``time_table``: the decoding times the ranks measured, against one process;
- ``mla_table``: what one latent head (MLA) costs per GPU under tp, DCP and DP attention (cited configs).
"""

from __future__ import annotations

import os

import torch

__all__ = ["hello", "fails_on_rank", "mlp_split", "tp_rule_table", "tp_bytes_table", "merge_demo", "cp_bytes_table",
           "cp_scaling_table", "time_table", "one_process", "mla_table", "tp_choice_evidence", "check_tp_choice",
           "lab_merge_inputs", "check_merge"]


def _bytes(n: int) -> str:
    """A byte count as printed: every digit, with thousands separators (exact on every machine; MiB with decimals
    would look like float noise to nbval)."""
    return f"{int(n):,}"


# --------------------------------------------------------------------------------------------
# Section 1: a process group
# --------------------------------------------------------------------------------------------


def hello(rank: int, world_size: int) -> dict:
    """Rank function: who am I, which backend, how many threads, and one all-reduce of (rank + 1)."""
    import torch.distributed as dist

    from ..dist.launch import rank_device

    t = torch.tensor([float(rank + 1)], device=rank_device())  # NCCL reduces GPU tensors only
    dist.all_reduce(t)  # the sum over ranks, the same on every rank afterwards
    return {"rank": dist.get_rank(), "of": dist.get_world_size(), "backend": dist.get_backend(),
            "torch threads": torch.get_num_threads(), "sum of rank + 1": int(t.item()),
            "own process": os.getpid() != os.getppid()}


def fails_on_rank(rank: int, world_size: int, bad: int) -> None:
    """Rank function: rank ``bad`` raises; the others wait at a barrier that never completes."""
    import torch.distributed as dist

    if rank == bad:
        raise ValueError(f"rank {rank} cannot find its shard")
    dist.barrier()


# --------------------------------------------------------------------------------------------
# Section 2: Megatron's split, in one process
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def mlp_split(mlp, x: torch.Tensor, tp: int):
    """The MLP's output computed whole and as ``tp`` ranks would: gate/up split by output columns, down by input
    rows, the partial outputs summed (the all-reduce). Returns (whole, list of partials)."""
    import torch.nn.functional as F

    whole = mlp(x)
    w = mlp.w_gate.weight.shape[0] // tp
    partials = []
    for r in range(tp):
        cols = slice(r * w, (r + 1) * w)  # this rank's slice of the hidden width
        h = F.silu(x @ mlp.w_gate.weight[cols].T) * (x @ mlp.w_up.weight[cols].T)  # (T, hidden / tp)
        partials.append(h @ mlp.w_down.weight[:, cols].T)  # (T, C): a partial sum of the output
    return whole, partials


# --------------------------------------------------------------------------------------------
# Section 3: tensor parallelism's rule and bytes
# --------------------------------------------------------------------------------------------


def tp_rule_table(config, sizes, seq_len: int, dtype=torch.float32):
    """One row per tp: allowed by the heads? by the MLP width? K/V heads per rank, copies of each K/V head, cache
    bytes per rank and in the whole group for one sequence of ``seq_len``. The refusals, in vLLM's words, are in the
    table's ``attrs["refusals"]`` ({tp: message}): a column too narrow to show them whole would cut them."""
    import pandas as pd

    from ..dist import tp as tpm

    rows, refusals = [], {}
    for n in sizes:
        row = {"tp": n}
        try:
            p = tpm.plan(config, n, mlp=False)
        except ValueError as e:
            refusals[n] = str(e)
            rows.append({**row, "heads allow it": "no", "MLP width allows it": "", "K/V heads per rank": "",
                         "copies of each K/V head": "", "cache bytes per rank": "", "cache bytes, whole group": ""})
            continue
        try:
            tpm.plan(config, n)
            mlp_ok = "yes"
        except ValueError:
            mlp_ok = f"no: {n} does not divide {config.hidden_dim}"
        per_rank = tpm.kv_bytes_per_rank(config, n, seq_len, dtype=dtype)
        rows.append({**row, "heads allow it": "yes", "MLP width allows it": mlp_ok,
                     "K/V heads per rank": len(p.kv_heads[0]), "copies of each K/V head": p.kv_replicas,
                     "cache bytes per rank": _bytes(per_rank), "cache bytes, whole group": _bytes(per_rank * n)})
    table = pd.DataFrame(rows, dtype=object).set_index("tp")
    table.attrs["refusals"] = refusals
    return table


def tp_bytes_table(results, config):
    """Per rank: heads, the cache bytes its KVCache allocated (measured) and the formula's, all-reduces run."""
    import pandas as pd

    from ..dist import tp as tpm

    tp = len(results)
    rows = [{"rank": r["rank"], "query heads": list(r["q_heads"]), "K/V heads cached": list(r["kv_heads"]),
             "cache buffer (B, H_KV, S_max, D)": tuple(r["cache_shape"]), "cache bytes (measured)": r["cache_bytes"],
             "formula": tpm.kv_bytes_per_rank(config, tp, r["max_len"]), "all-reduces": r["all_reduces"],
             "all-reduce bytes / decode step": r["all_reduce_bytes_per_step"]}
            for r in results]
    return pd.DataFrame(rows).set_index("rank")


def one_process(model, prompt, n):
    """Greedy tokens of the same decoding in this one process (kvlib.generate with a KVCache), and its timings:
    {"seconds": wall, "cpu_seconds": CPU time of this thread}."""
    import time

    from ..generate import generate

    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.no_grad():
        tokens = generate(model, [prompt], n)[0].tolist()
    return tokens, {"seconds": time.perf_counter() - t0, "cpu_seconds": time.thread_time() - c0}


# --------------------------------------------------------------------------------------------
# Section 4: decode context parallelism
# --------------------------------------------------------------------------------------------


def merge_demo(S: int = 40, cp: int = 3, seed: int = 0):
    """One decode query over S random cached positions: attention over all of them, the ranks' merged partials, and
    the partials averaged. Returns (max |merged - full|, max |averaged - full|)."""
    from ..cache import decode_attention_ref
    from ..dist import cp as cpm

    g = torch.Generator().manual_seed(seed)
    B, H, H_KV, D = 1, 9, 3, 64  # SmolLM2's heads
    q = torch.randn(B, H, D, generator=g)
    k, v = torch.randn(B, H_KV, S, D, generator=g), torch.randn(B, H_KV, S, D, generator=g)
    full = decode_attention_ref(q, k, v, torch.full((B,), S, dtype=torch.int32))
    parts = [cpm.local_attention(q, k[:, :, cpm.stripe(r, cp, S)], v[:, :, cpm.stripe(r, cp, S)]) for r in range(cp)]
    merged = cpm.merge(q, torch.stack([o for o, _ in parts], 2), torch.stack([lse for _, lse in parts], 2), "torch")
    averaged = torch.stack([o for o, _ in parts]).mean(0)
    return float((merged - full).abs().max()), float((averaged - full).abs().max())


def cp_bytes_table(results, config):
    """Per rank: positions held, cache bytes (measured, formula), all-gather bytes received per step (measured,
    formula)."""
    import pandas as pd

    from ..dist import cp as cpm

    cp = len(results)
    rows = [{"rank": r["rank"], "positions held": len(r["positions"]), "first positions": r["positions"][:6],
             "cache bytes (measured)": r["cache_bytes"],
             "cache formula": cpm.kv_bytes_per_rank(config, cp, r["max_len"]),
             "all-gather bytes in / step (measured)": r["gathered_bytes_per_step"],
             "all-gather formula": cpm.allgather_bytes_per_step(config, cp)} for r in results]
    return pd.DataFrame(rows).set_index("rank")


def cp_scaling_table(config, cp: int, lengths, dtype=torch.float32):
    """For one sequence of each length: the cache per rank without and with cp, and the bytes one rank receives per
    decode step (which do not depend on the length)."""
    import pandas as pd

    from ..dist import cp as cpm

    rows = [{"sequence length": f"{S:,}", "cache bytes, one process": _bytes(cpm.kv_bytes_per_rank(config, 1, S, dtype=dtype)),
             f"cache bytes per rank, cp = {cp}": _bytes(cpm.kv_bytes_per_rank(config, cp, S, dtype=dtype)),
             "all-gather bytes in / decode step": _bytes(cpm.allgather_bytes_per_step(config, cp))}
            for S in lengths]
    return pd.DataFrame(rows).set_index("sequence length")


def time_table(n_tokens: int, one: dict, runs: dict):
    """Per new token: the decoding's wall time (a launched run's slowest rank, since every rank waits for the others
    at each collective), the CPU time of the thread that ran the model (each rank's, lowest to highest), and the wall
    time spent inside the collectives (waiting + transfer; lowest to highest). one: ``one_process``'s timings;
    runs: {name: launch results}."""
    import pandas as pd

    def ms(seconds):
        return round(1e3 * seconds / n_tokens, 1)

    def span(values):
        lo, hi = ms(min(values)), ms(max(values))
        return f"{lo} to {hi}" if lo != hi else f"{lo}"

    rows = [{"run": "one process", "processes": 1, "wall ms per token": ms(one["seconds"]),
             "CPU ms per token, each rank": f"{ms(one['cpu_seconds'])}", "ms per token inside collectives": "none"}]
    for name, res in runs.items():
        rows.append({"run": name, "processes": len(res), "wall ms per token": ms(max(r["seconds"] for r in res)),
                     "CPU ms per token, each rank": span([r["cpu_seconds"] for r in res]),
                     "ms per token inside collectives": span([r["collective_seconds"] for r in res])})
    return pd.DataFrame(rows).set_index("run")


# --------------------------------------------------------------------------------------------
# Section 5: MLA's single latent head (cited configs)
# --------------------------------------------------------------------------------------------

# DeepSeek-V3's config.json: 61 layers; MLA caches kv_lora_rank + qk_rope_head_dim = 512 + 64 numbers per token per
# layer (one latent "head" shared by all 128 query heads).
DEEPSEEK_V3 = {"layers": 61, "latent": 512 + 64, "query heads": 128}


def mla_table(seq_len: int = 131072, gpus: int = 8, dtype_bytes: int = 2):
    """Cache bytes per GPU for one sequence of ``seq_len`` on ``gpus`` GPUs: tp (every rank holds the one latent
    head), tp + DCP (the tokens striped), DP attention (each rank a different request, whole)."""
    import pandas as pd

    per_token = DEEPSEEK_V3["layers"] * DEEPSEEK_V3["latent"] * dtype_bytes
    whole = per_token * seq_len
    rows = [{"layout": f"tp = {gpus}", "GPUs holding this sequence": gpus, "cache bytes per GPU": _bytes(whole),
             "copies in the group": gpus},
            {"layout": f"tp = {gpus}, dcp = {gpus}", "GPUs holding this sequence": gpus,
             "cache bytes per GPU": _bytes(-(-seq_len // gpus) * per_token), "copies in the group": 1},
            {"layout": f"DP attention, {gpus} ranks", "GPUs holding this sequence": 1, "cache bytes per GPU": _bytes(whole),
             "copies in the group": 1}]
    return pd.DataFrame(rows).set_index("layout")


# --------------------------------------------------------------------------------------------
# Lab 12a
# --------------------------------------------------------------------------------------------

# The decision's model: Llama-3-70B's attention (64 query heads, 8 K/V heads of dim 128, 80 layers), an fp16 cache.
LAB_MODEL = {"n_heads": 64, "n_kv_heads": 8, "head_dim": 128, "n_layers": 80}
LAB_SIZES = (1, 2, 4, 6, 8, 16, 32, 64)


def tp_choice_evidence(seq_len: int = 131072, dtype_bytes: int = 2):
    """Cache GiB per rank for one sequence at each candidate tp (None where vLLM refuses the tp)."""
    m = LAB_MODEL
    out = {}
    for tp in LAB_SIZES:
        if m["n_heads"] % tp or (m["n_kv_heads"] >= tp and m["n_kv_heads"] % tp) or (m["n_kv_heads"] < tp and tp % m["n_kv_heads"]):
            out[tp] = None
            continue
        heads = max(1, m["n_kv_heads"] // tp)
        out[tp] = 2 * m["n_layers"] * seq_len * heads * m["head_dim"] * dtype_bytes / 2**30
    return out


def check_tp_choice(yours, budget_gib: float) -> bool:
    """Lab 12a's decision: the smallest tp whose cache per rank fits ``budget_gib`` (None if no tp does)."""
    from .check import check_choice
    from .mistakes import lab12a

    evidence = tp_choice_evidence()
    fits = [tp for tp, gib in evidence.items() if gib is not None and gib <= budget_gib]
    ref = min(fits) if fits else None
    return check_choice(f"smallest tp for {budget_gib:g} GiB of cache per GPU", yours, ref,
                        why=lambda: lab12a.tp_choice(yours, ref, evidence, budget_gib))


def lab_merge_inputs(seed: int = 0):
    """Lab 12a's merge exercise: 3 ranks' partials (B, H, R, D) and lses (B, H, R), with one rank's scores far
    higher and one rank empty (lse -inf, partial 0) for one head."""
    g = torch.Generator().manual_seed(seed)
    part, lse = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 4, 3, generator=g)
    lse[0, 1, 2] += 200.0  # rank 2's positions score far higher for head 1: exp(lse) overflows fp32
    lse[0, 3, 0], part[0, 3, 0] = float("-inf"), 0.0  # rank 0 holds no position yet for head 3
    return part, lse


def check_merge(yours_fn) -> bool:
    """Run ``yours_fn(part, lse)`` on the lab's inputs against ``kvlib.dist.cp.merge_ref``, with the diagnoses."""
    from .check import check
    from .mistakes import lab12a
    from ..dist import cp as cpm

    part, lse = lab_merge_inputs()
    B, H, R, D = part.shape
    ref = cpm.merge_ref(part.reshape(B * H, R, D), lse.reshape(B * H, R)).view(B, H, D)
    return check(yours_fn(part.clone(), lse.clone()), ref, name="merged (B, H, D)",
                 mistakes=lab12a.merge_across_ranks(part, lse))
