"""Find, validate and load a CosyVoice2 or CosyVoice3 model directory.

The family comes from the directory itself (``cosyvoice2.yaml`` or ``cosyvoice3.yaml``, see
:mod:`cosyvoice_fast.modeldir.families`); a directory that holds both, neither, or a speech tokenizer of the other
family is refused naming the file.  The same code path loads the official directories, the tiny parity fixtures
and the synthetic directories written by :mod:`cosyvoice_fast.modeldir.synthetic`, so a parity test of this loader
is a test of what users run.
Weights are read with ``torch.load(weights_only=True)`` (no pickle code execution) and matched strictly: every
missing, unexpected or mis-shaped key is an error that names the file, the key and what to do.

Loading copies each weight once.  The networks are built without their random initialisation (:class:`SkipInit`:
every value is overwritten by the checkpoint anyway; on the 0.5B model that init cost seconds of CPU time per
start), the checkpoints are memory-mapped (``mmap=True``) and their tensors become the parameters
(``load_state_dict(assign=True)``), so the one copy left is ``.to(device, dtype)`` reading the mapped file.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.modeldir.families import FAMILIES, FOREIGN_YAMLS, Family, Modules, family_of
from cosyvoice_fast.modeldir.families import build_modules as _build_family_modules

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path("pretrained_models") / "CosyVoice2-0.5B"
REQUIRED_FILES = FAMILIES["cosyvoice2"].required_files  # CosyVoice2's; each Family lists its own
FRONTEND_FILES = FAMILIES["cosyvoice2"].frontend_files
_HINT_DOWNLOAD = ("download the model again (python -m cosyvoice_fast download) or pass --synthetic tiny "
                  "to try the app without weights")


def _hint_download(family: str) -> str:
    """What to do about a broken file of ``family``'s directory."""
    return (f"download {family_of(family).download} again (python -m cosyvoice_fast download) or pass "
            "--synthetic tiny to try the app without weights")


class ModelFileError(ValueError):
    """A model file is missing, unreadable, unsafe or does not match its family; the message says which and why."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """Paths of a validated model directory and the family its files name."""

    root: Path
    family: str = "cosyvoice2"

    def path(self, rel: str) -> Path:
        return self.root / rel

    @property
    def spec(self) -> Family:
        return family_of(self.family)

    @property
    def has_frontend(self) -> bool:
        """True when the ONNX speech tokenizer, speaker model and BPE files are present (prompt voices work)."""
        return not self.missing_frontend_files()

    def missing_frontend_files(self) -> list[str]:
        return [f for f in self.spec.frontend_files if not self.path(f).is_file()]


#: where ``download`` puts the CosyVoice3 model; used when the CosyVoice2 default is absent
DEFAULT_MODEL_DIR3 = Path("pretrained_models") / "Fun-CosyVoice3-0.5B"


def find_model_dir(model_dir: str | Path | None) -> Path | None:
    """The directory to load: the one given, else ``pretrained_models/CosyVoice2-0.5B`` or
    ``pretrained_models/Fun-CosyVoice3-0.5B`` (the first that exists), else None."""
    if model_dir is not None:
        return Path(model_dir)
    return next((d for d in (DEFAULT_MODEL_DIR, DEFAULT_MODEL_DIR3) if d.is_dir()), None)


def _shown(path: Path) -> str:
    """A path as the operator can find it: absolute (several model folders may hold an ``llm.pt``).  These
    messages go to the terminal of whoever starts the server; web users never see them."""
    return str(Path(path).absolute())


def detect_family(root: Path) -> Family:
    """The family ``root``'s files name: exactly one family yaml, and not another family's speech tokenizer in
    place of its own (the frontend would tokenise prompts with the wrong model)."""
    yamls = [f for f in FAMILIES.values() if (root / f.yaml).is_file()]
    if len(yamls) > 1:
        names = " and ".join(f.yaml for f in yamls)
        raise ModelFileError(f"Model directory {_shown(root)} holds both {names}: it mixes {yamls[0].title} and "
                             f"{yamls[1].title} files. Keep the yaml that came with these weights (remove the other), "
                             "or download the model again into an empty directory.")
    if not yamls:
        for other, title in FOREIGN_YAMLS.items():
            if (root / other).is_file():
                raise ModelFileError(f"Model directory {_shown(root)} holds {other}: it looks like a {title} model; "
                                     "cosyvoice_fast runs CosyVoice2 and CosyVoice3 only. Point --model-dir at a "
                                     "CosyVoice2-0.5B or Fun-CosyVoice3-0.5B directory.")
        wanted = " or ".join(f.yaml for f in FAMILIES.values())
        raise ModelFileError(f"Model directory {_shown(root)} is missing {wanted} (the file that says which model "
                             f"it is). To fix it, {_HINT_DOWNLOAD}.")
    family = yamls[0]
    if (root / family.speech_tokenizer).is_file():  # its own tokenizer is there: a spare file of another is harmless
        return family
    for other in FAMILIES.values():
        if other is not family and other.speech_tokenizer != family.speech_tokenizer \
                and (root / other.speech_tokenizer).is_file():
            raise ModelFileError(f"Model directory {_shown(root)} holds {family.yaml} ({family.title}) but also "
                                 f"{other.speech_tokenizer}, the {other.title} speech tokenizer: an unexpected file "
                                 f"(a {family.title} directory has {family.speech_tokenizer}). Remove it and put the "
                                 f"{family.download} files here, or download the model again.")
    return family


def validate_model_dir(model_dir: str | Path) -> ModelFiles:
    """Detect the family and check that every required file exists; the error lists all that are missing."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelFileError(f"Model directory {_shown(root)} does not exist or is not a directory. Pass "
                             "--model-dir pointing at CosyVoice2-0.5B or Fun-CosyVoice3-0.5B, or download one "
                             "(python -m cosyvoice_fast download) or pass --synthetic tiny to try the app without "
                             "weights.")
    family = detect_family(root)
    missing = [f for f in family.required_files if not (root / f).is_file()]
    if missing:
        raise ModelFileError(f"Model directory {_shown(root)} is missing {', '.join(missing)}. To fix it, "
                             f"{_hint_download(family.name)}.")
    return ModelFiles(root, family.name)


