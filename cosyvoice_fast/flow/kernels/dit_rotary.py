"""Triton rotary positions of CosyVoice3's DiT, in place on the fused q/k/v rows: one launch for q and k.

The DiT rotates only the first ``dim_head`` channels of its whole q and k projections (head 0; upstream hands
the multi-head projection to x-transformers' rotary before splitting heads), in adjacent pairs ``(2i, 2i+1)``
at angle ``pos · inv_freq[i]``.  The rows are ``(B·T, 3·H·D)`` = ``[q heads | k heads | v heads]`` of frames
``pos = row mod T`` (plus ``start``, for a window that begins later in the utterance).  Angles, cos/sin and the
rotation are fp32 (as x-transformers computes them: fp32 frequencies, the product cast back), stored in the
rows' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotary_kernel(qkv_ptr, inv_ptr, M, T, start, stride, k_off, HALF: tl.constexpr, BM: tl.constexpr,
                   BH: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    ri = tl.arange(0, BH)
    ok = (rm[:, None] < M) & (ri[None, :] < HALF)
    pos = (rm % T + start).to(tl.float32)
    inv = tl.load(inv_ptr + ri, mask=ri < HALF, other=0.0).to(tl.float32)
    ang = pos[:, None] * inv[None, :]
    c = tl.cos(ang)
    s = tl.sin(ang)
    for off in tl.static_range(2):
        base = qkv_ptr + rm[:, None] * stride + off * k_off + 2 * ri[None, :]
        even = tl.load(base, mask=ok, other=0.0)
        odd = tl.load(base + 1, mask=ok, other=0.0)
        e32 = even.to(tl.float32)
        o32 = odd.to(tl.float32)
        tl.store(base, (e32 * c - o32 * s).to(even.dtype), mask=ok)
        tl.store(base + 1, (o32 * c + e32 * s).to(odd.dtype), mask=ok)


def rotary_qk_(qkv: Tensor, frames: int, inner: int, inv_freq: Tensor, start: int = 0) -> Tensor:
    """Rotate, in place, the first ``2 · len(inv_freq)`` channels of q (columns ``0..``) and of k (columns
    ``inner..``) of ``qkv`` (M, 3·inner) rows, frame ``row mod frames + start``; returns ``qkv``."""
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < 2 * inner:
        raise ValueError(f"rotary_qk_: qkv must be (M, >= {2 * inner}) with unit column stride, "
                         f"got {tuple(qkv.shape)}")
    half = inv_freq.numel()
    if 2 * half > inner or qkv.shape[0] % frames:
        raise ValueError(f"rotary_qk_: {2 * half} rotated channels of {inner}, {qkv.shape[0]} rows of {frames}")
    m = qkv.shape[0]
    bm = 32
    _rotary_kernel[(triton.cdiv(m, bm),)](qkv, inv_freq.contiguous(), m, frames, start, qkv.stride(0), inner,
                                          HALF=half, BM=bm, BH=max(16, triton.next_power_of_2(half)), num_warps=4)
    return qkv


def rotary_qk_reference(qkv: Tensor, frames: int, inner: int, inv_freq: Tensor, start: int = 0) -> Tensor:
    """What :func:`rotary_qk_` computes, in PyTorch (for tests): a rotated copy."""
    from cosyvoice_fast.flow.model.dit import apply_rotary, rotary_tables

    pos = torch.arange(qkv.shape[0], device=qkv.device) % frames + start
    cos, sin = rotary_tables(inv_freq, pos, torch.float32)
    out = qkv.clone()
    for off in (0, inner):
        part = qkv[:, off:off + inner].float()
        out[:, off:off + inner] = apply_rotary(part, cos, sin).to(qkv.dtype)
    return out
