"""``POST /v1/audio/speech`` bodies: OpenAI's fields plus ours, validated into a :class:`SpeechParams`, then a
:class:`~cosyvoice_fast.frontend.request.SynthesisRequest`.  Every refusal is an :class:`ApiError` naming the field
(OpenAI's ``param``) and saying what to send instead.

OpenAI fields: ``model`` (any name; one model is served), ``input``, ``voice``, ``response_format``, ``speed``,
``stream_format``, ``instructions`` (= ``instruction``).  Extensions: ``mode``, ``prompt_audio`` (base64 in JSON,
a file part in multipart), ``prompt_text``, ``instruction``, ``seed``, ``token_hop_len_first``, ``token_hop_len``,
``pre_lookahead_len``, ``stream_scale_factor``, ``max_tokens``, ``backends`` (``{"llm", "flow", "vocoder",
"dtype", "incremental"}`` or ``"llm/flow/vocoder"``), ``request_id`` (a client's own id, e.g. the page's).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from cosyvoice_fast.serving.voices import bundled_voices
from cosyvoice_fast.serving.audio_encode import FORMATS, missing_package
from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.frontend.request import MODES, SynthesisRequest

MAX_INPUT_CHARS = 4096
MAX_PROMPT_BYTES = 10 * 2**20
MAX_BODY_BYTES = MAX_PROMPT_BYTES * 4 // 3 + 2**20  # a base64 prompt at the limit plus the other fields
STREAM_FORMATS = ("audio", "sse")
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_INT_FIELDS = ("seed", "token_hop_len_first", "token_hop_len", "pre_lookahead_len", "max_tokens")
_FIELDS = {"model", "input", "voice", "response_format", "speed", "stream_format", "instructions", "mode",
           "prompt_audio", "prompt_text", "instruction", "stream_scale_factor", "backends", "request_id",
           *_INT_FIELDS}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 408: "timeout_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


def short(value: Any, limit: int = 40) -> str:
    """``repr`` of a client's string, cut to ``limit`` characters (a 10,000-character name is never echoed)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"…' ({len(str(value))} characters)"


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def require_encoder(response_format: str) -> None:
    """Refuse (400, naming the package) a ``response_format`` whose encoder's package is not installed here."""
    name = missing_package(response_format)
    if name is not None:
        raise bad("response_format", f"response_format {response_format!r} needs the Python package {name!r}, "
                                     f"which is not installed on this server (pip install {name}, or pip install "
                                     "-r requirements.txt): ask for response_format 'pcm', which needs nothing",
                  code="format_unavailable")


