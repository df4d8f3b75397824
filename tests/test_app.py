"""The app as a client sees it: launched in-process on a free port with the tiny synthetic model and driven with
gradio_client (streamed chunks + final wav, dashboard figures carrying the telemetry's numbers, A/B, saved
voices, bad inputs answered with messages while the server keeps serving, no host files served)."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed here (pip install -r requirements.txt)")
sf = pytest.importorskip("soundfile", reason="soundfile is not installed here (pip install -r requirements.txt)")
gr_client = pytest.importorskip("gradio_client",
                                reason="gradio_client is not installed here (pip install -r requirements.txt)")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

from cosyvoice_fast.telemetry.record import STAGES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT = REPO / "assets" / "zero_shot_prompt.wav"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(client, base url, service) of a running app on the tiny synthetic model."""
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.app.page import build_demo, serve

    svc = load_service(None, synthetic="tiny", device="cpu", dtype="fp32",
                       speaker_cache_dir=tmp_path_factory.mktemp("speakers"), progress=False)
    demo = build_demo(svc)
    port = free_port()
    serve(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True, concurrency=2, max_queue=8)
    url = f"http://127.0.0.1:{port}/"
    try:
        yield Client(url, verbose=False), url, svc
    finally:
        demo.close()
        svc.close()


def args(**over):
    """Inputs of /synthesize: cross-lingual on the bundled prompt, a short first chunk, 60 tokens (3 chunks)."""
    a = dict(text="Hello world, this is a streaming test.", mode="cross_lingual",
             prompt_upload=handle_file(str(PROMPT)),
             prompt_mic=None, prompt_text="", instruct_text="", speaker=None, seed=7, stream=True, speed=1.0,
             token_hop_len_first=10, token_hop_len=10, pre_lookahead_len=3, stream_scale_factor=2.0,
             max_tokens=60, llm="eager", flow="eager", vocoder="eager", dtype="fp32", incremental_flow=True)
    a.update(over)
    return a


def ab_args(**over):
    a = args()
    cfg = ("token_hop_len_first", "token_hop_len", "pre_lookahead_len", "stream_scale_factor", "max_tokens",
           "llm", "flow", "vocoder", "dtype", "incremental_flow")
    out = {k: v for k, v in a.items() if k not in cfg}
    out.update({f"a_{k}": a[k] for k in cfg})
    out.update({f"b_{k}": a[k] for k in cfg})
    out.update(b_token_hop_len_first=25, b_pre_lookahead_len=1)
    out.update(over)
    return out


@pytest.fixture(scope="module")
def streamed(app):
    client = app[0]
    job = client.submit(**args(), api_name="/synthesize")
    final = job.result(timeout=120)
    return job.outputs(), final


def _unchanged(x) -> bool:
    """An output the handler left as it was (``gr.skip()`` reaches the client as an empty update)."""
    return x is None or (isinstance(x, dict) and x.get("__type__") == "update" and len(x) == 1)


def test_streaming_synthesis_yields_several_chunks_and_a_final_wav(streamed):
    # Gradio encodes streamed audio with the ffmpeg program; without it the app sends the audio whole at the end
    assert shutil.which("ffmpeg"), \
        "no ffmpeg on PATH, so the app cannot stream audio: install ffmpeg (Debian package)"
    outputs, final = streamed
    # the gr.State output (per-session history) is not part of the API: 8 values come back
    assert len(final) == 8
    stream_audio, wav_path, _ttfb, _timeline, hist, _summary, status, tele = final
    assert isinstance(tele, dict), f"raw telemetry should come back as a dict, got {type(tele)}"
    n_chunks = len(tele["chunks"])
    assert n_chunks >= 3, f"expected several chunks, got {n_chunks}"
    assert len(outputs) == n_chunks + 1  # one update per chunk, then the final one
    for o in outputs[:n_chunks]:
        assert isinstance(o[0], str) and o[0], "every chunk update carries streamed audio"
        assert _unchanged(o[1]), "the full wav comes only at the end"
        assert o[6].startswith("streaming")
    # the final result names the stream's file (no raw {'__type__': 'update'}) and does not replay it
    assert isinstance(stream_audio, str) and stream_audio.endswith(".m3u8"), stream_audio
    wav, sr = sf.read(wav_path)
    assert sr == 24000
    n_samples = sum(c["n_samples"] for c in tele["chunks"])
    assert len(wav) == n_samples and n_samples > 24000 * 1.5  # 60 tokens at 25 Hz = 2.4 s
    assert np.abs(wav).max() > 0
    assert status.startswith("done:") and f"{n_chunks} chunks" in status
    assert len(tele["token_times"]) == 60  # max_tokens reached (random weights rarely stop on their own)
    assert tele["params"]["token_hop_len_first"] == 10
    runs = json.loads(hist["plot"])["data"]  # the session history (gr.State) drawn: one run so far
    assert runs[0]["x"] == [1] and runs[0]["y"][0] == pytest.approx(tele["derived"]["ttfb_ms"])


