"""Known wrong answers to lab 04's exercises (KV memory): see kvlib.course.mistakes."""

from __future__ import annotations

import torch

__all__ = ['kv_bytes', 'sequences_that_fit', 'decode_step_time_floor', 'measured_kv_bytes', 'deployments_that_fit']

# --------------------------------------------------------------------------------------------
# Lab 04 · KV memory
# --------------------------------------------------------------------------------------------


def kv_bytes(cases):
    """cases: [(n_layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_element), ...]"""

    def each(f):
        return lambda: torch.tensor([f(*c) for c in cases])

    return {
        "the factor 2 is missing: every layer stores a key AND a value per head and token": each(
            lambda L, h, d, s, b, e: L * h * d * s * b * e),
        "batch is missing: each sequence of the batch has its own cache": each(
            lambda L, h, d, s, b, e: 2 * L * h * d * s * e),
        "bytes_per_element is missing: that counts numbers, not bytes": each(
            lambda L, h, d, s, b, e: 2 * L * h * d * s * b),
        "the result is in bits (× 8); count bytes": each(lambda L, h, d, s, b, e: 16 * L * h * d * s * b * e),
    }


def sequences_that_fit(cases):
    """cases: [(gpu_bytes, weight_bytes, bytes_per_sequence), ...]"""

    def each(f):
        return lambda: torch.tensor([f(*c) for c in cases])

    return {
        "no max(0, ...): when the weights alone exceed the GPU, nothing fits (0), not a negative number": each(
            lambda g, w, s: (g - w) // s),
        "the quotient is rounded to the nearest integer; a sequence fits only whole, so round down (//)": each(
            lambda g, w, s: max(0, round((g - w) / s))),
        "the quotient is rounded up; a sequence fits only whole, so round down (//)": each(
            lambda g, w, s: max(0, -(-(g - w) // s))),
        "the weights are not subtracted: they are loaded first, only the rest holds KV caches": each(
            lambda g, w, s: g // s),
    }


def decode_step_time_floor(cases, kv_of):
    """cases: [(spec, batch, context, bandwidth), ...]; ``kv_of(spec, context, batch)``: KV bytes."""

    def each(f):
        return lambda: torch.tensor([f(m, b, c, bw) for m, b, c, bw in cases], dtype=torch.float64)

    w = lambda m: m.weight_bytes("fp16")  # noqa: E731
    return {
        "the KV cache of one sequence only: a step reads the cache of every sequence in the batch": each(
            lambda m, b, c, bw: (w(m) + kv_of(m, c, 1)) / bw),
        "the weights are read once per sequence; the whole batch shares one pass over them": each(
            lambda m, b, c, bw: (b * w(m) + kv_of(m, c, b)) / bw),
        "the weights are missing: a step reads every weight once": each(lambda m, b, c, bw: kv_of(m, c, b) / bw),
        "the KV cache is missing: a step also reads every sequence's cached K/V": each(lambda m, b, c, bw: w(m) / bw),
    }




def measured_kv_bytes(case):
    """case: (n_layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_element) of the cache whose memory was
    measured; exercise 1's wrong formulas give these predictions (float64, as the check compares them)."""
    return {what: (lambda wrong=wrong: wrong()[0].to(torch.float64)) for what, wrong in kv_bytes([case]).items()}


def _choice(options, keep) -> torch.Tensor:
    """1 for each option ``keep(model, gpu_bytes)`` accepts, in order: the answer a wrong belief gives."""
    return torch.tensor([int(bool(keep(m, g))) for m, g in options])


def deployments_that_fit(options, batch: int, context: int, reserve_bytes: int):
    """options: [(ModelSpec, gpu_bytes), ...] for ``batch`` sequences of ``context`` tokens, fp16 weights and cache.
    The wrong decisions, as 0/1 per option (the check compares your set written the same way)."""

    def kv(m, b=batch, heads=None):
        return 2 * m.n_layers * (heads or m.n_kv_heads) * m.head_dim * context * b * 2

    def left(m, g):
        return g - m.weight_bytes("fp16") - reserve_bytes

    return {
        "the weights are left out: they are loaded first, and only the rest holds caches": lambda: _choice(
            options, lambda m, g: context <= m.max_context and kv(m) <= g - reserve_bytes),
        "the model's maximum context is left out: a model cannot serve sequences longer than "
        "max_position_embeddings, whatever the memory": lambda: _choice(
            options, lambda m, g: 0 < left(m, g) and kv(m) <= left(m, g)),
        "the cache is counted with the query heads: only the K/V heads are cached (GQA shares them)": lambda: _choice(
            options, lambda m, g: context <= m.max_context and 0 < left(m, g) and kv(m, heads=m.n_heads) <= left(m, g)),
        "the cache of one sequence only: every one of the batch's sequences keeps its own": lambda: _choice(
            options, lambda m, g: context <= m.max_context and 0 < left(m, g) and kv(m, b=1) <= left(m, g)),
    }
