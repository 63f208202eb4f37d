"""Train the course's tiny model on the CPU: ``python -m kvlib.train``.

What it does, start to finish (about 15 minutes on 2 CPU cores):
1. builds the corpus from the standard library's docstrings (kvlib.corpus), byte-level tokens;
2. trains an 8-head, MHA, Llama-style ``Transformer`` with AdamW on random windows of the
   training text (seeded: the same machine gives the same weights);
3. measures train/validation loss and the unigram baseline (the loss of a model that only knows
   how often each byte occurs), greedy continuations of a few prompts;
4. writes ``config.json`` + ``model.safetensors`` (Hugging Face Llama layout, so ``load_hf`` and
   ``transformers`` both read it), ``train_log.json`` and ``MODEL_CARD.md`` to ``--out``.

``--steps 20 --out /tmp/x`` is a quick smoke run (the test suite does this).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .corpus import ByteTokenizer, build_corpus, fingerprint, split_corpus
from .model import TINY_DIR, ModelConfig, Transformer, save_hf

TINY_CONFIG = ModelConfig(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=8, hidden_dim=688,
                          max_seq_len=1024, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)
PROMPTS = ["Return the ", "This module provides ", "class ", "If the optional argument ", "The socket "]


def unigram_loss(train_ids: torch.Tensor, val_ids: torch.Tensor) -> float:
    """Cross-entropy (nats/byte) on validation of the byte frequencies counted on train (+1 smoothing)."""
    counts = torch.bincount(train_ids, minlength=256).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[val_ids].mean())


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-byte cross-entropy over up to ``max_windows`` evenly spaced windows (no gradients; the model
    is left in the mode it was in)."""
    was_training = model.training
    model.eval()
    n = (len(ids) - 1) // seq_len
    starts = torch.linspace(0, (n - 1) * seq_len, min(n, max_windows)).long()
    losses = []
    with torch.no_grad():
        for chunk in starts.split(16):
            x = torch.stack([ids[s: s + seq_len] for s in chunk.tolist()])
            y = torch.stack([ids[s + 1: s + 1 + seq_len] for s in chunk.tolist()])
            losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum"))
    model.train(was_training)
    return float(sum(losses) / (len(starts) * seq_len))


@torch.no_grad()
def greedy(model, tok, prompt: str, n: int = 120) -> str:
    ids = torch.tensor([tok.encode(prompt)])
    for _ in range(n):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        if nxt.item() == tok.eos_id:
            break
        ids = torch.cat([ids, nxt], dim=1)
    return tok.decode(ids[0])


