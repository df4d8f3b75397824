"""CosyVoice3's ``fused`` flow stage: :class:`~cosyvoice_fast.flow.dit_graph.DiTGraphFlow` replaying the DiT on
Triton kernels (:class:`~cosyvoice_fast.flow.kernels.dit_fused.FusedDiT`: AdaLN in GEMM prologues, one
modulation table read per Euler step, in-place rotary, chunk-rule attention kernel) instead of eager PyTorch modules.
Same chunk rule, buckets, batching and exactness as the ``cudagraph`` stage; only the captured kernels differ.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from cosyvoice_fast.flow.dit_graph import DiTGraphFlow
from cosyvoice_fast.flow.kernels.dit_fused import FusedDiT


class DiTFusedFlow(DiTGraphFlow):
    """``DiTFusedFlow(flow, config, buckets=..., rows=..., capture_at_start=...)``: as :class:`DiTGraphFlow`."""

    backend = "fused"

    def __init__(self, flow: nn.Module, config: Any = None, **kwargs: Any):
        if "estimator" in kwargs:
            raise TypeError("DiTFusedFlow captures FusedDiT; use DiTGraphFlow(estimator=...) for another module")
        # called after DiTGraphFlow's checks: its modulation table holds the CFM's Euler steps
        super().__init__(flow, config, estimator=lambda dit: FusedDiT(dit, flow.cfg.cfm.n_timesteps), **kwargs)
