"""From a prompt voice to what the models are conditioned on, and a disk cache of such voices.

* :class:`OnnxSpeechTokenizer` (``speech_tokenizer_v2.onnx``: Whisper log-mel -> 25 Hz speech token ids) and
  :class:`OnnxSpeakerEmbedder` (``campplus.onnx``: Kaldi fbank -> 192-d x-vector) wrap onnxruntime sessions that
  are created on first use (importing onnxruntime and loading the graph costs seconds that a text-only or
  saved-speaker request should not pay).  ``InferenceSession.run`` is thread-safe, so only creation is locked.
* :func:`extract_prompt` runs the whole prompt path and returns :class:`PromptFeatures`.
* :class:`SpeakerCache` saves :class:`PromptFeatures` under a name, one safetensors file per speaker with its
  metadata as JSON in the safetensors header: no pickle anywhere, and each save is a single atomic rename.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cosyvoice_fast.frontend.audio import (
    DEFAULT_LIMITS, AudioSource, PromptAudioError, PromptLimits, load_audio, prepare_prompt,
)
from cosyvoice_fast.frontend.features import kaldi_fbank, prompt_mel_24k, whisper_log_mel

FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------------------- ONNX models


class _LazyOnnx:
    """An onnxruntime session built on first :meth:`session` call, on CUDA when onnxruntime offers it.

    ``device`` is "auto" (CUDA if the CUDA provider is installed, else CPU), "cuda" or "cpu".  ``threads`` is the
    intra-op thread count on CPU; 1 by default so a prompt extraction does not contend with the engine's threads.
    """

    def __init__(self, path: str | Path, device: str = "auto", threads: int = 1) -> None:
        self.path = Path(path)
        if device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device={device!r}: use 'auto', 'cuda' or 'cpu'")
        self.device = device
        self.threads = int(threads)
        self._session: Any = None
        self._lock = threading.Lock()

    def providers(self) -> list[str]:
        import onnxruntime as ort

        have_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
        if self.device == "cuda" and not have_cuda:
            raise RuntimeError(f"{self.path.name}: device='cuda' asked for, but this onnxruntime has no CUDA provider "
                               "(install onnxruntime-gpu, or use device='auto')")
        if self.device != "cpu" and have_cuda:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def session(self) -> Any:
        if self._session is None:
            with self._lock:
                if self._session is None:
                    if not self.path.is_file():
                        raise FileNotFoundError(f"{self.path} not found: the model directory is incomplete")
                    import onnxruntime as ort

                    opts = ort.SessionOptions()
                    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                    opts.intra_op_num_threads = self.threads
                    self._session = ort.InferenceSession(str(self.path), sess_options=opts,
                                                         providers=self.providers())
        return self._session


class OnnxSpeechTokenizer(_LazyOnnx):
    """``speech_tokenizer_v2.onnx``: (1, 128, T) Whisper log-mel + (1,) length -> (1, ~T/4) speech token ids.

    Inputs are addressed by position (``feats``, ``feats_length`` in the released file); the length's integer
    type is read from the graph so int32 and int64 exports both work.
    """

    max_seconds = 30.0

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        if feats.dim() != 3 or feats.shape[0] != 1:
            raise ValueError(f"speech tokenizer input must be (1, n_mels, frames), got {tuple(feats.shape)}")
        sess = self.session()
        inputs = sess.get_inputs()
        length_type = np.int64 if inputs[1].type == "tensor(int64)" else np.int32
        out = sess.run(None, {inputs[0].name: feats.detach().cpu().numpy().astype(np.float32),
                              inputs[1].name: np.array([feats.shape[2]], dtype=length_type)})[0]
        return torch.from_numpy(np.asarray(out).reshape(1, -1).astype(np.int32))

    def tokenize(self, wav16k: torch.Tensor | np.ndarray) -> torch.Tensor:
        """16 kHz waveform (at most 30 s, the tokenizer's training limit) -> (1, N) int32 token ids."""
        n = torch.as_tensor(wav16k).shape[-1]
        if n / 16000 > self.max_seconds:
            raise PromptAudioError(f"the speech tokenizer accepts at most {self.max_seconds:g} s of audio, got "
                                   f"{n / 16000:.1f} s: cut the prompt shorter")
        return self(whisper_log_mel(wav16k, n_mels=128))


class OnnxSpeakerEmbedder(_LazyOnnx):
    """``campplus.onnx``: (1, T, 80) mean-normalised Kaldi fbank -> (1, 192) speaker embedding (x-vector)."""

    def __call__(self, fbank: torch.Tensor) -> torch.Tensor:
        if fbank.dim() == 2:
            fbank = fbank.unsqueeze(0)
        if fbank.dim() != 3 or fbank.shape[0] != 1:
            raise ValueError(f"speaker model input must be (1, frames, bins), got {tuple(fbank.shape)}")
        sess = self.session()
        out = sess.run(None, {sess.get_inputs()[0].name: fbank.detach().cpu().numpy().astype(np.float32)})[0]
        return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(1, -1).copy())

    def embed(self, wav16k: torch.Tensor | np.ndarray) -> torch.Tensor:
        """16 kHz waveform -> (1, 192) float32 embedding."""
        return self(kaldi_fbank(wav16k, num_mel_bins=80, mean_normalise=True))


