"""Text normalisation: turn what a user typed into what the speech LM was trained to read.

The LM reads BPE tokens of *spoken-form* text.  Digits, percent signs or emoji are either read badly or turned
into byte tokens it never saw in training, so before tokenising we:

1. clean: drop control / format / private-use characters and emoji (emoji have no pronunciation the model
   knows; keeping them would feed it unseen byte tokens, so they are removed, not kept), fold full-width digits
   and letters to ASCII, enforce the empty / length limits with user-facing errors;
2. protect CosyVoice2 markup (``[breath]``, ``<strong>``, ``<|endofprompt|>`` ...) so no rule below touches it;
3. spell out numbers with small built-in rule sets (Chinese readings when the text contains Chinese, English
   words otherwise: integers, decimals, percents, times, ISO dates, ``$`` amounts, English ordinals and
   years, Chinese ``NNNN年`` years);
4. apply the punctuation clean-ups of the reference frontend (Chinese: drop full-width brackets, ``——`` and
   `` - `` become a comma pause, ``.`` becomes ``。``, spaces between Chinese characters go, a trailing comma
   becomes a full stop; ``²``/``³`` are read out) and collapse whitespace; line breaks become sentence breaks.

Everything is pure functions of the input: no model files, no network, no torch.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from typing import Any, Callable

from cosyvoice_fast.frontend.number_words import (
    EN_ONES, ZH_DIGIT, en_below_100, en_int, en_num, en_ordinal, en_year, number_to_chinese, number_to_english,
    plural_words, zh_digits, zh_num,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_CHARS = 5000

#: Markup tokens CosyVoice2 adds to the Qwen2 vocabulary, in the order they are registered (ids follow it).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>",
    "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)


NOTHING_TO_SAY = ("Text has nothing to speak: it holds only punctuation, symbols or emoji. "
                   "Type some words to synthesise.")


class EmptyTextError(ValueError):
    """The request has nothing to speak (empty, blank, or only symbols / emoji)."""


class TextTooLongError(ValueError):
    """The request is over the hard character limit; ``length`` and ``limit`` say by how much."""

    def __init__(self, length: int, limit: int) -> None:
        self.length, self.limit = length, limit
        super().__init__(f"Text is too long: {length} characters, the limit is {limit}. "
                         f"Split it into several shorter requests.")


def is_chinese(text: str) -> bool:
    """True when ``text`` holds at least one CJK ideograph (the reference frontend's language switch)."""
    return any("\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf" for c in text)


# ------------------------------------------------------------------------------------------------ cleaning

_EMOJI = re.compile(r"\s*[\U0001F000-\U0001FAFF\u2300-\u23FF\u2600-\u27BF\u2B00-\u2BFF"
                    "\uFE0E\uFE0F\u20E3\U000E0020-\U000E007F]+")
_FULLWIDTH = {**{0xFF10 + i: ord("0") + i for i in range(10)}, **{0xFF21 + i: ord("A") + i for i in range(26)},
              **{0xFF41 + i: ord("a") + i for i in range(26)}, 0xFF05: ord("%"), 0x3000: ord(" ")}
_MARKUP = re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len, reverse=True))
                     + r"|<\|[A-Za-z0-9_\-]{1,40}\|>")
_PUA = 0xE000  # placeholders for protected markup live in the Private Use Area (stripped from input first)


def _strip_unprintable(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u2028", "\n").replace("\u2029", "\n")
    out = []
    for c in text:
        if c == "\n":
            out.append(c)
        elif c in "\t\v\f":
            out.append(" ")
        elif unicodedata.category(c) not in ("Cc", "Cf", "Co", "Cs", "Cn"):
            out.append(c)
    return "".join(out)


def clean_text(text: str, *, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Strip unprintable characters and emoji, fold full-width ASCII, trim, and enforce the limits.

    This is all that happens to text when the caller turns normalisation off.  The length limit is checked on
    the cleaned text, before numbers are spelled out, so it means "characters the user typed".
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    printable = _strip_unprintable(text).strip()
    text = _EMOJI.sub("", printable).translate(_FULLWIDTH).strip()
    if not printable:
        raise EmptyTextError("Text is empty: type something to synthesise.")
    if not text:
        raise EmptyTextError(NOTHING_TO_SAY)
    if len(text) > max_chars:
        raise TextTooLongError(len(text), max_chars)
    return text


def has_speech(text: str) -> bool:
    """True when ``text`` holds a letter, ideograph or digit, i.e. more than punctuation and symbols."""
    return any(unicodedata.category(c)[0] in "LN" for c in text)


# ------------------------------------------------------------------------------------------ number rules

_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d]|,\d)")
_DATE = re.compile(r"(?<![\d.])(\d{4})([-/.])(\d{1,2})\2(\d{1,2})(?![\d])")
_TIME = re.compile(r"(?<![\d:])(\d{1,2}):(\d{2})(?::(\d{2}))?(?![\d:])")
_MONEY = re.compile(r"([$¥￥])\s?(\d+(?:\.\d+)?)")
_PERCENT = re.compile(r"(?:(?<![\w.\-])(-))?(?<![\d.])(\d+(?:\.\d+)?)\s?%")
_ORDINAL = re.compile(r"(?<![\d.])(\d+)(st|nd|rd|th)\b")
_DECADE = re.compile(r"(?<![\d.])(\d{4})s\b")
_ZH_YEAR = re.compile(r"(?<![\d.])(\d{4})(?=\s?年)")
_EN_YEAR = re.compile(r"(?<![\w.,$])(19\d\d|20[1-9]\d)(?![\d%]|\.\d|,\d)")
_EN_NEGATIVE = re.compile(r"(?<![\w.\-])-(?=\d)")
_ZH_NEGATIVE = re.compile(r"(?<![\dA-Za-z.\-])-(?=\d)")
_ZH_RANGE = re.compile(r"(?<![\d\-])([1-9]\d{0,3}|0)-([1-9]\d{0,3}|0)(?![\d\-])")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_MONTHS = ("January February March April May June July August September October November December").split()


