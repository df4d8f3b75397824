"""What the person running the server sees: a taken port before the model loads, our start-up lines, one log line
per request (no traceback for user mistakes), /health while warming up, and open streams ending on shutdown."""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest

from cosyvoice_fast.app import launch
from cosyvoice_fast.telemetry import request_log
from cosyvoice_fast.telemetry.record import ChunkTiming, RequestTelemetry

gr_client = pytest.importorskip("gradio_client", reason="gradio_client is not installed here (pip install -r "
                                "requirements.txt)")
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

from tests.test_app import args, free_port  # noqa: E402


# ------------------------------------------------------------------------------------------------ start-up

def test_taken_port_names_the_port_flag():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(launch.PortInUse) as e:
            launch.check_port("127.0.0.1", port)
    assert str(e.value) == (f"port {port} on 127.0.0.1 is already in use (another app.py or server?). Start with "
                            f"another port, e.g. --port {port + 1}, or stop the program that holds it.")
    launch.check_port("127.0.0.1", port)  # free again: no error


def test_app_stops_on_a_taken_port_before_loading_the_model(monkeypatch, capsys):
    import app as app_module
    import cosyvoice_fast.serving.service as service

    monkeypatch.setattr(service, "load_service", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        assert app_module.main(["--synthetic", "tiny", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"error: port {port} on 127.0.0.1 is already in use (another app.py or server?). Start "
                           f"with another port, e.g. --port {port + 1}, or stop the program that holds it.")
    assert "GRADIO_SERVER_PORT" not in err and "Traceback" not in err


def test_start_up_lines_name_our_flags_not_gradios():
    local = launch.urls_message("http://127.0.0.1:7860/", None, share=False)
    assert local == ("Running on http://127.0.0.1:7860  (health: http://127.0.0.1:7860/health)\n"
                     "For a public gradio.live link, restart with --share (add --auth user:pass to protect it).")
    shared = launch.urls_message("http://127.0.0.1:7860/", "https://abc.gradio.live", share=True)
    assert shared.splitlines()[1] == ("Public link: https://abc.gradio.live  (temporary; anyone with it can use the "
                                      "app: consider --auth)")
    assert "share=True" not in local + shared and "launch()" not in local + shared


def test_log_lines_go_above_a_progress_bar(capsys):
    """Through tqdm.write: a log line during a bar is a line of its own (it used to be glued to the bar)."""
    from tqdm import tqdm

    launch.setup_logging()
    try:
        with tqdm(total=2, desc="loading", file=None) as bar:
            logging.getLogger("cosyvoice_fast.test").info("loaded llm.pt")
            bar.update(1)
    finally:
        logging.getLogger().handlers[:] = []
    err = capsys.readouterr().err
    assert "\nINFO cosyvoice_fast.test: loaded llm.pt\n" in "\n" + err.replace("\r", "\n")


# ------------------------------------------------------------------------------------------------ request log

def test_request_line_format():
    t = RequestTelemetry("abc123", received=10.0)
    t.params = {"mode": "zero_shot", "chars": 42}
    t.chunks = [ChunkTiming(index=i, segment=0, n_tokens=25, n_samples=24000, delivered=d)
                for i, d in enumerate((10.25, 10.9))]
    t.finished = 11.0
    line = request_log.format_line(t, "ok")
    assert line == f"request abc123 mode=zero_shot chars=42 ttfb=250ms rtf={t.rtf:.3f} audio=2.00s outcome=ok"
    t.error = "PromptAudioError: the prompt is 41.0 s long; use 3-30 s\nsecond line"
    assert request_log.format_line(t, "rejected").endswith(
        'rtf=- audio=2.00s outcome=rejected error="PromptAudioError: the prompt is 41.0 s long; use 3-30 s"')


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.app.page import build_demo, serve

    svc = load_service(None, synthetic="tiny", device="cpu", speaker_cache_dir=tmp_path_factory.mktemp("spk"),
                       progress=False)
    demo = build_demo(svc)
    port = free_port()
    serve(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True, concurrency=2, max_queue=8)
    try:
        yield Client(f"http://127.0.0.1:{port}/", verbose=False), svc, demo
    finally:
        demo.close()
        svc.close()


def _request_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cosyvoice_fast.requests"]


def test_user_mistake_is_one_line_without_traceback(served, caplog, capfd):
    client = served[0]
    caplog.set_level(logging.INFO, logger="cosyvoice_fast.requests")
    with pytest.raises(AppError, match="Text is empty: type something to synthesise."):
        client.predict(**args(text="  "), api_name="/synthesize")
    with pytest.raises(AppError, match="Zero-shot needs the prompt's transcript"):
        client.predict(**args(mode="zero_shot", prompt_text=""), api_name="/synthesize")
    lines = _request_lines(caplog)
    assert len(lines) == 2
    assert lines[0].endswith('mode=cross_lingual chars=2 ttfb=- rtf=- audio=0.00s outcome=rejected '
                             'error="Text is empty: type something to synthesise."')
    assert " mode=zero_shot chars=38 " in lines[1] and "outcome=rejected" in lines[1]
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def test_every_request_is_one_line(served, caplog):
    client = served[0]
    caplog.set_level(logging.INFO, logger="cosyvoice_fast.requests")
    client.predict(**args(max_tokens=20), api_name="/synthesize")
    (line,) = _request_lines(caplog)
    assert line.startswith("request ") and " mode=cross_lingual chars=38 ttfb=" in line
    assert " rtf=" in line and "rtf=-" not in line and line.endswith("outcome=ok")


# ------------------------------------------------------------------------------------------------ warm-up

def test_health_is_not_ready_while_warming_up(served, monkeypatch):
    import httpx

    client, svc, _ = served
    gate = threading.Event()
    real = svc.frontend.prompt_features
    monkeypatch.setattr(svc.frontend, "prompt_features", lambda *a, **k: (gate.wait(30), real(*a, **k))[1])
    thread = svc.start_warmup()
    try:
        r = httpx.get(client.src.rstrip("/") + "/health", timeout=10)
        assert r.status_code == 503
        body = r.json()
        assert body["ready"] is False and body["warming"] == ["frontend", "engine"]
        assert body["status"] == "warming up: frontend, engine"
    finally:
        gate.set()
        thread.join(60)
    r = httpx.get(client.src.rstrip("/") + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["ready"] is True and r.json()["warming"] == []
    assert svc.warmup_error is None


def test_warm_up_request_stays_out_of_the_metrics(served):
    import torch

    svc = served[1]
    if not torch.cuda.is_available():  # on a GPU the app's default cudagraph/bf16 set is warmed as well
        assert svc.warm_backends() == [svc.engine.default_backend]
    before = svc.metrics.exposition()
    svc.start_warmup(background=False)
    assert svc.warming() == [] and svc.warmup_error is None
    def ok_count(exposition: bytes) -> list[str]:
        prefix = 'cosyvoice_requests_total{outcome="ok"}'
        return [ln for ln in exposition.decode().splitlines() if ln.startswith(prefix)]

    assert ok_count(svc.metrics.exposition()) == ok_count(before)


# ------------------------------------------------------------------------------------------------ uploads, shutdown

def test_oversize_upload_answers_at_once(served, tmp_path):
    """Gradio's client refuses a file over the server's limit before sending it; ``result()`` raises at once with
    the limit (iterating the job instead would wait forever: a gradio_client bug, see README)."""
    import soundfile as sf
    from gradio_client import handle_file

    client = served[0]
    big = tmp_path / "big.wav"
    sf.write(big, np.zeros(24000 * 240, np.float32), 24000, subtype="PCM_16")  # 11.5 MB
    job = client.submit(**args(prompt_upload=handle_file(str(big))), api_name="/synthesize")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="exceeds the maximum file size of 10485760 bytes"):
        job.result(timeout=30)
    assert time.monotonic() - t0 < 30


def test_shutdown_ends_every_open_stream_with_a_message(tmp_path):
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.app.page import build_demo, serve
    from cosyvoice_fast.app.messages import SHUTTING_DOWN

    svc = load_service(None, synthetic="tiny", device="cpu", speaker_cache_dir=tmp_path / "spk", progress=False)
    demo = build_demo(svc)
    port = free_port()
    serve(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True, concurrency=2, max_queue=8)
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    # two long streams (2000 tokens = 80 s of audio each), both under way when the server stops
    jobs = [client.submit(**args(max_tokens=2000, seed=s), api_name="/synthesize") for s in (1, 2)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(len(j.outputs()) >= 1 for j in jobs):
        time.sleep(0.05)
    assert all(len(j.outputs()) >= 1 for j in jobs), "the streams never started"
    t0 = time.monotonic()
    launch.shutdown(demo, svc)
    for j in jobs:
        with pytest.raises(AppError, match=SHUTTING_DOWN.split(",")[0]):
            j.result(timeout=30)
    assert time.monotonic() - t0 < 30
