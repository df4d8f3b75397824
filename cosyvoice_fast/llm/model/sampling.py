"""Speech-token samplers: nucleus (top-p within top-k), full-distribution random, and repetition-aware (RAS).

Every draw goes through an explicit ``torch.Generator`` so each request owns its randomness: two seeded
requests interleaved on one thread give the same tokens as each run alone.

Relation to upstream's global-RNG sampler (``cosyvoice.utils.common``): the candidate set, the order of the
candidates (stable descending sort of ``softmax(logp)``), the un-normalised candidate probabilities and the
single ``torch.multinomial(..., 1, replacement=True)`` call per draw are the same, so on CPU a
``torch.Generator().manual_seed(s)`` reproduces upstream after ``torch.manual_seed(s)`` draw for draw.  This
holds only while the tensors handed to ``multinomial`` have exactly upstream's length: for one sample torch
draws one exponential variate *per element* (``argmax(p / q)``, ``q ~ Exp(1)``), so padding the candidates to
a fixed ``top_k`` would give equally distributed but different draws and shift the stream afterwards.
A CUDA generator has its own stream, so draws on GPU differ from CPU draws with the same seed
(``_draw`` runs on the generator's device, so a CPU generator keeps CPU draws even for GPU log-probs).

Probabilities are always computed in fp32 (upstream computes them in the logits' dtype, fp32 in practice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch


class Sampler(Protocol):
    """Picks the next token id from fp32 log-probs (V,) given the tokens emitted so far."""

    def __call__(self, logp: torch.Tensor, history: Sequence[int], generator: torch.Generator) -> int: ...


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One categorical draw from (un-normalised) ``probs`` on the generator's device."""
    probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, replacement=True, generator=generator).item())


def _nucleus_size(sorted_probs: np.ndarray, top_p: float) -> int:
    """How many leading candidates to keep: accumulate in fp32, one addition at a time, and keep taking while
    the running mass is still below ``top_p``.  A running fp32 sum is used on purpose (``torch.cumsum`` on CPU
    accumulates in fp64), so the cut-off is bit-identical to upstream's loop even at the boundary."""
    limit = np.float32(top_p)
    total = np.float32(0.0)
    n = 0
    for p in sorted_probs:
        if not total < limit:
            break
        total = np.float32(total + p)
        n += 1
    return max(n, 1)


def nucleus_sample(logp: torch.Tensor, generator: torch.Generator, top_p: float = 0.8, top_k: int = 25) -> int:
    """Sample among the most likely tokens: take them in order while the mass so far is < ``top_p`` and fewer
    than ``top_k`` are taken (so the token that crosses ``top_p`` is included), then draw in proportion."""
    probs = logp.float().softmax(dim=0)
    k = min(top_k, probs.numel())
    sorted_p, sorted_idx = probs.sort(descending=True, stable=True)
    head_p, head_idx = sorted_p[:k], sorted_idx[:k]
    n = _nucleus_size(head_p.cpu().numpy(), top_p)
    choice = _draw(head_p[:n], generator)
    return int(head_idx[choice].item())


def random_sample(logp: torch.Tensor, generator: torch.Generator) -> int:
    """Sample from the full distribution ``softmax(logp)``."""
    return _draw(logp.float().softmax(dim=0), generator)


def ras_sample(logp: torch.Tensor, history: Sequence[int], generator: torch.Generator, top_p: float = 0.8,
               top_k: int = 25, win_size: int = 10, tau_r: float = 0.1) -> int:
    """Repetition-aware sampling (VALL-E 2): a nucleus draw, unless that token already occurs at least
    ``win_size * tau_r`` times among the last ``win_size`` emitted tokens; then the token is banned and a
    draw is made from the full remaining distribution, which breaks the loops nucleus sampling falls into."""
    token = nucleus_sample(logp, generator, top_p, top_k)
    window = list(history[-win_size:]) if win_size > 0 else []
    if window.count(token) >= win_size * tau_r:
        banned = logp.float().clone()
        banned[token] = -float("inf")
        token = random_sample(banned, generator)
    return token


def greedy_sample(logp: torch.Tensor, history: Sequence[int], generator: torch.Generator) -> int:
    """Argmax; ignores history and generator (for tests and deterministic debugging)."""
    return int(logp.argmax().item())


@dataclass(frozen=True, slots=True)
class RasSampler:
    """:func:`ras_sample` with fixed parameters (CosyVoice2's defaults), usable as a :class:`Sampler`."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    def __call__(self, logp: torch.Tensor, history: Sequence[int], generator: torch.Generator) -> int:
        return ras_sample(logp, history, generator, self.top_p, self.top_k, self.win_size, self.tau_r)


@dataclass(frozen=True, slots=True)
class NucleusSampler:
    """:func:`nucleus_sample` as a :class:`Sampler` (no repetition check)."""

    top_p: float = 0.8
    top_k: int = 25

    def __call__(self, logp: torch.Tensor, history: Sequence[int], generator: torch.Generator) -> int:
        return nucleus_sample(logp, generator, self.top_p, self.top_k)
