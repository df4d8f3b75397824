"""Triton causal convolutions of the flow estimator as GEMMs over channels-last rows, with the ResNet
block's neighbours fused in.

A causal conv with ``taps`` taps reads frames ``t - taps + 1 .. t`` of the same batch row (zeros before the
first frame) and masks its input: ``y[t] = sum_tap W[:, tap, :] · (x · m)[t - taps + 1 + tap] + bias``.  The
weight is packed tap-major, ``(N, taps · C)``.  The input may come from two row-major tensors concatenated
along channels (the U-Net's skip connection), so the concatenation is never materialised.

Epilogue (in this order, each optional): per-frame LayerNorm over all N output channels (one program holds
whole rows), Mish, ``* mask``, ``+ vec[b]`` (the ResNet block's time embedding), ``+ residual``.  A second
weight (``res_w``, a 1x1 conv over the same masked input at frame ``t``) can be accumulated in the same K loop
(it is the last tap's tile) and stored separately: the ResNet block's residual projection, read back by its
second conv's epilogue.  A ResNet block is thus two kernels.

The LayerNorm epilogue needs whole rows in one program, so those convs run on few programs that each stream
the whole weight.  :func:`row_epilogue` is the same epilogue as a separate row-wise pass, so a conv can instead
run as a GEMM spread over N plus that pass (two launches, many more programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.kernels.common import _act, _pow2
from cosyvoice_fast.flow.kernels.estimator_linear import _mm, spread_tiles
from cosyvoice_fast.flow.kernels.tuning import FlowTuning, Tiles, default_tuning
from cosyvoice_fast.kernels.pdl import pdl_start

@triton.jit
def _conv_src(acc, racc, x_ptr, C_src, c_base, w_ptr, rw_ptr, mask_ptr, ctx_ptr, s_cb, s_cc, s_ct, b, rm, t_in,
              m_ok, rn, n_ok, rk, K_total, C_all, TAPS: tl.constexpr, HAS_RW: tl.constexpr, HAS_CTX: tl.constexpr,
              IEEE: tl.constexpr, BK: tl.constexpr):
    """Accumulate one input source (channels ``c_base .. c_base + C_src`` of the concatenation).  With
    ``HAS_CTX`` the columns before a row's first frame come from its context ``ctx[b, c, taps - 1 - k]`` (the
    already masked input ``k`` frames before it) instead of zeros."""
    wdt = w_ptr.dtype.element_ty
    for tap in tl.static_range(TAPS):
        shift = TAPS - 1 - tap
        src_ok = m_ok & (t_in >= shift)
        src = rm - shift
        mval = tl.load(mask_ptr + src, mask=src_ok, other=0.0).to(tl.float32)
        for c0 in range(0, C_src, BK):
            cc = c0 + rk
            c_ok = cc < C_src
            a = tl.load(x_ptr + src[:, None] * C_src + cc[None, :], mask=src_ok[:, None] & c_ok[None, :], other=0.0)
            a = a.to(tl.float32) * mval[:, None]
            if HAS_CTX:
                if shift > 0:
                    from_ctx = m_ok & (t_in < shift)
                    a += tl.load(ctx_ptr + b[:, None] * s_cb + (c_base + cc)[None, :] * s_cc
                                 + (TAPS - 1 - shift + t_in)[:, None] * s_ct,
                                 mask=from_ctx[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            a = a.to(wdt)
            kcol = tap * C_all + c_base + cc
            w = tl.load(w_ptr + rn[None, :] * K_total + kcol[:, None], mask=n_ok[None, :] & c_ok[:, None], other=0.0)
            acc += _mm(a, w, IEEE)
            if HAS_RW:
                if tap == TAPS - 1:
                    rw = tl.load(rw_ptr + rn[None, :] * C_all + (c_base + cc)[:, None],
                                 mask=n_ok[None, :] & c_ok[:, None], other=0.0)
                    racc += _mm(a, rw, IEEE)
    return acc, racc


@triton.jit
def _row_apply(x_ptr, rm, m_ok, T, N, mask_ptr, lnw_ptr, lnb_ptr, vec_ptr, stride_vec, res_ptr, y_ptr, eps,
               ACT: tl.constexpr, OUT_MASK: tl.constexpr, HAS_VEC: tl.constexpr, HAS_RES: tl.constexpr,
               BN: tl.constexpr):
    """``act(LayerNorm(x)) (* mask) (+ vec[b]) (+ residual)`` of whole rows ``rm`` of x (M, N) into y (the
    epilogue of :func:`row_epilogue`)."""
    rn = tl.arange(0, BN)
    n_ok = rn < N
    ok = m_ok[:, None] & n_ok[None, :]
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(ok, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    g = tl.load(lnw_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    bb = tl.load(lnb_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    y = _act(xc * rstd[:, None] * g[None, :] + bb[None, :], ACT)
    if OUT_MASK:
        y *= tl.load(mask_ptr + rm, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_VEC:
        b = rm // T
        y += tl.load(vec_ptr + b[:, None] * stride_vec + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + rm[:, None] * N + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_kernel(x1_ptr, x2_ptr, mask_ptr, w_ptr, b_ptr, lnw_ptr, lnb_ptr, vec_ptr, res_ptr, rw_ptr, rb_ptr,
                 rout_ptr, y_ptr, ctx_ptr, M, T, N, C1, C2, stride_vec, s_cb, s_cc, s_ct,
                 eps, TAPS: tl.constexpr, HAS_X2: tl.constexpr, HAS_LN: tl.constexpr, ACT: tl.constexpr,
                 OUT_MASK: tl.constexpr, HAS_VEC: tl.constexpr, HAS_RES: tl.constexpr, HAS_RW: tl.constexpr,
                 HAS_CTX: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    b = rm // T
    t_in = rm - b * T
    C_all = C1 + C2
    K_total = TAPS * C_all
    pdl_start(PDL)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    racc = tl.zeros([BM, BN], dtype=tl.float32)
    acc, racc = _conv_src(acc, racc, x1_ptr, C1, 0, w_ptr, rw_ptr, mask_ptr, ctx_ptr, s_cb, s_cc, s_ct, b, rm,
                          t_in, m_ok, rn, n_ok, rk, K_total, C_all, TAPS, HAS_RW, HAS_CTX, IEEE, BK)
    if HAS_X2:
        acc, racc = _conv_src(acc, racc, x2_ptr, C2, C1, w_ptr, rw_ptr, mask_ptr, ctx_ptr, s_cb, s_cc, s_ct, b,
                              rm, t_in, m_ok, rn, n_ok, rk, K_total, C_all, TAPS, HAS_RW, HAS_CTX, IEEE, BK)
    ok = m_ok[:, None] & n_ok[None, :]
    acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LN:  # the whole row is in this program (BN >= N, one program along N)
        mean = tl.sum(tl.where(ok, acc, 0.0), axis=1) / N
        xc = tl.where(ok, acc - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        g = tl.load(lnw_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        bb = tl.load(lnb_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        acc = xc * rstd[:, None] * g[None, :] + bb[None, :]
    acc = _act(acc, ACT)
    if OUT_MASK:
        acc *= tl.load(mask_ptr + rm, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_VEC:
        acc += tl.load(vec_ptr + b[:, None] * stride_vec + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + rm[:, None] * N + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)
    if HAS_RW:
        racc += tl.load(rb_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(rout_ptr + rm[:, None] * N + rn[None, :], racc.to(rout_ptr.dtype.element_ty), mask=ok)


def pack_conv_weight(weight: Tensor) -> Tensor:
    """(N, C, taps) Conv1d weight -> the (N, taps · C) tap-major GEMM operand the kernel reads."""
    n, c, k = weight.shape
    return weight.detach().permute(0, 2, 1).reshape(n, k * c).contiguous()


def conv_tiles(m: int, fp32: bool, tuning: FlowTuning | None = None) -> Tiles:
    """The tile table of a conv launch over ``m`` rows: fp32 tiles (IEEE dots need smaller ones), else the pair
    tiles over ``tuning.pair_rows`` rows, the large ones from ``tuning.large_m`` rows, the base ones between."""
    t = tuning or default_tuning()
    if fp32:
        return t.conv_fp32
    return t.conv_pair if t.pair(m) else t.conv_large if m >= t.large_m else t.conv


def causal_conv(x1: Tensor, mask: Tensor, weight: Tensor, bias: Tensor, frames: int, *, x2: Tensor | None = None,
                taps: int = 3, ln: tuple[Tensor, Tensor, float] | None = None, act: int = 0,
                out_mask: bool = False, vec: Tensor | None = None, residual: Tensor | None = None,
                res_weight: Tensor | None = None, res_bias: Tensor | None = None,
                res_out: Tensor | None = None, ctx: Tensor | None = None,
                tuning: FlowTuning | None = None) -> Tensor:
    """Causal conv over rows ``b·frames + t`` of ``x1`` (M, C1) [‖ ``x2`` (M, C2)], input masked by ``mask``
    (M,), ``weight`` packed by :func:`pack_conv_weight`; see the module docstring for the epilogue options.
    ``vec`` is (B, >= N) with unit column stride; ``res_weight`` (N, C1 + C2) writes into ``res_out`` (M, N).
    ``ctx`` (B, C1 + C2, taps - 1): the input columns before each row's first frame (an incremental window,
    :mod:`~cosyvoice_fast.flow.kernels.estimator_window`); zeros when None."""
    m, c1 = x1.shape
    c2 = 0 if x2 is None else x2.shape[1]
    n = weight.shape[0]
    if weight.shape[1] != taps * (c1 + c2) or not weight.is_contiguous():
        raise ValueError(f"causal_conv: weight must be packed ({n}, {taps * (c1 + c2)}), got {tuple(weight.shape)}")
    if not x1.is_contiguous() or (x2 is not None and (not x2.is_contiguous() or x2.shape[0] != m)):
        raise ValueError("causal_conv: inputs must be contiguous (M, C) with the same M")
    if m % frames or mask.numel() != m:
        raise ValueError(f"causal_conv: {m} rows are not batch rows of {frames} frames with a ({m},) mask")
    if (res_weight is None) != (res_out is None) or (res_weight is not None and res_bias is None):
        raise ValueError("causal_conv: res_weight, res_bias and res_out go together")
    if ctx is not None and ctx.shape != (m // frames, c1 + c2, taps - 1):
        raise ValueError(f"causal_conv: ctx must be ({m // frames}, {c1 + c2}, {taps - 1}), got {tuple(ctx.shape)}")
    y = torch.empty(m, n, device=x1.device, dtype=x1.dtype)
    fp32 = weight.dtype == torch.float32
    tiles = conv_tiles(m, fp32, tuning)
    t = tuning or default_tuning()
    if ln is not None:  # whole rows per program
        bm, bn = _pow2(m, 16, tiles["ln_bm"]), _pow2(n)
    else:
        bm, bn = spread_tiles(m, n, _pow2(m, 16, tiles["bm"]), _pow2(n, 16, tiles["bn"]), tiles.get("min_programs", 0))
    # row-wide tiles (and a second weight) must still fit in shared memory
    bk = _pow2(max(c1, c2), 16, (32 if fp32 else 64) if ln is not None else tiles["bk"])
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    lnw, lnb, eps = ln if ln is not None else (bias, bias, 0.0)
    s_cb, s_cc, s_ct = ctx.stride() if ctx is not None else (0, 0, 0)
    _conv_kernel[grid](
        x1, x2 if x2 is not None else x1, mask, weight, bias, lnw, lnb, vec if vec is not None else bias,
        residual if residual is not None else y, res_weight if res_weight is not None else weight,
        res_bias if res_bias is not None else bias, res_out if res_out is not None else y, y,
        ctx if ctx is not None else x1, M=m, T=frames, N=n, C1=c1, C2=c2,
        stride_vec=vec.stride(0) if vec is not None else 0, s_cb=s_cb, s_cc=s_cc, s_ct=s_ct, eps=float(eps),
        TAPS=taps, HAS_X2=x2 is not None, HAS_LN=ln is not None, ACT=act, OUT_MASK=out_mask,
        HAS_VEC=vec is not None, HAS_RES=residual is not None, HAS_RW=res_weight is not None,
        HAS_CTX=ctx is not None, IEEE=fp32, BM=bm, BN=bn, BK=bk,
        num_warps=tiles["ln_warps"] if ln is not None else tiles["warps"],
        num_stages=tiles["stages"], **t.pdl_kwargs(x1, m))
    return y


@triton.jit
def _row_kernel(x_ptr, mask_ptr, lnw_ptr, lnb_ptr, vec_ptr, res_ptr, y_ptr, M, T, N, stride_vec, eps,
                ACT: tl.constexpr, HAS_VEC: tl.constexpr, HAS_RES: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    pdl_start(PDL)
    _row_apply(x_ptr, rm, rm < M, T, N, mask_ptr, lnw_ptr, lnb_ptr, vec_ptr, stride_vec, res_ptr, y_ptr, eps, ACT,
               True, HAS_VEC, HAS_RES, BN)


def row_epilogue(x: Tensor, mask: Tensor, ln: tuple[Tensor, Tensor, float], frames: int, *, act: int = 0,
                 vec: Tensor | None = None, residual: Tensor | None = None,
                 tuning: FlowTuning | None = None) -> Tensor:
    """``act(LayerNorm(x)) * mask (+ vec[b]) (+ residual)`` over rows ``b·frames + t`` of contiguous x (M, N):
    the LayerNorm epilogue of :func:`causal_conv` as its own pass."""
    m, n = x.shape
    if not x.is_contiguous() or mask.numel() != m or m % frames:
        raise ValueError(f"row_epilogue: need contiguous x (M, N) with a (M,) mask and M a multiple of {frames}")
    y = torch.empty_like(x)
    t = tuning or default_tuning()
    bm = t.row_bm
    _row_kernel[(triton.cdiv(m, bm),)](x, mask, ln[0], ln[1], vec if vec is not None else x,
                                      residual if residual is not None else x, y, M=m,
                                      T=frames, N=n, stride_vec=vec.stride(0) if vec is not None else 0,
                                      eps=float(ln[2]), ACT=act, HAS_VEC=vec is not None,
                                      HAS_RES=residual is not None, BM=bm, BN=_pow2(n), num_warps=4,
                                      **t.pdl_kwargs(x, m))
    return y
