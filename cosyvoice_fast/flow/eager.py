"""The eager flow backend: the reference every faster flow backend is checked against."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.config.schedule import ChunkCall, plan_solves


def fold_to_flow_vocab(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Real CosyVoice2 has one 6561-token speech vocabulary for LM and flow.  Test-sized models (the parity
    fixture, ``--synthetic tiny``) give the flow a smaller table; fold ids into it so they run end to end.
    A no-op for the real model (ids are already below its vocabulary), and free of host syncs."""
    return torch.remainder(tokens, vocab)


def _encode_call(flow: torch.nn.Module, inputs: Any, tokens: torch.Tensor, call: ChunkCall, streaming: bool,
                 encode: Any = None):
    """The encoder half of one flow call (per request): ``FlowEncoding`` over prompt + tokens.

    ``encode`` replaces ``flow.encode`` (same signature, e.g. a graph-replaying runner).  A runner that takes
    chunk calls itself (``encode_calls``, the graph encoder) gets this one directly: the length tensors built
    here for ``flow.encode``'s signature would be two more host-to-device copies, with the GPU idle, before a
    first chunk's encoder starts."""
    encode_calls = getattr(encode, "encode_calls", None)
    if encode_calls is not None:
        return encode_calls([(inputs, tokens, call)], streaming)[0]
    dev = inputs.embedding.device
    tokens = fold_to_flow_vocab(tokens.to(dev), flow.cfg.vocab_size)
    tlen = torch.tensor([tokens.shape[1]], dtype=torch.int32, device=dev)
    ptok = inputs.flow_prompt_speech_token
    plen = torch.tensor([ptok.shape[1]], dtype=torch.int32, device=dev)
    return (encode or flow.encode)(tokens, tlen, ptok, plen, inputs.embedding, streaming=streaming,
                                   finalize=call.finalize, n_lookahead=call.lookahead)


def _encode_group(flow: torch.nn.Module, group: list[tuple[Any, torch.Tensor, ChunkCall]], streaming: bool,
                  encode: Any = None) -> list[Any]:
    """The encoder half of several calls of one exact shape (token count, prompt length, look-ahead, finalize)
    as one pass: rows of the encoder never mix (no padding is needed at equal shapes), so each row equals its
    own pass within float rounding (another GEMM batch size)."""
    from cosyvoice_fast.flow.model.flow import FlowEncoding

    if len(group) == 1:
        inputs, tokens, call = group[0]
        return [_encode_call(flow, inputs, tokens, call, streaming, encode)]
    dev = group[0][0].embedding.device
    here = group[0][1].device  # token ids arrive on the host from the scheduler: one copy for all rows
    tokens = fold_to_flow_vocab(torch.cat([t.to(here) for _, t, _ in group]).to(dev), flow.cfg.vocab_size)
    ptok = torch.cat([inp.flow_prompt_speech_token for inp, _, _ in group])
    emb = torch.cat([inp.embedding for inp, _, _ in group])
    rows = len(group)
    tlen = torch.full((rows,), tokens.shape[1], dtype=torch.int32, device=dev)
    plen = torch.full((rows,), ptok.shape[1], dtype=torch.int32, device=dev)
    call = group[0][2]
    enc = (encode or flow.encode)(tokens, tlen, ptok, plen, emb, streaming=streaming, finalize=call.finalize,
                                  n_lookahead=call.lookahead)
    return [FlowEncoding(enc.mu[i:i + 1], enc.spks[i:i + 1]) for i in range(rows)]


def flow_chunk_mel(flow: torch.nn.Module, inputs: Any, tokens: torch.Tensor, call: ChunkCall,
                   stream: bool = True, estimator: Any = None, encode: Any = None) -> torch.Tensor:
    """Upstream's per-chunk flow call: the whole prefix is recomputed and the new frames are kept.

    Non-final streaming chunks run chunk-causal attention with ``call.lookahead`` trailing context tokens;
    the final chunk runs full attention, as upstream does.  ``estimator`` replaces the CFM estimator (a
    captured graph or TensorRT engine with the same calling convention), ``encode`` the encoder.
    """
    streaming = stream and not call.finalize
    with torch.inference_mode():
        enc = _encode_call(flow, inputs, tokens, call, streaming, encode)
        mel = flow.decode(enc.mu, enc.spks, inputs.prompt_feat, streaming=streaming, estimator=estimator)
    return mel[:, :, call.token_offset * flow.cfg.token_mel_ratio:]


#: ``(seg, inputs, tokens, call)``: one request's pending flow call, as passed to ``FlowStage.chunk``.
ChunkItem = tuple[Any, Any, torch.Tensor, ChunkCall]


