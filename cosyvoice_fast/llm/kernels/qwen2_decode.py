"""One Qwen2 decode step (one token per row, static KV cache) as 5 Triton kernels per layer + 3 per step.

From ``Tiles.cublas_rows`` rows on, the step runs :func:`~.qwen2_hybrid.decode_rows` instead: cuBLAS GEMMs with
Triton kernels for RoPE/cache write, attention and SiLU*mul (9 launches per layer), which beats these
weight-streaming projections once many rows share each weight tile.

Per layer: (1) RMSNorm + q/k/v + bias + RoPE + KV-cache write, (2) decode attention split over keys with the
split merge in the same kernel, (3) o-projection + residual, (4) RMSNorm + gate/up + SiLU*mul, (5) the
down projection split over K, whose last split adds the partial sums to the residual.  Per step: the copy of
the input embeddings into the fp32 residual stream, the zeroing of the merge counters, and the final RMSNorm.
:func:`step_logits` (every step below ``Tiles.cublas_rows``) ends with the final norm and the speech head in one
kernel (:mod:`.qwen2_head`); a GEMV step also gathers the embeddings and zeroes the counters in one, so the whole
step to its logits is one chain.
Steps of one or two rows (``Tiles.gemv_rows``) take the projections of :mod:`.qwen2_gemv` (weights loaded
before each kernel waits for the previous one, no tensor cores), larger steps the looped ones of
:mod:`.qwen2_proj`.  The tuning (a frozen :class:`~.qwen2_proj.Tiles`) is passed in, by default the GPU one.

:class:`FusedDecoder` is a drop-in for :class:`~cosyvoice_fast.llm.model.qwen2.Qwen2Decoder` *as a CUDA-graph
runner calls it*: ``decoder(inputs_embeds, pos, cache, kv_len=...)``.  One-token calls with a cache take the
fused path; everything else (cache-less passes, the eager prefill of inputs longer than every prefill
graph) goes to the wrapped decoder unchanged.  :meth:`FusedDecoder.prefill_rows` is the prefill the batched
prefill graphs replay (:mod:`.qwen2_hybrid`).  The cache is
the model's own :class:`~cosyvoice_fast.llm.model.kv_cache.KVCache` (per layer (B, Hkv, max_len, D) buffers, rows may
be views of a larger pool), written at the row's position as the eager path writes it.  Nothing here reads a
tensor on the host, so the step can be captured in a CUDA graph; scratch tensors come from the caching
allocator (or the graph's pool while capturing), like any PyTorch op's outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from cosyvoice_fast.llm.model.kv_cache import KVCache
from cosyvoice_fast.llm.model.qwen2 import Qwen2Decoder
from cosyvoice_fast.llm.kernels import qwen2_attention as attn_k
from cosyvoice_fast.llm.kernels import qwen2_gemv as gemv_k
from cosyvoice_fast.llm.kernels import qwen2_head as head_k
from cosyvoice_fast.llm.kernels import qwen2_proj as proj_k
from cosyvoice_fast.llm.kernels.qwen2_proj import TILES, Tiles
from cosyvoice_fast.kernels.common import can_run_on
from cosyvoice_fast.llm.kernels.qwen2_hybrid import decode_rows, prefill_rows


def kernels_per_step(n_layers: int) -> int:
    """Kernel launches of one fused decode step: 5 per layer, the embedding copy, the counter memset and the
    final norm."""
    return 5 * n_layers + 3


def _positions(pos: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-row positions (rows,) int64 from ``pos`` (rows, 1) per row, or (1,) shared by every row."""
    if pos.dim() == 2:
        if pos.shape != (rows, 1):
            raise ValueError(f"per-row positions {tuple(pos.shape)} for {rows} rows; expected ({rows}, 1)")
        return pos.reshape(rows).contiguous()
    if pos.shape != (1,):
        raise ValueError(f"a decode step writes one position per row; got positions of shape {tuple(pos.shape)}")
    return pos if rows == 1 else pos.expand(rows).contiguous()


