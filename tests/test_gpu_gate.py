"""The gate between graph captures and serving GPU work (``kernels.gpu_gate``): a capture waits for the work in
progress and holds new work back; work never waits for itself; the engine's turns and admissions hold it.  And
what a failed capture leaves behind (its pool released, the gate free), and the background thread's BLAS set-up
before its first capture: both failures seen on an H200 (docs/RESULTS.md, round 3 session 4)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from cosyvoice_fast.engine.engine import Engine
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.kernels.gpu_gate import GPU_GATE, GpuGate


def _thread(fn) -> threading.Thread:  # noqa: ANN001
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_capture_waits_for_work_in_progress_and_holds_new_work_back():
    gate, order = GpuGate(), []
    working, release = threading.Event(), threading.Event()

    def turn() -> None:
        with gate.work():
            working.set()
            release.wait(5)
            order.append("turn ends")

    def capture() -> None:
        with gate.exclusive():
            order.append("capture")
            time.sleep(0.1)
            order.append("capture ends")

    def later_turn() -> None:
        with gate.work():
            order.append("later turn")

    t1 = _thread(turn)
    assert working.wait(5)
    t2 = _thread(capture)
    time.sleep(0.1)
    assert order == []  # the capture waits for the turn in progress
    t3 = _thread(later_turn)
    time.sleep(0.05)
    release.set()
    for t in (t1, t2, t3):
        t.join(5)
    # a turn that came while the capture waited runs after it (the capture is not starved by a busy engine)
    assert order == ["turn ends", "capture", "capture ends", "later turn"]
    assert gate.workers == 0


def test_work_is_reentrant_and_a_capture_inside_work_does_not_wait_for_itself():
    gate = GpuGate()
    with gate.work():
        with gate.work():
            assert gate.workers == 1
            with gate.exclusive():  # a shape captured inside a turn before the runners froze
                assert gate.workers == 0
                with gate.exclusive():
                    pass
            assert gate.workers == 1
    assert gate.workers == 0


def test_two_workers_that_both_capture_do_not_deadlock():
    gate, done = GpuGate(), []
    both = threading.Barrier(2)

    def worker(name: str) -> None:
        with gate.work():
            both.wait(5)
            with gate.exclusive():
                done.append(name)
                time.sleep(0.02)

    threads = [_thread(lambda n=n: worker(n)) for n in ("a", "b")]
    for t in threads:
        t.join(5)
    assert sorted(done) == ["a", "b"] and gate.workers == 0


def test_an_exception_releases_either_side():
    gate = GpuGate()
    with pytest.raises(ValueError):
        with gate.exclusive():
            raise ValueError("capture failed")
    with pytest.raises(ValueError):
        with gate.work():
            raise ValueError("turn failed")
    done = threading.Event()
    _thread(lambda: (gate.exclusive().__enter__(), done.set()))
    assert done.wait(2) and gate.workers == 0


def test_the_engine_serves_nothing_while_a_capture_holds_the_gate_and_resumes_after(tiny_models, load_case):
    case = load_case("case_flow_stream")
    g = torch.Generator().manual_seed(3)
    inputs = ModelInputs(text_segments=[torch.randint(0, 1000, (1, 6), generator=g)],
                         prompt_text=torch.randint(0, 1000, (1, 4), generator=g),
                         llm_prompt_speech_token=case["prompt_token"], flow_prompt_speech_token=case["prompt_token"],
                         prompt_feat=case["prompt_feat"], embedding=case["embedding"])
    eng = Engine(tiny_models)
    try:
        want = sum(len(c.samples) for c in eng.stream(SynthesisRequest(inputs=inputs, seed=5, max_tokens=20, ignore_eos=True)))
        chunks: list[int] = []
        finished = threading.Event()
        with GPU_GATE.exclusive():  # as a background capture would, for 0.5 s
            t = _thread(lambda: (chunks.extend(len(c.samples) for c in
                                               eng.stream(SynthesisRequest(inputs=inputs, seed=5, max_tokens=20, ignore_eos=True))),
                                 finished.set()))
            time.sleep(0.5)
            assert chunks == [] and not finished.is_set()  # admission and turns wait for the capture
        assert finished.wait(60)
        t.join(5)
        assert sum(chunks) == want > 0  # and the request then runs to the same audio length
        assert GPU_GATE.workers == 0
    finally:
        eng.close()


class _FakeGraph:
    """A CUDAGraph stand-in whose capture fails the way an invalidated one does (``capture_end`` raises)."""

    def __init__(self) -> None:
        self.begun_with = None

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:  # noqa: ANN001
        assert GPU_GATE._capturer == threading.get_ident()  # captured holding the gate alone
        self.begun_with = (pool, capture_error_mode)

    def capture_end(self) -> None:
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def pool(self):  # noqa: ANN201 - torch refuses to answer after a failed capture
        raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")


@pytest.fixture
def fake_capture_cuda(monkeypatch):
    """Just enough of torch.cuda for :func:`graphs.capture` on a CPU; records the pools released."""
    import types

    from cosyvoice_fast.kernels import graphs

    stream = types.SimpleNamespace(wait_stream=lambda other: None, synchronize=lambda: None)
    released: list = []
    monkeypatch.setattr(graphs, "capture_stream", lambda device: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("fresh", 7))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda dev, pool: released.append((dev, pool)),
                        raising=False)
    return released


@pytest.mark.parametrize("given,freed", [(("runner", 3), ("runner", 3)), (None, ("fresh", 7))])
def test_a_failed_capture_frees_the_pool_it_was_given_and_the_gate(fake_capture_cuda, given, freed):
    """The pool id passed to the capture (``graph.pool()`` raises after a failed one: the pool stayed
    "recording" and took 37 later captures with it on an H100 and an H200) is released; the gate too."""
    from cosyvoice_fast.kernels import graphs

    before = graphs.captures()
    with pytest.raises(RuntimeError, match="previous error during capture"):
        graphs.capture(lambda: None, torch.device("cuda", 0), given, warmup=0)
    assert fake_capture_cuda == [(0, freed)]
    assert GPU_GATE._capturer is None and GPU_GATE.workers == 0 and graphs.captures() == before


def test_the_background_thread_sets_up_its_blas_handles_before_its_first_capture(monkeypatch):
    """The LLM's background captures skip the warm-up (it would write live rows), so the thread's cuBLAS
    handles must exist before them: ``prepare_capture_thread`` runs once, on the worker, before any job."""
    import types

    from cosyvoice_fast.kernels import graphs
    from cosyvoice_fast.kernels.graphs import BackgroundCaptures, DeferredCapture

    events: list = []
    monkeypatch.setattr(graphs, "capture_stream", lambda device: types.SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graphs, "prepare_capture_thread",
                        lambda device: events.append(("prepare", str(device), threading.current_thread().name)))
    worker = BackgroundCaptures(device="cuda:0")
    worker.add([DeferredCapture("llm-decode", (256, n), lambda n=n: events.append(("capture", n)))
                for n in (2, 4)])
    assert worker.join(10) and worker.failed == 0 and worker.done == 2
    assert events == [("prepare", "cuda:0", "cosyvoice-capture"), ("capture", 2), ("capture", 4)]