def test_without_ffmpeg_the_audio_comes_whole_at_the_end(app):
    """No ffmpeg: each chunk leaves the streaming player alone, the last update gives it the whole utterance, and
    the header says why."""
    from cosyvoice_fast.app.handlers import CONFIG_FIELDS, VOICE_FIELDS, Handlers

    h = Handlers(app[2], stream_audio=False)
    assert "ffmpeg not found" in h.header_markdown()
    a = args(prompt_upload=str(PROMPT))
    outs = list(h.synthesize(*[a[k] for k in VOICE_FIELDS + CONFIG_FIELDS], []))
    assert len(outs) >= 4  # 3 chunks, then the final update
    for o in outs[:-1]:
        assert _unchanged(o[0]) and o[6].startswith("streaming")
    (sr, whole), (_, full) = outs[-1][0], outs[-1][1]
    assert sr == 24000 and whole.dtype == np.int16 and len(whole) > 24000 * 1.5
    assert np.array_equal(whole, full) and np.abs(whole).max() > 0


def test_dashboard_figures_carry_telemetry_values(streamed):
    outputs, final = streamed
    ttfb, timeline, hist, summary, raw = (final[2], final[3], final[4], final[5], final[7])
    fig = json.loads(ttfb["plot"])
    assert ttfb["type"] == "plotly"
    assert [t["name"] for t in fig["data"]] == list(STAGES)
    bd = raw["derived"]["ttfb_breakdown_ms"]
    for t in fig["data"]:
        assert t["x"][0] == pytest.approx(bd[t["name"]], abs=1e-6)
    assert sum(t["x"][0] for t in fig["data"]) == pytest.approx(raw["derived"]["ttfb_ms"], rel=1e-6)
    tl = {t["name"]: t for t in json.loads(timeline["plot"])["data"]}
    assert {"LLM tokens", "flow", "vocoder", "emission", "playback deadline", "underrun"} <= set(tl)
    assert tl["flow"]["x"] == pytest.approx([c["flow_ms"] for c in raw["derived"]["chunks"]], abs=1e-6)
    assert tl["playback deadline"]["x"] == pytest.approx([c["deadline_s"] * 1e3 for c in raw["derived"]["chunks"]])
    hist_traces = json.loads(hist["plot"])["data"]
    assert hist_traces[0]["name"] == "eager/eager/eager fp32" and hist_traces[0]["x"] == [1]
    rows = {r[0]: r[1] for r in summary["data"]}
    assert rows["TTFB"] == pytest.approx(raw["derived"]["ttfb_ms"], abs=0.06)
    assert rows["chunks"] == len(raw["chunks"])
    # the dashboard updated live: the first chunk's update already had a TTFB figure and a one-row timeline
    first = outputs[0]
    assert json.loads(first[2]["plot"])["data"], "TTFB figure drawn with the first chunk"
    assert len(json.loads(first[3]["plot"])["data"][0]["y"]) == 1


def test_ab_returns_two_results_and_a_difference_table(app, tmp_path):
    client = app[0]
    fresh = tmp_path / "fresh_prompt.wav"  # audio the frontend has not seen yet (its cache is keyed on content)
    wav, sr = sf.read(PROMPT, dtype="float32")
    sf.write(fresh, 0.9 * wav, sr)
    a_wav, b_wav, ttfb, tl_a, tl_b, diff, status = client.predict(
        **ab_args(prompt_upload=handle_file(str(fresh))), api_name="/ab")
    wa, sra = sf.read(a_wav)
    wb, srb = sf.read(b_wav)
    assert sra == srb == 24000 and len(wa) > 0 and len(wb) > 0
    bars = json.loads(ttfb["plot"])["data"]
    assert [t["name"] for t in bars] == list(STAGES) and bars[0]["y"] == ["A", "B"]
    rows = {r[0]: r[1:] for r in diff["data"]}
    assert rows["TTFB (ms)"][0] > 0 and rows["TTFB (ms)"][1] > 0
    # each figure is rounded to 0.1 ms on its own, so the rounded difference may differ from B - A by one step
    assert rows["TTFB (ms)"][2] == pytest.approx(rows["TTFB (ms)"][1] - rows["TTFB (ms)"][0], abs=0.1 + 1e-6)
    # A: first hop 10 -> 3 chunks for 60 tokens; B: first hop 25 -> 2 chunks
    assert rows["chunks"][:2] == [3, 2]
    # the prompt voice was analysed before A: both runs took it from the cache, so their frontends compare
    assert rows["prompt from cache (1 = yes)"][:2] == [1, 1]
    assert json.loads(tl_a["plot"])["data"] and json.loads(tl_b["plot"])["data"]
    ttfb_a, ttfb_b = rows["TTFB (ms)"][:2]
    # the status line rounds the TTFBs to 1 ms, the table to 0.1 ms: they agree within 0.55 ms
    shown = re.fullmatch(r"done: A TTFB (\d+) ms · B TTFB (\d+) ms", status)
    assert shown and abs(int(shown[1]) - ttfb_a) <= 0.55 and abs(int(shown[2]) - ttfb_b) <= 0.55, status
    assert all(r[1] is None or round(r[1], 1) == r[1] for name, r in rows.items() if "ms" in name)  # 0.1 ms


