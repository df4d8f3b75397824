"""Admission and capacity: requests beyond ``max_streams`` or beyond the LLM's slots wait and start when one frees;
only a full queue refuses (``EngineBusy``, a clear message, a counter); a request cancelled while it waits never
starts; 64 concurrent streams through 16 streams and 8 LLM slots all complete and equal their solo runs.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from cosyvoice_fast.llm.eager import EagerLLM
from cosyvoice_fast.llm.kv_pool import SlotPool
from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.engine.engine import Engine, EngineBusy
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest

PARAMS = StreamParams(token_hop_len_first=5, token_hop_len=5, pre_lookahead_len=0)


class SlotLimitedLLM(EagerLLM):
    """The eager LLM with a fixed number of slots, like the cudagraph LLM: ``prefill`` takes one per state from a
    pool that raises ``PoolExhausted`` when empty, so the test fails if the engine ever asks for too many."""

    def __init__(self, inner: EagerLLM, slots: int):
        super().__init__(inner.llm, inner.config)
        self.pool = SlotPool(list(range(slots)), name="LLM slot")
        self.capacity = slots
        self.most_in_use = 0

    def free_slots(self) -> int:
        return self.pool.capacity - self.pool.in_use

    def prefill(self, states):  # noqa: ANN001
        for st in states:
            st.slot, _ = self.pool.acquire()
        self.most_in_use = max(self.most_in_use, self.pool.in_use)
        return super().prefill(states)

    def release(self, state) -> None:  # noqa: ANN001
        super().release(state)
        if state.slot is not None:
            self.pool.release(state.slot)
            state.slot = None


@pytest.fixture(scope="module")
def case(load_case):
    return load_case("case_flow_stream")


def _request(case: dict, i: int, max_tokens: int = 12) -> SynthesisRequest:
    g = torch.Generator().manual_seed(2000 + i)
    n_prompt = 8 + (i % 5) * 3
    inputs = ModelInputs(text_segments=[torch.randint(0, 1000, (1, 4 + i % 4), generator=g)],
                         prompt_text=torch.randint(0, 1000, (1, 3), generator=g),
                         llm_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                         flow_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                         prompt_feat=case["prompt_feat"][:, :2 * n_prompt],
                         embedding=case["embedding"] + 0.05 * torch.randn(1, 192, generator=g))
    return SynthesisRequest(inputs=inputs, seed=11 * i + 3, max_tokens=max_tokens, ignore_eos=True,
                            stream_params=PARAMS, request_id=f"adm{i}")


def _wait(pred, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition never became true"
        time.sleep(0.002)


def test_64_streams_through_16_streams_and_8_slots_equal_their_solo_runs(tiny_models, case):
    """64 requests at once, 16 may run and 8 hold an LLM slot: the rest wait (admission queue, then for a slot)
    and every one completes with exactly its solo audio.  Bit-identical, not merely close: on CPU the eager LLM
    steps each row alone and the flow (incremental, per-request state) and vocoder run per request, so batching
    changes no reduction order; only which requests share a turn differs."""
    eng = Engine(tiny_models, config=EngineConfig(max_streams=16, queue_limit=64))
    try:
        stages = eng.stages(BackendConfig())
        stages.llm = llm = SlotLimitedLLM(stages.llm, slots=8)
        n = 64
        solo = [[c.samples for c in eng.stream(_request(case, i))] for i in range(n)]
        assert len({np.concatenate(s).tobytes() for s in solo}) == n  # different audio, or equality proves nothing
        out: dict[int, object] = {}
        barrier = threading.Barrier(n)
        most_active = [0]

        def run(i: int) -> None:
            try:
                barrier.wait(timeout=30)
                chunks = []
                for c in eng.stream(_request(case, i)):
                    chunks.append(c)
                    most_active[0] = max(most_active[0], eng.stats()["active"])
                out[i] = chunks
            except Exception as e:  # noqa: BLE001
                out[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a request hung"
        for i in range(n):
            got = out[i]
            assert isinstance(got, list), f"request {i} failed: {got!r}"
            assert len(got) == len(solo[i]) == 2  # a chunk at 5 tokens (the next hop is 10), the final one at 12
            assert all(np.array_equal(a, c.samples) for a, c in zip(solo[i], got)), f"request {i} differs"
        teles = [c.telemetry for i in range(n) for c in out[i] if c.telemetry is not None]
        assert len(teles) == n and all(not math.isnan(t.admitted) for t in teles)
        assert all(t.ttfb_breakdown()["admission"] >= 0 for t in teles)
        assert max(t.ttfb_breakdown()["admission"] for t in teles) > 0  # some of them did wait in the queue
        assert llm.most_in_use == 8 and llm.free_slots() == 8  # never more than 8 slots asked for, all returned
        assert most_active[0] <= 16
        stats = eng.stats()
        assert stats["rejected"] == 0 and stats["active"] == 0 and stats["queued"] == 0
        assert stats["admitted"] == 2 * n and stats["decode_rows"] > stats["decode_steps"]  # decode was batched
    finally:
        eng.close()


def test_full_queue_refuses_with_a_message_and_a_counter_and_cancelled_waiters_never_start(tiny_models, case):
    eng = Engine(tiny_models, config=EngineConfig(max_streams=1, queue_limit=1))
    outcomes: list[tuple[str, str]] = []
    eng.add_observer(lambda tele, outcome: outcomes.append((tele.request_id, outcome)))
    try:
        running = eng.stream(_request(case, 0, max_tokens=400))  # holds the only stream for a long while
        first = next(running)
        assert first.index == 0
        waiting = eng.stream(_request(case, 1))
        assert eng.stats()["queued"] == 1
        with pytest.raises(EngineBusy, match=r"1 requests running \(max_streams=1\) and 1 waiting "
                                             r"\(queue_limit=1\); try again"):
            eng.stream(_request(case, 2))
        stats = eng.stats()
        assert stats["rejected"] == 1 and stats["queue_limit"] == 1 and stats["max_active"] == 1
        assert ("adm2", "rejected") in outcomes
        waiting_state = waiting._state
        waiting.close()  # cancelled while queued: it must never start
        _wait(lambda: eng.stats()["queued"] == 0)
        assert waiting_state.done and math.isnan(waiting_state.telemetry.admitted)
        assert math.isnan(waiting_state.telemetry.prefill_start) and waiting_state.decode_steps == 0
        assert ("adm1", "cancelled") in outcomes
        later = eng.stream(_request(case, 3))  # the queue has room again
        running.close()
        chunks = list(later)  # starts once the running one is gone
        assert chunks[-1].is_last and not math.isnan(chunks[-1].telemetry.admitted)
        assert chunks[-1].telemetry.ttfb_breakdown()["admission"] > 0
        assert eng.stats()["rejected"] == 1 and eng.stats()["admitted"] == 2
    finally:
        eng.close()


def test_queue_limit_zero_refuses_beyond_max_streams_at_once(tiny_models, case):
    eng = Engine(tiny_models, config=EngineConfig(max_streams=1, queue_limit=0))
    try:
        running = eng.stream(_request(case, 0, max_tokens=400))
        next(running)
        with pytest.raises(EngineBusy, match="queue_limit=0"):
            eng.stream(_request(case, 1))
        running.close()
        _wait(lambda: eng.stats()["active"] == eng.stats()["queued"] == 0)
        assert len(list(eng.stream(_request(case, 2)))) == 2  # a free stream admits again
    finally:
        eng.close()
