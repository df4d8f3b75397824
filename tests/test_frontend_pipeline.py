"""The frontend per mode on a synthetic model directory (byte-level BPE, tiny ONNX models): layouts, caches,
errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

sf = pytest.importorskip("soundfile", reason="soundfile is not installed here (pip install -r requirements.txt)")

from cosyvoice_fast.config.yamlfile import ConfigError  # noqa: E402
from cosyvoice_fast.frontend.audio import PromptAudioError  # noqa: E402
from cosyvoice_fast.frontend.pipeline import Frontend, FrontendConfig  # noqa: E402
from cosyvoice_fast.frontend.speaker import SpeakerCacheError  # noqa: E402
from cosyvoice_fast.frontend.request import SynthesisRequest  # noqa: E402
from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir  # noqa: E402

PROMPT = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "zero_shot_prompt.wav"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return synthetic_model_dir("tiny")


@pytest.fixture()
def fe(model_dir: Path, tmp_path: Path) -> Frontend:
    return Frontend.from_model_dir(model_dir, speaker_cache_dir=tmp_path / "speakers")


@pytest.fixture(scope="module")
def prompt_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if PROMPT.is_file():
        return PROMPT
    t = np.arange(int(2.0 * 16000)) / 16000  # a voiced-looking tone with an envelope
    wav = 0.3 * np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    path = tmp_path_factory.mktemp("p") / "prompt.wav"
    sf.write(path, wav.astype(np.float32), 16000)
    return path


def ids(fe: Frontend, text: str) -> list[int]:
    return fe.tokenizer.encode(text)


def test_zero_shot_layout(fe: Frontend, prompt_wav: Path) -> None:
    req = SynthesisRequest(text="Hello world.", prompt_wav=prompt_wav, prompt_text="hi there")
    inp, hit = fe.prepare(req)
    assert hit is False
    assert inp.text_segments[0][0].tolist() == ids(fe, "Hello world.")
    assert inp.prompt_text[0].tolist() == ids(fe, "hi there")  # one piece: never split, no mark added
    n = inp.flow_prompt_speech_token.shape[1]
    assert n > 10
    assert torch.equal(inp.llm_prompt_speech_token, inp.flow_prompt_speech_token)
    assert inp.prompt_feat.shape == (1, 2 * n, 80)
    assert inp.embedding.shape == (1, 192)


def test_cross_lingual_and_instruct_hide_prompt_speech_from_the_lm(fe: Frontend, prompt_wav: Path) -> None:
    cl, _ = fe.prepare(SynthesisRequest(text="Bonjour.", mode="cross_lingual", prompt_wav=prompt_wav))
    assert cl.prompt_text.shape == (1, 0) and cl.llm_prompt_speech_token.shape == (1, 0)
    assert cl.flow_prompt_speech_token.shape[1] > 0
    ins, hit = fe.prepare(SynthesisRequest(text="Hello.", mode="instruct2", prompt_wav=prompt_wav,
                                           instruct_text="Speak slowly"))
    assert hit is True  # same audio as the request before: features from the LRU
    eop = fe.tokenizer.token_to_id("<|endofprompt|>")
    assert ins.prompt_text[0].tolist() == ids(fe, "Speak slowly") + [eop]
    assert ins.llm_prompt_speech_token.shape == (1, 0)
    assert torch.equal(ins.flow_prompt_speech_token, cl.flow_prompt_speech_token)


def test_long_text_is_split_into_segments(fe: Frontend, prompt_wav: Path) -> None:
    text = " ".join(f"This is sentence number {w}." for w in ("one", "two", "three", "four", "five", "six",
                                                               "seven", "eight", "nine", "ten", "eleven"))
    inp, _ = fe.prepare(SynthesisRequest(text=text, mode="cross_lingual", prompt_wav=prompt_wav))
    lens = [t.shape[1] for t in inp.text_segments]
    assert len(lens) >= 3 and max(lens) <= 80 + 20
    assert sum(lens) >= len(ids(fe, text)) - len(lens)  # nothing dropped (pieces may tokenise at joins)


def test_saved_speaker_round_trip_skips_the_onnx_models(fe: Frontend, prompt_wav: Path, model_dir: Path,
                                                        tmp_path: Path) -> None:
    saved = fe.add_speaker("alice", prompt_wav, None, "hi there")
    assert fe.list_speakers() == ["alice"]
    fresh = Frontend.from_model_dir(model_dir, speaker_cache_dir=tmp_path / "speakers")
    inp, hit = fresh.prepare(SynthesisRequest(text="Hello.", mode="speaker", speaker="alice"))
    assert hit is True and inp.speaker == "alice"
    assert fresh.speech_tokenizer._session is None and fresh.embedder._session is None
    assert torch.equal(inp.llm_prompt_speech_token, saved.speech_token)
    assert inp.prompt_text[0].tolist() == ids(fe, "hi there")
    fe.add_speaker("bob", prompt_wav)  # no transcript: cross-lingual layout
    inp, _ = fresh.prepare(SynthesisRequest(text="Hello.", mode="speaker", speaker="bob"))
    assert inp.prompt_text.shape == (1, 0) and inp.llm_prompt_speech_token.shape == (1, 0)
    fe.delete_speaker("bob")
    with pytest.raises(SpeakerCacheError, match="no saved speaker named 'bob'"):
        fresh.prepare(SynthesisRequest(text="Hello.", mode="speaker", speaker="bob"))


def test_bad_inputs_have_clear_messages(fe: Frontend, prompt_wav: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the prompt's transcript"):
        fe.prepare(SynthesisRequest(text="Hello.", prompt_wav=prompt_wav))
    with pytest.raises(ValueError, match="needs an instruction"):
        fe.prepare(SynthesisRequest(text="Hello.", mode="instruct2", prompt_wav=prompt_wav))
    with pytest.raises(PromptAudioError, match="needs a prompt voice"):
        fe.prepare(SynthesisRequest(text="Hello.", mode="cross_lingual"))
    fake = tmp_path / "notes.wav"
    fake.write_text("definitely not audio")
    with pytest.raises(PromptAudioError, match="could not decode 'notes.wav' as audio"):
        fe.prepare(SynthesisRequest(text="Hello.", mode="cross_lingual", prompt_wav=fake))
    with pytest.raises(SpeakerCacheError):
        fe.add_speaker("../etc/passwd", prompt_wav)
    with pytest.raises(ConfigError, match="Text is empty"):
        SynthesisRequest(text="   ", mode="cross_lingual", prompt_wav=prompt_wav)
    with pytest.raises(ValueError, match="nothing to speak"):
        fe.prepare(SynthesisRequest(text="!!! ???", mode="cross_lingual", prompt_wav=prompt_wav))


def test_lru_is_bounded_and_keyed_by_content(model_dir: Path, tmp_path: Path, prompt_wav: Path) -> None:
    fe = Frontend.from_model_dir(model_dir, speaker_cache_dir=None, config=FrontendConfig(prompt_lru_size=1))
    wav, sr = sf.read(prompt_wav, dtype="float32")
    copy = tmp_path / "copy.wav"
    sf.write(copy, wav, sr)
    a, hit_a = fe.prompt_features(wav, sr)
    b, hit_b = fe.prompt_features(wav.copy(), sr)  # same samples, another array: a hit
    assert (hit_a, hit_b) == (False, True) and b is a
    _, hit_c = fe.prompt_features(copy)  # a different key evicts the only slot
    _, hit_d = fe.prompt_features(wav, sr)
    assert (hit_c, hit_d) == (False, False)
    with pytest.raises(SpeakerCacheError, match="without a speaker cache"):
        fe.add_speaker("x", wav, sr)


def test_wrong_sample_rate_model_is_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="24 kHz prompt mel"):
        Frontend.from_model_dir(model_dir, sample_rate=22050)
