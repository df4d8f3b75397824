"""Batched flow chunks: several requests' flow calls share ONE guided CFM solve.

CPU (fp32, tiny fixture): the batched maths equals per-item ``flow_chunk_mel`` for items of different prompt
lengths, token counts and attention modes; the solver feeds the estimator 2B rows (B conditional, then B zero
rows); the graph runner pads batch rows to its row buckets with zero, mask-0 rows (fake graphs); the engine runs
concurrent first chunks as one batch and still gives every request exactly its solo audio; a failing batch
fails only the culprit's request.  GPU: ``python -m pytest -m gpu tests/test_flow_batch.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cosyvoice_fast.flow.graph import GraphEncoder, CudaGraphFlow, GraphEstimator, bucket_rows
from cosyvoice_fast.flow.eager import EagerFlow, flow_chunk_mel, flow_chunk_mel_batch, plan_solves
from cosyvoice_fast.flow.onnx_export import example_inputs
from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.model import tiny_config
from cosyvoice_fast.engine.engine import Engine, RequestStream
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.config.schedule import plan

HAS_CUDA = torch.cuda.is_available()
TOL = 1e-5


_gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


@pytest.fixture(scope="module")
def case(load_case) -> dict:
    return load_case("case_flow_stream")


@pytest.fixture(scope="module")
def flow(tiny_models):
    return tiny_models.flow


def _inputs(case: dict, n_prompt: int, i: int, device="cpu", dtype=torch.float32) -> ModelInputs:
    g = torch.Generator().manual_seed(100 + i)
    inputs = ModelInputs(text_segments=[torch.tensor([[1, 2, 3]])],
                         flow_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                         prompt_feat=case["prompt_feat"][:, :2 * n_prompt],
                         embedding=case["embedding"] + 0.05 * torch.randn(1, 192, generator=g))
    return inputs.to(device, dtype)


def _items(case: dict, device="cpu", dtype=torch.float32):
    """Different prompt lengths, token counts, streaming and final calls (two of each mode)."""
    out = []
    for i, (n_prompt, k) in enumerate([(8, 0), (14, 1), (20, -1), (11, -1), (17, 0)]):
        calls = plan(n_prompt, case["token"].shape[1], StreamParams())
        call = calls[k]
        out.append((None, _inputs(case, n_prompt, i, device, dtype), case["token"][:, :call.n_tokens], call))
    assert {c.finalize for *_, c in out} == {True, False}
    return out


# ------------------------------------------------------------------------------------------- maths (CPU)


def test_batched_chunks_equal_per_item_chunks(flow, case):
    items = _items(case)
    ref = [flow_chunk_mel(flow, inp, tok, call) for _, inp, tok, call in items]
    out = flow_chunk_mel_batch(flow, items)
    assert len({r.shape[2] for r in ref}) == len(ref)  # really different lengths (right padding exercised)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert (a - b).abs().max().item() <= TOL


def test_equal_shaped_calls_share_encoder_passes_and_equal_per_item_chunks(flow, case):
    """Seven calls of one exact shape (different voices, same prompt length and call) are encoded in one pass
    of 7 rows, an eighth of another shape alone; each mel equals its own :func:`flow_chunk_mel`."""
    call = plan(14, case["token"].shape[1], StreamParams())[1]
    items = [(None, _inputs(case, 14, i), case["token"][:, :call.n_tokens], call) for i in range(7)]
    other = plan(9, case["token"].shape[1], StreamParams())[0]
    items.append((None, _inputs(case, 9, 7), case["token"][:, :other.n_tokens], other))
    rows: list[int] = []

    def spy(tokens, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        rows.append(int(tokens.shape[0]))
        return flow.encode(tokens, *args, **kwargs)

    ref = [flow_chunk_mel(flow, inp, tok, c) for _, inp, tok, c in items]
    out = flow_chunk_mel_batch(flow, items, encode=spy)
    assert sorted(rows) == [1, 7]
    for a, b in zip(out, ref):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL


def test_eager_solve_policies(flow, case):
    items = _items(case)
    ref = [flow_chunk_mel(flow, inp, tok, call) for _, inp, tok, call in items]
    stage = EagerFlow(flow, tiny_config())
    assert stage.max_batch == 1  # CPU: the reference stays a plain loop
    assert all(torch.equal(a, b) for a, b in zip(stage.solve(items), ref))  # a loop of chunk(): exact
    stage.max_batch = 4
    assert all((a - b).abs().max().item() <= TOL for a, b in zip(stage.solve(items), ref))
    # same-length items (same prompt, same call, different text and speaker) share an unpadded solve; equal to
    # float rounding (bit-exact on some CPUs, not on all: BLAS may block a batch of 4 differently)
    same = [(None, _inputs(case, 20, i), case["token"][:, i:i + 40], plan(20, 90, StreamParams())[0])
            for i in range(4)]
    solo = [stage.chunk(*it) for it in same]
    assert all((a - b).abs().max().item() <= 1e-5 for a, b in zip(stage.solve(same), solo))


def test_solver_feeds_the_estimator_2b_rows(flow, case):
    items = _items(case)[:3]
    seen = []
    est = flow.decoder.estimator

    def spy(x, mask, mu, t, spks, cond, streaming):
        seen.append((x.shape, t.shape, streaming))
        b = x.shape[0] // 2
        assert torch.equal(x[:b], x[b:])  # the same state in the conditional and unconditional rows
        assert not mu[b:].any() and not spks[b:].any() and not cond[b:].any()
        assert torch.equal(mask[:b], mask[b:])
        return est(x, mask, mu, t, spks, cond, streaming)

    flow_chunk_mel_batch(flow, items, estimator=spy)
    steps = flow.cfg.cfm.n_timesteps
    # items 0, 1 stream (one solve of 2 -> 4 rows), item 2 is final (a solve of 1 -> 2 rows)
    assert sorted((s[0][0], s[2]) for s in seen) == sorted([(4, True)] * steps + [(2, False)] * steps)
    assert all(s[1][0] == s[0][0] for s in seen)


def test_plan_solves():
    assert plan_solves([30, 10, 20], 16) == [[1, 2, 0]]
    assert plan_solves([30, 10, 20, 10], 2) == [[1, 3], [2, 0]]
    assert plan_solves([10, 20, 10], 16, same_length=True) == [[0, 2], [1]]
    # budget on n * frames: 2 * 20 = 40 fits, 3 * 30 does not
    assert plan_solves([10, 20, 30], 16, cost=lambda n, f: n * f, budget=40) == [[0, 1], [2]]
    assert plan_solves([100], 16, cost=lambda n, f: n * f, budget=1) == [[0]]  # a single item always runs


# ------------------------------------------------------------------ graph runner with batch rows (CPU, fake graphs)


def _rows(frames: int, rows: int, seed: int):
    """Estimator inputs with ``rows`` rows of different valid lengths (row r keeps frames - 7r)."""
    parts = [example_inputs(frames, seed=seed + r) for r in range(rows // 2)]
    x, mask, mu, t, spks, cond = (torch.cat([p[k] for p in parts]) for k in range(6))
    for r in range(rows):
        n = frames - 7 * r
        mask[r, :, n:] = 0
        for z in (x, mu, cond):
            z[r, :, n:] = 0
    return x, mask, mu, t[:1].expand(rows).contiguous(), spks, cond


def test_bucket_rows():
    assert [bucket_rows(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)] == [2, 2, 4, 4, 8, 8, 16, 16, 32, 32, None]


def test_graph_estimator_pads_batch_rows(flow, fake_graphs):
    est = flow.decoder.estimator
    runner = GraphEstimator(est, torch.device("cpu"), granularity=50, max_frames=300)  # budget 2 * 300^2 row-frames
    # big batches first, so smaller ones reuse buffers holding stale real rows beyond their own
    for rows, frames, streaming in ((8, 120, True), (6, 110, True), (2, 90, True), (4, 73, False), (10, 60, True),
                                    (34, 50, True), (32, 150, True)):
        args = _rows(frames, rows, seed=rows)
        with torch.inference_mode():
            ref = est(*args, streaming)
            out = runner(*args, streaming)
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= TOL, (rows, frames)
    keys = {k for c in runner.caches.values() for k in c.graphs}
    assert keys == {(150, 8, torch.float32), (100, 2, torch.float32), (100, 4, torch.float32),
                    (100, 16, torch.float32)}
    # 34 rows exceed the largest row bucket; 32 rows x 150^2 exceed the attention-memory budget (2 * 300^2)
    assert runner.eager_calls == 2 and runner.replays == 5


def test_cudagraph_solve_through_the_row_padded_runner(flow, case, fake_graphs):
    """CudaGraphFlow's batched path on CPU (fake graphs stand in for CUDA graphs)."""
    stage = CudaGraphFlow.__new__(CudaGraphFlow)  # __init__ refuses without CUDA
    stage.flow, stage.config, stage.incremental = flow, tiny_config(), None
    stage.estimator = GraphEstimator(flow.decoder.estimator, torch.device("cpu"), granularity=50)
    stage.encoder = GraphEncoder(flow, torch.device("cpu"))  # fake graphs too: replays re-run encode_padded
    items = _items(case)
    ref = [flow_chunk_mel(flow, inp, tok, call) for _, inp, tok, call in items]
    out = stage.solve(items)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL
    assert stage.estimator.eager_calls == 0
    rows = sorted({k[1] for c in stage.estimator.caches.values() for k in c.graphs})
    assert rows == [4, 8]  # 3 streaming items -> 6 rows -> 8; 2 final items -> 4 rows


