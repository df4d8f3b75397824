"""Test-only helpers shared by several test modules (kept out of the package: nothing in production uses them)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from cosyvoice_fast.llm.buckets import token_budget
from cosyvoice_fast.llm.prefill import PrefillItem
from cosyvoice_fast.llm.stage import LLMState, accept_token
from cosyvoice_fast.llm.token_filter import NO_FILTER, TokenFilter


def teacher_forced_logp(stage: Any, lm_input: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """(len(tokens) + 1, V) log-probs of a :class:`~cosyvoice_fast.llm.graph.CudaGraphLLM` ``stage``: after
    prefilling ``lm_input``, then after feeding each token through the captured graphs (no masking, no sampling
    effects).  Drives the stage's own slot, prefill and replay internals, as only the parity tests need."""
    index, s = stage.pool.acquire()
    gen = torch.Generator(device=stage.device)
    try:
        with torch.inference_mode(), stage._lock:
            if stage._feed is not None:
                stage._feed.settle()
            stage._set_mask(s, 0, 0, False)
            token_budget(lm_input.shape[1], len(tokens) + 1, stage.max_len, True)
            s.q.exponential_(1.0, generator=gen)
            (group,) = stage.prefiller.groups([PrefillItem(0, None, s, lm_input=lm_input)])
            stage.prefiller.run(*group)
            rows = [s.logp.clone()]
            row = LLMState(text=lm_input, prompt_text=None, prompt_speech=None, generator=gen, min_len=0,
                           max_len=len(tokens) + 1, ignore_eos=False, slot=index)
            for i, tok in enumerate(tokens):
                row.history.append(int(tok))
                row.pos = lm_input.shape[1] + i
                if stage._feed is not None:  # the batched graph, this row alone (others not live)
                    stage._launch([row], ahead=False)
                    stage._feed.take(index, row, row.step)  # only the log-probs are wanted
                else:  # the batched graph, this row alone (others idle at max_len - 1)
                    stage._replay_rows([row])
                rows.append(s.logp.clone())
        return torch.stack(rows)
    finally:
        stage.pool.release(index)


def random_full_size_lm(dtype: torch.dtype, device: str = "cuda", seed: int = 0) -> torch.nn.Module:
    """The speech LM at CosyVoice2-0.5B shapes with seeded random weights (norms at 1, a sharper speech head so
    sampling is not flat): what the GPU tests and the fused-decode check time and compare backends on."""
    from cosyvoice_fast.config.model import full_config
    from cosyvoice_fast.llm.model.speech_lm import Qwen2LM

    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        lm = Qwen2LM(full_config().llm)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.1 if name.startswith("llm_decoder.weight") else 0.02, generator=g)
    return lm.to(dtype).eval().requires_grad_(False)


class ScriptedLLM:
    """An LLM stage that draws a fixed token script (to replay upstream's recorded tokens through the real flow and
    vocoder); its states carry ``token_filter`` (the engine must ask it) and are kept in ``states``."""

    capacity = None
    prefill_synced = True  # host-side tokens: nothing to wait for

    def __init__(self, tokens: list[int], token_filter: TokenFilter = NO_FILTER):
        self.tokens, self.filter, self.states = tokens, token_filter, []

    def new_state(self, inputs, text, generator, max_tokens, ignore_eos):  # noqa: ANN001
        st = LLMState(text, None, None, generator, 0, len(self.tokens), ignore_eos, token_filter=self.filter)
        self.states.append(st)
        return st

    def free_slots(self):
        return None

    def decode(self, states):  # noqa: ANN001
        return [accept_token(st, self.tokens[st.step], 1 << 30) for st in states]

    prefill = decode

    def release(self, state):  # noqa: ANN001
        pass


@contextmanager
def serving(app: Any) -> Iterator[int]:
    """uvicorn serving the ASGI ``app`` on a free 127.0.0.1 port in a daemon thread; yields the port, stops on
    exit.  ``log_level="warning"``: a test that reads the server's log sets its own handler level."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@contextmanager
def tiny_api(speaker_dir: Any, **mount_kw: Any) -> Iterator[tuple[Any, int]]:
    """The HTTP + WebSocket API (``mount_api(app, svc, **mount_kw)``) over the tiny synthetic model on CPU, served
    by :func:`serving`; yields (service, port) and closes the service on exit."""
    from fastapi import FastAPI

    from cosyvoice_fast.serving.http import mount_api
    from cosyvoice_fast.serving.service import load_service

    svc = load_service(None, "tiny", "cpu", "fp32", speaker_cache_dir=speaker_dir, progress=False)
    try:
        app = FastAPI()
        mount_api(app, svc, **mount_kw)
        with serving(app) as port:
            yield svc, port
    finally:
        svc.close()
