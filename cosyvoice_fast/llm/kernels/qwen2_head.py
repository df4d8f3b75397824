"""The end of a looped decode step (more rows than a GEMV step, fewer than ``Tiles.cublas_rows``): the final
RMSNorm and the speech head.

Why a kernel of its own: steps of the looped projections (:mod:`.qwen2_proj`) used to end with the final norm
as one kernel, then the head as a cuBLAS GEMM, its bias and a cast to fp32 as torch ops: three launches outside
the programmatic-dependent-launch chain, ~25 µs under CUPTI at 16 rows on an H100 for ~12 MB of weights.
:func:`head` is one kernel in the chain: each program owns ``Tiles.head`` output columns and the step's whole row block,
normalises each K tile of the fp32 residual as it loads it (:func:`~.qwen2_pieces.normed_gemm`, the q/k/v and
gate/up kernels' prologue) and adds the bias before the one rounding to the weight dtype.  Its logits are those
of the GEMV head (:func:`~.qwen2_gemv.head`), which ends one- and two-row steps: a step's tokens do not depend on
how many rows share it beyond fp32 summation order.  (The step's start stays torch's gather, cast and memset:
the gather kernel of GEMV steps, :func:`~.qwen2_gemv.embed`, measured slower ahead of the looped projections.)

:func:`rmsnorm` is the final norm alone, for callers that want the hidden state rather than logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cosyvoice_fast.kernels.pdl import pdl_start
from cosyvoice_fast.llm.kernels.qwen2_pieces import normed_gemm
from cosyvoice_fast.llm.kernels.qwen2_proj import (
    TILES, Tiles, dot_precision, k_block, launch_options, normed_options, row_block,
)


@triton.jit
def _head_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, ss_ptr, B, K: tl.constexpr, N, eps, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
                 NT: tl.constexpr, NTP: tl.constexpr):
    """Program (column block, row block): ``out[b, n] = float(round(norm(x[b]) @ W[n, :]^T + bias[n]))``."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    bias = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)  # a weight: read before the wait
    rows, rmask, acc, _ = normed_gemm(x_ptr, nw_ptr, w_ptr, cols, cols, cmask, B, K, eps, BLOCK_M, BLOCK_K, PREC,
                                      PDL, PAIR=False, ss_ptr=ss_ptr, NT=NT, NTP=NTP)
    y = (acc + bias[None, :]).to(w_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program: ``w * (x * rsqrt(mean(x^2) + eps))`` rounded to ``out``'s dtype (x: the fp32
    residual)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    kmask = k < N
    x = tl.load(x_ptr + row * N + k, mask=kmask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + k, mask=kmask, other=0.0)
    tl.store(out_ptr + row * N + k, ((x * rstd).to(w.dtype) * w).to(out_ptr.dtype.element_ty), mask=kmask)


def head(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
         eps: float, sums: torch.Tensor | None = None, tiles: Tiles = TILES) -> None:
    """out (B, N) fp32 <- ``linear(rmsnorm(x), w, b)`` rounded to the weight dtype, for any number of rows of
    the fp32 residual ``x`` (B, K): the values of :func:`~.qwen2_gemv.head` (which takes 1..``gemv_rows``) up to
    fp32 summation order.  ``sums``: the residual's per-tile sums of squares for the norm statistics (see
    :func:`~.qwen2_proj.qkv_rope`); None: a pass over each row."""
    rows, k_dim, n = check_head(x, w, b, out)
    bm, bn = row_block(rows), tiles.head
    grid = (triton.cdiv(n, bn), triton.cdiv(rows, bm))
    _head_kernel[grid](x, norm_w, w, b, out, x if sums is None else sums, rows, k_dim, n, eps, BLOCK_M=bm,
                       BLOCK_N=bn, BLOCK_K=k_block(k_dim, w.dtype, bm, tiles), PREC=dot_precision(w.dtype),
                       **normed_options(x, sums, tiles))


def check_head(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple[int, int, int]:
    """``(rows, K, N)`` of a head call, or a ValueError naming the shapes a (B, K) residual needs."""
    rows, k_dim = x.shape
    n = w.shape[0]
    if w.shape != (n, k_dim) or b.shape != (n,) or out.shape != (rows, n) or out.dtype != torch.float32:
        raise ValueError(f"head: weight ({n}, {k_dim}), bias ({n},) and a ({rows}, {n}) float32 output expected, got "
                         f"{tuple(w.shape)}, {tuple(b.shape)}, {tuple(out.shape)} {out.dtype}")
    return rows, k_dim, n


def rmsnorm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """out (B, N) <- RMSNorm(x) with weight ``w``; ``x`` the fp32 residual."""
    rows, n = x.shape
    _rmsnorm_kernel[(rows,)](x, w, out, n, eps, BLOCK=triton.next_power_of_2(n), **launch_options(x, 1))
