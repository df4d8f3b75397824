"""Numbers as words, the small built-in rule sets of the text normaliser: Chinese readings (一百零五, 三点一四)
and English words in the style of ``inflect`` (one thousand and five, twenty-first, nineteen oh five).

Pure functions of their input; :mod:`cosyvoice_fast.frontend.text_normalize` decides where in a text they apply.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------------ Chinese numbers

ZH_DIGIT = "零一二三四五六七八九"


def _zh_below_10000(n: int) -> str:
    out, zero_pending = [], False
    for power, unit in ((1000, "千"), (100, "百"), (10, "十"), (1, "")):
        d = n // power % 10
        if d == 0:
            zero_pending = bool(out)
            continue
        if zero_pending:
            out.append("零")
        out.append(ZH_DIGIT[d] + unit)
        zero_pending = False
    return "".join(out)


def number_to_chinese(n: int) -> str:
    """Cardinal reading of 0 <= n < 10^16: 105 -> 一百零五, 100000001 -> 一亿零一, 12 -> 十二."""
    if not 0 <= n < 10 ** 16:
        raise ValueError(f"number out of range for a Chinese cardinal reading: {n}")
    if n == 0:
        return "零"
    groups = []
    while n:
        n, g = divmod(n, 10000)
        groups.append(g)
    out, gap = "", False
    for idx in range(len(groups) - 1, -1, -1):
        g = groups[idx]
        if g == 0:
            gap = True
            continue
        if out and (gap or g < 1000):
            out += "零"
        out += _zh_below_10000(g) + ("", "万", "亿", "万亿")[idx]
        gap = False
    return out[1:] if out.startswith("一十") else out


def zh_digits(s: str) -> str:
    """Digit by digit: 2024 -> 二零二四."""
    return "".join(ZH_DIGIT[int(c)] for c in s)


def zh_int(s: str) -> str:
    """Digits as a cardinal; leading zeros (codes) and runs of 11+ digits (phone numbers, ids) are read digit
    by digit."""
    return zh_digits(s) if (len(s) > 1 and s[0] == "0") or len(s) > 10 else number_to_chinese(int(s))


def zh_num(s: str) -> str:
    """A decimal in Chinese: 3.14 -> 三点一四."""
    whole, _, frac = s.partition(".")
    return zh_int(whole) + ("点" + zh_digits(frac) if frac else "")


# ------------------------------------------------------------------------------------------ English numbers

EN_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
            "sixteen seventeen eighteen nineteen").split()
_EN_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_EN_SCALES = ("", " thousand", " million", " billion", " trillion", " quadrillion")
_EN_ORDINAL = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
               "nine": "ninth", "twelve": "twelfth"}


def en_below_100(n: int) -> str:
    """0 to 99 in words, hyphenated: 42 -> forty-two."""
    if n < 20:
        return EN_ONES[n]
    return _EN_TENS[n // 10] + ("-" + EN_ONES[n % 10] if n % 10 else "")


def number_to_english(n: int) -> str:
    """Cardinal words for 0 <= n < 10^18 in the style of ``inflect`` (British "and", but no commas, which
    would make the model pause): 1005 -> "one thousand and five", 342 -> "three hundred and forty-two"."""
    if not 0 <= n < 10 ** 18:
        raise ValueError(f"number out of range for an English cardinal reading: {n}")
    if n == 0:
        return "zero"
    groups = []
    while n:
        n, g = divmod(n, 1000)
        groups.append(g)
    words = []
    for idx in range(len(groups) - 1, -1, -1):
        g = groups[idx]
        if g == 0:
            continue
        hundreds, rest = divmod(g, 100)
        part = [EN_ONES[hundreds] + " hundred"] if hundreds else []
        if rest:
            part.append(("and " if hundreds or (idx == 0 and words) else "") + en_below_100(rest))
        words.append(" ".join(part) + _EN_SCALES[idx])
    return " ".join(words)


def en_ordinal(words: str) -> str:
    """The ordinal of cardinal words: twenty-one -> twenty-first."""
    head, sep, last = words.rpartition("-") if "-" in words.rsplit(" ", 1)[-1] else words.rpartition(" ")
    if last in _EN_ORDINAL:
        last = _EN_ORDINAL[last]
    else:
        last = last[:-1] + "ieth" if last.endswith("y") else last + "th"
    return head + sep + last


def en_year(n: int) -> str:
    """A year as read aloud: 1905 -> nineteen oh five, 1900 -> nineteen hundred."""
    hi, lo = divmod(n, 100)
    if lo == 0:
        return number_to_english(hi) + " hundred"
    return number_to_english(hi) + (" oh " + EN_ONES[lo] if lo < 10 else " " + en_below_100(lo))


def en_int(s: str) -> str:
    """Digits as a cardinal, or digit by digit for codes (leading zero) and ids (over 15 digits)."""
    if (len(s) > 1 and s[0] == "0") or len(s) > 15:
        return " ".join(EN_ONES[int(c)] for c in s)
    return number_to_english(int(s))


def en_num(s: str) -> str:
    """A decimal in English: 3.14 -> three point one four."""
    whole, _, frac = s.partition(".")
    return en_int(whole) + (" point " + " ".join(EN_ONES[int(c)] for c in frac) if frac else "")


def plural_words(words: str) -> str:
    """The plural of number words: twenty -> twenties."""
    return words[:-1] + "ies" if words.endswith("y") else words + "s"
