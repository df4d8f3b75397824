"""The engine's LLM stage for bi-streamed requests: text pieces in, speech tokens out, batched like any request.

The engine drives every LM through one protocol (:class:`~.base.LLMStage`: ``new_state``/``prefill``/``decode``/
``release``).  A bi-streamed request differs in two ways, both hidden here: its next input may be several rows
(text, prompt speech, ``task``) instead of one token, and it may have to wait for text.  So each
:class:`BistreamLLMState` carries the schedule (:class:`~cosyvoice_fast.llm.model.bistream.BistreamState`) and the
request's :class:`~cosyvoice_fast.engine.bistream.TextFeed`; its ``ready`` is False while the schedule waits for
text that has not come, and the engine skips it (and sleeps until :meth:`Engine.wake`) instead of spinning.

A reader thread per request pulls the text source (:func:`start_reader`), pushes pieces into the feed under the
stage's lock and wakes the engine.  Its errors (a timeout, text over the length limit, nothing to speak) become
the request's error at its next step, with the frontend's message.

Rows run through a runner with ``acquire``/``step_batch``/``release``: the eager one
(:class:`~.bistream_eager.EagerBistream`, any device) or :class:`~.bistream_graph.GraphBistream` (CUDA graphs);
tokens are decided on the host exactly as the eager driver decides them, so the same seed gives the same ids.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from cosyvoice_fast.llm.model.bistream import BistreamState
from cosyvoice_fast.llm.model.sampling import Sampler
from cosyvoice_fast.llm.token_filter import TokenFilter
from cosyvoice_fast.llm.stage import LLMState, StepResult
from cosyvoice_fast.llm.bistream_eager import EagerBistream, decide

log = logging.getLogger(__name__)


@dataclass(eq=False)
class BistreamLLMState(LLMState):
    """An :class:`LLMState` whose text arrives while it runs (``feed``), stepped by ``bistream``'s schedule."""

    bistream: BistreamState | None = None
    feed: Any = None  # runtime.bistream.TextFeed

    @property
    def error(self) -> BaseException | None:
        """What stopped the text source early (timeout, over-long text, nothing to speak)."""
        return None if self.feed is None else self.feed.error

    @property
    def ready(self) -> bool:
        """False while the schedule waits for text the source has not delivered (the engine skips the row)."""
        return self.error is not None or self.done or self.bistream is None or not self.bistream.waiting


