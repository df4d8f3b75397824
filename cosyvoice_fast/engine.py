"""The streaming engine: many requests, one GPU worker, audio chunks the moment their tokens exist.

Shape of the runtime:

- ``Engine.stream(request)`` runs the frontend in the caller's thread (CPU/ONNX work must not hold the GPU
  worker), hands a :class:`RequestState` to the worker and yields :class:`AudioChunk`s from the request's own
  queue (blocking ``get``: no polling, a chunk is handed over the moment it is queued).
- One worker thread owns all model work and interleaves requests step by step.  Each turn it
  (1) drops cancelled requests, (2) starts LMs of new segments (prefill), (3) runs every *first* chunk that
  is ready (first audio has priority) as one batched flow call where the backend offers ``chunk_batch``,
  (4) advances every running LM by one token (the ``cudagraph`` LLM turns these into one batched decode
  step), (5) runs one ready later chunk, earliest playback deadline first.  A new request therefore waits at
  most one decode round, never behind another request's long tail.
- Closing the iterator (or :meth:`Engine.cancel`, or dropping the iterator, even before its first chunk) marks
  the request; the worker drops it before its next step, so its LM stops within one decode step and its caches
  are freed.  A consumer blocked waiting for a chunk in another thread is woken (the stream just ends).
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
from .backends.cudagraph_flow import call_frames
from .config import BackendConfig, ConfigError, StreamParams
from .engine_config import EngineConfig
from .modelfiles import LoadedModels
from .request import AudioChunk, ModelInputs, SynthesisRequest
from .runtime.state import RequestState, SegmentState
from .runtime.vocoder_stream import vocode_chunk
from .schedule import ChunkCall, ChunkCursor
from .telemetry import ChunkTiming, RequestTelemetry, now

log = logging.getLogger(__name__)

_DONE = object()

#: ``observer(telemetry, outcome)``; outcome is one of :data:`OUTCOMES`.
Observer = Callable[[RequestTelemetry, str], None]
OUTCOMES = ("ok", "cancelled", "error", "rejected")


class EngineClosed(RuntimeError):
    pass


class EngineBusy(RuntimeError):
    """The engine's admission queue is full: the request was refused (HTTP front ends answer 429/503)."""


