"""HiFTGenerator: mel (50 Hz) + NSF excitation -> 24 kHz waveform (HiFi-GAN upsampler ending in an iSTFT).

The network upsamples the mel by ``prod(upsample_rates)`` (120) with transposed convs and multi-receptive-field
residual blocks, predicting a tiny STFT (n_fft 16, hop 4) instead of samples; ``torch.istft`` turns it into
audio, supplying the last factor of 4.  At every resolution the STFT of the excitation from
:mod:`.hift_source`, strided down to that resolution, is added in, which is what pins the output pitch.

The work is split so that backends can swap pieces: :meth:`HiFTGenerator.f0` and
:meth:`HiFTGenerator.source` (random) produce the excitation, :meth:`HiFTGenerator.decode` is a pure function
of (mel, excitation) - the part worth capturing in a CUDA graph - and :meth:`HiFTGenerator.inference` chains
them with the streaming rule of forcing the previous chunk's excitation onto the head of the new one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice_fast.config.model import HiFTConfig
from cosyvoice_fast.vocoder.model.hift_common import (  # noqa: F401 - istft re-exported: its home before CosyVoice3
    HiFTBase, SnakeUnits, down_rates, istft, residual_stacks, stage_widths,
)
from cosyvoice_fast.vocoder.model.source import F0Predictor, HarmonicNoiseSource


class Snake(nn.Module):
    """Periodic activation x + sin^2(a x) / a with a learnt per-channel frequency ``a`` (linear scale)."""

    EPS = 1e-9  # keeps 1/a finite for a channel whose a was trained to zero

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        a = self.alpha.view(1, -1, 1)
        return x + (1.0 / (a + self.EPS)) * torch.sin(x * a).pow(2)


def time_major(x: Tensor) -> Tensor:
    """The same (B, C, T) values stored time-major (strides (T·C, 1, C)).  cuDNN's fast fp32/TF32 convolutions
    work in that layout (NHWC) and wrap two layout transposes around each call on channel-major tensors; a
    conv stack kept time-major (:func:`conv_time_major`) skips them.  Elementwise ops keep the layout."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def weight_4d(conv: nn.Module) -> Tensor:
    """A 1-D convolution's weight as the channels-last 4-D weight of the equivalent 2-D convolution (kernel 1 x
    K): what :func:`conv_time_major` takes, made once (a copy: it goes stale if the weight changes)."""
    return conv.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)


def conv_time_major(conv: nn.Module, weight4: Tensor, x: Tensor, bias: bool = True) -> Tensor:
    """``conv(x)`` (a ``Conv1d`` or ``ConvTranspose1d``, groups 1) for a time-major ``x``, computed as the 2-D
    convolution of its (B, C, 1, T) view, which is channels-last: PyTorch hands cuDNN NHWC tensors, so no
    transposes run (PyTorch's 1-D path would make the input channel-major first).  Returns time-major
    (B, C', T'); ``bias=False`` leaves the bias out (the fused residual units add it in their pass)."""
    x4 = x.unsqueeze(2)
    b = conv.bias if bias else None
    stride, padding, dilation = (1, conv.stride[0]), (0, conv.padding[0]), (1, conv.dilation[0])
    if isinstance(conv, nn.ConvTranspose1d):
        y = F.conv_transpose2d(x4, weight4, b, stride, padding, (0, conv.output_padding[0]), 1, dilation)
    else:
        y = F.conv2d(x4, weight4, b, stride, padding, dilation)
    return y.squeeze(2)


def _same_padding(kernel: int, dilation: int) -> int:
    return (kernel - 1) * dilation // 2


class SnakeResBlock(SnakeUnits):
    """One residual unit per dilation: Snake -> dilated conv -> Snake -> conv, added back to its input.

    Lengths are preserved ("same" padding), so the block can sit anywhere in the upsampling chain.
    """

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel, dilation=d, padding=_same_padding(kernel, d)))
            for d in dilations)
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel, padding=_same_padding(kernel, 1)))
            for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)


