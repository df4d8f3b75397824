"""Cross-fade math for joining consecutive streaming vocoder chunks (pure functions, no state).

Each streaming chunk is vocoded with its predecessor's last frames re-attached in front, so the head of the
new waveform and the held-back tail of the old one cover the same time span.  They are blended with the two
halves of a symmetric Hamming window: the rising half on the new head, the falling half on the old tail.
"""

from __future__ import annotations

import torch
from torch import Tensor


def hamming_fade_window(n_overlap: int, device: torch.device | str | None = None,
                        dtype: torch.dtype = torch.float32) -> Tensor:
    """Symmetric Hamming window of ``2 * n_overlap`` points (numpy's ``np.hamming``); its first half fades
    in, its second half fades out.  Computed in float64, then cast, so fp32 users get correctly rounded taps."""
    if n_overlap <= 0:
        raise ValueError(f"n_overlap must be positive, got {n_overlap}")
    window = torch.hamming_window(2 * n_overlap, periodic=False, dtype=torch.float64, device=device)
    return window.to(dtype)


def fade_in_out(fade_in_wav: Tensor, fade_out_wav: Tensor, window: Tensor) -> Tensor:
    """Blend the tail of ``fade_out_wav`` into the head of ``fade_in_wav`` over ``len(window) // 2`` samples.

    Returns a new tensor shaped like ``fade_in_wav``: head = head * window[:n] + old_tail * window[n:], the
    rest copied.  The blend is computed in the promoted dtype of wav and window (float64 for a float64
    window, like the numpy reference) and rounded once to ``fade_in_wav``'s dtype.
    """
    n = window.shape[0] // 2
    if fade_in_wav.shape[-1] < n or fade_out_wav.shape[-1] < n:
        raise ValueError(f"both waveforms need at least {n} samples to cross-fade")
    window = window.to(fade_in_wav.device)
    head = fade_in_wav[..., :n] * window[:n] + fade_out_wav[..., -n:].to(fade_in_wav.device) * window[n:]
    return torch.cat([head.to(fade_in_wav.dtype), fade_in_wav[..., n:]], dim=-1)
