"""The ``cudagraph`` flow backend: the CFM estimator replayed as CUDA graphs, one per time-length bucket.

A flow chunk is ~10 Euler steps, each one estimator call on the CFG batch of 2 (conditional row, all-zero
unconditional row).  The estimator is a few hundred small kernels, so eager execution is launch-bound; here
each Euler step is one graph replay, and the step graph also mixes the CFG rows and advances the state
(:mod:`~cosyvoice_fast.flow.graph_solve`), so a solve is its steps' replays back to back.  The encoder
(one call per chunk, or one per group of requests' chunks) replays graphs over padded token buckets
(:mod:`~cosyvoice_fast.flow.graph_encoder`).

Bucket policy
-------------
The estimator sees ``T = token_mel_ratio · (prompt tokens + encoded tokens)`` frames.  ``T`` is rounded *up*
to a multiple of the estimator's attention chunk (``DecoderConfig.static_chunk_size``, 50 frames = 1 s), the
tail zero-padded and masked out.  With upstream's schedule (the first hop padded so that prompt + hop ends on a
25-token boundary, then hops of 50 and 100 tokens) every non-final streaming call already has ``T`` on a
multiple of 50, so it runs with no padding at all; only the final call of each segment pays up to 49 padded
frames.  Buckets run up to ``max_frames`` (default 3000 = 60 s, i.e. ≤ 60 buckets per attention mode); longer
inputs run the eager estimator (counted in :attr:`GraphEstimator.eager_calls`).  Graphs are keyed by
(bucket, dtype) separately for chunk-causal (streaming) and full attention, captured on first use (or ahead
of time with :meth:`CudaGraphFlow.warmup`) and LRU-capped by ``max_graphs`` per mode.

Batched solves (:meth:`CudaGraphFlow.solve`): B requests' chunks share one guided Euler solve, so each
estimator call has 2B rows (B conditional, B unconditional).  Graphs are keyed by (bucket, rows, dtype) with
the rows padded up to :data:`ROW_SIZES` (2, 4, 8, 16, 32) by all-zero rows whose mask is 0 (their output is
zero and, rows being independent, they touch no real row).  A solve is capped at 16 requests and at the
attention memory of the largest single call (``rows · bucket² <= 2 · max_frames²``); bigger batches are split.

Why padding is exact: every time-mixing op of the estimator looks only left (causal convolutions, per-frame
LayerNorm, 1x1 convs) or is masked (attention keys must be valid frames; chunk-causal limits depend only on
the absolute position), and each block multiplies its input by the mask, so zero-mask frames appended on the
right never reach a real frame.  ``tests/test_flow_backends.py`` checks padded == unpadded on CPU.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.schedule import ChunkCall, bucket_frames, schedule_frames
from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.kernels.graphs import cuda_missing
from cosyvoice_fast.flow.eager import flow_chunk_mel, flow_chunk_mel_batch
from cosyvoice_fast.flow.graph_encoder import ENCODER_ROWS, GraphEncoder

if TYPE_CHECKING:
    from cosyvoice_fast.flow.graph_incremental import GraphIncrementalFlow

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAMES = 3000  # 60 s of mel at 50 Hz; longer estimator inputs run eagerly
#: Captured batch-row counts.  One request is the CFG pair (2 rows); a batched solve of B requests has 2B rows,
#: padded up to the next size here with all-zero, mask-0 rows so that few graphs exist.
ROW_SIZES = (2, 4, 8, 16, 32)


# --------------------------------------------------------------------------------------------- shape policy


def bucket_rows(rows: int, sizes: Sequence[int] = ROW_SIZES) -> int | None:
    """The captured batch-row count serving ``rows`` estimator rows (the smallest size >= rows), or None when
    ``rows`` exceeds the largest size."""
    if rows < 1:
        raise ValueError(f"an estimator call needs at least one row, got {rows}")
    return next((r for r in sorted(sizes) if r >= rows), None)


# --------------------------------------------------------------------------------------- the graph runner


def why_unavailable_on(device: torch.device, engines_dir: Path | None = None) -> str | None:
    """Why this backend cannot run on ``device`` (the availability registry asks), or None when it can."""
    return cuda_missing(device)


def why_unavailable(flow: torch.nn.Module) -> str | None:
    """The reason this backend cannot drive ``flow`` here, or None when it can."""
    reason = why_unavailable_on(next(flow.parameters()).device)
    return None if reason is None else f"flow backend 'cudagraph' {reason}; choose 'eager' instead"


class GraphEstimator:
    """Callable with the estimator's signature ``(x, mask, mu, t, spks, cond, streaming) -> velocity`` that
    pads to the length bucket and to the row bucket (:data:`ROW_SIZES`; 2 = one request's CFG pair) and
    replays a captured graph of ``estimator``; with ``solver`` it also runs whole guided solves as replays of
    one step graph per bucket (:meth:`solve`, :mod:`~cosyvoice_fast.flow.graph_solve`), which are then the
    graphs captured at start-up.  A replay always covers its whole bucket: padded rows and frames are zeroed
    and masked."""

    def __init__(self, estimator: torch.nn.Module, device: torch.device, granularity: int = 50,
                 max_frames: int = DEFAULT_MAX_FRAMES, max_graphs: int = 128, buckets: Sequence[int] | None = None,
                 solver: tuple[float, int] | None = None):
        from cosyvoice_fast.flow.graph_solve import StepGraphs
        from cosyvoice_fast.kernels.graphs import GraphCache

        self.estimator = estimator
        self.device = device
        self.granularity = granularity
        #: configured lengths (``EngineConfig.flow_buckets``): a call pads up to the next one; None: every
        #: multiple of ``granularity`` up to ``max_frames``
        self.buckets = tuple(sorted(buckets)) if buckets else None
        self.max_frames = max(self.buckets) if self.buckets else max_frames
        self.caches = {
            mode: GraphCache(self._fn(mode), device, max_graphs, f"flow-estimator-{'stream' if mode else 'full'}")
            for mode in (True, False)}
        #: ``solver = (CFG rate, Euler steps)``: whole solves replay one step graph per bucket
        #: (:mod:`~cosyvoice_fast.flow.graph_solve`, :meth:`solve`), captured instead of single forwards
        self.steps = None if solver is None else StepGraphs(self, *solver, max_graphs=max_graphs)
        self.lock = threading.Lock()
        self.eager_calls = 0
        self._last_replay: torch.cuda.Event | None = None

    def _fn(self, streaming: bool):
        est = self.estimator

        def run(x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> tuple[Tensor]:
            return (est(x, mask, mu, t, spks, cond, streaming),)

        return run

    def all_caches(self) -> list:
        """Every graph cache: single forwards per attention mode, then the step graphs' when solves use them."""
        return [*self.caches.values(), *(self.steps.caches.values() if self.steps else ())]

    @property
    def captures(self) -> int:
        return sum(c.captures for c in self.all_caches())

    def freeze(self) -> None:
        """Capture nothing more (see :meth:`~.graphs.GraphCache.freeze`)."""
        for c in self.all_caches():
            c.freeze()

    @property
    def replays(self) -> int:
        """Estimator forwards replayed from graphs (a step graph's replay is one forward)."""
        return sum(c.replays for c in self.all_caches())

    def row_frames_budget(self) -> int:
        """``rows · bucket²`` of the largest graph (2 rows at ``max_frames``): batched calls stay within it."""
        return 2 * self.max_frames ** 2

    def _fits(self, rows: int, bucket: int) -> bool:
        return bucket <= self.max_frames and rows * bucket ** 2 <= self.row_frames_budget()

    def graph_shape(self, frames: int, rows: int) -> tuple[int, int] | None:
        """(length bucket, row bucket) of a call of ``rows`` estimator rows over ``frames`` frames, or None when
        no graph may serve it (more rows than the largest row bucket, or past the graph budget)."""
        bucket, prows = self.bucket(frames), bucket_rows(rows)
        return None if prows is None or not self._fits(prows, bucket) else (bucket, prows)

    def _example(self, frames: int, dtype: torch.dtype, rows: int = 2) -> tuple[Tensor, ...]:
        b, c = rows, self.estimator.cfg.out_channels
        z = torch.zeros(b, c, frames, device=self.device, dtype=dtype)
        return (z, torch.ones(b, 1, frames, device=self.device, dtype=dtype), z.clone(),
                torch.zeros(b, device=self.device, dtype=dtype), torch.zeros(b, c, device=self.device, dtype=dtype),
                z.clone())

    def bucket(self, frames: int) -> int:
        """The captured length serving ``frames`` (may exceed ``max_frames``: then the call runs eagerly)."""
        if self.buckets is not None:
            return next((b for b in self.buckets if b >= frames), bucket_frames(frames, self.granularity))
        return bucket_frames(frames, self.granularity)

    def capture(self, frames: int, streaming: bool, dtype: torch.dtype, rows: int = 2) -> int:
        """Capture (if not yet) the graph serving ``frames`` x ``rows``; returns its bucket length."""
        bucket = self.bucket(frames)
        if bucket > self.max_frames:
            raise ValueError(f"{frames} frames exceed the largest bucket ({self.max_frames}); they run eagerly")
        prows = bucket_rows(rows)
        if prows is None or not self._fits(prows, bucket):
            raise ValueError(f"{rows} rows x {bucket} frames exceed the graph budget; they run eagerly")
        with self.lock:
            if self.steps is not None:  # solves replay step graphs; single forwards are not served by a graph
                self.steps.capture(bucket, prows, dtype, streaming)
            else:
                self.caches[bool(streaming)].get((bucket, prows, dtype), self._example(bucket, dtype, prows))
        return bucket

    def deferred_job(self, frames: int, streaming: bool, dtype: torch.dtype, rows: int = 2) -> Any:
        """:meth:`capture`'s graph as a background job (``kernels.graphs.DeferredCapture``; caches frozen
        meanwhile): captured without the lock, published under it."""
        bucket, prows = self.bucket(frames), bucket_rows(rows)
        if self.steps is not None:
            cache, example = self.steps.caches[bool(streaming)], partial(self.steps._example, bucket, prows, dtype)
        else:
            cache, example = self.caches[bool(streaming)], partial(self._example, bucket, dtype, prows)
        return cache.deferred_job("flow-estimator", (frames, streaming, rows), (bucket, prows, dtype), example,
                                  lock=self.lock)

    def solve(self, x0: Tensor, g: Any, ts: Tensor, dts: Tensor, cfg_rate: float, streaming: bool) -> Tensor | None:
        """A whole guided Euler solve (:meth:`~cosyvoice_fast.flow.model.cfm.CausalCFM.solve_batch` calls it) as
        replays of one step graph, or None when it is not served by one (no ``solver``, another CFG rate or
        step count, a shape past the graph budget, a shape not captured at start-up): the caller then runs its
        step loop over :meth:`__call__`."""
        if (self.steps is None or x0.device.type != self.device.type
                or (x0.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            return None
        with self.lock, torch.inference_mode():
            self._after_last_replay(x0)
            out = self.steps.solve(x0, g, ts, dts, cfg_rate, streaming)
            if out is not None:
                self._mark_replay(x0)
            return out

    def _after_last_replay(self, x: Tensor) -> None:
        """Graphs share their memory pool and static buffers: a replay enqueued by another thread or stream must
        finish before this one starts (caller holds the lock)."""
        if x.device.type == "cuda" and self._last_replay is not None:
            torch.cuda.current_stream(x.device).wait_event(self._last_replay)

    def _mark_replay(self, x: Tensor) -> None:
        if x.device.type == "cuda":
            self._last_replay = torch.cuda.Event()
            self._last_replay.record(torch.cuda.current_stream(x.device))

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                 streaming: bool = False) -> Tensor:
        frames, rows = x.shape[-1], x.shape[0]
        shape = self.graph_shape(frames, rows)
        if (shape is None or x.device.type != self.device.type
                or (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            self.eager_calls += 1
            with torch.inference_mode():
                return self.estimator(x, mask, mu, t, spks, cond, streaming)
        bucket, prows = shape
        cache = self.caches[bool(streaming)]
        key = (bucket, prows, x.dtype)
        with self.lock, torch.inference_mode():
            g = cache.graphs.get(key)
            if g is None:
                g = cache.get(key, self._example(bucket, x.dtype, prows))
            else:
                cache.graphs.move_to_end(key)
            if g is None:  # frozen after start-up and this shape was not captured: eager, never a capture
                self.eager_calls += 1
                return self.estimator(x, mask, mu, t, spks, cond, streaming)
            self._after_last_replay(x)
            xs, ms, mus, ts, ss, cs = g.inputs[:6]
            for dst, src in ((xs, x), (ms, mask), (mus, mu), (cs, cond)):
                dst[:rows, ..., :frames].copy_(src)
                if frames < bucket:
                    dst[:rows, ..., frames:].zero_()  # masked anyway; zeros keep stale values (and NaN*0) out
            ts[:rows].copy_(t.reshape(-1).expand(rows))
            ss[:rows].copy_(spks)
            if rows < prows:  # padding rows: all zero, mask 0 (output 0); stale rows of a bigger batch cleared
                for buf in (xs, ms, mus, ts, ss, cs):
                    buf[rows:].zero_()
            g.graph.replay()
            cache.replays += 1
            out = g.outputs[0][:rows, ..., :frames].clone()
            self._mark_replay(x)
            return out


class CudaGraphFlow:
    """Flow stage: graph-replayed encoder (token buckets) and estimator (frame buckets; see the module
    docstring for the bucket policy)."""

    max_batch = ROW_SIZES[-1] // 2  # requests per batched solve (2 CFG rows each)
    #: FlowStage: the incremental runner streaming chunks use (set per instance; None: every chunk recomputes)
    incremental: "GraphIncrementalFlow | None" = None
    #: what a streamed segment of a voice with no prompt state does (``IncrementalFlow``'s ``new_voices``)
    new_voices = "incremental"

    def __init__(self, flow: torch.nn.Module, config: ModelConfig, granularity: int | None = None,
                 max_frames: int = DEFAULT_MAX_FRAMES, max_graphs: int = 128, incremental: bool = True,
                 state_frames: int | None = None, buckets: Sequence[int] | None = None,
                 rows: Sequence[int] | None = None, capture_at_start: bool = False, progress: bool = True,
                 estimator: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                 encoder: Callable[[torch.nn.Module], Callable[..., Any]] | None = None,
                 defer_capture: bool = False):
        """``buckets`` / ``rows`` (``EngineConfig.flow_buckets`` / ``flow_rows``): the estimator lengths and
        requests per solve to serve from graphs; with ``capture_at_start`` every one of them (both attention
        modes), every encoder bucket and every incremental shape is captured here and nothing is captured later
        (uncaptured shapes run eagerly).  ``estimator`` maps the
        model's estimator (projections already fused) to the module the graphs capture instead of it (the
        ``fused`` backend's kernels); ``encoder`` maps the flow model to the padded-encode
        function its encoder graphs capture (:class:`GraphEncoder`'s ``encode``; default the model's own).
        ``defer_capture``: capture only what first chunks need here; the full-attention graphs (final chunks)
        are left in :attr:`deferred` for the engine's background capture thread."""
        reason = why_unavailable(flow)
        if reason is not None:
            raise BackendUnavailable(reason)
        self.flow = flow
        self.config = config
        est = flow.decoder.estimator
        est.fuse_projections()  # q/k/v as one GEMM per attention block: same values, fewer kernels per step
        gran = granularity or est.cfg.static_chunk_size or 50
        cfm = flow.cfg.cfm
        self.estimator = GraphEstimator(estimator(est) if estimator else est, next(flow.parameters()).device, gran,
                                        max_frames, max_graphs, buckets,
                                        solver=(cfm.inference_cfg_rate, cfm.n_timesteps))
        if rows:
            self.max_batch = min(max(rows), ROW_SIZES[-1] // 2)
        self.encoder = GraphEncoder(flow, next(flow.parameters()).device, buckets,
                                    rows=tuple(r for r in ENCODER_ROWS if r <= self.max_batch) or (1,),
                                    max_tokens=max_frames // flow.cfg.token_mel_ratio,
                                    encode=encoder(flow) if encoder else None)
        self.incremental = None
        if incremental:
            from cosyvoice_fast.flow.graph_incremental import DEFAULT_STATE_FRAMES, GraphIncrementalFlow

            # the captured estimator's own window maths when it has them (the fused kernels), else the eager ones
            window = getattr(self.estimator.estimator, "forward_window", None)
            self.incremental = GraphIncrementalFlow(flow, self, config, max_frames=state_frames or DEFAULT_STATE_FRAMES,
                                                    estimator=window, new_voices=self.new_voices)
        #: captures left for after ready (``kernels.graphs.DeferredCapture``; empty unless ``defer_capture``)
        self.deferred: list = []
        if capture_at_start:
            self.capture_all(rows or (1,), progress, defer=defer_capture)

    def capture_all(self, rows: Sequence[int], progress: bool = True, defer: bool = False) -> int:
        """Capture every incremental shape, encoder graph and (bucket x rows x attention mode) estimator graph,
        then freeze them: from here on a shape nobody captured runs eagerly.  Returns the graphs captured now;
        with ``defer`` the full-attention ones (final chunks) become :attr:`deferred` jobs instead
        (:func:`~cosyvoice_fast.flow.graph_capture.capture_flow`)."""
        from cosyvoice_fast.flow.graph_capture import capture_flow

        return capture_flow(self, rows, progress, defer)

    def recompute(self, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool = True) -> Tensor:
        """Upstream's full per-chunk recompute, graph-replayed."""
        return flow_chunk_mel(self.flow, inputs, tokens, call, stream, self.estimator, self.encoder)

    def chunk(self, seg: Any, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool = True) -> Tensor:
        """One flow call: streaming chunks of a segment run incrementally (their state in ``seg.flow_state``)
        when ``incremental`` is on, everything else is :meth:`recompute`."""
        if self.incremental is not None and seg is not None:
            return self.incremental.chunk(seg, inputs, tokens, call, stream)
        return self.recompute(inputs, tokens, call, stream)

    def solve_cost(self, n_items: int, frames: int) -> float:
        """``rows · bucket²`` of a solve of ``n_items`` requests whose longest input has ``frames`` frames."""
        rows = bucket_rows(2 * n_items) or 2 * n_items
        return rows * self.estimator.bucket(frames) ** 2

    def solve(self, items: Sequence[Any], stream: bool = True) -> list[Tensor]:
        """Several requests' chunks (first or later, any mix of requests): a segment that already streams
        incrementally (its state lives in the buffers or a saved copy) continues alone on that path; every
        other chunk joins one graph-replayed full-recompute solve per attention mode (split to stay within
        :data:`ROW_SIZES` and the memory budget), which is exact.  One mel per item, in order."""
        if len(items) == 1:
            return [self.chunk(*items[0], stream=stream)]
        out: list[Tensor | None] = [None] * len(items)
        shared = []
        for i, (seg, inputs, tokens, call) in enumerate(items):
            live = self.incremental is not None and seg is not None and not isinstance(seg.flow_state, (str, type(None)))
            if live and stream and not call.finalize:
                out[i] = self.incremental.chunk(seg, inputs, tokens, call, stream)
            else:
                if seg is not None:  # a recomputed segment keeps no incremental state (exact: recompute is)
                    seg.flow_state = None if call.finalize else "full"
                    seg.flow_info = None
                shared.append(i)
        mels = flow_chunk_mel_batch(self.flow, [items[i] for i in shared], stream, self.estimator,
                                    max_items=self.max_batch, cost=self.solve_cost,
                                    budget=self.estimator.row_frames_budget(), encode=self.encoder)
        for i, mel in zip(shared, mels):
            out[i] = mel
        return out  # type: ignore[return-value]

    def warmup(self, prompt_tokens: Iterable[int] = (0, 25, 50, 75, 100), total_tokens: int = 300,
               params: StreamParams | None = None, extra: Sequence[tuple[int, bool]] = (),
               batch_sizes: Sequence[int] = (1,)) -> list[tuple[int, bool]]:
        """Capture ahead of time the buckets the streamed schedule uses for these prompt lengths (plus
        ``extra`` ``(frames, streaming)`` pairs), for batched solves of each of ``batch_sizes`` requests (the
        row bucket of ``2 * size`` rows); returns the ``(bucket, streaming)`` pairs captured."""
        dtype = next(self.flow.parameters()).dtype
        want: set[tuple[int, bool]] = set()
        for p in prompt_tokens:
            for frames, streaming in schedule_frames(p, total_tokens, params, self.config.chunk_size,
                                                     self.flow.cfg.token_mel_ratio):
                want.add((bucket_frames(frames, self.estimator.granularity), streaming))
        want.update((bucket_frames(f, self.estimator.granularity), s) for f, s in extra)
        done = []
        rows = sorted({bucket_rows(2 * b) or ROW_SIZES[-1] for b in batch_sizes})
        for frames, streaming in sorted(want):
            if frames <= self.estimator.max_frames:
                for r in rows:
                    if self.estimator._fits(r, frames):
                        self.estimator.capture(frames, streaming, dtype, r)
                done.append((frames, streaming))
        return done
