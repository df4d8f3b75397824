"""A small cache of CUDA graphs keyed by input shape, shared by the graph-captured stage backends.

Capturing replaces hundreds of kernel launches per call with one replay.  Each key (an exact length, or a
length bucket) gets static input buffers, one warm-up on a side stream, then a capture; all graphs share one
memory pool so many lengths cost little extra memory.  The number of graphs is capped; past the cap the
caller's eager path runs (and is counted), so an unusual length is never slower than eager by more than
the copy in.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

log = logging.getLogger(__name__)


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

    def get(self, key: Hashable, example_inputs: tuple[torch.Tensor, ...]) -> CapturedGraph:
        with self.lock:
            g = self.graphs.get(key)
            if g is not None:
                self.graphs.move_to_end(key)
                return g
            g = self._capture(example_inputs)
            self.graphs[key] = g
            self.captures += 1
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
            return g

    def run(self, key: Hashable, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g = self.get(key, args)
        self.replays += 1
        return g.run(*args)

    def _capture(self, example: tuple[torch.Tensor, ...]) -> CapturedGraph:
        static_in = tuple(t.detach().clone() for t in example)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # warm-up: cuDNN/cuBLAS pick kernels and allocate workspaces outside the capture
                self.fn(*static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(*static_in)
        outs = out if isinstance(out, tuple) else (out,)
        log.debug("%s: captured shapes %s", self.name, [tuple(t.shape) for t in static_in])
        return CapturedGraph(graph, static_in, outs)
