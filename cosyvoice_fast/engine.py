"""The streaming engine: many requests, one GPU worker, audio chunks the moment their tokens exist.

Shape of the runtime (the engine is the only scheduler; stage backends execute the batch calls it makes):

- ``Engine.stream(request)`` runs the frontend in the caller's thread (CPU/ONNX work must not hold the GPU
  worker), then offers a :class:`RequestState` to the **admission queue** and yields :class:`AudioChunk`s from
  the request's own queue (blocking ``get``: no polling).  Capacity comes from one :class:`EngineConfig`:
  at most ``max_streams`` requests run at once; more wait in the queue (its own TTFB stage, ``admission``)
  and start when one finishes; only a request beyond ``queue_limit`` waiting ones is refused
  (:class:`EngineBusy`, counted in ``stats()["rejected"]``).  A request cancelled while it waits never starts.
- One worker thread owns all model work.  Each turn it (1) drops cancelled requests, (2) admits waiting
  requests into free streams, (3) starts the LMs of new segments in one ``llm.prefill(states)`` per stage set,
  never more than the backend's free slots (a request without a slot waits, it does not fail), (4) runs every
  ready *first* chunk (first audio has priority) batched, (5) steps every running LM in one
  ``llm.decode(states)`` per stage set, (6) runs every ready chunk of every request (first or later, earliest
  playback deadline first) in one flow call per stage set (``solve``: streams already on the incremental
  path continue there, the rest share batched solves per length bucket); vocoding stays per request.
  A new request therefore waits at most one turn, never behind another request's long tail.  Everything runs
  on one CUDA stream (``EngineConfig.cuda_streams`` is not used yet: no LLM/flow overlap).
- Closing the iterator (or :meth:`Engine.cancel`, or dropping the iterator, even before its first chunk) marks
  the request; the worker drops it before its next step, so its LM stops within one decode step and its slot,
  KV cache and flow state are freed.  A consumer blocked waiting for a chunk in another thread is woken.
- Observers (:meth:`Engine.add_observer`) see every request's telemetry once it is over, with its outcome
  (``ok``, ``cancelled``, ``error`` or ``rejected`` at admission): metrics hang off this hook.
- An error in one request goes to that request's consumer only; the others keep streaming.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import AsyncIterator, Callable

import numpy as np
import torch

from .backends import StageCache
from .backends.base import StageSet, check_available
from .config import BackendConfig, ConfigError, StreamParams
from .engine_config import EngineConfig
from .modelfiles import LoadedModels
from .request import AudioChunk, ModelInputs, SynthesisRequest
from .runtime.state import RequestState, SegmentState
from .runtime.stream import DONE, RequestStream
from .runtime.vocoder_stream import vocode_chunk
from .schedule import ChunkCall, ChunkCursor, call_frames
from .telemetry import ChunkTiming, RequestTelemetry, now

log = logging.getLogger(__name__)


#: ``observer(telemetry, outcome)``; outcome is one of :data:`OUTCOMES`.
Observer = Callable[[RequestTelemetry, str], None]
OUTCOMES = ("ok", "cancelled", "error", "rejected")


class EngineClosed(RuntimeError):
    pass


class EngineBusy(RuntimeError):
    """The engine's admission queue is full: the request was refused (HTTP front ends answer 429/503)."""


def _free_streams(config: EngineConfig, active: int) -> int:
    return max(0, config.max_streams - active)


