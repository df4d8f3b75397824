"""Bi-streaming parity with upstream (case_llm_bistream*.pt): every sub-case of every set in the fixture, on
the eager LM in fp32.  Ids, chunks, caps, special ids and the mix ratio are all read from the fixture file."""

from __future__ import annotations

import math
from itertools import islice

import pytest
import torch

from cosyvoice_fast.llm.bistream_eager import EagerBistream, decide, masked
from cosyvoice_fast.llm.model.bistream import PHASE_TEXT, BistreamSpec, BistreamState

TOL = 1e-4


def _sets(fixture_dir) -> list[tuple[str, dict, dict]]:
    """(name, top-level dict, sub-case) for every sub-case of every set: the ``cases`` of each
    ``case_llm_bistream*.pt`` file and any other top-level dict of sub-cases (a hold-out set)."""
    out = []
    for path in sorted(fixture_dir.glob("case_llm_bistream*.pt")):
        top = torch.load(path, weights_only=True)
        for key, group in top.items():
            if isinstance(group, dict) and group and all(isinstance(c, dict) and "out_tokens" in c
                                                         for c in group.values()):
                out += [(f"{path.stem}/{key}/{name}", top, case) for name, case in group.items()]
    return out


def pytest_generate_tests(metafunc):
    if "bistream_case" in metafunc.fixturenames:
        from conftest import FIXTURE_DIR

        cases = _sets(FIXTURE_DIR) if FIXTURE_DIR.is_dir() else []
        metafunc.parametrize("bistream_case", cases, ids=[c[0] for c in cases])


@pytest.fixture(scope="module")
def lm(tiny_models):
    return tiny_models.llm


def _spec(top: dict) -> BistreamSpec:
    text_rows, speech_rows = (int(x) for x in top["mix_ratio"])
    spec = BistreamSpec(text_rows, speech_rows, int(top["speech_token_size"]))
    assert (spec.eos_id, spec.invalid_id, spec.fill_id) == (int(top["eos_id"]), int(top["invalid_id"]),
                                                            int(top["fill_id"]))
    return spec


def _scripted_greedy(overrides: torch.Tensor):
    """The fixture's rule: argmax over the allowed ids, except where ``overrides`` scripts the decision."""
    script = {int(k): int(v) for k, v in overrides.tolist()}

    def sample(logp: torch.Tensor, history, generator) -> int:
        return script.get(len(history), int(logp.argmax()))

    return sample


def _reference_rows(lm, top: dict, case: dict, segments, out_tokens: list[int]) -> torch.Tensor:
    """The rows of one step built straight from the fixture's segment list and the weights (no code under test
    beyond the embedding tables)."""
    text = torch.cat([case["prompt_text"].reshape(-1)] + [c.reshape(-1) for c in case["text_chunks"]]).long()
    speech = case["prompt_speech_token"].reshape(-1).long()
    rows = []
    for kind, start, length in segments:
        if kind in ("sos", "task"):
            rows.append(lm.llm_embedding.weight[int(top[f"{kind}_id"])][None])
        elif kind == "text":
            rows.append(lm.llm.model.model.embed_tokens.weight[text[start:start + length]])
        elif kind == "prompt_speech":
            rows.append(lm.speech_embedding.weight[speech[start:start + length]])
        else:
            rows.append(lm.speech_embedding.weight[[out_tokens[start]]])
    return torch.cat(rows)[None]


def _run(lm, top: dict, case: dict, *, lazy: bool) -> dict:
    """Drive the schedule on the eager LM; ``lazy`` pushes each chunk only when the schedule waits for text,
    otherwise every chunk (and the end) is pushed before the first step."""
    spec = _spec(top)
    runner = EagerBistream(lm, sampler=_scripted_greedy(case["overrides"]))
    assert runner.spec == spec
    state = BistreamState(spec, case["prompt_text"].reshape(-1).tolist(),
                          case["prompt_speech_token"].reshape(-1).tolist(), max_tokens=int(case["max_yield"]))
    chunks = [c.reshape(-1).tolist() for c in case["text_chunks"]]
    if not lazy:
        for c in chunks:
            state.push_text(c)
        state.end_text()
    probe = top["probe_ids"].long()
    rec: dict = {k: [] for k in ("segments", "past", "inputs", "chunks", "phase", "forced", "token_logp", "probe",
                                 "first3", "margin", "restricted", "rows_err", "tokens")}
    cache, g = None, torch.Generator().manual_seed(0)
    while not state.done:
        if state.waiting:
            assert lazy, "all text was pushed, yet the schedule waits"
            state.push_text(chunks.pop(0)) if chunks else state.end_text()
            continue
        plan = state.next_step()
        ref = _reference_rows(lm, top, case, [s.as_tuple() for s in plan.segments], state.out)
        rows = lm.embed_segments(plan.segments, state.text_ids, state.prompt_speech, state.out)
        rec["rows_err"].append((rows - ref).abs().max().item())
        logp, cache = runner.forward(state, plan, cache)
        token = decide(plan, logp, state.out, runner.sampler, g)
        allowed = masked(logp, plan.banned)
        top2 = allowed.topk(2).values
        scripted = len(state.out) in {int(k) for k in case["overrides"][:, 0].tolist()}
        rec["margin"].append(math.nan if plan.forced is not None or scripted else (top2[0] - top2[1]).item())
        # upstream's own masking: eos in the text phase, nothing after the text ended
        upstream = masked(logp, (spec.eos_id,) if plan.phase == PHASE_TEXT else ())
        rec["restricted"].append(plan.forced is None and not scripted and int(upstream.argmax()) != token)
        rec["segments"].append([s.as_tuple() for s in plan.segments])
        rec["past"].append(plan.position)
        rec["inputs"].append(plan.rows)
        rec["chunks"].append(state.chunks_read)
        rec["phase"].append(plan.phase)
        rec["forced"].append(plan.forced is not None)
        rec["token_logp"].append(logp[token].item())
        rec["probe"].append(logp[probe])
        if len(rec["first3"]) < 3:
            rec["first3"].append(logp)
        out = state.accept(token)
        if out is not None:
            rec["tokens"].append(out)
    rec["state"] = state
    return rec


