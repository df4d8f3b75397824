"""CosyVoice3's ``cudagraph`` flow stage: the DiT estimator's guided Euler steps replayed as CUDA graphs.

The graph machinery is CosyVoice2's, unchanged: :class:`~cosyvoice_fast.flow.graph.GraphEstimator` pads a
call to its frame bucket (multiples of the DiT's 50-frame attention chunk, or ``EngineConfig.flow_buckets``)
and its row bucket, and with a ``solver`` replays one captured *step* graph per Euler step
(:mod:`~cosyvoice_fast.flow.graph_solve`: estimator, CFG mix and state update in one graph).  It only needs an
estimator with the CFM calling convention, ``cfg.out_channels`` and no host sync in its forward, which the
DiT has (its attention mask is built on the device, :meth:`DiT.attention_mask`).

Why padding is exact for the DiT: right-padded frames have mask 0, so no real query attends to them (keys
must be valid); the conv position embedding is causal (left-padded), rotary positions are absolute, and
everything else is per frame - padded frames never reach a real one.  A padded *row* (no valid frame) gets a
zero attention output (eager DiT: attends frame 0 only; never NaN either way) and is never read.  The graphs
capture :class:`~cosyvoice_fast.flow.kernels.dit_blas.BlasDiT` (the DiT's maths on cuBLAS GEMMs with fused
Triton glue), not the eager modules.  The token side (embedding, pre-look-ahead convs: a handful of
kernels per call) runs eagerly.

Batched solves (:meth:`solve`): several requests' calls of one attention mode share one guided solve over
right-padded ``mu`` (:func:`~cosyvoice_fast.flow.eager.flow_chunk_mel_batch`), split to stay within the row
buckets and the attention-memory budget.  Every chunk recomputes its prefix as upstream does (no K/V cache
here: :class:`~cosyvoice_fast.flow.dit_incremental.DiTIncrementalFlow` is the eager incremental runner).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.config.graph_plan import estimator_jobs
from cosyvoice_fast.config.schedule import ChunkCall
from cosyvoice_fast.flow.eager import ChunkItem, flow_chunk_mel, flow_chunk_mel_batch
from cosyvoice_fast.flow.graph import DEFAULT_MAX_FRAMES, ROW_SIZES, CudaGraphFlow, GraphEstimator
from cosyvoice_fast.flow.kernels.dit_blas import BlasDiT
from cosyvoice_fast.flow.model.dit_flow import DiTFlow
from cosyvoice_fast.kernels.graphs import cuda_missing


def why_unavailable(flow: nn.Module, backend: str = "cudagraph") -> str | None:
    """The reason ``backend`` cannot drive ``flow`` here, or None when it can."""
    reason = cuda_missing(next(flow.parameters()).device)
    return None if reason is None else f"flow backend '{backend}' {reason}; choose 'eager' instead"


class DiTGraphFlow:
    """FlowStage over a :class:`DiTFlow` with graph-replayed Euler steps (see the module docstring).

    ``buckets`` / ``rows`` (``EngineConfig.flow_buckets`` / ``flow_rows``): the estimator lengths and requests
    per solve served from graphs; with ``capture_at_start`` every one of them (both attention modes) is
    captured here and nothing later (an uncaptured shape runs eagerly, counted in ``estimator.eager_calls``)."""

    max_batch = ROW_SIZES[-1] // 2  # requests per batched solve (2 CFG rows each)
    incremental = None  # FlowStage: every chunk recomputes its prefix
    backend = "cudagraph"  # the name its refusal gives

    def __init__(self, flow: nn.Module, config: Any = None, buckets: Sequence[int] | None = None,
                 rows: Sequence[int] | None = None, capture_at_start: bool = False,
                 max_frames: int = DEFAULT_MAX_FRAMES, max_graphs: int = 128, progress: bool = True,
                 estimator: Callable[[nn.Module], nn.Module] | None = None):
        """``estimator`` maps the DiT to the module the graphs capture (CPU tests pass the eager DiT itself:
        BlasDiT's Triton kernels run ~100x slower under the interpreter); default
        :class:`~cosyvoice_fast.flow.kernels.dit_blas.BlasDiT` (cuBLAS GEMMs, fused AdaLN/rotary/attention/conv
        glue: the eager DiT's numbers in ~180 launches instead of ~1140)."""
        if not isinstance(flow, DiTFlow):
            raise TypeError(f"DiTGraphFlow drives CosyVoice3's DiTFlow, got {type(flow).__name__}; "
                            "CosyVoice2's flow runs on CudaGraphFlow")
        reason = why_unavailable(flow, self.backend)
        if reason is not None:
            raise BackendUnavailable(reason)
        self.flow = flow
        self.config = config
        est = flow.decoder.estimator
        cfm = flow.cfg.cfm
        module = estimator(est) if estimator else BlasDiT(est, cfm.n_timesteps)
        self.estimator = GraphEstimator(module, next(flow.parameters()).device,
                                        est.cfg.static_chunk_size,
                                        max_frames, max_graphs, buckets,
                                        solver=(cfm.inference_cfg_rate, cfm.n_timesteps))
        if rows:
            self.max_batch = min(max(rows), ROW_SIZES[-1] // 2)
        if capture_at_start:
            self.capture_all(rows or (1,), progress)

    # ``rows · bucket²`` of a solve: CosyVoice2's cost rule reads only ``self.estimator``
    solve_cost = CudaGraphFlow.solve_cost

    def capture_all(self, rows: Sequence[int], progress: bool = True) -> int:
        """Capture every (bucket x row bucket x attention mode) step graph of the start-up plan
        (:func:`~cosyvoice_fast.config.graph_plan.estimator_jobs`: streaming ones first, they serve first
        chunks), then freeze; returns the count."""
        from tqdm.auto import tqdm

        est = self.estimator
        dtype = next(self.flow.parameters()).dtype
        lengths = est.buckets or tuple(range(est.granularity, est.max_frames + 1, est.granularity))
        jobs = [job.shape for job in estimator_jobs(lengths, rows)]
        for cache in est.all_caches():
            cache.max_graphs = max(cache.max_graphs, len(jobs))
        for f, s, r in tqdm(jobs, desc="capturing DiT flow graphs", unit="graph", disable=not progress, leave=False):
            est.capture(f, s, dtype, r)
        est.freeze()
        return len(jobs)

    def chunk(self, seg: Any, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool = True) -> Tensor:
        """One request's call: upstream's recompute with the Euler steps replayed."""
        return flow_chunk_mel(self.flow, inputs, tokens, call, stream, self.estimator)

    def solve(self, items: Sequence[ChunkItem], stream: bool = True) -> list[Tensor]:
        """Several requests' calls, one shared graph-replayed solve per attention mode (split by the row
        buckets and the memory budget); one mel per item, in order, each equal to its :meth:`chunk` up to
        float rounding."""
        if len(items) == 1:
            return [self.chunk(*items[0], stream=stream)]
        with torch.inference_mode():
            return flow_chunk_mel_batch(self.flow, items, stream, self.estimator, max_items=self.max_batch,
                                        cost=self.solve_cost, budget=self.estimator.row_frames_budget())
