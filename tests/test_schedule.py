"""The chunk schedule: upstream's recorded calls, per-request parameters, and the second-request bug."""

from __future__ import annotations

import pytest

from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.schedule import ChunkCursor, first_hop, hop_for, plan


def test_default_schedule_matches_upstream_recorded_calls(load_case):
    case = load_case("case_flow_stream")
    prompt_len = case["prompt_token"].shape[1]
    total = case["token"].shape[1]
    calls = plan(prompt_len, total, StreamParams())
    assert [(c.n_tokens, c.token_offset, c.finalize) for c in calls] == [
        (c["n_tokens"], c["token_offset"], c["finalize"]) for c in case["calls"]]


def test_first_hop_pads_prompt_to_chunk_boundary_by_default():
    assert first_hop(20, StreamParams()) == 30
    assert first_hop(75, StreamParams()) == 25
    assert first_hop(76, StreamParams()) == 49


def test_token_hop_len_first_shortens_first_chunk_without_padding():
    calls = plan(20, 300, StreamParams(token_hop_len_first=5))
    assert calls[0].n_tokens == 5 + 3 and calls[0].hop == 5
    # later hops follow token_hop_len * 2**k capped at 100
    assert [c.hop for c in calls[1:4]] == [50, 100, 100]


def test_pre_lookahead_len_changes_tokens_needed():
    calls = plan(20, 200, StreamParams(token_hop_len_first=10, pre_lookahead_len=0))
    assert calls[0].n_tokens == 10 and calls[0].lookahead == 0
    calls = plan(20, 200, StreamParams(token_hop_len_first=10, pre_lookahead_len=2))
    assert calls[0].n_tokens == 12 and calls[0].lookahead == 2


def test_every_token_is_emitted_exactly_once():
    for total in (1, 7, 33, 90, 251):
        for p in (StreamParams(), StreamParams(token_hop_len_first=4, pre_lookahead_len=1)):
            calls = plan(20, total, p)
            assert calls[-1].finalize and calls[-1].n_tokens == total
            emitted = sum(c.hop for c in calls)
            assert emitted == total
            for a, b in zip(calls, calls[1:]):
                assert b.token_offset == a.token_offset + a.hop


def test_second_request_gets_the_same_first_chunk():
    """Upstream grew the hop on the shared model; here each request starts from its own parameters."""
    p = StreamParams()
    first = plan(20, 300, p)
    second = plan(20, 300, p)
    assert first == second
    assert second[0].n_tokens == 33


def test_cursor_waits_for_tokens_then_cuts():
    cur = ChunkCursor(20, StreamParams())
    assert cur.next_call(32, llm_done=False) is None
    call = cur.next_call(33, llm_done=False)
    assert call is not None and call.n_tokens == 33
    assert cur.next_call(82, llm_done=False) is None
    assert cur.next_call(83, llm_done=False).n_tokens == 83
    last = cur.next_call(90, llm_done=True)
    assert last.finalize and last.hop == 10
    assert cur.next_call(90, llm_done=True) is None


@pytest.mark.parametrize("kw,field", [
    ({"token_hop_len_first": 0}, "token_hop_len_first"),
    ({"token_hop_len_first": 101}, "token_hop_len_first"),
    ({"pre_lookahead_len": 4}, "pre_lookahead_len"),
    ({"pre_lookahead_len": -1}, "pre_lookahead_len"),
    ({"stream_scale_factor": 0.5}, "stream_scale_factor"),
    ({"token_hop_len": 50, "token_max_hop_len": 40}, "token_max_hop_len"),
])
def test_invalid_params_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        StreamParams(**kw)


def test_vocoder_frames_are_the_mel_lengths_every_non_final_chunk_takes():
    """Upstream's default schedule: a first chunk of 2 x (25..49) frames depending on the prompt length, then
    8 cached + 2 x 50 and 8 + 2 x 100; a fixed first hop gives one first length."""
    from cosyvoice_fast.config.schedule import vocoder_frames

    assert vocoder_frames(StreamParams()) == tuple(range(50, 100, 2)) + (108, 208)
    assert vocoder_frames(StreamParams(token_hop_len_first=10)) == (20, 108, 208)
    # every non-final call of real plans has one of these lengths
    want = set(vocoder_frames(StreamParams()))
    for prompt in (0, 7, 24, 75, 131):
        calls = [c for c in plan(prompt, 400, StreamParams()) if not c.finalize]
        assert {2 * c.hop + (8 if c.index else 0) for c in calls} <= want