def flow_chunk_mel_batch(flow: torch.nn.Module, items: Sequence[ChunkItem], stream: bool = True,
                         estimator: Any = None, max_items: int = 16,
                         cost: Callable[[int, int], float] | None = None, budget: float | None = None,
                         same_length: bool = False, encode: Any = None) -> list[torch.Tensor]:
    """:func:`flow_chunk_mel` for several requests' calls, with the CFM solves shared.

    Items of one exact shape (token count, prompt length, look-ahead, finalize: e.g. the first chunks of a
    burst of requests) share encoder passes (:func:`_encode_group`); the others are encoded on their own.  An
    ``encode`` with an ``encode_calls`` method (the graph encoder) takes each attention mode's items at once.
    Then the items with the same attention mode (non-final streaming calls chunk-causal, final calls full) run
    ONE guided Euler solve over their right-padded ``mu`` (:meth:`decode_batch`; split by :func:`plan_solves`).
    Returns one mel per item, in order, each equal to that item's :func:`flow_chunk_mel` (float rounding).
    """
    out: list[torch.Tensor | None] = [None] * len(items)
    ratio = flow.cfg.token_mel_ratio
    with torch.inference_mode():
        modes = [stream and not call.finalize for _, _, _, call in items]
        encs: list[Any] = [None] * len(items)
        encode_calls = getattr(encode, "encode_calls", None)
        if encode_calls is not None:  # a runner that pads mixed lengths itself (GraphEncoder)
            for mode in (True, False):
                idx = [i for i, m in enumerate(modes) if m == mode]
                if idx:
                    for i, enc in zip(idx, encode_calls([(items[i][1], items[i][2], items[i][3]) for i in idx],
                                                        mode)):
                        encs[i] = enc
        else:
            shapes: dict[tuple, list[int]] = {}
            for i, (_, inputs, tokens, call) in enumerate(items):
                key = (int(tokens.shape[1]), int(inputs.flow_prompt_speech_token.shape[1]), modes[i],
                       call.finalize, call.lookahead, inputs.embedding.dtype)
                shapes.setdefault(key, []).append(i)
            for idx in shapes.values():
                group = [(items[i][1], items[i][2], items[i][3]) for i in idx]
                for i, enc in zip(idx, _encode_group(flow, group, modes[idx[0]], encode)):
                    encs[i] = enc
        for streaming in (True, False):
            idx = [i for i, m in enumerate(modes) if m == streaming]
            if not idx:
                continue
            for group in plan_solves([int(encs[i].mu.shape[2]) for i in idx], max_items, cost, budget,
                                     same_length):
                sel = [idx[j] for j in group]
                mels = flow.decode_batch([encs[i].mu for i in sel], [encs[i].spks for i in sel],
                                         [items[i][1].prompt_feat for i in sel], streaming=streaming,
                                         estimator=estimator)
                for i, mel in zip(sel, mels):
                    out[i] = mel[:, :, items[i][3].token_offset * ratio:]
    return out  # type: ignore[return-value]


class EagerFlow:
    """Full-prefix recomputation per chunk (upstream's behaviour).

    :meth:`solve` shares the CFM solve between up to ``max_batch`` items whose estimator inputs have the same
    length (no padding: padded attention reduces over more keys, so this reference backend never pads).  Each
    item equals its own :meth:`chunk` to float rounding (~1e-6 in fp32), but not always bit for bit: BLAS may
    block a bigger batch differently (on CPU, 8 items already differ in the last bits, 4 do not).  Bit-for-bit
    equality with a solo run is this reference backend's contract on CPU, where batching buys nothing
    (compute-bound), so there ``max_batch`` defaults to 1 (``solve`` is then a loop of :meth:`chunk`); on a
    GPU, where each chunk is launch-bound, it defaults to 16.  It keeps no flow state (``incremental`` None)."""

    incremental = None  # FlowStage: no runner here keeps flow state between chunks

    def __init__(self, flow: torch.nn.Module, config: ModelConfig):
        self.flow = flow
        self.config = config
        on_gpu = next(flow.parameters()).device.type == "cuda"
        self.max_batch = 16 if on_gpu else 1  # items per batched CFM solve

    def chunk(self, seg: Any, inputs: Any, tokens: torch.Tensor, call: ChunkCall, stream: bool = True
              ) -> torch.Tensor:
        return flow_chunk_mel(self.flow, inputs, tokens, call, stream)

    def solve(self, items: Sequence[ChunkItem], stream: bool = True) -> list[torch.Tensor]:
        """Several requests' chunks with shared CFM solves; one mel per item, each equal to its :meth:`chunk`."""
        if len(items) == 1 or self.max_batch <= 1:
            return [self.chunk(*item, stream=stream) for item in items]
        return flow_chunk_mel_batch(self.flow, items, stream, max_items=self.max_batch, same_length=True)
