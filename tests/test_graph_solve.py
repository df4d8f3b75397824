"""Whole guided solves as replays of one step graph (``backends/graph_solve.py``).

CPU (fake graphs re-run the captured function on its static buffers): a solve through the step graphs equals
the step loop over single-forward graphs, bit for bit for the eager estimator (the fixture's) and within float
rounding for the fused kernels in the interpreter, for several batch sizes sharing one row bucket and rows of
different lengths; calls the
step graphs do not serve fall back to the loop; the fused estimator's time table equals its own time embedding.
GPU: the same equality at full size in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the fused estimator's kernels run in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.flow.graph import GraphEstimator  # noqa: E402
from cosyvoice_fast.config.model import CFMConfig, DecoderConfig  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator  # noqa: E402
from cosyvoice_fast.flow.model.cfm import CausalCFM  # noqa: E402
from cosyvoice_fast.flow.model.decoder import CausalConditionalDecoder  # noqa: E402

_gpu = pytest.mark.gpu


def _cfm(estimator: CausalConditionalDecoder, rate: float = 0.7) -> CausalCFM:
    """A CFM around ``estimator`` (its own is replaced) with CFG rate ``rate``."""
    cfm = CausalCFM(CFMConfig(inference_cfg_rate=rate), estimator.cfg).eval()
    cfm.estimator = estimator
    return cfm


def _guidance(batch: int, frames: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
              channels: int = 80) -> tuple[torch.Tensor, ...]:
    """(mu, mask, spks, cond) of ``batch`` utterances right-padded to ``frames``, row i 3·i frames shorter."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, 1, frames)
    for i in range(batch):
        mask[i, :, frames - 3 * i:] = 0
    mu = torch.randn(batch, channels, frames, generator=g) * mask
    cond = torch.randn(batch, channels, frames, generator=g) * mask
    spks = torch.randn(batch, channels, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (mu, mask, spks, cond))


def _runners(estimator: torch.nn.Module, steps: int, device: str = "cpu", **kw: object
             ) -> tuple[GraphEstimator, GraphEstimator]:
    """(the step loop over single-forward graphs, whole solves through step graphs)."""
    dev = torch.device(device)
    return (GraphEstimator(estimator, dev, **kw),
            GraphEstimator(estimator, dev, solver=(0.7, steps), **kw))


