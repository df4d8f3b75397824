"""Per-segment incremental flow state and the chunk runner that uses it.

Upstream re-runs the whole flow (encoder + 10 guided Euler steps of the estimator) over prompt + all tokens
so far for every streaming chunk and keeps only the new frames.  With streaming (chunk-causal) attention the
frames of a completed, look-ahead-complete chunk never change, so :class:`IncrementalFlow` keeps their
attention keys/values and causal-conv left columns (:mod:`cosyvoice_fast.flow.model.incremental`) and each
call runs only from the last committed chunk boundary to the end of the body.  The result equals
:func:`~cosyvoice_fast.flow.eager.flow_chunk_mel` for every non-final chunk (fp32 agreement ~1e-6).

Cost per non-final call: ``2 * (n_body - committed)`` frames through encoder and estimator, where
``committed`` is the last multiple of 25 tokens at or below ``n_tokens - 3`` of the previous call.  With the
default schedule (first hop padded to a chunk boundary, hops of 25·2^k, look-ahead 3) every body ends on a
boundary and exactly the new frames are computed; with a short first hop or a look-ahead below 3 at most one
chunk (25 tokens) plus ``3 - lookahead`` tokens is recomputed.  Attention still reads all earlier keys.

The final chunk (``finalize=True``): upstream runs it with *full* attention, which changes every frame's
context, so nothing can be reused; ``final="full"`` (the default, bit-for-bit upstream) does exactly that
recompute.  ``final="incremental"`` keeps chunk-causal attention for the last chunk too (no recompute; the
last frames differ from upstream's full-attention ones, as a different but equally valid model evaluation).

Prompt states: the prompt's committed share depends only on the voice (tokens, mel, embedding).  A voice's
first segment starts from an empty state (its first chunk solves prompt and chunk together, as upstream's
recompute does, so a new voice's first audio costs nothing extra); when the voice comes back its prompt state
is computed after that segment and kept in an in-memory LRU keyed by ``inputs.prompt_key``, and later requests
of the voice start from it.  :func:`prompt_flow_state` gives the same state as a ``dict[str, Tensor]`` for a
saved speaker's ``PromptFeatures.extra`` (``Engine.store_flow_state``); :meth:`IncrementalFlow.chunk` uses it
when ``inputs.flow_prompt_state`` carries one made by the same weights (fingerprint) and layout.

Memory: the state grows by :func:`state_bytes_per_frame` per committed mel frame (2.3 MB in bf16 at full
size, dominated by the estimator's keys/values of every Euler step and CFG row); it is released when the
segment's final chunk runs or the request is cancelled (the engine drops the segment).  The graph runner
(:mod:`cosyvoice_fast.flow.graph_incremental`) bounds it by fixed-size buffers.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from cosyvoice_fast.flow.eager import flow_chunk_mel, fold_to_flow_vocab
from cosyvoice_fast.flow.model.cfm import NOISE_FRAMES
from cosyvoice_fast.flow.model.incremental import (
    DecoderCache, EncoderCache, StaticDecoderCache, check_estimator, decode_increment, encode_increment,
)
from cosyvoice_fast.config.schedule import ChunkCall


log = logging.getLogger(__name__)


class StateCapacityError(RuntimeError):
    """A segment's flow state would outgrow the fixed-size buffers that hold it."""


STATE_VERSION = 1
FINAL_MODES = ("full", "incremental")
NEW_VOICE_MODES = ("incremental", "recompute")
#: ``seg.flow_state`` of a segment that recomputes because its voice had no prompt state yet
#: (``new_voices="recompute"``); its voice is remembered at its final chunk like an incremental one's.
NEW_VOICE = "full-new-voice"


