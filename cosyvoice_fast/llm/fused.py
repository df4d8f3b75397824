"""The ``fused`` LLM backend: the ``cudagraph`` runner with each decode step's decoder math on Triton kernels.

The ``cudagraph`` decoder launches ~19 kernels per layer (469 per step at 24 layers) and is GPU-bound by their
count, not by the 0.7 GB of bf16 weights it reads.  The fused step (:mod:`..kernels.qwen2_decode`) is 5 kernels
per layer (123 per step), chained with programmatic dependent launch.  Everything else (slots, prefill graphs,
KV buckets, batched rounds, sampling draw for draw) is the ``cudagraph`` runner's: it is handed the speech LM with
its decoder wrapped in a :class:`~..kernels.qwen2_decode.FusedDecoder`, which takes the one-token-per-row calls the
runner makes inside its decode graphs and passes prefill calls through to the model.  The runner's warm-up pass
runs every captured shape once before capture, which is when Triton compiles (a handful of variants: rows 1..16
share one row block, each row count picks its attention split count).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.config.backends import TRITON_MISSING, BackendUnavailable
from cosyvoice_fast.kernels.graphs import cuda_missing
from cosyvoice_fast.llm.graph import CudaGraphLLM


def why_unavailable_on(device: torch.device, engines_dir: Path | None = None) -> str | None:
    """Why this backend cannot run on ``device`` (the availability registry asks), or None when it can."""
    missing = cuda_missing(device)
    if missing is not None:
        return missing
    return TRITON_MISSING if importlib.util.find_spec("triton") is None else None


#: the attention kernels' score and value products are ``tl.dot`` calls, which need K >= 16 on a GPU
MIN_HEAD_DIM = 16


def why_unavailable(llm: torch.nn.Module) -> str | None:
    """The reason this backend cannot drive ``llm`` here, or None when it can."""
    reason = why_unavailable_on(next(llm.parameters()).device)
    if reason is not None:
        return f"llm backend 'fused' {reason}; choose 'eager' instead"
    head_dim = llm.cfg.qwen.head_dim
    if head_dim < MIN_HEAD_DIM and next(llm.parameters()).device.type == "cuda":
        return (f"llm backend 'fused' needs attention heads of at least {MIN_HEAD_DIM} dims (its attention is "
                f"tl.dot tiles); this model's heads have {head_dim} (the real models have 64): choose 'cudagraph'")
    return None


class _FusedView:
    """The speech LM as the graph runner sees it: the same module (parameters, embeddings, head, prefill),
    except that ``decoder`` is the fused drop-in.  The fused head kernels add a bias; a head without one
    (CosyVoice3's) is handed to them with a zero bias, which adds exactly nothing."""

    def __init__(self, llm: torch.nn.Module, decoder: Any):
        head = llm.llm_decoder
        if head.bias is None:
            head = SimpleNamespace(weight=head.weight, bias=torch.zeros(head.weight.shape[0], dtype=head.weight.dtype,
                                                                        device=head.weight.device))
        self.__dict__.update(_llm=llm, decoder=decoder, _head=head)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_llm"], name)

    def step_log_probs(self, tokens: torch.Tensor, pos: torch.Tensor, cache: Any,
                       kv_len: int | None = None) -> torch.Tensor:
        """The model's decode step on the fused decoder; a step below cuBLAS rows runs from the embedding
        gather to the speech head's logits as one kernel chain (:func:`~..kernels.qwen2_decode.step_logits`)."""
        llm, decoder = self.__dict__["_llm"], self.__dict__["decoder"]
        logits = decoder.step_logits(llm.speech_embedding.weight, self.__dict__["_head"], tokens, pos, cache, kv_len)
        if logits is None:
            hidden = decoder(llm.speech_embedding(tokens), pos, cache, kv_len=kv_len)
            return llm.log_probs(hidden[:, -1])
        return logits.log_softmax(dim=-1)


class FusedLLM(CudaGraphLLM):
    """:class:`CudaGraphLLM` over the fused decode step; same constructor arguments and public behaviour, plus
    ``splits``: the attention's key splits (default: chosen per row count) and ``tiles``: the kernels' frozen
    tuning (a :class:`~..kernels.qwen2_proj.Tiles`; None: the GPU default), which a benchmark passes to build a
    variant."""

    def __init__(self, llm: torch.nn.Module, config: ModelConfig, *, splits: int | None = None,
                 tiles: Any = None, **kwargs: Any):
        reason = why_unavailable(llm)
        if reason is not None:
            raise BackendUnavailable(reason)
        from cosyvoice_fast.llm.kernels.qwen2_decode import FusedDecoder

        decoder = FusedDecoder(llm.decoder, splits) if tiles is None else FusedDecoder(llm.decoder, splits, tiles)
        super().__init__(_FusedView(llm, decoder), config, **kwargs)
