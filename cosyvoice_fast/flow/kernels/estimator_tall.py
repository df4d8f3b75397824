"""The estimator's GEMMs at many rows as one Triton kernel each: wide tensor-core tiles, the epilogue fused in.

A batched solve stacks thousands of frames (16 requests x the CFG pair x 250 frames is 8000 rows).  The
cuBLAS path (:mod:`~cosyvoice_fast.flow.kernels.estimator_cublas`) computes the product fast but stores it in 16
bits, and a second Triton pass reads it back to add bias, activation, residual and the next LayerNorm: at
(8000 x 1024) that is 16 MB written and read again per GEMM, as much memory traffic as the product itself.
Here the product and all of that run in one kernel: tensor-core tiles (64 rows x 128 columns by default), a
plain K loop the compiler pipelines, and :func:`~cosyvoice_fast.kernels.common.
_epilogue_store` on the fp32 accumulator.  With ``norm_out`` the tile spans the whole output row (N is the
channel count, 256 in released models), so the row LayerNorm of the stored row is computed in registers too.
Its product alone is slower than cuBLAS's, so it runs only where the saved pass is worth more
(:func:`~cosyvoice_fast.flow.kernels.estimator_cublas.tall_product`).

Numerics: fp32 accumulation and one rounding of the result, like the fused row-tiled kernel (the cuBLAS path
rounds the product once more before its epilogue).  Only the tile order of the fp32 sums differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.kernels.common import _epilogue_store, _grouped_tile, _norm_rows_store, _pow2, interpreting
from cosyvoice_fast.flow.kernels.tuning import FlowTuning, default_tuning

@triton.jit
def _tall_kernel(x_ptr, w_ptr, b_ptr, r_ptr, rowmask_ptr, y_ptr, g_ptr, beta_ptr, norm_ptr,
                 M, N, K, stride_xm, stride_rm, rows_per_b, stride_yb, stride_yt, stride_yn, stride_nm, eps,
                 HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr, ROWMASK: tl.constexpr,
                 NORM: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm, rn, m_ok, n_ok = _grouped_tile(M, N, BM, BN)
    rk = tl.arange(0, BK)
    # out-of-range rows and columns read row / column 0 instead of a masked load (unmasked loads pipeline
    # better); their results are never stored
    a_rows = x_ptr + tl.where(m_ok, rm, 0)[:, None] * stride_xm
    w_cols = w_ptr + tl.where(n_ok, rn, 0)[None, :] * K
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        if EVEN_K:
            a = tl.load(a_rows + kk[None, :])
            w = tl.load(w_cols + kk[:, None])
        else:
            a = tl.load(a_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
            w = tl.load(w_cols + kk[:, None], mask=(kk < K)[:, None], other=0.0)
        if IEEE:  # fp32 operands, or 16-bit ones widened under the interpreter (whose 16-bit dots are wrong)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    stored = _epilogue_store(acc, rm, rn, m_ok, n_ok, b_ptr, r_ptr, rowmask_ptr, y_ptr, stride_rm, rows_per_b,
                             stride_yb, stride_yt, stride_yn, HAS_BIAS, ACT, HAS_RES, ROWMASK)
    if NORM:
        _norm_rows_store(stored, rm, rn, m_ok, n_ok, N, g_ptr, beta_ptr, norm_ptr, stride_nm, eps)


def tall_tiles(norm: bool, tuning: FlowTuning | None = None) -> dict:
    """The tile settings of one launch (``norm``: it writes the next LayerNorm, so its column tile is the whole
    row, whatever ``bn`` says)."""
    t = tuning or default_tuning()
    return t.tall_norm if norm else t.tall


def linear_tall(x: Tensor, weight: Tensor, bias: Tensor | None, *, act: int, residual: Tensor | None,
                rowmask: Tensor | None, out: Tensor, rows_per_b: int, out_strides: tuple[int, int, int],
                norm_out: tuple[Tensor, tuple[Tensor, Tensor, float]] | None = None,
                tiles: dict | None = None, tuning: FlowTuning | None = None) -> Tensor:
    """``act(x @ weight.T + bias) (+ residual) (* rowmask)`` into ``out`` (strides ``(batch, frame, channel)``
    as :func:`~cosyvoice_fast.flow.kernels.estimator_linear.linear` computed them, which validated the arguments),
    and ``norm_out[0] = LayerNorm(out)`` when given; x (M, K) with unit column stride, weight (N, K)
    contiguous.  ``tiles`` overrides the settings :func:`tall_tiles` picks (benchmarks)."""
    m, k = x.shape
    n = weight.shape[0]
    t = tiles if tiles is not None else tall_tiles(norm_out is not None, tuning)
    bm, bk = _pow2(m, 16, t["bm"]), _pow2(k, 16, t["bk"])
    bn = _pow2(n, 16, t["bn"]) if norm_out is None else _pow2(n, 16)
    if norm_out is not None:
        dst, (g, beta, eps) = norm_out
    else:
        dst, g, beta, eps = out, weight, weight, 0.0
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _tall_kernel[grid](
        x, weight, bias if bias is not None else weight, residual if residual is not None else x,
        rowmask if rowmask is not None else x, out, g, beta, dst, M=m, N=n, K=k, stride_xm=x.stride(0),
        stride_rm=residual.stride(0) if residual is not None else 0, rows_per_b=rows_per_b,
        stride_yb=out_strides[0], stride_yt=out_strides[1], stride_yn=out_strides[2], stride_nm=dst.stride(0),
        eps=float(eps),
        HAS_BIAS=bias is not None, ACT=act, HAS_RES=residual is not None, ROWMASK=rowmask is not None,
        NORM=norm_out is not None, EVEN_K=k % bk == 0, IEEE=weight.dtype == torch.float32 or interpreting(),
        BM=bm, BN=bn, BK=bk, num_warps=t["warps"], num_stages=t["stages"])
    return out
