"""Scale out on Ray Serve: replicas that each own one engine on one GPU (or CPU), behind Serve's HTTP proxy.

One engine on one device is the unit of serving; Ray Serve places replicas on the GPUs of one or many hosts, routes
each request to a lightly loaded replica, restarts replicas that die and exports their metrics.  Every replica
serves the project's own HTTP API (``/v1/audio/speech`` streamed, ``/v1/audio/voices``) plus ``GET /health``
through Serve's proxy, so clients cannot tell one replica from a cluster.

Requests go to the least-loaded replica of all (:mod:`~cosyvoice_fast.serving.ray_router`: Serve's count of
each replica's requests, the burst's own choices, then each engine's streams running + queued).
Limits follow the engine: a replica is sent at most ``max_streams + queue_limit`` requests (what its engine
admits, running plus waiting in its admission queue); beyond that requests wait in the proxy, up to
``max_queued_requests``, then get 503 with a Retry-After.
A replica whose engine worker stopped fails its health check and is replaced.  Saved speakers live in one shared
directory (``--speaker-dir``; a network file system across hosts), read by every replica.
"""

from __future__ import annotations

import faulthandler
import hashlib
import logging
import os
import signal
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI
from ray import serve

from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.serving.ray_metrics import RegistryMirror
from cosyvoice_fast.config.yamlfile import ConfigError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
APP_NAME = "cosyvoice"


@dataclass(frozen=True)
class RayServeOptions:
    """Everything a Serve deployment of the engine needs (picklable: it travels to every replica).

    ``replicas`` is a fixed count unless ``max_replicas`` is set (then Serve autoscales between ``min_replicas``
    and ``max_replicas``, aiming at ``target_ongoing`` requests per replica).  ``gpus_per_replica`` is ignored on
    a cluster without GPUs (CPU replicas).  ``max_queued_requests`` is how many requests each proxy holds while
    every replica is full before answering 503 (``None``: what all replicas admit together, so that a burst, whose
    requests all sit in the proxy's queue for a moment before assignment, is not turned away)."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_streams=16, queue_limit=16))
    model_dir: str | None = None
    synthetic: str | None = None
    device: str = "auto"
    dtype: str | None = None
    backend: str | None = None
    speaker_dir: str = "speakers"
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int | None = None
    target_ongoing: float | None = None
    gpus_per_replica: float = 1.0
    cpus_per_replica: float = 1.0
    max_queued_requests: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None
    proxy_location: str = "EveryNode"
    metrics_period_s: float = 5.0
    health_check_period_s: float = 5.0

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, what: str) -> None:
            if not cond:
                raise ConfigError(f"RayServeOptions.{name} {what}, got {getattr(self, name)!r}")

        need(isinstance(self.engine, EngineConfig), "engine", "must be an EngineConfig")
        need(isinstance(self.replicas, int) and self.replicas >= 1, "replicas", "must be at least 1")
        need(isinstance(self.min_replicas, int) and self.min_replicas >= 0, "min_replicas", "must be 0 or more")
        need(self.max_replicas is None or (isinstance(self.max_replicas, int) and self.max_replicas >= max(
            1, self.min_replicas)), "max_replicas", "must be at least 1 and at least min_replicas")
        need(self.target_ongoing is None or self.target_ongoing > 0, "target_ongoing", "must be positive")
        need(0 <= self.gpus_per_replica <= 8, "gpus_per_replica", "must be from 0 to 8 (fractions share a GPU)")
        need(self.cpus_per_replica > 0, "cpus_per_replica", "must be positive")
        need(self.max_queued_requests is None or self.max_queued_requests >= 1, "max_queued_requests",
             "must be at least 1")
        need(isinstance(self.port, int) and 0 < self.port < 65536, "port", "must be a TCP port (1-65535)")
        need(self.metrics_period_s > 0, "metrics_period_s", "must be positive")
        need(self.health_check_period_s > 0, "health_check_period_s", "must be positive")
        need(self.proxy_location in ("EveryNode", "HeadOnly"), "proxy_location", "must be EveryNode or HeadOnly")
        need(self.dtype in (None, "fp32", "fp16", "bf16"), "dtype", "must be fp32, fp16 or bf16")
        if self.backend is not None:
            backend_config(self.backend, "fp32")  # a bad name fails here, in the driver, not in every replica

    @property
    def capacity(self) -> int:
        """Requests one replica's engine admits: running plus waiting in its admission queue."""
        return self.engine.max_streams + self.engine.queue_limit


