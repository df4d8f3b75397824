"""The one way every runner captures CUDA graphs (:func:`capture`), and a small cache of graphs keyed by input
shape (:class:`GraphCache`) built on it.

Capturing replaces hundreds of kernel launches per call with one replay.  :func:`capture` warms the function
up on a side stream (library handles and kernel choices happen outside any capture), then captures it with
``capture_begin``/``capture_end`` into the caller's memory pool (``torch.cuda.graph`` would run
``gc.collect()`` and ``empty_cache()`` per graph), and counts it in :data:`CAPTURES`, which the engine reports.
Runners capture every shape their configuration names at start-up and then :meth:`GraphCache.freeze`: a
shape nobody captured runs eagerly (counted), so nothing is captured while requests are being served.

With background capture (``EngineConfig.background_capture``) a runner captures only the shapes a first chunk
needs in its constructor and hands the rest back as :class:`DeferredCapture` jobs; :class:`BackgroundCaptures`
runs them after the server is ready, in one thread on its own CUDA stream, and each job publishes its graph
under its runner's lock.  Until then that shape runs eagerly, as a frozen miss does.  Why this is safe:
capture itself executes nothing and holds :data:`~cosyvoice_fast.kernels.gpu_gate.GPU_GATE` alone (no
engine turn or admission runs GPU work meanwhile: a capture beside them was invalidated or deadlocked on
GPUs), the warm-up before it runs beside serving on fresh inputs outside any graph pool, and a new graph of
a shared pool is only replayed after publishing, under the same lock that serialises that runner's replays.
Each capturing thread reuses one capture stream per device (:func:`capture_stream`), so library workspaces
are set up once per thread, not once per graph, and one warm-up per graph is enough.
:func:`captures` counts captures outside that thread (start-up and, never, request threads);
:func:`background_captures` those of the background thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Hashable, Sequence

import torch

from cosyvoice_fast.kernels.gpu_gate import GPU_GATE

log = logging.getLogger(__name__)

#: graphs captured in this process outside the background capture thread (read it through :func:`captures`)
_CAPTURES = 0
#: graphs captured by :class:`BackgroundCaptures` threads (:func:`background_captures`)
_BACKGROUND = 0
_COUNT_LOCK = threading.Lock()
_ROLE = threading.local()  # ``background`` is True on a BackgroundCaptures worker thread
#: held by every stage build and by each background capture job: one capturer at a time in this process (a
#: device synchronisation during another thread's capture would invalidate it)
CAPTURE_LOCK = threading.RLock()


def cuda_missing(device: torch.device) -> str | None:
    """Why a backend that runs CUDA kernels cannot run on ``device``, or None: the requirement every non-eager
    backend states in its ``why_unavailable_on`` (the registry's question, ``engine.stages``)."""
    if device.type != "cuda":
        return f"needs a CUDA GPU (this engine runs on {device.type})"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch sees none here)"
    return None


def captures() -> int:
    """How many CUDA graphs this process has captured so far outside the background capture thread (all
    runners): at start-up, or on a request's path (which must never happen once the engine serves)."""
    return _CAPTURES


def background_captures() -> int:
    """How many CUDA graphs the background capture thread has captured so far (after ready)."""
    return _BACKGROUND


def all_captures() -> int:
    """Every capture of this process, on any thread (the start-up progress counts these)."""
    return _CAPTURES + _BACKGROUND


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The calling thread's capture stream on ``device``: created once per (thread, device) and reused by every
    :func:`capture` of that thread (the start-up thread and the background capture thread each have their own).

    cuBLAS/cuDNN keep their workspaces and handles per stream, so a fresh stream per graph made every capture
    pay for warm-up runs that only set those up again.  Reusing one stream per thread is safe: a capture waits
    for the caller's current stream before it starts and the caller's stream waits for the capture stream after
    it, so the stream never reorders work against its caller; and one thread never captures two graphs at once,
    so no two captures share the stream concurrently (threads never share one)."""
    streams = getattr(_ROLE, "streams", None)
    if streams is None:
        streams = _ROLE.streams = {}
    key = device.index if device.index is not None else torch.cuda.current_device()
    s = streams.get(key)
    if s is None:
        s = streams[key] = torch.cuda.Stream(torch.device("cuda", key))
    return s


def capture(fn: Callable[[], object], device: torch.device, pool: object, warmup: int = 1) -> tuple[
        "torch.cuda.CUDAGraph", object]:
    """Capture ``fn()`` (which reads and writes only static buffers) as a CUDA graph in ``pool``.

    ``warmup`` eager runs on the thread's capture stream (:func:`capture_stream`) come first; the capture runs on
    that stream too.  One warm-up is the minimum for a shape nobody ran before: a Triton kernel's first call of a
    new specialization compiles (and may autotune, running the kernel many times), which must not happen inside
    a capture; cuBLAS/cuDNN choose their kernels on it too.  ``warmup=0`` only where the caller already ran
    exactly this shape (and its Triton specializations) eagerly.  Returns the graph and what the captured call
    returned (static outputs, valid after each replay)."""
    side = capture_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()  # known, so a failed capture can free it
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(warmup):
            fn()
        if warmup:
            side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with GPU_GATE.exclusive():  # no other thread's GPU work while the stream captures (gpu_gate says why)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException:
                _end_failed_capture(graph, device, pool)
                raise
            try:
                graph.capture_end()
            except BaseException:
                _release_pool(device, pool)
                raise
    torch.cuda.current_stream(device).wait_stream(side)
    count_capture()
    return graph, out


def _end_failed_capture(graph: "torch.cuda.CUDAGraph", device: torch.device, pool: object) -> None:
    """After ``fn`` raised inside a capture: end the capture (it may already be invalid) and release the pool."""
    try:
        graph.capture_end()
        return  # ended cleanly: capture_end released the pool's recording itself
    except Exception:  # noqa: BLE001 - the capture failed already; the first error is the one raised
        pass
    _release_pool(device, pool)


def _release_pool(device: torch.device, pool: object) -> None:
    """torch's ``capture_end`` stops routing allocations into the graph's pool only after the stream capture
    ended well; after a failed one the pool stays "recording" and every later capture into it fails with
    "beginAllocateToPool: already recording to mempool_id" (seen on an H100 and an H200: one failed LLM
    capture took the family's 37 others with it).  End that routing here (``torch.cuda.use_mem_pool``'s own
    call), for the pool id the capture was given: ``graph.pool()`` refuses to answer after a failed capture."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        log.warning("this torch has no _cuda_endAllocateToPool: a failed capture's pool stays unusable")
        return
    try:
        end(device.index if device.index is not None else torch.cuda.current_device(), pool)
    except Exception:  # noqa: BLE001 - nothing to release (already ended)
        log.debug("graph pool already released after a failed capture", exc_info=True)


