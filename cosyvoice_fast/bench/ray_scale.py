"""Scale-out through Ray Serve: N = 1, 2, 4... replicas of one engine each, one after another on one cluster.

    python -m cosyvoice_fast.bench.serve --replicas 1,2 --synthetic full --backend cudagraph --dtype bf16 \\
        --gen-tokens 150 --per-replica 16 --kill-one --out scale.json

Each level sends the same requests (text, saved voice, seed, token cap) at ``per_replica x N`` concurrent streams,
``rounds`` requests per stream, after a warm-up of one request per stream; it reports TTFB p50/p95/max (from
sending the request to holding the first audio bytes), audio-seconds per second of wall time, errors and how
many requests each replica served (the ``x-replica`` header).  Ray starts once; a level only changes the
replica count (the running replicas stay: start-up with captured graphs takes ~100 s per replica).  The
in-process engine at 1 and ``per_replica`` streams is the baseline (proxy overhead = Serve TTFB at 1 minus
in-process TTFB at 1).  ``kill_one``: at the largest N, one replica is killed while every stream is in flight;
its streams must end with an error within seconds, every other stream must complete, the cluster must answer
503 with Retry-After (not hang) while it is short of capacity, and the replacement must serve again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from cosyvoice_fast.telemetry.record import percentile

log = logging.getLogger(__name__)

VOICE = "bench"
SAMPLE_RATE = 24000


def body(i: int, gen_tokens: int, hop_first: int) -> dict:
    return {"input": f"benchmark sentence number {i}, long enough to be a typical request.", "voice": VOICE,
            "seed": i, "max_tokens": gen_tokens, "token_hop_len_first": hop_first, "response_format": "pcm"}


def speak(client: Any, url: str, i: int, gen_tokens: int, hop_first: int,
          on_first: Callable[[dict], None] | None = None) -> dict:
    """One streamed request: ``status``, ``replica``, ``ttfb_s``, ``audio_s``, ``end`` (monotonic) and, when it
    failed, ``error`` (an HTTP status with its message, or the broken transfer)."""
    out: dict[str, Any] = {"i": i, "ttfb_s": float("nan"), "audio_s": 0.0}
    t0 = time.perf_counter()
    n = 0
    try:
        with client.stream("POST", f"{url}/v1/audio/speech", json=body(i, gen_tokens, hop_first)) as r:
            out.update(status=r.status_code, replica=r.headers.get("x-replica"),
                       retry_after=r.headers.get("retry-after"))
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                return out
            for data in r.iter_raw():
                if data and n == 0:
                    out["ttfb_s"] = time.perf_counter() - t0
                    if on_first is not None:
                        on_first(out)
                n += len(data)
    except Exception as e:  # noqa: BLE001 - a broken stream is a result here
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["end"] = time.monotonic()
        out["audio_s"] = n / 2 / SAMPLE_RATE
    return out


def run_load(fn: Callable[[int], dict], first: int, n: int, concurrency: int) -> tuple[list[dict], float]:
    """``fn(i)`` for i in first..first+n-1, ``concurrency`` at a time; the results and the wall time."""
    out: list[dict] = []
    lock = threading.Lock()
    todo = iter(range(first, first + n))

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            r = fn(i)
            with lock:
                out.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def summarize(results: list[dict], wall_s: float) -> dict:
    """TTFB p50/p95/max (ms) of the successful requests, audio-s/s, errors and the per-replica split."""
    ok = [r for r in results if "error" not in r]
    ttfb = [r["ttfb_s"] * 1e3 for r in ok]
    split: dict[str, int] = {}
    for r in results:
        key = r.get("replica") or "none"
        split[key] = split.get(key, 0) + 1
    errors = [r["error"] for r in results if "error" in r]
    return {"requests": len(results), "ok": len(ok), "errors": len(errors), "error_samples": errors[:3],
            "ttfb_p50_ms": percentile(ttfb, 50), "ttfb_p95_ms": percentile(ttfb, 95),
            "ttfb_max_ms": max(ttfb, default=float("nan")), "wall_s": wall_s,
            "audio_s_per_s": sum(r["audio_s"] for r in ok) / wall_s if wall_s > 0 else float("nan"),
            "per_replica": dict(sorted(split.items(), key=lambda kv: -kv[1]))}


def wait_healthy(replicas: int, timeout_s: float) -> float:
    """Seconds until the app runs ``replicas`` healthy replicas (raises TimeoutError after ``timeout_s``)."""
    from ray import serve

    from cosyvoice_fast.serving.ray_serve import APP_NAME

    t0 = time.monotonic()
    while True:
        try:
            st = serve.status().applications[APP_NAME].deployments["TTSReplica"]
            if str(st.status).endswith("HEALTHY") and st.replica_states.get("RUNNING", 0) == replicas:
                return time.monotonic() - t0
        except KeyError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{replicas} healthy replicas not reached in {timeout_s:.0f} s")
        time.sleep(1.0)


def wait_lost(replicas: int, since: float, timeout_s: float) -> float:
    """Seconds from ``since`` until Serve no longer counts ``replicas`` running (a killed one noticed), so that
    waiting for the replacement does not return on the status from before the kill."""
    from ray import serve

    from cosyvoice_fast.serving.ray_serve import APP_NAME

    while time.monotonic() - since < timeout_s:
        st = serve.status().applications[APP_NAME].deployments["TTSReplica"]
        if not str(st.status).endswith("HEALTHY") or st.replica_states.get("RUNNING", 0) < replicas:
            return time.monotonic() - since
        time.sleep(0.5)
    raise TimeoutError(f"Serve still counted {replicas} running replicas {timeout_s:.0f} s after the kill")


def kill_phase(client: Any, url: str, n: int, per_replica: int, gen_tokens: int, hop_first: int, burst: int,
               replacement_timeout_s: float) -> dict:
    """Kill one of ``n`` replicas while ``n x per_replica`` streams are in flight (every stream has its first
    audio; the victim is the replica holding the most); then ``burst`` short requests at once while capacity is
    short (more than the survivors and the proxy hold: some must be refused with 503, none may hang) and, within
    ``replacement_timeout_s``, the replacement serving again."""
    from cosyvoice_fast.serving.ray_serve import kill_replica

    streams = n * per_replica
    started = threading.Barrier(streams + 1, timeout=300)
    inflight: list[dict] = []
    lock = threading.Lock()

    def first(out: dict) -> None:
        with lock:
            inflight.append(out)
        started.wait()

    def one(i: int) -> None:
        r = speak(client, url, i, gen_tokens, hop_first, on_first=first)
        if r["ttfb_s"] != r["ttfb_s"]:
            started.abort()  # failed before its first audio: nothing left to wait for
        with lock:
            outs.append(r)

    outs: list[dict] = []
    threads = [threading.Thread(target=one, args=(20_000 + i,)) for i in range(streams)]
    for t in threads:
        t.start()
    try:
        started.wait()
    except threading.BrokenBarrierError:
        for t in threads:
            t.join()
        return {"error": "a stream failed before every stream had its first audio", "streams": summarize(outs, 1)}
    counts: dict[str, int] = {}
    for r in inflight:
        counts[r["replica"]] = counts.get(r["replica"], 0) + 1
    victim = max(counts, key=counts.get)
    killed_at = time.monotonic()
    kill_replica(victim)
    # capacity is short now: a burst beyond what the survivors and the proxy hold must be refused, not hang
    sent, _ = run_load(lambda i: speak(client, url, i, 5, hop_first), 30_000, burst, burst)
    for t in threads:
        t.join()
    lost = [r for r in outs if r.get("replica") == victim]
    kept = [r for r in outs if r.get("replica") != victim]
    refused = [r for r in sent if r.get("status") == 503]
    res: dict[str, Any] = {
        "in_flight_per_replica": counts, "victim": victim, "victim_streams": len(lost),
        "victim_streams_done_before_kill": sum(1 for r in lost if r["end"] < killed_at),
        "victim_streams_with_error": sum(1 for r in lost if "error" in r),
        "victim_error_after_kill_s_max": max((r["end"] - killed_at for r in lost), default=float("nan")),
        "victim_error_samples": [r.get("error") for r in lost[:2]],
        "survivor_streams": len(kept), "survivor_streams_ok": sum(1 for r in kept if "error" not in r),
        "survivor_error_samples": [r["error"] for r in kept if "error" in r][:3],
        "burst_requests": len(sent), "burst_503": len(refused),
        "burst_503_retry_after": sorted({str(r.get("retry_after")) for r in refused}),
        "burst_503_answered_after_kill_s_max": max((r["end"] - killed_at for r in refused), default=float("nan")),
        "burst_ok": sum(1 for r in sent if "error" not in r),
        "burst_other_errors": [r["error"] for r in sent if "error" in r and r.get("status") != 503][:3],
        "burst_done_after_kill_s_max": max((r["end"] - killed_at for r in sent), default=float("nan"))}
    try:
        res["replica_lost_seen_after_kill_s"] = wait_lost(n, killed_at, 60)
        wait_healthy(n, max(1.0, replacement_timeout_s - (time.monotonic() - killed_at)))
        res["replacement_healthy_after_kill_s"] = time.monotonic() - killed_at
        after, wall = run_load(lambda i: speak(client, url, i, gen_tokens, hop_first), 40_000, 2 * n, 2 * n)
        res["after_replacement"] = summarize(after, wall)
    except TimeoutError as e:
        res["replacement"] = str(e)
    return res


# ------------------------------------------------------------------------------------------------ the run
def save_voice(svc: Any, opts: Any, prompt_wav: str | None, seconds: float) -> None:
    """Save the ``bench`` voice into the replicas' speaker directory: ``seconds`` of ``prompt_wav`` (or of noise:
    the synthetic model's audio is noise anyway), through the loaded service's frontend or a bare one."""
    import numpy as np

    if svc is not None:
        frontend = svc.frontend
    else:
        from cosyvoice_fast.frontend.pipeline import Frontend
        from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

        root = opts.model_dir or synthetic_model_dir(opts.synthetic or "tiny")
        frontend = Frontend.from_model_dir(root, speaker_cache_dir=opts.speaker_dir)
    if prompt_wav:
        from cosyvoice_fast.frontend.audio import load_audio

        wav, sr = load_audio(prompt_wav)
    else:
        sr = SAMPLE_RATE
        wav = np.random.default_rng(0).standard_normal(int(seconds * sr)).astype(np.float32) * 0.1
    frontend.add_speaker(VOICE, wav[: int(seconds * sr)], sr, "a short transcript")


def in_process(svc: Any, gen_tokens: int, hop_first: int) -> Callable[[int], dict]:
    """The same request as :func:`speak`, to the engine in this process."""
    from cosyvoice_fast.config.stream import StreamParams
    from cosyvoice_fast.frontend.request import SynthesisRequest

    def one(i: int) -> dict:
        b = body(i, gen_tokens, hop_first)
        req = SynthesisRequest(text=b["input"], mode="speaker", speaker=VOICE, seed=i, max_tokens=gen_tokens,
                               stream_params=StreamParams(token_hop_len_first=hop_first))
        out: dict[str, Any] = {"i": i, "ttfb_s": float("nan"), "audio_s": 0.0, "replica": "in-process"}
        t0 = time.perf_counter()
        try:
            for chunk in svc.engine.stream(req):
                if out["ttfb_s"] != out["ttfb_s"]:
                    out["ttfb_s"] = time.perf_counter() - t0
                out["audio_s"] += len(chunk.samples) / SAMPLE_RATE
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {e}"
        out["end"] = time.monotonic()
        return out

    return one


def level(fn: Callable[[int], dict], concurrency: int, rounds: int) -> dict:
    """Warm up with one request per stream, then ``rounds`` requests per stream at ``concurrency`` (at least 8
    requests at one stream: the proxy overhead is read there)."""
    run_load(fn, 10_000, concurrency, concurrency)
    results, wall = run_load(fn, 0, rounds * concurrency if concurrency > 1 else max(8, rounds), concurrency)
    return {"concurrency": concurrency, **summarize(results, wall)}


def run_scale(opts: Any, counts: list[int], per_replica: int, rounds: int, gen_tokens: int, hop_first: int,
              baseline: bool, kill_one: bool, prompt_wav: str | None, replacement_timeout_s: float,
              save: Callable[[dict], None] = lambda r: None) -> dict:
    """The whole scale-out run (module doc); returns what the JSON report holds, handing it to ``save`` after
    every phase too (a run cut short by a time limit keeps what it measured)."""
    import gc

    import httpx
    import torch

    from cosyvoice_fast.serving.ray_serve import deploy, load_replica_service, start, stop

    gpu = torch.cuda.is_available()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if gpu else "cpu",
                              "gpus": torch.cuda.device_count() if gpu else 0, "levels": []}
    svc = load_replica_service(opts, "cuda" if gpu else "cpu") if baseline else None
    save_voice(svc, opts, prompt_wav, 3.0)
    if svc is not None:
        fn = in_process(svc, gen_tokens, hop_first)
        report["in_process"] = [level(fn, c, rounds) for c in (1, per_replica)]
        save(report)
        svc.close()
        del svc, fn
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()  # a replica needs the memory this process held
    t0 = time.monotonic()
    started = start(replace(opts, replicas=counts[0]))
    try:
        url = f"http://127.0.0.1:{opts.port}"
        client = httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0),
                              limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
        current = counts[0]
        report["ray_start_and_first_deploy_s"] = time.monotonic() - t0
        for n in counts:
            t1 = time.monotonic()
            if n != current:
                deploy(replace(opts, replicas=n))
                wait_healthy(n, 900)
                current = n
            row: dict[str, Any] = {"replicas": n, "scale_s": time.monotonic() - t1}
            fn = lambda i: speak(client, url, i, gen_tokens, hop_first)  # noqa: E731
            if n == counts[0]:
                row["one_stream"] = level(fn, 1, rounds)
            row["load"] = level(fn, per_replica * n, rounds)
            report["levels"].append(row)
            save(report)
            log.info("%d replicas: %s", n, row["load"])
        base = report["levels"][0]["load"]["audio_s_per_s"]
        for row in report["levels"]:
            row["speedup_vs_first"] = row["load"]["audio_s_per_s"] / base
        one = report["levels"][0].get("one_stream")
        if one and report.get("in_process"):
            report["proxy_overhead_ms_p50"] = one["ttfb_p50_ms"] - report["in_process"][0]["ttfb_p50_ms"]
        if kill_one and current >= 2:
            held = (opts.max_queued_requests or opts.capacity * current) + opts.capacity * current
            report["kill_one"] = kill_phase(client, url, current, per_replica, gen_tokens, hop_first, held,
                                            replacement_timeout_s)
            save(report)
        client.close()
    finally:
        stop(started)
    return report


def print_report(r: dict) -> None:
    print(f"device {r['device']} x {r['gpus']}")
    rows = [("in-process", x) for x in r.get("in_process", [])]
    for lv in r["levels"]:
        if "one_stream" in lv:
            rows.append((f"{lv['replicas']} replica(s)", lv["one_stream"]))
        rows.append((f"{lv['replicas']} replica(s)", lv["load"]))
    print(f"{'':>14} {'conc':>5} {'req':>5} {'ok':>5} {'TTFB p50/p95/max ms':>26} {'audio-s/s':>10}  per replica")
    for name, x in rows:
        print(f"{name:>14} {x['concurrency']:>5} {x['requests']:>5} {x['ok']:>5} "
              f"{x['ttfb_p50_ms']:>8.1f} /{x['ttfb_p95_ms']:>8.1f} /{x['ttfb_max_ms']:>8.1f} "
              f"{x['audio_s_per_s']:>10.1f}  {'/'.join(str(v) for v in x['per_replica'].values())}")
    if "proxy_overhead_ms_p50" in r:
        print(f"proxy overhead at 1 stream (p50): {r['proxy_overhead_ms_p50']:.1f} ms")
    if "kill_one" in r:
        print("kill one:", {k: v for k, v in r["kill_one"].items() if k != "after_replacement"})
