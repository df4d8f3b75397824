"""Ray Serve: replicas of the tiny synthetic model behind Serve's proxy, and the app's remote front end.

The unmarked tests need no cluster (options, deployment settings, the metrics mirror, the remote client's error
handling).  The ``ray`` tests share one local Ray instance (started and stopped here, 127.0.0.1 only) with two CPU
replicas: 32 concurrent streams each equal their solo run; a burst of 16 splits 8 ± 1 each; a running stream is
not held back by streams queued for admission (the thread-pool stall); a replica killed mid-load ends its streams
with an error within seconds while the other replica's streams finish untouched, and Ray's replacement serves new
requests; a full deployment answers 503 with Retry-After; shutting down leaves no Ray process behind.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed here (pip install -r requirements.txt)")

from cosyvoice_fast.engine.engine import EngineBusy
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.serving.metrics import EngineMetrics
from cosyvoice_fast.frontend.request import SynthesisRequest
from cosyvoice_fast.config.yamlfile import ConfigError

serve_ray = pytest.importorskip("cosyvoice_fast.serving.ray_serve")  # needs ray[serve]

SAMPLE_RATE = 24000


# ------------------------------------------------------------------------------------------------ no cluster
def test_options_name_the_bad_field():
    with pytest.raises(ConfigError, match=r"RayServeOptions\.replicas must be at least 1, got 0"):
        serve_ray.RayServeOptions(replicas=0)
    with pytest.raises(ConfigError, match=r"RayServeOptions\.max_replicas"):
        serve_ray.RayServeOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ConfigError, match=r"RayServeOptions\.max_queued_requests"):
        serve_ray.RayServeOptions(max_queued_requests=0)


def test_serve_command_line_becomes_options():
    import argparse

    from cosyvoice_fast.cli.serve import add_arguments, options_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    o = options_from_args(p.parse_args(["--ray", "--replicas", "3", "--max-streams", "4", "--queue-limit", "2",
                                        "--address", "auto", "--backend", "cudagraph", "--speaker-dir", "spk",
                                        "--proxy-location", "HeadOnly"]))
    assert (o.replicas, o.capacity, o.address, o.backend, o.proxy_location) == (3, 6, "auto", "cudagraph", "HeadOnly")
    assert os.path.isabs(o.speaker_dir)  # every replica must find the same directory, whatever its cwd
    with pytest.raises(ConfigError, match=r"RayServeOptions\.backend 'fastest' is unknown"):
        options_from_args(p.parse_args(["--ray", "--backend", "fastest"]))
    with pytest.raises(SystemExit):  # `serve` without --ray: argparse says --ray is required
        p.parse_args([])


def test_deployment_limits_follow_the_engine_config():
    cfg = EngineConfig(max_streams=3, queue_limit=2)
    d = serve_ray.build_app(serve_ray.RayServeOptions(engine=cfg, replicas=2), gpus_available=0)._bound_deployment
    assert d.max_ongoing_requests == 5  # the engine's running capacity + its admission queue
    assert d.max_queued_requests == 10  # the proxy holds as many as the two replicas admit
    assert d.num_replicas == 2
    assert d.ray_actor_options["num_gpus"] == 0.0 and d.init_args[1] == "cpu"  # no GPU in the cluster: CPU replicas
    assert d._deployment_config.backpressure_config.status_code == 503
    d = serve_ray.build_app(serve_ray.RayServeOptions(engine=cfg, gpus_per_replica=0.5, max_replicas=4,
                                                      max_queued_requests=7), gpus_available=2)._bound_deployment
    auto = d._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 4, 3)
    assert d.ray_actor_options["num_gpus"] == 0.5 and d.init_args[1] == "cuda" and d.max_queued_requests == 7


def test_a_new_replica_count_keeps_the_running_replicas_and_the_router():
    """Scaling 1 -> 4 replicas redeploys the same version (Serve then only adds replicas, instead of restarting
    every one); another engine config is a new version.  Every deployment routes with LeastLoadedRouter."""
    from cosyvoice_fast.serving.ray_router import LeastLoadedRouter

    cfg = EngineConfig(max_streams=3, queue_limit=2)
    one, four, other = (serve_ray.build_app(serve_ray.RayServeOptions(engine=e, replicas=n), 0)._bound_deployment
                        for e, n in ((cfg, 1), (cfg, 4), (EngineConfig(max_streams=4, queue_limit=2), 1)))
    assert (one.num_replicas, four.num_replicas) == (1, 4)
    assert one._version == four._version != other._version
    assert one.init_args == four.init_args  # what a replica is built from does not hold the count
    router = one._deployment_config.request_router_config
    assert router.get_request_router_class().__name__ == LeastLoadedRouter.__name__
    assert router.request_routing_stats_period_s == 1.0


def test_registry_mirror_copies_every_sample_with_its_labels():
    from cosyvoice_fast.serving.ray_metrics import RegistryMirror
    from cosyvoice_fast.telemetry.record import RequestTelemetry

    m = EngineMetrics()
    m.count_rejected("InputError")
    m.observe(RequestTelemetry("r1"), "cancelled")
    made: dict[str, tuple] = {}
    values: dict[tuple, float] = {}

    class Gauge:
        def __init__(self, name, description, keys):  # noqa: ANN001
            self.name = name
            made[name] = keys

        def set(self, value, tags):  # noqa: ANN001
            values[(self.name, tuple(sorted(tags.items())))] = value

    n = RegistryMirror(m.registry, Gauge).copy()
    assert n == len(values)
    assert values[("cosyvoice_requests_total", (("outcome", "rejected"),))] == 1.0
    assert values[("cosyvoice_requests_total", (("outcome", "cancelled"),))] == 1.0
    assert values[("cosyvoice_requests_total", (("outcome", "ok"),))] == 0.0
    assert values[("cosyvoice_request_errors_total", (("type", "InputError"),))] == 1.0
    assert made["cosyvoice_ttfb_seconds_bucket"] == ("le",)
    assert not any(name.endswith("_created") for name in made)
    m.count_rejected()
    RegistryMirror(m.registry, Gauge).copy()
    assert values[("cosyvoice_requests_total", (("outcome", "rejected"),))] == 2.0


def _remote(handler) -> "object":  # noqa: ANN001
    from cosyvoice_fast.serving.remote import RemoteEngine

    return RemoteEngine(httpx.Client(base_url="http://cluster", transport=httpx.MockTransport(handler)),
                        SAMPLE_RATE, "m")


class _DyingStream(httpx.SyncByteStream):
    def __iter__(self):
        yield np.arange(480, dtype="<i2").tobytes()
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def test_remote_stream_whose_replica_died_ends_with_a_clear_error():
    from cosyvoice_fast.serving.remote import RemoteStreamError

    eng = _remote(lambda req: httpx.Response(200, stream=_DyingStream(), headers={"x-replica": "abc"}))
    chunks = eng.stream(SynthesisRequest(text="hi", mode="speaker", speaker="alice"))
    first = next(chunks)
    assert len(first.samples) == 480 and first.samples[1] == pytest.approx(1 / 32767)
    with pytest.raises(RemoteStreamError, match=r"replica abc stopped this stream after 1 chunks"):
        next(chunks)


def test_remote_refusals_keep_the_clusters_message():
    busy = "Request dropped due to backpressure (num_queued_requests=1, max_queued_requests=1)."
    with pytest.raises(EngineBusy, match=r"the cluster is full \(Request dropped due to backpressure"):
        _remote(lambda req: httpx.Response(503, text=busy)).stream(
            SynthesisRequest(text="hi", mode="speaker", speaker="alice"))
    err = {"error": {"message": "voice 'zed' is not known here", "param": "voice"}}
    with pytest.raises(ValueError, match=r"HTTP 400\): voice 'zed' is not known here"):
        _remote(lambda req: httpx.Response(400, json=err)).stream(
            SynthesisRequest(text="hi", mode="speaker", speaker="zed"))


def test_remote_request_bodies_carry_the_voice_or_the_prompt():
    import base64

    from cosyvoice_fast.serving.remote import request_body

    b = request_body(SynthesisRequest(text="hi", mode="speaker", speaker="alice", seed=5, max_tokens=9), "m")
    assert (b["voice"], b["mode"], b["seed"], b["max_tokens"], b["response_format"]) == ("alice", "speaker", 5, 9,
                                                                                          "pcm")
    assert "prompt_audio" not in b and "backends" not in b  # the replicas' own backends serve it
    b = request_body(SynthesisRequest(text="hi", mode="zero_shot", prompt_wav=b"RIFFdata", prompt_text="hello"),
                     "m")
    assert base64.b64decode(b["prompt_audio"]) == b"RIFFdata" and b["prompt_text"] == "hello" and "voice" not in b


# ------------------------------------------------------------------------------------------------ the cluster
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_voice(speaker_dir, name: str, seed: int) -> None:
    """Save a voice into the shared directory the way the app does (random noise prompt: the model is random)."""
    from cosyvoice_fast.frontend.pipeline import Frontend
    from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

    fe = Frontend.from_model_dir(synthetic_model_dir("tiny"), speaker_cache_dir=speaker_dir,
                                 sample_rate=SAMPLE_RATE)
    wav = np.random.default_rng(seed).standard_normal(3 * SAMPLE_RATE).astype(np.float32) * 0.1
    fe.add_speaker(name, wav, SAMPLE_RATE, "a short transcript")


class Cluster:
    def __init__(self, tmp) -> None:  # noqa: ANN001
        import ray
        from ray import serve

        self.speaker_dir = tmp / "speakers"
        _save_voice(self.speaker_dir, "alice", 1)
        self.port = _free_port()
        ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(serve_ray.REPO_ROOT)}})
        self.session_dir = ray._private.worker._global_node.get_session_dir_path()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        # queue_limit 0: the engine admits max_streams requests (its admission queue is another branch's work), so
        # each replica is sent exactly what it runs
        self.opts = serve_ray.RayServeOptions(engine=EngineConfig(max_streams=16, queue_limit=0), synthetic="tiny",
                                              speaker_dir=str(self.speaker_dir), replicas=2, port=self.port,
                                              max_queued_requests=32, health_check_period_s=1.0)
        serve.run(serve_ray.build_app(self.opts, 0), name=serve_ray.APP_NAME, route_prefix="/", blocking=False)
        self.url = f"http://127.0.0.1:{self.port}"
        self.up = True

    def shutdown(self) -> None:
        import ray
        from ray import serve

        if self.up:
            self.up = False
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("ray_serve"))
    yield c
    c.shutdown()


def _speak(url: str, i: int, voice: str, max_tokens: int, out: dict | None = None, on_headers=None,
           prefix: str = "") -> dict:  # noqa: ANN001
    """One streamed request; fills and returns ``out``: status, pid, replica, then 'audio' (int16) or 'error'."""
    body = {"input": f"sentence number {i} for the cluster", "voice": voice, "seed": 100 + i,
            "max_tokens": max_tokens, "token_hop_len_first": 5, "response_format": "pcm"}
    out = {} if out is None else out
    parts = []
    try:
        with httpx.stream("POST", f"{url}{prefix}/v1/audio/speech", json=body, timeout=httpx.Timeout(120.0)) as r:
            out.update(status=r.status_code, pid=int(r.headers.get("x-replica-pid", 0)),
                       replica=r.headers.get("x-replica"), retry_after=r.headers.get("retry-after"))
            if r.status_code != 200:
                out["error"] = r.read().decode()
                return out
            if on_headers is not None:
                on_headers()
            for b in r.iter_bytes():
                parts.append(b)
        out["audio"] = np.frombuffer(b"".join(parts), dtype="<i2")
    except httpx.HTTPError as e:
        out["error"] = e
    return out


def _same_audio(a: np.ndarray, b: np.ndarray) -> bool:
    """Same length, and equal up to one int16 step: concurrent requests share batched flow solves, and a replica
    that already holds a voice's cached flow prompt state skips recomputing it; both equal the solo computation
    to float rounding, and a rounding difference can cross a quantisation step (a few samples in 10^4 do)."""
    return len(a) == len(b) and int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max(initial=0)) <= 1


def _replicas() -> dict:
    from ray import serve

    st = serve.status().applications[serve_ray.APP_NAME].deployments["TTSReplica"]
    return {"status": str(st.status), **st.replica_states}


HEALTHY = {"status": "DeploymentStatus.HEALTHY", "RUNNING": 2}


@pytest.mark.ray
def test_32_concurrent_streams_across_replicas_equal_their_solo_runs(cluster):
    _save_voice(cluster.speaker_dir, "bob", 2)  # saved after the replicas started: the shared directory is read live
    voices = httpx.get(f"{cluster.url}/v1/audio/voices", timeout=30).json()["voices"]
    assert sorted(v["name"] for v in voices if v["kind"] == "saved") == ["alice", "bob"]
    kinds = [(i, "alice" if i % 2 else "bob") for i in range(8)]
    solo = {k: _speak(cluster.url, *k, max_tokens=10) for k in kinds}
    assert all("audio" in s for s in solo.values()), solo
    assert len({s["audio"].tobytes() for s in solo.values()}) == len(kinds)  # distinct, so equality means something
    with ThreadPoolExecutor(32) as pool:
        runs = list(pool.map(lambda j: (kinds[j % 8], _speak(cluster.url, *kinds[j % 8], max_tokens=10)), range(32)))
    for k, r in runs:
        assert "audio" in r, f"{k} failed: {r.get('error')!r}"
        assert _same_audio(r["audio"], solo[k]["audio"]), f"{k} on replica {r['replica']} differs from solo"
    assert len({r["replica"] for _, r in runs}) == 2  # 32 streams > one replica's 16: both served


@pytest.mark.ray
def test_a_burst_of_streams_is_spread_evenly_over_the_replicas(cluster):
    """16 streams sent at once to 2 idle replicas: 8 each, give or take one (Serve's default router broke the
    burst's ties at random: 11/5 happened; ray_router ranks every replica, counting the burst's own choices)."""
    from collections import Counter

    go = threading.Barrier(16, timeout=60)

    def send(i: int) -> dict:
        go.wait()  # all 16 leave together: a burst, not a trickle
        return _speak(cluster.url, 70 + i, "alice", 10)

    with ThreadPoolExecutor(16) as pool:
        runs = list(pool.map(send, range(16)))
    assert all("audio" in r for r in runs), [r.get("error") for r in runs]
    counts = Counter(r["replica"] for r in runs)
    assert len(counts) == 2 and max(counts.values()) <= 9, f"requests per replica: {dict(counts)}"


def _ok_counts_by_replica(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_cosyvoice_requests_total{") and 'outcome="ok"' in line:
            replica = re.search(r'replica="([^"]+)"', line).group(1)
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.ray
def test_replica_metrics_reach_rays_exporter_labelled_by_replica(cluster):
    """After the 8 solo + 32 concurrent + 16 burst requests above, Ray's exporter shows 56 ok requests, split
    over the two replicas' own registries."""
    import ray

    port = ray._private.worker._global_node.metrics_export_port
    counts: dict[str, float] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        counts = _ok_counts_by_replica(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text)
        if sum(counts.values()) >= 56 and len(counts) == 2:
            break
        time.sleep(2)
    assert len(counts) == 2 and sum(counts.values()) == 56, counts
    assert all(v > 0 for v in counts.values())


