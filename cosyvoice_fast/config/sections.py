"""The yaml sections CosyVoice2 and CosyVoice3 write alike: the CFM sampler's ``cfm_params`` and the HiFT sizes.

Both families' flows wrap their estimator in the same guided CFM, and both vocoders are an NSF source + iSTFT
HiFi-GAN of the same shape (CosyVoice3's adds causal padding and a replayed noise table).  The dataclasses and
their readers live here once, so :mod:`cosyvoice_fast.config.cosyvoice2`, :mod:`~cosyvoice_fast.config.dit` and
:mod:`~cosyvoice_fast.config.causal_hift` each state only the fields that are their family's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cosyvoice_fast.config.yamlfile import require


@dataclass(frozen=True, slots=True)
class CFMConfig:
    """Conditional flow matching sampler settings."""

    in_channels: int = 240
    spk_emb_dim: int = 80
    sigma_min: float = 1e-6
    t_scheduler: str = "cosine"
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10


@dataclass(frozen=True, slots=True)
class HiFTSizes:
    """What every HiFT generator (NSF source + iSTFT HiFi-GAN) and its f0 predictor are sized by; each family's
    vocoder config is a subclass (``HiFTConfig``, ``CausalHiFTConfig``), so the two stay distinct types."""

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
    f0_num_class: int = 1
    f0_in_channels: int = 80
    f0_cond_channels: int = 512

    @property
    def upsample_factor(self) -> int:
        """Waveform samples per mel frame (480 at 24 kHz)."""
        n = self.istft_hop_len
        for r in self.upsample_rates:
            n *= r
        return n


def cfm_config_from_doc(dec: Any, fname: str, model: str) -> CFMConfig:
    """``flow.decoder`` (its ``in_channels``, ``spk_emb_dim`` and optional ``cfm_params``) -> :class:`CFMConfig`;
    ``model`` names the directory kind a missing field suggests.  Conversion errors propagate (callers wrap)."""
    cfm = dec.get("cfm_params", {})
    cfm = cfm.get("content", cfm) if isinstance(cfm, dict) else {}
    return CFMConfig(
        in_channels=int(require(dec, "in_channels", "flow.decoder.", fname, model)),
        spk_emb_dim=int(require(dec, "spk_emb_dim", "flow.decoder.", fname, model)),
        sigma_min=float(cfm.get("sigma_min", 1e-6)),
        t_scheduler=str(cfm.get("t_scheduler", "cosine")),
        inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
    )


def hift_sizes_from_doc(hift: Any, istft: Any, f0p: Any, fname: str, model: str) -> dict[str, Any]:
    """The :class:`HiFTSizes` fields of the ``hift:`` section, its ``istft_params`` and ``f0_predictor``, as keyword
    arguments for the family's subclass (which adds its own).  Conversion errors propagate (callers wrap)."""

    def get(key: str) -> Any:
        return require(hift, key, "hift.", fname, model)

    def ints(key: str) -> tuple[int, ...]:
        return tuple(int(r) for r in get(key))

    def nested(key: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(x) for x in r) for r in get(key))

    return dict(
        in_channels=int(get("in_channels")),
        base_channels=int(get("base_channels")),
        nb_harmonics=int(get("nb_harmonics")),
        sampling_rate=int(get("sampling_rate")),
        nsf_alpha=float(get("nsf_alpha")),
        nsf_sigma=float(get("nsf_sigma")),
        nsf_voiced_threshold=float(get("nsf_voiced_threshold")),
        upsample_rates=ints("upsample_rates"),
        upsample_kernel_sizes=ints("upsample_kernel_sizes"),
        istft_n_fft=int(require(istft, "n_fft", "hift.istft_params.", fname, model)),
        istft_hop_len=int(require(istft, "hop_len", "hift.istft_params.", fname, model)),
        resblock_kernel_sizes=ints("resblock_kernel_sizes"),
        resblock_dilation_sizes=nested("resblock_dilation_sizes"),
        source_resblock_kernel_sizes=ints("source_resblock_kernel_sizes"),
        source_resblock_dilation_sizes=nested("source_resblock_dilation_sizes"),
        lrelu_slope=float(hift.get("lrelu_slope", 0.1)),
        audio_limit=float(hift.get("audio_limit", 0.99)),
        f0_num_class=int(f0p.get("num_class", 1)),
        f0_in_channels=int(require(f0p, "in_channels", "hift.f0_predictor.", fname, model)),
        f0_cond_channels=int(require(f0p, "cond_channels", "hift.f0_predictor.", fname, model)),
    )