@pytest.fixture(scope="module")
def small() -> CausalConditionalDecoder:
    torch.manual_seed(0)
    cfg = DecoderConfig(channels=(32,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2,
                        static_chunk_size=20)
    return CausalConditionalDecoder(cfg).eval()


@pytest.mark.parametrize("kind", ["eager", "fused"])
def test_step_graph_solves_equal_the_step_loop(tiny_models, small, kind, fake_graphs):
    est = tiny_models.flow.decoder.estimator if kind == "eager" else FusedEstimator(small)
    cfm = _cfm(tiny_models.flow.decoder.estimator if kind == "eager" else small)
    # batches of 3 and 4 share the 8-row graph (their unconditional rows start at row 4 either way)
    cases = ((1, 37, True), (3, 40, True), (4, 33, True), (2, 20, False), (1, 37, True))
    if kind == "fused":  # the interpreter is slow: two Euler steps chain states, the 8-row graph serves two sizes
        steps, cases = 2, cases[1:3]
    else:
        steps = 10
    loop, solver = _runners(est, steps, granularity=20, max_frames=100)
    for batch, frames, streaming in cases:
        args = _guidance(batch, frames, seed=frames, channels=cfm.estimator.cfg.out_channels)
        with torch.inference_mode():
            ref = cfm.solve_batch(*args, n_timesteps=steps, streaming=streaming, estimator=loop)
            out = cfm.solve_batch(*args, n_timesteps=steps, streaming=streaming, estimator=solver)
        assert out.shape == ref.shape == (batch, 80, frames)
        if kind == "eager":
            assert torch.equal(out, ref), (batch, frames, streaming, (out - ref).abs().max().item())
        else:  # the interpreter's numpy tile products may round a row by where it sits in its tile (~1e-7)
            assert (out - ref).abs().max().item() <= 1e-5, (batch, frames, streaming)
    keys = sorted((mode, k[:2]) for mode, c in solver.steps.caches.items() for k in c.graphs)
    expected = [(False, (20, 4)), (True, (40, 2)), (True, (40, 8))] if kind == "eager" else [(True, (40, 8))]
    assert keys == expected
    assert solver.captures == len(expected) and solver.replays == steps * len(cases) and solver.eager_calls == 0
    assert not any(c.graphs for c in solver.caches.values())  # no single-forward graph was needed


def test_calls_the_step_graphs_do_not_serve_run_the_step_loop(tiny_models, fake_graphs):
    flow = tiny_models.flow
    est, steps = flow.decoder.estimator, flow.decoder.cfg.n_timesteps
    c = est.cfg.out_channels
    args = _guidance(2, 40, seed=1, channels=c)
    _, solver = _runners(est, steps, granularity=20, max_frames=60)
    with torch.inference_mode():
        # another CFG rate than the graphs were made for: the loop, over single-forward graphs
        _cfm(est, rate=0.5).solve_batch(*args, n_timesteps=steps, streaming=True, estimator=solver)
        assert solver.steps.replays == 0 and solver.replays == steps
        # another step count
        _cfm(est).solve_batch(*args, n_timesteps=steps - 1, streaming=True, estimator=solver)
        assert solver.steps.replays == 0 and solver.replays == 2 * steps - 1
        # past the graph budget (4 rows x 60^2 > 2 x 60^2): eager forwards
        _cfm(est).solve_batch(*_guidance(2, 60, seed=2, channels=c), n_timesteps=steps, streaming=True,
                              estimator=solver)
        assert solver.eager_calls == steps
        # frozen after start-up with only the 40-frame streaming graph captured: a full-attention solve is eager
        solver.capture(40, True, torch.float32, rows=4)
        solver.freeze()
        captured = solver.captures
        _cfm(est).solve_batch(*args, n_timesteps=steps, streaming=False, estimator=solver)
        assert solver.eager_calls == 2 * steps and solver.captures == captured
        ref = _cfm(est).solve_batch(*args, n_timesteps=steps, streaming=True)
        out = _cfm(est).solve_batch(*args, n_timesteps=steps, streaming=True, estimator=solver)
    assert solver.steps.replays == steps and solver.captures == captured
    assert (out - ref).abs().max().item() <= 1e-5


def test_time_table_is_the_forwards_time_embedding_and_is_filled_once(small, fake_graphs, monkeypatch):
    fused = FusedEstimator(small)
    x, mask, mu, _, spks, cond = (torch.randn(4, 80, 20), torch.ones(4, 1, 20), torch.randn(4, 80, 20),
                                  None, torch.randn(4, 80), torch.randn(4, 80, 20))
    ts = torch.tensor([0.0, 0.3, 0.9])
    table = fused.time_table(ts, 4)
    assert table.shape == (3, 4, fused.time_width()) == (3, 4, 3 * 32)  # three ResNet blocks of 32 channels
    with torch.inference_mode():
        for i in (0, 2):
            ref = fused(x, mask, mu, ts[i].expand(4).contiguous(), spks, cond, True)
            assert torch.equal(fused(x, mask, mu, ts[i:i + 1], spks, cond, True, tall=table[i]), ref)
    with pytest.raises(ValueError, match=r"tall must be \(4, 96\)"):
        fused(x, mask, mu, ts[:1], spks, cond, True, tall=table[0, :2])
    calls = []
    real = FusedEstimator.time_table
    monkeypatch.setattr(FusedEstimator, "time_table", lambda self, t, rows: calls.append(rows) or real(self, t, rows))
    _, solver = _runners(fused, 2, granularity=20, max_frames=60)
    with torch.inference_mode():
        for _ in range(2):
            _cfm(small).solve_batch(*_guidance(1, 20, seed=3), n_timesteps=2, streaming=True, estimator=solver)
    assert calls == [2]  # once for the one graph, not per solve


@_gpu
@pytest.mark.parametrize("batch,frames", [(1, 200), (5, 206)])
def test_gpu_step_graph_solves_equal_the_step_loop_bf16(batch, frames):
    """Full size, bf16, the fused kernels: the engine's first-chunk shape (one request, 200 frames) and a
    batched solve of five requests of different lengths in the 16-row graph: equal bit for bit."""
    torch.manual_seed(0)
    est = CausalConditionalDecoder(DecoderConfig()).cuda().eval().to(torch.bfloat16)
    fused = FusedEstimator(est)
    loop, solver = _runners(fused, 10, "cuda", granularity=50, max_frames=1000)  # budget 2 x 1000^2 >= 16 x 250^2
    args = _guidance(batch, frames, seed=frames, device="cuda", dtype=torch.bfloat16)
    cfm = _cfm(est).cuda()
    with torch.inference_mode():
        ref = cfm.solve_batch(*args, streaming=True, estimator=loop)
        for _ in range(2):  # the second solve replays the captured graph
            out = cfm.solve_batch(*args, streaming=True, estimator=solver)
            assert torch.equal(out, ref), (out - ref).abs().max().item()
    assert solver.steps.replays == 20 and solver.eager_calls == 0 and torch.isfinite(out).all()
