"""The ``cudagraph`` flow backend: the CFM estimator replayed as CUDA graphs, one per time-length bucket.

A flow chunk is ~10 Euler steps, each one estimator call on the CFG batch of 2 (conditional row, all-zero
unconditional row).  The estimator is a few hundred small kernels, so eager execution is launch-bound; here
each call is one graph replay.  The encoder (one call per chunk) stays eager.

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
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from ..config import ModelConfig, StreamParams
from ..schedule import ChunkCall, bucket_frames, call_frames, plan
from .base import BackendUnavailable
from .eager import flow_chunk_mel, flow_chunk_mel_batch

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


def schedule_frames(prompt_tokens: int, total_tokens: int, params: StreamParams | None = None,
                    chunk_size: int = 25, token_mel_ratio: int = 2) -> list[tuple[int, bool]]:
    """``(frames, streaming)`` of every estimator input the streamed schedule produces for one segment
    (non-final calls use chunk-causal attention, the final call full attention)."""
    params = params or StreamParams()
    return [(call_frames(c, prompt_tokens, token_mel_ratio), not c.finalize)
            for c in plan(prompt_tokens, total_tokens, params, chunk_size)]


# ------------------------------------------------------------------------------------------ the chunk call


def pad_estimator_inputs(x: Tensor, mask: Tensor, mu: Tensor, cond: Tensor, frames: int
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Zero-pad the time axis of ``x``, ``mask``, ``mu``, ``cond`` on the right to ``frames``."""
    pad = frames - x.shape[-1]
    if pad < 0:
        raise ValueError(f"cannot pad {x.shape[-1]} frames down to {frames}")
    f = torch.nn.functional.pad
    return f(x, (0, pad)), f(mask, (0, pad)), f(mu, (0, pad)), f(cond, (0, pad))


# --------------------------------------------------------------------------------------- the graph runner


def why_unavailable(flow: torch.nn.Module) -> str | None:
    """The reason this backend cannot drive ``flow`` here, or None when it can."""
    if not torch.cuda.is_available():
        return "flow backend 'cudagraph' needs a CUDA GPU (torch sees none here); choose 'eager' instead"
    dev = next(flow.parameters()).device
    if dev.type != "cuda":
        return f"flow backend 'cudagraph' needs a CUDA GPU, but the model is on {dev}; choose 'eager' instead"
    return None


