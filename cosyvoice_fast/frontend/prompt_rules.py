"""A model family's text rules: how prompt text is written, which markup tokens the tokenizer knows, what is refused.

CosyVoice2 and CosyVoice3 share the tokenizer (Qwen2's BPE in ``CosyVoice-BlankEN``) and the modes, but CosyVoice3
was trained on prompts that open with a system prompt closed by ``<|endofprompt|>``:

- zero_shot: CosyVoice2 the transcript; CosyVoice3 ``"You are a helpful assistant.<|endofprompt|>"`` + transcript;
- instruct2: CosyVoice2 the instruction + ``"<|endofprompt|>"``; CosyVoice3 ``"You are a helpful assistant. "`` +
  instruction + ``"<|endofprompt|>"`` (no LM prompt speech in either);
- cross_lingual: no LM prompt text; CosyVoice3 opens the tts text itself with
  ``"You are a helpful assistant.<|endofprompt|>"``.

A CosyVoice3 input whose prompt text and text both lack ``<|endofprompt|>`` is refused (:meth:`PromptRules.check`),
and, as upstream's frontend does, text that holds both ``<|`` and ``|>`` is taken as written: not normalised, not
split.  CosyVoice3's tokenizer also knows more markup: CosyVoice2's list, ``<|endofsystem|>``, CMU ARPAbet phones
(``[AA1]``) and pinyin syllable pieces (``[iǎng]``); ids past the base vocabulary go to them in list order
(:func:`derive_special_token_ids`).  The engine never looks at the family: the integration picks the rules once
(:func:`rules_for_family`) and the frontend asks them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cosyvoice_fast.frontend.text_normalize import SPECIAL_TOKENS

END_OF_PROMPT = "<|endofprompt|>"
SYSTEM_PROMPT = "You are a helpful assistant."

# CMU ARPAbet: vowels carry a stress digit (or none), consonants do not
_ARPABET_VOWELS = "AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW".split()
_ARPABET_CONSONANTS = "B CH D DH F G HH JH K L M N NG P R S SH T TH V W Y Z ZH".split()
# pinyin initials and tone-marked finals as CosyVoice3's tokenizer lists them (sorted by code point below)
_PINYIN = """
a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù iú iā
iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà uài uàn uàng
uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á
ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng
ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
""".split()


def _cosyvoice3_special_tokens() -> tuple[str, ...]:
    phones = sorted([*_ARPABET_CONSONANTS, *(v + s for v in _ARPABET_VOWELS for s in ("", "0", "1", "2"))])
    return (*SPECIAL_TOKENS, "<|endofsystem|>", *(f"[{p}]" for p in phones), *(f"[{p}]" for p in sorted(_PINYIN)))


#: CosyVoice3's ``additional_special_tokens``, in upstream's order (the order fixes their ids)
COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = _cosyvoice3_special_tokens()


def derive_special_token_ids(tokens: Iterable[str], known: Mapping[str, int], first_new_id: int) -> dict[str, int]:
    """Token -> id as ``add_special_tokens`` assigns them: a token already in ``known`` keeps its id, every other
    one takes the next free id from ``first_new_id`` on, in list order (a repeat keeps its first id)."""
    out: dict[str, int] = dict(known)
    nxt = first_new_id
    for t in tokens:
        if t not in out:
            out[t] = nxt
            nxt += 1
    return out


class PromptError(ValueError):
    """The prompt does not follow the model family's rules (e.g. a CosyVoice3 prompt without <|endofprompt|>)."""


@dataclass(frozen=True, slots=True)
class PromptRules:
    """One family's frontend rules (see the module table).  ``special_tokens``: the tokenizer's markup list;
    ``speech_tokenizer_file``: the ONNX speech tokenizer in the model directory; ``system_prompt`` None: the
    family has none (CosyVoice2); ``require_end_of_prompt``: inputs must hold ``<|endofprompt|>``;
    ``raw_markup_as_written``: text holding ``<|`` and ``|>`` skips normalisation and splitting."""

    family: str
    special_tokens: tuple[str, ...]
    speech_tokenizer_file: str = "speech_tokenizer_v2.onnx"
    system_prompt: str | None = None
    require_end_of_prompt: bool = False
    raw_markup_as_written: bool = False

    @property
    def cross_lingual_prefix(self) -> str:
        """What the LM must see before the tts text when no prompt text is given ("" for CosyVoice2)."""
        return "" if self.system_prompt is None else self.system_prompt + END_OF_PROMPT

    def zero_shot_prompt_text(self, transcript: str) -> str:
        """The LM prompt text for a zero-shot prompt whose audio says ``transcript``."""
        transcript = transcript.strip()
        if self.system_prompt is None or END_OF_PROMPT in transcript:
            return transcript
        return self.system_prompt + END_OF_PROMPT + transcript

    def instruct_prompt_text(self, instruction: str) -> str:
        """The LM prompt text for an instruct2 request (an instruction that already holds the marker is kept)."""
        instruction = instruction.strip()
        if self.system_prompt is None:
            return instruction if instruction.endswith(END_OF_PROMPT) else instruction + END_OF_PROMPT
        if END_OF_PROMPT in instruction:
            return instruction
        return f"{self.system_prompt} {instruction}{END_OF_PROMPT}"

    def cross_lingual_text(self, text: str) -> str:
        """The tts text of a request without LM prompt text (cross-lingual), prefixed where the family needs it."""
        if not self.cross_lingual_prefix or END_OF_PROMPT in text:
            return text
        return self.cross_lingual_prefix + text

    def as_written(self, text: str) -> bool:
        """Whether ``text`` skips normalisation and splitting (it holds ``<|`` and ``|>``, CosyVoice3)."""
        return self.raw_markup_as_written and "<|" in text and "|>" in text

    def check(self, prompt_text: str, text: str = "") -> None:
        """Refuse an input the family's LM would not accept: CosyVoice3 needs ``<|endofprompt|>`` in the prompt
        text or the text (raises :class:`PromptError`)."""
        if self.require_end_of_prompt and END_OF_PROMPT not in prompt_text and END_OF_PROMPT not in text:
            raise PromptError(f"the prompt text has no {END_OF_PROMPT}: {self.family} needs its prompt to open with a "
                              f"system prompt closed by it, e.g. '{SYSTEM_PROMPT}{END_OF_PROMPT}' followed by the "
                              "transcript (zero-shot) or the text (cross-lingual)")


COSYVOICE2_RULES = PromptRules(family="cosyvoice2", special_tokens=SPECIAL_TOKENS)
COSYVOICE3_RULES = PromptRules(family="cosyvoice3", special_tokens=COSYVOICE3_SPECIAL_TOKENS,
                               speech_tokenizer_file="speech_tokenizer_v3.onnx", system_prompt=SYSTEM_PROMPT,
                               require_end_of_prompt=True, raw_markup_as_written=True)
_RULES = {r.family: r for r in (COSYVOICE2_RULES, COSYVOICE3_RULES)}


def rules_for_family(family: str) -> PromptRules:
    """The rules of ``family`` (``cosyvoice2`` or ``cosyvoice3``)."""
    try:
        return _RULES[family]
    except KeyError:
        raise ValueError(f"no prompt rules for model family {family!r}; "
                         f"expected one of {', '.join(_RULES)}") from None
