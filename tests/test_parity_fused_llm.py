"""The fused decode step on the parity fixture (fp32): upstream's forced log-probs, greedy tokens, and the same
seeded tokens as the eager LM.

On CPU the Triton kernels run through the interpreter (~1 s per step at the fixture's size), so each test walks
only the first few steps of the recorded sequences; the GPU tests (tests/test_fused_llm.py) walk hundreds.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from cosyvoice_fast.llm import graph as cudagraph_llm, fused as fused_llm  # noqa: E402
from cosyvoice_fast.bench.llm_tools import generate_alone  # noqa: E402
from cosyvoice_fast.llm.eager import EagerLLM  # noqa: E402
from cosyvoice_fast.config.model import ModelConfig  # noqa: E402
from cosyvoice_fast.frontend.request import ModelInputs  # noqa: E402
from cosyvoice_fast.llm.kernels.qwen2_decode import FusedDecoder  # noqa: E402
from cosyvoice_fast.llm.model.speech_lm import Qwen2LM  # noqa: E402

TOL = 1e-4
STEPS = 5  # decode steps per test on the interpreter


@pytest.fixture(scope="module")
def cfg(fixture_dir) -> ModelConfig:
    return ModelConfig.from_files(fixture_dir / "cosyvoice2.yaml", fixture_dir / "CosyVoice-BlankEN/config.json")


@pytest.fixture(scope="module")
def lm(fixture_dir, cfg) -> Qwen2LM:
    model = Qwen2LM(cfg.llm)
    model.load_state_dict(torch.load(fixture_dir / "llm.pt", weights_only=True), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def case(load_case) -> dict:
    return load_case("case_llm")


def _steps(lm: Qwen2LM, case: dict, n: int, choose) -> tuple[torch.Tensor, list[int]]:  # noqa: ANN001
    """Prefill the zero-shot input (eager), then ``n`` fused decode steps feeding ``choose(i, logp)`` back.

    Returns the log-probs after the prefill and after each fed token ((n + 1, V)) and the fed tokens."""
    fused = FusedDecoder(lm.decoder, splits=1)
    with torch.inference_mode():
        x = lm.build_lm_input(case["text"], case["prompt_text"], case["prompt_speech_token"])
        cache = lm.new_cache(x.shape[1] + n)
        rows = [lm.prefill(x, cache)[0]]
        fed = []
        for i in range(n):
            pos = x.shape[1] + i
            fed.append(int(choose(i, rows[-1])))
            hidden = fused(lm.embed_speech(fed[-1]), torch.tensor([pos]), cache, kv_len=pos + 1)
            rows.append(lm.log_probs(hidden[:, -1])[0])
    return torch.stack(rows), fed


def test_fused_forced_steps_match_upstream_log_probs(lm, case):
    forced = case["forced_tokens"].tolist()
    n = min(STEPS, len(forced))
    rows, _ = _steps(lm, case, n, lambda i, _: forced[i])
    assert (rows[1:] - case["forced_logp"][:n]).abs().max().item() <= TOL


def test_fused_greedy_tokens_match_upstream(lm, case):
    greedy = case["greedy_tokens"].tolist()
    n = min(STEPS, len(greedy) - 1)
    rows, fed = _steps(lm, case, n, lambda i, logp: logp.argmax())
    assert fed + [int(rows[-1].argmax())] == greedy[:n + 1]


def test_fused_seeded_sampling_equals_eager_generate(lm, case):
    """The default RAS sampler on the fused log-probs draws the eager generator's tokens (eos ignored)."""
    seed, n = 7, STEPS
    eager = list(lm.generate(case["text"], case["prompt_text"], case["prompt_speech_token"],
                             generator=torch.Generator().manual_seed(seed), max_tokens=n + 1, ignore_eos=True))
    sampler, gen, stop = lm.default_sampler(), torch.Generator().manual_seed(seed), lm.cfg.speech_token_size
    history: list[int] = []

    def draw(_: int, logp: torch.Tensor) -> int:
        logp = logp.clone()
        logp[stop:] = -float("inf")
        history.append(int(sampler(logp, history, gen)))
        return history[-1]

    rows, _ = _steps(lm, case, n, draw)
    draw(n, rows[-1])
    assert history == eager and len(eager) == n + 1


def _together(stage, jobs: list[tuple]) -> list[list[int]]:
    """Run requests the way the engine does: one ``prefill`` over all, then one batched ``decode`` per turn over
    every running one.  ``jobs``: ``(inputs, text, generator, max_tokens, ignore_eos)``."""
    states = [stage.new_state(*job) for job in jobs]
    out: list[list[int]] = [[] for _ in jobs]
    call, live = stage.prefill, list(range(len(jobs)))
    while live:
        for i, r in zip(live, call([states[i] for i in live])):
            assert not isinstance(r, BaseException), r
            if r is not None:
                out[i].append(r)
        call, live = stage.decode, [i for i in live if not states[i].done]
    return out


class _EagerReplay:
    """Stands in for a captured graph: replaying runs the captured maths (here: the fused kernels) directly."""

    def __init__(self, fn):  # noqa: ANN001
        self.replay = fn


class _CpuFusedLLM(fused_llm.FusedLLM):
    def _capture_all(self, progress: bool, defer: bool = False) -> int:  # every graph (no background here)
        jobs = self._graph_jobs()
        for where, key, math in jobs:
            where[key] = _EagerReplay(math)
        return len(jobs)


@pytest.mark.parametrize("prefill", ["eager", "fused"])
def test_fused_backend_batched_rounds_equal_eager(lm, cfg, case, prefill, monkeypatch):
    """The whole backend (slots, batched rounds of two requests, per-row positions, sampling) over the fused
    step, with graph replays run directly: both requests draw the eager backend's tokens.  ``fused``: both
    prompts in one batched prefill on the fused kernels (padded to a bucket, keys straight into the slots);
    ``eager``: no prefill bucket, each prompt through the model's own prefill."""
    monkeypatch.setattr(fused_llm, "why_unavailable", lambda llm: None)
    monkeypatch.setattr(cudagraph_llm, "why_unavailable", lambda llm: None)
    inputs = ModelInputs(text_segments=[case["text"]], prompt_text=case["prompt_text"],
                         llm_prompt_speech_token=case["prompt_speech_token"])
    n_in = lm.build_lm_input(case["text"], case["prompt_text"], case["prompt_speech_token"]).shape[1]
    buckets = () if prefill == "eager" else (n_in + 3,)  # padding positions too
    stage = _CpuFusedLLM(lm, cfg, slots=2, max_len=n_in + 3 + STEPS + 8, kv_buckets=(n_in + STEPS + 8,),
                         prefill_buckets=buckets, progress=False, splits=1)
    n = STEPS
    ref = [generate_alone(EagerLLM(lm, cfg), inputs, case["text"], torch.Generator().manual_seed(s), n, True)
           for s in (1, 2)]
    got = _together(stage, [(inputs, case["text"], torch.Generator().manual_seed(s), n, True) for s in (1, 2)])
    assert got == ref
    assert stage.batched_rows == 2 * (n - 1) and stage.batched_steps == n - 1  # every step carried both rows
    assert stage.slots_in_use == 0
    assert (stage.prefiller.calls, stage.prefiller.rows_done) == ((0, 0) if prefill == "eager" else (1, 2))
