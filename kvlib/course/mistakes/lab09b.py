"""Known wrong answers to lab 09b's exercises (keeping fewer bits): see kvlib.course.mistakes.

Exercises 1-3 (2-bit groups, KIVI's keys, MLA's absorbed attention) share their diagnoses with lab 09
(``kvlib.course.mistakes.lab09``), re-exported here; exercise 4's decision has its own."""

from __future__ import annotations

from .lab09 import absorbed_attention, quantize_2bit, quantize_keys_2bit

__all__ = ["quantize_2bit", "quantize_keys_2bit", "absorbed_attention", "budget_choice"]

MEASURED = "held % of fp16 (measured)"
NOMINAL = "nominal % of fp16"
KL = "KL from the full cache (nats/token)"


def budget_choice(yours: str, ref: str | None, evidence, budget_pct: float) -> list[str]:
    """Lab 09b's decision (the cache to deploy within a memory budget): why ``yours`` is not ``ref``, from the
    evidence (``kvlib.course.ch09b.budget_evidence``), in one short line each."""
    if yours not in evidence.index:
        return [f"{yours!r} is not one of the candidates: " + ", ".join(repr(n) for n in evidence.index)]
    mine = evidence.loc[yours]
    lines = []
    if mine[MEASURED] > budget_pct:
        if mine[NOMINAL] <= budget_pct:
            lines.append(f"{yours} is {mine[NOMINAL]:.1f}% of fp16 by its bits but holds {mine[MEASURED]:.1f}% measured: "
                         "scales, zero points and exact windows count, so it is over the budget")
        else:
            lines.append(f"{yours} holds {mine[MEASURED]:.1f}% of fp16, over the {budget_pct:g}% budget")
    elif ref is not None:
        better = evidence.loc[ref]
        lines.append(f"{yours} fits ({mine[MEASURED]:.1f}%), but {ref} fits too ({better[MEASURED]:.1f}%) and is closer "
                     f"to the full cache: KL {better[KL]:.4f} vs {mine[KL]:.4f}")
        if "not KIVI" in yours:
            lines.append("its prompt attended through the 2-bit codes: same bytes as KIVI, more loss")
    if ref is None:
        lines.append(f"no candidate holds {budget_pct:g}% or less: the answer is None (none fits)")
    return lines
