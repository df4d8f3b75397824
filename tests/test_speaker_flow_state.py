"""A saved speaker's flow prompt state through the speaker cache (safetensors) and back into the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.frontend.request import SynthesisRequest
from cosyvoice_fast.serving.service import load_service

PROMPT = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "zero_shot_prompt.wav"


def _request(**kw) -> SynthesisRequest:
    return SynthesisRequest(text="Hello there, this is a somewhat longer test of the streaming voice.",
                            mode="speaker", speaker="alice", stream=True, max_tokens=150, ignore_eos=True, seed=3,
                            **kw)


def test_stored_state_round_trips_and_is_used(tmp_path):
    if not PROMPT.is_file():
        pytest.skip("example prompt not found beside the repo")
    cache = tmp_path / "speakers"
    svc = load_service(synthetic="tiny", device="cpu", speaker_cache_dir=cache, progress=False)
    try:
        svc.frontend.add_speaker("alice", str(PROMPT))
        stored = svc.engine.store_flow_state("alice")
        assert stored > 0
        with pytest.raises(ConfigError, match="keeps no flow state"):
            svc.engine.store_flow_state("alice", BackendConfig(incremental=False))
    finally:
        svc.close()
    with safe_open(str(cache / "alice.safetensors"), "pt") as f:
        keys = set(f.keys())
        flow = [f.get_tensor(k) for k in keys if k.startswith("extra.flow.")]
    nbytes = sum(t.numel() * t.element_size() for t in flow)
    assert {"extra.flow.meta", "extra.flow.ids", "extra.flow.fingerprint", "extra.flow.enc.tok.0"} <= keys
    assert nbytes == stored

    restarted = load_service(synthetic="tiny", device="cpu", speaker_cache_dir=cache, progress=False)
    try:
        eng = restarted.engine
        inc = eng.stages(BackendConfig()).flow
        audio, tele = eng.synthesize(_request())
        assert (inc.prompt_loaded, inc.prompt_hits) == (1, 0)  # the stored state, not a recompute
        assert len(tele.chunks) >= 3
        # the telemetry (and the dashboard's timeline) says what the flow did per chunk
        assert [c.flow_mode for c in tele.chunks] == ["incremental"] * (len(tele.chunks) - 1) + ["recompute"]
        assert all(c.flow_state_bytes > 0 for c in tele.chunks[:-1]) and tele.chunks[-1].flow_state_bytes == 0
        assert tele.chunks[1].flow_state_bytes > tele.chunks[0].flow_state_bytes  # grows with committed frames
        n_prompt = len(restarted.frontend._cache().get("alice").speech_token[0])
        assert tele.chunks[-1].flow_frames == 2 * (n_prompt + sum(c.n_tokens for c in tele.chunks))
        ref, _ = eng.synthesize(_request(backend=BackendConfig(incremental=False)))
        assert audio.shape == ref.shape and np.abs(audio - ref).max() <= 1e-3
        eng.synthesize(_request())
        assert (inc.prompt_loaded, inc.prompt_hits) == (1, 1)  # then served from the in-memory cache
    finally:
        restarted.close()