def read_config(files: ModelFiles) -> ModelConfig:
    """The directory's hyperparameters; the yaml's classes must name the family its file name does."""
    config = ModelConfig.from_files(files.path(files.spec.yaml), files.path("CosyVoice-BlankEN/config.json"))
    if config.family != files.family:
        found = family_of(config.family)
        raise ConfigError(f"{files.spec.yaml}: its llm and flow are {found.title}'s, but the file name says "
                          f"{files.spec.title}; rename it {found.yaml} if these are {found.title} weights")
    return config


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6: a zip archive
_PICKLE_MAGIC = b"\x80"  # the legacy torch.save format and plain pickle files start with a protocol opcode


def load_state_dict_file(path: Path, family: str = "cosyvoice2") -> dict[str, torch.Tensor]:
    """``torch.load(weights_only=True)`` with errors that say, in whole sentences, what is wrong with which file
    (its absolute path) and what to do.  The file's first bytes decide the diagnosis: torch's own exceptions for a
    random or cut-off file are arbitrary (IndexError, KeyError, "invalid load key"), so they are not shown."""
    shown = _shown(path)
    redownload = f"To fix it, {_hint_download(family)}."
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelFileError(f"{shown} cannot be opened ({e.strerror or type(e).__name__}). Check that the file "
                             "exists and that this user may read it.") from e
    if size == 0:
        raise ModelFileError(f"{shown} is empty (0 bytes): the download or copy did not finish. {redownload}")
    if head == _ZIP_MAGIC and not zipfile.is_zipfile(path):
        raise ModelFileError(f"{shown} is truncated: it starts like a PyTorch checkpoint but its end is missing "
                             f"({size} bytes). {redownload}")
    if head != _ZIP_MAGIC and not head.startswith(_PICKLE_MAGIC):
        raise ModelFileError(f"{shown} is not a PyTorch checkpoint (a file written by torch.save starts with a zip "
                             f"header; this one starts with bytes {head.hex(' ')}). {redownload}")
    try:
        # a zip checkpoint is memory-mapped: its tensors are read from the page cache when first used, not copied
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=head == _ZIP_MAGIC)
    except pickle.UnpicklingError as e:
        if "weights only load failed" not in str(e).lower():
            raise ModelFileError(f"{shown} is damaged or not a PyTorch checkpoint (the safe loader could not read "
                                 f"it). {redownload}") from e
        raise ModelFileError(
            f"{shown} was refused by the safe loader (torch.load weights_only=True): it contains pickled Python "
            "objects, not just tensors. Only load checkpoints you trust, and re-save it with "
            "torch.save(model.state_dict())."
        ) from e
    except Exception as e:  # noqa: BLE001 - torch raises anything from a damaged archive; all mean the same here
        raise ModelFileError(f"{shown} is damaged: PyTorch could not read it ({type(e).__name__}). "
                             f"{redownload}") from e
    if not isinstance(sd, dict):
        raise ModelFileError(f"{shown} holds a {type(sd).__name__}, not a state dict (names → tensors). Save the "
                             "weights with torch.save(model.state_dict()).")
    bad = next(((k, v) for k, v in sd.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))), None)
    if bad is not None:
        raise ModelFileError(f"{shown} is not a plain state dict: its entry {bad[0]!r} is of type "
                             f"{type(bad[1]).__name__}, not a tensor. Save the weights with "
                             "torch.save(model.state_dict()).")
    return sd


