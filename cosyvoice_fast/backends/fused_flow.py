"""The ``fused`` flow backend: the ``cudagraph`` flow with the estimator computed by fused Triton kernels.

Same bucket policy, graph runner and encoder graphs as :class:`~cosyvoice_fast.backends.cudagraph_flow.
CudaGraphFlow`; the captured function is :class:`~cosyvoice_fast.kernels.estimator_fused.FusedEstimator`
instead of the eager estimator, so each Euler step replays a graph of a few hundred fused kernels instead of
about a thousand small ones.  Padding stays exact for the same reasons (causal convs, masked keys, masked
inputs), and the fused attention needs no (rows, T, T) bias tensor.

Streaming chunks always recompute the prefix (like the ``tensorrt`` flow): the incremental runner's state
buffers are written by the eager estimator's math, which the fused kernels do not implement yet, and with a
fast estimator step a full recompute of a chunk is already short.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from ..config import ModelConfig
from .base import BackendUnavailable
from .cudagraph_flow import CudaGraphFlow


def why_unavailable(flow: torch.nn.Module | None = None) -> str | None:
    """The reason the fused flow cannot run here (no CUDA, no Triton, a model it does not support), or None."""
    if not torch.cuda.is_available():
        return "flow backend 'fused' needs a CUDA GPU (torch sees none here); choose 'eager' instead"
    if importlib.util.find_spec("triton") is None:
        return "flow backend 'fused' needs the triton package (pip install triton); choose 'cudagraph' instead"
    if flow is not None:
        dev = next(flow.parameters()).device
        if dev.type != "cuda":
            return f"flow backend 'fused' needs the model on a CUDA GPU, but it is on {dev}; choose 'eager' instead"
        if len(flow.decoder.estimator.cfg.channels) != 1:
            return "flow backend 'fused' supports the one-level estimator of released models; choose 'cudagraph'"
    return None


class FusedFlow(CudaGraphFlow):
    """Flow stage: graph-replayed encoder (exact shapes) and fused estimator (length and row buckets); the
    ``cudagraph`` flow's constructor arguments (buckets, rows, capture at start-up) except ``incremental``."""

    def __init__(self, flow: torch.nn.Module, config: ModelConfig, **kwargs: Any):
        reason = why_unavailable(flow)
        if reason is not None:
            raise BackendUnavailable(reason)
        from ..kernels.estimator_fused import FusedEstimator

        kwargs.pop("incremental", None)
        super().__init__(flow, config, incremental=False, estimator=FusedEstimator, **kwargs)
