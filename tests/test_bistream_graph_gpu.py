"""The graph bi-streaming LLM stage equals the eager one in fp32 on CUDA (same chunks, same seed, same tokens),
alone and batched with other requests.  Run on the GPU box (no tokenizer needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch



def _drive(stage, states):
    """Step ``states`` together through the stage's batch calls until all are done; tokens per state."""
    got = [[] for _ in states]
    first = True
    while not all(s.done for s in states):
        live = [s for s in states if not s.done]
        res = stage.prefill(live) if first else stage.decode(live)
        first = False
        for s, r in zip(live, res):
            if isinstance(r, BaseException):
                raise r
            if r is not None:
                got[states.index(s)].append(r)
    return got


def run_both(llm, device: str) -> dict[str, list[list[int]]]:
    """Three requests (with and without prompt speech, text in pieces of 3 ids) stepped together on the eager
    and the graph runner (``use_graphs`` only on CUDA); greedy picks, so the tokens must be identical."""
    from cosyvoice_fast.llm.bistream_eager import EagerBistream
    from cosyvoice_fast.llm.bistream_graph import GraphBistream
    from cosyvoice_fast.llm.bistream_stage import BistreamLLM
    from cosyvoice_fast.engine.bistream import IdText, TextFeed
    from cosyvoice_fast.llm.model.sampling import greedy_sample

    runs = {}
    graph = GraphBistream(llm, slots=4, max_len=1024, use_graphs=device == "cuda")
    for name, runner in (("eager", EagerBistream(llm)), ("graph", graph)):
        stage = BistreamLLM(runner, sampler=greedy_sample)
        states = []
        for i, (p_text, p_speech, n_text) in enumerate([(6, 38, 40), (2, 0, 27), (4, 15, 33)]):
            g = torch.Generator().manual_seed(100 + i)
            ids = torch.randint(0, 1000, (n_text,), generator=g).tolist()
            state = EagerBistream(llm).new_state(list(range(p_text)), list(range(50, 50 + p_speech)), max_tokens=60)
            feed = TextFeed(IdText(), state)
            for k in range(0, n_text, 3):
                feed.push(ids[k:k + 3])
            feed.end()
            inputs = SimpleNamespace(prompt_text=None, llm_prompt_speech_token=None)
            stage.attach(inputs, feed)
            states.append(stage.new_state(inputs, torch.zeros(1, 1), torch.Generator().manual_seed(i), 60, False))
        runs[name] = _drive(stage, states)
    return runs


@pytest.mark.gpu
def test_graph_stage_equals_eager_in_fp32():
    from helpers import random_full_size_lm

    runs = run_both(random_full_size_lm(torch.float32, "cuda").eval(), "cuda")
    assert runs["graph"] == runs["eager"]
    assert all(len(t) == 60 for t in runs["eager"])


def test_batched_padded_math_equals_eager_on_cpu(tiny_models):
    """The same comparison on the tiny fixture model on CPU (the graph runner's padded math, run eagerly)."""
    runs = run_both(tiny_models.llm, "cpu")
    assert runs["graph"] == runs["eager"]
    assert all(len(t) == 60 for t in runs["eager"])


@pytest.mark.gpu
def test_bench_bistream_on_cuda_with_the_graph_runner(tmp_path):
    """The engine path on CUDA: the graph runner through the engine, paced pre-tokenised text, c1 and c4."""
    import json

    from cosyvoice_fast.bench.bistream import main

    assert main(["--synthetic", "tiny", "--device", "cuda", "--dtype", "fp32", "--backend", "cudagraph",
                 "--concurrency", "1,4", "--requests", "4", "--gen-tokens", "60", "--text-tokens", "30",
                 "--piece-interval-ms", "20", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert all(res["by_concurrency"][c]["requests"] == 4 for c in ("1", "4"))
