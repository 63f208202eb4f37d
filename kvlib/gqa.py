"""Grouped-query attention (chapter 07): fewer K/V heads, and a kernel that reads each once.

What you will learn:
- GQA: H query heads share H_KV K/V heads in groups of n_rep = H / H_KV (query head h reads K/V
  head h // n_rep); MQA is H_KV = 1. The cache shrinks by the factor n_rep;
- ``repeat_kv``: the simplest way to run GQA with an MHA kernel — copy each K/V head n_rep times.
  It costs memory traffic: every copy is written and read again;
- ``grouped_decode_attention``: one program per (sequence, K/V head) loads each K/V tile *once*
  and computes all n_rep query heads of its group with ``tl.dot`` (the group padded to 16 rows, the
  smallest ``tl.dot`` tile), so the bytes read per token drop by n_rep;
- ``mha_to_gqa``: converting a trained MHA model by mean-pooling the K/V projection heads of each
  group (as the GQA paper, Ainslie et al. 2023, does), optionally followed by a short fine-tune.

Shapes: q (B, H, D); caches (B, H_KV, S_max, D); seq_lens (B,).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from . import runtime
from ._triton import check_kernel_dtype, tl, triton
from .attention import dot_on_tensor_cores
from .cache import _check_cache_args, check_num_splits, choose_splits, decode_attention_ref, merge_splits

__all__ = ["repeat_kv", "grouped_decode_attention", "grouped_decode_attention_ref", "mha_to_gqa", "finetune"]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_KV, S, D) -> (B, H_KV * n_rep, S, D); K/V head j serves heads j*n_rep .. j*n_rep+n_rep-1.

    >>> x = torch.tensor([10.0, 20.0]).view(1, 2, 1, 1)  # H_KV = 2 heads
    >>> repeat_kv(x, 3).flatten().tolist()  # 6 query heads: 3 per K/V head
    [10.0, 10.0, 10.0, 20.0, 20.0, 20.0]
    """
    if isinstance(n_rep, bool) or not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"n_rep must be an int >= 1, got {n_rep!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"x must be (B, H_KV, S, D), got shape {tuple(x.shape)}")
    if n_rep == 1:
        return x
    B, H_KV, S, D = x.shape
    return x[:, :, None].expand(B, H_KV, n_rep, S, D).reshape(B, H_KV * n_rep, S, D)  # a real copy


def grouped_decode_attention_ref(q, k_cache, v_cache, seq_lens):
    """The same result as chapter 03's reference (grouping changes the work, not the answer).

    >>> q, k = torch.ones(1, 4, 8), torch.ones(1, 2, 5, 8)  # H = 4 query heads, H_KV = 2
    >>> grouped_decode_attention_ref(q, k, k, torch.tensor([5])).shape
    torch.Size([1, 4, 8])
    """
    return decode_attention_ref(q, k_cache, v_cache, seq_lens)


