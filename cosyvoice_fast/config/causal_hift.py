"""CosyVoice3's vocoder (``CausalHiFTGenerator`` + ``CausalConvRNNF0Predictor``) as a frozen dataclass, read from the
``hift:`` section of ``cosyvoice3.yaml`` (the inert dict of :func:`~cosyvoice_fast.config.yamlfile.read_hyperpyyaml`).

Besides the network sizes it records what the NSF source's fixed noise tables depend on: upstream draws them from
torch's global generator at construction time, after ``set_all_random_seed(0)`` in the flow's CFM and the draws of
every module built in between (the flow's token embedding and speaker projection, then the f0 predictor).  The
replay (:mod:`cosyvoice_fast.vocoder.model.causal_noise`) needs those shapes, so the flow fields it uses are read
here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cosyvoice_fast.config.sections import HiFTSizes, hift_sizes_from_doc
from cosyvoice_fast.config.yamlfile import ConfigError, field_types, require


@dataclass(frozen=True, slots=True)
class CausalHiFTConfig(HiFTSizes):
    """The causal HiFT generator, its causal f0 predictor and the noise-table replay (real-model defaults): the
    shared :class:`~cosyvoice_fast.config.sections.HiFTSizes` plus what is CosyVoice3's own."""

    conv_pre_look_right: int = 4
    #: samples in upstream's fixed noise table (``300 * 24000`` in SineGen2): the longest audio one stream can get
    noise_table_len: int = 300 * 24000
    #: what the global generator drew between ``manual_seed(0)`` and the source module (see the module docstring)
    replay_cfm_noise: tuple[int, ...] = (1, 80, 50 * 300)
    replay_flow_vocab_size: int = 6561
    replay_flow_input_size: int = 80
    replay_flow_output_size: int = 80
    replay_spk_embed_dim: int = 192

    @property
    def n_harmonics(self) -> int:
        """Sine channels of the source: the fundamental plus ``nb_harmonics`` overtones."""
        return self.nb_harmonics + 1

    @property
    def f0_look_right(self) -> int:
        """Frames of right context the f0 predictor's first conv (kernel 4, right-causal) reads: 3."""
        return 3


def tiny_causal_hift_config() -> CausalHiFTConfig:
    """The sizes of ``shared/fixtures/cosyvoice3-tiny`` (HiFT and f0 predictor at 32 channels)."""
    return CausalHiFTConfig(base_channels=32, f0_cond_channels=32)


_MODEL = "CosyVoice3"  # what a missing field suggests


def causal_hift_config_from_doc(doc: dict[str, Any], fname: str) -> CausalHiFTConfig:
    """The ``hift:`` section (and its ``f0_predictor``) of an inert ``cosyvoice3.yaml`` dict; errors name ``fname``
    and the field.  The flow fields the noise-table replay needs fall back to the real model's values when the
    file has no ``flow:`` section (a yaml loaded with ``flow`` overridden)."""
    hift = require(doc, "hift", "", fname, _MODEL)
    tag = getattr(hift, "tag", "")
    if tag and "CausalHiFTGenerator" not in tag:
        raise ConfigError(f"{fname}: hift is {tag.split('.')[-1]}, not CausalHiFTGenerator; "
                          "is this a CosyVoice3 model directory?")
    istft = require(hift, "istft_params", "hift.", fname, _MODEL)
    f0p = require(hift, "f0_predictor", "hift.", fname, _MODEL)
    f0_tag = getattr(f0p, "tag", "")
    if f0_tag and "CausalConvRNNF0Predictor" not in f0_tag:
        raise ConfigError(f"{fname}: hift.f0_predictor is {f0_tag.split('.')[-1]}, not CausalConvRNNF0Predictor")
    flow = doc.get("flow") if isinstance(doc.get("flow"), dict) else {}

    with field_types(fname, "a field of hift"):
        cfg = CausalHiFTConfig(
            **hift_sizes_from_doc(hift, istft, f0p, fname, _MODEL),
            conv_pre_look_right=int(hift.get("conv_pre_look_right", 4)),
            replay_flow_vocab_size=int(flow.get("vocab_size", 6561)),
            replay_flow_input_size=int(flow.get("input_size", 80)),
            replay_flow_output_size=int(flow.get("output_size", 80)),
            replay_spk_embed_dim=int(flow.get("spk_embed_dim", 192)),
        )
    _check(cfg, fname)
    return cfg


def _check(cfg: CausalHiFTConfig, fname: str) -> None:
    """Refuse what the causal generator cannot be: SineGen2 (24 kHz-style source) and consistent list lengths."""
    n = len(cfg.upsample_rates)
    if cfg.sampling_rate == 22050:
        raise ConfigError(f"{fname}: hift.sampling_rate 22050 selects upstream's SineGen, which the causal HiFT "
                          "does not use; CosyVoice3 runs at 24000")
    if len(cfg.upsample_kernel_sizes) != n or len(cfg.source_resblock_kernel_sizes) != n \
            or len(cfg.source_resblock_dilation_sizes) != n:
        raise ConfigError(f"{fname}: hift.upsample_kernel_sizes / source_resblock_* need one entry per upsample "
                          f"rate ({n})")
    if len(cfg.resblock_kernel_sizes) != len(cfg.resblock_dilation_sizes):
        raise ConfigError(f"{fname}: hift.resblock_kernel_sizes and resblock_dilation_sizes differ in length")
    if cfg.base_channels % (2 ** n) != 0:
        raise ConfigError(f"{fname}: hift.base_channels {cfg.base_channels} must be divisible by {2 ** n}")