def _dates_and_times(text: str, zh: bool) -> str:
    def date(m: re.Match) -> str:
        y, mo, d = m.group(1), int(m.group(3)), int(m.group(4))
        if not (1 <= mo <= 12 and 1 <= d <= 31):
            return m.group(0)
        if zh:
            return f"{zh_digits(y)}年{number_to_chinese(mo)}月{number_to_chinese(d)}日"
        return f"{_MONTHS[mo - 1]} {en_ordinal(number_to_english(d))} {_en_year_or_int(y)}"

    def time(m: re.Match) -> str:
        h, mi, sec = int(m.group(1)), int(m.group(2)), m.group(3)
        if h > 24 or mi > 59 or (sec is not None and int(sec) > 59):
            return m.group(0)
        if zh:
            out = number_to_chinese(h) + "点" + ("" if mi == 0 and sec is None else _zh_minute(mi) + "分")
            return out + (number_to_chinese(int(sec)) + "秒" if sec is not None else "")
        out = number_to_english(h) + (" o'clock" if mi == 0 else
                                      " oh " + EN_ONES[mi] if mi < 10 else " " + en_below_100(mi))
        return out + (f" and {number_to_english(int(sec))} seconds" if sec is not None else "")

    return _TIME.sub(time, _DATE.sub(date, text))


def _zh_minute(mi: int) -> str:
    return "零" + ZH_DIGIT[mi] if 0 < mi < 10 else number_to_chinese(mi)


def _en_year_or_int(y: str) -> str:
    return en_year(int(y)) if _EN_YEAR.fullmatch(y) else en_int(y)


def _spell_numbers_zh(text: str) -> str:
    text = _MONEY.sub(lambda m: zh_num(m.group(2)) + ("美元" if m.group(1) == "$" else "元"), text)
    text = _PERCENT.sub(lambda m: ("负" if m.group(1) else "") + "百分之" + zh_num(m.group(2)), text)
    text = _ZH_YEAR.sub(lambda m: zh_digits(m.group(1)), text)
    text = _ZH_RANGE.sub(r"\1到\2", text)
    text = _ZH_NEGATIVE.sub("负", text)
    return _NUMBER.sub(lambda m: zh_num(m.group(0)), text)


def _spell_numbers_en(text: str) -> str:
    def money(m: re.Match) -> str:
        whole, _, cents = m.group(2).partition(".")
        unit = {"$": "dollar", "¥": "yuan", "￥": "yuan"}[m.group(1)]
        plural = (lambda w, k: w + ("" if k == 1 or w == "yuan" else "s"))
        if len(cents) == 2:
            out = f"{en_int(whole)} {plural(unit, int(whole))}"
            return out + (f" and {number_to_english(int(cents))} {plural('cent', int(cents))}" if int(cents) else "")
        return f"{en_num(m.group(2))} {plural(unit, 0 if cents else int(whole))}"

    text = _MONEY.sub(money, text)
    text = _PERCENT.sub(lambda m: ("minus " if m.group(1) else "") + en_num(m.group(2)) + " percent", text)
    text = _ORDINAL.sub(lambda m: en_ordinal(en_int(m.group(1))), text)
    text = _DECADE.sub(lambda m: plural_words(_en_year_or_int(m.group(1))), text)
    text = _EN_YEAR.sub(lambda m: en_year(int(m.group(1))), text)
    text = _EN_NEGATIVE.sub("minus ", text)

    def number(m: re.Match) -> str:  # "Windows10" -> "Windows ten", not "Windowsten"
        before = " " if m.start() and text[m.start() - 1].isalpha() else ""
        after = " " if m.end() < len(text) and text[m.end()].isalpha() else ""
        return before + en_num(m.group(0)) + after

    return _NUMBER.sub(number, text)


