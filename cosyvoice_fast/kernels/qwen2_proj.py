"""Weight-streaming projections of a Qwen2 decode step: q/k/v (+ RMSNorm, RoPE, KV write), gate/up (+ RMSNorm,
SiLU*mul), o and down (+ residual).  The step's end (final RMSNorm, speech head) is :mod:`.qwen2_head`.

Why these shapes: at decode a row is one token, so every projection reads its whole weight once per step and
does ~1 FLOP per weight byte: the kernels are weight-bandwidth kernels.  Each program owns a slice of output
columns and *all* rows of the step (``BLOCK_M`` = 16..64 rows padded, one ``tl.dot`` per K tile), so a weight
byte crosses the memory bus once however many rows step together (1..64); more than 64 rows add row blocks.
Everything that would otherwise be its own kernel rides in the prologue or epilogue of one of these:

- RMSNorm: each program recomputes its rows' ``rsqrt(mean(x^2) + eps)`` from the fp32 residual (a hidden row is
  a few KiB; recomputing beats a launch), then normalises each K tile as it is loaded;
- RoPE and the KV-cache write: a q/k/v program owns column pairs ``(d, d + D/2)`` of one head, exactly the pairs
  the half-split rotation mixes, so it rotates in registers and stores q to a scratch buffer, k/v straight into
  the cache row at the row's own position;
- SiLU*mul: a gate/up program owns the same columns of gate and up;
- residuals: the residual stream stays fp32 in one (rows, H) buffer.  The o-projection adds into it.  The down
  projection (the largest matrix, but only H = 896 output columns) is split over K as well, so one row's weight
  stream has enough programs in flight; each split writes an fp32 partial sum to a (S, rows, H) scratch and bumps
  a per-tile counter, and the split that arrives last adds all partials to the residual in split order and puts
  the counter back to zero (the attention's merge, :mod:`.qwen2_attention`, works the same way).  Deterministic,
  no atomics on data, no extra kernel, and every reader sees one finished fp32 residual row.
- the q/k/v projection is small (~2 MB) and has few column programs (36 at CosyVoice2-0.5B's 18 heads), each
  walking all of K in sequence; split over K the same way (``Tiles.qkv_split``, :func:`split_pair`), the split
  that arrives last sums the partials and then applies bias, RoPE and the stores.  Each split recomputes the
  whole row's norm statistics.  gate/up can split too (``Tiles.gate_up_split``) but already has ~1 program per
  SM, so its default stays one.

K tiles are ``Tiles.k_bytes`` of each weight row (128 bf16 / 64 fp32 elements), pipelined with cp.async: a
few stages in flight per program, ~2 programs per SM for the big matrices, and small enough shared memory that
the 152 gate/up programs fit on an H100's 132 SMs in one wave.  The norm pre-pass is unrolled (the hidden size is
a compile-time constant) so all of a row's loads issue at once.

Accumulation is fp32 everywhere; fp32 weights use IEEE products (no TF32) so fp32 runs match eager to ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, pdl_start

MAX_ROW_BLOCK = 64


@dataclass(frozen=True, slots=True)
class Tiles:
    """Output columns per program of each projection (and keys per attention tile).  Narrow tiles give one
    row's weight stream many programs (~1 per SM or more for the big matrices); ``tl.dot`` needs >= 16."""

    qkv: int = 16  # per half-head: a program owns 2 x qkv columns of one head (capped at head_dim / 2)
    oproj: int = 16
    gate_up: int = 32  # of gate and of up each
    down: int = 16
    attn_keys: int = 32
    attn_programs: int = 512  # decode attention programs to aim for (key splits = this / (rows x kv heads))
    down_split: int = 4  # K splits of the down projection (partial sums, see the module docstring)
    qkv_split: int = 4  # K splits of the looped q/k/v projection (its last split applies bias, RoPE and stores)
    gate_up_split: int = 1  # K splits of the looped gate/up projection (its last split applies SiLU*mul)
    pdl: bool = True  # programmatic dependent launch: a kernel launches while the previous one drains (CUDA only)
    k_bytes: int = 256  # bytes of one weight row per K tile (128 bf16 elements: ~54 KB of smem per gate/up program)
    early_tile: bool = True  # the looped projections load their first weight tile before the PDL wait
    gemv: bool = True  # steps of up to gemv_rows rows take the weight-prefetch GEMV kernels of .qwen2_gemv
    gemv_rows: int = 2  # the most rows a GEMV step takes (each program multiplies its weights by each row in turn)
    gemv_head: bool = True  # a GEMV step gathers its embeddings and applies norm + speech head in its own kernels
    looped_head: bool = True  # a looped step ends in one norm + speech head kernel (.qwen2_head; not cuBLAS steps)
    head: int = 32  # output columns per program of the looped steps' speech head
    norm_warps: int = 4  # warps of the looped kernels with the RMSNorm prologue (q/k/v, gate/up, speech head)
    rolled_norm: bool = False  # their norm-statistics pass as a loop over K tiles instead of unrolled
    gemv_cols: int = 8  # output columns per program of those kernels (gate/up, down)
    gemv_small_cols: int = 4  # the same for q/k/v (per half-head) and the o-projection: ~2 MB matrices
    down_chunk: int = 512  # K elements per split of their down projection
    cublas_rows: int = 32  # steps of at least this many rows take cuBLAS GEMMs (.qwen2_hybrid); 0: never

    def __post_init__(self) -> None:
        for name in ("qkv", "oproj", "gate_up", "down", "head", "attn_keys", "k_bytes", "down_chunk",
                     "attn_programs"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {v}")
        for name in ("gemv_cols", "gemv_small_cols"):
            v = getattr(self, name)
            if not 1 <= v <= 64 or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two in 1..64, got {v}")
        if not 1 <= self.gemv_rows <= 16:
            raise ValueError(f"Tiles.gemv_rows must be 1..16, got {self.gemv_rows}")
        if not isinstance(self.cublas_rows, int) or not 0 <= self.cublas_rows <= 1024:
            raise ValueError(f"Tiles.cublas_rows must be an int in 0..1024 (0: never), got {self.cublas_rows!r}")
        for name in ("down_split", "qkv_split", "gate_up_split"):
            if not 1 <= getattr(self, name) <= 16:
                raise ValueError(f"Tiles.{name} must be 1..16, got {getattr(self, name)}")
        if self.norm_warps not in (2, 4, 8, 16):
            raise ValueError(f"Tiles.norm_warps must be 2, 4, 8 or 16, got {self.norm_warps!r}")
        for name in ("pdl", "early_tile", "gemv", "gemv_head", "looped_head", "rolled_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Tiles.{name} must be True or False, got {getattr(self, name)!r}")


TILES = Tiles()  # what the launchers use (read at each launch, so a benchmark can swap it)


# ------------------------------------------------------------------------------------------ shared pieces


@triton.jit
def _resid_tile(x_ptr, rows, rmask, k, K):
    """fp32 residual tile ``x[rows, k]``."""
    return tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k[None, :] < K), other=0.0
                   ).to(tl.float32)


