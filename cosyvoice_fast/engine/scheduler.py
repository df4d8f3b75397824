"""The engine's scheduler: the request lists, the LLM side, and the worker thread(s) that run both sides.

Two sides share the running requests:

- the **LLM side** (:meth:`Scheduler.llm_turn`) drops cancelled requests, admits waiting ones, opens segments,
  prefills and decodes their LMs, and appends the chunk calls that became ready to each segment;
- the **chunk side** (:class:`~.chunks.ChunkRunner`) solves and vocodes every ready chunk call.

Which requests share which call (and which wait) is decided by the pure policy
(:func:`~cosyvoice_fast.engine.policy.plan`, whose docstring states the rules) over a
:class:`~cosyvoice_fast.engine.policy.Snapshot` of the requests; this module takes the snapshots, executes the
batches and waits on its condition when the policy finds nothing to do.

With ``EngineConfig.cuda_streams == 2`` each side has its own worker thread, and on a GPU its own CUDA stream
(the LLM's at high priority): a 100 ms batch of flow solves no longer holds every stream's decoding behind it.
First audio keeps precedence: while a batch holding a first chunk is solved, the LMs already past their own
first chunk pause, and an LM pauses as soon as its own first chunk is ready (:func:`~.policy.yields`), so that
solve has the GPU to itself as in the serial order (``EngineConfig.first_chunk_priority``; off: every LM keeps
decoding).  Both threads wait on one condition when idle (never a busy loop), and each wakes the other when it
made work for it.  With ``cuda_streams == 1`` one thread runs an LLM turn then a chunk turn.  Each turn's GPU
work holds :data:`~cosyvoice_fast.kernels.gpu_gate.GPU_GATE` shared (a graph capture waits for it).

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
from cosyvoice_fast.config.schedule import ChunkCall, ChunkCursor
from cosyvoice_fast.telemetry.record import RequestTelemetry, now
from cosyvoice_fast.engine import policy
from cosyvoice_fast.engine.chunks import ChunkContext, ChunkRunner, gather_wait
from cosyvoice_fast.engine.policy import Limits, RequestView, Snapshot
from cosyvoice_fast.engine.state import Phase, RequestState, SegmentState
from cosyvoice_fast.engine.stream import CLIENT_ERRORS, DONE
from cosyvoice_fast.llm.stage import steppable
from cosyvoice_fast.kernels.gpu_gate import GPU_GATE

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
        self.chunks = ChunkRunner(ChunkContext(lock=self.cv, busy=self.busy, count=self.count, fail=self.fail,
                                               finish=self.finish, device=device), sample_rate, token_mel_ratio)
        self.overlap = config.cuda_streams == 2
        self.limits = Limits(max_streams=config.max_streams, largest_solve=max(config.flow_rows),
                             overlap=self.overlap, first_chunk_priority=config.first_chunk_priority)
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
        """Make a stage's wall-clock honest on a GPU (this thread's stream only: never the other side's work)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def held(self) -> int:
        """Requests the engine still holds: waiting, running, or ended while their chunk was being computed."""
        with self.cv:
            return len(self.incoming) + len({id(st) for st in self.active} | self.busy)

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
            if not isinstance(e, CLIENT_ERRORS):  # a client's mistake is one line of the request log, no trace
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
        """:func:`~cosyvoice_fast.engine.policy.yields` for ``st`` now."""
        pending = bool(st.segment is not None and st.segment.pending)
        view = RequestView(pending=pending, emitted=st.chunks_emitted, busy=id(st) in self.busy)
        return policy.yields(view, self.limits, self.first_busy)

    def _completes_first_chunk(self, st: RequestState) -> bool:
        """:func:`~cosyvoice_fast.engine.policy.completes_first_chunk` for ``st`` now."""
        seg = st.segment
        short = seg.cursor.tokens_short(len(seg.tokens)) if seg is not None and st.chunks_emitted == 0 else None
        view = RequestView(pending=bool(seg is not None and seg.pending), emitted=st.chunks_emitted,
                           stream=st.request.stream, tokens_short=short)
        return policy.completes_first_chunk(view, self.limits)

    def _view(self, st: RequestState, llm_side: bool) -> RequestView:
        seg = st.segment
        phase = st.phase
        ready = llm_side and phase is Phase.DECODING and steppable(seg.llm)  # type: ignore[union-attr]
        short = (seg.cursor.tokens_short(len(seg.tokens))  # type: ignore[union-attr]
                 if ready and st.chunks_emitted == 0 and not seg.pending else None)  # type: ignore[union-attr]
        return RequestView(phase=phase, llm=id(st.stages.llm), cancelled=st.cancelled.is_set(), llm_ready=ready,
                           pending=bool(seg is not None and seg.pending), emitted=st.chunks_emitted,
                           busy=id(st) in self.busy, stream=st.request.stream, tokens_short=short,
                           deadline=st.playback_deadline(self.chunks.sample_rate))

    def _snapshot(self, states: list[RequestState], llm_side: bool = True) -> Snapshot:
        """What the policy decides on for ``states`` now (the caller holds ``cv`` where the moment matters); the
        chunk side (``llm_side`` off) asks nothing of LLM states or stages, which only the LLM side touches."""
        views = [self._view(st, llm_side) for st in states]
        free: dict[int, int | None] = {}
        for st, v in zip(states, views):
            if llm_side and v.phase is Phase.PREFILL and v.llm not in free:
                free[v.llm] = st.stages.llm.free_slots()
        return Snapshot(requests=views, waiting=len(self.incoming), releases=bool(self._release),
                        free_slots=free, first_busy=self.first_busy)

    def _llm_loop(self) -> None:
        self._llm_thread = threading.get_ident()
        torch.set_grad_enabled(False)
        self._bind_stream(priority=-1)
        while True:
            with self.cv:
                while not self.closed and not policy.llm_has_work(self._snapshot(self.active), self.limits):
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
                while not self.closed and not policy.chunk_has_work(self._snapshot(self.active, False)):
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
        with self.cv:
            states = list(self.active)
            batches = policy.plan(self._snapshot(states, llm_side=False), self.limits).chunks
        for batch in batches:
            if batch.first:
                self.first_busy = self.overlap
            try:
                with GPU_GATE.work():
                    self.chunks.run([states[i] for i in batch.rows])
            finally:
                if batch.first:
                    with self.cv:
                        self.first_busy = False
                        self.cv.notify_all()

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
                    left = gather_wait(opening, cfg.first_chunk_wait_ms / 1e3, None, self.limits.largest_solve)
                else:
                    left = gather_wait([st for st in running if st.chunks_emitted > 0], cfg.later_chunk_wait_ms / 1e3,
                                       self.chunks.sample_rate, self.limits.largest_solve)
                if left <= 0:
                    return
                self.cv.wait(timeout=left)

    def llm_turn(self) -> None:
        with GPU_GATE.work():  # a graph capture (background, or a new backend's build) waits for this turn
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
        for _ in range(policy.admissions(len(self.incoming), len(self.active), self.limits)):
            st = self.incoming.popleft()
            st.telemetry.admitted = now()
            self.counts["admitted"] += 1
            self.active.append(st)

    def _start_segments(self) -> None:
        """Open the next segment of every request that has none, and prefill their LMs: one ``prefill`` call
        per LLM stage over as many of them as it has free slots (oldest first; the rest wait)."""
        for st in list(self.active):
            if st.segment is None and not st.cancelled.is_set() and not st.done:
                self.guard(st, self._open_segment)
        states = list(self.active)
        snap = self._snapshot(states)
        for rows in policy.plan(snap, self.limits).prefill:
            take = [states[i] for i in rows]
            llm = take[0].stages.llm
            t0 = now()
            for st in take:
                if st.segment.index == 0:
                    st.telemetry.prefill_start = t0
            results = llm.prefill([st.segment.llm for st in take])
            if not llm.prefill_synced:
                self.sync()
            t1 = now()
            for st, res in zip(take, results):
                st.segment.llm_started = True
                if st.segment.index == 0:
                    st.telemetry.prefill_done = t1
                self.guard(st, lambda s, r=res: self._take_token(s, r))
        if any(v.phase is Phase.PREFILL for v in snap.requests):  # prefilled, or waiting for a free LLM slot
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
        states = list(self.active)
        plan = policy.plan(self._snapshot(states), self.limits)
        for rows in plan.decode:
            for i in rows:
                states[i].segment.llm.no_ahead = i in plan.no_ahead  # type: ignore[union-attr]
        for rows in plan.decode:
            group = [states[i] for i in rows]
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
        if plan.decode:
            self.wake()

    def _take_token(self, st: RequestState, res: object) -> None:
        """Record one LLM result for ``st``: the token (or the end of its LM) and any chunk calls now ready."""
        if isinstance(res, BaseException):
            raise res
        seg = st.segment
        assert seg is not None and seg.llm is not None
        st.decode_steps += 1
        if res is not None:
            seg.tokens += seg.llm.to_flow(int(res))  # [] where the family's filter drops it (the LM keeps it)
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
