"""The one way every runner captures CUDA graphs (:func:`capture`), and a small cache of graphs keyed by input
shape (:class:`GraphCache`) built on it.

Capturing replaces hundreds of kernel launches per call with one replay.  :func:`capture` warms the function
up on a side stream (library handles and kernel choices happen outside any capture), then captures it with
``capture_begin``/``capture_end`` into the caller's memory pool (``torch.cuda.graph`` would run
``gc.collect()`` and ``empty_cache()`` per graph), and counts it in :data:`CAPTURES`, which the engine reports.
Runners capture every shape their configuration names at start-up and then :meth:`GraphCache.freeze`: a
shape nobody captured runs eagerly (counted), so nothing is captured while requests are being served.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

log = logging.getLogger(__name__)

#: graphs captured in this process, by every runner (read it through :func:`captures`)
_CAPTURES = 0
_COUNT_LOCK = threading.Lock()


def cuda_missing(device: torch.device) -> str | None:
    """Why a backend that runs CUDA kernels cannot run on ``device``, or None: the requirement every non-eager
    backend states in its ``why_unavailable_on`` (the registry's question, ``engine.stages``)."""
    if device.type != "cuda":
        return f"needs a CUDA GPU (this engine runs on {device.type})"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch sees none here)"
    return None


def captures() -> int:
    """How many CUDA graphs this process has captured so far (all runners)."""
    return _CAPTURES


def capture(fn: Callable[[], object], device: torch.device, pool: object, warmup: int = 1) -> tuple[
        "torch.cuda.CUDAGraph", object]:
    """Capture ``fn()`` (which reads and writes only static buffers) as a CUDA graph in ``pool``.

    ``warmup`` eager runs on a side stream come first; the capture runs on that stream too.  Returns the graph
    and what the captured call returned (static outputs, valid after each replay)."""
    global _CAPTURES
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(warmup):
            fn()
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(side)
    with _COUNT_LOCK:
        _CAPTURES += 1
    return graph, out


@dataclass
class CapturedGraph:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]

    def run(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copy ``args`` into the static inputs, replay, return the static outputs (valid until next replay)."""
        for dst, src in zip(self.inputs, args):
            dst.copy_(src)
        self.graph.replay()
        return self.outputs


class GraphCache:
    """Graphs of ``fn(*inputs) -> tuple of outputs`` per key; ``max_graphs`` caps memory (LRU eviction)."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], device: torch.device, max_graphs: int = 64,
                 name: str = "graph"):
        self.fn = fn
        self.device = device
        self.max_graphs = max_graphs
        self.name = name
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[Hashable, CapturedGraph] = OrderedDict()
        self.lock = threading.Lock()
        self.captures = 0
        self.replays = 0
        self.frozen = False  # set after start-up: a missing key is not captured (the caller runs eagerly)

    def freeze(self) -> None:
        """From now on never capture: :meth:`get` answers ``None`` for a key nobody captured."""
        self.frozen = True

    def get(self, key: Hashable, example_inputs: tuple[torch.Tensor, ...]) -> CapturedGraph | None:
        with self.lock:
            g = self.graphs.get(key)
            if g is not None:
                self.graphs.move_to_end(key)
                return g
            if self.frozen:
                return None
            g = self._capture(example_inputs)
            self.graphs[key] = g
            self.captures += 1
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
            return g

    def run(self, key: Hashable, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Replay the graph of ``key`` on ``args``; eagerly (``fn(*args)``) when frozen without one."""
        g = self.get(key, args)
        if g is None:
            with torch.inference_mode():
                out = self.fn(*args)
            return out if isinstance(out, tuple) else (out,)
        self.replays += 1
        return g.run(*args)

    def _capture(self, example: tuple[torch.Tensor, ...]) -> CapturedGraph:
        static_in = tuple(t.detach().clone() for t in example)
        # two warm-ups: cuDNN/cuBLAS pick kernels and allocate workspaces outside the capture
        graph, out = capture(lambda: self.fn(*static_in), self.device, self.pool, warmup=2)
        outs = out if isinstance(out, tuple) else (out,)
        log.debug("%s: captured shapes %s", self.name, [tuple(t.shape) for t in static_in])
        return CapturedGraph(graph, static_in, outs)
