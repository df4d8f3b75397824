"""The scheduling policy as a pure function: snapshots of plain numbers in, batches out (no threads, no model)."""

from __future__ import annotations

from cosyvoice_fast.engine.policy import (
    ChunkBatch, Limits, RequestView, Snapshot, admissions, chunk_has_work, completes_first_chunk, llm_has_work, plan,
    yields,
)
from cosyvoice_fast.engine.state import Phase, RequestState, SegmentState

A, B = 101, 202  # two LLM stages' identities
SERIAL = Limits(max_streams=16, largest_solve=4)
OVERLAP = Limits(max_streams=16, largest_solve=4, overlap=True, first_chunk_priority=True)


def decoding(llm: int = A, **kw) -> RequestView:
    return RequestView(**{"phase": Phase.DECODING, "llm": llm, "llm_ready": True, **kw})


def test_prefill_takes_the_oldest_up_to_each_stage_s_free_slots():
    reqs = [RequestView(phase=Phase.PREFILL, llm=A), RequestView(phase=Phase.PREFILL, llm=B), decoding(),
            RequestView(phase=Phase.PREFILL, llm=A), RequestView(phase=Phase.PREFILL, llm=A),
            RequestView(phase=Phase.PREFILL, llm=B), RequestView(phase=Phase.OPENING, llm=A)]
    p = plan(Snapshot(reqs, free_slots={A: 2, B: None}), SERIAL)
    assert p.prefill == [[0, 3], [1, 5]]  # A's third waits for a slot; B is unbounded
    assert p.decode == [[2]]
    p = plan(Snapshot(reqs, free_slots={A: 0, B: 1}), SERIAL)
    assert p.prefill == [[1]]  # no slot on A: its requests wait, they do not fail


def test_decode_batches_per_stage_and_skips_cancelled_unready_and_finished_lms():
    reqs = [decoding(A), decoding(B), decoding(A, cancelled=True), RequestView(phase=Phase.DECODING, llm=A),
            RequestView(phase=Phase.DRAINING, llm=A, pending=True), decoding(A), decoding(B)]
    p = plan(Snapshot(reqs), SERIAL)
    assert p.decode == [[0, 5], [1, 6]]
    assert p.no_ahead == frozenset()  # serial: nothing runs beside a solve, nothing pauses
    assert p.chunks == [ChunkBatch((4,), True)]


def test_lms_past_their_first_chunk_pause_while_a_first_chunk_is_solved():
    opening, ahead, own_ready = decoding(emitted=0), decoding(emitted=3), decoding(emitted=0, pending=True)
    computing = decoding(emitted=0, busy=True)
    assert [yields(r, OVERLAP, False) for r in (opening, ahead, own_ready, computing)] == [False, False, True, False]
    assert [yields(r, OVERLAP, True) for r in (opening, ahead, own_ready, computing)] == [False, True, True, True]
    off = Limits(max_streams=16, largest_solve=4, overlap=True, first_chunk_priority=False)
    assert not any(yields(r, lim, True) for r in (ahead, own_ready) for lim in (off, SERIAL))
    p = plan(Snapshot([opening, ahead, own_ready], first_busy=True), OVERLAP)
    assert p.decode == [[0]]
    assert plan(Snapshot([opening, ahead, own_ready]), OVERLAP).decode == [[0, 1]]


def test_the_step_that_completes_a_first_chunk_launches_nothing_ahead():
    due = decoding(tokens_short=1)
    assert completes_first_chunk(due, OVERLAP)
    for r in (decoding(tokens_short=2), decoding(tokens_short=1, emitted=1), decoding(tokens_short=1, stream=False),
              decoding(tokens_short=1, pending=True)):
        assert not completes_first_chunk(r, OVERLAP)
    assert not completes_first_chunk(due, SERIAL)
    p = plan(Snapshot([decoding(tokens_short=5), due]), OVERLAP)
    assert p.decode == [[0, 1]] and p.no_ahead == frozenset({1})


def test_chunks_first_chunks_first_then_by_deadline_in_slices_of_the_largest_solve():
    first = [RequestView(phase=Phase.DECODING, pending=True, emitted=0) for _ in range(5)]
    later = [RequestView(phase=Phase.DRAINING, pending=True, emitted=2, deadline=d) for d in (9.0, 3.0, 7.0)]
    idle = [RequestView(phase=Phase.DECODING, emitted=1, deadline=0.0), RequestView(phase=Phase.DONE, pending=True)]
    reqs = [later[0], first[0], idle[0], first[1], later[1], first[2], first[3], idle[1], later[2], first[4]]
    p = plan(Snapshot(reqs), SERIAL)
    assert p.chunks == [ChunkBatch((1, 3, 5, 6), True), ChunkBatch((9,), True), ChunkBatch((4, 8, 0), False)]
    assert chunk_has_work(Snapshot(reqs)) and not chunk_has_work(Snapshot(idle))


def test_admission_fills_free_streams_only():
    lim = Limits(max_streams=16, largest_solve=4)
    assert admissions(5, 14, lim) == 2
    assert admissions(1, 14, lim) == 1
    assert admissions(3, 16, lim) == 0


def test_the_llm_worker_sleeps_when_nothing_can_move():
    blocked = [RequestView(phase=Phase.PREFILL, llm=A), decoding(llm_ready=False),
               RequestView(phase=Phase.DRAINING, pending=True)]
    full = [decoding(llm_ready=False)] * 16
    assert not llm_has_work(Snapshot(blocked, free_slots={A: 0}), OVERLAP)
    assert llm_has_work(Snapshot(blocked, free_slots={A: 1}), OVERLAP)  # a slot freed
    assert llm_has_work(Snapshot(blocked, free_slots={A: 0}), SERIAL)  # the same worker runs the ready chunk
    assert llm_has_work(Snapshot(blocked, free_slots={A: 0}, releases=True), OVERLAP)
    assert llm_has_work(Snapshot(blocked, free_slots={A: 0}, waiting=1), OVERLAP)  # room for a waiting one
    assert not llm_has_work(Snapshot(full, waiting=1), OVERLAP)  # 16 running: the queue waits
    assert llm_has_work(Snapshot([RequestView(phase=Phase.OPENING)]), OVERLAP)
    assert llm_has_work(Snapshot([decoding(llm_ready=False, cancelled=True)]), OVERLAP)
    own_first_ready = decoding(emitted=0, pending=True)
    assert not llm_has_work(Snapshot([own_first_ready]), OVERLAP)  # paused for its own first chunk


def test_a_request_s_phase_follows_its_state():
    st = RequestState(request=None, inputs=None, telemetry=None, stages=None, llm_generator=None,  # type: ignore
                      vocoder_generator=None)
    assert st.phase is Phase.OPENING
    st.segment = seg = SegmentState(index=0, text=None, cursor=None)  # type: ignore[arg-type]
    assert st.phase is Phase.PREFILL
    seg.llm_started = True
    assert st.phase is Phase.DECODING
    seg.llm_done = True
    assert st.phase is Phase.DRAINING
    st.close()
    assert st.phase is Phase.DONE
