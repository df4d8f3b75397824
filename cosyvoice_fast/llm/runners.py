"""Which LM runner serves each (model family, backend): the llm folder's table for the engine's stage factory.

The runners are family-blind: everything a family changes in the LM (where sos/task live, the head's size and
bias, the stop ids, the min-length mask, the token filter) is data on :class:`~cosyvoice_fast.config.model.LLMConfig`
that the model and the runners read.  What differs per family here is which backends exist: the TensorRT-LLM
export is written for CosyVoice2's LM only.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from cosyvoice_fast.config.backends import BackendUnavailable, Check, ask_module, refuse, runs_anywhere
from cosyvoice_fast.config.engine import EngineConfig, resolve_llm_slots

#: ``build(models, lm_module, dtype, engine_config)``: the stage object (lm_module cast to ``dtype``)
Build = Callable[[Any, torch.nn.Module, torch.dtype, EngineConfig], Any]


def _eager(models: Any, llm: torch.nn.Module, dtype: torch.dtype, engine: EngineConfig) -> Any:
    from cosyvoice_fast.llm.eager import EagerLLM

    return EagerLLM(llm, models.config)


def _graph(models: Any, llm: torch.nn.Module, dtype: torch.dtype, engine: EngineConfig) -> Any:
    from cosyvoice_fast.llm.graph import CudaGraphLLM

    slots = resolve_llm_slots(engine, models.config.llm.qwen, dtype, models.device)
    return CudaGraphLLM(llm, models.config, slots=slots, max_len=engine.max_context,
                       defer_capture=engine.background_capture and engine.capture_at_start)


def _fused(models: Any, llm: torch.nn.Module, dtype: torch.dtype, engine: EngineConfig) -> Any:
    from cosyvoice_fast.llm.fused import FusedLLM

    slots = resolve_llm_slots(engine, models.config.llm.qwen, dtype, models.device)
    return FusedLLM(llm, models.config, slots=slots, max_len=engine.max_context,
                   defer_capture=engine.background_capture and engine.capture_at_start)


def _trtllm(models: Any, llm: torch.nn.Module, dtype: torch.dtype, engine: EngineConfig) -> Any:
    from cosyvoice_fast.llm.trtllm import TrtLlmLLM

    return TrtLlmLLM(llm, models.config)


_SHARED = {"eager": _eager, "cudagraph": _graph, "fused": _fused}

#: family -> runner (= backend) name -> how to build it
RUNNERS: Mapping[str, Mapping[str, Build]] = {
    "cosyvoice2": {**_SHARED, "trtllm": _trtllm},
    "cosyvoice3": dict(_SHARED),
}

_COMMON: Mapping[str, tuple[Check, str]] = {
    "eager": (runs_anywhere, ""), "cudagraph": (ask_module("cosyvoice_fast.llm.graph"), ""),
    "fused": (ask_module("cosyvoice_fast.llm.fused"), "")}

#: family -> backend -> (can it run here?, a note when the name means something else for this family)
BACKENDS: Mapping[str, Mapping[str, tuple[Check, str]]] = {
    "cosyvoice2": {**_COMMON, "trtllm": (ask_module("cosyvoice_fast.llm.trtllm"), "")},
    "cosyvoice3": {**_COMMON, "trtllm": (refuse("not written for cosyvoice3 (the TensorRT-LLM export covers "
                                                "CosyVoice2's LM only); use cudagraph or fused"), "")},
}


def build_llm(family: str, models: Any, name: str, llm: torch.nn.Module, dtype: torch.dtype,
              engine: EngineConfig) -> Any:
    """The LM stage object of backend ``name`` for ``family``."""
    table = RUNNERS[family]
    if name not in table:
        raise BackendUnavailable(f"llm backend {name!r} is not written for {family}; choose one of "
                                 f"{', '.join(table)}")
    return table[name](models, llm, dtype, engine)
