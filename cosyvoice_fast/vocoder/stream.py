"""Chunked vocoding with seamless joins: the mel/source/speech caches and the hamming cross-fade.

Each non-final chunk keeps its last 8 mel frames (re-vocoded at the head of the next chunk so the generator has
left context), its last 3840 source samples (forced onto the start of the next chunk's source so the harmonic
phase continues) and its last 3840 output samples (held back, then cross-faded with the next chunk's head).
The sum of emitted samples is exactly ``480 × mel frames`` of the whole stream: nothing is dropped or doubled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from cosyvoice_fast.vocoder.crossfade import fade_in_out, hamming_fade_window
from cosyvoice_fast.config.schedule import MEL_CACHE_FRAMES
from cosyvoice_fast.vocoder.stage import ChunkVocoder, Vocoded, VocodeJob

log = logging.getLogger(__name__)


@dataclass
class VocoderCache:
    """Per-stream carry-over between vocoder calls (lives in the request's segment state)."""

    mel: torch.Tensor
    source: torch.Tensor
    speech: torch.Tensor


VocoderFn = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def _prepare(job: VocodeJob, overlap: int) -> tuple[torch.Tensor, torch.Tensor] | Vocoded:
    """The vocoder call a job needs, (mel, cache_source); or its final result when no call is needed."""
    mel, cache = job.mel, job.cache
    if cache is not None and cache.speech.shape[-1] == 0:
        # frames held back from chunk(s) too short to vocode alone (see below): vocode them now, as a first chunk
        mel = torch.cat([cache.mel.to(mel), mel], dim=2)
        cache = None
    if cache is None and not job.finalize and job.speed == 1.0 and mel.shape[2] < MEL_CACHE_FRAMES:
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
    if job.speed != 1.0:
        if cache is not None:
            raise ValueError("speed change needs the whole utterance in one vocoder call (turn streaming off)")
        mel = F.interpolate(mel, size=int(mel.shape[2] / job.speed), mode="linear")
    return mel, cache_source


def _finish(job: VocodeJob, mel: torch.Tensor, speech: torch.Tensor, source: torch.Tensor, overlap: int
            ) -> Vocoded:
    """Cross-fade with the held-back tail, and keep this chunk's tail for the next one."""
    cache = job.cache if job.cache is None or job.cache.speech.shape[-1] > 0 else None
    if cache is not None:
        window = hamming_fade_window(overlap, device=speech.device, dtype=speech.dtype)
        speech = fade_in_out(speech, cache.speech, window)
    if job.finalize:
        return speech, None
    new_cache = VocoderCache(mel=mel[:, :, -MEL_CACHE_FRAMES:], source=source[:, :, -overlap:],
                             speech=speech[:, -overlap:])
    return speech[:, :-overlap], new_cache


def vocode_chunk(vocoder: VocoderFn, mel: torch.Tensor, cache: VocoderCache | None, finalize: bool,
                 samples_per_frame: int = 480, speed: float = 1.0
                 ) -> tuple[torch.Tensor, VocoderCache | None]:
    """Vocode the new frames ``mel`` (1, 80, T) of one chunk; return (samples to emit (1, N), new cache).

    ``vocoder(mel, cache_source) -> (wav, source)`` is the stage backend (eager HiFT or a captured one).
    ``speed`` (non-streaming only) time-stretches the mel before vocoding, as upstream does.
    """
    overlap = MEL_CACHE_FRAMES * samples_per_frame
    job = VocodeJob(mel=mel, cache=cache, finalize=finalize, speed=speed)
    call = _prepare(job, overlap)
    if isinstance(call[1], VocoderCache) or call[1] is None:
        return call  # type: ignore[return-value]
    full_mel, cache_source = call
    speech, source = vocoder(full_mel, cache_source)
    return _finish(job, full_mel, speech, source, overlap)


def vocode_chunks(vocoder: ChunkVocoder, jobs: Sequence[VocodeJob], samples_per_frame: int = 480
                  ) -> list[Vocoded | Exception]:
    """Vocode several streams' chunks on one vocoder stage: calls of one shape (mel frames, cached source
    samples) share one ``vocoder.vocode_batch`` forward (at most its ``max_batch`` rows); a lone call runs through
    ``vocoder.vocode``.  Results are in ``jobs`` order; a job that failed
    gets its exception (the others are unaffected: a failed shared forward is retried row by row)."""
    overlap = MEL_CACHE_FRAMES * samples_per_frame
    out: list[Vocoded | Exception | None] = [None] * len(jobs)
    calls: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for i, job in enumerate(jobs):
        try:
            call = _prepare(job, overlap)
        except Exception as e:  # noqa: BLE001 - this job's own mistake
            out[i] = e
            continue
        if isinstance(call[1], VocoderCache):
            out[i] = call  # type: ignore[assignment]
            continue
        mel, src = call
        calls.setdefault((mel.shape[2], src.shape[-1]), []).append((i, mel, src))
    most = max(1, int(vocoder.max_batch))
    groups = [g[k:k + most] for g in calls.values() for k in range(0, len(g), most)]
    for group in groups:
        results: list[tuple[torch.Tensor, torch.Tensor] | Exception] | None = None
        if len(group) > 1:
            try:
                mels = torch.cat([m for _, m, _ in group])
                srcs = torch.cat([s.to(mels.device) for _, _, s in group])
                wavs, sources = vocoder.vocode_batch(mels, srcs, [jobs[i].generator for i, _, _ in group])
                results = [(wavs[k:k + 1], sources[k:k + 1]) for k in range(len(group))]
            except Exception:  # noqa: BLE001 - find the culprit row by row
                log.exception("batched vocoder call for %d chunks failed; retrying them one by one", len(group))
        if results is None:
            results = []
            for i, m, s in group:
                try:
                    results.append(vocoder.vocode(m, s, jobs[i].generator))
                except Exception as e:  # noqa: BLE001
                    results.append(e)
        for (i, mel, _), res in zip(group, results):
            out[i] = res if isinstance(res, Exception) else _finish(jobs[i], mel, res[0], res[1], overlap)
    return out  # type: ignore[return-value]


class ChunkJoining:
    """``vocode_jobs`` for a CosyVoice2 stage (one with ``vocode`` / ``vocode_batch``): the cross-faded joining
    of :func:`vocode_chunks`."""

    def vocode_jobs(self, jobs: Sequence[VocodeJob]) -> list[Vocoded | Exception]:
        return vocode_chunks(self, jobs)  # type: ignore[arg-type]