# ----------------------------------------------------------------------------------------------- prompt features


@dataclass
class PromptFeatures:
    """Everything the models need from one prompt voice, independent of the text to synthesise.

    ``speech_token`` (1, N) int32 and ``speech_feat`` (1, ratio*N, 80) are cut to each other (two 50 Hz mel frames
    per 25 Hz token); ``embedding`` (1, 192) is the speaker x-vector.  ``prompt_text`` / ``prompt_text_tokens``
    are the transcript (zero-shot mode), when known.  ``extra`` holds further named tensors (e.g. a precomputed
    flow state) and ``meta`` JSON-able facts (duration, source); both survive :class:`SpeakerCache` unchanged, so
    later additions need no format change.
    """

    speech_token: torch.Tensor
    speech_feat: torch.Tensor
    embedding: torch.Tensor
    prompt_text: str = ""
    prompt_text_tokens: torch.Tensor | None = None
    token_mel_ratio: int = 2
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.speech_token = torch.as_tensor(self.speech_token).to(torch.int32).reshape(1, -1)
        if self.prompt_text_tokens is not None:
            self.prompt_text_tokens = torch.as_tensor(self.prompt_text_tokens).to(torch.int32).reshape(1, -1)
        n = self.speech_token.shape[1]
        if self.speech_feat.dim() != 3 or self.speech_feat.shape[0] != 1:
            raise ValueError(f"speech_feat must be (1, frames, mels), got {tuple(self.speech_feat.shape)}")
        if self.speech_feat.shape[1] != self.token_mel_ratio * n:
            raise ValueError(f"speech_feat has {self.speech_feat.shape[1]} frames for {n} speech tokens; expected "
                             f"{self.token_mel_ratio * n} ({self.token_mel_ratio} per token)")
        if self.embedding.dim() != 2 or self.embedding.shape[0] != 1:
            raise ValueError(f"embedding must be (1, dim), got {tuple(self.embedding.shape)}")

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> contiguous CPU tensor map (safetensors layout)."""
        out = {"speech_token": self.speech_token, "speech_feat": self.speech_feat, "embedding": self.embedding}
        if self.prompt_text_tokens is not None:
            out["prompt_text_tokens"] = self.prompt_text_tokens
        out.update({f"extra.{k}": v for k, v in self.extra.items()})
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}

    def metadata(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "prompt_text": self.prompt_text, "token_mel_ratio": self.token_mel_ratio,
                "meta": self.meta}

    @classmethod
    def from_parts(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> "PromptFeatures":
        if int(metadata.get("format", -1)) > FORMAT_VERSION:
            raise ValueError(f"saved with a newer format ({metadata.get('format')}); upgrade cosyvoice_fast")
        return cls(speech_token=tensors["speech_token"], speech_feat=tensors["speech_feat"],
                   embedding=tensors["embedding"], prompt_text=str(metadata.get("prompt_text", "")),
                   prompt_text_tokens=tensors.get("prompt_text_tokens"),
                   token_mel_ratio=int(metadata.get("token_mel_ratio", 2)),
                   extra={k[len("extra."):]: v for k, v in tensors.items() if k.startswith("extra.")},
                   meta=dict(metadata.get("meta", {})))


def align_prompt(speech_token: torch.Tensor, speech_feat: torch.Tensor,
                 ratio: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut (1, N) tokens and (1, F, 80) mel to ``n = min(F // ratio, N)`` tokens and ``ratio * n`` frames.

    The tokenizer (100 Hz mel, /4) and the 24 kHz mel (hop 480) disagree by a frame or two at the end; the flow
    needs the exact ratio, so both are cut to the shorter, as upstream does.
    """
    n = min(speech_feat.shape[1] // ratio, speech_token.shape[1])
    return speech_token[:, :n], speech_feat[:, : ratio * n]


def extract_prompt(source: AudioSource, sr: int | None, tokenizer: OnnxSpeechTokenizer,
                   embedder: OnnxSpeakerEmbedder, prompt_text: str = "",
                   prompt_text_tokens: torch.Tensor | None = None, token_mel_ratio: int = 2,
                   limits: PromptLimits = DEFAULT_LIMITS) -> PromptFeatures:
    """Prompt audio (path, bytes or array + ``sr``) -> :class:`PromptFeatures`.

    Decodes, validates and trims once, then: 24 kHz -> prompt mel (1, F, 80); 16 kHz -> Whisper log-mel -> speech
    tokens; 16 kHz -> fbank -> embedding; tokens and mel cut to the token/mel ratio.
    """
    wav, rate = load_audio(source, sr)
    wav16k, wav24k = prepare_prompt(wav, rate, limits)
    feat = prompt_mel_24k(torch.from_numpy(wav24k)).transpose(1, 2).contiguous()
    tokens = tokenizer.tokenize(wav16k)
    tokens, feat = align_prompt(tokens, feat, token_mel_ratio)
    if tokens.shape[1] == 0:
        raise PromptAudioError("the speech tokenizer found no speech in the prompt audio: use a clearer recording")
    return PromptFeatures(speech_token=tokens, speech_feat=feat, embedding=embedder.embed(wav16k),
                          prompt_text=prompt_text, prompt_text_tokens=prompt_text_tokens,
                          token_mel_ratio=token_mel_ratio,
                          meta={"seconds": round(len(wav16k) / 16000, 3), "source_sample_rate": rate})


# ----------------------------------------------------------------------------------------------- speaker cache


class SpeakerCacheError(ValueError):
    """A speaker name is unusable, unknown, or its file is damaged; the message says what to do."""


_NAME = re.compile(r"[A-Za-z0-9_\-\u4e00-\u9fff]{1,64}")
_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}
_SUFFIX = ".safetensors"
_META_KEY = "cosyvoice_fast"


