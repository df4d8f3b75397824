"""Text half of the frontend: normalise, split into LM-sized pieces, tokenise with the Qwen2 BPE.

``normalize`` (in ``text_normalize``) makes spoken-form text; ``split_text`` cuts it at sentence ends into pieces
of a bounded size, each synthesised by one LM call; ``TextTokenizer`` maps a piece to the ids the speech LM's
text embedding expects.  The tokenizer is rebuilt with the ``tokenizers`` library from the files the official
model directory ships (``CosyVoice-BlankEN/{vocab.json, merges.txt, tokenizer_config.json}``) so that ids equal
those of ``transformers.AutoTokenizer`` + ``add_special_tokens`` with CosyVoice2's markup tokens, without
depending on transformers.  Nothing here imports torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from cosyvoice_fast.frontend.text_normalize import (
    DEFAULT_MAX_CHARS, NOTHING_TO_SAY, SPECIAL_TOKENS, EmptyTextError, TextTooLongError, clean_text, has_speech,
    is_chinese, normalize,
)

__all__ = ["DEFAULT_MAX_CHARS", "SPECIAL_TOKENS", "EOS_TOKEN", "EmptyTextError", "TextTooLongError", "TextTokenizer",
           "clean_text", "is_chinese", "normalize", "normalize_and_split", "split_text"]

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_SUBDIR = "CosyVoice-BlankEN"

# ------------------------------------------------------------------------------------------------ splitting

_SENTENCE_END = {"zh": frozenset("。？！；：、.?!;"), "en": frozenset(".?!;:")}
_FINAL_MARK = {"zh": "。", "en": "."}
_CLOSERS = frozenset("\"'”’」』）)】》")
_SOFT_BREAKS = frozenset("，,、；;：:…—")


def _is_break(text: str, i: int, marks: frozenset[str]) -> bool:
    c = text[i]
    if c not in marks:
        return False
    # "example.com", "e.g" and leftover decimals: a dot between ASCII letters/digits does not end a sentence.
    return not (c == "." and 0 < i < len(text) - 1 and text[i - 1].isascii() and text[i - 1].isalnum()
                and text[i + 1].isascii() and text[i + 1].isalnum())


def _cut_after_runs(text: str, marks: frozenset[str]) -> list[str]:
    """Cut after every run of ``marks`` and the closing quotes that follow: "a。。”b" -> ["a。。”", "b"]."""
    parts, start, i = [], 0, 0
    while i < len(text):
        if _is_break(text, i, marks):
            j = i + 1
            while j < len(text) and (text[j] in marks or text[j] in _CLOSERS):
                j += 1
            parts.append(text[start:j])
            start = i = j
        else:
            i += 1
    if start < len(text):
        parts.append(text[start:])
    return parts


def _pack(parts: Iterable[str], length: Callable[[str], int], limit: int) -> list[str]:
    """Greedy concatenation of consecutive parts while the measured length stays <= limit."""
    out: list[str] = []
    for p in parts:
        if out and length(out[-1] + p) <= limit:
            out[-1] += p
        else:
            out.append(p)
    return out


def _fit(text: str, length: Callable[[str], int], limit: int) -> list[str]:
    """Cut an over-long sentence into units <= limit: at soft breaks (commas...), then before whitespace,
    then between characters, always measuring the real concatenation."""
    if length(text) <= limit:
        return [text]
    for cutter in (lambda s: _cut_after_runs(s, _SOFT_BREAKS), lambda s: re.findall(r"\s*\S+\s*$|\s*\S+", s),
                   list):
        parts = cutter(text)
        if len(parts) > 1:
            return [u for part in _pack(parts, length, limit) for u in _fit(part, length, limit)]
    return [text]  # a single character over the limit: nothing smaller exists


def split_text(text: str, tokenize_fn: Callable[[str], Sequence[int]] | None, max_tokens: int = 80,
               min_tokens: int = 60, merge_len: int = 20, *, lang: str | None = None) -> list[str]:
    """Split normalised text into pieces for separate LM calls, losing no character.

    Sizes are characters for Chinese (as the reference frontend counts) and ``len(tokenize_fn(piece))`` for
    other text.  Sentences (cut after runs of sentence-final marks and any closing quotes) are packed greedily
    up to ``max_tokens``; a piece still holding at most ``min_tokens`` may grow to ``max_tokens + merge_len``
    rather than be closed short, and a final remainder under ``merge_len`` joins the previous piece within the
    same bound.  A single sentence over ``max_tokens`` is cut at commas, then spaces, then characters.  So every
    piece is at most ``max_tokens + merge_len`` long, and ``"".join(pieces) == text`` except that a sentence-final
    mark ("。" or ".") is appended when the text does not end with one (the LM expects a closed sentence).
    Pieces of bare punctuation are folded into a neighbour; raises ``EmptyTextError`` if nothing is speakable.
    """
    if max_tokens < 1 or min_tokens < 0 or merge_len < 0:
        raise ValueError("max_tokens must be >= 1, min_tokens and merge_len >= 0")
    if not has_speech(text):
        raise EmptyTextError(NOTHING_TO_SAY)
    lang = lang or ("zh" if is_chinese(text) else "en")
    if lang == "zh" or tokenize_fn is None:
        length: Callable[[str], int] = len
    else:
        def length(s: str) -> int:
            return len(tokenize_fn(s))
    marks = _SENTENCE_END.get(lang, _SENTENCE_END["en"])
    tail = text.rstrip()
    while tail and tail[-1] in _CLOSERS:
        tail = tail[:-1]
    if not tail or tail[-1] not in marks:
        text += _FINAL_MARK.get(lang, ".")

    sentences: list[str] = []
    for s in _cut_after_runs(text, marks):
        if sentences and not (has_speech(s) and has_speech(sentences[-1])):
            sentences[-1] += s  # bare punctuation joins its neighbour
        else:
            sentences.append(s)

    bound = max_tokens + merge_len
    pieces: list[str] = []
    for unit in (u for s in sentences for u in _fit(s, length, max_tokens)):
        if pieces:
            size = length(pieces[-1] + unit)
            if size <= max_tokens or (length(pieces[-1]) <= min_tokens and size <= bound):
                pieces[-1] += unit
                continue
        pieces.append(unit)
    if len(pieces) > 1 and (length(pieces[-1]) < merge_len or not has_speech(pieces[-1])) \
            and length(pieces[-2] + pieces[-1]) <= bound:
        last = pieces.pop()
        pieces[-1] += last
    return pieces


def normalize_and_split(text: str, tokenize_fn: Callable[[str], Sequence[int]] | None, *,
                        text_frontend: bool = True, max_chars: int = DEFAULT_MAX_CHARS,
                        tn: Callable[[str, bool], str] | None = None, **split_kw) -> list[str]:
    """The whole text path for a synthesis request: ``normalize`` then ``split_text``.

    With ``text_frontend=False`` the text is only cleaned and limit-checked and comes back as one piece (the
    reference frontend's escape hatch for pre-normalised or phoneme-annotated input).
    """
    if not text_frontend:
        return [clean_text(text, max_chars=max_chars)]
    return split_text(normalize(text, max_chars=max_chars, tn=tn), tokenize_fn, **split_kw)


# ------------------------------------------------------------------------------------------------ tokenizer

# Qwen2's pre-tokenisation pattern (contractions, letter runs, single digits, punctuation runs, whitespace).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _require(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(
            f"Tokenizer file missing: {path}. The model directory must contain {TOKENIZER_SUBDIR}/ with vocab.json, "
            f"merges.txt and tokenizer_config.json (as shipped with CosyVoice2-0.5B); re-download the model.")
    return path


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        line = line.strip()
        if not line or (n == 0 and line.startswith("#version")):
            continue
        pair = line.split()
        if len(pair) != 2:
            raise ValueError(f"{path}: line {n + 1} is not a merge pair: {line!r}")
        merges.append((pair[0], pair[1]))
    return merges


def _build_byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], add_prefix_space: bool) -> Tokenizer:
    """The fast tokenizer transformers derives from Qwen2's slow vocab/merges files, assembled by hand."""
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _token_content(value: object) -> str | None:
    return value.get("content") if isinstance(value, dict) else value  # type: ignore[return-value]


def _clean_up_spaces(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class TextTokenizer:
    """Qwen2 byte-level BPE plus CosyVoice2's markup tokens; ``encode`` never splits a special token."""

    special_tokens: tuple[str, ...] = SPECIAL_TOKENS

    def __init__(self, backend: Tokenizer, *, skip_special_tokens: bool = True, clean_up_spaces: bool = False,
                 special_tokens: Sequence[str] = SPECIAL_TOKENS) -> None:
        self._tok = backend
        self.skip_special_tokens = skip_special_tokens
        self._clean_up = clean_up_spaces
        self.special_tokens = tuple(special_tokens)  # the family's markup list (CosyVoice3's is longer)
        for t in (EOS_TOKEN, *self.special_tokens):
            if backend.token_to_id(t) is None:
                raise ValueError(f"tokenizer lacks the special token {t!r}; build it with TextTokenizer.from_dir")
        self.special_token_ids: dict[str, int] = {t: backend.token_to_id(t) for t in (EOS_TOKEN, *self.special_tokens)}

    @classmethod
    def from_dir(cls, path: str | Path, *, skip_special_tokens: bool = True,
                 special_tokens: Sequence[str] = SPECIAL_TOKENS) -> TextTokenizer:
        """Load from a model directory (or its ``CosyVoice-BlankEN`` folder itself); ``special_tokens``: the
        family's markup list (``PromptRules.special_tokens``; CosyVoice2's by default).

        Uses ``tokenizer.json`` when present, else ``vocab.json`` + ``merges.txt``.  The tokens declared in
        ``tokenizer_config.json`` are registered first (in id order), then CosyVoice2's, in upstream's order, so
        new ids follow the base vocabulary exactly as transformers assigns them.
        """
        root = Path(path)
        d = root / TOKENIZER_SUBDIR if (root / TOKENIZER_SUBDIR).is_dir() else root
        if not d.is_dir():
            raise FileNotFoundError(f"Tokenizer directory not found: {d}")
        cfg_path = d / "tokenizer_config.json"
        if (d / "tokenizer.json").is_file():
            tok = Tokenizer.from_file(str(d / "tokenizer.json"))
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        else:
            vocab = json.loads(_require(d / "vocab.json").read_text(encoding="utf-8"))
            merges = _read_merges(_require(d / "merges.txt"))
            cfg = json.loads(_require(cfg_path).read_text(encoding="utf-8"))
            tok = _build_byte_level_bpe(vocab, merges, bool(cfg.get("add_prefix_space") or False))

        named = [t for t in dict.fromkeys([_token_content(cfg.get(k)) for k in _NAMED_SPECIAL]
                                          + [_token_content(v) for v in cfg.get("additional_special_tokens") or []])
                 if t]
        declared = sorted(((int(i), v) for i, v in (cfg.get("added_tokens_decoder") or {}).items()),
                          key=lambda kv: kv[0])
        for _, v in declared:
            content = v["content"]
            special = bool(v.get("special", False)) or content in named
            token = AddedToken(content, single_word=bool(v.get("single_word", False)),
                               lstrip=bool(v.get("lstrip", False)), rstrip=bool(v.get("rstrip", False)),
                               normalized=bool(v.get("normalized", not special)), special=special)
            (tok.add_special_tokens if special else tok.add_tokens)([token])
        for content in [t for t in named if tok.token_to_id(t) is None]:  # named in the config, declared nowhere
            tok.add_special_tokens([AddedToken(content, normalized=False, special=True)])
        # What CosyVoice2's tokenizer passes to add_special_tokens: eos, pad, then the markup tokens.
        for content in (EOS_TOKEN, EOS_TOKEN, *special_tokens):
            tok.add_special_tokens([AddedToken(content, normalized=False, special=True)])
        return cls(tok, skip_special_tokens=skip_special_tokens,
                   clean_up_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)), special_tokens=special_tokens)

    def __len__(self) -> int:
        """Vocabulary size including added tokens (ids are 0 .. len-1)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self.special_token_ids[EOS_TOKEN]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text map to their single ids."""
        return self._tok.encode(text).ids

    @property
    def added_tokens(self) -> tuple[str, ...]:
        """Every token matched whole before pre-tokenisation (eos, CosyVoice2's markup, the config's tokens)."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values())

    def pretokenize(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character spans of Qwen2's pre-tokens of ``text`` (no added tokens inside): the units
        BPE never merges across, so ids of text cut at a span boundary concatenate to the ids of the whole."""
        return [span for _, span in self._tok.pre_tokenizer.pre_tokenize_str(text)]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool | None = None) -> str:
        skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip)
        return _clean_up_spaces(text) if self._clean_up else text
