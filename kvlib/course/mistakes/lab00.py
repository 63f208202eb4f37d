"""Known wrong answers to lab 00's exercises (first Triton kernel): see kvlib.course.mistakes."""

from __future__ import annotations

import math

import torch

__all__ = ['n_programs', 'offsets_and_mask', 'choose_tile', 'choose_tile_reference', 'axpy']

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


# The decision of exercise 3: which tile makes vector_add.add on n elements faster in the interpreter, and why.
TILE_CHOICES = (16, 1024)
TILE_REASONS = {
    1: "fewer masked lanes",  # wrong: masked lanes cost (almost) nothing
    2: "fewer programs: the interpreter pays a fixed Python cost per program",  # right
    3: "fewer bytes read",  # wrong: the same bytes either way
}


def choose_tile_reference(n=20_000):
    """The right (tile, reason) of exercise 3, kept here so that the lab's check cell does not show it: in the
    interpreter the tile that launches fewer programs is faster, for reason 2."""
    return min(TILE_CHOICES, key=lambda t: -(-n // t)), 2


def choose_tile(n=20_000):
    """Every wrong (tile, reason) answer to exercise 3, each with what it misses. The right one is (1024, 2)."""
    small, big = TILE_CHOICES
    p_small, p_big = -(-n // small), -(-n // big)
    m_small, m_big = p_small * small - n, p_big * big - n
    slower = (f"tile {small} launches {p_small:,} programs to tile {big}'s {p_big}, and the interpreter runs every "
              f"program as Python code with a fixed cost: measure both in the next cell")
    return {
        f"tile {small} because it masks fewer lanes ({m_small} against {m_big}): but masked lanes cost almost nothing; "
        + slower: (small, 1),
        f"tile {small} with the reason 'fewer programs': {slower}": (small, 2),
        f"tile {small} because it reads fewer bytes: both tiles read and write the same 3 × 4 × {n:,} bytes (masked "
        "lanes load nothing); " + slower: (small, 3),
        f"the right tile for the wrong reason: tile {big} masks more lanes ({m_big}) than tile {small} ({m_small}) and "
        "is still faster, so masked lanes are not what the time follows": (big, 1),
        f"the right tile for the wrong reason: both tiles read and write the same 3 × 4 × {n:,} bytes (a masked lane "
        "loads nothing); what differs is the number of programs": (big, 3),
    }


def axpy(alpha, x, y):
    return {
        "alpha is missing: the result is x + y": lambda: x + y,
        "alpha multiplies y instead of x": lambda: x + alpha * y,
        "alpha multiplies x + y": lambda: alpha * (x + y),
    }


