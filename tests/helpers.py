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


def random_full_size_lm(dtype: torch.dtype, device: str = "cuda", seed: int = 0) -> torch.nn.Module:
    """The speech LM at CosyVoice2-0.5B shapes with seeded random weights (norms at 1, a sharper speech head so
    sampling is not flat): what the GPU tests and the fused-decode check time and compare backends on."""
    from cosyvoice_fast.config.model import full_config
    from cosyvoice_fast.llm.model.speech_lm import Qwen2LM

    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        lm = Qwen2LM(full_config().llm)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.1 if name.startswith("llm_decoder.weight") else 0.02, generator=g)
    return lm.to(dtype).eval().requires_grad_(False)
