"""The names every stage uses to say "this backend cannot run here": a leaf, so stages and the registry agree.

The registry that asks each backend lives in :mod:`cosyvoice_fast.engine.stages`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackendInfo:
    stage: str
    name: str
    available: bool
    reason: str = ""


TRITON_MISSING = "package triton is not installed (pip install triton; CUDA builds of torch ship with it)"


class BackendUnavailable(RuntimeError):
    """A backend was asked for that cannot run here; the message says why and what to choose instead."""
