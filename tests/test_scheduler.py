"""The two-sided scheduler: the LLM side and the chunk side in their own threads (``cuda_streams=2``) give the
same audio as one thread running both; a state that is not ``ready`` is neither stepped nor failed and costs no
busy loop until ``Engine.wake``; chunks of one shape share a vocoder forward, and a failing row stays its own."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cosyvoice_fast.vocoder.eager import EagerVocoder
from cosyvoice_fast.engine.engine import Engine
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.config.schedule import ChunkCursor
from cosyvoice_fast.vocoder.stream import VocodeJob, vocode_chunk, vocode_chunks


@pytest.fixture(scope="module")
def case(load_case):
    return load_case("case_flow_stream")


def _request(case: dict, i: int, max_tokens: int = 20) -> SynthesisRequest:
    g = torch.Generator().manual_seed(300 + i)
    n_prompt = 8 + (i % 3) * 4
    inputs = ModelInputs(text_segments=[torch.randint(0, 1000, (1, 5 + i % 3), generator=g)],
                         prompt_text=torch.randint(0, 1000, (1, 3), generator=g),
                         llm_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                         flow_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                         prompt_feat=case["prompt_feat"][:, :2 * n_prompt], embedding=case["embedding"])
    return SynthesisRequest(inputs=inputs, seed=11 * i + 3, max_tokens=max_tokens, ignore_eos=True)


def _all_at_once(eng: Engine, reqs: list[SynthesisRequest]) -> list[np.ndarray]:
    out: list[np.ndarray | None] = [None] * len(reqs)

    def run(i: int) -> None:
        out[i] = eng.synthesize(reqs[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return out  # type: ignore[return-value]


def test_overlapped_sides_equal_one_thread(tiny_models, case):
    reqs = [_request(case, i) for i in range(6)]
    results = {}
    for streams, priority in ((1, True), (2, True), (2, False)):
        eng = Engine(tiny_models, config=EngineConfig(cuda_streams=streams, first_chunk_priority=priority))
        try:
            results[streams, priority] = _all_at_once(eng, reqs)
            stats = eng.stats()
            assert stats["overlap"] is (streams == 2)
            assert len(eng._threads) == streams
            assert stats["flow_rows"] >= 6 and stats["vocoder_rows"] == stats["flow_rows"]
            assert eng.active_requests() == 0
        finally:
            eng.close()
    for key in ((2, True), (2, False)):  # CPU eager stages do not batch across requests: bit-equal
        for a, b in zip(results[1, True], results[key]):
            np.testing.assert_array_equal(a, b)
    assert len({a.tobytes() for a in results[2, True]}) == len(reqs)


@pytest.mark.parametrize("priority", [True, False])
def test_first_chunk_priority_pauses_only_lms_past_their_first_chunk(tiny_models, case, priority):
    eng = Engine(tiny_models, config=EngineConfig(first_chunk_priority=priority))
    try:
        sched = eng._sched

        class Seg:
            pending: list = []

        class St:
            def __init__(self, emitted: int):
                self.chunks_emitted, self.segment = emitted, Seg()

        opening, ahead = St(0), St(2)
        assert not sched._yields(opening) and not sched._yields(ahead)  # no first chunk being solved
        sched.first_busy = True
        try:
            assert not sched._yields(opening)  # still on its way to its own first audio: never paused
            assert sched._yields(ahead) is priority
        finally:
            sched.first_busy = False
    finally:
        eng.close()


@pytest.mark.parametrize("streams, priority", [(2, True), (2, False), (1, True)])
def test_an_lm_pauses_once_its_own_first_chunk_is_ready(tiny_models, case, streams, priority):
    """Its own first chunk ready (not yet taken by the chunk side, nothing being solved): the LM pauses at once
    with the priority on and the sides overlapped; the decode step whose token makes that chunk due is marked
    ``no_ahead`` one token before, and never for a later chunk, a non-streamed request or a chunk already due."""
    eng = Engine(tiny_models, config=EngineConfig(cuda_streams=streams, first_chunk_priority=priority))
    on = priority and streams == 2
    try:
        sched = eng._sched
        cursor = ChunkCursor(8, StreamParams())
        due = cursor.tokens_short(0)

        class Seg:
            def __init__(self, n: int, pending: bool):
                self.tokens, self.pending, self.cursor = list(range(n)), [object()] if pending else [], cursor

        class St:
            def __init__(self, emitted: int, n: int, pending: bool = False, stream: bool = True):
                self.chunks_emitted, self.segment = emitted, Seg(n, pending)
                self.request = SynthesisRequest(inputs=_request(case, 0).inputs, stream=stream)

        assert not sched.first_busy
        assert sched._yields(St(0, due, pending=True)) is on
        assert not sched._yields(St(0, due - 1)) and not sched._yields(St(1, due + 30, pending=True))
        assert sched._completes_first_chunk(St(0, due - 1)) is on
        for st in (St(0, due - 2), St(0, due, pending=True), St(1, due - 1), St(0, due - 1, stream=False)):
            assert not sched._completes_first_chunk(st)
    finally:
        eng.close()


def test_a_lone_stream_runs_its_first_chunk_with_its_lm_paused(tiny_models, case):
    """End to end on one stream: no decode step runs between the first chunk becoming ready and its audio
    (the LM pauses on its own first chunk, even while the chunk side is slow to take it: 30 ms here), and the
    audio equals the serial engine's."""
    req = _request(case, 1, max_tokens=80)  # 12 prompt tokens: the first chunk is due at 38 + 3 tokens
    out = {}
    for streams in (1, 2):
        eng = Engine(tiny_models, config=EngineConfig(cuda_streams=streams))
        if streams == 2:
            gather = eng._sched._gather
            eng._sched._gather = lambda: (time.sleep(0.03), gather())[1]
        try:
            audio, tele = eng.synthesize(req)
            out[streams] = audio
            if streams == 2:
                first = tele.chunks[0]
                assert not [t for t in tele.token_times if first.tokens_ready < t < first.delivered]
        finally:
            eng.close()
    np.testing.assert_array_equal(out[1], out[2])


