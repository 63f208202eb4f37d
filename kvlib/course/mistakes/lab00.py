"""Known wrong answers to lab 00's exercises (first Triton kernel): see kvlib.course.mistakes."""

from __future__ import annotations

import math

import torch

__all__ = ['n_programs', 'offsets_and_mask', 'axpy']

# --------------------------------------------------------------------------------------------
# Lab 00 · first Triton kernel
# --------------------------------------------------------------------------------------------


def n_programs(cases):
    """cases: [(n, tile), ...]"""
    return {
        "n // tile rounds down: the last, partly filled tile gets no program": lambda: torch.tensor(
            [n // t for n, t in cases]),
        "n // tile + 1 is one program too many when n is a multiple of tile": lambda: torch.tensor(
            [n // t + 1 for n, t in cases]),
        "math.ceil(n / tile) goes through a float, which cannot hold every large n exactly: "
        "stay with integers, (n + tile - 1) // tile": lambda: torch.tensor([math.ceil(n / t) for n, t in cases]),
    }


def offsets_and_mask(pid, n, tile):
    base = pid * tile + torch.arange(tile)
    return {
        "the mask keeps offset n too (<= instead of <): the last valid index is n - 1": lambda: [base, base <= n],
        "the offsets start at pid, not at pid * tile: each program owns a whole tile": lambda: [
            pid + torch.arange(tile), pid + torch.arange(tile) < n],
        "the offsets ignore pid: every program would read the first tile": lambda: [
            torch.arange(tile), torch.arange(tile) < n],
    }


def axpy(alpha, x, y):
    return {
        "alpha is missing: the result is x + y": lambda: x + y,
        "alpha multiplies y instead of x": lambda: x + alpha * y,
        "alpha multiplies x + y": lambda: alpha * (x + y),
    }


