"""Streaming audio encoders for the HTTP API: float32 chunks in, bytes of one continuous file out.

Every container is written by FFmpeg's muxers through PyAV (no hand-written codec or header): ``wav`` is FFmpeg's
WAV muxer on an output that cannot seek, so it writes the standard unknown-length header (RIFF and data sizes
0xFFFFFFFF, as OpenAI's streamed wav does) and never comes back to patch it; ``opus`` is Ogg Opus with 20 ms pages
(the Ogg muxer otherwise holds a second of audio before writing a page); ``mp3`` (LAME), ``aac`` (ADTS) and
``flac`` their native streams, except that ``flac`` is sent whole at the end (:class:`FlacEncoder`: its header must
carry the length).  ``pcm`` is raw 16-bit little-endian mono at the engine's rate (OpenAI's
``pcm``), a plain sample conversion.  ``flush_packets`` makes each muxed packet leave at once, so the bytes of a
chunk are available as soon as the chunk is encoded.
"""

from __future__ import annotations

import importlib
import io
from dataclasses import dataclass

import numpy as np

FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")


@dataclass(frozen=True)
class Container:
    """FFmpeg muxer, encoder and the HTTP media type of one ``response_format``."""

    muxer: str
    codec: str
    media_type: str
    options: tuple[tuple[str, str], ...] = ()


CONTAINERS = {
    "wav": Container("wav", "pcm_s16le", "audio/wav"),
    "mp3": Container("mp3", "libmp3lame", "audio/mpeg"),
    "opus": Container("ogg", "libopus", "audio/ogg", (("page_duration", "20000"),)),
    "aac": Container("adts", "aac", "audio/aac"),
    "flac": Container("flac", "flac", "audio/flac"),
}
MEDIA_TYPES = {"pcm": "audio/pcm", **{k: c.media_type for k, c in CONTAINERS.items()}}
PACKAGES = {k: "av" for k in CONTAINERS}  # the Python package (PyAV) each format's encoder needs; pcm needs none


def missing_package(fmt: str) -> str | None:
    """The package ``fmt``'s encoder needs and this server lacks, else None: checked before a response starts, so
    a missing PyAV is a 400 naming it rather than a 200 whose body breaks at the first chunk."""
    name = PACKAGES.get(fmt)
    if name is None:
        return None
    try:
        importlib.import_module(name)
    except ImportError:
        return name
    return None


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> int16 (clipped, not normalised: chunks keep one loudness)."""
    return (np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


class StreamEncoder:
    """``encode(chunk)`` -> the bytes that chunk completes; ``finish()`` -> the rest (codec tail, trailer)."""

    def encode(self, samples: np.ndarray) -> bytes:
        raise NotImplementedError

    def finish(self) -> bytes:
        return b""


class PcmEncoder(StreamEncoder):
    def encode(self, samples: np.ndarray) -> bytes:
        return to_pcm16(samples).astype("<i2").tobytes()


class _Sink:
    """A write-only file for PyAV: without ``seek`` the muxers write streaming headers and never rewind."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class AvEncoder(StreamEncoder):
    """One PyAV output container fed chunk by chunk (PyAV resamples to the codec's sample format and frame size)."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        import av

        spec = CONTAINERS[fmt]
        self.sample_rate = sample_rate
        self._sink = self._new_sink()
        self._out = av.open(self._sink, mode="w", format=spec.muxer,
                            options={"flush_packets": "1", **dict(spec.options)})
        self._stream = self._out.add_stream(spec.codec, rate=sample_rate, layout="mono")
        self._pts = 0
        self._closed = False

    def _frame(self, samples: np.ndarray):  # noqa: ANN202 - av.AudioFrame
        import av

        pcm = to_pcm16(samples)
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += len(pcm)
        return frame

    def encode(self, samples: np.ndarray) -> bytes:
        if len(samples):
            for packet in self._stream.encode(self._frame(samples)):
                self._out.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        if not self._closed:
            self._closed = True
            for packet in self._stream.encode(None):
                self._out.mux(packet)
            self._out.close()
        return self._sink.take()

    @staticmethod
    def _new_sink() -> "_Sink | _WholeFile":
        return _Sink()

    def close(self) -> None:
        """Release the container without a proper ending (the client is gone)."""
        if not self._closed:
            self._closed = True
            try:
                self._out.close()
            except Exception:  # noqa: BLE001 - nothing useful left to do with a half-written stream
                pass


class _WholeFile(io.BytesIO):
    """A seekable output whose bytes are handed over only when the container is closed."""

    def take(self) -> bytes:
        return self.getvalue() if self.closed_by_muxer else b""

    closed_by_muxer = False


class FlacEncoder(AvEncoder):
    """FLAC, sent whole at the end: a FLAC stream's STREAMINFO header must carry the total sample count (and MD5)
    for common readers (libsndfile/soundfile read a streamed header's "unknown" length as 2**63 frames and fail),
    and the count is known only at the end, so the muxer writes to a seekable buffer and rewrites the header.
    Ask for ``pcm``, ``wav``, ``opus`` or ``mp3`` to hear audio while it is made."""

    @staticmethod
    def _new_sink() -> _WholeFile:
        return _WholeFile()

    def finish(self) -> bytes:
        if not self._closed:
            self._closed = True
            for packet in self._stream.encode(None):
                self._out.mux(packet)
            self._out.close()
            self._sink.closed_by_muxer = True
        return self._sink.take()


def make_encoder(fmt: str, sample_rate: int) -> StreamEncoder:
    """The encoder of ``response_format`` ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == "pcm":
        return PcmEncoder()
    if fmt not in CONTAINERS:
        raise ValueError(f"response_format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return FlacEncoder(fmt, sample_rate) if fmt == "flac" else AvEncoder(fmt, sample_rate)
