"""HiFT captured in CUDA graphs: the whole chunk (f0, excitation, filter network) per (mel length, rows).

HiFT's convolutions look both ways, so zero-padding a chunk to a length bucket would change its last samples:
graphs are therefore keyed by the exact length.  The streaming schedule uses few lengths (2·first hop, then
8 + 2·hop: :func:`~cosyvoice_fast.config.schedule.vocoder_frames`), so for those lengths a graph per (length, rows)
is captured at start-up (``lengths`` x ``rows``; rows are zero-padded up to the next captured count, and rows
never mix).  Such a graph runs everything after the random draw: the f0 predictor, the excitation from noise
drawn beforehand with each request's own generator (:meth:`HarmonicNoiseSource.from_noise`), the previous
chunk's excitation spliced over the overlap, and the filter network.  So a batch of 16 chunks costs 16 small
``normal_`` draws and one replay instead of ~30 eager launches per row plus the filter pass: the excitation is
cheap on the GPU but was launch-bound on the CPU, in the chunk thread that shares the GIL with decoding.

The f0 predictor runs its convolutions in full fp32 (TF32 off) on every path of this backend: the excitation
integrates f0 into a phase, so f0 rounding grows with the chunk; in fp32 a batched row stays within float
rounding of the same chunk alone.  Weight norm is folded into plain weights first (same numbers, fewer
kernels).  Final chunks take whatever length is left, so their lengths are captured for one row only
(:func:`~cosyvoice_fast.config.schedule.final_vocoder_frames`: every final length of the default schedule).  Shapes
with no start-up graph (other stream settings, whole utterances) keep the old paths: the eager excitation then
a one-row filter graph captured on first use, or one eager filter pass from ``min_batch`` rows.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

import torch

from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.vocoder.eager import batch_sources
from cosyvoice_fast.vocoder.stream import ChunkJoining
from cosyvoice_fast.kernels.graphs import CapturedGraph, DeferredCapture, GraphCache, capture, cuda_missing


def why_unavailable_on(device: torch.device, engines_dir: Path | None = None) -> str | None:
    """Why this backend cannot run on ``device`` (the availability registry asks), or None when it can."""
    return cuda_missing(device)


@contextmanager
def fp32_convs() -> Iterator[None]:
    """cuDNN convolutions in full fp32 inside the block (TF32 off), the other cuDNN flags unchanged."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved


class CudaGraphVocoder(ChunkJoining):
    def __init__(self, hift: torch.nn.Module, max_graphs: int = 48, max_batch: int = 16, min_batch: int = 6,
                 rows: Sequence[int] = (), lengths: Sequence[int] = (), final_lengths: Sequence[int] = (),
                 progress: bool = True, defer_after: Sequence[int] | None = None):
        """``lengths`` x ``rows``: the whole-chunk graphs captured now (non-final chunks, which arrive in step
        across streams); ``final_lengths``: lengths captured for the smallest row count only (final chunks,
        whose lengths vary per utterance, so they rarely share a batch).  ``defer_after``: the first-chunk
        lengths; given, only those are captured here, for the smallest row count (one request's first chunk,
        ``config.graph_plan.hift_jobs``), and the rest are left in :attr:`deferred` for the
        engine's background capture thread (a chunk of such a length runs the eager path until then), and the
        one-row filter graphs are never captured on first use (a shape no start-up graph covers runs eagerly)."""
        dev = next(hift.parameters()).device
        reason = why_unavailable_on(dev)
        if reason is not None:
            raise BackendUnavailable(f"vocoder backend 'cudagraph' {reason}; choose 'eager' instead")
        self.hift = hift
        self.device = dev
        self.max_batch = max_batch  # chunks of one vocode_batch call
        self.min_batch = min_batch  # from this many rows a shape without a graph takes one eager filter pass
        self.plain = self._plain_model(hift)
        self.graphs = GraphCache(lambda mel, src: (self.plain.decode(mel, src),), dev, max_graphs, "hift")
        self.batch_rows = tuple(sorted({r for r in rows if 1 <= r <= max_batch}))
        self.batch_graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.batch_replays = 0  # chunk batches (one row included) served by a start-up graph
        self.eager_batches = 0  # batches that ran an eager filter pass (no graph for their shape)
        self._pool = torch.cuda.graph_pool_handle()
        # capture order (``config.graph_plan.hift_jobs``): the streamed lengths first (first chunks are the
        # shortest of them), then the lengths only final chunks have
        jobs = sorted({(n, r) for n in lengths for r in self.batch_rows})
        if self.batch_rows:
            jobs += sorted({(n, self.batch_rows[0]) for n in final_lengths} - set(jobs))
        firsts = set(defer_after or ())
        now = jobs if defer_after is None else [j for j in jobs if j[0] in firsts and j[1] == self.batch_rows[0]]
        self._capture_batches(now, progress, jobs)
        #: captures left for after ready (``kernels.graphs.DeferredCapture``; empty unless ``defer_after``): each
        #: graph is published by one dict assignment (readers only ``get``); until then its shape runs eagerly
        self.deferred = [DeferredCapture("hift", j, partial(self._capture_one, *j), partial(self._publish, j))
                         for j in jobs if j not in now]
        if defer_after is not None:  # nothing is captured on a request's path: other shapes' filter pass is eager
            self.graphs.freeze()

    def _plain_model(self, hift: torch.nn.Module) -> torch.nn.Module:
        """The module the graphs run: a weight-norm-folded copy (``fused`` also swaps in its kernels here)."""
        return hift.remove_weight_norm().eval()

    def _f0(self, mel: torch.Tensor) -> torch.Tensor:
        with fp32_convs():
            return self.plain.f0(mel)

    def _chunk(self, mel: torch.Tensor, noise: torch.Tensor, cache: torch.Tensor, keep: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a start-up graph runs: (wav, excitation) of ``mel`` given the noise draw, with ``cache`` taking
        the excitation's place where ``keep`` is set (the overlap with the previous chunk)."""
        src = torch.where(keep, cache, self.plain.m_source.from_noise(self._f0(mel), noise))
        return self.plain.decode(mel, src), src

    def _capture_batches(self, jobs: Sequence[tuple[int, int]], progress: bool,
                         every: Sequence[tuple[int, int]]) -> None:
        """Capture the whole chunk for ``jobs`` (some of ``every`` (length, row count)) at start-up; the others
        are :attr:`deferred` to the background capture thread, never captured on a request's path."""
        from tqdm.auto import tqdm

        # the noise draw is the largest input (9 harmonics per sample): one buffer per row count, sized for the
        # longest length of ``every``, serves every length (row i's first n samples are contiguous, as a solo
        # draw needs)
        per_frame = self.plain.samples_per_frame
        longest = {r: max(n for n, rr in every if rr == r) * per_frame for _, r in every}
        self._noise_rows = {r: torch.zeros(r, m, self.plain.m_source.n_harmonics, device=self.device)
                            for r, m in longest.items()}
        for n, r in tqdm(jobs, desc="capturing HiFT graphs", unit="graph", disable=not progress or not jobs,
                         leave=False):
            self._publish((n, r), self._capture_one(n, r))

    def _capture_one(self, n: int, r: int) -> CapturedGraph:
        mel = torch.zeros(r, self.plain.cfg.in_channels, n, device=self.device)
        noise = self._noise_rows[r][:, :n * self.plain.samples_per_frame]
        cache = torch.zeros(r, 1, n * self.plain.samples_per_frame, device=self.device)
        keep = torch.zeros(r, 1, n * self.plain.samples_per_frame, dtype=torch.bool, device=self.device)
        graph, out = capture(lambda a=(mel, noise, cache, keep): self._chunk(*a), self.device, self._pool, warmup=1)
        return CapturedGraph(graph, (mel, noise, cache, keep), out)

    def _publish(self, key: tuple[int, int], graph: CapturedGraph) -> None:
        self.batch_graphs[key] = graph

    def _graph_for(self, rows: int, frames: int) -> CapturedGraph | None:
        """The graph of the smallest row count >= ``rows`` captured so far at ``frames`` (padding rows are
        zeros and never mix with real ones), or None."""
        got = self.batch_graphs  # read once: the background thread publishes by assignment
        return next((got[frames, c] for c in self.batch_rows if c >= rows and (frames, c) in got), None)

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor, generator: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._graph_for(1, mel.shape[-1]) is not None:
            return self.vocode_batch(mel, cache_source, [generator])
        mel = mel.float().contiguous()
        with torch.inference_mode():
            source = self.plain.source(self._f0(mel), generator)
            n = cache_source.shape[-1]
            if n > 0:
                source = torch.cat([cache_source.to(source), source[:, :, n:]], dim=2)
            (wav,) = self.graphs.run(mel.shape[-1], mel, source.contiguous())
            return wav.clone(), source

    def vocode_batch(self, mels: torch.Tensor, sources: torch.Tensor, generators: Sequence[torch.Generator | None]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """B chunks of one shape; each row's noise drawn from its own generator exactly as alone, so a row
        equals the same chunk alone within float rounding (see the module docstring).  The start-up graph of
        (length, rows) when there is one; else one eager filter pass from ``min_batch`` rows, else the
        one-row path per chunk."""
        b, _, frames = mels.shape
        g = self._graph_for(b, frames)
        if g is None and b < self.min_batch:
            outs = [self.vocode(mels[i:i + 1], sources[i:i + 1], gen) for i, gen in enumerate(generators)]
            return torch.cat([w for w, _ in outs]), torch.cat([s for _, s in outs])
        with torch.inference_mode():
            if g is None:
                self.eager_batches += 1
                with fp32_convs():
                    src = batch_sources(self.plain, mels.float(), sources.float(), generators)
                return self.plain.decode(mels.float().contiguous(), src), src
            mel_in, noise_in, cache_in, keep_in = g.inputs
            mel_in[:b].copy_(mels)
            for i, gen in enumerate(generators):  # the draw HarmonicNoiseSource.forward makes for this row alone
                if gen is None:
                    gen = torch.Generator(device=self.device)
                    gen.seed()
                noise_in[i:i + 1].normal_(generator=gen)
            n = sources.shape[-1]
            keep_in.fill_(False)
            if n > 0:
                cache_in[:b, :, :n].copy_(sources)
                keep_in[:, :, :n] = True
            if b < mel_in.shape[0]:  # padding rows: zeros (each row is independent; their output is dropped)
                mel_in[b:].zero_()
                noise_in[b:].zero_()
            g.graph.replay()
            self.batch_replays += 1
            wav, src = g.outputs
            return wav[:b].clone(), src[:b].clone()
