"""Security of the app and of the files it reads: login (``--auth``), no host file served, upload size limit,
speaker names that cannot escape the speaker directory, pickle-free speaker cache, weights_only model loading,
and user-facing errors without server paths.

One app is launched with a login (tiny synthetic model); every API call below either logs in or must be refused.
"""

from __future__ import annotations

import ast
import re
import struct
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed here (pip install -r requirements.txt)")
sf = pytest.importorskip("soundfile", reason="soundfile is not installed here (pip install -r requirements.txt)")
gr_client = pytest.importorskip("gradio_client",
                                reason="gradio_client is not installed here (pip install -r requirements.txt)")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

from cosyvoice_fast.frontend.speaker import SpeakerCache, SpeakerCacheError, validate_speaker_name  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "cosyvoice_fast"
USER, PASSWORD = "alice", "s3cret-pass"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.app.page import build_demo, serve
    from tests.test_app import free_port

    spk = tmp_path_factory.mktemp("speakers")
    svc = load_service(None, synthetic="tiny", device="cpu", speaker_cache_dir=spk, progress=False)
    demo = build_demo(svc)
    port = free_port()
    serve(demo, port=port, prevent_thread_lock=True, quiet=True, auth=(USER, PASSWORD))
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, svc, demo, spk
    finally:
        demo.close()
        svc.close()


@pytest.fixture(scope="module")
def client(app):
    return Client(app[0] + "/", auth=(USER, PASSWORD), verbose=False)


@pytest.fixture(scope="module")
def logged_in(app):
    """An httpx client holding the login cookie."""
    c = httpx.Client(base_url=app[0], timeout=60)
    r = c.post("/login", data={"username": USER, "password": PASSWORD})
    assert r.status_code == 200, r.text
    yield c
    c.close()


def _prompt(tmp_path: Path, seconds: float = 1.5) -> Path:
    t = np.arange(int(seconds * 16000)) / 16000
    p = tmp_path / "voice.wav"
    sf.write(p, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 16000)
    return p


# ------------------------------------------------------------------------------------------------ login

@pytest.mark.parametrize("method, path", [
    ("GET", "/config"), ("GET", "/gradio_api/info"), ("GET", "/gradio_api/openapi.json"),
    ("POST", "/gradio_api/call/synthesize"), ("POST", "/gradio_api/queue/join"), ("POST", "/gradio_api/upload"),
    ("POST", "/gradio_api/run/random_seed"), ("GET", "/gradio_api/file=/etc/passwd"),
])
def test_unauthenticated_api_calls_are_refused(app, method, path):
    r = httpx.request(method, app[0] + path, json={"data": []} if method == "POST" else None)
    assert r.status_code == 401, (path, r.status_code, r.text[:200])


def test_wrong_password_is_refused(app):
    r = httpx.post(app[0] + "/login", data={"username": USER, "password": "guess"})
    assert r.status_code == 400 and "Incorrect credentials" in r.text
    with pytest.raises(Exception):
        Client(app[0] + "/", auth=(USER, "guess"), verbose=False)


def test_logged_in_client_works(client):
    seed = client.predict(api_name="/random_seed")
    assert 0 <= seed < 2**31


def test_health_and_metrics_need_no_login_and_hold_no_secrets(app):
    for path in ("/health", "/metrics"):
        r = httpx.get(app[0] + path)
        assert r.status_code == 200
        assert PASSWORD not in r.text and str(app[3]) not in r.text and "/tmp" not in r.text


def test_app_py_auth_flag_is_parsed_and_checked():
    import app as app_module  # the repository's app.py

    assert app_module.parse_args(["--auth", "bob:pa:ss"]).auth == "bob:pa:ss"  # the password may hold ':'
    for bad in ("nocolon", ":nopassworduser"):
        with pytest.raises(SystemExit):
            app_module.parse_args(["--auth", bad])


# ------------------------------------------------------------------------------------------------ files

def test_launch_serves_no_extra_paths_and_limits_uploads(app):
    _, _, demo, _ = app
    assert demo.allowed_paths == [] or demo.allowed_paths is None
    assert demo.max_file_size == 10 * 1024 * 1024


@pytest.mark.parametrize("target", [
    "/etc/passwd", "../../../../etc/passwd", quote("/etc/passwd", safe=""), "%2e%2e/%2e%2e/etc/passwd",
    str(REPO / "app.py"), str(REPO / "cosyvoice_fast" / "modelfiles.py"), "~/.bashrc", "file:///etc/passwd",
])
def test_no_host_file_is_served(app, logged_in, target):
    r = logged_in.get(f"/gradio_api/file={target}")
    assert r.status_code in (403, 404), (target, r.status_code)
    assert "root:" not in r.text


def test_model_and_speaker_files_are_not_served(app, logged_in):
    _, svc, _, spk = app
    for f in [svc.models.files.path("llm.pt"), svc.models.files.path("cosyvoice2.yaml"), spk]:
        r = logged_in.get(f"/gradio_api/file={f}")
        assert r.status_code in (403, 404), (f, r.status_code)


def test_upload_over_the_limit_is_refused(app, logged_in):
    big = b"RIFF" + bytes(11 * 1024 * 1024)
    r = logged_in.post("/gradio_api/upload", files={"files": ("big.wav", big, "audio/wav")})
    assert r.status_code == 413 and "10" in r.text
    small = logged_in.post("/gradio_api/upload", files={"files": ("small.wav", b"RIFF" + bytes(1000), "audio/wav")})
    assert small.status_code == 200


