"""Decode attention of a Qwen2 step over a slot's KV cache, split over keys, merged in the same kernel.

Why split over keys: at decode each row has one query per head, so a kernel per (row, kv head) would run 2
programs for one row and read the whole context serially.  Instead ``SPLITS`` programs per (row, kv head) each
take an even share of the row's *own* filled prefix (``min(pos + 1, kv_len)`` keys, read at run time, so a row
early in its utterance reads only what it wrote; positions past it are never touched) and keep an online
softmax: unnormalised output, running max and sum per query head.  GQA: the ``Hq / Hkv`` query heads sharing a
kv head are the query rows of one program, so each K/V tile is loaded once for all of them.

The merge (``exp(m_s - max)``-weighted sum of the splits over the summed weights) needs no kernel of its own:
each program writes its partials, then bumps a per-(row, kv head) counter; the program that arrives last merges
all splits of its group, writes the normalised output in the model dtype and puts the counter back to zero for
the next layer (and the next graph replay).  The counters must start at zero (one memset per step).  Partials
are re-read past L1 (``.cg``) because the same scratch serves every layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cosyvoice_fast.kernels.pdl import pdl_start
from cosyvoice_fast.llm.kernels.qwen2_proj import TILES, Tiles, dot_precision, launch_options


@triton.jit
def kv_tile_math(q, k, v, allowed, scale, m, l_sum, acc, PREC: tl.constexpr):
    """One loaded key/value tile of an online softmax: scores of ``q`` against ``k``, ``allowed`` (broadcast
    to the scores) masking the rest; returns the updated running max, sum and unnormalised output."""
    sc = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    sc = tl.where(allowed, sc, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(sc - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_sum, acc


@triton.jit
def kv_tile_step(q, kc_ptr, vc_ptr, off, smask, allowed, scale, m, l_sum, acc, PREC: tl.constexpr):
    """:func:`kv_tile_math` over the keys and values at ``off`` (rows ``smask``).  Shared by the decode splits
    and the prefill's causal blocks."""
    k = tl.load(kc_ptr + off, mask=smask[:, None], other=0.0)
    v = tl.load(vc_ptr + off, mask=smask[:, None], other=0.0)
    return kv_tile_math(q, k, v, allowed, scale, m, l_sum, acc, PREC)


