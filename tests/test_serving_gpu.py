"""The serving core on a GPU (tiny fixture model, all-cudagraph stage set): more requests than streams and LLM slots
all complete (they wait instead of failing), and once the engine has started nothing is captured while serving.

Run with ``python -m pytest -m gpu tests/test_serving_gpu.py`` (skipped without CUDA).
"""

from __future__ import annotations

import threading

import pytest
import torch

from cosyvoice_fast.kernels import graphs
from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.engine.engine import Engine
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest

PARAMS = (StreamParams(), StreamParams(token_hop_len_first=7, token_hop_len=13, pre_lookahead_len=0),
          StreamParams(token_hop_len_first=10, pre_lookahead_len=1))


def _request(case: dict, i: int) -> SynthesisRequest:
    g = torch.Generator().manual_seed(3000 + i)
    n_prompt = 8 + (i * 7) % 23  # mixed prompt lengths: mixed flow, encoder and vocoder shapes
    inputs = ModelInputs(text_segments=[torch.randint(0, 1000, (1, 5 + i % 4), generator=g)],
                         prompt_text=torch.randint(0, 1000, (1, 3), generator=g),
                         llm_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                         flow_prompt_speech_token=case["prompt_token"][:, :n_prompt],
                         prompt_feat=case["prompt_feat"][:, :2 * n_prompt],
                         embedding=case["embedding"] + 0.05 * torch.randn(1, 192, generator=g))
    return SynthesisRequest(inputs=inputs, seed=i, max_tokens=40 + 17 * (i % 5), ignore_eos=True,
                            stream_params=PARAMS[i % len(PARAMS)], request_id=f"gpu{i}")


def _serve(eng: Engine, reqs: list[SynthesisRequest], timings: list | None = None) -> dict[int, object]:
    out: dict[int, object] = {}

    def run(i: int, req: SynthesisRequest) -> None:
        try:
            chunks = list(eng.stream(req))
            out[i] = sum(len(c.samples) for c in chunks)
            if timings is not None:
                timings.extend(c.timing for c in chunks if c.timing is not None)
        except Exception as e:  # noqa: BLE001
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(reqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return out


@pytest.mark.gpu
def test_gpu_more_requests_than_slots_wait_and_nothing_is_captured_while_serving(fixture_dir, load_case):
    from cosyvoice_fast.modeldir.files import load_models

    case = load_case("case_flow_stream")
    models = load_models(fixture_dir, device="cuda")
    # every graph before serving (background capture off: tests/test_startup_background.py covers it)
    cfg = EngineConfig(max_streams=6, llm_slots=4, max_context=512, queue_limit=32,
                       flow_buckets=(50, 100, 150, 200, 300, 400, 600), flow_rows=(1, 2, 4), vocoder_rows=(1,),
                       background_capture=False)
    # recompute flow: which stream gets the incremental buffers depends on timing, and with it the encoder's
    # exact shapes; the incremental graphs' start-up capture is covered in tests/test_incremental_graphs.py
    backend = BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="cudagraph", dtype="fp32", incremental=False)
    eng = Engine(models, backend=backend, config=cfg)
    try:
        stages = eng.stages(backend)
        after_start = graphs.captures()
        est = stages.flow.estimator
        fixed = est.captures
        assert stages.llm.capacity == 4 and est.captures > 0 and all(c.frozen for c in est.all_caches())
        enc = stages.flow.encoder  # token-bucket graphs: every voice length was served by start-up captures
        enc_fixed = enc.captures
        assert enc_fixed > 0 and all(c.frozen for c in enc.caches.values())
        reqs = [_request(case, i) for i in range(12)]
        timings: list = []
        first = _serve(eng, reqs, timings)  # 12 requests, 6 streams, 4 LLM slots: the rest wait, none fails
        for i, r in enumerate(reqs):
            assert first[i] == r.max_tokens * 960, f"request {i}: {first[i]!r}"
        # a solve's end is read from CUDA events once its audio reached the host: the stamps stay in order
        assert len(timings) >= 24
        for t in timings:
            stamps = [t.tokens_ready, t.flow_start, t.flow_end, t.vocoder_end, t.delivered]
            assert all(b - a >= -5e-4 for a, b in zip(stamps, stamps[1:])), stamps
        assert est.captures == fixed  # LLM, estimator and encoder graphs were all captured at start-up
        # whether two requests' encoder calls meet in one replay depends on timing (a cold first run had none),
        # so batched encoder replays are asserted where they are deterministic: tests/test_graph_encoder.py
        assert enc.captures == enc_fixed and enc.eager_calls == 0
        warm = graphs.captures()  # + the exact-shape HiFT graphs of final-chunk lengths served once
        again = _serve(eng, list(reversed([_request(case, i) for i in range(12)])))
        assert all(again[i] == first[11 - i] for i in range(12)), again
        assert graphs.captures() == warm, "a graph was captured while serving lengths already seen"
        assert est.captures == fixed and enc.captures == enc_fixed
        stats = eng.stats()
        assert stats["rejected"] == 0 and stats["graph_captures"] == warm >= after_start
        assert stats["decode_rows"] > stats["decode_steps"]  # decode steps were shared
    finally:
        eng.close()


