"""Incremental text frontend: text in pieces gives the ids of the whole text; sources with limits; messages.

The tokenizer is a Qwen2-format byte-level BPE *trained here* on the test texts, so merges span whole words and
Chinese runs: a piece released at the wrong place would change the ids (a merge-free tokenizer would hide it).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import random

import pytest

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed here "
                                                      "(pip install -r requirements.txt)")
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from cosyvoice_fast.frontend.text import EOS_TOKEN, SPECIAL_TOKENS, TextTokenizer, _build_byte_level_bpe
from cosyvoice_fast.frontend.text_normalize import EmptyTextError, TextTooLongError
from cosyvoice_fast.frontend.text_source import SourceLimits, TextSourceTimeout, aread_pieces, read_pieces
from cosyvoice_fast.frontend.text_stream import NOTHING_STREAMED, IncrementalText, whole_text_ids

TEXTS = {
    "en": ("Hello world, it's 5 % off on 2024-05-01 at 12:30 for $5.99 [breath] really.\nThe 1990s, the 21st "
           "well-known U.S.A. story: don't   stop -5 degrees, 3.14 and 1,000,000 people <strong>now</strong>! "
           "Windows10 and x² too."),
    "zh": "你好，世界。今天是2024年5月1日，气温25度到30度，我用iPhone 15拍照[breath]真好！价格是$5.5，百分之3%。",
    "mixed_spaces": "  Mixed   spaces\t\tand\n\nnew lines  end. Another line\nwith more words,  here and there  ",
}


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    bpe = _build_byte_level_bpe({}, [], add_prefix_space=False)
    bpe.model = models.BPE()
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = list(TEXTS.values()) * 3 + ["the quick brown fox jumps over the lazy dog " * 5,
                                         "two thousand and twenty-four point five percent dollars",
                                         "二零二四年五月一日 百分之三 五点五美元 你好世界今天真好"]
    bpe.train_from_iterator(corpus, trainer)
    for t in (EOS_TOKEN, *SPECIAL_TOKENS):
        bpe.add_special_tokens([AddedToken(t, normalized=False, special=True)])
    tok = TextTokenizer(bpe)
    assert any(len(tok.decode([i])) >= 4 for i in tok.encode(TEXTS["en"]))  # real merges exist
    return tok


def _token_pieces(tok: TextTokenizer, text: str, n: int) -> list[str]:
    """``text`` cut into pieces of ``n`` of its own tokens (how an LLM streams its output)."""
    enc = tok._tok.encode(text)
    ends = [end for _, end in enc.offsets]
    cuts = [0] + [ends[i] for i in range(n - 1, len(ends), n)] + [len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def _stream(tok: TextTokenizer, pieces: list[str], **kw) -> tuple[list[int], int]:
    """(all ids, how many were released before finish())."""
    inc = IncrementalText(tok, **kw)
    ids: list[int] = []
    for p in pieces:
        ids += inc.push(p)
    early = len(ids)
    return ids + inc.finish(), early


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("n", [1, 3, 7])
def test_pieces_of_tokens_give_the_ids_of_the_whole_text(tok, name, n):
    text = TEXTS[name]
    pieces = _token_pieces(tok, text, n)
    assert "".join(pieces) == text and len(pieces) >= 3
    ids, early = _stream(tok, pieces)
    whole = whole_text_ids(text, tok)
    assert ids == whole
    assert early >= 0.7 * len(whole)  # streamed as it came, not held to the end


@pytest.mark.parametrize("seed", range(6))
def test_random_character_cuts_give_the_ids_of_the_whole_text(tok, seed):
    rng = random.Random(seed)
    for text in TEXTS.values():
        cuts = sorted(rng.sample(range(1, len(text)), k=len(text) // 4))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _stream(tok, pieces)[0] == whole_text_ids(text, tok)


def test_english_is_released_one_word_behind(tok):
    inc = IncrementalText(tok)
    assert inc.push("Twenty") == []  # the word may go on
    assert inc.push(" apples") == tok.encode("Twenty")  # a new word began: the previous one is final
    assert inc.push(" cost 5") == tok.encode(" apples")
    assert inc.push(".") == []  # "5" may still be "5.5": numbers wait for the next word
    assert inc.push("5 dollars") == tok.encode(" cost five point five")
    assert inc.finish() == tok.encode(" dollars")  # no full stop is added: the LM reads the stream as sent


def test_chinese_is_released_at_punctuation(tok):
    inc = IncrementalText(tok)
    assert inc.push("你好世界") == []  # one pre-token until punctuation ends it
    assert inc.push("，今天") == tok.encode("你好世界")
    assert inc.finish() == tok.encode("，今天")


def test_empty_pieces_are_ignored_and_an_empty_stream_is_refused(tok):
    inc = IncrementalText(tok)
    assert inc.push("") == [] and inc.push("Hi ") == [] and inc.push("") == []
    assert inc.finish() == tok.encode("Hi")
    for pieces in ([], ["", "  ", "\n"], ["😀", " ", "!!"]):
        inc = IncrementalText(tok)
        for p in pieces:
            assert inc.push(p) == []
        with pytest.raises(EmptyTextError, match="without anything to speak"):
            inc.finish()
    assert NOTHING_STREAMED.startswith("The text stream ended")


def test_text_over_the_limit_is_refused_at_the_piece_that_crosses_it(tok):
    inc = IncrementalText(tok, max_chars=40)
    inc.push("a" * 20 + " 😀😀😀😀😀😀 ")  # emoji are removed before counting: still within the limit
    inc.push("b" * 19)
    with pytest.raises(TextTooLongError, match="42 characters, the limit is 40"):
        inc.push("cc")


def test_misuse_messages(tok):
    inc = IncrementalText(tok)
    with pytest.raises(TypeError, match="must be a str, got bytes"):
        inc.push(b"hi")  # type: ignore[arg-type]
    inc.push("hi")
    inc.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        inc.push("more")
    with pytest.raises(ValueError, match="lang='fr'"):
        IncrementalText(tok, lang="fr")


# ------------------------------------------------------------------------------------------ sources


class FakeClock:
    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_never_ending_source_is_cut_by_the_total_limit():
    pieces = read_pieces(itertools.repeat("word "), SourceLimits(idle_timeout_s=5, total_timeout_s=10),
                         clock=FakeClock(1.0))
    got = []
    with pytest.raises(TextSourceTimeout, match="ran longer than 10 s without ending"):
        for p in pieces:
            got.append(p)
    assert 5 <= len(got) <= 10


def test_a_slow_iterator_is_cut_by_the_idle_limit():
    pieces = read_pieces(iter(["a", "b"]), SourceLimits(idle_timeout_s=2, total_timeout_s=100),
                         clock=FakeClock(3.0))
    with pytest.raises(TextSourceTimeout, match="no text piece arrived for 2 s"):
        list(pieces)


def test_queue_source_ends_with_none_and_times_out_when_silent():
    q: queue.Queue = queue.Queue()
    for item in ("Hello", " world", None):
        q.put(item)
    assert list(read_pieces(q)) == ["Hello", " world"]
    q.put("only this")
    with pytest.raises(TextSourceTimeout, match="no text piece arrived for 0.05 s"):
        list(read_pieces(q, SourceLimits(idle_timeout_s=0.05)))


def test_async_sources():
    async def agen():
        yield "a"
        yield "b"

    async def silent():
        yield "a"
        await asyncio.sleep(3600)

    async def main():
        got = [p async for p in aread_pieces(agen())]
        q: asyncio.Queue = asyncio.Queue()
        for item in ("x", "y", None):
            q.put_nowait(item)
        got_q = [p async for p in aread_pieces(q)]
        with pytest.raises(TextSourceTimeout, match="no text piece arrived"):
            [p async for p in aread_pieces(silent(), SourceLimits(idle_timeout_s=0.05))]
        return got, got_q

    assert asyncio.run(main()) == (["a", "b"], ["x", "y"])


def test_source_errors_name_the_problem():
    with pytest.raises(TypeError, match="str pieces, got int"):
        list(read_pieces([1]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="SourceLimits.idle_timeout_s"):
        SourceLimits(idle_timeout_s=0)


# ------------------------------------------------------------------------------------------ the prompt side

def test_prompt_side_is_prepared_once_and_matches_prepare(tmp_path):
    """A bi-streamed request prepares its voice once (``prepare_prompt``), then only text arrives; the inputs it
    builds equal what ``prepare`` builds for the whole text, and the same upload is an LRU hit the second time."""
    from pathlib import Path

    import torch

    from cosyvoice_fast.frontend.pipeline import Frontend
    from cosyvoice_fast.frontend.request import SynthesisRequest
    from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

    wav = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "zero_shot_prompt.wav"
    if not wav.is_file():
        pytest.skip("needs ../shared/prompts/zero_shot_prompt.wav")
    fe = Frontend.from_model_dir(synthetic_model_dir("tiny"), speaker_cache_dir=tmp_path)
    req = SynthesisRequest(text="Hello there, general.", prompt_wav=wav, prompt_text="a prompt transcript")
    side = fe.prepare_prompt(req)
    assert not side.cache_hit and fe.prepare_prompt(req).cache_hit
    stream = fe.text_stream()
    ids = stream.push("Hello there,") + stream.push(" general.") + stream.finish()
    assert ids == whole_text_ids(req.text, fe.tokenizer)
    whole, _ = fe.prepare(req)
    built = side.model_inputs(whole.text_segments)
    for name in ("prompt_text", "llm_prompt_speech_token", "flow_prompt_speech_token", "prompt_feat", "embedding"):
        assert torch.equal(getattr(built, name), getattr(whole, name)), name
    assert torch.equal(side.lm_prompt[0], whole.prompt_text)
    assert torch.equal(side.lm_prompt[1], whole.llm_prompt_speech_token)


def test_text_feed_hands_released_ids_to_the_schedule_and_times_them(tok):
    """Released ids reach the LM's text stream in chunks of 5 (the rest at the end); arrival times are kept per piece, and
    the moment the 5th text token reached the schedule is recorded (first audio is measured from it)."""
    from cosyvoice_fast.llm.model.bistream import BistreamSpec, BistreamState
    from cosyvoice_fast.engine.bistream import TextFeed

    clock = FakeClock(1.0)
    feed = TextFeed(IncrementalText(tok), BistreamState(BistreamSpec(), [], []), clock=clock)
    text = TEXTS["en"]
    pieces = _token_pieces(tok, text, 3)
    released = [feed.push(p) for p in pieces]
    released.append(feed.end())
    assert feed.text.ids == whole_text_ids(text, tok)
    assert feed.t_first_piece == 1.0 and [a.t for a in feed.arrivals] == [float(i + 1) for i in range(len(pieces))]
    assert [a.ids_released for a in feed.arrivals] == released[:-1]
    cumulative = [sum(released[:i + 1]) for i in range(len(released))]
    fifth = next(i for i, c in enumerate(cumulative) if c >= 5)
    assert feed.t_text_token_5 == feed.arrivals[fifth].t
    st = feed.state  # no LM steps here: it read chunks until it could decode, the rest wait unread
    assert st.text_ended and st.chunks_read + st.chunks_unread == -(-len(feed.text.ids) // st.spec.text_rows)
    assert st.text_ids == feed.text.ids[:len(st.text_ids)] and not st.waiting