def prepare_capture_thread(device: torch.device) -> None:
    """Create the calling thread's cuBLAS/cuBLASLt handles and their workspaces on its capture stream, outside
    any capture.  torch keeps BLAS handles per thread and workspaces per (handle, stream), so a new thread's
    first GEMM calls ``cublasCreate``; inside a capture that fails (H200: ``CUBLAS_STATUS_NOT_INITIALIZED``, the
    LLM's background captures, which skip the warm-up because running their step would write live rows)."""
    side = capture_stream(device)
    with torch.cuda.stream(side), torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = torch.ones(16, 16, device=device, dtype=dtype)
            torch.nn.functional.linear(a, a, a[0])
            torch.bmm(a[None], a[None])
    side.synchronize()


def count_capture() -> None:
    """Count one capture for the calling thread's role (:func:`captures` or :func:`background_captures`)."""
    global _CAPTURES, _BACKGROUND
    with _COUNT_LOCK:
        if getattr(_ROLE, "background", False):
            _BACKGROUND += 1
        else:
            _CAPTURES += 1


@dataclass
class CapturedGraph:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]

    def run(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copy ``args`` into the static inputs, replay, return the static outputs (valid until next replay)."""
        for dst, src in zip(self.inputs, args):
            dst.copy_(src)
        self.graph.replay()
        return self.outputs


class GraphCache:
    """Graphs of ``fn(*inputs) -> tuple of outputs`` per key; ``max_graphs`` caps memory (LRU eviction)."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], device: torch.device, max_graphs: int = 64,
                 name: str = "graph"):
        self.fn = fn
        self.device = device
        self.max_graphs = max_graphs
        self.name = name
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[Hashable, CapturedGraph] = OrderedDict()
        self.lock = threading.Lock()
        self.captures = 0
        self.replays = 0
        self.frozen = False  # set after start-up: a missing key is not captured (the caller runs eagerly)

    def freeze(self) -> None:
        """From now on never capture: :meth:`get` answers ``None`` for a key nobody captured."""
        self.frozen = True

    def get(self, key: Hashable, example_inputs: tuple[torch.Tensor, ...]) -> CapturedGraph | None:
        with self.lock:
            g = self.graphs.get(key)
            if g is not None:
                self.graphs.move_to_end(key)
                return g
            if self.frozen:
                return None
            g = self._capture(example_inputs)
            self.graphs[key] = g
            self.captures += 1
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
            return g

    def run(self, key: Hashable, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Replay the graph of ``key`` on ``args``; eagerly (``fn(*args)``) when frozen without one."""
        g = self.get(key, args)
        if g is None:
            with torch.inference_mode():
                out = self.fn(*args)
            return out if isinstance(out, tuple) else (out,)
        self.replays += 1
        return g.run(*args)

    def deferred_job(self, family: str, shape: tuple[Any, ...], key: Hashable,
                     example: Callable[[], tuple[torch.Tensor, ...]], lock: Any = None) -> "DeferredCapture":
        """The background capture of ``key`` although the cache is frozen: captured holding no runner lock (a
        request meanwhile finds no graph and runs eagerly), then published under ``lock`` (the runner's replay
        lock, if it has one) and the cache's own.  ``example`` makes the inputs when the job runs."""
        return DeferredCapture(family, shape, lambda: self._capture(example()), partial(self._publish, key, lock))

    def _publish(self, key: Hashable, lock: Any, g: CapturedGraph) -> None:
        with lock if lock is not None else nullcontext(), self.lock:
            self.graphs.setdefault(key, g)
            self.captures += 1

    def _capture(self, example: tuple[torch.Tensor, ...]) -> CapturedGraph:
        static_in = tuple(t.detach().clone() for t in example)
        # one warm-up: Triton compiles and cuDNN/cuBLAS pick kernels outside the capture; their workspaces already
        # exist on the thread's persistent capture stream after its first graph (see :func:`capture_stream`)
        graph, out = capture(lambda: self.fn(*static_in), self.device, self.pool, warmup=1)
        outs = out if isinstance(out, tuple) else (out,)
        log.debug("%s: captured shapes %s", self.name, [tuple(t.shape) for t in static_in])
        return CapturedGraph(graph, static_in, outs)


@dataclass(frozen=True)
class DeferredCapture:
    """One graph a runner left for after ready: its family and shape (as ``config.graph_plan`` names them),
    ``capture`` (makes the graph; runs holding :data:`CAPTURE_LOCK`) and ``publish`` (hands it to the runner
    under the runner's lock, after :data:`CAPTURE_LOCK` is released: a request thread holding its runner's lock
    never waits for a capture)."""

    family: str
    shape: tuple[Any, ...]
    capture: Callable[[], Any]
    publish: Callable[[Any], None] | None = None


class BackgroundCaptures:
    """Run deferred captures in order in ONE background thread, on its own CUDA stream.

    :meth:`add` queues jobs (a stage build hands over its runners' ``deferred`` lists) and starts the thread if
    it is idle; it exits when the queue is empty.  Each capture runs under :data:`CAPTURE_LOCK`, which stage
    builds hold too, so a background capture never overlaps a start-up capture or its device synchronisations.  A job
    that raises is logged as a warning and skipped (its shape keeps running eagerly): serving never sees the
    error.  ``on_done(seconds, captured, failed)`` is called each time the queue runs dry (one log line too).
    Thread-safe views: :attr:`done`, :attr:`failed`, :attr:`total`, :attr:`finished`, :attr:`seconds`."""

    def __init__(self, device: Any = None, on_done: Callable[[float, int, int], None] | None = None):
        self.device = device
        self.on_done = on_done
        self.done = self.failed = self.total = 0
        self.seconds: float | None = None  # from the first job to the queue running dry (None: not yet)
        self.errors: list[str] = []
        self._queue: list[DeferredCapture] = []
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._stopped = False
        self._t0: float | None = None

    @property
    def finished(self) -> bool:
        """True when every queued job has run (also before any was queued)."""
        return self._idle.is_set()

    def add(self, jobs: Sequence[DeferredCapture]) -> None:
        if not jobs:
            return
        with self._lock:
            if self._stopped:
                return
            self._queue.extend(jobs)
            self.total += len(jobs)
            if not self._idle.is_set():
                return  # the running thread takes them
            self._idle.clear()
            self.seconds = None
            if self._t0 is None:
                self._t0 = time.perf_counter()
        threading.Thread(target=self._run, name="cosyvoice-capture", daemon=True).start()

    def stop(self) -> None:
        """Capture nothing more after the job in progress (engine shutdown)."""
        with self._lock:
            self._stopped = True
            self._queue.clear()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the queue ran dry; True when it has."""
        return self._idle.wait(timeout)

    def _next(self) -> DeferredCapture | None:
        with self._lock:
            if self._queue:
                return self._queue.pop(0)
            self.seconds = time.perf_counter() - (self._t0 or time.perf_counter())
            self._t0 = None
            self._idle.set()
            return None

    def _run(self) -> None:
        _ROLE.background = True
        dev = torch.device(self.device) if self.device is not None else None
        stream = capture_stream(dev) if dev is not None and dev.type == "cuda" else None  # this thread's own
        if stream is not None:
            try:
                with CAPTURE_LOCK:
                    prepare_capture_thread(dev)
            except Exception:  # noqa: BLE001 - the captures below then fail one by one, each logged
                log.warning("could not set up the background capture thread's BLAS handles", exc_info=True)
        while (job := self._next()) is not None:
            try:
                with CAPTURE_LOCK, torch.cuda.stream(stream) if stream is not None else nullcontext():
                    graph = job.capture()
                if job.publish is not None:
                    job.publish(graph)
                self.done += 1
            except Exception as e:  # noqa: BLE001 - a failed capture leaves that shape eager, never more
                self.failed += 1
                msg = f"{job.family} {job.shape}: {type(e).__name__}: {e}"[:300]
                self.errors.append(msg)
                log.warning("background graph capture failed (%s); that shape keeps running eagerly", msg)
        log.info("background graph capture finished: %d/%d graphs in %.1f s%s", self.done, self.total,
                 self.seconds or 0.0, f" ({self.failed} failed: those shapes run eagerly)" if self.failed else "")
        if self.on_done is not None:
            try:
                self.on_done(self.seconds or 0.0, self.done, self.failed)
            except Exception:  # noqa: BLE001
                log.exception("background capture: the completion callback failed")
