"""The flow + vocoder side of the scheduler: turn every ready chunk call into audio, batched.

The LLM side appends :class:`~cosyvoice_fast.config.schedule.ChunkCall`s to a segment's ``pending`` list as tokens
arrive; :meth:`ChunkRunner.run` takes the next call of each given request and solves them together: requests
whose flow stage object is the same share one ``flow.solve`` (the backend pads them into length buckets and
keeps streams on its incremental path), and their mels are vocoded with one ``vocode_jobs`` call per vocoder
stage (equal shapes share one HiFT ``vocode_batch`` forward, up to the stage's ``max_batch``).  A failing
batched call is retried request by request, so only the culprit's request fails.

It runs in the chunk worker thread when the engine overlaps (``EngineConfig.cuda_streams == 2``), else in the one
worker after the LLM step.  Either way the request may be cancelled or failed by the other side while its chunk
is being computed: every hand-over to the consumer checks ``state.done`` under the scheduler's lock, so nothing is
sent after a request ended.  The runner sees the scheduler only through a :class:`ChunkContext` (its lock, the
busy set and three callbacks), so this module does not import the scheduler.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from cosyvoice_fast.frontend.request import AudioChunk
from cosyvoice_fast.config import schedule as chunk_schedule
from cosyvoice_fast.config.schedule import ChunkCall, call_frames, first_chunk_wait, later_chunk_wait
from cosyvoice_fast.telemetry.record import ChunkTiming, now
from cosyvoice_fast.engine.state import RequestState, SegmentState
from cosyvoice_fast.engine.stream import DONE
from cosyvoice_fast.llm.stage import steppable
from cosyvoice_fast.vocoder.stage import VocodeJob

log = logging.getLogger(__name__)

#: one chunk in flight: the request, its segment (held locally: the request may drop it meanwhile), call, timing
Taken = tuple[RequestState, SegmentState, ChunkCall, ChunkTiming]


def group_by(states: list[Any], key: Any) -> list[list[Any]]:
    """``states`` grouped by the identity of ``key(state)`` (a stage object), in first-seen order."""
    groups: dict[int, list[Any]] = {}
    for st in states:
        groups.setdefault(id(key(st)), []).append(st)
    return list(groups.values())


@dataclass(frozen=True)
class ChunkContext:
    """What the chunk runner needs of the scheduler that owns the requests."""

    lock: threading.Condition  #: the scheduler's condition: guards request state shared with the LLM side
    busy: set[int]  #: ids of requests whose chunk is being computed (the runner adds and removes them)
    count: Callable[..., None]  #: ``count("flow_calls", 1, ...)``: adds to the engine's counters
    fail: Callable[[RequestState, BaseException], None]  #: end a request with an error (its consumer gets it)
    finish: Callable[[RequestState], None]  #: end a request that got its last chunk
    device: torch.device


def gather_wait(states: list[RequestState], max_wait: float, sample_rate: int | None, largest_solve: int) -> float:
    """Seconds the ready chunks among ``states`` (all first, or all later: ``sample_rate`` given) should wait for
    the others' next calls, so that they share one solve (never once they fill ``largest_solve``); the caller
    holds the scheduler's lock."""
    if max_wait <= 0:
        return 0.0
    ready = [st for st in states if st.segment.pending]
    if not ready or len(ready) >= largest_solve:
        return 0.0
    short = []
    for st in states:
        seg = st.segment
        if seg.pending or not seg.llm_started or seg.llm_done or not steppable(seg.llm) \
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


