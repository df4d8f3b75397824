"""Request isolation on one engine: 16 concurrent streams with different prompts and seeds produce exactly their
solo audio, and faults injected into one request (in the LM, the flow or the vocoder, mid-stream) reach that
request's consumer only; a consumer that stops reading does not hold anybody else up.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.engine.engine import Engine
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.vocoder.stream import ChunkJoining

N = 16
PARAMS = StreamParams(token_hop_len_first=5, token_hop_len=5, pre_lookahead_len=0)
MAX_TOKENS = 12  # chunks at 5, 10 and the final 12 tokens: three flow + vocoder calls per request


class InjectedFault(RuntimeError):
    pass


class FaultyLLM:
    """Fails the row of requests whose inputs are tagged ``speaker == tag`` once they hold ``after`` tokens (the
    other rows of the same batched call go on)."""

    def __init__(self, inner, tag: str, after: int = 6):
        self.inner, self.tag, self.after = inner, tag, after
        self.capacity = inner.capacity
        self.prefill_synced = False  # the engine waits for the stream after prefill (a no-op on the CPU)
        # the tagged states themselves, compared by identity: an ``id()`` of a state that has since been freed can
        # come back as a later, untagged request's state (it did: a later test's request failed with this fault)
        self.tagged: list[object] = []

    def new_state(self, inputs, text, generator, max_tokens, ignore_eos):  # noqa: ANN001
        st = self.inner.new_state(inputs, text, generator, max_tokens, ignore_eos)
        if inputs.speaker == self.tag:
            self.tagged.append(st)
        return st

    def _is_tagged(self, st) -> bool:  # noqa: ANN001
        return any(st is t for t in self.tagged)

    def free_slots(self):
        return self.inner.free_slots()

    def prefill(self, states):  # noqa: ANN001
        return self.inner.prefill(states)

    def decode(self, states):  # noqa: ANN001
        out = self.inner.decode(states)
        return [InjectedFault(f"LM fault injected at token {st.step - 1}")
                if self._is_tagged(st) and st.step > self.after else r for st, r in zip(states, out)]

    def release(self, state):  # noqa: ANN001
        self.inner.release(state)


class FaultyFlow:
    """Raises on the ``n``-th chunk (1-based) of requests tagged ``speaker == tag``."""

    max_batch = 1  # each request's chunk alone, so the fault hits only the tagged one

    def __init__(self, inner, tag: str, n: int = 2):
        self.inner, self.tag, self.n = inner, tag, n
        self.calls: dict[int, int] = {}

    def solve(self, items):  # noqa: ANN001
        return [self.chunk(*item) for item in items]

    def chunk(self, seg, inputs, tokens, call):  # noqa: ANN001
        if inputs.speaker == self.tag:
            k = self.calls[id(seg)] = self.calls.get(id(seg), 0) + 1
            if k == self.n:
                raise InjectedFault(f"flow fault injected on chunk {k}")
        return self.inner.chunk(seg, inputs, tokens, call)


class FaultyVocoder(ChunkJoining):
    """Raises for the requests whose vocoder generator (one per request) was armed."""

    max_batch = 1  # each chunk alone through ``vocode``, where the fault is injected

    def __init__(self, inner):
        self.inner = inner
        self.armed: list[object] = []  # the generators themselves (identity, not a reusable id())

    def vocode_batch(self, mels, sources, generators):  # noqa: ANN001
        outs = [self.vocode(mels[i:i + 1], sources[i:i + 1], g) for i, g in enumerate(generators)]
        return torch.cat([w for w, _ in outs]), torch.cat([s for _, s in outs])

    def vocode(self, mel, cache_source, generator):  # noqa: ANN001
        if any(generator is g for g in self.armed):
            raise InjectedFault("vocoder fault injected")
        return self.inner.vocode(mel, cache_source, generator)


def _inputs(case: dict, i: int, tag: str | None = None) -> ModelInputs:
    """Different prompt lengths, text and embedding per ``i``."""
    g = torch.Generator().manual_seed(1000 + i)
    n_prompt = 8 + (i % 5) * 3  # 8..20 prompt tokens
    return ModelInputs(text_segments=[torch.randint(0, 1000, (1, 4 + i % 4), generator=g)],
                       prompt_text=torch.randint(0, 1000, (1, 3), generator=g),
                       llm_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                       flow_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                       prompt_feat=case["prompt_feat"][:, :2 * n_prompt],
                       embedding=case["embedding"] + 0.05 * torch.randn(1, 192, generator=g), speaker=tag)


def _request(case: dict, i: int, tag: str | None = None) -> SynthesisRequest:
    return SynthesisRequest(inputs=_inputs(case, i, tag), seed=7 * i + 1, max_tokens=MAX_TOKENS, ignore_eos=True,
                            stream_params=PARAMS, request_id=f"req{i}")


@pytest.fixture(scope="module")
def case(load_case):
    return load_case("case_flow_stream")


@pytest.fixture(scope="module")
def engine(tiny_models):
    eng = Engine(tiny_models)
    stages = eng.stages(BackendConfig())
    stages.llm = FaultyLLM(stages.llm, tag="llm-fault")
    stages.flow = FaultyFlow(stages.flow, tag="flow-fault")
    stages.vocoder = FaultyVocoder(stages.vocoder)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def solo(engine, case):
    """Each request alone, one after the other: the reference audio (per chunk)."""
    return [[c.samples for c in engine.stream(_request(case, i))] for i in range(N)]


def _run_all(engine, requests, start_barrier=True):
    """Consume every request in its own thread; {index: list of chunk arrays | exception}."""
    out: dict[int, object] = {}
    barrier = threading.Barrier(len(requests))

    def run(i, req):
        try:
            if start_barrier:
                barrier.wait(timeout=30)
            out[i] = [c.samples for c in engine.stream(req)]
        except Exception as e:  # noqa: BLE001
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return out


def test_solo_references_differ(solo):
    """Different prompts and seeds give different audio (otherwise equality below would prove nothing)."""
    assert all(len(s) >= 2 for s in solo), [len(s) for s in solo]
    flat = [np.concatenate(s) for s in solo]
    assert len({a.tobytes() for a in flat}) == N


def test_16_concurrent_streams_equal_their_solo_audio(engine, case, solo):
    out = _run_all(engine, [_request(case, i) for i in range(N)])
    for i in range(N):
        got = out[i]
        assert isinstance(got, list), f"request {i} failed: {got!r}"
        assert len(got) == len(solo[i])
        for k, (a, b) in enumerate(zip(solo[i], got)):
            assert np.array_equal(a, b), f"request {i}, chunk {k} differs from its solo run"
    assert engine.active_requests() == 0


def test_faults_mid_stream_stay_in_their_request(engine, case, solo):
    """Requests 3 (LM fault at token 6), 7 (flow fault on chunk 2) and 11 (vocoder fault on its first call) fail
    with their own error; the 13 others still produce exactly their solo audio."""
    reqs = [_request(case, i, tag={3: "llm-fault", 7: "flow-fault"}.get(i)) for i in range(N)]
    voc = engine.stages(BackendConfig()).vocoder
    real_admit = engine._admit

    def admit(req):  # arm the vocoder fault for request 11 through its own generator object
        st = real_admit(req)
        if req.request_id == "req11":
            voc.armed.append(st.vocoder_generator)
        return st

    engine._admit = admit
    try:
        out = _run_all(engine, reqs)
    finally:
        engine._admit = real_admit
        voc.armed.clear()
    for i, msg in ((3, "LM fault injected at token 6"), (7, "flow fault injected on chunk 2"),
                   (11, "vocoder fault injected")):
        assert isinstance(out[i], InjectedFault) and msg in str(out[i]), (i, out[i])
    for i in set(range(N)) - {3, 7, 11}:
        assert isinstance(out[i], list), f"request {i} was disturbed: {out[i]!r}"
        assert all(np.array_equal(a, b) for a, b in zip(solo[i], out[i])) and len(out[i]) == len(solo[i])
    assert engine.active_requests() == 0 and engine._thread.is_alive()
    # and the engine keeps serving the same audio afterwards
    again = [c.samples for c in engine.stream(_request(case, 5))]
    assert all(np.array_equal(a, b) for a, b in zip(solo[5], again))


def test_a_stalled_consumer_does_not_hold_up_the_others(engine, case, solo):
    """A consumer that takes its first chunk and then stops reading: the worker does not wait for it."""
    stalled = engine.stream(_request(case, 0))
    first = next(stalled)
    t0 = time.perf_counter()
    out = _run_all(engine, [_request(case, i) for i in (1, 2, 3)], start_barrier=False)
    assert time.perf_counter() - t0 < 60
    for k, i in enumerate((1, 2, 3)):
        assert all(np.array_equal(a, b) for a, b in zip(solo[i], out[k]))
    rest = [first.samples] + [c.samples for c in stalled]  # its chunks waited in its own queue
    assert all(np.array_equal(a, b) for a, b in zip(solo[0], rest)) and len(rest) == len(solo[0])
