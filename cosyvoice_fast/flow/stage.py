"""The flow stage's contract with the engine: speech tokens of one chunk call in, mel frames out.

``chunk(segment_state, inputs, tokens, call) -> mel (1, 80, new frames)``; optionally ``solve(items)`` for
several requests' calls at once (``items`` are ``(segment_state, inputs, tokens, call)`` tuples; each mel must
equal that item's ``chunk`` up to float rounding) and ``max_batch`` (items it will share; <= 1: do not batch).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class FlowStage(Protocol):
    def chunk(self, seg: Any, inputs: Any, tokens: torch.Tensor, call: Any) -> torch.Tensor: ...
