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

from cosyvoice_fast.bench.load import in_process, run_load, save_voice, speak, summarize

log = logging.getLogger(__name__)

#: seconds after which a level counts as stalled (every level here takes a few seconds on a GPU)
STALL_S = 90.0
TOKENS_PER_SECOND = 25  # speech tokens per second of audio (both families)


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
    full_s = gen_tokens / TOKENS_PER_SECOND  # a stream that ran to its max_tokens (the synthetic LM never stops early)
    kept = [r for r in outs if r.get("replica") != victim]
    refused = [r for r in sent if r.get("status") == 503]
    res: dict[str, Any] = {
        "in_flight_per_replica": counts, "victim": victim, "victim_streams": len(lost),
        "victim_streams_done_before_kill": sum(1 for r in lost if r["end"] < killed_at),
        "victim_streams_with_error": sum(1 for r in lost if "error" in r),
        # a stream of the victim that ended without an error must have all its audio (it finished as the kill
        # landed); one that ended short without an error would be a silent truncation a client cannot detect
        "victim_streams_complete": sum(1 for r in lost if "error" not in r and r["audio_s"] >= full_s - 0.05),
        "victim_streams_short_without_error": sum(1 for r in lost if "error" not in r
                                                  and r["audio_s"] < full_s - 0.05),
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
def dump_replica_stacks() -> None:
    """Ask every Serve replica process of this host for its thread stacks (``TTSReplica`` registers faulthandler
    on SIGUSR1: the stacks land in the replica's log), so a stalled run says what each thread waited on."""
    import os
    import signal
    import subprocess

    pids = subprocess.run(["pgrep", "-f", "ServeReplica"], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGUSR1)
        except (OSError, ValueError):
            pass
    log.warning("a level has run %.0f s: asked replica processes %s for their stacks (see their logs)", STALL_S,
                pids)


def level(fn: Callable[[int], dict], concurrency: int, rounds: int) -> dict:
    """Warm up with one request per stream, then ``rounds`` requests per stream at ``concurrency`` (at least 8
    requests at one stream: the proxy overhead is read there).  A level still running after :data:`STALL_S`
    gets the replicas' stacks dumped into their logs (:func:`dump_replica_stacks`)."""
    watchdog = threading.Timer(STALL_S, dump_replica_stacks)
    watchdog.daemon = True
    watchdog.start()
    try:
        run_load(fn, 10_000, concurrency, concurrency)
        results, wall = run_load(fn, 0, rounds * concurrency if concurrency > 1 else max(8, rounds), concurrency)
    finally:
        watchdog.cancel()
    return {"concurrency": concurrency, **summarize(results, wall)}


def run_scale(opts: Any, counts: list[int], per_replica: int, rounds: int, gen_tokens: int, hop_first: int,
              baseline: bool, kill_one: bool, prompt_wav: str | None, replacement_timeout_s: float,
              save: Callable[[dict], None] = lambda r: None, peak_per_replica: int = 0) -> dict:
    """The whole scale-out run (module doc); returns what the JSON report holds, handing it to ``save`` after
    every phase too (a run cut short by a time limit keeps what it measured).  ``peak_per_replica``: at the
    largest count, one more level at that many streams per replica (the "64 streams on 2 replicas" row: each
    replica full and its admission queue in use), reported as the row's ``peak``."""
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
            if peak_per_replica and n == counts[-1]:
                row["peak"] = level(fn, peak_per_replica * n, rounds)
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
        if "peak" in lv:
            rows.append((f"{lv['replicas']} replica(s)", lv["peak"]))
    print(f"{'':>14} {'conc':>5} {'req':>5} {'ok':>5} {'TTFB p50/p95/max ms':>26} {'audio-s/s':>10}  per replica")
    for name, x in rows:
        print(f"{name:>14} {x['concurrency']:>5} {x['requests']:>5} {x['ok']:>5} "
              f"{x['ttfb_p50_ms']:>8.1f} /{x['ttfb_p95_ms']:>8.1f} /{x['ttfb_max_ms']:>8.1f} "
              f"{x['audio_s_per_s']:>10.1f}  {'/'.join(str(v) for v in x['per_replica'].values())}")
    if "proxy_overhead_ms_p50" in r:
        print(f"proxy overhead at 1 stream (p50): {r['proxy_overhead_ms_p50']:.1f} ms")
    if "kill_one" in r:
        print("kill one:", {k: v for k, v in r["kill_one"].items() if k != "after_replacement"})
