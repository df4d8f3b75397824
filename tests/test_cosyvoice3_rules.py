"""CosyVoice3's rules outside the networks (cosyvoice3-tiny case_rules.pt): the silent-token filter (rule, LM state
and engine hook), the tokenizer's special tokens and their ids, and the prompt-text rules with their refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.model import LLMConfig, QwenConfig, llm_config_from_doc
from cosyvoice_fast.config.yamlfile import read_hyperpyyaml
from cosyvoice_fast.frontend.prompt_rules import (
    COSYVOICE2_RULES, COSYVOICE3_RULES, COSYVOICE3_SPECIAL_TOKENS, PromptError, derive_special_token_ids,
    rules_for_family,
)
from cosyvoice_fast.llm.model.speech_lm import build_speech_lm
from cosyvoice_fast.llm.stage import LLMState, accept_token
from cosyvoice_fast.llm.token_filter import NO_FILTER, TokenFilter
from helpers import ScriptedLLM

BASE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # what the Qwen2 tokenizer knows before them


@pytest.fixture(scope="module")
def rules(load_case3) -> dict:
    return load_case3("case_rules")


@pytest.fixture(scope="module")
def llm_case(load_case3) -> dict:
    return load_case3("case_llm")


@pytest.fixture(scope="module")
def cfg3(fixture3_dir, llm_case) -> LLMConfig:
    raw = json.loads((fixture3_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    qwen = QwenConfig(**{n: raw[n] for n in QwenConfig.__dataclass_fields__ if n in raw})
    doc = read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml")
    return llm_config_from_doc(doc["llm"], qwen, "cosyvoice3.yaml", endofprompt_id=int(llm_case["eop_id"]))


# ------------------------------------------------------------------------------------------ silent-token filter

def test_cosyvoice3_silent_filter_reproduces_upstream_script(cfg3, rules):
    s = rules["silent"]
    f = TokenFilter.for_config(cfg3)
    assert f.silent_tokens == frozenset(s["silent_tokens"].tolist()) and f.max_run == int(s["max_silent_run"])
    script, kept = s["script"].tolist(), s["kept"].tolist()
    assert f.apply(script) == kept
    # the same through a request's LLM state, token by token, while its history keeps every token
    st = LLMState(torch.zeros(1, 1), None, None, torch.Generator(), 0, len(script), False, token_filter=f)
    passed = []
    for t in script:
        assert accept_token(st, t, cfg3.first_stop_id) == t
        passed += st.to_flow(t)
    assert passed == kept and st.history == script


def test_cosyvoice2_filters_nothing(rules):
    assert TokenFilter.for_config(LLMConfig()) is NO_FILTER
    script = rules["silent"]["script"].tolist()
    assert NO_FILTER.apply(script) == script


class _SpyFlow:
    """Records the tokens the engine hands the flow; runs the real (CosyVoice2 tiny) flow on them modulo its
    vocabulary."""

    max_batch = 1

    def __init__(self, inner, vocab: int):  # noqa: ANN001
        self.inner, self.vocab, self.tokens = inner, vocab, []

    def solve(self, items):  # noqa: ANN001
        return [self.chunk(*item) for item in items]

    def chunk(self, seg, inputs, tokens, call):  # noqa: ANN001
        self.tokens.append(tokens[0].tolist())
        return self.inner.chunk(seg, inputs, tokens % self.vocab, call)


def test_cosyvoice3_silent_filter_in_the_engine(tiny_models, load_case, cfg3, rules):
    """The engine's one hook: filtered tokens never reach the flow, the LM state's history keeps them all."""
    from cosyvoice_fast.engine.engine import Engine
    from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest

    case = load_case("case_flow_stream")
    script, kept = rules["silent"]["script"].tolist(), rules["silent"]["kept"].tolist()
    eng = Engine(tiny_models)
    try:
        stages = eng.stages(BackendConfig())
        llm = ScriptedLLM(script, TokenFilter.for_config(cfg3))
        spy = _SpyFlow(stages.flow, tiny_models.config.flow.vocab_size)
        stages.llm, stages.flow = llm, spy
        inputs = ModelInputs(text_segments=[torch.arange(6)[None]], prompt_text=torch.arange(4)[None],
                             llm_prompt_speech_token=case["prompt_token"],
                             flow_prompt_speech_token=case["prompt_token"], prompt_feat=case["prompt_feat"],
                             embedding=case["embedding"])
        chunks = list(eng.stream(SynthesisRequest(inputs=inputs, seed=0, stream=False)))
    finally:
        eng.close()
    assert spy.tokens == [kept]  # one non-streaming flow call over exactly the tokens that pass
    assert llm.states[0].history == script
    assert sum(len(c.samples) for c in chunks) == len(kept) * tiny_models.config.token_mel_ratio * 480


# ------------------------------------------------------------------------------------------ special tokens

def test_cosyvoice3_special_tokens_and_derived_ids(rules, llm_case):
    assert COSYVOICE3_SPECIAL_TOKENS == tuple(rules["special_tokens"])
    expected = rules["special_token_ids"]
    known = {t: expected[t] for t in BASE_SPECIALS}
    derived = derive_special_token_ids(COSYVOICE3_SPECIAL_TOKENS, known, max(known.values()) + 1)
    assert derived == dict(expected)
    assert derived["<|endofprompt|>"] == int(llm_case["real_eop_id"])
    # CosyVoice2's list is CosyVoice3's head: its ids are unchanged
    assert COSYVOICE3_SPECIAL_TOKENS[:len(COSYVOICE2_RULES.special_tokens)] == COSYVOICE2_RULES.special_tokens


def test_cosyvoice3_tokenizer_assigns_the_derived_ids(tmp_path):
    """TextTokenizer.from_dir with CosyVoice3's list gives every token the id the derivation says."""
    from cosyvoice_fast.frontend.text import TextTokenizer
    from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

    tok = TextTokenizer.from_dir(synthetic_model_dir("tiny"), special_tokens=COSYVOICE3_SPECIAL_TOKENS)
    known = {t: tok.token_to_id(t) for t in BASE_SPECIALS if tok.token_to_id(t) is not None}
    first = len(tok) - len([t for t in COSYVOICE3_SPECIAL_TOKENS if t not in known])
    derived = derive_special_token_ids(COSYVOICE3_SPECIAL_TOKENS, known, first)
    got = {t: tok.token_to_id(t) for t in COSYVOICE3_SPECIAL_TOKENS}
    assert got == {t: derived[t] for t in COSYVOICE3_SPECIAL_TOKENS}
    assert tok.encode("[AA1]<|endofprompt|>") == [derived["[AA1]"], derived["<|endofprompt|>"]]


