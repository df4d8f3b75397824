"""Whole guided Euler solves as back-to-back replays of one captured *step* graph.

The step loop of :meth:`~cosyvoice_fast.flow.model.cfm.CausalCFM.solve_batch` around a graph-replayed estimator
runs a dozen small eager operations per Euler step: copies of ``x``, the mask, ``mu``, the condition, the
speaker rows and the time into the graph's static buffers, a clone of its output, the CFG mix and the Euler
update.  For one request's first chunk they cost about as much GPU time as half an estimator forward over the
ten steps (measured on an H200).  Here the step itself is the graph: it reads step ``i``'s flow time and
step size from two device tables by a device-side step counter, runs the estimator, mixes the CFG rows, advances
the state in place and moves the counter on.  A solve copies its inputs once and replays that graph once per
step, with nothing in between.

Rows: the estimator sees ``[conditional rows, zero rows | unconditional rows, zero rows]``, each half
``rows / 2`` long, so the CFG mix is ``v[:half]`` against ``v[half:]`` for every batch size a row bucket
serves (one graph per bucket, as for single forwards).  The estimator never mixes rows, so a row's velocity
does not depend on where it sits, and the mix and update are the step loop's own torch operations in the same
dtype: a solve equals the step loop over single-forward graphs bit for bit.  Zero rows (mask 0) give a zero
velocity, so their state stays zero.

An estimator with a ``time_table`` (the fused kernels) also takes its time projections from a table that is
filled once per graph, since a solve's Euler times are the same every time: its forwards skip the three
time-embedding GEMMs, which depend on nothing but the time.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor


class StepGraphs:
    """The step graphs of one :class:`~cosyvoice_fast.flow.graph.GraphEstimator` (its estimator,
    length buckets, row buckets and lock), for solves with CFG rate ``cfg_rate`` and ``n_steps`` Euler steps;
    keyed by (bucket, rows, dtype) per attention mode."""

    def __init__(self, runner: Any, cfg_rate: float, n_steps: int, max_graphs: int = 128):
        from cosyvoice_fast.kernels.graphs import GraphCache

        if n_steps < 1:
            raise ValueError(f"a solve needs at least one Euler step, got n_steps={n_steps}")
        self.runner = runner
        self.cfg_rate = float(cfg_rate)
        self.n_steps = int(n_steps)
        self.timed = callable(getattr(runner.estimator, "time_table", None))
        self.caches = {mode: GraphCache(self._fn(mode), runner.device, max_graphs,
                                        f"flow-solve-step-{'stream' if mode else 'full'}") for mode in (True, False)}
        # (mode, key) -> (the graph's time buffer, the Euler times and steps written into it and its table)
        self._filled: dict[tuple, tuple[Tensor, tuple]] = {}

    def _fn(self, streaming: bool) -> Callable[..., tuple[Tensor]]:
        est, w = self.runner.estimator, self.cfg_rate

        def step(x: Tensor, mask: Tensor, mu: Tensor, spks: Tensor, cond: Tensor, ts: Tensor, dts: Tensor,
                 idx: Tensor, *table: Tensor) -> tuple[Tensor]:
            half = x.shape[0]
            if table:  # the time projections come from the table: the time itself is not read
                v = est(torch.cat([x, x]), mask, mu, ts[:1].expand(2 * half), spks, cond, streaming,
                        tall=table[0].index_select(0, idx)[0])
            else:
                v = est(torch.cat([x, x]), mask, mu, ts.index_select(0, idx).expand(2 * half), spks, cond, streaming)
            x.add_(dts.index_select(0, idx) * ((1.0 + w) * v[:half] - w * v[half:]))
            idx.add_(1).remainder_(ts.shape[0])
            return (x,)

        return step

    def _example(self, bucket: int, rows: int, dtype: torch.dtype) -> tuple[Tensor, ...]:
        dev, c, n = self.runner.device, self.runner.estimator.cfg.out_channels, self.n_steps
        z = torch.zeros(rows, c, bucket, device=dev, dtype=dtype)
        example = (torch.zeros(rows // 2, c, bucket, device=dev, dtype=dtype),  # the state: conditional rows
                   torch.ones(rows, 1, bucket, device=dev, dtype=dtype), z,  # mask, mu
                   torch.zeros(rows, c, device=dev, dtype=dtype), z.clone(),  # speakers, condition
                   torch.zeros(n, device=dev, dtype=dtype), torch.zeros(n, device=dev, dtype=dtype),  # times, steps
                   torch.zeros(1, device=dev, dtype=torch.long))  # the step counter
        if self.timed:
            example += (torch.zeros(n, rows, self.runner.estimator.time_width(), device=dev, dtype=dtype),)
        return example

    @property
    def replays(self) -> int:
        """Step graphs replayed (one estimator forward each)."""
        return sum(c.replays for c in self.caches.values())

    def capture(self, bucket: int, rows: int, dtype: torch.dtype, streaming: bool) -> None:
        """Capture (if not yet) the step graph of ``rows`` estimator rows (a row bucket) at length ``bucket``."""
        self.caches[bool(streaming)].get((bucket, rows, dtype), self._example(bucket, rows, dtype))

    def solve(self, x0: Tensor, g: Any, ts: Tensor, dts: Tensor, cfg_rate: float, streaming: bool) -> Tensor | None:
        """The guided solve of ``x0`` (B, C, T) with the guidance batch ``g`` (2B rows: conditional, then
        unconditional) and the host tensors ``ts``/``dts`` of :func:`~cosyvoice_fast.flow.model.cfm.euler_schedule`;
        the final state (B, C, T), or None when no step graph serves it: another CFG rate or step count, a
        shape past the runner's graph budget, or one not captured once capturing is over.  The caller holds the
        runner's lock and orders the replays after earlier ones."""
        b, _, frames = x0.shape
        shape = self.runner.graph_shape(frames, 2 * b)
        if cfg_rate != self.cfg_rate or ts.shape[0] != self.n_steps or shape is None:
            return None
        bucket, rows = shape
        mode = bool(streaming)
        key = (bucket, rows, x0.dtype)
        cache = self.caches[mode]
        graph = cache.graphs.get(key)
        if graph is None:
            graph = cache.get(key, self._example(bucket, rows, x0.dtype))
            if graph is None:  # frozen after start-up and this shape was never captured
                return None
        else:
            cache.graphs.move_to_end(key)
        x, mask, mu, spks, cond, tbuf, dtbuf, idx, *table = graph.inputs
        half = rows // 2
        if b == half:  # the rows fill the bucket (one request's pair in the 2-row graph): one copy per input
            _stage_full(x0, g, x, mask, mu, spks, cond, frames)
        else:
            for buf in (x, mask, mu, spks, cond):
                buf.zero_()
            x[:b, :, :frames].copy_(x0)
            for dst, src in ((mask, g.mask), (mu, g.mu), (cond, g.cond)):
                dst[:b, :, :frames].copy_(src[:b])
                dst[half:half + b, :, :frames].copy_(src[b:])
            spks[:b].copy_(g.spks[:b])
            spks[half:half + b].copy_(g.spks[b:])
        times = (tuple(ts.tolist()), tuple(dts.tolist()))
        filled = self._filled.get((mode, key))
        if filled is None or filled[0] is not tbuf or filled[1] != times:
            tbuf.copy_(ts)
            dtbuf.copy_(dts)
            if table:
                table[0].copy_(self.runner.estimator.time_table(tbuf, rows))
            self._filled[(mode, key)] = (tbuf, times)
        idx.zero_()
        for _ in range(self.n_steps):
            graph.graph.replay()
        cache.replays += self.n_steps
        return x[:b, :, :frames].clone()


def _stage_full(x0: Tensor, g: Any, x: Tensor, mask: Tensor, mu: Tensor, spks: Tensor, cond: Tensor,
                frames: int) -> None:
    """Write a solve whose conditional and unconditional rows fill the step graph's rows into its static inputs:
    one copy per input, and a clear of the frames past ``frames`` only when the bucket is longer.  A solve's
    first chunk runs on an otherwise idle GPU after the encoder, so every small launch here is on its path
    (the general case's clears and per-half copies were ~15 launches)."""
    x[:, :, :frames].copy_(x0)
    for dst, src in ((mask, g.mask), (mu, g.mu), (cond, g.cond)):
        dst[:, :, :frames].copy_(src)
    spks.copy_(g.spks)
    if frames < x.shape[2]:  # padded frames: zeros keep stale values (and NaN * 0) out of the masked tail
        for buf in (x, mask, mu, cond):
            buf[:, :, frames:].zero_()
