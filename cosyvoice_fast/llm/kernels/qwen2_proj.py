"""Weight-streaming projections of a Qwen2 decode step: q/k/v (+ RMSNorm, RoPE, KV write), gate/up (+ RMSNorm,
SiLU*mul), o and down (+ residual).  The step's end (final RMSNorm, speech head) is :mod:`.qwen2_head`.

Why these shapes: at decode a row is one token, so every projection reads its whole weight once per step and
does ~1 FLOP per weight byte: the kernels are weight-bandwidth kernels.  Each program owns a slice of output
columns and *all* rows of the step (``BLOCK_M`` = 16..64 rows padded, one ``tl.dot`` per K tile), so a weight
byte crosses the memory bus once however many rows step together (1..64); more than 64 rows add row blocks.
Everything that would otherwise be its own kernel rides in the prologue or epilogue of one of these:

- RMSNorm: each program gets its rows' ``rsqrt(mean(x^2) + eps)`` (recomputing beats a launch), then normalises
  each K tile as it is loaded.  The statistics come from a pass over the fp32 residual rows (the first layer's
  norm), or (every later norm) from the per-column-tile sums of squares that the o- or down projection left
  when it finished the residual: a few KiB instead of the whole rows per program (:mod:`.qwen2_pieces`);
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
  that arrives last sums the partials and then applies bias, RoPE and the stores.  gate/up is not split: it
  already has ~1 program per SM, and measured slower split.

K tiles are ``Tiles.k_bytes`` of each weight row (128 bf16 / 64 fp32 elements), pipelined with cp.async: a
few stages in flight per program, ~2 programs per SM for the big matrices, and small enough shared memory that
the 152 gate/up programs fit on an H100's 132 SMs in one wave.  Each program loads its first weight tile before
the programmatic-dependent-launch wait (weights never depend on the previous kernel).  The pass over the rows is
unrolled (the hidden size is a compile-time constant) so all of a row's loads issue at once; a loop over K tiles
measured no faster.

Accumulation is fp32 everywhere; fp32 weights use IEEE products (no TF32) so fp32 runs match eager to ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cosyvoice_fast.kernels.pdl import pdl_options, pdl_start
from cosyvoice_fast.llm.kernels.qwen2_pieces import (
    normed_gemm, rope_inputs, rope_store, split_add, split_pair, w_tile,
)

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
    k_bytes: int = 256  # bytes of one weight row per K tile (128 bf16 elements: ~54 KB of smem per gate/up program)
    gemv_rows: int = 2  # steps of up to this many rows take the weight-prefetch GEMV kernels of .qwen2_gemv
    head: int = 32  # output columns per program of the looped steps' speech head
    norm_warps: int = 4  # warps of the looped kernels with the RMSNorm prologue (q/k/v, gate/up, speech head)
    gemv_cols: int = 8  # output columns per program of the GEMV kernels (gate/up, down, speech head)
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
        for name in ("down_split", "qkv_split"):
            if not 1 <= getattr(self, name) <= 16:
                raise ValueError(f"Tiles.{name} must be 1..16, got {getattr(self, name)}")
        if self.norm_warps not in (2, 4, 8, 16):
            raise ValueError(f"Tiles.norm_warps must be 2, 4, 8 or 16, got {self.norm_warps!r}")


#: the GPU tuning every launcher takes by default (a benchmark builds another ``Tiles`` and passes it in)
TILES = Tiles()


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _qkv_rope_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, freq_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, part_ptr, cnt_ptr,
                     ss_ptr, B, K: tl.constexpr, eps, stride_cb, stride_ch, stride_cp,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                     PDL: tl.constexpr, SPLIT_K: tl.constexpr, NT: tl.constexpr, NTP: tl.constexpr):
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
                                          BLOCK_K, PREC, PDL, SPLIT_K=SPLIT_K, ss_ptr=ss_ptr, NT=NT, NTP=NTP)
    if SPLIT_K > 1:
        acc1, acc2, last = split_pair(acc1, acc2, part_ptr, cnt_ptr, rows, rmask, col1, col2, dmask, B,
                                      (HQ + 2 * HKV) * D, SPLIT_K)
        rmask = tl.where(last, rmask, False)
    b1, b2, freq, pos = rope_inputs(head, d, dmask, rows, rmask, b_ptr, freq_ptr, pos_ptr, D)
    rope_store(acc1, acc2, head, d, dmask, rows, rmask, b1, b2, freq, pos, q_ptr, kc_ptr, vc_ptr,
               stride_cb, stride_ch, stride_cp, HQ, HKV, D)


@triton.jit
def _gate_up_kernel(x_ptr, nw_ptr, w_ptr, h_ptr, ss_ptr, B, K: tl.constexpr, N: tl.constexpr, eps,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                    PDL: tl.constexpr, NT: tl.constexpr, NTP: tl.constexpr):
    """``h = silu(gate(norm(x))) * up(norm(x))`` for columns ``n`` (gate rows n, up rows N + n of the fused weight)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    rows, rmask, acc_g, acc_u = normed_gemm(x_ptr, nw_ptr, w_ptr, cols, cols + N, cmask, B, K, eps, BLOCK_M,
                                            BLOCK_K, PREC, PDL, ss_ptr=ss_ptr, NT=NT, NTP=NTP)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + rows[:, None] * N + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _proj_residual_kernel(a_ptr, w_ptr, r_ptr, part_ptr, cnt_ptr, ss_ptr, B, K, N, SPLIT_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                          PDL: tl.constexpr, SUMS: tl.constexpr):
    """``r[:, n] += a @ W[n, :]^T`` for columns ``n``, over K split ``program_id(2)`` (see :func:`split_add`)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    sid = tl.program_id(2)
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_end = tl.minimum(sid * chunk + chunk, K)
    k = sid * chunk + tl.arange(0, BLOCK_K)
    w = w_tile(w_ptr, cols, cmask, k, K, k_end)  # weights never depend on the previous kernel: before the wait
    pdl_start(PDL)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k[None, :] < k_end), other=0.0)
    acc = tl.dot(a, w, input_precision=PREC)
    for k0 in range(sid * chunk + BLOCK_K, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & (k[None, :] < k_end), other=0.0)
        acc = tl.dot(a, w_tile(w_ptr, cols, cmask, k, K, k_end), acc, input_precision=PREC)
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    split_add(acc, r_ptr, part_ptr, cnt_ptr, tile, rows, rmask, cols, cmask, B, N, SPLIT_K, ss_ptr, SUMS)


# ------------------------------------------------------------------------------------------ launchers


def row_block(rows: int) -> int:
    """Rows per program: all of them up to 64 (tl.dot needs >= 16), so weights stream once per step."""
    return min(MAX_ROW_BLOCK, max(16, triton.next_power_of_2(rows)))


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 products for fp32 weights (TF32 would cost ~1e-3 of parity); tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def normed_options(t: torch.Tensor, sums: torch.Tensor | None, tiles: Tiles) -> dict:
    """:func:`launch_options` of the looped kernels with the RMSNorm prologue (:func:`normed_gemm`): their warp
    count (``Tiles.norm_warps``) and the (tiles, B) sums of squares to take the statistics from (``sums``;
    None: a pass over each row)."""
    if sums is not None and (sums.dim() != 2 or sums.shape[1] != t.shape[0] or sums.dtype != torch.float32):
        raise ValueError(f"norm sums: a float32 (tiles, {t.shape[0]}) buffer expected, got {tuple(sums.shape)} "
                         f"{sums.dtype}")
    nt = 0 if sums is None else sums.shape[0]
    return {**launch_options(t, 3), "num_warps": tiles.norm_warps, "NT": nt,
            "NTP": triton.next_power_of_2(max(nt, 1))}


def launch_options(t: torch.Tensor, stages: int) -> dict:
    """Launch keywords shared by the fused kernels: PDL (a kernel launches while the previous one drains) on
    CUDA tensors; the interpreter has none."""
    return {**pdl_options(True, t), "num_warps": 4, "num_stages": stages}


def k_block(k: int, dtype: torch.dtype, block_m: int = 16, tiles: Tiles = TILES) -> int:
    """K elements per tile: ``Tiles.k_bytes`` of a weight row, halved for 64-row blocks, whose fp32 residual
    tiles (in the norm-statistics pass and the GEMM, each pipelined over 3 stages) would otherwise need more
    than the H100's 227 KB of shared memory per program (352 KB measured for the q/k/v kernel)."""
    elems = tiles.k_bytes // torch.empty((), dtype=dtype).element_size()
    if block_m > 32:
        elems //= 2
    return max(16, min(elems, triton.next_power_of_2(k)))


