"""The parts of the HiFT vocoder that CosyVoice2's :mod:`.hift` and CosyVoice3's :mod:`.causal_hift` compute
identically: the excitation's STFT going in, the residual-unit chain and the multi-receptive-field average in
the middle, the log-magnitude / phase iSTFT head coming out.

The two generators differ only in how their convolutions pad (centred or one-sided) and how the excitation is
made; everything here is pure maths on tensors, so one copy keeps both families bit-identical to what each
computed on its own (the same ops in the same order).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def stage_widths(cfg: Any) -> list[int]:
    """Channels after each upsampling stage: ``base_channels`` halved per stage."""
    return [cfg.base_channels // 2 ** (i + 1) for i in range(len(cfg.upsample_rates))]


def down_rates(cfg: Any) -> list[int]:
    """The excitation's STFT runs at the final resolution; stage i sees it strided down by the product of the
    upsample rates still to come after stage i."""
    return [math.prod(cfg.upsample_rates[i + 1:]) for i in range(len(cfg.upsample_rates))]


def residual_stacks(block: Callable[[int, int, tuple[int, ...]], nn.Module], widths: Sequence[int],
                    cfg: Any) -> tuple[nn.ModuleList, nn.ModuleList]:
    """``(source_resblocks, resblocks)`` of ``block(channels, kernel, dilations)``: one per stage on the
    excitation branch, then ``len(resblock_kernel_sizes)`` per stage for :func:`mrf`; built in this order, which
    is the order their random initialisation draws in."""
    source = nn.ModuleList(block(c, k, tuple(d)) for c, k, d in
                           zip(widths, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes))
    mrf_blocks = nn.ModuleList(block(c, k, tuple(d)) for c in widths
                               for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
    return source, mrf_blocks


def hann_window(n_fft: int) -> Tensor:
    """Periodic Hann computed in float64 like scipy's, so the fp32 window is bit-identical to the reference."""
    return torch.hann_window(n_fft, periodic=True, dtype=torch.float64).float()


def istft(spec: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """Inverse of a centred, one-sided STFT: (B, n_fft // 2 + 1, F) complex -> (B, (F - 1) * hop) real.

    Same result as ``torch.istft(spec, n_fft, hop, n_fft, window)`` (inverse FFT, window, overlap-add,
    division by the summed squared window, centre padding trimmed), but built from ops that never read a
    value back to the host: ``torch.istft`` checks the window envelope with a device sync, which makes it
    impossible to capture in a CUDA graph.
    """
    n_frames = spec.shape[-1]
    frames = torch.fft.irfft(spec, n=n_fft, dim=1) * window.unsqueeze(-1)  # (B, n_fft, F)
    full_len = n_fft + hop * (n_frames - 1)
    fold = dict(output_size=(1, full_len), kernel_size=(1, n_fft), stride=(1, hop))
    signal = F.fold(frames, **fold).flatten(1)  # overlap-add
    envelope = F.fold(window.pow(2).view(1, -1, 1).expand(1, n_fft, n_frames), **fold).flatten(1)
    start = n_fft // 2
    end = start + hop * (n_frames - 1)
    return signal[:, start:end] / envelope[:, start:end]


def source_spectrum(source: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """(B, 1, L) excitation -> (B, n_fft + 2, L / hop + 1): real parts then imaginary parts of a centred STFT."""
    spec = torch.stft(source.squeeze(1), n_fft, hop, n_fft, window=window, return_complex=True)
    return torch.cat([spec.real, spec.imag], dim=1)


def spectrum_waveform(x: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """conv_post output (B, n_fft + 2, F) -> (B, (F - 1) * hop) audio: the first n_fft // 2 + 1 channels are a
    log-magnitude (its exp capped at 100), the rest a phase squashed through ``sin`` (the trained models expect
    this squashing; keep it)."""
    bins = n_fft // 2 + 1
    magnitude = torch.exp(x[:, :bins]).clamp(max=1e2)
    phase = torch.sin(x[:, bins:])
    spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    return istft(spec, n_fft, hop, window)


def mrf(blocks: Sequence[nn.Module], x: Tensor) -> Tensor:
    """The multi-receptive-field fusion: the mean of every residual block's output on the same input."""
    acc = blocks[0](x)
    for block in blocks[1:]:
        acc = acc + block(x)
    return acc / len(blocks)


class SnakeUnits(nn.Module):
    """Residual units ``x + conv2(snake2(conv1(snake1(x))))``, one per dilation; subclasses build the four module
    lists (``activations1``, ``convs1``, ``activations2``, ``convs2``: the checkpoints' key names) with their
    own padding.  A base of both families' blocks, not one of them: a backend that swaps CosyVoice2's blocks
    (centred padding) must not take CosyVoice3's."""

    activations1: nn.ModuleList
    convs1: nn.ModuleList
    activations2: nn.ModuleList
    convs2: nn.ModuleList

    def forward(self, x: Tensor) -> Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class HiFTBase(nn.Module):
    """What both generators hold and do alike: the iSTFT sizes, the window, the excitation's spectrum, the
    multi-receptive-field average of stage ``i`` and the waveform head.  Subclasses build the networks (their
    attribute names are their checkpoint's keys) and must set ``resblocks``."""

    resblocks: nn.ModuleList

    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg
        self.n_fft = cfg.istft_n_fft
        self.hop = cfg.istft_hop_len
        self.samples_per_frame = cfg.upsample_factor
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.register_buffer("stft_window", hann_window(self.n_fft), persistent=False)

    def _source_spectrum(self, source: Tensor) -> Tensor:
        return source_spectrum(source, self.n_fft, self.hop, self.stft_window)

    def _mrf(self, stage: int, x: Tensor) -> Tensor:
        return mrf(self.resblocks[stage * self.num_kernels:(stage + 1) * self.num_kernels], x)

    def _waveform(self, x: Tensor) -> Tensor:
        return spectrum_waveform(x, self.n_fft, self.hop, self.stft_window)
