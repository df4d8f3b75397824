"""The causal convolutions of CosyVoice3's HiFT: every layer pads on one side only, so an output sample never
depends on input to its right (except ``conv_pre`` and the f0 predictor's first conv, which read a fixed number of
frames *ahead* and are fed those frames as real context while streaming).

Each class is a plain ``nn.Conv1d`` (so weight norm and the checkpoint's key names apply unchanged) whose
``forward`` does the one-sided padding: zeros, or the caller's ``context`` frames in their place.  That the padding
is one-sided is what makes the vocoder streamable with a bounded left context
(:mod:`cosyvoice_fast.vocoder.causal_stream`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice_fast.vocoder.model.hift import Snake
from cosyvoice_fast.vocoder.model.hift_common import SnakeUnits


class CausalConv1d(nn.Conv1d):
    """Stride-1 conv padded ``(kernel - 1) * dilation`` on one side: ``look_right`` False pads the past (left),
    True pads the future (right); ``context`` (B, C, pad) replaces the zeros by real frames."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, look_right: bool = False):
        super().__init__(cin, cout, kernel, dilation=dilation)
        self.pad = (kernel - 1) * dilation
        self.look_right = look_right

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:  # type: ignore[override]
        if context is None:
            x = F.pad(x, (0, self.pad) if self.look_right else (self.pad, 0))
        elif context.shape[-1] != self.pad:
            raise ValueError(f"context has {context.shape[-1]} frames; this conv reads {self.pad}")
        else:
            x = torch.cat([x, context] if self.look_right else [context, x], dim=2)
        return self._conv_forward(x, self.weight, self.bias)


class CausalUpsampleConv(nn.Conv1d):
    """Nearest-neighbour upsampling by ``rate``, then a left-padded stride-1 conv (CosyVoice3's ``ups.i``)."""

    def __init__(self, cin: int, cout: int, kernel: int, rate: int):
        super().__init__(cin, cout, kernel)
        self.rate = rate

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        x = x.repeat_interleave(self.rate, dim=2)  # = nearest interpolation by an integer factor
        return self._conv_forward(F.pad(x, (self.kernel_size[0] - 1, 0)), self.weight, self.bias)


class CausalDownsampleConv(nn.Conv1d):
    """Left-pad ``rate - 1`` zeros, then a conv of kernel ``2 * rate`` and stride ``rate`` (``source_downs.i``);
    ``rate`` 1 is a plain 1x1 conv."""

    def __init__(self, cin: int, cout: int, rate: int):
        super().__init__(cin, cout, 2 * rate if rate > 1 else 1, stride=rate)
        self.rate = rate

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        if self.rate > 1:
            x = F.pad(x, (self.rate - 1, 0))
        return self._conv_forward(x, self.weight, self.bias)


class CausalResBlock(SnakeUnits):
    """One residual unit per dilation: Snake -> dilated causal conv -> Snake -> causal conv, added back."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(weight_norm(CausalConv1d(channels, channels, kernel, d)) for d in dilations)
        self.convs2 = nn.ModuleList(weight_norm(CausalConv1d(channels, channels, kernel)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def left_context(self) -> int:
        """Samples of the past one output reads (at this block's resolution)."""
        return sum(c1.pad + c2.pad for c1, c2 in zip(self.convs1, self.convs2))


class CausalF0Predictor(nn.Module):
    """``CausalConvRNNF0Predictor``: conv (kernel 4, 3 frames ahead) then 4 left-causal convs (kernel 3), ELU after
    each, weight norm on all five, ``|classifier|``.  Always computed in float64, as upstream does: the source
    integrates f0 into a phase, so f0 rounding grows with the utterance.  Key names: ``condnet.{0,2,4,6,8}``."""

    N_CONVS = 5

    def __init__(self, in_channels: int, cond_channels: int, num_class: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(self.N_CONVS):
            conv = CausalConv1d(in_channels, cond_channels, 4, look_right=True) if i == 0 else \
                CausalConv1d(cond_channels, cond_channels, 3)
            layers += [weight_norm(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    @property
    def look_right(self) -> int:
        return self.condnet[0].pad

    def left_context(self) -> int:
        """Frames of the past one f0 value reads (8 for four kernel-3 convs)."""
        return sum(self.condnet[i].pad for i in range(2, len(self.condnet), 2))

    def forward(self, mel: Tensor, finalize: bool = True) -> Tensor:
        """(B, n_mels, T) -> (B, T) f0 in Hz, float64 (finalize) or (B, T - 3) f0 of all but the last 3 frames,
        which are read as the first conv's right context (not finalize)."""
        x = mel.double()
        r = self.look_right
        for i in range(0, len(self.condnet), 2):
            conv = self.condnet[i]
            w, b = _weight64(conv), conv.bias.double()
            if i == 0:
                # not finalize: the last r frames are the first conv's right context, read but given no output
                x = F.pad(x, (0, r)) if finalize else x
            else:
                x = F.pad(x, (conv.pad, 0))
            x = F.elu(F.conv1d(x, w, b, dilation=conv.dilation))
        y = F.linear(x.transpose(1, 2), self.classifier.weight.double(), self.classifier.bias.double())
        return y.squeeze(-1).abs()


def _weight64(conv: nn.Conv1d) -> Tensor:
    """A conv's weight in float64, weight norm evaluated in float64 (upstream casts the module, then the
    parametrisation runs in that precision); a folded plain weight is just widened."""
    p = getattr(conv, "parametrizations", None)
    if p is not None and "weight" in p:
        g, v = p.weight.original0, p.weight.original1
        return torch._weight_norm(v.double(), g.double(), 0)
    return conv.weight.double()