# --------------------------------------------------------------------------------------------- engine (CPU)


class SpyBatchFlow:
    """Wraps a flow stage; records batch sizes; raises for items whose speaker tag is ``fault``."""

    def __init__(self, inner, fault: str | None = None):
        self.inner, self.fault, self.batches = inner, fault, []
        self.max_batch = 8

    def _check(self, inputs):
        if self.fault is not None and inputs.speaker == self.fault:
            raise RuntimeError("flow fault injected")

    def chunk(self, seg, inputs, tokens, call):  # noqa: ANN001
        self._check(inputs)
        return self.inner.chunk(seg, inputs, tokens, call)

    def solve(self, items):  # noqa: ANN001
        self.batches.append(len(items))
        for it in items:
            self._check(it[1])
        return self.inner.solve(items)


PARAMS = StreamParams(token_hop_len_first=5, token_hop_len=5, pre_lookahead_len=0)


def _request(case: dict, i: int, tag: str | None = None) -> SynthesisRequest:
    g = torch.Generator().manual_seed(1000 + i)
    n_prompt = 20 if i % 2 == 0 else 14  # two lengths: each pair shares an unpadded solve
    inputs = ModelInputs(text_segments=[torch.randint(0, 1000, (1, 5), generator=g)],
                         prompt_text=torch.randint(0, 1000, (1, 3), generator=g),
                         llm_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                         flow_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                         prompt_feat=case["prompt_feat"][:, :2 * n_prompt],
                         embedding=case["embedding"] + 0.05 * torch.randn(1, 192, generator=g), speaker=tag)
    return SynthesisRequest(inputs=inputs, seed=7 * i + 1, max_tokens=12, ignore_eos=True, stream_params=PARAMS,
                            request_id=f"req{i}", backend=BackendConfig(incremental=False))


