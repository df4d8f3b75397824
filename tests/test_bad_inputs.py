"""The bad-input matrix: every way a user (or an operator) can hand the engine something wrong, each answered with
the exact user-facing message, or served when it should work.

Text, prompt audio, modes, backends, speakers and stream parameters go through the library on the tiny synthetic
model (with its synthetic frontend); the upload cases also go through the app's handlers, whose messages must not
leak server paths.  Broken model directories are built in ``tmp_path`` from the parity fixture (symlinks for
the files left intact).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

gr = pytest.importorskip("gradio", reason="gradio is not installed here (pip install -r requirements.txt)")
sf = pytest.importorskip("soundfile", reason="soundfile is not installed here (pip install -r requirements.txt)")

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.config.stream import StreamParams  # noqa: E402
from cosyvoice_fast.modeldir.files import ModelFileError, load_models, validate_model_dir  # noqa: E402
from cosyvoice_fast.frontend.request import SynthesisRequest  # noqa: E402

TINY = dict(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from cosyvoice_fast.serving.service import load_service

    s = load_service(None, synthetic="tiny", device="cpu", dtype="fp32",
                     speaker_cache_dir=tmp_path_factory.mktemp("speakers"), progress=False)
    yield s
    s.close()


def _tone(seconds: float, sr: int, channels: int = 1, amp: float = 0.3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    x = (amp * np.sin(2 * np.pi * 190 * t) * (1 + 0.3 * rng.standard_normal(t.size))).astype(np.float32)
    return np.stack([x, 0.5 * x], axis=1) if channels == 2 else x


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    """Prompt files, good and bad, by name."""
    d = tmp_path_factory.mktemp("prompts")
    out = {}

    def w(name: str, data: np.ndarray, sr: int, subtype: str | None = None) -> None:
        out[name] = d / f"{name}.wav"
        sf.write(out[name], data, sr, subtype=subtype)

    w("ok", _tone(1.5, 16000), 16000)
    w("8k", _tone(1.5, 8000), 8000)
    w("96k", _tone(1.5, 96000), 96000)
    w("stereo", _tone(1.5, 44100, channels=2), 44100)
    w("clipped", np.clip(_tone(1.5, 16000, amp=5.0), -1, 1), 16000)  # heavily clipped: still a voice
    w("silent", np.zeros(32000, np.float32), 16000)
    w("long", _tone(31, 16000), 16000)
    w("short", _tone(0.3, 16000), 16000)
    w("4k", _tone(1.5, 4000), 4000)
    w("nan", np.where(np.arange(24000) == 100, np.nan, _tone(1.5, 16000)).astype(np.float32), 16000, "FLOAT")
    (d / "notes.wav").write_text("these are meeting notes, not a recording\n")  # renamed text file
    out["not_audio"] = d / "notes.wav"
    (d / "empty.wav").write_bytes(b"")
    out["empty"] = d / "empty.wav"
    (d / "header_only.wav").write_bytes(open(out["ok"], "rb").read()[:44])  # a wav header and no samples
    out["header_only"] = d / "header_only.wav"
    return out


def synth(svc, **kw):
    kw = {"text": "hello world", "mode": "cross_lingual", **TINY, **kw}
    wav, tele = svc.engine.synthesize(SynthesisRequest(**kw))
    return wav, tele


# ------------------------------------------------------------------------------------------------ text

@pytest.mark.parametrize("text, message", [
    ("", "Text is empty: type something to synthesise."),
    ("   \n\t ", "Text is empty: type something to synthesise."),
    ("\x00\x07\u200b", "Text is empty: type something to synthesise."),  # control / format characters only
    ("😀👍🎉", "Text has nothing to speak: it holds only punctuation, symbols or emoji."),
    ("?!… —", "Text has nothing to speak"),
    ("a" * 20000, "Text is too long: 20000 characters, the limit is 5000. Split it into several shorter requests."),
], ids=["empty", "whitespace", "control-only", "emoji-only", "punctuation-only", "20000-chars"])
def test_bad_text_is_refused_with_a_message(svc, wavs, text, message):
    with pytest.raises(ValueError) as e:
        synth(svc, text=text, prompt_wav=wavs["ok"])
    assert message in str(e.value)
    assert svc.engine.active_requests() == 0


@pytest.mark.parametrize("text", [
    "Hello 😀 world 👍🏽!",                                  # emoji are dropped, the words are spoken
    "bell\x07 and\x00 null\u200b and\ttab",                 # control / zero-width characters are stripped
    "你好, world! Привет, мир. مرحبا 123 ½ ＡＢＣ",           # mixed scripts, digits, full-width letters
], ids=["emoji", "control", "mixed-scripts"])
def test_odd_but_valid_text_is_synthesised(svc, wavs, text):
    wav, tele = synth(svc, text=text, prompt_wav=wavs["ok"], max_tokens=4)
    assert len(wav) > 0 and np.isfinite(wav).all() and tele.error is None


def test_text_at_the_limit_is_split_not_refused(svc):
    assert len(svc.frontend.text_segments("x" * 5000)) > 1
    with pytest.raises(ValueError, match="Text is too long: 5001 characters, the limit is 5000"):
        svc.frontend.text_segments("x" * 5001)


def test_long_text_is_split_into_segments(svc):
    segs = svc.frontend.text_segments("This is one sentence. " * 200)  # 4400 characters: under the limit
    assert len(segs) > 10 and all(s.shape[1] <= 80 for s in segs)


# ------------------------------------------------------------------------------------------------ prompt audio

@pytest.mark.parametrize("name", ["ok", "8k", "96k", "stereo", "clipped"])
def test_prompt_variants_that_work(svc, wavs, name):
    wav, tele = synth(svc, prompt_wav=wavs[name])
    assert len(wav) == 12 * 960 and tele.error is None


@pytest.mark.parametrize("name, message", [
    ("not_audio", "could not decode 'notes.wav' as audio: use a WAV, FLAC, MP3 or OGG file"),
    ("empty", "prompt audio file 'empty.wav' is empty (0 bytes): record or upload it again"),
    ("header_only", "no samples"),
    ("silent", "the prompt audio is silent: check the microphone"),
    ("long", "the prompt audio is too long: 31.0 s after trimming silence, at most 30 s is supported"),
    ("short", "the prompt audio is too short: 0.30 s long after trimming silence, at least 0.5 s is needed"),
    ("4k", "sample rate is 4000 Hz, below the minimum of 8000 Hz"),
    ("nan", "invalid samples (NaN or infinity)"),
])
def test_bad_prompt_audio_is_refused_with_limits(svc, wavs, name, message):
    with pytest.raises(ValueError) as e:
        synth(svc, prompt_wav=wavs[name])
    assert message in str(e.value)
    assert str(wavs[name].parent) not in str(e.value), "the message must not show the server's directories"


def test_missing_prompt_file(svc, tmp_path):
    with pytest.raises(ValueError, match="prompt audio file 'gone.wav' does not exist"):
        synth(svc, prompt_wav=tmp_path / "gone.wav")


@pytest.mark.parametrize("name, message", [
    ("not_audio", "could not decode 'notes.wav' as audio"),
    ("empty", "is empty (0 bytes)"),
    ("long", "too long"),
    ("short", "too short"),
    ("silent", "silent"),
])
def test_app_handlers_give_the_same_message_without_paths(svc, wavs, name, message):
    """The app's synthesize and save-voice handlers: a gr.Error with the library's text, no server path."""
    from cosyvoice_fast.app.handlers import CONFIG_FIELDS, VOICE_FIELDS, Handlers

    h = Handlers(svc, stream_audio=False)
    voice = dict(text="hello", mode="cross_lingual", prompt_upload=str(wavs[name]), prompt_mic=None,
                 prompt_text="", instruct_text="", speaker=None, seed=1, stream=True, speed=1.0)
    cfg = dict(token_hop_len_first=10, token_hop_len=10, pre_lookahead_len=3, stream_scale_factor=2.0,
               max_tokens=10, llm="eager", flow="eager", vocoder="eager", dtype="fp32", incremental_flow=True)
    values = [voice[k] for k in VOICE_FIELDS] + [cfg[k] for k in CONFIG_FIELDS] + [[]]
    with pytest.raises(gr.Error) as e:
        list(h.synthesize(*values))
    assert message in e.value.message and str(wavs[name].parent) not in e.value.message
    with pytest.raises(gr.Error) as e:
        h.save_speaker("voice_x", str(wavs[name]), None, "")
    assert message in e.value.message and str(wavs[name].parent) not in e.value.message


# ------------------------------------------------------------------------------------------------ modes etc.

@pytest.mark.parametrize("kw, message", [
    (dict(mode="karaoke"), "unknown mode 'karaoke'; choose one of zero_shot, cross_lingual, instruct2, speaker"),
    (dict(mode="zero_shot", prompt_text=""), "zero-shot mode needs the prompt's transcript"),
    (dict(mode="instruct2", instruct_text="  "), "instruct mode needs an instruction"),
    (dict(mode="cross_lingual", prompt_wav=None), "mode 'cross_lingual' needs a prompt voice"),
    (dict(mode="speaker", speaker=None, prompt_wav=None), "mode 'speaker' needs a saved speaker name"),
    (dict(mode="speaker", speaker="nobody", prompt_wav=None), "no saved speaker named 'nobody'"),
    (dict(mode="speaker", speaker="../../etc/passwd", prompt_wav=None), "invalid speaker name '../../etc/passwd'"),
    (dict(mode="speaker", speaker="a" * 65, prompt_wav=None), "use 1 to 64 letters"),
    (dict(mode="speaker", speaker="CON", prompt_wav=None), "invalid speaker name 'CON'"),
    (dict(seed=-1), "seed=-1: use a whole number from 0 to 2**63-1"),
    (dict(speed=3.0, stream=False), "speed=3.0 is out of range: use 0.5 to 2.0"),
    (dict(speed=1.5, stream=True), "speed change works only without streaming"),
    (dict(max_tokens=0), "max_tokens=0: use 1 to 4000"),
    (dict(max_tokens=5000), "max_tokens=5000: use 1 to 4000"),
    (dict(max_tokens=None, ignore_eos=True), "ignore_eos needs max_tokens"),
])
def test_bad_request_fields(svc, wavs, kw, message):
    kw = {"prompt_wav": wavs["ok"], **kw}
    with pytest.raises(ValueError) as e:
        synth(svc, **kw)
    assert message in str(e.value)


@pytest.mark.parametrize("kw, message", [
    (dict(llm="vllm"), "unknown llm backend 'vllm'; choose one of eager, cudagraph, fused, trtllm"),
    (dict(flow="warp-drive"), "unknown flow backend 'warp-drive'"),
    (dict(vocoder="tensorrt"), "unknown vocoder backend 'tensorrt'; choose one of eager, cudagraph, fused"),
    (dict(dtype="int4"), "unknown dtype 'int4'; choose fp32, fp16 or bf16"),
])
def test_unknown_backend_or_dtype(kw, message):
    with pytest.raises(ConfigError) as e:
        BackendConfig(**kw)
    assert message in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the backend can run")
@pytest.mark.parametrize("stage", ["llm", "flow", "vocoder"])
def test_backend_unavailable_here_says_why(svc, wavs, stage):
    with pytest.raises(RuntimeError) as e:
        synth(svc, prompt_wav=wavs["ok"], backend=BackendConfig(**{stage: "cudagraph"}))
    assert f"{stage} backend 'cudagraph' is unavailable: needs a CUDA GPU" in str(e.value)
    assert "Choose 'eager' instead." in str(e.value)


@pytest.mark.parametrize("kw, message", [
    (dict(token_hop_len_first=0), "token_hop_len_first=0 is out of range: use a whole number of tokens from 1 to 100"),
    (dict(token_hop_len_first=101), "token_hop_len_first=101 is out of range"),
    (dict(token_hop_len_first=2.5), "token_hop_len_first=2.5 is out of range"),
    (dict(token_hop_len=0), "token_hop_len=0 is out of range: use a whole number of tokens from 1 to 200"),
    (dict(token_hop_len=201, token_max_hop_len=400), "token_hop_len=201 is out of range"),
    (dict(stream_scale_factor=0.5), "stream_scale_factor=0.5 is out of range: use a factor from 1.0 to 4.0"),
    (dict(stream_scale_factor=4.5), "stream_scale_factor=4.5 is out of range"),
    (dict(token_hop_len=50, token_max_hop_len=40), "token_max_hop_len=40 is out of range: use a whole number "
                                                   "from token_hop_len to 400"),
    (dict(token_max_hop_len=401), "token_max_hop_len=401 is out of range"),
    (dict(pre_lookahead_len=-1), "pre_lookahead_len=-1 is out of range: use 0 to 3 tokens"),
    (dict(pre_lookahead_len=4), "pre_lookahead_len=4 is out of range"),
])
def test_out_of_range_stream_params(kw, message):
    with pytest.raises(ConfigError) as e:
        StreamParams(**kw)
    assert message in str(e.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_stream_scale_factor(value):
    with pytest.raises(ConfigError, match="stream_scale_factor=.* is out of range"):
        StreamParams(stream_scale_factor=value)


def test_engine_still_serves_after_the_matrix(svc, wavs):
    wav, tele = synth(svc, prompt_wav=wavs["ok"])
    assert len(wav) == 12 * 960 and svc.engine.active_requests() == 0


# ------------------------------------------------------------------------------------------------ model dirs

def _model_copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """``dst`` with symlinks to ``src``'s files (cheap: flow.pt is 48 MB), except those in ``skip``."""
    dst.mkdir()
    (dst / "CosyVoice-BlankEN").mkdir()
    for rel in ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "CosyVoice-BlankEN/config.json"):
        if rel not in skip:
            os.symlink(src / rel, dst / rel)
    return dst