class Engine:
    """Serve streaming synthesis requests on one set of loaded models."""

    def __init__(self, models: LoadedModels, frontend: object | None = None,
                 backend: BackendConfig | None = None, config: EngineConfig | None = None):
        self.models = models
        self.frontend = frontend
        self.default_backend = backend or BackendConfig()
        self.config = config or EngineConfig()
        self._rejected = 0  # refused at admission because the queue was full
        self._admitted = 0  # left the admission queue
        self._decode_calls = 0  # llm.decode calls (batched steps) and the rows they carried
        self._decode_rows = 0
        self._stage_sets = StageCache(models, self.config)
        self._stage_lock = threading.Lock()
        self._cv = threading.Condition()
        self._incoming: deque[RequestState] = deque()
        self._active: list[RequestState] = []
        self._closed = False
        self._observers: list[Observer] = []
        self._thread = threading.Thread(target=self._run, name="cosyvoice-worker", daemon=True)
        self._thread.start()
        self.stages(self.default_backend)

    # ------------------------------------------------------------------------------------------- public API
    @property
    def sample_rate(self) -> int:
        return self.models.config.sample_rate

    def stages(self, config: BackendConfig) -> StageSet:
        """The stage implementations for ``config``: each stage is built once per (stage, backend, dtype) and
        shared with every config naming it (they hold no request state); a bounded number is kept per stage
        (``EngineConfig.stage_variants``)."""
        with self._stage_lock:
            if config not in self._stage_sets:
                check_available(config, self.models.device)
            return self._stage_sets.get(config)

    def store_flow_state(self, speaker: str, backend: BackendConfig | None = None) -> int:
        """Compute a saved speaker's flow prompt state with ``backend``'s incremental flow (default: the
        engine's) and store it in the speaker cache (safetensors, ``extra`` entries ``flow.*``), so that after a
        restart that voice's first chunk does not recompute its prompt.  Returns the bytes stored.

        The state is specific to the flow weights, dtype and runner layout (checked by a fingerprint on use: a
        mismatching one is ignored and recomputed), and large: ~2.3 MB per committed prompt frame in bf16 at
        full size (~230 MB for a 3 s prompt)."""
        from .frontend.pipeline import FLOW_STATE_PREFIX, Frontend
        from .backends.incremental_flow import IncrementalFlow

        if self.frontend is None:
            raise ValueError("this engine has no frontend, so it has no speaker cache")
        cfg = backend or self.default_backend
        flow = self.stages(cfg).flow
        inc = flow if isinstance(flow, IncrementalFlow) else getattr(flow, "incremental", None)
        if inc is None:
            raise ConfigError(f"flow backend {cfg.flow!r} with incremental={cfg.incremental} keeps no flow state; "
                              "choose eager or cudagraph with incremental on")
        cache = self.frontend._cache()  # type: ignore[attr-defined]
        feats = cache.get(speaker)
        inputs = Frontend.build_inputs([torch.zeros(1, 1, dtype=torch.int32)], feats, "cross_lingual")
        state = inc.prompt_flow_state(inputs.to(self.models.device, cfg.torch_dtype))
        feats.extra = {k: v for k, v in feats.extra.items() if not k.startswith(FLOW_STATE_PREFIX)}
        feats.extra.update({FLOW_STATE_PREFIX + k: v for k, v in state.items()})
        cache.add(speaker, feats, overwrite=True)
        return sum(v.numel() * v.element_size() for v in state.values())

    def stream(self, request: SynthesisRequest) -> "RequestStream":
        """Yield the request's audio chunks as they are produced; closing the iterator cancels the request."""
        state = self._admit(request)
        return RequestStream(self, state)

    def synthesize(self, request: SynthesisRequest) -> tuple[np.ndarray, RequestTelemetry]:
        """The whole utterance as one array (24 kHz float32) and its telemetry."""
        parts, tele = [], None
        for chunk in self.stream(request):
            parts.append(chunk.samples)
            tele = chunk.telemetry or tele
        return (np.concatenate(parts) if parts else np.zeros(0, np.float32)), tele

    async def astream(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """asyncio-friendly :meth:`stream`: waits for chunks in a thread, cancels on ``aclose``/cancel."""
        admit = asyncio.ensure_future(asyncio.to_thread(self._admit, request))
        try:
            state = await asyncio.shield(admit)
        except asyncio.CancelledError:
            # cancelled while the frontend ran: the admission finishes in its thread, then is dropped at once
            admit.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                                    else RequestStream(self, f.result()).close())
            raise
        stream = RequestStream(self, state)
        try:
            while True:
                chunk = await asyncio.to_thread(next, stream, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            # Thread-safe, unlike closing a generator: a `next` still blocked in its thread (the task was cancelled
            # while it waited) is woken by the worker with the end-of-stream marker, so no thread is left behind.
            stream.close()

    def wake(self) -> None:  # bistream hook (h19e implements)
        """A text source delivered text: let the scheduler step the states that were waiting for it."""
        with self._cv:
            self._cv.notify_all()

    def cancel(self, request_id: str) -> bool:
        with self._cv:
            for st in list(self._incoming) + self._active:
                if st.id == request_id:
                    st.cancelled.set()
                    self._cv.notify_all()
                    return True
        return False

    def add_observer(self, fn: Observer) -> None:
        """Call ``fn(telemetry, outcome)`` once per request when it is over (in the consumer's thread; keep it
        quick).  An observer that raises is logged and ignored."""
        self._observers.append(fn)

    def remove_observer(self, fn: Observer) -> None:
        if fn in self._observers:
            self._observers.remove(fn)

    def _notify(self, tele: RequestTelemetry, outcome: str) -> None:
        for fn in list(self._observers):
            try:
                fn(tele, outcome)
            except Exception:  # metrics must never break synthesis
                log.exception("telemetry observer %r failed", fn)

    @property
    def max_active(self) -> int:
        """Requests running at once (``EngineConfig.max_streams``)."""
        return self.config.max_streams

    def stats(self) -> dict[str, object]:
        """A snapshot for health checks, metrics and soak tests (the public seam: nothing outside reads the
        engine's private fields).  Keys: ``running`` (worker alive and not closed), ``active`` (admitted and
        running), ``queued`` (waiting in the admission queue), ``stage_sets`` (built stage sets as
        ``llm/flow/vocoder/dtype`` strings), ``observers``, ``max_active`` (= ``max_streams``), ``queue_limit``,
        ``rejected`` (refused because the queue was full), ``admitted`` (requests that left the queue),
        ``llm_slots`` / ``llm_slots_free`` (summed over the built LLM stages; ``None`` when unbounded),
        ``decode_steps`` / ``decode_rows`` (batched LLM decode calls and the request-steps they carried),
        ``graph_captures`` (CUDA graphs captured in this process: constant after start-up except for the
        exact-shape flow-encoder and HiFT graphs of a new chunk length); also ``stage_configs`` (the cached sets'
        backend configs as dicts), ``stages_built`` (implementations as ``stage/backend/dtype``, least recently
        used first) and ``stage_variants`` (the bound per stage)."""
        with self._cv:
            active, queued = len(self._active), len(self._incoming)
            rejected, admitted = self._rejected, self._admitted
            steps, rows = self._decode_calls, self._decode_rows
        configs = self._stage_sets.configs()  # the cache's own lock: a build in progress does not block this
        built = self._stage_sets.stage_names()
        sets = [f"{c.llm}/{c.flow}/{c.vocoder}/{c.dtype}" for c in configs]
        llms = list({id(m): m for m in self._stage_sets.llm_stages()}.values())  # shared between sets: count once
        from .backends.graphs import captures

        caps = [getattr(m, "capacity", None) for m in llms]
        slots = None if any(c is None for c in caps) else sum(caps)
        free = None if slots is None else sum(m.free_slots() for m in llms)
        return {"running": self._thread.is_alive() and not self._closed, "active": active, "queued": queued,
                "stage_sets": sets, "observers": len(self._observers), "max_active": self.max_active,
                "queue_limit": self.config.queue_limit, "rejected": rejected, "admitted": admitted,
                "llm_slots": slots, "llm_slots_free": free, "decode_steps": steps, "decode_rows": rows,
                "stage_configs": [{k: getattr(c, k) for k in BackendConfig.__slots__} for c in configs],
                "stages_built": built, "stage_variants": self.config.stage_variants,
                "graph_captures": captures()}

    def active_requests(self) -> int:
        with self._cv:
            return len(self._incoming) + len(self._active)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- admission
    def prepare(self, request: SynthesisRequest, tele: RequestTelemetry | None = None) -> ModelInputs:
        """Run the frontend (text, prompt audio or saved speaker) -> model inputs."""
        if request.inputs is not None:
            return request.inputs
        if self.frontend is None:
            raise ValueError("this engine has no frontend (the model directory lacks the tokenizer or ONNX files):"
                             " pass token ids as inputs, or load a complete CosyVoice2-0.5B directory")
        inputs, cache_hit = self.frontend.prepare(request)  # type: ignore[attr-defined]
        if tele is not None:
            tele.speaker_cache_hit = cache_hit
        return inputs

    def _admit(self, request: SynthesisRequest) -> RequestState:
        tele = RequestTelemetry(request.request_id)
        tele.params = {"mode": request.mode, "chars": len(request.text)}  # known even when admission refuses it
        try:
            return self._admit_checked(request, tele)
        except Exception as e:  # refused before reaching the worker (bad prompt, backend, engine full): observed
            tele.error = f"{type(e).__name__}: {e}"
            self._notify(tele, "rejected")
            raise

    def _check_room(self) -> None:
        """Raise :class:`EngineBusy` (and count it) when the admission queue is full (caller holds ``_cv``)."""
        cfg = self.config
        waiting = len(self._incoming) - _free_streams(cfg, len(self._active))  # beyond the free streams
        if waiting >= cfg.queue_limit:
            self._rejected += 1
            raise EngineBusy(f"the engine is full: {len(self._active)} requests running (max_streams="
                             f"{cfg.max_streams}) and {len(self._incoming)} waiting (queue_limit="
                             f"{cfg.queue_limit}); try again in a moment")

    def _admit_checked(self, request: SynthesisRequest, tele: RequestTelemetry) -> RequestState:
        if self._closed:
            raise EngineClosed("the engine is shut down")
        with self._cv:  # refuse before the frontend's work when the queue is already full
            self._check_room()
        cfg = request.backend or self.default_backend
        tele.params = {**tele.params, "backend": f"{cfg.llm}/{cfg.flow}/{cfg.vocoder}", "dtype": cfg.dtype,
                       "incremental_flow": cfg.incremental,
                       "stream": request.stream, "seed": request.seed,
                       **{k: getattr(request.stream_params, k) for k in StreamParams.__slots__}}
        stages = self.stages(cfg)
        dev = self.models.device
        if request.text_source is not None:  # bistream hook
            from .runtime.bistream import bistream_inputs  # bistream hook
            stages, inputs = bistream_inputs(self, request, stages, tele)  # bistream hook
        else:  # bistream hook
            inputs = self.prepare(request, tele).to(dev, cfg.torch_dtype)  # prompt mel/embedding feed the flow
        tele.frontend_done = now()
        g_llm = torch.Generator(device=dev).manual_seed(request.seed)
        g_voc = torch.Generator(device=dev).manual_seed(request.seed + 1)
        state = RequestState(request=request, inputs=inputs, telemetry=tele, stages=stages,
                             llm_generator=g_llm, vocoder_generator=g_voc)
        with self._cv:
            # checked again under the lock: a request queued after the worker exited would never be answered
            if self._closed:
                raise EngineClosed("the engine is shut down")
            self._check_room()
            self._incoming.append(state)
            self._cv.notify_all()
        return state

    # ------------------------------------------------------------------------------------------- worker
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._closed and not self._incoming and not self._active:
                    self._cv.wait()
                if self._closed:
                    for st in list(self._incoming) + self._active:
                        self._fail(st, EngineClosed("the engine was shut down"))
                    self._incoming.clear()
                    return
                self._admit_waiting()
                if self._active and not self._incoming and all(_idle(s) for s in self._active):
                    self._cv.wait(timeout=0.5)  # bistream hook (h19e implements): every LM waits for text
                    continue
            if not self._active:
                continue
            try:
                self._turn()
            except Exception as e:  # a scheduler bug must fail the requests in flight, never hang them
                log.exception("engine scheduler failed; failing the active requests")
                for st in list(self._active):
                    self._fail(st, RuntimeError(f"internal engine error ({type(e).__name__}): {e}"))

    def _admit_waiting(self) -> None:
        """Move waiting requests into free streams, oldest first (caller holds ``_cv``).  A request cancelled
        while it waited ends here without ever starting."""
        for st in [s for s in self._incoming if s.cancelled.is_set()]:
            self._incoming.remove(st)
            st.telemetry.cancelled = True
            st.close()
            st.out.put(DONE)
        while self._incoming and len(self._active) < self.config.max_streams:
            st = self._incoming.popleft()
            st.telemetry.admitted = now()
            self._admitted += 1
            self._active.append(st)

    def _turn(self) -> None:
        for st in list(self._active):
            if st.cancelled.is_set():
                st.telemetry.cancelled = True
                st.out.put(DONE)  # wakes a consumer blocked on the queue in another thread
                self._finish(st)
        self._start_segments()
        first = [st for st in self._active if st.segment and st.segment.pending and st.chunks_emitted == 0]
        self._run_chunks(first)
        self._decode()
        ready = [st for st in self._active if st.segment and st.segment.pending]
        ready.sort(key=lambda s: s.audio_samples_emitted / self.sample_rate + s.telemetry.received)
        self._run_chunks(ready)  # every ready chunk (first or later), earliest playback deadline first, batched

    def _guard(self, st: RequestState, fn: Callable[[RequestState], None]) -> None:
        if st not in self._active:
            return
        try:
            fn(st)
        except Exception as e:  # one request's failure must not disturb the others
            log.exception("request %s failed", st.id)
            self._fail(st, e)

    @staticmethod
    def _by_stage_set(states: list[RequestState]) -> list[list[RequestState]]:
        groups: dict[int, list[RequestState]] = {}
        for st in states:
            groups.setdefault(id(st.stages), []).append(st)
        return list(groups.values())

    def _start_segments(self) -> None:
        """Open the next segment of every request that has none, and prefill their LMs: one ``prefill`` call
        per stage set over as many of them as the backend has free slots (oldest first; the rest wait)."""
        starting: list[RequestState] = []
        for st in list(self._active):
            if st.segment is None and not st.cancelled.is_set():
                self._guard(st, self._open_segment)
                if st in self._active and st.segment is not None:
                    starting.append(st)
            elif st.segment is not None and not st.segment.llm_started:  # waiting for a free LLM slot
                starting.append(st)
        for group in self._by_stage_set(starting):
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
            _sync(self.models.device)
            t1 = now()
            for st, res in zip(take, results):
                st.segment.llm_started = True
                if st.segment.index == 0:
                    st.telemetry.prefill_done = t1
                self._guard(st, lambda s, r=res: self._take_token(s, r))

    def _open_segment(self, st: RequestState) -> None:
        segs = st.inputs.text_segments
        if st.next_segment >= len(segs):
            st.out.put(DONE)
            self._finish(st)
            return
        idx = st.next_segment
        st.next_segment += 1
        text = segs[idx]
        prompt_len = st.inputs.flow_prompt_speech_token.shape[1]
        params = st.request.stream_params
        st.segment = SegmentState(index=idx, text=text,
                                  cursor=ChunkCursor(prompt_len, params, self.models.config.chunk_size))
        st.segment.llm = st.stages.llm.new_state(st.inputs, text, st.llm_generator, st.request.max_tokens,
                                                 st.request.ignore_eos)
        if st.segment.llm.done:  # nothing to generate (a zero token budget): the segment ends at once
            st.segment.llm_started = True
            self._take_token(st, None)

    def _decode(self) -> None:
        """One ``decode`` call per stage set over every running LM (the cudagraph LLM makes it one replay)."""
        rows = [st for st in self._active if st.segment is not None and st.segment.llm_started
                and not st.segment.llm_done and not st.cancelled.is_set()
                and st.segment.llm.ready]  # bistream hook (h19e implements)
        for group in self._by_stage_set(rows):
            try:
                results = group[0].stages.llm.decode([st.segment.llm for st in group])
                if len(results) != len(group):
                    raise RuntimeError(f"llm.decode returned {len(results)} results for {len(group)} states")
            except Exception as e:  # noqa: BLE001 - the step failed as a whole: every row of it fails
                log.exception("batched decode step for %d requests failed", len(group))
                results = [e] * len(group)
            with self._cv:
                self._decode_calls += 1
                self._decode_rows += len(group)
            for st, res in zip(group, results):
                self._guard(st, lambda s, r=res: self._take_token(s, r))

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
            seg.llm_done = True
            st.stages.llm.release(seg.llm)
        if st.request.stream:
            while (call := seg.cursor.next_call(len(seg.tokens), seg.llm_done)) is not None:
                seg.pending.append((call, now()))
        elif seg.llm_done:
            n = len(seg.tokens)
            seg.pending.append((ChunkCall(0, 0, n, n, 0, finalize=True), now()))

    def _run_chunk(self, st: RequestState) -> None:
        call, timing = self._take_call(st)
        mel = self._flow_one(st, call, timing)
        self._emit(st, call, timing, mel)

    def _run_chunks(self, states: list[RequestState]) -> None:
        """Run the next pending chunk of each of ``states``.  Requests on the same stage set whose flow stage
        has ``solve`` share one batched flow computation; every other chunk runs alone.  Vocoding and
        emission stay per request.  A failing batched call is retried item by item, so that only the culprit's
        request fails."""
        for group in self._by_stage_set(states):
            flow = group[0].stages.flow
            batch = getattr(flow, "solve", None)
            if len(group) == 1 or batch is None or getattr(flow, "max_batch", 2) <= 1:
                for st in group:
                    self._guard(st, self._run_chunk)
                continue
            taken: list[tuple[RequestState, ChunkCall, ChunkTiming]] = []
            for st in group:
                if st in self._active:
                    call, timing = self._take_call(st)
                    taken.append((st, call, timing))
                    st.segment.flow_info = None  # the backend reports incremental chunks; the rest recompute
            start = now()
            items = [(st.segment, st.inputs, self._call_tokens(st, call), call) for st, call, _ in taken]
            try:
                mels = batch(items)
                _sync(self.models.device)
                if len(mels) != len(items):
                    raise RuntimeError(f"solve returned {len(mels)} mels for {len(items)} items")
            except Exception:  # noqa: BLE001 - isolate the culprit: each request alone, failures stay its own
                log.exception("batched flow call for %d requests failed; retrying them one by one", len(items))
                for st, call, timing in taken:
                    self._guard(st, lambda s, c=call, t=timing: self._emit(s, c, t, self._flow_one(s, c, t)))
                continue
            end = now()
            for (st, call, timing), mel in zip(taken, mels):
                timing.flow_start, timing.flow_end = start, end  # the mel existed when the whole batch did
                self._flow_info(st, call, timing)
                self._guard(st, lambda s, c=call, t=timing, m=mel: self._emit(s, c, t, m))

    def _take_call(self, st: RequestState) -> tuple[ChunkCall, ChunkTiming]:
        seg = st.segment
        assert seg is not None
        call, ready_at = seg.pending.pop(0)
        timing = ChunkTiming(index=st.chunks_emitted, segment=seg.index, n_tokens=call.hop,
                             sample_rate=self.sample_rate, tokens_ready=ready_at, finalize=call.finalize)
        return call, timing

    @staticmethod
    def _call_tokens(st: RequestState, call: ChunkCall) -> torch.Tensor:
        assert st.segment is not None
        return torch.tensor([st.segment.tokens[:call.n_tokens]], dtype=torch.int32)

    def _flow_one(self, st: RequestState, call: ChunkCall, timing: ChunkTiming) -> torch.Tensor:
        assert st.segment is not None
        st.segment.flow_info = None
        timing.flow_start = now()
        mel = st.stages.flow.chunk(st.segment, st.inputs, self._call_tokens(st, call), call)
        _sync(self.models.device)
        timing.flow_end = now()
        self._flow_info(st, call, timing)
        return mel

    def _flow_info(self, st: RequestState, call: ChunkCall, timing: ChunkTiming) -> None:
        """What the flow computed for this chunk (the dashboard shows it): the backend's own account
        (incremental runners) or upstream's full recompute of prompt + every token so far."""
        seg = st.segment
        info = seg.flow_info if seg is not None else None
        if info is None:
            frames = call_frames(call, st.inputs.flow_prompt_speech_token.shape[1],
                                 self.models.config.flow.token_mel_ratio)
            info = ("recompute", frames, 0)
        timing.flow_mode, timing.flow_frames, timing.flow_state_bytes = info

    def _emit(self, st: RequestState, call: ChunkCall, timing: ChunkTiming, mel: torch.Tensor) -> None:
        """Vocode one chunk's mel and hand the audio to the request's consumer."""
        seg = st.segment
        assert seg is not None
        speed = st.request.speed if not st.request.stream else 1.0
        voc = st.stages.vocoder
        wav, seg.voc_cache = vocode_chunk(lambda m, cs: voc.vocode(m, cs, st.vocoder_generator), mel,
                                          seg.voc_cache, call.finalize, speed=speed)
        samples = wav[0].float().cpu().numpy()
        timing.vocoder_end = now()
        timing.n_samples = len(samples)
        last_segment = st.next_segment >= len(st.inputs.text_segments)
        is_last = call.finalize and last_segment
        st.telemetry.chunks.append(timing)
        st.chunks_emitted += 1
        st.audio_samples_emitted += len(samples)
        st.out.put(AudioChunk(samples=samples, index=timing.index, segment=seg.index,
                              sample_rate=self.sample_rate, is_last=is_last, timing=timing))
        if call.finalize:
            seg.close(st.stages.llm)
            st.segment = None
            if is_last:
                st.out.put(DONE)
                self._finish(st)

    def _fail(self, st: RequestState, err: BaseException) -> None:
        st.telemetry.error = f"{type(err).__name__}: {err}"
        st.out.put(err)
        self._finish(st)

    def _finish(self, st: RequestState) -> None:
        st.close()  # frees the LLM slot, flow and vocoder state
        if st in self._active:
            self._active.remove(st)


def _idle(st: RequestState) -> bool:  # bistream hook (h19e implements)
    """Nothing to do for ``st`` until its text source delivers: its LM waits for text, no chunk is pending."""
    seg = st.segment
    return (seg is not None and seg.llm_started and not seg.llm_done and not seg.pending and seg.llm is not None
            and not seg.llm.ready and not st.cancelled.is_set())


def _sync(device: torch.device) -> None:
    """Make stage wall-clock honest on a GPU: the stage ends when its kernels have run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
