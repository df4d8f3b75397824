"""CosyVoice3 flow stages (eager, incremental, CUDA graph) driven by the engine's chunk schedule on the fixture's
streamed call (``case_flow_stream``): each keeps exactly upstream's new frames.

CPU: eager reproduces every kept mel (1e-4, the fixture's tolerance) with the schedule of ``config/schedule.py``;
the incremental runner equals eager (1e-4) while computing only the new chunks; the graph runner's padding and
batching run through ``fake_graphs`` (the captured DiT's kernels: ``test_cosyvoice3_dit_kernels.py``).  GPU tests
(``-m gpu``) compare the graph stage with eager on CUDA (``fused`` is the same runner for CosyVoice3).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # the fused kernels run through Triton's interpreter (set before Triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.config.dit import dit_flow_config_from_doc
from cosyvoice_fast.config.schedule import ChunkCursor
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.yamlfile import read_hyperpyyaml
from cosyvoice_fast.flow.dit_eager import DiTEagerFlow
from cosyvoice_fast.flow.dit_incremental import DiTIncrementalFlow
from cosyvoice_fast.flow.model.dit_flow import DiTFlow, load_dit_flow
from cosyvoice_fast.frontend.request import ModelInputs

TOL = 1e-4


@pytest.fixture(scope="module")
def cv3_flow(fixture3_dir) -> DiTFlow:
    cfg = dit_flow_config_from_doc(read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml"), "cosyvoice3.yaml")
    return load_dit_flow(cfg, torch.load(fixture3_dir / "flow.pt", weights_only=True))


@pytest.fixture(scope="module")
def stream_case(load_case3) -> dict:
    return load_case3("case_flow_stream")


def _inputs(case: dict, device: str = "cpu", dtype: torch.dtype = torch.float32) -> ModelInputs:
    inputs = ModelInputs(text_segments=[torch.tensor([[1, 2, 3]])], flow_prompt_speech_token=case["prompt_token"],
                         prompt_feat=case["prompt_feat"], embedding=case["embedding"])
    return inputs.to(device, dtype)


def _schedule(case: dict, chunk_tokens: int) -> list:
    """The engine's calls for the whole token list (all tokens available, as upstream's recorded run)."""
    cursor = ChunkCursor(case["prompt_token"].shape[1], StreamParams(), chunk_tokens)
    n, calls = case["token"].shape[1], []
    while (call := cursor.next_call(n, llm_done=True)) is not None:
        calls.append(call)
    return calls


def _segment() -> SimpleNamespace:
    return SimpleNamespace(flow_state=None, flow_info=None)


def _maxabs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float().cpu() - b.float().cpu()).abs().max())


def test_cosyvoice3_schedule_matches_upstream_calls(cv3_flow, stream_case):
    calls = _schedule(stream_case, cv3_flow.cfg.chunk_tokens)
    rec = stream_case["calls"]
    assert [(c.n_tokens, c.token_offset, c.finalize) for c in calls] == \
        [(int(r["n_tokens"]), int(r["token_offset"]), bool(r["finalize"])) for r in rec]
    # upstream's streaming flag is "not final" (the DiT's last call attends over everything)
    assert [not c.finalize for c in calls] == [bool(r["streaming"]) for r in rec]


@pytest.mark.parametrize("runner", [DiTEagerFlow, DiTIncrementalFlow])
def test_cosyvoice3_flow_stage_keeps_upstreams_frames(cv3_flow, stream_case, runner):
    stage = runner(cv3_flow, None)
    inputs, seg, ratio = _inputs(stream_case), _segment(), cv3_flow.cfg.token_mel_ratio
    calls = _schedule(stream_case, cv3_flow.cfg.chunk_tokens)
    kept = []
    for call, rec in zip(calls, stream_case["calls"]):
        mel = stage.chunk(seg, inputs, stream_case["token"][:, :call.n_tokens], call)
        assert _maxabs(mel, rec["mel"][:, :, ratio * call.token_offset:]) <= TOL, f"call {call.index}"
        kept.append(mel)
    assert sum(m.shape[2] for m in kept) == stream_case["nonstream_mel"].shape[2]
    assert seg.flow_state is None  # dropped at the final call


def test_cosyvoice3_incremental_computes_only_new_chunks(cv3_flow, stream_case):
    stage, seg = DiTIncrementalFlow(cv3_flow), _segment()
    inputs, ratio, chunk = _inputs(stream_case), cv3_flow.cfg.token_mel_ratio, cv3_flow.cfg.dit.static_chunk_size
    n_prompt = stream_case["prompt_token"].shape[1]
    calls = _schedule(stream_case, cv3_flow.cfg.chunk_tokens)
    seen, cached = [], 0
    for call in calls:
        stage.chunk(seg, inputs, stream_case["token"][:, :call.n_tokens], call)
        total = ratio * (n_prompt + call.n_tokens - (0 if call.finalize else call.lookahead))
        expect = ("full", total) if call.finalize else ("incremental", total - cached)
        seen.append(seg.flow_info[:2])
        assert seg.flow_info[:2] == expect
        if not call.finalize:
            cached = total // chunk * chunk
            assert seg.flow_state.frames == cached and seg.flow_info[2] == seg.flow_state.nbytes() > 0
    assert stage.increments == len(calls) - 1 and stage.recomputes == 1


def test_cosyvoice3_incremental_unaligned_hops_equal_eager(cv3_flow, stream_case):
    """A first hop that does not end on a chunk (no padding) leaves a partial chunk: it is recomputed."""
    params = StreamParams(token_hop_len_first=7, token_hop_len=15)
    cursor = ChunkCursor(stream_case["prompt_token"].shape[1], params, cv3_flow.cfg.chunk_tokens)
    eager, inc, seg = DiTEagerFlow(cv3_flow), DiTIncrementalFlow(cv3_flow), _segment()
    inputs, n = _inputs(stream_case), stream_case["token"].shape[1]
    ratio, chunk = cv3_flow.cfg.token_mel_ratio, cv3_flow.cfg.dit.static_chunk_size
    n_prompt = ratio * stream_case["prompt_token"].shape[1]
    partial = 0
    while (call := cursor.next_call(n, llm_done=True)) is not None:
        toks = stream_case["token"][:, :call.n_tokens]
        assert _maxabs(inc.chunk(seg, inputs, toks, call), eager.chunk(None, inputs, toks, call)) <= TOL
        if not call.finalize:
            total = n_prompt + ratio * (call.n_tokens - call.lookahead)
            assert seg.flow_state.frames == total // chunk * chunk
            partial += total % chunk != 0
    assert partial >= 1  # some call ended inside a chunk: its tail was recomputed by the next call


def test_cosyvoice3_incremental_short_lookahead_equals_eager(cv3_flow, stream_case):
    """With less look-ahead than the model's, a chunk's last tokens change when more arrive: never cached."""
    params = StreamParams(pre_lookahead_len=1)
    cursor = ChunkCursor(stream_case["prompt_token"].shape[1], params, cv3_flow.cfg.chunk_tokens)
    eager, inc, seg = DiTEagerFlow(cv3_flow), DiTIncrementalFlow(cv3_flow), _segment()
    inputs, n = _inputs(stream_case), stream_case["token"].shape[1]
    ratio, chunk = cv3_flow.cfg.token_mel_ratio, cv3_flow.cfg.dit.static_chunk_size
    n_prompt = stream_case["prompt_token"].shape[1]
    while (call := cursor.next_call(n, llm_done=True)) is not None:
        toks = stream_case["token"][:, :call.n_tokens]
        assert _maxabs(inc.chunk(seg, inputs, toks, call), eager.chunk(None, inputs, toks, call)) <= TOL
        if not call.finalize:
            stable = ratio * (n_prompt + call.n_tokens - call.lookahead - (cv3_flow.cfg.pre_lookahead_len - 1))
            assert seg.flow_state.frames == stable // chunk * chunk


def test_cosyvoice3_incremental_reuses_a_voices_prompt_state(cv3_flow, stream_case):
    """A longer prompt (the fixture's prompt plus half its tokens, with made-up prompt mel) so that complete
    chunks depend on prompt tokens only: the voice's second segment starts after them, equal to eager."""
    half = stream_case["token"].shape[1] // 2
    ratio = cv3_flow.cfg.token_mel_ratio
    ptok = torch.cat((stream_case["prompt_token"], stream_case["token"][:, :half]), dim=1)
    pfeat = torch.cat((stream_case["prompt_feat"], stream_case["nonstream_mel"][:, :, :ratio * half].transpose(1, 2)),
                      dim=1)
    inputs = ModelInputs(text_segments=[torch.tensor([[1, 2, 3]])], flow_prompt_speech_token=ptok, prompt_feat=pfeat,
                         embedding=stream_case["embedding"])
    tokens = stream_case["token"][:, half:]
    stage, eager = DiTIncrementalFlow(cv3_flow), DiTEagerFlow(cv3_flow)
    cached = stage.prompt_frames(ptok.shape[1])
    assert cached > 0 and cached % cv3_flow.cfg.dit.static_chunk_size == 0
    refs: list[torch.Tensor] = []
    for voice_segment in range(2):
        seg = _segment()
        cursor = ChunkCursor(ptok.shape[1], StreamParams(), cv3_flow.cfg.chunk_tokens)
        call = cursor.next_call(tokens.shape[1], llm_done=True)
        assert not call.finalize, "the fixture has too few tokens for a streaming first call"
        for i in range(2):  # the first call and the one after it (the latter may be the final one)
            toks = tokens[:, :call.n_tokens]
            if voice_segment == 0:
                refs.append(eager.chunk(None, inputs, toks, call))
            assert _maxabs(stage.chunk(seg, inputs, toks, call), refs[i]) <= TOL
            if i == 0:
                frames = ratio * (ptok.shape[1] + call.n_tokens - call.lookahead)
                assert seg.flow_info[1] == frames - (cached if voice_segment else 0)
            call = cursor.next_call(tokens.shape[1], llm_done=True)
        assert stage.prompt_hits == voice_segment
    assert list(stage.prompt_states) == [inputs.prompt_key]
    assert stage.prompt_states[inputs.prompt_key].frames == cached


def test_cosyvoice3_eager_solve_equals_chunks(cv3_flow, stream_case):
    stage = DiTEagerFlow(cv3_flow)
    stage.max_batch = 4  # share the solve (CPU defaults to 1)
    inputs = _inputs(stream_case)
    call = _schedule(stream_case, cv3_flow.cfg.chunk_tokens)[0]
    toks = stream_case["token"][:, :call.n_tokens]
    one = stage.chunk(None, inputs, toks, call)
    both = stage.solve([(None, inputs, toks, call), (None, inputs, toks, call)])
    assert all(_maxabs(m, one) <= 1e-5 for m in both)


def test_cosyvoice3_stages_refuse_cosyvoice2_flow():
    with pytest.raises(TypeError, match="CosyVoice3's DiTFlow"):
        DiTEagerFlow(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="CosyVoice3's DiTFlow"):
        DiTIncrementalFlow(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------ CUDA graphs


def _graph_stage(flow: DiTFlow, monkeypatch=None, **kw):
    from cosyvoice_fast.flow import dit_graph

    if monkeypatch is not None:  # CPU: fake_graphs replays eagerly; the device check is the only CUDA part
        monkeypatch.setattr(dit_graph, "why_unavailable", lambda flow, backend: None)
        # the bookkeeping under test on the eager modules: the default BlasDiT's Triton kernels take ~100x longer
        # under the interpreter (tests/test_cosyvoice3_dit_kernels.py replays it through this stage)
        kw.setdefault("estimator", lambda dit: dit)
    return dit_graph.DiTGraphFlow(flow, None, **kw)


def _stream(stage, inputs, case, chunk_tokens):
    return [stage.chunk(None, inputs, case["token"][:, :c.n_tokens], c) for c in _schedule(case, chunk_tokens)]


def test_cosyvoice3_graph_flow_pads_to_buckets_and_replays(cv3_flow, stream_case, fake_graphs, monkeypatch):
    stage = _graph_stage(cv3_flow, monkeypatch)
    inputs, chunk = _inputs(stream_case), cv3_flow.cfg.chunk_tokens
    ref = _stream(DiTEagerFlow(cv3_flow), inputs, stream_case, chunk)
    out = _stream(stage, inputs, stream_case, chunk)
    assert [a.shape for a in out] == [b.shape for b in ref]
    assert max(_maxabs(a, b) for a, b in zip(out, ref)) <= TOL
    est, steps = stage.estimator, cv3_flow.cfg.cfm.n_timesteps
    assert est.eager_calls == 0 and est.replays == len(ref) * steps
    n_prompt, ratio, gran = stream_case["prompt_token"].shape[1], cv3_flow.cfg.token_mel_ratio, est.granularity
    keys = {(-(-ratio * (n_prompt + c.n_tokens - (0 if c.finalize else c.lookahead)) // gran) * gran, not c.finalize)
            for c in _schedule(stream_case, chunk)}
    assert est.captures == len(keys)


def test_cosyvoice3_graph_flow_captures_the_plan_then_freezes(cv3_flow, stream_case, fake_graphs, monkeypatch):
    """Start-up capture follows ``graph_plan.estimator_jobs`` (streaming first); afterwards a shape nobody
    captured runs eagerly (never a capture while serving) and still keeps upstream's frames."""
    from cosyvoice_fast.config.graph_plan import estimator_jobs

    n_prompt, ratio = stream_case["prompt_token"].shape[1], cv3_flow.cfg.token_mel_ratio
    calls = _schedule(stream_case, cv3_flow.cfg.chunk_tokens)
    frames = [ratio * (n_prompt + c.n_tokens - (0 if c.finalize else c.lookahead)) for c in calls]
    gran = cv3_flow.cfg.dit.static_chunk_size
    buckets = tuple(sorted({-(-f // gran) * gran for f, c in zip(frames, calls) if not c.finalize}))
    stage = _graph_stage(cv3_flow, monkeypatch, buckets=buckets, rows=(1,), capture_at_start=True, progress=False)
    est = stage.estimator
    plan = estimator_jobs(buckets, (1,))
    assert est.captures == len(plan) and [j.shape[1] for j in plan][0] is True
    out = _stream(stage, _inputs(stream_case), stream_case, cv3_flow.cfg.chunk_tokens)
    for call, mel, rec in zip(calls, out, stream_case["calls"]):
        assert _maxabs(mel, rec["mel"][:, :, ratio * call.token_offset:]) <= TOL
    assert est.captures == len(plan)  # frozen: nothing captured while serving
    served = [not c.finalize or -(-f // gran) * gran in buckets for f, c in zip(frames, calls)]
    assert est.eager_calls == cv3_flow.cfg.cfm.n_timesteps * served.count(False)


def test_cosyvoice3_graph_flow_batches_mixed_requests(cv3_flow, stream_case, load_case3, fake_graphs, monkeypatch):
    stage = _graph_stage(cv3_flow, monkeypatch, rows=(1, 2, 4))
    assert stage.max_batch == 4
    other = load_case3("case_flow")
    calls = _schedule(stream_case, cv3_flow.cfg.chunk_tokens)
    a, b = _inputs(stream_case), _inputs(other)
    items = [(None, a, stream_case["token"][:, :c.n_tokens], c) for c in calls]
    full = ChunkCursor(other["prompt_token"].shape[1], StreamParams(), cv3_flow.cfg.chunk_tokens)
    last = full.next_call(other["token"].shape[1], llm_done=True)
    while not last.finalize:  # the other request's final call (full attention, another length)
        last = full.next_call(other["token"].shape[1], llm_done=True)
    items.append((None, b, other["token"][:, :last.n_tokens], last))
    eager = DiTEagerFlow(cv3_flow)
    mels = stage.solve(items)
    for (seg, inp, toks, call), mel in zip(items, mels):
        assert _maxabs(mel, eager.chunk(seg, inp, toks, call)) <= TOL
    assert _maxabs(mels[-1], other["mel"][:, :, -mels[-1].shape[2]:]) <= TOL


def test_cosyvoice3_graph_flow_refuses_cpu_and_cosyvoice2(cv3_flow):
    from cosyvoice_fast.config.backends import BackendUnavailable
    from cosyvoice_fast.flow.dit_graph import DiTGraphFlow

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only refusal")
    with pytest.raises(BackendUnavailable, match="flow backend 'cudagraph' needs a CUDA GPU"):
        DiTGraphFlow(cv3_flow)
    with pytest.raises(TypeError, match="CosyVoice3's DiTFlow"):
        DiTGraphFlow(torch.nn.Linear(2, 2))


@pytest.fixture
def cv3_flow_cuda(cv3_flow, no_tf32):
    import copy

    return copy.deepcopy(cv3_flow).cuda().eval()


@pytest.mark.gpu
def test_gpu_cosyvoice3_graph_equals_eager_fp32(cv3_flow_cuda, stream_case):
    inputs, chunk = _inputs(stream_case, "cuda"), cv3_flow_cuda.cfg.chunk_tokens
    ref = _stream(DiTEagerFlow(cv3_flow_cuda), inputs, stream_case, chunk)
    for call, mel in zip(stream_case["calls"], ref):  # eager CUDA fp32 is upstream's fp32 too
        assert _maxabs(mel, call["mel"][:, :, -mel.shape[2]:]) <= TOL
    stage = _graph_stage(cv3_flow_cuda)
    for _ in range(2):  # the second pass replays what the first captured
        out = _stream(stage, inputs, stream_case, chunk)
        assert max(_maxabs(a, b) for a, b in zip(out, ref)) <= TOL
    assert stage.estimator.eager_calls == 0
    assert stage.estimator.replays == 2 * len(ref) * cv3_flow_cuda.cfg.cfm.n_timesteps


@pytest.mark.gpu
def test_gpu_cosyvoice3_graph_bf16_close_to_fp32(cv3_flow_cuda, stream_case):
    """bf16 (8-bit mantissa) over 10 Euler steps: max error <= 5e-2 x the mel's scale, mean <= 1e-2 x scale
    (a real defect is O(1)); graph and eager bf16 within the same max bound (the graphs run BlasDiT, whose fused
    sites round once where eager rounds per op, so the two bf16 runs are not the same kernels)."""
    inputs32, chunk = _inputs(stream_case, "cuda"), cv3_flow_cuda.cfg.chunk_tokens
    ref = _stream(DiTEagerFlow(cv3_flow_cuda), inputs32, stream_case, chunk)
    flow16 = cv3_flow_cuda.to(torch.bfloat16)
    inputs16 = _inputs(stream_case, "cuda", torch.bfloat16)
    out = _stream(_graph_stage(flow16, capture_at_start=True, buckets=(100, 200, 250), rows=(1,),
                               progress=False), inputs16, stream_case, chunk)
    eager16 = _stream(DiTEagerFlow(flow16), inputs16, stream_case, chunk)
    for a, b, e in zip(out, ref, eager16):
        scale = max(1.0, b.abs().max().item())
        assert torch.isfinite(a).all()
        assert _maxabs(a, b) <= 5e-2 * scale and (a.float() - b.float()).abs().mean().item() <= 1e-2 * scale
        assert _maxabs(a, e) <= 5e-2 * scale
