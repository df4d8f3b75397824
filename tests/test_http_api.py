"""The OpenAI-compatible API on a real server (the app on 127.0.0.1, tiny synthetic model, CPU, ``--auth``) driven
by the official ``openai`` package: every format decodes to the engine's own samples, SSE carries the telemetry, a
disconnect cancels the engine request, every error status comes as OpenAI's JSON naming the field to fix."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed here (pip install -r requirements.txt)")
sf = pytest.importorskip("soundfile", reason="soundfile is not installed here (pip install -r requirements.txt)")
openai = pytest.importorskip("openai", reason="openai is not installed here (pip install -r requirements.txt)")
av = pytest.importorskip("av", reason="av is not installed here (pip install -r requirements.txt)")

from cosyvoice_fast.serving.audio_encode import to_pcm16  # noqa: E402
from cosyvoice_fast.engine.engine import EngineBusy, EngineClosed  # noqa: E402
from cosyvoice_fast.frontend.request import SynthesisRequest  # noqa: E402
from cosyvoice_fast.config.stream import StreamParams  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT = REPO / "assets" / "zero_shot_prompt.wav"
AUTH = ("tester", "s3cret")
KEY = f"{AUTH[0]}:{AUTH[1]}"
# a short request: 40 tokens in chunks of 10 (first) then 20
EXTRA = {"max_tokens": 40, "token_hop_len_first": 10, "token_hop_len": 10, "seed": 11}
MP3_FRAME = 1152  # MPEG-1 layer III samples per frame: a stream without LAME's trailer tag keeps its padding


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, service) of the app with --auth, serving /v1 beside the page."""
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.app.page import build_demo, serve

    svc = load_service(None, synthetic="tiny", device="cpu", dtype="fp32",
                       speaker_cache_dir=tmp_path_factory.mktemp("speakers"), progress=False)
    demo = build_demo(svc)
    port = _free_port()
    serve(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True, auth=AUTH)
    try:
        yield f"http://127.0.0.1:{port}", svc
    finally:
        demo.close()
        svc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _http(server) -> httpx.Client:
    return httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def reference(server):
    """The engine's own samples for EXTRA on the bundled cross-lingual voice (same seed as the API requests)."""
    svc = server[1]
    req = SynthesisRequest(text="Hello from the API.", mode="cross_lingual",
                           prompt_wav=str(REPO / "assets" / "cross_lingual_prompt.wav"), seed=EXTRA["seed"],
                           stream_params=StreamParams(token_hop_len_first=10, token_hop_len=10),
                           max_tokens=EXTRA["max_tokens"])
    wav, tele = svc.engine.synthesize(req)
    assert len(tele.chunks) >= 2
    return wav


def _speech(client, fmt: str, **extra):
    body = {**EXTRA, **extra}
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice2", voice="cross_lingual_prompt", input="Hello from the API.", response_format=fmt,
            extra_body=body) as resp:
        data = b"".join(resp.iter_bytes())
        return data, resp.headers


def _telemetry(server, rid: str) -> dict:
    with _http(server) as h:
        r = h.get(f"/v1/requests/{rid}/telemetry")
    assert r.status_code == 200, r.text
    return r.json()


def _same_audio(pcm: np.ndarray, reference: np.ndarray) -> None:
    """The engine's samples as 16-bit PCM, to 1 LSB: a voice's cached flow prompt state (reused after the first
    request) changes float rounding, not the audio."""
    assert len(pcm) == len(reference)
    assert np.abs(pcm.astype(np.int32) - to_pcm16(reference)).max() <= 1


def _decode_av(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as f:
        frames = [fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)]
        rate = f.streams.audio[0].rate
    return np.concatenate(frames), rate


