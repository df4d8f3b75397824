"""Cancellation frees the request within one decode step, however the consumer goes away: closing the iterator
mid-stream or before its first chunk, dropping it, Engine.cancel, closing it from another thread while a
``next`` is blocked, ``astream`` aclose / task cancel; and in the app, a client that cancels its job."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest
import torch

from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.engine.engine import Engine
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.flow.incremental_state import FlowState

FAST = StreamParams(token_hop_len_first=3, token_hop_len=3, pre_lookahead_len=0)


@pytest.fixture(scope="module")
def case(load_case):
    return load_case("case_flow_stream")


@pytest.fixture(scope="module")
def engine(tiny_models):
    eng = Engine(tiny_models)
    outcomes: list[tuple[str, str]] = []
    eng.add_observer(lambda tele, outcome: outcomes.append((tele.request_id, outcome)))
    eng.outcomes = outcomes  # type: ignore[attr-defined]
    yield eng
    eng.close()


def _long(case, seed=0, **kw) -> SynthesisRequest:
    """A request that would run for 400 tokens (tens of seconds here) unless cancelled."""
    inputs = ModelInputs(text_segments=[torch.arange(6)[None] + seed], llm_prompt_speech_token=case["prompt_token"],
                         flow_prompt_speech_token=case["prompt_token"], prompt_feat=case["prompt_feat"],
                         embedding=case["embedding"])
    return SynthesisRequest(inputs=inputs, seed=seed, max_tokens=400, ignore_eos=True, stream_params=FAST, **kw)


def _state(engine, rid):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with engine._cv:
            for st in list(engine._incoming) + engine._active:
                if st.id == rid:
                    return st
        time.sleep(0.001)
    raise AssertionError(f"request {rid} never became active")


def _drained(engine, timeout=10.0) -> float:
    t0 = time.monotonic()
    while engine.active_requests() and time.monotonic() - t0 < timeout:
        time.sleep(0.002)
    assert engine.active_requests() == 0, "the cancelled request is still held by the engine"
    return time.monotonic() - t0


def _assert_freed(engine, st, steps_at_cancel):
    assert st.done and st.segment is None, "per-request state (KV cache, flow/vocoder caches) not released"
    assert st.decode_steps - steps_at_cancel <= 1, "the LM ran more than one step after the cancel"
    assert len(st.telemetry.token_times) < 400
    assert st not in engine._active and st not in engine._incoming


def test_close_mid_stream(engine, case):
    req = _long(case, 1)
    it = engine.stream(req)
    next(it), next(it)
    st = _state(engine, req.request_id)
    flow_state = weakref.ref(st.segment.flow_state)  # the incremental flow's per-request state (the default)
    assert isinstance(flow_state(), FlowState) and flow_state().nbytes() > 0
    it.close()
    steps = st.decode_steps
    _drained(engine)
    _assert_freed(engine, st, steps)
    gc.collect()
    assert flow_state() is None, "the cancelled request's flow state is still referenced"
    assert st.telemetry.cancelled and (req.request_id, "cancelled") in engine.outcomes
    assert list(it) == []  # a closed stream just ends


def test_close_before_the_first_chunk(engine, case):
    """Closing a stream never iterated used to do nothing (a generator that never started has no finally to
    run): the request ran all 400 tokens in the background.  It is cancelled now."""
    req = _long(case, 2)
    it = engine.stream(req)
    st = _state(engine, req.request_id)
    it.close()
    steps = st.decode_steps
    _drained(engine)
    _assert_freed(engine, st, steps)


def test_dropping_the_iterator_cancels(engine, case):
    req = _long(case, 3)
    it = engine.stream(req)
    next(it)
    st = _state(engine, req.request_id)
    del it
    gc.collect()
    steps = st.decode_steps
    _drained(engine)
    _assert_freed(engine, st, steps)


def test_breaking_out_of_a_for_loop_cancels(engine, case):
    req = _long(case, 4)
    for _chunk in engine.stream(req):
        break
    _drained(engine)


def test_engine_cancel_ends_the_consumers_iteration(engine, case):
    req = _long(case, 5)
    it = engine.stream(req)
    next(it)
    assert engine.cancel(req.request_id)
    t0 = time.monotonic()
    rest = list(it)  # must end, not hang
    assert time.monotonic() - t0 < 10 and len(rest) < 100
    _drained(engine)
    assert not engine.cancel(req.request_id)  # already gone


def test_close_from_another_thread_wakes_a_blocked_next(engine, case):
    """A consumer thread blocked in ``next`` while another thread closes the stream (what a web server does when
    the client disconnects): the blocked ``next`` returns, nothing stays stuck."""
    req = _long(case, 6, stream=False)  # non-streaming: no chunk until the end, so `next` blocks
    it = engine.stream(req)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(next(it, "ended")))
    t.start()
    st = _state(engine, req.request_id)
    time.sleep(0.1)
    assert t.is_alive()
    it.close()
    t.join(timeout=10)
    assert not t.is_alive() and got == ["ended"]
    steps = st.decode_steps
    _drained(engine)
    _assert_freed(engine, st, steps)


def test_astream_aclose_frees_the_request(engine, case):
    async def main():
        req = _long(case, 7)
        agen = engine.astream(req)
        await agen.__anext__()
        st = _state(engine, req.request_id)
        await agen.aclose()
        return st

    st = asyncio.run(main())
    steps = st.decode_steps
    _drained(engine)
    _assert_freed(engine, st, steps)


def test_astream_task_cancel_frees_the_request_and_its_thread(engine, case):
    """Cancel the task while it awaits a chunk in a worker thread (non-streaming: the chunk never comes)."""
    async def main():
        req = _long(case, 8, stream=False)
        chunks = []

        async def consume():
            async for c in engine.astream(req):
                chunks.append(c)

        task = asyncio.create_task(consume())
        st = await asyncio.to_thread(_state, engine, req.request_id)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the thread that waited for the chunk must come back: the default executor shuts down cleanly
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.shutdown_default_executor(), timeout=10)
        return st, chunks

    st, chunks = asyncio.run(main())
    steps = st.decode_steps
    _drained(engine)
    _assert_freed(engine, st, steps)
    assert chunks == []


def test_astream_task_cancelled_during_admission(engine, case, monkeypatch):
    """Cancelled while the frontend runs: the request admitted afterwards is dropped, not left running."""
    real = engine._admit
    gate = threading.Event()

    def slow_admit(req):
        gate.wait(5)
        return real(req)

    monkeypatch.setattr(engine, "_admit", slow_admit)

    async def main():
        task = asyncio.create_task(engine.astream(_long(case, 9)).__anext__())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await asyncio.sleep(0.5)

    asyncio.run(main())
    _drained(engine)


def test_observer_outcomes(engine, case):
    ok = SynthesisRequest(inputs=_long(case, 10).inputs, seed=1, max_tokens=4, ignore_eos=True)
    engine.synthesize(ok)
    assert (ok.request_id, "ok") in engine.outcomes
    bad = SynthesisRequest(text="no frontend here", seed=1)
    with pytest.raises(ValueError, match="this engine has no frontend"):
        engine.synthesize(bad)
    assert (bad.request_id, "rejected") in engine.outcomes
    assert sum(1 for rid, _ in engine.outcomes if rid == ok.request_id) == 1  # reported once


# ------------------------------------------------------------------------------------------------ the app

@pytest.fixture(scope="module")
def app(tmp_path_factory):
    pytest.importorskip("gradio_client")
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.bench.soak import test_prompt
    from cosyvoice_fast.app.page import build_demo, serve
    from tests.test_app import free_port

    d = tmp_path_factory.mktemp("app")
    svc = load_service(None, synthetic="tiny", device="cpu", speaker_cache_dir=d / "spk", progress=False)
    demo = build_demo(svc)
    port = free_port()
    serve(demo, port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}", svc, test_prompt(d / "p.wav")
    finally:
        demo.close()
        svc.close()


def _endless(prompt_file):
    """/synthesize inputs: cross-lingual, 3-token chunks, 2000 tokens (far longer than any test waits)."""
    return ["hello there", "cross_lingual", prompt_file, None, "", "", None, 1, True, 1.0, 3, 3, 0, 1.0, 2000,
            "eager", "eager", "eager", "fp32", True, ""]  # last: client_request_id (none: the app synthesises)


def test_app_client_cancel_frees_the_engine(app):
    """A gradio_client job cancelled mid-stream (what the Stop button does): the handler's generator is closed,
    so the engine request is cancelled instead of running to its end."""
    from gradio_client import Client, handle_file

    url, svc, prompt = app
    client = Client(url + "/", verbose=False)
    job = client.submit(*_endless(handle_file(str(prompt))), api_name="/synthesize")
    deadline = time.monotonic() + 60
    while not job.outputs() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.outputs(), "no chunk streamed"
    assert svc.engine.active_requests() == 1
    job.cancel()
    _drained(svc.engine, timeout=15)


def test_app_client_disconnect_frees_the_engine(app):
    """A client that drops the event stream (a closed tab, a lost network) after the first chunks."""
    import httpx

    url, svc, prompt = app
    up = httpx.post(f"{url}/gradio_api/upload", files={"files": ("p.wav", prompt.read_bytes(), "audio/wav")})
    data = _endless({"path": up.json()[0], "orig_name": "p.wav", "meta": {"_type": "gradio.FileData"}})
    event_id = httpx.post(f"{url}/gradio_api/call/synthesize", json={"data": data}).json()["event_id"]
    seen = 0
    with httpx.stream("GET", f"{url}/gradio_api/call/synthesize/{event_id}", timeout=60) as resp:
        for line in resp.iter_lines():
            seen += line.startswith("event: generating")
            if seen >= 2:
                break  # leaving the block closes the connection
    assert seen == 2 and svc.engine.active_requests() == 1
    _drained(svc.engine, timeout=15)