# ------------------------------------------------------------------------------------------ prompt rules

def test_cosyvoice3_prompt_texts():
    r = rules_for_family("cosyvoice3")
    assert r is COSYVOICE3_RULES
    assert r.zero_shot_prompt_text(" Hi there ") == "You are a helpful assistant.<|endofprompt|>Hi there"
    assert r.instruct_prompt_text("Speak slowly.") == "You are a helpful assistant. Speak slowly.<|endofprompt|>"
    assert r.cross_lingual_text("Bonjour.") == "You are a helpful assistant.<|endofprompt|>Bonjour."
    written = "You are a helpful assistant. Say it in Cantonese.<|endofprompt|>"
    assert r.instruct_prompt_text(written) == written and r.cross_lingual_text(written + "x") == written + "x"
    assert r.as_written("a <|endofprompt|> b") and not r.as_written("a < | b |") and not r.as_written("<|a")
    # CosyVoice2 keeps its own: no system prompt, markup protected rather than skipped
    assert COSYVOICE2_RULES.zero_shot_prompt_text("Hi") == "Hi"
    assert COSYVOICE2_RULES.instruct_prompt_text("Speak slowly.") == "Speak slowly.<|endofprompt|>"
    assert COSYVOICE2_RULES.cross_lingual_text("Bonjour.") == "Bonjour."
    assert not COSYVOICE2_RULES.as_written("<|endofprompt|>")
    with pytest.raises(ValueError, match="no prompt rules for model family 'cosyvoice1'"):
        rules_for_family("cosyvoice1")


