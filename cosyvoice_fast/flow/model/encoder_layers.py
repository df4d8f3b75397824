"""Building blocks of the flow's token encoder (a Conformer without convolution modules).

Every block here is pure tensor math in (batch, time, channels) layout unless stated otherwise.  Attribute names
are chosen so that state-dict keys equal those of the official ``flow.pt`` (``self_attn.linear_q``,
``feed_forward.w_1``, ``norm_mha``, ``embed.out.0`` ...).

The relative positional table is computed on the fly from the sequence length instead of being kept as a large
pre-built buffer: it is a deterministic function of the length, costs a few microseconds to build, keeps the
state dict equal to the checkpoint's, and never has to be "extended" (no mutable module state).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def relative_position_table(n_query: int, n_key: int, d_model: int, device: torch.device | None = None,
                            dtype: torch.dtype = torch.float32) -> Tensor:
    """Sinusoidal encodings of the relative distances ``i - j`` a query/key grid can have, largest first.

    For queries at the last ``n_query`` of ``n_key`` positions the distances run from ``n_key - 1`` down to
    ``-(n_query - 1)``; for self-attention (``n_query == n_key == T``) that is ``T-1 .. -(T-1)``, the ESPnet
    "new" relative encoding.  Even channels hold ``sin(r * w_k)``, odd ones ``cos(r * w_k)`` with
    ``w_k = 10000^(-2k/d_model)``.  Angles are formed in fp32 exactly as ``r * w`` so that the values are
    bit-compatible with a table built once for all positions.  Returns ``(1, n_key + n_query - 1, d_model)``.
    """
    rel = torch.arange(n_key - 1, -n_query, -1, device=device, dtype=torch.float32).unsqueeze(1)
    freqs = torch.exp(torch.arange(0, d_model, 2, device=device, dtype=torch.float32)
                      * -(math.log(10000.0) / d_model))
    angles = rel * freqs
    table = torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1).flatten(1)
    return table.unsqueeze(0).to(dtype)


def shift_relative_scores(raw: Tensor, n_key: int) -> Tensor:
    """Re-index position scores from "distance bucket" to "key index" without copying.

    ``raw[..., i, m]`` scores query ``i`` against the table row ``m`` (distance ``n_key - 1 - m`` measured from
    the last query); the result ``out[..., i, j]`` is the score for the distance between query ``i`` (at
    absolute position ``n_key - n_query + i``) and key ``j``, i.e. ``raw[..., i, n_query - 1 - i + j]``.
    Along a row that is a contiguous run, and each next row starts ``width - 1`` elements later in memory, so a
    strided view expresses it exactly (this is the Transformer-XL shift without its pad/reshape copies).
    """
    raw = raw.contiguous()
    n_query, width = raw.shape[-2], raw.shape[-1]
    if width != n_key + n_query - 1:
        raise ValueError(f"position scores have width {width}, expected {n_key + n_query - 1}")
    lead = raw.shape[:-2]
    lead_strides = raw.stride()[:-2]
    return raw.as_strided((*lead, n_query, n_key), (*lead_strides, width - 1, 1),
                          raw.storage_offset() + n_query - 1)


class RelPositionSelfAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative-position terms (ESPnet flavour).

    scores = ((q + u) k^T + shift((q + v) p^T)) / sqrt(d_k), where p is the projected relative table and
    u, v are the learned per-head biases.  The content term runs inside ``scaled_dot_product_attention``
    and the position term enters it as an additive float mask (together with the -inf of masked keys), so
    fused attention kernels can be used on GPU.
    """

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by {n_heads} heads")
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.linear_q = nn.Linear(d_model, d_model)
        self.linear_k = nn.Linear(d_model, d_model)
        self.linear_v = nn.Linear(d_model, d_model)
        self.linear_out = nn.Linear(d_model, d_model)
        self.linear_pos = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_heads, self.d_k))

    def forward(self, x: Tensor, pos_table: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, T, D); pos_table (1, 2T-1, D); mask (B, 1|T, T) bool, True = may attend, or None."""
        b, t, _ = x.shape
        h, dk = self.n_heads, self.d_k
        q = self.linear_q(x).view(b, t, h, dk)
        k = self.linear_k(x).view(b, t, h, dk).transpose(1, 2)
        v = self.linear_v(x).view(b, t, h, dk).transpose(1, 2)
        p = self.linear_pos(pos_table).view(pos_table.shape[0], -1, h, dk).transpose(1, 2)
        q_content = (q + self.pos_bias_u).transpose(1, 2)
        q_position = (q + self.pos_bias_v).transpose(1, 2)
        scale = 1.0 / math.sqrt(dk)
        bias = shift_relative_scores(torch.matmul(q_position, p.transpose(-2, -1)), t) * scale
        if mask is not None:
            bias = bias.masked_fill(~mask.unsqueeze(1), float("-inf"))
        out = F.scaled_dot_product_attention(q_content, k, v, attn_mask=bias, scale=scale)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, h * dk))


class FeedForward(nn.Module):
    """Position-wise two-layer MLP with SiLU (upstream's default "swish" activation)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(d_model, hidden)
        self.w_2 = nn.Linear(hidden, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerBlock(nn.Module):
    """Pre-norm block: x + MHA(LN(x)), then + FF(LN(x)).  No macaron FF and no conv module in CosyVoice2."""

    def __init__(self, d_model: int, n_heads: int, hidden: int):
        super().__init__()
        self.self_attn = RelPositionSelfAttention(d_model, n_heads)
        self.feed_forward = FeedForward(d_model, hidden)
        self.norm_mha = nn.LayerNorm(d_model, eps=1e-12)
        self.norm_ff = nn.LayerNorm(d_model, eps=1e-12)

    def forward(self, x: Tensor, pos_table: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), pos_table, mask)
        return x + self.feed_forward(self.norm_ff(x))


class LinearEmbed(nn.Module):
    """Linear + LayerNorm, scaled by sqrt(d_model) (the scale of the relative-position encoding step).

    ``out`` is a Sequential so the keys are ``out.0.*`` (Linear) and ``out.1.*`` (LayerNorm) as in flow.pt.
    """

    def __init__(self, d_in: int, d_model: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(d_in, d_model), nn.LayerNorm(d_model, eps=1e-5))
        self.xscale = math.sqrt(d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.xscale


class PreLookahead(nn.Module):
    """Residual causal conv pair that lets each token see ``lookahead`` future tokens before attention.

    conv1 (kernel lookahead+1) looks right; conv2 (kernel 3) is left-padded, i.e. causal.  Future tokens
    beyond the input come from ``context`` (already embedded look-ahead tokens that are not themselves
    encoded) or are zeros at the true end of the utterance.
    """

    def __init__(self, channels: int, lookahead: int, hidden: int | None = None):
        super().__init__()
        self.lookahead = lookahead
        hidden = channels if hidden is None else hidden  # CosyVoice3: 80 mel channels in/out, 1024 between
        self.conv1 = nn.Conv1d(channels, hidden, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, kernel_size=3)

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """x (B, T, C); context (B, n <= lookahead, C) or None -> (B, T, C)."""
        y = x.transpose(1, 2)
        n_ctx = 0
        if context is not None and context.shape[1] > 0:
            n_ctx = context.shape[1]
            if n_ctx > self.lookahead:
                raise ValueError(f"{n_ctx} look-ahead context tokens given, the layer uses at most {self.lookahead}")
            y = torch.cat((y, context.transpose(1, 2)), dim=2)
        y = F.pad(y, (0, self.lookahead - n_ctx))
        y = F.leaky_relu(self.conv1(y))
        y = self.conv2(F.pad(y, (self.conv2.kernel_size[0] - 1, 0)))
        return y.transpose(1, 2) + x


class CausalUpsample(nn.Module):
    """Nearest-neighbour repeat by ``stride`` then a left-padded (causal) conv of kernel 2*stride+1."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, kernel_size=2 * stride + 1)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, C, T) -> (B, C, stride*T)."""
        y = torch.repeat_interleave(x, self.stride, dim=2)
        return self.conv(F.pad(y, (2 * self.stride, 0)))
