"""The price of the proxy: TTFB of one engine in-process against the same engine as one Ray Serve replica;
with ``--replicas 1,2,...`` the scale-out run instead (:mod:`cosyvoice_fast.bench.ray_scale`).

    python -m cosyvoice_fast.bench.serve --synthetic full --concurrency 1,16 --requests 20 --gen-tokens 150 \
        --out bench_serve.json

Both sides get the very same requests (text, saved voice, seed, token cap) on the same GPU, one after the other:
first the engine in this process (loaded exactly as a replica loads it), then that engine behind Serve's HTTP
proxy (``--replicas 1``).  TTFB is what a caller sees: from the call (in-process) or from sending the HTTP request
to holding the first audio bytes.  Each concurrency level is warmed up before it is timed.  Random-weight models
practically never stop on their own, so ``--gen-tokens`` fixes every request's length.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
from pathlib import Path
from typing import Callable

from cosyvoice_fast.bench.load import in_process, run_load, save_voice, speak, summarize

log = logging.getLogger(__name__)


def over_http(url: str, gen_tokens: int, hop_first: int) -> Callable[[int], dict]:
    """:func:`~cosyvoice_fast.bench.load.speak` through one client that keeps up to 256 connections."""
    import httpx

    client = httpx.Client(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=256))
    return lambda i: speak(client, url, i, gen_tokens, hop_first)


def measure(fn: Callable[[int], dict], levels: list[int], requests: int) -> dict[int, dict[str, float]]:
    """TTFB p50/p95 at each concurrency, after a warm-up there (graphs, batch shapes); any failed request stops
    the comparison (a TTFB beside an error would compare different work)."""
    res = {}
    for c in levels:
        run_load(fn, 10_000, c, c)
        results, wall = run_load(fn, 0, requests, c)
        s = summarize(results, wall)
        if s["errors"]:
            raise RuntimeError(f"{s['errors']} of {s['requests']} requests failed at concurrency {c}: "
                               f"{s['error_samples'][0]}")
        res[c] = {"p50_ms": s["ttfb_p50_ms"], "p95_ms": s["ttfb_p95_ms"], "n": s["requests"]}
        log.info("concurrency %d: TTFB p50 %.1f ms, p95 %.1f ms", c, res[c]["p50_ms"], res[c]["p95_ms"])
    return res


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast.bench.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--synthetic", choices=["tiny", "full"])
    ap.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--backend", help="preset or llm:flow:vocoder (default: cudagraph on GPU, eager on CPU)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--gen-tokens", type=int, default=150)
    ap.add_argument("--token-hop-len-first", type=int, default=25)
    ap.add_argument("--max-streams", type=int, default=16)
    ap.add_argument("--queue-limit", type=int, default=16)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out", default="bench_serve.json")
    scale = ap.add_argument_group("scale-out (bench/ray_scale.py): N replicas one after another on one cluster")
    scale.add_argument("--replicas", help="replica counts to run in turn, e.g. 1,2,4 (one GPU each); this mode "
                                          "ignores --concurrency and --requests")
    scale.add_argument("--per-replica", type=int, default=16, help="concurrent streams per replica (default 16)")
    scale.add_argument("--rounds", type=int, default=2, help="timed requests per stream (default 2)")
    scale.add_argument("--peak-per-replica", type=int, default=0,
                       help="at the largest count, one more level at this many streams per replica (e.g. 32: "
                            "64 streams on 2 replicas, each full with its queue in use); default: none")
    scale.add_argument("--kill-one", action="store_true",
                       help="at the largest count, kill one replica mid-load (fault, 503 and replacement checks)")
    scale.add_argument("--replacement-timeout", type=float, default=240.0,
                       help="seconds to wait for the killed replica's replacement (default 240)")
    scale.add_argument("--no-baseline", action="store_true", help="skip the in-process engine baseline")
    scale.add_argument("--prompt-wav", help="the saved voice's audio (its first 3 s; default: 3 s of noise)")
    scale.add_argument("--address", help="Ray cluster to join (auto or HOST:PORT; default: start a local Ray)")
    scale.add_argument("--cpus-per-replica", type=float, default=1.0)
    scale.add_argument("--proxy-location", choices=["EveryNode", "HeadOnly"], default="EveryNode",
                       help="HeadOnly when several Ray nodes share this machine (their proxies would clash)")
    a = ap.parse_args(argv)
    if a.replicas:
        return scale_main(a)
    levels = [int(c) for c in a.concurrency.split(",")]

    import torch

    from cosyvoice_fast.config.engine import EngineConfig
    from cosyvoice_fast.serving.ray_serve import RayServeOptions, load_replica_service, start, stop

    gpu = torch.cuda.is_available()
    speakers = tempfile.mkdtemp(prefix="bench_serve_speakers_")
    opts = RayServeOptions(engine=EngineConfig(max_streams=a.max_streams, queue_limit=a.queue_limit),
                           model_dir=a.model_dir, synthetic=a.synthetic, dtype=a.dtype, backend=a.backend,
                           speaker_dir=speakers, replicas=1, port=a.port)
    device = "cuda" if gpu else "cpu"
    svc = load_replica_service(opts, device)
    save_voice(svc, opts, None, 3.0)
    local = measure(in_process(svc, a.gen_tokens, a.token_hop_len_first), levels, a.requests)
    svc.close()
    del svc
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()  # the replica needs the memory this process held

    started = start(opts)
    try:
        served = measure(over_http(f"http://127.0.0.1:{a.port}", a.gen_tokens, a.token_hop_len_first), levels,
                         a.requests)
    finally:
        stop(started)
    name = torch.cuda.get_device_name() if gpu else "cpu"
    rows = [{"concurrency": c, "in_process": local[c], "serve": served[c],
             "p50_ratio": served[c]["p50_ms"] / local[c]["p50_ms"]} for c in levels]
    Path(a.out).write_text(json.dumps({"device": name, "args": vars(a), "rows": rows}, indent=1))
    print(f"device {name}; {a.requests} requests per level, {a.gen_tokens} tokens each")
    print(f"{'conc':>5} {'in-process p50/p95 ms':>24} {'Serve p50/p95 ms':>20} {'p50 ratio':>10}")
    for r in rows:
        print(f"{r['concurrency']:>5} {r['in_process']['p50_ms']:>12.1f} /{r['in_process']['p95_ms']:>9.1f} "
              f"{r['serve']['p50_ms']:>9.1f} /{r['serve']['p95_ms']:>8.1f} {r['p50_ratio']:>10.3f}")
    return 0


def scale_main(a: argparse.Namespace) -> int:
    """``--replicas 1,2,...``: the scale-out run of :mod:`cosyvoice_fast.bench.ray_scale`, JSON to ``--out``."""
    from cosyvoice_fast.bench.ray_scale import print_report, run_scale
    from cosyvoice_fast.config.engine import EngineConfig
    from cosyvoice_fast.serving.ray_serve import RayServeOptions

    try:
        counts = [int(n) for n in a.replicas.split(",")]
    except ValueError:
        raise SystemExit(f"--replicas {a.replicas!r}: give replica counts separated by commas, e.g. 1,2,4") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"--replicas {a.replicas!r}: every count must be at least 1")
    speakers = tempfile.mkdtemp(prefix="bench_serve_speakers_")
    opts = RayServeOptions(engine=EngineConfig(max_streams=a.max_streams, queue_limit=a.queue_limit),
                           model_dir=a.model_dir, synthetic=a.synthetic, dtype=a.dtype, backend=a.backend,
                           speaker_dir=speakers, replicas=counts[0], port=a.port, address=a.address,
                           cpus_per_replica=a.cpus_per_replica, proxy_location=a.proxy_location)
    def save(report: dict) -> None:
        Path(a.out).write_text(json.dumps({**report, "args": vars(a)}, indent=1, default=str))

    report = run_scale(opts, counts, a.per_replica, a.rounds, a.gen_tokens, a.token_hop_len_first,
                       not a.no_baseline, a.kill_one, a.prompt_wav, a.replacement_timeout, save,
                       peak_per_replica=a.peak_per_replica)
    save(report)
    print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
