"""The vocoder stage's contract with the engine: a mel chunk in, waveform and excitation source out.

``vocode(mel, cache_source, generator) -> (wav, source)``; optionally ``vocode_batch(mels, sources,
generators) -> (wavs, sources)`` for B chunks of one shape at once (each row equals that row's ``vocode`` up to
float rounding; the noise of row i is drawn from ``generators[i]``).
"""

from __future__ import annotations

from typing import Protocol

import torch


class VocoderStage(Protocol):
    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]: ...
