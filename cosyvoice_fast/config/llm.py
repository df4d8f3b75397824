"""The speech LM's hyperparameters: the Qwen2 backbone (``CosyVoice-BlankEN/config.json``) and the family data of
CosyVoice2's ``Qwen2LM`` / CosyVoice3's ``CosyVoice3LM`` (the yaml's ``llm`` section).

:mod:`cosyvoice_fast.config.model` re-exports everything here under its old home.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cosyvoice_fast.config.yamlfile import ConfigError, require


@dataclass(frozen=True, slots=True)
class QwenConfig:
    """The Qwen2 decoder inside the speech LM (from ``CosyVoice-BlankEN/config.json``)."""

    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    intermediate_size: int = 4864
    vocab_size: int = 151936
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("config.json: hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("config.json: num_attention_heads must be divisible by num_key_value_heads")


#: speech-LM families: where the sos/task rows live, the head's size and bias, the stop ids and the silent filter
LLM_FAMILIES = ("cosyvoice2", "cosyvoice3")
#: ``CosyVoice3LM`` keeps its own ids in 200 rows past the speech tokens (sos, eos, task, fill, then unused)
CV3_EXTRA_ROWS = 200
#: CosyVoice3's "FSQ silent and breath" speech tokens and how many of them in a row reach the flow
CV3_SILENT_TOKENS = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)
CV3_MAX_SILENT_RUN = 5


@dataclass(frozen=True, slots=True)
class LLMConfig:
    """The speech LM: text+speech Qwen2 predicting 25 Hz speech tokens (CosyVoice2 ``Qwen2LM`` or CosyVoice3
    ``CosyVoice3LM``).

    The families differ only in data, all derived from ``speech_token_size`` (S) here so that no runner branches
    on the family: CosyVoice2 frames the text with a separate 2-row ``llm_embedding`` (sos = row 0, task = row 1),
    scores S + 3 classes with a biased head, eos = S, fill = S + 2.  CosyVoice3 takes sos / task from rows S and
    S + 2 of ``speech_embedding``, scores S + 200 classes without a bias, eos = S + 1, fill = S + 3, and filters
    runs of silent tokens before the flow.  In both, every id >= S ends generation (:attr:`first_stop_id`) and
    index S is the one masked while fewer than min_len tokens exist (:attr:`min_len_masked_id`: upstream masks
    S, which is eos in CosyVoice2 but sos in CosyVoice3, so CosyVoice3 may stop before min_len).
    ``endofprompt_id``: the text id every CosyVoice3 prompt must hold (``<|endofprompt|>``, 151646 in the real
    tokenizer); None: not checked."""

    llm_input_size: int = 896
    llm_output_size: int = 896
    speech_token_size: int = 6561
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    qwen: QwenConfig = field(default_factory=QwenConfig)
    family: str = "cosyvoice2"
    endofprompt_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in LLM_FAMILIES:
            raise ConfigError(f"llm family {self.family!r} is unknown; expected one of {', '.join(LLM_FAMILIES)}")
        if self.endofprompt_id is not None and not 0 <= self.endofprompt_id < self.qwen.vocab_size:
            raise ConfigError(f"llm endofprompt_id {self.endofprompt_id} is outside the text vocabulary "
                              f"(0 .. {self.qwen.vocab_size - 1})")

    @property
    def v3(self) -> bool:
        return self.family == "cosyvoice3"

    @property
    def frame_in_speech_table(self) -> bool:
        """Whether sos / task are rows of ``speech_embedding`` (CosyVoice3) rather than of ``llm_embedding``."""
        return self.v3

    @property
    def sos_id(self) -> int:
        """Row of the sos vector (of ``speech_embedding`` if :attr:`frame_in_speech_table`, else ``llm_embedding``)."""
        return self.speech_token_size if self.v3 else 0

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2 if self.v3 else 1

    @property
    def eos_token(self) -> int:
        return self.speech_token_size + 1 if self.v3 else self.speech_token_size

    @property
    def fill_id(self) -> int:
        """The bi-streaming "more text please" id."""
        return self.speech_token_size + (3 if self.v3 else 2)

    @property
    def vocab_out(self) -> int:
        """Rows of ``llm_decoder`` / ``speech_embedding``: speech tokens + the LM's own ids (3 or 200)."""
        return self.speech_token_size + (CV3_EXTRA_ROWS if self.v3 else 3)

    @property
    def decoder_bias(self) -> bool:
        return not self.v3

    @property
    def first_stop_id(self) -> int:
        """Every id from here to ``vocab_out - 1`` ends generation and is never yielded."""
        return self.speech_token_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(range(self.first_stop_id, self.vocab_out))

    @property
    def min_len_masked_id(self) -> int:
        """The one id masked while fewer than min_len tokens exist (upstream's ``ignore_eos`` index)."""
        return self.speech_token_size

    @property
    def silent_tokens(self) -> tuple[int, ...]:
        """Speech ids of which at most :attr:`max_silent_run` in a row reach the flow (CosyVoice2: none)."""
        return CV3_SILENT_TOKENS if self.v3 else ()

    @property
    def max_silent_run(self) -> int:
        return CV3_MAX_SILENT_RUN if self.v3 else 0


#: the text id of ``<|endofprompt|>`` in CosyVoice3's tokenizer (upstream hard-codes it in its LM)
REAL_ENDOFPROMPT_ID = 151646


def llm_family_of(llm_doc: Any) -> str | None:
    """``cosyvoice2`` / ``cosyvoice3`` from the yaml's ``llm`` tag (``Qwen2LM`` / ``CosyVoice3LM``), else None."""
    tag = str(getattr(llm_doc, "tag", ""))
    if tag.endswith("CosyVoice3LM"):
        return "cosyvoice3"
    return "cosyvoice2" if tag.endswith("Qwen2LM") else None


def llm_config_from_doc(llm: Any, qwen: QwenConfig, fname: str, endofprompt_id: int | None = None) -> LLMConfig:
    """The yaml's ``llm`` section as an :class:`LLMConfig`; the family comes from its tag.  ``endofprompt_id``:
    the tokenizer's ``<|endofprompt|>`` id for a CosyVoice3 LM (None: :data:`REAL_ENDOFPROMPT_ID` when the text
    vocabulary holds it, else unchecked, as for a tiny test model)."""
    family = llm_family_of(llm)
    if family is None:
        raise ConfigError(f"{fname}: llm is {str(getattr(llm, 'tag', '')).split('.')[-1] or '?'}; expected "
                          "Qwen2LM (CosyVoice2) or CosyVoice3LM (CosyVoice3)")
    if family == "cosyvoice3" and endofprompt_id is None and REAL_ENDOFPROMPT_ID < qwen.vocab_size:
        endofprompt_id = REAL_ENDOFPROMPT_ID
    sampling = llm.get("sampling", {}) or {}
    try:
        return LLMConfig(
            llm_input_size=int(require(llm, "llm_input_size", "llm.", fname)),
            llm_output_size=int(require(llm, "llm_output_size", "llm.", fname)),
            speech_token_size=int(require(llm, "speech_token_size", "llm.", fname)),
            top_p=float(sampling.get("top_p", 0.8)),
            top_k=int(sampling.get("top_k", 25)),
            win_size=int(sampling.get("win_size", 10)),
            tau_r=float(sampling.get("tau_r", 0.1)),
            qwen=qwen,
            family=family,
            endofprompt_id=endofprompt_id if family == "cosyvoice3" else None,
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{fname}: a field of llm has the wrong type ({e})") from e
