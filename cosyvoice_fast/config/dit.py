"""CosyVoice3's flow hyperparameters (``CausalMaskedDiffWithDiT``), read from ``cosyvoice3.yaml`` as inert data.

CosyVoice3 drops CosyVoice2's conformer encoder: token embedding -> pre-look-ahead conv pair -> repeat x2 -> the
same guided CFM, whose estimator is a DiT.  The sizes here are the ones ``flow.pt`` must match; everything that
can be missing or malformed raises :class:`ConfigError` naming the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cosyvoice_fast.config.sections import CFMConfig, cfm_config_from_doc
from cosyvoice_fast.config.yamlfile import ConfigError, require


@dataclass(frozen=True, slots=True)
class DiTConfig:
    """The DiT estimator (``flow.decoder.estimator``): AdaLN-Zero transformer blocks over mel frames."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # frames per attention chunk while streaming
    num_decoding_left_chunks: int = -1  # < 0: every left chunk is visible
    time_freq_dim: int = 256  # sinusoidal time embedding width (fixed by upstream's TimestepEmbedding)
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16

    def __post_init__(self) -> None:
        for name in ("dim", "depth", "heads", "dim_head", "ff_mult", "mel_dim", "mu_dim", "static_chunk_size"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"DiT {name}={getattr(self, name)!r} must be a positive integer")
        if self.dim_head % 2:
            raise ConfigError(f"DiT dim_head={self.dim_head} must be even (rotary positions rotate channel pairs)")
        if self.dim % self.conv_pos_groups:
            raise ConfigError(f"DiT dim={self.dim} must be divisible by the {self.conv_pos_groups} conv groups")
        if self.num_decoding_left_chunks >= 0:
            raise ConfigError(f"DiT num_decoding_left_chunks={self.num_decoding_left_chunks}: only -1 (all left "
                              "chunks, upstream's CosyVoice3 setting) is supported")

    @property
    def inner_dim(self) -> int:
        return self.heads * self.dim_head

    @property
    def in_features(self) -> int:
        """Width of ``input_embed.proj``'s input: x, cond, mu and the speaker vector side by side."""
        return 2 * self.mel_dim + self.mu_dim + self.spk_dim


@dataclass(frozen=True, slots=True)
class DiTFlowConfig:
    """``CausalMaskedDiffWithDiT``: speech tokens + prompt + speaker vector -> 80-bin mel at 50 Hz."""

    input_size: int = 80  # token embedding width (= mel channels: no encoder in between)
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    dit: DiTConfig = field(default_factory=DiTConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)

    def __post_init__(self) -> None:
        if self.dit.static_chunk_size % self.token_mel_ratio:
            raise ConfigError(f"DiT static_chunk_size={self.dit.static_chunk_size} must be a whole number of tokens "
                              f"(a multiple of token_mel_ratio={self.token_mel_ratio})")
        if self.input_size != self.dit.mu_dim:
            raise ConfigError(f"flow input_size={self.input_size} must equal the DiT's mu_dim={self.dit.mu_dim}")

    @property
    def chunk_tokens(self) -> int:
        """Speech tokens per DiT attention chunk (25 for the real model)."""
        return self.dit.static_chunk_size // self.token_mel_ratio


_MODEL = "CosyVoice3"  # what a missing field suggests


def dit_flow_config_from_doc(doc: dict[str, Any], fname: str) -> DiTFlowConfig:
    """The ``flow:`` section of an inert ``read_hyperpyyaml`` document -> :class:`DiTFlowConfig`."""
    flow = require(doc, "flow", "", fname, _MODEL)
    tag = getattr(flow, "tag", "")
    if "CausalMaskedDiffWithDiT" not in tag:
        raise ConfigError(f"{fname}: flow is {tag.split('.')[-1] or '?'}, expected CausalMaskedDiffWithDiT "
                          "(a CosyVoice3 model directory)")
    pre = require(flow, "pre_lookahead_layer", "flow.", fname, _MODEL)
    dec = require(flow, "decoder", "flow.", fname, _MODEL)
    est = require(dec, "estimator", "flow.decoder.", fname, _MODEL)
    e = "flow.decoder.estimator."
    try:
        pre_len = int(require(flow, "pre_lookahead_len", "flow.", fname, _MODEL))
        if int(require(pre, "pre_lookahead_len", "flow.pre_lookahead_layer.", fname, _MODEL)) != pre_len:
            raise ConfigError(f"{fname}: flow.pre_lookahead_layer.pre_lookahead_len differs from "
                              f"flow.pre_lookahead_len={pre_len}")
        mel_dim = int(require(est, "mel_dim", e, fname, _MODEL))
        return DiTFlowConfig(
            input_size=int(require(flow, "input_size", "flow.", fname, _MODEL)),
            output_size=int(require(flow, "output_size", "flow.", fname, _MODEL)),
            spk_embed_dim=int(require(flow, "spk_embed_dim", "flow.", fname, _MODEL)),
            vocab_size=int(require(flow, "vocab_size", "flow.", fname, _MODEL)),
            token_mel_ratio=int(require(flow, "token_mel_ratio", "flow.", fname, _MODEL)),
            pre_lookahead_len=pre_len,
            pre_lookahead_channels=int(require(pre, "channels", "flow.pre_lookahead_layer.", fname, _MODEL)),
            dit=DiTConfig(
                dim=int(require(est, "dim", e, fname, _MODEL)),
                depth=int(require(est, "depth", e, fname, _MODEL)),
                heads=int(require(est, "heads", e, fname, _MODEL)),
                dim_head=int(require(est, "dim_head", e, fname, _MODEL)),
                ff_mult=int(require(est, "ff_mult", e, fname, _MODEL)),
                mel_dim=mel_dim,
                mu_dim=int(est.get("mu_dim") or mel_dim),
                spk_dim=int(require(est, "spk_dim", e, fname, _MODEL)),
                out_channels=int(est.get("out_channels") or mel_dim),
                static_chunk_size=int(require(est, "static_chunk_size", e, fname, _MODEL)),
                num_decoding_left_chunks=int(est.get("num_decoding_left_chunks", -1)),
            ),
            cfm=cfm_config_from_doc(dec, fname, _MODEL),
        )
    except ConfigError as err:
        if str(err).startswith(fname):
            raise
        raise ConfigError(f"{fname}: {err}") from err
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{fname}: a flow field has the wrong type ({err})") from err


def tiny_dit_flow_config() -> DiTFlowConfig:
    """The sizes of ``shared/fixtures/cosyvoice3-tiny`` (for synthetic CPU runs; tests read the fixture yaml)."""
    return DiTFlowConfig(pre_lookahead_channels=64, dit=DiTConfig(dim=64, depth=2, heads=4, dim_head=16))
