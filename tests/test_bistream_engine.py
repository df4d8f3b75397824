"""Bi-streaming through the engine on the tiny synthetic model: a text source in, streamed audio out.

Text pieces are cut at the tokenizer's own token boundaries (how an LLM streams); the feed regroups released ids
into the schedule's 5-row chunks, so the speech must not depend on how the text was cut."""

from __future__ import annotations

import queue
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.frontend.text_source import SourceLimits
from cosyvoice_fast.frontend.request import SynthesisRequest

PROMPT = Path(__file__).resolve().parent.parent / "assets" / "cross_lingual_prompt.wav"
TEXT = "Hello there, this sentence arrives a few words at a time, like an agent's reply in 1990."
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from cosyvoice_fast.serving.service import load_service

    s = load_service(None, "tiny", "cpu", "fp32", speaker_cache_dir=tmp_path_factory.mktemp("spk"), progress=False)
    yield s
    s.close()


def _pieces(svc, n: int) -> list[str]:
    enc = svc.frontend.tokenizer._tok.encode(TEXT)
    ends = [end for _, end in enc.offsets]
    cuts = [0] + [ends[i] for i in range(n - 1, len(ends), n)] + [len(TEXT)]
    return [TEXT[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def _request(source, **kw) -> SynthesisRequest:
    return SynthesisRequest(text_source=source, mode="zero_shot", prompt_wav=str(PROMPT), prompt_text="a prompt",
                            seed=3, max_tokens=MAX_TOKENS, **kw)


def _run(svc, source, **kw):
    chunks = list(svc.engine.stream(_request(source, **kw)))
    tele = chunks[-1].telemetry
    return np.concatenate([c.samples for c in chunks]), tele, chunks


def test_same_text_whole_and_in_pieces_gives_the_same_audio(svc):
    whole, tele, chunks = _run(svc, iter([TEXT]))
    assert len(tele.token_times) == MAX_TOKENS and len(whole) == MAX_TOKENS * 960
    assert chunks[-1].is_last and len(chunks) > 1  # streamed in several chunks
    for n in (1, 3, 7):
        pieces = _pieces(svc, n)
        assert len(pieces) > 1
        audio, t2, _ = _run(svc, iter(pieces))
        assert len(t2.text_arrivals) == len(pieces)
        # same tokens, same chunk calls; float rounding only (chunks may be vocoded in other batch groupings)
        np.testing.assert_allclose(audio, whole, rtol=0, atol=1e-5)


def test_queue_source_streams_while_text_arrives(svc):
    q: queue.Queue = queue.Queue()
    pieces = _pieces(svc, 3)

    def produce():
        for p in pieces:
            q.put(p)
        q.put(None)

    threading.Thread(target=produce, daemon=True).start()
    audio, tele, _ = _run(svc, q)
    assert len(audio) == MAX_TOKENS * 960 and len(tele.text_arrivals) == len(pieces)
    assert tele.first_audio_from_text > 0 and tele.first_audio_from_token5 > 0
    d = tele.to_dict()
    assert len(d["text_arrivals"]) == len(pieces) and d["derived"]["first_audio_from_text_ms"] > 0


def test_async_source(svc):
    async def agen():
        for p in _pieces(svc, 7):
            yield p

    audio, _, _ = _run(svc, agen())
    whole, _, _ = _run(svc, iter([TEXT]))
    np.testing.assert_allclose(audio, whole, rtol=0, atol=1e-5)


def test_never_ending_source_is_cut_by_the_idle_timeout(svc):
    q: queue.Queue = queue.Queue()
    q.put("Hello")
    with pytest.raises(TimeoutError, match="no text piece arrived for 0.3 s"):
        _run(svc, q, source_limits=SourceLimits(idle_timeout_s=0.3))
    assert svc.engine.stats()["active"] == 0


def test_text_over_the_length_limit_gets_a_clear_message(svc):
    limit = svc.frontend.config.max_chars
    with pytest.raises(ValueError, match=str(limit)):
        _run(svc, iter(["word " * 50] * (limit // 200 + 2)))


def test_empty_pieces_only_get_a_clear_message(svc):
    with pytest.raises(ValueError, match="without anything to speak"):
        _run(svc, iter(["", "", ""]))


def test_empty_pieces_between_words_are_ignored(svc):
    whole, _, _ = _run(svc, iter([TEXT]))
    audio, _, _ = _run(svc, iter(["", TEXT[:20], "", TEXT[20:], ""]))
    np.testing.assert_allclose(audio, whole, rtol=0, atol=1e-5)


def test_closing_the_stream_mid_text_cancels_the_request(svc):
    q: queue.Queue = queue.Queue()
    for p in _pieces(svc, 3)[:8]:
        q.put(p)  # never ended: the request is alive only through its consumer
    stream = svc.engine.stream(_request(q))  # the LM runs out of text before its first chunk: it waits
    for _ in range(200):
        if svc.engine.stats()["active"] == 1:
            break
        threading.Event().wait(0.05)
    assert svc.engine.stats()["active"] == 1
    stream.close()
    for _ in range(100):
        if svc.engine.stats()["active"] == 0:
            break
        threading.Event().wait(0.05)
    assert svc.engine.stats()["active"] == 0
    q.put(None)  # the reader thread was told to stop; let it see the end of its queue


@pytest.mark.parametrize("kw, message", [
    (dict(text="hi", text_source=iter(["a"])), "either text or text_source"),
    (dict(text_source="a whole string"), "whole string"),
    (dict(text_source=42), "iterator, an async iterator or a queue"),
    (dict(), "Text is empty"),
])
def test_bad_sources_get_clear_messages(kw, message):
    with pytest.raises(ConfigError, match=message):
        SynthesisRequest(**kw)


def test_adapter_tokens_equal_the_eager_driver(svc):
    """The engine's stage (eager runner) gives the eager driver's tokens for the same chunks and seed."""
    from cosyvoice_fast.llm.bistream_eager import EagerBistream
    from cosyvoice_fast.llm.bistream_stage import BistreamLLM
    from cosyvoice_fast.engine.bistream import TextFeed

    llm = svc.models.llm
    tok = svc.frontend.text_stream()
    tok.push(TEXT)
    ids = tok.ids + tok.finish()
    chunks = [ids[i:i + 5] for i in range(0, len(ids), 5)]
    prompt_text, prompt_speech = [1, 2, 3], list(range(10, 27))
    ref = list(EagerBistream(llm).tokens(prompt_text, prompt_speech, chunks, torch.Generator().manual_seed(5),
                                         max_tokens=MAX_TOKENS))
    stage = BistreamLLM(EagerBistream(llm))
    feed = TextFeed(tok, EagerBistream(llm).new_state(prompt_text, prompt_speech, MAX_TOKENS))
    for c in chunks:
        feed.state.push_text(c)
    feed.state.end_text()

    from types import SimpleNamespace

    inputs = SimpleNamespace(prompt_text=torch.tensor([prompt_text]),
                             llm_prompt_speech_token=torch.tensor([prompt_speech]))
    stage.attach(inputs, feed)
    st = stage.new_state(inputs, torch.zeros(1, 1), torch.Generator().manual_seed(5), MAX_TOKENS, False)
    got, call = [], stage.prefill
    while not st.done:
        (res,) = call([st])
        call = stage.decode
        if res is not None:
            got.append(res)
    assert got == ref and len(got) == MAX_TOKENS


def test_pre_tokenised_source_with_model_inputs(svc):
    """``inputs`` (the prompt side) + a source of token-id lists: no tokenizer needed (the GPU bench's path)."""
    from cosyvoice_fast.bench.engine_bench import synthetic_inputs
    from cosyvoice_fast.bench.bistream import paced

    inputs = synthetic_inputs(svc.models.config, 20, 23, seed=2)
    ids = inputs.text_segments[0][0].tolist()
    runs = []
    for piece in (1, 3, 7, len(ids)):
        req = SynthesisRequest(inputs=inputs, text_source=paced(ids, piece, 0.0), seed=2, max_tokens=MAX_TOKENS)
        chunks = list(svc.engine.stream(req))
        runs.append(np.concatenate([c.samples for c in chunks]))
        assert len(chunks[-1].telemetry.text_arrivals) == -(-len(ids) // piece)
    assert len(runs[0]) == MAX_TOKENS * 960
    for r in runs[1:]:
        np.testing.assert_allclose(r, runs[0], rtol=0, atol=1e-5)


def test_bench_bistream_runs_on_the_tiny_model(tmp_path):
    import json

    from cosyvoice_fast.bench.bistream import main

    assert main(["--synthetic", "tiny", "--device", "cpu", "--concurrency", "1,2", "--requests", "2",
                 "--gen-tokens", "30", "--text-tokens", "12", "--piece-interval-ms", "0", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    for c in ("1", "2"):
        agg = res["by_concurrency"][c]
        assert agg["requests"] == 2 and agg["first_audio_from_text_p50_ms"] > 0 and agg["last_audio_lag_p50_ms"] > 0


def test_chunk_timeline_marks_text_arrivals(svc):
    from cosyvoice_fast.app.dashboard import TEXT_ROW, chunk_timeline_figure

    pieces = _pieces(svc, 3)
    _, tele, chunks = _run(svc, iter(pieces))
    fig = chunk_timeline_figure(tele)
    marks = [tr for tr in fig.data if tr.name == "text piece arrived"]
    assert len(marks) == 1 and len(marks[0].x) == len(pieces) and set(marks[0].y) == {TEXT_ROW}
    assert [tr for tr in fig.data if tr.name == "5th text token"]
    assert list(fig.layout.yaxis.categoryarray)[0] == TEXT_ROW and len(fig.layout.yaxis.categoryarray) == len(chunks) + 1


def test_type_as_you_go_handler_feeds_words_and_marks_them(svc):
    from cosyvoice_fast.app.dashboard import TEXT_ROW
    from cosyvoice_fast.app.bistream import type_as_you_go, words_at

    assert "".join(words_at(TEXT, 100)) == TEXT
    with pytest.raises(ValueError, match="words per second"):
        next(words_at(TEXT, 0))
    outs = list(type_as_you_go(svc, TEXT, 100, MAX_TOKENS))
    status, (sr, audio), fig = outs[-1]
    assert sr == 24000 and len(audio) == MAX_TOKENS * 960
    fed = re.search(r"done: (\d+) words fed", status)
    # the LM may reach its token cap before the last words arrive (then the request ends and feeding stops)
    assert fed and 1 <= int(fed.group(1)) <= len(TEXT.split(" ")), status
    assert any(tr.name == "text piece arrived" and set(tr.y) == {TEXT_ROW} for tr in fig.data)
