"""A CosyVoice3 model directory: its family detected from its files, mixed or unknown directories refused naming
the file, the loader building CosyVoice3's networks, synthetic CosyVoice3 directories, and the backend table."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from cosyvoice_fast.config.backends import BackendConfig, BackendUnavailable
from cosyvoice_fast.config.yamlfile import read_hyperpyyaml
from cosyvoice_fast.modeldir.files import ModelFileError, load_models, read_config, validate_model_dir

WEIGHTS = ("llm.pt", "flow.pt", "hift.pt")


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """A writable copy of a fixture model directory (the fixtures are read-only), without ``skip``."""
    dst.mkdir(parents=True)
    (dst / "CosyVoice-BlankEN").mkdir()
    for f in ("cosyvoice2.yaml", "cosyvoice3.yaml", *WEIGHTS, "CosyVoice-BlankEN/config.json"):
        if (src / f).is_file() and f not in skip:
            shutil.copyfile(src / f, dst / f)
    return dst


def test_cosyvoice3_fixture_is_detected_and_read(fixture3_dir):
    files = validate_model_dir(fixture3_dir)
    assert files.family == "cosyvoice3"
    assert "speech_tokenizer_v3.onnx" in files.spec.frontend_files
    cfg = read_config(files)
    doc = read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml")
    est = doc["flow"]["decoder"]["estimator"]
    assert cfg.family == cfg.llm.family == "cosyvoice3"
    assert (cfg.sample_rate, cfg.token_mel_ratio, cfg.chunk_size) == (
        doc["sample_rate"], doc["token_mel_ratio"], doc["chunk_size"])
    assert (cfg.flow.dit.dim, cfg.flow.dit.depth, cfg.flow.dit.heads) == (est["dim"], est["depth"], est["heads"])
    assert cfg.flow.dit.static_chunk_size == doc["chunk_size"] * doc["token_mel_ratio"]
    assert cfg.hift.base_channels == doc["hift"]["base_channels"]
    assert cfg.llm.vocab_out == doc["llm"]["speech_token_size"] + 200


def test_cosyvoice3_fixture_loads_strictly(fixture3_dir):
    models = load_models(fixture3_dir, progress=False)
    assert models.family == "cosyvoice3"
    assert type(models.flow).__name__ == "DiTFlow" and type(models.hift).__name__ == "CausalHiFTGenerator"
    for fname, module in zip(WEIGHTS, (models.llm, models.flow, models.hift)):
        sd = torch.load(fixture3_dir / fname, weights_only=True)
        got = module.state_dict()
        assert sorted(got) == sorted(sd), fname  # the fixture stores torch >= 2.1's weight-norm names, as we do
        assert all(torch.equal(got[k], v) for k, v in sd.items()), fname


def test_both_yamls_are_refused_naming_them(fixture_dir, fixture3_dir, tmp_path):
    d = _copy(fixture3_dir, tmp_path / "m")
    shutil.copyfile(fixture_dir / "cosyvoice2.yaml", d / "cosyvoice2.yaml")
    with pytest.raises(ModelFileError) as e:
        validate_model_dir(d)
    assert f"Model directory {d.absolute()} holds both cosyvoice2.yaml and cosyvoice3.yaml: it mixes CosyVoice2 " \
           "and CosyVoice3 files." in str(e.value)


def test_cosyvoice2_yaml_with_the_v3_speech_tokenizer_is_refused(fixture_dir, tmp_path):
    d = _copy(fixture_dir, tmp_path / "m")
    (d / "speech_tokenizer_v3.onnx").write_bytes(b"onnx")
    with pytest.raises(ModelFileError) as e:
        validate_model_dir(d)
    assert "holds cosyvoice2.yaml (CosyVoice2) but also speech_tokenizer_v3.onnx, the CosyVoice3 speech " \
           "tokenizer: an unexpected file (a CosyVoice2 directory has speech_tokenizer_v2.onnx)" in str(e.value)


def test_a_directory_without_a_family_yaml_names_both(fixture3_dir, tmp_path):
    d = _copy(fixture3_dir, tmp_path / "m", skip=("cosyvoice3.yaml",))
    with pytest.raises(ModelFileError) as e:
        validate_model_dir(d)
    assert f"Model directory {d.absolute()} is missing cosyvoice2.yaml or cosyvoice3.yaml (the file that says " \
           "which model it is)." in str(e.value)


def test_cosyvoice3_missing_weights_are_named(fixture3_dir, tmp_path):
    d = _copy(fixture3_dir, tmp_path / "m", skip=("hift.pt",))
    with pytest.raises(ModelFileError) as e:
        validate_model_dir(d)
    assert str(e.value).startswith(f"Model directory {d.absolute()} is missing hift.pt. To fix it, download "
                                   "Fun-CosyVoice3-0.5B again")


@pytest.mark.parametrize("fname", ["llm.pt", "flow.pt"])
def test_cosyvoice2_weights_in_a_cosyvoice3_directory_say_which_family_they_look_like(
        fixture_dir, fixture3_dir, tmp_path, fname):
    d = _copy(fixture3_dir, tmp_path / "m", skip=(fname,))
    shutil.copyfile(fixture_dir / fname, d / fname)
    with pytest.raises(ModelFileError) as e:
        load_models(d, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{(d / fname).absolute()}: ")
    assert msg.endswith(f"This {fname} looks like a CosyVoice2 file, but cosyvoice3.yaml describes a CosyVoice3 "
                        f"model: the directory mixes two downloads. Put the {fname} of Fun-CosyVoice3-0.5B here (or "
                        "point --model-dir at the CosyVoice2-0.5B directory it came from).")


def test_cosyvoice3_weights_in_a_cosyvoice2_directory_say_so(fixture_dir, fixture3_dir, tmp_path):
    d = _copy(fixture_dir, tmp_path / "m", skip=("hift.pt",))
    shutil.copyfile(fixture3_dir / "hift.pt", d / "hift.pt")
    with pytest.raises(ModelFileError, match="This hift.pt looks like a CosyVoice3 file, but cosyvoice2.yaml "
                                             "describes a CosyVoice2 model"):
        load_models(d, progress=False)


def test_synthetic_tiny3_is_the_fixtures_sizes_with_a_v3_frontend(fixture3_dir, tmp_path):
    from cosyvoice_fast.modeldir.synthetic import write_synthetic_model_dir

    d = write_synthetic_model_dir(tmp_path / "s", "tiny3")
    files = validate_model_dir(d)
    assert files.family == "cosyvoice3" and files.has_frontend
    assert (d / "speech_tokenizer_v3.onnx").is_file() and not (d / "speech_tokenizer_v2.onnx").exists()
    assert read_config(files) == read_config(validate_model_dir(fixture3_dir))
    models = load_models(d, progress=False)
    assert models.family == "cosyvoice3"


def test_cosyvoice3_backend_table_is_honest():
    from cosyvoice_fast.engine.stages import available_backends, check_available, stage_keys

    info = {(b.stage, b.name): b for b in available_backends("cpu", family="cosyvoice3")}
    assert info[("llm", "eager")].available and info[("flow", "eager")].available
    assert info[("vocoder", "eager")].available
    assert not info[("llm", "trtllm")].available and "not written for cosyvoice3" in info[("llm", "trtllm")].reason
    assert not info[("flow", "tensorrt")].available
    assert info[("vocoder", "fused")].note.startswith("fused = cudagraph for cosyvoice3")
    assert info[("flow", "fused")].note.startswith("fused = cudagraph for cosyvoice3")  # the all-Triton DiT lost
    assert not any(b.note for b in available_backends("cpu"))  # CosyVoice2's names mean what they say
    fused = stage_keys(BackendConfig(flow="fused", vocoder="fused"), "cosyvoice3")
    graph = stage_keys(BackendConfig(flow="cudagraph", vocoder="cudagraph"), "cosyvoice3")
    assert fused["vocoder"] == graph["vocoder"] == ("vocoder", "cudagraph", "fp32")  # one runner, one object
    assert fused["flow"] == graph["flow"] == ("flow", "cudagraph", "fp32")  # one runner, one object
    assert stage_keys(BackendConfig(flow="cudagraph", incremental=False), "cosyvoice3")["flow"] == graph["flow"]
    assert stage_keys(BackendConfig(), "cosyvoice3")["flow"][1] == "incremental"
    with pytest.raises(BackendUnavailable, match="flow backend 'tensorrt' is unavailable: not written for "
                                                 "cosyvoice3"):
        check_available(BackendConfig(flow="tensorrt"), "cpu", "cosyvoice3")


def test_backends_command_lists_cosyvoice3_with_its_notes(capsys):
    from cosyvoice_fast.cli.main import main

    assert main(["backends", "--device", "cpu", "--family", "cosyvoice3"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert any(r.split()[:3] == ["vocoder", "fused", "no"] and "fused = cudagraph for cosyvoice3" in r for r in rows)
    assert any(r.split()[:3] == ["llm", "trtllm", "no"] and "not written for cosyvoice3" in r for r in rows)
    assert any(r.split() == ["vocoder", "eager", "yes"] for r in rows)
