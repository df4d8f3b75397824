"""Triton self-attention of the flow's token encoder: relative-position scores computed in the kernel.

The encoder's attention (ESPnet's relative-position flavour, :class:`~cosyvoice_fast.flow.model.encoder_layers.
RelPositionSelfAttention`) scores query ``i`` against key ``j`` as

    ((q_i + u) · k_j  +  (q_i + v) · p[T-1-i+j]) / sqrt(d)

where ``p`` is the projected relative-position table (row ``m`` encodes the distance ``T-1-m``).  Eagerly that
is a (T, 2T-1) product per head, a strided re-index, a scale, a mask fill and an attention call with the result
as a dense float bias: a dozen launches per block and a (B, H, T, T) tensor.  Here one kernel does it all with
an online softmax: for a (query tile, key tile) pair the table rows it needs form one contiguous band of
``BM + BN - 1`` rows, so the kernel takes the product of the ``q + v`` tile with that band (a tensor-core dot)
and gathers each score's diagonal entry from it in registers (``tl.gather``).  The key mask is an index rule:
key ``j`` of batch row ``b`` is visible when ``j < lengths[b] · len_scale`` and, with a chunk size ``c > 0``,
``j < (i // c + 1) · c`` -- the eager encoder's padding and chunk-causal masks.  A query always sees key 0
(every row has at least one valid token), so no row is empty.

Inputs are the fused q/k/v rows ``(B·T, 3·H·D)`` ([q heads | k heads | v heads]); the output is ``(B·T, H·D)``,
the rows the out-projection reads.  ``q + u`` and ``q + v`` are rounded to the operand dtype as the eager
module's additions are; everything after is fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.flow.kernels.estimator_attention import _lanes, head_lanes
from cosyvoice_fast.flow.kernels.estimator_linear import _mm
from cosyvoice_fast.flow.kernels.tuning import FlowTuning, Tiles, default_tuning
from cosyvoice_fast.kernels.pdl import pdl_start

@triton.jit
def _relpos_kernel(qkv_ptr, pos_ptr, u_ptr, v_ptr, len_ptr, o_ptr, T, chunk, len_scale, stride_p, qk_scale,
                   H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    stride = 3 * H * D
    i0 = pid_m * BM
    ri = i0 + tl.arange(0, BM)
    rd = tl.arange(0, DP)  # the head dimension's lanes, padded to a power of two (masked past D)
    d_ok = rd < D
    rw = tl.arange(0, BW)  # the band's BM + BN - 1 rows, rounded up to a power of two
    i_ok = ri < T
    base = qkv_ptr + b * T * stride
    # lengths and the per-head biases are inputs and parameters, never written by the previous kernel
    n_keys = tl.minimum(tl.load(len_ptr + b).to(tl.int32) * len_scale, T)
    if DP != D:
        bias_u = tl.load(u_ptr + h * D + rd, mask=d_ok, other=0.0).to(tl.float32)
        bias_v = tl.load(v_ptr + h * D + rd, mask=d_ok, other=0.0).to(tl.float32)
    else:
        bias_u = tl.load(u_ptr + h * D + rd).to(tl.float32)
        bias_v = tl.load(v_ptr + h * D + rd).to(tl.float32)
    io_ok = _lanes(i_ok[:, None], d_ok[None, :], DP != D)
    pdl_start(PDL)
    q = tl.load(base + ri[:, None] * stride + h * D + rd[None, :], mask=io_ok, other=0.0)
    qu = (q.to(tl.float32) + bias_u[None, :]).to(q.dtype)
    qv = (q.to(tl.float32) + bias_v[None, :]).to(q.dtype)
    if chunk > 0:
        limit = (ri // chunk + 1) * chunk
        last = tl.minimum(i0 + BM, T) - 1
        hi = tl.minimum((last // chunk + 1) * chunk, n_keys)
    else:
        limit = ri * 0 + T
        hi = n_keys
    # band slot of score (i, j) within a key tile: the table row T-1-i+j minus the band's first row
    slot = (BM - 1) - (ri - i0)[:, None] + tl.arange(0, BN)[None, :]
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    for n0 in range(0, hi, BN):
        rj = n0 + tl.arange(0, BN)
        j_ok = rj < n_keys
        kt = tl.load(base + rj[None, :] * stride + (H + h) * D + rd[:, None],
                     mask=_lanes(j_ok[None, :], d_ok[:, None], DP != D), other=0.0)
        s = _mm(qu, kt, IEEE)
        row = T - i0 - BM + n0 + rw  # table rows of the band
        pt = tl.load(pos_ptr + row[None, :] * stride_p + h * D + rd[:, None],
                     mask=_lanes(((row >= 0) & (row < 2 * T - 1))[None, :], d_ok[:, None], DP != D), other=0.0)
        band = _mm(qv, pt, IEEE)
        s = (s + tl.gather(band, slot, axis=1)) * qk_scale
        s = tl.where(j_ok[None, :] & (rj[None, :] < limit[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(base + rj[:, None] * stride + (2 * H + h) * D + rd[None, :],
                    mask=_lanes(j_ok[:, None], d_ok[None, :], DP != D), other=0.0)
        acc = acc * alpha[:, None] + _mm(p.to(q.dtype), v, IEEE)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (b * T + ri[:, None]) * (H * D) + h * D + rd[None, :], o.to(o_ptr.dtype.element_ty),
             mask=io_ok)


def relpos_tiles(dtype: torch.dtype, tuning: FlowTuning | None = None) -> Tiles:
    """The tile table :func:`relpos_attention` launches with for operands of ``dtype`` (fp32 operands run IEEE
    dots, which need smaller tiles)."""
    t = tuning or default_tuning()
    return t.relpos_fp32 if dtype == torch.float32 else t.relpos


def relpos_attention(qkv: Tensor, pos: Tensor, bias_u: Tensor, bias_v: Tensor, lengths: Tensor, batch: int,
                     heads: int, head_dim: int, chunk: int, len_scale: int = 1, out: Tensor | None = None,
                     tiles: Tiles | None = None, tuning: FlowTuning | None = None) -> Tensor:
    """Relative-position multi-head attention over ``qkv`` (B·T, 3·H·D); returns (B·T, H·D).

    ``pos`` (2T-1, H·D), unit column stride: the projected relative-position table of this block (a column
    slice of a wider table is fine); ``bias_u`` / ``bias_v`` (H, D); ``lengths`` (B,) integer device tensor: row
    ``b`` attends its first ``lengths[b] · len_scale`` keys; ``chunk`` > 0: chunk-causal attention with chunks of
    that many frames.  ``tiles`` overrides :func:`relpos_tiles` (benchmarks)."""
    rows = qkv.shape[0]
    hd = heads * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != 3 * hd or not qkv.is_contiguous():
        raise ValueError(f"relpos_attention: qkv must be contiguous (B*T, {3 * hd}), got {tuple(qkv.shape)}")
    if batch < 1 or rows % batch:
        raise ValueError(f"relpos_attention: {rows} rows do not split into {batch} batch rows")
    t = rows // batch
    if pos.dim() != 2 or pos.shape != (2 * t - 1, hd) or pos.stride(1) != 1:
        raise ValueError(f"relpos_attention: pos must be ({2 * t - 1}, {hd}) with unit column stride, got "
                         f"{tuple(pos.shape)}")
    if bias_u.shape != (heads, head_dim) or bias_v.shape != (heads, head_dim):
        raise ValueError(f"relpos_attention: bias_u and bias_v must be ({heads}, {head_dim})")
    if lengths.shape != (batch,) or lengths.dtype.is_floating_point:
        raise ValueError(f"relpos_attention: lengths must be ({batch},) integers, got {tuple(lengths.shape)} "
                         f"{lengths.dtype}")
    out = torch.empty(rows, hd, device=qkv.device, dtype=qkv.dtype) if out is None else out
    tn = tuning or default_tuning()
    tiles = relpos_tiles(qkv.dtype, tn) if tiles is None else tiles
    grid = (triton.cdiv(t, tiles["bm"]), batch * heads)
    _relpos_kernel[grid](qkv, pos, bias_u.contiguous(), bias_v.contiguous(), lengths, out, T=t, chunk=int(chunk),
                         len_scale=int(len_scale), stride_p=pos.stride(0),
                         qk_scale=(1.0 / math.sqrt(head_dim)) * 1.4426950408889634, H=heads, D=head_dim,
                         DP=head_lanes(head_dim),
                         IEEE=qkv.dtype == torch.float32, BM=tiles["bm"], BN=tiles["bn"],
                         BW=triton.next_power_of_2(tiles["bm"] + tiles["bn"] - 1), num_warps=tiles["warps"],
                         num_stages=tiles["stages"], **tn.pdl_kwargs(qkv, rows))
    return out
