"""Prompt audio: decode, downmix, resample, trim and validate a user's voice recording.

A prompt voice arrives as a path, raw bytes from an upload or microphone, or an array already in memory.  It is
turned into float32 mono in [-1, 1] and resampled twice from its *original* rate (16 kHz for the speech tokenizer
and speaker model, 24 kHz for the prompt mel), so neither branch inherits the other's resampling error.

Decoding tries ``soundfile`` (libsndfile: WAV, FLAC, OGG/Vorbis, Opus, MP3) first because it is fast, in-process
and exact; formats it cannot read (M4A/AAC, some MP3 or WebM) go through ``audioread``, which uses whatever system
decoder exists (usually ffmpeg).  Resampling uses ``soxr`` at "HQ" quality (librosa's ``soxr_hq``); upstream
CosyVoice uses torchaudio's sinc resampler, which differs from soxr by < 0.01 in amplitude on speech — far below
anything the speech tokenizer or speaker model can notice — and soxr needs no torchaudio.

Every problem a user can cause raises :class:`PromptAudioError` whose message says what was wrong and what to do.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np

AudioSource = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO, np.ndarray]

TOKENIZER_SR = 16000
MEL_SR = 24000


class PromptAudioError(ValueError):
    """The prompt audio cannot be used; the message is meant for the person who supplied it."""


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What a usable prompt looks like.

    ``max_seconds`` is 30 because the speech tokenizer was trained on (and upstream refuses) longer inputs;
    ``min_seconds`` 0.5 because shorter clips give a handful of tokens and an unreliable speaker embedding.
    ``silence_peak`` (about -74 dBFS) separates "silent" from "quiet": anything quieter is only noise floor.
    ``trim_top_db`` and ``trim_margin_s`` say what counts as leading/trailing silence (frames more than 60 dB
    below the loudest frame) and how much of it to keep around the speech, so the first phoneme's onset and the
    last one's decay are not clipped.  ``min_input_sr`` guards against telephone-band or corrupt headers.
    """

    min_seconds: float = 0.5
    max_seconds: float = 30.0
    silence_peak: float = 2e-4
    trim_top_db: float = 60.0
    trim_margin_s: float = 0.1
    min_input_sr: int = 8000


DEFAULT_LIMITS = PromptLimits()


# ----------------------------------------------------------------------------------------------- decoding


def _describe(source: object) -> str:
    if isinstance(source, (str, os.PathLike)):
        return f"'{Path(source).name}'"
    return "the uploaded audio"


def _to_mono(data: np.ndarray) -> np.ndarray:
    """(frames,) or (frames, channels) -> (frames,) float32: channel mean, as upstream does."""
    data = np.asarray(data, dtype=np.float32)
    if data.ndim == 2:
        data = data.mean(axis=1, dtype=np.float32)
    elif data.ndim != 1:
        raise PromptAudioError(f"audio with shape {data.shape} is not a waveform: pass (samples,) or "
                               "(samples, channels)")
    return np.ascontiguousarray(data, dtype=np.float32)


def _read_soundfile(source: object) -> tuple[np.ndarray, int] | None:
    import soundfile as sf

    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            source = io.BytesIO(bytes(source))
        data, sr = sf.read(source, dtype="float32", always_2d=True)
    except Exception:  # noqa: BLE001 - any libsndfile failure means "try the next decoder"
        return None
    return data, int(sr)


