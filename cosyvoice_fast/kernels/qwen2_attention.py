"""Decode attention of a Qwen2 step over a slot's KV cache, split over keys, and the o-projection that merges
the splits and adds the residual.

Why split over keys: at decode each row has one query per head, so a kernel per (row, kv head) would run 2
programs for one row and read the whole context serially.  Instead ``SPLITS`` programs per (row, kv head) each
take an even share of the row's *own* filled prefix (``min(pos + 1, kv_len)`` keys, read at run time, so a row
early in its utterance reads only what it wrote; positions past it are never touched) and keep an online
softmax: unnormalised output, running max and sum per query head.  GQA: the ``Hq / Hkv`` query heads sharing a
kv head are the query rows of one program, so each K/V tile is loaded once for all of them.

The merge (``exp(m_s - max)``-weighted sum of the splits over the summed weights) is the o-projection's
prologue rather than its own kernel: the o-projection needs every head of a row anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import qwen2_proj
from .qwen2_proj import dot_precision, row_block


@triton.jit
def _attn_split_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, kv_len, scale,
                       stride_cb, stride_ch, stride_cp,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                       QB: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr):
    """Program (row, kv head, split): partial attention of the row's ``Hq / Hkv`` query heads over one key range."""
    REP: tl.constexpr = HQ // HKV
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sid = tl.program_id(2)
    i = tl.arange(0, QB)
    imask = i < REP
    heads = kvh * REP + i
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + b * (HQ * D) + heads[:, None] * D + dd[None, :], mask=imask[:, None], other=0.0)
    n_keys = tl.minimum(tl.load(pos_ptr + b).to(tl.int32) + 1, kv_len)
    chunk = (n_keys + SPLITS - 1) // SPLITS
    start = sid * chunk
    end = tl.minimum(start + chunk, n_keys)
    m = tl.full([QB], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([QB], dtype=tl.float32)
    acc = tl.zeros([QB, D], dtype=tl.float32)
    base = b * stride_cb + kvh * stride_ch
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < end
        off = base + s[:, None] * stride_cp + dd[None, :]
        k = tl.load(kc_ptr + off, mask=smask[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        sc = tl.where(smask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + off, mask=smask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    part = (b * HQ + heads) * SPLITS + sid
    tl.store(o_ptr + part[:, None] * D + dd[None, :], acc, mask=imask[:, None])
    tl.store(m_ptr + part, m, mask=imask)
    tl.store(l_ptr + part, l_sum, mask=imask)


@triton.jit
def _oproj_residual_kernel(o_ptr, m_ptr, l_ptr, w_ptr, r_ptr, B, N,
                           HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """``r[:, n] += merge(splits) @ Wo[n, :]^T``: K runs head by head, each head's splits merged on load."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < B
    sp = tl.arange(0, SPLITS)
    dd = tl.arange(0, D)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in range(HQ):
        head_part = (rows * HQ + h) * SPLITS
        mx = tl.max(tl.load(m_ptr + head_part[:, None] + sp[None, :], mask=rmask[:, None], other=0.0), axis=1)
        num = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        den = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s in range(SPLITS):  # split 0 is never empty, so mx is finite and empty splits weigh exp(-inf) = 0
            wt = tl.exp(tl.load(m_ptr + head_part + s, mask=rmask, other=0.0) - mx)
            den += wt * tl.load(l_ptr + head_part + s, mask=rmask, other=1.0)
            o = tl.load(o_ptr + (head_part + s)[:, None] * D + dd[None, :], mask=rmask[:, None], other=0.0)
            num += wt[:, None] * o
        w = tl.load(w_ptr + cols[None, :] * (HQ * D) + (h * D + dd)[:, None], mask=cmask[None, :], other=0.0)
        acc = tl.dot((num / den[:, None]).to(w.dtype), w, acc, input_precision=PREC)
    ptrs = r_ptr + rows[:, None] * N + cols[None, :]
    m2 = rmask[:, None] & cmask[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=m2, other=0.0) + acc, mask=m2)


def attention_splits(rows: int, n_kv: int) -> int:
    """Key splits per (row, kv head): ~64 programs in all, at most 16, so one row fills the GPU with
    attention programs while many rows do not pay a merge per split (power of two: it is a tile dimension)."""
    target = max(1, 64 // (rows * n_kv))
    return min(16, 1 << (target.bit_length() - 1))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     kv_len: int, o_part: torch.Tensor, m_part: torch.Tensor, l_part: torch.Tensor) -> None:
    """Split attention partials of q (B, Hq, D) over cache rows 0..B-1 (positions ``< min(pos[b] + 1, kv_len)``)
    into ``o_part`` (B, Hq, S, D), ``m_part``/``l_part`` (B, Hq, S), all fp32."""
    rows, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    splits = o_part.shape[2]
    rep = n_heads // n_kv
    _attn_split_kernel[(rows, n_kv, splits)](
        q, k_cache, v_cache, pos, o_part, m_part, l_part, kv_len, head_dim ** -0.5,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HQ=n_heads, HKV=n_kv, D=head_dim, SPLITS=splits, QB=max(16, triton.next_power_of_2(rep)),
        BLOCK_S=qwen2_proj.TILES.attn_keys, PREC=dot_precision(q.dtype), num_warps=4, num_stages=2)


def oproj_residual(o_part: torch.Tensor, m_part: torch.Tensor, l_part: torch.Tensor, w: torch.Tensor,
                   resid: torch.Tensor) -> None:
    """resid (B, N) fp32 += merged attention (B, Hq*D) @ Wo^T with ``w`` (N, Hq*D)."""
    rows, n_heads, splits, head_dim = o_part.shape
    n = w.shape[0]
    bm, bn = row_block(rows), qwen2_proj.TILES.oproj
    _oproj_residual_kernel[(triton.cdiv(n, bn), triton.cdiv(rows, bm))](
        o_part, m_part, l_part, w, resid, rows, n, HQ=n_heads, D=head_dim, SPLITS=splits, BLOCK_M=bm,
        BLOCK_N=bn, PREC=dot_precision(w.dtype), num_warps=4, num_stages=2)