# ------------------------------------------------------------------------------------------ punctuation

_NEWLINES = re.compile(r"[ \t]*\n[\s]*")
_ZH_BRACKETS = str.maketrans("", "", "（）【】()`")


def _newlines_to_breaks(text: str, zh: bool) -> str:
    """A line break ends a sentence: add a full stop unless punctuation already closes the line."""
    def repl(m: re.Match) -> str:
        prev = text[m.start() - 1] if m.start() else ""
        if prev and unicodedata.category(prev)[0] == "P":
            return "" if zh else " "
        return "。" if zh else ". "
    return _NEWLINES.sub(repl, text)


def _drop_cjk_spaces(text: str) -> str:
    """Keep a space only between two ASCII characters (English words inside Chinese text)."""
    return re.sub(r" +", lambda m: " " if (0 < m.start() and m.end() < len(text)
                                           and text[m.start() - 1].isascii() and text[m.end()].isascii())
                  else "", text)


def _punctuation_zh(text: str) -> str:
    text = text.translate(_ZH_BRACKETS).replace("——", "，").replace(" - ", "，")
    text = text.replace("²", "平方").replace("³", "立方")
    text = re.sub(r"(?<![A-Za-z0-9])\.|\.(?![A-Za-z0-9])", "。", text)
    text = _drop_cjk_spaces(re.sub(r"\s+", " ", text))
    return re.sub(r"[，,、]+$", "。", text)


def _punctuation_en(text: str) -> str:
    text = re.sub(r"\s*²", " squared", re.sub(r"\s*³", " cubed", text))
    return re.sub(r"\s+", " ", text).strip()


# ------------------------------------------------------------------------------------------ entry point

def normalize(text: str, *, max_chars: int = DEFAULT_MAX_CHARS, lang: str | None = None,
              tn: Callable[[str, bool], str] | None = None) -> str:
    """User text -> spoken-form text for the tokenizer (one string; see ``split_text`` for splitting).

    ``lang`` is ``"zh"`` or ``"en"``; by default Chinese rules apply iff the text contains Chinese.  ``tn``
    (``tn(text, is_chinese) -> text``, e.g. :class:`WetextTN`) verbalises first, with markup tokens hidden from
    it; the built-in number rules then only see what it left.
    Raises ``EmptyTextError`` / ``TextTooLongError`` (``ValueError``s with messages meant for the user).
    """
    text = clean_text(text, max_chars=max_chars)
    protected: list[str] = []

    def protect(m: re.Match) -> str:
        protected.append(m.group(0))
        return chr(_PUA + len(protected) - 1)

    text = _MARKUP.sub(protect, text)
    zh = is_chinese(text) if lang is None else lang == "zh"
    text = _newlines_to_breaks(text, zh)
    if tn is not None:
        text = tn(text, zh)
    text = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), text)
    text = _dates_and_times(text, zh)
    text = _spell_numbers_zh(text) if zh else _spell_numbers_en(text)
    text = _punctuation_zh(text) if zh else _punctuation_en(text)
    text = re.sub("[\uE000-\uF8FF]", lambda m: protected[ord(m.group(0)) - _PUA], text).strip()
    if not has_speech(text):
        raise EmptyTextError(NOTHING_TO_SAY)
    return text


class WetextTN:
    """Text normalisation by ``wetext`` (the FST runtime of WeTextProcessing, the normaliser the reference
    frontend uses) when it is installed: its grammars ship inside the wheel, so it works offline.  Optional:
    :meth:`load` returns None (and the built-in rules do all the work) when the package is missing or fails."""

    def __init__(self, zh: Any, en: Any) -> None:
        self.zh, self.en = zh, en

    @classmethod
    def load(cls) -> "WetextTN | None":
        try:
            from wetext import Normalizer
        except ImportError:
            return None
        try:
            tn = cls(Normalizer(lang="zh", operator="tn", remove_erhua=False), Normalizer(lang="en", operator="tn"))
            tn("1", True), tn("1", False)  # the grammars load lazily: fail here, not on a user's request
        except Exception as e:  # noqa: BLE001 - any failure means: use the built-in rules
            log.warning("wetext is installed but unusable (%s: %s); using the built-in text rules", type(e).__name__, e)
            return None
        return tn

    def __call__(self, text: str, zh: bool) -> str:
        try:
            return (self.zh if zh else self.en).normalize(text)
        except Exception:  # noqa: BLE001 - wetext asserts on inputs it has no token for (e.g. only punctuation)
            return text  # the built-in rules run next either way
