"""Batched decode steps fed from the device, so the next step can be launched before this one's tokens are read.

With the repetition-aware sampler inside the decode graph (``CudaGraphLLM(device_ras=True)``), everything a row's
next step needs exists on the device when a step ends: the drawn token, the next position, the generator offset
after one draw (two after a fallback), and the last tokens for the repetition window.  The graph writes them
back into its own input columns (:meth:`StepFeed.advance`).  The step after can then be replayed before the host
has read anything, so the host's work per token (reading the tokens, accepting them, the engine's bookkeeping)
runs while the GPU computes the next step instead of between two steps.

Layout: ``step_in`` has one column per slot.  Its rows are the token to feed, the position to write it at, the
generator's seed and offset, and the last W history tokens (oldest first, right-aligned, -1 where the history is
shorter; the rule only counts them).  Before a replay the host copies in ``staged`` (unless the device holds
its contents already).  That holds fresh columns
for the rows whose inputs come from the host, a ``fresh`` flag, and a ``live`` flag for the rows this replay
steps.  The graph merges the fresh columns, steps the live rows, and advances only those.  Rows that are not live
compute at ``max_len - 1`` with their inputs kept; the LLM backend's docstring says why that is harmless.

On the host, a row's launched step whose result is not read yet is *pending*: at most two per row, the step the
engine asked for and the one launched ahead.  A pending result stays valid however long the row waits.  A row the
engine leaves out of a call (one yielding the GPU to a first chunk, say) keeps it and takes it when it returns,
because nothing but the row's own steps touches its column and its cache row.  Pending steps are dropped only
when the row's slot is released.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import numpy as np
import torch

#: rows of a ``step_in`` column before the history window
TOKEN, POS, SEED, OFFSET, WINDOW = 0, 1, 2, 3, 4
#: staged host buffers in turn: one is written while the copies of the others may still be in flight
_STAGING = 3


#: With the kernels, the graph writes each row's token, fallback flag and position into a ring in pinned host
#: memory (entry ``pos % RING`` of the row's slot) instead of the host copying the tokens after each replay.
#: A slot has at most two steps pending (the one asked for and the one ahead), so four entries are never
#: overwritten before they are read.
RING = 4


def _feed_kernels(device: torch.device) -> ModuleType | None:
    """The kernel module when it can run on ``device`` (CUDA, or the interpreter on CPU), else None."""
    try:
        from cosyvoice_fast.llm.kernels import step_feed
        from cosyvoice_fast.kernels.common import can_run_on
    except ImportError:  # no triton: the torch operations
        return None
    return step_feed if can_run_on(device) else None


def int64(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits (how it travels in the graph's input buffer)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass(eq=False)
class Launch:
    """One replay's tokens and fallback flags in host memory (its own copy, or the feed's ring), readable once
    the replay's event fired."""

    out: torch.Tensor | None  # (2, S) int64, pinned on a GPU; None where the graph writes the ring
    event: Any  # torch.cuda.Event, or None on CPU (the replay ran synchronously)
    refs: int = 0  # pending rows that will read it
    waited: bool = False

    def __post_init__(self) -> None:
        self.view = self.out.numpy() if self.out is not None else None

    def wait(self) -> None:
        if not self.waited:
            if self.event is not None:
                self.event.synchronize()
            self.waited = True


@dataclass(frozen=True, slots=True)
class Row:
    """A row of one launch: its slot, the state it steps and the step index (``len(history)`` at that step)."""

    slot: int
    state: Any
    step: int
    pos: int  # the position the step writes (where its result sits in the feed's ring)