@pytest.mark.ray
def test_killed_replica_ends_its_streams_with_an_error_and_is_replaced(cluster):
    # 24 streams: one replica admits 16 at most, so both replicas hold some whatever Serve's router picks (with
    # 16, its cached queue lengths sometimes sent all of them to one replica)
    kinds = [(20 + i % 4, "alice") for i in range(24)]
    outs: list[dict] = [{} for _ in kinds]
    started = threading.Barrier(len(kinds) + 1, timeout=120)
    with ThreadPoolExecutor(len(kinds)) as pool:
        futures = [pool.submit(_speak, cluster.url, *k, 150, o, started.wait) for k, o in zip(kinds, outs)]
        started.wait()  # every stream has its headers: all are in flight
        counts: dict[int, int] = {}
        for o in outs:
            counts[o["pid"]] = counts.get(o["pid"], 0) + 1
        assert len(counts) == 2 and max(counts.values()) <= 16, f"streams per replica: {counts}"
        victim = max(counts, key=counts.get)
        serve_ray.kill_replica(next(o["replica"] for o in outs if o["pid"] == victim))  # ray.kill on its actor
        killed = time.monotonic()
        for f, o in zip(futures, outs):  # the victim's streams end at once (a generous bound: a hang fails it)
            if o["pid"] == victim:
                f.result(timeout=120)
        assert time.monotonic() - killed < 30, "the killed replica's streams did not end within 30 s"
        results = [f.result(timeout=300) for f in futures]
    on_victim = [r for r in results if r["pid"] == victim]
    others = [(k, r) for k, r in zip(kinds, results) if r["pid"] != victim]
    for r in on_victim:  # an HTTP-level error the client sees at once: never a clean end, never a hang
        assert isinstance(r.get("error"), httpx.RemoteProtocolError), r.get("error")
        assert "incomplete chunked read" in str(r["error"])
    refs: dict = {}
    for k, r in others:
        assert "audio" in r, f"stream on the surviving replica failed: {r.get('error')!r}"
        refs.setdefault(k, _speak(cluster.url, *k, max_tokens=150)["audio"])
        assert _same_audio(r["audio"], refs[k]), f"{k} changed by the other replica's death"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and _replicas() != HEALTHY:
        time.sleep(1)
    assert _replicas() == HEALTHY
    survivor = {r["pid"] for _, r in others}
    new = [_speak(cluster.url, 40 + i, "alice", max_tokens=5) for i in range(12)]
    assert all("audio" in r and len(r["audio"]) > 0 for r in new), [r.get("error") for r in new]
    assert {r["pid"] for r in new} - survivor - {victim}, "Ray's replacement replica served nothing"