def qkv_tiles(rows: int, n_heads: int, n_kv: int, head_dim: int, tiles: Tiles = TILES) -> int:
    """Programs of one K split of :func:`qkv_rope` (the split counters it needs)."""
    return ((n_heads + 2 * n_kv) * triton.cdiv(head_dim // 2, _qkv_block(head_dim, tiles))
            * triton.cdiv(rows, row_block(rows)))


def _qkv_block(head_dim: int, tiles: Tiles) -> int:
    return max(16, min(tiles.qkv, head_dim // 2))


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
             counters: torch.Tensor | None = None, sums: torch.Tensor | None = None, tiles: Tiles = TILES) -> None:
    """q (B, Hq, D) <- RoPE(norm(x) Wq + bq); cache rows b at ``pos[b]`` <- RoPE(k), v.  ``x``: the fp32 (B, K)
    residual.  With ``parts`` (S, B, (Hq + 2 Hkv) D) fp32 scratch and ``counters`` (>= :func:`qkv_tiles`) int32
    zeros, K is split S ways (see :func:`split_pair`).  ``sums``: the (tiles, B) sums of squares the residual's
    last writer left (:func:`proj_residual`), for the norm statistics; None: a pass over each row."""
    rows, k_dim = x.shape
    half = head_dim // 2
    if half < 1 or half & (half - 1):
        raise ValueError(f"head_dim {head_dim}: the fused kernels need a power-of-two head_dim >= 2")
    block_n, bm = _qkv_block(head_dim, tiles), row_block(rows)
    split = _split_scratch(parts, counters, rows, w.shape[0], qkv_tiles(rows, n_heads, n_kv, head_dim, tiles),
                           "qkv_rope")
    grid = ((n_heads + 2 * n_kv) * triton.cdiv(half, block_n), triton.cdiv(rows, bm), split)
    _qkv_rope_kernel[grid](x, norm_w, w, b, inv_freq, pos, q_out, k_cache, v_cache,
                           x if parts is None else parts, x if counters is None else counters,
                           x if sums is None else sums, rows, k_dim, eps,
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                           HQ=n_heads, HKV=n_kv, D=head_dim, BLOCK_N=block_n, BLOCK_M=bm,
                           BLOCK_K=k_block(k_dim, w.dtype, bm, tiles), PREC=dot_precision(w.dtype), SPLIT_K=split,
                           **normed_options(x, sums, tiles))


def gate_up(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, h_out: torch.Tensor, eps: float,
            sums: torch.Tensor | None = None, tiles: Tiles = TILES) -> None:
    """h (B, I) <- silu(norm(x) Wg) * (norm(x) Wu) with ``w`` the fused (2I, K) gate/up weight.  ``sums``: as
    in :func:`qkv_rope`."""
    rows, k_dim = x.shape
    n = w.shape[0] // 2
    bm, bn = row_block(rows), tiles.gate_up
    grid = (triton.cdiv(n, bn), triton.cdiv(rows, bm))
    _gate_up_kernel[grid](x, norm_w, w, h_out, x if sums is None else sums, rows, k_dim, n, eps, BLOCK_M=bm,
                          BLOCK_N=bn, BLOCK_K=k_block(k_dim, w.dtype, bm, tiles), PREC=dot_precision(w.dtype),
                          **normed_options(x, sums, tiles))


def proj_residual(a: torch.Tensor, w: torch.Tensor, resid: torch.Tensor, parts: torch.Tensor | None = None,
                  counters: torch.Tensor | None = None, block_n: int = 16, sums: torch.Tensor | None = None,
                  tiles: Tiles = TILES) -> None:
    """resid (B, N) fp32 += a (B, K) @ w (N, K)^T.  With ``parts`` (S, B, N) fp32 scratch and ``counters``
    (>= column blocks x row blocks) int32 zeros, K is split S ways (see :func:`split_add`).  With ``sums``
    (N / block_n, B) fp32, each column block's sums of squares of the new residual land there, for the next
    norm (:func:`qkv_rope`, :func:`gate_up`, :func:`.qwen2_head.head`)."""
    rows, k_dim = a.shape
    n = w.shape[0]
    bm = row_block(rows)
    split = _split_scratch(parts, counters, rows, n, triton.cdiv(n, block_n) * triton.cdiv(rows, bm),
                           "proj_residual")
    if sums is not None and (sums.shape != (triton.cdiv(n, block_n), rows) or sums.dtype != torch.float32):
        raise ValueError(f"proj_residual: sums of squares need a float32 ({triton.cdiv(n, block_n)}, {rows}) "
                         f"buffer, got {tuple(sums.shape)} {sums.dtype}")
    grid = (triton.cdiv(n, block_n), triton.cdiv(rows, bm), split)
    _proj_residual_kernel[grid](a, w, resid, resid if parts is None else parts,
                                resid if counters is None else counters, resid if sums is None else sums, rows,
                                k_dim, n, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=block_n,
                                BLOCK_K=k_block(k_dim, w.dtype, bm, tiles), PREC=dot_precision(w.dtype),
                                SUMS=sums is not None, **launch_options(a, 3))
