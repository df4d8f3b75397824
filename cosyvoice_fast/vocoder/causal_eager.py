"""The eager CosyVoice3 vocoder stage: the causal HiFT in fp32 (f0 in float64), streamed at a bounded cost per chunk
(:mod:`cosyvoice_fast.vocoder.causal_stream`); the reference the captured backend is checked against.

CosyVoice3's audio is deterministic (the NSF noise is a fixed table), so the jobs' generators are not used.
Each job's ``cache`` is its stream's :class:`~cosyvoice_fast.vocoder.causal_stream.CausalStreamState`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cosyvoice_fast.vocoder.causal_stream import stream_step, whole_utterance
from cosyvoice_fast.vocoder.stage import Vocoded, VocodeJob

SPEED_NEEDS_WHOLE = "speed change needs the whole utterance in one vocoder call (turn streaming off)"


def run_job(hift: torch.nn.Module, job: VocodeJob) -> Vocoded:
    """One job on ``hift``: the samples to emit and the stream's new state (None after the final chunk)."""
    mel = job.mel.float()
    with torch.inference_mode():
        if job.speed != 1.0:
            if job.cache is not None or not job.finalize:
                raise ValueError(SPEED_NEEDS_WHOLE)
            return whole_utterance(hift, mel, job.speed), None
        return stream_step(hift, job.cache, mel, job.finalize)


class CausalEagerVocoder:
    """``CausalHiFTGenerator`` run eagerly, one stream at a time (windows of different streams differ in length)."""

    max_batch = 1

    def __init__(self, hift: torch.nn.Module):
        self.hift = hift

    def vocode_jobs(self, jobs: Sequence[VocodeJob]) -> list[Vocoded | Exception]:
        out: list[Vocoded | Exception] = []
        for job in jobs:
            try:
                out.append(run_job(self.hift, job))
            except Exception as e:  # noqa: BLE001 - this job's own failure; the others go on
                out.append(e)
        return out
