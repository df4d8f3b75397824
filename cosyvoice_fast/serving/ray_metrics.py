"""Export one replica's Prometheus registry through Ray's metrics, labelled by replica.

Each Serve replica owns an :class:`~cosyvoice_fast.serving.metrics.EngineMetrics` registry, but behind Serve's proxy a
``GET /metrics`` would reach whichever replica the router picks.  Ray already runs a metrics agent on every node
that Prometheus scrapes (``ray start --metrics-export-port``), so each replica copies its registry's samples into
``ray.serve.metrics.Gauge``s every few seconds; Serve tags those with ``deployment``, ``replica`` and
``application`` itself.  Every sample becomes a gauge holding its current value (a counter's running total, a
histogram's cumulative bucket counts with an ``le`` tag), so PromQL's ``rate()`` and ``histogram_quantile()``
work on them as on the originals; Ray prefixes the names with ``ray_``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

#: ``make_gauge(name, description, tag_keys)`` -> an object with ``set(value, tags=...)``
GaugeFactory = Callable[[str, str, tuple[str, ...]], Any]


def _ray_gauge(name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
    from ray.serve.metrics import Gauge

    return Gauge(name, description=description, tag_keys=tag_keys)


class RegistryMirror:
    """Copies the samples of a ``prometheus_client`` registry into gauges made by ``make_gauge``."""

    def __init__(self, registry: Any, make_gauge: GaugeFactory = _ray_gauge) -> None:
        self.registry = registry
        self.make_gauge = make_gauge
        self._gauges: dict[tuple[str, tuple[str, ...]], Any] = {}

    def copy(self) -> int:
        """Mirror every sample once; returns how many were set.  ``*_created`` timestamps are skipped."""
        n = 0
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                keys = tuple(sorted(s.labels))
                gauge = self._gauges.get((s.name, keys))
                if gauge is None:
                    gauge = self._gauges[(s.name, keys)] = self.make_gauge(s.name, family.documentation, keys)
                gauge.set(float(s.value), tags=dict(s.labels))
                n += 1
        return n

    def run_every(self, period_s: float, stop: threading.Event) -> threading.Thread:
        """Copy every ``period_s`` seconds in a daemon thread until ``stop`` is set (a failure is logged once
        per period and never reaches the replica's requests)."""

        def loop() -> None:
            while not stop.wait(period_s):
                try:
                    self.copy()
                except Exception:  # noqa: BLE001 - metrics must never take the replica down
                    log.exception("copying the replica's metrics into Ray's failed")

        t = threading.Thread(target=loop, name="ray-metrics-mirror", daemon=True)
        t.start()
        return t
