"""Device-RAS decode steps of the ``cudagraph`` LLM, launched ahead of the call that asks for them.

With the repetition-aware sampler inside the batched decode graph (``device_ras``, on where Triton is), each
row's exponential variates are recomputed from its generator's seed and offset (:mod:`.kernels.philox`), the
repetition check reads the row's last history tokens, and the host only advances each generator by one draw
(two after a fallback).  The graph also writes each row's next inputs back into its own input columns
(:mod:`.decode_feed`), so with ``decode_ahead`` each decode call launches the step after the one it returns
before reading anything: the host's per-token work (reading, accepting, the engine's bookkeeping) overlaps the
GPU's next step instead of sitting between two steps.  A prefill does the same for each row's first decode
step (its graph wrote that step's inputs), so the GPU goes from a new request's prefill straight into its first
step while the host reads the prefill's tokens.

:class:`DecodeAhead` is a mixin of :class:`~.graph.CudaGraphLLM`: its methods use the step feed, slot pool and
replay the backend's constructor sets up.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from cosyvoice_fast.llm.decode_feed import Row, StepFeed
from cosyvoice_fast.llm.kv_pool import SlotPool
from cosyvoice_fast.llm.prefill import PrefillItem
from cosyvoice_fast.llm.stage import LLMState, StepResult

log = logging.getLogger(__name__)


class DecodeAhead:
    """Launching device-RAS steps, ahead or behind a prefill, and taking their pending results (see the module
    docstring).  :class:`~.graph.CudaGraphLLM` sets every attribute named here in its constructor and provides
    ``_set_mask`` (:class:`~.graph_slots.SlotSteps`), ``_replay``, ``_accept_rows`` and ``release``."""

    decode_ahead: bool
    max_len: int
    pool: SlotPool
    ahead_rows: int
    _feed: StepFeed
    _drawn: torch.Tensor
    _repeats: int

    def _launch(self, rows: Sequence[LLMState], ahead: bool, prefilled: bool = False) -> None:
        """Replay one device-RAS step for ``rows``: each at its next step whose result is not pending yet.
        ``ahead``: one past the step pending for it, with inputs the graph left on the device; else its next
        step from the host's state (a fresh column).  ``prefilled``: the first decode step of rows whose prefill
        was just launched and whose token is not read yet (the prefill graph wrote their columns).  Its result
        becomes pending (:class:`.decode_feed.StepFeed`)."""
        columns: dict[int, list[int] | None] = {}
        launched, top = [], 0
        for st in rows:
            s = self.pool.item(st.slot)
            step, pos = (st.step + 1, st.pos + 1) if ahead else (st.step + prefilled, st.pos)
            s.cache.check_room(pos, 1)
            self._set_mask(s, step, st.min_len, st.ignore_eos)
            fresh = not (ahead or prefilled)
            columns[s.index] = self._feed.column(st.history[-1], pos, st.generator, st.history) if fresh else None
            launched.append(Row(s.index, st, step, pos))
            top = max(top, pos)
        self._feed.stage(columns)
        self._replay(top, max(columns))
        self._feed.collect(self._drawn, launched)
        self.ahead_rows += len(launched) if ahead or prefilled else 0

    def _launch_first(self, group: Sequence[PrefillItem]) -> None:
        """Between a prefill replay and the read of its tokens: launch the first decode step of each row that
        will take one (its prefill graph wrote the step's inputs), so the GPU goes on from the prefill to that
        step while the host reads, accepts and schedules.  A row whose prefill token ends it (a stop id) drops
        the step when its slot is released.  The inputs assume the prefill's token was drawn with one draw: true
        whenever the repetition threshold is positive (an empty window never repeats)."""
        if any(it.state.generator.device.type != "cuda" for it in group):
            return  # a CPU generator's row is sampled on the host from the prefill's log-probs: keep them
        if self._repeats <= 0:
            return  # a rule that redraws even on an empty window moves the generator twice: the column is wrong
        rows = [it.state for it in group if it.state.max_len > 1 and it.state.pos < self.max_len]
        if not rows:
            return
        try:
            self._launch(rows, ahead=False, prefilled=True)
        except Exception:  # noqa: BLE001 - only a head start: the decode call launches these steps itself
            log.exception("could not launch the first decode step behind a prefill; the decode call launches it")
            for st in rows:
                self._feed.drop(st.slot)

    def _decode_fed(self, states: Sequence[LLMState]) -> list[StepResult]:
        """A device-RAS decode call (caller holds the lock): launch the rows whose step is not pending (new,
        or back after sitting out), then, with ``decode_ahead``, every row's step after, and only then read
        and accept the results of the steps asked for.  The step launched ahead is this call's ``states``'s
        next step: the engine's next call usually asks for it, and finds it computed or computing.  A state with
        ``no_ahead`` set gets none: the engine pauses it after this step, so a step ahead would only take GPU time
        from the chunk that paused it (and its next call launches that step from the host, as after sitting
        out)."""
        feed = self._feed
        try:
            feed.settle()
            fresh = [st for st in states if not feed.pending(st.slot, st, st.step)]
            if fresh:
                self._launch(fresh, ahead=False)
            # a CPU generator's row is sampled on the host from the step's log-probs: nothing may overwrite them
            if self.decode_ahead and all(st.generator.device.type == "cuda" for st in states):
                more = [st for st in states if st.step + 1 < st.max_len and st.pos + 1 < self.max_len
                        and not st.no_ahead]
                if more:
                    self._launch(more, ahead=True)
        except Exception as e:  # noqa: BLE001 - the launch failed as a whole: each row gets the error
            for st in states:
                self.release(st)
            return [e] * len(states)
        return self._accept_rows(states, lambda st, s: feed.take(st.slot, st, st.step))
