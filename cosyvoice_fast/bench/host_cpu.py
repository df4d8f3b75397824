"""How much host CPU a benchmark's timed run used: the whole process, and each engine worker thread.

A serving engine feeds the GPU from Python threads that share one interpreter lock.  When the GPU sits idle
with requests in flight, the question is whether the host was the limit: a worker thread near 100 % of one core,
or worker threads together near 100 % (they can only run Python one at a time), says it was.  CPU time includes
a thread's waits inside CUDA synchronisation calls when the driver spins, so a high figure is an upper bound on
Python work; a low one rules the host out.
"""

from __future__ import annotations

import threading
import time
from typing import Any

#: the engine's worker threads (``runtime.scheduler.Scheduler.start`` names them)
WORKERS = ("cosyvoice-llm", "cosyvoice-chunks")


def _thread_clock(thread: threading.Thread) -> int | None:
    """The CPU-time clock of a running thread (Linux and other POSIX systems), or None where unavailable."""
    getter = getattr(time, "pthread_getcpuclockid", None)
    if getter is None or thread.ident is None or not thread.is_alive():
        return None
    try:
        return getter(thread.ident)
    except (OSError, OverflowError):
        return None


class HostCpu:
    """``with HostCpu() as cpu: ...`` then ``cpu.report()``: CPU seconds per wall second, as percent of one core,
    for the process and for each worker thread alive at the start (``None`` where not measurable)."""

    def __init__(self, workers: tuple[str, ...] = WORKERS):
        self.workers = workers
        self._clocks: dict[str, tuple[int, float]] = {}
        self._start = (0.0, 0.0)
        self.result: dict[str, float | None] = {}

    def __enter__(self) -> "HostCpu":
        for t in threading.enumerate():
            if t.name in self.workers and (clk := _thread_clock(t)) is not None:
                self._clocks[t.name] = (clk, time.clock_gettime(clk))
        self._start = (time.perf_counter(), time.process_time())
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._start[0]
        cpu = time.process_time() - self._start[1]
        self.result = {"host_cpu_pct": 100.0 * cpu / wall if wall > 0 else None}
        for name in self.workers:
            key = name.replace("cosyvoice-", "") + "_thread_cpu_pct"
            try:
                clk, t0 = self._clocks[name]
                self.result[key] = 100.0 * (time.clock_gettime(clk) - t0) / wall if wall > 0 else None
            except (KeyError, OSError):  # not running at the start, or ended meanwhile
                self.result[key] = None

    def report(self) -> dict[str, Any]:
        return dict(self.result)
