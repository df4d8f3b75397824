"""Spectral features of a prompt voice, one function per consumer.

* :func:`prompt_mel_24k` — the 80-bin log-magnitude mel at 24 kHz / 50 Hz that the flow model is conditioned on
  (the same analysis that produced its training targets, so it must match bit-for-bit in spirit: magnitude, not
  power; natural log; slaney filters; no centring but a symmetric reflect pad).
* :func:`whisper_log_mel` — the 128-bin Whisper log-mel at 16 kHz / 100 Hz the speech tokenizer was trained on.
* :func:`kaldi_fbank` — Kaldi 80-bin log filterbank at 16 kHz (dither 0), mean-normalised per bin, for the
  CAM++ speaker model.  Computed by kaldi-native-fbank (C++), which implements Kaldi's recipe exactly; it agrees
  with torchaudio's Python port to ~1.5e-4 (float32 accumulation order), without needing torchaudio.

Filter banks and windows are built by pure functions cached with :func:`functools.lru_cache` on their sizes; the
cached arrays are read-only and every call gets its own tensor, so nothing shared can be mutated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class MelSpec:
    """The flow's mel analysis (``feat_extractor`` in cosyvoice2.yaml); defaults are CosyVoice2's."""

    sample_rate: int = 24000
    n_fft: int = 1920
    hop: int = 480
    win: int = 1920
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float = 8000.0
    log_floor: float = 1e-5


PROMPT_MEL = MelSpec()

WHISPER_SR = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160


_F_SP = 200.0 / 3  # Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    return hz / _F_SP if hz < _MIN_LOG_HZ else _MIN_LOG_MEL + float(np.log(hz / _MIN_LOG_HZ)) / _LOGSTEP


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    log_part = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mels - _MIN_LOG_MEL))
    return np.where(mels >= _MIN_LOG_MEL, log_part, _F_SP * mels)


@lru_cache(maxsize=16)
def _slaney_mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None) -> np.ndarray:
    """(n_mels, n_fft//2+1) slaney-scale, slaney-normalised triangles: librosa's ``filters.mel`` defaults,
    bit for bit (same float64 steps, stored into float32 as it does; a test compares them).

    Built here rather than imported: ``librosa.filters`` pulls in scipy.signal and numba, ~1.1 s of every
    process start (measured on the 2-core CI box) for one small matrix."""
    fmax = float(sr) / 2 if fmax is None else fmax
    fft_hz = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_hz = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    gaps = np.diff(mel_hz)
    ramps = np.subtract.outer(mel_hz, fft_hz)
    filters = np.zeros((n_mels, 1 + n_fft // 2), dtype=np.float32)
    for i in range(n_mels):
        filters[i] = np.maximum(0, np.minimum(-ramps[i] / gaps[i], ramps[i + 2] / gaps[i + 1]))
    filters *= (2.0 / (mel_hz[2:n_mels + 2] - mel_hz[:n_mels]))[:, np.newaxis]  # equal area per filter
    filters.setflags(write=False)
    return filters


def mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """A fresh float32 tensor of :func:`_slaney_mel_filters` on ``device``."""
    return torch.tensor(_slaney_mel_filters(sr, n_fft, n_mels, float(fmin), fmax), device=device)


def _as_batch(wav: torch.Tensor | np.ndarray) -> torch.Tensor:
    """(T,) or (1, T) array/tensor -> (1, T) float32 tensor."""
    t = torch.as_tensor(wav, dtype=torch.float32)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"expected a waveform of shape (T,) or (B, T), got {tuple(t.shape)}")
    return t


def prompt_mel_24k(wav24k: torch.Tensor | np.ndarray, spec: MelSpec = PROMPT_MEL) -> torch.Tensor:
    """(1, T) 24 kHz waveform -> (1, 80, frames) natural-log mel magnitudes, ``frames = T // hop``.

    The signal is reflect-padded by (n_fft - hop) / 2 on both sides and framed without centring, which puts frame
    ``i`` around sample ``i * hop + hop / 2`` and yields exactly one frame per hop.  The 1e-9 inside the square
    root keeps the gradient-free magnitude finite for all-zero frames, as in training.
    """
    y = _as_batch(wav24k)
    pad = (spec.n_fft - spec.hop) // 2
    if y.shape[-1] <= pad:
        raise ValueError(f"waveform of {y.shape[-1]} samples is too short for a {spec.n_fft}-point mel frame")
    y = torch.nn.functional.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    window = torch.hann_window(spec.win, device=y.device)
    stft = torch.stft(y, spec.n_fft, hop_length=spec.hop, win_length=spec.win, window=window, center=False,
                      normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(stft.real.pow(2) + stft.imag.pow(2) + 1e-9)
    fb = mel_filters(spec.sample_rate, spec.n_fft, spec.n_mels, spec.fmin, spec.fmax, device=y.device)
    return torch.log(torch.clamp(torch.matmul(fb, magnitude), min=spec.log_floor))


def whisper_log_mel(wav16k: torch.Tensor | np.ndarray, n_mels: int = 128) -> torch.Tensor:
    """(1, T) 16 kHz waveform -> (1, n_mels, T // 160) Whisper log-mel, the speech tokenizer's input.

    Centred 400-point Hann STFT, power spectrum, the last frame dropped (Whisper's convention, so 1 s gives 100
    frames), slaney mel filters, log10 with a 1e-10 floor, dynamic range capped at 80 dB below the maximum of
    the whole input, then scaled by (x + 4) / 4 to roughly [-1, 1].
    """
    y = _as_batch(wav16k)
    window = torch.hann_window(WHISPER_N_FFT, device=y.device)
    stft = torch.stft(y, WHISPER_N_FFT, WHISPER_HOP, window=window, center=True, pad_mode="reflect",
                      return_complex=True)
    power = stft[..., :-1].abs() ** 2
    fb = mel_filters(WHISPER_SR, WHISPER_N_FFT, n_mels, device=y.device)
    log_spec = torch.clamp(fb @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(wav16k: torch.Tensor | np.ndarray, num_mel_bins: int = 80, mean_normalise: bool = True,
                sample_rate: int = 16000) -> torch.Tensor:
    """(T,) or (1, T) waveform in [-1, 1] -> (frames, num_mel_bins) Kaldi log fbank, frames = 1 + (T - 400) // 160.

    Kaldi defaults otherwise (25 ms povey window, 10 ms shift, pre-emphasis 0.97, DC removal, power spectrum,
    20 Hz low cut, snip edges) with dither 0 so the result is deterministic.  With ``mean_normalise`` the
    per-bin mean over frames is subtracted, the speaker model's input normalisation.
    """
    import kaldi_native_fbank as knf

    samples = _as_batch(wav16k)
    if samples.shape[0] != 1:
        raise ValueError("kaldi_fbank takes a single waveform")
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = float(sample_rate)
    opts.frame_opts.dither = 0.0
    opts.mel_opts.num_bins = int(num_mel_bins)
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(float(sample_rate), samples[0].cpu().numpy().tolist())
    fbank.input_finished()
    n = fbank.num_frames_ready
    if n == 0:
        raise ValueError(f"waveform of {samples.shape[1]} samples is shorter than one 25 ms fbank frame")
    feats = torch.from_numpy(np.stack([np.asarray(fbank.get_frame(i), dtype=np.float32) for i in range(n)]))
    if mean_normalise:
        feats = feats - feats.mean(dim=0, keepdim=True)
    return feats