def test_summary_shows_the_first_chunk_the_engine_made(streamed):
    _, final = streamed
    rows = {r[0]: r[1:] for r in final[5]["data"]}
    assert rows["first chunk"] == [final[7]["chunks"][0]["n_tokens"], "tokens (as asked)"]
    assert final[7]["chunks"][0]["n_tokens"] == 10


def test_page_errors_are_one_status_line_not_an_error_on_every_output(app):
    """The page (its request id given): a refusal is the status line's message, the other outputs untouched; a
    gradio_client caller without a request id still gets the error (test_bad_inputs_come_back_as_messages)."""
    out = app[0].predict(**args(text="   ", client_request_id="page-0123456789abcdef"), api_name="/synthesize")
    assert out[6] == "Not synthesised: Text is empty: type something to synthesise."
    assert all(_unchanged(x) for i, x in enumerate(out) if i != 6)
    ab = app[0].predict(**ab_args(text="", client_request_ids="page-a,page-b"), api_name="/ab")
    assert ab[6] == "Not run: Text is empty: type something to synthesise." and all(map(_unchanged, ab[:6]))


def test_type_as_you_go_has_named_inputs_and_outputs_and_streams_chinese(app):
    api = app[0].view_api(print_info=False, return_format="dict")["named_endpoints"]["/type_as_you_go"]
    assert [p["parameter_name"] for p in api["parameters"]] == ["text", "words_per_second", "max_tokens"]
    assert [r["label"] for r in api["returns"]] == ["status", "speech", "chunk timeline"]
    status, speech, _ = app[0].predict("今天天气很好。", 20, 20, api_name="/type_as_you_go")
    assert status.startswith("done: ") and int(status.split()[1]) > 1  # fed piece by piece, not as one "word"
    assert app[0].predict("  ", 20, 20, api_name="/type_as_you_go")[0] == (
        "Not spoken: Text is empty: type something to speak.")


def test_stop_reports_what_the_page_heard(app):
    """Stop hands the page's player clock to the server: the status says what was heard, not what was made (the
    engine runs ahead of playback)."""
    import threading

    from cosyvoice_fast.app import tables
    from cosyvoice_fast.app.handlers import Handlers
    from cosyvoice_fast.serving.http import api_store

    client, url, svc = app
    session = httpx.post(f"{url}v1/sessions", timeout=10).json()["session"]  # as the page does
    rid = f"{session}.page-stop-test-0001"  # the address the page hands to its Gradio events
    body = {"model": "cosyvoice2", "input": "A long sentence that keeps the engine busy for a while.",
            "voice": "zero_shot_prompt", "response_format": "pcm", "max_tokens": 2000,
            "request_id": "page-stop-test-0001"}
    got = threading.Event()

    def listen():
        with httpx.stream("POST", f"{url}v1/audio/speech", json=body, headers={"X-Session": session},
                          timeout=120) as r:
            for _ in r.iter_bytes():
                got.set()
    t = threading.Thread(target=listen)
    t.start()
    assert got.wait(60), "no audio arrived"
    status = Handlers(svc).stop(rid, 1.25, 5.5)
    t.join(60)
    assert status == "stopped after 1.25 s heard (5.50 s of audio received before Stop)"
    live = api_store(svc).get(rid)
    assert live.client["stop_heard_s"] == 1.25
    tele = httpx.get(f"{url}v1/requests/{rid}/telemetry", timeout=10).json()
    assert tele["outcome"] == "cancelled"
    made = sum(c["n_samples"] for c in tele["telemetry"]["chunks"]) / 24000
    assert tables.status_line(tele["telemetry"], "cancelled").startswith(
        f"stopped after 1.25 s heard ({made:.2f} s of audio made in {len(tele['telemetry']['chunks'])} chunk")
    assert tables.stopped_line(float("nan"), 2.0, 1) == "stopped: 2.00 s of audio made in 1 chunk before Stop"



