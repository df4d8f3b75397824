"""Metrics, health and the soak read the engine only through ``Engine.stats()`` (and its observer hook): an object
with nothing but that public surface is enough for them."""

from __future__ import annotations

import math
import types

import pytest

from cosyvoice_fast.serving.metrics import EngineMetrics, health, queue_wait
from cosyvoice_fast.telemetry.record import RequestTelemetry


class StatsOnly:
    """Only the engine's public seam: ``stats()``, ``add_observer`` and ``sample_rate``."""

    sample_rate = 24000

    def __init__(self, **stats):
        self.observers = []
        self.frontend = None
        self._stats = {"running": True, "active": 0, "queued": 0, "stage_sets": [], "observers": 0,
                       "max_active": 64, "stage_configs": [], "stages_built": [], "stage_variants": 3,
                       "queue_limit": 64, "llm_slots": None, **stats}

    def stats(self):
        return dict(self._stats, observers=len(self.observers))

    def add_observer(self, fn):
        self.observers.append(fn)


def value(m: EngineMetrics, name: str, labels: dict | None = None) -> float:
    return m.registry.get_sample_value(name, labels or {})


def test_gauges_read_stats_at_scrape_time():
    eng = StatsOnly(active=5, queued=3)
    m = EngineMetrics().attach(eng)
    assert value(m, "cosyvoice_queue_depth") == 3 and value(m, "cosyvoice_active_requests") == 8
    eng._stats.update(active=1, queued=0)
    assert value(m, "cosyvoice_queue_depth") == 0 and value(m, "cosyvoice_active_requests") == 1
    assert eng.observers == [m.observe]


def tele(frontend_done=1.0, admitted=math.nan, prefill_start=math.nan, error=None) -> RequestTelemetry:
    return RequestTelemetry("r", received=0.5, frontend_done=frontend_done, admitted=admitted,
                            prefill_start=prefill_start, error=error)


def test_queue_wait_is_admitted_minus_frontend_done():
    assert queue_wait(tele(admitted=1.25)) == pytest.approx(0.25)
    assert queue_wait(tele(prefill_start=1.1)) == 0.0  # started without an admission stamp: no wait
    assert math.isnan(queue_wait(tele()))  # never admitted (refused, or cancelled while queued)
    assert math.isnan(queue_wait(tele(frontend_done=math.nan)))  # the frontend refused it


def test_wait_histogram_and_refused_counter():
    m = EngineMetrics()
    m.observe(tele(admitted=1.25, prefill_start=1.3), "ok")
    m.observe(tele(admitted=3.0, prefill_start=3.1), "cancelled")
    m.observe(tele(error="EngineBusy: the engine is at its limit of 64 active requests"), "rejected")
    m.observe(tele(frontend_done=math.nan, error="PromptAudioError: could not decode"), "rejected")
    assert value(m, "cosyvoice_queue_wait_seconds_count") == 2
    assert value(m, "cosyvoice_queue_wait_seconds_sum") == pytest.approx(0.25 + 2.0)
    assert value(m, "cosyvoice_queue_wait_seconds_bucket", {"le": "0.25"}) == 1
    assert value(m, "cosyvoice_refused_total") == 1
    assert value(m, "cosyvoice_requests_total", {"outcome": "rejected"}) == 2
    assert value(m, "cosyvoice_request_errors_total", {"type": "EngineBusy"}) == 1


def test_health_reads_stats():
    cfg = {"llm": "cudagraph", "flow": "cudagraph", "vocoder": "eager", "dtype": "bf16", "incremental": False}
    eng = StatsOnly(active=2, queued=1, stage_configs=[cfg])
    models = types.SimpleNamespace(device="cpu", dtype="torch.float32")
    svc = types.SimpleNamespace(engine=eng, models=models, model_name="m", synthetic=False, frontend=None)
    h = health(svc)
    assert h["ready"] is True and h["status"] == "ok"
    assert h["backends_built"] == ["cudagraph/cudagraph/eager bf16 recompute"]
    assert h["active_requests"] == 3 and h["queued_requests"] == 1
    eng._stats["running"] = False
    assert health(svc)["ready"] is False and health(svc)["status"] == "engine stopped"


def test_soak_samples_stats():
    pytest.importorskip("psutil")
    from cosyvoice_fast.bench.soak import Resources

    eng = StatsOnly(active=2, queued=4, stage_sets=["a", "b"])
    eng.add_observer(print)
    r = Resources.sample(eng)
    assert (r.engine_active, r.engine_incoming, r.engine_stage_sets, r.engine_observers) == (2, 4, 2, 1)
