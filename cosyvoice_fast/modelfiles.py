"""Find, validate and load a CosyVoice2 model directory.

The same code path loads the official CosyVoice2-0.5B directory, the tiny parity fixture and the synthetic
directories written by :mod:`cosyvoice_fast.synthetic`, so a parity test of this loader is a test of what users run.
Weights are read with ``torch.load(weights_only=True)`` (no pickle code execution) and matched strictly: every
missing, unexpected or mis-shaped key is an error that names the file, the key and what to do.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path("pretrained_models") / "CosyVoice2-0.5B"
REQUIRED_FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", "CosyVoice-BlankEN/config.json")
FRONTEND_FILES = ("campplus.onnx", "speech_tokenizer_v2.onnx", "CosyVoice-BlankEN/vocab.json",
                  "CosyVoice-BlankEN/merges.txt")
_HINT_DOWNLOAD = ("download CosyVoice2-0.5B again (python -m cosyvoice_fast download) or pass --synthetic tiny "
                  "to try the app without weights")


class ModelFileError(ValueError):
    """A model file is missing, unreadable, unsafe or does not match CosyVoice2; the message says which and why."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """Paths of a validated model directory."""

    root: Path

    def path(self, rel: str) -> Path:
        return self.root / rel

    @property
    def has_frontend(self) -> bool:
        """True when the ONNX speech tokenizer, speaker model and BPE files are present (prompt voices work)."""
        return all(self.path(f).is_file() for f in FRONTEND_FILES)

    def missing_frontend_files(self) -> list[str]:
        return [f for f in FRONTEND_FILES if not self.path(f).is_file()]


def find_model_dir(model_dir: str | Path | None) -> Path | None:
    """The directory to load: the one given, else ``pretrained_models/CosyVoice2-0.5B`` if it exists, else None."""
    if model_dir is not None:
        return Path(model_dir)
    return DEFAULT_MODEL_DIR if DEFAULT_MODEL_DIR.is_dir() else None


def validate_model_dir(model_dir: str | Path) -> ModelFiles:
    """Check that every required file exists; the error lists all that are missing."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelFileError(f"model directory {root.name or str(root)!r} does not exist or is not a directory; "
                             f"pass --model-dir pointing at CosyVoice2-0.5B, or {_HINT_DOWNLOAD}")
    missing = [f for f in REQUIRED_FILES if not (root / f).is_file()]
    if "cosyvoice2.yaml" in missing:  # say so when it is another generation's directory, not a broken one
        for other, family in (("cosyvoice.yaml", "CosyVoice1"), ("cosyvoice3.yaml", "CosyVoice3")):
            if (root / other).is_file():
                raise ModelFileError(f"model directory {root.name!r} holds {other}: it looks like a {family} "
                                     "model; cosyvoice_fast runs CosyVoice2 only. Point --model-dir at a "
                                     "CosyVoice2-0.5B directory.")
    if missing:
        raise ModelFileError(f"model directory {root.name!r} is missing {', '.join(missing)}; {_HINT_DOWNLOAD}")
    return ModelFiles(root)


def read_config(files: ModelFiles) -> ModelConfig:
    return ModelConfig.from_files(files.path("cosyvoice2.yaml"), files.path("CosyVoice-BlankEN/config.json"))


def load_state_dict_file(path: Path) -> dict[str, torch.Tensor]:
    """``torch.load(weights_only=True)`` with errors that say what went wrong in user terms."""
    name = path.name
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ModelFileError(
            f"{name}: refused by the safe loader (torch.load weights_only=True): it contains pickled Python objects, "
            "not just tensors. Only load checkpoints you trust; re-save it as torch.save(model.state_dict())."
        ) from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        raise ModelFileError(f"{name}: cannot be read ({type(e).__name__}: {str(e)[:160]}); the file is truncated "
                             f"or corrupt: {_HINT_DOWNLOAD}") from e
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ModelFileError(f"{name}: expected a state dict (names → tensors), found {type(sd).__name__}")
    return sd


def load_strict(module: nn.Module, sd: dict[str, torch.Tensor], fname: str, family_hint: str) -> None:
    """Load ``sd`` into ``module`` requiring identical keys and shapes; report the first offenders."""
    own = module.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} {tuple(sd[k].shape)} vs expected {tuple(v.shape)}" for k, v in own.items()
              if k in sd and sd[k].shape != v.shape]
    problems = []
    if missing:
        problems.append(f"missing key {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        problems.append(f"unexpected key {unexpected[0]}"
                        + (f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    if shapes:
        problems.append(f"wrong shape {shapes[0]}" + (f" (+{len(shapes) - 1} more)" if len(shapes) > 1 else ""))
    if problems:
        raise ModelFileError(f"{fname}: {'; '.join(problems)}; {family_hint}")
    module.load_state_dict(sd, strict=True)


@dataclass
class LoadedModels:
    """The three networks of one model directory, ready for inference."""

    config: ModelConfig
    files: ModelFiles
    llm: nn.Module
    flow: nn.Module
    hift: nn.Module
    device: torch.device
    dtype: torch.dtype


_FAMILY = ("is this a CosyVoice2 (not CosyVoice1/3) model, and do cosyvoice2.yaml and "
           "CosyVoice-BlankEN/config.json belong to the same download?")


def build_modules(config: ModelConfig) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Instantiate the three networks (random init) for ``config``."""
    from .models.flow import CausalMaskedDiffWithXvec
    from .models.hift import HiFTGenerator
    from .models.llm import Qwen2LM

    return Qwen2LM(config.llm), CausalMaskedDiffWithXvec(config.flow), HiFTGenerator(config.hift)


def load_models(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                progress: bool = True) -> LoadedModels:
    """Validate, read the config, build the modules and strictly load ``llm.pt``, ``flow.pt``, ``hift.pt``.

    The LLM and flow are cast to ``dtype``; HiFT stays fp32 (its iSTFT and f0 path lose accuracy in half
    precision and it is a small share of the time).
    """
    from tqdm.auto import tqdm

    from .models.weightnorm import convert_legacy_weight_norm

    files = validate_model_dir(model_dir)
    try:
        config = read_config(files)
    except ConfigError as e:
        raise ModelFileError(str(e)) from e
    llm, flow, hift = build_modules(config)
    steps = [("llm.pt", llm, None), ("flow.pt", flow, None), ("hift.pt", hift, convert_legacy_weight_norm)]
    bar = tqdm(steps, desc=f"loading {files.root.name}", unit="file", disable=not progress, leave=False)
    for fname, module, fix in bar:
        bar.set_postfix_str(fname)
        sd = load_state_dict_file(files.path(fname))
        if fix is not None:
            sd = fix(sd)
        load_strict(module, sd, fname, _FAMILY)
        log.info("loaded %s (%d tensors)", fname, len(sd))
    dev = torch.device(device)
    llm = llm.to(dev, dtype).eval()
    flow = flow.to(dev, dtype).eval()
    hift = hift.to(dev).eval()
    for m in (llm, flow, hift):
        m.requires_grad_(False)
    return LoadedModels(config=config, files=files, llm=llm, flow=flow, hift=hift, device=dev, dtype=dtype)
