"""CosyVoice2's flow and vocoder hyperparameters: the conformer encoder, the U-Net CFM estimator and HiFT.

Siblings of :mod:`cosyvoice_fast.config.dit` and :mod:`cosyvoice_fast.config.causal_hift` (CosyVoice3's); filled by
:mod:`cosyvoice_fast.config.model` from ``cosyvoice2.yaml``, which re-exports them under their old home.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
class CFMConfig:
    """Conditional flow matching sampler settings."""

    in_channels: int = 240
    spk_emb_dim: int = 80
    sigma_min: float = 1e-6
    t_scheduler: str = "cosine"
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10


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
class HiFTConfig:
    """HiFTGenerator (NSF source + iSTFT HiFi-GAN) and its ConvRNN f0 predictor."""

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