class HiFTGenerator(HiFTBase):
    """CosyVoice2's vocoder; attribute names match the keys of ``hift.pt``.

    ``time_major`` (off by default; a speed setting, not a weight): :meth:`decode` runs its conv stack on
    time-major activations (see :func:`time_major`), through :func:`conv_time_major` for every convolution that
    carries a ``weight4`` buffer (:func:`weight_4d`; the fused vocoder's private copy gets them).  Same maths;
    on a GPU, cuDNN may pick other algorithms (float rounding)."""

    time_major = False
    #: a replacement for the filter network's ``Conv1d`` calls, ``fn(conv, x) -> conv(x)`` (a speed setting a
    #: backend installs, e.g. the fused vocoder's Triton convolutions); None: PyTorch's
    conv_override = None

    def __init__(self, cfg: HiFTConfig):
        super().__init__(cfg)
        spec_ch = self.n_fft + 2  # real and imaginary parts of n_fft // 2 + 1 bins
        widths = stage_widths(cfg)

        self.m_source = HarmonicNoiseSource(cfg)
        self.f0_predictor = F0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, cfg.f0_num_class)
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, cfg.base_channels, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(c * 2, c, k, stride=u, padding=(k - u) // 2))
            for c, u, k in zip(widths, cfg.upsample_rates, cfg.upsample_kernel_sizes))

        self.source_downs = nn.ModuleList(
            nn.Conv1d(spec_ch, c, 1) if s == 1 else nn.Conv1d(spec_ch, c, 2 * s, stride=s, padding=s // 2)
            for c, s in zip(widths, down_rates(cfg)))
        self.source_resblocks, self.resblocks = residual_stacks(SnakeResBlock, widths, cfg)
        self.conv_post = weight_norm(nn.Conv1d(widths[-1], spec_ch, 7, padding=3))


    # ------------------------------------------------------------------------------------------ excitation

    def f0(self, mel: Tensor) -> Tensor:
        """(B, 80, T) mel -> (B, T) predicted f0 in Hz."""
        return self.f0_predictor(mel)

    def source(self, f0: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """(B, T) f0 -> (B, 1, T * 480) excitation; the only random step of the vocoder (see HarmonicNoiseSource)."""
        return self.m_source(f0, generator)

    # ------------------------------------------------------------------------------------------ filter

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """(B, 80, T) mel and (B, 1, T * 480) excitation -> (B, T * 480) waveform in [-0.99, 0.99].

        Deterministic: all randomness is in ``source``.
        """
        s_spec = self._source_spectrum(source)
        if self.time_major:
            mel, s_spec = time_major(mel), time_major(s_spec)
        conv = self._conv
        x = conv(self.conv_pre, mel)
        last = len(self.ups) - 1
        for i, (up, down, src_block) in enumerate(zip(self.ups, self.source_downs, self.source_resblocks)):
            x = conv(up, F.leaky_relu(x, self.cfg.lrelu_slope))
            if i == last:
                # the transposed convs yield T*120 steps; the STFT of T*480 samples has one frame more
                x = F.pad(x, (1, 0), mode="reflect")
                if self.time_major:  # the pad's output is channel-major again
                    x = time_major(x)
            x = x + src_block(conv(down, s_spec))
            x = self._mrf(i, x)
        x = conv(self.conv_post, F.leaky_relu(x))  # default 0.01 slope here, as trained
        wav = self._waveform(x)
        return wav.clamp(-self.cfg.audio_limit, self.cfg.audio_limit)

    def _conv(self, conv: nn.Module, x: Tensor) -> Tensor:
        if self.conv_override is not None and isinstance(conv, nn.Conv1d):
            return self.conv_override(conv, x)
        w4 = getattr(conv, "weight4", None)
        return conv_time_major(conv, w4, x) if self.time_major and w4 is not None else conv(x)

    # ------------------------------------------------------------------------------------------ full call

    def inference(self, mel: Tensor, cache_source: Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """(B, 80, T) mel -> ((B, T * 480) waveform, (B, 1, T * 480) excitation used).

        ``cache_source`` (B, 1, N), when non-empty, replaces the first N excitation samples: in streaming the
        new mel starts with the previous chunk's last frames, and reusing that chunk's excitation there keeps
        the harmonic phase (and noise) identical across the overlap that is then cross-faded.
        """
        source = self.source(self.f0(mel), generator)
        if cache_source is not None and cache_source.shape[-1] > 0:
            n = cache_source.shape[-1]
            if n > source.shape[-1]:
                raise ValueError(f"cache_source has {n} samples but this call only makes {source.shape[-1]}")
            source = torch.cat([cache_source.to(source), source[:, :, n:]], dim=2)
        return self.decode(mel, source), source

    # ------------------------------------------------------------------------------------------ speed

    def remove_weight_norm(self) -> HiFTGenerator:
        """A copy with every weight-norm parametrisation folded into a plain weight (faster; not loadable
        from ``hift.pt`` any more, since its keys become ``X.weight``).  ``self`` is left untouched.

        The copy is built fresh rather than deep-copied: parametrised modules share a generated class with
        their deep copies, and un-parametrising the copy would strip the ``weight`` property from ``self``.
        """
        plain = HiFTGenerator(self.cfg)
        plain.load_state_dict(self.state_dict(), strict=True)
        for module in plain.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        ref = next(self.parameters())
        plain = plain.to(device=ref.device, dtype=ref.dtype).train(self.training)
        return plain.requires_grad_(ref.requires_grad)
