"""A new voice's prompt flow state computed ahead of its first chunk (``EngineConfig.prompt_state_ahead``): the
incremental runner starts a segment from it (``prepare``), every chunk stays equal to upstream's recompute, the
first chunk then solves only the frames after the prompt's committed chunks, and the engine does this on the chunk
side while the LM decodes, without changing the audio beyond float rounding."""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
import types

import numpy as np
import pytest
import torch

from cosyvoice_fast.backends.eager import flow_chunk_mel
from cosyvoice_fast.backends.incremental_flow import FlowState, IncrementalFlow
from cosyvoice_fast.config import StreamParams
from cosyvoice_fast.engine import Engine
from cosyvoice_fast.engine_config import EngineConfig
from cosyvoice_fast.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.schedule import plan

from test_incremental_flow import TOL, _inputs, _max_err, _tokens
from test_incremental_graphs import _graph_flow
from test_scheduler import GatedLLM


def _committed_frames(flow, n_prompt: int) -> int:
    """Mel frames of the prompt's complete chunks whose look-ahead lies inside the prompt (from the model)."""
    chunk = flow.encoder.cfg.static_chunk_size
    la = flow.encoder.pre_lookahead_layer.lookahead
    return flow.encoder.cfg.upsample_stride * max(0, (n_prompt - la) // chunk * chunk)


@pytest.fixture(scope="module")
def flow(tiny_models):
    return tiny_models.flow


@pytest.mark.parametrize("runner", ["graph", "eager"])
def test_a_prepared_segment_streams_incrementally_from_its_prompt_state(flow, runner):
    """The fused flow's setting (``new_voices="recompute"``) recomputes a new voice's chunks; prepared, the same
    segment streams incrementally from the start: only the final (full-attention) chunk recomputes, the first
    chunk solves only the frames after the prompt's committed ones, and every chunk equals upstream's."""
    n_prompt = 57
    inc = (_graph_flow(flow, new_voices="recompute") if runner == "graph"
           else IncrementalFlow(flow, new_voices="recompute"))
    inputs = types.SimpleNamespace(**vars(_inputs(n_prompt, seed=21)), prompt_key="voice-21")
    committed = _committed_frames(flow, n_prompt)
    assert committed > 0
    seg = types.SimpleNamespace(flow_state=None)
    assert inc.prepare(seg, inputs) is True and inc.prepared == 1
    assert isinstance(seg.flow_state, FlowState) and seg.flow_state.dec.n_frames == committed
    assert inc.prepare(seg, inputs) is False  # a segment with a state is left alone
    assert inc.memory()["prompt_states"] == 0  # the segment's own, not the returning voices' LRU

    tokens = _tokens(100, 21)
    calls = plan(n_prompt, 100, StreamParams())
    outs, refs, costs = [], [], []
    for call in calls:
        tok = tokens[:, :call.n_tokens]
        before = seg.flow_state.frames_computed if isinstance(seg.flow_state, FlowState) else None
        outs.append(inc.chunk(seg, inputs, tok, call))
        refs.append(flow_chunk_mel(flow, inputs, tok, call))
        if before is not None and isinstance(seg.flow_state, FlowState):
            costs.append(seg.flow_state.frames_computed - before)
    assert max(_max_err(outs, refs)) <= TOL
    assert costs[0] == 2 * (n_prompt + calls[0].hop) - committed  # the first chunk: only frames after the prompt's
    if runner == "graph":
        assert inc.full.calls == 1  # only the final (full-attention) chunk recomputed


def test_a_prompt_shorter_than_a_chunk_has_nothing_to_prepare(flow):
    inc = _graph_flow(flow, new_voices="recompute")
    seg = types.SimpleNamespace(flow_state=None)
    assert _committed_frames(flow, 20) == 0
    assert inc.prepare(seg, _inputs(20, seed=3)) is False and seg.flow_state is None and inc.prepared == 0


def test_prepare_waits_while_another_live_segment_holds_the_buffers(flow):
    """The graph runner holds one live segment's state; a second new voice is not prepared (it would evict the
    first one's only copy), and is once that segment is gone."""
    inc = _graph_flow(flow, new_voices="recompute")
    a, b = (types.SimpleNamespace(flow_state=None) for _ in range(2))
    assert inc.prepare(a, _inputs(57, seed=1)) is True
    assert inc.prepare(b, _inputs(57, seed=2)) is False and b.flow_state is None
    a.flow_state = None  # its request ended
    gc.collect()
    assert inc.prepare(b, _inputs(57, seed=2)) is True and inc.graphs.saves == 0


def _request(n_prompt: int, seed: int) -> SynthesisRequest:
    p = _inputs(n_prompt, seed)
    g = torch.Generator().manual_seed(seed)
    inputs = ModelInputs(text_segments=[torch.randint(0, 1000, (1, 10), generator=g)],
                         prompt_text=torch.randint(0, 1000, (1, 3), generator=g),
                         llm_prompt_speech_token=p.flow_prompt_speech_token,
                         flow_prompt_speech_token=p.flow_prompt_speech_token, prompt_feat=p.prompt_feat,
                         embedding=p.embedding)
    return SynthesisRequest(inputs=inputs, seed=seed, max_tokens=100, ignore_eos=True)


def _gated_run(eng: Engine, req: SynthesisRequest, until=lambda: True):  # noqa: ANN001
    """Stream ``req`` with its LM held before its first decode step until ``until()`` holds (the chunk side has
    done its part), so the order of the two sides is fixed."""
    stages = eng.stages(req.backend or eng.default_backend)
    gate = threading.Event()
    real_llm, stages.llm = stages.llm, GatedLLM(stages.llm, gate)
    try:
        it = eng.stream(req)
        deadline = time.monotonic() + 60
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        eng.wake()
        chunks = list(it)
        return np.concatenate([c.samples for c in chunks]), it.telemetry
    finally:
        stages.llm = real_llm


def test_engine_computes_a_new_voices_prompt_state_while_the_lm_decodes(tiny_models):
    req = _request(57, seed=31)
    committed = _committed_frames(tiny_models.flow, 57)
    eng = Engine(tiny_models, config=EngineConfig(cuda_streams=2))
    try:
        audio, tele = _gated_run(eng, req, until=lambda: eng.stats()["prompt_states_ahead"] == 1)
        assert eng.stats()["prompt_states_ahead"] == 1
    finally:
        eng.close()
    off = Engine(tiny_models, config=EngineConfig(cuda_streams=2, prompt_state_ahead=False))
    try:
        ref, ref_tele = _gated_run(off, req)
        assert off.stats()["prompt_states_ahead"] == 0
    finally:
        off.close()
    first, ref_first = tele.chunks[0], ref_tele.chunks[0]
    assert math.isfinite(tele.prompt_state_ms) and tele.prompt_state_ms > 0
    assert math.isnan(ref_tele.prompt_state_ms)
    assert first.flow_mode == "incremental" and first.flow_frames == ref_first.flow_frames - committed
    assert len(tele.chunks) == len(ref_tele.chunks) >= 3
    assert audio.shape == ref.shape
    np.testing.assert_allclose(audio, ref, atol=1e-3, rtol=0)  # the same maths, in another order of solves
    assert tele.to_dict()["prompt_state_ms"] == tele.prompt_state_ms


def test_a_failing_prepare_costs_only_the_head_start(tiny_models, caplog):
    req = _request(57, seed=41)
    eng = Engine(tiny_models, config=EngineConfig(cuda_streams=2))
    try:
        ref = eng.synthesize(_request(57, seed=41))[0]  # a fresh voice each time: nothing cached across requests
        flow = eng.stages(req.backend or eng.default_backend).flow

        def broken(seg, inputs):  # noqa: ANN001
            raise RuntimeError("prompt state exploded")

        flow.prepare = broken
        try:
            with caplog.at_level(logging.WARNING, logger="cosyvoice_fast.runtime.scheduler"):
                audio, tele = _gated_run(eng, req, until=lambda: any("could not be computed ahead" in r.message
                                                                     for r in caplog.records))
            assert any("prompt state exploded" in (r.exc_text or str(r.exc_info)) for r in caplog.records)
        finally:
            del flow.prepare
        assert tele.error is None and len(tele.chunks) >= 3
        np.testing.assert_allclose(audio, ref, atol=1e-3, rtol=0)
        assert math.isnan(tele.prompt_state_ms)
    finally:
        eng.close()
