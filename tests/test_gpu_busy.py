"""``bench --gpu-busy``: the driver's busy % sampled by nvidia-smi while the timed requests run."""

from __future__ import annotations

import os
import stat
import time

import torch

from cosyvoice_fast.bench.gpu_busy import GpuBusy


def test_samples_are_averaged_and_unreadable_lines_skipped(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    args_file = tmp_path / "args"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args_file}\nprintf '40\\n[N/A]\\n70\\n100\\n'\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuBusy(torch.device("cuda", 1), interval_ms=50) as busy:
        deadline = time.monotonic() + 10
        while len(busy.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert busy.samples == [40.0, 70.0, 100.0] and busy.percent == 70.0
    assert args_file.read_text().split() == ["-i", "1", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                             "-lms=50"]


def test_no_measurement_off_the_gpu():
    with GpuBusy(torch.device("cpu")) as busy:
        pass
    assert busy.percent is None and busy.samples == []