def backend_config(name: str, dtype: str) -> Any:
    """A backend preset (``eager``, ``cudagraph``, ``fused``...) or ``llm:flow:vocoder``.  Imported here: the
    presets import torch, which the Ray driver does not otherwise need."""
    from cosyvoice_fast.config.presets import parse_backend

    return parse_backend(name, dtype, "RayServeOptions.backend")


# ------------------------------------------------------------------------------------------------ the replica
def load_replica_service(opts: RayServeOptions, device: str) -> Any:
    """Load the models and an engine sized by ``opts.engine`` whose default backend (what requests that name none
    get) is ``opts.backend``: by default cudagraph on a GPU, the eager reference on CPU."""
    from cosyvoice_fast.config.backends import BackendConfig
    from cosyvoice_fast.serving.service import load_service

    dtype = opts.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    name = opts.backend or ("cudagraph" if device.startswith("cuda") else None)
    backend = backend_config(name, dtype) if name else BackendConfig(dtype=dtype)
    return load_service(opts.model_dir, opts.synthetic, device, dtype, speaker_cache_dir=opts.speaker_dir,
                        progress=False, backend=backend, engine_config=opts.engine)


class _ReplicaHeaders:
    """ASGI middleware naming the replica (Serve's replica id and the process id) on every response, so a
    client, a log line or a test can tell which replica served a stream."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.extra = [(b"x-replica-pid", str(os.getpid()).encode()), (b"x-replica", replica.encode())]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + self.extra}
            await send(message)

        await self.app(scope, receive, send_with)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica
        return "local"


def build_asgi_app(get_service: Callable[[], Any]) -> FastAPI:
    """A replica's HTTP app: the project's ``/v1`` routes and ``GET /health``, naming the replica on responses."""
    api = FastAPI(title="cosyvoice_fast on Ray Serve")
    from cosyvoice_fast.serving.http import create_api_router

    api.include_router(create_api_router(get_service))
    api.add_middleware(_ReplicaHeaders, replica=_replica_id())

    @api.get("/health")
    def health_route() -> dict:
        """This replica's readiness (model, device, engine stats) and its id."""
        from cosyvoice_fast.serving.metrics import health

        svc = get_service()
        return {**health(svc), "replica": _replica_id(), "pid": os.getpid(), "engine": svc.engine.stats()}

    return api


