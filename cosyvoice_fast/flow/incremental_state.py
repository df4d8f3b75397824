"""The incremental flow's per-segment state and the maths that advances it, apart from the chunk runner.

Upstream re-runs the whole flow (encoder + 10 guided Euler steps of the estimator) over prompt + all tokens
so far for every streaming chunk and keeps only the new frames.  With streaming (chunk-causal) attention the
frames of a completed, look-ahead-complete chunk never change, so a :class:`FlowState` keeps their attention
keys/values and causal-conv left columns (:mod:`cosyvoice_fast.flow.model.incremental`) and
:func:`run_increment` runs only from the last committed chunk boundary to the end of the body.  The result
equals :func:`~cosyvoice_fast.flow.eager.flow_chunk_mel` for every non-final chunk (fp32 agreement ~1e-6).

Cost per non-final call: ``2 * (n_body - committed)`` frames through encoder and estimator, where
``committed`` is the last multiple of 25 tokens at or below ``n_tokens - 3`` of the previous call.  With the
default schedule (first hop padded to a chunk boundary, hops of 25·2^k, look-ahead 3) every body ends on a
boundary and exactly the new frames are computed; with a short first hop or a look-ahead below 3 at most one
chunk (25 tokens) plus ``3 - lookahead`` tokens is recomputed.  Attention still reads all earlier keys.

Prompt states: the prompt's committed share depends only on the voice (tokens, mel, embedding);
:func:`prompt_flow_state` gives it as a ``dict[str, Tensor]`` for a saved speaker's ``PromptFeatures.extra``
(``Engine.store_flow_state``), valid for the flow weights that made it (:func:`flow_fingerprint`).

Memory: the state grows by :func:`state_bytes_per_frame` per committed mel frame (2.3 MB in bf16 at full
size, dominated by the estimator's keys/values of every Euler step and CFG row).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from cosyvoice_fast.flow.model.cfm import NOISE_FRAMES
from cosyvoice_fast.flow.model.incremental import DecoderCache, StaticDecoderCache, check_estimator, decode_increment
from cosyvoice_fast.flow.model.incremental_encoder import EncoderCache, encode_increment


class StateCapacityError(RuntimeError):
    """A segment's flow state would outgrow the fixed-size buffers that hold it."""


STATE_VERSION = 1


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
