"""The incremental flow with its estimator solve replayed as CUDA graphs over fixed-size state buffers.

Eager incremental execution (:class:`~cosyvoice_fast.flow.incremental.IncrementalFlow`) computes only each
chunk's new frames, but on a GPU it is launch-bound: ten Euler steps of a few hundred small kernels each,
plus the bookkeeping of growing key/value lists.  Here the whole guided solve of one chunk (all Euler steps,
CFG pair) is one graph replay.  A graph bakes in its memory addresses, so the state cannot be a per-request
list of tensors; instead the runner owns one set of buffers of fixed capacity:

* ``kv`` (S, A, 2, 2, H, max_frames, d): for every Euler step S and attention layer A, keys and values of the
  CFG pair at absolute estimator frame positions (prompt frames first).  A call writes its frames' keys and
  values at ``[start, start + n)`` (``index_copy_`` with a position tensor, a graph input) and attends over the
  first ``C`` positions under an additive mask (also an input) that hides unwritten positions and later chunks.
* ``ctx``: per causal conv, the (S, 2, C_in, kernel - 1) left columns, read and rewritten in place.

One graph per (frames bucket ``n``, key capacity bucket ``C``) serves every call of that shape for every
request: positions, mask and commit point are data, not shapes.  The buffers hold one request's state at a
time ("resident").  A segment starts incrementally only when no other live segment is resident, and otherwise
recomputes its chunks (exact, upstream's scheme): swapping states would cost a copy of every committed frame
per chunk plus a saved copy per waiting stream, which measured slower than recomputing at 16 streams.  When the
buffers change hands the resident state is saved (a copy of its ``[0, n_frames)`` keys/values) unless its
request is gone.  Prompt states (the committed prompt frames of a voice) are saved copies, loaded when a
request of that voice starts: ~2.3 MB per frame at full size in bf16, a ~0.3 ms copy for a 3 s prompt instead
of recomputing it.

Why this is not faster for the first chunk: each Euler step of the estimator is a chain of ~1000 small
kernels whose cost barely depends on the frame count at these sizes (measured 3.5 ms per step for 50 frames
and for 200), so computing only the new frames removes work, not latency; it pays off as the prefix grows
(flat per-chunk cost instead of a growing one).

Exactness: the maths is :func:`~cosyvoice_fast.flow.model.incremental.estimator_increment` with a
:class:`~cosyvoice_fast.flow.model.incremental.StaticWindow`; padded query frames sit after every real frame
(causal convs never read rightwards; masked as keys), so a padded call equals the unpadded one.  On CPU the
same runner executes eagerly (no capture), which is how ``tests/test_incremental_graphs.py`` checks it
against upstream's full recompute.

Capacity: a segment whose frames would exceed ``max_frames`` (default 1500 = 30 s of mel including the
prompt) raises :class:`~cosyvoice_fast.flow.incremental_state.StateCapacityError`, and that segment continues on
the full-recompute path (exact, slower); the text frontend splits long texts into sentences well below that.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from cosyvoice_fast.flow.model.cfm import NOISE_FRAMES, euler_schedule
from cosyvoice_fast.config.graph_plan import INCREMENTAL_CAPACITY, INCREMENTAL_FRAMES, incremental_bucket, \
    incremental_shapes
from cosyvoice_fast.config.schedule import ChunkCall
from cosyvoice_fast.flow.incremental import IncrementalFlow
from cosyvoice_fast.flow.incremental_state import StateCapacityError
from cosyvoice_fast.flow.model.incremental import (
    StaticDecoderCache, StaticWindow, check_estimator, estimator_layout, guided_solve, static_mask,
)
from cosyvoice_fast.flow.model.incremental_encoder import EncoderCache, encoder_commit_point
from cosyvoice_fast.kernels.graphs import capture

log = logging.getLogger(__name__)

DEFAULT_STATE_FRAMES = 1500  # 30 s of 50 Hz mel (prompt included) per segment in the fixed-size buffers


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph, or None on CPU (the function then runs eagerly)
    inputs: dict[str, Any]
    output: Tensor | None


class IncrementalEstimatorGraphs:
    """The estimator half of an incremental flow call (``decode`` of
    :func:`~cosyvoice_fast.flow.incremental_state.run_increment`) over fixed-size buffers, replayed as graphs.

    ``capture=False`` (always on CPU) runs the same function eagerly on the same buffers.
    """

    def __init__(self, flow: nn.Module, max_frames: int = DEFAULT_STATE_FRAMES,
                 frame_buckets: tuple[int, ...] = INCREMENTAL_FRAMES,
                 capacity_buckets: tuple[int, ...] = INCREMENTAL_CAPACITY, max_graphs: int = 48,
                 capture: bool | None = None,
                 estimator: Callable[..., Tensor] | None = None):
        """``estimator``: computes one Euler step on a window (``guided_solve``'s argument; default the eager
        maths, the ``fused`` backend passes :meth:`~cosyvoice_fast.flow.kernels.estimator_fused.FusedEstimator.
        forward_window`)."""
        est = flow.decoder.estimator
        check_estimator(est)
        p = next(flow.parameters())
        self.flow = flow
        self.estimator = estimator
        self.device, self.dtype = p.device, p.dtype
        self.capture = (p.device.type == "cuda") if capture is None else capture
        self.chunk = est.cfg.static_chunk_size
        #: new-frame and key-capacity buckets (``config.graph_plan``): a handful of graphs serve every call
        self.frame_buckets, self.capacity_buckets = tuple(frame_buckets), tuple(capacity_buckets)
        self.max_frames = min(max_frames, NOISE_FRAMES)
        self.max_graphs = max_graphs
        self.steps = flow.decoder.cfg.n_timesteps
        self.schedule = euler_schedule(self.steps, flow.decoder.cfg.t_scheduler, self.device, self.dtype)
        # the fused estimator's time projections of every Euler step, made once: its windows skip three GEMMs
        owner = getattr(estimator, "__self__", None)
        self.time_table = (owner.time_table(self.schedule[0], 2) if callable(getattr(owner, "time_table", None))
                           else None)
        layout = estimator_layout(flow)
        heads = {(h, d) for kind, h, d in layout if kind == "kv"}
        if len(heads) != 1:
            raise ValueError(f"estimator attention layers differ in shape ({sorted(heads)}); not supported")
        (h, d), = heads
        n_attn = sum(1 for kind, *_ in layout if kind == "kv")
        self.convs = [(c, left) for kind, c, left in layout if kind == "conv"]
        self.kv = torch.zeros(self.steps, n_attn, 2, 2, h, self.max_frames, d, device=self.device, dtype=self.dtype)
        self.ctx = [torch.zeros(self.steps, 2, c, left, device=self.device, dtype=self.dtype)
                    for c, left in self.convs]
        self.frame_bytes = self.kv[..., :1, :].numel() * self.kv.element_size()
        self.graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.lock = threading.RLock()
        self._resident: weakref.ref | None = None
        self.frozen = False  # after capture_all: shapes not captured run eagerly, nothing is captured
        self.captures = self.replays = self.saves = self.loads = self.eager_calls = 0
        log.info("incremental flow buffers: %.2f GiB for %d frames (%.2f MB per frame)",
                 self.nbytes() / 2 ** 30, self.max_frames, self.frame_bytes / 1e6)

    def nbytes(self) -> int:
        return (self.kv.numel() * self.kv.element_size()
                + sum(c.numel() * c.element_size() for c in self.ctx))

    # ------------------------------------------------------------------------------------- residency
    def resident(self) -> StaticDecoderCache | None:
        return None if self._resident is None else self._resident()

    def save(self, cache: StaticDecoderCache) -> None:
        """Give ``cache`` its own copy of its state if it lives only in the buffers (no-op otherwise)."""
        if not isinstance(cache, StaticDecoderCache) or cache.kv is not None:
            return
        with self.lock:
            if self.resident() is not cache:
                raise RuntimeError("flow state was lost: it is neither saved nor resident")
            cache.kv = self.kv[..., :cache.n_frames, :].clone()
            cache.ctx = [c.clone() for c in self.ctx]
            self.saves += 1

    def _evict(self) -> None:
        """Free the buffers for other use: the resident state is saved first if its request is still alive."""
        cur = self.resident()
        if cur is not None and cur.kv is None:
            self.save(cur)
        self._resident = None

    def _load(self, cache: StaticDecoderCache) -> None:
        if self.resident() is cache:
            return
        self._evict()
        if cache.n_frames:
            if cache.kv is None or cache.ctx is None:
                raise RuntimeError("flow state was lost: it is neither saved nor resident")
            self.kv[..., :cache.n_frames, :].copy_(cache.kv)
        if cache.ctx is None:
            for c in self.ctx:
                c.zero_()
        else:
            torch._foreach_copy_(self.ctx, [c.to(self.dtype) for c in cache.ctx])
        self.loads += 1

    # ---------------------------------------------------------------------------------------- graphs
    def _new_inputs(self, n: int, cap: int) -> dict[str, Any]:
        dev, dt = self.device, self.dtype
        c = self.flow.decoder.estimator.cfg.out_channels
        return {"x0": torch.zeros(1, c, n, device=dev, dtype=dt), "mu": torch.zeros(1, c, n, device=dev, dtype=dt),
                "cond": torch.zeros(1, c, n, device=dev, dtype=dt), "spks": torch.zeros(1, c, device=dev, dtype=dt),
                "mask": static_mask(0, n, n, cap, self.chunk, dev, dt),
                "pos": torch.arange(n, device=dev), "valid": torch.full((1,), n, device=dev),
                "ctx_index": {left: torch.arange(left, device=dev) for left in sorted({lt for _, lt in self.convs})}}

    def _solve(self, inp: dict[str, Any], cap: int) -> Tensor:
        table = self.time_table
        windows = [StaticWindow(self.kv[i, ..., :cap, :], [c[i] for c in self.ctx], inp["pos"], inp["ctx_index"],
                                inp["mask"], inp["valid"], None if table is None else table[i])
                   for i in range(self.steps)]
        return guided_solve(self.flow, inp["x0"], inp["mu"], inp["spks"], inp["cond"], windows, self.schedule,
                            self.estimator)

    def _graph(self, n: int, cap: int) -> _Graph | None:
        """The graph of shape (``n`` frames, ``cap`` key positions): captured now unless :attr:`frozen`
        (then ``None`` when missing: the call runs the same maths eagerly on the same buffers)."""
        key = (n, cap)
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            return g
        inp = self._new_inputs(n, cap)
        if not self.capture:
            g = _Graph(None, inp, None)
        elif self.frozen:
            return None
        else:
            self._evict()  # warm-up and capture write into the buffers
            graph, out = capture(lambda: self._solve(inp, cap), self.device, self.pool, warmup=1)
            g = _Graph(graph, inp, out)
            self.captures += 1
            log.debug("captured incremental flow graph: %d frames, %d key positions", n, cap)
        self.graphs[key] = g
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return g

    def shapes(self, max_solve_frames: int) -> list[tuple[int, int]]:
        """Every (frames bucket, key capacity) a call of at most ``max_solve_frames`` new frames can use."""
        return incremental_shapes(self.max_frames, max_solve_frames, self.frame_buckets, self.capacity_buckets)

    def capture_all(self, max_solve_frames: int = 400, progress: bool = False) -> int:
        """Capture every shape of :meth:`shapes` now (start-up), then freeze: a call of more new frames (a
        first chunk whose voice has no prompt state and a long prompt) runs eagerly instead of capturing."""
        from tqdm.auto import tqdm

        shapes = self.shapes(max_solve_frames)
        self.max_graphs = max(self.max_graphs, len(shapes))
        with self.lock:
            for nb, cap in tqdm(shapes, desc="capturing incremental flow graphs", unit="graph",
                                disable=not progress, leave=False):
                self._graph(nb, cap)
        self.frozen = True
        return len(shapes)

    # ----------------------------------------------------------------------------------------- decode
    def __call__(self, flow: nn.Module, mu: Tensor, spks: Tensor, cond: Tensor, x0: Tensor, cache: Any,
                 commit_end: int) -> tuple[Tensor, StaticDecoderCache]:
        """Guided Euler solve on frames ``[cache.n_frames, cache.n_frames + n)`` (see
        :func:`~cosyvoice_fast.flow.model.incremental.decode_increment`)."""
        if not isinstance(cache, StaticDecoderCache):
            if cache.n_frames:
                raise ValueError("flow state has the list layout of the eager incremental flow; recompute it")
            cache = StaticDecoderCache(frame_bytes=self.frame_bytes)
        start, n = cache.n_frames, mu.shape[2]
        if n == 0:
            return x0.float(), cache
        new_start = max(start, (min(commit_end, start + n) // self.chunk) * self.chunk)
        if start + n > self.max_frames:
            raise StateCapacityError(f"{start + n} frames > the {self.max_frames} the buffers hold")
        # past the last frame bucket: the exact length (like a shape near the buffers' end: eager when frozen)
        nb, cap = incremental_bucket(n, start, self.max_frames, self.frame_buckets, self.capacity_buckets) or (
            n, self.max_frames)
        dev = self.device
        with self.lock, torch.inference_mode():
            g = self._graph(nb, cap) or _Graph(None, self._new_inputs(nb, cap), None)
            self._load(cache)
            inp = g.inputs
            for name, src in (("x0", x0), ("mu", mu), ("cond", cond)):
                inp[name][..., :n].copy_(src)
                inp[name][..., n:].zero_()
            inp["spks"].copy_(spks)
            inp["mask"].copy_(static_mask(start, n, nb, cap, self.chunk, dev, self.dtype))
            inp["pos"].copy_(torch.arange(start, start + nb, device=dev))
            inp["valid"].fill_(n)
            for left, idx in inp["ctx_index"].items():
                idx.copy_(torch.arange(new_start - start, new_start - start + left, device=dev))
            try:
                if g.graph is None:
                    out = self._solve(inp, cap)
                    if self.capture:  # a shape start-up did not capture
                        self.eager_calls += 1
                else:
                    g.graph.replay()
                    out = g.output
                    self.replays += 1
                mel = out[..., :n].clone()
            except BaseException:
                self._resident = None  # the buffers are half-updated: no state may trust them
                raise
            new = StaticDecoderCache(new_start, frame_bytes=self.frame_bytes)
            self._resident = weakref.ref(new)
        return mel, new


def recompute_encoder(encode: Any):
    """An ``encode`` for :func:`~cosyvoice_fast.flow.incremental_state.run_increment` that re-runs the whole
    (chunk-causal) encoder with ``encode`` (``flow.encode``'s signature, e.g. a graph-replaying
    :class:`~cosyvoice_fast.flow.graph_encoder.GraphEncoder`) and keeps the new frames.

    Same values as the incremental encoder (chunk-causal attention and look-ahead make committed frames final);
    on a GPU the captured full encoder (one replay) is cheaper than the eager incremental one (hundreds of
    launches), while its work grows with the utterance far more slowly than the estimator's.  Keeps no slots."""

    def run(flow: nn.Module, ids: Tensor, n_body: int, n_final: int, cache: EncoderCache
            ) -> tuple[Tensor, EncoderCache]:
        ct, n = cache.n_tokens, ids.shape[1]
        stride = flow.encoder.cfg.upsample_stride
        new = EncoderCache(encoder_commit_point(flow, ct, n_body, n_final))
        if n_body == ct:
            return ids.new_zeros(1, flow.encoder_proj.out_features, 0).float(), new
        ids = ids.clamp(min=0).to(torch.int32)
        empty = ids[:, :0]
        dev = ids.device
        finalize = n_body == n
        enc = encode(ids, torch.tensor([n], dtype=torch.int32, device=dev), empty,
                     torch.zeros(1, dtype=torch.int32, device=dev),
                     torch.zeros(1, flow.cfg.spk_embed_dim, device=dev, dtype=next(flow.parameters()).dtype),
                     streaming=True, finalize=finalize, n_lookahead=None if finalize else n - n_body)
        return enc.mu[:, :, stride * ct:stride * n_body], new

    return run