def test_cosyvoice3_prompt_without_endofprompt_is_refused(cfg3, llm_case, fixture3_dir):
    msg = ("the prompt text has no <|endofprompt|>: cosyvoice3 needs its prompt to open with a system prompt closed "
           "by it, e.g. 'You are a helpful assistant.<|endofprompt|>' followed by the transcript (zero-shot) or the "
           "text (cross-lingual)")
    with pytest.raises(PromptError) as e:
        COSYVOICE3_RULES.check("Hi there", "Hello.")
    assert str(e.value) == msg
    COSYVOICE3_RULES.check("You are a helpful assistant.<|endofprompt|>Hi", "Hello.")
    COSYVOICE3_RULES.check("", "You are a helpful assistant.<|endofprompt|>Hello.")
    COSYVOICE2_RULES.check("Hi there", "Hello.")
    # the LM refuses ids without the config's id (the fixture's stand-in id, not the real tokenizer's)
    eop = int(llm_case["eop_id"])
    assert cfg3.endofprompt_id == eop
    lm = build_speech_lm(cfg3)
    lm.load_state_dict(torch.load(fixture3_dir / "llm.pt", weights_only=True), strict=True)
    prompt = llm_case["prompt_text"][llm_case["prompt_text"] != eop][None]
    with pytest.raises(ValueError, match=rf"^the prompt text holds no <\|endofprompt\|> \(text id {eop}\)"):
        lm.build_lm_input(llm_case["text"], prompt)
    assert lm.build_lm_input(llm_case["text"], llm_case["prompt_text"]).shape[1] == llm_case["no_prompt_speech"][
        "lm_input"].shape[1]


def test_cosyvoice3_frontend_layouts(tmp_path):
    """The frontend with CosyVoice3's rules: system prompt before the transcript, the instruction wrapped, and the
    cross-lingual text pieces opened with the system part (ids as the tokenizer encodes the whole strings)."""
    import soundfile as sf

    from cosyvoice_fast.frontend.pipeline import Frontend
    from cosyvoice_fast.frontend.request import SynthesisRequest
    from cosyvoice_fast.frontend.speaker import OnnxSpeakerEmbedder, OnnxSpeechTokenizer
    from cosyvoice_fast.frontend.text import TextTokenizer
    from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

    d = synthetic_model_dir("tiny")
    tok = TextTokenizer.from_dir(d, special_tokens=COSYVOICE3_RULES.special_tokens)
    fe = Frontend(tok, OnnxSpeechTokenizer(d / "speech_tokenizer_v2.onnx", device="cpu"),
                  OnnxSpeakerEmbedder(d / "campplus.onnx", device="cpu"), None, None, COSYVOICE3_RULES)
    t = np.arange(32000) / 16000
    wav = tmp_path / "p.wav"
    sf.write(wav, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 16000)
    system = "You are a helpful assistant.<|endofprompt|>"
    zs, _ = fe.prepare(SynthesisRequest(text="Hello world.", prompt_wav=wav, prompt_text="hi there"))
    assert zs.prompt_text[0].tolist() == tok.encode(system + "hi there")
    assert zs.text_segments[0][0].tolist() == tok.encode("Hello world.")
    ins, _ = fe.prepare(SynthesisRequest(text="Hello.", mode="instruct2", prompt_wav=wav, instruct_text="Speak slowly"))
    assert ins.prompt_text[0].tolist() == tok.encode("You are a helpful assistant. Speak slowly<|endofprompt|>")
    assert ins.llm_prompt_speech_token.shape == (1, 0)
    cl, _ = fe.prepare(SynthesisRequest(text="Bonjour.", mode="cross_lingual", prompt_wav=wav))
    assert cl.prompt_text.shape == (1, 0) and cl.llm_prompt_speech_token.shape == (1, 0)
    assert cl.text_segments[0][0].tolist() == tok.encode(system + "Bonjour.")
    # a bi-streamed cross-lingual text gets the system part as its LM prompt text (the schedule needs it there)
    side = fe.prepare_prompt(SynthesisRequest(text="Bonjour.", mode="cross_lingual", prompt_wav=wav))
    assert side.lm_prompt[0][0].tolist() == tok.encode(system) and side.lm_prompt[1].shape == (1, 0)
    # text holding <| and |> is taken as written: one piece, not normalised
    raw = system + "It costs 5 dollars."
    cl2, _ = fe.prepare(SynthesisRequest(text=raw, mode="cross_lingual", prompt_wav=wav))
    assert [s[0].tolist() for s in cl2.text_segments] == [tok.encode(raw)]