@serve.deployment(name="TTSReplica")
@serve.ingress()
class TTSReplica:
    """One engine on one device; its HTTP app is built in the replica (nothing of it is pickled)."""

    def __init__(self, opts: RayServeOptions, device: str) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        try:  # `kill -USR1 <pid>` writes every thread's stack into this replica's log: what a stalled replica waits on
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (AttributeError, RuntimeError, ValueError):  # no such signal on this platform
            pass
        if device == "cpu":
            import torch

            torch.set_num_threads(max(1, int(opts.cpus_per_replica)))  # not every core of the host per replica
        self.service = load_replica_service(opts, device)
        self._stop = threading.Event()
        metrics = getattr(self.service, "metrics", None)
        if metrics is not None:
            mirror = RegistryMirror(metrics.registry)
            mirror.copy()
            mirror.run_every(opts.metrics_period_s, self._stop)
        log.info("replica %s (pid %d) ready: %s on %s, %d requests admitted", _replica_id(), os.getpid(),
                 self.service.model_name, device, opts.capacity)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_asgi_app(lambda: self.service)

    def record_routing_stats(self) -> dict:
        """This replica's engine load for the router (:mod:`~cosyvoice_fast.serving.ray_router`), every second."""
        st = self.service.engine.stats()
        return {"active": int(st["active"]), "queued": int(st["queued"])}

    def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; raising marks the replica unhealthy (replaced)."""
        stats = self.service.engine.stats()
        if not stats["running"]:
            raise RuntimeError("the engine's worker thread has stopped: this replica cannot synthesise")

    def __del__(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
        if getattr(self, "service", None) is not None:
            self.service.close()


# ------------------------------------------------------------------------------------------------ the app
def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0))


def build_app(opts: RayServeOptions, gpus_available: float) -> Any:
    """The bound Serve application for ``opts`` on a cluster with ``gpus_available`` GPUs."""
    gpus = opts.gpus_per_replica if gpus_available > 0 else 0.0
    device = opts.device if opts.device != "auto" else ("cuda" if gpus > 0 else "cpu")
    if gpus and opts.replicas * gpus > gpus_available:
        log.warning("%d replicas x %g GPUs need %g GPUs but the cluster has %g: the extra replicas wait for one "
                    "(add hosts with `ray start --address ...` or lower --replicas)", opts.replicas, gpus,
                    opts.replicas * gpus, gpus_available)
    scaling: dict[str, Any] = {"num_replicas": opts.replicas}
    if opts.max_replicas is not None:
        scaling = {"autoscaling_config": {
            "min_replicas": opts.min_replicas, "max_replicas": opts.max_replicas,
            "initial_replicas": min(max(opts.replicas, opts.min_replicas), opts.max_replicas),
            "target_ongoing_requests": opts.target_ongoing or opts.engine.max_streams}}
    from ray.serve.config import BackpressureConfig, RequestRouterConfig

    from cosyvoice_fast.serving.ray_router import LeastLoadedRouter

    # What a replica is built from, without the replica count: redeploying with another count (bench's scale-out,
    # an operator's `--replicas`) keeps the running replicas (a stable `version`) and only adds or removes some.
    replica_opts = replace(opts, replicas=1, min_replicas=1, max_replicas=None, target_ongoing=None,
                           max_queued_requests=None, address=None, proxy_location="EveryNode")
    deployment = TTSReplica.options(
        max_ongoing_requests=opts.capacity,
        max_queued_requests=opts.max_queued_requests or opts.capacity * (opts.max_replicas or opts.replicas),
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1),
        request_router_config=RequestRouterConfig(request_router_class=LeastLoadedRouter,
                                                  request_routing_stats_period_s=1.0),
        ray_actor_options={"num_gpus": gpus, "num_cpus": opts.cpus_per_replica},
        health_check_period_s=opts.health_check_period_s,
        **scaling,
    )
    # Ray 2.60 removed `version=` from the public options and gives every `serve.run` a random code version,
    # which restarts every replica (~100 s each with captured graphs); a version derived from what the replicas
    # are built from makes a new replica count a lightweight update, as Serve's own config deploys do.
    deployment._version = hashlib.sha256(repr((replica_opts, device, gpus)).encode()).hexdigest()[:16]
    return deployment.bind(replica_opts, device)


def start(opts: RayServeOptions) -> bool:
    """Connect to (``opts.address``) or start a local Ray, start Serve's proxy and deploy the app; returns
    whether this call started Ray itself (then :func:`stop` shuts it down)."""
    import ray

    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}}
    started = not ray.is_initialized() and opts.address is None
    if not ray.is_initialized():
        ray.init(address=opts.address, runtime_env=runtime_env, include_dashboard=False)
    serve.start(proxy_location=opts.proxy_location, http_options={"host": opts.host, "port": opts.port})
    deploy(opts)
    return started


def deploy(opts: RayServeOptions) -> None:
    """(Re)deploy the app with ``opts`` on the connected cluster, waiting until its replicas are healthy.  Only
    the replica count changed: the running replicas stay and replicas are added or removed."""
    serve.run(build_app(opts, cluster_gpus()), name=APP_NAME, route_prefix="/", blocking=False)


def replica_actor_name(replica_id: str) -> str:
    """The Ray actor name of this app's replica ``replica_id`` (the ``x-replica`` header of its responses)."""
    return f"SERVE_REPLICA::{APP_NAME}#TTSReplica#{replica_id}"


def kill_replica(replica_id: str) -> None:
    """Kill one replica's actor (its process) as a crash would; Serve starts a replacement."""
    import ray

    ray.kill(ray.get_actor(replica_actor_name(replica_id), namespace="serve"), no_restart=True)


def stop(started_ray: bool) -> None:
    """Take the app down; and Serve and Ray too when :func:`start` started them (Ray is shut down even when
    Serve's shutdown fails, so no Ray process outlives the command)."""
    import ray

    try:
        if started_ray:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    finally:
        if started_ray:
            ray.shutdown()