class GraphEstimator:
    """Callable with the estimator's signature ``(x, mask, mu, t, spks, cond, streaming) -> velocity`` that
    pads to the length bucket and to the row bucket (:data:`ROW_SIZES`; 2 = one request's CFG pair) and
    replays a captured graph of ``estimator``."""

    def __init__(self, estimator: torch.nn.Module, device: torch.device, granularity: int = 50,
                 max_frames: int = DEFAULT_MAX_FRAMES, max_graphs: int = 128, buckets: Sequence[int] | None = None):
        from .graphs import GraphCache

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
        self.lock = threading.Lock()
        self.eager_calls = 0
        self._last_replay: torch.cuda.Event | None = None

    def _fn(self, streaming: bool):
        est = self.estimator

        def run(x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> tuple[Tensor]:
            return (est(x, mask, mu, t, spks, cond, streaming),)

        return run

    @property
    def captures(self) -> int:
        return sum(c.captures for c in self.caches.values())

    def freeze(self) -> None:
        """Capture nothing more (see :meth:`~.graphs.GraphCache.freeze`)."""
        for c in self.caches.values():
            c.freeze()

    @property
    def replays(self) -> int:
        return sum(c.replays for c in self.caches.values())

    def row_frames_budget(self) -> int:
        """``rows · bucket²`` of the largest graph (2 rows at ``max_frames``): batched calls stay within it."""
        return 2 * self.max_frames ** 2

    def _fits(self, rows: int, bucket: int) -> bool:
        return bucket <= self.max_frames and rows * bucket ** 2 <= self.row_frames_budget()

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
            self.caches[bool(streaming)].get((bucket, prows, dtype), self._example(bucket, dtype, prows))
        return bucket

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                 streaming: bool = False) -> Tensor:
        frames, rows = x.shape[-1], x.shape[0]
        bucket = self.bucket(frames)
        prows = bucket_rows(rows)
        if (prows is None or not self._fits(prows, bucket) or x.device.type != self.device.type
                or (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            self.eager_calls += 1
            with torch.inference_mode():
                return self.estimator(x, mask, mu, t, spks, cond, streaming)
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
            on_gpu = x.device.type == "cuda"
            if on_gpu and self._last_replay is not None:
                # static buffers are shared: a replay enqueued by another thread/stream must finish first
                torch.cuda.current_stream(x.device).wait_event(self._last_replay)
            xs, ms, mus, ts, ss, cs = g.inputs
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
            if on_gpu:
                self._last_replay = torch.cuda.Event()
                self._last_replay.record(torch.cuda.current_stream(x.device))
            return out


class GraphEncoder:
    """``flow.encode`` replayed as a CUDA graph per exact input shape (prompt tokens, tokens, dtype) and flags.

    The encoder is ~12 ms of launch-bound eager work per chunk at full size.  Its convolutions look ahead and
    its attention is chunked by absolute position, so padding to a bucket would need its own proof; exact
    shapes need none, and the streaming schedule repeats them: for one prompt length every request's chunks
    have the same lengths, so after the first request (or a warm-up) every encoder call is a replay.  A new
    shape costs one capture (a few eager runs).  If a capture ever fails, the encoder runs eagerly from then on
    (logged once), so correctness never depends on it.
    """

    def __init__(self, flow: torch.nn.Module, device: torch.device, max_graphs: int = 64):
        self.flow = flow
        self.device = device
        self.max_graphs = max_graphs
        self.caches: dict[tuple[bool, bool, int | None], Any] = {}
        self.disabled: str | None = None
        self.eager_calls = 0  # one-call passes that could not replay a graph
        self.batched_calls = 0  # calls over several equal-shaped rows (replayed row by row, see __call__)

    def _cache(self, flags: tuple[bool, bool, int | None]) -> Any:
        from .graphs import GraphCache

        cache = self.caches.get(flags)
        if cache is None:
            streaming, finalize, n_lookahead = flags
            flow = self.flow

            def run(tokens: Tensor, tlen: Tensor, ptok: Tensor, plen: Tensor, emb: Tensor) -> tuple[Tensor, ...]:
                enc = flow.encode(tokens, tlen, ptok, plen, emb, streaming=streaming, finalize=finalize,
                                  n_lookahead=n_lookahead)
                return enc.mu, enc.spks

            cache = self.caches[flags] = GraphCache(run, self.device, self.max_graphs, "flow-encoder")
        return cache

    def __call__(self, tokens: Tensor, tlen: Tensor, ptok: Tensor, plen: Tensor, emb: Tensor, *,
                 streaming: bool, finalize: bool, n_lookahead: int | None) -> Any:
        from ..models.flow import FlowEncoding

        if tokens.shape[0] > 1:
            # Several equal-shaped calls: replayed row by row on the exact-shape graphs.  A graph per row count
            # would make new shapes while serving (which calls meet depends on timing), and an eager batched pass
            # leaves a shape without its graph for when it comes alone.
            self.batched_calls += 1
            rows = [self(tokens[i:i + 1], tlen[i:i + 1], ptok[i:i + 1], plen[i:i + 1], emb[i:i + 1],
                         streaming=streaming, finalize=finalize, n_lookahead=n_lookahead)
                    for i in range(tokens.shape[0])]
            return FlowEncoding(torch.cat([r.mu for r in rows]), torch.cat([r.spks for r in rows]))
        if self.disabled is not None or tokens.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            self.eager_calls += 1
            return self.flow.encode(tokens, tlen, ptok, plen, emb, streaming=streaming, finalize=finalize,
                                    n_lookahead=n_lookahead)
        cache = self._cache((bool(streaming), bool(finalize), n_lookahead))
        key = (tokens.shape[1], ptok.shape[1], emb.dtype)
        try:
            mu, spks = cache.run(key, tokens, tlen, ptok, plen, emb)
        except RuntimeError as e:  # e.g. an op that cannot be captured: stay correct, lose the speed-up
            self.disabled = f"{type(e).__name__}: {e}"
            log.warning("flow encoder capture failed, running it eagerly from now on: %s", self.disabled)
            torch.cuda.synchronize(self.device)
            return self.__call__(tokens, tlen, ptok, plen, emb, streaming=streaming, finalize=finalize,
                                 n_lookahead=n_lookahead)
        # outputs live in the graph pool, which other shapes' graphs reuse: copy before the next replay
        return FlowEncoding(mu.clone(), spks.clone())


class CudaGraphFlow:
    """Flow stage: graph-replayed encoder (exact shapes) and estimator (length buckets; see the module
    docstring for the bucket policy)."""

    max_batch = ROW_SIZES[-1] // 2  # requests per batched solve (2 CFG rows each)

    def __init__(self, flow: torch.nn.Module, config: ModelConfig, granularity: int | None = None,
                 max_frames: int = DEFAULT_MAX_FRAMES, max_graphs: int = 128, incremental: bool = True,
                 state_frames: int | None = None, buckets: Sequence[int] | None = None,
                 rows: Sequence[int] | None = None, capture_at_start: bool = False, progress: bool = True,
                 estimator: Callable[[torch.nn.Module], torch.nn.Module] | None = None):
        """``buckets`` / ``rows`` (``EngineConfig.flow_buckets`` / ``flow_rows``): the estimator lengths and
        requests per solve to serve from graphs; with ``capture_at_start`` every one of them (both attention
        modes) and every incremental shape is captured here and nothing is captured later (uncaptured shapes
        run eagerly; the exact-shape encoder graphs still capture on a new length).  ``estimator`` maps the
        model's estimator (projections already fused) to the module the graphs capture instead of it (the
        ``fused`` backend's kernels)."""
        reason = why_unavailable(flow)
        if reason is not None:
            raise BackendUnavailable(reason)
        self.flow = flow
        self.config = config
        est = flow.decoder.estimator
        est.fuse_projections()  # q/k/v as one GEMM per attention block: same values, fewer kernels per step
        gran = granularity or est.cfg.static_chunk_size or 50
        self.estimator = GraphEstimator(estimator(est) if estimator else est, next(flow.parameters()).device, gran,
                                        max_frames, max_graphs, buckets)
        self.encoder = GraphEncoder(flow, next(flow.parameters()).device)
        if rows:
            self.max_batch = min(max(rows), ROW_SIZES[-1] // 2)
        self.incremental = None
        if incremental:
            from .cudagraph_incremental import DEFAULT_STATE_FRAMES, GraphIncrementalFlow

            self.incremental = GraphIncrementalFlow(flow, self, config, max_frames=state_frames or DEFAULT_STATE_FRAMES)
        if capture_at_start:
            self.capture_all(rows or (1,), progress)

    def capture_all(self, rows: Sequence[int], progress: bool = True) -> int:
        """Capture every (bucket x rows x attention mode) estimator graph and every incremental shape, then
        freeze both: from here on a shape nobody captured runs eagerly.  Returns the graphs captured."""
        from tqdm.auto import tqdm

        dtype = next(self.flow.parameters()).dtype
        lengths = self.estimator.buckets or tuple(range(self.estimator.granularity, self.estimator.max_frames + 1,
                                                        self.estimator.granularity))
        row_buckets = sorted({bucket_rows(2 * r) or ROW_SIZES[-1] for r in rows})
        jobs = [(f, s, r) for f in lengths for s in (True, False) for r in row_buckets if self.estimator._fits(r, f)]
        self.estimator.caches[True].max_graphs = self.estimator.caches[False].max_graphs = max(
            self.estimator.caches[True].max_graphs, len(jobs))
        for f, s, r in tqdm(jobs, desc="capturing flow graphs", unit="graph", disable=not progress, leave=False):
            self.estimator.capture(f, s, dtype, r)
        self.estimator.freeze()
        n = len(jobs)
        if self.incremental is not None:
            n += self.incremental.graphs.capture_all(progress=progress)
        return n

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
