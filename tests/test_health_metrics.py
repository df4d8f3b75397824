"""``GET /health`` (readiness) and ``GET /metrics`` (Prometheus) on the running app, fed by the engine's telemetry;
one metrics registry per service, none global."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed here (pip install -r requirements.txt)")
gr_client = pytest.importorskip("gradio_client",
                                reason="gradio_client is not installed here (pip install -r requirements.txt)")
from prometheus_client import REGISTRY  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

from cosyvoice_fast.serving.metrics import EngineMetrics  # noqa: E402
from cosyvoice_fast.telemetry.record import ChunkTiming, RequestTelemetry  # noqa: E402


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.bench.soak import test_prompt
    from cosyvoice_fast.app.page import build_demo, serve
    from tests.test_app import free_port

    d = tmp_path_factory.mktemp("hm")
    svc = load_service(None, synthetic="tiny", device="cpu", speaker_cache_dir=d / "spk", progress=False)
    demo = build_demo(svc)
    port = free_port()
    serve(demo, port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, svc, test_prompt(d / "p.wav")
    finally:
        demo.close()
        svc.close()


def scrape(url: str) -> dict[str, float]:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
            if "le" in s.labels:
                continue
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def synth_args(prompt, **over):
    a = dict(text="Hello metrics.", mode="cross_lingual", prompt_upload=handle_file(str(prompt)), prompt_mic=None,
             prompt_text="", instruct_text="", speaker=None, seed=3, stream=True, speed=1.0,
             token_hop_len_first=10, token_hop_len=10, pre_lookahead_len=3, stream_scale_factor=2.0, max_tokens=20,
             llm="eager", flow="eager", vocoder="eager", dtype="fp32", incremental_flow=True)
    a.update(over)
    return a


def test_health_reports_readiness(app):
    url, svc, _ = app
    r = httpx.get(url + "/health")
    assert r.status_code == 200
    h = r.json()
    assert h["ready"] is True and h["status"] == "ok" and h["model_loaded"] is True
    assert h["model"] == "synthetic-tiny" and h["synthetic"] is True and h["frontend"] is True
    assert h["device"] == "cpu" and h["dtype"] == "float32" and h["sample_rate"] == 24000
    assert "eager" in h["backends"]["llm"] and "eager" in h["backends"]["vocoder"]
    assert "eager/eager/eager fp32" in h["backends_built"]
    assert h["active_requests"] == 0
    assert httpx.head(url + "/health").status_code == 200  # probes that use HEAD


def test_metrics_follow_requests(app):
    url, svc, prompt = app
    m0 = scrape(url)
    assert m0['cosyvoice_requests_total{outcome="ok"}'] == 0
    client = Client(url + "/", verbose=False)
    final = client.predict(**synth_args(prompt), api_name="/synthesize")
    tele = final[7]
    with pytest.raises(AppError, match="Text is empty"):
        client.predict(**synth_args(prompt, text="  "), api_name="/synthesize")  # refused by the app itself
    notes = prompt.parent / "notes.wav"
    notes.write_text("not audio")
    with pytest.raises(AppError, match="could not decode"):
        client.predict(**synth_args(notes), api_name="/synthesize")  # refused by the frontend
    m = scrape(url)
    assert m['cosyvoice_requests_total{outcome="ok"}'] == 1
    assert m['cosyvoice_requests_total{outcome="rejected"}'] == 2
    assert m['cosyvoice_request_errors_total{type="PromptAudioError"}'] == 1
    assert m['cosyvoice_request_errors_total{type="InputError"}'] == 1
    assert m["cosyvoice_ttfb_seconds_count"] == 1 and m["cosyvoice_rtf_count"] == 1
    assert m["cosyvoice_ttfb_seconds_sum"] == pytest.approx(tele["derived"]["ttfb_ms"] / 1e3, rel=1e-6)
    assert m["cosyvoice_rtf_sum"] == pytest.approx(tele["derived"]["rtf"], rel=1e-6)
    assert m["cosyvoice_chunks_total"] == len(tele["chunks"])
    assert m["cosyvoice_audio_seconds_total"] == pytest.approx(20 * 0.04)
    assert m["cosyvoice_active_requests"] == 0


def test_one_registry_per_service_nothing_global():
    a, b = EngineMetrics(), EngineMetrics()  # would raise "Duplicated timeseries" on a shared registry
    assert a.registry is not b.registry
    assert REGISTRY.get_sample_value("cosyvoice_requests_total", {"outcome": "ok"}) is None
    t = RequestTelemetry("x", received=0.0)
    t.chunks.append(ChunkTiming(0, 0, 10, n_samples=9600, flow_start=0.1, flow_end=0.2, vocoder_end=0.3,
                                delivered=0.4, tokens_ready=0.05))
    t.finished = 0.5
    a.observe(t, "ok")
    assert a.registry.get_sample_value("cosyvoice_requests_total", {"outcome": "ok"}) == 1
    assert b.registry.get_sample_value("cosyvoice_requests_total", {"outcome": "ok"}) == 0
    assert a.registry.get_sample_value("cosyvoice_ttfb_seconds_sum") == pytest.approx(0.4)


def test_health_says_not_ready_once_the_engine_stops(app):
    """Last in this module: shuts the engine down."""
    url, svc, _ = app
    svc.engine.close()
    r = httpx.get(url + "/health")
    assert r.status_code == 503 and r.json()["ready"] is False and r.json()["status"] == "engine stopped"
