"""Which flow runner serves each (model family, backend): the flow folder's table for the engine's stage factory.

A backend name is what a user picks (``eager``, ``cudagraph``, ``fused``, ``tensorrt``); with the ``incremental``
flag it resolves to a *runner* (:func:`runner_for`), the object actually built and cached.  Two backends that
resolve to one runner share it (CosyVoice3's flow has no separate incremental graph runner: its ``cudagraph``
runner recomputes every chunk, whatever the flag, and serves ``fused`` too).  :data:`BACKENDS` notes where a name
means something else for a family.  The engine never names a family: it asks this table.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from cosyvoice_fast.config.backends import BackendUnavailable, Check, ask_module, refuse, runs_anywhere
from cosyvoice_fast.config.engine import EngineConfig

#: ``build(models, flow_module, engine_config)``: the stage object of one runner (flow_module cast to the dtype)
Build = Callable[[Any, torch.nn.Module, EngineConfig], Any]

def _cv2_eager(models: Any, flow: torch.nn.Module, engine: EngineConfig) -> Any:
    from cosyvoice_fast.flow.eager import EagerFlow

    return EagerFlow(flow, models.config)


def _cv2_incremental(models: Any, flow: torch.nn.Module, engine: EngineConfig) -> Any:
    from cosyvoice_fast.flow.incremental import IncrementalFlow

    return IncrementalFlow(flow, models.config)


def _cv2_graph(incremental: bool) -> Build:
    def build(models: Any, flow: torch.nn.Module, engine: EngineConfig) -> Any:
        from cosyvoice_fast.flow.graph import CudaGraphFlow

        return CudaGraphFlow(flow, models.config, incremental=incremental, buckets=engine.flow_buckets,
                             rows=engine.flow_rows, capture_at_start=engine.capture_at_start,
                             defer_capture=engine.background_capture)
    return build


def _cv2_fused(incremental: bool) -> Build:
    def build(models: Any, flow: torch.nn.Module, engine: EngineConfig) -> Any:
        from cosyvoice_fast.flow.fused import FusedFlow

        return FusedFlow(flow, models.config, incremental=incremental, buckets=engine.flow_buckets,
                         rows=engine.flow_rows, capture_at_start=engine.capture_at_start,
                         defer_capture=engine.background_capture)
    return build


def _cv2_tensorrt(models: Any, flow: torch.nn.Module, engine: EngineConfig) -> Any:
    from cosyvoice_fast.flow.tensorrt import TensorRTFlow

    return TensorRTFlow(flow, models.config)


def _cv3_eager(models: Any, flow: torch.nn.Module, engine: EngineConfig) -> Any:
    from cosyvoice_fast.flow.dit_eager import DiTEagerFlow

    return DiTEagerFlow(flow, models.config)


def _cv3_incremental(models: Any, flow: torch.nn.Module, engine: EngineConfig) -> Any:
    from cosyvoice_fast.flow.dit_incremental import DiTIncrementalFlow

    return DiTIncrementalFlow(flow, models.config)


def _cv3_graph(models: Any, flow: torch.nn.Module, engine: EngineConfig) -> Any:
    from cosyvoice_fast.flow.dit_graph import DiTGraphFlow

    return DiTGraphFlow(flow, models.config, buckets=engine.flow_buckets, rows=engine.flow_rows,
                        capture_at_start=engine.capture_at_start)


#: family -> runner name -> how to build it
RUNNERS: Mapping[str, Mapping[str, Build]] = {
    "cosyvoice2": {"eager": _cv2_eager, "incremental": _cv2_incremental,
                   "cudagraph": _cv2_graph(False), "cudagraph-incremental": _cv2_graph(True),
                   "fused": _cv2_fused(False), "fused-incremental": _cv2_fused(True), "tensorrt": _cv2_tensorrt},
    "cosyvoice3": {"eager": _cv3_eager, "incremental": _cv3_incremental, "cudagraph": _cv3_graph},
}

#: CosyVoice3's ``fused`` flow is its cudagraph runner: the DiT on Triton GEMMs lost to cuBLAS (docs/VARIANTS.md)
CV3_FUSED_NOTE = ("fused = cudagraph for cosyvoice3 (its captured DiT already fuses AdaLN, rotary, attention and "
                  "convs around cuBLAS GEMMs; the all-Triton DiT measured slower)")

#: family -> backend -> (can it run here?, a note when the name means something else for this family)
BACKENDS: Mapping[str, Mapping[str, tuple[Check, str]]] = {
    "cosyvoice2": {"eager": (runs_anywhere, ""), "cudagraph": (ask_module("cosyvoice_fast.flow.graph"), ""),
                   "fused": (ask_module("cosyvoice_fast.flow.fused"), ""),
                   "tensorrt": (ask_module("cosyvoice_fast.flow.tensorrt"), "")},
    # the DiT graph runner's rule is the U-Net one's (a CUDA device), asked of the module that states it
    "cosyvoice3": {"eager": (runs_anywhere, ""), "cudagraph": (ask_module("cosyvoice_fast.flow.graph"), ""),
                   "fused": (ask_module("cosyvoice_fast.flow.graph"), CV3_FUSED_NOTE),
                   "tensorrt": (refuse("not written for cosyvoice3 (the DiT estimator has no ONNX export); use "
                                       "cudagraph or fused"), "")},
}


#: family -> (backend, incremental flag) -> runner.  Eager with the flag is the ``incremental`` runner; CosyVoice2's
#: graph runners take the flag as a variant; tensorrt ignores it (no state inputs), and so do CosyVoice3's graph
#: runners (they recompute every chunk).
RESOLVE: Mapping[str, Mapping[tuple[str, bool], str]] = {
    "cosyvoice2": {("eager", False): "eager", ("eager", True): "incremental",
                   ("cudagraph", False): "cudagraph", ("cudagraph", True): "cudagraph-incremental",
                   ("fused", False): "fused", ("fused", True): "fused-incremental",
                   ("tensorrt", False): "tensorrt", ("tensorrt", True): "tensorrt"},
    "cosyvoice3": {("eager", False): "eager", ("eager", True): "incremental",
                   ("cudagraph", False): "cudagraph", ("cudagraph", True): "cudagraph",
                   ("fused", False): "cudagraph", ("fused", True): "cudagraph",
                   ("tensorrt", False): "tensorrt", ("tensorrt", True): "tensorrt"},
}


def runner_for(family: str, backend: str, incremental: bool) -> str:
    """The runner serving ``backend`` with the ``incremental`` flag for ``family`` (the flow stage's cache key)."""
    return RESOLVE[family][(backend, bool(incremental))]


def build_flow(family: str, models: Any, runner: str, flow: torch.nn.Module, engine: EngineConfig) -> Any:
    """The flow stage object of ``runner`` for ``family``."""
    table = RUNNERS[family]
    if runner not in table:
        raise BackendUnavailable(f"flow runner {runner!r} is not written for {family}; choose one of "
                                 f"{', '.join(table)}")
    return table[runner](models, flow, engine)