@pytest.fixture(scope="module")
def batch_engine(tiny_models):
    eng = Engine(tiny_models)
    stages = eng.stages(BackendConfig(incremental=False))
    stages.flow.max_batch = 4  # CPU defaults to 1 (no batching)
    stages.flow = SpyBatchFlow(stages.flow)
    yield eng
    eng.close()


def _together(eng: Engine, reqs: list[SynthesisRequest]) -> dict[int, object]:
    """Admit all requests in one go (the worker sees them in the same turn), consume each in a thread."""
    with eng._cv:
        streams = [RequestStream(eng, eng._admit(r)) for r in reqs]
    out: dict[int, object] = {}

    def run(i):
        try:
            out[i] = [c.samples for c in streams[i]]
        except Exception as e:  # noqa: BLE001
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return out


def _same_audio(a: np.ndarray, b: np.ndarray) -> bool:
    """A batched request's audio against its solo run.  The batched solve changes GEMM batch sizes, so the mels
    differ by float rounding (<= 1e-5 above); the random-weight HiFT amplifies that into up to ~1e-4 on single
    samples, by an amount that depends on the CPU's kernels (1.004e-4 on one CI machine, 0 on another).  So the
    bound is the engine tests' (tests/test_engine.py): max <= 1e-3, mean <= 1e-5; a wrong chunk, row or
    generator differs by orders of magnitude more."""
    return a.shape == b.shape and np.abs(a - b).max() <= 1e-3 and np.abs(a - b).mean() <= 1e-5


def test_engine_batches_first_chunks_and_keeps_solo_audio(batch_engine, case):
    spy = batch_engine.stages(BackendConfig(incremental=False)).flow
    solo = [[c.samples for c in batch_engine.stream(_request(case, i))] for i in range(4)]
    assert spy.batches == []  # one request at a time: nothing to batch
    out = _together(batch_engine, [_request(case, i) for i in range(4)])
    assert spy.batches and spy.batches[0] == 4  # the four first chunks ran as one flow call
    for i in range(4):
        assert isinstance(out[i], list), out[i]
        assert len(out[i]) == len(solo[i]) >= 2
        for k, (a, b) in enumerate(zip(out[i], solo[i])):
            assert _same_audio(a, b), f"request {i}, chunk {k}"
    assert len({np.concatenate(s).tobytes() for s in solo}) == 4  # different requests, different audio


