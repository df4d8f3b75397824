"""The bi-streaming schedule as a state machine, without an LM: the branches the parity fixture does not reach
(text ending before decoding, unplaced prompt speech, a fill right after new text) and misuse messages."""

from __future__ import annotations

import logging

import pytest

from cosyvoice_fast.llm.model.bistream import (
    PHASE_FINAL, PHASE_TEXT, BistreamError, BistreamSpec, BistreamState, Segment,
)

SPEC = BistreamSpec(text_rows=5, speech_rows=15, speech_token_size=100)


def step(st: BistreamState, token: int) -> int | None:
    assert st.next_step() is not None
    return st.accept(token)


def segs(plan) -> list[tuple[str, int, int]]:
    return [s.as_tuple() for s in plan.segments]


@pytest.mark.parametrize("s, nf", [(0, 15), (1, 14), (14, 1), (15, 15), (38, 7)])
def test_first_forced_fill_aligns_to_the_prompt_speech(s, nf):
    assert BistreamState(SPEC, [1] * 6, list(range(s))).next_fill == nf


def test_text_ending_before_any_decoding_feeds_everything_with_task():
    st = BistreamState(SPEC, [1, 2], [])
    st.push_text([3])
    assert st.waiting and st.next_step() is None
    st.end_text()
    plan = st.next_step()
    assert segs(plan) == [("sos", 0, 1), ("text", 0, 3), ("task", 0, 1)]
    assert plan.phase == PHASE_FINAL and plan.forced is None and plan.banned == (SPEC.invalid_id, SPEC.fill_id)
    assert st.accept(7) == 7
    assert segs(st.next_step()) == [("speech", 0, 1)] and st.next_step().position == 5
    assert st.accept(SPEC.eos_id) is None and st.done and st.eos_reached
    assert [e.label for e in st.events] == ["need_text", "text_wait", "final", "eos"]


def test_unplaced_prompt_speech_is_dropped_with_a_warning(caplog):
    st = BistreamState(SPEC, [1] * 6, list(range(20)))
    st.push_text([2, 3])  # 8 rows: one 5 + 15 group; 5 prompt speech rows left, 3 text rows queued
    assert st.waiting
    with caplog.at_level(logging.WARNING):
        st.end_text()
    assert "5 prompt speech tokens unplaced" in caplog.text
    assert segs(st.next_step()) == [("sos", 0, 1), ("text", 0, 5), ("prompt_speech", 0, 15), ("text", 5, 3),
                                    ("task", 0, 1)]


def test_picked_fill_right_after_new_text_is_fed_again_when_text_ends():
    st = BistreamState(SPEC, [], [])
    st.push_text([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert segs(st.next_step()) == [("sos", 0, 1), ("text", 0, 5)]
    assert st.accept(SPEC.fill_id) is None  # the LM asks for more text at once
    # 6 rows are queued, but as upstream the schedule reads the next chunk before it takes text again
    assert st.next_fill == 16 and st.waiting and st.queued_text == 6
    st.push_text([12])
    plan = st.next_step()
    assert segs(plan) == [("text", 5, 5)] and plan.position == 6 and plan.phase == PHASE_TEXT
    st.accept(SPEC.fill_id)
    assert st.waiting and st.queued_text == 2
    st.end_text()
    assert segs(st.next_step()) == [("text", 5, 5), ("text", 10, 2), ("task", 0, 1)]
    assert st.next_step().position == 11


def test_cap_stops_after_max_tokens_yielded():
    st = BistreamState(SPEC, [1] * 5, [], max_tokens=2)
    st.push_text([1])
    assert step(st, 4) == 4 and not st.done
    assert step(st, 5) == 5 and st.done and st.next_step() is None
    assert st.events[-1].label == "cap" and st.events[-1].n == 2


def test_ratio_cap_applies_once_the_text_has_ended():
    st = BistreamState(SPEC, [1] * 4, [], max_token_text_ratio=2.0)
    st.push_text([1, 2])  # 6 rows: decoding starts, 2 target-text tokens so far
    for _ in range(15):
        step(st, 3)  # no cap while text may still come: 15 tokens for 2 text tokens
    assert st.cap is None and not st.done
    assert st.next_step().forced == SPEC.fill_id
    st.accept(SPEC.fill_id)
    st.push_text([5, 6])
    st.end_text()  # 4 target-text tokens in all: cap 8, already 15 yielded -> the next token is the last
    assert st.cap == 8
    assert step(st, 3) == 3 and st.done and st.events[-1].label == "cap"


def test_misuse_is_refused_with_a_message():
    st = BistreamState(SPEC, [1] * 5, [])
    with pytest.raises(BistreamError, match="without a step"):
        st.accept(3)
    with pytest.raises(ValueError, match="empty text chunk"):
        st.push_text([])
    st.push_text([1])
    with pytest.raises(BistreamError, match="not allowed in this phase"):
        step(st, SPEC.eos_id)
    for _ in range(15):
        step(st, 3)
    assert st.next_step().forced == SPEC.fill_id
    with pytest.raises(BistreamError, match="forced fill"):
        st.accept(3)
    st.accept(SPEC.fill_id)
    st.end_text()
    with pytest.raises(BistreamError, match="after the text source ended"):
        st.push_text([1])
    with pytest.raises(BistreamError, match="outside the LM's vocabulary"):
        step(st, SPEC.fill_id + 1)


@pytest.mark.parametrize("field, value", [("text_rows", 0), ("speech_rows", -1), ("speech_token_size", 2.5)])
def test_spec_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"BistreamSpec\.{field}"):
        BistreamSpec(**{field: value})
    with pytest.raises(ValueError, match="Segment.kind"):
        Segment("word", 0, 1)
    with pytest.raises(ValueError, match="max_tokens"):
        BistreamState(SPEC, [], [], max_tokens=0)
    with pytest.raises(ValueError, match="max_token_text_ratio"):
        BistreamState(SPEC, [], [], max_token_text_ratio=0)
