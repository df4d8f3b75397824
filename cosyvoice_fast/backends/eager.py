"""The eager PyTorch backend: the reference every faster backend is checked against."""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ..config import ModelConfig
from ..schedule import ChunkCall


class EagerLLM:
    """Speech-token generation with the model's own KV cache, one token per ``next``."""

    def __init__(self, llm: torch.nn.Module, config: ModelConfig):
        self.llm = llm
        self.config = config

    def generate(self, inputs: Any, text: torch.Tensor, generator: torch.Generator, max_tokens: int | None,
                 ignore_eos: bool) -> Iterator[int]:
        return self.llm.generate(text=text, prompt_text=inputs.prompt_text,
                                 prompt_speech_token=inputs.llm_prompt_speech_token, generator=generator,
                                 max_tokens=max_tokens, ignore_eos=ignore_eos)


def fold_to_flow_vocab(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Real CosyVoice2 has one 6561-token speech vocabulary for LM and flow.  Test-sized models (the parity
    fixture, ``--synthetic tiny``) give the flow a smaller table; fold ids into it so they run end to end.
    A no-op for the real model (ids are already below its vocabulary), and free of host syncs."""
    return torch.remainder(tokens, vocab)


def flow_chunk_mel(flow: torch.nn.Module, inputs: Any, tokens: torch.Tensor, call: ChunkCall,
                   stream: bool = True, estimator: Any = None) -> torch.Tensor:
    """Upstream's per-chunk flow call: the whole prefix is recomputed and the new frames are kept.

    Non-final streaming chunks run chunk-causal attention with ``call.lookahead`` trailing context tokens;
    the final chunk runs full attention, as upstream does.  ``estimator`` replaces the CFM estimator (a
    captured graph or TensorRT engine with the same calling convention); the encoder always runs eagerly.
    """
    dev = inputs.embedding.device
    tokens = fold_to_flow_vocab(tokens.to(dev), flow.cfg.vocab_size)
    tlen = torch.tensor([tokens.shape[1]], dtype=torch.int32, device=dev)
    ptok = inputs.flow_prompt_speech_token
    plen = torch.tensor([ptok.shape[1]], dtype=torch.int32, device=dev)
    streaming = stream and not call.finalize
    with torch.inference_mode():
        enc = flow.encode(tokens, tlen, ptok, plen, inputs.embedding, streaming=streaming,
                          finalize=call.finalize, n_lookahead=call.lookahead)
        mel = flow.decode(enc.mu, enc.spks, inputs.prompt_feat, streaming=streaming, estimator=estimator)
    return mel[:, :, call.token_offset * flow.cfg.token_mel_ratio:]


class EagerFlow:
    """Full-prefix recomputation per chunk (upstream's behaviour)."""

    def __init__(self, flow: torch.nn.Module, config: ModelConfig):
        self.flow = flow
        self.config = config

    def chunk(self, seg: Any, inputs: Any, tokens: torch.Tensor, call: ChunkCall, stream: bool = True
              ) -> torch.Tensor:
        return flow_chunk_mel(self.flow, inputs, tokens, call, stream)


class EagerVocoder:
    """HiFT in fp32 with the request's own generator for the NSF source noise."""

    def __init__(self, hift: torch.nn.Module):
        self.hift = hift

    def vocode(self, mel: torch.Tensor, cache_source: torch.Tensor, generator: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            return self.hift.inference(mel.float(), cache_source=cache_source.float(), generator=generator)
