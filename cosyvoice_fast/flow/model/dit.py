"""CosyVoice3's CFM estimator: a DiT (AdaLayerNorm-Zero transformer) over mel frames.

Calling convention as CosyVoice2's U-Net (:data:`cosyvoice_fast.flow.model.cfm.Estimator`):
``(x, mask, mu, t, spks, cond, streaming) -> velocity``, all (B, 80, T) channel-first, ``t`` (B,), ``spks``
(B, 80), ``mask`` (B, 1, T) with ones on valid frames.  Attribute names match ``flow.pt``'s
``decoder.estimator.*`` keys.

The maths, in order:

* time: 256-wide sinusoid of ``1000 t`` (``[sin | cos]`` halves, frequencies ``exp(-k ln(1e4) / 127)``) ->
  Linear -> SiLU -> Linear = ``temb`` (B, dim);
* input: ``proj(cat[x, cond, mu, spks repeated])`` plus a causal convolutional position embedding of it (two
  left-padded grouped convs, kernel 31, Mish), so a frame only ever sees frames to its left before attention;
* blocks: AdaLN-Zero modulation from ``SiLU(temb)``; attention with rotary positions; a tanh-GELU MLP;
* rotary quirk (upstream applies x-transformers' rotary to the whole multi-head projection before the heads are
  split): only the first ``dim_head`` channels - head 0 - are rotated, in adjacent pairs ``(2i, 2i+1)`` at
  frequency ``inv_freq[i]``; the other heads carry no position information at all;
* attention mask: keys must be valid frames; while streaming also ``j < (i // C + 1) * C`` (C = 50 frames,
  every left chunk visible).  Chunks are aligned at frame 0 of the estimator input (the prompt's start).

Blocks expose their halves (:meth:`DiTBlock.qkv`, :meth:`DiTBlock.finish`) so an incremental runner can attend
new frames to cached keys/values of earlier chunks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_fast.config.dit import DiTConfig


def sinusoidal_time(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    """(B,) flow times -> (B, dim) ``[sin | cos]`` features in fp32."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
    arg = scale * t.float().unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((arg.sin(), arg.cos()), dim=-1)


def rotary_tables(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(dim_head/2,) frequencies, (T,) positions -> ``cos``, ``sin`` (T, dim_head/2), computed in fp32."""
    ang = positions.float().unsqueeze(1) * inv_freq.float().unsqueeze(0)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent channel pairs of the first ``2 * cos.shape[-1]`` channels of ``x`` (B, T, C); the rest pass.

    ``out[2i] = x[2i] cos - x[2i+1] sin``, ``out[2i+1] = x[2i+1] cos + x[2i] sin``, in the wider of the two
    dtypes (fp32 tables: as x-transformers computes it) and stored in ``x``'s dtype."""
    d = 2 * cos.shape[-1]
    pairs = x[..., :d].unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((rot.to(x.dtype), x[..., d:]), dim=-1)


def chunk_attention_mask(n_query: int, n_key: int, chunk: int, key_valid: Tensor | None = None,
                         query_start: int = 0, device: torch.device | None = None) -> Tensor | None:
    """Boolean (B or 1, 1, n_query, n_key) mask: query ``query_start + i`` sees key ``j`` iff key ``j`` is valid
    and, when ``chunk > 0``, ``j < ((query_start + i) // chunk + 1) * chunk``.  None when nothing is masked."""
    allowed = None
    if chunk > 0:
        q = torch.arange(query_start, query_start + n_query, device=device)
        k = torch.arange(n_key, device=device)
        allowed = (k.unsqueeze(0) < ((q // chunk + 1) * chunk).unsqueeze(1)).unsqueeze(0).unsqueeze(0)
    if key_valid is not None:
        kv = key_valid.bool().reshape(key_valid.shape[0], 1, 1, n_key)
        allowed = kv if allowed is None else allowed & kv
    return allowed


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        w = self.time_mlp[0].weight
        return self.time_mlp(sinusoidal_time(t, self.freq_dim).to(w.dtype))


class CausalConvPositionEmbedding(nn.Module):
    """Two left-padded grouped convs with Mish: a frame's position signal depends only on frames to its left."""

    def __init__(self, dim: int, kernel: int, groups: int):
        super().__init__()
        self.kernel = kernel
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())

    @property
    def receptive_left(self) -> int:
        """How many frames to the left one output frame depends on (60 for kernel 31)."""
        return 2 * (self.kernel - 1)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, dim) -> (B, T, dim)."""
        y = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))
        y = F.pad(self.conv1(y), (self.kernel - 1, 0))
        return self.conv2(y).transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.in_features, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim, cfg.conv_pos_kernel, cfg.conv_pos_groups)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor) -> Tensor:
        """x, cond, mu (B, T, 80), spks (B, 80) -> (B, T, dim)."""
        s = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        h = self.proj(torch.cat((x, cond, mu, s), dim=-1))
        return self.conv_pos_embed(h) + h


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` (a persistent buffer in flow.pt)."""

    def __init__(self, dim_head: int):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim_head, 2).float() / dim_head))
        self.register_buffer("inv_freq", inv)


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim: int, n: int):
        super().__init__()
        self.linear = nn.Linear(dim, n * dim)
        self.n = n

    def forward(self, temb_act: Tensor) -> tuple[Tensor, ...]:
        """SiLU(temb) (B, dim) -> ``n`` (B, 1, dim) modulation vectors."""
        return tuple(m.unsqueeze(1) for m in self.linear(temb_act).chunk(self.n, dim=1))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int):
        super().__init__()
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh")),
                                nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


