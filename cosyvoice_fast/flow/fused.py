"""The ``fused`` flow backend: the ``cudagraph`` flow with the estimator computed by fused Triton kernels.

Same bucket policy, graph runner and encoder graphs as :class:`~cosyvoice_fast.flow.graph.
CudaGraphFlow`; the captured function is :class:`~cosyvoice_fast.flow.kernels.estimator_fused.FusedEstimator`
instead of the eager estimator, so each Euler step replays a graph of a few hundred fused kernels instead of
about a thousand small ones, and the encoder graphs capture :class:`~cosyvoice_fast.flow.kernels.encoder_fused.
FusedEncoder` (five kernels per Conformer block instead of about twenty).  Padding stays exact for the same
reasons (causal convs, masked keys, masked inputs), and the fused attention needs no (rows, T, T) bias tensor.

With ``incremental`` (the engine's default, as for ``cudagraph``) streaming chunks run on the incremental
runner of :mod:`~cosyvoice_fast.flow.graph_incremental` with these same kernels on its windows
(:meth:`~cosyvoice_fast.flow.kernels.estimator_fused.FusedEstimator.forward_window`): a chunk computes only the
frames after the last committed chunk, reading the earlier frames' keys/values and conv context from the
runner's buffers; final chunks, non-streaming requests and streams that join a batched solve recompute.
A voice with no prompt state yet recomputes its segment (``new_voices = "recompute"``): a window over prompt and
chunk together costs more than the recompute of the same frames (the window's conv-context launches and
cached-key writes, as measured on an H100), so incremental pays only from the voice's cached prompt state on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.kernels.graphs import cuda_missing
from cosyvoice_fast.flow.graph import CudaGraphFlow


def why_unavailable_on(device: torch.device, engines_dir: Path | None = None) -> str | None:
    """Why the fused flow cannot run on ``device`` (no CUDA, no Triton; the availability registry asks), or None."""
    missing = cuda_missing(device)
    if missing is not None:
        return missing
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package (pip install triton)"
    return None


def why_unavailable(flow: torch.nn.Module) -> str | None:
    """The reason the fused flow cannot drive ``flow`` here (no CUDA, no Triton, a model it does not support)."""
    dev = next(flow.parameters()).device
    reason = why_unavailable_on(dev)
    if reason is not None:
        other = "cudagraph" if dev.type == "cuda" and torch.cuda.is_available() else "eager"
        return f"flow backend 'fused' {reason}; choose '{other}' instead"
    if len(flow.decoder.estimator.cfg.channels) != 1:
        return "flow backend 'fused' supports the one-level estimator of released models; choose 'cudagraph'"
    return None


def _fused_encode(flow: torch.nn.Module) -> Any:
    """The padded-encode function the ``fused`` flow's encoder graphs capture."""
    from cosyvoice_fast.flow.kernels.encoder_fused import FusedEncoder

    return FusedEncoder(flow).encode_padded


class FusedFlow(CudaGraphFlow):
    """Flow stage: graph-replayed encoder (exact shapes) and fused estimator (length and row buckets, and the
    incremental runner's windows); the ``cudagraph`` flow's constructor arguments, except that ``incremental``
    is off unless asked for (the engine passes ``BackendConfig.incremental``; a stage built directly, as the
    profilers do, recomputes and allocates no state buffers)."""

    new_voices = "recompute"

    def __init__(self, flow: torch.nn.Module, config: ModelConfig, fused_encoder: bool = True, **kwargs: Any):
        """``fused_encoder``: the encoder graphs capture :class:`~cosyvoice_fast.flow.kernels.encoder_fused.
        FusedEncoder` (five kernels per Conformer block) rather than the eager encoder."""
        reason = why_unavailable(flow)
        if reason is not None:
            raise BackendUnavailable(reason)
        from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator

        kwargs.setdefault("incremental", False)
        super().__init__(flow, config, estimator=FusedEstimator, encoder=_fused_encode if fused_encoder else None,
                         **kwargs)
