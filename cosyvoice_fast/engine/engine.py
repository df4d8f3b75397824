"""The streaming engine: many requests, audio chunks the moment their tokens exist.

- ``Engine.stream(request)`` runs the frontend in the caller's thread (CPU/ONNX work must not hold the
  workers), then offers a :class:`RequestState` to the **admission queue** and yields :class:`AudioChunk`s from
  the request's own queue (blocking ``get``: no polling).  Capacity comes from one :class:`EngineConfig`:
  at most ``max_streams`` requests run at once; more wait in the queue (its own TTFB stage, ``admission``)
  and start when one finishes; only a request beyond ``queue_limit`` waiting ones is refused
  (:class:`EngineBusy`, counted in ``stats()["rejected"]``).  A request cancelled while it waits never starts.
- The :class:`~cosyvoice_fast.engine.scheduler.Scheduler` is the only scheduler: its LLM side batches every
  running LM into one prefill/decode call per LLM stage, its chunk side batches every ready chunk into one flow
  solve and one vocoder call per stage; with ``EngineConfig.cuda_streams == 2`` the two sides run in their own
  threads (and CUDA streams), so flow solves no longer stall decoding.
- Closing the iterator (or :meth:`Engine.cancel`, or dropping the iterator, even before its first chunk) marks
  the request; the LLM side drops it before its next step, so its LM stops within one decode step and its slot,
  KV cache and flow state are freed.  A consumer blocked waiting for a chunk in another thread is woken.
- Observers (:meth:`Engine.add_observer`) see every request's telemetry once it is over, with its outcome
  (``ok``, ``cancelled``, ``error`` or ``rejected`` at admission): metrics hang off this hook.
- An error in one request goes to that request's consumer only; the others keep streaming.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import numpy as np
import torch

from cosyvoice_fast.engine.stages import StageCache
from cosyvoice_fast.kernels.graphs import BackgroundCaptures
from cosyvoice_fast.kernels.gpu_gate import GPU_GATE
from cosyvoice_fast.engine.stages import StageSet, check_available, family_of_models
from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.modeldir.files import LoadedModels
from cosyvoice_fast.frontend.request import AudioChunk, ModelInputs, SynthesisRequest
from cosyvoice_fast.engine.scheduler import EngineClosed, Scheduler
from cosyvoice_fast.engine.state import RequestState
from cosyvoice_fast.engine.stream import RequestStream
from cosyvoice_fast.telemetry.record import RequestTelemetry, now

log = logging.getLogger(__name__)


#: ``observer(telemetry, outcome)``; outcome is one of :data:`OUTCOMES`.
Observer = Callable[[RequestTelemetry, str], None]
OUTCOMES = ("ok", "cancelled", "error", "rejected")


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
        self._stage_sets = StageCache(models, self.config)
        self._stage_lock = threading.Lock()
        #: the graphs stage builds left for after ready (``EngineConfig.background_capture``), one thread
        self.background = BackgroundCaptures(models.device)
        self._admit_pool: ThreadPoolExecutor | None = None  # asyncio front ends' admissions (aopen)
        self._observers: list[Observer] = []
        cfg = models.config
        self._sched = Scheduler(self.config, models.device, cfg.sample_rate, cfg.chunk_size,
                                cfg.flow.token_mel_ratio)
        # the scheduler's shared objects, under the names the stream objects and tests use
        self._cv, self._incoming, self._active = self._sched.cv, self._sched.incoming, self._sched.active
        self._sched.turn = lambda: self._turn()  # one seam: a test may replace the engine's turn
        self._threads = self._sched.start()
        self._thread = self._threads[0]
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
                check_available(config, self.models.device, family_of_models(self.models))
            built = self._stage_sets.get(config)
        self.background.add(self._stage_sets.take_deferred())  # captured behind this set's first-chunk graphs
        return built

    def store_flow_state(self, speaker: str, backend: BackendConfig | None = None) -> int:
        """Compute a saved speaker's flow prompt state with ``backend``'s incremental flow (default: the
        engine's) and store it in the speaker cache (safetensors, ``extra`` entries ``flow.*``), so that after a
        restart that voice's first chunk does not recompute its prompt.  Returns the bytes stored.

        The state is specific to the flow weights, dtype and runner layout (checked by a fingerprint on use: a
        mismatching one is ignored and recomputed), and large: ~2.3 MB per committed prompt frame in bf16 at
        full size (~230 MB for a 3 s prompt)."""
        from cosyvoice_fast.frontend.pipeline import FLOW_STATE_PREFIX, Frontend

        if self.frontend is None:
            raise ValueError("this engine has no frontend, so it has no speaker cache")
        cfg = backend or self.default_backend
        flow = self.stages(cfg).flow
        inc = flow.incremental
        if inc is None:
            raise ConfigError(f"flow backend {cfg.flow!r} with incremental={cfg.incremental} keeps no flow state; "
                              "choose eager, cudagraph or fused with incremental on")
        cache = self.frontend._cache()  # type: ignore[attr-defined]
        feats = cache.get(speaker)
        inputs = Frontend.build_inputs([torch.zeros(1, 1, dtype=torch.int32)], feats, "cross_lingual")
        with GPU_GATE.work():
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

    async def aopen(self, request: SynthesisRequest) -> "RequestStream":
        """asyncio-friendly :meth:`stream`: the admission (frontend work, bounded in time) runs on the engine's
        own small admission pool, never on asyncio's default executor, and the returned stream is iterated with
        ``async for`` (no thread per waiting stream).  Cancelled while the frontend runs, the request is dropped
        as soon as its admission finishes."""
        loop = asyncio.get_running_loop()
        admit = loop.run_in_executor(self._admission_pool(), self.stream, request)
        try:
            return await asyncio.shield(admit)
        except asyncio.CancelledError:
            admit.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                                    else f.result().close())
            raise

    async def astream(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """The request's chunks as an async generator (:meth:`aopen` then ``async for``); cancels the request on
        ``aclose`` or when the consuming task is cancelled."""
        stream = await self.aopen(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.close()  # thread-safe: the worker drops the request before its next step

    def _admission_pool(self) -> ThreadPoolExecutor:
        with self._stage_lock:
            if self._admit_pool is None:
                self._admit_pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                                      thread_name_prefix="cosyvoice-admit")
            return self._admit_pool

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
        ``flow_calls`` / ``flow_rows`` and ``vocoder_calls`` / ``vocoder_rows`` (likewise for chunks),
        ``overlap`` (LLM and chunk sides in their own threads/streams), ``graph_captures`` (CUDA graphs
        captured in this process: constant after start-up except for the exact-shape flow-encoder and HiFT
        graphs of a new chunk length); also ``stage_configs`` (the cached sets'
        backend configs as dicts), ``stages_built`` (implementations as ``stage/backend/dtype``, least recently
        used first) and ``stage_variants`` (the bound per stage)."""
        with self._cv:
            active, queued = len(self._active), len(self._incoming)
            counts = dict(self._sched.counts)
        configs = self._stage_sets.configs()  # the cache's own lock: a build in progress does not block this
        built = self._stage_sets.stage_names()
        sets = [f"{c.llm}/{c.flow}/{c.vocoder}/{c.dtype}" for c in configs]
        llms = list({id(m): m for m in self._stage_sets.llm_stages()}.values())  # shared between sets: count once
        from cosyvoice_fast.kernels.graphs import background_captures, captures

        caps = [m.capacity for m in llms]
        slots = None if any(c is None for c in caps) else sum(caps)
        free = None if slots is None else sum(m.free_slots() for m in llms)
        return {"running": self._thread.is_alive() and not self._sched.closed, "active": active, "queued": queued,
                "stage_sets": sets, "observers": len(self._observers), "max_active": self.max_active,
                "queue_limit": self.config.queue_limit, **counts, "overlap": self._sched.overlap,
                "llm_slots": slots, "llm_slots_free": free,
                "stage_configs": [{k: getattr(c, k) for k in BackendConfig.__slots__} for c in configs],
                "stages_built": built, "stage_variants": self.config.stage_variants,
                "graph_captures": captures(), "background_captures": background_captures()}

    def active_requests(self) -> int:
        """Requests the engine still holds (waiting, running, or finishing a chunk computed for them)."""
        return self._sched.held()

    def close(self) -> None:
        self.background.stop()
        with self._cv:
            self._sched.closed = True
            self._cv.notify_all()
        if self._admit_pool is not None:
            self._admit_pool.shutdown(wait=False)  # queued admissions run and meet EngineClosed
        for t in self._threads:
            t.join(timeout=10)

    def wake(self) -> None:
        """Wake the scheduler (thread-safe): a request's input changed, e.g. a text source delivered text that
        makes its LLM state ``ready`` again."""
        self._sched.wake()

    def _turn(self) -> None:
        """One turn of the LLM worker (both sides when they do not overlap); tests replace it to inject faults."""
        self._sched.step()

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
            self._sched.counts["rejected"] += 1
            starting = len(self._incoming) - waiting  # admitted, taking a free stream at the worker's next turn
            raise EngineBusy(f"the engine is full: {len(self._active) + starting} requests running (max_streams="
                             f"{cfg.max_streams}) and {waiting} waiting (queue_limit="
                             f"{cfg.queue_limit}); try again in a moment")

    def _admit_checked(self, request: SynthesisRequest, tele: RequestTelemetry) -> RequestState:
        if self._sched.closed:
            raise EngineClosed("the engine is shut down")
        with self._cv:  # refuse before the frontend's work when the queue is already full
            self._check_room()
        cfg = request.backend or self.default_backend
        tele.params = {**tele.params, "backend": f"{cfg.llm}/{cfg.flow}/{cfg.vocoder}", "dtype": cfg.dtype,
                       "incremental_flow": cfg.incremental,
                       "stream": request.stream, "seed": request.seed,
                       **{k: getattr(request.stream_params, k) for k in StreamParams.__slots__}}
        stages = self.stages(cfg)  # outside the gate: a new backend's build captures graphs
        dev = self.models.device
        with GPU_GATE.work():  # the frontend's GPU work and the copies never overlap a graph capture
            if request.text_source is not None:  # bi-streaming: the voice is prepared once, text arrives later
                from cosyvoice_fast.engine.bistream import bistream_inputs

                stages, inputs = bistream_inputs(self, request, stages, tele)
            else:
                inputs = self.prepare(request, tele).to(dev, cfg.torch_dtype)  # prompt mel/embedding: the flow's
            if dev.type == "cuda":  # the copies ran on this thread's stream; the workers read them on their own
                torch.cuda.current_stream(dev).synchronize()
            g_llm = torch.Generator(device=dev).manual_seed(request.seed)
            g_voc = torch.Generator(device=dev).manual_seed(request.seed + 1)
        tele.frontend_done = now()
        state = RequestState(request=request, inputs=inputs, telemetry=tele, stages=stages,
                             llm_generator=g_llm, vocoder_generator=g_voc)
        with self._cv:
            # checked again under the lock: a request queued after the worker exited would never be answered
            if self._sched.closed:
                raise EngineClosed("the engine is shut down")
            self._check_room()
            self._incoming.append(state)
            self._cv.notify_all()
        return state