@dataclass
class FlowState:
    """Everything one text segment carries between flow calls.

    ``enc`` covers tokens ``[0, enc.n_tokens)`` (prompt tokens first), ``dec`` frames ``[0, dec.n_frames)``;
    ``mu_tail`` is the encoder output for frames ``[dec.n_frames, stride * enc.n_tokens)`` (empty when the
    encoder and estimator chunks line up, as in every released model).
    """

    enc: EncoderCache = field(default_factory=EncoderCache)
    dec: DecoderCache | StaticDecoderCache = field(default_factory=DecoderCache)
    mu_tail: Tensor | None = None
    chunks: int = 0  # calls run on this state (telemetry)
    frames_computed: int = 0  # estimator frames run over those calls (telemetry)

    def nbytes(self) -> int:
        """Bytes held by the state tensors (keys/values dominate: see :func:`state_bytes_per_frame`)."""
        tail = 0 if self.mu_tail is None else self.mu_tail.numel() * self.mu_tail.element_size()
        return self.enc.nbytes() + self.dec.nbytes() + tail

    def to_dict(self) -> dict[str, Tensor]:
        """Flat ``name -> tensor`` map (e.g. for ``PromptFeatures.extra``); :meth:`from_dict` inverts it."""
        n_steps = len(self.dec.steps) if isinstance(self.dec, DecoderCache) else 0
        out: dict[str, Tensor] = {
            "meta": torch.tensor([STATE_VERSION, self.enc.n_tokens, self.dec.n_frames, n_steps,
                                  len(self.enc.tok_slots), len(self.enc.frame_slots)], dtype=torch.int64)}
        for i, t in enumerate(self.enc.tok_slots):
            out[f"enc.tok.{i}"] = t
        for i, t in enumerate(self.enc.frame_slots):
            out[f"enc.frame.{i}"] = t
        if isinstance(self.dec, StaticDecoderCache):
            if self.dec.kv is None or self.dec.ctx is None:
                raise ValueError("flow state lives in a graph runner's buffers; save it first")
            out["dec.kv"] = self.dec.kv
            out.update({f"dec.ctx.{i}": t for i, t in enumerate(self.dec.ctx)})
        else:
            for s, slots in enumerate(self.dec.steps):
                for i, t in enumerate(slots):
                    out[f"dec.{s}.{i}"] = t
        if self.mu_tail is not None:
            out["mu_tail"] = self.mu_tail
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Tensor], device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> "FlowState":
        meta = [int(v) for v in d["meta"].tolist()]
        if meta[0] != STATE_VERSION:
            raise ValueError(f"flow state version {meta[0]}, expected {STATE_VERSION}; recompute it")
        _, n_tok, n_frames, n_steps, n_tok_slots, n_frame_slots = meta

        def mv(t: Tensor) -> Tensor:
            return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)

        enc = EncoderCache(n_tok, [mv(d[f"enc.tok.{i}"]) for i in range(n_tok_slots)],
                           [mv(d[f"enc.frame.{i}"]) for i in range(n_frame_slots)])
        tail = d.get("mu_tail")
        tail = None if tail is None else mv(tail)
        if "dec.kv" in d:  # the fixed-size layout of the graph runner
            ctx, i = [], 0
            while f"dec.ctx.{i}" in d:
                ctx.append(mv(d[f"dec.ctx.{i}"]))
                i += 1
            return cls(enc, StaticDecoderCache(n_frames, mv(d["dec.kv"]), ctx), tail)
        steps = []
        for s in range(n_steps):
            slots, i = [], 0
            while f"dec.{s}.{i}" in d:
                slots.append(mv(d[f"dec.{s}.{i}"]))
                i += 1
            steps.append(slots)
        return cls(enc, DecoderCache(n_frames, steps), tail)


def _cond_slice(prompt_feat: Tensor, start: int, end: int, like: Tensor) -> Tensor:
    """(1, 80, end - start): the prompt mel on frames below its length, zeros after (the CFM condition)."""
    cond = like.new_zeros(1, like.shape[1], end - start)
    stop = min(end, prompt_feat.shape[1])
    if stop > start:
        cond[:, :, :stop - start] = prompt_feat[:, start:stop].transpose(1, 2).to(like.dtype)
    return cond


