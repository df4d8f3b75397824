"""The per-stage backend interface and the registry that says which backends can run here, and why not.

The engine is the only scheduler: it decides which requests run, when, and which of them share a call.  Each
stage backend offers batch calls over request states and keeps no per-request state of its own:

- LLM: ``new_state(inputs, text, generator, max_tokens, ignore_eos) -> LLMState`` (plain data, no device work),
  ``prefill(states)`` and ``decode(states)`` (one token per state, see :class:`LLMStage`), ``release(state)``,
  and ``capacity`` (slots; ``None`` = unbounded).  The slot index, cache position, token history, generator
  and length limits live on the :class:`LLMState`, which the request's segment owns.
- flow: ``chunk(segment_state, inputs, tokens, call) -> mel (1, 80, new frames)``; optionally
  ``solve(items) -> list of mels`` for several requests' calls at once (``items`` are
  ``(segment_state, inputs, tokens, call)`` tuples; each mel must equal that item's ``chunk`` up to float
  rounding) and ``max_batch`` (items it will share; <= 1 means "do not batch").
- vocoder: ``vocode(mel, cache_source, generator) -> (wav, source)``; optionally
  ``vocode_batch(mels, sources, generators) -> (wavs, sources)`` for B chunks of one shape at once (each row
  equals that row's ``vocode`` up to float rounding; the noise of row i is drawn from ``generators[i]``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence, Union

import torch

from ..config import BackendConfig


@dataclass(eq=False)
class LLMState:
    """One text segment's speech-token generation: everything a backend needs to step it, owned by the segment.

    ``history`` holds the tokens drawn so far (the repetition check reads it; the last one is fed next),
    ``pos`` the cache position the next fed token is written at, ``slot`` the backend slot it holds (``None``:
    none), ``cache`` a backend's per-state cache (the eager LM's own KV cache), ``extra`` anything else a
    backend keeps per request (e.g. an external runner's stream).  ``done`` turns true when a stop id was drawn
    or ``max_len`` tokens exist; a done state holds no slot.  ``no_ahead`` is the engine's word, set before each
    decode call, that it will not ask for this state's next step right away (the step's token completes the
    request's first chunk, whose solve should find the GPU free): a backend that launches steps ahead of the
    call that asks for them (``decode_ahead``) does not for this state this time."""

    text: torch.Tensor
    prompt_text: torch.Tensor | None
    prompt_speech: torch.Tensor | None
    generator: torch.Generator
    min_len: int
    max_len: int
    ignore_eos: bool
    history: list[int] = field(default_factory=list)
    pos: int = 0
    slot: int | None = None
    cache: Any = None
    extra: Any = None
    done: bool = False
    no_ahead: bool = False

    @property
    def ready(self) -> bool:
        """Whether the state can be stepped now.  Always on plain states; a bi-streaming state is not while it
        waits for more text (the engine then neither steps nor fails it, and is woken by ``Engine.wake``)."""
        return True

    @property
    def step(self) -> int:
        """Index of the token the next draw produces (selects the eos mask)."""
        return len(self.history)


#: a row's outcome of ``prefill``/``decode``: a token, ``None`` (a stop id was drawn: no token) or the row's error
StepResult = Union[int, None, BaseException]


def new_llm_state(model: torch.nn.Module, inputs: Any, text: torch.Tensor, generator: torch.Generator,
                  max_tokens: int | None, ignore_eos: bool) -> LLMState:
    """An :class:`LLMState` with the model's length limits (upstream's 2x/20x text rules, ``max_tokens``)."""
    min_len, max_len = model.length_limits(int(text.shape[-1]), max_tokens, ignore_eos)
    return LLMState(text=text, prompt_text=inputs.prompt_text, prompt_speech=inputs.llm_prompt_speech_token,
                    generator=generator, min_len=min_len, max_len=max_len, ignore_eos=ignore_eos,
                    done=max_len <= 0)


def accept_token(state: LLMState, token: int, stop: int) -> int | None:
    """Record a drawn token on ``state``: a stop id ends it (``None``), else it joins the history and the state
    is done once it holds ``max_len`` tokens.  Returns what the caller gets for this draw."""
    if token >= stop:
        state.done = True
        return None
    state.history.append(token)
    if len(state.history) >= state.max_len:
        state.done = True
    return token


class LLMStage(Protocol):
    """Speech-token generation as batch calls over states (see the module docstring).

    ``prefill(states)`` takes a slot per state (the engine never passes more than ``free_slots()``), runs
    the prompt and draws each state's first token; ``decode(states)`` feeds each state's last token and draws
    the next (states must not be done).  Both return one :data:`StepResult` per state, in order; a state that
    became done has given its slot back.  ``release(state)`` frees a state's slot and cache (idempotent: the
    engine calls it on cancellation and errors)."""

    capacity: int | None

    def new_state(self, inputs: Any, text: torch.Tensor, generator: torch.Generator, max_tokens: int | None,
                  ignore_eos: bool) -> LLMState: ...

    def free_slots(self) -> int | None: ...

    def prefill(self, states: Sequence[LLMState]) -> list[StepResult]: ...

    def decode(self, states: Sequence[LLMState]) -> list[StepResult]: ...

    def release(self, state: LLMState) -> None: ...


def iter_alone(stage: LLMStage, inputs: Any, text: torch.Tensor, generator: torch.Generator,
               max_tokens: int | None = None, ignore_eos: bool = False) -> Iterator[int]:
    """One request's tokens, run alone through ``stage``'s batch calls, one per ``next`` (tests, profiling).

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


class FlowStage(Protocol):
    def chunk(self, seg: Any, inputs: Any, tokens: torch.Tensor, call: Any) -> torch.Tensor: ...


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


TRITON_MISSING = "package triton is not installed (pip install triton; CUDA builds of torch ship with it)"


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
    fused_off = no_cuda if not cuda else ("" if _has("triton") else TRITON_MISSING)
    out += [BackendInfo(s, "fused", not fused_off, fused_off) for s in ("llm", "vocoder")]
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
