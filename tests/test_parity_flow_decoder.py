"""The CFM estimator and sampler against upstream's recorded first estimator call and fixed noise."""

from __future__ import annotations

import pytest
import torch

from cosyvoice_fast.flow.model.cfm import euler_schedule, fixed_noise, time_grid


@pytest.fixture(scope="module")
def cfm(tiny_models):
    """The CausalCFM as the model loader builds it (flow.pt's ``decoder.*``)."""
    return tiny_models.flow.decoder


def test_estimator_parity(cfm, load_case):
    case = load_case("case_flow")
    ei = case["estimator_inputs"]
    with torch.no_grad():
        out = cfm.estimator(ei["x"], ei["mask"], ei["mu"], ei["t"], ei["spks"], ei["cond"],
                            streaming=bool(case["estimator_streaming"]))
    assert out.shape == case["estimator_output"].shape
    assert (out - case["estimator_output"]).abs().max().item() <= 1e-4


def test_fixed_noise_is_upstreams_buffer(load_case):
    rec = load_case("case_flow")["noise"]
    torch.testing.assert_close(fixed_noise()[:, :, : rec.shape[2]], rec, atol=0, rtol=0)


def test_cfm_solve_reproduces_mel(cfm, load_case):
    case = load_case("case_flow")
    ei = case["estimator_inputs"]
    mel_new = case["mel"].shape[2]
    with torch.no_grad():
        out = cfm(ei["mu"][:1], ei["mask"][:1], ei["spks"][:1], ei["cond"][:1], n_timesteps=cfm.cfg.n_timesteps,
                  streaming=bool(case["streaming"]))
    assert (out[:, :, -mel_new:] - case["mel"]).abs().max().item() <= 1e-4


def test_solver_feeds_estimator_a_guidance_batch(cfm, load_case):
    """One call per Euler step (the yaml's count) on the configured grid, each a batch of 2 whose second row has mu/spks/cond zeroed; a swapped-in
    estimator (how a graph backend plugs in) gives the same mel as the built-in one."""
    ei = load_case("case_flow")["estimator_inputs"]
    mu, mask, spks, cond = ei["mu"][:1], ei["mask"][:1], ei["spks"][:1], ei["cond"][:1]
    steps, scheduler = cfm.cfg.n_timesteps, cfm.cfg.t_scheduler
    seen = []

    def spy(x, m, mu2, t, spks2, cond2, streaming):
        seen.append(t.clone())
        assert x.shape[0] == 2 and torch.equal(x[0], x[1])
        assert torch.equal(mu2[0], mu[0]) and not mu2[1].any() and not spks2[1].any() and not cond2[1].any()
        assert torch.equal(m, torch.cat([mask, mask]))
        return cfm.estimator(x, m, mu2, t, spks2, cond2, streaming)

    with torch.no_grad():
        ref = cfm(mu, mask, spks, cond, n_timesteps=steps)
        out = cfm(mu, mask, spks, cond, n_timesteps=steps, estimator=spy)
    assert torch.equal(out, ref)
    assert len(seen) == steps
    grid = time_grid(steps, scheduler)
    torch.testing.assert_close(torch.stack([t[0] for t in seen]), grid[:-1], atol=0, rtol=0)
    assert torch.equal(seen[0], ei["t"])  # the recorded first call ran at t = 0 for both rows
    ts, dts = euler_schedule(steps, scheduler)
    assert abs(dts.sum().item() - 1.0) < 1e-6 and torch.all(dts > 0)


def test_fully_padded_batch_row_stays_finite(cfm, load_case):
    """A batch row with no valid frame must not turn into NaN (softmax over nothing), nor disturb other rows."""
    ei = load_case("case_flow")["estimator_inputs"]
    mask = ei["mask"].clone()
    mask[1] = 0
    with torch.no_grad():
        for streaming in (False, True):
            out = cfm.estimator(ei["x"], mask, ei["mu"], ei["t"], ei["spks"], ei["cond"], streaming=streaming)
            row0 = cfm.estimator(ei["x"][:1], mask[:1], ei["mu"][:1], ei["t"][:1], ei["spks"][:1], ei["cond"][:1],
                                 streaming=streaming)
            assert torch.isfinite(out).all()
            assert not out[1].any()
            assert (out[:1] - row0).abs().max().item() <= 1e-5


def test_streaming_estimator_is_chunk_causal(cfm, load_case):
    """Changing frames from a later chunk boundary on leaves every earlier frame's output unchanged."""
    ei = load_case("case_flow")["estimator_inputs"]
    chunk = cfm.estimator.cfg.static_chunk_size
    n_frames = ei["x"].shape[2]
    assert n_frames > chunk, "case_flow's estimator call must span more than one attention chunk"
    cut = chunk * ((n_frames - 1) // chunk)  # the last chunk boundary inside the call
    args = [ei[k].clone() for k in ("x", "mask", "mu", "t", "spks", "cond")]
    with torch.no_grad():
        ref = cfm.estimator(*args, streaming=True)
        full = cfm.estimator(*args, streaming=False)
        args[0][:, :, cut:] += torch.randn_like(args[0][:, :, cut:])
        args[2][:, :, cut:] += 1.0
        moved = cfm.estimator(*args, streaming=True)
    assert (moved[..., :cut] - ref[..., :cut]).abs().max().item() <= 1e-5
    assert (moved[..., cut:] - ref[..., cut:]).abs().max().item() > 1e-3
    assert (full - ref).abs().max().item() > 1e-3  # full attention does look ahead


def test_zero_padding_after_valid_frames_is_exact(cfm, load_case):
    """Padding at the end with mask 0 does not change valid frames (what length-bucketed graphs rely on)."""
    ei = load_case("case_flow")["estimator_inputs"]
    t_valid = ei["x"].shape[2]
    pad = 37

    def padded(x: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, pad), value=value)

    with torch.no_grad():
        for streaming in (False, True):
            ref = cfm.estimator(ei["x"], ei["mask"], ei["mu"], ei["t"], ei["spks"], ei["cond"], streaming=streaming)
            out = cfm.estimator(padded(ei["x"]), padded(ei["mask"]), padded(ei["mu"]), ei["t"], ei["spks"],
                                padded(ei["cond"]), streaming=streaming)
            assert (out[..., :t_valid] - ref).abs().max().item() <= 1e-5


def test_fused_qkv_keeps_values_and_state_dict(tiny_models):
    import copy

    from cosyvoice_fast.flow.onnx_export import example_inputs

    est = copy.deepcopy(tiny_models.flow.decoder.estimator)
    before = {k: v.clone() for k, v in est.state_dict().items()}
    args = example_inputs(120, seed=3)
    with torch.inference_mode():
        ref = [est(*args, streaming) for streaming in (True, False)]
        est.fuse_projections().fuse_projections()  # idempotent
        got = [est(*args, streaming) for streaming in (True, False)]
    after = est.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    blk = est.mid_blocks[0][1][0].attn1
    assert blk.to_q.weight.data_ptr() == blk.qkv_weight.data_ptr()
    for a, b in zip(got, ref):
        assert (a - b).abs().max().item() <= 1e-5
    assert not copy.deepcopy(est).mid_blocks[0][1][0].attn1._fused()  # a copy runs unfused until fused again