@pytest.mark.ray
def test_a_running_stream_is_not_held_back_by_streams_waiting_for_admission(cluster):
    """The 66 s stall of the GPU run (issue 56), on CPU: Ray runs a replica's request code on an event loop whose
    thread pool has min(32, num_cpus + 4) threads, 5 at one CPU per replica.  A stream that waited for its next chunk
    in that pool (``asyncio.to_thread``) held a thread, so eight streams waiting in the engine's admission queue took
    all five and the running stream's later chunks queued behind them: its audio arrived only after queued requests
    had started.  Awaited without a thread (the engine's output queue wakes the loop), the running stream's audio is
    all delivered before the first queued request starts (they start only when it has finished)."""
    from ray import serve

    queued = 8  # more than the pool's 5 threads
    opts = serve_ray.RayServeOptions(engine=EngineConfig(max_streams=1, queue_limit=queued), synthetic="tiny",
                                     speaker_dir=str(cluster.speaker_dir), replicas=1)  # the proxy holds the burst
    serve.run(serve_ray.build_app(opts, 0), name="stall", route_prefix="/stall", blocking=False)
    try:
        first: dict[int, float] = {}
        ends: dict[int, float] = {}

        def timed(i: int, max_tokens: int, on_headers=None) -> dict:  # noqa: ANN001
            def mark() -> None:
                first[i] = time.monotonic()
                if on_headers is not None:
                    on_headers()

            out = _speak(cluster.url, i, "alice", max_tokens, None, mark, "/stall")
            ends[i] = time.monotonic()
            return out

        started = threading.Barrier(2, timeout=120)
        with ThreadPoolExecutor(queued + 1) as pool:
            running = pool.submit(timed, 0, 40, started.wait)  # 8 chunks: seconds of work on the CPU
            started.wait()  # its first chunk is out: it holds the engine's only stream
            waiting = [pool.submit(timed, 1 + j, 10) for j in range(queued)]
            results = [running.result(timeout=300)] + [f.result(timeout=300) for f in waiting]
        assert all("audio" in r for r in results), [r.get("error") for r in results]
        assert len({r["pid"] for r in results}) == 1
        later = min(first[i] for i in range(1, queued + 1))
        assert ends[0] < later, (f"the running stream ended {ends[0] - later:.2f} s after the first queued request's "
                                 "audio: its chunks waited behind the queued streams")
    finally:
        serve.delete("stall")


