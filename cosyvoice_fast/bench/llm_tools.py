"""One request run alone through an LLM stage's batch calls: what the profilers and the parity tests drive.

Not how the engine drives a backend (it batches every running state into one call), so this lives beside the
benchmarks rather than in :mod:`cosyvoice_fast.llm`.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from cosyvoice_fast.llm.stage import LLMStage


def iter_alone(stage: LLMStage, inputs: Any, text: torch.Tensor, generator: torch.Generator,
               max_tokens: int | None = None, ignore_eos: bool = False) -> Iterator[int]:
    """One request's tokens, run alone through ``stage``'s batch calls, one per ``next``.

    Not how the engine drives a backend (it batches every running state into one call); closing the
    iterator releases the slot."""
    state = stage.new_state(inputs, text, generator, max_tokens, ignore_eos)
    try:
        call = stage.prefill
        while not state.done:
            (res,) = call([state])
            call = stage.decode
            if isinstance(res, BaseException):
                raise res
            if res is not None:
                yield res
    finally:
        stage.release(state)


def generate_alone(stage: LLMStage, inputs: Any, text: torch.Tensor, generator: torch.Generator,
                   max_tokens: int | None = None, ignore_eos: bool = False) -> list[int]:
    """Every token of one request run alone (see :func:`iter_alone`)."""
    return list(iter_alone(stage, inputs, text, generator, max_tokens, ignore_eos))