def load_strict(module: nn.Module, sd: dict[str, torch.Tensor], fname: str, family_hint: str,
                assign: bool = False) -> None:
    """Load ``sd`` into ``module`` requiring identical keys and shapes; report the first offenders.  ``assign``:
    ``sd``'s tensors become the parameters and buffers (no copy; see the module docstring)."""
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
        raise ModelFileError(f"{fname}: {'; '.join(problems)}. {family_hint}")
    if not assign:
        module.load_state_dict(sd, strict=True)
        return
    # the checkpoint's tensors become the parameters: in the module's own dtypes (an fp16 file still loads into
    # fp32 parameters, as a copy would), and parameters the module shares (tied embeddings) stay shared
    sd = {k: v if v.dtype == own[k].dtype else v.to(own[k].dtype) for k, v in sd.items()}
    ties = _shared_parameters(module)
    module.load_state_dict(sd, strict=True, assign=True)
    for first, others in ties:
        owner_param = module.get_parameter(first)
        for name in others:
            parent, _, attr = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, owner_param)


def _shared_parameters(module: nn.Module) -> list[tuple[str, list[str]]]:
    """Parameters reachable under several names (tied weights): (first name, the other names)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [(n[0], n[1:]) for n in names.values() if len(n) > 1]


class SkipInit(TorchFunctionMode):
    """Build modules without their ``torch.nn.init`` random initialisation (parameters keep whatever memory
    they got), for networks whose every parameter is loaded right after.  A torch function mode, so it acts on
    this thread only: another thread building a module meanwhile (the synthetic writer) keeps its init.
    Buffers computed in constructors (rotary frequencies, the fixed CFM noise, STFT windows) are unaffected."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **kwargs)


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

    @property
    def family(self) -> str:
        """``cosyvoice2`` or ``cosyvoice3``: which stage runners serve these networks."""
        return self.config.family


def _family_hint(spec: Family) -> str:
    others = "/".join(["CosyVoice1"] + [f.title[-1] for f in FAMILIES.values() if f is not spec])  # CosyVoice1/3
    return (f"Is this a {spec.title} (not {others}) model, and do {spec.yaml} and CosyVoice-BlankEN/config.json "
            "belong to the same download?")


def build_modules(config: ModelConfig) -> Modules:
    """Instantiate the three networks (random init) for ``config`` (its family's, see ``modeldir/families.py``)."""
    return _build_family_modules(config)


def load_models(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                progress: bool = True) -> LoadedModels:
    """Validate, read the config, build the modules and strictly load ``llm.pt``, ``flow.pt``, ``hift.pt``.

    The LLM and flow are cast to ``dtype``; HiFT stays fp32 (its iSTFT and f0 path lose accuracy in half
    precision and it is a small share of the time).
    """
    from tqdm.auto import tqdm

    from cosyvoice_fast.vocoder.model.weightnorm import convert_legacy_weight_norm

    files = validate_model_dir(model_dir)
    try:
        config = read_config(files)
    except ConfigError as e:
        raise ModelFileError(str(e)) from e
    with SkipInit():  # every parameter is loaded below: its random init would be thrown away
        llm, flow, hift = build_modules(config)
    steps = [("llm.pt", llm, None), ("flow.pt", flow, None), ("hift.pt", hift, convert_legacy_weight_norm)]
    bar = tqdm(steps, desc=f"loading {files.root.name}", unit="file", disable=not progress, leave=False)
    for fname, module, fix in bar:
        bar.set_postfix_str(fname)
        sd = load_state_dict_file(files.path(fname), files.family)
        if fix is not None:
            sd = fix(sd)
        hint = files.spec.mismatch_hint(fname, sd) or _family_hint(files.spec)
        load_strict(module, sd, _shown(files.path(fname)), hint, assign=True)
        log.info("loaded %s (%d tensors)", fname, len(sd))
    dev = torch.device(device)
    llm = llm.to(dev, dtype).eval()
    flow = flow.to(dev, dtype).eval()
    hift = hift.to(dev).eval()
    for m in (llm, flow, hift):
        m.requires_grad_(False)
    return LoadedModels(config=config, files=files, llm=llm, flow=flow, hift=hift, device=dev, dtype=dtype)
