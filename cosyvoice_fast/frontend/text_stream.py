"""Incremental text frontend: normalise and tokenise text that arrives in pieces (a voice agent's LLM output)
without changing what normalising the whole text would give.

The LM reads BPE ids of spoken-form text, and both steps look at context: normalisation rewrites numbers, dates
or markup that may still be arriving ("$5" + ".99", "2024" + "-05-01"), and Qwen2's pre-tokenizer makes a run of
letters one unit (a Chinese clause without punctuation is one unit, "，世界" another).  So a piece is held back
until a *safe boundary*: a letter that starts a new word (after a space or punctuation, not after a digit, not
inside ``[...]`` / ``<...>`` markup).  When such a letter has arrived, everything before the pre-token that holds
it is final: its normalised text cannot change and its ids are exactly those of the whole text.  English text is
therefore released word by word, one word behind; Chinese text clause by clause (at punctuation), because the
tokenizer itself treats an unpunctuated run of Chinese characters as one unit.

Cost stays linear: each boundary re-normalises only the text since the previous boundary (rules never reach
further back than the start of a word), and only the newly final text is tokenised.

The language (Chinese or English rules) is decided once, from the text up to the first boundary, unless given.
"""

from __future__ import annotations

import logging
import unicodedata
from dataclasses import dataclass
from typing import Callable

from cosyvoice_fast.frontend.text import TextTokenizer
from cosyvoice_fast.frontend.text_normalize import (
    _FULLWIDTH, DEFAULT_MAX_CHARS, EmptyTextError, TextTooLongError, clean_text, is_chinese, normalize,
)

log = logging.getLogger(__name__)

#: how far back an unclosed ``[`` or ``<`` still blocks a boundary (the longest markup token is shorter)
MARKUP_REACH = 48
NOTHING_STREAMED = ("The text stream ended without anything to speak: send at least one piece with words or "
                    "numbers before ending the stream.")


def _is_word_start(raw: str, i: int) -> bool:
    """``raw[i]`` is a letter after a space or punctuation (not after a letter, digit or combining mark), and
    no markup bracket is open before it."""
    if i < 1 or unicodedata.category(raw[i])[0] != "L" or unicodedata.category(raw[i - 1])[0] in "LNM":
        return False
    window = raw[max(0, i - MARKUP_REACH):i]
    return window.rfind("[") <= window.rfind("]") and window.rfind("<") <= window.rfind(">")


def whole_text_ids(text: str, tokenizer: TextTokenizer, *, lang: str | None = None,
                   max_chars: int = DEFAULT_MAX_CHARS, tn: Callable[[str, bool], str] | None = None) -> list[int]:
    """What :class:`IncrementalText` must produce for ``text`` however it is cut: the ids of the whole text,
    normalised in one piece (no sentence split, no added full stop: the bi-streaming LM reads one stream)."""
    return tokenizer.encode(normalize(text, max_chars=max_chars, lang=lang or _lang(text), tn=tn))


def _lang(text: str) -> str:
    return "zh" if is_chinese(text) else "en"


@dataclass
class IncrementalText:
    """Pieces of text in, final token ids out as soon as they are safe (see the module docstring).

    ``push(piece)`` returns the ids that became final (often none); ``finish()`` the rest.  Together they equal
    :func:`whole_text_ids` of the concatenated pieces.  Empty pieces are accepted and give nothing (LLM streams
    send them); a stream that ends with nothing to speak raises :class:`EmptyTextError`; text over ``max_chars``
    raises :class:`TextTooLongError` at the piece that crosses the limit.
    """

    tokenizer: TextTokenizer
    lang: str | None = None
    max_chars: int = DEFAULT_MAX_CHARS
    tn: Callable[[str, bool], str] | None = None

    def __post_init__(self) -> None:
        if self.lang not in (None, "zh", "en"):
            raise ValueError(f"lang={self.lang!r}: use 'zh', 'en' or None (decided from the text)")
        if self.max_chars < 1:
            raise ValueError(f"max_chars={self.max_chars!r}: use a whole number >= 1")
        self.raw = ""
        self.ids: list[int] = []  # every id released so far
        self.final_text = ""  # the normalised text those ids encode
        self._anchor = 0  # raw index of the letter at the last boundary (0: none yet)
        self._head = ""  # normalised text before that letter
        self._finished = False

    def push(self, piece: str) -> list[int]:
        """Add a piece; the ids that became final with it."""
        if self._finished:
            raise RuntimeError("text arrived after finish(); start a new stream for more text")
        if not isinstance(piece, str):
            raise TypeError(f"a text piece must be a str, got {type(piece).__name__}")
        start = max(self._anchor + 1, len(self.raw), 1)  # only new characters can start a new boundary
        self.raw += piece
        if len(self.raw) > self.max_chars:  # cleaning only removes characters: count them only past the limit
            try:
                cleaned = len(clean_text(self.raw, max_chars=len(self.raw)))
            except EmptyTextError:
                cleaned = 0
            if cleaned > self.max_chars:
                raise TextTooLongError(cleaned, self.max_chars)
        cut = next((i for i in range(len(self.raw) - 1, start - 1, -1) if _is_word_start(self.raw, i)), None)
        if cut is None:
            return []
        self.lang = self.lang or _lang(self.raw[:cut + 1])
        letter = self.raw[cut].translate(_FULLWIDTH)
        normalized = self._head + self._normalize(self.raw[self._anchor:cut + 1])
        if not normalized.endswith(letter):  # a rule rewrote the boundary letter: not a safe boundary after all
            return []
        stable = normalized[:self._last_pretoken_start(normalized)]
        self._anchor, self._head = cut, normalized[:-len(letter)]
        return self._release(stable)

    def finish(self) -> list[int]:
        """The text has ended: the ids not released yet."""
        if self._finished:
            return []
        self._finished = True
        self.lang = self.lang or _lang(self.raw)
        try:  # after a boundary the rest starts with a letter, so only a stream without one can be empty
            normalized = self._head + self._normalize(self.raw[self._anchor:])
        except EmptyTextError:
            raise EmptyTextError(NOTHING_STREAMED) from None
        return self._release(normalized)

    # ------------------------------------------------------------------------------------------ helpers

    def _normalize(self, text: str) -> str:
        return normalize(text, max_chars=max(self.max_chars, len(text)), lang=self.lang, tn=self.tn)

    def _last_pretoken_start(self, text: str) -> int:
        """Index in ``text`` where its last pre-token starts (searched after the text already final)."""
        base = len(self.final_text)
        tail = text[base:]
        after_special = max((tail.rfind(t) + len(t) for t in self.tokenizer.added_tokens if t in tail), default=0)
        spans = self.tokenizer.pretokenize(tail[after_special:])
        return base + after_special + (spans[-1][0] if spans else 0)

    def _release(self, stable: str) -> list[int]:
        """Tokenise the newly final text (from a pre-token boundary, so its ids continue the earlier ones)."""
        if not stable.startswith(self.final_text):  # never seen; would mean a rule reached across a boundary
            log.warning("incremental normalisation diverged from the text already released (%r vs %r); "
                        "continuing after it", stable[-40:], self.final_text[-40:])
            return []
        new = stable[len(self.final_text):]
        if not new:
            return []
        ids = self.tokenizer.encode(new)
        self.final_text = stable
        self.ids += ids
        return ids
