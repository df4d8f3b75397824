"""Weight-streaming projections of a Qwen2 decode step: q/k/v (+ RMSNorm, RoPE, KV write), gate/up (+ RMSNorm,
SiLU*mul), down (+ residual), and the final RMSNorm.

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
- residuals: the residual stream stays fp32 in one (rows, H) buffer that the down and o projections add into.

Accumulation is fp32 everywhere; fp32 weights use IEEE products (no TF32) so fp32 runs match eager to ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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

    def __post_init__(self) -> None:
        for name in ("qkv", "oproj", "gate_up", "down", "attn_keys"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16, got {v}")


TILES = Tiles()  # what the launchers use (read at each launch, so a benchmark can swap it)


# ------------------------------------------------------------------------------------------ shared pieces


@triton.jit
def _row_rstd(x_ptr, rows, rmask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` of fp32 rows ``rows`` of a (B, K) contiguous buffer."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k[None, :] < K), other=0.0)
        x = x.to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _normed_tile(x_ptr, rows, rmask, k, K, rstd, nw_ptr):
    """A (BLOCK_M, BLOCK_K) tile of ``RMSNorm(x)`` in the norm weight's dtype: normalise in fp32, round, then
    scale (the reference order)."""
    kmask = k < K
    x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    nw = tl.load(nw_ptr + k, mask=kmask, other=0.0)
    return (x.to(tl.float32) * rstd[:, None]).to(nw.dtype) * nw[None, :]


@triton.jit
def _w_tile(w_ptr, cols, cmask, k, K):
    """Weight rows ``cols`` of a (N, K) row-major matrix, K tile ``k``, as a (BLOCK_K, BLOCK_N) operand."""
    return tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=cmask[None, :] & (k[:, None] < K), other=0.0)


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _qkv_rope_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, freq_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
                     B, K, eps, stride_cb, stride_ch, stride_cp,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """Program (column block, row block): columns ``d`` and ``d + D/2`` of one q, k or v head."""
    HALF: tl.constexpr = D // 2
    NB: tl.constexpr = (HALF + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    head = pid // NB
    d = (pid % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
    dmask = d < HALF  # all true unless head_dim / 2 < 16 (test-sized models): tl.dot needs 16 columns
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    rstd = _row_rstd(x_ptr, rows, rmask, K, eps, BLOCK_M, BLOCK_K)
    col1 = head * D + d
    col2 = col1 + HALF
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xn = _normed_tile(x_ptr, rows, rmask, k, K, rstd, nw_ptr)
        acc1 = tl.dot(xn, _w_tile(w_ptr, col1, dmask, k, K), acc1, input_precision=PREC)
        acc2 = tl.dot(xn, _w_tile(w_ptr, col2, dmask, k, K), acc2, input_precision=PREC)
    acc1 += tl.load(b_ptr + col1, mask=dmask, other=0.0).to(tl.float32)[None, :]
    acc2 += tl.load(b_ptr + col2, mask=dmask, other=0.0).to(tl.float32)[None, :]
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    # q and k heads rotate (half-split pairing: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin); v heads do not
    rot = head < HQ + HKV
    ang = pos.to(tl.float32)[:, None] * tl.load(freq_ptr + d, mask=dmask, other=0.0)[None, :]
    c = tl.where(rot, tl.cos(ang), 1.0)
    s = tl.where(rot, tl.sin(ang), 0.0)
    o1 = acc1 * c - acc2 * s
    o2 = acc2 * c + acc1 * s
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
        off = rows[:, None] * stride_cb + kvh * stride_ch + pos[:, None] * stride_cp + d[None, :]
        tl.store(c_ptr + off, o1.to(kc_ptr.dtype.element_ty), mask=m2)
        tl.store(c_ptr + off + HALF, o2.to(kc_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _gate_up_kernel(x_ptr, nw_ptr, w_ptr, h_ptr, B, K, N, eps,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """``h = silu(gate(norm(x))) * up(norm(x))`` for columns ``n`` (gate rows n, up rows N + n of the fused weight)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    rstd = _row_rstd(x_ptr, rows, rmask, K, eps, BLOCK_M, BLOCK_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xn = _normed_tile(x_ptr, rows, rmask, k, K, rstd, nw_ptr)
        acc_g = tl.dot(xn, _w_tile(w_ptr, cols, cmask, k, K), acc_g, input_precision=PREC)
        acc_u = tl.dot(xn, _w_tile(w_ptr, cols + N, cmask, k, K), acc_u, input_precision=PREC)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + rows[:, None] * N + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _down_residual_kernel(h_ptr, w_ptr, r_ptr, B, K, N,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """``r[:, n] += h @ W[n, :]^T`` (fp32 residual; each program owns its columns, so no two write alike)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k[None, :] < K), other=0.0)
        acc = tl.dot(a, _w_tile(w_ptr, cols, cmask, k, K), acc, input_precision=PREC)
    ptrs = r_ptr + rows[:, None] * N + cols[None, :]
    m2 = rmask[:, None] & cmask[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=m2, other=0.0) + acc, mask=m2)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr):
    """One row per program: ``w * (x * rsqrt(mean(x^2) + eps))`` rounded to ``out``'s dtype."""
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    kmask = k < N
    x = tl.load(x_ptr + row * N + k, mask=kmask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + k, mask=kmask, other=0.0)
    tl.store(out_ptr + row * N + k, ((x * rstd).to(w.dtype) * w).to(out_ptr.dtype.element_ty), mask=kmask)


# ------------------------------------------------------------------------------------------ launchers


def row_block(rows: int) -> int:
    """Rows per program: all of them up to 64 (tl.dot needs >= 16), so weights stream once per step."""
    return min(MAX_ROW_BLOCK, max(16, triton.next_power_of_2(rows)))


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 products for fp32 weights (TF32 would cost ~1e-3 of parity); tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _k_block(k: int) -> int:
    return min(128, triton.next_power_of_2(k))


def qkv_rope(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, b: torch.Tensor, inv_freq: torch.Tensor,
             pos: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
             n_heads: int, n_kv: int, head_dim: int) -> None:
    """q (B, Hq, D) <- RoPE(norm(x) Wq + bq); cache rows b at ``pos[b]`` <- RoPE(k), v.  ``x``: fp32 (B, K)."""
    rows, k_dim = x.shape
    half = head_dim // 2
    if half < 1 or half & (half - 1):
        raise ValueError(f"head_dim {head_dim}: the fused kernels need a power-of-two head_dim >= 2")
    block_n = max(16, min(TILES.qkv, half))
    bm = row_block(rows)
    grid = ((n_heads + 2 * n_kv) * triton.cdiv(half, block_n), triton.cdiv(rows, bm))
    _qkv_rope_kernel[grid](x, norm_w, w, b, inv_freq, pos, q_out, k_cache, v_cache, rows, k_dim, eps,
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                           HQ=n_heads, HKV=n_kv, D=head_dim, BLOCK_N=block_n, BLOCK_M=bm,
                           BLOCK_K=_k_block(k_dim), PREC=dot_precision(w.dtype), num_warps=4, num_stages=3)


def gate_up(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, h_out: torch.Tensor, eps: float) -> None:
    """h (B, I) <- silu(norm(x) Wg) * (norm(x) Wu) with ``w`` the fused (2I, K) gate/up weight."""
    rows, k_dim = x.shape
    n = w.shape[0] // 2
    bm, bn = row_block(rows), TILES.gate_up
    grid = (triton.cdiv(n, bn), triton.cdiv(rows, bm))
    _gate_up_kernel[grid](x, norm_w, w, h_out, rows, k_dim, n, eps, BLOCK_M=bm, BLOCK_N=bn,
                          BLOCK_K=_k_block(k_dim), PREC=dot_precision(w.dtype), num_warps=4, num_stages=3)


def down_residual(h: torch.Tensor, w: torch.Tensor, resid: torch.Tensor) -> None:
    """resid (B, N) fp32 += h (B, K) W^T with ``w`` (N, K)."""
    rows, k_dim = h.shape
    n = w.shape[0]
    bm, bn = row_block(rows), TILES.down
    grid = (triton.cdiv(n, bn), triton.cdiv(rows, bm))
    _down_residual_kernel[grid](h, w, resid, rows, k_dim, n, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=_k_block(k_dim),
                                PREC=dot_precision(w.dtype), num_warps=4, num_stages=3)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """out (B, N) <- RMSNorm(x) with weight ``w``; ``x`` fp32."""
    rows, n = x.shape
    _rmsnorm_kernel[(rows,)](x, w, out, n, eps, BLOCK=triton.next_power_of_2(n), num_warps=4)