@pytest.mark.parametrize("over, expect", [
    (dict(text="   "), "Text is empty"),
    (dict(mode="zero_shot", prompt_text=""), "transcript"),
    (dict(prompt_upload=None), "needs a prompt voice"),
    (dict(token_hop_len_first=0), "token_hop_len_first=0 is out of range: use a whole number from 1 to 100"),
    (dict(speed=1.5), "only without streaming"),
    (dict(llm="trtllm"), "llm='trtllm' is not available here: "),
])
def test_bad_inputs_come_back_as_messages(app, over, expect):
    client = app[0]
    with pytest.raises(AppError, match=expect):
        client.predict(**args(**over), api_name="/synthesize")


def test_bad_prompt_files_are_messages_and_app_keeps_serving(app, tmp_path):
    client = app[0]
    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("this is not a recording")
    with pytest.raises(AppError) as e:
        client.predict(**args(prompt_upload=handle_file(str(not_audio))), api_name="/synthesize")
    assert str(e.value).strip()
    long_wav = tmp_path / "long.wav"
    sf.write(long_wav, (0.1 * np.random.default_rng(0).standard_normal(16000 * 45)).astype(np.float32), 16000)
    with pytest.raises(AppError) as e:
        client.predict(**args(prompt_upload=handle_file(str(long_wav))), api_name="/synthesize")
    assert "too long" in str(e.value)
    out = client.predict(**args(max_tokens=20), api_name="/synthesize")  # still serving
    assert out[6].startswith("done:")


def test_saved_voice_roundtrip(app):
    client, _, svc = app
    if svc.frontend is None:
        pytest.skip("the synthetic model directory has no frontend files")
    upd = client.predict("app_test_voice", handle_file(str(PROMPT)), None, "希望你以后能够做的比我还好呦。",
                         api_name="/save_speaker")
    # the dropdown comes back as an update: new choices, the saved voice selected
    assert upd["value"] == "app_test_voice" and ["app_test_voice", "app_test_voice"] in upd["choices"]
    assert "app_test_voice" in svc.frontend.list_speakers()
    out = client.predict(**args(mode="speaker", speaker="app_test_voice", prompt_upload=None, max_tokens=20),
                         api_name="/synthesize")
    assert out[6].startswith("done:")
    upd = client.predict("app_test_voice", api_name="/delete_speaker")
    assert upd["value"] is None and ["app_test_voice", "app_test_voice"] not in upd["choices"]
    assert "app_test_voice" not in svc.frontend.list_speakers()
    with pytest.raises(AppError, match="name"):
        client.predict("", handle_file(str(PROMPT)), None, "", api_name="/save_speaker")


def test_no_host_files_are_served(app):
    _, url, _ = app
    for path in ("/etc/passwd", str(REPO / "app.py"), "app.py", str(PROMPT)):
        assert httpx.get(f"{url}gradio_api/file={path}").status_code in (403, 404), path
    # a server path passed as if it had been uploaded is refused, not read
    data = list(args(prompt_upload={"path": str(PROMPT), "meta": {"_type": "gradio.FileData"}}).values()) + [""]
    r = httpx.post(f"{url}gradio_api/call/synthesize", json={"data": data})
    events = httpx.get(f"{url}gradio_api/call/synthesize/{r.json()['event_id']}", timeout=60).text
    assert "event: error" in events and "not uploaded by a user" in events


def test_random_seed(app):
    seed = app[0].predict(api_name="/random_seed")
    assert isinstance(seed, (int, float)) and 0 <= seed < 2**31


def test_readme_gradio_client_example_runs(app, monkeypatch):
    """The README's gradio_client block, run as written against this app (only the URL differs)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### From Python (`gradio_client`)"):]
    code = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 9)]
    monkeypatch.chdir(REPO)
    scope: dict = {}
    exec(code.replace("http://127.0.0.1:7860/", app[1]), scope)  # noqa: S102 - the README's own example
    assert scope["status"].startswith("done: ") and isinstance(scope["telemetry"], dict)
    assert scope["stream"].endswith(".m3u8") and scope["wav"].endswith(".wav")
