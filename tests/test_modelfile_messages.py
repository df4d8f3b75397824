"""Model-file messages: what is wrong, with which file (its absolute path), and what to do — in whole sentences.

Runs on a synthetic model directory, so it needs no fixture."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from cosyvoice_fast.modeldir.files import REQUIRED_FILES, ModelFileError, load_models, load_state_dict_file
from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

FIX = ("To fix it, download CosyVoice2-0.5B again (python -m cosyvoice_fast download) or pass --synthetic tiny to "
       "try the app without weights.")


@pytest.fixture()
def model_dir(tmp_path) -> Path:
    """A private copy of the tiny synthetic model directory (files we may break)."""
    src = synthetic_model_dir("tiny")
    dst = tmp_path / "models" / "CosyVoice2-0.5B"
    shutil.copytree(src, dst)
    assert all((dst / f).is_file() for f in REQUIRED_FILES)
    return dst


def _error(model_dir: Path) -> str:
    with pytest.raises(ModelFileError) as e:
        load_models(model_dir, progress=False)
    return str(e.value)


def test_random_bytes_are_not_a_checkpoint(model_dir):
    (model_dir / "llm.pt").write_bytes(b"\x13\x37" + os.urandom(4094))
    msg = _error(model_dir)
    assert msg.startswith(f"{model_dir.absolute() / 'llm.pt'} is not a PyTorch checkpoint (a file written by "
                          "torch.save starts with a zip header; this one starts with bytes 13 37 ")
    assert msg.endswith(FIX) and "pickled Python objects" not in msg


def test_text_file_is_not_a_checkpoint(model_dir):
    (model_dir / "flow.pt").write_text("version https://git-lfs.github.com/spec/v1\n")  # an LFS pointer
    assert _error(model_dir) == (f"{model_dir / 'flow.pt'} is not a PyTorch checkpoint (a file written by torch.save "
                                 f"starts with a zip header; this one starts with bytes 76 65 72 73). {FIX}")


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.99])
def test_truncated_file_is_a_whole_sentence(model_dir, keep):
    data = (model_dir / "hift.pt").read_bytes()
    n = int(len(data) * keep)
    (model_dir / "hift.pt").write_bytes(data[:n])
    assert _error(model_dir) == (f"{model_dir / 'hift.pt'} is truncated: it starts like a PyTorch checkpoint but "
                                 f"its end is missing ({n} bytes). {FIX}")


def test_empty_file(model_dir):
    (model_dir / "llm.pt").write_bytes(b"")
    assert _error(model_dir) == f"{model_dir / 'llm.pt'} is empty (0 bytes): the download or copy did not finish. {FIX}"


def test_pickled_objects_are_refused_with_the_path(model_dir):
    with open(model_dir / "flow.pt", "wb") as f:
        pickle.dump({"w": Path("x")}, f)
    assert _error(model_dir) == (
        f"{model_dir / 'flow.pt'} was refused by the safe loader (torch.load weights_only=True): it contains pickled "
        "Python objects, not just tensors. Only load checkpoints you trust, and re-save it with "
        "torch.save(model.state_dict()).")


def test_dict_with_a_non_tensor_entry(model_dir):
    torch.save({"w": torch.zeros(1), "step": 3}, model_dir / "llm.pt")
    assert _error(model_dir) == (f"{model_dir / 'llm.pt'} is not a plain state dict: its entry 'step' is of type "
                                 "int, not a tensor. Save the weights with torch.save(model.state_dict()).")


def test_relative_path_is_shown_absolute(model_dir, monkeypatch):
    """Two model folders may both hold an llm.pt: the message says which one."""
    monkeypatch.chdir(model_dir.parent)
    (model_dir / "llm.pt").write_bytes(b"junk")
    with pytest.raises(ModelFileError) as e:
        load_models(Path("CosyVoice2-0.5B"), progress=False)
    assert str(e.value).startswith(f"{model_dir.absolute() / 'llm.pt'} is not a PyTorch checkpoint")


def test_wrong_keys_name_the_full_path(model_dir):
    torch.save({"conv_pre.weight": torch.zeros(3, 3)}, model_dir / "hift.pt")
    msg = _error(model_dir)
    assert msg.startswith(f"{model_dir / 'hift.pt'}: missing key ")
    assert msg.endswith(". Is this a CosyVoice2 (not CosyVoice1/3) model, and do cosyvoice2.yaml and "
                        "CosyVoice-BlankEN/config.json belong to the same download?")


def test_missing_files_and_directory_name_the_full_path(model_dir, tmp_path):
    (model_dir / "hift.pt").unlink()
    assert _error(model_dir) == f"Model directory {model_dir} is missing hift.pt. {FIX}"
    gone = tmp_path / "elsewhere" / "CosyVoice2-0.5B"
    assert _error(gone) == (f"Model directory {gone} does not exist or is not a directory. Pass --model-dir pointing "
                            "at CosyVoice2-0.5B or Fun-CosyVoice3-0.5B, or download one (python -m cosyvoice_fast "
                            "download) or pass --synthetic tiny to try the app without weights.")


def test_good_file_still_loads(model_dir):
    sd = load_state_dict_file(model_dir / "hift.pt")
    assert sd and all(isinstance(v, torch.Tensor) for v in sd.values())
