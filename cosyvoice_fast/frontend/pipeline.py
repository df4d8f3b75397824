"""The frontend as the engine sees it: a :class:`SynthesisRequest` in, one :class:`ModelInputs` out.

It ties the pieces of this package together per mode, with CosyVoice2's LM-input layout (CosyVoice3 writes its
prompt texts with a system prompt: the family's :class:`~cosyvoice_fast.frontend.prompt_rules.PromptRules`):

==============  ==============================  =====================  ==========================================
mode            LM prompt text                  LM prompt speech       flow (tokens, mel, embedding)
==============  ==============================  =====================  ==========================================
zero_shot       transcript of the prompt        prompt speech tokens   the prompt's
cross_lingual   none                            none                   the prompt's
instruct2       instruction + <|endofprompt|>   none                   the prompt's
speaker         as saved (zero-shot layout with a transcript, cross-lingual without)
==============  ==============================  =====================  ==========================================

Prompt work (decode, resample, log-mel, two ONNX models) costs tens to hundreds of milliseconds, so it is done
once per voice: saved speakers skip it entirely, and a small in-memory LRU keyed by the audio's content hash
lets a user who re-submits the same upload (the common case in a demo) skip it too.  Both count as a
``speaker_cache_hit`` in the request's telemetry.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.frontend.audio import DEFAULT_LIMITS, AudioSource, PromptAudioError, PromptLimits
from cosyvoice_fast.frontend.prompt_rules import COSYVOICE2_RULES, END_OF_PROMPT, PromptRules
from cosyvoice_fast.frontend.speaker import (
    OnnxSpeakerEmbedder, OnnxSpeechTokenizer, PromptFeatures, SpeakerCache, SpeakerCacheError, extract_prompt,
    validate_speaker_name,
)
from cosyvoice_fast.frontend.text import DEFAULT_MAX_CHARS, TextTokenizer, normalize, normalize_and_split
from cosyvoice_fast.frontend.text_normalize import WetextTN
from cosyvoice_fast.frontend.text_stream import IncrementalText

PROMPT_SAMPLE_RATE = 24000  # the prompt mel's rate; CosyVoice2's flow and HiFT run at 24 kHz


#: ``PromptFeatures.extra`` keys under this prefix hold the voice's flow prompt state (incremental flow)
FLOW_STATE_PREFIX = "flow."


@dataclass
class FrontendConfig:
    """Limits and knobs of the frontend (defaults follow the reference frontend)."""

    max_chars: int = DEFAULT_MAX_CHARS
    split_max_tokens: int = 80
    split_min_tokens: int = 60
    split_merge_len: int = 20
    text_frontend: bool = True  # False: text is only cleaned, not normalised or split (pre-normalised input)
    normalizer: str = "auto"  # "auto": wetext when installed and working, else the built-in rules; "builtin"
    prompt_lru_size: int = 16
    onnx_device: str = "auto"
    token_mel_ratio: int = 2
    limits: PromptLimits = field(default_factory=lambda: DEFAULT_LIMITS)


@dataclass(frozen=True)
class PromptSide:
    """The prompt half of a request's model inputs (features, the LM layout's mode, prompt text ids) and
    whether it came from a cache; :meth:`model_inputs` adds the text.  ``lm_prefix``: ids the LM must see
    before the text when the mode gives it no prompt text (CosyVoice3's system prompt in cross-lingual mode)."""

    prompt: PromptFeatures
    mode: str
    prompt_text: torch.Tensor | None
    speaker: str | None
    cache_hit: bool
    lm_prefix: torch.Tensor | None = None

    def model_inputs(self, segments: list[torch.Tensor]) -> ModelInputs:
        return Frontend.build_inputs(segments, self.prompt, self.mode, self.prompt_text, speaker=self.speaker)

    @property
    def lm_prompt(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt text ids, prompt speech tokens) as the LM sees them (see the module table), each (1, n)."""
        empty = torch.zeros(1, 0, dtype=torch.int32)
        text = self.prompt_text if self.prompt_text is not None and self.mode in ("zero_shot", "instruct2") else empty
        if self.mode == "cross_lingual" and self.lm_prefix is not None:  # a bi-streamed text: the prefix leads it
            text = self.lm_prefix
        return text, self.prompt.speech_token if self.mode == "zero_shot" else empty


def _content_key(source: AudioSource, sr: int | None) -> str | None:
    """A hash of the prompt's bytes (file content, raw bytes or samples + rate); None if it cannot be read."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(source, np.ndarray):
        h.update(str((source.dtype.str, source.shape, sr)).encode())
        h.update(np.ascontiguousarray(source).tobytes())
    elif isinstance(source, (bytes, bytearray, memoryview)):
        h.update(bytes(source))
    else:
        try:
            with open(source, "rb") as f:  # noqa: PTH123 - str or Path
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        except (OSError, TypeError):
            return None  # load_audio will report the problem with a proper message
        h.update(str(sr).encode())
    return h.hexdigest()


class Frontend:
    """Text + prompt voice (or saved speaker) -> :class:`ModelInputs`.  Thread-safe; one per engine."""

    def __init__(self, tokenizer: TextTokenizer, speech_tokenizer: OnnxSpeechTokenizer,
                 embedder: OnnxSpeakerEmbedder, speakers: SpeakerCache | None = None,
                 config: FrontendConfig | None = None, rules: PromptRules = COSYVOICE2_RULES) -> None:
        self.tokenizer = tokenizer
        self.rules = rules  # the model family's prompt-text rules (see frontend.prompt_rules)
        self.speech_tokenizer = speech_tokenizer
        self.embedder = embedder
        self.speakers = speakers
        self.config = config or FrontendConfig()
        if self.config.normalizer not in ("auto", "builtin"):
            raise ValueError(f"normalizer={self.config.normalizer!r}: use 'auto' or 'builtin'")
        self.tn = WetextTN.load() if self.config.normalizer == "auto" else None
        self._lru: OrderedDict[str, PromptFeatures] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, root: str | Path, speaker_cache_dir: str | Path | None = "speakers",
                       sample_rate: int = PROMPT_SAMPLE_RATE, config: FrontendConfig | None = None,
                       rules: PromptRules = COSYVOICE2_RULES) -> "Frontend":
        """Load the tokenizer now and the ONNX models lazily (a saved-speaker request never needs them);
        ``rules``: the model family's (``prompt_rules.rules_for_family``), CosyVoice2's by default."""
        if sample_rate != PROMPT_SAMPLE_RATE:
            raise ValueError(f"sample_rate {sample_rate}: the CosyVoice2 frontend computes a 24 kHz prompt mel; "
                             "is this a CosyVoice2 model directory?")
        cfg = config or FrontendConfig()
        root = Path(root)
        return cls(TextTokenizer.from_dir(root, special_tokens=rules.special_tokens),
                   OnnxSpeechTokenizer(root / rules.speech_tokenizer_file, device=cfg.onnx_device),
                   OnnxSpeakerEmbedder(root / "campplus.onnx", device=cfg.onnx_device),
                   SpeakerCache(speaker_cache_dir) if speaker_cache_dir is not None else None, cfg, rules)

    # ------------------------------------------------------------------------------------------------ text

    def text_segments(self, text: str) -> list[torch.Tensor]:
        """Normalise and split ``text``; one (1, n) int32 id tensor per segment."""
        c = self.config
        pieces = normalize_and_split(text, self.tokenizer.encode, text_frontend=c.text_frontend
                                     and not self.rules.as_written(text),
                                     max_chars=c.max_chars, tn=self.tn, max_tokens=c.split_max_tokens,
                                     min_tokens=c.split_min_tokens, merge_len=c.split_merge_len)
        return [self._ids(p) for p in pieces]

    def encode_prompt_text(self, text: str) -> torch.Tensor:
        """A transcript or instruction: normalised as one piece (never split), then tokenised."""
        text = text.strip()
        if self.config.text_frontend and not self.rules.as_written(text):
            text = normalize(text, max_chars=self.config.max_chars, tn=self.tn)
        return self._ids(text)

    def _ids(self, text: str) -> torch.Tensor:
        return torch.tensor([self.tokenizer.encode(text)], dtype=torch.int32)

    # ------------------------------------------------------------------------------------------------ prompt

    def prompt_features(self, source: AudioSource, sr: int | None = None) -> tuple[PromptFeatures, bool]:
        """Prompt audio -> its features, from the in-memory LRU when this exact audio was seen; (features, hit)."""
        key = _content_key(source, sr) if self.config.prompt_lru_size > 0 else None
        if key is not None:
            with self._lock:
                hit = self._lru.get(key)
                if hit is not None:
                    self._lru.move_to_end(key)
                    return hit, True
        feats = extract_prompt(source, sr, self.speech_tokenizer, self.embedder,
                               token_mel_ratio=self.config.token_mel_ratio, limits=self.config.limits)
        if key is not None:
            with self._lock:
                self._lru[key] = feats
                while len(self._lru) > self.config.prompt_lru_size:
                    self._lru.popitem(last=False)
        return feats, False

    # ------------------------------------------------------------------------------------------------ speakers

    def _cache(self) -> SpeakerCache:
        if self.speakers is None:
            raise SpeakerCacheError("this server runs without a speaker cache directory: saved voices are disabled")
        return self.speakers

    def add_speaker(self, name: str, source: AudioSource, sr: int | None = None, transcript: str = "",
                    overwrite: bool = True) -> PromptFeatures:
        """Compute everything prompt-dependent once and save it as ``name`` (transcript optional)."""
        cache = self._cache()
        validate_speaker_name(name)  # before the expensive part
        feats, _ = self.prompt_features(source, sr)
        transcript = transcript.strip()
        saved = PromptFeatures(speech_token=feats.speech_token, speech_feat=feats.speech_feat,
                               embedding=feats.embedding, prompt_text=transcript,
                               prompt_text_tokens=self.encode_prompt_text(self.rules.zero_shot_prompt_text(transcript))
                               if transcript else None,
                               token_mel_ratio=feats.token_mel_ratio, extra=dict(feats.extra), meta=dict(feats.meta))
        cache.add(name, saved, overwrite=overwrite)
        return saved

    def delete_speaker(self, name: str) -> None:
        self._cache().delete(name)

    def list_speakers(self) -> list[str]:
        return self.speakers.list() if self.speakers is not None else []

    # ------------------------------------------------------------------------------------------------ requests

    def prepare(self, request: SynthesisRequest) -> tuple[ModelInputs, bool]:
        """The request's model inputs and whether the prompt came from a cache (saved speaker or LRU)."""
        segments = self.text_segments(request.text)
        side = self.prepare_prompt(request)
        if side.mode == "cross_lingual" and side.lm_prefix is not None and END_OF_PROMPT not in request.text:
            segments = [torch.cat([side.lm_prefix, s], dim=1) for s in segments]  # each piece opens with it
        return side.model_inputs(segments), side.cache_hit

    def prepare_prompt(self, request: SynthesisRequest) -> "PromptSide":
        """Everything the request's voice and mode contribute, without its text: done once per request, so a
        bi-streamed text (which arrives later, in pieces) never waits for prompt work after its first piece.
        Reads only the prompt fields of ``request`` (mode, prompt audio, transcript, instruction, speaker)."""
        mode = request.mode
        if mode == "speaker":
            if not request.speaker:
                raise SpeakerCacheError("mode 'speaker' needs a saved speaker name: pick one or save a voice first")
            prompt = self._cache().get(request.speaker)
            has_text = prompt.prompt_text_tokens is not None and prompt.prompt_text_tokens.shape[1] > 0
            return PromptSide(prompt, "zero_shot" if has_text else "cross_lingual", prompt.prompt_text_tokens,
                              request.speaker, True, None if has_text else self._lm_prefix())
        if request.prompt_wav is None:
            raise PromptAudioError(f"mode '{mode}' needs a prompt voice: upload or record 3 to 10 s of clear speech")
        prompt_text = None
        if mode == "zero_shot":
            if not request.prompt_text.strip():
                raise ValueError("zero-shot mode needs the prompt's transcript (what is said in the prompt audio); "
                                 "without one use cross-lingual mode")
            prompt_text = self.encode_prompt_text(self.rules.zero_shot_prompt_text(request.prompt_text))
        elif mode == "instruct2":
            instruct = request.instruct_text.strip()
            if not instruct:
                raise ValueError("instruct mode needs an instruction, e.g. 'Speak slowly and calmly.'")
            prompt_text = self.encode_prompt_text(self.rules.instruct_prompt_text(instruct))
        prompt, hit = self.prompt_features(request.prompt_wav, request.prompt_sr)
        return PromptSide(prompt, mode, prompt_text, None, hit, self._lm_prefix() if mode == "cross_lingual" else None)

    def _lm_prefix(self) -> torch.Tensor | None:
        """The family's cross-lingual prefix as ids (None where it has none)."""
        prefix = self.rules.cross_lingual_prefix
        return self._ids(prefix) if prefix else None

    def text_stream(self, lang: str | None = None) -> IncrementalText:
        """An incremental normaliser + tokeniser with this frontend's tokenizer, rules and length limit."""
        return IncrementalText(self.tokenizer, lang=lang, max_chars=self.config.max_chars, tn=self.tn)

    @staticmethod
    def build_inputs(segments: list[torch.Tensor], prompt: PromptFeatures, mode: str,
                     prompt_text: torch.Tensor | None = None, speaker: str | None = None) -> ModelInputs:
        """Assemble :class:`ModelInputs` for ``mode`` (see the module table): only zero-shot shows the LM the
        prompt's speech tokens; the flow always gets them with the prompt mel and speaker embedding, and a
        stored flow prompt state (``extra`` entries ``flow.*``, see ``Engine.store_flow_state``) when there is one."""
        empty = torch.zeros(1, 0, dtype=torch.int32)
        text = prompt_text if prompt_text is not None and mode in ("zero_shot", "instruct2") else empty
        return ModelInputs(text_segments=segments, prompt_text=text,
                           llm_prompt_speech_token=prompt.speech_token if mode == "zero_shot" else empty,
                           flow_prompt_speech_token=prompt.speech_token, prompt_feat=prompt.speech_feat,
                           embedding=prompt.embedding, speaker=speaker,
                           flow_prompt_state={k[len(FLOW_STATE_PREFIX):]: v for k, v in prompt.extra.items()
                                              if k.startswith(FLOW_STATE_PREFIX)} or None)
