"""CosyVoice3's eager flow stage: upstream's per-chunk recompute, the reference the faster DiT runners match.

:class:`~cosyvoice_fast.flow.model.dit_flow.DiTFlow` speaks CosyVoice2's flow interface (``encode`` /
``decode`` / ``decode_batch``), so the chunk rule is :mod:`cosyvoice_fast.flow.eager`'s, unchanged, and it is
CosyVoice3's rule too: a non-final call runs the DiT chunk-causal (``streaming=True``) with the call's trailing
look-ahead tokens as pre-look-ahead context only; the final call runs full attention (``streaming=False``) over
every token; the new frames are those after ``token_mel_ratio * token_offset``.  No mel fade here (CosyVoice3
has none; the vocoder stage owns its own carry-over).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from cosyvoice_fast.flow.eager import EagerFlow
from cosyvoice_fast.flow.model.dit_flow import DiTFlow


class DiTEagerFlow(EagerFlow):
    """FlowStage over a :class:`DiTFlow`: ``chunk`` recomputes the whole prefix per call (as upstream),
    ``solve`` shares one guided solve between same-length calls on a GPU (``max_batch`` 16; 1 on CPU, where
    batching buys nothing and each item stays bit-identical to its own ``chunk``).  No state between chunks."""

    def __init__(self, flow: nn.Module, config: Any = None):
        if not isinstance(flow, DiTFlow):
            raise TypeError(f"DiTEagerFlow drives CosyVoice3's DiTFlow, got {type(flow).__name__}; "
                            "CosyVoice2's flow runs on EagerFlow")
        super().__init__(flow, config)
