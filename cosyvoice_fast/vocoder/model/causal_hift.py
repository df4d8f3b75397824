"""CausalHiFTGenerator: CosyVoice3's vocoder, mel (50 Hz) -> 24 kHz waveform, with causal convolutions throughout.

Same network as CosyVoice2's HiFT (:mod:`.hift`: NSF source, upsampling convs with Snake residual blocks, a tiny
iSTFT), except that every convolution pads one side only (:mod:`.causal_layers`): ``conv_pre`` reads 4 frames
ahead, the f0 predictor 3 frames ahead (in float64), everything else looks only back.  The NSF noise comes from a
fixed table (:mod:`.causal_noise`), so the audio is deterministic.

``finalize`` False is upstream's streaming call on the mel so far: the f0 predictor reads its last 3 frames as
context, ``decode`` gets the other frames and reads the last 4 of those as ``conv_pre``'s context, the
excitation's STFT loses the matching 480 frames and the waveform its last 480 samples (the iSTFT's tail, which
the next frame would overlap): ``(T - 8) * 480`` samples.  ``finalize`` True pads zeros instead: ``T * 480``.
Since nothing but those look-aheads reads the future, the samples a call emits are final, and a later call can
recompute them from a bounded window of the past (:mod:`cosyvoice_fast.vocoder.causal_stream`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from cosyvoice_fast.config.causal_hift import CausalHiFTConfig
from cosyvoice_fast.vocoder.model.causal_layers import (CausalConv1d, CausalDownsampleConv, CausalF0Predictor,
                                                         CausalResBlock, CausalUpsampleConv)
from cosyvoice_fast.vocoder.model.causal_noise import NoiseTable
from cosyvoice_fast.vocoder.model.causal_source import CausalSineSource
from cosyvoice_fast.vocoder.model.hift_common import (
    HiFTBase, down_rates, residual_stacks, stage_widths,
)
from cosyvoice_fast.vocoder.model.weightnorm import convert_legacy_weight_norm


class CausalHiFTGenerator(HiFTBase):
    """Attribute names match the keys of CosyVoice3's ``hift.pt``.  ``noise``: the fixed noise table (shared by
    copies; None draws it by replaying upstream's construction from the config)."""

    def __init__(self, cfg: CausalHiFTConfig, noise: NoiseTable | None = None):
        super().__init__(cfg)
        self.look_right = cfg.conv_pre_look_right
        spec_ch = self.n_fft + 2
        widths = stage_widths(cfg)
        ins = [cfg.base_channels] + widths[:-1]

        self.noise = noise if noise is not None else NoiseTable(cfg)
        self.m_source = CausalSineSource(cfg, self.noise)
        self.f0_predictor = CausalF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, cfg.f0_num_class)
        self.conv_pre = weight_norm(CausalConv1d(cfg.in_channels, cfg.base_channels, cfg.conv_pre_look_right + 1,
                                                 look_right=True))
        self.ups = nn.ModuleList(weight_norm(CausalUpsampleConv(cin, c, k, u))
                                 for cin, c, u, k in zip(ins, widths, cfg.upsample_rates, cfg.upsample_kernel_sizes))
        self.down_rates = down_rates(cfg)
        self.source_downs = nn.ModuleList(CausalDownsampleConv(spec_ch, c, s) for c, s in zip(widths, self.down_rates))
        self.source_resblocks, self.resblocks = residual_stacks(CausalResBlock, widths, cfg)
        self.conv_post = weight_norm(CausalConv1d(widths[-1], spec_ch, 7))

    def load_checkpoint(self, state_dict: Mapping[str, Tensor]) -> "CausalHiFTGenerator":
        """Strict load of ``hift.pt`` in either weight-norm key style (``weight_g``/``weight_v`` or
        ``parametrizations.weight.original0/1``)."""
        self.load_state_dict(convert_legacy_weight_norm(state_dict), strict=True)
        return self

    # ------------------------------------------------------------------------------------------ excitation

    def f0(self, mel: Tensor, finalize: bool = True) -> Tensor:
        """(B, 80, T) mel -> (B, T) f0 (finalize) or (B, T - 3) (not: the last 3 frames are look-ahead); float64."""
        return self.f0_predictor(mel, finalize)

    def source(self, f0: Tensor, phase0: Tensor | None = None, offset: int = 0) -> tuple[Tensor, Tensor]:
        """(B, T) float32 f0 starting at sample ``offset`` -> ((B, 1, T * 480) excitation, float64 phase sum)."""
        return self.m_source(f0, phase0, offset)

    # ------------------------------------------------------------------------------------------ filter

    def decode(self, mel: Tensor, source: Tensor, finalize: bool = True) -> Tensor:
        """(B, 80, T) mel and (B, 1, T * 480) excitation -> (B, T * 480) waveform (finalize), else the last 4
        frames are ``conv_pre``'s look-ahead and (B, (T - 5) * 480) samples come out."""
        s_spec = self._source_spectrum(source)
        if finalize:
            x = self.conv_pre(mel)
        else:
            r = self.look_right
            x = self.conv_pre(mel[:, :, :-r], mel[:, :, -r:])
            s_spec = s_spec[:, :, :-(self.samples_per_frame // self.hop) * r]
        last = len(self.ups) - 1
        for i, (up, down, src_block) in enumerate(zip(self.ups, self.source_downs, self.source_resblocks)):
            x = up(F.leaky_relu(x, self.cfg.lrelu_slope))
            if i == last:  # the STFT of T * 480 samples has one frame more than T * 120
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + src_block(down(s_spec))
            x = self._mrf(i, x)
        x = self.conv_post(F.leaky_relu(x))  # default 0.01 slope here, as trained
        wav = self._waveform(x)
        if not finalize:
            wav = wav[:, :-self.samples_per_frame]
        return wav.clamp(-self.cfg.audio_limit, self.cfg.audio_limit)

    # ------------------------------------------------------------------------------------------ full call

    def inference(self, mel: Tensor, finalize: bool = True) -> tuple[Tensor, Tensor]:
        """Upstream's call on a whole mel (B, 80, T): ((B, T * 480) or (B, (T - 8) * 480) waveform, excitation)."""
        f0 = self.f0(mel, finalize).to(mel.dtype)
        source, _ = self.source(f0)
        body = mel if finalize else mel[:, :, :-self.f0_predictor.look_right]
        return self.decode(body, source, finalize), source

    def decode_left_context(self) -> int:
        """Mel frames of the past that decide one output sample of :meth:`decode` (an upper bound): a window that
        starts this many frames before the first sample it must get right reproduces the whole-utterance call.

        Walks back from the waveform: iSTFT overlap and ``conv_post``, then per stage (last first) the residual
        blocks, the source branch (its own residual block, the strided conv and the STFT frame overlap; the
        source itself is carried, not recomputed) and the upsampling conv, dividing by the stage's rate."""
        overlap = -(-self.n_fft // self.hop) + 1
        r = overlap + self.conv_post.pad
        need = 0
        for i in reversed(range(len(self.ups))):
            per_frame = math.prod(self.cfg.upsample_rates[:i + 1])
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            r += max(b.left_context() for b in blocks)
            src = self.source_resblocks[i].left_context() + 1 + -(-overlap // self.down_rates[i])
            need = max(need, -(-(r + src) // per_frame))
            r += self.ups[i].kernel_size[0] - 1 + (1 if i == len(self.ups) - 1 else 0)
            r = -(-r // self.cfg.upsample_rates[i])
        return max(need, r) + 1

    # ------------------------------------------------------------------------------------------ speed

    def remove_weight_norm(self) -> "CausalHiFTGenerator":
        """A copy with weight norm folded into plain weights (fewer kernels; same noise table), except the f0
        predictor, which keeps its parametrisation so that its weights are still evaluated in float64."""
        plain = CausalHiFTGenerator(self.cfg, self.noise)
        plain.load_state_dict(self.state_dict(), strict=True)
        for name, module in plain.named_modules():
            if not name.startswith("f0_predictor") and parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        ref = next(self.parameters())
        return plain.to(device=ref.device, dtype=ref.dtype).train(self.training).requires_grad_(ref.requires_grad)