@pytest.mark.ray
def test_full_deployment_answers_503_with_a_message(cluster):
    """One replica admitting one request, the proxy holding one more: the third is turned away at once."""
    from ray import serve

    opts = serve_ray.RayServeOptions(engine=EngineConfig(max_streams=1, queue_limit=0), synthetic="tiny",
                                     speaker_dir=str(cluster.speaker_dir), replicas=1, max_queued_requests=1)
    serve.run(serve_ray.build_app(opts, 0), name="small", route_prefix="/small", blocking=False)
    try:
        started = threading.Barrier(2, timeout=120)
        with ThreadPoolExecutor(3) as pool:
            long = pool.submit(_speak, cluster.url, 60, "alice", 150, None, started.wait, "/small")
            started.wait()  # the replica's only slot is taken
            later = [pool.submit(_speak, cluster.url, 61 + i, "alice", 5, None, None, "/small") for i in range(2)]
            answers = [f.result(timeout=300) for f in later]
            refused = [a for a in answers if a["status"] == 503]
            assert refused, answers
            assert "Request dropped due to backpressure" in refused[0]["error"]
            assert refused[0]["retry_after"] == "1"  # BackpressureConfig(retry_after_s=1): come back, not hang
            assert long.result(timeout=300).get("audio") is not None
    finally:
        serve.delete("small")


