"""CosyVoice3's streamed vocoding at a bounded cost per chunk.

Upstream's ``token2wav`` appends each chunk's mel to the utterance's whole mel and re-runs HiFT on all of it
(``finalize`` False, so the look-ahead frames are held back), then emits the samples past those already emitted:
chunk k costs O(k).  The causal HiFT makes that unnecessary: apart from the fixed look-aheads (3 frames for the f0
predictor, 4 for ``conv_pre``) every layer only looks back, the excitation's phase is a running sum and its noise
a fixed table indexed by sample.  So a call here keeps per stream (:class:`CausalStreamState`):

* the last mel frames: the f0 predictor's left context (8) plus ``decode``'s (:meth:`~cosyvoice_fast.vocoder.
  model.causal_hift.CausalHiFTGenerator.decode_left_context`, 30 for CosyVoice3) and the held-back look-ahead;
* the excitation of the frames that window covers, the float64 phase sum, and the sample offset (the noise rows);
* how many frames have f0 and how many samples were emitted.

and computes f0 for the new frames only (with 8 frames of left context), and ``decode`` on a window of
``decode_left_context()`` frames before the first sample to emit up to the same end upstream's call has.  Every
output sample of that window past its first ``decode_left_context()`` frames depends only on real inputs, so it
is upstream's sample (float rounding of different-length convolutions aside: ~1e-5).  Per call the decoder
processes ``new frames + decode_left_context() + 5`` frames (5 = the held-back look-ahead ``conv_pre`` 4 + the
iSTFT's last frame) and the f0 predictor ``new frames + 8 + 3``, whatever the utterance's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from cosyvoice_fast.vocoder.model.causal_hift import CausalHiFTGenerator

#: frames the f0 predictor reads ahead (its first conv, kernel 4): a non-final call has f0 up to T - 3
F0_LOOK_RIGHT = 3
#: frames a non-final call holds back: f0 look-ahead 3 + conv_pre look-ahead 4 + the iSTFT tail's frame 1
HELD_BACK = 8


@dataclass
class CausalStreamState:
    """One stream's carry-over between calls (opaque to the engine: it lives in the segment's ``voc_cache``)."""

    mel: Tensor  #: (1, 80, K) the utterance's mel frames [mel_start, n_mel)
    mel_start: int
    n_mel: int  #: frames received so far
    n_f0: int  #: frames whose f0 and excitation exist
    phase: Tensor | None  #: (1, H) float64 sum of cycles over frames [0, n_f0)
    source: Tensor  #: (1, 1, S) excitation of frames [source_start, n_f0)
    source_start: int
    emitted: int  #: frames of audio emitted (samples / 480)
    last_decode_frames: int = 0  #: mel frames the last call's decode processed (tests and telemetry)
    last_f0_frames: int = 0  #: mel frames the last call's f0 predictor processed


def empty_state(mel: Tensor) -> CausalStreamState:
    """The state of a stream before its first chunk (``mel`` gives device and dtype)."""
    return CausalStreamState(mel=mel.new_zeros(1, mel.shape[1], 0), mel_start=0, n_mel=0, n_f0=0, phase=None,
                             source=mel.new_zeros(1, 1, 0), source_start=0, emitted=0)


@dataclass
class StepPlan:
    """What one call needs decoded: ``mel`` (1, 80, n) and ``source`` (1, 1, n * 480) of the window (None: no
    sample to emit yet), its ``finalize``, the samples of its output to drop (``skip``: the left context), and
    the stream's state after the call (None after the final call)."""

    mel: Tensor | None
    source: Tensor | None
    finalize: bool
    skip: int
    state: CausalStreamState | None


