"""CosyVoice2's flow and vocoder hyperparameters: the conformer encoder, the U-Net CFM estimator and HiFT.

Siblings of :mod:`cosyvoice_fast.config.dit` and :mod:`cosyvoice_fast.config.causal_hift` (CosyVoice3's), with
their readers of ``cosyvoice2.yaml``; what both families share (CFM, HiFT sizes) is in
:mod:`cosyvoice_fast.config.sections`.  :mod:`cosyvoice_fast.config.model` re-exports them under their old home.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cosyvoice_fast.config.sections import (  # noqa: F401 - CFMConfig re-exported: its home before CosyVoice3
    CFMConfig, HiFTSizes, cfm_config_from_doc, hift_sizes_from_doc,
)
from cosyvoice_fast.config.yamlfile import field_types, require


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """UpsampleConformerEncoder (rel-pos attention, pre-look-ahead, 2x upsampling, 4 up-blocks)."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    static_chunk_size: int = 25
    pre_lookahead_len: int = 3
    upsample_stride: int = 2


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """CausalConditionalDecoder, the CFM estimator (a 1-D U-Net of ResNet + transformer blocks)."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    act_fn: str = "gelu"
    static_chunk_size: int = 50
    num_decoding_left_chunks: int = -1


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """CausalMaskedDiffWithXvec: speech tokens + prompt -> 80-bin mel at 50 Hz."""

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)


@dataclass(frozen=True, slots=True)
class HiFTConfig(HiFTSizes):
    """HiFTGenerator (NSF source + iSTFT HiFi-GAN) and its ConvRNN f0 predictor: the shared sizes, nothing more."""


_MODEL = "CosyVoice2 or CosyVoice3"  # what a missing field suggests (the message predates the family split)


def flow_config_from_doc(doc: dict[str, Any], fname: str) -> FlowConfig:
    """The ``flow:`` section of an inert ``cosyvoice2.yaml`` dict -> :class:`FlowConfig`; errors name the field."""
    flow = require(doc, "flow", "", fname, _MODEL)
    enc = require(flow, "encoder", "flow.", fname, _MODEL)
    dec = require(flow, "decoder", "flow.", fname, _MODEL)
    est = require(dec, "estimator", "flow.decoder.", fname, _MODEL)

    def get(d: Any, key: str, where: str) -> Any:
        return require(d, key, where, fname, _MODEL)

    e = "flow.decoder.estimator."
    with field_types(fname):
        return FlowConfig(
            input_size=int(get(flow, "input_size", "flow.")),
            output_size=int(get(flow, "output_size", "flow.")),
            spk_embed_dim=int(get(flow, "spk_embed_dim", "flow.")),
            vocab_size=int(get(flow, "vocab_size", "flow.")),
            token_mel_ratio=int(get(flow, "token_mel_ratio", "flow.")),
            pre_lookahead_len=int(get(flow, "pre_lookahead_len", "flow.")),
            encoder=EncoderConfig(
                input_size=int(get(enc, "input_size", "flow.encoder.")),
                output_size=int(get(enc, "output_size", "flow.encoder.")),
                attention_heads=int(get(enc, "attention_heads", "flow.encoder.")),
                linear_units=int(get(enc, "linear_units", "flow.encoder.")),
                num_blocks=int(get(enc, "num_blocks", "flow.encoder.")),
                static_chunk_size=int(enc.get("static_chunk_size", 0) or 0),
                pre_lookahead_len=int(get(flow, "pre_lookahead_len", "flow.")),
            ),
            decoder=DecoderConfig(
                in_channels=int(get(est, "in_channels", e)),
                out_channels=int(get(est, "out_channels", e)),
                channels=tuple(int(c) for c in get(est, "channels", e)),
                attention_head_dim=int(get(est, "attention_head_dim", e)),
                n_blocks=int(get(est, "n_blocks", e)),
                num_mid_blocks=int(get(est, "num_mid_blocks", e)),
                num_heads=int(get(est, "num_heads", e)),
                act_fn=str(est.get("act_fn", "gelu")),
                static_chunk_size=int(est.get("static_chunk_size", 50)),
                num_decoding_left_chunks=int(est.get("num_decoding_left_chunks", -1)),
            ),
            cfm=cfm_config_from_doc(dec, fname, _MODEL),
        )


def hift_config_from_doc(doc: dict[str, Any], fname: str) -> HiFTConfig:
    """The ``hift:`` section of an inert ``cosyvoice2.yaml`` dict -> :class:`HiFTConfig`; errors name the field."""
    hift = require(doc, "hift", "", fname, _MODEL)
    istft = require(hift, "istft_params", "hift.", fname, _MODEL)
    f0p = require(hift, "f0_predictor", "hift.", fname, _MODEL)
    with field_types(fname):
        return HiFTConfig(**hift_sizes_from_doc(hift, istft, f0p, fname, _MODEL))
