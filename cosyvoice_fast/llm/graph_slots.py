"""A ``cudagraph`` LLM slot and its per-step host work: the eos mask, the draw's variates, the RAS rule on the host.

:class:`~.graph.CudaGraphLLM` hands each request a :class:`Slot` (views of one row of its batched buffers).
:class:`SlotSteps` holds what the backend does per slot around a replay when the repetition-aware rule does not
run inside the graph (no Triton, a CPU generator, a prefill's first token): mirror the eager sampler's
masking, draw the nucleus variates from the request's own generator, and apply the rule (and any fallback
draw) on the host, so the tokens are the eager sampler's draw for draw.  It is a mixin of the backend: its
methods use the buffers the backend's constructor allocates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from cosyvoice_fast.llm.decode_feed import int64
from cosyvoice_fast.llm.kv_pool import SlotPool
from cosyvoice_fast.llm.model.kv_cache import KVCache
from cosyvoice_fast.llm.model.sampling import random_sample
from cosyvoice_fast.llm.prefill import PrefillItem
from cosyvoice_fast.llm.stage import LLMState

_NEG_INF = -float("inf")


@dataclass
class Slot:
    """One request's static state: its cache and the graphs' per-row inputs and outputs.

    ``cache``, ``bias``, ``q``, ``logp`` and ``token`` are views of row ``index`` of the backend's batched
    buffers, so the batched decode graphs and the batched prefill graphs (which gather and scatter by slot
    index) share them.
    """

    index: int
    cache: KVCache
    bias: torch.Tensor  # (V,) fp32: 0 or -inf (the step's eos/stop mask)
    q: torch.Tensor  # (top_k,) fp32: exponential variates of this step's draw
    logp: torch.Tensor  # (V,) fp32 out: masked log-probs
    token: torch.Tensor  # (1,) int64 out: the nucleus draw
    mask_mode: str = ""


class SlotSteps:
    """The backend's per-slot host work (see the module docstring).  :class:`~.graph.CudaGraphLLM` sets every
    attribute named here in its constructor and provides ``_replay``."""

    llm: torch.nn.Module
    sampler: Any
    device: torch.device
    device_ras: bool
    max_len: int
    pool: SlotPool
    fallback_draws: int
    _philox: Any
    _copied: torch.cuda.Event | None
    _host_in: torch.Tensor
    _host_np: Any
    _step_in: torch.Tensor

    def _set_mask(self, s: Slot, step: int, min_len: int, ignore_eos: bool) -> None:
        """Mirror eager's per-step masking: all stop ids with ``ignore_eos``, else the config's min-len id (eos in
        CosyVoice2, sos in CosyVoice3) for the first ``min_len``."""
        mode = "stops" if ignore_eos else ("eos" if step < min_len else "none")
        if mode == s.mask_mode:
            return
        cfg = self.llm.cfg
        s.bias.zero_()
        if mode == "stops":
            s.bias[cfg.first_stop_id:] = _NEG_INF
        elif mode == "eos":
            s.bias[cfg.min_len_masked_id] = _NEG_INF
        s.mask_mode = mode

    def _take(self, s: Slot, history: list[int], gen: torch.Generator, token: int,
              fallback: int | None = None) -> int:
        """The step's token on the host, with the RAS repetition rule applied exactly as the eager sampler does.

        ``token``: the graph's nucleus draw, read to the host with its step's other rows.  ``fallback`` (device
        RAS): the graph applied the rule already and says whether it redrew; the generator is advanced past
        the draws it made."""
        if gen.device.type != "cuda":  # a CPU generator draws on the CPU: let the eager sampler do all of it
            return int(self.sampler(s.logp, history, gen))
        if fallback is not None:
            gen.set_offset(gen.get_offset() + self._philox.DRAW_OFFSET * (1 + fallback))
            self.fallback_draws += fallback
            return token
        win, tau = self.sampler.win_size, self.sampler.tau_r
        window = history[-win:] if win > 0 else []
        if window.count(token) >= win * tau:
            banned = s.logp.clone()
            banned[token] = _NEG_INF
            token = random_sample(banned, gen)
            self.fallback_draws += 1
        return token

    def _replay_rows(self, rows: Sequence[LLMState]) -> None:
        """Feed each state's last token at its position and replay the batched graph (bucket: the largest
        position); the host samples afterwards.  Rows not listed sit at ``max_len - 1`` (see the module
        docstring for why that is harmless).  The path without device RAS."""
        if self._copied is not None:  # the pinned buffer is read by an async copy: wait for the last one
            self._copied.synchronize()  # (normally long done: every step syncs on its tokens)
        host = self._host_np
        host[0, :] = 0
        host[1, :] = self.max_len - 1
        slots = [self.pool.item(r.slot) for r in rows]
        for r, s in zip(rows, slots):
            s.cache.check_room(r.pos, 1)
            host[0, s.index] = r.history[-1]
            host[1, s.index] = r.pos
        self._step_in.copy_(self._host_in, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        for r, s in zip(rows, slots):
            self._set_mask(s, r.step, r.min_len, r.ignore_eos)
            if r.generator.device.type == "cuda":  # each row's draw from its own generator, in its own order
                s.q.exponential_(1.0, generator=r.generator)
        self._replay(max(r.pos for r in rows), max(s.index for s in slots))

    def _prefill_draw(self, it: PrefillItem, in_graph: bool) -> None:
        """The nucleus variates of a prefill draw: ``exponential_`` of the request's generator into the slot's
        buffer, or with device RAS the same bits from its seed and offset, drawn by the prefill graph itself
        (``in_graph``: its item carries them) or here; the generator is advanced past them either way."""
        gen, s = it.state.generator, it.slot
        if not self.device_ras:
            s.q.exponential_(1.0, generator=gen)
            return
        offset = gen.get_offset()
        it.draw = (int64(gen.initial_seed()), offset)
        if not in_graph:
            state = torch.tensor([[it.draw[0]], [offset]], dtype=torch.long)
            self._philox.exponential_rows(state.to(self.device, non_blocking=True), s.q.view(1, -1))
        gen.set_offset(offset + self._philox.DRAW_OFFSET)