class NotAWeight:
    """A custom class: pickling it puts a global into the file, which weights_only=True refuses to resolve."""

    def __init__(self) -> None:
        self.payload = "would run code on load"


def test_model_dir_missing(tmp_path):
    with pytest.raises(ModelFileError) as e:
        validate_model_dir(tmp_path / "CosyVoice2-0.5B")
    assert f"Model directory {tmp_path / 'CosyVoice2-0.5B'} does not exist or is not a directory." in str(e.value)


def test_model_dir_missing_a_file(fixture_dir, tmp_path):
    d = _model_copy(fixture_dir, tmp_path / "m", skip=("hift.pt", "CosyVoice-BlankEN/config.json"))
    with pytest.raises(ModelFileError) as e:
        load_models(d, progress=False)
    assert f"Model directory {tmp_path / 'm'} is missing hift.pt, CosyVoice-BlankEN/config.json." in str(e.value)
    assert "python -m cosyvoice_fast download" in str(e.value)


def test_truncated_checkpoint(fixture_dir, tmp_path):
    d = _model_copy(fixture_dir, tmp_path / "m", skip=("llm.pt",))
    (d / "llm.pt").write_bytes((fixture_dir / "llm.pt").read_bytes()[:100_000])
    with pytest.raises(ModelFileError) as e:
        load_models(d, progress=False)
    assert str(e.value).startswith(f"{d / 'llm.pt'} is truncated: it starts like a PyTorch checkpoint but its end "
                                   "is missing (100000 bytes). To fix it, download CosyVoice2-0.5B again")


