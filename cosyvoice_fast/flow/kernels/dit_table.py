"""The per-Euler-step modulation table that both captured DiTs (:class:`~.dit_blas.BlasDiT`,
:class:`~.dit_fused.FusedDiT`) read inside their step graphs.

Every AdaLN vector of the DiT depends only on the flow time, and a streaming solve runs the same 10 times for
every chunk.  So the table holds one row of modulations per Euler step, filled outside any capture; a step
graph gets the step's index as a device scalar and reads its row, never an AdaLN weight.  One module serves one
schedule: its captured graphs hold the table's address, so another schedule needs another module.
"""

from __future__ import annotations

import torch
from torch import Tensor


class StepTable:
    """Mixin: :meth:`time_table` fills ``packed()["table"]`` (``n_steps`` rows) through
    :meth:`step_modulation` and returns each row's step index; the class sets ``n_steps`` and ``_times``."""

    n_steps: int
    _times: tuple[float, ...] | None

    def packed(self) -> dict:
        raise NotImplementedError

    def step_modulation(self, t: Tensor, packed: dict) -> Tensor:
        """The modulation row of one flow time ``t`` (shape (1,))."""
        raise NotImplementedError

    def time_width(self) -> int:
        """Columns of a :meth:`time_table` row: one, the Euler step's index."""
        return 1

    def time_table(self, ts: Tensor, rows: int) -> Tensor:
        """(n_steps, rows, 1): step ``i``'s index for each row; fills the modulation table for the times ``ts``
        (called by the step graphs outside any capture, once per filling; a host read of ``ts`` is fine)."""
        p = self.packed()
        name = type(self).__name__
        times = tuple(float(v) for v in ts.tolist())
        if len(times) != self.n_steps:
            raise ValueError(f"{name} holds {self.n_steps} Euler steps' modulations, got {len(times)} times")
        if self._times is not None and self._times != times:
            raise ValueError(f"{name} serves one Euler schedule per module (captured graphs read its table); "
                             f"build another {name} for another schedule")
        with torch.no_grad():
            for i in range(self.n_steps):
                p["table"][i].copy_(self.step_modulation(ts[i:i + 1], p))
        self._times = times
        idx = torch.arange(self.n_steps, device=ts.device).to(p["table"].dtype)
        return idx.view(-1, 1, 1).expand(-1, rows, 1)