class StepFeed:
    """The device-side step inputs of the batched device-RAS decode graphs and the host's record of pending steps.

    Graph side: :meth:`read` at the start of a step and :meth:`advance` at its end.  Host side: :meth:`stage`
    before a replay, :meth:`collect` after it, :meth:`take` to read a row's result, :meth:`drop` when a slot is
    released.  ``draw_offset``: how far one ``exponential_`` draw moves a generator's offset.  The inputs are
    merged and advanced with one launch each (:mod:`..kernels.step_feed`) where Triton runs the tensors, else
    (or with ``kernels`` False, the tests' reference) with torch operations and a copy of the tokens."""

    def __init__(self, slots: int, max_len: int, window: int, draw_offset: int, device: torch.device,
                 kernels: bool = True):
        self.window, self.max_len, self.draw_offset = window, max_len, draw_offset
        self.rows = WINDOW + window
        self.device = device
        self._cuda = device.type == "cuda"
        # one column per slot plus a spare one, which a batched prefill's unused rows write (:meth:`begin`)
        self.step_in = torch.zeros(self.rows, slots + 1, dtype=torch.long, device=device)
        self.step_in[POS].fill_(max_len - 1)
        self.staged = torch.zeros(self.rows + 2, slots, dtype=torch.long, device=device)  # + fresh, live flags
        self._host = [torch.zeros(self.rows + 2, slots, dtype=torch.long, pin_memory=self._cuda)
                      for _ in range(_STAGING)]
        self._host_np = [h.numpy() for h in self._host]
        self._copied = [torch.cuda.Event() if self._cuda else None for _ in range(_STAGING)]
        self._turn = 0
        self._sent: np.ndarray | None = None  # the fresh and live flags of the last copy, and its stream
        self._sent_stream: Any = None
        self.skipped = 0  # stage calls that copied nothing (the device already held their flags)
        self._free: list[Launch] = []
        self._pending: dict[int, deque[tuple[Launch, Row]]] = {}
        self._last: Launch | None = None
        self._stream: Any = None
        self.dropped = 0  # pending results thrown away (their row ended or was released first)
        self._kernels = _feed_kernels(device) if kernels else None
        # with the kernels the graph writes each row's result into host memory itself (the advance kernel, the
        # step's last): no copy between two replays.  Pinned memory is mapped into the GPU's address space
        self._ring = self._ring_np = None
        if self._kernels is not None:
            self._ring = torch.full((RING, 3, slots + 1), -1, dtype=torch.long, pin_memory=self._cuda)
            self._ring_np = self._ring.numpy()

    # ---------------------------------------------------------------------------------------- graph side

    def read(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Merge the staged fresh columns of rows ``0 .. n-1``, then return what the step reads: tokens (n, 1),
        positions (n, 1; ``max_len - 1`` where not live), generator states (2, n), windows (n, W), live (n,)."""
        staged, inp = self.staged[:, :n], self.step_in[:, :n]
        if self._kernels is not None:
            pos, live = self._kernels.read_columns(staged, inp, self.max_len)
        else:
            inp.copy_(torch.where(staged[self.rows].bool(), staged[:self.rows], inp))
            live = staged[self.rows + 1].bool()
            pos = torch.where(live, inp[POS], self.max_len - 1).view(-1, 1)
        return inp[TOKEN].view(-1, 1), pos, inp[SEED:OFFSET + 1], inp[WINDOW:].t(), live

    def advance(self, n: int, drawn: torch.Tensor, live: torch.Tensor) -> None:
        """Write each live row's next inputs from the step's ``drawn`` ((2, n) int64: tokens, fallback flags):
        the token, the next position (kept inside the cache), the offset past this step's draws, the window
        shifted by the token."""
        inp = self.step_in[:, :n]
        if self._kernels is not None:
            self._kernels.advance_columns(inp, drawn, live, self.max_len, self.draw_offset, self._ring)
            return
        token, fallback = drawn[0], drawn[1]
        parts = [token[None], (inp[POS] + 1).clamp(max=self.max_len - 1)[None], inp[SEED:SEED + 1],
                 (inp[OFFSET] + self.draw_offset * (1 + fallback.long()))[None]]
        if self.window:
            parts += [inp[WINDOW + 1:], token[None]]
        inp.copy_(torch.where(live, torch.cat(parts), inp))

    def begin(self, slots: torch.Tensor, token: torch.Tensor, last: torch.Tensor, seed: torch.Tensor,
              offset: torch.Tensor) -> None:
        """Graph side, at the end of a prefill: write each prefilled row's first decode step into its column
        (``slots`` (R,) int64, the spare column for a replay's unused rows): the prefill's drawn ``token`` fed at
        the position after the prompt's ``last``, the generator's ``seed`` and its ``offset`` moved past the
        prefill's one draw, and a window holding only that token.  So that step can be launched before the host
        has read the token.  One draw: with a positive repetition threshold the rule never redraws a first token
        (its window is empty); the runner starts no step this way otherwise."""
        cols = [token[None], (last + 1).clamp(max=self.max_len - 1)[None], seed[None],
                (offset + self.draw_offset)[None]]
        if self.window:
            cols += [torch.full((self.window - 1, token.shape[0]), -1, dtype=torch.long, device=token.device),
                     token[None]]
        self.step_in.index_copy_(1, slots, torch.cat(cols))

    # ---------------------------------------------------------------------------------------- host side

    def column(self, token: int, pos: int, generator: torch.Generator, history: Sequence[int]) -> list[int]:
        """A fresh column from the host's state (a CPU generator's row gets zeros: the host samples it)."""
        on_device = generator.device.type == "cuda"
        seed = int64(generator.initial_seed()) if on_device else 0
        offset = generator.get_offset() if on_device else 0
        recent = list(history[-self.window:]) if self.window else []
        return [token, pos, seed, offset] + [-1] * (self.window - len(recent)) + recent

    def stage(self, columns: dict[int, list[int] | None]) -> None:
        """Copy in the next replay's inputs: ``columns`` maps each live slot to its fresh column, or to None
        when its inputs are on the device already (the previous step of the row advanced them).

        A replay with no fresh column and the same live rows as the last copied one (every step of a steady
        batch) copies nothing: the device buffer already holds those flags, and its column rows are read only
        where a fresh flag is set.  That takes a host-to-device copy off the GPU's path between two steps."""
        flags = np.zeros((2, self.staged.shape[1]), dtype=np.int64)
        for slot, col in columns.items():
            flags[1, slot] = 1
            flags[0, slot] = col is not None
        stream = torch.cuda.current_stream(self.device) if self._cuda else None
        if (not flags[0].any() and self._sent is not None and stream == self._sent_stream
                and np.array_equal(flags, self._sent)):
            self.skipped += 1
            return
        self._turn = i = (self._turn + 1) % _STAGING
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # its last copy (two replays ago) must be done before it is rewritten
        host, r = self._host_np[i], self.rows
        host[r:, :] = flags
        for slot, col in columns.items():
            if col is not None:
                host[:r, slot] = col
        self.staged.copy_(self._host[i], non_blocking=True)
        if self._copied[i] is not None:
            self._copied[i].record()
        self._sent, self._sent_stream = flags, stream

    def collect(self, drawn: torch.Tensor, rows: Sequence[Row]) -> Launch:
        """After a replay: make each row pending on it, and copy its (2, S) tokens and fallback flags to the
        host unless the graph writes them into the ring itself."""
        launch = self._free.pop() if self._free else Launch(
            None if self._ring is not None else torch.zeros(drawn.shape, dtype=torch.long, pin_memory=self._cuda),
            torch.cuda.Event() if self._cuda else None)
        if launch.out is not None:
            launch.out.copy_(drawn, non_blocking=True)
        if launch.event is not None:
            launch.event.record()
            self._stream = torch.cuda.current_stream(self.device)
        launch.waited = False
        for row in rows:
            self._pending.setdefault(row.slot, deque()).append((launch, row))
            launch.refs += 1
        self._last = launch
        return launch

    def pending(self, slot: int, state: Any, step: int) -> bool:
        """Whether ``state``'s step ``step`` was launched already (its result waits in a launch)."""
        q = self._pending.get(slot)
        return bool(q) and q[0][1].state is state and q[0][1].step == step

    def take(self, slot: int, state: Any, step: int) -> tuple[int, int]:
        """The (token, fallback) of ``state``'s pending step ``step``, waiting for it if needed."""
        if not self.pending(slot, state, step):
            raise RuntimeError(f"slot {slot} has no launched step {step} for this state (internal error)")
        launch, row = self._pending[slot].popleft()
        launch.wait()
        if launch.view is not None:
            out = int(launch.view[0, slot]), int(launch.view[1, slot])
        else:
            token, fallback, pos = (int(v) for v in self._ring_np[row.pos % RING, :, slot])
            if pos != row.pos:
                raise RuntimeError(f"slot {slot}: the token ring holds the step at position {pos}, not the one at "
                                   f"{row.pos} (internal error)")
            out = token, fallback
        self._unref(launch)
        return out

    def drop(self, slot: int) -> None:
        """Forget the slot's pending steps (its state ended or was released)."""
        for launch, _ in self._pending.pop(slot, ()):
            self.dropped += 1
            self._unref(launch)

    def settle(self) -> None:
        """Called before any replay: if the last launch went to another CUDA stream (another engine thread
        sharing this backend), wait for it, since graphs share one scratch pool and must not run at once."""
        last = self._last
        if last is None or last.event is None or last.waited:
            return
        if torch.cuda.current_stream(self.device) != self._stream:
            last.event.synchronize()

    def _unref(self, launch: Launch) -> None:
        launch.refs -= 1
        if launch.refs == 0:
            self._free.append(launch)  # reused by a later replay, whose copy is ordered after this one's