@triton.jit
def _grouped_decode_kernel(
    q_ptr, k_ptr, v_ptr,  # q (B, H, D); caches (B, H_KV, S_max, D)
    o_ptr, lse_ptr,  # partials (B*H, SPLITS, D) fp32 and (B*H, SPLITS) log-sum-exp, as _decode_kernel
    seq_lens_ptr,  # (B,)
    stride_qb, stride_qh,  # q strides (D stride 1)
    stride_kb, stride_kh, stride_ks,  # k strides (D stride 1)
    stride_vb, stride_vh, stride_vs,  # v strides (D stride 1)
    H_KV, D, n_rep, split_len,  # K/V heads, head dim, query heads per K/V head, positions per split
    qk_scale,  # 1/sqrt(D) * log2(e)
    SPLITS: tl.constexpr,  # programs per (sequence, K/V head) along the positions
    GROUP: tl.constexpr,  # n_rep padded to a power of two >= 16 (tl.dot needs 16 rows)
    TILE_N: tl.constexpr,  # cached positions per step
    TILE_D: tl.constexpr,  # head dim padded to a power of two
):
    pid = tl.program_id(0)  # which (sequence, K/V head)
    split = tl.program_id(1)
    b = pid // H_KV
    kv_h = pid % H_KV
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)

    g = tl.arange(0, GROUP)  # rows: the query heads of this group (padding rows beyond n_rep)
    g_ok = g < n_rep
    heads = kv_h * n_rep + g  # query head of each row
    dims = tl.arange(0, TILE_D)
    dim_ok = dims < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=g_ok[:, None] & dim_ok[None, :], other=0.0)  # (GROUP, TILE_D)
    m_i = tl.full((GROUP,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((GROUP,), dtype=tl.float32)
    acc = tl.zeros((GROUP, TILE_D), dtype=tl.float32)
    for pos0 in range(start, end, TILE_N):
        pos = pos0 + tl.arange(0, TILE_N)
        pos_ok = pos < end
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + b * stride_kb + kv_h * stride_kh + pos[:, None] * stride_ks + dims[None, :],
                    mask=kv_mask, other=0.0)  # (TILE_N, TILE_D): loaded once for the whole group
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale  # (GROUP, TILE_N)
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + b * stride_vb + kv_h * stride_vh + pos[:, None] * stride_vs + dims[None, :],
                    mask=kv_mask, other=0.0)  # (TILE_N, TILE_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new

    rows = (b * H_KV * n_rep + heads) * SPLITS + split  # (GROUP,) row of each query head's partial result
    empty = l_i == 0.0
    tl.store(o_ptr + rows[:, None] * D + dims[None, :], acc / tl.where(empty, 1.0, l_i)[:, None],
             mask=g_ok[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + rows, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))), mask=g_ok)


def _grouped_tiles(D: int, interpreter: bool, tensor_cores: bool = True) -> int:
    """TILE_N: 4096 elements per K (or V) tile; half that on FMA units (fp32, or a T4), where 32 x 128 needs
    255 registers and spills on sm_75 (kvlib.compile_check checks both)."""
    elements = 4096 if tensor_cores else 2048
    return 32 if interpreter else max(16, elements // max(16, triton.next_power_of_2(D)))


def grouped_decode_attention(q, k_cache, v_cache, seq_lens, num_splits=None):
    """Decode attention with one program per (sequence, K/V head) serving its whole query group.

    q (B, H, D); caches (B, H_KV, S_max, D), fp32 or fp16 (bf16 only on a GPU of compute capability
    >= 8.0: the interpreter computes its tl.dot wrongly); seq_lens (B,).

    >>> from kvlib.runtime import DEVICE
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(2, 8, 16, generator=g).to(DEVICE)  # H = 8
    >>> k, v = (torch.randn(2, 2, 8, 16, generator=g).to(DEVICE) for _ in range(2))  # H_KV = 2: groups of 4
    >>> lens = torch.tensor([8, 5], device=DEVICE)
    >>> out = grouped_decode_attention(q, k, v, lens)
    >>> torch.allclose(out, grouped_decode_attention_ref(q, k, v, lens), atol=1e-5)
    True
    """
    longest = _check_cache_args(q, k_cache, v_cache, seq_lens)
    check_kernel_dtype("gqa.grouped_decode_attention", "q", q, dot=True)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous along the head dim D (stride 1)")
    if not runtime.require_triton("gqa.grouped_decode_attention", q=q, k_cache=k_cache,
                                  v_cache=v_cache, seq_lens=seq_lens):
        return grouped_decode_attention_ref(q, k_cache, v_cache, seq_lens)
    B, H, D = q.shape
    H_KV, S_max = k_cache.shape[1], k_cache.shape[2]
    n_rep = H // H_KV
    if num_splits is None:
        num_splits = choose_splits(B * H_KV, longest)
    check_num_splits(num_splits)
    seq_lens = seq_lens.contiguous()  # the kernel reads seq_lens[b] with a unit stride
    TILE_D = max(16, triton.next_power_of_2(D))
    part = torch.empty(B * H, num_splits, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(B * H, num_splits, device=q.device, dtype=torch.float32)
    _grouped_decode_kernel[(B * H_KV, num_splits)](
        q, k_cache, v_cache, part, lse, seq_lens, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), H_KV, D, n_rep, triton.cdiv(S_max, num_splits), (1.0 / math.sqrt(D)) * 1.4426950408889634,
        SPLITS=num_splits, GROUP=max(16, triton.next_power_of_2(n_rep)),
        TILE_N=_grouped_tiles(D, runtime.INTERPRETER, dot_on_tensor_cores(q.dtype, q.device)), TILE_D=TILE_D,
    )
    return merge_splits(q, part, lse)


# --------------------------------------------------------------------------------------------
# Converting a trained MHA model
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def mha_to_gqa(model, n_kv_heads: int):
    """A copy of ``model`` with ``n_kv_heads`` K/V heads: each group's K and V projection heads are
    averaged (mean-pooling, as in the GQA paper). Query and output projections are unchanged.

    >>> from kvlib.model import ModelConfig, Transformer
    >>> mha = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=4, hidden_dim=64)).eval()
    >>> gqa = mha_to_gqa(mha, 2)
    >>> gqa.config.n_kv_heads, tuple(gqa.layers[0].attn.wk.weight.shape)  # (H_KV * D, C)
    (2, (16, 32))
    """
    cfg = model.config
    if not isinstance(n_kv_heads, int) or n_kv_heads < 1 or cfg.n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads must be a positive divisor of n_heads={cfg.n_heads}, got {n_kv_heads!r}")
    if cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(f"mha_to_gqa converts an MHA model (n_kv_heads == n_heads); this one has {cfg.n_kv_heads}")
    from .model import Transformer

    new_cfg = copy.deepcopy(cfg)
    new_cfg.n_kv_heads = n_kv_heads
    new = Transformer(new_cfg).to(model.device, model.dtype)
    state = model.state_dict()
    group, D, C = cfg.n_heads // n_kv_heads, cfg.head_dim, cfg.dim
    for name, t in state.items():
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):  # (H*D, C) -> (H_KV, group, D, C) -> mean
            state[name] = t.view(n_kv_heads, group, D, C).mean(dim=1).reshape(n_kv_heads * D, C)
        elif name.endswith(("attn.wk.bias", "attn.wv.bias")):
            state[name] = t.view(n_kv_heads, group, D).mean(dim=1).reshape(n_kv_heads * D)
    new.load_state_dict(state)
    return new.eval()


