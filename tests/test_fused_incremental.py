"""The fused estimator on incremental windows (``kernels/estimator_window.py``, ``FusedEstimator.forward_window``).

CPU (Triton interpreter, fp32): cached-key attention and the conv context against torch, and the fixed-buffer
incremental flow with the fused estimator against upstream's full recompute on every streamed chunk (and against
the eager incremental maths).  GPU (marked ``gpu``): the same flow captured as graphs, fp32 within the parity
tolerance, bf16 within the eager incremental path's own distance from recompute.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.flow.graph_incremental import GraphIncrementalFlow  # noqa: E402
from cosyvoice_fast.flow.eager import flow_chunk_mel  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_fused import FusedEstimator  # noqa: E402
from cosyvoice_fast.flow.kernels.estimator_window import attention_cached, update_conv_context  # noqa: E402
from cosyvoice_fast.flow.model.incremental import static_mask  # noqa: E402
from cosyvoice_fast.config.schedule import plan  # noqa: E402

from test_incremental_flow import SCHEDULES, TOL, _inputs, _max_err, _tokens  # noqa: E402
from test_incremental_graphs import Recompute, _cuda, _stream  # noqa: E402


@pytest.mark.parametrize("start,n,valid,chunk,d", [(0, 20, 20, 8, 16), (16, 13, 9, 8, 16), (40, 5, 5, 20, 16),
                                                    (24, 40, 33, 8, 16), (16, 13, 9, 8, 24), (24, 40, 33, 8, 40)])
def test_cached_attention_matches_masked_sdpa_and_writes_its_keys(start, n, valid, chunk, d):
    """Head sizes 24 and 40 run on padded, masked lanes: the cache's lanes past the head stay untouched."""
    torch.manual_seed(start + n)
    b, h, cap = 2, 2, 72
    qkv = torch.randn(b * n, 3 * h * d)
    kv = torch.randn(2, b, h, cap, d)
    before = kv.clone()
    out = attention_cached(qkv, kv, torch.tensor([start]), torch.tensor([valid]), h, d, chunk)
    q, k, v = qkv.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    ref_kv = before.clone()
    ref_kv[0, :, :, start:start + n] = k
    ref_kv[1, :, :, start:start + n] = v
    assert torch.equal(kv, ref_kv)  # the window's keys/values are written, nothing else changes
    mask = static_mask(start, valid, n, cap, chunk, torch.device("cpu"))
    ref = torch.nn.functional.scaled_dot_product_attention(q, ref_kv[0], ref_kv[1], attn_mask=mask)
    assert (out.view(b, n, h, d).transpose(1, 2) - ref).abs().max().item() <= 1e-5


def test_cached_attention_refuses_bad_buffers():
    qkv = torch.zeros(8, 96)
    with pytest.raises(ValueError, match=r"kv must be \(2, B, 2, C, 16\)"):
        attention_cached(qkv, torch.zeros(2, 2, 3, 10, 16), torch.tensor([0]), torch.tensor([4]), 2, 16, 4)
    with pytest.raises(ValueError, match="chunk-causal"):
        attention_cached(qkv, torch.zeros(2, 2, 2, 10, 16), torch.tensor([0]), torch.tensor([4]), 2, 16, 0)


@pytest.mark.parametrize("commit", [0, 1, 5, 9])
def test_conv_context_takes_the_columns_before_the_commit_point(commit):
    torch.manual_seed(commit)
    b, frames, c1, c2, left = 2, 9, 5, 3, 2
    x1, x2 = torch.randn(b * frames, c1), torch.randn(b * frames, c2)
    ctx = torch.randn(b, c1 + c2, left)
    xp = torch.cat((ctx, torch.cat((x1, x2), 1).view(b, frames, -1).transpose(1, 2)), dim=2)  # (B, C, left + T)
    ref = xp[:, :, commit:commit + left].clone()  # StaticWindow's rule: padded input at commit + arange(left)
    update_conv_context(x1, ctx, torch.tensor([commit]), frames, x2=x2)
    assert torch.equal(ctx, ref)


def _fused_flow(flow, **kw) -> GraphIncrementalFlow:
    fused = FusedEstimator(flow.decoder.estimator)
    return GraphIncrementalFlow(flow, Recompute(flow), estimator=fused.forward_window, **kw)


