"""The excitation half of HiFT: mel -> f0 contour -> harmonic-plus-noise source waveform.

HiFT is a neural source-filter vocoder.  A small conv net guesses the pitch of every mel frame, and the pitch
track is turned into a sample-rate excitation (a sum of sine harmonics on voiced frames, noise everywhere)
that the generator in :mod:`.hift` filters into speech.  Feeding the generator a pitch-locked sine makes
periodicity easy for it; keeping the last chunk's excitation at the head of the next chunk keeps the
harmonic phase continuous across streaming chunks.

Numerics follow the 24 kHz CosyVoice2 source (a per-frame phase increment integrated at frame rate and
linearly interpolated to sample rate).  The reference draws a random initial phase per harmonic, but adds it
to a sample that the frame-rate resampling never reads, so it has no effect; it is therefore not drawn here.
The only randomness left is the additive Gaussian noise, which comes from an explicit ``torch.Generator``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice_fast.config.model import HiFTConfig


class F0Predictor(nn.Module):
    """Five weight-normed 3-tap convs with ELU, then a per-frame linear read-out; |.| keeps f0 non-negative.

    Layer indices in ``condnet`` (0, 2, 4, 6, 8 hold weights, the odd ones are ELUs) are part of the
    checkpoint's key names, hence the flat ``nn.Sequential``.
    """

    N_CONVS = 5

    def __init__(self, in_channels: int, cond_channels: int, num_class: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(self.N_CONVS):
            conv = nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, kernel_size=3, padding=1)
            layers += [weight_norm(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: Tensor) -> Tensor:
        """(B, n_mels, T) -> (B, T) fundamental frequency in Hz (0-ish on unvoiced frames)."""
        hidden = self.condnet(mel).transpose(1, 2)
        return self.classifier(hidden).squeeze(-1).abs()


class HarmonicNoiseSource(nn.Module):
    """f0 at frame rate -> one-channel excitation at sample rate (``m_source`` in the checkpoint).

    Harmonics 1..(nb_harmonics+1) of f0 are generated with amplitude ``sine_amp`` where the frame is voiced
    (f0 above ``voiced_threshold``), Gaussian noise of std ``noise_std`` (voiced) or ``sine_amp / 3``
    (unvoiced) is added, and a learnt linear mix + tanh (``l_linear``) folds the harmonics into one channel.
    """

    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.sampling_rate = cfg.sampling_rate
        self.upsample = cfg.upsample_factor
        self.n_harmonics = cfg.nb_harmonics + 1
        self.sine_amp = cfg.nsf_alpha
        self.noise_std = cfg.nsf_sigma
        self.voiced_threshold = cfg.nsf_voiced_threshold
        self.l_linear = nn.Linear(self.n_harmonics, 1)

    def noise_shape(self, f0: Tensor) -> tuple[int, int, int]:
        """Shape of the standard-normal draw :meth:`from_noise` consumes: (B, T * upsample, n_harmonics)."""
        return f0.shape[0], f0.shape[1] * self.upsample, self.n_harmonics

    def harmonics(self, f0: Tensor) -> tuple[Tensor, Tensor]:
        """Deterministic part: ((B, L, H) scaled sines, (B, L, 1) voiced mask), L = T * upsample.

        The phase is integrated at frame rate (cumulative sum of per-frame cycles per sample, scaled by the
        hop) and linearly interpolated to samples, exactly the operation order of the reference so that the
        fp32 rounding of large phases is the same.
        """
        mult = torch.arange(1, self.n_harmonics + 1, device=f0.device, dtype=f0.dtype)
        cycles = (f0.unsqueeze(-1) * mult / self.sampling_rate) % 1  # (B, T, H) cycles per sample
        frame_phase = torch.cumsum(cycles, dim=1) * 2 * math.pi
        phase = F.interpolate(frame_phase.transpose(1, 2) * self.upsample, scale_factor=float(self.upsample),
                              mode="linear")
        sines = torch.sin(phase).transpose(1, 2) * self.sine_amp
        f0_samples = f0.repeat_interleave(self.upsample, dim=1).unsqueeze(-1)
        voiced = (f0_samples > self.voiced_threshold).to(f0.dtype)
        return sines, voiced

    def from_noise(self, f0: Tensor, noise: Tensor) -> Tensor:
        """(B, T) f0 and a (B, L, H) standard-normal tensor -> (B, 1, L) excitation.  Pure and deterministic."""
        sines, voiced = self.harmonics(f0)
        noise_amp = voiced * self.noise_std + (1 - voiced) * (self.sine_amp / 3)
        excitation = sines * voiced + noise_amp * noise
        return torch.tanh(self.l_linear(excitation)).transpose(1, 2)

    def forward(self, f0: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(B, T) f0 -> (B, 1, T * upsample) excitation; noise drawn from ``generator``.

        Without a generator a fresh, nondeterministically seeded one is used (never the global RNG): pass
        one seeded per request for reproducible audio.
        """
        if generator is None:
            generator = torch.Generator(device=f0.device)
            generator.seed()
        noise = torch.randn(self.noise_shape(f0), generator=generator, device=f0.device, dtype=f0.dtype)
        return self.from_noise(f0, noise)