def test_empty_checkpoint(fixture_dir, tmp_path):
    d = _model_copy(fixture_dir, tmp_path / "m", skip=("hift.pt",))
    (d / "hift.pt").write_bytes(b"")
    with pytest.raises(ModelFileError) as e:
        load_models(d, progress=False)
    assert str(e.value).startswith(f"{d / 'hift.pt'} is empty (0 bytes): the download or copy did not finish.")


def test_pickle_with_code_is_refused_by_weights_only(fixture_dir, tmp_path):
    d = _model_copy(fixture_dir, tmp_path / "m", skip=("flow.pt",))
    torch.save({"weight": torch.zeros(2), "extra": NotAWeight()}, d / "flow.pt")
    with pytest.raises(ModelFileError) as e:
        load_models(d, progress=False)
    assert f"{d / 'flow.pt'} was refused by the safe loader (torch.load weights_only=True)" in str(e.value)
    assert "contains pickled Python objects" in str(e.value)


def test_plain_pickle_reduce_payload_is_refused_not_run(fixture_dir, tmp_path):
    """A classic malicious pickle (``__reduce__`` calling a function): refused, and the function never runs."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    d = _model_copy(fixture_dir, tmp_path / "m", skip=("hift.pt",))
    with open(d / "hift.pt", "wb") as f:
        pickle.dump({"w": Evil()}, f)
    with pytest.raises(ModelFileError):
        load_models(d, progress=False)
    assert not marker.exists()


def test_checkpoint_of_the_wrong_model(fixture_dir, tmp_path):
    d = _model_copy(fixture_dir, tmp_path / "m", skip=("hift.pt",))
    torch.save({"conv_pre.weight": torch.zeros(3, 3)}, d / "hift.pt")
    with pytest.raises(ModelFileError) as e:
        load_models(d, progress=False)
    assert str(e.value).startswith(f"{d / 'hift.pt'}: missing key")
    assert ". Is this a CosyVoice2 (not CosyVoice1/3) model" in str(e.value)


def test_not_a_state_dict(fixture_dir, tmp_path):
    d = _model_copy(fixture_dir, tmp_path / "m", skip=("llm.pt",))
    torch.save([torch.zeros(1)], d / "llm.pt")
    with pytest.raises(ModelFileError) as e:
        load_models(d, progress=False)
    assert str(e.value) == (f"{d / 'llm.pt'} holds a list, not a state dict (names → tensors). Save the weights "
                            "with torch.save(model.state_dict()).")


COSYVOICE1_YAML = """\
sample_rate: 22050
llm: !new:cosyvoice.llm.llm.TransformerLM
    text_encoder_input_size: 512
    llm_input_size: 1024
