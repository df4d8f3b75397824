"""The step runner the GPU benchmark scripts share (``bf16_error.py``).

These scripts run as a single call on a remote GPU machine under a hard wall-clock limit, and only what they
have written under ``$OUT`` comes back.  So each measurement is a named *step*: it runs under its own time limit
(a hung or slow step costs that step, not the call), its result or failure is recorded, and the JSON results file
is rewritten after every step, so a call that is killed still leaves everything measured before it.

Results layout (the keys the scripts' JSON files have always had, plus the status maps)::

    results[name]                 the step's return value, or {"error": "..."} when it failed
    results["step_seconds"][name] wall seconds the step took
    results["step_status"][name]  "ok" | "error" | "timeout" | "skipped" (the script's time budget was spent)
    results["step_errors"][name]  the failure message of every step that did not finish

The time limit is a ``SIGALRM`` interval timer, so it only works in the main thread, and it interrupts Python
code: a single blocking call into CUDA (a synchronize on a hung kernel) returns before the step can be stopped.
The call's own wall-clock limit covers that case.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable

__all__ = ["StepRunner", "StepTimeout", "require_cuda"]


class StepTimeout(BaseException):
    """Raised inside a step when its time limit is reached.

    A ``BaseException``, not an ``Exception``: steps often catch ``Exception`` so that one failing variant does
    not hide the others, and such a handler must not swallow the step's time limit.
    """


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise StepTimeout()


class StepRunner:
    """Runs named steps under per-step time limits and keeps ``results`` on disk after every step.

    ``out`` is the JSON file rewritten after each step (atomically: a call killed mid-write still leaves the
    previous complete file).  ``step_timeout`` is the default limit in seconds; ``budget_s``, when given, caps
    the whole run: each step's limit shrinks to the time left, and steps after the budget are recorded as
    skipped, so a script can promise to finish inside its caller's limit.  ``echo_chars`` bounds the line
    printed per step (only the tail of a remote call's output comes back).
    """

    def __init__(self, out: str | Path, results: dict[str, Any] | None = None, step_timeout: float = 150.0,
                 budget_s: float | None = None, echo_chars: int = 400) -> None:
        self.out = Path(out)
        self.results: dict[str, Any] = {} if results is None else results
        self.step_timeout = step_timeout
        self.budget_s = budget_s
        self.echo_chars = echo_chars
        self.started = time.monotonic()
        self.out.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        """Rewrite the JSON file now (steps that append to ``results`` themselves may call it mid-step)."""
        tmp = self.out.with_name(f".{self.out.name}.tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(tmp, self.out)

    def status(self, name: str) -> str | None:
        """``"ok"``, ``"error"``, ``"timeout"`` or ``"skipped"`` for a step that ran, else None."""
        return self.results.get("step_status", {}).get(name)

    def ok(self, name: str) -> bool:
        """Whether step ``name`` ran to completion (later steps that need its result check this)."""
        return self.status(name) == "ok"

    def remaining_s(self) -> float | None:
        """Seconds left of ``budget_s`` (None without a budget)."""
        if self.budget_s is None:
            return None
        return self.budget_s - (time.monotonic() - self.started)

    def run(self, name: str, fn: Callable[[], Any], timeout: float | None = None, store: bool = True) -> Any:
        """Run ``fn()`` as step ``name``; return its value, or None when it failed, timed out or was skipped.

        With ``store`` the value goes to ``results[name]`` (``{"error": ...}`` on failure); without it the step
        is expected to put what it measures into ``results`` itself (e.g. appending to lists) and only the
        status, the seconds and any failure message are recorded.  The file is saved afterwards either way.
        """
        limit = self.step_timeout if timeout is None else timeout
        left = self.remaining_s()
        t0 = time.monotonic()
        if left is not None and left < 1.0:
            status, value, message = "skipped", None, f"skipped: the time budget of {self.budget_s:g} s was spent"
        else:
            status, value, message = _call(fn, limit if left is None else min(limit, left))
        seconds = time.monotonic() - t0
        if store:
            self.results[name] = value if status == "ok" else {"error": message}
        self.results.setdefault("step_seconds", {})[name] = round(seconds, 1)
        self.results.setdefault("step_status", {})[name] = status
        if status != "ok":
            self.results.setdefault("step_errors", {})[name] = message
        shown = (json.dumps(value, default=str) if store else "ok") if status == "ok" else message
        print(f"[{name}] {seconds:.1f} s: {shown[:self.echo_chars]}", flush=True)
        self.save()
        return value


def _call(fn: Callable[[], Any], limit: float) -> tuple[str, Any, str]:
    """``fn()`` under a ``limit``-second alarm -> (status, value, failure message)."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, max(limit, 0.001))
            return "ok", fn(), ""
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    # outside the inner try: an alarm that fires just as fn returns, before the timer is cleared, lands here too
    except StepTimeout:
        return "timeout", None, f"timed out after {limit:g} s"
    except Exception as e:  # noqa: BLE001 - record and go on to the next step
        return "error", None, f"{type(e).__name__}: {e}"[:500]
    finally:
        signal.signal(signal.SIGALRM, previous)


def require_cuda(script: str) -> None:
    """Exit with status 2 and a clear message when no CUDA GPU is visible (these scripts measure only GPUs)."""
    import torch

    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (torch.cuda.is_available() is False, torch {torch.__version__}): "
              "run it on the GPU machine.", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":  # a library, not a script: ``--help`` says what it is
    print(__doc__)
