"""The bi-streaming WebSocket on the tiny synthetic model, through a real server and the ``websockets`` client."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from helpers import tiny_api

websockets = pytest.importorskip("websockets")
uvicorn = pytest.importorskip("uvicorn")

TEXT = "Hello there, this sentence arrives a few words at a time, like an agent's reply."
START = {"type": "start", "voice": None, "mode": "cross_lingual", "max_tokens": 80, "seed": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_api(tmp_path_factory.mktemp("spk")) as (svc, port):
        yield svc, f"ws://127.0.0.1:{port}/v1/audio/speech/stream"


def _start(**kw) -> str:
    from cosyvoice_fast.serving.voices import bundled_voices

    voice = next(iter(bundled_voices()))
    return json.dumps({**START, "voice": voice, **kw})


async def _session(url: str, messages: list[str]) -> tuple[list, list[bytes]]:
    jsons, audio = [], []
    async with websockets.connect(url) as ws:
        await ws.send(messages[0])
        for m in messages[1:]:
            await ws.send(m)
        try:
            async for frame in ws:
                (audio if isinstance(frame, bytes) else jsons).append(frame if isinstance(frame, bytes)
                                                                      else json.loads(frame))
        except websockets.ConnectionClosedError as e:  # an error closes with 1008/1011
            jsons.append({"closed": e.rcvd.code if e.rcvd else None})
    return jsons, audio


def test_text_pieces_in_decodable_audio_out(server):
    svc, url = server
    words = TEXT.split(" ")
    msgs = [_start()] + [json.dumps({"type": "text", "text": w + " "}) for w in words] + ['{"type": "end"}']
    jsons, audio = asyncio.run(_session(url, msgs))
    assert jsons[0]["type"] == "ready" and jsons[-1]["type"] == "done", jsons
    pcm = np.frombuffer(b"".join(audio), dtype="<i2")
    assert len(audio) > 1 and len(pcm) == 80 * 960  # max_tokens speech tokens, 960 samples each
    assert np.abs(pcm).max() > 0
    tele = jsons[-1]["telemetry"]
    assert len(tele["text_arrivals"]) == len(words) and tele["derived"]["first_audio_from_text_ms"] > 0


@pytest.mark.parametrize("first, message", [
    ("hello", "the first message must be JSON"),
    (json.dumps({"type": "start", "voice": "nobody"}), "voice 'nobody' is not known"),
    (json.dumps({"type": "start", "input": "x"}), "'input' is not used here"),
])
def test_bad_start_gets_a_json_error(server, first, message):
    _, url = server
    jsons, audio = asyncio.run(_session(url, [first]))
    assert not audio and jsons[-1] == {"closed": 1008}
    assert jsons[-2]["type"] == "error" and message in jsons[-2]["error"]["message"]


def test_bad_message_gets_a_json_error(server):
    _, url = server
    jsons, _ = asyncio.run(_session(url, [_start(), json.dumps({"type": "speak"})]))
    assert jsons[-1] == {"closed": 1008} and jsons[-2]["type"] == "error" and jsons[-2]["error"]["param"] == "type"


def test_disconnect_mid_text_cancels_the_request(server):
    svc, url = server

    async def go():
        async with websockets.connect(url) as ws:
            await ws.send(_start())
            assert json.loads(await ws.recv())["type"] == "ready"
            await ws.send(json.dumps({"type": "text", "text": "Hello there, this is"}))
            for _ in range(200):
                if svc.engine.stats()["active"] == 1:
                    break
                await asyncio.sleep(0.05)
            assert svc.engine.stats()["active"] == 1

    asyncio.run(go())  # leaves the socket without sending "end"
    for _ in range(200):
        if svc.engine.stats()["active"] == 0:
            break
        time.sleep(0.05)
    assert svc.engine.stats()["active"] == 0


def test_auth_guards_the_websocket_like_the_http_routes(server):
    """Behind ``--auth`` the handshake needs the same credentials as /v1 (refused with close code 1008)."""
    pytest.importorskip("httpx")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from cosyvoice_fast.serving.http import mount_api

    svc, _ = server
    app = FastAPI()
    mount_api(app, svc, auth=("ann", "secret"))
    client = TestClient(app)
    with pytest.raises(WebSocketDisconnect) as refused:
        with client.websocket_connect("/v1/audio/speech/stream") as ws:
            ws.receive_text()
    assert refused.value.code == 1008 and "not authenticated" in refused.value.reason
    with client.websocket_connect("/v1/audio/speech/stream", headers={"authorization": "Bearer ann:secret"}) as ws:
        ws.send_text(json.dumps({"type": "start", "voice": "nobody"}))
        reply = json.loads(ws.receive_text())
    assert reply["type"] == "error" and "voice 'nobody' is not known" in reply["error"]["message"]
