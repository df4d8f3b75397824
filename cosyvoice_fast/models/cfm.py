"""Conditional flow matching sampler: Euler steps on a cosine time grid with classifier-free guidance.

The ODE always starts from the same fixed noise (``torch.randn(1, 80, 15000)`` from a generator seeded 0),
truncated to the utterance length: upstream does this so that re-running a longer prefix in streaming gives
the same starting point for the frames already emitted.  Guidance runs the conditional and unconditional
estimates as one batch of 2 (row 1 has mu, speaker and prompt condition zeroed) and mixes them as
``(1 + w) · v_cond − w · v_uncond``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..config import CFMConfig, DecoderConfig
from .flow_decoder import CausalConditionalDecoder

NOISE_FRAMES = 15000


def fixed_noise(n_frames: int = NOISE_FRAMES, channels: int = 80) -> Tensor:
    """The fixed CFM start noise, drawn on CPU from its own generator (the global RNG is untouched)."""
    return torch.randn(1, channels, n_frames, generator=torch.Generator().manual_seed(0))


def time_grid(n_steps: int, scheduler: str, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``n_steps + 1`` flow times from 0 to 1; 'cosine' spends more steps near t = 0."""
    t = torch.linspace(0, 1, n_steps + 1, device=device, dtype=dtype)
    if scheduler == "cosine":
        t = 1 - torch.cos(t * 0.5 * math.pi)
    return t


class CausalCFM(nn.Module):
    """Holds the estimator (``estimator.*`` keys) and runs the guided Euler solve."""

    def __init__(self, cfg: CFMConfig, decoder_cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.estimator = CausalConditionalDecoder(decoder_cfg)
        self.register_buffer("noise", fixed_noise(), persistent=False)

    def guided_velocity(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                        streaming: bool) -> Tensor:
        """One estimator call with CFG for a batch-1 state ``x`` at flow time ``t`` (a 0-dim or (1,) tensor)."""
        zeros_mu, zeros_spk, zeros_cond = torch.zeros_like(mu), torch.zeros_like(spks), torch.zeros_like(cond)
        v = self.estimator(torch.cat([x, x]), torch.cat([mask, mask]), torch.cat([mu, zeros_mu]),
                           t.reshape(1).expand(2), torch.cat([spks, zeros_spk]), torch.cat([cond, zeros_cond]),
                           streaming)
        v_cond, v_uncond = v[:1], v[1:]
        w = self.cfg.inference_cfg_rate
        return (1.0 + w) * v_cond - w * v_uncond

    def forward(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, n_timesteps: int = 10,
                streaming: bool = False, noise: Tensor | None = None) -> Tensor:
        """(1, 80, T) conditions -> (1, 80, T) mel in fp32."""
        if mu.shape[0] != 1:
            raise ValueError("the CFM runs one utterance at a time (batch 1, CFG doubles it)")
        frames = mu.shape[2]
        start = self.noise if noise is None else noise
        if frames > start.shape[2]:
            raise ValueError(f"{frames} mel frames exceed the fixed noise length {start.shape[2]} "
                             f"({start.shape[2] / 50:.0f} s); split the text into shorter segments")
        x = start[:, :, :frames].to(device=mu.device, dtype=mu.dtype)
        grid = time_grid(n_timesteps, self.cfg.t_scheduler, mu.device, mu.dtype)
        spks = spks.to(mu.dtype)
        for i in range(n_timesteps):
            dt = grid[i + 1] - grid[i]
            x = x + dt * self.guided_velocity(x, mask, mu, grid[i], spks, cond, streaming)
        return x.float()
