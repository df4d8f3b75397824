"""Triton attention of the flow estimator: the chunk-causal mask as an index rule, not a (B, T, T) tensor.

Query frame ``i`` of row ``b`` may attend key frame ``j`` when ``mask[b, j]`` is set and, with a chunk size
``c > 0``, ``j < (i // c + 1) · c`` (its own chunk and every earlier one).  Key blocks past the last chunk
any query of the tile can see are never loaded, so streaming calls do less work than full ones.

Rows with no visible key: eager attention opens them (attends everything) to avoid a NaN; such a row is
always a padding frame (a real frame sees at least itself), whose value never reaches a real frame and is
zeroed by the estimator's output mask, so here it is simply 0.  The output is therefore identical on every
real frame and on the estimator's output.

Inputs are the fused q/k/v projection rows ``(B·T, 3·H·D)`` ([q heads | k heads | v heads]); the output is
``(B·T, H·D)``, the layout the out-projection reads.  Online softmax in fp32 (exp2 with the scale folded in).

:func:`attention_out` is the same attention with the block's out-projection, bias and residual fused in: one
program takes a tile of query frames through every head in turn and accumulates ``o_h @ Wo[:, h]^T``, so the
(B·T, H·D) intermediate never exists and a transformer block loses a launch (fewer, longer programs instead).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.kernels.common import _live_rows, extent_args, interpreting, pair_rows, pdl_kwargs
from cosyvoice_fast.kernels.pdl import pdl_start


#: Tiles of :func:`attention` when a row has more than 32 frames: query rows ``bm``, key rows ``bn``, ``warps``,
#: pipeline ``stages`` (``benchmarks/estimator_attention_sweep.py`` times others; none was faster across the
#: shapes solves produce, BENCHMARKS.md).
ATTN_TUNING = {"bm": 64, "bn": 64, "warps": 4, "stages": 3}
_ATTN_SMALL = {"bm": 16, "bn": 16, "warps": 4, "stages": 3}
#: 16-bit tiles over ``estimator_common.PAIR_ROWS`` rows (one request's CFG pair), chosen together with that
#: forward's GEMM and convolution tiles (BENCHMARKS.md, session 23).
ATTN_PAIR = {"bm": 32, "bn": 128, "warps": 4, "stages": 3}


@triton.jit
def _online_update(q, k_ptrs, v_ptrs, k_ok, v_ok, allowed, qk_scale, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key block of the online softmax: scores of ``q`` against the (D, BN) keys at ``k_ptrs``, hidden
    where not ``allowed``; returns the updated (running max, running sum, accumulator).  ``k_ok`` / ``v_ok``
    mask the key and value loads (broadcast to their tiles)."""
    kt = tl.load(k_ptrs, mask=k_ok, other=0.0)
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    s = tl.where(allowed, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptrs, mask=v_ok, other=0.0)
    if IEEE:
        pv = tl.dot(p.to(q.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attn_step(q, base, k_off, v_off, mask_row, rj, rd, T, limit, qk_scale, stride, m_i, l_i, acc,
               IEEE: tl.constexpr):
    """One key block ``rj`` of the online softmax for the queries ``q`` whose keys end at ``limit``: returns the
    updated (running max, running sum, accumulator)."""
    j_ok = rj < T
    keep = tl.load(mask_row + rj, mask=j_ok, other=0.0) != 0
    allowed = keep[None, :] & (rj[None, :] < limit[:, None])
    return _online_update(q, base + rj[None, :] * stride + k_off + rd[:, None],
                          base + rj[:, None] * stride + v_off + rd[None, :], j_ok[None, :], j_ok[:, None],
                          allowed, qk_scale, m_i, l_i, acc, IEEE)


@triton.jit
def _query_tile(qkv_ptr, T, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr):
    """This program's place in a (query tiles, B·H) grid over q/k/v rows ``(B·T, 3·H·D)``: (query tile, batch
    row, head, row stride, query frames, head-dim lanes, valid queries, the batch row's first q/k/v row)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    stride = 3 * H * D
    ri = pid_m * BM + tl.arange(0, BM)
    return pid_m, b, h, stride, ri, tl.arange(0, D), ri < T, qkv_ptr + b * T * stride


@triton.jit
def _attn_kernel(qkv_ptr, mask_ptr, o_ptr, ext_ptr, T, chunk, qk_scale,
                 H: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr, EXT: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, PDL: tl.constexpr):
    # a ragged launch: batch rows and query tiles past the live extent are capacity (the extent is a graph
    # input, read before the wait)
    live, T = _live_rows(0, T, ext_ptr, EXT)
    pid_m, b, h, stride, ri, rd, i_ok, base = _query_tile(qkv_ptr, T, H, D, BM)
    pdl_start(PDL)
    if EXT > 0:
        if b >= live // T or pid_m * BM >= T:
            return
    q = tl.load(base + ri[:, None] * stride + h * D + rd[None, :], mask=i_ok[:, None], other=0.0)
    if chunk > 0:
        limit = (ri // chunk + 1) * chunk
        last = tl.minimum(pid_m * BM + BM, T) - 1
        hi = tl.minimum((last // chunk + 1) * chunk, T)
    else:
        limit = ri * 0 + T
        hi = T
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for n0 in range(0, hi, BN):
        m_i, l_i, acc = _attn_step(q, base, (H + h) * D, (2 * H + h) * D, mask_ptr + b * T, n0 + tl.arange(0, BN),
                                   rd, T, limit, qk_scale, stride, m_i, l_i, acc, IEEE)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (b * T + ri[:, None]) * (H * D) + h * D + rd[None, :], o.to(o_ptr.dtype.element_ty),
             mask=i_ok[:, None])


def attention_tiles(frames: int, rows: int | None = None, fp32: bool = False) -> dict:
    """The tile table :func:`attention` launches with for batch rows of ``frames`` frames, ``rows`` rows in all
    (``None``: many), 16-bit operands unless ``fp32``."""
    if frames <= 32:
        return _ATTN_SMALL
    pair = rows is not None and pair_rows(rows) and not fp32 and not interpreting()
    return ATTN_PAIR if pair else ATTN_TUNING


def attention(qkv: Tensor, mask: Tensor, batch: int, heads: int, head_dim: int, chunk: int,
              out: Tensor | None = None, tiles: dict | None = None, extent: Tensor | None = None) -> Tensor:
    """Multi-head attention over ``qkv`` (B·T, 3·H·D) with the key ``mask`` (B·T,) and chunk rule ``chunk``
    (0 = full attention); returns (B·T, H·D).  ``tiles`` overrides :func:`attention_tiles` (benchmarks).
    ``extent``: a ragged launch (:mod:`~cosyvoice_fast.kernels.common`), batch row ``b`` at rows
    ``b·T ..`` of the live frame count ``T``; the tiles are chosen for the capacity."""
    rows = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != 3 * heads * head_dim or not qkv.is_contiguous():
        raise ValueError(f"attention: qkv must be contiguous (B*T, {3 * heads * head_dim}), got {tuple(qkv.shape)}")
    if rows % batch or mask.numel() != rows:
        raise ValueError(f"attention: {rows} rows do not split into {batch} batch rows with a ({rows},) mask")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"attention: head_dim must be a power of two >= 16, got {head_dim}")
    t = rows // batch
    out = torch.empty(rows, heads * head_dim, device=qkv.device, dtype=qkv.dtype) if out is None else out
    tiles = attention_tiles(t, rows, qkv.dtype == torch.float32) if tiles is None else tiles
    grid = (triton.cdiv(t, tiles["bm"]), batch * heads)
    _attn_kernel[grid](qkv, mask, out, **extent_args(extent, qkv), T=t, chunk=int(chunk),
                       qk_scale=(1.0 / math.sqrt(head_dim)) * 1.4426950408889634, H=heads, D=head_dim,
                       IEEE=qkv.dtype == torch.float32, BM=tiles["bm"], BN=tiles["bn"], num_warps=tiles["warps"],
                       num_stages=tiles["stages"], **pdl_kwargs(qkv, rows))
    return out


@triton.jit
def _attn_head(base, q_off, k_off, v_off, mask_row, ri, i_ok, rd, T, chunk, hi, qk_scale, stride,
               D: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """One head's normalised attention output (BM, D) in fp32 for query rows ``ri`` (0 where no key is
    visible)."""
    q = tl.load(base + ri[:, None] * stride + q_off + rd[None, :], mask=i_ok[:, None], other=0.0)
    if chunk > 0:
        limit = (ri // chunk + 1) * chunk
    else:
        limit = ri * 0 + T
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for n0 in range(0, hi, BN):
        m_i, l_i, acc = _attn_step(q, base, k_off, v_off, mask_row, n0 + tl.arange(0, BN), rd, T, limit, qk_scale,
                                   stride, m_i, l_i, acc, IEEE)
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def _attn_out_kernel(qkv_ptr, mask_ptr, wo_ptr, bo_ptr, res_ptr, y_ptr, ext_ptr, T, C, chunk, qk_scale,
                     H: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr, EXT: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    live, T = _live_rows(0, T, ext_ptr, EXT)  # a ragged launch: rows and tiles past the live extent are capacity
    stride = 3 * H * D
    ri = pid_m * BM + tl.arange(0, BM)
    rd = tl.arange(0, D)
    rc = tl.arange(0, BC)
    i_ok = ri < T
    c_ok = rc < C
    base = qkv_ptr + b * T * stride
    if chunk > 0:
        last = tl.minimum(pid_m * BM + BM, T) - 1
        hi = tl.minimum((last // chunk + 1) * chunk, T)
    else:
        hi = T
    pdl_start(PDL)
    if EXT > 0:
        if b >= live // T or pid_m * BM >= T:
            return
    out = tl.zeros([BM, BC], dtype=tl.float32)
    for h in range(H):
        o = _attn_head(base, h * D, (H + h) * D, (2 * H + h) * D, mask_ptr + b * T, ri, i_ok, rd, T, chunk, hi,
                       qk_scale, stride, D, IEEE, BM, BN)
        wo = tl.load(wo_ptr + rc[None, :] * (H * D) + h * D + rd[:, None], mask=c_ok[None, :], other=0.0)
        if IEEE:
            out += tl.dot(o.to(wo.dtype), wo, input_precision="ieee")
        else:
            out += tl.dot(o.to(wo.dtype), wo)
    ok = i_ok[:, None] & c_ok[None, :]
    rows = b * T + ri
    out += tl.load(bo_ptr + rc, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    out += tl.load(res_ptr + rows[:, None] * C + rc[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * C + rc[None, :], out.to(y_ptr.dtype.element_ty), mask=ok)


def attention_out(qkv: Tensor, mask: Tensor, batch: int, heads: int, head_dim: int, chunk: int, wo: Tensor,
                  bo: Tensor, residual: Tensor, out: Tensor | None = None, extent: Tensor | None = None) -> Tensor:
    """``residual + attention(...) @ wo.T + bo`` in one kernel: (B·T, C) for ``wo`` (C, H·D) (``extent``: a
    ragged launch, as :func:`attention`)."""
    rows, c = residual.shape
    if qkv.dim() != 2 or qkv.shape != (rows, 3 * heads * head_dim) or not qkv.is_contiguous():
        raise ValueError(f"attention_out: qkv must be contiguous ({rows}, {3 * heads * head_dim}), "
                         f"got {tuple(qkv.shape)}")
    if wo.shape != (c, heads * head_dim) or not wo.is_contiguous() or not residual.is_contiguous():
        raise ValueError(f"attention_out: need contiguous wo ({c}, {heads * head_dim}) and residual ({rows}, {c})")
    if rows % batch or mask.numel() != rows:
        raise ValueError(f"attention_out: {rows} rows do not split into {batch} batch rows with a ({rows},) mask")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"attention_out: head_dim must be a power of two >= 16, got {head_dim}")
    t = rows // batch
    out = torch.empty_like(residual) if out is None else out
    bm = 64 if interpreting() else 16
    bn = 64 if t > 32 else 16
    _attn_out_kernel[(triton.cdiv(t, bm), batch)](
        qkv, mask, wo, bo, residual, out, **extent_args(extent, qkv), T=t, C=c, chunk=int(chunk),
        qk_scale=(1.0 / math.sqrt(head_dim)) * 1.4426950408889634, H=heads, D=head_dim,
        IEEE=qkv.dtype == torch.float32, BM=bm, BN=bn,
        BC=max(16, triton.next_power_of_2(c)), num_warps=4, **pdl_kwargs(qkv, rows))
    return out
