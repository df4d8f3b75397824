"""Capturing the ``cudagraph`` LLM's graphs: all at start-up, or (``defer_capture``) only those a first chunk at low
concurrency needs, the rest handed to the engine's background capture thread.

Before ready (``config.graph_plan.llm_jobs``): decode graphs for 1 and all rows at the smallest and the largest
KV bucket, prefill graphs for 1 and the most rows per length.  The LLM has no eager path, so until the other
graphs land a step replays the smallest captured graph that covers it (:func:`~.buckets.captured_shape`):
padded rows are rows no request is in (they run at position ``max_len - 1``, writing only their own cache row
where a later step overwrites it before any query reads it; prefill's unused rows write only the spare row) and a
bigger KV bucket only attends over more masked positions (see :mod:`.graph`).  Every shape is warmed up here, at
start-up, so a background capture runs no warm-up: it executes nothing and touches no request's rows.

:class:`GraphCaptures` is a mixin of :class:`~.graph.CudaGraphLLM`: its methods use the buffers, graphs and lock
the backend's constructor sets up.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any, Callable

import torch

from cosyvoice_fast.config.graph_plan import ends
from cosyvoice_fast.kernels.graphs import DeferredCapture, capture, capture_stream


class GraphCaptures:
    """Which LLM graphs to capture and when (see the module docstring).  ``deferred``: the captures left for the
    background thread (empty without ``defer_capture``)."""

    device: torch.device
    buckets: tuple[int, ...]
    row_counts: tuple[int, ...]
    prefiller: Any
    deferred: list
    _batch_graphs: dict
    _lock: threading.RLock
    _batch_step_math: Callable[[int, int], None]

    def _graph_jobs(self) -> list[tuple[dict[int, Any], int, Any]]:
        """Every graph to capture: ``(where it goes, its key, the math it replays)``; warm-ups first per kind."""
        jobs = [(self._batch_graphs, (b, n), partial(self._batch_step_math, b, n))
                for b in self.buckets for n in self.row_counts]
        return jobs + self.prefiller.jobs()

    def _capture_all(self, progress: bool, defer: bool = False) -> int:
        """Warm every shape up, capture those needed before ready (all without ``defer``) and leave the rest in
        :attr:`deferred`; returns the graphs captured now."""
        from tqdm.auto import tqdm

        every = self._graph_jobs()
        jobs = [j for j in every if not defer or self._before_ready(j[0], j[1])]
        side = capture_stream(self.device)  # the captures below run on it: its library workspaces are set up here
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: library handles and kernel choices happen outside any capture
            for b in self.buckets:
                for n in self.row_counts:
                    self._batch_step_math(b, n)
            self.prefiller.warm()
        torch.cuda.synchronize(self.device)
        scratch = torch.cuda.graph_pool_handle()
        for where, key, step in tqdm(jobs, desc="capturing LLM graphs", unit="graph", disable=not progress,
                                     leave=False):
            where[key], _ = capture(step, self.device, scratch, warmup=0)  # warmed up above, once per shape
        torch.cuda.synchronize(self.device)
        #: captures left for after ready (``kernels.graphs.DeferredCapture``).  Each runs with no warm-up (every
        #: shape ran above), so capturing executes nothing and touches no request's rows; it is published under
        #: the runner's lock, which every replay holds (the graphs share one memory pool: one replay at a time)
        self.deferred = [
            DeferredCapture("llm-decode" if where is self._batch_graphs else "llm-prefill", key,
                            partial(self._capture_later, step, scratch), partial(self._publish, where, key))
            for where, key, step in every if defer and not self._before_ready(where, key)]
        return len(jobs)

    def _before_ready(self, where: dict, key: tuple[int, int]) -> bool:
        """Whether graph ``key`` of ``where`` is captured before ready (``config.graph_plan.llm_jobs``'s rule)."""
        if where is self._batch_graphs:
            return key[0] in ends(self.buckets) and key[1] in ends(self.row_counts)
        return key[1] in ends(self.prefiller.row_counts[key[0]])

    def _capture_later(self, step: Callable[[], None], pool: Any) -> Any:
        return capture(step, self.device, pool, warmup=0)[0]

    def _publish(self, where: dict, key: tuple[int, int], graph: Any) -> None:
        with self._lock:
            where[key] = graph