class Engine:
    """Serve streaming synthesis requests on one set of loaded models."""

    def __init__(self, models: LoadedModels, frontend: object | None = None,
                 backend: BackendConfig | None = None, max_active: int | None = None,
                 config: EngineConfig | None = None):
        self.models = models
        self.frontend = frontend
        self.default_backend = backend or BackendConfig()
        self.config = config or EngineConfig(**({} if max_active is None else {"max_streams": max_active}))
        self.max_active = self.config.max_streams
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
        from .runtime.flow_state import IncrementalFlow

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

    def stats(self) -> dict[str, object]:
        """A snapshot for health checks, metrics and soak tests (the public seam: nothing outside reads the
        engine's private fields).  Keys: ``running`` (worker alive and not closed), ``active`` (admitted and
        running), ``queued`` (waiting for admission), ``stage_sets`` (built stage sets as ``llm/flow/vocoder/dtype``
        strings), ``observers``, ``max_active``; also ``stage_configs`` (the cached sets' backend configs as dicts,
        ``incremental`` included), ``stages_built`` (implementations as ``stage/backend/dtype``, least recently used
        first), ``stage_variants`` (the bound per stage), ``queue_limit`` and ``llm_slots`` (``None``: sized when
        the cudagraph LLM is built) from the engine's config."""
        with self._cv:
            active, queued = len(self._active), len(self._incoming)
        configs = self._stage_sets.configs()  # the cache's own lock: a build in progress does not block this
        built = self._stage_sets.stage_names()
        sets = [f"{c.llm}/{c.flow}/{c.vocoder}/{c.dtype}" for c in configs]
        return {"running": self._thread.is_alive() and not self._closed, "active": active, "queued": queued,
                "stage_sets": sets, "observers": len(self._observers), "max_active": self.max_active,
                "stage_configs": [{k: getattr(c, k) for k in BackendConfig.__slots__} for c in configs],
                "stages_built": built, "stage_variants": self.config.stage_variants,
                "queue_limit": self.config.queue_limit, "llm_slots": self.config.llm_slots}

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
        try:
            return self._admit_checked(request, tele)
        except Exception as e:  # refused before reaching the worker (bad prompt, backend, engine full): observed
            tele.error = f"{type(e).__name__}: {e}"
            self._notify(tele, "rejected")
            raise

    def _admit_checked(self, request: SynthesisRequest, tele: RequestTelemetry) -> RequestState:
        if self._closed:
            raise EngineClosed("the engine is shut down")
        cfg = request.backend or self.default_backend
        tele.params = {"backend": f"{cfg.llm}/{cfg.flow}/{cfg.vocoder}", "dtype": cfg.dtype,
                       "incremental_flow": cfg.incremental,
                       "stream": request.stream, "seed": request.seed,
                       **{k: getattr(request.stream_params, k) for k in StreamParams.__slots__}}
        stages = self.stages(cfg)
        dev = self.models.device
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
            if len(self._incoming) + len(self._active) >= self.max_active:
                raise EngineBusy(f"the engine is at its limit of {self.max_active} active requests; "
                                   "try again in a moment")
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
                    return
                while self._incoming:
                    self._active.append(self._incoming.popleft())
            try:
                self._turn()
            except Exception as e:  # a scheduler bug must fail the requests in flight, never hang them
                log.exception("engine scheduler failed; failing the active requests")
                for st in list(self._active):
                    self._fail(st, RuntimeError(f"internal engine error ({type(e).__name__}): {e}"))

    def _turn(self) -> None:
        for st in list(self._active):
            if st.cancelled.is_set():
                st.telemetry.cancelled = True
                st.out.put(_DONE)  # wakes a consumer blocked on the queue in another thread
                self._finish(st)
        for st in list(self._active):
            if st.segment is None:
                self._guard(st, self._start_segment)
        first = [st for st in self._active if st.segment and st.segment.pending and st.chunks_emitted == 0]
        self._run_chunks(first)
        for st in list(self._active):
            seg = st.segment
            if seg is not None and not seg.llm_done and not st.cancelled.is_set():
                self._guard(st, self._llm_step)
        ready = [st for st in self._active if st.segment and st.segment.pending]
        if ready:
            ready.sort(key=lambda s: (s.chunks_emitted > 0, s.audio_samples_emitted / self.sample_rate
                                      + s.telemetry.received))
            if ready[0].chunks_emitted == 0:  # first chunks that became ready during this turn: all at once
                self._run_chunks([st for st in ready if st.chunks_emitted == 0])
            else:
                self._guard(ready[0], self._run_chunk)

    def _guard(self, st: RequestState, fn: Callable[[RequestState], None]) -> None:
        if st not in self._active:
            return
        try:
            fn(st)
        except Exception as e:  # one request's failure must not disturb the others
            log.exception("request %s failed", st.id)
            self._fail(st, e)

    def _start_segment(self, st: RequestState) -> None:
        segs = st.inputs.text_segments
        if st.next_segment >= len(segs):
            st.out.put(_DONE)
            self._finish(st)
            return
        idx = st.next_segment
        st.next_segment += 1
        text = segs[idx]
        prompt_len = st.inputs.flow_prompt_speech_token.shape[1]
        params = st.request.stream_params
        st.segment = SegmentState(index=idx, text=text,
                                  cursor=ChunkCursor(prompt_len, params, self.models.config.chunk_size))
        if idx == 0:
            st.telemetry.prefill_start = now()
        st.segment.token_iter = st.stages.llm.generate(st.inputs, text, st.llm_generator,
                                                       st.request.max_tokens, st.request.ignore_eos)
        self._llm_step(st)  # prefill + first token
        if idx == 0:
            st.telemetry.prefill_done = now()

    def _llm_step(self, st: RequestState) -> None:
        seg = st.segment
        assert seg is not None and seg.token_iter is not None
        tok = next(seg.token_iter, None)
        st.decode_steps += 1
        if tok is None:
            seg.llm_done = True
            seg.token_iter = None
        else:
            seg.tokens.append(int(tok))
            st.telemetry.token_times.append(now())
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
        has ``chunk_batch`` share one batched flow computation; every other chunk runs alone.  Vocoding and
        emission stay per request.  A failing batched call is retried item by item, so that only the culprit's
        request fails."""
        groups: dict[int, list[RequestState]] = {}
        for st in states:
            groups.setdefault(id(st.stages), []).append(st)
        for group in groups.values():
            flow = group[0].stages.flow
            batch = getattr(flow, "chunk_batch", None)
            if len(group) == 1 or batch is None or getattr(flow, "max_batch", 2) <= 1:
                for st in group:
                    self._guard(st, self._run_chunk)
                continue
            taken: list[tuple[RequestState, ChunkCall, ChunkTiming]] = []
            for st in group:
                if st in self._active:
                    call, timing = self._take_call(st)
                    taken.append((st, call, timing))
            start = now()
            items = [(st.segment, st.inputs, self._call_tokens(st, call), call) for st, call, _ in taken]
            try:
                mels = batch(items)
                _sync(self.models.device)
                if len(mels) != len(items):
                    raise RuntimeError(f"chunk_batch returned {len(mels)} mels for {len(items)} items")
            except Exception:  # noqa: BLE001 - isolate the culprit: each request alone, failures stay its own
                log.exception("batched flow call for %d requests failed; retrying them one by one", len(items))
                for st, call, timing in taken:
                    self._guard(st, lambda s, c=call, t=timing: self._emit(s, c, t, self._flow_one(s, c, t)))
                continue
            end = now()
            for (st, call, timing), mel in zip(taken, mels):
                timing.flow_start, timing.flow_end = start, end  # the mel existed when the whole batch did
                if st.segment is not None:
                    st.segment.flow_info = None  # a batched solve recomputes (see CudaGraphFlow.chunk_batch)
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
            seg.close()
            st.segment = None
            if is_last:
                st.out.put(_DONE)
                self._finish(st)

    def _fail(self, st: RequestState, err: BaseException) -> None:
        st.telemetry.error = f"{type(err).__name__}: {err}"
        st.out.put(err)
        self._finish(st)

    def _finish(self, st: RequestState) -> None:
        st.close()
        if st in self._active:
            self._active.remove(st)


class RequestStream:
    """The consumer side of one request: iterate for :class:`AudioChunk`s.

    ``close()`` (also on ``with`` exit and when the object is garbage-collected, even before the first chunk)
    cancels the request if it is still running.  Unlike a generator it may be closed from another thread while a
    ``next`` is blocked waiting: that ``next`` then ends the iteration.
    """

    def __init__(self, engine: Engine, state: RequestState):
        self._engine = engine
        self._state = state
        self._got_last = False
        self._ended = False
        self._lock = threading.Lock()

    @property
    def request_id(self) -> str:
        return self._state.id

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> AudioChunk:
        if self._ended:
            raise StopIteration
        item = self._state.out.get()
        if item is _DONE:
            self._end("ok" if self._got_last else "cancelled")
            raise StopIteration
        if isinstance(item, BaseException):
            self._end("error")
            raise item
        item.timing.delivered = now()
        if item.is_last:
            self._got_last = True
            self._state.telemetry.finished = item.timing.delivered
            item.telemetry = self._state.telemetry
        return item

    def close(self) -> None:
        self._end("ok" if self._got_last else "cancelled")

    def _end(self, outcome: str) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        st = self._state
        if not st.done:
            st.cancelled.set()
            with self._engine._cv:
                self._engine._cv.notify_all()
        self._engine._notify(st.telemetry, outcome)

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _sync(device: torch.device) -> None:
    """Make stage wall-clock honest on a GPU: the stage ends when its kernels have run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
