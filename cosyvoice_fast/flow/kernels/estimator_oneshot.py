"""One-shot GEMMs for the estimator's few-rows forwards: each launch has one dependent load round.

A first chunk's forward (the CFG pair x a few hundred frames) is a chain of a few hundred small GEMMs whose
arithmetic takes well under a microsecond each; what a launch costs is its chain of *dependent* memory round
trips after the previous kernel's writes become visible.  The row-tiled kernels of
:mod:`~cosyvoice_fast.flow.kernels.estimator_linear` walk K in tiles and take LayerNorm statistics in a pass of their
own, so a launch waits on several L2 round trips in a row.  Here a program

1. loads its whole (K, BN) weight tile, bias and LayerNorm parameters *before* the programmatic-dependent-launch
   wait (none of them depends on the previous kernel, so they arrive while it drains),
2. loads its whole (BM, K) activation tile (and residual tile) in one round after the wait,
3. takes the LayerNorm statistics from those registers, multiplies, and stores the epilogue.

That suits K up to a thousand or so (the estimator's 256 and 1024); the weight tile's register footprint is what
bounds BN (:func:`oneshot_tiles`).  Numerics are those of ``linear``: fp32 statistics and accumulation, IEEE fp32
dots for fp32 operands, and its epilogue (bias, activation, residual, row mask, strided store), with the residual
tile loaded together with the activations instead of after the product.
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.kernels.common import ACT_NONE, PRO_LN, PRO_NONE, _act, _grouped_tile, _pow2, gemm_output
from cosyvoice_fast.flow.kernels.tuning import FlowTuning, default_tuning
from cosyvoice_fast.kernels.pdl import pdl_start

def oneshot_tiles(m: int, n: int, k: int, dtype: torch.dtype, tuning: FlowTuning | None = None) -> Mapping:
    """The tiles (``bm``, ``bn``, ``warps``, optional ``bk`` and ``stages``) of a :func:`linear_oneshot` launch
    for an (m, k) x (k, n) product, from ``tuning.oneshot_tiles``: the fastest of the variants timed on an H100
    at 112 and 412 rows for the estimator's shapes; over ``tuning.pair_rows`` rows the pair tiles, chosen over
    the whole forward.  K of 1024 runs in one step at few rows and in pipelined steps of 256 beyond."""
    t = tuning or default_tuning()
    table = t.oneshot_tiles
    if dtype == torch.float32:
        return table["fp32"]
    few = m <= t.few_rows
    if t.pair(m):  # (the final 80-wide projection keeps the tiles below)
        if k <= 256 and n >= 1024:
            return table["pair_qkv"] if n >= 1536 else table["pair_ff1"]
        if k > 256:
            return table["pair_out"] if k <= 512 else table["pair_ff2"]
    if k <= 256:  # q/k/v (N = 1536) and FF1 (N = 1024), both with the LayerNorm prologue
        return table["small_k_wide"] if not few and n >= 1536 else table["small_k"]
    if k <= 512:  # the attention out-projection (K = heads x head_dim)
        return table["out_few"] if few else table["out_many"]
    return table["ff2_few"] if few else table["ff2_many"]  # FF2 and the time embedding (K = 1024)


@triton.jit
def _oneshot_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, lnw_ptr, lnb_ptr, rowmask_ptr,
                    M, N, K, stride_xm, stride_rm, rows_per_b, stride_yb, stride_yt, stride_yn, eps,
                    PRO: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
                    ROWMASK: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, KSTEPS: tl.constexpr, PDL: tl.constexpr):
    rm, rn, m_ok, n_ok = _grouped_tile(M, N, BM, BN)
    rk = tl.arange(0, BK)
    k_ok = rk < K
    ok = m_ok[:, None] & n_ok[None, :]
    # everything that does not depend on the previous kernel is requested before the wait
    w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if PRO == 1:
        g = tl.load(lnw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        beta = tl.load(lnb_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
    pdl_start(PDL)
    # one round of activation loads: the row tile (its first K step) and the residual tile together
    a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if HAS_RES:
        res = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=ok, other=0.0)
    if ROWMASK:
        keep = tl.load(rowmask_ptr + rm, mask=m_ok, other=0.0).to(tl.float32)
    if PRO == 1:  # LayerNorm: fp32 statistics of the whole row from the registers (mean, then centred moment)
        af = a.to(tl.float32)
        mean = tl.sum(af, axis=1) / K
        ac = tl.where(k_ok[None, :], af - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(ac * ac, axis=1) / K + eps)
        a = (ac * rstd[:, None] * g[None, :] + beta[None, :]).to(w.dtype)
    if IEEE:
        acc = tl.dot(a, w, input_precision="ieee")
    else:
        acc = tl.dot(a, w)
    for s in tl.static_range(1, KSTEPS):  # K beyond one tile (no LayerNorm then): further steps, pipelined
        kk = s * BK + rk
        kk_ok = kk < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & kk_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=n_ok[None, :] & kk_ok[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += bias[None, :]
    acc = _act(acc, ACT)
    if HAS_RES:
        acc += res.to(tl.float32)
    if ROWMASK:
        acc *= keep[:, None]
    bi = rm // rows_per_b
    ti = rm - bi * rows_per_b
    dst = y_ptr + bi[:, None] * stride_yb + ti[:, None] * stride_yt + rn[None, :] * stride_yn
    tl.store(dst, acc.to(y_ptr.dtype.element_ty), mask=ok)


def linear_oneshot(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, prologue: int = PRO_NONE,
                   ln: tuple[Tensor, Tensor, float] | None = None, act: int = ACT_NONE,
                   residual: Tensor | None = None, rowmask: Tensor | None = None, out: Tensor | None = None,
                   out_btc: tuple[int, int] | None = None, tiles: Mapping | None = None,
                   tuning: FlowTuning | None = None) -> Tensor:
    """``act(prologue(x) @ weight.T + bias) (+ residual) (* rowmask)`` for x (M, K) row-major and weight (N, K):
    ``linear``'s contract for the prologues :data:`PRO_NONE` and :data:`PRO_LN` (``ln = (gamma, beta, eps)``;
    the Mish prologue stays on the row-tiled kernel, which measured 3.6x faster for the time embedding's
    2-row GEMM on an H100); ``out_btc = (B, T)`` stores row ``b·T + t`` at ``out[b, n, t]`` of a (B, N, T)
    tensor.  ``tiles`` (``bm``, ``bn``, ``warps``, optional ``bk``, ``stages``) overrides :func:`oneshot_tiles`;
    ``tuning``: the launch settings (``None``: :func:`~.tuning.default_tuning`)."""
    if prologue not in (PRO_NONE, PRO_LN):
        raise ValueError(f"linear_oneshot: prologue {prologue} is not PRO_NONE or PRO_LN; use linear()")
    if prologue == PRO_LN and ln is None:
        raise ValueError("linear_oneshot: the LayerNorm prologue needs ln=(gamma, beta, eps)")
    n, k = weight.shape
    m = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"linear_oneshot: x must be (M, {k}) with unit column stride, got {tuple(x.shape)}")
    out, rows_per_b, syb, syt, syn = gemm_output("linear_oneshot", m, weight, residual, out, out_btc, x.device,
                                                 x.dtype)
    lnw, lnb, eps = ln if prologue == PRO_LN else (weight, weight, 0.0)
    t = tuning or default_tuning()
    tiles = oneshot_tiles(m, n, k, weight.dtype, t) if tiles is None else tiles
    bm, bn = _pow2(m, 16, tiles["bm"]), _pow2(n, 16, tiles["bn"])
    # the LayerNorm needs the whole row in one tile; otherwise K is walked in steps of at most bk
    bk = _pow2(k) if prologue == PRO_LN else _pow2(k, 16, tiles.get("bk", 1 << 30))
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _oneshot_kernel[grid](
        x, weight, bias if bias is not None else weight, residual if residual is not None else x, out, lnw, lnb,
        rowmask if rowmask is not None else x, M=m, N=n, K=k, stride_xm=x.stride(0),
        stride_rm=residual.stride(0) if residual is not None else 0, rows_per_b=rows_per_b, stride_yb=syb,
        stride_yt=syt, stride_yn=syn, eps=float(eps), PRO=prologue,
        HAS_BIAS=bias is not None, ACT=act, HAS_RES=residual is not None,
        ROWMASK=rowmask is not None, IEEE=weight.dtype == torch.float32, BM=bm, BN=bn, BK=bk,
        KSTEPS=triton.cdiv(k, bk), num_warps=tiles["warps"], num_stages=tiles.get("stages", 2), **t.pdl_kwargs(x, m))
    return out
