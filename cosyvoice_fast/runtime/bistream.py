"""A bi-streamed request's text side: pieces in, LM schedule fed, arrival times kept for telemetry.

One object per request joins the incremental frontend (pieces -> final token ids) and the LM schedule
(:class:`~cosyvoice_fast.models.bistream.BistreamState`, which reads id chunks when it needs them), and notes
when each piece arrived, so first audio can be measured from the first text piece and from the moment the 5th
text token reached the LM (the schedule cannot decode before 5 text rows are queued).  It holds no thread: the
engine (or a CLI loop) calls :meth:`TextFeed.push` as pieces come and steps the state while it is not waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..frontend.text_stream import IncrementalText
from ..models.bistream import BistreamState


@dataclass(frozen=True, slots=True)
class PieceArrival:
    """A text piece: when it arrived (clock seconds), its length in characters, the ids it released."""

    t: float
    chars: int
    ids_released: int


@dataclass(eq=False)
class TextFeed:
    """Pieces -> :class:`IncrementalText` -> :class:`BistreamState`, with arrival times.

    Each :meth:`push` that releases ids hands them to the schedule as one chunk (chunk boundaries are part of
    the LM's input, see the schedule's docstring); :meth:`end` releases the rest and ends the text."""

    text: IncrementalText
    state: BistreamState
    clock: Callable[[], float] = time.monotonic
    arrivals: list[PieceArrival] = field(default_factory=list)
    t_first_piece: float | None = None
    t_text_token_5: float | None = None  # when the 5th token of the target text reached the schedule
    t_end: float | None = None
    text_tokens: int = 0

    def push(self, piece: str) -> int:
        """One piece arrived; returns how many ids it released to the LM."""
        now = self.clock()
        if self.t_first_piece is None:
            self.t_first_piece = now
        ids = self.text.push(piece)
        self._feed(ids, now)
        self.arrivals.append(PieceArrival(now, len(piece), len(ids)))
        return len(ids)

    def end(self) -> int:
        """The text is complete: release what was held back and start the LM's final phase."""
        now = self.clock()
        ids = self.text.finish()
        self._feed(ids, now)
        self.state.end_text()
        self.t_end = now
        return len(ids)

    def _feed(self, ids: list[int], now: float) -> None:
        if not ids:
            return
        self.state.push_text(ids)
        before, self.text_tokens = self.text_tokens, self.text_tokens + len(ids)
        if before < 5 <= self.text_tokens:
            self.t_text_token_5 = now
