"""The eager LLM backend: the reference every faster LLM backend is checked against."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.llm.stage import LLMState, StepResult, accept_token, new_llm_state


class EagerLLM:
    """Speech-token generation with the model's own KV cache per state, the reference for every faster LLM.

    Batch calls loop their rows (each state has its own cache sized to its prompt + ``max_len``): eager PyTorch
    at batch 1 is the reference, and a row's math is exactly :meth:`Qwen2LM.generate`'s, so the same seed gives
    the same tokens however the engine groups the rows.  No slots: ``capacity`` is ``None``."""

    capacity: int | None = None
    prefill_synced = False  # rows run one after another on the caller's stream

    def __init__(self, llm: torch.nn.Module, config: ModelConfig):
        self.llm = llm
        self.config = config
        self.sampler = llm.default_sampler()

    def new_state(self, inputs: Any, text: torch.Tensor, generator: torch.Generator, max_tokens: int | None,
                  ignore_eos: bool) -> LLMState:
        return new_llm_state(self.llm, inputs, text, generator, max_tokens, ignore_eos)

    def free_slots(self) -> int | None:
        return None

    def _draw(self, st: LLMState, logp: torch.Tensor) -> int | None:
        """Mask as :meth:`Qwen2LM.generate` does for this step, draw, record the token on ``st``."""
        cfg = self.llm.cfg
        if st.ignore_eos:
            logp[cfg.first_stop_id:] = -float("inf")
        elif st.step < st.min_len:
            logp[cfg.min_len_masked_id] = -float("inf")
        tok = accept_token(st, int(self.sampler(logp, st.history, st.generator)), cfg.first_stop_id)
        if st.done:
            self.release(st)
        return tok

    def _rows(self, states: Sequence[LLMState], one: Callable[[LLMState], int | None]) -> list[StepResult]:
        out: list[StepResult] = []
        for st in states:
            try:
                with torch.inference_mode():
                    out.append(one(st))
            except Exception as e:  # noqa: BLE001 - a row's failure is that row's own
                self.release(st)
                out.append(e)
        return out

    def _prefill_one(self, st: LLMState) -> int | None:
        lm_input = self.llm.build_lm_input(st.text, st.prompt_text, st.prompt_speech)
        st.cache = self.llm.new_cache(lm_input.shape[1] + st.max_len)
        st.pos = lm_input.shape[1]
        return self._draw(st, self.llm.prefill(lm_input, st.cache)[0])

    def _decode_one(self, st: LLMState) -> int | None:
        logp = self.llm.decode_step(st.history[-1], st.cache, st.pos)[0]
        st.pos += 1
        return self._draw(st, logp)

    def prefill(self, states: Sequence[LLMState]) -> list[StepResult]:
        return self._rows(states, self._prefill_one)

    def decode(self, states: Sequence[LLMState]) -> list[StepResult]:
        return self._rows(states, self._decode_one)

    def release(self, state: LLMState) -> None:
        state.cache = None