def validate_speaker_name(name: object) -> str:
    """Return ``name`` if it is safe as a file name on every OS, else raise :class:`SpeakerCacheError`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.lower() in _RESERVED:
        shown = repr(name) if not isinstance(name, str) or len(name) <= 70 else repr(name[:64] + "...")
        raise SpeakerCacheError(f"invalid speaker name {shown}: use 1 to 64 letters, digits, '_', '-' or Chinese "
                                "characters (no spaces, dots or slashes)")
    return name


def _write_failed(name: str, e: OSError) -> None:
    """Log the OS error once (for the operator) and raise a message for the user without server paths."""
    logging.getLogger(__name__).warning("saving speaker %r failed: %s", name, e)
    raise SpeakerCacheError(f"could not save the voice '{name}': the server cannot write its speaker folder "
                            f"({e.strerror or type(e).__name__}); the operator must make it writable (or start "
                            "with another --speaker-cache DIR)") from None


class SpeakerCache:
    """Named :class:`PromptFeatures` in a directory, ``<name>.safetensors`` each.

    Writes go to a temporary file in the same directory, are fsynced, then renamed over the target, so a crash
    leaves either the old or the new speaker, never half a file.  Loaded speakers are memoised and reloaded when
    the file's modification time changes (another process may save the same name).  Thread-safe.
    """

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self._lock = threading.Lock()
        self._memo: dict[str, tuple[int, PromptFeatures]] = {}

    def _path(self, name: str) -> Path:
        return self.dir / f"{validate_speaker_name(name)}{_SUFFIX}"

    def list(self) -> list[str]:
        """Saved speaker names, sorted."""
        if not self.dir.is_dir():
            return []
        names = (p.name[: -len(_SUFFIX)] for p in self.dir.iterdir() if p.name.endswith(_SUFFIX) and p.is_file())
        return sorted(n for n in names if _NAME.fullmatch(n))

    def __contains__(self, name: object) -> bool:
        try:
            return self._path(name).is_file()  # type: ignore[arg-type]
        except SpeakerCacheError:
            return False

    def add(self, name: str, prompt: PromptFeatures, overwrite: bool = True) -> Path:
        """Save ``prompt`` as ``name`` (replacing a speaker of the same name unless ``overwrite`` is False)."""
        from safetensors.torch import save

        path = self._path(name)
        clash = [n for n in self.list() if n.lower() == name.lower() and n != name]
        if clash:  # would collide on case-insensitive file systems (macOS, Windows)
            raise SpeakerCacheError(f"a speaker named '{clash[0]}' already exists; names differing only in case "
                                    "are not allowed: pick another name or delete that one first")
        if not overwrite and path.exists():
            raise SpeakerCacheError(f"a speaker named '{name}' already exists: pick another name or delete it first")
        blob = save(prompt.tensors(), metadata={_META_KEY: json.dumps(prompt.metadata(), ensure_ascii=False)})
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.dir)
        except OSError as e:  # read-only or full disk: the operator's to fix; the user gets a sentence, not errno
            _write_failed(name, e)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(e, OSError):
                _write_failed(name, e)
            raise
        with self._lock:
            self._memo.pop(name, None)
        return path

    def get(self, name: str) -> PromptFeatures:
        """The saved speaker ``name``; :class:`SpeakerCacheError` if there is none or its file is damaged."""
        path = self._path(name)
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            known = ", ".join(self.list()) or "none yet"
            raise SpeakerCacheError(f"no saved speaker named '{name}' (saved: {known}): save the voice first") from None
        with self._lock:
            hit = self._memo.get(name)
            if hit is not None and hit[0] == mtime:
                return hit[1]
        prompt = self._load(path, name)
        with self._lock:
            self._memo[name] = (mtime, prompt)
        return prompt

    @staticmethod
    def _load(path: Path, name: str) -> PromptFeatures:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = json.loads((f.metadata() or {})[_META_KEY])
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            return PromptFeatures.from_parts(tensors, metadata)
        except Exception as e:  # noqa: BLE001 - any parse failure means a damaged or foreign file
            raise SpeakerCacheError(f"saved speaker '{name}' is damaged or from an incompatible version "
                                    f"({type(e).__name__}): delete it and save the voice again") from e

    def delete(self, name: str) -> None:
        """Remove the saved speaker ``name``; :class:`SpeakerCacheError` if there is none."""
        path = self._path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise SpeakerCacheError(f"no saved speaker named '{name}' to delete") from None
        with self._lock:
            self._memo.pop(name, None)

    def __len__(self) -> int:
        return len(self.list())
