"""The estimator's GEMMs at many rows: cuBLAS or the tall Triton kernel for the product, the epilogue around it.

A batched solve stacks thousands of frames (16 requests x the CFG pair x 250 frames is 8000 rows), and even
one request's later chunks have several hundred (the CFG pair x 450 frames of a final chunk is 900).  There the
row-tiled GEMMs of :mod:`~cosyvoice_fast.flow.kernels.estimator_linear` (thin tiles that re-read every weight tile per
32 rows, right for a launch-bound forward of a few hundred rows) fall far behind the tensor cores, so from
``FlowTuning.many_rows_m`` rows on (16-bit weights) :func:`linear_cublas` computes ``act(prologue(X) @ W^T + bias)
(+ residual) (* rowmask)`` as: the LayerNorm prologue (``F.layer_norm``, fp32 statistics), then either

* the product on cuBLAS (``torch.mm``, fp32 accumulation, 16-bit result) and one elementwise Triton pass for
  bias, activation, residual, row mask and the strided (B, N, T) store, or
* the tall Triton kernel (:mod:`~cosyvoice_fast.flow.kernels.estimator_tall`), product and epilogue in one,

per GEMM as :func:`tall_product` says.

The LayerNorm prologue is a separate pass here (neither product takes a prologue), but in a transformer block
every residual-producing GEMM (attention out-projection, second feed-forward GEMM) is followed by a LayerNorm +
GEMM.  So the epilogue can also write the next LayerNorm of the row it stores (``norm_out``): its tile then
spans the whole row (N = channels), and the next GEMM reads the normed rows with no prologue, which saves the
LayerNorm launch and a read of the residual stream.

Numerics: on cuBLAS the product is rounded to 16 bits once before the epilogue adds bias and residual in fp32,
where the fused kernels round once after; the difference is one 16-bit rounding of the product (bf16 noise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from cosyvoice_fast.kernels.common import PRO_LN, PRO_NONE, _epilogue_store, _norm_rows_store, _pow2
from cosyvoice_fast.flow.kernels.estimator_tall import linear_tall
from cosyvoice_fast.flow.kernels.tuning import FlowTuning, default_tuning



def tall_product(act: int, residual: Tensor | None, norm_out: object | None) -> bool:
    """Whether a many-rows GEMM runs as the tall Triton kernel rather than cuBLAS + epilogue pass.

    Where the epilogue has work of its own (an activation, or a residual with no LayerNorm after
    it) the fused kernel saves the whole write and re-read of the product and wins although its product is
    slower than cuBLAS's; a plain product (q/k/v) is cuBLAS's alone, and a residual with the whole-row
    LayerNorm (few, wide tiles) measured no faster fused.  Forcing either kernel everywhere measured slower
    (all tall: 32 x 450 frames 14.2 against 12.9 ms a forward; all cuBLAS: 8 x 206 frames 2.77 against 2.65)."""
    return act != 0 or (residual is not None and norm_out is None)


def use_many_rows(m: int, weight: Tensor, prologue: int, tuning: FlowTuning | None = None) -> bool:
    """Whether a ``linear`` call of ``m`` rows takes the many-rows path: 16-bit weights, a plain or LayerNorm
    prologue, and at least ``tuning.many_rows_m`` rows."""
    return (m >= (tuning or default_tuning()).many_rows_m and weight.dtype in (torch.bfloat16, torch.float16)
            and prologue in (PRO_NONE, PRO_LN))


@triton.jit
def _epilogue_kernel(y_ptr, b_ptr, r_ptr, rowmask_ptr, out_ptr, M, N, stride_rm, rows_per_b, stride_ob,
                     stride_ot, stride_on, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
                     ROWMASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    y = tl.load(y_ptr + rm[:, None] * N + rn[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0)
    _epilogue_store(y.to(tl.float32), rm, rn, m_ok, n_ok, b_ptr, r_ptr, rowmask_ptr, out_ptr, stride_rm, rows_per_b,
                    stride_ob, stride_ot, stride_on, HAS_BIAS, ACT, HAS_RES, ROWMASK)


@triton.jit
def _epilogue_norm_kernel(y_ptr, b_ptr, r_ptr, rowmask_ptr, out_ptr, g_ptr, beta_ptr, norm_ptr, M, N,
                          stride_rm, stride_om, stride_on, stride_nm, eps, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                          HAS_RES: tl.constexpr, ROWMASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """:func:`_epilogue_kernel` for a row-major output whose rows fit one tile (``BN >= N``), which also stores
    ``LayerNorm(row as stored)`` to ``norm_ptr`` (:func:`~cosyvoice_fast.kernels.common._norm_rows_store`)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    ok = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptr + rm[:, None] * N + rn[None, :], mask=ok, other=0.0)
    h = _epilogue_store(y.to(tl.float32), rm, rn, m_ok, n_ok, b_ptr, r_ptr, rowmask_ptr, out_ptr, stride_rm, M,
                        0, stride_om, stride_on, HAS_BIAS, ACT, HAS_RES, ROWMASK)
    _norm_rows_store(h, rm, rn, m_ok, n_ok, N, g_ptr, beta_ptr, norm_ptr, stride_nm, eps)


