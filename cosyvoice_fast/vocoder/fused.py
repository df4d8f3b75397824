"""The ``fused`` vocoder backend: the ``cudagraph`` vocoder whose residual units run fused Triton passes.

Same graphs, batching and start-up captures as :class:`~cosyvoice_fast.vocoder.graph.
CudaGraphVocoder`; only the captured module differs: its Snake residual blocks are
:class:`~cosyvoice_fast.vocoder.kernels.hift_snake.FusedSnakeResBlock` (Snake, conv bias and residual add in one pass
each), so a filter pass launches about half as many kernels and moves about half as many bytes; and its conv
stack runs time-major (:func:`~cosyvoice_fast.vocoder.model.hift.conv_time_major`), so cuDNN's NHWC convolutions need
no layout transposes around them.  With ``triton_convs`` (the default) its ``Conv1d`` layers are Triton kernels
(:mod:`~cosyvoice_fast.vocoder.kernels.hift_conv`) with the residual units' bias, residual and Snake in their epilogues,
and the f0 predictor's convolutions run there in full fp32 with their ELU.  HiFT stays fp32 (bf16 was not
faster and cost ~37 dB SNR).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from cosyvoice_fast.config.backends import TRITON_MISSING, BackendUnavailable
from cosyvoice_fast.kernels.graphs import cuda_missing
from cosyvoice_fast.vocoder.graph import CudaGraphVocoder


def why_unavailable_on(device: torch.device, engines_dir: Path | None = None) -> str | None:
    """Why the fused vocoder cannot run on ``device`` (no CUDA, no Triton; the availability registry asks), or
    None."""
    return cuda_missing(device) or (TRITON_MISSING if importlib.util.find_spec("triton") is None else None)


class FusedVocoder(CudaGraphVocoder):
    """HiFT in CUDA graphs with fused residual units; :class:`CudaGraphVocoder`'s constructor arguments, plus
    ``time_major``: run the conv stack time-major; ``triton_convs``: its ``Conv1d`` layers and the f0 predictor's
    as Triton kernels (see :func:`~cosyvoice_fast.vocoder.kernels.hift_snake.fuse_hift`, which refuses them without
    ``time_major``), for calls of at most ``triton_max_rows`` batch rows (``None``: the kernels' default,
    :data:`~cosyvoice_fast.vocoder.kernels.hift_conv.TRITON_MAX_ROWS`)."""

    def __init__(self, hift: torch.nn.Module, time_major: bool = True, triton_convs: bool = True,
                 triton_max_rows: int | None = None, **kwargs):
        dev = next(hift.parameters()).device
        reason = why_unavailable_on(dev)
        if reason is not None:
            other = "eager" if cuda_missing(dev) else "cudagraph"
            raise BackendUnavailable(f"vocoder backend 'fused' {reason}; choose '{other}' instead")
        from cosyvoice_fast.vocoder.kernels.hift_conv import TRITON_MAX_ROWS  # Triton is here: checked above

        self.time_major = time_major
        self.triton_convs = triton_convs
        self.triton_max_rows = TRITON_MAX_ROWS if triton_max_rows is None else triton_max_rows
        super().__init__(hift, **kwargs)

    def _plain_model(self, hift: torch.nn.Module) -> torch.nn.Module:
        from cosyvoice_fast.vocoder.kernels.hift_snake import fuse_hift

        plain = super()._plain_model(hift)
        fuse_hift(plain, time_major=self.time_major, triton_convs=self.triton_convs,
                  triton_max_rows=self.triton_max_rows)
        return plain

    def _f0(self, mel: torch.Tensor) -> torch.Tensor:
        from cosyvoice_fast.vocoder.kernels.hift_conv import f0_fused, use_triton

        if not self.triton_convs or not use_triton(mel.shape[0], self.triton_max_rows):
            return super()._f0(mel)
        return f0_fused(self.plain.f0_predictor, mel)
