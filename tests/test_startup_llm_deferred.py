"""The ``cudagraph`` LLM before ready: only the plan's few graphs are captured, a step pads up to the smallest
CAPTURED graph that covers it (rows and KV length), and padded steps give exactly the tokens of unpadded ones.

The runner refuses a CPU model, so these tests stand a fake capture in for CUDA's: a "graph" replays its step's
math eagerly.  That is the runner's own code path (bucket choice, padded rows at ``max_len - 1``, the spare
prefill row, publishing), minus the capture itself, which the GPU tests cover."""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch

from cosyvoice_fast.bench.llm_tools import generate_alone
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.config.graph_plan import llm_jobs, split_ready
from cosyvoice_fast.frontend.request import ModelInputs
from cosyvoice_fast.kernels import graphs
from cosyvoice_fast.kernels.graphs import BackgroundCaptures
from cosyvoice_fast.llm.buckets import captured_shape
from cosyvoice_fast.llm.model.kv_cache import KVCacheFullError

SLOTS, MAX_LEN = 3, 1024  # default KV buckets 256, 512, 1024; decode rows 1, 2, 3


def test_the_chooser_takes_the_smallest_captured_bucket_then_the_fewest_rows():
    captured = {(256, 1), (256, 64), (2048, 1), (2048, 64)}
    assert captured_shape(captured, 1, 1) == (256, 1)
    assert captured_shape(captured, 256, 2) == (256, 64)  # rows padded, same bucket
    assert captured_shape(captured, 257, 1) == (2048, 1)  # KV length padded
    assert captured_shape(captured, 300, 3) == (2048, 64)
    assert captured_shape(captured | {(512, 4)}, 300, 3) == (512, 4)  # a middle one, once captured
    with pytest.raises(KVCacheFullError, match="no captured graph holds 2049 positions x 1 rows"):
        captured_shape(captured, 2049, 1)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CudaGraphLLM on the CPU: a capture records its step (replay runs it), streams are no-ops."""
    from cosyvoice_fast.llm import graph as lgraph
    from cosyvoice_fast.llm import graph_capture as lcap

    def fake_capture(fn, device, pool, warmup=1):  # noqa: ANN001
        graphs.count_capture()
        return types.SimpleNamespace(replay=fn), None

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(lgraph, "why_unavailable", lambda llm: None)
    monkeypatch.setattr(lcap, "capture", fake_capture)
    monkeypatch.setattr(lcap, "capture_stream", lambda device: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def _llm(tiny_models, defer: bool):
    from cosyvoice_fast.llm.graph import CudaGraphLLM

    return CudaGraphLLM(copy.deepcopy(tiny_models.llm), tiny_models.config, slots=SLOTS, max_len=MAX_LEN,
                        progress=False, defer_capture=defer)


def _together(stage, case, seeds, n, device="cpu"):  # noqa: ANN001
    """``len(seeds)`` requests decoded in the same steps (rows 0 .. len-1), ``n`` forced tokens each."""
    inputs = ModelInputs(text_segments=[case["text"]], prompt_text=case["prompt_text"],
                         llm_prompt_speech_token=case["prompt_speech_token"])
    states = [stage.new_state(inputs, case["text"], torch.Generator(device).manual_seed(s), n, True)
              for s in seeds]
    stage.prefill(states)
    while not all(st.done for st in states):
        stage.decode([st for st in states if not st.done])
    return [st.history for st in states]


def test_before_ready_the_runner_captures_the_plans_graphs_and_defers_the_rest(tiny_models, fake_cuda):
    engine = EngineConfig(background_capture=True)
    before, after = split_ready(llm_jobs(SLOTS, MAX_LEN), engine)
    stage = _llm(tiny_models, defer=True)
    now = sorted(stage._batch_graphs) + sorted(stage.prefiller.graphs)
    assert now == sorted(j.shape for j in before if j.family == "llm-decode") + \
        sorted(j.shape for j in before if j.family == "llm-prefill")
    assert sorted(stage._batch_graphs) == [(256, 1), (256, 3), (1024, 1), (1024, 3)]
    assert [(d.family, d.shape) for d in stage.deferred] == [(j.family, j.shape) for j in after]
    full = _llm(tiny_models, defer=False)
    assert full.deferred == [] and len(full._batch_graphs) + len(full.prefiller.graphs) == len(before) + len(after)


def test_padded_steps_give_exactly_the_unpadded_tokens_and_background_graphs_are_used_once_in(
        tiny_models, load_case, fake_cuda):
    from cosyvoice_fast.llm.buckets import bucket_for

    case = load_case("case_llm")
    full, early = _llm(tiny_models, defer=False), _llm(tiny_models, defer=True)
    n = 300  # the fixture's prompt + 300 tokens crosses the 256 and 512 KV buckets
    wanted: set[tuple[int, int]] = set()  # the exact (bucket, rows) of each step
    replay = early._replay

    def spy(top: int, last_slot: int) -> None:
        wanted.add((bucket_for(early.buckets, top), next(c for c in early.row_counts if c > last_slot)))
        replay(top, last_slot)

    early._replay = spy
    two = _together(full, case, (7, 8), n)
    assert _together(early, case, (7, 8), n) == two  # 2 rows padded to 3, 512-long attention padded to 1024
    assert {(256, 2), (512, 2)} <= wanted  # padded to (1024, 3): neither is captured before ready
    assert generate_alone(early, *_alone(case, 9, n)) == generate_alone(full, *_alone(case, 9, n))
    worker = BackgroundCaptures(device="cpu")
    worker.add(early.deferred)
    assert worker.join(120) and worker.failed == 0 and worker.done == len(early.deferred)
    assert sorted(early._batch_graphs) == sorted(full._batch_graphs)
    assert sorted(early.prefiller.graphs) == sorted(full.prefiller.graphs)
    assert _together(early, case, (7, 8), n) == two
    assert early.slots_in_use == 0


def _alone(case, seed, n):  # noqa: ANN001
    inputs = ModelInputs(text_segments=[case["text"]], prompt_text=case["prompt_text"],
                         llm_prompt_speech_token=case["prompt_speech_token"])
    return inputs, case["text"], torch.Generator().manual_seed(seed), n, True


@pytest.mark.gpu
def test_gpu_padded_steps_and_concurrent_background_captures_give_the_tokens_of_every_graph_captured(
        tiny_models, load_case):
    """Real graphs (device RAS, decode ahead): the deferred runner's padded steps, then the same requests while
    the background thread captures the rest, then with everything in, equal the fully captured runner's tokens;
    no capture happens on this (a request's) thread."""
    from cosyvoice_fast.llm.graph import CudaGraphLLM

    case = load_case("case_llm")

    def build(defer: bool) -> CudaGraphLLM:
        llm = copy.deepcopy(tiny_models.llm).cuda()
        return CudaGraphLLM(llm, tiny_models.config, slots=SLOTS, max_len=MAX_LEN, progress=False,
                            defer_capture=defer)

    full, early = build(False), build(True)
    seeds, n = (21, 22), 300
    want = _together(full, case, seeds, n, "cuda")
    assert _together(early, case, seeds, n, "cuda") == want  # padded: only the plan's 12 graphs exist
    fg = graphs.captures()
    worker = BackgroundCaptures(device="cuda")
    worker.add(early.deferred)
    during = _together(early, case, seeds, n, "cuda")  # while it captures
    assert worker.join(300) and worker.failed == 0, worker.errors
    assert during == want and graphs.captures() == fg
    assert sorted(early._batch_graphs) == sorted(full._batch_graphs)
    assert _together(early, case, seeds, n, "cuda") == want and early.slots_in_use == 0
