"""The streaming engine on the tiny fixture model: schedule, mel parity, joins, concurrency, cancellation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.engine.engine import Engine
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.telemetry.record import STAGES
from helpers import ScriptedLLM


class SpyFlow:
    max_batch = 1  # every call through ``chunk``, so each is recorded alone

    def __init__(self, inner):  # noqa: ANN001
        self.inner = inner
        self.calls: list[tuple] = []

    def solve(self, items):  # noqa: ANN001
        return [self.chunk(*item) for item in items]

    def chunk(self, seg, inputs, tokens, call):  # noqa: ANN001
        mel = self.inner.chunk(seg, inputs, tokens, call)
        self.calls.append((call, mel.clone()))
        return mel


@pytest.fixture(scope="module")
def engine(tiny_models):
    eng = Engine(tiny_models)
    yield eng
    eng.close()


def _inputs(case: dict, n_text: int = 6, seed: int = 0) -> ModelInputs:
    g = torch.Generator().manual_seed(seed)
    return ModelInputs(text_segments=[torch.randint(0, 1000, (1, n_text), generator=g)],
                       prompt_text=torch.randint(0, 1000, (1, 4), generator=g),
                       llm_prompt_speech_token=case["prompt_token"], flow_prompt_speech_token=case["prompt_token"],
                       prompt_feat=case["prompt_feat"], embedding=case["embedding"])


@pytest.fixture(scope="module")
def stream_case(load_case):
    return load_case("case_flow_stream")


def test_default_schedule_and_mel_match_upstream_stream(tiny_models, stream_case):
    eng = Engine(tiny_models)
    try:
        stages = eng.stages(BackendConfig())
        spy = SpyFlow(stages.flow)
        stages.llm, stages.flow = ScriptedLLM(stream_case["token"][0].tolist()), spy
        chunks = list(eng.stream(SynthesisRequest(inputs=_inputs(stream_case), seed=0)))
    finally:
        eng.close()
    rec = stream_case["calls"]
    assert len(spy.calls) == len(rec) == len(chunks)
    for (call, mel), r in zip(spy.calls, rec):
        assert (call.n_tokens, call.token_offset, call.finalize) == (r["n_tokens"], r["token_offset"], r["finalize"])
        expected = r["mel"][:, :, r["token_offset"] * 2:]
        assert mel.shape == expected.shape
        assert (mel - expected).abs().max().item() <= 1e-4
    # no sample dropped or doubled at the joins: 960 samples per token in total
    total = sum(len(c.samples) for c in chunks)
    assert total == stream_case["token"].shape[1] * 960
    assert chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])


def test_joins_are_continuous(engine, stream_case):
    params = StreamParams(token_hop_len_first=10, token_hop_len=15, stream_scale_factor=1.0)
    chunks = list(engine.stream(SynthesisRequest(inputs=_inputs(stream_case), seed=3, max_tokens=80,
                                                 ignore_eos=True, stream_params=params)))
    wav = np.concatenate([c.samples for c in chunks])
    assert len(wav) == 80 * 960
    # the two Hamming halves sum to at most 1.08, so a cross-faded join may exceed HiFT's 0.99 clip slightly
    assert np.isfinite(wav).all() and np.abs(wav).max() <= 0.99 * 1.08 + 1e-6
    steps = np.abs(np.diff(wav))
    joins = np.cumsum([len(c.samples) for c in chunks])[:-1]
    assert len(joins) == 5  # 10 + 15*4 tokens, then the final 10
    assert steps[joins - 1].max() <= steps.max()  # no jump at a join beyond what the signal itself has
    assert steps[joins - 1].max() < 10 * np.median(steps) + 0.2


@pytest.mark.parametrize("hop_first,lookahead,expected_first", [(25, 3, 30), (10, 3, 10), (5, 0, 5), (8, 2, 8)])
def test_first_chunk_token_count_follows_params(engine, stream_case, hop_first, lookahead, expected_first):
    req = SynthesisRequest(inputs=_inputs(stream_case), seed=1, max_tokens=60, ignore_eos=True,
                           stream_params=StreamParams(token_hop_len_first=hop_first, pre_lookahead_len=lookahead))
    chunks = list(engine.stream(req))
    assert chunks[0].timing.n_tokens == expected_first
    assert len(chunks[0].samples) == expected_first * 960 - 3840  # 8 frames held back for the cross-fade


def test_second_identical_request_starts_with_the_same_first_chunk(engine, stream_case):
    """Upstream rewrote the hop on the shared model, so its second request began with a 100-token chunk."""
    firsts = []
    for _ in range(2):
        chunks = list(engine.stream(SynthesisRequest(inputs=_inputs(stream_case), seed=2, max_tokens=60,
                                                     ignore_eos=True)))
        firsts.append([c.timing.n_tokens for c in chunks])
    assert firsts[0] == firsts[1]
    assert firsts[0][0] == 30


def test_concurrent_seeded_requests_equal_solo(engine, stream_case):
    reqs = [dict(inputs=_inputs(stream_case, seed=i), seed=100 + i, max_tokens=30) for i in range(8)]
    solo = [engine.synthesize(SynthesisRequest(**r))[0] for r in reqs]
    results: list[np.ndarray | None] = [None] * len(reqs)

    def run(i: int) -> None:
        results[i] = engine.synthesize(SynthesisRequest(**reqs[i]))[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "concurrent requests hung"
    for i, (a, b) in enumerate(zip(solo, results)):
        assert b is not None and len(a) == len(b), f"request {i}"
        np.testing.assert_array_equal(a, b)
    assert len({len(a) for a in solo}) > 1 or not all(np.array_equal(solo[0], a) for a in solo[1:])


def test_cancel_stops_within_one_step_and_frees_state(engine, stream_case):
    req = SynthesisRequest(inputs=_inputs(stream_case), seed=5, max_tokens=400, ignore_eos=True,
                           stream_params=StreamParams(token_hop_len_first=5, pre_lookahead_len=0))
    it = engine.stream(req)
    first = next(it)
    assert first.index == 0
    state = next(s for s in engine._active if s.id == req.request_id)
    it.close()
    steps_at_cancel = state.decode_steps
    deadline = time.time() + 10
    while engine.active_requests() and time.time() < deadline:
        time.sleep(0.01)
    assert engine.active_requests() == 0
    assert state.decode_steps - steps_at_cancel <= 1
    assert state.segment is None and state.telemetry.cancelled
    assert len(state.telemetry.token_times) < 400


def test_telemetry_stages_ordered_and_sum_to_ttfb(engine, stream_case):
    chunks = list(engine.stream(SynthesisRequest(inputs=_inputs(stream_case), seed=7, max_tokens=50,
                                                 ignore_eos=True)))
    tele = chunks[-1].telemetry
    bd = tele.ttfb_breakdown()
    assert list(bd) == list(STAGES)
    assert all(v >= 0 for v in bd.values()), bd
    assert abs(sum(bd.values()) - tele.ttfb * 1e3) < 1e-6
    c0 = tele.chunks[0]
    assert tele.received <= tele.frontend_done <= tele.prefill_start <= tele.prefill_done <= c0.tokens_ready
    assert c0.tokens_ready <= c0.flow_start <= c0.flow_end <= c0.vocoder_end <= c0.delivered
    assert len(tele.token_times) == 50 and tele.rtf > 0
    assert [c.index for c in tele.chunks] == list(range(len(tele.chunks)))


def test_error_in_one_request_does_not_disturb_others(engine, stream_case):
    bad = _inputs(stream_case)
    bad.prompt_feat = torch.zeros(1, 500, 80)  # more prompt frames than the prompt tokens give: flow refuses
    good = SynthesisRequest(inputs=_inputs(stream_case), seed=9, max_tokens=40, ignore_eos=True)
    out: dict[str, object] = {}

    def run_bad() -> None:
        try:
            list(engine.stream(SynthesisRequest(inputs=bad, seed=9, max_tokens=40, ignore_eos=True)))
        except Exception as e:  # noqa: BLE001
            out["bad"] = e

    t = threading.Thread(target=run_bad)
    t.start()
    wav, tele = engine.synthesize(good)
    t.join(timeout=120)
    assert isinstance(out.get("bad"), ValueError) and "prompt mel" in str(out["bad"])
    assert len(wav) == 40 * 960 and tele.error is None


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "karaoke"}, "unknown mode"),
    ({"speed": 3.0, "stream": False}, "speed"),
    ({"speed": 1.5, "stream": True}, "streaming"),
    ({"ignore_eos": True}, "max_tokens"),
    ({"text": "   ", "inputs": None}, "Text is empty"),
])
def test_invalid_requests_raise_clear_errors(stream_case, kwargs, match):
    base = {"inputs": _inputs(stream_case)}
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        SynthesisRequest(**base)


def test_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="unknown flow backend"):
        BackendConfig(flow="warp-drive")


def test_cudagraph_backend_without_cuda_says_why(engine, stream_case):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    req = SynthesisRequest(inputs=_inputs(stream_case), backend=BackendConfig(llm="cudagraph"))
    with pytest.raises(Exception, match="needs a CUDA GPU"):
        list(engine.stream(req))


def test_scheduler_failure_fails_requests_instead_of_hanging(tiny_models, stream_case, monkeypatch):
    eng = Engine(tiny_models)
    try:
        def broken_turn() -> None:
            raise KeyError("boom")

        monkeypatch.setattr(eng, "_turn", broken_turn)
        with pytest.raises(RuntimeError, match=r"internal engine error \(KeyError\)"):
            list(eng.stream(SynthesisRequest(inputs=_inputs(stream_case), seed=0, max_tokens=5, ignore_eos=True)))
        assert eng.active_requests() == 0 and eng._thread.is_alive()
    finally:
        eng.close()


def test_incremental_flow_streams_the_same_audio(engine, stream_case):
    """The ``incremental`` flow keeps per-request encoder/estimator state yet yields upstream's chunks."""
    out = {}
    for flow, incremental in (("eager", False), ("incremental", True)):
        req = SynthesisRequest(inputs=_inputs(stream_case), seed=4, max_tokens=90, ignore_eos=True,
                               backend=BackendConfig(flow="eager", incremental=incremental))
        out[flow] = [c.samples for c in engine.stream(req)]
    assert [len(c) for c in out["eager"]] == [len(c) for c in out["incremental"]]
    assert len(out["eager"]) >= 3
    # mels agree within 3.3e-6 (tests/test_incremental_flow.py); the random-weight HiFT turns that float noise
    # into at most a few 1e-4 on samples swinging between its clips (see tests/test_parity_hift.py)
    for a, b in zip(out["eager"], out["incremental"]):
        assert np.abs(a - b).max() <= 1e-3 and np.abs(a - b).mean() <= 1e-5