def _read_audioread(path: str) -> tuple[np.ndarray, int] | None:
    """Decode with the system decoder (ffmpeg, GStreamer, ...) through audioread; 16-bit PCM blocks."""
    try:
        import audioread
    except ImportError:
        return None
    try:
        with audioread.audio_open(path) as f:
            sr, channels = int(f.samplerate), int(f.channels)
            blocks = [np.frombuffer(b, dtype="<i2") for b in f]
    except Exception:  # noqa: BLE001 - no backend or undecodable: the caller reports it
        return None
    if not blocks or channels < 1 or sr < 1:
        return None
    pcm = np.concatenate(blocks).astype(np.float32) / 32768.0
    return pcm[: len(pcm) // channels * channels].reshape(-1, channels), sr


def _decode(source: AudioSource) -> tuple[np.ndarray, int]:
    what = _describe(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise PromptAudioError(f"prompt audio file {what} does not exist: check the path")
        if path.stat().st_size == 0:
            raise PromptAudioError(f"prompt audio file {what} is empty (0 bytes): record or upload it again")
        got = _read_soundfile(str(path)) or _read_audioread(str(path))
    else:
        if not isinstance(source, (bytes, bytearray, memoryview)):
            source = source.read()  # file-like object
        data = bytes(source)
        if not data:
            raise PromptAudioError("the uploaded prompt audio is empty (0 bytes): record or upload it again")
        got = _read_soundfile(data)
        if got is None:  # audioread needs a real file
            fd, tmp = tempfile.mkstemp(prefix="cosyvoice_prompt_")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                got = _read_audioread(tmp)
            finally:
                os.unlink(tmp)
    if got is None:
        raise PromptAudioError(
            f"could not decode {what} as audio: use a WAV, FLAC, MP3 or OGG file "
            "(M4A and other formats need ffmpeg installed)")
    return got


def load_audio(source: AudioSource, sr: int | None = None) -> tuple[np.ndarray, int]:
    """Decode ``source`` to float32 mono samples and their sample rate (no resampling, no trimming).

    ``source`` is a path, encoded bytes / a binary file object (any format the decoders know), or an array or
    tensor of samples — then ``sr`` is required, integer PCM is scaled to [-1, 1] and (samples, channels) or
    (channels, samples) is downmixed.
    """
    if type(source).__module__.startswith("torch"):  # a tensor, without importing torch here
        source = source.detach().cpu().numpy()  # type: ignore[union-attr]
    if isinstance(source, np.ndarray):
        if sr is None:
            raise PromptAudioError("a waveform array needs its sample rate: pass sr=")
        data = source
        if np.issubdtype(data.dtype, np.integer):  # PCM: signed is two's complement, unsigned is offset binary
            info = np.iinfo(data.dtype)
            half = float(info.max + 1) if info.min < 0 else float(info.max + 1) / 2.0
            data = (data.astype(np.float64) - (0.0 if info.min < 0 else half)) / half
        if data.ndim == 2 and data.shape[0] < data.shape[1] and data.shape[0] <= 8:
            data = data.T  # (channels, samples) as torch / librosa lay it out
        return _to_mono(data), int(sr)
    data, rate = _decode(source)
    return _to_mono(data), rate


# ----------------------------------------------------------------------------------------------- processing


def resample(wav: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Band-limited resampling with soxr "HQ" (what librosa calls ``soxr_hq``); float32 in, float32 out."""
    wav = np.ascontiguousarray(wav, dtype=np.float32)
    if sr_in == sr_out or wav.size == 0:
        return wav.copy()
    import soxr

    return np.ascontiguousarray(soxr.resample(wav, sr_in, sr_out, quality="HQ"), dtype=np.float32)


def speech_bounds(wav: np.ndarray, sr: int, top_db: float = 60.0, margin_s: float = 0.1) -> tuple[int, int]:
    """[start, end) sample range of ``wav`` without leading/trailing silence.

    A 25 ms frame (10 ms hop) counts as sound when its RMS is within ``top_db`` of the loudest frame — the
    relative threshold makes it work at any recording level.  ``margin_s`` of the surrounding audio is kept.
    """
    n = len(wav)
    frame, hop = max(1, int(0.025 * sr)), max(1, int(0.010 * sr))
    if n <= frame:
        return 0, n
    n_frames = 1 + (n - frame) // hop
    idx = np.arange(frame)[None, :] + hop * np.arange(n_frames)[:, None]
    rms = np.sqrt(np.mean(np.square(wav[idx], dtype=np.float64), axis=1))
    loud = np.flatnonzero(rms > rms.max() * 10.0 ** (-top_db / 20.0))
    if loud.size == 0:
        return 0, n
    margin = int(round(margin_s * sr))
    start = max(0, int(loud[0]) * hop - margin)
    end = min(n, int(loud[-1]) * hop + frame + margin)
    return start, end


def trim_silence(wav: np.ndarray, sr: int, top_db: float = 60.0, margin_s: float = 0.1) -> np.ndarray:
    """``wav`` without leading/trailing silence (see :func:`speech_bounds`); inner pauses are kept."""
    start, end = speech_bounds(wav, sr, top_db, margin_s)
    return wav[start:end]


def validate_and_trim(wav: np.ndarray, sr: int, limits: PromptLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Reject unusable audio with a message for the user; return the trimmed waveform at the same rate."""
    if sr < limits.min_input_sr:
        raise PromptAudioError(f"the prompt audio's sample rate is {sr} Hz, below the minimum of "
                               f"{limits.min_input_sr} Hz: record or export it at 16 kHz or more")
    if wav.size == 0:
        raise PromptAudioError("the prompt audio contains no samples: record or upload it again")
    if not np.all(np.isfinite(wav)):
        raise PromptAudioError("the prompt audio contains invalid samples (NaN or infinity): export it again as "
                               "16-bit WAV")
    peak = float(np.max(np.abs(wav)))
    if peak < limits.silence_peak:
        raise PromptAudioError("the prompt audio is silent: check the microphone or pick a recording in which "
                               "the speaker can be heard")
    if peak > 1.0:  # float files may exceed full scale; the features assume [-1, 1]
        wav = wav / peak
    wav = trim_silence(wav, sr, limits.trim_top_db, limits.trim_margin_s)
    seconds = len(wav) / sr
    if seconds < limits.min_seconds:
        raise PromptAudioError(f"the prompt audio is too short: {seconds:.2f} s long after trimming silence, "
                               f"at least {limits.min_seconds:g} s is needed (3 to 10 s of clear speech works best)")
    if seconds > limits.max_seconds:
        raise PromptAudioError(f"the prompt audio is too long: {seconds:.1f} s after trimming silence, at most "
                               f"{limits.max_seconds:g} s is supported: cut it to 3 to 10 s of clear speech")
    return np.ascontiguousarray(wav, dtype=np.float32)


def prepare_prompt(wav: np.ndarray, sr: int, limits: PromptLimits = DEFAULT_LIMITS) -> tuple[np.ndarray, np.ndarray]:
    """Validated, trimmed mono prompt -> (16 kHz, 24 kHz) float32 waveforms, both resampled from ``sr``."""
    wav = validate_and_trim(_to_mono(wav), int(sr), limits)
    return resample(wav, sr, TOKENIZER_SR), resample(wav, sr, MEL_SR)


def load_prompt(source: AudioSource, sr: int | None = None,
                limits: PromptLimits = DEFAULT_LIMITS) -> tuple[np.ndarray, np.ndarray]:
    """:func:`load_audio` + :func:`prepare_prompt`: any prompt source -> (16 kHz, 24 kHz) waveforms."""
    wav, rate = load_audio(source, sr)
    return prepare_prompt(wav, rate, limits)
