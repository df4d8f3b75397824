"""The incremental flow's chunk runner: each streaming chunk computes only its new frames.

The state and its maths are :mod:`cosyvoice_fast.flow.incremental_state`; this module decides, per call,
whether a segment continues on its state or recomputes as upstream does, and keeps the voices' prompt states.

The final chunk (``finalize=True``): upstream runs it with *full* attention, which changes every frame's
context, so nothing can be reused; it is recomputed exactly as upstream does (bit for bit).

Prompt states: the prompt's committed share depends only on the voice (tokens, mel, embedding).  A voice's
first segment starts from an empty state (its first chunk solves prompt and chunk together, as upstream's
recompute does, so a new voice's first audio costs nothing extra); when the voice comes back its prompt state
is computed after that segment and kept in an in-memory LRU keyed by ``inputs.prompt_key``, and later requests
of the voice start from it.  :meth:`IncrementalFlow.chunk` also uses ``inputs.flow_prompt_state`` (a saved
speaker's stored state) when it was made by the same weights (fingerprint) and layout.

Memory: a segment's state is released when its final chunk runs or the request is cancelled (the engine drops
the segment).  The graph runner (:mod:`cosyvoice_fast.flow.graph_incremental`) bounds it by fixed-size buffers.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from cosyvoice_fast.config.schedule import ChunkCall
from cosyvoice_fast.flow.eager import ChunkItem, flow_chunk_mel, fold_to_flow_vocab
from cosyvoice_fast.flow.incremental_state import (
    FlowState, StateCapacityError, flow_fingerprint, prompt_flow_state, prompt_state, run_increment,
)
from cosyvoice_fast.flow.model.incremental import check_estimator, decode_increment
from cosyvoice_fast.flow.model.incremental_encoder import EncoderCache, encode_increment

log = logging.getLogger(__name__)

NEW_VOICE_MODES = ("incremental", "recompute")
#: ``seg.flow_state`` of a segment that recomputes because its voice had no prompt state yet
#: (``new_voices="recompute"``); its voice is remembered at its final chunk like an incremental one's.
NEW_VOICE = "full-new-voice"


class IncrementalFlow:
    """Drop-in for :class:`~cosyvoice_fast.flow.eager.EagerFlow` that carries state in ``seg.flow_state``.

    The last chunk of a segment, and a non-streaming request, run as upstream (full attention, full recompute,
    exact).  Calls are never batched (:attr:`max_batch` 1): each segment advances its own state.

    Prompt states: the committed state of a voice's prompt is kept in an LRU of ``max_prompt_states`` entries
    (keyed by ``inputs.prompt_key``, a digest of the prompt's tokens, mel and embedding) once the voice comes
    back (:meth:`remember_prompt`), or taken from ``inputs.flow_prompt_state`` (a stored
    :func:`prompt_flow_state` dict, e.g. from the speaker cache) when its fingerprint and ids match.  A request
    of such a voice starts from it, so its first chunk computes only the frames after the prompt's last
    complete chunk; a new voice's first chunk solves prompt and chunk together.

    ``new_voices``: a segment whose voice has no prompt state yet starts from an empty state
    (``"incremental"``, the default) or recomputes all its chunks (``"recompute"``: where an incremental
    solve over prompt and chunk together is slower than the recompute of the same frames, as with the fused
    kernels); either way the voice's prompt state is computed when it comes back.

    Each chunk reports ``seg.flow_info = (mode, estimator frames, state bytes)`` for the telemetry.

    Subclasses replace ``encoder`` (the encoder half, :func:`encode_increment`'s signature), ``decoder`` (the
    estimator half, :func:`decode_increment`'s signature; a ``save(cache)`` method, when it has one, detaches a
    state from its buffers) and :meth:`full_chunk` (the full recompute).
    """

    layout = "slots"  # the state layout its decoder reads ("static" for the fixed-size graph buffers)
    max_batch = 1  # FlowStage: each segment advances its own state, so calls are never batched

    def __init__(self, flow: nn.Module, config: Any = None, max_prompt_states: int = 8,
                 new_voices: str = "incremental"):
        if new_voices not in NEW_VOICE_MODES:
            raise ValueError(f"new_voices must be one of {NEW_VOICE_MODES}, got {new_voices!r}")
        self.new_voices = new_voices
        check_estimator(flow.decoder.estimator)
        if flow.encoder.cfg.static_chunk_size <= 0 or flow.decoder.estimator.cfg.static_chunk_size <= 0:
            raise ValueError("incremental flow needs chunk-causal streaming attention")
        self.flow = flow
        self.config = config
        self.max_prompt_states = max_prompt_states
        self.prompt_states: OrderedDict[str, FlowState] = OrderedDict()
        self.seen: OrderedDict[str, None] = OrderedDict()  # voices streamed once (their state is not cached yet)
        self.prompt_hits = self.prompt_misses = self.prompt_loaded = self.fallbacks = 0
        self._fingerprint: Tensor | None = None
        self.decoder: Callable[..., tuple[Tensor, Any]] = decode_increment
        self.encoder: Callable[..., tuple[Tensor, EncoderCache]] = encode_increment

    @property
    def incremental(self) -> "IncrementalFlow":
        """FlowStage: the runner that keeps flow state (this one)."""
        return self

    # ----------------------------------------------------------------------------------------- hooks
    def full_chunk(self, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool) -> Tensor:
        """Upstream's full recompute of one call (finals, non-streaming requests, fallbacks)."""
        return flow_chunk_mel(self.flow, inputs, tokens, call, stream)

    def fingerprint(self) -> Tensor:
        if self._fingerprint is None:
            self._fingerprint = flow_fingerprint(self.flow)
        return self._fingerprint

    # ------------------------------------------------------------------------------------ prompt states
    def _stored_state(self, inputs: Any) -> FlowState | None:
        cached = getattr(inputs, "flow_prompt_state", None)
        if not cached:
            return None
        ids, fp = cached.get("ids"), cached.get("fingerprint")
        ptok = inputs.flow_prompt_speech_token
        n = int(cached["meta"][1])
        if ("dec.kv" in cached) != (self.layout == "static"):
            return None  # made by the other flow runner (list vs fixed-size layout): recompute
        if self.encoder is encode_increment and int(cached["meta"][1]) > 0 and "enc.tok.0" not in cached:
            return None  # made without encoder slots (a recomputing encoder); this one needs them
        if fp is None or not torch.equal(fp.cpu(), self.fingerprint()):
            log.info("stored flow prompt state was made by other flow weights/settings; recomputing it")
            return None
        if ids is None or ids.shape[1] != n or n > ptok.shape[1] \
                or not torch.equal(ptok[:, :n].to("cpu", torch.int64), ids):
            return None
        p = next(self.flow.parameters())
        try:
            return FlowState.from_dict(cached, device=p.device, dtype=p.dtype)
        except (KeyError, ValueError) as e:  # another layout or version: recompute
            log.info("stored flow prompt state is not usable here (%s); recomputing it", e)
            return None

    def initial_state(self, inputs: Any, compute: bool = True) -> FlowState | None:
        """The prompt's committed state: from the LRU, else the stored dict, else (``compute``) computed; a
        found or computed state is remembered in the LRU.  None when absent and not computed."""
        key = getattr(inputs, "prompt_key", None)
        if key is not None and key in self.prompt_states:
            self.prompt_states.move_to_end(key)
            self.prompt_hits += 1
            return self.prompt_states[key]
        state = self._stored_state(inputs)
        if state is not None:
            self.prompt_loaded += 1
        else:
            if not compute:
                return None
            state = prompt_state(self.flow, inputs, self.decoder, self.encoder)
        self.prompt_misses += 1
        if key is not None and self.max_prompt_states > 0:
            save = getattr(self.decoder, "save", None)
            if save is not None:
                save(state.dec)  # shared by many requests: it must own its tensors, not live in a runner's buffers
            self.prompt_states[key] = state
            while len(self.prompt_states) > self.max_prompt_states:
                self.prompt_states.popitem(last=False)
        return state

    def remember_prompt(self, inputs: Any) -> None:
        """After a streamed segment: compute and cache the voice's prompt state if this voice was streamed
        before and its state is not cached yet.

        A voice's first segment started from an empty state (see :meth:`chunk`); computing its prompt state
        costs one more solve over the prompt, worth paying only for voices that come back (a one-off upload
        would pay it for nothing, measured: +40 ms on every final chunk when every request brings a new voice).
        Saved speakers can have theirs stored ahead of time (``Engine.store_flow_state``)."""
        key = getattr(inputs, "prompt_key", None)
        if key is None or self.max_prompt_states <= 0 or key in self.prompt_states:
            return
        if key in self.seen:
            self.initial_state(inputs)
            return
        self.seen[key] = None
        while len(self.seen) > 16 * self.max_prompt_states:
            self.seen.popitem(last=False)

    def prompt_flow_state(self, inputs: Any) -> dict[str, Tensor]:
        """:func:`prompt_flow_state` for this stage's flow and layout (to persist with a speaker)."""
        return prompt_flow_state(self.flow, inputs, self.decoder, self.fingerprint(), self.encoder)

    def memory(self) -> dict[str, int]:
        """Bytes held by cached prompt states (each request's state size is in its chunk telemetry)."""
        return {"prompt_states": len(self.prompt_states),
                "prompt_state_bytes": sum(s.nbytes() for s in self.prompt_states.values())}

    # ------------------------------------------------------------------------------------------ chunks
    def chunk(self, seg: Any, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool = True) -> Tensor:
        """The mel (1, 80, new frames) of ``call``; same contract as ``EagerFlow.chunk``."""
        if seg.flow_state in ("full", NEW_VOICE):  # outgrew the state earlier, or a new voice: full recompute
            if call.finalize:
                if seg.flow_state == NEW_VOICE:
                    self.remember_prompt(inputs)
                seg.flow_state = None
            return self.full_chunk(inputs, tokens, call, stream)
        fresh = not isinstance(seg.flow_state, FlowState)
        # A one-shot (non-streaming) request is a single finalize call with no state: always upstream's full pass.
        if not stream or call.finalize:
            seg.flow_state = None
            mel = self.full_chunk(inputs, tokens, call, stream)
            if stream and not fresh:
                self.remember_prompt(inputs)
            return mel
        try:
            if fresh:
                # A voice without a cached prompt state starts from an empty state: its first chunk then solves
                # prompt and chunk together (one solve, as upstream's recompute) instead of paying for the
                # prompt state first; that state is computed after the segment (remember_prompt).  With
                # ``new_voices="recompute"`` such a segment recomputes every chunk instead.
                state = self.initial_state(inputs, compute=False)
                if state is None and self.new_voices == "recompute":
                    seg.flow_state = NEW_VOICE
                    return self.full_chunk(inputs, tokens, call, stream)
                state = state or FlowState()
            else:
                state = seg.flow_state
            before = state.frames_computed
            mel, state = self.step(state, inputs, tokens, call)
        except StateCapacityError as e:
            # Past the state's capacity: this segment continues with upstream's full recompute (exact, slower).
            self.fallbacks += 1
            log.info("incremental flow state full (%s); recomputing this segment's chunks", e)
            seg.flow_state = "full"
            return self.full_chunk(inputs, tokens, call, stream)
        seg.flow_state = None if call.finalize else state
        if hasattr(seg, "flow_info"):
            seg.flow_info = ("incremental", state.frames_computed - before, 0 if call.finalize else state.nbytes())
        if call.finalize:
            self.remember_prompt(inputs)
        return mel

    def solve(self, items: Sequence[ChunkItem], stream: bool = True) -> list[Tensor]:
        """FlowStage: one :meth:`chunk` per item, in order (states are per segment, nothing is shared)."""
        return [self.chunk(*item, stream=stream) for item in items]

    def step(self, state: FlowState, inputs: Any, tokens: Tensor, call: ChunkCall) -> tuple[Tensor, FlowState]:
        """One streaming chunk on an explicit state: (mel of the call's new frames, next state)."""
        flow = self.flow
        dev = inputs.embedding.device
        tokens = fold_to_flow_vocab(tokens.to(dev), flow.cfg.vocab_size)
        ids = torch.cat((inputs.flow_prompt_speech_token.to(dev), tokens), dim=1).long()
        n = ids.shape[1]
        la = flow.encoder.pre_lookahead_layer.lookahead
        if call.finalize:
            n_body = n_final = n
        else:
            n_ctx = la if call.lookahead is None else call.lookahead
            if n_ctx > la:
                raise ValueError(f"{n_ctx} look-ahead context tokens given, the layer uses at most {la}")
            n_body, n_final = n - n_ctx, n - la
        stride = flow.encoder.cfg.upsample_stride
        n_prompt = inputs.prompt_feat.shape[1]
        if n_prompt > stride * n_body:
            raise ValueError(f"prompt mel has {n_prompt} frames but the tokens give only {stride * n_body}")
        out_start = n_prompt + flow.cfg.token_mel_ratio * call.token_offset
        if state.dec.n_frames > out_start or state.enc.n_tokens > n_body:
            # the state is ahead of this call: start over from the prompt's (or from nothing)
            state = self.initial_state(inputs, compute=False) or FlowState()
            if state.dec.n_frames > out_start:
                state = FlowState()
        with torch.inference_mode():
            mel, start, new = run_increment(flow, state, ids, n_body, n_final, inputs.embedding, inputs.prompt_feat,
                                            self.decoder, self.encoder)
        return mel[:, :, out_start - start:], new