def test_pcm_is_the_engines_audio_and_telemetry_is_kept(server, client, reference):
    data, headers = _speech(client, "pcm")
    assert headers["content-type"] == "audio/pcm"
    _same_audio(np.frombuffer(data, dtype="<i2"), reference)
    t = _telemetry(server, headers["x-request-id"])
    assert t["outcome"] == "ok"
    assert sum(c["n_samples"] for c in t["telemetry"]["chunks"]) == len(reference)
    assert set(t["telemetry"]["derived"]["ttfb_breakdown_ms"]) >= {"app_queue", "frontend", "llm_prefill", "flow"}


@pytest.mark.parametrize("fmt", ["wav", "opus", "flac"])
def test_exact_length_formats_decode_to_the_engines_sample_count(client, reference, fmt):
    data, headers = _speech(client, fmt)
    if fmt == "flac":  # a streamed FLAC's header cannot hold the length (libsndfile then refuses it): PyAV
        wav, sr = _decode_av(data)
    else:
        wav, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == 24000
    assert len(wav) == len(reference)
    if fmt in ("wav", "flac"):  # lossless: the engine's 16-bit samples
        _same_audio(wav, reference)


def test_wav_stream_has_the_unknown_length_header(client):
    data, _ = _speech(client, "wav")
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"


@pytest.mark.parametrize("fmt", ["mp3", "aac"])
def test_lossy_formats_decode_to_the_engines_sample_count_plus_codec_padding(client, reference, fmt):
    data, _ = _speech(client, fmt)
    wav, sr = _decode_av(data)
    assert sr == 24000
    # encoder delay + last-frame padding, which a streamed file (no trailer to patch) cannot announce
    frame = MP3_FRAME if fmt == "mp3" else 1024
    assert len(reference) <= len(wav) < len(reference) + 2 * frame


def test_sse_events_carry_audio_and_end_with_telemetry(client, reference):
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice2", voice="cross_lingual_prompt", input="Hello from the API.", response_format="pcm",
            extra_body={**EXTRA, "stream_format": "sse"}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done"
    _same_audio(np.frombuffer(b"".join(base64.b64decode(e["audio"]) for e in deltas), dtype="<i2"), reference)
    done = events[-1]
    assert done["usage"]["chunks"] == len(done["telemetry"]["chunks"]) == len(deltas)
    assert done["telemetry"]["derived"]["ttfb_ms"] > 0


def test_voices_lists_saved_and_bundled_and_each_is_usable(server, client):
    svc = server[1]
    svc.frontend.add_speaker("alice", str(PROMPT), transcript="希望你以后能够做的比我还好呦。")
    with _http(server) as h:
        voices = {v["id"]: v for v in h.get("/v1/audio/voices").json()["voices"]}
    assert voices["alice"]["kind"] == "saved"
    assert voices["zero_shot_prompt"]["kind"] == "bundled" and voices["zero_shot_prompt"]["mode"] == "zero_shot"
    assert voices["cross_lingual_prompt"]["mode"] == "cross_lingual"
    for name in voices:
        with client.audio.speech.with_streaming_response.create(
                model="cosyvoice2", voice=name, input="Hi.", response_format="pcm",
                extra_body={"max_tokens": 10, "token_hop_len_first": 10}) as resp:
            assert len(b"".join(resp.iter_bytes())) == 2 * 10 * 960, name


def test_prompt_audio_by_multipart_and_base64(server):
    raw = PROMPT.read_bytes()
    with _http(server) as h:
        a = h.post("/v1/audio/speech", data={"input": "Hi.", "response_format": "pcm", "max_tokens": "10",
                                             "token_hop_len_first": "10", "seed": "3", "mode": "cross_lingual"},
                   files={"prompt_audio": ("p.wav", raw, "audio/wav")})
        b = h.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm", "max_tokens": 10,
                                             "token_hop_len_first": 10, "seed": 3, "mode": "cross_lingual",
                                             "prompt_audio": base64.b64encode(raw).decode()})
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.content == b.content and len(a.content) == 2 * 10 * 960


