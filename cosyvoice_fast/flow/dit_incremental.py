"""CosyVoice3's incremental flow stage: a streaming chunk computes only the frames after its segment's last
complete 50-frame attention chunk (prompt included), attending to cached keys/values of the chunks before.

The maths and why it is exact are :mod:`cosyvoice_fast.flow.model.dit_increment`.  The state lives on the
segment (``seg.flow_state``, a :class:`DiTSolveCache`), grows by complete chunks, and is dropped at the final
call.  The final call (``finalize=True``) runs upstream's *full* attention over every frame, which changes every
frame's context, so it is a full recompute (:func:`flow_chunk_mel`), exactly as :class:`DiTEagerFlow` runs it;
so are non-streaming requests.  Memory per cached frame: steps x blocks x 2 (k, v) x 2 CFG rows x heads x
dim_head values (1.8 MB per frame in bf16 at full size, ~0.9 GB for a 10 s segment before its final call).

Prompt states: the complete chunks of a voice's prompt whose frames depend on prompt tokens only (each token's
``mu`` looks ``pre_lookahead_len`` tokens ahead, so the last ones depend on the text) are the same for every
request of that voice.  A voice's first segment solves prompt and chunk together (as the recompute does) and its
first call's cache, cut to those chunks, is kept in an LRU keyed by ``inputs.prompt_key`` (the digest of prompt
tokens, mel and embedding); later segments of the voice start from it, so their first chunk computes only the
frames after it.  Cached tensors are never written in place (a cache grows by new tensors), so segments share
a prompt state safely.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from cosyvoice_fast.config.schedule import ChunkCall, call_frames
from cosyvoice_fast.flow.eager import ChunkItem, _encode_call, flow_chunk_mel
from cosyvoice_fast.flow.model.dit_flow import DiTFlow
from cosyvoice_fast.flow.model.dit_increment import DiTSolveCache, solve_increment


class DiTIncrementalFlow:
    """FlowStage over a :class:`DiTFlow` that carries per-segment K/V caches in ``seg.flow_state``.

    Calls are never batched (``max_batch`` 1: each segment advances its own cache).  A call without a segment
    (``seg`` None), a final call or a non-streaming request runs the full recompute; streaming non-final calls
    continue the segment's cache (a first call: its voice's prompt state, or nothing) and grow it.
    ``seg.flow_info`` reports ``(mode, estimator frames, state bytes)`` per call; ``prompt_hits`` counts
    segments that started from a voice's prompt state (at most ``max_prompt_states`` voices are kept)."""

    max_batch = 1
    incremental = None  # FlowStage: no voice prompt states to store (Engine.store_flow_state does nothing)

    def __init__(self, flow: nn.Module, config: Any = None, max_prompt_states: int = 8):
        if not isinstance(flow, DiTFlow):
            raise TypeError(f"DiTIncrementalFlow drives CosyVoice3's DiTFlow, got {type(flow).__name__}")
        if flow.cfg.dit.static_chunk_size <= 0:
            raise ValueError("the incremental DiT flow needs chunk-causal streaming attention")
        self.flow = flow
        self.config = config
        self.recomputes = self.increments = 0
        self.max_prompt_states = max_prompt_states
        self.prompt_states: OrderedDict[str, DiTSolveCache] = OrderedDict()
        self.prompt_hits = 0

    def prompt_frames(self, n_prompt_tokens: int) -> int:
        """Frames of a prompt that depend on prompt tokens only, floored to complete attention chunks."""
        cfg = self.flow.cfg
        stable = cfg.token_mel_ratio * max(0, n_prompt_tokens - cfg.pre_lookahead_len)
        return stable // cfg.dit.static_chunk_size * cfg.dit.static_chunk_size

    def _start_state(self, seg: Any, inputs: Any, call: ChunkCall) -> DiTSolveCache:
        """The cache a call continues: the segment's own, else its voice's prompt state, else empty."""
        if isinstance(seg.flow_state, DiTSolveCache) and call.index > 0:
            return seg.flow_state
        key = getattr(inputs, "prompt_key", None)
        state = self.prompt_states.get(key) if key is not None else None
        if state is None:
            return DiTSolveCache()
        self.prompt_states.move_to_end(key)
        self.prompt_hits += 1
        return state

    def _remember_prompt(self, inputs: Any, cache: DiTSolveCache) -> None:
        key = getattr(inputs, "prompt_key", None)
        if key is None or self.max_prompt_states <= 0 or key in self.prompt_states:
            return
        n = self.prompt_frames(inputs.flow_prompt_speech_token.shape[1])
        if n <= 0 or cache.frames < n:
            return
        self.prompt_states[key] = cache.head(n)
        while len(self.prompt_states) > self.max_prompt_states:
            self.prompt_states.popitem(last=False)

    def chunk(self, seg: Any, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool = True) -> Tensor:
        if seg is None or call.finalize or not stream:
            if seg is not None:
                seg.flow_state = None
                n_prompt = inputs.flow_prompt_speech_token.shape[1]
                seg.flow_info = ("full", call_frames(call, n_prompt, self.flow.cfg.token_mel_ratio), 0)
            self.recomputes += 1
            return flow_chunk_mel(self.flow, inputs, tokens, call, stream)
        cache = self._start_state(seg, inputs, call)
        flow = self.flow
        with torch.inference_mode():
            enc = _encode_call(flow, inputs, tokens, call, streaming=True)
            mu, total = enc.mu, enc.mu.shape[2]
            n_prompt = inputs.prompt_feat.shape[1]
            first_new = n_prompt + call.token_offset * flow.cfg.token_mel_ratio
            if cache.frames > first_new or n_prompt > total:
                cache = DiTSolveCache()  # cannot continue this state (should not happen with a cursor's calls)
            cond = torch.zeros_like(mu)
            cond[:, :, :n_prompt] = inputs.prompt_feat.transpose(1, 2).to(mu.dtype)
            start = cache.frames
            # with less look-ahead than the model's, the last encoded tokens saw zeros where later calls see
            # tokens: their frames change, so they are not cached (recomputed by the next call, as eager does)
            unstable = flow.cfg.token_mel_ratio * max(0, flow.cfg.pre_lookahead_len - call.lookahead)
            x, seg.flow_state = solve_increment(flow.decoder, mu, enc.spks.to(mu.dtype), cond, cache,
                                                flow.cfg.cfm.n_timesteps, stable=total - unstable)
        if start == 0:
            self._remember_prompt(inputs, seg.flow_state)
        seg.flow_info = ("incremental", total - start, seg.flow_state.nbytes())
        self.increments += 1
        return x[:, :, first_new - start:]

    def solve(self, items: Sequence[ChunkItem], stream: bool = True) -> list[Tensor]:
        """One call after another (each segment advances its own cache)."""
        return [self.chunk(*item, stream=stream) for item in items]

