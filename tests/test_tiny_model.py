"""The bundled tiny model: it loads, it is better than a unigram model by a wide margin, its card is
true, its text reads like its corpus, and the training script runs."""

import json
import re
import subprocess
import sys

import pytest
import torch

from kvlib.corpus import ByteTokenizer, build_corpus, split_corpus
from kvlib.generate import generate_naive
from kvlib.model import TINY_DIR, load_tiny
from kvlib.train import evaluate, unigram_loss


@pytest.fixture(scope="module")
def tiny():
    return load_tiny(device="cpu")


@pytest.fixture(scope="module")
def log():
    return json.loads((TINY_DIR / "train_log.json").read_text())


def test_weights_are_small_safetensors_and_the_model_is_mha_with_8_heads(tiny):
    model, tok = tiny
    size = (TINY_DIR / "model.safetensors").stat().st_size
    assert size <= 20 * 2**20
    assert not list(TINY_DIR.glob("*.bin")) and not list(TINY_DIR.glob("*.pt"))
    cfg = model.config
    assert cfg.n_heads == 8 and cfg.n_kv_heads == 8 and cfg.vocab_size == tok.vocab_size == 256
    assert 1_000_000 <= cfg.num_params() <= 10_000_000


def test_held_out_loss_beats_unigram_by_a_wide_margin(tiny, log):
    model, tok = tiny
    train_text, val_text = split_corpus(build_corpus())
    train_ids = torch.tensor(tok.encode(train_text))
    val_ids = torch.tensor(tok.encode(val_text))
    val = evaluate(model, val_ids, 256, max_windows=32)
    uni = unigram_loss(train_ids, val_ids)
    assert val < 0.6 * uni, f"validation {val:.3f} vs unigram {uni:.3f} nats/byte"
    # the card's figures were measured on this corpus recipe; rebuilding it gives the same numbers
    # when the Python version matches (the corpus comes from the standard library)
    if sys.version.split()[0] == log["python"]:
        assert abs(uni - log["unigram_val_loss"]) < 1e-3
        assert abs(val - log["val_loss"]) < 0.05


def test_model_card_states_the_measured_figures(log):
    card = (TINY_DIR / "MODEL_CARD.md").read_text()
    for key in ("train_loss", "val_loss", "unigram_val_loss"):
        assert f"{log[key]:.3f}" in card, key
    assert f"{log['params']:,}" in card and f"{log['steps']:,}" in card
    for prompt in log["samples"]:
        assert repr(prompt) in card


def test_greedy_text_reads_like_docstrings(tiny):
    model, tok = tiny
    out = generate_naive(model, [tok.encode("This module provides "), tok.encode("class ")], 100, eos_id=tok.eos_id)
    text = tok.decode(out[0]) + " " + tok.decode(out[1])
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 8, text
    common = {"the", "of", "a", "is", "to", "and", "in", "if", "for", "be", "or", "an", "as", "by", "with",
              "return", "returns", "object", "value", "string", "list", "file", "name", "not", "this"}
    assert sum(w.lower() in common for w in words) >= 3, text
    assert sum(c.isalpha() or c in " \n.,()'_" for c in text) / max(1, len(text)) > 0.85, text


def test_training_script_smoke_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvlib.train", "--steps", "3", "--batch", "2", "--seq-len", "32",
                        "--precision", "fp32", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("config.json", "model.safetensors", "MODEL_CARD.md", "train_log.json"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "train_log.json").read_text())["steps"] == 3


def test_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # ok"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("abc") + [tok.eos_id]) == "abc"
