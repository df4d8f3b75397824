"""What the estimator's GEMM modules share: activation and prologue codes, the fused epilogue, small helpers.

:mod:`~cosyvoice_fast.flow.kernels.estimator_linear` (fused Triton GEMMs) and
:mod:`~cosyvoice_fast.flow.kernels.estimator_cublas` (cuBLAS product plus a Triton epilogue) both apply the same
epilogue, and ``linear`` dispatches to the cuBLAS path; keeping the shared pieces here lets each of the two
import the other's needs at module level without an import cycle.  The two interpreter checks
(:func:`interpreting`, :func:`can_run_on`) live here too and serve every kernel module, the LLM's included.

**Ragged extents.**  A CUDA graph fixes every launch's grid at capture, so a solve padded up to its graph's
bucket (rows and frames) used to pay for every padded frame.  Each row kernel of the estimator therefore takes
an optional ``extent``: a 2-element int32 device tensor ``[B, T]``, the live batch rows and frames of this
replay, written before each replay (:class:`~cosyvoice_fast.flow.graph.GraphEstimator`).  Under
it the activations are laid out as ``B·T`` rows -- row ``b·T + t`` -- inside the capacity ``B_cap·T_cap``
buffers, so all padding sits past row ``B·T``: a program whose tile starts there returns at once, convolutions
and attention find batch row ``b`` at ``b·T``, and the final projection stores into the capacity (B, N, T)
output by the live ``T``.  cuBLAS products and ``F.layer_norm`` still run over the capacity rows (garbage in,
garbage out in rows nobody reads).  The extent is written before the forward is launched (a graph input,
filled before each replay) and never while it runs, so kernels read it *before* their PDL wait: a dependent
load after the wait would add a memory round trip to every launch of the chain.  A skipping program still
returns only after :func:`~.pdl.pdl_start`, so a kernel completes only after the one before it
(programmatic dependent launch stays transitive).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.kernels.pdl import pdl_options

# activation codes shared by the estimator kernels
ACT_NONE, ACT_GELU, ACT_SILU, ACT_MISH = 0, 1, 2, 3
# prologue codes of :func:`~cosyvoice_fast.flow.kernels.estimator_linear.linear`
PRO_NONE, PRO_LN, PRO_MISH, PRO_SINUS = 0, 1, 2, 3

#: Rows (``min`` to ``max``, inclusive) of a 16-bit launch that gets the *pair tiles*: one request's CFG pair at
#: the flow's frame buckets from 100 to 250 (a new voice's first chunk is one), a chain of ~340 launches of a
#: few hundred rows each.  In such a chain a kernel's time depends on its neighbours' grids (the next kernel's
#: programs start, and park, while it drains), so tiles timed one kind at a time did not add up; the GEMM,
#: attention and convolution tiles for these launches were chosen together, over the whole forward
#: (``benchmarks/first_forward_ab.py``).  At 2 x 56 frames they were slower than the few-rows tiles, hence the
#: lower bound (BENCHMARKS.md, session 23).  Read at each launch, so a benchmark or test may change it.
PAIR_ROWS = {"min": 129, "max": 512}

#: Launch settings of every estimator kernel, read at each launch (a benchmark flips them before a capture):
#: ``pdl`` -- programmatic dependent launch on CUDA (:mod:`.pdl`): a kernel's programs start while the previous
#: kernel drains and wait before their first activation read; only for launches over at most ``pdl_max_rows``
#: rows (one request's CFG pair is a few hundred; with several waves of programs the parked programs of the
#: next kernel cost more than the hidden gap, see BENCHMARKS.md); ``early_weights`` -- the row-tiled GEMMs
#: (:func:`~cosyvoice_fast.flow.kernels.estimator_linear.linear`) load their first weight tile before that wait;
#: ``oneshot`` -- ``linear`` calls of at most ``oneshot_max_rows`` rows run as one-shot GEMMs
#: (:mod:`~cosyvoice_fast.flow.kernels.estimator_oneshot`) instead of the row-tiled kernel, except the Mish and
#: sinusoidal prologues (the time embedding) and a ``norm_out`` request.  Up to the top of
#: :data:`PAIR_ROWS`: one request's CFG pair up to the flow's 250-frame bucket, where the one-shot GEMMs with the
#: pair tiles beat the row-tiled ones at every measured length (BENCHMARKS.md, session 23).  ``conv_tail`` --
#: a ResNet block's convs that run spread over output channels (``FusedEstimator``'s ``resnet_split_ln``) apply
#: their LayerNorm epilogue in the conv's last program per row tile (a *tail* conv, :mod:`.estimator_conv`)
#: instead of a row pass of their own: two launches per ResNet block instead of four (341 -> 313 per forward).
#: Off: on an H100 the forward got 1-7 % slower at 200-250 frames (the last program's serial pass sits at the
#: end of every conv), and a first chunk's flow no faster (BENCHMARKS.md, session 24).
LAUNCH = {"pdl": True, "pdl_max_rows": 1024, "early_weights": True, "oneshot": True,
          "oneshot_max_rows": PAIR_ROWS["max"], "conv_tail": False}


def pair_rows(m: int) -> bool:
    """Whether a launch over ``m`` rows takes the pair tiles (:data:`PAIR_ROWS`)."""
    return PAIR_ROWS["min"] <= m <= PAIR_ROWS["max"]


def pdl_kwargs(t: Tensor, rows: int) -> dict:
    """The ``PDL`` constexpr and launch flag of an estimator kernel over ``rows`` rows whose operands live where
    ``t`` does."""
    return pdl_options(LAUNCH["pdl"] and rows <= LAUNCH["pdl_max_rows"], t)


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


def extent_args(extent: Tensor | None, like: Tensor, out_btc: object = None) -> dict:
    """The ``ext_ptr`` / ``EXT`` launch arguments of a row kernel for an optional ragged ``extent`` (see the
    module docstring), after checking it is a 2-element int32 tensor on ``like``'s device.  ``EXT`` is 0 (no
    extent), 1 (ragged rows) or 2 (ragged rows stored into a (B, N, T) output, ``out_btc`` given: the store
    splits rows by the live frame count)."""
    if extent is None:
        return {"ext_ptr": like, "EXT": 0}
    if extent.dtype != torch.int32 or extent.numel() != 2 or extent.device != like.device:
        raise ValueError(f"extent must be a 2-element int32 tensor [batch rows, frames] on {like.device}, got "
                         f"{extent.dtype} with {extent.numel()} elements on {extent.device}")
    return {"ext_ptr": extent, "EXT": 2 if out_btc is not None else 1}


@triton.jit
def _live_rows(M, T, ext_ptr, EXT: tl.constexpr):
    """(rows, frames per batch row) of this launch: the capacity ``M`` and ``T`` it was launched for, or under a
    ragged extent (``EXT`` > 0) the live ``B·T`` and ``T`` read from ``ext_ptr``."""
    if EXT > 0:
        T = tl.load(ext_ptr + 1)
        M = tl.load(ext_ptr) * T
    return M, T


@triton.jit
def _live_gemm_rows(M, rows_per_b, ext_ptr, EXT: tl.constexpr):
    """(rows, rows per output batch row) of a GEMM launch: the capacity ones it was launched with, or under a
    ragged extent the live ``B·T`` rows, and (``EXT == 2``: a (B, N, T) store) the live ``T`` per batch row."""
    if EXT > 0:
        M, t_live = _live_rows(M, rows_per_b, ext_ptr, EXT)
        if EXT == 2:
            rows_per_b = t_live
    return M, rows_per_b


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
