"""Conditional flow matching sampler: Euler steps on a cosine time grid with classifier-free guidance.

The ODE always starts from the same fixed noise (``torch.randn(1, 80, 15000)`` from a generator seeded 0),
truncated to the utterance length: upstream does this so that re-running a longer prefix in streaming gives
the same starting point for the frames already emitted.  Guidance runs the conditional and unconditional
estimates as one batch of 2 (row 1 has mu, speaker and prompt condition zeroed) and mixes them as
``(1 + w) · v_cond − w · v_uncond``.

The solve is split into pieces a faster backend can reuse: ``euler_schedule`` (the step times, computed
once), ``guidance_batch`` (the step-invariant half of the estimator input, built once per solve) and
``euler_step`` / ``guided_velocity`` (one estimator call; the estimator can be swapped for a captured graph).
An estimator that offers ``solve(x, guidance, ts, dts, cfg_rate, streaming)`` may take the whole step loop
(a graph runner replaying one captured step per Euler step); it answers None when it does not serve a call.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor, nn

from cosyvoice_fast.config.model import CFMConfig, DecoderConfig
from cosyvoice_fast.flow.model.decoder import CausalConditionalDecoder

NOISE_FRAMES = 15000

# (x, mask, mu, t, spks, cond, streaming) -> velocity, the estimator's calling convention.
Estimator = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool], Tensor]


def fixed_noise(n_frames: int = NOISE_FRAMES, channels: int = 80) -> Tensor:
    """The fixed CFM start noise, drawn on CPU from its own generator (the global RNG is untouched)."""
    return torch.randn(1, channels, n_frames, generator=torch.Generator().manual_seed(0))


def time_grid(n_steps: int, scheduler: str, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> Tensor:
    """``n_steps + 1`` flow times from 0 to 1; 'cosine' spends more steps near t = 0."""
    if scheduler not in ("cosine", "linear"):
        raise ValueError(f"unknown CFM t_scheduler {scheduler!r}; expected 'cosine' or 'linear'")
    t = torch.linspace(0, 1, n_steps + 1, device=device, dtype=dtype)
    if scheduler == "cosine":
        t = 1 - torch.cos(t * 0.5 * math.pi)
    return t


def euler_schedule(n_steps: int, scheduler: str, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Per-step ``(t, dt)``, each of shape (n_steps,).

    Upstream does not index the grid: it advances ``t += dt`` and takes the next ``dt`` as ``grid[i+1] - t``.
    In fp32 that equals the grid exactly; in bf16/fp16 the running sum can round differently, so the same
    recurrence is followed here, on CPU.  Its ~40 scalar ops cost a few hundred microseconds of host time, on
    the path of every flow chunk, so the result is made once per (steps, scheduler, dtype) and copied out.
    """
    ts, dts = _euler_schedule_cpu(int(n_steps), scheduler, dtype)
    return ts.to(device, copy=True), dts.to(device, copy=True)


