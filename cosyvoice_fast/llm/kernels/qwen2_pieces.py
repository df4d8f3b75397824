"""Triton device functions shared by the decode projections (:mod:`.qwen2_proj`, :mod:`.qwen2_gemv`,
:mod:`.qwen2_head`, :mod:`.qwen2_hybrid`): the RMSNorm prologue, the RoPE and KV-cache epilogue, and the
reductions of a projection split over K.

The norm prologue gets each row's ``rsqrt(mean(x^2) + eps)`` one of two ways.  A pass over the fp32 residual
rows (:func:`row_rstd`): every program of every normed kernel reads its rows whole, ~57 KB of L2 reads per program
at 16 rows of CosyVoice2-0.5B.  Or, where the residual's last writer (the o- or down projection, through
:func:`split_add`) left the sums of squares of each column tile it finished, from those (:func:`sums_rstd`): a
(tiles, rows) read of a few KiB.  The split reductions are deterministic: partials are added in split order by
whichever split arrives last, no atomics on data.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cosyvoice_fast.kernels.pdl import pdl_start


@triton.jit
def _resid_tile(x_ptr, rows, rmask, k, K):
    """fp32 residual tile ``x[rows, k]``."""
    return tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k[None, :] < K), other=0.0
                   ).to(tl.float32)


@triton.jit
def row_rstd(x_ptr, rows, rmask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` of residual rows ``rows``.  Unrolled (K is a constexpr), all of a row's
    loads issue at once, though the whole (BLOCK_M, K) fp32 block is live in registers (a loop over K tiles,
    one tile live and the loads in sequence, measured no faster)."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        x = _resid_tile(x_ptr, rows, rmask, k0 + tl.arange(0, BLOCK_K), K)
        ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def sums_rstd(ss_ptr, rows, rmask, B, K, eps, NT: tl.constexpr, NTP: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` of rows ``rows`` from the (NT, B) sums of squares that the residual's last
    writer left per column tile (:func:`split_add`), added in tile order."""
    t = tl.arange(0, NTP)  # NT rounded up to a power of two
    ss = tl.load(ss_ptr + t[:, None] * B + rows[None, :], mask=(t[:, None] < NT) & rmask[None, :], other=0.0)
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _normed_tile(x_ptr, rows, rmask, k, K, rstd, nw_ptr):
    """A (BLOCK_M, BLOCK_K) tile of ``RMSNorm(x)`` in the norm weight's dtype: normalise in fp32, round, then
    scale (the reference order)."""
    x = _resid_tile(x_ptr, rows, rmask, k, K)
    nw = tl.load(nw_ptr + k, mask=k < K, other=0.0)
    return (x * rstd[:, None]).to(nw.dtype) * nw[None, :]


