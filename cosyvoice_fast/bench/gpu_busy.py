"""How busy the GPU was while a benchmark ran: the driver's "utilization.gpu" sampled by ``nvidia-smi``.

The driver reports, per sample period, the share of time in which at least one kernel was executing.  That is
the right question for a serving engine ("is the GPU ever idle, waiting for the host?"), not how full the SMs
were while busy: a GPU 95 % busy with latency-bound decode kernels still has most of its arithmetic unused.
Sampling is done by a background ``nvidia-smi -lms`` process, so it costs the measured process nothing.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading

import torch

log = logging.getLogger(__name__)


class GpuBusy:
    """``with GpuBusy(device) as busy: ...`` then ``busy.percent`` (mean over the samples; ``None`` without
    ``nvidia-smi`` or samples)."""

    def __init__(self, device: torch.device, interval_ms: int = 100):
        self.device = device
        self.interval_ms = interval_ms
        self.samples: list[float] = []
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    @property
    def percent(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None

    def __enter__(self) -> "GpuBusy":
        exe = shutil.which("nvidia-smi")
        if exe is None or self.device.type != "cuda":
            log.warning("GPU busy %% not measured: %s", "no nvidia-smi on PATH" if exe is None else "not a CUDA run")
            return self
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._proc = subprocess.Popen([exe, "-i", str(index), "--query-gpu=utilization.gpu",
                                       "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.samples.append(float(line.strip()))
            except ValueError:  # "[N/A]" on GPUs that do not report it
                continue

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        if self._reader is not None:
            self._reader.join(timeout=5)
