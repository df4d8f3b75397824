"""Host CPU accounting of a benchmark run: the process and each named engine worker thread."""

from __future__ import annotations

import threading
import time

import pytest

from cosyvoice_fast.bench.host_cpu import HostCpu


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def _sleep(stop: threading.Event) -> None:
    stop.wait()


@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="no per-thread CPU clocks here")
def test_a_spinning_worker_reads_near_a_core_and_a_sleeping_one_near_zero():
    stop = threading.Event()
    busy = threading.Thread(target=_spin, args=(stop,), name="cosyvoice-llm", daemon=True)
    idle = threading.Thread(target=_sleep, args=(stop,), name="cosyvoice-chunks", daemon=True)
    busy.start()
    idle.start()
    try:
        with HostCpu() as cpu:
            time.sleep(0.5)
    finally:
        stop.set()
        busy.join()
        idle.join()
    r = cpu.report()
    assert set(r) == {"host_cpu_pct", "llm_thread_cpu_pct", "chunks_thread_cpu_pct"}
    assert r["llm_thread_cpu_pct"] > 40.0  # a pure-Python loop: as much of a core as the GIL and CI give it
    assert r["chunks_thread_cpu_pct"] < 5.0
    assert r["host_cpu_pct"] >= r["llm_thread_cpu_pct"] - 1.0  # the process includes its threads


def test_workers_not_running_are_reported_as_not_measured():
    with HostCpu(workers=("no-such-thread",)) as cpu:
        time.sleep(0.01)
    r = cpu.report()
    assert r["no-such-thread_thread_cpu_pct"] is None
    assert r["host_cpu_pct"] is not None and r["host_cpu_pct"] >= 0.0