class GraphIncrementalFlow(IncrementalFlow):
    """:class:`IncrementalFlow` whose estimator solve is :class:`IncrementalEstimatorGraphs`, with
    ``full`` (a :class:`~cosyvoice_fast.flow.graph.CudaGraphFlow`: its ``recompute``)
    serving final chunks, non-streaming requests and segments past the buffers' capacity."""

    layout = "static"

    def __init__(self, flow: nn.Module, full: Any, config: Any = None,
                 max_frames: int = DEFAULT_STATE_FRAMES, max_prompt_states: int = 8, capture: bool | None = None,
                 estimator: Callable[..., Tensor] | None = None, new_voices: str = "incremental"):
        super().__init__(flow, config, max_prompt_states, new_voices)
        self.full = full
        self.busy = 0  # segments that recomputed because another stream held the buffers
        # the captured full encoder (one replay) rather than the eager incremental one (hundreds of launches)
        self.encoder = recompute_encoder(getattr(full, "encoder", None) or flow.encode)
        self.graphs = self.decoder = IncrementalEstimatorGraphs(flow, max_frames, capture=capture, estimator=estimator)

    def chunk(self, seg: Any, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool = True) -> Tensor:
        """As :meth:`IncrementalFlow.chunk`, except that a segment starts incrementally only if no other live
        segment holds the buffers, else it recomputes throughout.

        Why: swapping states in and out costs a copy of every committed frame's keys/values per chunk
        (~2.3 MB per frame) and a saved copy per waiting stream; measured at 16 streams that made chunks slower
        than recomputing.  One stream per buffer set keeps the memory bounded by the buffers and gives the solo
        stream (the latency case) the flat per-chunk cost."""
        if stream and not call.finalize and seg is not None and seg.flow_state is None:
            cur = self.graphs.resident()
            if cur is not None and cur.kv is None:  # a live stream's only copy: leave it there
                self.busy += 1
                seg.flow_state = "full"
        return super().chunk(seg, inputs, tokens, call, stream)

    def full_chunk(self, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool) -> Tensor:
        return self.full.recompute(inputs, tokens, call, stream)

    def memory(self) -> dict[str, int]:
        return {**super().memory(), "state_buffer_bytes": self.graphs.nbytes(),
                "state_bytes_per_frame": self.graphs.frame_bytes}
