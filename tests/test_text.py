"""Text frontend: normalisation rules, sentence splitting, the Qwen2-format BPE tokenizer and input limits."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="tokenizers is not installed here (pip install -r requirements.txt)")

from cosyvoice_fast.frontend.text import (
    DEFAULT_MAX_CHARS, SPECIAL_TOKENS, EmptyTextError, TextTokenizer, TextTooLongError, is_chinese, normalize,
    normalize_and_split, split_text,
)  # noqa: E402
from cosyvoice_fast.frontend.number_words import number_to_chinese, number_to_english  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ a tiny Qwen2-format BPE

def _byte_alphabet() -> list[str]:
    """GPT-2/Qwen2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest move to 256+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("Ġwor", "l"),
          ("Ġworl", "d"), ("ä", "½"), ("ä½", "ł")]  # the last two build "你" (e4 bd a0) from its bytes


def _write_blank_en(d: Path, *, tokenizer_json: bool = False) -> int:
    """Write vocab.json / merges.txt / tokenizer_config.json the way Qwen2 ships them; return the base size."""
    d.mkdir(parents=True, exist_ok=True)
    tokens = _byte_alphabet() + [a + b for a, b in MERGES]
    vocab = {t: i for i, t in enumerate(tokens)}
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES), encoding="utf-8")
    n = len(vocab)

    def added(content: str) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                "special": True}

    cfg = {"add_prefix_space": False, "bos_token": None, "clean_up_tokenization_spaces": False,
           "added_tokens_decoder": {str(n): added("<|endoftext|>"), str(n + 1): added("<|im_start|>"),
                                    str(n + 2): added("<|im_end|>")},
           "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|endoftext|>",
           "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>",
           "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return n


@pytest.fixture(scope="module")
def blank_en(tmp_path_factory) -> tuple[Path, int]:
    model_dir = tmp_path_factory.mktemp("model")
    n = _write_blank_en(model_dir / "CosyVoice-BlankEN")
    return model_dir, n


@pytest.fixture(scope="module")
def tok(blank_en) -> TextTokenizer:
    return TextTokenizer.from_dir(blank_en[0])


# ------------------------------------------------------------------------------------------ tokenizer

def test_special_token_ids_follow_upstream_order(tok, blank_en):
    n = blank_en[1]
    assert n == 256 + len(MERGES)
    assert tok.eos_id == n and tok.token_to_id("<|im_start|>") == n + 1 and tok.token_to_id("<|im_end|>") == n + 2
    # CosyVoice2 appends its markup after the config's three tokens: <|endofprompt|> is 151646 on the real vocab.
    for i, t in enumerate(SPECIAL_TOKENS[2:]):
        assert tok.special_token_ids[t] == n + 3 + i, t
    assert tok.special_token_ids["<|endofprompt|>"] == n + 3 and tok.special_token_ids["[mn]"] == n + 19
    assert len(tok) == n + 3 + len(SPECIAL_TOKENS) - 2 == n + 20


def test_bpe_merges_and_byte_fallback_ids(tok):
    base = {t: i for i, t in enumerate(_byte_alphabet() + [a + b for a, b in MERGES])}
    assert tok.encode(" the world") == [base["Ġthe"], base["Ġworld"]]
    assert tok.encode("hello") == [base["he"], base["ll"], base["o"]]
    assert tok.encode("你") == [base["ä½ł"]]
    assert tok.encode("好") == [base[c] for c in "å¥½"]  # no merge: three byte tokens
    assert tok.encode("I'm") == [base["I"], base["'"], base["m"]]


def test_special_tokens_are_never_split(tok):
    ids = tok.special_token_ids
    a, b = tok.encode("a"), tok.encode("b")
    assert tok.encode("a[breath]b") == a + [ids["[breath]"]] + b
    assert tok.encode("<strong>a</strong>") == [ids["<strong>"]] + a + [ids["</strong>"]]
    assert tok.encode("用<|endofprompt|>") == tok.encode("用") + [ids["<|endofprompt|>"]]
    assert tok.encode("[laughter][laughter]") == [ids["[laughter]"]] * 2
    assert tok.encode("[vocalized-noise]") == [ids["[vocalized-noise]"]]
    assert tok.encode("[breath") == tok.encode("[") + tok.encode("breath")  # unclosed: ordinary text


def test_decode_round_trip_and_skip_special(tok, blank_en):
    for s in ["Hello, world!", "今天天气很好，我们去公园散步吧。", "  two  spaces\nnew line\ttab", "café ñ 😀 ½",
              "I'm sure they'll say it's fine"]:
        assert tok.decode(tok.encode(s)) == unicodedata.normalize("NFC", s)
    ids = tok.encode("<|endofprompt|>a[breath]b<|endoftext|>")
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "<|endofprompt|>a[breath]b<|endoftext|>"
    keep = TextTokenizer.from_dir(blank_en[0] / "CosyVoice-BlankEN", skip_special_tokens=False)
    assert keep.decode(ids) == "<|endofprompt|>a[breath]b<|endoftext|>"


def test_tokenizer_json_gives_the_same_ids(tmp_path, tok, blank_en):
    from tokenizers import AddedToken

    from cosyvoice_fast.frontend.text import _build_byte_level_bpe, _read_merges

    d = tmp_path / "CosyVoice-BlankEN"
    n = _write_blank_en(d)
    base = _build_byte_level_bpe(json.loads((d / "vocab.json").read_text(encoding="utf-8")),
                                 _read_merges(d / "merges.txt"), False)
    base.add_special_tokens([AddedToken(t, normalized=False, special=True)
                             for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    base.save(str(d / "tokenizer.json"))
    for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (d / f).unlink()
    other = TextTokenizer.from_dir(tmp_path)
    assert other.special_token_ids == tok.special_token_ids and len(other) == n + 20
    assert other.encode("the world [sigh]你") == tok.encode("the world [sigh]你")


@pytest.mark.parametrize("missing", ["vocab.json", "merges.txt", "tokenizer_config.json"])
def test_missing_tokenizer_file_is_named(tmp_path, missing):
    _write_blank_en(tmp_path / "CosyVoice-BlankEN")
    (tmp_path / "CosyVoice-BlankEN" / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
        TextTokenizer.from_dir(tmp_path)


# ------------------------------------------------------------------------------------------ number readings

@pytest.mark.parametrize("n, words", [(0, "零"), (7, "七"), (10, "十"), (12, "十二"), (20, "二十"), (105, "一百零五"),
                                      (110, "一百一十"), (1001, "一千零一"), (1010, "一千零一十"), (10000, "一万"),
                                      (100000, "十万"), (110000, "十一万"), (100010, "十万零一十"),
                                      (1234567, "一百二十三万四千五百六十七"), (100000001, "一亿零一"),
                                      (1000000000000, "一万亿")])
def test_number_to_chinese(n, words):
    assert number_to_chinese(n) == words


@pytest.mark.parametrize("n, words", [  # inflect's readings, without its commas
    (0, "zero"), (13, "thirteen"), (21, "twenty-one"), (105, "one hundred and five"), (1005, "one thousand and five"),
    (1010, "one thousand and ten"), (1999, "one thousand nine hundred and ninety-nine"), (20000, "twenty thousand"),
    (110000, "one hundred and ten thousand"), (100000001, "one hundred million and one"),
    (123456, "one hundred and twenty-three thousand four hundred and fifty-six"), (1000000, "one million")])
def test_number_to_english(n, words):
    assert number_to_english(n) == words


# ------------------------------------------------------------------------------------------ normalisation

@pytest.mark.parametrize("text, expected", [
    ("今天是2024年3月5日，气温-5度，增长了50%。", "今天是二零二四年三月五日，气温负五度，增长了百分之五十。"),
    ("价格是3.5元，共1,234,567人", "价格是三点五元，共一百二十三万四千五百六十七人"),
    ("1.5%的增长", "百分之一点五的增长"),
    ("会议在10:30开始，10:05结束", "会议在十点三十分开始，十点零五分结束"),
    ("2024-01-15 发布", "二零二四年一月十五日发布"),
    ("会议于2024/3/8召开", "会议于二零二四年三月八日召开"),
    ("电话13800138000，编号007", "电话一三八零零一三八零零零，编号零零七"),
    ("温度从-3到-10度，范围3-5天", "温度从负三到负十度，范围三到五天"),
    ("第1名和第21名", "第一名和第二十一名"),
    ("你好 世界 hello world 好", "你好世界hello world好"),
    ("（注意）【重要】这是——测试 - 结束,", "注意重要这是，测试，结束。"),
    ("面积100m²，体积3m³", "面积一百m平方，体积三m立方"),
    ("  多个   空格\t和\r\n换行  ", "多个空格和。换行"),
    ("第一行\n第二行。\n第三行", "第一行。第二行。第三行"),
    ("访问example.com了解更多.", "访问example.com了解更多。"),
    ("你好 😀 世界", "你好世界"),
    ("[breath]你好<|endofprompt|>100", "[breath]你好<|endofprompt|>一百"),
])
def test_normalize_chinese(text, expected):
    assert is_chinese(text)
    assert normalize(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("I have 3 apples and 2.5 pears.", "I have three apples and two point five pears."),
    ("It grew 50% in 1999, then -3% in 2005.",
     "It grew fifty percent in nineteen ninety-nine, then minus three percent in two thousand and five."),
    ("The 21st of May, 1990s music, $5.50 and $1.",
     "The twenty-first of May, nineteen nineties music, five dollars and fifty cents and one dollar."),
    ("Meet at 10:30 or 10:00.", "Meet at ten thirty or ten o'clock."),
    ("Call me at 8:05 am, the 3rd time.", "Call me at eight oh five am, the third time."),
    ("2024-01-15 release", "January fifteenth twenty twenty-four release"),
    ("The year 1905 and 1900 and 2100", "The year nineteen oh five and nineteen hundred and two thousand one hundred"),
    ("0.5 and -0.25 and 1,000,000", "zero point five and minus zero point two five and one million"),
    ("Windows10 is   5x\n\nfaster", "Windows ten is five x. faster"),
    ("100m² and 2m³", "one hundred m squared and two m cubed"),
    ("Hello 😀 world 👍🏽!", "Hello world!"),
    ("a\u200bb\x07c\ufeff d", "abc d"),
    ("１２３ ｆｕｌｌ", "one hundred and twenty-three full"),
    ("<strong>2</strong> cats [laughter]", "<strong>two</strong> cats [laughter]"),
])
def test_normalize_english(text, expected):
    assert not is_chinese(text)
    assert normalize(text) == expected


def test_normalize_forced_language():
    assert normalize("I have 3", lang="zh") == "I have三"
    assert normalize("有3个", lang="en") == "有 three 个"


# ------------------------------------------------------------------------------------------ limits and errors

@pytest.mark.parametrize("text", ["", "   ", "\n\t \r\n", "\x00\x07", "\u200b"])
def test_empty_text(text):
    with pytest.raises(EmptyTextError, match=r"^Text is empty: type something to synthesise\.$"):
        normalize(text)


@pytest.mark.parametrize("text", ["😀😀", "。。！", "... !!", "🎉 ?"])
def test_nothing_to_speak(text):
    with pytest.raises(EmptyTextError, match="nothing to speak"):
        normalize(text)


def test_too_long():
    assert DEFAULT_MAX_CHARS == 5000
    normalize("a" * 5000)
    with pytest.raises(TextTooLongError, match="5001 characters, the limit is 5000") as e:
        normalize("a" * 5001)
    assert isinstance(e.value, ValueError) and (e.value.length, e.value.limit) == (5001, 5000)
    with pytest.raises(TextTooLongError, match="limit is 10"):
        normalize("eleven chars", max_chars=10)
    assert normalize("  padded  " + "\x00" * 50, max_chars=6) == "padded"  # measured after cleaning


def test_not_a_string():
    with pytest.raises(TypeError):
        normalize(b"bytes")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ splitting

def _check_split(text: str, pieces: list[str], mark: str, size, max_tokens=80, merge_len=20) -> None:
    joined = "".join(pieces)
    assert joined in (text, text + mark)
    assert all(size(p) <= max_tokens + merge_len for p in pieces), [size(p) for p in pieces]


def test_split_chinese_counts_characters():
    sentence = "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐，笑容如花儿般绽放。"
    assert len(sentence) == 50
    text = normalize(sentence * 4 + "他说：“你好！！”然后走了")
    pieces = split_text(text, None)
    assert pieces == [sentence * 2, sentence * 2, "他说：“你好！！”然后走了。"]
    _check_split(text, pieces, "。", len)


def test_split_english_respects_token_budget(tok):
    sentence = "The quick brown fox jumps over the lazy dog."
    text = normalize(" ".join([sentence] * 12) + " And then, well, nothing happened")
    pieces = split_text(text, tok.encode)
    _check_split(text, pieces, ".", lambda p: len(tok.encode(p)))
    assert len(pieces) >= 3 and all(p.rstrip().endswith(".") for p in pieces)
    assert pieces[1].startswith(" The quick")  # whitespace travels with the next sentence
    small = split_text(text, tok.encode, max_tokens=30, min_tokens=20, merge_len=5)
    assert "".join(small) == "".join(pieces) and all(len(tok.encode(p)) <= 35 for p in small)


def test_split_long_sentences_without_punctuation(tok):
    words = " ".join(["word"] * 200)
    pieces = split_text(words, tok.encode)
    _check_split(words, pieces, ".", lambda p: len(tok.encode(p)))
    # cut between words at 80 tokens; the 3-token remainder " word." (< merge_len) joins the last piece
    assert [len(tok.encode(p)) for p in pieces] == [79, 80, 80, 80, 83]  # " word" is 2 tokens here
    run = "a" * 300
    pieces = split_text(run, tok.encode)
    assert "".join(pieces) == run + "." and [len(tok.encode(p)) for p in pieces] == [80, 80, 80, 61]
    zh = "好" * 250
    assert [len(p) for p in split_text(zh, None)] == [80, 80, 91]  # the 11-char tail merges (bound 100)
    clauses = "，".join(["一二三四五六七八九"] * 20) + "。"
    pieces = split_text(clauses, None)
    assert "".join(pieces) == clauses and all(p.endswith(("，", "。")) for p in pieces)


@pytest.mark.parametrize("text, expected", [
    ("Hi.", ["Hi."]), ("Hi", ["Hi."]), ("“你好”", ["“你好”。"]), ("你好！！", ["你好！！"]),
    ("!Hello!! ...", ["!Hello!! ..."]), ("Wait... what?", ["Wait... what?"]),
    ("他说：“你好。”", ["他说：“你好。”"]),
])
def test_split_small_cases(tok, text, expected):
    assert split_text(text, tok.encode) == expected


def test_split_keeps_every_character_fuzz(tok):
    import random

    rng = random.Random(0)
    alphabet = list("abc de，。！？.!?;:、“”\"' 你好世界[]") + ["[breath]", " the", "Hello"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        text = "x" + text.strip()
        lang = "zh" if is_chinese(text) else "en"
        pieces = split_text(text, tok.encode, max_tokens=20, min_tokens=12, merge_len=6)
        size = len if lang == "zh" else (lambda p: len(tok.encode(p)))
        _check_split(text, pieces, "。" if lang == "zh" else ".", size, max_tokens=20, merge_len=6)


def test_split_rejects_nothing_to_speak(tok):
    with pytest.raises(EmptyTextError):
        split_text("。。", tok.encode)


def test_normalize_and_split(tok):
    assert normalize_and_split("我有3个苹果", tok.encode) == ["我有三个苹果。"]
    assert normalize_and_split(" raw 3 <|x|> ", tok.encode, text_frontend=False) == ["raw 3 <|x|>"]
    with pytest.raises(EmptyTextError):
        normalize_and_split("  ", tok.encode)


def test_text_path_does_not_import_torch():
    code = ("import sys; import cosyvoice_fast.frontend.text, cosyvoice_fast.frontend.text_normalize; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


# ------------------------------------------------------------------------------------- optional external TN


def test_external_tn_runs_first_and_never_sees_markup():
    from cosyvoice_fast.frontend.text_normalize import normalize

    seen = []

    def tn(text: str, zh: bool) -> str:
        seen.append((text, zh))
        return text.replace("42", "forty-two")

    out = normalize("I said 42 [laughter] times", tn=tn)
    assert out == "I said forty-two [laughter] times"
    assert len(seen) == 1 and "[laughter]" not in seen[0][0] and seen[0][1] is False
    assert normalize("我有3个苹果", tn=lambda t, zh: t.replace("3", "三") if zh else t) == "我有三个苹果"


class _FakeNormalizer:
    """Stands in for ``wetext.Normalizer`` (an optional package): records its calls, verbalises one number."""

    made: list[tuple[str, str]] = []

    def __init__(self, lang: str, operator: str, **kw: object) -> None:
        self.lang = lang
        _FakeNormalizer.made.append((lang, operator))

    def normalize(self, text: str) -> str:
        if not text.strip(" .,!?"):
            raise AssertionError  # what wetext does on punctuation-only input
        return text.replace("30", "thirty" if self.lang == "en" else "三十")


def test_wetext_is_used_when_installed_and_its_failures_fall_back(monkeypatch):
    import sys
    import types

    from cosyvoice_fast.frontend.text_normalize import WetextTN, normalize

    monkeypatch.setitem(sys.modules, "wetext", types.SimpleNamespace(Normalizer=_FakeNormalizer))
    _FakeNormalizer.made.clear()
    tn = WetextTN.load()
    assert tn is not None and sorted(_FakeNormalizer.made) == [("en", "tn"), ("zh", "tn")]
    assert normalize("It costs 30 dollars.", tn=tn) == "It costs thirty dollars."
    assert normalize("我有30个", tn=tn) == "我有三十个"
    assert tn("?!", False) == "?!"  # a wetext assertion is not the user's error: the built-in rules go on


def test_without_wetext_the_built_in_rules_do_the_work(monkeypatch):
    import sys

    from cosyvoice_fast.frontend.text_normalize import WetextTN

    monkeypatch.setitem(sys.modules, "wetext", None)  # import wetext -> ImportError
    assert WetextTN.load() is None
