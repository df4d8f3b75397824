"""The vocoder stage's contract with the engine: a mel chunk in, waveform and excitation source out.

``vocode(mel, cache_source, generator) -> (wav, source)``; ``vocode_batch(mels, sources, generators) ->
(wavs, sources)`` for B chunks of one shape at once (each row equals that row's ``vocode`` up to float rounding;
the noise of row i is drawn from ``generators[i]``), at most ``max_batch`` rows (<= 1: the engine vocodes each
chunk alone through ``vocode``).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class VocoderStage(Protocol):
    max_batch: int

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def vocode_batch(self, mels: torch.Tensor, sources: torch.Tensor, generators: Sequence[torch.Generator | None]
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...
