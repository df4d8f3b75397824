"""UpsampleConformerEncoder: 25 Hz speech-token embeddings -> 50 Hz frames for the flow-matching decoder.

Pipeline (all in (batch, time, channels)):
    embed (Linear+LN, x sqrt(d)) -> pre-look-ahead conv -> ``num_blocks`` Conformer blocks
    -> causal 2x upsample -> up_embed (Linear+LN) -> ``num_up_blocks`` Conformer blocks -> after_norm.

In streaming mode attention is chunk-causal: a position sees every earlier chunk and its own chunk, with
chunks of ``static_chunk_size`` tokens before the upsample and ``stride`` times that many frames after it.
Chunks are counted from the first position of the input (the first prompt token), which is what makes the
outputs of already-finished chunks independent of later tokens, except for the pre-look-ahead's reach of
``pre_lookahead_len`` tokens into the next chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from cosyvoice_fast.config.model import EncoderConfig
from cosyvoice_fast.flow.model.encoder_layers import (
    CausalUpsample, ConformerBlock, LinearEmbed, PreLookahead, relative_position_table,
)


def attention_mask(lengths: Tensor | None, n: int, chunk: int, device: torch.device) -> Tensor | None:
    """Boolean "may attend" mask: key padding from ``lengths`` and, if ``chunk > 0``, chunk-causality.

    Returns (B, 1, n), (1|B, n, n) or None when every position may attend to every other one.
    """
    keep: Tensor | None = None
    if lengths is not None:
        keep = (torch.arange(n, device=device).unsqueeze(0) < lengths.to(device).unsqueeze(1)).unsqueeze(1)
    if chunk > 0:
        pos = torch.arange(n, device=device)
        chunk_end = (pos // chunk + 1) * chunk
        causal = (pos.unsqueeze(0) < chunk_end.unsqueeze(1)).unsqueeze(0)
        keep = causal if keep is None else keep & causal
    return keep


class UpsampleConformerEncoder(nn.Module):
    """The flow's token encoder; parameter names match the ``encoder.*`` keys of flow.pt."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.output_size
        self.cfg = cfg
        self.embed = LinearEmbed(cfg.input_size, d)
        self.pre_lookahead_layer = PreLookahead(d, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerBlock(d, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_blocks))
        self.up_layer = CausalUpsample(d, cfg.upsample_stride)
        self.up_embed = LinearEmbed(d, d)
        self.up_encoders = nn.ModuleList(
            ConformerBlock(d, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_up_blocks))
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def forward(self, xs: Tensor, xs_lens: Tensor | None = None, context: Tensor | None = None,
                streaming: bool = False) -> tuple[Tensor, Tensor | None]:
        """Encode token embeddings.

        xs: (B, T, input_size) token embeddings; xs_lens: (B,) valid lengths or None (all valid; lengths larger
        than T are clipped, as when a caller counts look-ahead tokens it passed separately); context: (B, n, input_size)
        raw embeddings of up to ``pre_lookahead_len`` tokens that follow ``xs``, used only as look-ahead;
        streaming: chunk-causal attention.  Returns (B, stride*T, output_size) and the (B, 1, stride*T) validity
        mask (None when ``xs_lens`` is None).
        """
        x = self.embed(xs)
        ctx = self.embed(context) if context is not None and context.shape[1] > 0 else None
        x = self.pre_lookahead_layer(x, ctx)
        return self._blocks(x, xs_lens, streaming)

    def forward_padded(self, xs: Tensor, full_lens: Tensor, body_lens: Tensor, streaming: bool = False
                       ) -> tuple[Tensor, Tensor]:
        """Encode right-padded rows of different lengths in one pass.

        Row ``i`` of xs (B, T, input_size) holds ``full_lens[i]`` token embeddings: ``body_lens[i]`` encoded tokens
        followed by their look-ahead-only context (at most ``pre_lookahead_len``), then padding.  Valid outputs
        (the first ``stride * body_lens[i]`` frames) equal :meth:`forward` on that row alone with the context passed
        separately: the embedded padding is zeroed (the look-ahead conv sees zeros past the context, as at an
        utterance end), every later time-mixing op is causal or masked by ``body_lens``, and chunk-causal limits
        count from the first position.  Only the reduction order of a longer attention row differs.
        """
        x = self.embed(xs)
        t = xs.shape[1]
        inside = torch.arange(t, device=xs.device).unsqueeze(0) < full_lens.to(xs.device).unsqueeze(1)
        x = self.pre_lookahead_layer(x * inside.unsqueeze(-1).to(x.dtype))
        out, valid = self._blocks(x, body_lens, streaming)
        return out, valid  # type: ignore[return-value]

    def _blocks(self, x: Tensor, xs_lens: Tensor | None, streaming: bool) -> tuple[Tensor, Tensor | None]:
        """Everything after the look-ahead conv: Conformer blocks, upsample, up-blocks, final norm."""
        t = x.shape[1]
        stride = self.cfg.upsample_stride
        chunk = self.cfg.static_chunk_size if streaming else 0
        mask = attention_mask(xs_lens, t, chunk, x.device)
        pos = relative_position_table(t, t, x.shape[-1], x.device, x.dtype)
        for block in self.encoders:
            x = block(x, pos, mask)

        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        t_up = t * stride
        up_lens = None if xs_lens is None else xs_lens * stride
        x = self.up_embed(x)
        mask = attention_mask(up_lens, t_up, chunk * stride, x.device)
        pos = relative_position_table(t_up, t_up, x.shape[-1], x.device, x.dtype)
        for block in self.up_encoders:
            x = block(x, pos, mask)
        x = self.after_norm(x)

        valid = None
        if up_lens is not None:
            valid = (torch.arange(t_up, device=x.device).unsqueeze(0) < up_lens.to(x.device).unsqueeze(1))
            valid = valid.unsqueeze(1)
        return x, valid
