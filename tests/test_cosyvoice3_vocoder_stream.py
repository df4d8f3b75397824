"""CosyVoice3's bounded streamed vocoding (vocoder/causal_stream.py) and its engine stage (vocoder/causal_eager.py):
each call emits upstream's samples for that call while processing only its new frames plus a fixed context."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cosyvoice_fast.config.causal_hift import causal_hift_config_from_doc
from cosyvoice_fast.config.yamlfile import read_hyperpyyaml
from cosyvoice_fast.vocoder.causal_eager import SPEED_NEEDS_WHOLE, CausalEagerVocoder
from cosyvoice_fast.vocoder.causal_stream import HELD_BACK, stream_step
from cosyvoice_fast.vocoder.model.causal_hift import CausalHiFTGenerator
from cosyvoice_fast.vocoder.stage import VocodeJob

TOL = 1e-4
F0_CONTEXT = 8 + 3  # the f0 predictor's left context (4 convs of kernel 3) and its look-ahead


@pytest.fixture(scope="module")
def case(load_case3) -> dict:
    return load_case3("case_hift")


@pytest.fixture(scope="module")
def cfg(fixture3_dir):
    return causal_hift_config_from_doc(read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml"), "cosyvoice3.yaml")


@pytest.fixture(scope="module")
def hift(cfg, fixture3_dir) -> CausalHiFTGenerator:
    sd = torch.load(fixture3_dir / "hift.pt", weights_only=True)
    return CausalHiFTGenerator(cfg).load_checkpoint(sd).eval()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def _stream(hift, mel, sizes, bound=None):
    """Feed ``mel`` in chunks of ``sizes`` (cycled); return the emitted chunks and each call's (new, decoded,
    f0 frames)."""
    outs, work, state, a, k = [], [], None, 0, 0
    n = mel.shape[2]
    with torch.inference_mode():
        while a < n:
            b = min(n, a + sizes[k % len(sizes)])
            wav, state = stream_step(hift, state, mel[:, :, a:b], b == n)
            outs.append(wav)
            if state is not None:
                work.append((b - a, state.last_decode_frames, state.last_f0_frames, state.mel.shape[2]))
            a, k = b, k + 1
    return outs, work


def test_cosyvoice3_stream_emits_upstreams_chunks(hift, case):
    """The n_mel of token2wav's calls (case_hift's ``stream``): every emitted chunk, same length, within 1e-4."""
    mel, prev, state = case["mel"], 0, None
    for call in case["stream"]:
        with torch.inference_mode():
            wav, state = stream_step(hift, state, mel[:, :, prev:call["n_mel"]], call["finalize"])
        ref = call["emitted"] if not call["finalize"] else case["wav"][:, call["speech_offset"]:]
        assert wav.shape == ref.shape
        assert _err(wav, ref) <= TOL
        assert (state is None) == call["finalize"]
        if state is not None:
            assert state.emitted * 480 == call["speech_offset"] + ref.shape[1] == call["n_out"]
        prev = call["n_mel"]


@pytest.mark.parametrize("sizes", [(50,), (100,), (37, 13, 60)])
def test_cosyvoice3_stream_is_bounded_and_equals_one_shot_in_float64(hift, case, sizes):
    """600 random frames in float64 (no fp32 rounding to hide behind): the streamed audio is the one-shot audio,
    while every call decodes at most new + decode_left_context() + 5 frames and keeps a bounded mel tail."""
    h64 = CausalHiFTGenerator(hift.cfg, hift.noise)
    h64.load_state_dict(hift.state_dict())
    h64 = h64.double().eval()
    m = case["mel"]
    g = torch.Generator().manual_seed(int(m.shape[2]))
    mel = (torch.randn(1, m.shape[1], 600, generator=g) * m.std() + m.mean()).double()
    with torch.inference_mode():
        whole, _ = h64.inference(mel)
    outs, work = _stream(h64, mel, sizes)
    assert [o.shape[1] for o in outs[:-1]] == [(sum(w[0] for w in work[:i + 1]) - HELD_BACK) * 480
                                             - sum(o.shape[1] for o in outs[:i]) for i in range(len(work))]
    assert _err(torch.cat(outs, dim=1), whole) <= 1e-8
    ctx = hift.decode_left_context()
    assert ctx == 30 if hift.cfg.upsample_rates == (8, 5, 3) else ctx > 0  # CosyVoice3's layout
    for new, decoded, f0_frames, kept in work:
        assert decoded <= new + ctx + 5
        assert f0_frames <= new + F0_CONTEXT
        assert kept <= ctx + HELD_BACK + 1


def test_cosyvoice3_stream_left_context_is_needed(hift, case):
    """With a shorter decode window the stream no longer reproduces the one-shot audio: the bound is not slack."""
    h64 = CausalHiFTGenerator(hift.cfg, hift.noise)
    h64.load_state_dict(hift.state_dict())
    h64 = h64.double().eval()
    short = hift.decode_left_context() - 5
    h64.decode_left_context = lambda: short  # type: ignore[method-assign]
    mel = case["mel"].double()
    with torch.inference_mode():
        whole, _ = h64.inference(mel)
    outs, _ = _stream(h64, mel, (50,))
    assert _err(torch.cat(outs, dim=1), whole) > 1e-6


def test_cosyvoice3_stream_fp32_long_equals_one_shot(hift, case):
    """fp32 as served: 600 frames made of the fixture's own mel, in chunks of 50, within 1e-4 of one shot."""
    m = case["mel"]
    mel = torch.cat([m, m.flip(2)] * (600 // (2 * m.shape[2]) + 1), dim=2)[:, :, :600]
    with torch.inference_mode():
        whole, _ = hift.inference(mel)
    outs, _ = _stream(hift, mel, (50,))
    assert _err(torch.cat(outs, dim=1), whole) <= TOL


def test_cosyvoice3_stream_refuses_audio_longer_than_the_noise_table(cfg, hift, case):
    short = CausalHiFTGenerator(dataclasses.replace(cfg, noise_table_len=100 * 480)).eval()
    with torch.inference_mode():
        _, state = stream_step(short, None, case["mel"][:, :, :60], False)
        with pytest.raises(ValueError, match=r"^101 mel frames make 48480 samples, more than CosyVoice3's noise"):
            stream_step(short, state, case["mel"][:, :, 60:101], True)


# --------------------------------------------------------------------------------------------- the stage

def test_cosyvoice3_eager_stage_streams_jobs_and_keeps_failures_apart(hift, case):
    voc = CausalEagerVocoder(hift)
    assert voc.max_batch == 1
    mel = case["mel"]
    calls, prev, cache, got = case["stream"], 0, None, []
    for call in calls:
        jobs = [VocodeJob(mel=mel[:, :, prev:call["n_mel"]], cache=cache, finalize=call["finalize"]),
                VocodeJob(mel=mel[0], cache=None, finalize=True)]  # a bad job beside it: (80, T), no batch axis
        (wav, cache), bad = voc.vocode_jobs(jobs)
        assert isinstance(bad, ValueError) and "must be (1, n_mels, frames)" in str(bad)
        got.append(wav)
        prev = call["n_mel"]
    assert cache is None
    assert _err(torch.cat(got, dim=1), torch.cat([c["emitted"] for c in calls[:-1]]
                                                 + [case["wav"][:, calls[-1]["speech_offset"]:]], dim=1)) <= TOL


def test_cosyvoice3_eager_stage_speed(hift, case):
    voc = CausalEagerVocoder(hift)
    mel = case["mel"][:, :, :40]
    (wav, cache), = voc.vocode_jobs([VocodeJob(mel=mel, cache=None, finalize=True, speed=2.0)])
    with torch.inference_mode():
        ref, _ = hift.inference(F.interpolate(mel, size=20, mode="linear"))
    assert cache is None and wav.shape == (1, 20 * 480) and _err(wav, ref) <= TOL
    (err,) = voc.vocode_jobs([VocodeJob(mel=mel, cache=None, finalize=False, speed=2.0)])
    assert isinstance(err, ValueError) and str(err) == SPEED_NEEDS_WHOLE


# --------------------------------------------------------------------------------------------- captured backend

def _two_streams(case):
    """Two streams: the fixture's token2wav schedule, and the same mel reversed in steady chunks of 50."""
    mel = case["mel"]
    a = [(prev, c["n_mel"], c["finalize"]) for prev, c in zip([0] + [c["n_mel"] for c in case["stream"]],
                                                               case["stream"])]
    n = mel.shape[2]
    b = [(s, min(n, s + 50), s + 50 >= n) for s in range(0, n, 50)]
    return [(mel, a), (mel.flip(2).contiguous(), b)]


def _run_stage(voc, streams, device="cpu"):
    """Interleave the streams' calls, one ``vocode_jobs`` per round; return each stream's emitted audio."""
    caches, outs = [None] * len(streams), [[] for _ in streams]
    for k in range(max(len(calls) for _, calls in streams)):
        live = [i for i, (_, calls) in enumerate(streams) if k < len(calls)]
        jobs = []
        for i in live:
            mel, calls = streams[i]
            a, b, fin = calls[k]
            jobs.append(VocodeJob(mel=mel[:, :, a:b].to(device), cache=caches[i], finalize=fin))
        for i, res in zip(live, voc.vocode_jobs(jobs)):
            assert not isinstance(res, Exception), res
            outs[i].append(res[0].cpu())
            caches[i] = res[1]
    return [torch.cat(o, dim=1) for o in outs]


def _graph_stage(hift, streams, monkeypatch=None):
    from cosyvoice_fast.vocoder import causal_graph
    from cosyvoice_fast.vocoder.causal_stream import decode_windows

    if monkeypatch is not None:  # CPU: fake_graphs replays eagerly; the device check is the only CUDA part
        monkeypatch.setattr(causal_graph, "why_unavailable", lambda device: None)
    ctx = hift.decode_left_context()
    lengths = {n for _, calls in streams for n in decode_windows(ctx, [b - a for a, b, fin in calls if not fin])}
    return causal_graph.CausalGraphVocoder(hift, max_batch=4, rows=(1, 2), lengths=sorted(lengths),
                                           final_lengths=(_final_window(ctx, streams[0][1]),))


def _final_window(ctx, calls):
    """Decode-window frames of a stream's final call: the left context plus every frame not emitted before."""
    before = calls[-2][1] - HELD_BACK if len(calls) > 1 else 0
    return calls[-1][1] - max(0, before - ctx)


def test_cosyvoice3_graph_stage_batches_streams_like_eager(hift, case, fake_graphs, monkeypatch):
    streams = _two_streams(case)
    ref = _run_stage(CausalEagerVocoder(hift), streams)
    voc = _graph_stage(hift, streams, monkeypatch)
    got = _run_stage(voc, streams)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and _err(g, r) <= TOL
    # every window had a graph but the reversed stream's final one (only the first stream's final length was
    # captured): it ran eagerly
    ctx = hift.decode_left_context()
    finals = [_final_window(ctx, calls) for _, calls in streams]
    assert voc.eager_batches == int(finals[0] != finals[1])
    assert voc.replays >= len(streams[0][1])


@pytest.mark.gpu
def test_cosyvoice3_graph_stage_on_gpu_matches_eager(hift, case):
    cuda = CausalHiFTGenerator(hift.cfg, hift.noise)
    cuda.load_state_dict(hift.state_dict())
    cuda = cuda.cuda().eval()
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # fp32 parity means fp32
    try:
        streams = _two_streams(case)
        ref = _run_stage(CausalEagerVocoder(cuda), streams, "cuda")
        voc = _graph_stage(cuda, streams)
        got = _run_stage(voc, streams, "cuda")
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    assert voc.replays > 0
    for g, r in zip(got, ref):
        assert g.shape == r.shape and _err(g, r) <= TOL
    calls = case["stream"]
    upstream = torch.cat([c["emitted"] for c in calls[:-1]] + [case["wav"][:, calls[-1]["speech_offset"]:]], dim=1)
    # GPU kernels (cuDNN convolutions, cuFFT) vs upstream's CPU run: fp32 rounding amplified by the magnitude exp;
    # measured 3.4e-3 on an H100 (the CPU path is within 1e-4 of upstream: tests/test_parity_cosyvoice3_hift.py)
    assert _err(ref[0], upstream) <= 5e-3
