"""The CFM estimator of CosyVoice2: a causal 1-D U-Net of ResNet and transformer blocks.

Input channels are ``[x, mu, speaker, cond]`` stacked (4 × 80 = 320); the output is the velocity field for
the 80 mel channels.  Everything along time is causal (left-padded convolutions, per-frame LayerNorm) and
attention is either full or, when streaming, chunk-causal (static chunks of 50 frames, all left chunks
visible), so frames of a finished chunk never change when later frames are appended.  That property is what
makes incremental and length-bucketed (zero-padded) execution exact.  (With more than one entry in
``channels`` the stride-2 down/up-sampling between levels would look one frame ahead; released models have a
single level, where both are causal 3-tap convolutions.)

Module names follow the official checkpoint (``decoder.estimator.*`` in flow.pt).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice_fast.config.model import DecoderConfig


class CausalConv1d(nn.Conv1d):
    """Conv1d that only looks left: ``kernel - 1`` zeros are padded in front."""

    def __init__(self, c_in: int, c_out: int, kernel: int):
        super().__init__(c_in, c_out, kernel)
        self.left = kernel - 1

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.left, 0)))


class _ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over channels of a (B, C, T) tensor (per frame, hence causal)."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class CausalBlock1D(nn.Module):
    """conv -> per-frame LayerNorm -> Mish, masked before and after (``block.0`` / ``block.2`` keys)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.block = nn.Sequential(CausalConv1d(c_in, c_out, 3), nn.Identity(), _ChannelLayerNorm(c_out),
                                   nn.Identity(), nn.Mish())

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.block(x * mask) * mask


class CausalResnetBlock1D(nn.Module):
    """Two causal blocks with the timestep embedding added in between, plus a 1x1 residual projection."""

    def __init__(self, c_in: int, c_out: int, time_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, c_out))
        self.block1 = CausalBlock1D(c_in, c_out)
        self.block2 = CausalBlock1D(c_out, c_out)
        self.res_conv = nn.Conv1d(c_in, c_out, 1)

    def forward(self, x: Tensor, mask: Tensor, t: Tensor) -> Tensor:
        h = self.block1(x, mask) + self.mlp(t).unsqueeze(-1)
        h = self.block2(h, mask)
        return h + self.res_conv(x * mask)


class SelfAttention(nn.Module):
    """Multi-head self-attention with bias-free q/k/v and a biased output projection (``to_out.0``)."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])

    def fuse(self) -> None:
        """One GEMM for q/k/v: the three weights move into one tensor and the projections become views of it
        (same values and state dict; the fused tensor is a non-persistent buffer).  Idempotent."""
        if self._fused():
            return
        weight = torch.cat([self.to_q.weight.detach(), self.to_k.weight.detach(), self.to_v.weight.detach()])
        n = self.to_q.weight.shape[0]
        self.to_q.weight.data, self.to_k.weight.data = weight[:n], weight[n:2 * n]
        self.to_v.weight.data = weight[2 * n:]
        self.register_buffer("qkv_weight", weight, persistent=False)

    def _fused(self) -> bool:
        """The fused tensor is used only while the projections are still views of it (a copy or a dtype cast
        gives them their own storage; :meth:`fuse` re-establishes it)."""
        w = getattr(self, "qkv_weight", None)
        return w is not None and self.to_q.weight.data_ptr() == w.data_ptr()

    def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
        """``x`` (B, T, C); ``allowed`` (B, 1|T, T) bool, True where query i may attend key j — or the additive
        (B, 1, 1|T, T) float mask :func:`attention_bias` builds once for many blocks."""
        b, t, _ = x.shape

        def heads(z: Tensor) -> Tensor:
            return z.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        if self._fused():
            q, k, v = F.linear(x, self.qkv_weight).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x))
        mask = allowed.unsqueeze(1) if allowed.dtype == torch.bool else allowed
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](o.transpose(1, 2).reshape(b, t, -1))


# The estimator's ``act_fn`` names the feed-forward nonlinearity; CosyVoice2 ships "gelu" (erf form).  Other
# names upstream accepts (gated or snake variants) would need different weights, so they are refused loudly
# rather than silently computed with the wrong function.
GELU_APPROXIMATION = {"gelu": "none", "gelu-approximate": "tanh"}


class GELUProj(nn.Module):
    """Linear then GELU (the ``ff.net.0.proj`` key)."""

    def __init__(self, c_in: int, c_out: int, approximate: str = "none"):
        super().__init__()
        self.proj = nn.Linear(c_in, c_out)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x), approximate=self.approximate)


class FeedForward(nn.Module):
    """Linear 4x up + GELU, then linear down (``net.0`` / ``net.2`` keys; ``net.1`` is a parameter-free dropout)."""

    def __init__(self, dim: int, act_fn: str = "gelu", mult: int = 4):
        super().__init__()
        if act_fn not in GELU_APPROXIMATION:
            raise ValueError(f"estimator act_fn {act_fn!r} is not supported; CosyVoice2 uses 'gelu' "
                             f"(supported: {', '.join(GELU_APPROXIMATION)})")
        self.net = nn.ModuleList([GELUProj(dim, dim * mult, GELU_APPROXIMATION[act_fn]), nn.Dropout(0.0),
                                  nn.Linear(dim * mult, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + feed-forward, residual both (``norm1``/``attn1``/``norm3``/``ff`` keys)."""

    def __init__(self, dim: int, heads: int, head_dim: int, act_fn: str = "gelu"):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, act_fn)

    def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
        x = x + self.attn1(self.norm1(x), allowed)
        return x + self.ff(self.norm3(x))