def test_chunk_batches_run_in_slices_of_the_largest_captured_solve(tiny_models, case):
    """With ``flow_rows`` up to 2, four first chunks ready together run as two flow calls of two requests (each
    slice vocoded and sent before the next is solved), and every request's audio equals its solo run."""
    eng = Engine(tiny_models, config=EngineConfig(flow_rows=(1, 2)))
    try:
        stages = eng.stages(BackendConfig(incremental=False))
        stages.flow.max_batch = 4  # CPU defaults to 1 (no batching)
        spy = stages.flow = SpyBatchFlow(stages.flow)
        solo = [[c.samples for c in eng.stream(_request(case, i))] for i in range(4)]
        out = _together(eng, [_request(case, i) for i in range(4)])
    finally:
        eng.close()
    assert spy.batches[:2] == [2, 2] and max(spy.batches) == 2
    for i in range(4):  # within float rounding of the solo run, as every batched solve (see above)
        assert isinstance(out[i], list), out[i]
        a, b = np.concatenate(out[i]), np.concatenate(solo[i])
        assert _same_audio(a, b), f"request {i}"


def test_engine_batch_telemetry_spans_the_batch(batch_engine, case):
    got = []
    batch_engine.add_observer(lambda tele, outcome: got.append(tele))
    try:
        _together(batch_engine, [_request(case, i) for i in range(3)])
    finally:
        batch_engine._observers.clear()
    firsts = [t.chunks[0] for t in got]
    assert len(firsts) == 3
    assert len({(c.flow_start, c.flow_end) for c in firsts}) == 1  # one batch: one flow span
    assert all(c.flow_start <= c.flow_end <= c.vocoder_end for c in firsts)


def test_a_failing_batch_fails_only_the_culprit(tiny_models, case):
    eng = Engine(tiny_models)
    try:
        stages = eng.stages(BackendConfig(incremental=False))
        solo = [[c.samples for c in eng.stream(_request(case, i))] for i in range(4)]
        stages.flow.max_batch = 4
        stages.flow = SpyBatchFlow(stages.flow, fault="bad")
        out = _together(eng, [_request(case, i, tag="bad" if i == 2 else None) for i in range(4)])
        assert 4 in stages.flow.batches
        assert isinstance(out[2], RuntimeError) and "flow fault injected" in str(out[2])
        for i in (0, 1, 3):
            assert isinstance(out[i], list), out[i]
            assert len(out[i]) == len(solo[i])
            assert all(_same_audio(a, b) for a, b in zip(out[i], solo[i]))
        assert eng.active_requests() == 0
    finally:
        eng.close()


# ------------------------------------------------------------------------------------------------------ GPU


@_gpu
def test_gpu_cudagraph_solve_equals_eager_fp32(tiny_models, case, no_tf32):
    import copy

    flow_cuda = copy.deepcopy(tiny_models.flow).cuda().eval()
    items = _items(case, "cuda")
    eager = EagerFlow(flow_cuda, tiny_config())
    ref = [eager.chunk(*it) for it in items]
    stage = CudaGraphFlow(flow_cuda, tiny_config())
    for _ in range(2):  # the second pass replays the graphs captured by the first
        out = stage.solve(items)
        errs = [(a - b).abs().max().item() for a, b in zip(out, ref)]
        assert [a.shape for a in out] == [b.shape for b in ref]
        assert max(errs) <= 1e-4, errs
    assert stage.estimator.eager_calls == 0
    # a bigger batch (12 streaming items -> 24 rows -> the 32-row graph; 8 final -> 16 rows) stays exact too
    out = stage.solve(items * 4)
    assert max((a - b).abs().max().item() for a, b in zip(out, ref * 4)) <= 1e-4
    assert stage.estimator.eager_calls == 0
    assert {k[1] for c in stage.estimator.all_caches() for k in c.graphs} >= {16, 32}
    eager.max_batch = 16
    out = eager.solve(items)
    assert max((a - b).abs().max().item() for a, b in zip(out, ref)) <= 1e-4


@_gpu
def test_gpu_cudagraph_solve_bf16_stays_close(tiny_models, case):
    import copy

    flow16 = copy.deepcopy(tiny_models.flow).cuda().to(torch.bfloat16).eval()
    items = _items(case, "cuda", torch.bfloat16)
    ref = [EagerFlow(flow16, tiny_config()).chunk(*it) for it in items]
    out = CudaGraphFlow(flow16, tiny_config()).solve(items)
    for a, b in zip(out, ref):
        scale = max(1.0, b.abs().max().item())
        assert torch.isfinite(a).all()
        assert (a - b).abs().max().item() <= 5e-2 * scale and (a - b).abs().mean().item() <= 1e-2 * scale