@triton.jit
def _row_rstd(x_ptr, rows, rmask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              ROLLED: tl.constexpr = False):
    """``1 / sqrt(mean(x^2) + eps)`` of residual rows ``rows``.  Unrolled (K is a constexpr), all of a row's
    loads issue at once, but the whole (BLOCK_M, K) fp32 block is live in registers; ``ROLLED`` loops over K
    tiles instead (one tile live, the loads in sequence)."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ROLLED:
        for k0 in range(0, K, BLOCK_K):
            x = _resid_tile(x_ptr, rows, rmask, k0 + tl.arange(0, BLOCK_K), K)
            ss += tl.sum(x * x, axis=1)
    else:
        for k0 in tl.static_range(0, K, BLOCK_K):
            x = _resid_tile(x_ptr, rows, rmask, k0 + tl.arange(0, BLOCK_K), K)
            ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


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
def split_add(acc, r_ptr, part_ptr, cnt_ptr, tile, rows, rmask, cols, cmask, B, N, SPLIT_K: tl.constexpr):
    """``r[rows, cols] += acc`` for a projection split over K (split ``program_id(2)``): one split adds directly;
    with several, each stores its fp32 partial and bumps the tile's counter, and the last to arrive adds every
    partial in split order (deterministic) and resets the counter to zero for the next layer and replay."""
    m2 = rmask[:, None] & cmask[None, :]
    off = rows[:, None] * N + cols[None, :]
    if SPLIT_K == 1:
        tl.store(r_ptr + off, tl.load(r_ptr + off, mask=m2, other=0.0) + acc, mask=m2)
    else:
        sid = tl.program_id(2)
        tl.store(part_ptr + sid * B * N + off, acc, mask=m2)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.load(part_ptr + off, mask=m2, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(part_ptr + s * B * N + off, mask=m2, other=0.0, cache_modifier=".cg")
            tl.store(r_ptr + off, tl.load(r_ptr + off, mask=m2, other=0.0) + total, mask=m2)
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
def _w_tile(w_ptr, cols, cmask, k, K, k_end):
    """Weight rows ``cols`` of a (N, K) row-major matrix, K tile ``k`` (< ``k_end``), as a (BLOCK_K, BLOCK_N)
    operand."""
    return tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=cmask[None, :] & (k[:, None] < k_end), other=0.0)


@triton.jit
def normed_gemm(x_ptr, nw_ptr, w_ptr, cols_a, cols_b, cmask, B, K: tl.constexpr, eps,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
                EARLY: tl.constexpr, PAIR: tl.constexpr = True, ROLLED: tl.constexpr = False,
                SPLIT_K: tl.constexpr = 1):
    """``RMSNorm(x) @ W[cols_a]^T`` and ``@ W[cols_b]^T`` for this program's row block (``program_id(1)``):
    the q/k/v kernel's rotation pair and the gate/up kernel's two halves (without ``PAIR`` only ``cols_a``: the
    speech head, :mod:`.qwen2_head`).  With ``EARLY`` the first K tile of the weights is loaded before the PDL
    wait (weights never depend on the previous kernel); ``ROLLED``: see :func:`_row_rstd`.  With ``SPLIT_K`` > 1
    the program multiplies only its split's K range (``program_id(2)``; the norm statistics still cover the
    whole row).  Returns ``(rows, row mask, acc_a, acc_b)`` with fp32 accumulators (``acc_b`` is meaningless
    without ``PAIR``)."""
    CHUNK: tl.constexpr = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    k_lo = tl.program_id(2) * CHUNK if SPLIT_K > 1 else 0
    k_hi = tl.minimum(k_lo + CHUNK, K) if SPLIT_K > 1 else K
    k = k_lo + tl.arange(0, BLOCK_K)
    if not EARLY:
        pdl_start(PDL)
    wa = _w_tile(w_ptr, cols_a, cmask, k, K, k_hi)
    if PAIR:
        wb = _w_tile(w_ptr, cols_b, cmask, k, K, k_hi)
    if EARLY:
        pdl_start(PDL)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    rstd = _row_rstd(x_ptr, rows, rmask, K, eps, BLOCK_M, BLOCK_K, ROLLED)
    xn = _normed_tile(x_ptr, rows, rmask, k, K, rstd, nw_ptr)
    acc_a = tl.dot(xn, wa, input_precision=PREC)
    acc_b = acc_a
    if PAIR:
        acc_b = tl.dot(xn, wb, input_precision=PREC)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xn = _normed_tile(x_ptr, rows, rmask, k, K, rstd, nw_ptr)
        acc_a = tl.dot(xn, _w_tile(w_ptr, cols_a, cmask, k, K, k_hi), acc_a, input_precision=PREC)
        if PAIR:
            acc_b = tl.dot(xn, _w_tile(w_ptr, cols_b, cmask, k, K, k_hi), acc_b, input_precision=PREC)
    return rows, rmask, acc_a, acc_b


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _qkv_rope_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, freq_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, part_ptr, cnt_ptr,
                     B, K: tl.constexpr, eps, stride_cb, stride_ch, stride_cp,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                     PDL: tl.constexpr, EARLY: tl.constexpr, ROLLED: tl.constexpr, SPLIT_K: tl.constexpr):
    """Program (column block, row block, K split): columns ``d`` and ``d + D/2`` of one q, k or v head."""
    HALF: tl.constexpr = D // 2
    NB: tl.constexpr = (HALF + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    head = pid // NB
    d = (pid % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
    dmask = d < HALF  # all true unless head_dim / 2 < 16 (test-sized models): tl.dot needs 16 columns
    col1 = head * D + d
    col2 = col1 + HALF
    rows, rmask, acc1, acc2 = normed_gemm(x_ptr, nw_ptr, w_ptr, col1, col2, dmask, B, K, eps, BLOCK_M,
                                          BLOCK_K, PREC, PDL, EARLY, ROLLED=ROLLED, SPLIT_K=SPLIT_K)
    if SPLIT_K > 1:
        acc1, acc2, last = split_pair(acc1, acc2, part_ptr, cnt_ptr, rows, rmask, col1, col2, dmask, B,
                                      (HQ + 2 * HKV) * D, SPLIT_K)
        rmask = tl.where(last, rmask, False)
    b1, b2, freq, pos = rope_inputs(head, d, dmask, rows, rmask, b_ptr, freq_ptr, pos_ptr, D)
    rope_store(acc1, acc2, head, d, dmask, rows, rmask, b1, b2, freq, pos, q_ptr, kc_ptr, vc_ptr,
               stride_cb, stride_ch, stride_cp, HQ, HKV, D)


@triton.jit
def _gate_up_kernel(x_ptr, nw_ptr, w_ptr, h_ptr, part_ptr, cnt_ptr, B, K: tl.constexpr, N: tl.constexpr, eps,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                    PDL: tl.constexpr, EARLY: tl.constexpr, ROLLED: tl.constexpr, SPLIT_K: tl.constexpr):
    """``h = silu(gate(norm(x))) * up(norm(x))`` for columns ``n`` (gate rows n, up rows N + n of the fused weight)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    rows, rmask, acc_g, acc_u = normed_gemm(x_ptr, nw_ptr, w_ptr, cols, cols + N, cmask, B, K, eps, BLOCK_M,
                                            BLOCK_K, PREC, PDL, EARLY, ROLLED=ROLLED, SPLIT_K=SPLIT_K)
    if SPLIT_K > 1:
        acc_g, acc_u, last = split_pair(acc_g, acc_u, part_ptr, cnt_ptr, rows, rmask, cols, cols + N, cmask, B,
                                        2 * N, SPLIT_K)
        rmask = tl.where(last, rmask, False)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + rows[:, None] * N + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _proj_residual_kernel(a_ptr, w_ptr, r_ptr, part_ptr, cnt_ptr, B, K, N, SPLIT_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                          PDL: tl.constexpr, EARLY: tl.constexpr):
    """``r[:, n] += a @ W[n, :]^T`` for columns ``n``, over K split ``program_id(2)`` (see :func:`split_add`)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    sid = tl.program_id(2)
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_end = tl.minimum(sid * chunk + chunk, K)
    k = sid * chunk + tl.arange(0, BLOCK_K)
    if not EARLY:
        pdl_start(PDL)
    w = _w_tile(w_ptr, cols, cmask, k, K, k_end)
    if EARLY:
        pdl_start(PDL)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k[None, :] < k_end), other=0.0)
    acc = tl.dot(a, w, input_precision=PREC)
    for k0 in range(sid * chunk + BLOCK_K, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k[None, :] < k_end), other=0.0)
        acc = tl.dot(a, _w_tile(w_ptr, cols, cmask, k, K, k_end), acc, input_precision=PREC)
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    split_add(acc, r_ptr, part_ptr, cnt_ptr, tile, rows, rmask, cols, cmask, B, N, SPLIT_K)


# ------------------------------------------------------------------------------------------ launchers


def row_block(rows: int) -> int:
    """Rows per program: all of them up to 64 (tl.dot needs >= 16), so weights stream once per step."""
    return min(MAX_ROW_BLOCK, max(16, triton.next_power_of_2(rows)))


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 products for fp32 weights (TF32 would cost ~1e-3 of parity); tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def looped_options(t: torch.Tensor) -> dict:
    """:func:`launch_options` of the looped projections, plus whether their first weight tile loads before the
    PDL wait (``Tiles.early_tile``)."""
    return {**launch_options(t, 3), "EARLY": TILES.early_tile}


def normed_options(t: torch.Tensor) -> dict:
    """:func:`looped_options` of the looped kernels with the RMSNorm prologue (:func:`normed_gemm`): their warp
    count and norm pass (``Tiles.norm_warps``, ``Tiles.rolled_norm``)."""
    return {**looped_options(t), "num_warps": TILES.norm_warps, "ROLLED": TILES.rolled_norm}


def launch_options(t: torch.Tensor, stages: int) -> dict:
    """Launch keywords shared by the fused kernels: PDL only on CUDA tensors (the interpreter has none)."""
    return {**pdl_options(TILES.pdl, t), "num_warps": 4, "num_stages": stages}


def k_block(k: int, dtype: torch.dtype, block_m: int = 16) -> int:
    """K elements per tile: ``TILES.k_bytes`` of a weight row, halved for 64-row blocks, whose fp32 residual
    tiles (in the norm-statistics pass and the GEMM, each pipelined over 3 stages) would otherwise need more
    than the H100's 227 KB of shared memory per program (352 KB measured for the q/k/v kernel)."""
    elems = TILES.k_bytes // torch.empty((), dtype=dtype).element_size()
    if block_m > 32:
        elems //= 2
    return max(16, min(elems, triton.next_power_of_2(k)))


