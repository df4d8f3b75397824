"""What the estimator's GEMM modules share: activation and prologue codes, the fused epilogue, small helpers.

:mod:`~cosyvoice_fast.flow.kernels.estimator_linear` (fused Triton GEMMs) and
:mod:`~cosyvoice_fast.flow.kernels.estimator_cublas` (cuBLAS product plus a Triton epilogue) both apply the same
epilogue, and ``linear`` dispatches to the cuBLAS path; keeping the shared pieces here lets each of the two
import the other's needs at module level without an import cycle.  The two interpreter checks
(:func:`interpreting`, :func:`can_run_on`) live here too and serve every kernel module, the LLM's included.
The flow kernels' launch settings and tiles are :class:`~cosyvoice_fast.flow.kernels.tuning.FlowTuning`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# activation codes shared by the estimator kernels
ACT_NONE, ACT_GELU, ACT_SILU, ACT_MISH = 0, 1, 2, 3
# prologue codes of :func:`~cosyvoice_fast.flow.kernels.estimator_linear.linear`
PRO_NONE, PRO_LN, PRO_MISH, PRO_SINUS = 0, 1, 2, 3

def gemm_output(who: str, m: int, weight: Tensor, residual: Tensor | None, out: Tensor | None,
                out_btc: tuple[int, int] | None, device: torch.device, dtype: torch.dtype
                ) -> tuple[Tensor, int, int, int, int]:
    """The checks and output layout ``linear`` and ``linear_oneshot`` share: a contiguous (N, K) weight, a
    row-major (M, N) residual, and the output (``out`` or a new tensor) with its store addressing
    ``(out, rows_per_b, stride_yb, stride_yt, stride_yn)`` -- row-major (M, N), or ``out_btc = (B, T)``'s
    (B, N, T) layout where row ``b·T + t`` lands at ``out[b, :, t]``."""
    n = weight.shape[0]
    if not weight.is_contiguous():
        raise ValueError(f"{who}: weight must be contiguous (N, K)")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"{who}: residual must be ({m}, {n}) row-major, got {tuple(residual.shape)}")
    if out_btc is None:
        out = torch.empty(m, n, device=device, dtype=dtype) if out is None else out
        return out, max(m, 1), 0, out.stride(0), out.stride(1)
    b, t = out_btc
    out = torch.empty(b, n, t, device=device, dtype=dtype) if out is None else out
    return out, t, out.stride(0), out.stride(2), out.stride(1)


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def can_run_on(device: torch.device) -> bool:
    """Triton runs CUDA tensors; CPU tensors only through its interpreter (``TRITON_INTERPRET=1``)."""
    return device.type == "cuda" or interpreting()


def _pow2(n: int, lo: int = 16, hi: int | None = None) -> int:
    """The next power of two from ``n``, at least ``lo`` and (when given) at most ``hi``: a tile extent."""
    p = max(lo, triton.next_power_of_2(n))
    return p if hi is None else min(p, hi)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """Elementwise activation in fp32 (GELU is the erf form CosyVoice2 uses)."""
    if ACT == 1:
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:
        x = x / (1.0 + tl.exp(-x))
    elif ACT == 3:
        # mish = x * tanh(softplus(x)) = x * n / (n + 2), n = e^x (e^x + 2); softplus is linear past 20
        e = tl.exp(tl.minimum(x, 20.0))
        n = e * (e + 2.0)
        x = tl.where(x > 20.0, x, x * n / (n + 2.0))
    return x


@triton.jit
def _grouped_tile(M, N, BM: tl.constexpr, BN: tl.constexpr):
    """(rows, columns, row mask, column mask) of this program's (BM, BN) output tile in a 1-D launch whose
    column tiles vary fastest, so the programs in flight together share their rows of X in L2."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    pid_m = pid // n_tiles
    pid_n = pid - pid_m * n_tiles
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    return rm, rn, rm < M, rn < N


@triton.jit
def _epilogue_store(acc, rm, rn, m_ok, n_ok, b_ptr, r_ptr, rowmask_ptr, y_ptr, stride_rm, rows_per_b, stride_yb,
                    stride_yt, stride_yn, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
                    ROWMASK: tl.constexpr):
    """``act(acc + bias) (+ residual) (* rowmask)`` of an fp32 (rows ``rm``, columns ``rn``) tile, stored at row
    ``b·rows_per_b + t``, column ``n`` through the given strides (row-major, or the (B, N, T) layout).  Returns
    the tile as stored (rounded to ``y``'s dtype, in fp32), for a caller that derives more from it."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc = _act(acc, ACT)
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=ok, other=0.0).to(tl.float32)
    if ROWMASK:
        acc *= tl.load(rowmask_ptr + rm, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    bi = rm // rows_per_b
    ti = rm - bi * rows_per_b
    dst = y_ptr + bi[:, None] * stride_yb + ti[:, None] * stride_yt + rn[None, :] * stride_yn
    stored = acc.to(y_ptr.dtype.element_ty)
    tl.store(dst, stored, mask=ok)
    return stored.to(tl.float32)


@triton.jit
def _norm_rows_store(h, rm, rn, m_ok, n_ok, N, g_ptr, beta_ptr, norm_ptr, stride_nm, eps):
    """Store ``LayerNorm(h)`` of an fp32 tile whose columns ``rn`` span whole rows of N: fp32 statistics, mean
    and biased variance (two passes over the registers), eps inside the square root, as ``F.layer_norm``."""
    ok = m_ok[:, None] & n_ok[None, :]
    h = tl.where(ok, h, 0.0)
    mean = tl.sum(h, axis=1) / N
    hc = tl.where(ok, h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(hc * hc, axis=1) / N + eps)
    g = tl.load(g_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    normed = hc * rstd[:, None] * g[None, :] + beta[None, :]
    tl.store(norm_ptr + rm[:, None] * stride_nm + rn[None, :], normed.to(norm_ptr.dtype.element_ty), mask=ok)