def layer_norm(x: Tensor) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6)


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, T, heads*d) -> (B, heads, T, d)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(cfg.dim, 6)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def modulation(self, temb_act: Tensor) -> tuple[Tensor, ...]:
        """shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, each (B, 1, dim)."""
        return self.attn_norm(temb_act)

    def qkv(self, x: Tensor, mods: tuple[Tensor, ...], cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Residual stream (B, T, dim) -> q, k, v (B, heads, T, dim_head), rotary applied to q and k."""
        h = layer_norm(x) * (1 + mods[1]) + mods[0]
        a = self.attn
        q = apply_rotary(a.to_q(h), cos, sin)
        k = apply_rotary(a.to_k(h), cos, sin)
        return split_heads(q, a.heads), split_heads(k, a.heads), split_heads(a.to_v(h), a.heads)

    def finish(self, x: Tensor, o: Tensor, mods: Tensor | tuple[Tensor, ...]) -> Tensor:
        """Residual stream and attention output (B, heads, T, dim_head) -> the block's output (B, T, dim)."""
        x = x + mods[2] * self.attn.to_out[0](o.transpose(1, 2).flatten(2))
        h = layer_norm(x) * (1 + mods[4]) + mods[3]
        return x + mods[5] * self.ff(h)

    def forward(self, x: Tensor, temb_act: Tensor, mask: Tensor | None, cos: Tensor, sin: Tensor) -> Tensor:
        mods = self.modulation(temb_act)
        q, k, v = self.qkv(x, mods, cos, sin)
        return self.finish(x, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), mods)


class DiT(nn.Module):
    """The estimator; :meth:`forward` follows the CFM's estimator convention."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.time_embed = TimestepEmbedding(cfg.dim, cfg.time_freq_dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.depth)])
        self.norm_out = AdaLayerNormZero(cfg.dim, 2)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)

    def time_act(self, t: Tensor, batch: int) -> Tensor:
        """Flow time (0-dim or (B,)) -> SiLU(temb) (B, dim), the input of every modulation."""
        t = t.reshape(-1).expand(batch) if t.numel() == 1 else t
        return F.silu(self.time_embed(t))

    def rotary(self, start: int, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Rotary cos/sin (fp32) for frames ``start .. start + n - 1``."""
        pos = torch.arange(start, start + n, device=device)
        return rotary_tables(self.rotary_embed.inv_freq, pos, torch.float32)

    def embed(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor) -> Tensor:
        """Channel-first (B, 80, T) inputs -> the residual stream (B, T, dim)."""
        return self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)

    def head(self, h: Tensor, temb_act: Tensor) -> Tensor:
        """Final AdaLN (scale, shift order) and projection: (B, T, dim) -> (B, 80, T)."""
        scale, shift = self.norm_out(temb_act)
        return self.proj_out(layer_norm(h) * (1 + scale) + shift).transpose(1, 2)

    def attention_mask(self, mask: Tensor, n: int, streaming: bool) -> Tensor:
        """The (B, 1, T or 1, T) boolean mask of one forward, built without a host sync (graph capture).

        Frame 0 always counts as a key: a row with no valid frame at all (a batch's padding row) then attends to
        it instead of to nothing, which would be NaN; a real row's frame 0 is always valid anyway."""
        valid = mask.reshape(mask.shape[0], -1)[:, :n] > 0
        valid = valid | (torch.arange(n, device=mask.device) == 0)
        chunk = self.cfg.static_chunk_size if streaming else 0
        return chunk_attention_mask(n, n, chunk, valid, device=mask.device)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool = False) -> Tensor:
        return self.forward_masked(x, mu, t, spks, cond, self.attention_mask(mask, x.shape[2], streaming))

    def forward_masked(self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                       attn_mask: Tensor | None) -> Tensor:
        """:meth:`forward` with the boolean attention mask given (no host sync: what a captured graph runs)."""
        temb = self.time_act(t, x.shape[0])
        h = self.embed(x, cond, mu, spks)
        cos, sin = self.rotary(0, x.shape[2], x.device)
        for block in self.transformer_blocks:
            h = block(h, temb, attn_mask, cos, sin)
        return self.head(h, temb)