@pytest.mark.gpu
def test_gpu_captured_vocoder_shares_an_eager_pass_for_many_rows_and_equals_solo(fixture_dir, load_case):
    """From ``min_batch`` rows the captured HiFT vocodes chunks of one shape in one eager filter pass (no new graph);
    under it each row replays its length's graph.  Either way every row equals its solo call: the excitation
    exactly (row by row from its own generator), the waveform within float rounding (another conv batch size)."""
    from cosyvoice_fast.vocoder.graph import CudaGraphVocoder
    from cosyvoice_fast.modeldir.files import load_models

    case = load_case("case_flow_stream")
    models = load_models(fixture_dir, device="cuda")
    voc = CudaGraphVocoder(models.hift, min_batch=3)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # TF32 convolutions pick other algorithms per batch size
    try:
        _vocoder_rows_equal_solo(voc, case)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.gpu
def test_gpu_vocoder_batch_graphs_captured_at_start_serve_padded_rows_and_equal_solo(fixture_dir, load_case):
    """Whole-chunk graphs (f0, excitation, filter) are captured in the constructor for the given (length, rows);
    a lone chunk replays the one-row graph and a batch of 3 chunks the 4-row graph (one zero padding row), with
    nothing captured while serving.  Each row's excitation is the one its generator gives the chunk alone (the
    noise draw exactly; f0 on another batch size within float rounding) and its waveform equals the solo call's
    within float rounding; the cache overlap is spliced in exactly; a length with no graph takes the eager pass."""
    from cosyvoice_fast.vocoder.graph import CudaGraphVocoder
    from cosyvoice_fast.modeldir.files import load_models

    case = load_case("case_flow_stream")
    frames = int(case["prompt_feat"].shape[1])
    models = load_models(fixture_dir, device="cuda")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # TF32 convolutions pick other algorithms per batch size
    try:
        before = graphs.captures()
        voc = CudaGraphVocoder(models.hift, min_batch=2, rows=(1, 2, 4), lengths=(frames,), progress=False)
        assert sorted(voc.batch_graphs) == [(frames, 1), (frames, 2), (frames, 4)]
        assert graphs.captures() - before == 3
        mels = torch.randn(3, 80, frames, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) - 5
        srcs = torch.zeros(3, 1, 0, device="cuda")
        captures = graphs.captures()
        solo = [voc.vocode(mels[i:i + 1], srcs[i:i + 1], torch.Generator("cuda").manual_seed(20 + i))
                for i in range(3)]
        with torch.inference_mode():  # the excitation HarmonicNoiseSource.forward draws for the chunk alone
            eager = [voc.plain.source(voc._f0(mels[i:i + 1]), torch.Generator("cuda").manual_seed(20 + i))
                     for i in range(3)]
        wav, src = voc.vocode_batch(mels, srcs, [torch.Generator("cuda").manual_seed(20 + i) for i in range(3)])
        assert voc.batch_replays == 4 and voc.eager_batches == 0 and graphs.captures() == captures
        for i in range(3):
            assert (solo[i][1] - eager[i]).abs().max().item() <= 1e-5
            assert (src[i:i + 1] - solo[i][1]).abs().max().item() <= 1e-5
            assert (wav[i:i + 1] - solo[i][0]).abs().max().item() <= 1e-3
        # a later chunk: the previous chunk's excitation replaces the first n samples exactly
        n = 8 * voc.plain.samples_per_frame
        cached = torch.rand(3, 1, n, device="cuda")
        _, src2 = voc.vocode_batch(mels, cached, [torch.Generator("cuda").manual_seed(i) for i in range(3)])
        assert torch.equal(src2[:, :, :n], cached) and not torch.equal(src2[:, :, n:2 * n], src[:, :, n:2 * n])
        other = frames + 1  # no batched graph of this length: the eager pass, still no capture
        voc.vocode_batch(torch.randn(2, 80, other, device="cuda") - 5, torch.zeros(2, 1, 0, device="cuda"),
                         [torch.Generator("cuda").manual_seed(i) for i in range(2)])
        assert voc.eager_batches == 1 and graphs.captures() == captures
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.gpu
def test_gpu_final_chunk_lengths_replay_one_row_graphs_captured_at_start(fixture_dir, load_case):
    """``final_lengths`` are captured for one row only: a final chunk (with the previous chunk's excitation
    spliced in) replays its start-up graph, captures nothing, and equals the path without start-up graphs (eager
    excitation, then the filter graph) within float rounding; two final chunks of such a length go row by row."""
    from cosyvoice_fast.vocoder.graph import CudaGraphVocoder
    from cosyvoice_fast.modeldir.files import load_models

    case = load_case("case_flow_stream")
    frames = int(case["prompt_feat"].shape[1])
    final = frames + 8 + 2 * 3  # a later chunk's 8 cached frames + 3 tokens
    models = load_models(fixture_dir, device="cuda")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        voc = CudaGraphVocoder(models.hift, rows=(1, 2), lengths=(frames,), final_lengths=(final,), progress=False)
        assert sorted(voc.batch_graphs) == sorted([(frames, 1), (frames, 2), (final, 1)])
        ref = CudaGraphVocoder(models.hift, progress=False)  # no start-up graphs
        mels = torch.randn(2, 80, final, device="cuda", generator=torch.Generator("cuda").manual_seed(3)) - 5
        n = 8 * voc.plain.samples_per_frame
        cached = torch.rand(2, 1, n, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
        want = [ref.vocode(mels[i:i + 1], cached[i:i + 1], torch.Generator("cuda").manual_seed(30 + i))
                for i in range(2)]
        captures = graphs.captures()
        got = voc.vocode(mels[:1], cached[:1], torch.Generator("cuda").manual_seed(30))
        assert voc.batch_replays == 1 and graphs.captures() == captures
        assert torch.equal(got[1][:, :, :n], cached[:1])
        assert (got[1] - want[0][1]).abs().max().item() <= 1e-5
        assert (got[0] - want[0][0]).abs().max().item() <= 1e-3
        wav, src = voc.vocode_batch(mels, cached, [torch.Generator("cuda").manual_seed(30 + i) for i in range(2)])
        assert voc.batch_replays == 3 and voc.eager_batches == 0 and graphs.captures() == captures
        for i in range(2):
            assert (wav[i:i + 1] - want[i][0]).abs().max().item() <= 1e-3
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _vocoder_rows_equal_solo(voc, case) -> None:  # noqa: ANN001
    frames = int(case["prompt_feat"].shape[1])
    mels = torch.randn(4, 80, frames, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) - 5
    srcs = torch.zeros(4, 1, 0, device="cuda")

    def gens():
        return [torch.Generator("cuda").manual_seed(10 + i) for i in range(4)]

    solo = [voc.vocode(mels[i:i + 1], srcs[i:i + 1], g) for i, g in enumerate(gens())]
    captures = graphs.captures()
    for rows in (2, 4):  # 2 < min_batch: graph replays; 4: one eager pass
        wav, src = voc.vocode_batch(mels[:rows], srcs[:rows], gens()[:rows])
        assert wav.shape == (rows, solo[0][0].shape[-1])
        for i in range(rows):
            assert torch.equal(src[i:i + 1], solo[i][1])
            assert (wav[i:i + 1] - solo[i][0]).abs().max().item() <= 1e-3
    assert graphs.captures() == captures
