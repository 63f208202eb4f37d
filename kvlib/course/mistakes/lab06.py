"""Known wrong answers to lab 06's exercises (INT8 KV): see kvlib.course.mistakes."""

from __future__ import annotations

import math

import torch

from ._common import NO_SQRT_D

__all__ = ['quantized_values', 'quant_scales', 'dequantize', 'int8_attention_one', 'axis_choice']

# --------------------------------------------------------------------------------------------
# Lab 06 · INT8 KV
# --------------------------------------------------------------------------------------------


def _groups(x, dim):
    return tuple(range(x.dim())) if dim is None else dim


def _quant(x, dim, *, rounding="away", levels=127, absolute=True, zero_scale=1.0):
    amax = (x.float().abs() if absolute else x.float()).amax(dim=_groups(x, dim), keepdim=True)
    scale = torch.where(amax > 0, amax / levels, torch.full_like(amax, zero_scale))
    y = x.float() / scale
    if rounding == "away":
        r = torch.sign(y) * torch.floor(y.abs() + 0.5)
    elif rounding == "even":
        r = torch.round(y)
    elif rounding == "up":
        r = torch.floor(y + 0.5)
    else:  # truncation, what .to(torch.int8) does by itself
        r = torch.trunc(y)
    return r.clamp(-127, 127).nan_to_num(0).to(torch.int8), scale


TORCH_ROUND = ("torch.round rounds half to even (2.5 -> 2); the store kernel rounds half away from zero: "
               "sign(y) * floor(|y| + 0.5)")


def quantized_values(x, dim):
    return {
        "x / scale is converted with .to(torch.int8) without rounding, which truncates toward zero: round first, "
        "sign(y) * floor(|y| + 0.5)": lambda: _quant(x, dim, rounding="trunc")[0],
        TORCH_ROUND: lambda: _quant(x, dim, rounding="even")[0],
        "floor(y + 0.5) rounds -2.5 up to -2; round half away from zero: sign(y) * floor(|y| + 0.5)": lambda: _quant(
            x, dim, rounding="up")[0],
        "the scale is amax / 128; the largest magnitude must map to 127": lambda: _quant(x, dim, levels=128)[0],
        "the scale is amax / 255 (that is for unsigned 8-bit); symmetric int8 maps amax to 127": lambda: _quant(
            x, dim, levels=255)[0],
        "the max is taken of x, not of |x|: a group whose largest magnitude is negative gets the wrong scale":
            lambda: _quant(x, dim, absolute=False)[0],
    }


def quant_scales(x, dim):
    return {
        "the scale is amax / 128; the largest magnitude must map to 127": lambda: _quant(x, dim, levels=128)[1],
        "the scale is amax / 255 (that is for unsigned 8-bit); symmetric int8 maps amax to 127": lambda: _quant(
            x, dim, levels=255)[1],
        "the max is taken of x, not of |x|": lambda: _quant(x, dim, absolute=False)[1],
        "an all-zero group got scale 0: give it scale 1 (its values are 0 anyway), or x / scale is 0/0": lambda: _quant(
            x, dim, zero_scale=0.0)[1],
        "the scale is amax itself; it is amax / 127": lambda: _quant(x, dim, levels=1)[1],
    }


def dequantize(q, scale):
    return {"q is divided by the scale; x_hat = q * scale": lambda: q.float() / scale}


def int8_attention_one(q, k_q, k_scale, v_q, v_scale, L):
    from ...quant import int8_decode_attention_ref

    one = lambda t: t[None, None]  # noqa: E731

    def ref(ks=k_scale, vs=v_scale, qq=q, length=L):
        return int8_decode_attention_ref(one(qq), one(k_q), one(ks), one(v_q), one(vs), torch.tensor([length]))[0, 0]

    ones = torch.ones_like(k_scale)
    return {
        "V's scale is missing: each row's probability must be multiplied by v_scale[s] (the values are int8 "
        "multiples of it)": lambda: ref(vs=ones),
        "K's scale is missing: each row's score must be multiplied by k_scale[s]": lambda: ref(ks=ones),
        "both scales are missing: the int8 numbers are multiples of their row's scale": lambda: ref(ones, ones),
        "K's scale was used for V too: V has scales of its own": lambda: ref(vs=k_scale),
        NO_SQRT_D: lambda: ref(qq=q * math.sqrt(q.shape[0])),
        "all S rows were read: only the first L are valid": lambda: ref(length=k_q.shape[0]),
    }




def axis_choice(yours: dict, ref: dict, evidence) -> list[str]:
    """Lab 06's decision (the axis along which K and V get their scales): one line for each tensor whose axis
    differs from the reference, saying why from the evidence (``kvlib.course.ch06.axis_evidence``)."""
    lines = []
    for t in ("K", "V"):
        mine, right = yours.get(t), ref[t]
        if mine == right:
            continue
        if mine not in ("per-token", "per-channel"):
            lines.append(f"{t}: {mine!r} is not one of the two axes: 'per-token' or 'per-channel'")
            continue
        e = evidence.loc[t]
        ratio, err_mine, err_right = e["largest / median channel max"], e[f"{mine} error"], e[f"{right} error"]
        if mine == "per-token":
            lines.append(f"{t} per token: its largest channel is {ratio:.1f}x the median one, so in every token it "
                         f"sets the row's scale and coarsens the other channels ({err_mine:.4f} vs {err_right:.4f})")
        else:
            lines.append(f"{t} per channel: its channels are even (largest {ratio:.1f}x the median) but its tokens are "
                         f"not, and a small token gets the step of the largest ({err_mine:.4f} vs {err_right:.4f})")
    return lines