def test_special_ids_match_the_model(lm, load_case):
    top = load_case("case_llm_bistream")
    assert (int(top["sos_id"]), int(top["task_id"])) == (lm.cfg.sos_id, lm.cfg.task_id)
    assert int(top["speech_token_size"]) == lm.cfg.speech_token_size
    assert int(top["fill_id"]) + 1 == lm.cfg.vocab_out  # the fill is the LM's last class


def test_bistream_case(lm, bistream_case):
    _, top, case = bistream_case
    rec = _run(lm, top, case, lazy=True)
    st = rec["state"]
    k = len(case["out_tokens"])
    # decisions, exactly
    assert st.out == case["out_tokens"].tolist()
    assert rec["tokens"] == case["tokens"].tolist()
    fills = [i for i, t in enumerate(st.out) if t == int(top["fill_id"])]
    assert fills == case["fill_positions"].tolist()
    assert st.eos_reached == bool(case["eos_reached"])
    text_phase_tokens = sum(1 for t, p in zip(st.out, rec["phase"]) if p == PHASE_TEXT and t < st.spec.eos_id)
    assert text_phase_tokens == int(case["n_text_phase_tokens"])
    assert sum(rec["restricted"]) == int(case["n_restricted"])
    # the schedule, exactly
    assert rec["segments"] == [[tuple(s) for s in step] for step in case["step_segments"]]
    assert rec["past"] == case["step_past_len"].tolist()
    assert rec["inputs"] == case["step_input_len"].tolist()
    assert rec["chunks"] == case["step_chunks_received"].tolist()
    assert rec["phase"] == case["step_phase"].tolist()
    assert rec["forced"] == case["step_forced_fill"].tolist()
    assert [(e.label, e.chunks, e.n, e.numbers) for e in st.events] == \
        [(lab, int(c), int(n), tuple(int(x) for x in nums)) for lab, c, n, nums in case["events"]]
    assert len(rec["past"]) == k
    # the numbers, within tolerance
    assert max(rec["rows_err"]) <= TOL
    assert (torch.tensor(rec["token_logp"]) - case["step_token_logp"]).abs().max().item() <= TOL
    assert (torch.stack(rec["probe"]) - case["step_logp_probe"]).abs().max().item() <= TOL
    if "logp_first3" in case:
        first = case["logp_first3"]
        assert (torch.stack(rec["first3"][:first.shape[0]]) - first).abs().max().item() <= TOL
    ours, theirs = torch.tensor(rec["margin"]), case["step_margin"]
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert (ours - theirs).nan_to_num().abs().max().item() <= 2 * TOL


def test_pushing_all_text_first_changes_nothing(lm, bistream_case):
    """Chunks are read only when the schedule needs one, so text arriving before the first step (here: all of
    it, and its end) gives the recorded run, chunk counts included."""
    _, top, case = bistream_case
    rec = _run(lm, top, case, lazy=False)
    assert rec["state"].out == case["out_tokens"].tolist()
    assert rec["segments"] == [[tuple(s) for s in step] for step in case["step_segments"]]
    assert rec["chunks"] == case["step_chunks_received"].tolist()


def test_cache_grows_keeping_its_contents(lm):
    """A bi-streamed request's length is unknown up front: the eager cache is regrown with its rows copied."""
    from cosyvoice_fast.llm.bistream_eager import ensure_room

    small = lm.new_cache(8)
    x = torch.randn(1, 8, lm.cfg.llm_input_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        lm.prefill(x, small)
        grown = ensure_room(lm, small, 9, chunk=16)
        assert grown.max_len == 16 and ensure_room(lm, grown, 16) is grown
        assert all(torch.equal(g[:, :, :8], s) for g, s in zip(grown.k + grown.v, small.k + small.v))
        y = torch.randn(1, 1, lm.cfg.llm_input_size, generator=torch.Generator().manual_seed(1))
        ref = lm.prefill(torch.cat([x, y], 1), lm.new_cache(9))
        assert (lm.prefill(y, grown, start=8) - ref).abs().max().item() <= 1e-5


def test_token_iterator_yields_the_recorded_tokens(lm, bistream_case):
    """The eager driver's iterator (text as an iterable of chunks, pulled like upstream's generator)."""
    _, top, case = bistream_case
    runner = EagerBistream(lm, sampler=_scripted_greedy(case["overrides"]))
    it = runner.tokens(case["prompt_text"], case["prompt_speech_token"], iter(case["text_chunks"]),
                       torch.Generator(), max_tokens=int(case["max_yield"]))
    assert list(islice(it, len(case["tokens"]) + 1)) == case["tokens"].tolist()


# ------------------------------------------------------------------------------------------ batched graph path


def _run_batched(lm, cases: list[tuple[str, dict, dict]], runner=None) -> dict[str, dict]:
    """Every sub-case at once, the way an engine round works: text pushed to every request that waits, then
    one ``step_batch`` over every request that can step (in :class:`GraphBistream`, feeds of 1, 5, 9, 10 or 54
    rows share one padded forward), then each request's own decision."""
    from cosyvoice_fast.llm.bistream_graph import GraphBistream

    runner = runner or GraphBistream(lm, slots=len(cases), max_len=256, kv_buckets=(128, 256), use_graphs=True)
    live = []
    for name, top, case in cases:
        st = BistreamState(_spec(top), case["prompt_text"].reshape(-1).tolist(),
                           case["prompt_speech_token"].reshape(-1).tolist(), max_tokens=int(case["max_yield"]))
        live.append({"name": name, "state": st, "slot": runner.acquire(), "top": top, "case": case,
                     "chunks": [c.reshape(-1).tolist() for c in case["text_chunks"]], "logp": [],
                     "sampler": _scripted_greedy(case["overrides"])})
    g = torch.Generator()
    while any(not r["state"].done for r in live):
        for r in live:
            st = r["state"]
            while st.waiting:
                st.push_text(r["chunks"].pop(0)) if r["chunks"] else st.end_text()
        ready = [r for r in live if not r["state"].done]
        logps = runner.step_batch([(r["state"], r["slot"]) for r in ready])
        for r, logp in zip(ready, logps):
            st = r["state"]
            plan = st.next_step()
            token = decide(plan, logp, st.out, r["sampler"], g)
            r["logp"].append(logp[token].item())
            st.accept(token)
            if st.done:
                runner.release(r["slot"])
    return {r["name"]: r for r in live} | {"_runner": runner}


def test_batched_graph_path_gives_the_recorded_ids(lm, fixture_dir, fake_graphs):
    """The graph path's bookkeeping (row padding, per-row positions, idle rows at the top of the cache, KV
    buckets) on CPU with replays that re-run the captured function: every sub-case, all stepped together."""
    cases = _sets(fixture_dir)
    runs = _run_batched(lm, cases)
    runner = runs.pop("_runner")
    for name, _, case in cases:
        st = runs[name]["state"]
        assert st.out == case["out_tokens"].tolist(), name
        assert (torch.tensor(runs[name]["logp"]) - case["step_token_logp"]).abs().max().item() <= TOL, name
    assert runner.eager_steps == 0
    keys = {key for cache in runner._graphs.values() for key in cache.graphs}
    assert {rows for _, rows in keys} == {1, 8, 64}  # single tokens, text after a fill / the final feed, the start


def test_eager_slots_driven_like_an_engine_round(lm, fixture_dir):
    """The eager runner's slot calls (the same as the graph runner's) interleave requests without mixing them."""
    cases = _sets(fixture_dir)
    runs = _run_batched(lm, cases, runner=EagerBistream(lm))
    runner = runs.pop("_runner")
    for name, _, case in cases:
        assert runs[name]["state"].out == case["out_tokens"].tolist(), name
    assert runner._caches == {}  # every slot released


def test_graph_runner_without_graphs_runs_the_same_math_eagerly(lm, fixture_dir):
    """On a CPU (no CUDA graphs) the padded batched forward runs as is, with the same ids; asking for graphs
    there is refused with a message."""
    from cosyvoice_fast.llm.bistream_graph import GraphBistream

    cases = _sets(fixture_dir)
    runner = GraphBistream(lm, slots=len(cases), max_len=256)
    assert not runner.use_graphs
    runs = _run_batched(lm, cases, runner=runner)
    runs.pop("_runner")
    for name, _, case in cases:
        assert runs[name]["state"].out == case["out_tokens"].tolist(), name
    assert runner.eager_steps > 0
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphBistream(lm, use_graphs=True)


@pytest.mark.gpu
def test_batched_graph_path_on_cuda_gives_the_recorded_ids(tiny_models, fixture_dir):
    """The same with real CUDA graphs in fp32 (run through the device tool with the fixture carried along)."""
    import copy

    lm = copy.deepcopy(tiny_models.llm).to("cuda")
    cases = _sets(fixture_dir)
    runs = _run_batched(lm, cases)
    runs.pop("_runner")
    for name, _, case in cases:
        assert runs[name]["state"].out == case["out_tokens"].tolist(), name
        assert (torch.tensor(runs[name]["logp"]) - case["step_token_logp"]).abs().max().item() <= TOL, name
