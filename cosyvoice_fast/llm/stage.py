"""The LLM stage's contract with the engine: per-request :class:`LLMState` and the batch calls of :class:`LLMStage`.

The engine is the only scheduler: it decides which requests run, when, and which of them share a call.  An LLM
backend offers ``new_state(inputs, text, generator, max_tokens, ignore_eos) -> LLMState`` (plain data, no device
work), ``prefill(states)`` and ``decode(states)`` (one token per state), ``release(state)`` and ``capacity``
(slots; ``None`` = unbounded).  The slot index, cache position, token history, generator and length limits live
on the :class:`LLMState`, which the request's segment owns, so a backend keeps no per-request state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, Union

import torch

from cosyvoice_fast.llm.token_filter import NO_FILTER, TokenFilter


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
    call that asks for them (``decode_ahead``) does not for this state this time.  ``token_filter`` is the
    family's rule for which tokens reach the flow and ``silent_run`` its state (see :meth:`to_flow`)."""

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
    token_filter: TokenFilter = NO_FILTER
    silent_run: int = 0

    def to_flow(self, token: int) -> list[int]:
        """What of the drawn ``token`` goes on to the flow: ``[token]``, or ``[]`` when the family's filter drops
        it (CosyVoice3 drops long runs of silent tokens; the LM's ``history`` keeps every token either way).
        Call once per drawn token, in order: it advances the rule."""
        keep, self.silent_run = self.token_filter.step(self.silent_run, token)
        return [token] if keep else []

    @property
    def ready(self) -> bool:
        """Whether the state can be stepped now.  Always on plain states; a bi-streaming state is not while it
        waits for more text (the engine then neither steps nor fails it, and is woken by ``Engine.wake``)."""
        return True

    @property
    def step(self) -> int:
        """Index of the token the next draw produces (selects the eos mask)."""
        return len(self.history)


def steppable(state: LLMState | None) -> bool:
    """Whether a segment's LM ``state`` can take part in a decode call now: it exists and is
    :attr:`~LLMState.ready` (a bi-streaming state waiting for text is not).  The one place the engine's
    scheduler and chunk runner ask."""
    return state is not None and state.ready


#: a row's outcome of ``prefill``/``decode``: a token, ``None`` (a stop id was drawn: no token) or the row's error
StepResult = Union[int, None, BaseException]


def new_llm_state(model: torch.nn.Module, inputs: Any, text: torch.Tensor, generator: torch.Generator,
                  max_tokens: int | None, ignore_eos: bool) -> LLMState:
    """An :class:`LLMState` with the model's length limits (upstream's 2x/20x text rules, ``max_tokens``) and
    token filter; a prompt the model refuses (a CosyVoice3 one without ``<|endofprompt|>``) raises here, before
    any device work."""
    model.check_prompt(text, inputs.prompt_text)
    min_len, max_len = model.length_limits(int(text.shape[-1]), max_tokens, ignore_eos)
    return LLMState(text=text, prompt_text=inputs.prompt_text, prompt_speech=inputs.llm_prompt_speech_token,
                    generator=generator, min_len=min_len, max_len=max_len, ignore_eos=ignore_eos,
                    done=max_len <= 0, token_filter=TokenFilter.for_config(model.cfg))


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
    engine calls it on cancellation and errors).  ``prefill_synced``: ``prefill`` returns only once its GPU work
    is done (it read the drawn tokens back), so the engine need not wait for the stream to time it."""

    capacity: int | None
    prefill_synced: bool

    def new_state(self, inputs: Any, text: torch.Tensor, generator: torch.Generator, max_tokens: int | None,
                  ignore_eos: bool) -> LLMState: ...

    def free_slots(self) -> int | None: ...

    def prefill(self, states: Sequence[LLMState]) -> list[StepResult]: ...

    def decode(self, states: Sequence[LLMState]) -> list[StepResult]: ...

    def release(self, state: LLMState) -> None: ...
