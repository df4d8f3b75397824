"""Decode projections for steps of one or two rows (one or two streams decoding): each program loads its whole
weight slice *before* it waits for the previous kernel, and multiplies without tensor cores.

Why: at one row a decode step is a chain of ~120 kernels that each read a few MB of weights and do almost no
arithmetic.  The looped kernels of :mod:`.qwen2_proj` start streaming weights only once the kernel before them
has finished (programmatic dependent launch lets them launch early, but their first load sits behind the wait),
so every link of the chain pays a full memory latency plus its own stream, and ``tl.dot`` pads the one row to
16.  Weights never depend on the previous kernel, so here a program loads all of its weight columns (every K at
once, ``(cols, next_pow2(K))`` with the tail masked) at launch, then waits (``gdc_wait``), and only then reads
the activations it needs: the weight stream of kernel *n + 1* overlaps kernel *n*.  The same holds for every other
read that kernel *n* does not write: norm weights, the q/k/v bias, rotary frequencies and positions, and the
residual the o-projection adds to (last written two kernels back; in a PDL chain a kernel's prologue runs only
once the kernel before it has passed its own wait, so everything earlier has finished).  Each of those, read
after the wait, was one more memory round trip on the step's critical path.  The row is multiplied by a
broadcast-and-sum in fp32.  Each program holds its slice in registers, so slices are narrow (``Tiles.gemv_cols``
columns; ``Tiles.gemv_small_cols`` for the ~2 MB q/k/v and o-projection matrices, which at 8 columns a program
would leave SMs idle) and the down projection is split over K in ``Tiles.down_chunk`` pieces whose partial sums
the last split adds (:func:`~.qwen2_pieces.split_add`).  The same whole-K tiles through ``tl.dot`` for 2..16 rows
spilled and ran three times slower than the looped kernels on an H100.

A program multiplies its weight slice by each row of the step in turn (broadcast-and-sum per row), so a row's
result does not depend on how many rows share the step.  That per-row work grows with the rows while the
weight stream does not: on an H100 two rows still beat the looped kernels and four no longer do, hence
``Tiles.gemv_rows`` = 2 (a sweep of 1..16 rows on an H100).

Same numerics as the looped kernels: RMSNorm in fp32, rounded to the weight dtype before the product, fp32
products and accumulation, fp32 residual stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cosyvoice_fast.kernels.pdl import pdl_start
from cosyvoice_fast.llm.kernels.qwen2_head import check_head
from cosyvoice_fast.llm.kernels.qwen2_pieces import rope_inputs, rope_store, split_add
from cosyvoice_fast.llm.kernels.qwen2_proj import TILES, Tiles, launch_options


@triton.jit
def _w_slice(w_ptr, cols, cmask, k0, K, KP: tl.constexpr):
    """Weight rows ``cols`` of a (N, K) row-major matrix, elements ``k0 .. min(k0 + KP, K)``: (cols, KP)."""
    k = k0 + tl.arange(0, KP)
    return tl.load(w_ptr + cols[:, None] * K + k[None, :], mask=cmask[:, None] & (k[None, :] < K), other=0.0)


@triton.jit
def _norm_weight(nw_ptr, K, KP: tl.constexpr):
    """The RMSNorm weight as (KP,), zeros past K: a weight, so the kernels load it before their PDL wait (after
    it, its load would only be issued once the row's sum of squares is reduced: one more memory round trip on
    the step's critical path)."""
    k = tl.arange(0, KP)
    return tl.load(nw_ptr + k, mask=k < K, other=0.0)


@triton.jit
def _normed_row(x_ptr, nw, K, eps, valid, KP: tl.constexpr):
    """``RMSNorm(x)`` of the fp32 residual row as (1, KP), rounded to the norm weight's dtype then scaled by
    ``nw`` (:func:`_norm_weight`); zeros where ``valid``, (1,) bool, is false: a padding row of the program's
    row block."""
    k = tl.arange(0, KP)
    x = tl.load(x_ptr + k, mask=(k < K) & valid, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    return ((x * rstd).to(nw.dtype) * nw)[None, :]


@triton.jit
def _live(r, B):
    """(1,) bool: whether row ``r`` of the program's row block is one of the step's ``B`` rows (a tensor, not a
    scalar, so that it combines with load and store masks under the interpreter too)."""
    return (tl.arange(0, 1) + r) < B


@triton.jit
def _times_wt(a, w):
    """``a (1, KP) @ w (N, KP)^T`` as (1, N): fp32 products summed in fp32."""
    return tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _qkv_gemv_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, freq_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, B, K, eps,
                     stride_cb, stride_ch, stride_cp, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """Program: columns ``d`` and ``d + D/2`` of one q, k or v head, for each of the ``B`` rows in turn."""
    HALF: tl.constexpr = D // 2
    NB: tl.constexpr = (HALF + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    head = pid // NB
    d = (pid % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
    dmask = d < HALF
    col1 = head * D + d
    w1 = _w_slice(w_ptr, col1, dmask, 0, K, KP)
    w2 = _w_slice(w_ptr, col1 + HALF, dmask, 0, K, KP)
    nw = _norm_weight(nw_ptr, K, KP)
    rows = tl.arange(0, ROWS)
    b1, b2, freq, pos = rope_inputs(head, d, dmask, rows, rows < B, b_ptr, freq_ptr, pos_ptr, D)
    pdl_start(PDL)
    acc1 = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for r in tl.static_range(ROWS):
        xn = _normed_row(x_ptr + r * K, nw, K, eps, _live(r, B), KP)
        acc1 = tl.where(rows[:, None] == r, _times_wt(xn, w1), acc1)
        acc2 = tl.where(rows[:, None] == r, _times_wt(xn, w2), acc2)
    rope_store(acc1, acc2, head, d, dmask, rows, rows < B, b1, b2, freq, pos, q_ptr, kc_ptr, vc_ptr,
               stride_cb, stride_ch, stride_cp, HQ, HKV, D)


@triton.jit
def _gate_up_gemv_kernel(x_ptr, nw_ptr, w_ptr, h_ptr, B, K, N, eps, BLOCK_N: tl.constexpr, KP: tl.constexpr,
                         ROWS: tl.constexpr, PDL: tl.constexpr):
    """``h = silu(gate(norm(x))) * up(norm(x))`` for columns ``n`` (gate rows n, up rows N + n) of each row."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    wg = _w_slice(w_ptr, cols, cmask, 0, K, KP)
    wu = _w_slice(w_ptr, cols + N, cmask, 0, K, KP)
    nw = _norm_weight(nw_ptr, K, KP)
    pdl_start(PDL)
    for r in tl.static_range(ROWS):
        live = _live(r, B)
        xn = _normed_row(x_ptr + r * K, nw, K, eps, live, KP)
        g = _times_wt(xn, wg)
        h = g * tl.sigmoid(g) * _times_wt(xn, wu)
        tl.store(h_ptr + r * N + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=cmask[None, :] & live[:, None])


@triton.jit
def _proj_gemv_kernel(a_ptr, w_ptr, r_ptr, part_ptr, cnt_ptr, B, K, N, SPLIT_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """``r[b, n] += a[b] @ W[n, :]^T`` for columns ``n`` of each row ``b``; program ``(i, 0, s)`` takes K
    elements ``s·KP .. (s+1)·KP`` (all of K when ``SPLIT_K`` is 1)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    k0 = tl.program_id(2) * KP
    w = _w_slice(w_ptr, cols, cmask, k0, K, KP)
    rows = tl.arange(0, ROWS)
    if SPLIT_K == 1:  # one piece (the o-projection): the residual was last written two kernels back, so read now
        r_off = rows[:, None] * N + cols[None, :]
        r_mask = (rows < B)[:, None] & cmask[None, :]
        r_old = tl.load(r_ptr + r_off, mask=r_mask, other=0.0)
    pdl_start(PDL)
    k = k0 + tl.arange(0, KP)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for r in tl.static_range(ROWS):
        a = tl.load(a_ptr + r * K + k, mask=(k < K) & _live(r, B), other=0.0)[None, :]
        acc = tl.where(rows[:, None] == r, _times_wt(a, w), acc)
    if SPLIT_K == 1:
        tl.store(r_ptr + r_off, r_old + acc, mask=r_mask)
    else:
        split_add(acc, r_ptr, part_ptr, cnt_ptr, tl.program_id(0), rows, rows < B, cols, cmask, B, N, SPLIT_K)


@triton.jit
def _head_gemv_kernel(x_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, B, K, N, eps, BLOCK_N: tl.constexpr,
                      KP: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """``out[b, n] = float(bf16(norm(x[b]) @ W[n, :]^T + bias[n]))``: the final RMSNorm and the LM head (the
    linear layer's output rounded to the weight dtype once, as a GEMM with a bias epilogue rounds it)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = _w_slice(w_ptr, cols, cmask, 0, K, KP)
    bias = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    nw = _norm_weight(nw_ptr, K, KP)
    pdl_start(PDL)
    for r in tl.static_range(ROWS):
        live = _live(r, B)
        y = _times_wt(_normed_row(x_ptr + r * K, nw, K, eps, live, KP), w) + bias
        tl.store(out_ptr + r * N + cols[None, :], y.to(w_ptr.dtype.element_ty).to(tl.float32),
                 mask=cmask[None, :] & live[:, None])


@triton.jit
def _embed_kernel(tok_ptr, table_ptr, x_ptr, cnt_ptr, K, C, KP: tl.constexpr, CP: tl.constexpr,
                  PDL: tl.constexpr):
    """Row ``b`` of the fp32 residual stream <- the embedding of token ``tok[b]``; program 0 also zeroes the
    step's ``C`` merge and split counters (one launch for what were a gather, a cast and a memset)."""
    pdl_start(PDL)
    row = tl.program_id(0)
    k = tl.arange(0, KP)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    x = tl.load(table_ptr + tok * K + k, mask=k < K, other=0.0)
    tl.store(x_ptr + row * K + k, x.to(tl.float32), mask=k < K)
    c = tl.arange(0, CP)
    tl.store(cnt_ptr + c, tl.zeros([CP], dtype=tl.int32), mask=c + row * CP < C)  # program 0 only


# ------------------------------------------------------------------------------------------ launchers


def _check_rows(rows: int, tiles: Tiles) -> int:
    """The program's row block (a power of two) for a step of ``rows`` rows, which must be 1..``Tiles.gemv_rows``."""
    most = tiles.gemv_rows
    if not 1 <= rows <= most:
        raise ValueError(f"the GEMV decode kernels take 1 to {most} rows (Tiles.gemv_rows), got {rows}; steps of "
                         "more rows use the looped kernels of qwen2_proj")
    return triton.next_power_of_2(rows)


def _cols(cols: int, tiles: Tiles, small: bool = False) -> int:
    return max(1, min(tiles.gemv_small_cols if small else tiles.gemv_cols, cols))


def qkv_rope(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, b: torch.Tensor, inv_freq: torch.Tensor,
             pos: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
             n_heads: int, n_kv: int, head_dim: int, tiles: Tiles = TILES) -> None:
    """:func:`.qwen2_proj.qkv_rope` for up to ``Tiles.gemv_rows`` rows (same arguments, same results)."""
    rows, k_dim = x.shape
    block = _check_rows(rows, tiles)
    half = head_dim // 2
    if half < 1 or half & (half - 1):
        raise ValueError(f"head_dim {head_dim}: the fused kernels need a power-of-two head_dim >= 2")
    bn = _cols(half, tiles, small=True)
    grid = ((n_heads + 2 * n_kv) * triton.cdiv(half, bn),)
    _qkv_gemv_kernel[grid](x, norm_w, w, b, inv_freq, pos, q_out, k_cache, v_cache, rows, k_dim, eps,
                           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), HQ=n_heads, HKV=n_kv,
                           D=head_dim, BLOCK_N=bn, KP=triton.next_power_of_2(k_dim), ROWS=block,
                           **launch_options(x, 1))


def gate_up(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, h_out: torch.Tensor, eps: float,
            tiles: Tiles = TILES) -> None:
    """:func:`.qwen2_proj.gate_up` for up to ``Tiles.gemv_rows`` rows."""
    rows, k_dim = x.shape
    block = _check_rows(rows, tiles)
    n = w.shape[0] // 2
    bn = _cols(n, tiles)
    _gate_up_gemv_kernel[(triton.cdiv(n, bn),)](x, norm_w, w, h_out, rows, k_dim, n, eps, BLOCK_N=bn,
                                                KP=triton.next_power_of_2(k_dim), ROWS=block,
                                                **launch_options(x, 1))


def proj_residual(a: torch.Tensor, w: torch.Tensor, resid: torch.Tensor, parts: torch.Tensor | None = None,
                  counters: torch.Tensor | None = None, tiles: Tiles = TILES) -> None:
    """resid (B, N) fp32 += a (B, K) @ w (N, K)^T for up to ``Tiles.gemv_rows`` rows.  With ``parts`` (S, B, N)
    fp32 scratch and ``counters`` (>= column blocks) int32 zeros, K is split into S = ``split_count(K)`` pieces
    of ``Tiles.down_chunk``; without, one piece of all of K, and then ``resid`` is read before the PDL wait: the
    kernel launched just before this one must not write it (in the decode step it is the attention or gate/up)."""
    rows, k_dim = a.shape
    block = _check_rows(rows, tiles)
    n = w.shape[0]
    bn = _cols(n, tiles, small=parts is None)
    if parts is None:
        split, kp = 1, triton.next_power_of_2(k_dim)
    else:
        split, kp = split_count(k_dim, tiles), tiles.down_chunk
        if parts.shape != (split, rows, n) or counters is None or counters.numel() < triton.cdiv(n, bn):
            raise ValueError(f"proj_residual: K {k_dim} in pieces of {kp} needs parts ({split}, {rows}, {n}) and "
                             f"{triton.cdiv(n, bn)} counters, got {tuple(parts.shape)} and "
                             f"{None if counters is None else counters.numel()}")
    grid = (triton.cdiv(n, bn), 1, split)
    _proj_gemv_kernel[grid](a, w, resid, resid if parts is None else parts,
                            resid if counters is None else counters, rows, k_dim, n, SPLIT_K=split, BLOCK_N=bn,
                            KP=kp, ROWS=block, **launch_options(a, 1))


def head(x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
         eps: float, tiles: Tiles = TILES) -> None:
    """out (B, N) fp32 <- the speech head over the final norm: ``linear(rmsnorm(x), w, b)`` in the weight dtype,
    as fp32, for up to ``Tiles.gemv_rows`` rows of the fp32 residual ``x`` (B, K)."""
    rows, k_dim, n = check_head(x, w, b, out)
    block = _check_rows(rows, tiles)
    bn = _cols(n, tiles)
    _head_gemv_kernel[(triton.cdiv(n, bn),)](x, norm_w, w, b, out, rows, k_dim, n, eps, BLOCK_N=bn,
                                             KP=triton.next_power_of_2(k_dim), ROWS=block, **launch_options(x, 1))


def embed(tokens: torch.Tensor, table: torch.Tensor, x: torch.Tensor, counters: torch.Tensor) -> None:
    """x (B, K) fp32 <- ``table[tokens]`` (tokens: B int64 ids, table (V, K)), and ``counters`` (int32) <- 0."""
    rows, k_dim = x.shape
    if tokens.numel() != rows or table.shape[1] != k_dim or counters.dtype != torch.int32:
        raise ValueError(f"embed: {rows} token ids, a (V, {k_dim}) table and int32 counters expected, got "
                         f"{tokens.numel()} ids, {tuple(table.shape)}, {counters.dtype}")
    c = counters.numel()
    _embed_kernel[(rows,)](tokens, table, x, counters, k_dim, c, KP=triton.next_power_of_2(k_dim),
                           CP=triton.next_power_of_2(max(c, 1)), **launch_options(x, 1))


def split_count(k_dim: int, tiles: Tiles = TILES) -> int:
    """K pieces of the GEMV down projection: ``Tiles.down_chunk`` elements each (the last one partial)."""
    return triton.cdiv(k_dim, tiles.down_chunk)
