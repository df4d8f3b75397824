"""One gate between a CUDA graph capture and the GPU work of serving (:data:`GPU_GATE`).

A stream capture must not overlap another thread's GPU work in this process.  Measured on GPUs, both ways it
breaks: in ``thread_local`` mode an H100's first background capture beside start-up work was invalidated (and
torch left its pool "recording"); in ``relaxed`` mode an H200 deadlocked, the capturing thread inside
``cudaStreamEndCapture`` and a request's chunk thread inside a pageable host-to-device copy, both forever.

So every piece of serving GPU work (an engine turn, a request's admission copies, a flow-state computation)
holds the gate shared (:meth:`GpuGate.work`; any number at once, re-entrant per thread), and the capture
itself (``capture_begin`` to ``capture_end``, which executes nothing and takes milliseconds) holds it alone
(:meth:`GpuGate.exclusive`).  A waiting capture lets the turns in progress finish and holds new ones back,
so it waits at most one turn and a turn waits at most one capture; warm-ups and Triton compiles run outside
the gate, beside serving.  At start-up nothing serves, so the gate costs nothing there.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class GpuGate:
    """A readers-writer gate: many GPU workers, or one capture (writer preference, re-entrant per thread)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._workers = 0  # threads inside :meth:`work` (each counted once, however deep)
        self._capturer: int | None = None  # the thread holding, or waiting for, the exclusive side
        self._depth = 0  # the capturer's nesting of :meth:`exclusive`
        self._local = threading.local()

    @property
    def workers(self) -> int:
        """Threads inside :meth:`work` now (for tests and diagnostics)."""
        with self._cond:
            return self._workers

    @contextmanager
    def work(self) -> Iterator[None]:
        """Hold the gate shared around GPU work that may run while the engine serves."""
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            me = threading.get_ident()
            with self._cond:
                while self._capturer is not None and self._capturer != me:
                    self._cond.wait()
                self._workers += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._workers -= 1
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the gate alone around a capture: wait for every other thread's :meth:`work` to end.

        A caller inside its own :meth:`work` (a shape captured inside a turn before the runners froze) sets its
        share down while it waits and captures, so a capture never waits for itself, and two such callers never
        wait for each other."""
        me = threading.get_ident()
        mine = getattr(self._local, "depth", 0) > 0
        with self._cond:
            if self._capturer != me:
                if mine:
                    self._workers -= 1
                    self._cond.notify_all()
                while self._capturer is not None:
                    self._cond.wait()
                self._capturer = me
            self._depth += 1
            while self._workers > 0:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if self._depth == 0:
                    self._capturer = None
                    if mine:
                        self._workers += 1
                    self._cond.notify_all()


#: the process's gate (one GPU process serves one engine's devices; a capture on any device waits for all work)
GPU_GATE = GpuGate()
