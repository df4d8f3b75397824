"""Prompt audio decoding/validation, the ONNX wrappers (on tiny exported graphs), and the speaker cache."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

sf = pytest.importorskip("soundfile", reason="soundfile is not installed here (pip install -r requirements.txt)")

from cosyvoice_fast.frontend.audio import (
    PromptAudioError, load_audio, load_prompt, prepare_prompt, resample, speech_bounds, trim_silence,
)
from cosyvoice_fast.frontend.features import whisper_log_mel  # noqa: E402
from cosyvoice_fast.frontend.speaker import (
    OnnxSpeakerEmbedder, OnnxSpeechTokenizer, PromptFeatures, SpeakerCache, SpeakerCacheError, align_prompt,
    extract_prompt, validate_speaker_name,
)

# audioread (the decoder fallback) imports stdlib modules that Python 3.11 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:'(aifc|audioop|sunau)' is deprecated:DeprecationWarning")


def tone(seconds: float, sr: int, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(round(seconds * sr))) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def peak_hz(wav: np.ndarray, sr: int) -> float:
    spec = np.abs(np.fft.rfft(wav * np.hanning(len(wav))))
    return float(np.argmax(spec) * sr / len(wav))


# ----------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("fmt,subtype,tol", [("WAV", "PCM_16", 1 / 32768), ("FLAC", "PCM_16", 1 / 32768),
                                             ("WAV", "FLOAT", 0.0), ("OGG", "VORBIS", None)])
def test_decode_formats(tmp_path, fmt, subtype, tol):
    wav = tone(1.0, 24000)
    path = tmp_path / f"p.{fmt.lower()}"
    sf.write(path, wav, 24000, format=fmt, subtype=subtype)
    got, sr = load_audio(path)
    assert sr == 24000 and got.dtype == np.float32 and got.ndim == 1
    if tol is None:  # lossy: same length and pitch, high correlation
        assert abs(len(got) - len(wav)) <= 2048
        n = min(len(got), len(wav))
        assert np.corrcoef(got[:n], wav[:n])[0, 1] > 0.99
    else:
        assert len(got) == len(wav) and float(np.abs(got - wav).max()) <= tol
    from_bytes, sr2 = load_audio(path.read_bytes())
    assert sr2 == sr and np.array_equal(from_bytes, got)
    with open(path, "rb") as f:
        assert np.array_equal(load_audio(f)[0], got)


@pytest.mark.skipif("MP3" not in sf.available_formats(), reason="libsndfile without MP3")
def test_decode_mp3(tmp_path):
    path = tmp_path / "p.mp3"
    sf.write(path, tone(1.0, 24000), 24000, format="MP3")
    got, sr = load_audio(path)
    assert sr == 24000 and abs(peak_hz(got, sr) - 440) < 5


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="no ffmpeg for the audioread fallback")
def test_decode_m4a_through_audioread(tmp_path):
    src, dst = tmp_path / "p.wav", tmp_path / "p.m4a"
    sf.write(src, tone(1.0, 24000), 24000)
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(src), "-c:a", "aac", str(dst)], check=True)
    for source in (dst, dst.read_bytes()):  # soundfile cannot read AAC: this exercises the fallback
        got, sr = load_audio(source)
        assert sr == 24000 and 0.95 < len(got) / sr < 1.1 and abs(peak_hz(got, sr) - 440) < 5


def test_stereo_is_averaged(tmp_path):
    left = tone(1.0, 16000)
    path = tmp_path / "st.wav"
    sf.write(path, np.stack([left, 0.5 * left], axis=1), 16000, subtype="FLOAT")
    got, _ = load_audio(path)
    np.testing.assert_allclose(got, 0.75 * left, atol=1e-7)
    # arrays: (samples, channels), (channels, samples) and integer PCM
    np.testing.assert_allclose(load_audio(np.stack([left, 0.5 * left], 1), 16000)[0], 0.75 * left, atol=1e-7)
    np.testing.assert_allclose(load_audio(np.stack([left, 0.5 * left], 0), 16000)[0], 0.75 * left, atol=1e-7)
    pcm = (left * 32767).astype(np.int16)
    np.testing.assert_allclose(load_audio(pcm, 16000)[0], left, atol=1e-4)
    np.testing.assert_allclose(load_audio(np.stack([pcm, pcm]), 16000)[0], left, atol=1e-4)
    np.testing.assert_allclose(load_audio(torch.from_numpy(left)[None], 16000)[0], left)
    u8 = np.round(left * 127 + 128).astype(np.uint8)
    np.testing.assert_allclose(load_audio(u8, 16000)[0], left, atol=1e-2)


@pytest.mark.parametrize("sr", [8000, 22050, 96000])
def test_resampled_to_16k_and_24k(sr):
    w16, w24 = prepare_prompt(tone(2.0, sr, freq=1000.0), sr)
    assert w16.dtype == w24.dtype == np.float32
    assert abs(len(w16) - 32000) <= 1 and abs(len(w24) - 48000) <= 1
    assert abs(peak_hz(w16, 16000) - 1000) < 2 and abs(peak_hz(w24, 24000) - 1000) < 2
    assert 0.45 < float(np.abs(w24).max()) < 0.55


def test_resample_identity_and_length():
    x = tone(0.5, 24000)
    assert np.array_equal(resample(x, 24000, 24000), x)
    assert len(resample(x, 24000, 16000)) == 8000


def test_trim_silence_keeps_speech_and_margin():
    sr = 16000
    wav = np.concatenate([np.zeros(sr), tone(1.0, sr), np.zeros(2 * sr)]).astype(np.float32)
    wav += 1e-6 * np.random.default_rng(0).standard_normal(len(wav)).astype(np.float32)  # -120 dB noise floor
    start, end = speech_bounds(wav, sr, top_db=60.0, margin_s=0.1)
    assert abs(start - int(0.9 * sr)) <= 0.02 * sr and abs(end - int(2.1 * sr)) <= 0.03 * sr
    trimmed = trim_silence(wav, sr)
    assert np.array_equal(trimmed, wav[start:end])
    # inner pauses are kept
    two = np.concatenate([tone(0.5, sr), np.zeros(sr), tone(0.5, sr)]).astype(np.float32)
    assert len(trim_silence(two, sr)) == len(two)
    w16, _ = prepare_prompt(wav, sr)
    assert abs(len(w16) - 1.2 * sr) <= 0.05 * sr


# ----------------------------------------------------------------------------------------------- rejections


def _raises(msg: str):
    return pytest.raises(PromptAudioError, match="^" + re.escape(msg) + "$")


def test_rejects_empty_and_silent(tmp_path):
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, np.float32), 16000)
    with _raises("the prompt audio contains no samples: record or upload it again"):
        load_prompt(empty)
    zero_bytes = tmp_path / "zero.wav"
    zero_bytes.write_bytes(b"")
    with _raises("prompt audio file 'zero.wav' is empty (0 bytes): record or upload it again"):
        load_prompt(zero_bytes)
    with _raises("the uploaded prompt audio is empty (0 bytes): record or upload it again"):
        load_prompt(b"")
    with _raises("the prompt audio is silent: check the microphone or pick a recording in which the speaker can be "
                 "heard"):
        load_prompt(np.zeros(32000, np.float32), 16000)


def test_rejects_too_short_and_too_long():
    with _raises("the prompt audio is too short: 0.30 s long after trimming silence, at least 0.5 s is needed "
                 "(3 to 10 s of clear speech works best)"):
        prepare_prompt(tone(0.3, 16000), 16000)
    # silence around a short blip does not count (0.2 s + 2 x 0.1 s margin + one 25 ms analysis frame)
    padded = np.concatenate([np.zeros(32000), tone(0.2, 16000), np.zeros(32000)]).astype(np.float32)
    with pytest.raises(PromptAudioError, match="too short: 0.43 s"):
        prepare_prompt(padded, 16000)
    noise = (0.1 * np.random.default_rng(0).standard_normal(31 * 16000)).astype(np.float32)
    with _raises("the prompt audio is too long: 31.0 s after trimming silence, at most 30 s is supported: cut it to "
                 "3 to 10 s of clear speech"):
        prepare_prompt(noise, 16000)


def test_rejects_non_audio(tmp_path):
    fake = tmp_path / "notes.wav"
    fake.write_bytes(b"this is a text file, not audio\n" * 200)
    with _raises("could not decode 'notes.wav' as audio: use a WAV, FLAC, MP3 or OGG file (M4A and other formats "
                 "need ffmpeg installed)"):
        load_audio(fake)
    with _raises("could not decode the uploaded audio as audio: use a WAV, FLAC, MP3 or OGG file (M4A and other "
                 "formats need ffmpeg installed)"):
        load_audio(fake.read_bytes())
    with _raises("prompt audio file 'missing.wav' does not exist: check the path"):
        load_audio(tmp_path / "missing.wav")


def test_rejects_bad_arrays():
    with _raises("a waveform array needs its sample rate: pass sr="):
        load_audio(np.zeros(10, np.float32))
    with _raises("the prompt audio's sample rate is 4000 Hz, below the minimum of 8000 Hz: record or export it at "
                 "16 kHz or more"):
        prepare_prompt(tone(1.0, 4000), 4000)
    bad = tone(1.0, 16000)
    bad[5] = np.nan
    with _raises("the prompt audio contains invalid samples (NaN or infinity): export it again as 16-bit WAV"):
        prepare_prompt(bad, 16000)
    assert issubclass(PromptAudioError, ValueError)


def test_over_full_scale_is_normalised():
    w16, w24 = prepare_prompt(tone(1.0, 24000, amp=3.0), 24000)
    assert abs(float(np.abs(w24).max()) - 1.0) < 1e-3


# ----------------------------------------------------------------------------------------------- tiny ONNX models


def _save_onnx(nodes, inputs, outputs, inits, path: Path) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(helper.make_graph(nodes, path.stem, inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    """speech_tokenizer: tokens = argmax over mel bins of every 4th frame; campplus: time mean @ W (80 x 192)."""
    from onnx import TensorProto, helper, numpy_helper

    d = tmp_path_factory.mktemp("onnx")
    i64 = lambda *v: numpy_helper.from_array(np.array(v, np.int64))  # noqa: E731
    inits = [i64(0), i64(2**62), i64(1), i64(4)]
    for t, name in zip(inits, ("starts", "ends", "axes", "steps")):
        t.name = name
    for length_type, fname in ((TensorProto.INT32, "tok32.onnx"), (TensorProto.INT64, "tok64.onnx")):
        _save_onnx([helper.make_node("ArgMax", ["feats"], ["ids"], axis=1, keepdims=0),
                    helper.make_node("Slice", ["ids", "starts", "ends", "axes", "steps"], ["indices"])],
                   [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
                    helper.make_tensor_value_info("feats_length", length_type, [1])],
                   [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "N"])], inits, d / fname)
    w = np.random.default_rng(0).standard_normal((80, 192)).astype(np.float32)
    _save_onnx([helper.make_node("ReduceMean", ["input"], ["m"], axes=[1], keepdims=0),
                helper.make_node("MatMul", ["m", "w"], ["output"])],
               [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
               [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
               [numpy_helper.from_array(w, "w")], d / "campplus.onnx")
    np.save(d / "w.npy", w)
    return d


@pytest.mark.parametrize("fname", ["tok32.onnx", "tok64.onnx"])
def test_onnx_speech_tokenizer(onnx_dir, fname):
    tok = OnnxSpeechTokenizer(onnx_dir / fname, device="cpu")
    assert tok._session is None  # lazy
    feats = torch.randn(1, 128, 37, generator=torch.Generator().manual_seed(0))
    ids = tok(feats)
    assert ids.dtype == torch.int32 and ids.shape == (1, 10)
    assert torch.equal(ids, feats.argmax(1)[:, ::4].to(torch.int32))
    wav = tone(2.0, 16000)
    assert torch.equal(tok.tokenize(wav), tok(whisper_log_mel(wav)))
    with pytest.raises(PromptAudioError, match="at most 30 s"):
        tok.tokenize(np.zeros(31 * 16000, np.float32))


def test_onnx_speaker_embedder(onnx_dir):
    emb = OnnxSpeakerEmbedder(onnx_dir / "campplus.onnx", device="cpu")
    fb = torch.randn(50, 80, generator=torch.Generator().manual_seed(1))
    out = emb(fb)
    assert out.shape == (1, 192) and out.dtype == torch.float32
    np.testing.assert_allclose(out[0].numpy(), fb.numpy().mean(0) @ np.load(onnx_dir / "w.npy"), atol=1e-5)


def test_onnx_lazy_session_is_created_once_across_threads(onnx_dir):
    emb = OnnxSpeakerEmbedder(onnx_dir / "campplus.onnx", device="cpu")
    fb = torch.randn(1, 30, 80, generator=torch.Generator().manual_seed(2))
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: (emb(fb), id(emb.session())), range(8)))
    assert len({sid for _, sid in outs}) == 1
    assert all(torch.equal(o, outs[0][0]) for o, _ in outs)


def test_onnx_provider_choice_and_errors(onnx_dir, tmp_path):
    import onnxruntime as ort

    auto = OnnxSpeakerEmbedder(onnx_dir / "campplus.onnx")
    has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    assert auto.providers()[0] == ("CUDAExecutionProvider" if has_cuda else "CPUExecutionProvider")
    assert OnnxSpeakerEmbedder(onnx_dir / "campplus.onnx", device="cpu").providers() == ["CPUExecutionProvider"]
    with pytest.raises(FileNotFoundError, match="model directory is incomplete"):
        OnnxSpeakerEmbedder(tmp_path / "none.onnx").session()
    with pytest.raises(ValueError, match="device="):
        OnnxSpeakerEmbedder(onnx_dir / "campplus.onnx", device="tpu")


def test_synthetic_model_files_work(tmp_path):
    """The tiny graphs the synthetic model directories ship have the same interface."""
    from cosyvoice_fast.modeldir.synthetic_frontend import write_speaker_model, write_speech_tokenizer

    write_speech_tokenizer(tmp_path / "speech_tokenizer_v2.onnx", 1000)
    write_speaker_model(tmp_path / "campplus.onnx")
    p = extract_prompt(tone(2.0, 24000), 24000, OnnxSpeechTokenizer(tmp_path / "speech_tokenizer_v2.onnx"),
                       OnnxSpeakerEmbedder(tmp_path / "campplus.onnx"))
    assert p.speech_token.shape == (1, 50) and int(p.speech_token.max()) < 1000
    assert p.speech_feat.shape == (1, 100, 80) and p.embedding.shape == (1, 192)


# ----------------------------------------------------------------------------------------------- alignment


@pytest.mark.parametrize("n_tok,n_frames,expect", [(50, 100, 50), (51, 100, 50), (50, 103, 50), (48, 100, 48),
                                                   (10, 5, 2)])
def test_align_prompt(n_tok, n_frames, expect):
    t, f = align_prompt(torch.arange(n_tok)[None], torch.randn(1, n_frames, 80))
    assert t.shape == (1, expect) and f.shape == (1, 2 * expect, 80)
    assert torch.equal(t[0], torch.arange(expect))


def test_extract_prompt_aligns_tokens_and_mel(onnx_dir):
    tok, emb = OnnxSpeechTokenizer(onnx_dir / "tok32.onnx"), OnnxSpeakerEmbedder(onnx_dir / "campplus.onnx")
    # 2.03 s: 25 Hz tokenizer gives ceil(203/4) = 51 tokens, the mel 101 frames -> both cut to 50 / 100
    wav = tone(2.03, 16000, freq=300.0)
    p = extract_prompt(wav, 16000, tok, emb, prompt_text="你好", prompt_text_tokens=[5, 6, 7])
    assert p.speech_token.shape == (1, 50) and p.speech_token.dtype == torch.int32
    assert p.speech_feat.shape == (1, 100, 80) and p.embedding.shape == (1, 192)
    assert p.prompt_text == "你好" and p.prompt_text_tokens.tolist() == [[5, 6, 7]]
    assert p.meta == {"seconds": 2.03, "source_sample_rate": 16000}
    with pytest.raises(ValueError, match="expected 98"):
        PromptFeatures(p.speech_token[:, :49], p.speech_feat, p.embedding)


# ----------------------------------------------------------------------------------------------- speaker cache


def _prompt(seed: int = 0, n: int = 12) -> PromptFeatures:
    g = torch.Generator().manual_seed(seed)
    return PromptFeatures(speech_token=torch.randint(0, 6561, (1, n), generator=g, dtype=torch.int32),
                          speech_feat=torch.randn(1, 2 * n, 80, generator=g), embedding=torch.randn(1, 192, generator=g),
                          prompt_text="希望你以后能够做的比我还好呦。", prompt_text_tokens=torch.tensor([[1, 2, 3]]),
                          extra={"flow_cache": torch.randn(2, 3, generator=g)}, meta={"seconds": 3.1, "note": "é"})


def _same(a: PromptFeatures, b: PromptFeatures) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return (ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) and ta[k].dtype == tb[k].dtype for k in ta)
            and a.metadata() == b.metadata())


def test_speaker_cache_round_trip(tmp_path):
    cache = SpeakerCache(tmp_path / "speakers")
    assert cache.list() == [] and "alice" not in cache
    p = _prompt()
    cache.add("alice", p)
    cache.add("张三_2", _prompt(1, 7))
    assert cache.list() == ["alice", "张三_2"] and "alice" in cache and len(cache) == 2
    got = cache.get("alice")
    assert _same(got, p) and got.extra["flow_cache"].shape == (2, 3)
    assert _same(SpeakerCache(tmp_path / "speakers").get("张三_2"), _prompt(1, 7))  # a fresh instance reads disk
    cache.add("alice", _prompt(2))  # overwrite
    assert _same(cache.get("alice"), _prompt(2))
    with pytest.raises(SpeakerCacheError, match="already exists"):
        cache.add("alice", p, overwrite=False)
    with pytest.raises(SpeakerCacheError, match="differing only in case"):
        cache.add("Alice", p)
    cache.delete("alice")
    assert cache.list() == ["张三_2"]
    with pytest.raises(SpeakerCacheError, match=re.escape("no saved speaker named 'alice' (saved: 张三_2): save the "
                                                          "voice first")):
        cache.get("alice")
    with pytest.raises(SpeakerCacheError, match="no saved speaker named 'alice' to delete"):
        cache.delete("alice")
    assert sorted(p.name for p in (tmp_path / "speakers").iterdir()) == ["张三_2.safetensors"]  # no temp files


@pytest.mark.parametrize("name", ["../x", "a/b", "", "x" * 200, "..", "a b", "a.b", "x\n", "CON", None, "a\\b"])
def test_speaker_cache_refuses_unsafe_names(tmp_path, name):
    cache = SpeakerCache(tmp_path)
    with pytest.raises(SpeakerCacheError, match="invalid speaker name .*: use 1 to 64 letters, digits"):
        cache.add(name, _prompt())
    for op in (cache.get, cache.delete):
        with pytest.raises(SpeakerCacheError, match="invalid speaker name"):
            op(name)
    assert list(tmp_path.iterdir()) == [] and name not in cache
    assert validate_speaker_name("x" * 64) == "x" * 64


def test_speaker_files_are_safetensors_not_pickle(tmp_path):
    cache = SpeakerCache(tmp_path)
    path = cache.add("bob", _prompt())
    blob = path.read_bytes()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_len])  # safetensors: u64 length + JSON header + raw tensor bytes
    meta = json.loads(header["__metadata__"]["cosyvoice_fast"])
    assert meta["prompt_text"] == "希望你以后能够做的比我还好呦。" and meta["format"] == 1
    assert set(header) - {"__metadata__"} == {"speech_token", "speech_feat", "embedding", "prompt_text_tokens",
                                              "extra.flow_cache"}
    assert header["speech_token"]["dtype"] == "I32"
    assert not blob.startswith((b"\x80", b"PK"))  # neither a pickle stream nor a torch.save zip
    with pytest.raises(Exception):
        pickle.loads(blob)


def test_damaged_speaker_file(tmp_path):
    cache = SpeakerCache(tmp_path)
    (tmp_path / "eve.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpeakerCacheError, match="saved speaker 'eve' is damaged .*: delete it and save the voice"):
        cache.get("eve")
