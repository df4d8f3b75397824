"""The exact incremental guided solve of CosyVoice3's DiT: a streaming chunk computes only its new frames.

Why it is exact.  While streaming, frame ``i`` attends to keys ``j < (i // C + 1) * C`` (C = 50 frames, chunks
aligned at the prompt's first frame) and everything else in the DiT looks left (the causal conv position
embedding, 60 frames) or is per frame.  Between two calls of one segment the earlier frames' inputs do not
change: the start noise is indexed by frame position, the prompt condition and speaker are the same, and ``mu``
of an already encoded token depends only on tokens up to its look-ahead, which the earlier call already had.
So, step by step, a frame in a chunk that was *complete* in the earlier call has the same state, keys and
values in the later call (checked numerically: within 2e-6 in fp32 on the fixture).  The cache keeps, per
Euler step, the state ``x`` of those frames (for the conv window of the next frames) and, per block, their
keys and values (both CFG rows); a call runs its frames from the first incomplete chunk on, attending to the
cached keys.  Equal to the full recompute up to float rounding (GEMMs of other shapes).

Not for full attention: upstream's final call attends over everything, so every frame changes (the runner
recomputes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from cosyvoice_fast.flow.model.cfm import GuidedCFM, euler_schedule
from cosyvoice_fast.flow.model.dit import DiT, chunk_attention_mask


@dataclass
class DiTSolveCache:
    """Per Euler step: ``xs[i]`` (1, 80, frames) the state entering step ``i``; ``kv[i][l]`` the keys and values
    (2, heads, frames, dim_head) of block ``l`` (conditional, unconditional row).  ``frames`` is a multiple of
    the attention chunk: only complete chunks are kept."""

    frames: int = 0
    xs: list[Tensor] = field(default_factory=list)
    kv: list[list[tuple[Tensor, Tensor]]] = field(default_factory=list)

    def head(self, frames: int) -> "DiTSolveCache":
        """A compact copy of the first ``min(frames, self.frames)`` cached frames (``frames``: a multiple of the
        chunk): what a solve over those frames alone would have cached, since no cached frame depends on a later
        one."""
        n = min(frames, self.frames)
        return DiTSolveCache(n, [x[:, :, :n].clone() for x in self.xs],
                             [[(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in step] for step in self.kv])

    def nbytes(self) -> int:
        n = sum(x.numel() * x.element_size() for x in self.xs)
        return n + sum(k.numel() * k.element_size() * 2 for step in self.kv for k, _ in step)


def _window_velocity(est: DiT, x: Tensor, mu: Tensor, spks: Tensor, cond: Tensor, t: Tensor, start: int,
                     total: int, past: list[tuple[Tensor, Tensor]] | None, w: float
                     ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Guided velocity of frames ``start .. total - 1``.  ``x``, ``mu``, ``cond`` (1, 80, n) cover frames
    ``total - n .. total - 1`` (the conv window to the left of ``start`` included); ``past`` holds the keys and
    values of frames ``0 .. start - 1`` per block.  Returns (1, 80, total - start) and the new frames' k/v."""
    skip = start - (total - x.shape[2])
    zeros = torch.zeros_like(mu)
    h = est.embed(torch.cat([x, x]), torch.cat([cond, zeros]), torch.cat([mu, zeros]),
                  torch.cat([spks, torch.zeros_like(spks)]))[:, skip:]
    temb = est.time_act(t, 2)
    cos, sin = est.rotary(start, total - start, x.device)
    mask = chunk_attention_mask(total - start, total, est.cfg.static_chunk_size, query_start=start, device=x.device)
    new_kv = []
    for li, block in enumerate(est.transformer_blocks):
        mods = block.modulation(temb)
        q, k, v = block.qkv(h, mods, cos, sin)
        new_kv.append((k, v))
        if past is not None and past[li][0].shape[2] > 0:
            k, v = torch.cat((past[li][0], k), dim=2), torch.cat((past[li][1], v), dim=2)
        h = block.finish(h, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), mods)
    out = est.head(h, temb)
    return (1.0 + w) * out[:1] - w * out[1:], new_kv


def _grow(old: Tensor | None, new: Tensor, keep: int) -> Tensor:
    """``old`` with the first ``keep`` frames (dim 2) of ``new`` appended (a new tensor: states are shared)."""
    part = new[:, :, :keep]
    return part.clone() if old is None else torch.cat((old, part), dim=2)


def solve_increment(cfm: GuidedCFM, mu: Tensor, spks: Tensor, cond: Tensor, cache: DiTSolveCache,
                    n_steps: int, stable: int | None = None) -> tuple[Tensor, DiTSolveCache]:
    """The streaming guided solve of ``mu`` (1, 80, T) given ``cache`` of its first ``cache.frames`` frames.

    Returns the final state of frames ``cache.frames .. T - 1`` (1, 80, T - cache.frames) in fp32 and the cache
    extended by the frames of every chunk now complete within the first ``stable`` frames (default T): frames
    whose ``mu`` a later call may still change (tokens encoded with less than the model's look-ahead) must not
    be cached."""
    est: DiT = cfm.estimator
    chunk = est.cfg.static_chunk_size
    total, start = mu.shape[2], cache.frames
    if start > total or start % chunk:
        raise ValueError(f"cache of {start} frames cannot continue a {total}-frame call (chunk {chunk})")
    left = max(0, start - est.input_embed.conv_pos_embed.receptive_left)
    stable = total if stable is None else min(stable, total)
    keep = (stable // chunk) * chunk - start  # new frames that complete chunks (cached for the next call)
    x = cfm.start_noise(total, mu.device, mu.dtype)[:, :, start:]
    ts, dts = euler_schedule(n_steps, cfm.cfg.t_scheduler, "cpu", mu.dtype)
    ts, dts = ts.to(mu.device), dts.to(mu.device)
    w = cfm.cfg.inference_cfg_rate
    out = DiTSolveCache(frames=start + max(0, keep))
    for i in range(n_steps):
        past_x = cache.xs[i][:, :, left:] if cache.frames else x[:, :, :0]
        window = torch.cat((past_x, x), dim=2)
        v, new_kv = _window_velocity(est, window, mu[:, :, left:], spks, cond[:, :, left:], ts[i], start, total,
                                     cache.kv[i] if cache.frames else None, w)
        if keep > 0:
            old = cache.kv[i] if cache.frames else [(None, None)] * len(new_kv)
            out.xs.append(_grow(cache.xs[i] if cache.frames else None, x, keep))
            out.kv.append([(_grow(pk, k, keep), _grow(pv, v_, keep)) for (k, v_), (pk, pv) in zip(new_kv, old)])
        x = x + dts[i] * v
    if keep <= 0:
        out = cache
    return x.float(), out
