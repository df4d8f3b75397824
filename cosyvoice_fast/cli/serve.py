"""``python -m cosyvoice_fast serve --ray``: options and the blocking entry point (Ray is imported only here)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from cosyvoice_fast.config.flags import add_cli_args, from_cli_args

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", action="store_true", required=True,
                   help="serve on Ray Serve: one engine per replica, replicas on the GPUs of one or many hosts")
    p.add_argument("--model-dir", help="CosyVoice2-0.5B directory, the same path on every host")
    p.add_argument("--synthetic", choices=["tiny", "full", "tiny3", "full3"],
                   help="random-weight model of that size (no download; tiny3/full3: CosyVoice3)")
    p.add_argument("--device", default="auto", help="replica device (default: cuda when the replica has a GPU)")
    p.add_argument("--dtype", dest="replica_dtype", choices=["fp32", "fp16", "bf16"],
                   help="replica precision (default: bf16 on GPU replicas, fp32 on CPU ones)")
    p.add_argument("--backend", help="backend preset (eager, cudagraph, tensorrt, ...) or llm:flow:vocoder "
                                     "(default: cudagraph on GPU, eager on CPU)")
    p.add_argument("--address", help="Ray cluster to join: auto (the one `ray start --head` started on this host) "
                                     "or HOST:PORT; default: start a local Ray on this host")
    p.add_argument("--replicas", type=int, default=1, help="replicas (engines) to run (default 1)")
    p.add_argument("--gpus-per-replica", type=float, default=1.0,
                   help="GPUs each replica reserves (default 1; ignored on a cluster without GPUs: CPU replicas)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs each replica reserves (default 1)")
    p.add_argument("--min-replicas", type=int, default=1, help="autoscaling lower bound (with --max-replicas)")
    p.add_argument("--max-replicas", type=int, help="autoscale between --min-replicas and this")
    p.add_argument("--target-ongoing", type=float,
                   help="autoscaling target: requests per replica (default: --max-streams)")
    p.add_argument("--max-queued-requests", type=int,
                   help="requests each proxy holds while every replica is full before answering 503 "
                        "(default: what all replicas admit together)")
    p.add_argument("--speaker-dir", default="speakers",
                   help="saved speakers, shared by every replica (a network file system path across hosts)")
    p.add_argument("--host", default="127.0.0.1", help="interface of Serve's HTTP proxy (0.0.0.0 for every one)")
    p.add_argument("--port", type=int, default=8000, help="port of Serve's HTTP proxy (default 8000)")
    p.add_argument("--proxy-location", choices=["EveryNode", "HeadOnly"], default="EveryNode",
                   help="an HTTP proxy on every host of the cluster (default), or on the head only (several Ray "
                        "nodes on one machine would otherwise clash on --port)")
    add_cli_args(p, parts=("engine",))  # each replica's EngineConfig: the same flags as every other tool


def options_from_args(a: argparse.Namespace) -> Any:
    """The validated :class:`~cosyvoice_fast.serving.ray_serve.RayServeOptions` of the command line."""
    from pathlib import Path

    from cosyvoice_fast.serving.ray_serve import RayServeOptions

    return RayServeOptions(
        engine=from_cli_args(a).engine, model_dir=a.model_dir,
        synthetic=a.synthetic, device=a.device, dtype=a.replica_dtype, backend=a.backend,
        speaker_dir=str(Path(a.speaker_dir).resolve()), replicas=a.replicas, min_replicas=a.min_replicas,
        max_replicas=a.max_replicas, target_ongoing=a.target_ongoing, gpus_per_replica=a.gpus_per_replica,
        cpus_per_replica=a.cpus_per_replica, max_queued_requests=a.max_queued_requests, host=a.host, port=a.port,
        address=a.address, proxy_location=a.proxy_location)


def cmd_serve(a: argparse.Namespace) -> int:
    """Deploy, print where it answers, and serve until Ctrl-C / SIGTERM (then take the app down)."""
    opts = options_from_args(a)
    from cosyvoice_fast.serving.ray_serve import start, stop

    started = start(opts)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    host = "127.0.0.1" if opts.host in ("0.0.0.0", "::") else opts.host
    count = str(opts.replicas) if opts.max_replicas is None else f"{opts.min_replicas}-{opts.max_replicas}"
    print(f"serving on http://{host}:{opts.port}/v1/audio/speech ({count} replicas, {opts.capacity} requests "
          "each); Ctrl-C stops", flush=True)
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave Ray half shut down
        stop(started)
    return 0
