"""The vocoder stage's contract with the engine: each stream's next mel chunk in, the samples to emit out.

The engine hands a stage the chunks that are ready (:class:`VocodeJob`: new mel frames, the stream's opaque
carry-over ``cache`` from the previous call, ``finalize``, the request's noise generator, ``speed``) through
:meth:`VocoderStage.vocode_jobs`, and gets per job either ``(samples (1, N), new cache)`` (None after the final
chunk) or the job's own exception.  How chunks are joined is the stage's business: CosyVoice2's stages overlap
and cross-fade (:func:`~cosyvoice_fast.vocoder.stream.vocode_chunks`, built on their ``vocode`` /
``vocode_batch``: :class:`ChunkVocoder`); CosyVoice3's carry a causal state
(:mod:`cosyvoice_fast.vocoder.causal_stream`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch


@dataclass
class VocodeJob:
    """One chunk to vocode: its new mel frames, the stream's carry-over, and the request's noise generator."""

    mel: torch.Tensor
    cache: Any  #: what the stage returned for this stream's previous chunk (None for the first)
    finalize: bool
    generator: torch.Generator | None = None
    speed: float = 1.0


#: a job's outcome: samples to emit (1, N) and the stream's new carry-over (None after the final chunk)
Vocoded = tuple[torch.Tensor, Any]


class VocoderStage(Protocol):
    #: chunks the engine may hand over in one ``vocode_jobs`` call (<= 1: one at a time, emitted as soon as done)
    max_batch: int

    def vocode_jobs(self, jobs: Sequence[VocodeJob]) -> list[Vocoded | Exception]: ...


class ChunkVocoder(Protocol):
    """CosyVoice2's stage primitives: ``vocode(mel, cache_source, generator) -> (wav, source)``;
    ``vocode_batch(mels, sources, generators) -> (wavs, sources)`` for B chunks of one shape at once (each row
    equals that row's ``vocode`` up to float rounding; the noise of row i is drawn from ``generators[i]``), at most
    ``max_batch`` rows."""

    max_batch: int

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def vocode_batch(self, mels: torch.Tensor, sources: torch.Tensor, generators: Sequence[torch.Generator | None]
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...