@pytest.mark.ray
def test_remote_front_end_streams_from_the_cluster(cluster):
    from cosyvoice_fast.serving.remote import connect

    svc = connect(cluster.url)
    try:
        assert svc.engine.sample_rate == SAMPLE_RATE and svc.synthetic
        assert "alice" in svc.frontend.list_speakers()
        req = SynthesisRequest(text="sentence number 3 for the cluster", mode="speaker", speaker="alice",
                               seed=103, max_tokens=10, stream_params=_params(5))
        got = np.concatenate([c.samples for c in svc.engine.stream(req)])
        ref = _speak(cluster.url, 3, "alice", 10)["audio"]
        assert _same_audio(np.round(got * 32767).astype(np.int16), ref)
        # the app's handlers on the remote service: the same request from the page, and a clear refusal
        from cosyvoice_fast.app.handlers import CONFIG_FIELDS, VOICE_FIELDS, Handlers

        voice = {"text": req.text, "mode": "speaker", "prompt_upload": None, "prompt_mic": None, "prompt_text": "",
                 "instruct_text": "", "speaker": "alice", "seed": 103, "stream": True, "speed": 1.0}
        cfg = {"token_hop_len_first": 5, "token_hop_len": 25, "pre_lookahead_len": 3, "stream_scale_factor": 2.0,
               "max_tokens": 10, "llm": "eager", "flow": "eager", "vocoder": "eager", "dtype": "fp32",
               "incremental_flow": True}
        h = Handlers(svc)
        last = list(h.synthesize(*[voice[k] for k in VOICE_FIELDS], *[cfg[k] for k in CONFIG_FIELDS], []))[-1]
        sr, wav = last[1]
        assert sr == SAMPLE_RATE and _same_audio(wav, ref)  # the page re-quantises the floats (truncating)
        assert last[6].startswith("done: ")
        import gradio as gr

        prompt = serve_ray.REPO_ROOT / "assets" / "cross_lingual_prompt.wav"  # an upload travels as base64
        voice.update(mode="cross_lingual", prompt_upload=str(prompt))
        last = list(h.synthesize(*[voice[k] for k in VOICE_FIELDS], *[cfg[k] for k in CONFIG_FIELDS], []))[-1]
        assert last[6].startswith("done: ") and len(last[1][1]) > 0
        with pytest.raises(gr.Error, match="voices are saved on the cluster"):
            h.save_speaker("carol", str(prompt), None, "")
    finally:
        svc.close()


def _params(first: int):  # noqa: ANN202
    from cosyvoice_fast.config.stream import StreamParams

    return StreamParams(token_hop_len_first=first)


@pytest.mark.ray
def test_zz_shutdown_leaves_no_ray_process(cluster):
    import psutil

    ray_children = [p for p in psutil.Process().children(recursive=True)]
    assert ray_children, "no Ray processes found under the test process"
    cluster.shutdown()
    gone, alive = psutil.wait_procs(ray_children, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(cluster.session_dir in arg for arg in (p.info["cmdline"] or [])):
                left.append(p.info)
        except psutil.Error:
            pass
    assert not left, left