def run_increment(flow: nn.Module, state: FlowState, ids: Tensor, n_body: int, n_final: int, embedding: Tensor,
                  prompt_feat: Tensor, decode: Callable[..., tuple[Tensor, Any]] = decode_increment,
                  encode: Callable[..., tuple[Tensor, EncoderCache]] = encode_increment
                  ) -> tuple[Tensor, int, FlowState]:
    """Advance ``state`` over tokens ``ids`` (1, N) with body ``[0, n_body)``.

    Returns (mel (1, 80, n) in fp32 for absolute frames ``[start, 2 * n_body)``, ``start``, new state).
    ``decode`` runs the estimator half (:func:`decode_increment`, or a fixed-buffer graph runner with the same
    signature), ``encode`` the encoder half (:func:`encode_increment` or an equivalent).  With
    :func:`decode_increment` the input state is not modified, so a failed call leaves it
    usable; a graph runner's state lives in its buffers and is invalid after a failure.
    """
    stride = flow.encoder.cfg.upsample_stride
    enc_start = stride * state.enc.n_tokens
    dec_start = state.dec.n_frames
    mu_new, enc = encode(flow, ids, n_body, n_final, state.enc)
    parts = [t for t in (state.mu_tail, mu_new) if t is not None and t.shape[2] > 0]
    mu = torch.cat(parts, dim=2) if parts else mu_new
    end = dec_start + mu.shape[2]
    if end != stride * n_body or enc_start - dec_start != (0 if state.mu_tail is None else state.mu_tail.shape[2]):
        raise ValueError("flow state is inconsistent (encoder and estimator frames do not line up)")
    if end > NOISE_FRAMES:
        raise ValueError(f"{end} mel frames exceed the fixed noise length {NOISE_FRAMES} "
                         f"({NOISE_FRAMES / 50:.0f} s); split the text into shorter segments")
    spks = flow.speaker_condition(embedding).to(mu.dtype)
    cond = _cond_slice(prompt_feat, dec_start, end, mu)
    x0 = flow.decoder.noise[:, :, dec_start:end].to(device=mu.device, dtype=mu.dtype)
    mel, dec = decode(flow, mu, spks, cond, x0, state.dec, commit_end=stride * enc.n_tokens)
    tail_from = dec.n_frames - dec_start
    tail = mu[:, :, tail_from:stride * enc.n_tokens - dec_start]
    new = FlowState(enc, dec, tail if tail.shape[2] > 0 else None, state.chunks + 1,
                    state.frames_computed + mu.shape[2])
    return mel, dec_start, new


def flow_fingerprint(flow: nn.Module) -> Tensor:
    """An int64 (4,) digest of what a flow state depends on: the flow's configuration, dtype and weights.

    A stored prompt state is used only by a flow with the same fingerprint, so a speaker cache written with
    other weights (or dtype, or Euler step count) is recomputed instead of silently giving wrong audio.
    Computed once per stage (one pass over the weights)."""
    h = hashlib.sha256(repr((flow.cfg, flow.encoder.cfg, flow.decoder.cfg, flow.decoder.estimator.cfg)).encode())
    with torch.no_grad():
        for name, p in flow.named_parameters():
            h.update(name.encode())
            h.update(str(p.dtype).encode())
            h.update(repr(tuple(p.shape)).encode())
            # sums in float64 of the tensor and of its flat index-weighted values: a cheap, order-sensitive summary
            flat = p.detach().reshape(-1).double()
            w = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64).remainder_(977)
            h.update(torch.stack([flat.sum(), (flat * w).sum()]).cpu().numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.int64).clone()


@torch.inference_mode()
def prompt_flow_state(flow: nn.Module, inputs: Any, decode: Callable[..., tuple[Tensor, Any]] = decode_increment,
                      fingerprint: Tensor | None = None,
                      encode: Callable[..., tuple[Tensor, EncoderCache]] = encode_increment) -> dict[str, Tensor]:
    """The committed flow state of the prompt alone (``inputs.flow_prompt_speech_token``, ``prompt_feat``,
    ``embedding``), as a ``dict[str, Tensor]`` (CPU) to store in the speaker cache's ``extra``.

    Commits the complete 25-token chunks whose 3-token look-ahead lies inside the prompt.  Valid only for the
    same flow weights, dtype and Euler step count (``fingerprint``, checked on use) and the layout of the
    ``decode`` that made it; :meth:`FlowState.from_dict` rebuilds it.
    """
    state = prompt_state(flow, inputs, decode, encode)
    save = getattr(decode, "save", None)
    if save is not None:
        save(state.dec)
    d = {k: v.detach().to("cpu").contiguous() for k, v in state.to_dict().items()}
    # The committed prompt ids, so a cached state is never applied to another prompt (checked on use).
    d["ids"] = inputs.flow_prompt_speech_token[:, :int(d["meta"][1])].detach().to("cpu", torch.int64)
    d["fingerprint"] = flow_fingerprint(flow) if fingerprint is None else fingerprint
    return d