@pytest.fixture(scope="module")
def flow(tiny_models):
    """The fixture's flow with 2 Euler steps instead of its 10 (the interpreter runs every kernel as Python; the
    steps are identical calls, so 2 check the same maths, the state of every step included)."""
    f = copy.deepcopy(tiny_models.flow)
    f.decoder.cfg = dataclasses.replace(f.decoder.cfg, n_timesteps=2)  # the incremental runner's step count
    f.cfg = dataclasses.replace(f.cfg, cfm=f.decoder.cfg)  # upstream's recompute (flow.decode)
    return f


@pytest.mark.parametrize("schedule,n_prompt,n_tokens", [("default", 57, 100), ("first7_hop13_la0", 30, 50)])
def test_fused_window_chunks_equal_full_recompute(flow, schedule, n_prompt, n_tokens):
    """Every streamed chunk (first, middle and the full-attention final one, which recomputes) equals upstream's
    recompute, from an empty state and from the voice's cached prompt state."""
    inc = _fused_flow(flow, capture=False)
    inputs, tokens = _inputs(n_prompt, seed=5), _tokens(n_tokens, 5)
    inputs.prompt_key = "voice"
    outs, refs, _ = _stream(inc, flow, inputs, tokens, SCHEDULES[schedule])
    assert max(_max_err(outs, refs)) <= TOL
    inc.initial_state(inputs)  # the voice's prompt state, computed by the fused windows and cached
    outs, refs, _ = _stream(inc, flow, inputs, tokens, SCHEDULES[schedule])
    assert max(_max_err(outs, refs)) <= TOL
    assert inc.prompt_hits >= 1


def test_fused_window_equals_the_eager_window_maths(flow):
    """Same buffers, same chunks: the fused kernels' keys/values and context equal the eager maths' state."""
    inputs, tokens = _inputs(33, seed=9), _tokens(60, 9)
    eager = GraphIncrementalFlow(flow, Recompute(flow), capture=False)
    fused = _fused_flow(flow, capture=False)
    a, _, _ = _stream(eager, flow, inputs, tokens, SCHEDULES["default"])
    b, _, _ = _stream(fused, flow, inputs, tokens, SCHEDULES["default"])
    assert len(a) >= 2 and max(_max_err(b, a)) <= TOL
    # the fused windows took their time projections from the runner's table (one row per Euler step, CFG pair)
    assert eager.graphs.time_table is None and fused.graphs.time_table.shape[:2] == (2, 2)
    assert (fused.graphs.kv - eager.graphs.kv).abs().max().item() <= TOL
    for c_f, c_e in zip(fused.graphs.ctx, eager.graphs.ctx):
        assert (c_f - c_e).abs().max().item() <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["default", "first7_hop13_la0"])
def test_gpu_captured_fused_windows_equal_full_recompute_fp32(flow_cuda_fp32, schedule):
    inc = _fused_flow(flow_cuda_fp32)
    captured = inc.graphs.capture_all()
    inputs, tokens = _cuda(_inputs(57, seed=31)), _tokens(160, 31).cuda()
    for _ in range(3):
        outs, refs, _ = _stream(inc, flow_cuda_fp32, inputs, tokens, SCHEDULES[schedule])
        assert max(_max_err(outs, refs)) <= TOL
    assert inc.graphs.replays >= 3 * (len(outs) - 1) and inc.graphs.eager_calls == 0
    assert inc.graphs.captures == captured


@pytest.mark.gpu
def test_gpu_fused_windows_bf16_as_close_as_the_eager_windows(tiny_models):
    flow16 = copy.deepcopy(tiny_models.flow).cuda().to(torch.bfloat16).eval()
    inputs, tokens = _cuda(_inputs(40, seed=41), torch.bfloat16), _tokens(150, 41).cuda()
    ref32 = copy.deepcopy(tiny_models.flow).cuda().eval()
    fused, eager = _fused_flow(flow16), GraphIncrementalFlow(flow16, Recompute(flow16))
    outs_f, _, _ = _stream(fused, flow16, inputs, tokens, SCHEDULES["default"])
    outs_e, _, _ = _stream(eager, flow16, inputs, tokens, SCHEDULES["default"])
    inputs32 = _cuda(_inputs(40, seed=41))
    refs = [flow_chunk_mel(ref32, inputs32, tokens[:, :c.n_tokens], c)
            for c in plan(40, tokens.shape[1], SCHEDULES["default"])]
    err_f, err_e = _max_err(outs_f, refs), _max_err(outs_e, refs)
    assert all(torch.isfinite(o).all() for o in outs_f)
    assert max(err_f) <= 2 * max(err_e) + 1e-2