def qkv_tiles(rows: int, n_heads: int, n_kv: int, head_dim: int) -> int:
    """Programs of one K split of :func:`qkv_rope` (the split counters it needs)."""
    return (n_heads + 2 * n_kv) * triton.cdiv(head_dim // 2, _qkv_block(head_dim)) * triton.cdiv(rows, row_block(rows))


def gate_up_tiles(rows: int, inter: int) -> int:
    """Programs of one K split of :func:`gate_up` (the split counters it needs)."""
    return triton.cdiv(inter, TILES.gate_up) * triton.cdiv(rows, row_block(rows))


def _qkv_block(head_dim: int) -> int:
    return max(16, min(TILES.qkv, head_dim // 2))


def _split_scratch(parts: torch.Tensor | None, counters: torch.Tensor | None, rows: int, n: int, tiles: int,
                   what: str) -> int:
    """The K splits that ``parts`` (S, rows, n) fp32 gives (1 without), or a ValueError naming what is missing."""
    split = 1 if parts is None else parts.shape[0]
    if split > 1 and (parts.shape[1:] != (rows, n) or parts.dtype != torch.float32 or counters is None
                      or counters.numel() < tiles):
        raise ValueError(f"{what}: a {split}-way K split needs float32 parts ({split}, {rows}, {n}) and {tiles} "
                         f"counters, got {tuple(parts.shape)} {parts.dtype} and "
                         f"{None if counters is None else counters.numel()}")
    return split


def qkv_rope(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, b: torch.Tensor, inv_freq: torch.Tensor,
             pos: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
             n_heads: int, n_kv: int, head_dim: int, parts: torch.Tensor | None = None,
             counters: torch.Tensor | None = None) -> None:
    """q (B, Hq, D) <- RoPE(norm(x) Wq + bq); cache rows b at ``pos[b]`` <- RoPE(k), v.  ``x``: the fp32 (B, K)
    residual.  With ``parts`` (S, B, (Hq + 2 Hkv) D) fp32 scratch and ``counters`` (>= :func:`qkv_tiles`) int32
    zeros, K is split S ways (see :func:`split_pair`)."""
    rows, k_dim = x.shape
    half = head_dim // 2
    if half < 1 or half & (half - 1):
        raise ValueError(f"head_dim {head_dim}: the fused kernels need a power-of-two head_dim >= 2")
    block_n, bm = _qkv_block(head_dim), row_block(rows)
    split = _split_scratch(parts, counters, rows, w.shape[0], qkv_tiles(rows, n_heads, n_kv, head_dim), "qkv_rope")
    grid = ((n_heads + 2 * n_kv) * triton.cdiv(half, block_n), triton.cdiv(rows, bm), split)
    _qkv_rope_kernel[grid](x, norm_w, w, b, inv_freq, pos, q_out, k_cache, v_cache,
                           x if parts is None else parts, x if counters is None else counters, rows, k_dim, eps,
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                           HQ=n_heads, HKV=n_kv, D=head_dim, BLOCK_N=block_n, BLOCK_M=bm,
                           BLOCK_K=k_block(k_dim, w.dtype, bm), PREC=dot_precision(w.dtype), SPLIT_K=split,
                           **normed_options(x))


def gate_up(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, h_out: torch.Tensor, eps: float,
            parts: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> None:
    """h (B, I) <- silu(norm(x) Wg) * (norm(x) Wu) with ``w`` the fused (2I, K) gate/up weight.  With ``parts``
    (S, B, 2I) fp32 scratch and ``counters`` (>= :func:`gate_up_tiles`) int32 zeros, K is split S ways."""
    rows, k_dim = x.shape
    n = w.shape[0] // 2
    bm, bn = row_block(rows), TILES.gate_up
    split = _split_scratch(parts, counters, rows, 2 * n, gate_up_tiles(rows, n), "gate_up")
    grid = (triton.cdiv(n, bn), triton.cdiv(rows, bm), split)
    _gate_up_kernel[grid](x, norm_w, w, h_out, x if parts is None else parts, x if counters is None else counters,
                          rows, k_dim, n, eps, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=k_block(k_dim, w.dtype, bm),
                          PREC=dot_precision(w.dtype), SPLIT_K=split, **normed_options(x))


def proj_residual(a: torch.Tensor, w: torch.Tensor, resid: torch.Tensor, parts: torch.Tensor | None = None,
                  counters: torch.Tensor | None = None, block_n: int = 16) -> None:
    """resid (B, N) fp32 += a (B, K) @ w (N, K)^T.  With ``parts`` (S, B, N) fp32 scratch and ``counters``
    (>= column blocks x row blocks) int32 zeros, K is split S ways (see :func:`split_add`)."""
    rows, k_dim = a.shape
    n = w.shape[0]
    bm = row_block(rows)
    split = 1 if parts is None else parts.shape[0]
    tiles = triton.cdiv(n, block_n) * triton.cdiv(rows, bm)
    if split > 1 and (parts.shape[1:] != (rows, n) or counters is None or counters.numel() < tiles):
        raise ValueError(f"proj_residual: a {split}-way K split needs parts ({split}, {rows}, {n}) and {tiles} "
                         f"counters, got {tuple(parts.shape)} and {None if counters is None else counters.numel()}")
    grid = (triton.cdiv(n, block_n), triton.cdiv(rows, bm), split)
    _proj_residual_kernel[grid](a, w, resid, resid if parts is None else parts,
                                resid if counters is None else counters, rows, k_dim, n, SPLIT_K=split,
                                BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=k_block(k_dim, w.dtype, bm),
                                PREC=dot_precision(w.dtype), **looped_options(a))
