"""Chunk-by-chunk execution of the flow's encoder with carried state (see
:mod:`~cosyvoice_fast.flow.model.incremental` for why a committed chunk never changes).

The token-level Conformer stack and the frame-level (upsampled) one each run over one :class:`Window`; the
state is their key/value and causal-conv slots.  Pure math on the modules of
:class:`~cosyvoice_fast.flow.model.flow.CausalMaskedDiffWithXvec`; no module is modified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_fast.flow.model.encoder_layers import relative_position_table, shift_relative_scores
from cosyvoice_fast.flow.model.incremental import Window, slots_nbytes


@dataclass
class EncoderCache:
    """Committed encoder state: ``n_tokens`` tokens (a multiple of the encoder chunk) and their frames."""

    n_tokens: int = 0
    tok_slots: list[Tensor] = field(default_factory=list)  # conv2 context, then (K, V) per token-level block
    frame_slots: list[Tensor] = field(default_factory=list)  # upsample conv context, then (K, V) per up block

    def nbytes(self) -> int:
        return slots_nbytes(self.tok_slots) + slots_nbytes(self.frame_slots)


def _relpos_attention(att: nn.Module, x: Tensor, win: Window) -> Tensor:
    """The encoder's rel-pos self-attention for queries ``[start, start + n)`` against keys ``[0, start + n)``."""
    b, t, d = x.shape
    h, dk = att.n_heads, att.d_k
    q = att.linear_q(x).view(b, t, h, dk)
    k = att.linear_k(x).view(b, t, h, dk).transpose(1, 2)
    v = att.linear_v(x).view(b, t, h, dk).transpose(1, 2)
    k, v = win.keys_values(k, v)
    n_key = k.shape[2]
    table = relative_position_table(t, n_key, d, x.device, x.dtype)
    p = att.linear_pos(table).view(1, -1, h, dk).transpose(1, 2)
    q_content = (q + att.pos_bias_u).transpose(1, 2)
    q_position = (q + att.pos_bias_v).transpose(1, 2)
    scale = 1.0 / math.sqrt(dk)
    bias = shift_relative_scores(torch.matmul(q_position, p.transpose(-2, -1)), n_key) * scale
    bias = bias.masked_fill(~win.visible(t, x.device), float("-inf"))
    out = F.scaled_dot_product_attention(q_content, k, v, attn_mask=bias, scale=scale)
    return att.linear_out(out.transpose(1, 2).reshape(b, t, h * dk))


def encoder_commit_point(flow: nn.Module, committed: int, n_body: int, n_final: int) -> int:
    """Tokens committed after a call: the last chunk boundary at or before ``min(n_final, n_body)``."""
    chunk = flow.encoder.cfg.static_chunk_size
    return max(committed, (min(n_final, n_body) // chunk) * chunk)


def encode_increment(flow: nn.Module, ids: Tensor, n_body: int, n_final: int, cache: EncoderCache
                     ) -> tuple[Tensor, EncoderCache]:
    """Encode tokens ``[cache.n_tokens, n_body)`` of ``ids`` (1, N) (prompt + target ids, N - n_body <= look-ahead
    tokens used as context only; missing look-ahead is zero, as at an utterance end).

    ``n_final``: tokens before it have their complete, real look-ahead (``N - pre_lookahead_len`` for a non-final
    call, ``N`` at the end of the utterance); complete chunks below it are committed.
    Returns ``mu`` (1, 80, stride * (n_body - cache.n_tokens)) for frames ``[stride * cache.n_tokens,
    stride * n_body)`` and the new cache (the old one is not modified).
    """
    enc = flow.encoder
    ct = cache.n_tokens
    n = ids.shape[1]
    pl = enc.pre_lookahead_layer
    la, stride, chunk = pl.lookahead, enc.cfg.upsample_stride, enc.cfg.static_chunk_size
    if not ct <= n_body <= n <= n_body + la:
        raise ValueError(f"cannot encode tokens [{ct}, {n_body}) of {n} with look-ahead {la}")
    if ct and not cache.tok_slots:
        raise ValueError("encoder state has no slots (made by a recomputing encoder); recompute it")
    new_ct = encoder_commit_point(flow, ct, n_body, n_final)
    commit = new_ct - ct
    if n_body == ct:
        return ids.new_zeros(1, flow.encoder_proj.out_features, 0).float(), cache

    win = Window(cache.tok_slots, ct, commit, chunk)
    e = enc.embed(flow.input_embedding(ids[:, ct:].clamp(min=0).long()))  # (1, n - ct, D)
    y = F.pad(e.transpose(1, 2), (0, n_body + la - n))
    y = F.leaky_relu(pl.conv1(y))  # (1, D, n_body - ct): conv1 outputs of the body tokens
    y = win.conv(pl.conv2, y)
    x = y.transpose(1, 2) + e[:, :n_body - ct]
    for blk in enc.encoders:
        x = x + _relpos_attention(blk.self_attn, blk.norm_mha(x), win)
        x = x + blk.feed_forward(blk.norm_ff(x))

    fwin = Window(cache.frame_slots, stride * ct, stride * commit, chunk * stride)
    y = torch.repeat_interleave(x.transpose(1, 2), enc.up_layer.stride, dim=2)
    x = fwin.conv(enc.up_layer.conv, y).transpose(1, 2)
    x = enc.up_embed(x)
    for blk in enc.up_encoders:
        x = x + _relpos_attention(blk.self_attn, blk.norm_mha(x), fwin)
        x = x + blk.feed_forward(blk.norm_ff(x))
    x = enc.after_norm(x)
    mu = flow.encoder_proj(x).transpose(1, 2).contiguous()
    return mu, EncoderCache(new_ct, win.new, fwin.new)