@triton.jit
def rotate_store(x1, x2, head, d, dmask, rows, rmask, pos, crow, freq, q_ptr, kc_ptr, vc_ptr,
                 stride_cb, stride_ch, stride_cp, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    """fp32 columns ``d`` and ``d + D/2`` of one q, k or v head for ``rows``: RoPE on q and k heads (half-split
    pairing: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin; v heads do not rotate), then q to its scratch rows
    and k/v into cache rows ``crow`` at positions ``pos``.  ``freq``: the rotary frequencies of columns ``d``."""
    HALF: tl.constexpr = D // 2
    rot = head < HQ + HKV
    ang = pos.to(tl.float32)[:, None] * freq[None, :]
    c = tl.where(rot, tl.cos(ang), 1.0)
    s = tl.where(rot, tl.sin(ang), 0.0)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    m2 = rmask[:, None] & dmask[None, :]
    if head < HQ:
        base = q_ptr + rows[:, None] * (HQ * D) + head * D + d[None, :]
        tl.store(base, o1.to(q_ptr.dtype.element_ty), mask=m2)
        tl.store(base + HALF, o2.to(q_ptr.dtype.element_ty), mask=m2)
    else:
        kvh = head - HQ
        c_ptr = kc_ptr
        if head >= HQ + HKV:
            kvh = head - HQ - HKV
            c_ptr = vc_ptr
        off = crow[:, None] * stride_cb + kvh * stride_ch + pos[:, None] * stride_cp + d[None, :]
        tl.store(c_ptr + off, o1.to(kc_ptr.dtype.element_ty), mask=m2)
        tl.store(c_ptr + off + HALF, o2.to(kc_ptr.dtype.element_ty), mask=m2)


@triton.jit
def rope_inputs(head, d, dmask, rows, rmask, b_ptr, freq_ptr, pos_ptr, D: tl.constexpr):
    """What the q/k/v epilogue reads besides the products: the bias of columns ``d`` and ``d + D/2`` of
    ``head`` (fp32), their rotary frequencies and each row's position.  None of it is written by the kernel
    before, so the GEMV kernel loads it ahead of its PDL wait."""
    HALF: tl.constexpr = D // 2
    col1 = head * D + d
    b1 = tl.load(b_ptr + col1, mask=dmask, other=0.0).to(tl.float32)
    b2 = tl.load(b_ptr + col1 + HALF, mask=dmask, other=0.0).to(tl.float32)
    freq = tl.load(freq_ptr + d, mask=dmask, other=0.0)
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    return b1, b2, freq, pos


@triton.jit
def rope_store(acc1, acc2, head, d, dmask, rows, rmask, b1, b2, freq, pos, q_ptr, kc_ptr, vc_ptr,
               stride_cb, stride_ch, stride_cp, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    """The q/k/v epilogue of a decode step: bias, then :func:`rotate_store` with each row's own position and
    cache row (``b1``, ``b2``, ``freq``, ``pos`` from :func:`rope_inputs`)."""
    rotate_store(acc1 + b1[None, :], acc2 + b2[None, :], head, d, dmask, rows, rmask, pos, rows, freq, q_ptr,
                 kc_ptr, vc_ptr, stride_cb, stride_ch, stride_cp, HQ, HKV, D)


@triton.jit
def _store_sums(ss_ptr, r, m2, rows, rmask, B, SUMS: tl.constexpr):
    """With ``SUMS``: the sums of squares of the finished residual tile ``r`` over its columns, at row ``rows`` of
    column tile ``program_id(0)`` of the (tiles, B) buffer the next norm reads (:func:`sums_rstd`)."""
    if SUMS:
        sq = tl.where(m2, r * r, 0.0)
        tl.store(ss_ptr + tl.program_id(0) * B + rows, tl.sum(sq, axis=1), mask=rmask)


@triton.jit
def split_add(acc, r_ptr, part_ptr, cnt_ptr, tile, rows, rmask, cols, cmask, B, N, SPLIT_K: tl.constexpr,
              ss_ptr=None, SUMS: tl.constexpr = False):
    """``r[rows, cols] += acc`` for a projection split over K (split ``program_id(2)``): one split adds directly;
    with several, each stores its fp32 partial and bumps the tile's counter, and the last to arrive adds every
    partial in split order (deterministic) and resets the counter to zero for the next layer and replay.
    With ``SUMS`` the writer of the finished tile also leaves its sums of squares (:func:`_store_sums`)."""
    m2 = rmask[:, None] & cmask[None, :]
    off = rows[:, None] * N + cols[None, :]
    if SPLIT_K == 1:
        r = tl.load(r_ptr + off, mask=m2, other=0.0) + acc
        tl.store(r_ptr + off, r, mask=m2)
        _store_sums(ss_ptr, r, m2, rows, rmask, B, SUMS)
    else:
        sid = tl.program_id(2)
        tl.store(part_ptr + sid * B * N + off, acc, mask=m2)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.load(part_ptr + off, mask=m2, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(part_ptr + s * B * N + off, mask=m2, other=0.0, cache_modifier=".cg")
            r = tl.load(r_ptr + off, mask=m2, other=0.0) + total
            tl.store(r_ptr + off, r, mask=m2)
            _store_sums(ss_ptr, r, m2, rows, rmask, B, SUMS)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def split_pair(acc_a, acc_b, part_ptr, cnt_ptr, rows, rmask, cols_a, cols_b, cmask, B, N: tl.constexpr,
               SPLIT_K: tl.constexpr):
    """The two sums of :func:`normed_gemm` split over K (split ``program_id(2)``), as :func:`split_add` does it:
    each split stores its fp32 partials at columns ``cols_a``/``cols_b`` of a (S, B, N) scratch and bumps its
    tile's counter.  Returns ``(sum_a, sum_b, last)``: ``last`` is true only in the split that arrived last,
    whose sums add every partial in split order (deterministic) and which puts the counter back to zero; the
    caller masks its epilogue's stores with it."""
    sid = tl.program_id(2)
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    m2 = rmask[:, None] & cmask[None, :]
    off_a = rows[:, None] * N + cols_a[None, :]
    off_b = rows[:, None] * N + cols_b[None, :]
    tl.store(part_ptr + sid * B * N + off_a, acc_a, mask=m2)
    tl.store(part_ptr + sid * B * N + off_b, acc_b, mask=m2)
    tl.debug_barrier()  # every thread's partial is issued before the release below
    last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    ml = tl.where(last, m2, False)  # (not m2 & last: the interpreter's stores refuse that mask)
    sum_a = tl.load(part_ptr + off_a, mask=ml, other=0.0, cache_modifier=".cg")
    sum_b = tl.load(part_ptr + off_b, mask=ml, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        sum_a += tl.load(part_ptr + s * B * N + off_a, mask=ml, other=0.0, cache_modifier=".cg")
        sum_b += tl.load(part_ptr + s * B * N + off_b, mask=ml, other=0.0, cache_modifier=".cg")
    if last:
        tl.atomic_xchg(cnt_ptr + tile, 0)
    return sum_a, sum_b, last


@triton.jit
def w_tile(w_ptr, cols, cmask, k, K, k_end):
    """Weight rows ``cols`` of a (N, K) row-major matrix, K tile ``k`` (< ``k_end``), as a (BLOCK_K, BLOCK_N)
    operand."""
    return tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=cmask[None, :] & (k[:, None] < k_end), other=0.0)


@triton.jit
def normed_gemm(x_ptr, nw_ptr, w_ptr, cols_a, cols_b, cmask, B, K: tl.constexpr, eps,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
                PAIR: tl.constexpr = True,
                SPLIT_K: tl.constexpr = 1, ss_ptr=None, NT: tl.constexpr = 0, NTP: tl.constexpr = 1):
    """``RMSNorm(x) @ W[cols_a]^T`` and ``@ W[cols_b]^T`` for this program's row block (``program_id(1)``):
    the q/k/v kernel's rotation pair and the gate/up kernel's two halves (without ``PAIR`` only ``cols_a``: the
    speech head, :mod:`.qwen2_head`).  The first K tile of the weights is loaded before the PDL wait (weights
    never depend on the previous kernel, so that load overlaps the kernel before).  With ``SPLIT_K`` > 1
    the program multiplies only its split's K range (``program_id(2)``; the norm statistics still cover the
    whole row).  With ``NT`` > 0 the statistics come from the ``NT`` per-tile sums of squares at ``ss_ptr``
    (:func:`sums_rstd`) instead of a pass over the row.  Returns ``(rows, row mask, acc_a, acc_b)`` with fp32
    accumulators (``acc_b`` is meaningless without ``PAIR``)."""
    CHUNK: tl.constexpr = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    k_lo = tl.program_id(2) * CHUNK if SPLIT_K > 1 else 0
    k_hi = tl.minimum(k_lo + CHUNK, K) if SPLIT_K > 1 else K
    k = k_lo + tl.arange(0, BLOCK_K)
    wa = w_tile(w_ptr, cols_a, cmask, k, K, k_hi)
    if PAIR:
        wb = w_tile(w_ptr, cols_b, cmask, k, K, k_hi)
    pdl_start(PDL)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    if NT > 0:
        rstd = sums_rstd(ss_ptr, rows, rmask, B, K, eps, NT, NTP)
    else:
        rstd = row_rstd(x_ptr, rows, rmask, K, eps, BLOCK_M, BLOCK_K)
    xn = _normed_tile(x_ptr, rows, rmask, k, K, rstd, nw_ptr)
    acc_a = tl.dot(xn, wa, input_precision=PREC)
    acc_b = acc_a
    if PAIR:
        acc_b = tl.dot(xn, wb, input_precision=PREC)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xn = _normed_tile(x_ptr, rows, rmask, k, K, rstd, nw_ptr)
        acc_a = tl.dot(xn, w_tile(w_ptr, cols_a, cmask, k, K, k_hi), acc_a, input_precision=PREC)
        if PAIR:
            acc_b = tl.dot(xn, w_tile(w_ptr, cols_b, cmask, k, K, k_hi), acc_b, input_precision=PREC)
    return rows, rmask, acc_a, acc_b
