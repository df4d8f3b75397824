"""Serve's request router for the TTS replicas: the least-loaded replica of all, ties broken evenly.

Serve's default router compares two random replicas by their ongoing requests, read from a cache that a burst
outruns: the requests of a burst are routed concurrently, each probing replicas that all still report 0, so ties
are broken at random (a 16-stream burst on 2 replicas split 11/5 as often as 8/8).  For streaming TTS a request is
a stream for seconds, so an uneven burst stays uneven.  This router ranks *every* replica (N is small: one per
GPU) by

1. the requests in flight there: this proxy's own count (sent minus completed, exact for the streams it holds)
   or Serve's cached count for the replica, whichever is higher, plus the requests this router chose it for in
   the last second that have not been sent yet (so the concurrent choices of a burst see each other),
2. then the replica's own engine load, streams running + queued (``record_routing_stats`` of the replica, every
   second), for the ties of equal counts.

Serve then sends the request to the first replica in that order that accepts it (below ``max_ongoing_requests``).
Ray cloudpickles this module by value for every proxy, so it imports nothing of the project.
"""

from __future__ import annotations

import random
import time
from typing import Any, List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

#: seconds a choice counts against its replica before Serve reports the request routed
RESERVATION_S = 1.0


class LeastLoadedRouter(FIFOMixin, RequestRouter):
    """Rank all replicas by (in flight + reserved, engine load); see the module doc."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._state()

    def _state(self) -> None:
        if not hasattr(self, "_reserved"):
            self._reserved: dict[Any, list[float]] = {}
            self._inflight: dict[Any, int] = {}

    def _reservations(self, replica_id: Any, now: float) -> int:
        live = [t for t in self._reserved.get(replica_id, []) if now - t < RESERVATION_S]
        self._reserved[replica_id] = live
        return len(live)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._state()
        now = time.monotonic()
        cache = self.replica_queue_len_cache
        for r in candidate_replicas:
            if cache.get(r.replica_id) is None:
                # what this proxy has in flight there: Serve then sends without probing first (a probe that
                # misses its 0.1 s deadline on a busy host sent the request to the other replica instead)
                cache.update(r.replica_id, self._inflight.get(r.replica_id, 0))

        def key(r: RunningReplica) -> tuple:
            stats = r.routing_stats or {}
            engine = int(stats.get("active", 0)) + int(stats.get("queued", 0))
            ongoing = max(cache.get(r.replica_id) or 0, self._inflight.get(r.replica_id, 0))
            return ongoing + self._reservations(r.replica_id, now), engine, random.random()

        ranked = sorted(candidate_replicas, key=key)
        self._reserved.setdefault(ranked[0].replica_id, []).append(now)
        return [[r] for r in ranked]

    def on_send_request(self, replica_id: Any) -> None:
        """Counted from here on (Serve's cache and ours): drop the oldest reservation of that replica."""
        super().on_send_request(replica_id)
        self._state()
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1
        held = self._reserved.get(replica_id)
        if held:
            held.pop(0)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._state()
        self._inflight[replica_id] = max(0, self._inflight.get(replica_id, 0) - 1)