class GatedLLM:
    """Wraps an LLM stage: its states are not ``ready`` until ``gate`` is set (like a text source that has not
    delivered yet); counts decode rows of gated states."""

    def __init__(self, inner, gate: threading.Event):  # noqa: ANN001
        self.inner, self.gate = inner, gate
        self.capacity = inner.capacity
        self.prefill_synced = False  # the engine waits for the stream after prefill (a no-op on the CPU)
        self.gated_rows = 0

    def new_state(self, *args):  # noqa: ANN002
        st = self.inner.new_state(*args)
        gate = self.gate
        st.__class__ = type("GatedState", (st.__class__,), {"ready": property(lambda self: gate.is_set())})
        return st

    def free_slots(self):
        return self.inner.free_slots()

    def prefill(self, states):  # noqa: ANN001
        return self.inner.prefill(states)

    def decode(self, states):  # noqa: ANN001
        self.gated_rows += sum(not self.gate.is_set() for _ in states)
        return self.inner.decode(states)

    def release(self, state):  # noqa: ANN001
        self.inner.release(state)


def test_a_state_that_is_not_ready_waits_without_spinning_until_wake(tiny_models, case):
    req = _request(case, 1)
    eng = Engine(tiny_models)
    try:
        ref = eng.synthesize(_request(case, 1))[0]
        gate = threading.Event()
        stages = eng.stages(req.backend or eng.default_backend)
        gated = GatedLLM(stages.llm, gate)
        real_llm, stages.llm = stages.llm, gated
        turns = []
        real_turn = eng._turn

        def counting_turn() -> None:
            turns.append(1)
            real_turn()

        eng._turn = counting_turn
        it = eng.stream(req)
        time.sleep(0.5)  # prefilled (one token), then waiting: not stepped, not failed, no busy loop
        assert gated.gated_rows == 0
        assert len(turns) < 20, f"the scheduler spun {len(turns)} turns while its only state was not ready"
        assert eng.active_requests() == 1
        gate.set()
        eng.wake()
        audio = np.concatenate([c.samples for c in it])
        np.testing.assert_array_equal(audio, ref)  # waiting changed nothing: same tokens, same audio
    finally:
        stages.llm = real_llm
        eng.close()