class BistreamLLM:
    """Batch calls over bi-streamed states on ``runner`` (eager or graph), one lock for schedule updates."""

    prefill_synced = False

    def __init__(self, runner: Any, sampler: Sampler | None = None):
        self.runner = runner
        self.llm = runner.llm
        self.sampler = sampler if sampler is not None else self.llm.default_sampler()
        self.lock = threading.Lock()  # the reader threads push text; the engine's worker steps
        self._feeds: dict[int, Any] = {}
        self.capacity: int | None = None if isinstance(runner, EagerBistream) else runner.cache.batch

    def free_slots(self) -> int | None:
        return None if self.capacity is None else len(self.runner._free)

    def attach(self, inputs: Any, feed: Any) -> None:
        """Bind a request's text feed to its model inputs; :meth:`new_state` picks it up for that request."""
        self._feeds[id(inputs)] = feed

    def new_state(self, inputs: Any, text: torch.Tensor, generator: torch.Generator, max_tokens: int | None,
                  ignore_eos: bool) -> BistreamLLMState:
        feed = self._feeds.pop(id(inputs), None)
        if feed is None:
            raise RuntimeError("a bi-streaming state needs a text feed: use bistream_inputs() to admit the request")
        return BistreamLLMState(text=text, prompt_text=inputs.prompt_text, prompt_speech=inputs.llm_prompt_speech_token,
                                generator=generator, min_len=0, max_len=max_tokens or 1 << 30, ignore_eos=ignore_eos,
                                bistream=feed.state, feed=feed, token_filter=TokenFilter.for_config(self.llm.cfg))

    def prefill(self, states: Sequence[BistreamLLMState]) -> list[StepResult]:
        for st in states:
            if st.slot is None:
                st.slot = self.runner.acquire()
        return self.decode(states)

    def decode(self, states: Sequence[BistreamLLMState]) -> list[StepResult]:
        """One step for every state that has one; a waiting state gets ``None`` (no token) and stays running."""
        results: list[StepResult] = [None] * len(states)
        with self.lock:
            rows = []
            for i, st in enumerate(states):
                if st.error is not None:
                    results[i] = st.error
                elif not st.done and st.bistream.next_step() is not None:
                    rows.append(i)
                elif st.bistream.done:
                    self._end(st)
            if rows:
                logps = self.runner.step_batch([(states[i].bistream, states[i].slot) for i in rows])
                for i, logp in zip(rows, logps):
                    st = states[i]
                    bs = st.bistream
                    logp = logp.to(st.generator.device)  # the graph runner hands log-probs back on the host
                    token = decide(bs.next_step(), logp, bs.out, self.sampler, st.generator)
                    results[i] = bs.accept(token)
                    if results[i] is not None:
                        st.history.append(int(results[i]))
                    if bs.done:
                        self._end(st)
        return results

    def _end(self, st: BistreamLLMState) -> None:
        st.done = True
        self.release(st)

    def release(self, state: BistreamLLMState) -> None:
        reader = getattr(state.feed, "reader", None)
        if reader is not None:
            reader.stop.set()  # the reader stops at its next piece
        if state.bistream is not None and not state.bistream.done:
            state.bistream.close()
        if state.slot is not None:
            self.runner.release(state.slot)
            state.slot = None


def push_piece(stage: BistreamLLM, state_feed: Any, piece: str) -> int:
    """Push one piece under the stage's lock (the worker may be stepping the same schedule)."""
    with stage.lock:
        if state_feed.state.done:
            return 0
        return state_feed.push(piece)


def end_text(stage: BistreamLLM, feed: Any) -> None:
    with stage.lock:
        if not feed.state.done:
            feed.end()


@dataclass
class ReaderHandle:
    """The reader thread of one request; ``error`` holds what stopped it early (also set on the LM state)."""

    thread: threading.Thread
    stop: threading.Event = field(default_factory=threading.Event)


def start_reader(stage: BistreamLLM, feed: Any, source: Any, limits: Any, wake: Callable[[], None],
                 on_error: Callable[[BaseException], None], on_piece: Callable[[float], None] | None = None,
                 stop: threading.Event | None = None) -> ReaderHandle:
    """Pull ``source`` in a daemon thread: every piece goes into ``feed`` and wakes the engine; the end (or an
    error: timeout, over-long text, no text) too.  ``stop`` (set on cancellation) ends it at the next piece."""
    from cosyvoice_fast.frontend.text_source import aread_pieces, read_pieces

    stop = stop or threading.Event()

    def consume(piece: str) -> bool:
        if stop.is_set():
            return False
        push_piece(stage, feed, piece)
        if on_piece is not None:
            on_piece(feed.arrivals[-1].t if feed.arrivals else 0.0)
        wake()
        return True

    def run() -> None:
        try:
            if hasattr(source, "__aiter__") or isinstance(source, asyncio.Queue):
                async def pull() -> bool:
                    async for piece in aread_pieces(source, limits):
                        if not consume(piece):
                            return False
                    return True

                finished = asyncio.run(pull())
            else:
                finished = True
                for piece in read_pieces(source, limits):
                    if not consume(piece):
                        finished = False
                        break
            if finished and not stop.is_set():
                end_text(stage, feed)
        except BaseException as e:  # noqa: BLE001 - the request fails with the reader's message, nothing else
            if not stop.is_set():
                on_error(e)
        wake()

    thread = threading.Thread(target=run, name="bistream-text", daemon=True)
    thread.start()
    return ReaderHandle(thread, stop)
