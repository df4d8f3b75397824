"""Which backend runs each stage (:class:`BackendConfig`), and the names every stage uses to say "this backend
cannot run here".  A leaf, so the stages, the registry and every front end agree on the spelling.

The registry that asks each backend whether it can run lives in :mod:`cosyvoice_fast.engine.stages`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cosyvoice_fast.config.yamlfile import ConfigError


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """Whether ``stage``'s backend ``name`` can run here (``reason``: why not) and, in ``note``, what it really
    runs where that differs from its name (e.g. ``fused`` served by the cudagraph runner for a family)."""

    stage: str
    name: str
    available: bool
    reason: str = ""
    note: str = ""


#: ``check(device, engines_dir)``: why a backend cannot run on ``device`` (None: it can)
Check = Callable[[torch.device, Path], "str | None"]


def runs_anywhere(device: torch.device, engines_dir: Path | None = None) -> str | None:
    """The eager backends: plain PyTorch, on any device."""
    return None


def ask_module(module: str) -> Check:
    """The ``why_unavailable_on(device, engines_dir)`` of a backend module, imported when first asked (backend
    modules import no Triton or TensorRT before their check has found it)."""
    def ask(device: torch.device, engines_dir: Path) -> str | None:
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            return f"not in this build ({module} is missing)"
        return found.why_unavailable_on(device, engines_dir)
    return ask


def refuse(reason: str) -> Check:
    """A backend that is not written for a model family: the same reason on every device."""
    def never(device: torch.device, engines_dir: Path) -> str | None:
        return reason
    return never


TRITON_MISSING = "package triton is not installed (pip install triton; CUDA builds of torch ship with it)"


class BackendUnavailable(RuntimeError):
    """A backend was asked for that cannot run here; the message says why and what to choose instead."""


TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def default_dtype(device: torch.device | str) -> str:
    """The dtype a run uses when none is asked for: bf16 on a CUDA GPU (the fast backends are built for it),
    fp32 elsewhere (bf16/fp16 on a CPU are slow and inexact).  The one place this default lives."""
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


#: every backend name each stage accepts (whether it can run on this machine is :mod:`cosyvoice_fast.engine.stages`' business)
BACKEND_CHOICES: dict[str, tuple[str, ...]] = {"llm": ("eager", "cudagraph", "fused", "trtllm"),
                                               "flow": ("eager", "cudagraph", "fused", "tensorrt"),
                                               "vocoder": ("eager", "cudagraph", "fused")}


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """Which implementation runs each stage, and in which dtype.

    ``incremental``: streaming chunks of the ``eager``, ``cudagraph`` and ``fused`` flows reuse the segment's
    flow state (keys/values and conv context of the frames already made, and of the prompt, cached per voice)
    and compute only their new frames; off, every chunk recomputes the whole prefix as upstream does.  Both give
    the same streaming chunks (within float rounding); final chunks are upstream's full-attention pass either
    way.  The ``tensorrt`` flow always recomputes (no state inputs).  The flag is the one spelling: the old flow
    name ``incremental`` is refused with a message that names the flag.
    """

    llm: str = "eager"
    flow: str = "eager"
    vocoder: str = "eager"
    dtype: str = "fp32"
    incremental: bool = True

    def __post_init__(self) -> None:
        if self.flow == "incremental":  # the old spelling of the flag: a user may still type it
            raise ConfigError("flow backend 'incremental' is not a separate backend: use flow='eager' with "
                              "incremental=True (the default: the command line's --recompute-flow turns it off)")
        for stage, ok in BACKEND_CHOICES.items():
            v = getattr(self, stage)
            if v not in ok:
                raise ConfigError(f"unknown {stage} backend {v!r}; choose one of {', '.join(ok)}")
        if self.dtype not in TORCH_DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose fp32, fp16 or bf16")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the LM and flow run in (HiFT always runs in fp32)."""
        return TORCH_DTYPES[self.dtype]
