"""Incremental streaming flow (carried encoder/estimator state) against upstream's full per-chunk recompute."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from cosyvoice_fast.flow.eager import flow_chunk_mel
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.model import tiny_config
from cosyvoice_fast.flow.model.flow import CausalMaskedDiffWithXvec
from cosyvoice_fast.flow.incremental import IncrementalFlow
from cosyvoice_fast.flow.incremental_state import FlowState, prompt_flow_state, prompt_state, state_bytes_per_frame
from cosyvoice_fast.config.schedule import ChunkCall, plan

TOL = 1e-4
VOCAB = 1000

SCHEDULES = {
    "default": StreamParams(),
    "first10_la1": StreamParams(token_hop_len_first=10, pre_lookahead_len=1),
    "first7_hop13_la0": StreamParams(token_hop_len_first=7, token_hop_len=13, pre_lookahead_len=0),
    "first30_la2": StreamParams(token_hop_len_first=30, token_hop_len=20, stream_scale_factor=1.0,
                                token_max_hop_len=20, pre_lookahead_len=2),
}


def _inputs(n_prompt: int, seed: int, embedding: torch.Tensor | None = None) -> types.SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return types.SimpleNamespace(
        embedding=torch.randn(1, 192, generator=g) if embedding is None else embedding,
        flow_prompt_speech_token=torch.randint(0, VOCAB, (1, n_prompt), generator=g, dtype=torch.int32),
        prompt_feat=torch.randn(1, 2 * n_prompt, 80, generator=g))


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 6561, (1, n), generator=torch.Generator().manual_seed(seed + 1), dtype=torch.int32)


def _run_stream(flow, inputs, tokens, params):
    """(calls, incremental mels, reference mels, states seen before each call)."""
    inc = IncrementalFlow(flow)
    seg = types.SimpleNamespace(flow_state=None)
    calls = plan(inputs.flow_prompt_speech_token.shape[1], tokens.shape[1], params)
    outs, refs, states = [], [], []
    for call in calls:
        tok = tokens[:, :call.n_tokens]
        states.append(seg.flow_state)
        outs.append(inc.chunk(seg, inputs, tok, call))
        refs.append(flow_chunk_mel(flow, inputs, tok, call))
    assert seg.flow_state is None  # released after the final chunk
    return calls, outs, refs, states


def _max_err(outs, refs) -> list[float]:
    errs = []
    for o, r in zip(outs, refs):
        assert o.shape == r.shape
        errs.append((o - r).abs().max().item() if r.numel() else 0.0)
    return errs


@pytest.fixture(scope="module")
def flow(tiny_models):
    return tiny_models.flow


@pytest.fixture(scope="module")
def deep_flow():
    """Random weights, more layers than the fixture (slot ordering), an estimator chunk of 100 frames that is
    not the encoder's 50 (carried mu tail) and non-zero rel-pos biases."""
    cfg = tiny_config().flow
    cfg = dataclasses.replace(cfg, encoder=dataclasses.replace(cfg.encoder, num_blocks=2, num_up_blocks=2),
                              decoder=dataclasses.replace(cfg.decoder, n_blocks=2, static_chunk_size=100))
    torch.manual_seed(0)
    model = CausalMaskedDiffWithXvec(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "pos_bias" in name:
                p.normal_(0, 0.5)
    return model.eval()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("n_prompt", [20, 57])
def test_every_chunk_equals_full_recompute(flow, schedule, n_prompt):
    inputs = _inputs(n_prompt, seed=n_prompt)
    calls, outs, refs, _ = _run_stream(flow, inputs, _tokens(130, n_prompt), SCHEDULES[schedule])
    assert len(calls) >= 3
    errs = _max_err(outs, refs)
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize("schedule", ["default", "first10_la1"])
def test_deeper_random_model(deep_flow, schedule):
    inputs = _inputs(44, seed=9)
    calls, outs, refs, _ = _run_stream(deep_flow, inputs, _tokens(140, 9), SCHEDULES[schedule])
    errs = _max_err(outs[:-1], refs[:-1]) + _max_err(outs[-1:], refs[-1:])
    assert max(errs) <= TOL, errs


def test_recorded_upstream_stream(flow, load_case):
    """The fixture's recorded upstream calls: non-final chunks reproduced incrementally, final one as upstream."""
    case = load_case("case_flow_stream")
    inputs = types.SimpleNamespace(embedding=case["embedding"], flow_prompt_speech_token=case["prompt_token"].int(),
                                   prompt_feat=case["prompt_feat"])
    calls = plan(case["prompt_token"].shape[1], case["token"].shape[1], StreamParams())
    assert [c.n_tokens for c in calls] == [c["n_tokens"] for c in case["calls"]]
    inc = IncrementalFlow(flow)
    seg = types.SimpleNamespace(flow_state=None)
    for call, rec in zip(calls, case["calls"]):
        mel = inc.chunk(seg, inputs, case["token"][:, :call.n_tokens].int(), call)
        want = rec["mel"][:, :, 2 * call.token_offset:]
        assert mel.shape == want.shape
        assert (mel - want).abs().max().item() <= TOL


def test_default_schedule_computes_only_new_frames(flow):
    """Default hops end every body on a chunk boundary: each frame goes through the estimator once."""
    n_prompt = 57
    inputs = _inputs(n_prompt, seed=3)
    calls, _, _, states = _run_stream(flow, inputs, _tokens(130, 3), StreamParams())
    first = states[1]
    assert states[0] is None and first is not None
    body_end = n_prompt + calls[0].token_offset + calls[0].hop
    assert first.frames_computed == 2 * body_end  # a new voice: prompt and first chunk in one solve
    for st, prev_call in zip(states[2:], calls[1:]):
        body_end = n_prompt + prev_call.token_offset + prev_call.hop
        assert st.dec.n_frames == 2 * body_end  # everything before the next chunk is committed


def test_short_first_hop_recomputes_at_most_one_chunk(flow):
    params = SCHEDULES["first10_la1"]
    inputs = _inputs(20, seed=4)
    calls, _, _, states = _run_stream(flow, inputs, _tokens(130, 4), params)
    for st, nxt in zip(states[1:], calls[1:]):
        out_start = 2 * (20 + nxt.token_offset)
        assert 0 <= out_start - st.dec.n_frames < 2 * 25 + 2 * 3


def test_prompt_state_dict_roundtrip(flow):
    """The prompt's share, stored as dict[str, Tensor] (speaker cache ``extra``), gives the same chunks."""
    n_prompt = 61
    inputs = _inputs(n_prompt, seed=6)
    d = prompt_flow_state(flow, inputs)
    assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items())
    st = FlowState.from_dict(d)
    assert st.enc.n_tokens == 50 and st.dec.n_frames == 100 and len(st.dec.steps) == flow.cfg.cfm.n_timesteps
    assert st.nbytes() == prompt_state(flow, inputs).nbytes() > 0

    tokens = _tokens(80, 6)
    ref_calls, ref_outs, _, _ = _run_stream(flow, inputs, tokens, StreamParams())
    cached = types.SimpleNamespace(**vars(inputs), flow_prompt_state=d)
    inc = IncrementalFlow(flow)
    seg = types.SimpleNamespace(flow_state=None)
    for call, ref in zip(ref_calls, ref_outs):
        assert (inc.chunk(seg, cached, tokens[:, :call.n_tokens], call) - ref).abs().max().item() <= 1e-5


