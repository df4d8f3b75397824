"""Test-only helpers shared by several test modules (kept out of the package: nothing in production uses them)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cosyvoice_fast.llm.buckets import token_budget
from cosyvoice_fast.llm.prefill import PrefillItem
from cosyvoice_fast.llm.stage import LLMState


def teacher_forced_logp(stage: Any, lm_input: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """(len(tokens) + 1, V) log-probs of a :class:`~cosyvoice_fast.llm.graph.CudaGraphLLM` ``stage``: after
    prefilling ``lm_input``, then after feeding each token through the captured graphs (no masking, no sampling
    effects).  Drives the stage's own slot, prefill and replay internals, as only the parity tests need."""
    index, s = stage.pool.acquire()
    gen = torch.Generator(device=stage.device)
    try:
        with torch.inference_mode(), stage._lock:
            if stage._feed is not None:
                stage._feed.settle()
            stage._set_mask(s, 0, 0, False)
            token_budget(lm_input.shape[1], len(tokens) + 1, stage.max_len, True)
            s.q.exponential_(1.0, generator=gen)
            (group,) = stage.prefiller.groups([PrefillItem(0, None, s, lm_input=lm_input)])
            stage.prefiller.run(*group)
            rows = [s.logp.clone()]
            row = LLMState(text=lm_input, prompt_text=None, prompt_speech=None, generator=gen, min_len=0,
                           max_len=len(tokens) + 1, ignore_eos=False, slot=index)
            for i, tok in enumerate(tokens):
                row.history.append(int(tok))
                row.pos = lm_input.shape[1] + i
                if stage._feed is not None:  # the batched graph, this row alone (others not live)
                    stage._launch([row], ahead=False)
                    stage._feed.take(index, row, row.step)  # only the log-probs are wanted
                else:  # the batched graph, this row alone (others idle at max_len - 1)
                    stage._replay_rows([row])
                rows.append(s.logp.clone())
        return torch.stack(rows)
    finally:
        stage.pool.release(index)