def plan_step(hift: CausalHiFTGenerator, state: CausalStreamState | None, mel: Tensor, finalize: bool) -> StepPlan:
    """Everything of a call but ``decode``: f0 and excitation of the new frames, the decode window and the new
    state (see the module docstring).  The state passed in is not modified."""
    if mel.dim() != 3 or mel.shape[0] != 1:
        raise ValueError(f"a stream's mel chunk must be (1, n_mels, frames), got {tuple(mel.shape)}")
    st = state if state is not None else empty_state(mel)
    per = hift.samples_per_frame
    total = st.n_mel + mel.shape[2]
    if total * per > hift.noise.limit:
        raise ValueError(f"{total} mel frames make {total * per} samples, more than CosyVoice3's noise table holds "
                         f"({hift.noise.limit}): split the text into shorter requests")
    mel_all = torch.cat([st.mel, mel.to(st.mel)], dim=2)
    base = st.mel_start
    look, f0_ctx = hift.f0_predictor.look_right, hift.f0_predictor.left_context()

    # f0 and excitation of the frames that now have their look-ahead
    f0_end = total if finalize else total - look
    n_f0, phase, source = st.n_f0, st.phase, st.source
    f0_frames = 0
    if f0_end > n_f0:
        a = max(0, n_f0 - f0_ctx)
        f0 = hift.f0(mel_all[:, :, a - base:], finalize).to(mel_all.dtype)[:, n_f0 - a:]
        f0_frames = total - a
        new_src, phase = hift.source(f0, phase, n_f0 * per)
        source = torch.cat([source, new_src], dim=2)
        n_f0 = f0_end

    # the window whose output past ``skip`` is what upstream's call on the whole mel emits now
    ctx = hift.decode_left_context()
    emit_end = total if finalize else total - HELD_BACK
    win_mel = win_src = None
    skip = decode_frames = 0
    if emit_end > st.emitted:
        w0 = max(0, st.emitted - ctx)
        w1 = total if finalize else total - look
        win_mel = mel_all[:, :, w0 - base:w1 - base]
        win_src = source[:, :, (w0 - st.source_start) * per:(w1 - st.source_start) * per]
        skip, decode_frames = (st.emitted - w0) * per, w1 - w0
    if finalize:
        return StepPlan(win_mel, win_src, True, skip, None)
    emitted = max(st.emitted, emit_end)
    keep_mel = max(0, min(n_f0 - f0_ctx, emitted - ctx))
    keep_src = max(st.source_start, emitted - ctx)
    new_state = CausalStreamState(
        mel=mel_all[:, :, keep_mel - base:], mel_start=keep_mel, n_mel=total, n_f0=n_f0, phase=phase,
        source=source[:, :, (keep_src - st.source_start) * per:], source_start=keep_src, emitted=emitted,
        last_decode_frames=decode_frames, last_f0_frames=f0_frames)
    return StepPlan(win_mel, win_src, False, skip, new_state)


def finish_step(plan: StepPlan, decoded: Tensor | None) -> tuple[Tensor, CausalStreamState | None]:
    """(samples to emit (1, N), new state) from the plan and ``decode``'s output on its window (1, M)."""
    if plan.mel is None or decoded is None:
        ref = plan.mel if plan.mel is not None else plan.state.mel if plan.state is not None else None
        empty = torch.zeros(1, 0) if ref is None else ref.new_zeros(1, 0)
        return empty, plan.state
    return decoded[:, plan.skip:], plan.state


def stream_step(hift: CausalHiFTGenerator, state: CausalStreamState | None, mel: Tensor, finalize: bool
                ) -> tuple[Tensor, CausalStreamState | None]:
    """Vocode the new frames ``mel`` (1, 80, n) of one stream; return (the samples upstream's ``token2wav`` emits
    for this call (1, N), the new state; None after ``finalize``).  Pure function of its inputs: the state passed
    in is not modified."""
    plan = plan_step(hift, state, mel, finalize)
    decoded = None if plan.mel is None else hift.decode(plan.mel, plan.source, plan.finalize)
    return finish_step(plan, decoded)


def decode_windows(ctx: int, chunks: Sequence[int]) -> list[int]:
    """The decode window lengths (frames) of a stream whose non-final calls bring ``chunks`` mel frames each, for
    a decoder of left context ``ctx``: the shapes a captured backend wants at start-up."""
    out, total, emitted = [], 0, 0
    for n in chunks:
        total += n
        if total - HELD_BACK > emitted:
            out.append(total - F0_LOOK_RIGHT - max(0, emitted - ctx))
            emitted = total - HELD_BACK
    return out


def whole_utterance(hift: CausalHiFTGenerator, mel: Tensor, speed: float = 1.0) -> Tensor:
    """A non-streamed utterance (1, 80, T) -> (1, T' * 480) audio; ``speed`` != 1 stretches the mel linearly to
    ``int(T / speed)`` frames first, as upstream does (non-streaming only)."""
    if speed != 1.0:
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
    wav, _ = stream_step(hift, None, mel, finalize=True)
    return wav
