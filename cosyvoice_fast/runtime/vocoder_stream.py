"""Chunked vocoding with seamless joins: the mel/source/speech caches and the hamming cross-fade.

Each non-final chunk keeps its last 8 mel frames (re-vocoded at the head of the next chunk so the generator has
left context), its last 3840 source samples (forced onto the start of the next chunk's source so the harmonic
phase continues) and its last 3840 output samples (held back, then cross-faded with the next chunk's head).
The sum of emitted samples is exactly ``480 × mel frames`` of the whole stream: nothing is dropped or doubled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..crossfade import fade_in_out, hamming_fade_window

MEL_CACHE_FRAMES = 8


@dataclass
class VocoderCache:
    """Per-stream carry-over between vocoder calls (lives in the request's segment state)."""

    mel: torch.Tensor
    source: torch.Tensor
    speech: torch.Tensor


VocoderFn = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def vocode_chunk(vocoder: VocoderFn, mel: torch.Tensor, cache: VocoderCache | None, finalize: bool,
                 samples_per_frame: int = 480, speed: float = 1.0
                 ) -> tuple[torch.Tensor, VocoderCache | None]:
    """Vocode the new frames ``mel`` (1, 80, T) of one chunk; return (samples to emit (1, N), new cache).

    ``vocoder(mel, cache_source) -> (wav, source)`` is the stage backend (eager HiFT or a captured one).
    ``speed`` (non-streaming only) time-stretches the mel before vocoding, as upstream does.
    """
    overlap = MEL_CACHE_FRAMES * samples_per_frame
    if cache is not None and cache.speech.shape[-1] == 0:
        # frames held back from chunk(s) too short to vocode alone (see below): vocode them now, as a first chunk
        mel = torch.cat([cache.mel.to(mel), mel], dim=2)
        cache = None
    if cache is None and not finalize and speed == 1.0 and mel.shape[2] < MEL_CACHE_FRAMES:
        # A first chunk of under 8 mel frames (token_hop_len_first < 4) cannot leave the 3840-sample tail the
        # next cross-fade needs (that raised "both waveforms need at least 3840 samples" on the second chunk).
        # Keep its frames and emit nothing yet; the next chunk vocodes them with its own.  Totals are unchanged.
        empty = mel.new_zeros(1, 0, dtype=torch.float32)
        return empty, VocoderCache(mel=mel, source=mel.new_zeros(1, 1, 0, dtype=torch.float32), speech=empty)
    if cache is not None:
        mel = torch.cat([cache.mel.to(mel), mel], dim=2)
        cache_source = cache.source
    else:
        cache_source = torch.zeros(1, 1, 0, device=mel.device, dtype=mel.dtype)
    if speed != 1.0:
        if cache is not None:
            raise ValueError("speed change needs the whole utterance in one vocoder call (turn streaming off)")
        mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
    speech, source = vocoder(mel, cache_source)
    if cache is not None:
        window = hamming_fade_window(overlap, device=speech.device, dtype=speech.dtype)
        speech = fade_in_out(speech, cache.speech, window)
    if finalize:
        return speech, None
    new_cache = VocoderCache(mel=mel[:, :, -MEL_CACHE_FRAMES:], source=source[:, :, -overlap:],
                             speech=speech[:, -overlap:])
    return speech[:, :-overlap], new_cache
