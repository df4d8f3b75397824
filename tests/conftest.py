"""Shared test fixtures.  The parity fixture directory is read only through ``../shared/fixtures/cosyvoice2-tiny``
(or ``COSYVOICE_FIXTURE_DIR``).

A clone on its own has no fixtures: tests that need them skip with a reason naming ``COSYVOICE_FIXTURE_DIR``, so a
newcomer gets a clean run.  CI sets ``COSYVOICE_REQUIRE_FIXTURES=1`` (``.ci/run``): there a missing fixture fails,
so parity can never pass by being skipped.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest
import torch

import skip_check
from skip_check import pytest_collectreport, pytest_sessionfinish  # noqa: F401 - pytest hooks: CI's skip report

REPO_ROOT = Path(__file__).resolve().parents[1]
# COSYVOICE_FIXTURE_DIR points elsewhere where ../shared is not beside the checkout (e.g. a GPU box)
FIXTURE_DIR = Path(os.environ.get("COSYVOICE_FIXTURE_DIR") or REPO_ROOT / ".." / "shared" / "fixtures" / "cosyvoice2-tiny")
# the CosyVoice3 fixture (a hold-out set with other sizes and seeds may be swapped in through the variable)
FIXTURE3_DIR = Path(os.environ.get("COSYVOICE3_FIXTURE_DIR")
                    or REPO_ROOT / ".." / "shared" / "fixtures" / "cosyvoice3-tiny")
REQUIRE_FIXTURES = os.environ.get("COSYVOICE_REQUIRE_FIXTURES", "") not in ("", "0")
_missing_fixture_tests: list[str] = []


def missing_fixtures_message(path: Path, family: str = "cosyvoice2") -> str:
    """What a test that needs the parity fixtures says when they are absent (pinned by tests/test_conftest.py)."""
    var = "COSYVOICE_FIXTURE_DIR" if family == "cosyvoice2" else "COSYVOICE3_FIXTURE_DIR"
    return (f"parity fixtures not found at {path.resolve()}: put ../shared/fixtures/{family}-tiny beside the "
            f"checkout or set {var}=/path/to/{family}-tiny")


def _require(path: Path, family: str) -> Path:
    if not path.is_dir():
        msg = missing_fixtures_message(path, family)
        if REQUIRE_FIXTURES:
            pytest.fail(f"{msg} (COSYVOICE_REQUIRE_FIXTURES=1: the fixtures are required here)", pytrace=False)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """The parity fixture directory; skips the test (fails it under COSYVOICE_REQUIRE_FIXTURES=1) when absent."""
    return _require(FIXTURE_DIR, "cosyvoice2")


@pytest.fixture(scope="session")
def fixture3_dir() -> Path:
    """The CosyVoice3 parity fixture directory (``COSYVOICE3_FIXTURE_DIR``); absent: as :func:`fixture_dir`."""
    return _require(FIXTURE3_DIR, "cosyvoice3")


@pytest.fixture(scope="session")
def load_case3(fixture3_dir):
    """``load_case3("case_llm")`` -> the recorded CosyVoice3 dict."""

    def _load(name: str) -> dict:
        return torch.load(fixture3_dir / f"{name}.pt", weights_only=True)

    return _load


def pytest_runtest_logreport(report):  # noqa: ANN001 - pytest hook
    """Count the tests skipped for want of fixtures, for one summary line instead of a line per test; record every
    skip for CI's check against tests/allowed_skips.txt."""
    skip_check.record(report)
    if report.skipped and isinstance(report.longrepr, tuple) and "FIXTURE_DIR" in str(report.longrepr[2]):
        _missing_fixture_tests.append(report.nodeid)


def pytest_terminal_summary(terminalreporter):  # noqa: ANN001 - pytest hook
    if _missing_fixture_tests:
        terminalreporter.write_line(
            f"{len(_missing_fixture_tests)} tests skipped: {missing_fixtures_message(FIXTURE_DIR)}", yellow=True)


@pytest.fixture
def no_tf32():
    """True fp32 for references on a GPU: cuDNN convolutions default to TF32 (10-bit mantissa) and pick their
    algorithms by shape and batch size, which moves results at the 1e-3 level.  Restored afterwards."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="session")
def load_case(fixture_dir):
    """``load_case("case_llm")`` -> the recorded dict."""

    def _load(name: str) -> dict:
        return torch.load(fixture_dir / f"{name}.pt", weights_only=True)

    return _load


@pytest.fixture(scope="session")
def tiny_models(fixture_dir):
    """The fixture model directory loaded with the same loader users use (fp32, CPU, eval mode)."""
    from cosyvoice_fast.modeldir.files import load_models

    return load_models(fixture_dir, device="cpu")


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest hook
    """Tests marked ``gpu`` skip, with the reason, where torch sees no CUDA GPU (CI, laptops)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool: python -m pytest -m gpu ...)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class _FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: replay re-runs the function on the static inputs."""

    def __init__(self, fn, inputs, outputs):  # noqa: ANN001
        self.fn, self.inputs, self.outputs = fn, inputs, outputs

    def replay(self) -> None:
        for dst, src in zip(self.outputs, self.fn(*self.inputs)):
            dst.copy_(src)


class _FakeGraphCache:
    """``backends.graphs.GraphCache`` without CUDA: same keys, static buffers and counters, eager replays."""

    def __init__(self, fn, device, max_graphs=64, name="graph"):  # noqa: ANN001
        from collections import OrderedDict

        self.fn, self.graphs, self.captures, self.replays = fn, OrderedDict(), 0, 0
        self.max_graphs, self.frozen, self.lock = max_graphs, False, threading.Lock()

    def freeze(self) -> None:
        self.frozen = True

    def _capture(self, example):  # noqa: ANN001
        from cosyvoice_fast.kernels.graphs import CapturedGraph

        static = tuple(t.detach().clone() for t in example)
        outs = tuple(o.clone() for o in self.fn(*static))
        return CapturedGraph(_FakeGraph(self.fn, static, outs), static, outs)

    def get(self, key, example):  # noqa: ANN001
        if key not in self.graphs:
            if self.frozen:
                return None
            self.graphs[key] = self._capture(example)
            self.captures += 1
        return self.graphs[key]

    def deferred_job(self, family, shape, key, example, lock=None):  # noqa: ANN001
        """``GraphCache.deferred_job``: captured off every lock, published under the runner's ``lock``."""
        from cosyvoice_fast.kernels.graphs import DeferredCapture

        def publish(graph) -> None:  # noqa: ANN001
            assert self.frozen, "a background capture comes after the runner froze its caches"
            with lock if lock is not None else contextlib.nullcontext():
                self.graphs.setdefault(key, graph)
                self.captures += 1

        return DeferredCapture(family, shape, lambda: self._capture(example()), publish)


@pytest.fixture
def fake_graphs(monkeypatch):
    """Graph-captured backends' bookkeeping (padding, keys, buffers) testable on CPU."""
    import cosyvoice_fast.kernels.graphs as graphs

    monkeypatch.setattr(graphs, "GraphCache", _FakeGraphCache)


@pytest.fixture
def flow_cuda_fp32(tiny_models):
    """The fixture's flow on the GPU in fp32 with TF32 off (fp32 parity means fp32), restored afterwards."""
    import copy

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield copy.deepcopy(tiny_models.flow).cuda().eval()
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
