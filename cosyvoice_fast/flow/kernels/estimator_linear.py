"""Triton GEMMs of the flow estimator with their neighbours fused in (channels-last rows, one row = one frame).

* :func:`linear` — ``Y = epilogue(prologue(X) @ W^T)``: an optional LayerNorm prologue (row statistics in a
  first pass over K, so K is not limited by a tile), or a Mish prologue, or the sinusoidal time features
  computed from the flow time itself; bias, GELU/SiLU, a residual add, a row mask and a strided store (the
  estimator's last projection writes the (B, 80, T) layout directly) in the epilogue; from
  ``FlowTuning.many_rows_m`` rows (16-bit weights) the call takes the
  many-rows path (:mod:`~cosyvoice_fast.flow.kernels.estimator_cublas`: cuBLAS or a tall Triton kernel), whose
  epilogue can also write the next LayerNorm of its output (``norm_out``); below it, with
  ``FlowTuning.oneshot`` (up to ``FlowTuning.oneshot_max_rows`` rows), the one-shot GEMM of
  :mod:`~cosyvoice_fast.flow.kernels.estimator_oneshot` (one dependent load round per launch), and the row-tiled
  kernel here for the Mish and sinusoidal prologues (the time embedding), ``norm_out`` and more rows.

Accumulation is fp32 everywhere; with fp32 operands the dots run as IEEE fp32 (not TF32) so that the fused
estimator matches eager PyTorch to 1e-4.  Why these fusions: the estimator is launch-bound (hundreds of tiny
kernels per forward), so every elementwise/norm pass folded into a GEMM removes a launch and a round trip.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

# re-exported: the codes and helpers are imported from here by the other estimator modules and the tests
from cosyvoice_fast.kernels.common import (
    ACT_GELU, ACT_MISH, ACT_NONE, ACT_SILU, PRO_LN, PRO_MISH, PRO_NONE, PRO_SINUS, _act, _epilogue_store, _pow2,
    gemm_output,
)
from cosyvoice_fast.flow.kernels.estimator_cublas import linear_cublas, use_many_rows
from cosyvoice_fast.flow.kernels.estimator_oneshot import linear_oneshot
from cosyvoice_fast.flow.kernels.tuning import FlowTuning, default_tuning
from cosyvoice_fast.kernels.pdl import pdl_start

def spread_tiles(m: int, n: int, bm: int, bn: int, min_programs: int) -> tuple[int, int]:
    """Narrow the (bm, bn) tile -- columns first, down to 32, then rows, down to 16 -- until the launch has at
    least ``min_programs`` programs: a 2-row forward's N = 256 GEMMs (out-projection, FF2, the ResNet convs)
    otherwise run on ~50 programs of an H100's 132 SMs, each walking all of K alone."""
    while min_programs and triton.cdiv(m, bm) * triton.cdiv(n, bn) < min_programs:
        if bn > 32:
            bn //= 2
        elif bm > 16:
            bm //= 2
        else:
            break
    return bm, bn


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _a_tile(x_ptr, rm, m_ok, kk, K, stride_xm, lnw_ptr, lnb_ptr, mean, rstd, tval, wdt, PRO: tl.constexpr):
    """The (BM, BK) left operand at K columns ``kk``: x itself, LayerNorm(x), Mish(x), or the sinusoidal time
    features of ``tval``."""
    k_ok = kk < K
    if PRO == 3:
        half = K // 2
        idx = tl.where(kk < half, kk, kk - half)
        freq = tl.load(lnw_ptr + idx, mask=k_ok, other=0.0).to(tl.float32)
        arg = tval[:, None] * freq[None, :]
        a = tl.where(kk[None, :] < half, tl.sin(arg), tl.cos(arg))
        a = tl.where(m_ok[:, None] & k_ok[None, :], a, 0.0).to(wdt)
    else:
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if PRO == 1:
            g = tl.load(lnw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            bb = tl.load(lnb_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            a = ((a.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :] + bb[None, :]).to(wdt)
        elif PRO == 2:
            a = _act(a.to(tl.float32), 3).to(wdt)
    return a


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, lnw_ptr, lnb_ptr, rowmask_ptr,
                   M, N, K, stride_xm, stride_rm, rows_per_b, stride_yb, stride_yt, stride_yn,
                   eps, sinus_scale,
                   PRO: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
                   ROWMASK: tl.constexpr, IEEE: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    wdt = w_ptr.dtype.element_ty
    if not EARLY:
        pdl_start(PDL)
    # the first K tile of the weight: weights never depend on the previous kernel, so with EARLY its load is in
    # flight while the previous kernel drains
    w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=n_ok[None, :] & (rk[:, None] < K), other=0.0)
    if EARLY:
        pdl_start(PDL)
    mean = tl.zeros([BM], dtype=tl.float32)
    rstd = mean
    tval = mean
    if PRO == 1:  # LayerNorm statistics of each row, fp32
        s1 = tl.zeros([BM], dtype=tl.float32)
        s2 = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            xv = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K),
                         other=0.0).to(tl.float32)
            s1 += tl.sum(xv, axis=1)
            s2 += tl.sum(xv * xv, axis=1)
        mean = s1 / K
        rstd = 1.0 / tl.sqrt(tl.maximum(s2 / K - mean * mean, 0.0) + eps)
    if PRO == 3:  # sinusoidal flow-time features from t (one scalar per row)
        tval = tl.load(x_ptr + rm * stride_xm, mask=m_ok, other=0.0).to(tl.float32) * sinus_scale
    acc = _mm(_a_tile(x_ptr, rm, m_ok, rk, K, stride_xm, lnw_ptr, lnb_ptr, mean, rstd, tval, wdt, PRO), w, IEEE)
    for k0 in range(BK, K, BK):
        kk = k0 + rk
        a = _a_tile(x_ptr, rm, m_ok, kk, K, stride_xm, lnw_ptr, lnb_ptr, mean, rstd, tval, wdt, PRO)
        w = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=n_ok[None, :] & (kk[:, None] < K), other=0.0)
        acc += _mm(a, w, IEEE)
    _epilogue_store(acc, rm, rn, m_ok, n_ok, b_ptr, r_ptr, rowmask_ptr, y_ptr, stride_rm, rows_per_b, stride_yb,
                    stride_yt, stride_yn, HAS_BIAS, ACT, HAS_RES, ROWMASK)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, prologue: int = PRO_NONE,
           ln: tuple[Tensor, Tensor, float] | None = None, act: int = ACT_NONE, residual: Tensor | None = None,
           rowmask: Tensor | None = None, out: Tensor | None = None, out_btc: tuple[int, int] | None = None,
           freqs: Tensor | None = None, sinus_scale: float = 1000.0,
           norm_out: tuple[Tensor, tuple[Tensor, Tensor, float]] | None = None,
           oneshot: bool | None = None, tuning: FlowTuning | None = None) -> Tensor:
    """``act(prologue(x) @ weight.T + bias) (+ residual) (* rowmask)`` for x (M, K) row-major, weight (N, K).

    ``prologue``: :data:`PRO_LN` (``ln`` = (gamma, beta, eps)), :data:`PRO_MISH`, or :data:`PRO_SINUS`, where
    ``x`` is the (M,) flow time and row ``m`` is ``[sin | cos](sinus_scale · t · freqs)`` (``freqs``: the K/2
    fp32 frequencies, passed in so they are bit-identical to the eager embedding's).  ``out_btc = (B, T)``
    stores row ``b·T + t``, column ``n`` at ``out[b, n, t]`` of a (B, N, T) tensor (the estimator's output
    layout); otherwise ``out`` is (M, N).

    ``norm_out = (dst, (gamma, beta, eps))`` also fills ``dst`` (M, N), row-major, with
    ``F.layer_norm(out, (N,), gamma, beta, eps)``: the LayerNorm that the next GEMM would otherwise apply as
    its prologue, so that GEMM can read ``dst`` with no prologue.  On the many-rows path (:func:`use_many_rows`)
    it is part of the epilogue and costs no launch; on the row-tiled path, whose tiles do not span a row, it
    is a separate pass, so callers pass it only where :func:`use_many_rows` holds (elsewhere the next GEMM's
    LayerNorm prologue is free) -- it is filled on either path so that a wrong guess costs time, not results.

    ``oneshot``: whether a call of few rows may take the one-shot GEMM (``None``: ``tuning.oneshot``).
    ``tuning``: the launch settings and tiles (``None``: :func:`~.tuning.default_tuning`).
    """
    n, k = weight.shape
    m = x.shape[0]
    if prologue == PRO_SINUS and x.dim() != 1:
        raise ValueError(f"linear: the sinusoidal prologue reads a (M,) time vector, got {tuple(x.shape)}")
    if prologue != PRO_SINUS and (x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1):
        raise ValueError(f"linear: x must be (M, {k}) with unit column stride, got {tuple(x.shape)}")
    out, rows_per_b, syb, syt, syn = gemm_output(
        "linear", m, weight, residual, out, out_btc, x.device,
        x.dtype if prologue != PRO_SINUS or out_btc is not None else weight.dtype)
    lnw, lnb, eps = ln if ln is not None else (weight, weight, 0.0)
    if prologue == PRO_LN and ln is None:
        raise ValueError("linear: the LayerNorm prologue needs ln=(gamma, beta, eps)")
    if prologue == PRO_SINUS:
        if freqs is None or freqs.numel() != k // 2 or freqs.dtype != torch.float32 or k % 2:
            raise ValueError(f"linear: the sinusoidal prologue needs {k // 2} fp32 freqs and an even K ({k})")
        lnw = freqs
    if norm_out is not None:
        _check_norm_out(norm_out, m, n, out_btc)
    t = tuning or default_tuning()
    if use_many_rows(m, weight, prologue, t):
        return linear_cublas(x, weight, bias, prologue=prologue, ln=ln, act=act, residual=residual, rowmask=rowmask,
                             out=out, rows_per_b=rows_per_b, out_strides=(syb, syt, syn), norm_out=norm_out,
                             tuning=t)
    if (t.oneshot if oneshot is None else oneshot) and m <= t.oneshot_max_rows \
            and prologue in (PRO_NONE, PRO_LN) and norm_out is None:
        return linear_oneshot(x, weight, bias, prologue=prologue, ln=ln, act=act, residual=residual,
                              rowmask=rowmask, out=out, out_btc=out_btc, tuning=t)
    tiles = t.linear_fp32 if weight.dtype == torch.float32 else t.linear
    bm, bn = spread_tiles(m, n, _pow2(m, 16, tiles["bm"]), _pow2(n, 16, tiles["bn"]), tiles.get("min_programs", 0))
    bk = _pow2(k, 16, tiles["bk"])
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _linear_kernel[grid](
        x, weight, bias if bias is not None else weight, residual if residual is not None else x, out, lnw, lnb,
        rowmask if rowmask is not None else x, M=m, N=n, K=k, stride_xm=x.stride(0),
        stride_rm=residual.stride(0) if residual is not None else 0, rows_per_b=rows_per_b, stride_yb=syb,
        stride_yt=syt, stride_yn=syn, eps=float(eps), sinus_scale=float(sinus_scale),
        PRO=prologue, HAS_BIAS=bias is not None, ACT=act, HAS_RES=residual is not None,
        ROWMASK=rowmask is not None, IEEE=weight.dtype == torch.float32, BM=bm, BN=bn, BK=bk,
        EARLY=t.early_weights, num_warps=tiles["warps"], num_stages=tiles["stages"], **t.pdl_kwargs(x, m))
    if norm_out is not None:
        dst, (g, beta, norm_eps) = norm_out
        dst.copy_(F.layer_norm(out, (n,), g, beta, norm_eps))
    return out


def _check_norm_out(norm_out: tuple[Tensor, tuple[Tensor, Tensor, float]], m: int, n: int,
                    out_btc: tuple[int, int] | None, who: str = "linear") -> None:
    """``norm_out`` must be a row-major (M, N) tensor with N-long gamma and beta: the
    normed rows feed the next GEMM as its ``x``, and a whole-row epilogue tile stores them with one row stride."""
    dst, (g, beta, _) = norm_out
    if out_btc is not None:
        raise ValueError(f"{who}: norm_out is for row-major (M, N) outputs, not the (B, N, T) out_btc layout")
    if dst.shape != (m, n) or dst.stride(1) != 1:
        raise ValueError(f"{who}: norm_out must be ({m}, {n}) row-major, got {tuple(dst.shape)}")
    if g.shape != (n,) or beta.shape != (n,):
        raise ValueError(f"{who}: norm_out's gamma and beta must be ({n},), got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