def _jobs(case: dict, n: int, frames: int, seed: int) -> list[VocodeJob]:
    g = torch.Generator().manual_seed(seed)
    mel = case["prompt_feat"].transpose(1, 2)  # (1, 80, T) real-looking mel frames
    out = []
    for i in range(n):
        start = int(torch.randint(0, mel.shape[2] - frames, (1,), generator=g))
        out.append(VocodeJob(mel=mel[:, :, start:start + frames].contiguous(), cache=None, finalize=False,
                             generator=torch.Generator().manual_seed(seed + i)))
    return out


class SpyVocoder:
    def __init__(self, inner: EagerVocoder, max_batch: int, bad: set[int] = frozenset()):
        self.inner, self.max_batch, self.bad = inner, max_batch, bad
        self.batches: list[int] = []
        self.singles = 0

    def vocode(self, mel, cache_source, generator):  # noqa: ANN001
        if generator.initial_seed() in self.bad:
            raise RuntimeError(f"row with seed {generator.initial_seed()} is broken")
        self.singles += 1
        return self.inner.vocode(mel, cache_source, generator)

    def vocode_batch(self, mels, sources, generators):  # noqa: ANN001
        if any(g.initial_seed() in self.bad for g in generators):
            raise RuntimeError("a row of this batch is broken")
        self.batches.append(mels.shape[0])
        return self.inner.vocode_batch(mels, sources, generators)


def test_vocode_chunks_shares_a_forward_per_shape_and_equals_row_by_row(tiny_models, case):
    voc = EagerVocoder(tiny_models.hift)
    jobs = _jobs(case, 3, 12, seed=40) + _jobs(case, 2, 9, seed=50)
    ref = [vocode_chunk(lambda m, cs, g=j.generator: voc.vocode(m, cs, g), j.mel, j.cache, j.finalize)
           for j in _jobs(case, 3, 12, seed=40) + _jobs(case, 2, 9, seed=50)]
    spy = SpyVocoder(voc, max_batch=2)
    got = vocode_chunks(spy, jobs)
    assert sorted(spy.batches) == [2, 2] and spy.singles == 1  # 3 of one shape: a pair and a single; 2 of another
    for (w, c), (rw, rc) in zip(got, ref):
        assert w.shape == rw.shape and c.mel.shape == rc.mel.shape
        d = (w - rw).abs()
        # another conv batch size, float rounding only; the log-magnitude exp and the phase sin of HiFT's iSTFT
        # head amplify it at a few samples of this random tiny model (~2e-4 seen), the bulk stays at ~1e-6
        assert d.max().item() <= 1e-3 and d.mean().item() <= 1e-5, (d.max().item(), d.mean().item())
        assert torch.equal(c.source, rc.source)  # the excitation is drawn row by row: exactly the solo draws


def test_vocode_chunks_keeps_a_failing_row_its_own(tiny_models, case):
    voc = EagerVocoder(tiny_models.hift)
    jobs = _jobs(case, 4, 10, seed=70)
    spy = SpyVocoder(voc, max_batch=4, bad={71})
    got = vocode_chunks(spy, jobs)
    assert isinstance(got[1], RuntimeError) and "seed 71" in str(got[1])
    ref = [vocode_chunk(lambda m, cs, g=j.generator: voc.vocode(m, cs, g), j.mel, j.cache, j.finalize)
           for j in _jobs(case, 4, 10, seed=70)]
    for i in (0, 2, 3):  # retried row by row after the shared forward failed: exactly their solo results
        assert torch.equal(got[i][0], ref[i][0])