def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - older builds: stay in fp32
        return False


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train the course's tiny byte-level model on the CPU.")
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="matmul precision while training (auto: bf16 autocast where the CPU has native "
                         "bf16, about 3x faster; weights stay fp32 either way)")
    ap.add_argument("--out", type=Path, default=TINY_DIR)
    args = ap.parse_args(argv)

    from tqdm.auto import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    tok = ByteTokenizer()
    docs = build_corpus()
    train_text, val_text = split_corpus(docs)
    train_ids = torch.tensor(tok.encode(train_text), dtype=torch.long)
    val_ids = torch.tensor(tok.encode(val_text), dtype=torch.long)
    print(f"corpus: {len(docs)} documents, train {len(train_ids):,} bytes, validation {len(val_ids):,} bytes",
          file=sys.stderr)

    bf16 = args.precision == "bf16" or (args.precision == "auto" and _cpu_has_bf16())
    model = Transformer(TINY_CONFIG)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    warmup = min(200, max(1, args.steps // 10))
    log = []
    bar = tqdm(range(args.steps), desc="training", mininterval=2.0)
    for step in bar:
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s: s + args.seq_len] for s in starts.tolist()])
        y = torch.stack([train_ids[s + 1: s + 1 + args.seq_len] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            entry = {"step": step, "train_loss_batch": round(loss.item(), 4)}
            if step % 300 == 0 or step == args.steps - 1:  # a quick look at held-out loss (16 windows)
                entry["val_loss_16"] = round(evaluate(model, val_ids, args.seq_len, max_windows=16), 4)
            log.append(entry)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    train_seconds = time.time() - t_start

    model.eval()
    final = {
        "train_loss": round(evaluate(model, train_ids, args.seq_len), 4),
        "val_loss": round(evaluate(model, val_ids, args.seq_len), 4),
        "unigram_val_loss": round(unigram_loss(train_ids, val_ids), 4),
    }
    samples = {p: greedy(model, tok, p) for p in PROMPTS}
    info = {
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "peak_lr": args.lr, "seed": args.seed,
        "tokens_seen": args.steps * args.batch * args.seq_len, "params": TINY_CONFIG.num_params(),
        "documents": len(docs), "train_bytes": len(train_ids), "val_bytes": len(val_ids),
        "corpus_fingerprint": fingerprint(train_text + val_text), "python": platform.python_version(),
        "torch": torch.__version__, "train_seconds": round(train_seconds, 1),
        "threads": torch.get_num_threads(), "precision": "bf16 autocast" if bf16 else "fp32", **final, "samples": samples, "log": log,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    save_hf(model, args.out)
    (args.out / "train_log.json").write_text(json.dumps(info, indent=1) + "\n")
    (args.out / "MODEL_CARD.md").write_text(model_card(info))
    print(json.dumps(final), file=sys.stderr)
    return info


def model_card(info: dict) -> str:
    c = TINY_CONFIG
    bits = 1 / math.log(2)
    lines = [
        "# kvlib tiny model",
        "",
        "A byte-level, Llama-style decoder trained by `python -m kvlib.train` on the CPU. It exists so that",
        "every chapter can run a *real* trained model anywhere, in seconds. It writes Python-docstring-like",
        "English; it knows nothing else.",
        "",
        "## Architecture",
        f"- {c.n_layers} layers, width {c.dim}, {c.n_heads} heads of dim {c.head_dim}, {c.n_kv_heads} K/V heads (MHA),",
        f"  SwiGLU MLP of width {c.hidden_dim}, RMSNorm, RoPE (theta {c.rope_theta:g}), untied embeddings",
        f"- vocabulary: 256 byte values (UTF-8 bytes); id 0 (NUL) is end-of-text",
        f"- parameters: {info['params']:,}",
        "- weights: `model.safetensors` (fp32) + `config.json` in the Hugging Face `LlamaForCausalLM` layout",
        "",
        "## Corpus recipe (built at train time, nothing downloaded, no text committed)",
        "`kvlib.corpus.build_corpus()`: the docstrings of the Python standard library's builtins, modules,",
        "classes, functions and methods (ASCII, at least 40 characters, deduplicated, in a fixed order) and the",
        "`pydoc_data.topics` help texts. Every 20th document is held out for validation.",
        f"- Python {info['python']}: {info['documents']:,} documents, {info['train_bytes']:,} training bytes,",
        f"  {info['val_bytes']:,} validation bytes (fingerprint `{info['corpus_fingerprint']}`)",
        "",
        "## Training",
        f"- {info['steps']:,} AdamW steps (betas 0.9/0.95, weight decay 0.1, peak lr {info['peak_lr']}, warm-up then",
        f"  cosine), batch {info['batch']} x {info['seq_len']} bytes = {info['tokens_seen']:,} bytes seen, seed {info['seed']}",
        f"- {info['precision']} matmuls, fp32 weights; wall time {info['train_seconds'] / 60:.1f} min on the CPU with "
        f"{info['threads']} threads (torch {info['torch']}), corpus building included",
        *([f"- note: {info['note']}"] if info.get("note") else []),
        "",
        "Held-out loss during training (16 validation windows, nats/byte): "
        + ", ".join(f"step {e['step']}: {e['val_loss_16']:.3f}" for e in info["log"] if "val_loss_16" in e) + ".",
        "",
        "## Results (nats per byte; bits per byte in brackets)",
        "| | loss |",
        "|---|---|",
        f"| train | {info['train_loss']:.3f} ({info['train_loss'] * bits:.2f} bits) |",
        f"| validation (held-out documents) | {info['val_loss']:.3f} ({info['val_loss'] * bits:.2f} bits) |",
        f"| unigram baseline on validation | {info['unigram_val_loss']:.3f} ({info['unigram_val_loss'] * bits:.2f} bits) |",
        "",
        f"The model's validation loss is {info['unigram_val_loss'] / info['val_loss']:.2f}x lower than the unigram "
        "baseline's.",
        "",
        "## Greedy continuations (120 bytes at most)",
        "",
    ]
    for p, s in info["samples"].items():
        lines += [f"- prompt `{p!r}`:", "", "  ```", *("  " + ln for ln in s.splitlines()), "  ```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