@dataclass(frozen=True)
class SpeechParams:
    """A validated speech request (errors name the field)."""

    input: str
    model: str = "cosyvoice2"
    voice: str | None = None
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: str = "audio"
    mode: str | None = None
    prompt_audio: bytes | None = None
    prompt_text: str = ""
    instruction: str = ""
    seed: int = 0
    token_hop_len_first: int = 25
    token_hop_len: int = 25
    pre_lookahead_len: int = 3
    stream_scale_factor: float = 2.0
    max_tokens: int | None = None
    backends: Mapping[str, Any] = field(default_factory=dict)
    request_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.input, str) or not self.input.strip():
            raise bad("input", "input is empty: send the text to speak in 'input'")
        if len(self.input) > MAX_INPUT_CHARS:
            raise ApiError(413, f"input is {len(self.input)} characters long; at most {MAX_INPUT_CHARS} are "
                                "accepted per request: split the text", param="input", code="input_too_long")
        for name, text in (("prompt_text", self.prompt_text), ("instruction", self.instruction)):
            if isinstance(text, str) and len(text) > MAX_INPUT_CHARS:
                raise ApiError(413, f"{name} is {len(text)} characters long; at most {MAX_INPUT_CHARS} are accepted "
                                    f"(a prompt's transcript or an instruction is a sentence or two)", param=name,
                               code="input_too_long")
        if self.voice is not None and len(self.voice) > 200:
            raise bad("voice", f"voice is {len(self.voice)} characters long: name a voice from GET /v1/audio/voices")
        if self.response_format not in FORMATS:
            raise bad("response_format", f"response_format {self.response_format!r} is not supported: choose "
                                         f"one of {', '.join(FORMATS)}")
        if self.stream_format not in STREAM_FORMATS:
            raise bad("stream_format", f"stream_format {self.stream_format!r}: choose 'audio' or 'sse'")
        if not 0.5 <= self.speed <= 2.0:
            raise bad("speed", f"speed {self.speed!r} is out of range: use 0.5 to 2.0")
        if self.mode is not None and self.mode not in MODES:
            raise bad("mode", f"mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.prompt_audio is not None and len(self.prompt_audio) > MAX_PROMPT_BYTES:
            raise ApiError(413, f"prompt_audio is {len(self.prompt_audio) / 2**20:.1f} MB; at most "
                                f"{MAX_PROMPT_BYTES // 2**20} MB are accepted: send 3 to 10 s of speech",
                           param="prompt_audio", code="prompt_too_large")
        if self.request_id is not None and not _ID.match(self.request_id):
            raise bad("request_id", "request_id must be 1 to 64 letters, digits, '-' or '_'")
        if self.voice is None and self.prompt_audio is None:
            raise bad("voice", "no voice: name one in 'voice' (GET /v1/audio/voices lists them) or send "
                               "'prompt_audio'")


def _typed(name: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind``; strings are accepted for numbers (multipart forms carry only strings)."""
    if value is None:
        return None
    try:
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
    except (TypeError, ValueError):
        raise bad(name, f"{name} must be a {'whole ' if kind is int else ''}number, got {value!r}") from None
    if not isinstance(value, kind):
        raise bad(name, f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _prompt_bytes(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise bad("prompt_audio", "prompt_audio must be a base64 string (or a file part of a multipart form)")
    if len(value) > MAX_BODY_BYTES:
        raise ApiError(413, "prompt_audio is larger than 10 MB: send 3 to 10 s of speech", param="prompt_audio",
                       code="prompt_too_large")
    try:
        return base64.b64decode(value.split(",", 1)[-1] if value.startswith("data:") else value, validate=True)
    except (binascii.Error, ValueError):
        raise bad("prompt_audio", "prompt_audio is not valid base64: encode the audio file's bytes") from None


def _backends(value: Any) -> dict[str, Any]:
    if value in (None, "", {}):
        return {}
    if isinstance(value, str):
        parts = value.split("/")
        if len(parts) != 3:
            raise bad("backends", "backends as a string is 'llm/flow/vocoder', e.g. 'eager/eager/eager'")
        return dict(zip(("llm", "flow", "vocoder"), parts))
    if not isinstance(value, Mapping):
        raise bad("backends", "backends must be an object {llm, flow, vocoder, dtype, incremental} or "
                              "'llm/flow/vocoder'")
    unknown = set(value) - {"llm", "flow", "vocoder", "dtype", "incremental"}
    if unknown:
        raise bad("backends", f"backends has unknown keys {sorted(unknown)}: use llm, flow, vocoder, dtype, "
                              "incremental")
    return dict(value)


def parse_speech(body: Mapping[str, Any]) -> SpeechParams:
    """A JSON object or a multipart form (``prompt_audio`` already read as bytes) -> :class:`SpeechParams`."""
    if not isinstance(body, Mapping):
        raise bad("body", "the body must be a JSON object (or a multipart form)")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise bad(unknown[0][:64], f"unknown field {short(unknown[0])}; accepted fields: "
                                   f"{', '.join(sorted(_FIELDS))}",
                  code="unknown_field")
    if "input" not in body:
        raise bad("input", "'input' is missing: send the text to speak", code="missing_field")
    ints = {k: _typed(k, body[k], int) for k in _INT_FIELDS if body.get(k) not in (None, "")}
    for k in ("speed", "stream_scale_factor"):
        if body.get(k) not in (None, ""):
            ints[k] = _typed(k, body[k], float)
    strs = {k: _typed(k, body[k], str) for k in ("input", "model", "voice", "response_format", "stream_format",
                                                  "mode", "prompt_text", "request_id") if body.get(k) is not None}
    instruction = body.get("instruction") or body.get("instructions") or ""
    return SpeechParams(**strs, **ints, instruction=_typed("instruction", instruction, str),
                        prompt_audio=_prompt_bytes(body.get("prompt_audio")),
                        backends=_backends(body.get("backends")))


def synthesis_request(p: SpeechParams, speakers: list[str], default_backend: BackendConfig) -> SynthesisRequest:
    """The engine request of ``p``: ``voice`` is a saved speaker or a bundled voice; ``prompt_audio`` overrides
    the voice's recording.  Streaming is on unless ``speed`` ≠ 1 (speed change needs the whole utterance)."""
    mode, wav, transcript, speaker = p.mode, p.prompt_audio, p.prompt_text, None
    if wav is None:
        bundled = bundled_voices()
        if p.voice in speakers:
            speaker, mode = p.voice, mode or "speaker"
        elif p.voice in bundled:
            v = bundled[p.voice]
            wav, transcript = str(v.path), transcript or v.transcript
            mode = mode or v.mode
        else:
            names = speakers + [n for n in bundled if n not in speakers]
            raise ApiError(400, f"voice {short(p.voice)} is not known here; choose one of "
                                f"{', '.join(names) or '(none)'} (GET /v1/audio/voices) or send prompt_audio", param="voice", code="voice_not_found")
    mode = mode or ("zero_shot" if transcript.strip() else "cross_lingual")
    if mode == "speaker" and speaker is None:
        raise bad("mode", "mode 'speaker' needs 'voice' to name a saved speaker")
    if mode == "zero_shot" and not transcript.strip():
        raise bad("prompt_text", "zero_shot needs the prompt's transcript in 'prompt_text' (or use mode "
                                 "'cross_lingual')")
    if mode == "instruct2" and not p.instruction.strip():
        raise bad("instruction", "mode 'instruct2' needs an 'instruction', e.g. 'Speak slowly and calmly.'")
    try:
        params = StreamParams(token_hop_len_first=p.token_hop_len_first, token_hop_len=p.token_hop_len,
                              pre_lookahead_len=p.pre_lookahead_len, stream_scale_factor=p.stream_scale_factor,
                              token_max_hop_len=max(100, p.token_hop_len))
    except ValueError as e:
        raise bad(str(e).split("=", 1)[0], str(e)) from None
    b = p.backends
    try:
        backend = BackendConfig(llm=b.get("llm", default_backend.llm), flow=b.get("flow", default_backend.flow),
                                vocoder=b.get("vocoder", default_backend.vocoder),
                                dtype=b.get("dtype", default_backend.dtype),
                                incremental=bool(b.get("incremental", default_backend.incremental)))
    except ValueError as e:
        raise bad("backends", str(e)) from None
    extra = {"request_id": p.request_id} if p.request_id else {}
    try:
        return SynthesisRequest(text=p.input, mode=mode, prompt_wav=wav if speaker is None else None,
                                prompt_text=transcript if mode == "zero_shot" else "",
                                instruct_text=p.instruction if mode == "instruct2" else "", speaker=speaker,
                                seed=p.seed, stream=p.speed == 1.0, stream_params=params, backend=backend,
                                speed=p.speed, max_tokens=p.max_tokens, **extra)
    except ValueError as e:
        msg = str(e)
        param = next((f for f in ("seed", "max_tokens", "speed") if msg.startswith(f)), "input")
        raise bad(param, msg) from None