@triton.jit
def _attn_split_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, out_ptr, o_ptr, m_ptr, l_ptr, cnt_ptr, kv_len, scale,
                       stride_cb, stride_ch, stride_cp,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                       QB: tl.constexpr, RB: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr,
                       PDL: tl.constexpr):
    """Program (row, kv head, split): attention of the row's ``Hq / Hkv`` query heads over one key range.

    Before its PDL wait it reads the row's position and the first key/value tile of its range, all but this
    step's own key: only that one (at ``pos``) is written by the kernel before (the q/k/v kernel), earlier
    positions by earlier steps.  So after the wait the first tile costs one round trip for q and the new key
    instead of one for the position and another for the tile."""
    REP: tl.constexpr = HQ // HKV
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sid = tl.program_id(2)
    i = tl.arange(0, QB)
    imask = i < REP
    heads = kvh * REP + i
    dd = tl.arange(0, D)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    n_keys = tl.minimum(pos + 1, kv_len)
    chunk = (n_keys + SPLITS - 1) // SPLITS
    start = sid * chunk
    end = tl.minimum(start + chunk, n_keys)
    base = b * stride_cb + kvh * stride_ch
    s = start + tl.arange(0, BLOCK_S)
    tile0 = base + s[:, None] * stride_cp + dd[None, :]
    smask = s < end
    old = (smask & (s != pos))[:, None]
    k = tl.load(kc_ptr + tile0, mask=old, other=0.0)
    v = tl.load(vc_ptr + tile0, mask=old, other=0.0)
    pdl_start(PDL)
    q = tl.load(q_ptr + b * (HQ * D) + heads[:, None] * D + dd[None, :], mask=imask[:, None], other=0.0)
    new = (smask & (s == pos))[:, None]
    k = tl.where(new, tl.load(kc_ptr + tile0, mask=new, other=0.0), k)
    v = tl.where(new, tl.load(vc_ptr + tile0, mask=new, other=0.0), v)
    m = tl.full([QB], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([QB], dtype=tl.float32)
    acc = tl.zeros([QB, D], dtype=tl.float32)
    if start < end:  # an empty range (more splits than keys) leaves its partials empty, as the loop did
        m, l_sum, acc = kv_tile_math(q, k, v, smask[None, :], scale, m, l_sum, acc, PREC)
    for s0 in range(start + BLOCK_S, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < end
        m, l_sum, acc = kv_tile_step(q, kc_ptr, vc_ptr, base + s[:, None] * stride_cp + dd[None, :], smask,
                                     smask[None, :], scale, m, l_sum, acc, PREC)
    out_rows = out_ptr + b * (HQ * D) + heads[:, None] * D + dd[None, :]
    if SPLITS == 1:
        tl.store(out_rows, (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=imask[:, None])
    else:
        part = (b * HQ + heads) * SPLITS + sid
        tl.store(o_ptr + part[:, None] * D + dd[None, :], acc, mask=imask[:, None])
        tl.store(m_ptr + part, m, mask=imask)
        tl.store(l_ptr + part, l_sum, mask=imask)
        tl.debug_barrier()  # every thread's partials are issued before the release below
        arrived = tl.atomic_add(cnt_ptr + b * HKV + kvh, 1, sem="acq_rel")
        if arrived == SPLITS - 1:  # the last split of this (row, kv head): merge them all
            r = tl.arange(0, RB)
            rmask = r < REP
            first = (b * HQ + kvh * REP + r) * SPLITS
            sp = tl.arange(0, SPLITS)
            ml = first[:, None] + sp[None, :]
            mm = tl.load(m_ptr + ml, mask=rmask[:, None], other=0.0, cache_modifier=".cg")
            wt = tl.exp(mm - tl.max(mm, axis=1)[:, None])  # split 0 is never empty: the max is finite
            den = tl.sum(wt * tl.load(l_ptr + ml, mask=rmask[:, None], other=1.0, cache_modifier=".cg"), axis=1)
            oo = tl.load(o_ptr + ml[:, :, None] * D + dd[None, None, :], mask=rmask[:, None, None], other=0.0,
                         cache_modifier=".cg")
            merged = tl.sum(oo * wt[:, :, None], axis=1) / den[:, None]
            dst = out_ptr + b * (HQ * D) + (kvh * REP + r)[:, None] * D + dd[None, :]
            tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
            tl.atomic_xchg(cnt_ptr + b * HKV + kvh, 0)


def attention_splits(rows: int, n_kv: int, tiles: Tiles = TILES) -> int:
    """Key splits per (row, kv head): about ``Tiles.attn_programs`` programs in all, at most 16, so few rows
    still fill the GPU with attention programs while many rows do not pay a merge per split (power of two: it
    is a tile dimension)."""
    target = max(1, tiles.attn_programs // (rows * n_kv))
    return min(16, 1 << (target.bit_length() - 1))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     kv_len: int, out: torch.Tensor, o_part: torch.Tensor, m_part: torch.Tensor,
                     l_part: torch.Tensor, counters: torch.Tensor, tiles: Tiles = TILES) -> None:
    """``out`` (B, Hq, D) <- softmax attention of q (B, Hq, D) over cache rows 0..B-1, positions
    ``< min(pos[b] + 1, kv_len)``.  Scratch: ``o_part`` (B, Hq, S, D), ``m_part``/``l_part`` (B, Hq, S) fp32 with
    S the split count, ``counters`` (B, Hkv) int32, zero on entry and on return."""
    rows, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    splits = o_part.shape[2]
    rep = n_heads // n_kv
    _attn_split_kernel[(rows, n_kv, splits)](
        q, k_cache, v_cache, pos, out, o_part, m_part, l_part, counters, kv_len, head_dim ** -0.5,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HQ=n_heads, HKV=n_kv, D=head_dim, SPLITS=splits, QB=max(16, triton.next_power_of_2(rep)),
        RB=triton.next_power_of_2(rep), BLOCK_S=tiles.attn_keys, PREC=dot_precision(q.dtype),
        **launch_options(q, 2))
