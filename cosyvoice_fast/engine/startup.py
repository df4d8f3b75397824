"""What a starting server is doing, for ``/health``, the page and the log: the start-up phases, graphs captured of
those planned, kernels compiled, seconds per phase, and an estimate from the previous start on this box.

A fresh GPU box used to sit for minutes behind "warming up" with nothing saying why or for how long.  The
phases are few and in order: ``loading weights`` -> ``capturing graphs`` (stage builds: Triton compiles each
new kernel shape during its first capture, so compiling and capturing interleave; the snapshot counts both) ->
``warming up`` (one short request per default backend) -> ``ready``.  Each finished phase logs one line with
its seconds; ``ready`` logs the total and writes the phase times into the compile cache directory, where the next
start reads them as its estimate.  Thread-safe: the warm-up thread advances it while ``/health`` reads it.

With background capture (``EngineConfig.background_capture``) ``capturing graphs`` covers only the graphs first
chunks need; the rest are captured after ready by the engine's background thread (:meth:`attach_background`),
and the status reads ``ready — capturing N/M in the background`` until it is done (one log line then, with
its seconds, which the compile cache record keeps as ``background_s``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from cosyvoice_fast.kernels.graphs import captures

log = logging.getLogger(__name__)

PHASES = ("loading weights", "capturing graphs", "warming up", "ready")
#: the compile cache record holding the previous start's phase times
RECORD = "startup"


def process_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None elsewhere: start-up is measured from the
    process start, so imports count too."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    # a container whose /proc/uptime is its own (LXCFS) while start times count from the host's boot: no answer
    return age if 0.0 <= age < 86400.0 else None


class StartupProgress:
    """The start-up phases of one server process (see the module docstring).

    ``graphs`` counts graphs captured before ready so far (default: ``kernels.graphs.captures``, which leaves
    out the background thread's: :meth:`attach_background` shows those),
    ``kernels`` kernels compiled so far (set by :meth:`attach_cache`: new entries in Triton's cache), ``clock``
    a monotonic clock in seconds (tests pass their own).  The clock starts at the process start when known."""

    def __init__(self, graphs: Callable[[], int] = captures, clock: Callable[[], float] = time.monotonic,
                 since_process_start: bool = True):
        self._graphs, self._clock = graphs, clock
        self._kernels: Callable[[], int] | None = None
        self._lock = threading.Lock()
        age = process_age_s() if since_process_start else None
        self._t0 = clock() - (age or 0.0)
        self._phase = PHASES[0]
        self._phase_t0 = self._t0
        self._done: list[tuple[str, float]] = []
        self._graphs0 = graphs()
        self._kernels0 = 0
        self.planned = 0
        self._estimate: dict[str, Any] | None = None
        self._cache: Any = None
        self._background: Any = None
        self.error: str | None = None

    # ------------------------------------------------------------------------------------------ updates
    def attach_cache(self, cache: Any) -> None:
        """Count compiled kernels in ``cache`` (a ``CompileCache``), read the previous start's record as the
        estimate, and write this start's there when ready."""
        with self._lock:
            self._cache = cache
            self._kernels = cache.entries
            self._kernels0 = cache.entries()
            self._estimate = cache.read_record(RECORD)

    def attach_background(self, worker: Any) -> None:
        """Show ``worker``'s progress (a ``kernels.graphs.BackgroundCaptures``: ``done``, ``total``, ``failed``,
        ``finished``, ``seconds``) once ready, and keep its seconds in the compile cache record when it is done."""
        with self._lock:
            self._background = worker
        worker.on_done = self._background_done

    def _background_done(self, seconds: float, captured: int, failed: int) -> None:
        if self._cache is not None:
            record = dict(self._cache.read_record(RECORD) or {})
            record.update(background_s=round(seconds, 2), background_graphs=captured, background_failed=failed)
            self._cache.write_record(RECORD, record)

    @property
    def settled(self) -> bool:
        """Ready, and no graph is being captured in the background any more (the page stops polling)."""
        bg = self._background
        return self.ready and (bg is None or bg.finished)

    def plan(self, graphs: int) -> None:
        """Graphs the stage builds will capture in all (``config.graph_plan``), shown as ``N/M``."""
        with self._lock:
            self.planned = max(0, int(graphs))

    def phase(self, name: str) -> None:
        """End the current phase (one log line with its seconds) and start ``name``; a phase never goes back."""
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r}; phases are {', '.join(PHASES)}")
        with self._lock:
            if PHASES.index(name) <= PHASES.index(self._phase):
                return
            self._end_phase()
            self._phase = name
        if name == "ready":
            self._finish()

    def fail(self, error: str) -> None:
        """Record a start-up step that failed (the server still serves; ``/health`` says what went wrong)."""
        with self._lock:
            self.error = error

    def _end_phase(self) -> None:
        now = self._clock()
        took = now - self._phase_t0
        self._done.append((self._phase, took))
        self._phase_t0 = now
        extra = ""
        if self._phase == "capturing graphs":
            extra = f" ({self._captured()} graphs, {self._compiled()} kernels compiled)"
        log.info("start-up: %s took %.1f s%s", self._phase, took, extra)

    def _finish(self) -> None:
        snap = self.snapshot()
        log.info("start-up: ready %.1f s after the process started (%s)", snap["elapsed_s"],
                 ", ".join(f"{p['name']} {p['seconds']:.1f} s" for p in snap["phases"]))
        if self._cache is not None:
            self._cache.write_record(RECORD, {"total_s": snap["elapsed_s"], "graphs": snap["graphs_captured"],
                                              "kernels_compiled": snap["kernels_compiled"],
                                              "phases": {p["name"]: p["seconds"] for p in snap["phases"]}})

    # ------------------------------------------------------------------------------------------ views
    def _captured(self) -> int:
        return self._graphs() - self._graphs0

    def _compiled(self) -> int:
        return max(0, self._kernels() - self._kernels0) if self._kernels is not None else 0

    @property
    def cache_path(self) -> str | None:
        """The compile cache directory in use (None: none attached)."""
        return str(self._cache.path) if self._cache is not None else None

    @property
    def ready(self) -> bool:
        return self._phase == "ready"

    def line(self) -> str:
        """One line for a person (the page shows it while starting): once ready, the background captures while
        they run, else empty."""
        snap = self.snapshot()
        if snap["phase"] == "ready":
            if snap["error"]:
                return f"Start-up warm-up failed ({snap['error']}); serving anyway."
            return "Ready" + snap["status"][len("ready"):] + "." if snap["background"] and \
                not snap["background"]["finished"] else ""
        return f"Starting up ({snap['elapsed_s']:.0f} s so far): {snap['status']}"

    def snapshot(self) -> dict[str, Any]:
        """What ``/health`` shows under ``startup``: ``phase``, ``status`` (one line for a person), graphs
        captured / planned, kernels compiled, seconds elapsed and per finished phase, and ``estimate_s`` /
        ``remaining_s`` from the previous start (None without one)."""
        with self._lock:
            now = self._clock()
            phase, done = self._phase, list(self._done)
            # once ready the clock stops: the total is the sum of the phases
            elapsed = sum(s for _, s in done) if phase == "ready" else now - self._t0
            n, m, k = self._captured(), self.planned, self._compiled()
            estimate = self._estimate.get("total_s") if self._estimate else None
            bg = self._background
        background = None if bg is None else {"captured": bg.done, "planned": bg.total, "failed": bg.failed,
                                              "finished": bg.finished, "seconds": bg.seconds}
        ready = "ready"
        if background is not None and not background["finished"]:
            ready = f"ready — capturing {background['captured']}/{background['planned']} graphs in the background"
        status = {"loading weights": "loading weights",
                  "capturing graphs": f"compiling kernels and capturing graphs {n}/{max(m, n)}"
                                      + (f" ({k} kernels compiled)" if k else ""),
                  "warming up": "warming up (one short request per default backend)",
                  "ready": ready}[phase]
        remaining = None
        if isinstance(estimate, (int, float)) and phase != "ready":
            remaining = round(max(0.0, float(estimate) - elapsed), 1)
            status += f", about {remaining:.0f} s left (previous start: {float(estimate):.0f} s)"
        return {"phase": phase, "status": status, "graphs_captured": n, "graphs_planned": max(m, n),
                "kernels_compiled": k, "elapsed_s": round(elapsed, 2),
                "phases": [{"name": p, "seconds": round(s, 2)} for p, s in done],
                "estimate_s": estimate, "remaining_s": remaining, "error": self.error, "background": background}