class TimestepMLP(nn.Module):
    """Sinusoidal flow-time features -> the embedding every ResNet block adds (``linear_1``/``linear_2``)."""

    def __init__(self, c_in: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(c_in, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def sinusoidal_embedding(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    """(B,) flow time in [0, 1] -> (B, dim) [sin | cos] features at geometric frequencies."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    arg = scale * t.reshape(-1, 1).float() * freqs.unsqueeze(0)
    return torch.cat([arg.sin(), arg.cos()], dim=-1)


def attention_allowed(mask: Tensor, chunk: int) -> Tensor:
    """(B, 1, T) frame mask -> bool (B, 1|T, T), True where a query may attend a key.

    Keys must be valid frames; with ``chunk`` > 0 they must also lie in the query's chunk or an earlier one
    (every left chunk stays visible: the released estimator ignores ``num_decoding_left_chunks``).  A row
    with no visible key (an all-padding batch row) has an undefined softmax (NaN on some SDPA kernels, and NaN
    survives the later ``* mask``); such rows are opened instead, as upstream does, which is harmless because
    padding never reaches valid frames.
    Built from tensor ops only (no host sync), so it can live inside a CUDA graph.
    """
    allowed = mask.bool()
    if chunk > 0:
        pos = torch.arange(mask.shape[-1], device=mask.device)
        chunk_end = (pos // chunk + 1) * chunk
        allowed = allowed & (pos.unsqueeze(0) < chunk_end.unsqueeze(1)).unsqueeze(0)
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def attention_bias(mask: Tensor, chunk: int, dtype: torch.dtype) -> Tensor:
    """:func:`attention_allowed` as the additive (B, 1, 1|T, T) mask SDPA takes, ``0`` / ``-inf`` in ``dtype``:
    built once per U-Net level instead of converted from bool inside each of its attention blocks (the
    estimator is kernel-count bound on a GPU)."""
    allowed = attention_allowed(mask, chunk).unsqueeze(1)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class CausalConditionalDecoder(nn.Module):
    """``forward(x, mask, mu, t, spks, cond, streaming) -> (B, 80, T)`` velocity, as upstream's estimator."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        chans = tuple(cfg.channels)
        time_dim = chans[0] * 4
        self.time_mlp = TimestepMLP(cfg.in_channels, time_dim)

        def tblocks(dim: int) -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim, cfg.act_fn)
                                 for _ in range(cfg.n_blocks))

        self.down_blocks = nn.ModuleList()
        c_out = cfg.in_channels
        for i, c in enumerate(chans):
            c_in, c_out = c_out, c
            last = i == len(chans) - 1
            down = CausalConv1d(c_out, c_out, 3) if last else nn.Conv1d(c_out, c_out, 3, stride=2, padding=1)
            self.down_blocks.append(nn.ModuleList([CausalResnetBlock1D(c_in, c_out, time_dim), tblocks(c_out), down]))
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock1D(chans[-1], chans[-1], time_dim), tblocks(chans[-1])])
            for _ in range(cfg.num_mid_blocks))
        ups = chans[::-1] + (chans[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(ups) - 1):
            c_in, c_out = ups[i] * 2, ups[i + 1]
            last = i == len(ups) - 2
            up = CausalConv1d(c_out, c_out, 3) if last else nn.ConvTranspose1d(c_out, c_out, 4, 2, 1)
            self.up_blocks.append(nn.ModuleList([CausalResnetBlock1D(c_in, c_out, time_dim), tblocks(c_out), up]))
        self.final_block = CausalBlock1D(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], cfg.out_channels, 1)

    def fuse_projections(self) -> "CausalConditionalDecoder":
        """Fuse q/k/v into one GEMM in every attention block (values and state dict unchanged)."""
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.fuse()
        return self

    @staticmethod
    def _attend(blocks: nn.ModuleList, x: Tensor, allowed: Tensor) -> Tensor:
        h = x.transpose(1, 2)
        for blk in blocks:
            h = blk(h, allowed)
        return h.transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool = False) -> Tensor:
        temb = self.time_mlp(sinusoidal_embedding(t, self.cfg.in_channels).to(x.dtype))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)
        chunk = self.cfg.static_chunk_size if streaming else 0
        skips, masks = [], [mask]
        for resnet, tblks, down in self.down_blocks:
            m = masks[-1]
            h = self._attend(tblks, resnet(h, m, temb), attention_bias(m, chunk, h.dtype))
            skips.append(h)
            h = down(h * m)
            masks.append(m[:, :, ::2])
        masks.pop()
        m = masks[-1]
        allowed = attention_bias(m, chunk, h.dtype)
        for resnet, tblks in self.mid_blocks:
            h = self._attend(tblks, resnet(h, m, temb), allowed)
        for resnet, tblks, up in self.up_blocks:
            m = masks.pop()
            skip = skips.pop()
            h = torch.cat([h[:, :, :skip.shape[-1]], skip], dim=1)
            h = self._attend(tblks, resnet(h, m, temb), attention_bias(m, chunk, h.dtype))
            h = up(h * m)
        h = self.final_block(h, m)
        return self.final_proj(h * m) * mask
