"""What a caller asks for (``SynthesisRequest``), what the models take (``ModelInputs``), and what comes back
(``AudioChunk``).

The runtime state of a request (generator, caches, cursor, telemetry) lives in :mod:`cosyvoice_fast.runtime`;
this module is plain data and validation, shared by the engine, the CLI, the app and the benchmark.
"""

from __future__ import annotations

import hashlib
import queue
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.frontend.text_source import SourceLimits
from cosyvoice_fast.telemetry.record import ChunkTiming, RequestTelemetry

MODES = ("zero_shot", "cross_lingual", "instruct2", "speaker")
MODE_LABELS = {"zero_shot": "zero-shot (prompt voice + its transcript)",
               "cross_lingual": "cross-lingual (prompt voice, no transcript)",
               "instruct2": "instruct (instruction + prompt voice)",
               "speaker": "saved speaker"}


def _i32(x: Any) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.int32)
    return t.reshape(1, -1) if t.dim() != 2 else t


@dataclass
class ModelInputs:
    """Everything prompt- and text-dependent the three networks need, for one request.

    ``text_segments`` are the target text's token ids, one tensor per segment of a long text (each streamed in
    turn with the same prompt).  ``prompt_text`` / ``llm_prompt_speech_token`` are what the LM sees of the prompt
    (empty in cross-lingual mode; instruct2 puts the instruction in ``prompt_text`` and no prompt speech);
    the flow always gets the prompt's speech tokens, mel and speaker embedding.
    """

    text_segments: list[torch.Tensor]
    prompt_text: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.int32))
    llm_prompt_speech_token: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.int32))
    flow_prompt_speech_token: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.int32))
    prompt_feat: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, 80))
    embedding: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 192))
    speaker: str | None = None
    #: digest of the flow prompt (tokens, mel, embedding): the key of the flow's per-voice prompt state cache
    prompt_key: str | None = None
    #: a stored flow prompt state (``flow.`` entries of a cached speaker's ``extra``), used when it matches
    flow_prompt_state: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.text_segments = [_i32(t) for t in self.text_segments]
        self.prompt_text = _i32(self.prompt_text)
        self.llm_prompt_speech_token = _i32(self.llm_prompt_speech_token)
        self.flow_prompt_speech_token = _i32(self.flow_prompt_speech_token)
        if not self.text_segments or any(t.shape[1] == 0 for t in self.text_segments):
            raise ConfigError("text is empty after tokenisation: type some words to synthesise")
        if self.prompt_feat.dim() != 3 or self.prompt_feat.shape[0] != 1:
            raise ConfigError(f"prompt_feat must be (1, frames, 80), got {tuple(self.prompt_feat.shape)}")
        if self.embedding.dim() != 2 or self.embedding.shape[0] != 1:
            raise ConfigError(f"embedding must be (1, dim), got {tuple(self.embedding.shape)}")
        if self.prompt_key is None and self.flow_prompt_speech_token.shape[1] > 0:
            self.prompt_key = prompt_digest(self.flow_prompt_speech_token, self.prompt_feat, self.embedding)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "ModelInputs":
        """A copy on ``device``; float tensors cast to ``dtype`` when given (token ids stay int32)."""
        def f(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype) if dtype is not None else t.to(device)

        return ModelInputs(text_segments=[t.to(device) for t in self.text_segments],
                           prompt_text=self.prompt_text.to(device),
                           llm_prompt_speech_token=self.llm_prompt_speech_token.to(device),
                           flow_prompt_speech_token=self.flow_prompt_speech_token.to(device),
                           prompt_feat=f(self.prompt_feat), embedding=f(self.embedding), speaker=self.speaker,
                           prompt_key=self.prompt_key, flow_prompt_state=self.flow_prompt_state)


def prompt_digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' shapes and float32/int values (CPU copies; a prompt is a few hundred KB)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu")
        t = t.float() if t.is_floating_point() else t.long()
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class SynthesisRequest:
    """One synthesis job as a caller describes it.  Either ``text`` (+ prompt / speaker) or ready ``inputs``.

    ``max_tokens`` caps speech tokens per segment; with ``ignore_eos`` the LM always runs to ``max_tokens``
    (benchmarks use this to make runs comparable).
    """

    text: str = ""
    mode: str = "zero_shot"
    prompt_wav: str | Path | bytes | np.ndarray | None = None
    prompt_sr: int | None = None
    prompt_text: str = ""
    instruct_text: str = ""
    speaker: str | None = None
    inputs: ModelInputs | None = None
    seed: int = 0
    stream: bool = True
    stream_params: StreamParams = field(default_factory=StreamParams)
    backend: BackendConfig | None = None
    speed: float = 1.0
    max_tokens: int | None = None
    ignore_eos: bool = False
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    #: bi-streaming: the text as it is written (an iterable or async iterable of str pieces, or a queue.Queue
    #: ended by None) instead of ``text``; read under ``source_limits``.  With ``inputs`` (the prompt side) the
    #: pieces are sequences of text-token ids instead (no tokenizer needed)
    text_source: Any = None
    source_limits: SourceLimits = field(default_factory=SourceLimits)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed={self.seed!r}: use a whole number from 0 to 2**63-1")
        if not 0.5 <= float(self.speed) <= 2.0:
            raise ConfigError(f"speed={self.speed!r} is out of range: use 0.5 to 2.0")
        if self.stream and float(self.speed) != 1.0:
            raise ConfigError("speed change works only without streaming: turn streaming off or set speed to 1.0")
        if self.max_tokens is not None and not 1 <= int(self.max_tokens) <= 4000:
            raise ConfigError(f"max_tokens={self.max_tokens!r}: use 1 to 4000")
        if self.ignore_eos and self.max_tokens is None:
            raise ConfigError("ignore_eos needs max_tokens (otherwise the LM would never stop)")
        if self.text_source is not None:
            _check_source(self.text_source)
            if self.text.strip():
                raise ConfigError("give either text or text_source, not both: text_source streams the text in "
                                  "pieces, text is the whole of it")
            if not isinstance(self.source_limits, SourceLimits):
                raise ConfigError(f"source_limits={self.source_limits!r}: use a SourceLimits")
            return
        if self.inputs is None and not self.text.strip():
            raise ConfigError("Text is empty: type something to synthesise.")


def _check_source(source: Any) -> None:
    """A text source must be an iterable/async iterable of str or a queue (a str itself is the whole text)."""
    if isinstance(source, (str, bytes)):
        raise ConfigError("text_source is a whole string: pass it as text, or give an iterator/queue of pieces")
    if not (hasattr(source, "__iter__") or hasattr(source, "__aiter__") or isinstance(source, queue.Queue)):
        raise ConfigError(f"text_source must be an iterator, an async iterator or a queue.Queue of str pieces, "
                          f"got {type(source).__name__}")


@dataclass
class AudioChunk:
    """A piece of the output stream: 24 kHz mono float32 samples, its position, and its timing."""

    samples: np.ndarray
    index: int
    segment: int
    sample_rate: int
    is_last: bool
    timing: ChunkTiming
    telemetry: RequestTelemetry | None = None  # set on the last chunk: the finished request's record

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate
