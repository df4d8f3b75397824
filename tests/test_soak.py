"""A scaled soak: 200 requests (100 one at a time, 100 eight at once) through the full path (frontend with a prompt
voice, engine, streaming and not), with cancellations mid-stream and refused prompts mixed in; resident memory,
open file descriptors, threads and the engine's internal containers must not grow.

Runs in about 20 s on 2 CPU cores: 4 speech tokens per request, and the flow's CFM solver cut to 2 steps on this
test's own copy of the model (leaks live in the bookkeeping, not in the number of solver steps).  The full-size
soak for a GPU box is ``python -m cosyvoice_fast soak`` (README, "Reliability").
"""

from __future__ import annotations

import dataclasses

import pytest

from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.bench.soak import run_soak

pytest.importorskip("psutil")


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from cosyvoice_fast.serving.service import load_service

    s = load_service(None, synthetic="tiny", device="cpu", speaker_cache_dir=tmp_path_factory.mktemp("spk"),
                     progress=False)
    flow = s.models.flow  # this service's own modules: other tests' models are untouched
    flow.cfg = dataclasses.replace(flow.cfg, cfm=dataclasses.replace(flow.cfg.cfm, n_timesteps=2))
    yield s
    s.close()


def test_soak_200_requests_no_growth(svc):
    before_metrics = {o: svc.metrics.requests.labels(o)._value.get() for o in ("ok", "cancelled", "rejected")}
    rep = run_soak(svc.engine, requests=200, concurrency=8, max_tokens=4, warmup=8,
                   stream_params=StreamParams(token_hop_len_first=25, pre_lookahead_len=0))
    print("\n" + rep.format())
    assert rep.problems(max_rss_growth_mb=50, max_fd_growth=2) == []
    assert rep.unexpected_errors == []
    assert sum(rep.outcomes.values()) == 200 and rep.outcomes["error"] == 0
    assert rep.outcomes["cancelled"] == rep.faults_injected["cancel_after_first_chunk"] > 20
    assert rep.outcomes["rejected"] == rep.faults_injected["too_short_prompt"] > 10
    # the engine's own containers are back where they were
    assert rep.after.engine_active == rep.after.engine_incoming == 0
    assert rep.after.engine_stage_sets == rep.before.engine_stage_sets
    assert rep.after.engine_observers == rep.before.engine_observers  # request log + metrics: none added
    assert rep.after.frontend_lru <= svc.frontend.config.prompt_lru_size
    assert rep.after.threads <= rep.before.threads + 1
    assert rep.wall_s < 60
    # every request reached the metrics exactly once (warm-up included: 8 more, of which 1 cancelled)
    got = {o: svc.metrics.requests.labels(o)._value.get() - before_metrics[o] for o in before_metrics}
    assert got["ok"] == rep.outcomes["ok"] + 7 and got["cancelled"] == rep.outcomes["cancelled"] + 1
    assert got["rejected"] == rep.outcomes["rejected"]
