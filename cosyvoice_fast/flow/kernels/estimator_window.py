"""Kernels of the fused estimator's incremental window: attention over cached keys, and causal-conv context.

An incremental flow call (:mod:`~cosyvoice_fast.flow.model.incremental`) runs the estimator only on the frames
from the last committed chunk boundary ``start`` on; what those frames read of earlier ones lives in fixed-size
buffers of the graph runner (:class:`~cosyvoice_fast.flow.model.incremental.StaticWindow`):

* per attention layer, keys and values ``(2, B, H, capacity, D)`` at absolute frame positions.
  :func:`attention_cached` writes the window's own keys and values there (for later calls) and attends, for
  query ``start + i``, to the cached keys ``[0, start)`` and to the window's keys up to
  ``min(end of the query's chunk, start + valid)``, read straight from the q/k/v rows.  Every cached key is in
  an earlier chunk than every query, so all of them are visible; padded queries (``i >= valid``) see the
  window's valid keys, so no row is empty.  Reading the window's keys from the rows rather than the buffer
  means no program reads what another one writes in the same launch.
* per causal conv, the last ``taps - 1`` input columns before ``start`` ``(B, C_in, taps - 1)``, which
  :func:`~cosyvoice_fast.flow.kernels.estimator_conv.causal_conv` reads in place of the zeros before a sequence's
  first frame, and :func:`update_conv_context` then replaces with the columns just before the new commit point.

``start``, ``valid`` and the commit point are one-element device tensors (inputs of the captured graph), so one
graph serves every call of its shape.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.flow.kernels.estimator_attention import (
    _lanes, _online_update, _query_tile, attention_tiles, head_lanes,
)
from cosyvoice_fast.flow.kernels.tuning import FlowTuning, Tiles, default_tuning
from cosyvoice_fast.kernels.pdl import pdl_start


@triton.jit
def _attn_cached_kernel(qkv_ptr, kv_ptr, o_ptr, start_ptr, valid_ptr, T, chunk, qk_scale,
                        s_kind, s_b, s_h, s_t, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                        IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    pid_m, b, h, stride, ri, rd, i_ok, base = _query_tile(qkv_ptr, T, H, D, DP, BM)
    d_ok = rd < D
    io_ok = _lanes(i_ok[:, None], d_ok[None, :], DP != D)
    cache = kv_ptr + b * s_b + h * s_h
    start = tl.load(start_ptr)
    end = start + tl.load(valid_ptr)
    pdl_start(PDL)
    q = tl.load(base + ri[:, None] * stride + h * D + rd[None, :], mask=io_ok, other=0.0)
    # this tile's own keys and values, kept for later calls (no program of this launch reads the buffer there)
    for kind in tl.static_range(2):
        kv = tl.load(base + ri[:, None] * stride + (H * (kind + 1) + h) * D + rd[None, :], mask=io_ok)
        tl.store(cache + kind * s_kind + (start + ri)[:, None] * s_t + rd[None, :], kv, mask=io_ok)
    limit = tl.minimum(((start + ri) // chunk + 1) * chunk, end) - start  # window-local key bound per query
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    for n0 in range(0, start, BN):  # cached keys: all visible
        rj = n0 + tl.arange(0, BN)
        j_ok = rj < start
        m_i, l_i, acc = _online_update(q, cache + rj[None, :] * s_t + rd[:, None],
                                       cache + s_kind + rj[:, None] * s_t + rd[None, :],
                                       _lanes(j_ok[None, :], d_ok[:, None], DP != D),
                                       _lanes(j_ok[:, None], d_ok[None, :], DP != D),
                                       j_ok[None, :] & i_ok[:, None], qk_scale, m_i, l_i, acc, IEEE)
    last = tl.minimum(pid_m * BM + BM, T) - 1
    hi = tl.minimum(((start + last) // chunk + 1) * chunk, end) - start
    for n0 in range(0, hi, BN):  # the window's keys, chunk-causal
        rj = n0 + tl.arange(0, BN)
        j_ok = rj < T
        m_i, l_i, acc = _online_update(q, base + rj[None, :] * stride + (H + h) * D + rd[:, None],
                                       base + rj[:, None] * stride + (2 * H + h) * D + rd[None, :],
                                       _lanes(j_ok[None, :], d_ok[:, None], DP != D),
                                       _lanes(j_ok[:, None], d_ok[None, :], DP != D),
                                       rj[None, :] < limit[:, None], qk_scale, m_i, l_i, acc, IEEE)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (b * T + ri[:, None]) * (H * D) + h * D + rd[None, :], o.to(o_ptr.dtype.element_ty),
             mask=io_ok)


def attention_cached(qkv: Tensor, kv: Tensor, start: Tensor, valid: Tensor, heads: int, head_dim: int,
                     chunk: int, tiles: Tiles | None = None, tuning: FlowTuning | None = None) -> Tensor:
    """Attention of a window's ``qkv`` rows (B·T, 3·H·D) against the cached keys/values ``kv`` (2, B, H, C, D)
    of positions ``[0, start)`` and its own chunk-causal keys below ``start + valid``; also writes its keys
    and values into ``kv`` at ``[start, start + T)``.  Returns (B·T, H·D).  ``tiles`` overrides the full
    attention's tile table (:func:`~cosyvoice_fast.flow.kernels.estimator_attention.attention_tiles`; narrower query
    tiles measured slower here too)."""
    if kv.dim() != 5 or kv.shape[0] != 2 or kv.shape[2] != heads or kv.shape[4] != head_dim or kv.stride(4) != 1:
        raise ValueError(f"attention_cached: kv must be (2, B, {heads}, C, {head_dim}) with unit last stride, "
                         f"got {tuple(kv.shape)}")
    batch = kv.shape[1]
    rows = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != 3 * heads * head_dim or not qkv.is_contiguous() or rows % batch:
        raise ValueError(f"attention_cached: qkv must be contiguous ({batch} x T, {3 * heads * head_dim}), "
                         f"got {tuple(qkv.shape)}")
    if chunk <= 0:
        raise ValueError("attention_cached: the incremental window needs chunk-causal attention (chunk > 0)")
    if start.numel() != 1 or valid.numel() != 1:
        raise ValueError("attention_cached: start and valid must be one-element device tensors")
    t = rows // batch
    out = torch.empty(rows, heads * head_dim, device=qkv.device, dtype=qkv.dtype)
    tn = tuning or default_tuning()
    tiles = tiles or attention_tiles(t, tuning=tn)
    _attn_cached_kernel[(triton.cdiv(t, tiles["bm"]), batch * heads)](
        qkv, kv, out, start, valid, t, int(chunk), (1.0 / math.sqrt(head_dim)) * 1.4426950408889634,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), H=heads, D=head_dim, DP=head_lanes(head_dim),
        IEEE=qkv.dtype == torch.float32, BM=tiles["bm"], BN=tiles["bn"], num_warps=tiles["warps"],
        num_stages=tiles["stages"], **tn.pdl_kwargs(qkv, rows))
    return out


@triton.jit
def _ctx_kernel(x1_ptr, x2_ptr, ctx_ptr, commit_ptr, T, C1, C2, s_b, s_c, s_t, LEFT: tl.constexpr,
                LP: tl.constexpr, HAS_X2: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    rj = tl.arange(0, LP)
    c_ok = rc < C1 + C2
    j_ok = rj < LEFT
    commit = tl.load(commit_ptr)
    src = commit - LEFT + rj  # window frame of each new context column; < 0: an old context column
    pdl_start(PDL)
    row = b * T + src
    in_x = (src >= 0)[:, None] & j_ok[:, None]
    val = tl.load(x1_ptr + row[:, None] * C1 + rc[None, :], mask=in_x & (rc < C1)[None, :], other=0.0)
    if HAS_X2:
        val += tl.load(x2_ptr + row[:, None] * C2 + (rc - C1)[None, :], mask=in_x & (rc >= C1)[None, :] & c_ok[None, :],
                       other=0.0)
    in_ctx = (src < 0)[:, None] & j_ok[:, None] & c_ok[None, :]
    cptr = ctx_ptr + b * s_b + rc[None, :] * s_c
    val += tl.load(cptr + (LEFT + src)[:, None] * s_t, mask=in_ctx, other=0.0)
    # every value is loaded before any is stored: the old columns read here may be the ones rewritten
    tl.store(cptr + rj[:, None] * s_t, val, mask=j_ok[:, None] & c_ok[None, :])


def update_conv_context(x1: Tensor, ctx: Tensor, commit: Tensor, frames: int, x2: Tensor | None = None,
                        tuning: FlowTuning | None = None) -> None:
    """After a causal conv read ``ctx`` (B, C1 + C2, taps - 1): replace it, in place, by the input columns
    just before window frame ``commit`` (the conv's input rows ``b·frames + t`` of ``x1`` (M, C1) [‖ ``x2``
    (M, C2)]), taking old context columns where ``commit < taps - 1`` (nothing committed keeps the context)."""
    m, c1 = x1.shape
    c2 = 0 if x2 is None else x2.shape[1]
    b, c, left = ctx.shape
    if c != c1 + c2 or m != b * frames or not x1.is_contiguous() or (x2 is not None and not x2.is_contiguous()):
        raise ValueError(f"update_conv_context: ctx ({b}, {c}, {left}) does not match inputs of {m} rows x "
                         f"{c1 + c2} channels over {frames} frames")
    if left == 0:
        return
    bc = min(256, triton.next_power_of_2(c))
    _ctx_kernel[(b, triton.cdiv(c, bc))](x1, x2 if x2 is not None else x1, ctx, commit, frames, c1, c2,
                                         ctx.stride(0), ctx.stride(1), ctx.stride(2), LEFT=left,
                                         LP=max(2, triton.next_power_of_2(left)), HAS_X2=x2 is not None, BC=bc,
                                         num_warps=4, **(tuning or default_tuning()).pdl_kwargs(x1, m))