def _run_gated(eng: Engine, reqs: list[SynthesisRequest]) -> list[list]:
    """Stream ``reqs`` together with their LMs held until all are prefilled, so they decode in lockstep."""
    gate = threading.Event()
    stages = eng.stages(eng.default_backend)
    real_llm, stages.llm = stages.llm, GatedLLM(stages.llm, gate)
    try:
        out: list[list] = [[] for _ in reqs]
        threads = [threading.Thread(target=lambda i=i: out[i].extend(eng.stream(reqs[i])))
                   for i in range(len(reqs))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # all prefilled (one token each), none decoding yet
            with eng._sched.cv:
                segs = [st.segment for st in eng._sched.active]
                if len(segs) == len(reqs) and all(s is not None and s.llm_started for s in segs):
                    break
            time.sleep(0.005)
        gate.set()
        eng.wake()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a request hung"
    finally:
        stages.llm = real_llm
    return out


@pytest.mark.parametrize("wait_ms", [0.0, 1000.0])
def test_first_chunks_a_few_tokens_apart_share_one_solve_when_gathered(tiny_models, case, wait_ms):
    """Two requests decoding in lockstep whose first chunks fall 4 tokens apart (prompts of 8 and 12 tokens pad
    the first hop to 42 and 38): with ``first_chunk_wait_ms`` the earlier one waits for the later one, so both
    go to the flow together; with 0 the earlier one is solved at once.  The audio is the same either way."""
    reqs = [_request(case, 0, max_tokens=60), _request(case, 1, max_tokens=60)]
    eng = Engine(tiny_models, config=EngineConfig(cuda_streams=2, first_chunk_wait_ms=wait_ms))
    try:
        refs = [eng.synthesize(r)[0] for r in reqs]
        out = _run_gated(eng, reqs)
    finally:
        eng.close()
    early, late = out[1][0].timing, out[0][0].timing  # 41 and 45 tokens
    assert early.tokens_ready < late.tokens_ready
    # gathered: the early chunk's solve starts only once the late one is ready too (one chunk turn takes both;
    # the eager CPU flow then runs them one by one); not gathered: it starts at once
    assert (early.flow_start >= late.tokens_ready) is (wait_ms > 0)
    for o, ref in zip(out, refs):
        np.testing.assert_array_equal(np.concatenate([c.samples for c in o]), ref)


@pytest.mark.parametrize("wait_ms", [0.0, 1000.0])
def test_final_chunks_a_few_tokens_apart_share_one_solve_when_gathered(tiny_models, case, wait_ms, monkeypatch):
    """Two requests with one prompt length decode in lockstep and stop at 60 and 64 tokens: their first chunks
    are ready together, their final chunks 4 tokens apart.  With ``later_chunk_wait_ms`` the earlier final waits
    for the later one (the listener's audio is no limit here: the slack rule is switched off, a CI machine may
    be slow); with 0 it is solved at once.  The audio is the same either way."""
    monkeypatch.setattr("cosyvoice_fast.config.schedule.LATER_SLACK_S", -float("inf"))
    reqs = [_request(case, 0, max_tokens=60), _request(case, 3, max_tokens=64)]  # 8-token prompts, both
    eng = Engine(tiny_models, config=EngineConfig(cuda_streams=2, later_chunk_wait_ms=wait_ms))
    try:
        refs = [eng.synthesize(r)[0] for r in reqs]
        out = _run_gated(eng, reqs)
    finally:
        eng.close()
    assert [len(o) for o in out] == [2, 2]
    early, late = out[0][-1].timing, out[1][-1].timing
    assert early.finalize and late.finalize and early.tokens_ready < late.tokens_ready
    assert (early.flow_start >= late.tokens_ready) is (wait_ms > 0)
    for o, ref in zip(out, refs):
        np.testing.assert_array_equal(np.concatenate([c.samples for c in o]), ref)


def test_chunk_audio_reaches_the_host_in_one_copy_split_per_chunk_and_failures_stay_their_own():
    from cosyvoice_fast.engine.chunks import ChunkRunner

    wavs = [torch.arange(5.0).view(1, 5), torch.zeros(1, 0), torch.full((1, 3), 2.5, dtype=torch.float64)]
    out = ChunkRunner._to_host(wavs)
    assert [o.dtype for o in out] == [np.float32] * 3
    assert [o.tolist() for o in out] == [[0.0, 1.0, 2.0, 3.0, 4.0], [], [2.5, 2.5, 2.5]]
    out[0][0] = 9.0
    assert wavs[0][0, 0].item() == 0.0  # the host samples are a copy, never a view of a model buffer
    assert ChunkRunner._to_host([]) == []

    class Broken(torch.Tensor):  # its own copy fails: the shared one fails too, then only it does
        def float(self):  # noqa: A003
            raise RuntimeError("copy failed")

    bad = torch.ones(1, 2).as_subclass(Broken)
    out = ChunkRunner._to_host([torch.ones(1, 2), bad, torch.zeros(1, 1)])
    assert out[0].tolist() == [1.0, 1.0] and out[2].tolist() == [0.0]
    assert isinstance(out[1], RuntimeError) and "copy failed" in str(out[1])