def _launch_epilogue_norm(y: Tensor, bias: Tensor | None, act: int, residual: Tensor | None,
                          rowmask: Tensor | None, out: Tensor,
                          norm_out: tuple[Tensor, tuple[Tensor, Tensor, float]], tuning: FlowTuning) -> None:
    """The epilogue pass that also writes ``norm_out[0] = LayerNorm(out)`` with ``norm_out[1]``'s parameters.

    The LayerNorm normalises each row *as stored* (rounded to ``out``'s dtype), not the fp32 sum it was
    rounded from: the stored row is the residual stream that the following blocks add to, and the tensor an
    unfused ``F.layer_norm`` would read, so the normed rows stay the LayerNorm of that very tensor (the same
    function as without the fusion, up to the rounding of the normed value) instead of the norm of a value
    that exists nowhere else.  For fp32 outputs the rounding is the identity."""
    m, n = y.shape
    dst, (g, beta, eps) = norm_out
    bn = _pow2(n, 16)
    bm = tuning.norm_epilogue_bm or max(1, min(32, 4096 // bn))  # about 4K fp32 values per program
    _epilogue_norm_kernel[(triton.cdiv(m, bm),)](
        y, bias if bias is not None else y, residual if residual is not None else y,
        rowmask if rowmask is not None else y, out, g, beta, dst, M=m, N=n,
        stride_rm=residual.stride(0) if residual is not None else 0, stride_om=out.stride(0),
        stride_on=out.stride(1), stride_nm=dst.stride(0), eps=float(eps),
        HAS_BIAS=bias is not None, ACT=act, HAS_RES=residual is not None, ROWMASK=rowmask is not None,
        BM=bm, BN=bn, num_warps=4 if bn <= 256 else 8)


def linear_cublas(x: Tensor, weight: Tensor, bias: Tensor | None, *, prologue: int,
                  ln: tuple[Tensor, Tensor, float] | None, act: int, residual: Tensor | None,
                  rowmask: Tensor | None, out: Tensor, rows_per_b: int, out_strides: tuple[int, int, int],
                  norm_out: tuple[Tensor, tuple[Tensor, Tensor, float]] | None = None,
                  tuning: FlowTuning | None = None) -> Tensor:
    """``linear``'s contract on the many-rows path; ``out`` and its ``(batch, frame, channel)`` strides come from
    :func:`~cosyvoice_fast.flow.kernels.estimator_linear.linear`, which validated the arguments (``norm_out`` only
    with a row-major ``out``)."""
    m, k = x.shape
    n = weight.shape[0]
    t = tuning or default_tuning()
    a = x if prologue == PRO_NONE else F.layer_norm(x, (k,), ln[0], ln[1], ln[2])
    if tall_product(act, residual, norm_out):
        return linear_tall(a, weight, bias, act=act, residual=residual, rowmask=rowmask, out=out,
                           rows_per_b=rows_per_b, out_strides=out_strides, norm_out=norm_out, tuning=t)
    plain = bias is None and act == 0 and residual is None and rowmask is None and norm_out is None
    if plain and out.dim() == 2 and out.is_contiguous():
        return torch.mm(a, weight.t(), out=out)
    y = torch.mm(a, weight.t())
    if norm_out is not None:
        _launch_epilogue_norm(y, bias, act, residual, rowmask, out, norm_out, t)
        return out
    bm, bn = t.epilogue_tiles or (32, _pow2(n, 16, 128))
    _epilogue_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        y, bias if bias is not None else y, residual if residual is not None else y,
        rowmask if rowmask is not None else y, out, M=m, N=n,
        stride_rm=residual.stride(0) if residual is not None else 0, rows_per_b=rows_per_b,
        stride_ob=out_strides[0], stride_ot=out_strides[1], stride_on=out_strides[2],
        HAS_BIAS=bias is not None, ACT=act,
        HAS_RES=residual is not None, ROWMASK=rowmask is not None, BM=bm, BN=bn, num_warps=4)
    return out