def decode_step(decoder: Qwen2Decoder, inputs_embeds: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                kv_len: int | None = None, splits: int | None = None, tiles: Tiles = TILES) -> torch.Tensor:
    """``decoder(inputs_embeds, pos, cache, kv_len)`` for one token per row, on the fused kernels.

    ``inputs_embeds`` (B, 1, H) in the model dtype; ``pos`` (B, 1) or (1,); the cache's batch must be B.  Returns
    the final-norm hidden states (B, 1, H) in the model dtype; keys/values land in the cache at ``pos``.
    ``splits``: key splits of the attention (a power of two; default from the row count, see
    :func:`~.qwen2_attention.attention_splits`).
    """
    rows, t, hidden = inputs_embeds.shape
    if t != 1:
        raise ValueError(f"the fused decode step takes one token per row, got {t}")
    step = _Step(decoder, inputs_embeds, rows, pos, cache, kv_len, splits, tiles)
    if step.hybrid:  # many rows: cuBLAS GEMMs with the Triton glue
        return decode_rows(decoder, inputs_embeds, step.positions, cache, step.kv_len, step.splits, tiles)
    counters = torch.zeros(step.counter_count, dtype=torch.int32, device=inputs_embeds.device)
    resid = torch.empty(rows, hidden, dtype=torch.float32, device=inputs_embeds.device)
    resid.copy_(inputs_embeds.reshape(rows, hidden))
    step.layers(resid, counters)
    out = torch.empty(rows, hidden, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
    head_k.rmsnorm(resid, decoder.norm.weight, out, decoder.norm.eps)
    return out.view(rows, 1, hidden)


def step_logits(decoder: Qwen2Decoder, table: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor,
                pos: torch.Tensor, cache: KVCache, kv_len: int | None = None, splits: int | None = None,
                tiles: Tiles = TILES) -> torch.Tensor | None:
    """``head(decoder(table[tokens], pos, cache, kv_len))`` as fp32 (B, V) logits for a step of the GEMV kernels
    or the looped ones, or None where the step is neither (a head without a bias, or cuBLAS rows): then embed,
    step and head apart.

    The step ends with one kernel that applies the final norm and the head (with its bias) inside the
    programmatic-dependent-launch chain: two launches fewer than the norm, cuBLAS's GEMM and a cast.  A GEMV step
    also starts with one kernel that gathers each row's embedding into the fp32 residual stream and zeroes the
    counters (three launches fewer: gather, cast, memset).  A looped step keeps those torch ops: ahead of the
    looped projections the gather kernel measured slower on an H100.
    ``tokens``: (B, 1) or (B,) int64 ids."""
    rows = tokens.numel()
    if head.bias is None:
        return None
    hidden = table.shape[1]
    step = _Step(decoder, table, rows, pos, cache, kv_len, splits, tiles)
    if step.hybrid:
        return None
    dev = table.device
    counters = torch.empty(step.counter_count, dtype=torch.int32, device=dev)
    resid = torch.empty(rows, hidden, dtype=torch.float32, device=dev)
    _gather(step.gemv, tokens.reshape(rows), table, resid, counters)
    sums = step.layers(resid, counters)
    logits = torch.empty(rows, head.weight.shape[0], dtype=torch.float32, device=dev)
    head_args = (resid, decoder.norm.weight, _contig(head.weight), head.bias, logits, decoder.norm.eps)
    if step.gemv:
        gemv_k.head(*head_args, tiles=tiles)
    else:
        head_k.head(*head_args, sums=sums, tiles=tiles)
    return logits


def _gather(gemv: bool, tokens: torch.Tensor, table: torch.Tensor, resid: torch.Tensor,
            counters: torch.Tensor) -> None:
    """A step's start: ``resid`` (B, H) fp32 <- ``table[tokens]``, ``counters`` <- 0; one kernel for a GEMV
    step, torch's gather, cast and memset for a looped one (see :func:`step_logits`)."""
    if gemv:
        gemv_k.embed(tokens, table, resid, counters)
    else:
        resid.copy_(table[tokens])
        counters.zero_()


class _Step:
    """One fused decode step's plan: its checks, positions, splits and kernels (the layers' part of it)."""

    def __init__(self, decoder: Qwen2Decoder, like: torch.Tensor, rows: int, pos: torch.Tensor, cache: KVCache,
                 kv_len: int | None, splits: int | None, tiles: Tiles):
        cfg = decoder.cfg
        if not can_run_on(like.device):
            raise RuntimeError("the fused Qwen2 kernels need CUDA tensors (on CPU, set TRITON_INTERPRET=1 to run "
                               "them through Triton's interpreter, as the tests do)")
        if cache.batch != rows:
            raise ValueError(f"a cache of {cache.batch} rows for a step of {rows} rows")
        if cache.dtype != like.dtype:
            raise ValueError(f"cache dtype {cache.dtype} differs from the model's {like.dtype}")
        decoder.fuse_projections()  # idempotent: re-links q/k/v and gate/up after a .to() gave them new storage
        self.decoder, self.cache, self.rows, self.dtype, self.tiles = decoder, cache, rows, like.dtype, tiles
        self.kv_len = cache.max_len if kv_len is None else min(int(kv_len), cache.max_len)
        self.positions = _positions(pos, rows)
        n_kv = cfg.num_key_value_heads
        self.splits = attn_k.attention_splits(rows, n_kv, tiles) if splits is None else int(splits)
        if self.splits < 1 or self.splits & (self.splits - 1):
            raise ValueError(f"attention splits must be a power of two >= 1, got {self.splits}")
        self.hybrid = 0 < tiles.cublas_rows <= rows
        self.gemv = rows <= tiles.gemv_rows
        hidden = cfg.hidden_size
        self.qkv_split = 1
        self.qkv_counters = 0
        if self.gemv:  # weights loaded before each kernel's wait (.qwen2_gemv); the down projection in K pieces
            self.split = gemv_k.split_count(cfg.intermediate_size, tiles)
            down_tiles = hidden  # counters: at most one per output column
        else:
            self.split, self.qkv_split = tiles.down_split, tiles.qkv_split
            down_tiles = triton.cdiv(hidden, tiles.down) * triton.cdiv(rows, proj_k.row_block(rows))
            if self.qkv_split > 1:
                self.qkv_counters = proj_k.qkv_tiles(rows, cfg.num_attention_heads, n_kv, cfg.head_dim, tiles)
        self.attn_counters = rows * n_kv
        self.down_counters = down_tiles
        self.counter_count = self.attn_counters + down_tiles + self.qkv_counters

    def layers(self, resid: torch.Tensor, counters: torch.Tensor) -> torch.Tensor | None:
        """Every layer over the fp32 residual ``resid`` (B, H), in place.  ``counters`` holds the attention's
        merge counters, then the down projection's split counters, then those of the q/k/v projection where it
        is split, all zero; each kernel puts its counters back to zero, so every layer (and the next replay)
        finds them so.  Returns the sums of squares the last down projection left for the final norm (looped
        steps), else None."""
        decoder, rows, dtype, tiles = self.decoder, self.rows, self.dtype, self.tiles
        cfg, dev = decoder.cfg, resid.device
        n_heads, n_kv, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hidden = cfg.hidden_size
        q = torch.empty(rows, n_heads, head_dim, dtype=dtype, device=dev)
        attn = torch.empty(rows, n_heads, head_dim, dtype=dtype, device=dev)
        o_part = torch.empty(rows, n_heads, self.splits, head_dim, dtype=torch.float32, device=dev)
        m_part = torch.empty(rows, n_heads, self.splits, dtype=torch.float32, device=dev)
        l_part = torch.empty(rows, n_heads, self.splits, dtype=torch.float32, device=dev)
        h = torch.empty(rows, cfg.intermediate_size, dtype=dtype, device=dev)
        attn_counters, down_counters, qkv_counters = counters.split(
            [self.attn_counters, self.down_counters, self.qkv_counters])
        attn_counters = attn_counters.view(rows, n_kv)
        parts = torch.empty(self.split, rows, hidden, dtype=torch.float32, device=dev) if self.split > 1 else None
        n_qkv = (n_heads + 2 * n_kv) * head_dim
        qkv_split = {} if self.qkv_split == 1 else {
            "parts": torch.empty(self.qkv_split, rows, n_qkv, dtype=torch.float32, device=dev),
            "counters": qkv_counters}
        proj = gemv_k if self.gemv else proj_k
        # looped steps: the o- and down projections leave per-tile sums of squares of the residual they finish,
        # which the next norm reads instead of the rows (the first layer's q/k/v reads the rows)
        sums = not self.gemv
        o_sums = torch.empty(triton.cdiv(hidden, tiles.oproj), rows, dtype=torch.float32, device=dev) \
            if sums else None
        down_sums = torch.empty(triton.cdiv(hidden, tiles.down), rows, dtype=torch.float32, device=dev) \
            if sums else None
        qkv_sums = {}
        inv_freq = decoder.rotary.inv_freq
        for i, layer in enumerate(decoder.layers):
            a, mlp = layer.self_attn, layer.mlp
            kc, vc = self.cache.k[i], self.cache.v[i]
            proj.qkv_rope(resid, layer.input_layernorm.weight, _contig(a.qkv_weight), _contig(a.qkv_bias),
                          inv_freq, self.positions, q, kc, vc, layer.input_layernorm.eps, n_heads, n_kv, head_dim,
                          **qkv_split, **qkv_sums, tiles=tiles)
            attn_k.decode_attention(q, kc, vc, self.positions, self.kv_len, attn, o_part, m_part, l_part,
                                    attn_counters, tiles)
            o_in, wo = attn.view(rows, n_heads * head_dim), _contig(a.o_proj.weight)
            gate_in = (resid, layer.post_attention_layernorm.weight, _contig(mlp.gate_up_weight), h,
                       layer.post_attention_layernorm.eps)
            if self.gemv:
                gemv_k.proj_residual(o_in, wo, resid, tiles=tiles)
                gemv_k.gate_up(*gate_in, tiles=tiles)
                gemv_k.proj_residual(h, _contig(mlp.down_proj.weight), resid, parts, down_counters, tiles=tiles)
            else:
                proj_k.proj_residual(o_in, wo, resid, block_n=tiles.oproj, sums=o_sums, tiles=tiles)
                proj_k.gate_up(*gate_in, sums=o_sums, tiles=tiles)
                proj_k.proj_residual(h, _contig(mlp.down_proj.weight), resid, parts, down_counters,
                                     block_n=tiles.down, sums=down_sums, tiles=tiles)
                qkv_sums = {"sums": down_sums}
        return down_sums if decoder.layers else None


def _contig(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"the fused kernels need contiguous weights, got strides {t.stride()} for {tuple(t.shape)}")
    return t


class FusedDecoder:
    """Wraps a :class:`Qwen2Decoder`: one-token steps over a cache run :func:`decode_step`, the rest runs the
    decoder itself; every other attribute is the decoder's (``fuse_projections``, ``layers``, ``cfg`` ...).
    ``tiles``: the kernels' tuning (the GPU default unless a benchmark passes another)."""

    def __init__(self, decoder: Qwen2Decoder, splits: int | None = None, tiles: Tiles = TILES):
        self.decoder = decoder
        self.splits = splits
        self.tiles = tiles
        decoder.fuse_projections()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["decoder"], name)

    def __call__(self, inputs_embeds: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None,
                 kv_len: int | None = None) -> torch.Tensor:
        if cache is None or inputs_embeds.shape[1] != 1:
            return self.decoder(inputs_embeds, pos, cache, kv_len)
        return decode_step(self.decoder, inputs_embeds, pos, cache, kv_len, self.splits, self.tiles)

    def step_logits(self, table: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor, pos: torch.Tensor,
                    cache: KVCache, kv_len: int | None = None) -> torch.Tensor | None:
        """:func:`step_logits` on the wrapped decoder (None where the step does not end in the fused head)."""
        return step_logits(self.decoder, table, head, tokens, pos, cache, kv_len, self.splits, self.tiles)

    def prefill_rows(self, inputs_embeds: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
                     cache: KVCache) -> torch.Tensor:
        """:func:`~.qwen2_hybrid.prefill_rows` on the wrapped decoder: prompts straight into their slot rows
        (what the batched prefill graphs replay)."""
        return prefill_rows(self.decoder, inputs_embeds, slots, last, cache)
