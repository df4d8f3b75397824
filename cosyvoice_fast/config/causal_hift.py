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

from cosyvoice_fast.config.yamlfile import ConfigError


@dataclass(frozen=True, slots=True)
class CausalHiFTConfig:
    """The causal HiFT generator, its causal f0 predictor and the noise-table replay (real-model defaults)."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4
    f0_num_class: int = 1
    f0_in_channels: int = 80
    f0_cond_channels: int = 512
    #: samples in upstream's fixed noise table (``300 * 24000`` in SineGen2): the longest audio one stream can get
    noise_table_len: int = 300 * 24000
    #: what the global generator drew between ``manual_seed(0)`` and the source module (see the module docstring)
    replay_cfm_noise: tuple[int, ...] = (1, 80, 50 * 300)
    replay_flow_vocab_size: int = 6561
    replay_flow_input_size: int = 80
    replay_flow_output_size: int = 80
    replay_spk_embed_dim: int = 192

    @property
    def upsample_factor(self) -> int:
        """Waveform samples per mel frame (480 at 24 kHz)."""
        n = self.istft_hop_len
        for r in self.upsample_rates:
            n *= r
        return n

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


def _get(d: Any, key: str, where: str, fname: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ConfigError(f"{fname}: missing field {where}{key}; is this a CosyVoice3 model directory?")
    return d[key]


def causal_hift_config_from_doc(doc: dict[str, Any], fname: str) -> CausalHiFTConfig:
    """The ``hift:`` section (and its ``f0_predictor``) of an inert ``cosyvoice3.yaml`` dict; errors name ``fname``
    and the field.  The flow fields the noise-table replay needs fall back to the real model's values when the
    file has no ``flow:`` section (a yaml loaded with ``flow`` overridden)."""
    hift = _get(doc, "hift", "", fname)
    tag = getattr(hift, "tag", "")
    if tag and "CausalHiFTGenerator" not in tag:
        raise ConfigError(f"{fname}: hift is {tag.split('.')[-1]}, not CausalHiFTGenerator; "
                          "is this a CosyVoice3 model directory?")
    istft = _get(hift, "istft_params", "hift.", fname)
    f0p = _get(hift, "f0_predictor", "hift.", fname)
    f0_tag = getattr(f0p, "tag", "")
    if f0_tag and "CausalConvRNNF0Predictor" not in f0_tag:
        raise ConfigError(f"{fname}: hift.f0_predictor is {f0_tag.split('.')[-1]}, not CausalConvRNNF0Predictor")
    flow = doc.get("flow") if isinstance(doc.get("flow"), dict) else {}

    def ints(key: str) -> tuple[int, ...]:
        return tuple(int(r) for r in _get(hift, key, "hift.", fname))

    def nested(key: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(x) for x in r) for r in _get(hift, key, "hift.", fname))

    try:
        cfg = CausalHiFTConfig(
            in_channels=int(_get(hift, "in_channels", "hift.", fname)),
            base_channels=int(_get(hift, "base_channels", "hift.", fname)),
            nb_harmonics=int(_get(hift, "nb_harmonics", "hift.", fname)),
            sampling_rate=int(_get(hift, "sampling_rate", "hift.", fname)),
            nsf_alpha=float(_get(hift, "nsf_alpha", "hift.", fname)),
            nsf_sigma=float(_get(hift, "nsf_sigma", "hift.", fname)),
            nsf_voiced_threshold=float(_get(hift, "nsf_voiced_threshold", "hift.", fname)),
            upsample_rates=ints("upsample_rates"),
            upsample_kernel_sizes=ints("upsample_kernel_sizes"),
            istft_n_fft=int(_get(istft, "n_fft", "hift.istft_params.", fname)),
            istft_hop_len=int(_get(istft, "hop_len", "hift.istft_params.", fname)),
            resblock_kernel_sizes=ints("resblock_kernel_sizes"),
            resblock_dilation_sizes=nested("resblock_dilation_sizes"),
            source_resblock_kernel_sizes=ints("source_resblock_kernel_sizes"),
            source_resblock_dilation_sizes=nested("source_resblock_dilation_sizes"),
            lrelu_slope=float(hift.get("lrelu_slope", 0.1)),
            audio_limit=float(hift.get("audio_limit", 0.99)),
            conv_pre_look_right=int(hift.get("conv_pre_look_right", 4)),
            f0_num_class=int(f0p.get("num_class", 1)),
            f0_in_channels=int(_get(f0p, "in_channels", "hift.f0_predictor.", fname)),
            f0_cond_channels=int(_get(f0p, "cond_channels", "hift.f0_predictor.", fname)),
            replay_flow_vocab_size=int(flow.get("vocab_size", 6561)),
            replay_flow_input_size=int(flow.get("input_size", 80)),
            replay_flow_output_size=int(flow.get("output_size", 80)),
            replay_spk_embed_dim=int(flow.get("spk_embed_dim", 192)),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{fname}: a field of hift has the wrong type ({e})") from e
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
