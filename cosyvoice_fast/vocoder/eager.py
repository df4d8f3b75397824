"""The eager vocoder backend: HiFT in fp32, the reference every faster vocoder backend is checked against."""

from __future__ import annotations

from typing import Sequence

import torch

from cosyvoice_fast.vocoder.stream import ChunkJoining


class EagerVocoder(ChunkJoining):
    """HiFT in fp32 with the request's own generator for the NSF source noise."""

    def __init__(self, hift: torch.nn.Module):
        self.hift = hift
        # Rows sharing a filter pass differ from single-row calls in float rounding (another conv algorithm for
        # another batch size).  On a GPU sharing pays; on CPU keep each request bit-equal to its solo run.
        self.max_batch = 16 if next(hift.parameters()).device.type == "cuda" else 1

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor, generator: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            return self.hift.inference(mel.float(), cache_source=cache_source.float(), generator=generator)

    def vocode_batch(self, mels: torch.Tensor, sources: torch.Tensor, generators: Sequence[torch.Generator | None]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """B chunks of one shape: each row's excitation from its own generator, one filter pass for all."""
        with torch.inference_mode():
            src = batch_sources(self.hift, mels.float(), sources.float(), generators)
            return self.hift.decode(mels.float(), src), src


def batch_sources(hift: torch.nn.Module, mels: torch.Tensor, cache_sources: torch.Tensor,
                  generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """(B, 1, T * 480) excitation of B chunks, row by row exactly as each chunk alone (f0 and the noise of row i
    from ``generators[i]``: the excitation is cheap, and its phase integrates f0), the first ``cache_sources``
    samples kept from the previous chunk.  Only the filter pass is shared."""
    src = torch.cat([hift.source(hift.f0(mels[i:i + 1]), g) for i, g in enumerate(generators)])
    n = cache_sources.shape[-1]
    if n > 0:
        src = torch.cat([cache_sources.to(src), src[:, :, n:]], dim=2)
    return src