def test_client_disconnect_cancels_the_engine_request(server):
    svc = server[1]
    with _http(server) as h:
        with h.stream("POST", "/v1/audio/speech", json={"input": "A long one.", "voice": "cross_lingual_prompt",
                                                         "response_format": "pcm", "max_tokens": 2000,
                                                         "token_hop_len_first": 10}) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            next(r.iter_raw())
        # leaving the block closed the connection mid-stream
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            t = h.get(f"/v1/requests/{rid}/telemetry").json()
            if t["outcome"] != "running":
                break
            time.sleep(0.1)
    assert t["outcome"] == "cancelled"
    while svc.engine.stats()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.engine.stats()["active"] == 0 and svc.engine.stats()["queued"] == 0
    with _http(server) as h:
        t = h.get(f"/v1/requests/{rid}/telemetry").json()
    assert t["telemetry"]["cancelled"] is True  # the worker dropped it (it marks the record when it does)
    assert len(t["telemetry"]["token_times"]) < 2000


@pytest.mark.parametrize("body,param,words", [
    ({"input": "", "voice": "cross_lingual_prompt"}, "input", "empty"),
    ({"voice": "cross_lingual_prompt"}, "input", "missing"),
    ({"input": "Hi", "voice": "alloy"}, "voice", "/v1/audio/voices"),
    ({"input": "Hi"}, "voice", "prompt_audio"),
    ({"input": "Hi", "voice": "cross_lingual_prompt", "response_format": "ogg"}, "response_format", "opus"),
    ({"input": "Hi", "voice": "cross_lingual_prompt", "speed": 3}, "speed", "0.5 to 2.0"),
    ({"input": "Hi", "voice": "cross_lingual_prompt", "stream_format": "chunks"}, "stream_format", "sse"),
    ({"input": "Hi", "voice": "cross_lingual_prompt", "pre_lookahead_len": 5}, "pre_lookahead_len", "0 to 3"),
    ({"input": "Hi", "voice": "cross_lingual_prompt", "token_hop_len_first": "x"}, "token_hop_len_first", "number"),
    ({"input": "Hi", "voice": "cross_lingual_prompt", "backends": {"llm": "vllm"}}, "backends", "eager"),
    ({"input": "Hi", "voice": "cross_lingual_prompt", "temprature": 1}, "temprature", "accepted fields"),
    ({"input": "Hi", "voice": "cross_lingual_prompt", "mode": "zero_shot"}, "prompt_text", "transcript"),
    ({"input": "Hi", "voice": "cross_lingual_prompt", "mode": "instruct2"}, "instruction", "instruction"),
    ({"input": "Hi", "prompt_audio": "%%%"}, "prompt_audio", "base64"),
    ({"input": "Hi", "prompt_audio": base64.b64encode(b"not audio at all").decode(), "mode": "cross_lingual"},
     "prompt_audio", "could not decode"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, words):
    with _http(server) as h:
        r = h.post("/v1/audio/speech", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert words in err["message"], err["message"]


@pytest.mark.parametrize("fmt", ["wav", "mp3", "opus", "aac", "flac"])
def test_a_format_whose_package_is_missing_is_a_400_naming_it(server, monkeypatch, fmt):
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # `import av` now fails, as without PyAV
    with _http(server) as h:
        r = h.post("/v1/audio/speech", json={"input": "Hi", "voice": "cross_lingual_prompt", "response_format": fmt})
        pcm = h.post("/v1/audio/speech", json={"input": "Hi", "voice": "cross_lingual_prompt",
                                               "response_format": "pcm", **EXTRA})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and err["code"] == "format_unavailable"
    assert "needs the Python package 'av'" in err["message"] and "pip install av" in err["message"]
    assert pcm.status_code == 200 and len(pcm.content) > 0  # pcm needs no package: still served


def test_openai_client_raises_bad_request_with_the_message(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="cosyvoice2", voice="alloy", input="Hi")
    assert "voice 'alloy' is not known" in str(e.value)


def test_too_large_is_413(server):
    with _http(server) as h:
        long_text = h.post("/v1/audio/speech", json={"input": "a" * 5000, "voice": "cross_lingual_prompt"})
        big = h.post("/v1/audio/speech", content=b"{" + b" " * (16 * 2**20) + b"}",
                     headers={"Content-Type": "application/json"})
    assert long_text.status_code == 413 and long_text.json()["error"]["param"] == "input"
    assert "split the text" in long_text.json()["error"]["message"]
    assert big.status_code == 413 and "MB" in big.json()["error"]["message"]


def test_auth_is_enforced_on_the_api(server):
    url = server[0]
    for headers in ({}, {"Authorization": "Bearer tester:wrong"}, {"Authorization": "Basic bm9wZTpub3Bl"}):
        r = httpx.post(url + "/v1/audio/speech", json={"input": "Hi", "voice": "cross_lingual_prompt"},
                       headers=headers)
        assert r.status_code == 401, r.text
        assert "--auth" in r.json()["error"]["message"]
        assert httpx.get(url + "/v1/audio/voices", headers=headers).status_code == 401
    basic = base64.b64encode(KEY.encode()).decode()
    assert httpx.get(url + "/v1/audio/voices", headers={"Authorization": f"Basic {basic}"}).status_code == 200
    bad_client = openai.OpenAI(base_url=url + "/v1", api_key="tester:wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.audio.speech.create(model="cosyvoice2", voice="cross_lingual_prompt", input="Hi")


def test_engine_full_is_429_and_engine_closed_is_503(server, monkeypatch):
    svc = server[1]
    # one request running and none may wait: the next is refused (the engine queues up to queue_limit otherwise)
    monkeypatch.setattr(svc.engine, "config", dataclasses.replace(svc.engine.config, max_streams=1, queue_limit=0))
    with _http(server) as h:
        with h.stream("POST", "/v1/audio/speech", json={"input": "Long.", "voice": "cross_lingual_prompt",
                                                         "response_format": "pcm", "max_tokens": 2000,
                                                         "token_hop_len_first": 10}) as first:
            assert first.status_code == 200
            r = h.post("/v1/audio/speech", json={"input": "Hi", "voice": "cross_lingual_prompt"})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert "try again" in r.json()["error"]["message"] and r.json()["error"]["type"] == "rate_limit_error"

        def closed(req):
            raise EngineClosed("the engine is shut down")

        monkeypatch.setattr(svc.engine, "stream", closed)
        r = h.post("/v1/audio/speech", json={"input": "Hi", "voice": "cross_lingual_prompt"})
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert EngineBusy.__mro__[1] is RuntimeError


def test_unknown_request_telemetry_is_404(server):
    with _http(server) as h:
        r = h.get("/v1/requests/nosuchid/telemetry")
    assert r.status_code == 404 and r.json()["error"]["param"] == "request_id"


def test_metrics_export_process_figures_and_count_gradio_input_refusals(server):
    url, svc = server

    def rejected() -> float:
        return svc.metrics.registry.get_sample_value("cosyvoice_requests_total", {"outcome": "rejected"})

    text = httpx.get(url + "/metrics").text
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert name in text, name
    with httpx.Client(base_url=url, timeout=60) as h:
        assert h.post("/login", data={"username": AUTH[0], "password": AUTH[1]}).status_code in (200, 302, 303)
        before = rejected()
        # a server path passed as if uploaded: Gradio refuses it while preprocessing, before the handler runs
        fake = {"path": str(PROMPT), "meta": {"_type": "gradio.FileData"}}
        data = ["Hi", "cross_lingual", fake, None, "", "", None, 1, True, 1.0, 10, 10, 3, 2.0, 20, "eager", "eager",
                "eager", "fp32", True, ""]
        r = h.post("/gradio_api/call/synthesize", json={"data": data})
        assert r.status_code == 200, r.text
        events = h.get(f"/gradio_api/call/synthesize/{r.json()['event_id']}").text
    assert "event: error" in events
    assert rejected() == before + 1