def prompt_state(flow: nn.Module, inputs: Any, decode: Callable[..., tuple[Tensor, Any]] = decode_increment,
                 encode: Callable[..., tuple[Tensor, EncoderCache]] = encode_increment) -> FlowState:
    """The committed state of the prompt alone (see :func:`prompt_flow_state`), on the inputs' device."""
    check_estimator(flow.decoder.estimator)
    ptok = inputs.flow_prompt_speech_token
    la = flow.encoder.pre_lookahead_layer.lookahead
    chunk = flow.encoder.cfg.static_chunk_size
    n_commit = max(0, (ptok.shape[1] - la) // chunk * chunk)
    if n_commit == 0:
        return FlowState()
    with torch.inference_mode():
        ids = ptok[:, :n_commit + la].to(inputs.embedding.device).long()
        _, _, state = run_increment(flow, FlowState(), ids, n_commit, n_commit, inputs.embedding, inputs.prompt_feat,
                                    decode, encode)
    state.chunks = state.frames_computed = 0
    return state


def state_bytes_per_frame(flow: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes the state grows by per committed 50 Hz mel frame (encoder and estimator), from the module sizes."""
    es = torch.finfo(dtype).bits // 8
    enc = flow.encoder
    d = enc.cfg.output_size
    stride = enc.cfg.upsample_stride
    enc_b = (2 * d * len(enc.encoders)) * es / stride + 2 * d * len(enc.up_encoders) * es
    est = flow.decoder.estimator
    n_attn = sum(len(b[1]) for b in est.down_blocks) + sum(len(b[1]) for b in est.mid_blocks) \
        + sum(len(b[1]) for b in est.up_blocks)
    inner = est.cfg.num_heads * est.cfg.attention_head_dim
    dec_b = n_attn * 2 * inner * es * 2 * flow.decoder.cfg.n_timesteps  # K+V, CFG batch 2, every Euler step
    return {"encoder": int(enc_b), "estimator": int(dec_b), "total": int(enc_b + dec_b)}


class IncrementalFlow:
    """Drop-in for :class:`~cosyvoice_fast.flow.eager.EagerFlow` that carries state in ``seg.flow_state``.

    ``final``: ``"full"`` (default) runs the last chunk as upstream (full attention, full recompute, exact);
    ``"incremental"`` keeps chunk-causal attention for it and reuses the state (a final call without earlier
    streaming chunks, i.e. a non-streaming request, still runs upstream's full pass).

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

    def __init__(self, flow: nn.Module, config: Any = None, final: str = "full", max_prompt_states: int = 8,
                 new_voices: str = "incremental"):
        if final not in FINAL_MODES:
            raise ValueError(f"final must be one of {FINAL_MODES}, got {final!r}")
        if new_voices not in NEW_VOICE_MODES:
            raise ValueError(f"new_voices must be one of {NEW_VOICE_MODES}, got {new_voices!r}")
        self.new_voices = new_voices
        check_estimator(flow.decoder.estimator)
        if flow.encoder.cfg.static_chunk_size <= 0 or flow.decoder.estimator.cfg.static_chunk_size <= 0:
            raise ValueError("incremental flow needs chunk-causal streaming attention")
        self.flow = flow
        self.config = config
        self.final = final
        self.max_prompt_states = max_prompt_states
        self.prompt_states: OrderedDict[str, FlowState] = OrderedDict()
        self.seen: OrderedDict[str, None] = OrderedDict()  # voices streamed once (their state is not cached yet)
        self.prompt_hits = self.prompt_misses = self.prompt_loaded = self.fallbacks = 0
        self._fingerprint: Tensor | None = None
        self.decoder: Callable[..., tuple[Tensor, Any]] = decode_increment
        self.encoder: Callable[..., tuple[Tensor, EncoderCache]] = encode_increment

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
        if not stream or (call.finalize and (self.final == "full" or fresh)):
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
