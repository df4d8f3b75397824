"""The ``trtllm`` LLM backend: the speech LM as a TensorRT-LLM engine, streamed token by token.

NOT RUN in this project's CI or on its benchmark GPU (TensorRT-LLM is not installable there); written against
TensorRT-LLM's public Python API (``ModelRunnerCpp``, ``QWenForCausalLM.from_hugging_face``, ``build``) and
covered on CPU up to the exported checkpoint (``tests/test_trtllm_export.py``).

Differences from eager, stated honestly: sampling is TensorRT-LLM's top-k/top-p (k 25, p 0.8) without RAS's
repetition window, so tokens are not identical to eager for the same seed.  The speech head's bias and the
mask of non-speech ids are applied by a logits post-processor (see :mod:`.trtllm_export`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.config.backends import BackendUnavailable
from cosyvoice_fast.kernels.graphs import cuda_missing
from cosyvoice_fast.llm.stage import LLMState, StepResult, accept_token, new_llm_state

log = logging.getLogger(__name__)

ENGINE_GLOB = "llm_trtllm*"


def why_unavailable_on(device: torch.device, engines_dir: Path | None = None) -> str | None:
    """Why this backend cannot run on ``device`` (the availability registry asks), or None: a CUDA GPU, and with
    ``engines_dir`` given the tensorrt_llm package and an engine built there."""
    missing = cuda_missing(device)
    if missing is not None or engines_dir is None:
        return missing
    if importlib.util.find_spec("tensorrt_llm") is None:
        return "package tensorrt_llm is not installed (pip install -r requirements-trt.txt)"
    if find_engine_dir(engines_dir) is None:
        return "no TensorRT-LLM engine built yet: run python -m cosyvoice_fast build-engines --model-dir DIR"
    return None


def find_engine_dir(engines_dir: str | Path = "engines") -> Path | None:
    dirs = sorted(Path(engines_dir).glob(ENGINE_GLOB))
    return dirs[-1] if dirs else None


class TrtLlmLLM:
    """Streams speech tokens from a TensorRT-LLM engine built by ``python -m cosyvoice_fast build-engines``."""

    def __init__(self, llm: torch.nn.Module, config: ModelConfig, engines_dir: str | Path = "engines"):
        if importlib.util.find_spec("tensorrt_llm") is None:
            raise BackendUnavailable("package tensorrt_llm is not installed (pip install -r requirements-trt.txt)")
        engine_dir = find_engine_dir(engines_dir)
        if engine_dir is None:
            raise BackendUnavailable("no TensorRT-LLM engine in engines/: run python -m cosyvoice_fast build-engines")
        from safetensors.torch import load_file
        from tensorrt_llm.runtime import ModelRunnerCpp

        meta = json.loads((engine_dir / "cosyvoice_fast.json").read_text())
        head = load_file(str(engine_dir / "speech_head.safetensors"))
        self.offset = int(meta["speech_offset"])
        self.rows = int(meta["speech_rows"])
        self.sos_id, self.task_id = int(meta["sos_id"]), int(meta["task_id"])
        self.config = config
        self.eos = config.llm.eos_token
        self.bias = head["bias"].cuda()
        self.runner = ModelRunnerCpp.from_dir(engine_dir=str(engine_dir),
                                              logits_processor_map={"cosyvoice_speech_head": self._logits})
        self.llm = llm

    def _logits(self, req_id: int, logits: torch.Tensor, ids: list[list[int]], stream_ptr: int,
                client_id: int | None) -> None:
        """Add the speech head's bias and forbid every non-speech id (the minimum length is ``min_tokens``)."""
        with torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr)):
            speech = logits[..., self.offset:self.offset + self.rows] + self.bias.to(logits.dtype)
            logits.fill_(float("-inf"))
            logits[..., self.offset:self.offset + self.rows] = speech

    capacity: int | None = None  # TensorRT-LLM's runner batches its own requests
    prefill_synced = False

    def new_state(self, inputs: Any, text: torch.Tensor, generator: torch.Generator, max_tokens: int | None,
                  ignore_eos: bool) -> LLMState:
        return new_llm_state(self.llm, inputs, text, generator, max_tokens, ignore_eos)

    def free_slots(self) -> int | None:
        return None

    def _tokens(self, st: LLMState) -> Iterator[int]:
        """The runner's token stream for one state (kept in ``st.extra``; TensorRT-LLM owns its scheduling)."""
        from cosyvoice_fast.llm.trtllm_export import ExtendedVocab

        vocab = ExtendedVocab(self.offset, self.rows)
        ids = vocab.lm_input_ids(st.text.cpu(), st.prompt_text.cpu(), st.prompt_speech.cpu())
        min_len = st.max_len if st.ignore_eos else st.min_len  # it cannot mask stop ids per step: no early stop
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=st.generator, device=st.generator.device).item())
        stream = self.runner.generate(
            [torch.tensor(ids, dtype=torch.int32)], max_new_tokens=st.max_len, end_id=self.offset + self.eos,
            pad_id=self.offset + self.eos, top_k=self.config.llm.top_k, top_p=self.config.llm.top_p,
            min_tokens=min_len, random_seed=seed, streaming=True, return_dict=True, logits_processor_names=["cosyvoice_speech_head"])
        emitted = 0
        for out in stream:
            seq = out["output_ids"][0][0].tolist()[len(ids):]
            for tok in seq[emitted:]:
                emitted += 1
                yield tok - self.offset

    def _next(self, st: LLMState) -> StepResult:
        try:
            tok = next(st.extra, None)
            out = accept_token(st, self.config.llm.speech_token_size if tok is None or tok < 0 else tok,
                               self.config.llm.speech_token_size)
        except Exception as e:  # noqa: BLE001 - a row's failure is that row's own
            st.done = True
            out = e
        if st.done:
            self.release(st)
        return out

    def prefill(self, states: Sequence[LLMState]) -> list[StepResult]:
        for st in states:
            st.extra = self._tokens(st)
        return [self._next(st) for st in states]

    def decode(self, states: Sequence[LLMState]) -> list[StepResult]:
        return [self._next(st) for st in states]

    def release(self, state: LLMState) -> None:
        if state.extra is not None:
            state.extra.close()
            state.extra = None
