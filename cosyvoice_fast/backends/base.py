"""The per-stage backend interface and the registry that says which backends can run here, and why not.

Each stage has one small interface so the engine does not care which implementation drives it:

- LLM: ``generate(inputs, text, generator, max_tokens, ignore_eos) -> Iterator[int]`` (prefill happens on the
  first ``next``; closing the iterator frees the KV cache);
- flow: ``chunk(segment_state, inputs, tokens, call) -> mel (1, 80, new frames)``; optionally
  ``chunk_batch(items) -> list of mels`` for several requests' calls at once (``items`` are
  ``(segment_state, inputs, tokens, call)`` tuples; each mel must equal that item's ``chunk`` up to float
  rounding) and ``max_batch`` (items it will share; <= 1 means "do not batch").  The engine batches
  pending chunks of requests on the same stage set through ``chunk_batch`` when present and loops ``chunk``
  otherwise (:func:`~cosyvoice_fast.backends.eager.chunk_batch_loop` is that loop);
- vocoder: ``vocode(mel, cache_source, generator) -> (wav, source)``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import torch

from ..config import BackendConfig


class LLMStage(Protocol):
    def generate(self, inputs: Any, text: torch.Tensor, generator: torch.Generator, max_tokens: int | None,
                 ignore_eos: bool) -> Iterator[int]: ...


class FlowStage(Protocol):
    def chunk(self, seg: Any, inputs: Any, tokens: torch.Tensor, call: Any) -> torch.Tensor: ...


class BatchedFlowStage(FlowStage, Protocol):
    """A flow stage that can share one computation between several requests' chunks (optional extension)."""

    max_batch: int

    def chunk_batch(self, items: Sequence[tuple[Any, Any, torch.Tensor, Any]]) -> list[torch.Tensor]: ...


class VocoderStage(Protocol):
    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor,
               generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class StageSet:
    """The three stage implementations one request runs on."""

    config: BackendConfig
    llm: LLMStage
    flow: FlowStage
    vocoder: VocoderStage


@dataclass(frozen=True, slots=True)
class BackendInfo:
    stage: str
    name: str
    available: bool
    reason: str = ""


class BackendUnavailable(RuntimeError):
    """A backend was asked for that cannot run here; the message says why and what to choose instead."""


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def available_backends(device: torch.device | str, engines_dir: str | Path = "engines") -> list[BackendInfo]:
    """Every (stage, backend) pair with whether it can run on ``device`` and, if not, the reason."""
    dev = torch.device(device)
    cuda = dev.type == "cuda" and torch.cuda.is_available()
    no_cuda = "needs a CUDA GPU (this engine runs on %s)" % dev.type
    engines = Path(engines_dir)
    out = [BackendInfo(s, "eager", True) for s in ("llm", "flow", "vocoder")]
    out.append(BackendInfo("flow", "incremental", True))  # eager math, any device
    for s in ("llm", "flow", "vocoder"):
        out.append(BackendInfo(s, "cudagraph", cuda, "" if cuda else no_cuda))
    if not cuda:
        out.append(BackendInfo("flow", "tensorrt", False, no_cuda))
    elif not _has("tensorrt"):
        out.append(BackendInfo("flow", "tensorrt", False, "package tensorrt is not installed "
                                                          "(pip install -r requirements-trt.txt)"))
    elif not any(engines.glob("flow_estimator*.plan")):
        out.append(BackendInfo("flow", "tensorrt", False, "no engine built yet: run python -m cosyvoice_fast "
                                                          "build-engines --model-dir DIR"))
    else:
        out.append(BackendInfo("flow", "tensorrt", True))
    from .fused_flow import why_unavailable as fused_flow_unavailable

    fused_flow_off = fused_flow_unavailable() if cuda else no_cuda
    out.append(BackendInfo("flow", "fused", fused_flow_off is None, fused_flow_off or ""))
    if not cuda:
        out.append(BackendInfo("llm", "trtllm", False, no_cuda))
    elif not _has("tensorrt_llm"):
        out.append(BackendInfo("llm", "trtllm", False, "package tensorrt_llm is not installed "
                                                       "(pip install -r requirements-trt.txt)"))
    elif not any(engines.glob("llm_trtllm*/")):
        out.append(BackendInfo("llm", "trtllm", False, "no TensorRT-LLM engine built yet: run python -m "
                                                       "cosyvoice_fast build-engines --model-dir DIR"))
    else:
        out.append(BackendInfo("llm", "trtllm", True))
    return out


def check_available(config: BackendConfig, device: torch.device | str) -> None:
    """Raise :class:`BackendUnavailable` naming the first stage whose chosen backend cannot run here."""
    infos = {(b.stage, b.name): b for b in available_backends(device)}
    for stage in ("llm", "flow", "vocoder"):
        name = getattr(config, stage)
        info = infos.get((stage, name))
        if info is None or not info.available:
            why = info.reason if info else "not implemented for this stage"
            raise BackendUnavailable(f"{stage} backend {name!r} is unavailable: {why}. Choose 'eager' instead.")