def test_state_bytes_grow_per_committed_frame(flow):
    inputs = _inputs(20, seed=7)
    _, _, _, states = _run_stream(flow, inputs, _tokens(200, 7), StreamParams())
    per_frame = state_bytes_per_frame(flow)["total"]
    a, b = states[1], states[2]
    assert b.nbytes() - a.nbytes() == per_frame * (b.dec.n_frames - a.dec.n_frames)


def test_state_ahead_of_call_starts_over(flow):
    """A state that already covers frames the call must return is not used (recomputed from the prompt)."""
    inputs = _inputs(30, seed=8)
    tokens = _tokens(140, 8)
    calls = plan(30, 140, StreamParams())
    assert not calls[1].finalize
    inc = IncrementalFlow(flow)
    seg = types.SimpleNamespace(flow_state=None)
    inc.chunk(seg, inputs, tokens[:, :calls[0].n_tokens], calls[0])
    inc.chunk(seg, inputs, tokens[:, :calls[1].n_tokens], calls[1])
    assert seg.flow_state.dec.n_frames > 2 * (30 + calls[1].token_offset)
    again = inc.chunk(seg, inputs, tokens[:, :calls[1].n_tokens], calls[1])  # replay: state is past its start
    ref = flow_chunk_mel(flow, inputs, tokens[:, :calls[1].n_tokens], calls[1])
    assert (again - ref).abs().max().item() <= TOL


def test_non_streaming_request_delegates(flow):
    inputs = _inputs(20, seed=10)
    tokens = _tokens(40, 10)
    call = ChunkCall(0, 0, 40, 40, 0, finalize=True)
    seg = types.SimpleNamespace(flow_state=None)
    out = IncrementalFlow(flow).chunk(seg, inputs, tokens, call, stream=False)
    assert torch.equal(out, flow_chunk_mel(flow, inputs, tokens, call, stream=False))


def test_one_shot_final_call_is_upstreams_full_pass(flow):
    """A non-streaming request (one finalize call, no earlier state) never switches to streaming attention."""
    inputs = _inputs(20, seed=11)
    tokens = _tokens(40, 11)
    call = ChunkCall(0, 0, 40, 40, 0, finalize=True)
    seg = types.SimpleNamespace(flow_state=None)
    out = IncrementalFlow(flow).chunk(seg, inputs, tokens, call)
    assert torch.equal(out, flow_chunk_mel(flow, inputs, tokens, call))


def test_cached_prompt_state_of_another_prompt_is_ignored(flow):
    inputs = _inputs(40, seed=12)
    other = prompt_flow_state(flow, _inputs(40, seed=13, embedding=inputs.embedding))
    tokens = _tokens(60, 12)
    call = plan(40, 60, StreamParams())[0]
    seg = types.SimpleNamespace(flow_state=None)
    cached = types.SimpleNamespace(**vars(inputs), flow_prompt_state=other)
    out = IncrementalFlow(flow).chunk(seg, cached, tokens[:, :call.n_tokens], call)
    ref = flow_chunk_mel(flow, inputs, tokens[:, :call.n_tokens], call)
    assert (out - ref).abs().max().item() <= TOL
