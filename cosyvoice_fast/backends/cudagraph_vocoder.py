"""HiFT with its filter network (``decode``) captured in CUDA graphs, one per exact mel length.

HiFT's convolutions look both ways, so zero-padding a chunk to a length bucket would change its last samples:
graphs are therefore keyed by the exact length.  The streaming schedule uses few lengths (2·first hop, then
8 + 2·hop), so a handful of graphs serve nearly every chunk; final chunks of odd lengths are captured on first
use.  f0 prediction and the NSF source (cheap, and random through the request's generator) stay eager.
Weight norm is folded into plain weights first (same numbers, fewer kernels).

Several chunks of one shape (many streams at once) share one *eager* filter pass over the plain HiFT instead
(:meth:`CudaGraphVocoder.vocode_batch`): a graph per (rows, length) would have to be captured while serving,
and replaying the one-row graph once per chunk serialises them.  The eager pass is launch-bound, so it only
pays from ``min_batch`` rows on (``benchmarks/hift_batch_check.py``; BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import BackendUnavailable
from .eager import batch_sources
from .graphs import GraphCache


class CudaGraphVocoder:
    def __init__(self, hift: torch.nn.Module, max_graphs: int = 48, max_batch: int = 16,
                 min_batch: int = 6):
        dev = next(hift.parameters()).device
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailable("vocoder backend 'cudagraph' needs the model on a CUDA GPU")
        self.hift = hift
        # rows of one eager batched filter pass (vocode_batch); a lone chunk replays its length's graph
        self.max_batch = max_batch
        self.min_batch = min_batch
        self.plain = hift.remove_weight_norm().eval()
        self.graphs = GraphCache(lambda mel, src: (self.plain.decode(mel, src),), dev, max_graphs, "hift")

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor, generator: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        mel = mel.float().contiguous()
        with torch.inference_mode():
            source = self.plain.source(self.plain.f0(mel), generator)
            n = cache_source.shape[-1]
            if n > 0:
                source = torch.cat([cache_source.to(source), source[:, :, n:]], dim=2)
            (wav,) = self.graphs.run(mel.shape[-1], mel, source.contiguous())
            return wav.clone(), source

    def vocode_batch(self, mels: torch.Tensor, sources: torch.Tensor, generators: Sequence[torch.Generator | None]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """B chunks of one shape in one eager filter pass of the plain HiFT (no capture); each row's excitation
        from its own generator, exactly as alone (see :func:`~cosyvoice_fast.backends.eager.batch_sources`).
        Under ``min_batch`` rows the eager pass (launch-bound) is slower than replaying the graph per row."""
        if mels.shape[0] < self.min_batch:
            outs = [self.vocode(mels[i:i + 1], sources[i:i + 1], g) for i, g in enumerate(generators)]
            return torch.cat([w for w, _ in outs]), torch.cat([s for _, s in outs])
        with torch.inference_mode():
            src = batch_sources(self.plain, mels.float(), sources.float(), generators)
            return self.plain.decode(mels.float().contiguous(), src), src