flow: !new:cosyvoice.flow.flow.MaskedDiffWithXvec
    input_size: 512
hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    sampling_rate: 22050
"""


def test_cosyvoice1_yaml_is_named_as_such(fixture_dir, tmp_path):
    d = _model_copy(fixture_dir, tmp_path / "m", skip=("cosyvoice2.yaml",))
    (d / "cosyvoice2.yaml").write_text(COSYVOICE1_YAML)
    with pytest.raises(ModelFileError) as e:
        load_models(d, progress=False)
    assert "cosyvoice2.yaml: llm is TransformerLM and flow is MaskedDiffWithXvec" in str(e.value)
    assert "not CosyVoice1, and not a mix" in str(e.value)


def test_cosyvoice1_directory_is_named_as_such(fixture_dir, tmp_path):
    d = _model_copy(fixture_dir, tmp_path / "CosyVoice-300M", skip=("cosyvoice2.yaml",))
    (d / "cosyvoice.yaml").write_text(COSYVOICE1_YAML)
    with pytest.raises(ModelFileError) as e:
        load_models(d, progress=False)
    assert "holds cosyvoice.yaml: it looks like a CosyVoice1 model; cosyvoice_fast runs CosyVoice2 and " \
        "CosyVoice3 only" in str(e.value)


def test_yaml_that_tries_to_run_code_is_inert(fixture_dir, tmp_path):
    marker = tmp_path / "pwned"
    d = _model_copy(fixture_dir, tmp_path / "m", skip=("cosyvoice2.yaml",))
    text = (fixture_dir / "cosyvoice2.yaml").read_text()
    (d / "cosyvoice2.yaml").write_text(f"boom: !!python/object/apply:os.system ['touch {marker}']\n"
                                       f"boom2: !apply:os.system ['touch {marker}']\n" + text)
    try:
        load_models(d, progress=False)  # either refused or loaded as inert data
    except (ModelFileError, ConfigError):
        pass
    assert not marker.exists()


@pytest.mark.parametrize("hop_first, hop", [(1, 1), (2, 3), (3, 2), (4, 1)])
def test_smallest_hops_stream_every_sample(svc, wavs, hop_first, hop):
    """token_hop_len_first 1-3 used to fail on the second chunk ("both waveforms need at least 3840 samples to
    cross-fade"): a first chunk under 8 mel frames left too short a tail for the cross-fade."""
    params = StreamParams(token_hop_len_first=hop_first, token_hop_len=hop, pre_lookahead_len=0)
    chunks = list(svc.engine.stream(SynthesisRequest(text="hello", mode="cross_lingual", prompt_wav=wavs["ok"],
                                                     stream_params=params, max_tokens=12, ignore_eos=True)))
    wav = np.concatenate([c.samples for c in chunks])
    assert len(wav) == 12 * 960 and np.isfinite(wav).all() and chunks[-1].is_last
    assert len(chunks) > 2
