"""Known wrong answers to lab 02's exercises (naive decoding): see kvlib.course.mistakes."""

from __future__ import annotations

import torch

__all__ = ['greedy_naive', 'recomputed_kv_rows', 'growth', 'GROWTH_KEYS', 'top_k_sample']

# --------------------------------------------------------------------------------------------
# Lab 02 · naive decoding
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_naive(model, prompt_ids, n, reference):
    def first_position():
        ids = list(prompt_ids)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, 0].argmax()))
        return ids[len(prompt_ids):]

    def never_grows():
        return [int(model(torch.tensor([list(prompt_ids)]))[0, -1].argmax())] * n

    return {
        "the next token comes from the logits of the first position, logits[0, 0]; the prediction for the "
        "next token is at the last one, logits[0, -1]": first_position,
        "the sequence never grows, so every step predicts the same token: append each new token to ids": never_grows,
        "the prompt is returned too: return only the n new tokens": lambda: list(prompt_ids) + [
            int(t) for t in reference],
    }


def recomputed_kv_rows(cases):
    """cases: [(prompt_len, n_new), ...]"""
    naive = [n * p + n * (n - 1) // 2 for p, n in cases]
    minimum = [p + n - 1 for p, n in cases]
    return {
        "the minimum counts the last new token too: it is never fed to the model, so prompt_len + n_new - 1":
            lambda: torch.tensor([[a, p + n] for a, (p, n) in zip(naive, cases)]),
        "the naive count is one step off: step i feeds prompt_len + i tokens for i = 0 … n_new - 1, "
        "not i = 1 … n_new": lambda: torch.tensor(
            [[n * p + n * (n + 1) // 2, b] for b, (p, n) in zip(minimum, cases)]),
        "the naive count uses the final length at every step, n_new * (prompt_len + n_new); the sequence "
        "grows one token per step": lambda: torch.tensor([[n * (p + n), b] for b, (p, n) in zip(minimum, cases)]),
    }


GROWTH_KEYS = "ABCDEF"


def growth(reference: dict):
    """Exercise 3's decision: the power of n each count grows like, A-F (see the lab), as a (6,) tensor.

    reference: the powers measured by counting on the real loops, {"A": 1, ...}; each mistake changes the
    answers a learner typically gets wrong and keeps the rest right.
    """
    def answer(**changed):
        return lambda: torch.tensor([{**reference, **changed}[k] for k in GROWTH_KEYS])

    r = reference
    return {
        "B: a total adds up the steps; n steps that each grow like n add up to about n²/2, one power more than "
        "one step (A)": answer(B=r["A"]),
        "C: the naive step scores all t query rows against the keys, t × t scores (all computed, one row used), so "
        "it grows like n², not n": answer(C=r["A"]),
        "D: the sum of n steps that each grow like n² grows like n³, one power more than one step (C)": answer(
            D=r["C"]),
        "E: with a cache a step computes K/V for its one new token only; a count that does not grow is n^0":
            answer(E=r["E"] + 1),
        "F: with a cache each position's K/V is computed once, so the total grows like n, not n²": answer(
            F=r["F"] + 1),
        "E and F: the cached loop computes one K/V row per step at any length (n^0), so n in all": answer(
            E=r["A"], F=r["B"]),
        "A and B are swapped: one step grows like n, the total of n steps like n²": answer(A=r["B"], B=r["A"]),
    }


def top_k_sample(logits, k, temperature, seed, draws):
    from ...generate import sample_next

    def sample(t, kk):
        g = torch.Generator().manual_seed(seed)
        return torch.stack([sample_next(logits, t, top_k=kk, generator=g) for _ in range(draws)])

    out = {
        "the temperature is not used: divide the logits by it before the softmax": lambda: sample(1.0, k),
        "the logits are multiplied by the temperature; divide them by it": lambda: sample(1 / temperature, k),
        "one token too many survives the top-k mask: keep exactly the k largest logits": lambda: sample(
            temperature, k + 1),
        "the draw is greedy (argmax); sample with torch.multinomial(probs, 1, generator=generator)": lambda: (
            logits.argmax(dim=-1).expand(draws, -1)),
    }
    if k > 1:
        out["one token too few survives: the mask drops the k-th largest too (mask logits < kth, not <= kth)"] = (
            lambda: sample(temperature, k - 1))
    return out


