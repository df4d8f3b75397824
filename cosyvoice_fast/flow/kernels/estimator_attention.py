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

Any head size works: the head dimension is walked as ``DP`` lanes, the next power of two from ``D`` (at least
16, the smallest dot), and the lanes past ``D`` are masked on every load and store, so they hold zeros that add
nothing to a score or an output.  A power-of-two head (the released models' 64) compiles with no lane mask.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.flow.kernels.tuning import FlowTuning, Tiles, default_tuning
from cosyvoice_fast.kernels.pdl import pdl_start


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
def _lanes(ok, d_ok, PAD: tl.constexpr):
    """``ok & d_ok`` when the head dimension is padded (``PAD``), else ``ok`` unchanged: a power-of-two head
    compiles with no lane mask at all."""
    if PAD:
        ok = ok & d_ok
    return ok


@triton.jit
def _attn_step(q, base, k_off, v_off, mask_row, rj, rd, T, limit, qk_scale, stride, m_i, l_i, acc,
               IEEE: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """One key block ``rj`` of the online softmax for the queries ``q`` whose keys end at ``limit``: returns the
    updated (running max, running sum, accumulator)."""
    j_ok = rj < T
    keep = tl.load(mask_row + rj, mask=j_ok, other=0.0) != 0
    allowed = keep[None, :] & (rj[None, :] < limit[:, None])
    d_ok = rd < D
    return _online_update(q, base + rj[None, :] * stride + k_off + rd[:, None],
                          base + rj[:, None] * stride + v_off + rd[None, :],
                          _lanes(j_ok[None, :], d_ok[:, None], DP != D), _lanes(j_ok[:, None], d_ok[None, :], DP != D),
                          allowed, qk_scale, m_i, l_i, acc, IEEE)


@triton.jit
def _query_tile(qkv_ptr, T, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr):
    """This program's place in a (query tiles, B·H) grid over q/k/v rows ``(B·T, 3·H·D)``: (query tile, batch
    row, head, row stride, query frames, the ``DP`` head-dim lanes, valid queries, the batch row's first q/k/v
    row)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    stride = 3 * H * D
    ri = pid_m * BM + tl.arange(0, BM)
    return pid_m, b, h, stride, ri, tl.arange(0, DP), ri < T, qkv_ptr + b * T * stride


@triton.jit
def _attn_kernel(qkv_ptr, mask_ptr, o_ptr, T, chunk, qk_scale, H: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    pid_m, b, h, stride, ri, rd, i_ok, base = _query_tile(qkv_ptr, T, H, D, DP, BM)
    io_ok = _lanes(i_ok[:, None], (rd < D)[None, :], DP != D)
    pdl_start(PDL)
    q = tl.load(base + ri[:, None] * stride + h * D + rd[None, :], mask=io_ok, other=0.0)
    if chunk > 0:
        limit = (ri // chunk + 1) * chunk
        last = tl.minimum(pid_m * BM + BM, T) - 1
        hi = tl.minimum((last // chunk + 1) * chunk, T)
    else:
        limit = ri * 0 + T
        hi = T
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    for n0 in range(0, hi, BN):
        m_i, l_i, acc = _attn_step(q, base, (H + h) * D, (2 * H + h) * D, mask_ptr + b * T, n0 + tl.arange(0, BN),
                                   rd, T, limit, qk_scale, stride, m_i, l_i, acc, IEEE, D, DP)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (b * T + ri[:, None]) * (H * D) + h * D + rd[None, :], o.to(o_ptr.dtype.element_ty),
             mask=io_ok)


def head_lanes(head_dim: int) -> int:
    """The lanes a kernel walks the head dimension with: the next power of two from ``head_dim``, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def attention_tiles(frames: int, rows: int | None = None, fp32: bool = False,
                    tuning: FlowTuning | None = None) -> Tiles:
    """The tile table :func:`attention` launches with for batch rows of ``frames`` frames, ``rows`` rows in all
    (``None``: many), 16-bit operands unless ``fp32``: small tiles up to 32 frames; the pair tiles over
    ``tuning.pair_rows`` rows; else ``tuning.attn`` (no other tile was faster across the shapes solves produce)."""
    t = tuning or default_tuning()
    if frames <= 32:
        return t.attn_small
    return t.attn_pair if rows is not None and t.pair(rows) and not fp32 else t.attn


def attention(qkv: Tensor, mask: Tensor, batch: int, heads: int, head_dim: int, chunk: int,
              out: Tensor | None = None, tiles: Tiles | None = None, tuning: FlowTuning | None = None) -> Tensor:
    """Multi-head attention over ``qkv`` (B·T, 3·H·D) with the key ``mask`` (B·T,) and chunk rule ``chunk``
    (0 = full attention); returns (B·T, H·D).  ``tiles`` overrides :func:`attention_tiles` (benchmarks)."""
    rows = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != 3 * heads * head_dim or not qkv.is_contiguous():
        raise ValueError(f"attention: qkv must be contiguous (B*T, {3 * heads * head_dim}), got {tuple(qkv.shape)}")
    if rows % batch or mask.numel() != rows:
        raise ValueError(f"attention: {rows} rows do not split into {batch} batch rows with a ({rows},) mask")
    t = tuning or default_tuning()
    n = rows // batch
    out = torch.empty(rows, heads * head_dim, device=qkv.device, dtype=qkv.dtype) if out is None else out
    tiles = attention_tiles(n, rows, qkv.dtype == torch.float32, t) if tiles is None else tiles
    grid = (triton.cdiv(n, tiles["bm"]), batch * heads)
    _attn_kernel[grid](qkv, mask, out, T=n, chunk=int(chunk),
                       qk_scale=(1.0 / math.sqrt(head_dim)) * 1.4426950408889634, H=heads, D=head_dim,
                       DP=head_lanes(head_dim), IEEE=qkv.dtype == torch.float32, BM=tiles["bm"], BN=tiles["bn"],
                       num_warps=tiles["warps"], num_stages=tiles["stages"], **t.pdl_kwargs(qkv, rows))
    return out
