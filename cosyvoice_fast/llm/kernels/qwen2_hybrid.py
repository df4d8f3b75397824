"""Qwen2 passes with cuBLAS GEMMs and Triton kernels for everything between them: the prefill, and decode
steps of many rows.

Why: the graph-replayed prefill of the model's own decoder launches ~25 kernels per layer (RoPE in pieces, cache
writes, mask and SDPA, the SwiGLU pieces, residual adds), plus a copy per layer and cache from a scratch cache
into the slots.  A one-request prefill of ~128 positions is bound by those ~600 launches, not by its
arithmetic; at 16 requests the GEMMs take over.  The fused decode projections (:mod:`.qwen2_proj`) stream
weights from few programs per row block, which is right for one or two rows but falls behind cuBLAS as rows
grow (a decode step's weights are read once either way).  So here the four projections stay cuBLAS calls (the
residual adds ride in ``addmm``) and the glue is:

- :func:`rope_kv`: bias-added q/k/v rows -> rotated q to a scratch, rotated k and v straight into the cache row
  at the position (a prefill's rows are the positions of prompts and go to each prompt's slot row: no scratch
  cache, no copies; a decode step's rows are slots, each at its own position);
- attention: :func:`prefill_attention` (causal, each prompt over its own slot row; query blocks of
  ``PREFILL_BLOCKS[0]`` positions per program, key tiles up to the diagonal, online softmax; GQA by indexing) or the decode step's
  split attention (:func:`~.qwen2_attention.decode_attention`);
- :func:`silu_mul`: ``silu(gate) * up`` of the fused gate/up GEMM's output.

Nine launches per layer.  The residual stream is the model dtype, as in the eager decoder; each residual add is
rounded once (inside ``addmm``) where the eager decoder rounds the projection and the sum separately.  RoPE
angles are computed in fp32 from the positions, as the fused decode step does.  Padding positions (a prompt
shorter than its bucket) compute garbage that no real position attends to, exactly like the padded eager
prefill; their keys/values land in the slot past the prompt, where decode steps overwrite them before any
query can see them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cosyvoice_fast.llm.model.kv_cache import KVCache
from cosyvoice_fast.llm.model.qwen2 import Qwen2Decoder
from cosyvoice_fast.kernels.pdl import pdl_start
from cosyvoice_fast.llm.kernels.qwen2_attention import decode_attention, kv_tile_step
from cosyvoice_fast.llm.kernels.qwen2_pieces import rotate_store
from cosyvoice_fast.llm.kernels.qwen2_proj import TILES, Tiles, dot_precision, launch_options

#: query positions per prefill attention program, and keys per tile of its walk (the GPU default; a test passes
#: smaller ones so a short prompt spans several blocks)
PREFILL_BLOCKS = (64, 64)
#: rows per program of the RoPE/cache-write and SiLU*mul kernels
ROWS_PER_PROGRAM = 16


@triton.jit
def _rope_kv_kernel(qkv_ptr, freq_ptr, slot_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, ROWS, T, stride_cb, stride_ch,
                    stride_cp, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BR: tl.constexpr,
                    PER_ROW: tl.constexpr, PDL: tl.constexpr):
    """Program (row block, head of q|k|v): q and k heads rotate (half-split pairs), q goes to its scratch, k/v to
    the cache.  Rows are prompt positions (row ``r`` = position ``r % T`` of prompt ``r // T``, cache row
    ``slot[r // T]``), or with ``PER_ROW`` decode rows (position ``pos[r]``, cache row ``r``)."""
    pdl_start(PDL)
    HALF: tl.constexpr = D // 2
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < ROWS
    head = tl.program_id(1)
    d = tl.arange(0, HALF)
    src = qkv_ptr + r[:, None] * ((HQ + 2 * HKV) * D) + head * D + d[None, :]
    x1 = tl.load(src, mask=rmask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=rmask[:, None], other=0.0).to(tl.float32)
    if PER_ROW:
        pos = tl.load(pos_ptr + r, mask=rmask, other=0)
        crow = r
    else:
        pos = r % T
        crow = tl.load(slot_ptr + r // T, mask=rmask, other=0)
    rotate_store(x1, x2, head, d, d < HALF, r, rmask, pos, crow, tl.load(freq_ptr + d), q_ptr, kc_ptr, vc_ptr,
                 stride_cb, stride_ch, stride_cp, HQ, HKV, D)


@triton.jit
def _prefill_attn_kernel(q_ptr, kc_ptr, vc_ptr, slot_ptr, out_ptr, T, scale, stride_cb, stride_ch, stride_cp,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    """Program (query block, q head, prompt): causal softmax attention of ``BM`` positions of one head over
    the prompt's keys ``<=`` each position, read from the prompt's slot row of the cache."""
    pdl_start(PDL)
    REP: tl.constexpr = HQ // HKV
    qb = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    t = qb * BM + tl.arange(0, BM)
    tmask = t < T
    dd = tl.arange(0, D)
    q_rows = (b * T + t)[:, None] * (HQ * D) + head * D + dd[None, :]
    q = tl.load(q_ptr + q_rows, mask=tmask[:, None], other=0.0)
    base = tl.load(slot_ptr + b) * stride_cb + (head // REP) * stride_ch
    m = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    end = tl.minimum(qb * BM + BM, T)
    for s0 in range(0, end, BN):  # key 0 is always allowed: the running max is finite from the first tile on
        s = s0 + tl.arange(0, BN)
        smask = s < end
        m, l_sum, acc = kv_tile_step(q, kc_ptr, vc_ptr, base + s[:, None] * stride_cp + dd[None, :], smask,
                                     smask[None, :] & (s[None, :] <= t[:, None]), scale, m, l_sum, acc, PREC)
    tl.store(out_ptr + q_rows, (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=tmask[:, None])


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, ROWS, N, BR: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    """``out[r, n] = silu(gu[r, n]) * gu[r, N + n]`` in fp32, rounded once."""
    pdl_start(PDL)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    m2 = (r < ROWS)[:, None] & (n < N)[None, :]
    g = tl.load(gu_ptr + r[:, None] * (2 * N) + n[None, :], mask=m2, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r[:, None] * (2 * N) + N + n[None, :], mask=m2, other=0.0).to(tl.float32)
    tl.store(out_ptr + r[:, None] * N + n[None, :], (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m2)


def _check_prompts(rows: int, length: int, slots: torch.Tensor) -> int:
    if rows % length or slots.shape != (rows // length,):
        raise ValueError(f"prefill: {rows} rows are not {tuple(slots.shape)} prompts of {length} positions")
    return rows // length


def rope_kv(qkv: torch.Tensor, inv_freq: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, *, length: int = 1, slots: torch.Tensor | None = None,
            positions: torch.Tensor | None = None) -> None:
    """q/k/v rows (rows, (Hq + 2·Hkv)·D), bias included -> ``q_out`` (rows, Hq, D) rotated, and rotated k and v
    into the cache: with ``slots``, rows are prompt ``r``'s positions ``0..T-1`` (T = ``length``) going to cache
    row ``slots[r]``; with ``positions`` (rows,) int64, row ``b`` goes to cache row ``b`` at ``positions[b]``."""
    rows = qkv.shape[0]
    if (slots is None) == (positions is None):
        raise ValueError("rope_kv takes either slots (a prefill) or positions (a decode step)")
    if slots is not None:
        _check_prompts(rows, length, slots)
    elif positions.shape != (rows,):
        raise ValueError(f"rope_kv: positions {tuple(positions.shape)} for {rows} rows")
    n_heads, head_dim = q_out.shape[1], q_out.shape[2]
    n_kv = k_cache.shape[1]
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), n_heads + 2 * n_kv)
    per_row = positions is not None
    _rope_kv_kernel[grid](qkv, inv_freq, positions if per_row else slots, positions if per_row else slots,
                          q_out, k_cache, v_cache, rows, length, k_cache.stride(0), k_cache.stride(1),
                          k_cache.stride(2), HQ=n_heads, HKV=n_kv, D=head_dim, BR=ROWS_PER_PROGRAM,
                          PER_ROW=per_row, **launch_options(qkv, 1))


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      length: int, out: torch.Tensor, blocks: tuple[int, int] = PREFILL_BLOCKS) -> None:
    """``out`` (R·T, Hq, D) <- causal attention of q (R·T, Hq, D), prompt ``r``'s positions ``0..T-1`` in rows
    ``r·T ..``, over the keys/values of positions ``0..T-1`` in cache row ``slots[r]`` (T = ``length``).
    ``blocks``: query positions per program and keys per tile."""
    rows, n_heads, head_dim = q.shape
    prompts = _check_prompts(rows, length, slots)
    block_m, block_n = blocks
    grid = (triton.cdiv(length, block_m), n_heads, prompts)
    _prefill_attn_kernel[grid](q, k_cache, v_cache, slots, out, length, head_dim ** -0.5, k_cache.stride(0),
                               k_cache.stride(1), k_cache.stride(2), HQ=n_heads, HKV=k_cache.shape[1], D=head_dim,
                               BM=block_m, BN=block_n, PREC=dot_precision(q.dtype), **launch_options(q, 2))


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (rows, I) <- ``silu(gate_up[:, :I]) * gate_up[:, I:]``."""
    rows, n = out.shape
    bn = 128
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(n, bn))
    _silu_mul_kernel[grid](gate_up, out, rows, n, BR=ROWS_PER_PROGRAM, BN=bn, **launch_options(out, 1))


def prefill_rows(decoder: Qwen2Decoder, inputs_embeds: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
                 cache: KVCache, blocks: tuple[int, int] = PREFILL_BLOCKS) -> torch.Tensor:
    """Prefill ``R`` prompts of ``T`` positions (``inputs_embeds`` (R, T, H), positions ``0..T-1``): keys and
    values into cache rows ``slots`` (R,) int64 at positions ``0..T-1``, and the final-norm hidden state of
    each prompt's position ``last[r]`` as (R, H).  The decoder's own ``decoder(x, arange(T), cache_row)`` per
    prompt, launched without host reads (it captures in a CUDA graph).  ``blocks``: the attention's tiles
    (:func:`prefill_attention`)."""
    n_prompts, length, hidden = inputs_embeds.shape
    if slots.shape != (n_prompts,) or last.shape != (n_prompts,):
        raise ValueError(f"prefill of {n_prompts} prompts needs slots and last of shape ({n_prompts},), got "
                         f"{tuple(slots.shape)} and {tuple(last.shape)}")
    if length > cache.max_len:
        raise ValueError(f"a prefill of {length} positions does not fit a cache of {cache.max_len}")
    decoder.fuse_projections()  # idempotent: re-links q/k/v and gate/up after a .to() gave them new storage
    cfg = decoder.cfg
    rows, dev, dtype = n_prompts * length, inputs_embeds.device, inputs_embeds.dtype
    n_heads, head_dim = cfg.num_attention_heads, cfg.head_dim
    q = torch.empty(rows, n_heads, head_dim, dtype=dtype, device=dev)
    attn = torch.empty(rows, n_heads, head_dim, dtype=dtype, device=dev)
    act = torch.empty(rows, cfg.intermediate_size, dtype=dtype, device=dev)
    x = inputs_embeds.reshape(rows, hidden)
    inv_freq = decoder.rotary.inv_freq
    for i, layer in enumerate(decoder.layers):
        a, mlp = layer.self_attn, layer.mlp
        qkv = F.linear(layer.input_layernorm(x), a.qkv_weight, a.qkv_bias)
        rope_kv(qkv, inv_freq, q, cache.k[i], cache.v[i], length=length, slots=slots)
        prefill_attention(q, cache.k[i], cache.v[i], slots, length, attn, blocks)
        x = torch.addmm(x, attn.view(rows, n_heads * head_dim), a.o_proj.weight.t())
        silu_mul(F.linear(layer.post_attention_layernorm(x), mlp.gate_up_weight), act)
        x = torch.addmm(x, act, mlp.down_proj.weight.t())
    picked = x.view(n_prompts, length, hidden)[torch.arange(n_prompts, device=dev), last]
    return decoder.norm(picked)


def decode_rows(decoder: Qwen2Decoder, inputs_embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                kv_len: int, splits: int, tiles: Tiles = TILES) -> torch.Tensor:
    """One decode step of ``B`` rows (``inputs_embeds`` (B, 1, H), row ``b`` at ``positions[b]`` (B,) int64 in
    cache row ``b``, attending over its positions ``< min(pos + 1, kv_len)`` with ``splits`` key splits):
    :func:`~.qwen2_decode.decode_step`'s function for many rows, on cuBLAS GEMMs.  Returns (B, 1, H)."""
    decoder.fuse_projections()
    cfg = decoder.cfg
    rows, _, hidden = inputs_embeds.shape
    dev, dtype = inputs_embeds.device, inputs_embeds.dtype
    n_heads, n_kv, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.empty(rows, n_heads, head_dim, dtype=dtype, device=dev)
    attn = torch.empty(rows, n_heads, head_dim, dtype=dtype, device=dev)
    act = torch.empty(rows, cfg.intermediate_size, dtype=dtype, device=dev)
    o_part = torch.empty(rows, n_heads, splits, head_dim, dtype=torch.float32, device=dev)
    m_part = torch.empty(rows, n_heads, splits, dtype=torch.float32, device=dev)
    l_part = torch.empty(rows, n_heads, splits, dtype=torch.float32, device=dev)
    counters = torch.zeros(rows, n_kv, dtype=torch.int32, device=dev)  # each layer's merge puts them back to 0
    x = inputs_embeds.reshape(rows, hidden)
    inv_freq = decoder.rotary.inv_freq
    for i, layer in enumerate(decoder.layers):
        a, mlp = layer.self_attn, layer.mlp
        qkv = F.linear(layer.input_layernorm(x), a.qkv_weight, a.qkv_bias)
        rope_kv(qkv, inv_freq, q, cache.k[i], cache.v[i], positions=positions)
        decode_attention(q, cache.k[i], cache.v[i], positions, kv_len, attn, o_part, m_part, l_part, counters,
                         tiles)
        x = torch.addmm(x, attn.view(rows, n_heads * head_dim), a.o_proj.weight.t())
        silu_mul(F.linear(layer.post_attention_layernorm(x), mlp.gate_up_weight), act)
        x = torch.addmm(x, act, mlp.down_proj.weight.t())
    return decoder.norm(x).view(rows, 1, hidden)