def finetune(model, train_ids: torch.Tensor, steps: int = 60, batch: int = 8, seq_len: int = 128,
             lr: float = 5e-4, seed: int = 0, progress: bool = False) -> list[float]:
    """A short, seeded AdamW fine-tune on random windows of ``train_ids``; returns the batch losses."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    steps_iter = range(steps)
    if progress:
        from tqdm.auto import tqdm

        steps_iter = tqdm(steps_iter, desc="fine-tune", leave=False)
    for _ in steps_iter:
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch,), generator=gen).tolist()
        x = torch.stack([train_ids[s: s + seq_len] for s in starts]).to(model.device)
        y = torch.stack([train_ids[s + 1: s + 1 + seq_len] for s in starts]).to(model.device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


# How tests/test_compile.py builds the grouped kernel (32 query / 8 K/V heads, D = 128, fp16): the default
# tiles for sm_80/sm_90 and the FMA tiles for a T4 (sm_75).
COMPILE_SPECS = [
    dict(kernel=_grouped_decode_kernel,
         signature={"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*fp32", "lse_ptr": "*fp32",
                    "seq_lens_ptr": "*i32", **{n: "i32" for n in (
                        "stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_ks", "stride_vb", "stride_vh",
                        "stride_vs", "H_KV", "D", "n_rep", "split_len")},
                    "qk_scale": "fp32", "SPLITS": "constexpr", "GROUP": "constexpr", "TILE_N": "constexpr",
                    "TILE_D": "constexpr"},
         archs=archs, constexprs=dict(SPLITS=splits, GROUP=16, TILE_N=_grouped_tiles(128, False, archs != (75,)),
                                      TILE_D=128))
    for archs in ((80, 90), (75,)) for splits in (1, 8)
]
