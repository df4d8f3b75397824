"""The flow stage's contract with the engine: speech tokens of one chunk call in, mel frames out.

Every flow runner (:class:`~cosyvoice_fast.flow.eager.EagerFlow`,
:class:`~cosyvoice_fast.flow.incremental.IncrementalFlow`, :class:`~cosyvoice_fast.flow.graph.CudaGraphFlow`
and its :class:`~cosyvoice_fast.flow.fused.FusedFlow`, :class:`~cosyvoice_fast.flow.tensorrt.TensorRTFlow`)
implements all of it, so the engine calls these members directly instead of probing for them:

* ``chunk(seg, inputs, tokens, call) -> mel (1, 80, new frames)``: one request's call;
* ``solve(items) -> [mel, ...]``: several requests' calls at once (``items`` are ``(seg, inputs, tokens,
  call)`` tuples); each mel equals that item's ``chunk`` up to float rounding, in order.  A runner that cannot
  share work loops over ``chunk``;
* ``max_batch``: items one ``solve`` may share; ``<= 1`` means the engine gains nothing by batching and calls
  ``chunk`` per request;
* ``incremental``: the :class:`~cosyvoice_fast.flow.incremental.IncrementalFlow` that keeps this stage's flow
  state between chunks (for ``Engine.store_flow_state``: its ``prompt_flow_state(inputs)``), or ``None`` when
  the stage recomputes every chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from cosyvoice_fast.flow.incremental import IncrementalFlow


class FlowStage(Protocol):
    max_batch: int

    @property
    def incremental(self) -> "IncrementalFlow | None": ...

    def chunk(self, seg: Any, inputs: Any, tokens: torch.Tensor, call: Any) -> torch.Tensor: ...

    def solve(self, items: Sequence[tuple[Any, Any, torch.Tensor, Any]]) -> list[torch.Tensor]: ...
