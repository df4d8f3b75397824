"""CosyVoice3's NSF excitation: f0 at frame rate -> one-channel source at sample rate, with the fixed noise table.

Upstream (``SineGen2``, causal) works at sample rate: f0 repeated 480x, per-sample cycles ``(f0·k / sr) % 1`` for
the 9 harmonics, a random initial phase added to sample 0, then ``interpolate(linear, 1/480)`` down to frame rate,
``cumsum · 2π``, ×480, ``interpolate(nearest, 480)`` back up, ``sin``.  The linear down-sampling reads samples
``480j + 239`` and ``480j + 240`` of frame j, both equal to that frame's value (weights exactly 1/2), so the frame
values are just the per-frame cycles, and sample 0 (where ``rand_ini`` was added) is never read: ``rand_ini``
cannot change the output, and the phase is computed at frame rate here.  The nearest up-sampling maps sample i to
frame ``i // 480`` for every length the table allows (checked).

Streaming: the phase is a running sum, so :meth:`CausalSineSource.forward` takes the sum of the frames before
``f0`` (``phase0``, float64) and returns it updated.  On the CPU torch's float32 ``cumsum`` accumulates in float64
and rounds each output, so a running float64 sum gives bit-identical phases to one call over the whole utterance.
The noise of sample i is row i of the table wherever the chunk starts.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from cosyvoice_fast.config.causal_hift import CausalHiFTConfig
from cosyvoice_fast.vocoder.model.causal_noise import NoiseTable


class CausalSineSource(nn.Module):
    """``m_source`` of the checkpoint (only ``l_linear`` is a weight); ``noise`` is the fixed table (not saved)."""

    def __init__(self, cfg: CausalHiFTConfig, noise: NoiseTable):
        super().__init__()
        self.sampling_rate = cfg.sampling_rate
        self.upsample = cfg.upsample_factor
        self.n_harmonics = cfg.n_harmonics
        self.sine_amp = cfg.nsf_alpha
        self.noise_std = cfg.nsf_sigma
        self.voiced_threshold = cfg.nsf_voiced_threshold
        self.l_linear = nn.Linear(self.n_harmonics, 1)
        self.noise = noise

    def frame_phase(self, f0: Tensor, phase0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(B, T) float32 f0 -> ((B, T, H) float32 phase in radians at the end of each frame's cycle sum,
        (B, H) float64 running cycle sum after the last frame).  ``phase0``: the sum before ``f0`` (None: 0)."""
        mult = torch.arange(1, self.n_harmonics + 1, device=f0.device, dtype=f0.dtype)
        cycles = (f0.unsqueeze(-1) * mult / self.sampling_rate) % 1  # (B, T, H), as upstream per sample
        acc = cycles.double()
        if phase0 is not None:
            acc = torch.cat([phase0.to(acc).unsqueeze(1), acc], dim=1)
        acc = torch.cumsum(acc, dim=1)
        if phase0 is not None:
            acc = acc[:, 1:]
        summed = acc.to(f0.dtype)  # float32 f0: upstream's float32 phase, rounded from the float64 sum
        return summed * 2 * math.pi, acc[:, -1] if acc.shape[1] else phase0

    def excitation(self, f0: Tensor, noise: Tensor, phase0: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(B, T) f0 and (B, T * 480, H) noise rows -> ((B, 1, T * 480) source, (B, H) float64 phase sum)."""
        frame_phase, phase_end = self.frame_phase(f0, phase0)
        phase = (frame_phase * self.upsample).repeat_interleave(self.upsample, dim=1)  # nearest x480
        sines = torch.sin(phase) * self.sine_amp
        uv = (f0 > self.voiced_threshold).to(f0.dtype).repeat_interleave(self.upsample, dim=1).unsqueeze(-1)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        excitation = sines * uv + noise_amp * noise.to(sines)
        return torch.tanh(self.l_linear(excitation)).transpose(1, 2), phase_end

    def forward(self, f0: Tensor, phase0: Tensor | None = None, offset: int = 0) -> tuple[Tensor, Tensor]:
        """(B, T) f0 of the frames starting at sample ``offset`` of the utterance -> ((B, 1, T * 480) source,
        (B, H) float64 phase sum); every row takes table rows ``[offset, offset + T * 480)``."""
        n = f0.shape[1] * self.upsample
        noise = self.noise.rows(offset, offset + n, f0.device).expand(f0.shape[0], -1, -1)
        return self.excitation(f0, noise, phase0)