@pytest.mark.parametrize("params", [StreamParams(), StreamParams(token_hop_len_first=7, token_hop_len=13,
                                                                   pre_lookahead_len=0),
                                    StreamParams(token_hop_len_first=10, pre_lookahead_len=1)])
def test_final_vocoder_frames_are_exactly_the_lengths_final_calls_take(params):
    """Every (prompt, utterance length) pair's final call has one of these lengths, and each length occurs."""
    from cosyvoice_fast.config.schedule import final_vocoder_frames

    seen = set()
    for prompt in range(0, 50, 3):
        for total in range(1, 330):
            last = plan(prompt, total, params)[-1]
            assert last.finalize
            seen.add(2 * (last.n_tokens - last.token_offset) + (8 if last.index else 0))
    assert seen == set(final_vocoder_frames(params))


def test_final_vocoder_frames_of_the_default_schedule():
    from cosyvoice_fast.config.schedule import final_vocoder_frames

    # alone: 2 x (1..51) tokens (first hop up to 49, look-ahead 3); after a chunk: 8 + 2 x (1..102) (hop 100)
    assert final_vocoder_frames(StreamParams()) == tuple(range(2, 213, 2))


def test_tokens_short_counts_down_to_the_next_call():
    cur = ChunkCursor(8, StreamParams())  # first hop padded to 42, look-ahead 3: the first call needs 45 tokens
    assert [cur.tokens_short(n) for n in (0, 41, 44, 45, 60)] == [45, 4, 1, 0, 0]
    assert cur.next_call(45, llm_done=False).n_tokens == 45
    assert cur.tokens_short(45) == 42 + hop_for(1, 8, StreamParams()) + 3 - 45  # the next hop past the 42 taken
    cur.next_call(45, llm_done=True)
    assert cur.tokens_short(0) == 0  # finished


def test_first_chunk_wait_waits_only_for_a_chunk_within_reach_and_only_so_long():
    from cosyvoice_fast.config.schedule import GATHER_TOKENS, first_chunk_wait

    assert first_chunk_wait(10.0, 10.002, [GATHER_TOKENS], 0.012) == pytest.approx(0.010)
    assert first_chunk_wait(10.0, 10.002, [GATHER_TOKENS + 1], 0.012) == 0.0  # too far: run now
    assert first_chunk_wait(10.0, 10.002, [0], 0.012) == 0.0  # due already (it will be in this batch)
    assert first_chunk_wait(10.0, 10.002, [], 0.012) == 0.0  # nobody else is coming
    assert first_chunk_wait(10.0, 10.013, [1], 0.012) == 0.0  # waited long enough
    assert first_chunk_wait(10.0, 10.0, [1], 0.0) == 0.0  # gathering off


def test_tokens_to_next_call_counts_down_to_a_hop_or_the_length_limit():
    cur = ChunkCursor(8, StreamParams())  # the first call needs 45 tokens
    assert cur.tokens_to_next_call(41, tokens_left=100) == 4  # the hop comes first
    assert cur.tokens_to_next_call(41, tokens_left=2) == 2  # the LM stops (final call) first
    assert cur.tokens_to_next_call(45, tokens_left=100) == 0  # due
    assert cur.next_call(45, llm_done=False).n_tokens == 45 and cur.tokens_to_next_call(46, tokens_left=1) == 1
    assert cur.next_call(47, llm_done=True).finalize
    assert cur.tokens_to_next_call(0, tokens_left=5) == 0  # finished: no call is coming


def test_later_chunk_wait_waits_like_a_first_chunk_while_the_listener_has_audio_left():
    from cosyvoice_fast.config.schedule import LATER_SLACK_S, later_chunk_wait

    far = 10.0 + LATER_SLACK_S + 1.0  # the most urgent listener runs out of audio a second past the slack
    assert later_chunk_wait(10.0, 10.002, far, [2], 0.012) == pytest.approx(0.010)
    assert later_chunk_wait(10.0, 10.002, far, [5], 0.012) == 0.0  # too far
    assert later_chunk_wait(10.0, 10.002, far, [], 0.012) == 0.0  # nobody else coming
    assert later_chunk_wait(10.0, 10.002, far, [2], 0.0) == 0.0  # gathering off
    close = 10.002 + LATER_SLACK_S + 0.004  # 4 ms of waiting left before the slack is reached
    assert later_chunk_wait(10.0, 10.002, close, [2], 0.012) == pytest.approx(0.004)
    assert later_chunk_wait(10.0, 10.002, 10.3, [2], 0.012) == 0.0  # the listener's audio runs out soon
    assert later_chunk_wait(10.0, 10.002, 10.3, [2], 0.012, slack_s=0.1) == pytest.approx(0.010)