@functools.lru_cache(maxsize=32)
def _euler_schedule_cpu(n_steps: int, scheduler: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    grid = time_grid(n_steps, scheduler, "cpu", dtype)
    ts, dts = [], []
    t = grid[0]
    for i in range(n_steps):
        dt = grid[i + 1] - t
        ts.append(t)
        dts.append(dt)
        t = t + dt
    return torch.stack(ts), torch.stack(dts)


class GuidanceBatch(NamedTuple):
    """The parts of the batch-2 (batch-2B for B utterances) estimator input that do not change between Euler
    steps; rows B..2B-1 are the unconditional copies of rows 0..B-1."""

    mask: Tensor  # (2, 1, T)
    mu: Tensor  # (2, 80, T), row 1 zero
    spks: Tensor  # (2, 80), row 1 zero
    cond: Tensor  # (2, 80, T), row 1 zero


class GuidedCFM(nn.Module):
    """Holds an estimator (``estimator.*`` keys) and runs the guided Euler solve.  The estimator is any module
    with the :data:`Estimator` calling convention: CosyVoice2's U-Net (:class:`CausalCFM`) or CosyVoice3's DiT."""

    def __init__(self, cfg: CFMConfig, estimator: nn.Module, channels: int):
        super().__init__()
        self.cfg = cfg
        self.estimator = estimator
        # Not in the checkpoint (persistent=False); being a buffer, ``.to(device)`` moves it with the module.
        # Note ``.to(dtype)`` casts it too, which matches upstream casting the noise to mu's dtype.
        self.register_buffer("noise", fixed_noise(channels=channels), persistent=False)

    @staticmethod
    def guidance_batch(mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor) -> GuidanceBatch:
        """Stack the conditional rows and the all-zero unconditional rows (batch B inputs -> batch 2B)."""
        return GuidanceBatch(mask=torch.cat([mask, mask]).to(mu.dtype),
                             mu=torch.cat([mu, torch.zeros_like(mu)]),
                             spks=torch.cat([spks, torch.zeros_like(spks)]).to(mu.dtype),
                             cond=torch.cat([cond, torch.zeros_like(cond)]).to(mu.dtype))

    def guided_velocity(self, x: Tensor, t: Tensor, g: GuidanceBatch, streaming: bool,
                        estimator: Estimator | None = None) -> Tensor:
        """One estimator call on the batch of 2 at flow time ``t`` (0-dim or (1,)), mixed by the CFG rate.

        ``estimator`` replaces ``self.estimator`` (e.g. a CUDA-graph runner with the same signature).
        """
        est = self.estimator if estimator is None else estimator
        b = x.shape[0]  # 1 for one utterance; B for a batched solve (rows: B conditional, then B zero rows)
        v = est(torch.cat([x, x]), g.mask, g.mu, t.reshape(1).expand(2 * b), g.spks, g.cond, streaming)
        w = self.cfg.inference_cfg_rate
        return (1.0 + w) * v[:b] - w * v[b:]

    def euler_step(self, x: Tensor, t: Tensor, dt: Tensor, g: GuidanceBatch, streaming: bool,
                   estimator: Estimator | None = None) -> Tensor:
        """State after step ``i`` given ``t = ts[i]``, ``dt = dts[i]`` from :func:`euler_schedule`."""
        return x + dt * self.guided_velocity(x, t, g, streaming, estimator)

    def start_noise(self, frames: int, device: torch.device, dtype: torch.dtype,
                    noise: Tensor | None = None) -> Tensor:
        """The first ``frames`` frames of the fixed noise (or of ``noise``), on ``device`` in ``dtype``."""
        start = self.noise if noise is None else noise
        if frames > start.shape[2]:
            raise ValueError(f"{frames} mel frames exceed the fixed noise length {start.shape[2]} "
                             f"({start.shape[2] / 50:.0f} s); split the text into shorter segments")
        return start[:, :, :frames].to(device=device, dtype=dtype)

    def forward(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, n_timesteps: int = 10,
                streaming: bool = False, noise: Tensor | None = None, *,
                estimator: Estimator | None = None) -> Tensor:
        """(1, 80, T) encoder output, (1, 1, T) mask, (1, 80) speaker, (1, 80, T) prompt mel -> (1, 80, T) mel.

        Computed in mu's dtype, returned in fp32.
        """
        if mu.shape[0] != 1:
            raise ValueError("the CFM runs one utterance at a time (batch 1, CFG doubles it); "
                             "use solve_batch for several right-padded utterances")
        return self.solve_batch(mu, mask, spks, cond, n_timesteps, streaming, noise, estimator=estimator)

    def solve_batch(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, n_timesteps: int = 10,
                    streaming: bool = False, noise: Tensor | None = None, *,
                    estimator: Estimator | None = None) -> Tensor:
        """The guided Euler solve for B utterances at once: (B, 80, T) mu, (B, 1, T) mask, (B, 80) speakers,
        (B, 80, T) conditions -> (B, 80, T) mel in fp32.

        Each row is one utterance right-padded to the common ``T`` (mask 0 on its padding, mu/cond zero there).
        The estimator sees ``2B`` rows: the B conditional rows, then the B unconditional (all-zero) rows, and
        row ``i`` is mixed with row ``B + i``.  Every row starts from the same fixed noise ``noise[:, :, :T]``,
        which on its valid frames is exactly what the utterance gets alone (the noise is indexed by frame
        position); right padding never reaches valid frames (see ``backends/cudagraph_flow.py``), so each row
        equals its own batch-1 solve.
        """
        b = mu.shape[0]
        x = self.start_noise(mu.shape[2], mu.device, mu.dtype, noise)
        if b != 1:
            x = x.expand(b, -1, -1).contiguous()
        ts, dts = euler_schedule(n_timesteps, self.cfg.t_scheduler, "cpu", mu.dtype)
        g = self.guidance_batch(mu, mask, spks, cond)
        solve = getattr(estimator, "solve", None)  # a graph runner that replays whole solves
        if solve is not None:
            out = solve(x, g, ts, dts, self.cfg.inference_cfg_rate, streaming)
            if out is not None:
                return out.float()
        ts, dts = ts.to(mu.device), dts.to(mu.device)
        for i in range(n_timesteps):
            x = self.euler_step(x, ts[i], dts[i], g, streaming, estimator)
        return x.float()


class CausalCFM(GuidedCFM):
    """CosyVoice2's CFM: the guided solve around the U-Net estimator."""

    def __init__(self, cfg: CFMConfig, decoder_cfg: DecoderConfig):
        super().__init__(cfg, CausalConditionalDecoder(decoder_cfg), decoder_cfg.out_channels)
