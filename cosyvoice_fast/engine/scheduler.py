"""The engine's scheduler: the request lists, the LLM side, and the worker thread(s) that run both sides.

Two sides share the running requests:

- the **LLM side** (:meth:`Scheduler.llm_turn`) drops cancelled requests, admits waiting ones into free streams,
  opens segments and prefills their LMs (one ``llm.prefill(states)`` per LLM stage, never more than its free
  slots: a request without a slot waits, it does not fail), then steps every running LM that is ``ready`` in one
  ``llm.decode(states)`` per LLM stage, and appends the chunk calls that became ready to each segment;
- the **chunk side** (:class:`~.chunks.ChunkRunner`) solves every ready chunk call, first chunks first (first
  audio has priority), batched per flow stage, and vocodes them batched per vocoder stage.

With ``EngineConfig.cuda_streams == 2`` each side has its own worker thread, and on a GPU its own CUDA stream
(the LLM's at high priority): a 100 ms batch of flow solves no longer holds every stream's decoding behind it.
First audio keeps precedence: while a batch holding a first chunk is solved, the LMs already past their own
first chunk pause, and an LM pauses as soon as its own first chunk is ready (see ``Scheduler._yields``), so that
solve has the GPU to itself as in the serial order
(``EngineConfig.first_chunk_priority``; with it off every LM keeps decoding).
Both threads wait on one condition when they have nothing to do (never a busy loop), and each wakes the other
when it made work for it.  With ``cuda_streams == 1`` one thread runs an LLM turn then a chunk turn.

Ownership keeps the two threads apart: an LLM state (slot, KV cache) is only ever touched on the LLM side, so
a request that ends on the chunk side (its last chunk, or an error) while its LM still holds a slot is handed
to the LLM side to release it; flow and vocoder state are only touched on the chunk side.  A request that
ended while its chunk was being computed gets nothing more (``state.done`` is checked under the lock).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

import torch

from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.config import schedule as chunk_schedule
from cosyvoice_fast.config.schedule import ChunkCall, ChunkCursor, first_chunk_wait, later_chunk_wait
from cosyvoice_fast.telemetry.record import RequestTelemetry, now
from cosyvoice_fast.engine.chunks import ChunkRunner, group_by
from cosyvoice_fast.engine.state import RequestState, SegmentState
from cosyvoice_fast.engine.stream import DONE

log = logging.getLogger(__name__)

COUNTERS = ("rejected", "admitted", "decode_steps", "decode_rows", "flow_calls", "flow_rows", "vocoder_calls",
            "vocoder_rows")


class EngineClosed(RuntimeError):
    """The engine is shut down (or was, while the request ran)."""


class Scheduler:
    """Requests waiting (``incoming``) and running (``active``), and the workers that advance them."""

    def __init__(self, config: EngineConfig, device: torch.device, sample_rate: int, chunk_size: int,
                 token_mel_ratio: int, notify: Callable[[RequestTelemetry, str], None] | None = None):
        self.config = config
        self.device = device
        self.chunk_size = chunk_size
        self.cv = threading.Condition()
        self.incoming: deque[RequestState] = deque()
        self.active: list[RequestState] = []
        #: ids of requests whose chunk the chunk side is computing (a request that ended meanwhile is still held)
        self.busy: set[int] = set()
        #: the chunk side is computing a batch with a first chunk in it (overlapped mode only, see ``_yields``)
        self.first_busy = False
        self.closed = False
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.chunks = ChunkRunner(self, sample_rate, token_mel_ratio)
        self.overlap = config.cuda_streams == 2
        self._release: list[RequestState] = []  # ended on the chunk side with an LM slot still held
        self._llm_thread: int | None = None  # the LLM worker's thread id once it runs
        #: what the LLM worker runs each time it has work; ``turn`` is the replaceable seam the engine points at it
        self.step: Callable[[], None] = self.llm_turn if self.overlap else self._serial_turn
        self.turn: Callable[[], None] = self.step

    # ------------------------------------------------------------------------------------------- helpers
    def count(self, *pairs: object) -> None:
        """``count("a", 1, "b", 2)`` adds to the counters ``Engine.stats()`` reports."""
        with self.cv:
            for k, v in zip(pairs[::2], pairs[1::2]):
                self.counts[k] += v  # type: ignore[index, operator]

    def sync(self) -> None:
        """Make a stage's wall-clock honest on a GPU: it ends when its kernels ran (this thread's stream only,
        so the other side's work is not waited for)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def held(self) -> int:
        """Requests the engine still holds: waiting, running, or ended while their chunk was being computed."""
        with self.cv:
            running = {id(st) for st in self.active} | self.busy
            return len(self.incoming) + len(running)

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def fail(self, st: RequestState, err: BaseException) -> None:
        with self.cv:
            if st.done:
                return
            st.telemetry.error = f"{type(err).__name__}: {err}"
            st.out.put(err)
            self.finish(st)

    def finish(self, st: RequestState) -> None:
        """End ``st`` (its consumer got DONE or an error already): out of the active list, state freed.  An LM
        slot still held is released on the LLM side (now, or at its next turn)."""
        with self.cv:
            if st in self.active:
                self.active.remove(st)
            seg = st.segment
            holds_slot = seg is not None and seg.llm is not None and not seg.llm_done
            if holds_slot and threading.get_ident() != self._llm_thread:
                st.done = True
                self._release.append(st)
            else:
                st.close()
            self.cv.notify_all()

    def guard(self, st: RequestState, fn: Callable[[RequestState], None]) -> None:
        if st not in self.active:
            return
        try:
            fn(st)
        except Exception as e:  # one request's failure must not disturb the others
            log.exception("request %s failed", st.id)
            self.fail(st, e)

    # ------------------------------------------------------------------------------------------- workers
    def start(self) -> list[threading.Thread]:
        llm = threading.Thread(target=self._llm_loop, name="cosyvoice-llm", daemon=True)
        threads = [llm]
        if self.overlap:
            threads.append(threading.Thread(target=self._chunk_loop, name="cosyvoice-chunks", daemon=True))
        for t in threads:
            t.start()
        return threads

    def _bind_stream(self, priority: int) -> None:
        if self.overlap and self.device.type == "cuda":
            torch.cuda.set_stream(torch.cuda.Stream(self.device, priority=priority))

    def _yields(self, st: RequestState) -> bool:
        """Whether ``st``'s LM skips this step to leave the GPU to a first chunk being solved (caller holds
        ``cv`` or reads a snapshot).  While the chunk side computes someone's first audio, only LMs that have not
        reached their own first chunk keep decoding: the others are ahead of their listeners anyway, and their
        decode kernels would share the GPU with (and slow down) the solve that someone is waiting for.

        An LM whose own first chunk is ready pauses at once, before the chunk side has taken it: its next tokens
        are for a chunk a whole first chunk of audio later, and a decode turn in between would hold the GIL and
        the GPU while the chunk side starts that solve (the time to first audio of a lone stream)."""
        if not self.config.first_chunk_priority or not self.overlap:
            return False
        seg = st.segment
        pending = bool(seg is not None and seg.pending)
        if st.chunks_emitted == 0 and pending:
            return True
        if not self.first_busy:
            return False
        return st.chunks_emitted > 0 or pending or id(st) in self.busy

    def _completes_first_chunk(self, st: RequestState) -> bool:
        """Whether ``st``'s next token makes its first chunk due (so :meth:`_yields` pauses its LM right after):
        the LLM stage is told not to launch its step after ahead (``LLMState.no_ahead``)."""
        seg = st.segment
        return (self.overlap and self.config.first_chunk_priority and st.request.stream and st.chunks_emitted == 0
                and seg is not None and not seg.pending and seg.cursor.tokens_short(len(seg.tokens)) == 1)

    def _llm_has_work(self) -> bool:
        """Caller holds ``cv``."""
        if self._release or (self.incoming and len(self.active) < self.config.max_streams):
            return True
        for st in self.active:
            seg = st.segment
            if st.cancelled.is_set() or seg is None:
                return True
            if not seg.llm_started:
                free = st.stages.llm.free_slots()
                if free is None or free > 0:
                    return True
            elif not seg.llm_done and seg.llm is not None and seg.llm.ready and not self._yields(st):
                return True
            if not self.overlap and seg.pending:
                return True
        return False

    def _llm_loop(self) -> None:
        self._llm_thread = threading.get_ident()
        torch.set_grad_enabled(False)
        self._bind_stream(priority=-1)
        while True:
            with self.cv:
                while not self.closed and not self._llm_has_work():
                    self.cv.wait()
                if self.closed:
                    self._close_all()
                    return
                self._admit_waiting()
            try:
                self.turn()
            except Exception as e:  # a scheduler bug must fail the requests in flight, never hang them
                log.exception("engine scheduler failed; failing the active requests")
                for st in list(self.active):
                    self.fail(st, RuntimeError(f"internal engine error ({type(e).__name__}): {e}"))

    def _chunk_loop(self) -> None:
        torch.set_grad_enabled(False)
        self._bind_stream(priority=0)
        while True:
            with self.cv:
                while not self.closed and not any(st.segment is not None and st.segment.pending and not st.done
                                                  for st in self.active):
                    self.cv.wait()
                if self.closed:
                    return
            try:
                self.chunk_turn()
            except Exception as e:  # noqa: BLE001
                log.exception("chunk worker failed; failing the requests with pending chunks")
                for st in list(self.active):
                    if st.segment is not None and st.segment.pending:
                        self.fail(st, RuntimeError(f"internal engine error ({type(e).__name__}): {e}"))

    def _close_all(self) -> None:
        for st in list(self.incoming) + list(self.active):
            self.fail(st, EngineClosed("the engine was shut down"))
        self.incoming.clear()

    # ------------------------------------------------------------------------------------------- turns
    def _serial_turn(self) -> None:
        self.llm_turn()
        self.chunk_turn()

    def chunk_turn(self) -> None:
        """Every ready chunk call: first chunks first, in their own batches (first audio must not pay for a long
        later chunk's solve), then the others by earliest playback deadline; each kind gathered over a few
        tokens (:meth:`_gather`).  Batches are at most the largest captured solve (``max(flow_rows)``
        requests), each vocoded and sent before the next is solved, so 64 first chunks do not all wait for
        four solves."""
        self._gather()
        first, later = self.chunks.ready()
        step = max(self.config.flow_rows)  # the largest captured solve: each slice's audio goes out after it
        for i in range(0, len(first), step):
            self.first_busy = self.overlap
            try:
                self.chunks.run(first[i:i + step])
            finally:
                with self.cv:
                    self.first_busy = False
                    self.cv.notify_all()
        for i in range(0, len(later), step):
            self.chunks.run(later[i:i + step])

    def _gather(self) -> None:
        """Keep ready chunks waiting while another request's chunk of the same kind (first, or later) is a few
        tokens away, so that they share one solve instead of the others waiting for a whole solve; never once
        they fill the largest captured solve (``flow_rows``).  First chunks wait at most
        ``first_chunk_wait_ms`` (:func:`~cosyvoice_fast.config.schedule.first_chunk_wait`); when none is ready, later
        chunks wait at most ``later_chunk_wait_ms`` and never while a listener's audio is about to run out
        (:func:`~cosyvoice_fast.config.schedule.later_chunk_wait`).  Only with the sides overlapped: the LLM side keeps
        decoding meanwhile and wakes this thread at each step.  The wait is on the condition, never a busy
        loop."""
        if not self.overlap:
            return
        cfg = self.config
        with self.cv:
            while not self.closed:
                running = [st for st in self.active if not st.done and st.segment is not None]
                opening = [st for st in running if st.chunks_emitted == 0]
                if any(st.segment.pending for st in opening):
                    left = self._gather_wait(opening, cfg.first_chunk_wait_ms / 1e3, None)
                else:
                    left = self._gather_wait([st for st in running if st.chunks_emitted > 0],
                                             cfg.later_chunk_wait_ms / 1e3, self.chunks.sample_rate)
                if left <= 0:
                    return
                self.cv.wait(timeout=left)

    def _gather_wait(self, states: list[RequestState], max_wait: float, sample_rate: int | None) -> float:
        """Seconds the ready chunks among ``states`` (all first, or all later: ``sample_rate`` given) should
        wait for the others' next calls; caller holds ``cv``."""
        if max_wait <= 0:
            return 0.0
        ready = [st for st in states if st.segment.pending]
        if not ready or len(ready) >= max(self.config.flow_rows):
            return 0.0
        short = []
        for st in states:
            seg = st.segment
            if seg.pending or not seg.llm_started or seg.llm_done or seg.llm is None or not seg.llm.ready \
                    or st.cancelled.is_set():  # only LMs decoding now (not one awaiting text) are coming
                continue
            n = len(seg.tokens)
            short.append(seg.cursor.tokens_short(n) if sample_rate is None
                         else seg.cursor.tokens_to_next_call(n, seg.llm.max_len - len(seg.llm.history)))
        since = min(st.segment.pending[0][1] for st in ready)
        if sample_rate is None:
            return first_chunk_wait(since, now(), short, max_wait)
        deadline = min(st.playback_deadline(sample_rate) for st in ready)
        return later_chunk_wait(since, now(), deadline, short, max_wait, slack_s=chunk_schedule.LATER_SLACK_S)

    def llm_turn(self) -> None:
        with self.cv:
            released, self._release = self._release, []
            for st in released:
                st.close()
            dropped = [st for st in self.active if st.cancelled.is_set()]
            for st in dropped:
                st.telemetry.cancelled = True
                st.out.put(DONE)  # wakes a consumer blocked on the queue in another thread
                self.finish(st)
        self._start_segments()
        self._decode()

    def _admit_waiting(self) -> None:
        """Move waiting requests into free streams, oldest first (caller holds ``cv``).  A request cancelled
        while it waited ends here without ever starting."""
        for st in [s for s in self.incoming if s.cancelled.is_set()]:
            self.incoming.remove(st)
            st.telemetry.cancelled = True
            st.close()
            st.out.put(DONE)
        while self.incoming and len(self.active) < self.config.max_streams:
            st = self.incoming.popleft()
            st.telemetry.admitted = now()
            self.counts["admitted"] += 1
            self.active.append(st)

    def _start_segments(self) -> None:
        """Open the next segment of every request that has none, and prefill their LMs: one ``prefill`` call
        per LLM stage over as many of them as it has free slots (oldest first; the rest wait)."""
        starting: list[RequestState] = []
        for st in list(self.active):
            if st.segment is None and not st.cancelled.is_set() and not st.done:
                self.guard(st, self._open_segment)
                if st in self.active and st.segment is not None and not st.segment.llm_started:
                    starting.append(st)
            elif st.segment is not None and not st.segment.llm_started:  # waiting for a free LLM slot
                starting.append(st)
        for group in group_by(starting, lambda s: s.stages.llm):
            llm = group[0].stages.llm
            free = llm.free_slots()
            take = group if free is None else group[:free]
            if not take:
                continue
            t0 = now()
            for st in take:
                if st.segment.index == 0:
                    st.telemetry.prefill_start = t0
            results = llm.prefill([st.segment.llm for st in take])
            if not getattr(llm, "prefill_synced", False):
                self.sync()
            t1 = now()
            for st, res in zip(take, results):
                st.segment.llm_started = True
                if st.segment.index == 0:
                    st.telemetry.prefill_done = t1
                self.guard(st, lambda s, r=res: self._take_token(s, r))
        if starting:
            self.wake()

    def _open_segment(self, st: RequestState) -> None:
        segs = st.inputs.text_segments
        if st.next_segment >= len(segs):
            st.out.put(DONE)
            self.finish(st)
            return
        idx = st.next_segment
        st.next_segment += 1
        prompt_len = st.inputs.flow_prompt_speech_token.shape[1]
        seg = SegmentState(index=idx, text=segs[idx],
                           cursor=ChunkCursor(prompt_len, st.request.stream_params, self.chunk_size))
        seg.llm = st.stages.llm.new_state(st.inputs, segs[idx], st.llm_generator, st.request.max_tokens,
                                          st.request.ignore_eos)
        st.segment = seg
        if seg.llm.done:  # nothing to generate (a zero token budget): the segment ends at once
            seg.llm_started = True
            self._take_token(st, None)

    def _decode(self) -> None:
        """One ``decode`` call per LLM stage over every running LM that is ready (the cudagraph LLM makes it one
        replay); a state that waits for input (not ``ready``) is skipped, neither stepped nor failed."""
        rows = [st for st in self.active if st.segment is not None and st.segment.llm_started
                and not st.segment.llm_done and not st.cancelled.is_set() and st.segment.llm is not None
                and st.segment.llm.ready and not self._yields(st)]
        for st in rows:
            st.segment.llm.no_ahead = self._completes_first_chunk(st)
        for group in group_by(rows, lambda s: s.stages.llm):
            try:
                results = group[0].stages.llm.decode([st.segment.llm for st in group])
                if len(results) != len(group):
                    raise RuntimeError(f"llm.decode returned {len(results)} results for {len(group)} states")
            except Exception as e:  # noqa: BLE001 - the step failed as a whole: every row of it fails
                log.exception("batched decode step for %d requests failed", len(group))
                results = [e] * len(group)
            self.count("decode_steps", 1, "decode_rows", len(group))
            for st, res in zip(group, results):
                self.guard(st, lambda s, r=res: self._take_token(s, r))
        if rows:
            self.wake()

    def _take_token(self, st: RequestState, res: object) -> None:
        """Record one LLM result for ``st``: the token (or the end of its LM) and any chunk calls now ready."""
        if isinstance(res, BaseException):
            raise res
        seg = st.segment
        assert seg is not None and seg.llm is not None
        st.decode_steps += 1
        if res is not None:
            seg.tokens.append(int(res))
            st.telemetry.token_times.append(now())
        if seg.llm.done:
            st.stages.llm.release(seg.llm)
            seg.llm_done = True
        with self.cv:
            if st.request.stream:
                while (call := seg.cursor.next_call(len(seg.tokens), seg.llm_done)) is not None:
                    seg.pending.append((call, now()))
            elif seg.llm_done:
                n = len(seg.tokens)
                seg.pending.append((ChunkCall(0, 0, n, n, 0, finalize=True), now()))
