"""HiFT with its filter network (``decode``) captured in CUDA graphs, one per exact mel length.

HiFT's convolutions look both ways, so zero-padding a chunk to a length bucket would change its last samples:
graphs are therefore keyed by the exact length.  The streaming schedule uses few lengths (2·first hop, then
8 + 2·hop), so a handful of graphs serve nearly every chunk; final chunks of odd lengths are captured on first
use.  f0 prediction and the NSF source (cheap, and random through the request's generator) stay eager.
Weight norm is folded into plain weights first (same numbers, fewer kernels).
"""

from __future__ import annotations

import torch

from .base import BackendUnavailable
from .graphs import GraphCache


class CudaGraphVocoder:
    def __init__(self, hift: torch.nn.Module, max_graphs: int = 48):
        dev = next(hift.parameters()).device
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailable("vocoder backend 'cudagraph' needs the model on a CUDA GPU")
        self.hift = hift
        # One chunk per replay: graphs are keyed by the exact length, and a row count per key would multiply
        # the shapes to capture (HiFT per chunk is a few ms; sharing it is not worth captures while serving).
        self.max_batch = 1
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
