"""Per-segment incremental flow state and the chunk runner that uses it.

Upstream re-runs the whole flow (encoder + 10 guided Euler steps of the estimator) over prompt + all tokens
so far for every streaming chunk and keeps only the new frames.  With streaming (chunk-causal) attention the
frames of a completed, look-ahead-complete chunk never change, so :class:`IncrementalFlow` keeps their
attention keys/values and causal-conv left columns (:mod:`cosyvoice_fast.models.flow_incremental`) and each
call runs only from the last committed chunk boundary to the end of the body.  The result equals
:func:`~cosyvoice_fast.backends.eager.flow_chunk_mel` for every non-final chunk (fp32 agreement ~1e-6).

Cost per non-final call: ``2 * (n_body - committed)`` frames through encoder and estimator, where
``committed`` is the last multiple of 25 tokens at or below ``n_tokens - 3`` of the previous call.  With the
default schedule (first hop padded to a chunk boundary, hops of 25·2^k, look-ahead 3) every body ends on a
boundary and exactly the new frames are computed; with a short first hop or a look-ahead below 3 at most one
chunk (25 tokens) plus ``3 - lookahead`` tokens is recomputed.  Attention still reads all earlier keys.

The final chunk (``finalize=True``): upstream runs it with *full* attention, which changes every frame's
context, so nothing can be reused; ``final="full"`` (the default, bit-for-bit upstream) does exactly that
recompute.  ``final="incremental"`` keeps chunk-causal attention for the last chunk too (no recompute; the
last frames differ from upstream's full-attention ones, as a different but equally valid model evaluation).

The prompt's committed share depends only on the speaker inputs; :func:`prompt_flow_state` computes it once
as a ``dict[str, Tensor]`` for ``PromptFeatures.extra``, and :meth:`IncrementalFlow.chunk` starts from it
when ``inputs.flow_prompt_state`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..backends.eager import flow_chunk_mel, fold_to_flow_vocab
from ..models.cfm import NOISE_FRAMES
from ..models.flow_incremental import (DecoderCache, EncoderCache, check_estimator, decode_increment,
                                       encode_increment)
from ..schedule import ChunkCall

STATE_VERSION = 1
FINAL_MODES = ("full", "incremental")


@dataclass
class FlowState:
    """Everything one text segment carries between flow calls.

    ``enc`` covers tokens ``[0, enc.n_tokens)`` (prompt tokens first), ``dec`` frames ``[0, dec.n_frames)``;
    ``mu_tail`` is the encoder output for frames ``[dec.n_frames, stride * enc.n_tokens)`` (empty when the
    encoder and estimator chunks line up, as in every released model).
    """

    enc: EncoderCache = field(default_factory=EncoderCache)
    dec: DecoderCache = field(default_factory=DecoderCache)
    mu_tail: Tensor | None = None
    chunks: int = 0  # calls run on this state (telemetry)
    frames_computed: int = 0  # estimator frames run over those calls (telemetry)

    def nbytes(self) -> int:
        """Bytes held by the state tensors (keys/values dominate: see :func:`state_bytes_per_frame`)."""
        tail = 0 if self.mu_tail is None else self.mu_tail.numel() * self.mu_tail.element_size()
        return self.enc.nbytes() + self.dec.nbytes() + tail

    def to_dict(self) -> dict[str, Tensor]:
        """Flat ``name -> tensor`` map (e.g. for ``PromptFeatures.extra``); :meth:`from_dict` inverts it."""
        out: dict[str, Tensor] = {
            "meta": torch.tensor([STATE_VERSION, self.enc.n_tokens, self.dec.n_frames, len(self.dec.steps),
                                  len(self.enc.tok_slots), len(self.enc.frame_slots)], dtype=torch.int64)}
        for i, t in enumerate(self.enc.tok_slots):
            out[f"enc.tok.{i}"] = t
        for i, t in enumerate(self.enc.frame_slots):
            out[f"enc.frame.{i}"] = t
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
        steps = []
        for s in range(n_steps):
            slots, i = [], 0
            while f"dec.{s}.{i}" in d:
                slots.append(mv(d[f"dec.{s}.{i}"]))
                i += 1
            steps.append(slots)
        tail = d.get("mu_tail")
        return cls(enc, DecoderCache(n_frames, steps), None if tail is None else mv(tail))


def _cond_slice(prompt_feat: Tensor, start: int, end: int, like: Tensor) -> Tensor:
    """(1, 80, end - start): the prompt mel on frames below its length, zeros after (the CFM condition)."""
    cond = like.new_zeros(1, like.shape[1], end - start)
    stop = min(end, prompt_feat.shape[1])
    if stop > start:
        cond[:, :, :stop - start] = prompt_feat[:, start:stop].transpose(1, 2).to(like.dtype)
    return cond


def run_increment(flow: nn.Module, state: FlowState, ids: Tensor, n_body: int, n_final: int, embedding: Tensor,
                  prompt_feat: Tensor) -> tuple[Tensor, int, FlowState]:
    """Advance ``state`` over tokens ``ids`` (1, N) with body ``[0, n_body)``.

    Returns (mel (1, 80, n) in fp32 for absolute frames ``[start, 2 * n_body)``, ``start``, new state); the
    input state is not modified, so a failed call leaves it usable.
    """
    stride = flow.encoder.cfg.upsample_stride
    enc_start = stride * state.enc.n_tokens
    dec_start = state.dec.n_frames
    mu_new, enc = encode_increment(flow, ids, n_body, n_final, state.enc)
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
    mel, dec = decode_increment(flow, mu, spks, cond, x0, state.dec, commit_end=stride * enc.n_tokens)
    tail_from = dec.n_frames - dec_start
    tail = mu[:, :, tail_from:stride * enc.n_tokens - dec_start]
    new = FlowState(enc, dec, tail if tail.shape[2] > 0 else None, state.chunks + 1,
                    state.frames_computed + mu.shape[2])
    return mel, dec_start, new


@torch.inference_mode()
def prompt_flow_state(flow: nn.Module, inputs: Any) -> dict[str, Tensor]:
    """The committed flow state of the prompt alone (``inputs.flow_prompt_speech_token``, ``prompt_feat``,
    ``embedding``), as a ``dict[str, Tensor]`` to store in the speaker cache's ``extra``.

    Commits the complete 25-token chunks whose 3-token look-ahead lies inside the prompt.  Valid only for the
    same flow weights, dtype and Euler step count; :meth:`FlowState.from_dict` rebuilds it.
    """
    state = prompt_state(flow, inputs).to_dict()
    # The committed prompt ids, so a cached state is never applied to another prompt (checked on use).
    state["ids"] = inputs.flow_prompt_speech_token[:, :state["meta"][1].item()].detach().to("cpu", torch.int64)
    return state


def prompt_state(flow: nn.Module, inputs: Any) -> FlowState:
    check_estimator(flow.decoder.estimator)
    ptok = inputs.flow_prompt_speech_token
    la = flow.encoder.pre_lookahead_layer.lookahead
    chunk = flow.encoder.cfg.static_chunk_size
    n_commit = max(0, (ptok.shape[1] - la) // chunk * chunk)
    if n_commit == 0:
        return FlowState()
    with torch.inference_mode():
        ids = ptok[:, :n_commit + la].to(inputs.embedding.device).long()
        _, _, state = run_increment(flow, FlowState(), ids, n_commit, n_commit, inputs.embedding, inputs.prompt_feat)
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
    """Drop-in for :class:`~cosyvoice_fast.backends.eager.EagerFlow` that carries state in ``seg.flow_state``.

    ``final``: ``"full"`` (default) runs the last chunk as upstream (full attention, full recompute, exact);
    ``"incremental"`` keeps chunk-causal attention for it and reuses the state (a final call without earlier
    streaming chunks, i.e. a non-streaming request, still runs upstream's full pass).
    """

    def __init__(self, flow: nn.Module, config: Any = None, final: str = "full"):
        if final not in FINAL_MODES:
            raise ValueError(f"final must be one of {FINAL_MODES}, got {final!r}")
        check_estimator(flow.decoder.estimator)
        if flow.encoder.cfg.static_chunk_size <= 0 or flow.decoder.estimator.cfg.static_chunk_size <= 0:
            raise ValueError("incremental flow needs chunk-causal streaming attention")
        self.flow = flow
        self.config = config
        self.final = final

    def initial_state(self, inputs: Any) -> FlowState:
        """From ``inputs.flow_prompt_state`` (a :func:`prompt_flow_state` dict) when present, else computed."""
        cached = getattr(inputs, "flow_prompt_state", None)
        if cached:
            ids = cached.get("ids")
            ptok = inputs.flow_prompt_speech_token
            n = int(cached["meta"][1])
            if ids is not None and ids.shape[1] == n and n <= ptok.shape[1] \
                    and torch.equal(ptok[:, :n].to("cpu", torch.int64), ids):
                p = next(self.flow.parameters())
                return FlowState.from_dict(cached, device=p.device, dtype=p.dtype)
        return prompt_state(self.flow, inputs)

    def chunk(self, seg: Any, inputs: Any, tokens: Tensor, call: ChunkCall, stream: bool = True) -> Tensor:
        """The mel (1, 80, new frames) of ``call``; same contract as ``EagerFlow.chunk``."""
        fresh = not isinstance(seg.flow_state, FlowState)
        # A one-shot (non-streaming) request is a single finalize call with no state: always upstream's full pass.
        if not stream or (call.finalize and (self.final == "full" or fresh)):
            seg.flow_state = None
            return flow_chunk_mel(self.flow, inputs, tokens, call, stream)
        state = self.initial_state(inputs) if fresh else seg.flow_state
        mel, state = self.step(state, inputs, tokens, call)
        seg.flow_state = None if call.finalize else state
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
            state = prompt_state(flow, inputs)  # the state is ahead of this call: start over from the prompt
            if state.dec.n_frames > out_start:
                state = FlowState()
        with torch.inference_mode():
            mel, start, new = run_increment(flow, state, ids, n_body, n_final, inputs.embedding, inputs.prompt_feat)
        return mel[:, :, out_start - start:], new
