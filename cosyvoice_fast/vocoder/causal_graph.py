"""CosyVoice3's vocoder stage with its filter network (``decode``) captured in CUDA graphs, several streams per replay.

Each call of a stream decodes a window of ``decode_left_context()`` past frames plus the new ones
(:mod:`cosyvoice_fast.vocoder.causal_stream`); with a steady chunk schedule those windows have few lengths
(:func:`~cosyvoice_fast.vocoder.causal_stream.decode_windows`), so a graph per (window frames, rows) is captured
at start-up for the non-final calls (``lengths`` x ``rows``) and per final length for one row (``final_lengths``:
final chunks vary per utterance).  Windows of one length and kind from different streams share a replay (rows
zero-padded up to the next captured count; rows never mix: every layer works per row).  A shape without a graph
runs eagerly (counted in ``eager_batches``): nothing is captured while serving.  f0 (float64) and the excitation
stay eager: they are small, and the phase sum and noise offset are per stream.  Weight norm is folded first
(except the f0 predictor's, kept for its float64 evaluation).
"""

from __future__ import annotations

from typing import Sequence

import torch

from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.kernels import graphs
from cosyvoice_fast.vocoder.causal_eager import SPEED_NEEDS_WHOLE
from cosyvoice_fast.vocoder.causal_stream import StepPlan, finish_step, plan_step
from cosyvoice_fast.vocoder.stage import Vocoded, VocodeJob


def why_unavailable(device: torch.device) -> str | None:
    """Why this backend cannot run on ``device``, or None (tests on CPU replace it, with ``fake_graphs``)."""
    return graphs.cuda_missing(device)


class CausalGraphVocoder:
    def __init__(self, hift: torch.nn.Module, max_batch: int = 16, rows: Sequence[int] = (1,),
                 lengths: Sequence[int] = (), final_lengths: Sequence[int] = (), max_graphs: int = 64):
        """``hift``: a loaded ``CausalHiFTGenerator`` on the GPU; ``rows``: batch sizes captured (<= ``max_batch``);
        ``lengths``: decode-window frames of non-final calls; ``final_lengths``: of final calls (one row)."""
        dev = next(hift.parameters()).device
        reason = why_unavailable(dev)
        if reason is not None:
            raise BackendUnavailable(f"vocoder backend 'cudagraph' {reason}; choose 'eager' instead")
        self.hift = hift
        self.device = dev
        self.max_batch = max(1, max_batch)
        self.plain = hift.remove_weight_norm().eval()
        self.rows = tuple(sorted({r for r in rows if 1 <= r <= self.max_batch})) or (1,)
        per, mels = self.plain.samples_per_frame, self.plain.cfg.in_channels
        self._graphs = {fin: graphs.GraphCache(lambda m, s, fin=fin: (self.plain.decode(m, s, fin),), dev,
                                               max_graphs, f"causal-hift{' final' if fin else ''}")
                        for fin in (False, True)}
        self.eager_batches = 0  # windows decoded without a graph (no graph for their shape)
        self.replays = 0
        jobs = [(n, r, False) for n in lengths for r in self.rows] + [(n, self.rows[0], True) for n in final_lengths]
        with torch.inference_mode():
            for n, r, fin in jobs:
                example = (torch.zeros(r, mels, n, device=dev), torch.zeros(r, 1, n * per, device=dev))
                self._graphs[fin].get((n, r), example)
        for cache in self._graphs.values():
            cache.freeze()

    def _decode(self, mels: torch.Tensor, sources: torch.Tensor, finalize: bool) -> torch.Tensor:
        """``decode`` of B windows of one length: the captured graph of the next row count up, else eagerly."""
        b, _, n = mels.shape
        r = next((c for c in self.rows if c >= b), None)
        cache = self._graphs[finalize]
        g = None if r is None else cache.get((n, r), ())  # frozen: None when nobody captured it
        if g is None:
            self.eager_batches += 1
            return self.plain.decode(mels, sources, finalize)
        if r > b:
            mels = torch.cat([mels, mels.new_zeros(r - b, *mels.shape[1:])])
            sources = torch.cat([sources, sources.new_zeros(r - b, *sources.shape[1:])])
        self.replays += 1
        (out,) = g.run(mels, sources)
        return out[:b].clone()

    def vocode_jobs(self, jobs: Sequence[VocodeJob]) -> list[Vocoded | Exception]:
        out: list[Vocoded | Exception | None] = [None] * len(jobs)
        plans: dict[int, StepPlan] = {}
        with torch.inference_mode():
            for i, job in enumerate(jobs):
                try:
                    if job.speed != 1.0:
                        raise ValueError(SPEED_NEEDS_WHOLE if job.cache is not None or not job.finalize else
                                         "speed change is served by the eager CosyVoice3 vocoder only")
                    plans[i] = plan_step(self.plain, job.cache, job.mel.float(), job.finalize)
                except Exception as e:  # noqa: BLE001 - this job's own failure
                    out[i] = e
            groups: dict[tuple[int, bool], list[int]] = {}
            for i, p in plans.items():
                if p.mel is None:
                    out[i] = finish_step(p, None)
                else:
                    groups.setdefault((p.mel.shape[2], p.finalize), []).append(i)
            for (_, fin), idx in groups.items():
                for k in range(0, len(idx), self.max_batch):
                    part = idx[k:k + self.max_batch]
                    self._run_group(part, plans, fin, out)
        return out  # type: ignore[return-value]

    def _run_group(self, part: list[int], plans: dict[int, StepPlan], fin: bool,
                   out: list[Vocoded | Exception | None]) -> None:
        """One shared decode for ``part``; a failure is retried row by row, so it stays the culprit's."""
        try:
            wav = self._decode(torch.cat([plans[i].mel for i in part]), torch.cat([plans[i].source for i in part]),
                               fin)
            for k, i in enumerate(part):
                out[i] = finish_step(plans[i], wav[k:k + 1])
            return
        except Exception as e:  # noqa: BLE001
            if len(part) == 1:
                out[part[0]] = e
                return
        for i in part:
            try:
                out[i] = finish_step(plans[i], self._decode(plans[i].mel, plans[i].source, fin))
            except Exception as e:  # noqa: BLE001
                out[i] = e
