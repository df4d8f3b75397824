"""The model families a directory can hold, as one table: the files that name each, the networks it builds.

A directory is CosyVoice2 when it holds ``cosyvoice2.yaml``, CosyVoice3 when it holds ``cosyvoice3.yaml`` (the name
upstream's own loader goes by); the speech tokenizer that comes with each (``speech_tokenizer_v2.onnx`` /
``_v3.onnx``) must match.  Everything that differs between the families when a directory is loaded is a field of
:class:`Family`, so the loader (:mod:`cosyvoice_fast.modeldir.files`) and the synthetic writer never branch on the
family name.  Which stage runners serve a family is each stage folder's own table (``llm/runners.py``,
``flow/runners.py``, ``vocoder/runners.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from cosyvoice_fast.config.model import ModelConfig

#: the three networks of one family, freshly built (random init) for a config
Modules = tuple[nn.Module, nn.Module, nn.Module]


def _build_cosyvoice2(config: ModelConfig) -> Modules:
    from cosyvoice_fast.flow.model.flow import CausalMaskedDiffWithXvec
    from cosyvoice_fast.llm.model.speech_lm import Qwen2LM
    from cosyvoice_fast.vocoder.model.hift import HiFTGenerator

    return Qwen2LM(config.llm), CausalMaskedDiffWithXvec(config.flow), HiFTGenerator(config.hift)


def _build_cosyvoice3(config: ModelConfig) -> Modules:
    from cosyvoice_fast.flow.model.dit_flow import DiTFlow
    from cosyvoice_fast.llm.model.speech_lm import build_speech_lm
    from cosyvoice_fast.vocoder.model.causal_hift import CausalHiFTGenerator

    return build_speech_lm(config.llm), DiTFlow(config.flow), CausalHiFTGenerator(config.hift)


def _sniff_llm(sd: Mapping[str, torch.Tensor]) -> str | None:
    if "llm_embedding.weight" in sd:  # CosyVoice2's 2-row sos/task table; CosyVoice3 keeps them in the speech table
        return "cosyvoice2"
    return "cosyvoice3" if "speech_embedding.weight" in sd and "llm_decoder.bias" not in sd else None


def _sniff_flow(sd: Mapping[str, torch.Tensor]) -> str | None:
    if any(k.startswith("encoder.") for k in sd):  # the conformer encoder
        return "cosyvoice2"
    return "cosyvoice3" if any(k.startswith("pre_lookahead_layer.") for k in sd) else None


def _sniff_hift(sd: Mapping[str, torch.Tensor]) -> str | None:
    """Same key names in both families; the f0 predictor's first conv looks 3 frames (CosyVoice2) or 4 (causal)."""
    for k, v in sd.items():
        if k.startswith("f0_predictor.condnet.0.") and v.dim() == 3 and v.shape[-1] > 1:
            return {3: "cosyvoice2", 4: "cosyvoice3"}.get(int(v.shape[-1]))
    return None


#: weight file -> "which family does this state dict look like?" (None: cannot tell)
SNIFF: Mapping[str, Callable[[Mapping[str, torch.Tensor]], str | None]] = {
    "llm.pt": _sniff_llm, "flow.pt": _sniff_flow, "hift.pt": _sniff_hift}


@dataclass(frozen=True)
class Family:
    """What tells one model family from the other when a directory is read."""

    name: str  #: ``ModelConfig.family``
    title: str  #: as users read it
    download: str  #: the official directory's name
    yaml: str  #: the hyperparameter file that names the family
    speech_tokenizer: str  #: the ONNX speech tokenizer of this family's frontend
    build: Callable[[ModelConfig], Modules]  #: LM, flow and vocoder for a config (random init)

    @property
    def required_files(self) -> tuple[str, ...]:
        return (self.yaml, "llm.pt", "flow.pt", "hift.pt", "CosyVoice-BlankEN/config.json")

    @property
    def frontend_files(self) -> tuple[str, ...]:
        return ("campplus.onnx", self.speech_tokenizer, "CosyVoice-BlankEN/vocab.json",
                "CosyVoice-BlankEN/merges.txt")

    def mismatch_hint(self, fname: str, sd: Mapping[str, torch.Tensor]) -> str:
        """A sentence for a strict-load failure of ``fname`` when its keys look like another family's file."""
        sniff = SNIFF.get(fname)
        other = sniff(sd) if sniff is not None else None
        if other is None or other == self.name:
            return ""
        theirs = FAMILIES[other]
        return (f"This {fname} looks like a {theirs.title} file, but {self.yaml} describes a {self.title} model: "
                f"the directory mixes two downloads. Put the {fname} of {self.download} here (or point --model-dir "
                f"at the {theirs.download} directory it came from).")


FAMILIES: Mapping[str, Family] = {
    "cosyvoice2": Family("cosyvoice2", "CosyVoice2", "CosyVoice2-0.5B", "cosyvoice2.yaml",
                         "speech_tokenizer_v2.onnx", _build_cosyvoice2),
    "cosyvoice3": Family("cosyvoice3", "CosyVoice3", "Fun-CosyVoice3-0.5B", "cosyvoice3.yaml",
                         "speech_tokenizer_v3.onnx", _build_cosyvoice3),
}

#: yaml files of families this package does not run: a directory holding one gets a message naming it
FOREIGN_YAMLS = {"cosyvoice.yaml": "CosyVoice1"}


def family_of(name: str) -> Family:
    """The :class:`Family` called ``name``; an unknown name is refused listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}") from None


def build_modules(config: ModelConfig) -> Modules:
    """Instantiate the three networks of ``config.family`` (random init)."""
    return family_of(config.family).build(config)