class StreamClock:
    """Host wall-clock times of points in this thread's CUDA stream, without waiting at each point.

    Waiting for the GPU right after a flow solve, only to stamp its end, left the GPU idle while the host then
    prepared the vocoder call.  A solve's end is an event instead; once a later point of the same stream has been
    waited for (the audio's copy to the host), the event's time follows from the GPU's own elapsed time between
    the two.  On the CPU every call ran synchronously, so a mark is simply the host's clock."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return now()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def time_of(self, mark: Any, last: Any, last_time: float) -> float:
        """When ``mark`` was passed, given that ``last`` (a later mark of the same stream, already waited for) was
        passed by ``last_time``; NaN when it cannot be known (no mark, or the GPU failed in between)."""
        if mark is None:
            return math.nan
        if not self.cuda:
            return float(mark)
        try:
            return last_time - mark.elapsed_time(last) / 1e3
        except RuntimeError:
            return math.nan


class ChunkRunner:
    """Runs chunk calls of many requests: batched flow solves, batched vocoding, hand-over to consumers."""

    def __init__(self, ctx: ChunkContext, sample_rate: int, token_mel_ratio: int):
        self.ctx = ctx
        self.sample_rate = sample_rate
        self.token_mel_ratio = token_mel_ratio
        self.clock = StreamClock(ctx.device)
        #: the flow's end mark of each chunk in flight (keyed by its timing), read once its audio is on the host
        self._flow_done: dict[int, Any] = {}

    # ------------------------------------------------------------------------------------------- execution
    def run(self, states: list[RequestState]) -> None:
        """Run the next pending chunk of each of ``states`` (flow batched per flow stage, then vocoded)."""
        for group in group_by(states, lambda s: s.stages.flow):
            taken = [t for st in group if (t := self._take(st)) is not None]
            if not taken:
                continue
            busy = self.ctx.busy
            with self.ctx.lock:
                busy.update(id(t[0]) for t in taken)
            mels: list[torch.Tensor | None] = []
            done: list[tuple[Taken, torch.Tensor]] = []
            try:
                mels = self._flow(taken)
                done = [(t, m) for t, m in zip(taken, mels) if m is not None]
                for vgroup in group_by(done, lambda tm: tm[0][0].stages.vocoder):
                    self._vocode_and_emit(vgroup)
            finally:
                del done, mels  # the chunk's tensors and flow state must not outlive the request's end
                for t in taken:  # a chunk that failed before its vocoder call leaves its mark here
                    self._flow_done.pop(id(t[3]), None)
                with self.ctx.lock:
                    busy.difference_update(id(t[0]) for t in taken)
                    del taken
                    self.ctx.lock.notify_all()

    def _take(self, st: RequestState) -> Taken | None:
        with self.ctx.lock:
            seg = st.segment
            if st.done or seg is None or not seg.pending:
                return None
            call, ready_at = seg.pending.pop(0)
        timing = ChunkTiming(index=st.chunks_emitted, segment=seg.index, n_tokens=call.hop,
                             sample_rate=self.sample_rate, tokens_ready=ready_at, finalize=call.finalize)
        return st, seg, call, timing

    @staticmethod
    def _tokens(seg: SegmentState, call: ChunkCall) -> torch.Tensor:
        return torch.tensor([seg.tokens[:call.n_tokens]], dtype=torch.int32)

    def _flow(self, taken: list[Taken]) -> list[torch.Tensor | None]:
        """Mels of every taken call (``None`` where that request failed)."""
        flow = taken[0][0].stages.flow
        if len(taken) > 1 and flow.max_batch > 1:
            for _, seg, _, _ in taken:
                seg.flow_info = None  # the backend reports incremental chunks; the rest recompute
            start = now()
            try:
                mels = flow.solve([(seg, st.inputs, self._tokens(seg, call), call) for st, seg, call, _ in taken])
                end = self.clock.mark()
                if len(mels) != len(taken):
                    raise RuntimeError(f"solve returned {len(mels)} mels for {len(taken)} items")
            except Exception:  # noqa: BLE001 - isolate the culprit: each request alone, failures stay its own
                log.exception("batched flow call for %d requests failed; retrying them one by one", len(taken))
            else:
                self.ctx.count("flow_calls", 1, "flow_rows", len(taken))
                for (st, seg, call, timing) in taken:
                    timing.flow_start = start
                    self._flow_done[id(timing)] = end  # the mel exists when the whole batch does
                    self._flow_info(st, seg, call, timing)
                return list(mels)
        return [self._flow_one(t) for t in taken]

    def _flow_one(self, t: Taken) -> torch.Tensor | None:
        st, seg, call, timing = t
        try:
            seg.flow_info = None
            timing.flow_start = now()
            mel = st.stages.flow.chunk(seg, st.inputs, self._tokens(seg, call), call)
            self._flow_done[id(timing)] = self.clock.mark()
            self.ctx.count("flow_calls", 1, "flow_rows", 1)
            self._flow_info(st, seg, call, timing)
            return mel
        except Exception as e:  # one request's failure must not disturb the others
            log.exception("request %s failed in the flow", st.id)
            self._fail(st, e)
            return None

    def _flow_info(self, st: RequestState, seg: SegmentState, call: ChunkCall, timing: ChunkTiming) -> None:
        """What the flow computed for this chunk (the dashboard shows it): the backend's own account
        (incremental runners) or upstream's full recompute of prompt + every token so far."""
        info = seg.flow_info
        if info is None:
            frames = call_frames(call, st.inputs.flow_prompt_speech_token.shape[1], self.token_mel_ratio)
            info = ("recompute", frames, 0)
        timing.flow_mode, timing.flow_frames, timing.flow_state_bytes = info

    def _job(self, t: Taken, mel: torch.Tensor) -> VocodeJob:
        st, seg, call, _ = t
        speed = st.request.speed if not st.request.stream else 1.0
        return VocodeJob(mel=mel, cache=seg.voc_cache, finalize=call.finalize, generator=st.vocoder_generator,
                         speed=speed)

    def _vocode_and_emit(self, items: list[tuple[Taken, torch.Tensor]]) -> None:
        voc = items[0][0][0].stages.vocoder
        if voc.max_batch <= 1:
            for item in items:  # no shared forward: each chunk goes out as soon as it is vocoded
                self._vocode_and_emit_all(voc, [item])
        else:
            self._vocode_and_emit_all(voc, items)

    def _vocode_and_emit_all(self, voc: Any, items: list[tuple[Taken, torch.Tensor]]) -> None:
        outs = voc.vocode_jobs([self._job(t, m) for t, m in items])
        self.ctx.count("vocoder_calls", 1, "vocoder_rows", len(items))
        done: list[tuple[Taken, torch.Tensor, Any]] = []
        for (t, _), out in zip(items, outs):
            if isinstance(out, Exception):
                log.error("request %s failed in the vocoder: %s", t[0].id, out, exc_info=out)
                self._fail(t[0], out)
            else:
                done.append((t, *out))
        flow_marks = [self._flow_done.pop(id(t[3]), None) for t, _ in items]
        last = self.clock.mark()
        host = self._to_host([wav for _, wav, _ in done])
        arrived = now()  # the copy waited for this thread's stream: the audio exists from here on
        emitted = {id(t) for t, _, _ in done}
        for (t, _), mark in zip(items, flow_marks):
            if id(t) in emitted:
                t[3].flow_end = self.clock.time_of(mark, last, arrived)
        for (t, _, cache), samples in zip(done, host):
            try:
                if isinstance(samples, Exception):
                    raise samples
                self._emit(t, samples, cache, arrived)
            except Exception as e:  # noqa: BLE001 - one request's failure must not disturb the others
                log.exception("request %s failed handing its chunk over", t[0].id)
                self._fail(t[0], e)

    @staticmethod
    def _to_host(wavs: list[torch.Tensor]) -> list[np.ndarray | Exception]:
        """Each (1, N) waveform as float32 samples in host memory, with one device-to-host copy for the whole
        batch: a copy per chunk waited for the GPU once per chunk, and the GPU sat idle through the host work
        between those waits.  A failed shared copy is retried chunk by chunk, so a failure stays its own."""
        if not wavs:
            return []
        try:
            host = torch.cat([w[0].float() for w in wavs]).cpu().numpy()
            bounds = np.cumsum([0] + [w.shape[-1] for w in wavs])
            return [host[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        except Exception:  # noqa: BLE001
            log.exception("copying %d chunks' audio to the host failed; copying them one by one", len(wavs))
        out: list[np.ndarray | Exception] = []
        for w in wavs:
            try:
                out.append(w[0].float().cpu().numpy().copy())
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out

    def _fail(self, st: RequestState, err: BaseException) -> None:
        with self.ctx.lock:
            self.ctx.busy.discard(id(st))  # ended here, by this side: not held on its account any more
            self.ctx.fail(st, err)

    def _emit(self, t: Taken, samples: np.ndarray, cache: Any, arrived: float) -> None:
        """Hand one chunk's audio (float32 host samples, on the host since ``arrived``) to the request's consumer
        (and end the segment/request on its last chunk)."""
        st, seg, call, timing = t
        timing.vocoder_end = arrived
        timing.n_samples = len(samples)
        seg.voc_cache = cache
        last_segment = st.next_segment >= len(st.inputs.text_segments)
        is_last = call.finalize and last_segment
        with self.ctx.lock:
            if st.done:  # cancelled or failed while this chunk was computed: nothing more reaches the consumer
                return
            st.telemetry.chunks.append(timing)
            st.chunks_emitted += 1
            st.audio_samples_emitted += len(samples)
            st.out.put(AudioChunk(samples=samples, index=timing.index, segment=seg.index,
                                  sample_rate=self.sample_rate, is_last=is_last, timing=timing))
            if call.finalize:
                seg.close(None)  # its LM is done and gave its slot back already; drops flow and vocoder state
                if st.segment is seg:
                    st.segment = None
                if is_last:
                    st.out.put(DONE)
                    self.ctx.busy.discard(id(st))  # ended here: its consumer may count the engine drained now
                    self.ctx.finish(st)
            self.ctx.lock.notify_all()  # a closed segment lets the LLM side open the next; a finish frees a stream
