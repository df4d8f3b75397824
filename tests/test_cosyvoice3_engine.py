"""CosyVoice3 through the one engine, scheduler and request object: the fixture's model directory loaded by the
user's loader, a streamed request whose chunks follow the schedule to the sample, deterministic audio, and the
app serving ``/v1/audio/speech`` on it over HTTP.

Sizes, ids and the vocoder's held-back frames are read from the fixture (a hold-out set may be swapped in); the
speech tokens a request generates are replayed on the LM stage alone with the request's seed, then passed through
the family's token filter, so the expected chunk lengths come from the schedule, not from the engine's output."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.schedule import plan
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.engine.engine import Engine
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.llm.token_filter import TokenFilter
from cosyvoice_fast.modeldir.files import load_models

REPO = Path(__file__).resolve().parents[1]
PARAMS = StreamParams(token_hop_len_first=10, token_hop_len=10)
MAX_TOKENS = 60
SEED = 3


@pytest.fixture(scope="module")
def models3(fixture3_dir):
    return load_models(fixture3_dir, progress=False)


@pytest.fixture(scope="module")
def engine3(models3):
    eng = Engine(models3, backend=BackendConfig())
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def inputs3(load_case3) -> ModelInputs:
    """The recorded LM prompt (system part, <|endofprompt|>, transcript) and text, and the recorded flow prompt."""
    llm, flow = load_case3("case_llm"), load_case3("case_flow_stream")
    return ModelInputs(text_segments=[llm["text"]], prompt_text=llm["prompt_text"],
                       llm_prompt_speech_token=flow["prompt_token"], flow_prompt_speech_token=flow["prompt_token"],
                       prompt_feat=flow["prompt_feat"], embedding=flow["embedding"])


def held_back_frames(load_case3) -> int:
    """Mel frames a non-final vocoder call holds back (upstream's causal HiFT: its look-aheads), from case_hift."""
    call = next(c for c in load_case3("case_hift")["stream"] if not c["finalize"])
    return int(call["n_mel"]) - int(call["n_out"]) // 480


def tokens_reaching_the_flow(engine: Engine, inputs: ModelInputs, seed: int, max_tokens: int) -> list[int]:
    """The request's speech tokens, drawn again by its LM stage alone with the engine's generator rule, filtered."""
    llm = engine.stages(BackendConfig()).llm
    state = llm.new_state(inputs, inputs.text_segments[0], torch.Generator().manual_seed(seed), max_tokens, True)
    llm.prefill([state])
    while not state.done:
        llm.decode([state])
    llm.release(state)
    return TokenFilter.for_config(engine.models.config.llm).apply(state.history)


def expected_chunk_samples(prompt: int, n: int, cfg, held: int) -> list[int]:
    """Samples of every streamed chunk: the flow's new frames per call (the schedule), less the vocoder's held-back
    frames until the final call, which emits the rest."""
    out, frames, emitted = [], 0, 0
    for call in plan(prompt, n, PARAMS, cfg.chunk_size):
        frames += cfg.token_mel_ratio * call.hop
        end = frames if call.finalize else max(emitted, frames - held)
        out.append((end - emitted) * cfg.sample_rate // 50)  # 480 samples per 50 Hz mel frame at 24 kHz
        emitted = end
    return out


def _request(inputs: ModelInputs, **kw) -> SynthesisRequest:
    args = dict(inputs=inputs, seed=SEED, stream=True, stream_params=PARAMS, max_tokens=MAX_TOKENS,
                ignore_eos=True)
    return SynthesisRequest(**{**args, **kw})


def test_cosyvoice3_stream_follows_the_schedule_and_repeats_exactly(engine3, inputs3, load_case3):
    cfg = engine3.models.config
    assert engine3.models.family == "cosyvoice3"
    kept = tokens_reaching_the_flow(engine3, inputs3, SEED, MAX_TOKENS)
    want = expected_chunk_samples(inputs3.flow_prompt_speech_token.shape[1], len(kept), cfg,
                                  held_back_frames(load_case3))
    runs = []
    for _ in range(2):
        chunks = list(engine3.stream(_request(inputs3)))
        assert [len(c.samples) for c in chunks] == want
        assert [c.is_last for c in chunks] == [False] * (len(want) - 1) + [True]
        assert all(c.sample_rate == cfg.sample_rate for c in chunks)
        wav = np.concatenate([c.samples for c in chunks])
        assert np.isfinite(wav).all() and 0 < np.abs(wav).max() <= 0.99 + 1e-6
        runs.append(wav)
    assert len(want) >= 3  # a first chunk, a later one and the final one
    assert sum(want) == len(kept) * cfg.token_mel_ratio * 480
    np.testing.assert_array_equal(runs[0], runs[1])  # CosyVoice3's noise is a fixed table: same seed, same audio


def test_cosyvoice3_recompute_flow_matches_the_incremental_one(engine3, inputs3, monkeypatch):
    """The flow's incremental runner (the default) and upstream's recompute, each picked through the family's
    runner table by the same engine, give every chunk the same mel (fixture tolerance 1e-4) and the same length.
    (The audio is compared through its mels: the fixture's f0 head sits on the voicing threshold on purpose, so
    1e-6 of mel rounding may flip a frame's voicing.)"""
    mels: dict[bool, list[torch.Tensor]] = {}
    lengths = {}
    for inc in (True, False):
        backend = BackendConfig(incremental=inc)
        flow = engine3.stages(backend).flow
        mels[inc] = []

        def chunk(seg, inputs, tokens, call, orig=flow.chunk, out=mels[inc]):  # noqa: ANN001 - the stage's own
            mel = orig(seg, inputs, tokens, call)
            out.append(mel.detach().clone())
            return mel

        monkeypatch.setattr(flow, "chunk", chunk)
        lengths[inc] = [len(c.samples) for c in engine3.stream(_request(inputs3, backend=backend))]
    assert type(engine3.stages(BackendConfig()).flow).__name__ == "DiTIncrementalFlow"
    assert type(engine3.stages(BackendConfig(incremental=False)).flow).__name__ == "DiTEagerFlow"
    assert lengths[True] == lengths[False] and len(mels[True]) == len(mels[False]) == len(lengths[True])
    for a, b in zip(mels[True], mels[False]):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-4


def test_cosyvoice3_whole_utterance_has_every_frame(engine3, inputs3):
    kept = tokens_reaching_the_flow(engine3, inputs3, SEED, 30)
    wav, tele = engine3.synthesize(_request(inputs3, stream=False, max_tokens=30))
    assert len(wav) == len(kept) * engine3.models.config.token_mel_ratio * 480 and np.isfinite(wav).all()
    assert len(tele.chunks) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server3(fixture3_dir, tmp_path_factory):
    """The app on the CosyVoice3 fixture's weights (a copy, with a synthetic frontend beside them: the fixture has
    no tokenizer or ONNX files), serving /v1 beside the page."""
    from cosyvoice_fast.app.page import build_demo, serve
    from cosyvoice_fast.modeldir.files import read_config, validate_model_dir
    from cosyvoice_fast.modeldir.synthetic_frontend import write_frontend_files
    from cosyvoice_fast.serving.service import load_service

    d = tmp_path_factory.mktemp("cv3") / "Fun-CosyVoice3-tiny"
    shutil.copytree(fixture3_dir, d, ignore=shutil.ignore_patterns("case_*.pt", "README.md"))
    d.chmod(0o755)
    (d / "CosyVoice-BlankEN").chmod(0o755)
    write_frontend_files(d, read_config(validate_model_dir(d)))
    svc = load_service(d, device="cpu", dtype="fp32", speaker_cache_dir=tmp_path_factory.mktemp("speakers"),
                       progress=False)
    demo = build_demo(svc)
    port = _free_port()
    serve(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}", svc
    finally:
        demo.close()
        svc.close()


def test_cosyvoice3_app_serves_speech_over_http(server3):
    import httpx

    url, svc = server3
    assert svc.models.family == "cosyvoice3" and svc.frontend is not None
    body = {"model": "cosyvoice3", "voice": "cross_lingual_prompt", "input": "Hello from CosyVoice3.",
            "response_format": "pcm", "max_tokens": 40, "token_hop_len_first": 10, "token_hop_len": 10, "seed": 11}
    with httpx.Client(base_url=url, timeout=120) as h:
        r = h.post("/v1/audio/speech", json=body)
        health = h.get("/health").json()
    assert r.status_code == 200, r.text
    pcm = np.frombuffer(r.content, dtype="<i2")
    ref, _ = svc.engine.synthesize(SynthesisRequest(
        text=body["input"], mode="cross_lingual", prompt_wav=str(REPO / "assets" / "cross_lingual_prompt.wav"),
        seed=11, stream_params=PARAMS, max_tokens=40))
    assert len(pcm) == len(ref) > 0
    assert np.abs(pcm.astype(np.int32) - np.round(np.clip(ref, -1, 1) * 32767).astype(np.int32)).max() <= 1
    assert health["family"] == "cosyvoice3"


def test_cosyvoice3_frontend_and_page_say_the_family(server3):
    from cosyvoice_fast.app.handlers import Handlers

    svc = server3[1]
    eop = svc.frontend.tokenizer.encode("<|endofprompt|>")
    assert len(eop) == 1  # one special token
    inputs, _ = svc.frontend.prepare(SynthesisRequest(
        text="Hello.", mode="cross_lingual", prompt_wav=str(REPO / "assets" / "cross_lingual_prompt.wav")))
    seg = inputs.text_segments[0][0].tolist()
    assert seg[:len(svc.frontend.tokenizer.encode("You are a helpful assistant."))] == \
        svc.frontend.tokenizer.encode("You are a helpful assistant.") and eop[0] in seg  # CosyVoice3's system prompt
    header = Handlers(svc, stream_audio=False).header_markdown()
    assert "streaming CosyVoice3" in header and "**family** `cosyvoice3`" in header


@pytest.mark.gpu
def test_cosyvoice3_cudagraph_stages_match_eager_on_the_gpu(fixture3_dir, inputs3, no_tf32, monkeypatch):
    """The family table's GPU runners serve a streamed request in fp32: the cudagraph flow gives every chunk's mel
    within 1e-4 of eager; CosyVoice3's fused flow and fused vocoder are its cudagraph runners, one object each."""
    from cosyvoice_fast.engine.stages import available_backends

    models = load_models(fixture3_dir, device="cuda", progress=False)
    ok = {(b.stage, b.name) for b in available_backends("cuda", family="cosyvoice3") if b.available}
    voc = "cudagraph" if ("vocoder", "cudagraph") in ok else "eager"
    configs = {"eager": BackendConfig(incremental=False),  # the LM stays eager: the same tokens in every run
               "graph": BackendConfig(flow="cudagraph", vocoder=voc),
               "fused": BackendConfig(flow="fused", vocoder="fused" if voc != "eager" else "eager")}
    with Engine(models, backend=configs["eager"]) as eng:
        assert eng.stages(configs["fused"]).flow is eng.stages(configs["graph"]).flow
        assert type(eng.stages(configs["fused"]).flow).__name__ == "DiTGraphFlow"
        assert eng.stages(configs["fused"]).vocoder is eng.stages(configs["graph"]).vocoder
        mels, lengths = {}, {}
        for name, backend in configs.items():
            flow = eng.stages(backend).flow
            mels[name] = []

            def chunk(seg, inputs, tokens, call, orig=flow.chunk, out=mels[name]):  # noqa: ANN001
                mel = orig(seg, inputs, tokens, call)
                out.append(mel.detach().float().cpu())
                return mel

            monkeypatch.setattr(flow, "chunk", chunk)
            chunks = list(eng.stream(_request(inputs3, backend=backend)))
            lengths[name] = [len(c.samples) for c in chunks]
            assert np.isfinite(np.concatenate([c.samples for c in chunks])).all()
            monkeypatch.undo()
    assert lengths["graph"] == lengths["eager"] == lengths["fused"]
    assert len(mels["graph"]) == len(mels["fused"]) == len(mels["eager"])
    for a, b in zip(mels["graph"], mels["eager"]):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-4
    for a, b in zip(mels["fused"], mels["graph"]):
        assert torch.equal(a, b)  # the same runner, replayed again


def test_cosyvoice3_graph_vocoder_from_the_family_table_serves_the_default_schedule(
        models3, engine3, inputs3, fake_graphs, monkeypatch):
    """The vocoder table's captured runner (``fused`` = ``cudagraph`` for CosyVoice3), built with the start-up
    windows it derives from the default schedule, serves a streamed request through the engine with every decode
    window from a start-up graph (CPU: graphs replayed eagerly, only the device check bypassed) and the eager
    runner's chunks.  Its final windows are cut to this request's one (all 121 take minutes to "capture" on a CPU;
    the formula that yields them is the one checked here)."""
    from cosyvoice_fast.config import schedule
    from cosyvoice_fast.config.backends import runs_anywhere
    from cosyvoice_fast.config.engine import EngineConfig
    from cosyvoice_fast.vocoder import causal_graph, runners

    default, n_max = StreamParams(), 100
    kept = tokens_reaching_the_flow(engine3, inputs3, SEED, n_max)
    calls = plan(inputs3.flow_prompt_speech_token.shape[1], len(kept), default, models3.config.chunk_size)
    full = schedule.final_vocoder_frames

    def this_final(params, chunk_size, ratio, cache_frames):  # noqa: ANN001 - final_vocoder_frames' arguments
        assert cache_frames + ratio * calls[-1].hop in full(params, chunk_size, ratio, cache_frames=cache_frames)
        return (cache_frames + ratio * calls[-1].hop,)

    monkeypatch.setattr(schedule, "final_vocoder_frames", this_final)
    monkeypatch.setattr(causal_graph, "why_unavailable", lambda device: None)
    monkeypatch.setitem(runners.BACKENDS["cosyvoice3"], "fused", (runs_anywhere, runners.CV3_FUSED_NOTE))
    with Engine(models3, backend=BackendConfig(), config=EngineConfig(vocoder_rows=(1,))) as eng:
        voc = eng.stages(BackendConfig(vocoder="fused")).vocoder
        assert type(voc).__name__ == "CausalGraphVocoder" and voc.eager_batches == 0
        out = {name: list(eng.stream(_request(inputs3, stream_params=default, max_tokens=n_max,
                                              backend=BackendConfig(vocoder=name))))
               for name in ("eager", "fused")}
    assert [len(c.samples) for c in out["fused"]] == [len(c.samples) for c in out["eager"]]
    assert len(out["eager"]) == len(calls) >= 3
    assert voc.replays == len(calls) and voc.eager_batches == 0  # every window (final included) was captured
    a, b = (np.concatenate([c.samples for c in out[k]]) for k in ("eager", "fused"))
    assert np.abs(a - b).max() <= 1e-4
