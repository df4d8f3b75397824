"""HiFT with its filter network (``decode``) captured in CUDA graphs, one per exact mel length (and row count).

HiFT's convolutions look both ways, so zero-padding a chunk to a length bucket would change its last samples:
graphs are therefore keyed by the exact length.  The streaming schedule uses few lengths (2·first hop, then
8 + 2·hop: :func:`~cosyvoice_fast.schedule.vocoder_frames`), so a handful of graphs serve nearly every chunk;
final chunks of odd lengths are captured on first use.  f0 prediction and the NSF source (cheap, and random
through the request's generator) stay eager.  Weight norm is folded into plain weights first (same numbers,
fewer kernels).

Several chunks of one shape (many streams at once) share one filter pass (:meth:`CudaGraphVocoder.vocode_batch`).
For the schedule's lengths that pass is a graph per (length, row count) captured at start-up (``lengths`` x
``rows``; rows are zero-padded up to the next captured count, and rows never mix): the eager pass is ~1000
small launches whatever the batch, so at 16 rows the graph is much faster than the eager pass and several
times faster than replaying the one-row graph per chunk.  A shape with no batched graph takes the eager pass
from ``min_batch`` rows, and the one-row graph per chunk below that.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .base import BackendUnavailable
from .eager import batch_sources
from .graphs import CapturedGraph, GraphCache, capture


class CudaGraphVocoder:
    def __init__(self, hift: torch.nn.Module, max_graphs: int = 48, max_batch: int = 16, min_batch: int = 6,
                 rows: Sequence[int] = (), lengths: Sequence[int] = (), progress: bool = True):
        dev = next(hift.parameters()).device
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailable("vocoder backend 'cudagraph' needs the model on a CUDA GPU")
        self.hift = hift
        self.device = dev
        # rows of one batched filter pass (vocode_batch); a lone chunk replays its length's graph
        self.max_batch = max_batch
        self.min_batch = min_batch
        self.plain = hift.remove_weight_norm().eval()
        self.graphs = GraphCache(lambda mel, src: (self.plain.decode(mel, src),), dev, max_graphs, "hift")
        self.batch_rows = tuple(sorted({r for r in rows if 1 < r <= max_batch}))
        self.batch_graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.batch_replays = 0  # batched filter passes served by a graph
        self.eager_batches = 0  # batched filter passes that ran eagerly (no graph for their shape)
        self._pool = torch.cuda.graph_pool_handle()
        self._capture_batches(tuple(sorted(set(lengths))), progress)

    def _capture_batches(self, lengths: tuple[int, ...], progress: bool) -> None:
        """Capture the filter pass for every (length, row count); start-up only, so serving never captures."""
        from tqdm.auto import tqdm

        jobs = [(n, r) for n in lengths for r in self.batch_rows]
        cfg = self.plain.cfg
        for n, r in tqdm(jobs, desc="capturing HiFT batch graphs", unit="graph", disable=not progress or not jobs,
                         leave=False):
            mel = torch.zeros(r, cfg.in_channels, n, device=self.device)
            src = torch.zeros(r, 1, n * self.plain.samples_per_frame, device=self.device)
            graph, out = capture(lambda m=mel, s=src: (self.plain.decode(m, s),), self.device, self._pool, warmup=1)
            self.batch_graphs[n, r] = CapturedGraph(graph, (mel, src), out)

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

    def _graph_for(self, rows: int, frames: int) -> CapturedGraph | None:
        r = next((c for c in self.batch_rows if c >= rows), None)
        return None if r is None else self.batch_graphs.get((frames, r))

    def vocode_batch(self, mels: torch.Tensor, sources: torch.Tensor, generators: Sequence[torch.Generator | None]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """B chunks of one shape in one filter pass; each row's excitation from its own generator, exactly as
        alone (see :func:`~cosyvoice_fast.backends.eager.batch_sources`).  The pass is the (length, rows) graph
        captured at start-up when there is one; else the eager pass from ``min_batch`` rows (launch-bound, so
        slower than per-row replays below that), else the one-row graph per chunk."""
        b, _, frames = mels.shape
        g = self._graph_for(b, frames)
        if g is None and b < self.min_batch:
            outs = [self.vocode(mels[i:i + 1], sources[i:i + 1], gen) for i, gen in enumerate(generators)]
            return torch.cat([w for w, _ in outs]), torch.cat([s for _, s in outs])
        with torch.inference_mode():
            src = batch_sources(self.plain, mels.float(), sources.float(), generators)
            if g is None:
                self.eager_batches += 1
                return self.plain.decode(mels.float().contiguous(), src), src
            mel_in, src_in = g.inputs
            mel_in[:b].copy_(mels)
            src_in[:b].copy_(src)
            if b < mel_in.shape[0]:  # padding rows: zeros (each row is independent; their output is dropped)
                mel_in[b:].zero_()
                src_in[b:].zero_()
            g.graph.replay()
            self.batch_replays += 1
            return g.outputs[0][:b].clone(), src