# ------------------------------------------------------------------------------------------------ speakers

@pytest.mark.parametrize("name", [
    "../evil", "..", "a/b", "a\\b", "/etc/passwd", "C:evil", ".hidden", "x.safetensors", "", " ", "a b",
    "con", "LPT1", "nul", "a\x00b", "evil\u202egnp", "a" * 65, None, 3,
])
def test_unsafe_speaker_names_are_refused(name):
    with pytest.raises(SpeakerCacheError, match="invalid speaker name"):
        validate_speaker_name(name)


def test_speaker_names_cannot_escape_the_cache_dir_through_the_app(app, client, tmp_path):
    _, svc, _, spk = app
    prompt = handle_file(str(_prompt(tmp_path)))
    outside = spk.parent / "escaped.safetensors"
    for name in ("../escaped", "..\\escaped", "/tmp/escaped"):
        with pytest.raises(AppError, match="invalid speaker name"):
            client.predict(name, prompt, None, "", api_name="/save_speaker")
        with pytest.raises(AppError, match="invalid speaker name|Pick a saved speaker|not in the list of choices"):
            client.predict(name, api_name="/delete_speaker")
    assert not outside.exists() and not Path("/tmp/escaped.safetensors").exists()
    assert all(p.parent == spk for p in spk.iterdir())


def test_speaker_cache_is_safetensors_and_pickle_free(app, client, tmp_path):
    _, svc, _, spk = app
    client.predict("sec_voice", handle_file(str(_prompt(tmp_path))), None, "hello there", api_name="/save_speaker")
    f = spk / "sec_voice.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])  # safetensors: u64 header length, then a JSON header
    assert raw[8:9] == b"{" and raw[8:8 + n].rstrip(b" ").endswith(b"}")
    assert not raw.startswith(b"\x80") and b"PK\x03\x04" not in raw[:4]  # neither a pickle nor a torch zip
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as st:
        assert {"speech_token", "speech_feat", "embedding"} <= set(st.keys())
    client.predict("sec_voice", api_name="/delete_speaker")


def test_a_pickle_planted_in_the_speaker_dir_is_not_executed(tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "planted.safetensors").write_bytes(pickle.dumps(Evil()))
    cache = SpeakerCache(tmp_path)
    with pytest.raises(SpeakerCacheError, match="saved speaker 'planted' is damaged"):
        cache.get("planted")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ source checks

def _calls(path: Path, func: str) -> list[ast.Call]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == func]


def test_every_torch_load_is_weights_only():
    found = 0
    for py in PKG.rglob("*.py"):
        for call in _calls(py, "load"):
            if getattr(call.func.value, "id", None) != "torch":
                continue
            found += 1
            kw = {k.arg: k.value for k in call.keywords}
            assert "weights_only" in kw and getattr(kw["weights_only"], "value", None) is True, \
                f"{py.relative_to(REPO)}:{call.lineno}: torch.load without weights_only=True"
    assert found >= 1


def test_no_pickle_deserialisation_in_the_package():
    for py in PKG.rglob("*.py"):
        src = py.read_text(encoding="utf-8")
        assert not re.search(r"\bpickle\.loads?\(|\bdill\.|\bjoblib\.load|yaml\.load\((?!.*Loader=)|"
                             r"yaml\.unsafe_load|(?<![.\w])eval\(|(?<![.\w])exec\(", src), py.relative_to(REPO)


# ------------------------------------------------------------------------------------------------ messages

def test_bad_upload_errors_show_no_server_paths(app, client, tmp_path):
    _, svc, _, spk = app
    notes = tmp_path / "notes.wav"
    notes.write_text("not audio at all")
    args = ["hello", "cross_lingual", handle_file(str(notes)), None, "", "", None, 1, True, 1.0,
            10, 10, 3, 2.0, 10, "eager", "eager", "eager", "fp32", True]
    with pytest.raises(AppError) as e:
        client.predict(*args, api_name="/synthesize")
    msg = str(e.value)
    assert "could not decode 'notes.wav' as audio" in msg
    with pytest.raises(AppError) as e2:
        client.predict("v1", handle_file(str(notes)), None, "", api_name="/save_speaker")
    msg2 = str(e2.value)
    assert "could not decode 'notes.wav' as audio" in msg2
    root = str(svc.models.files.root)
    for m in (msg, msg2):
        assert "/tmp/gradio" not in m and str(tmp_path) not in m and root not in m and str(spk) not in m, m
        assert not re.search(r"(?<![\w.])/(?:[\w.-]+/)+", m), f"absolute path in a user-facing message: {m}"


def test_redact_paths():
    from cosyvoice_fast.app.messages import redact_paths

    assert redact_paths("Error opening '/tmp/gradio/ab12/x.wav': bad") == "Error opening 'x.wav': bad"
    assert redact_paths("missing /home/u/models/CosyVoice2-0.5B/llm.pt") == "missing llm.pt"
    assert redact_paths(r"C:\Users\bob\voice.wav is empty") == "voice.wav is empty"
    assert redact_paths("B / A, tokens/s, 1/2, https://example.org/x") == "B / A, tokens/s, 1/2, https://example.org/x"
