"""CosyVoice3 speech LM (``CosyVoice3LM``) parity with upstream (cosyvoice3-tiny case_llm.pt), on the eager LM and
through the eager backend the engine drives.  Every size, id and token comes from the fixture."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # the fused kernels run through Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cosyvoice_fast.config.model import QwenConfig, llm_config_from_doc  # noqa: E402
from cosyvoice_fast.config.yamlfile import read_hyperpyyaml  # noqa: E402
from cosyvoice_fast.llm.eager import EagerLLM  # noqa: E402
from cosyvoice_fast.llm.model.sampling import greedy_sample  # noqa: E402
from cosyvoice_fast.llm.model.speech_lm import Qwen2LM, build_speech_lm  # noqa: E402

TOL = 1e-4
HAS_CUDA = torch.cuda.is_available()
_gpu = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def cosyvoice3_llm_config(fixture3_dir, eop_id: int):
    """The LLM config of the fixture's ``cosyvoice3.yaml`` + ``CosyVoice-BlankEN/config.json`` (read, never run)."""
    raw = json.loads((fixture3_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    names = [n for n in QwenConfig.__dataclass_fields__ if n in raw]
    qwen = QwenConfig(**{n: raw[n] for n in names})
    doc = read_hyperpyyaml(fixture3_dir / "cosyvoice3.yaml")
    return llm_config_from_doc(doc["llm"], qwen, "cosyvoice3.yaml", endofprompt_id=eop_id)


@pytest.fixture(scope="module")
def case(load_case3) -> dict:
    return load_case3("case_llm")


@pytest.fixture(scope="module")
def lm(fixture3_dir, case) -> Qwen2LM:
    cfg = cosyvoice3_llm_config(fixture3_dir, int(case["eop_id"]))
    model = build_speech_lm(cfg)
    model.load_state_dict(torch.load(fixture3_dir / "llm.pt", weights_only=True), strict=True)
    return model.eval()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _layouts(case: dict) -> list[tuple[str, dict, torch.Tensor | None]]:
    """(name, recorded dict, LM prompt speech) for the zero-shot and the no-prompt-speech layout."""
    return [("zero_shot", case, case["prompt_speech_token"]),
            ("no_prompt_speech", case["no_prompt_speech"], torch.zeros(1, 0, dtype=torch.int32))]


def test_cosyvoice3_ids_and_shapes_from_config(lm, case, fixture3_dir):
    cfg = lm.cfg
    assert cfg.family == "cosyvoice3" and cfg.speech_token_size == int(case["speech_token_size"])
    assert (cfg.sos_id, cfg.eos_token, cfg.task_id, cfg.fill_id) == tuple(
        int(case[k]) for k in ("sos_id", "eos_id", "task_id", "fill_id"))
    assert cfg.stop_token_ids == tuple(case["stop_token_ids"].tolist())
    assert cfg.vocab_out == case["logp_first"].shape[0]
    assert cfg.min_len_masked_id == cfg.sos_id  # upstream's ignore_eos index is sos in CosyVoice3
    sd = torch.load(fixture3_dir / "llm.pt", weights_only=True)
    assert "llm_embedding.weight" not in sd and "llm_decoder.bias" not in sd
    assert not hasattr(lm, "llm_embedding") and lm.llm_decoder.bias is None
    assert lm.llm_decoder.weight.shape == sd["llm_decoder.weight"].shape


@torch.inference_mode()
@pytest.mark.parametrize("layout", [0, 1], ids=["zero_shot", "no_prompt_speech"])
def test_cosyvoice3_lm_input_bit_exact_and_first_logp(lm, case, layout):
    _, rec, speech = _layouts(case)[layout]
    x = lm.build_lm_input(case["text"], case["prompt_text"], speech)
    assert x.shape == rec["lm_input"].shape
    assert torch.equal(x, rec["lm_input"])
    # the batched prefill's fixed-shape gather lays the same rows out
    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), case["prompt_text"].long(), case["text"].long(),
                     torch.zeros(1, 1, dtype=torch.long), speech.long()], dim=1)
    n_text = torch.tensor([case["prompt_text"].shape[1] + case["text"].shape[1]])
    assert torch.equal(lm.lm_input_rows(ids, n_text), rec["lm_input"])
    logp = lm.prefill(x, lm.new_cache(x.shape[1] + 1))
    assert logp.shape == (1, rec["logp_first"].shape[0])
    assert _err(logp[0], rec["logp_first"]) <= TOL


@torch.inference_mode()
def test_cosyvoice3_forced_steps_through_cache_and_full_forward(lm, case):
    x = case["lm_input"]
    forced = case["forced_tokens"].tolist()
    cache = lm.new_cache(x.shape[1] + len(forced))
    lm.prefill(x, cache)
    rows = [lm.decode_step(t, cache, x.shape[1] + i)[0] for i, t in enumerate(forced)]
    assert _err(torch.stack(rows), case["forced_logp"]) <= TOL
    full = lm(torch.cat([x, lm.speech_embedding(case["forced_tokens"].long())[None]], dim=1))[0]
    full = full[x.shape[1] - 1:]  # from the prompt's last row on: [logp_first, forced_logp...]
    assert full.shape == case["full_forward_logp"].shape
    assert _err(full, case["full_forward_logp"]) <= TOL


@torch.inference_mode()
def test_cosyvoice3_greedy_tokens_exact(lm, case):
    x = case["lm_input"]
    n = case["greedy_tokens"].shape[0]
    cache = lm.new_cache(x.shape[1] + n)
    logp, out = lm.prefill(x, cache)[0], []
    for i in range(n):
        out.append(int(logp.argmax()))
        if i + 1 < n:
            logp = lm.decode_step(out[-1], cache, x.shape[1] + i)[0]
    assert out == case["greedy_tokens"].tolist()


class _Recorder:
    """Greedy sampler that records each decision: the drawn id and whether id ``masked`` was at -inf."""

    def __init__(self, masked: int):
        self.masked, self.drawn, self.was_masked = masked, [], []

    def __call__(self, logp, history, generator) -> int:
        self.was_masked.append(bool(logp[self.masked] == -float("inf")))
        self.drawn.append(greedy_sample(logp, history, generator))
        return self.drawn[-1]


def _check_inference(rec: dict, tokens: list[int], sampler: _Recorder, min_len: int, max_len: int) -> None:
    inf = rec["inference"]
    assert tokens == inf["tokens"].tolist()
    assert sampler.drawn[-1] == int(inf["stop_id"]) and len(sampler.drawn) == int(inf["n_steps"])
    assert (min_len, max_len) == (int(inf["min_len"]), int(inf["max_len"]))
    assert sampler.was_masked == inf["step_masked_6561"].tolist()


@pytest.mark.parametrize("layout", [0, 1], ids=["zero_shot", "no_prompt_speech"])
def test_cosyvoice3_inference_rules_with_argmax(lm, case, layout):
    """Upstream's masking (index speech_token_size = sos before min_len), 200 stop ids and length rules."""
    _, rec, speech = _layouts(case)[layout]
    sampler = _Recorder(lm.cfg.speech_token_size)
    toks = list(lm.generate(case["text"], case["prompt_text"], speech, generator=torch.Generator(), sampler=sampler))
    _check_inference(rec, toks, sampler, *lm.length_limits(case["text"].shape[1]))


@pytest.mark.parametrize("layout", [0, 1], ids=["zero_shot", "no_prompt_speech"])
def test_cosyvoice3_inference_through_eager_backend(lm, case, layout):
    """The same decisions through the backend the engine drives (prefill + decode calls on an LLMState)."""
    from types import SimpleNamespace

    _, rec, speech = _layouts(case)[layout]
    backend = EagerLLM(lm, None)
    backend.sampler = sampler = _Recorder(lm.cfg.speech_token_size)
    inputs = SimpleNamespace(prompt_text=case["prompt_text"], llm_prompt_speech_token=speech)
    st = backend.new_state(inputs, case["text"], torch.Generator(), None, False)
    toks = [t for t in backend.prefill([st]) if t is not None]
    while not st.done:
        toks += [t for t in backend.decode([st]) if t is not None]
    assert st.history == toks
    _check_inference(rec, toks, sampler, st.min_len, st.max_len)


def test_cosyvoice3_prompt_without_endofprompt_is_refused(lm, case):
    eop = int(case["eop_id"])
    prompt = case["prompt_text"][case["prompt_text"] != eop][None]
    assert prompt.shape[1] == case["prompt_text"].shape[1] - 1
    with pytest.raises(ValueError, match=rf"holds no <\|endofprompt\|> \(text id {eop}\)"):
        lm.build_lm_input(case["text"], prompt, case["prompt_speech_token"])
    with pytest.raises(ValueError, match="holds no <\\|endofprompt\\|>"):
        next(lm.generate(case["text"], prompt, generator=torch.Generator()))
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="holds no <\\|endofprompt\\|>"):
        EagerLLM(lm, None).new_state(SimpleNamespace(prompt_text=prompt, llm_prompt_speech_token=None),
                                     case["text"], torch.Generator(), None, False)
    # the id may sit in the text instead (cross-lingual: the tts text carries the system prompt)
    text = torch.cat([case["prompt_text"], case["text"]], dim=1)
    assert torch.equal(lm.build_lm_input(text, None, None), case["no_prompt_speech"]["lm_input"])


# ------------------------------------------------------------------------------------------ greedy through config

def _greedy_lm(lm: Qwen2LM, device: str = "cpu") -> Qwen2LM:
    """The fixture LM with a sampler that is argmax on every backend: top_k 1, and a repetition threshold
    (win_size * tau_r) above the window so the RAS fallback never fires."""
    cfg = dataclasses.replace(lm.cfg, top_k=1, tau_r=2.0)
    out = build_speech_lm(cfg)
    out.load_state_dict(lm.state_dict(), strict=True)
    return out.to(device).eval()


def _tokens_alone(stage, case: dict, speech: torch.Tensor | None, device: str, seed: int = 0,
                  max_tokens: int | None = None, ignore_eos: bool = False) -> list[int]:
    from types import SimpleNamespace

    from cosyvoice_fast.bench.llm_tools import generate_alone

    inputs = SimpleNamespace(prompt_text=case["prompt_text"].to(device),
                             llm_prompt_speech_token=None if speech is None else speech.to(device))
    g = torch.Generator(device=device).manual_seed(seed)
    return generate_alone(stage, inputs, case["text"].to(device), g, max_tokens, ignore_eos)


@pytest.mark.parametrize("layout", [0, 1], ids=["zero_shot", "no_prompt_speech"])
def test_cosyvoice3_config_greedy_sampler_reproduces_inference_on_eager(lm, case, layout):
    """What the GPU tests rely on: top_k 1 with no RAS fallback is upstream's argmax run, stop included."""
    _, rec, speech = _layouts(case)[layout]
    toks = _tokens_alone(EagerLLM(_greedy_lm(lm), None), case, speech, "cpu")
    assert toks == rec["inference"]["tokens"].tolist()


@torch.inference_mode()
def test_cosyvoice3_fused_step_on_the_interpreter(lm, case):
    """The fused decode step with CosyVoice3's bias-free 6761-row head (handed to the kernels with a zero bias)
    reproduces the forced log-probs (Triton's interpreter on CPU; the kernels themselves on a GPU)."""
    pytest.importorskip("triton")
    from cosyvoice_fast.llm.fused import _FusedView
    from cosyvoice_fast.llm.kernels.qwen2_decode import FusedDecoder

    dev = "cuda" if HAS_CUDA else "cpu"
    ref = copy.deepcopy(lm).to(dev)
    view = _FusedView(ref, FusedDecoder(ref.decoder, splits=1))
    x = case["lm_input"].to(dev)
    forced = case["forced_tokens"][:1].tolist()
    cache = ref.new_cache(x.shape[1] + len(forced))
    ref.prefill(x, cache)
    for i, t in enumerate(forced):
        pos = torch.tensor([[x.shape[1] + i]], device=dev)
        logp = view.step_log_probs(torch.tensor([[t]], device=dev), pos, cache, kv_len=x.shape[1] + i + 1)
        assert logp.shape == (1, lm.cfg.vocab_out)
        assert _err(logp[0].cpu(), case["forced_logp"][i]) <= TOL


# ------------------------------------------------------------------------------------------ GPU: graph and fused


@pytest.fixture(scope="module")
def lm_cuda(lm) -> Qwen2LM:
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return copy.deepcopy(lm).cuda()


def _graph(kind: str, llm: Qwen2LM):
    from cosyvoice_fast.llm.fused import FusedLLM
    from cosyvoice_fast.llm.graph import CudaGraphLLM

    from cosyvoice_fast.config.backends import BackendUnavailable
    from cosyvoice_fast.llm.fused import MIN_HEAD_DIM

    cls = FusedLLM if kind == "fused" else CudaGraphLLM
    kwargs = dict(slots=3, max_len=512, kv_buckets=(64, 128, 256), progress=False)
    if kind == "fused" and llm.cfg.qwen.head_dim < MIN_HEAD_DIM:
        # a fixture whose heads are narrower than tl.dot's minimum: the backend must refuse it by name, not crash
        # in a Triton compile (the real model's heads are 64 wide)
        with pytest.raises(BackendUnavailable, match=f"at least {MIN_HEAD_DIM} dims.*have {llm.cfg.qwen.head_dim}"):
            cls(llm, None, **kwargs)
        return None
    # small buckets so a few hundred tokens cross several of them; the runners read nothing of the model config
    return cls(llm, None, **kwargs)


@_gpu
@pytest.mark.parametrize("kind", ["cudagraph", "fused"])
def test_gpu_cosyvoice3_teacher_forced_logp_matches_upstream(lm_cuda, case, kind):
    from helpers import teacher_forced_logp

    stage = _graph(kind, copy.deepcopy(lm_cuda))
    if stage is None:
        return
    rows = teacher_forced_logp(stage, case["lm_input"].cuda(), case["forced_tokens"].tolist()).cpu()
    assert rows.shape == (case["forced_tokens"].shape[0] + 1, lm_cuda.cfg.vocab_out)
    assert _err(rows, torch.cat([case["logp_first"][None], case["forced_logp"]])) <= TOL
    assert stage.slots_in_use == 0


@_gpu
@pytest.mark.parametrize("kind", ["cudagraph", "fused"])
@pytest.mark.parametrize("layout", [0, 1], ids=["zero_shot", "no_prompt_speech"])
def test_gpu_cosyvoice3_greedy_inference_matches_upstream(lm_cuda, case, kind, layout):
    """Upstream's argmax run (min-len mask on index 6561 = sos, any of the 200 stop ids ends it) on the graphs."""
    _, rec, speech = _layouts(case)[layout]
    stage = _graph(kind, _greedy_lm(lm_cuda, "cuda"))
    if stage is None:
        return
    assert _tokens_alone(stage, case, speech, "cuda") == rec["inference"]["tokens"].tolist()


@_gpu
@pytest.mark.parametrize("kind", ["cudagraph", "fused"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_cosyvoice3_sampled_tokens_equal_eager_fp32(lm_cuda, case, kind, seed):
    stage, eager = _graph(kind, copy.deepcopy(lm_cuda)), EagerLLM(lm_cuda, None)
    if stage is None:
        return
    speech = case["prompt_speech_token"]
    assert _tokens_alone(stage, case, speech, "cuda", seed) == _tokens_alone(eager, case, speech, "cuda", seed)
    forced = _tokens_alone(stage, case, speech, "cuda", seed, 300, True)  # 41 + 300 positions: every kv bucket
    assert len(forced) == 300 and max(forced) < lm_cuda.cfg.speech_token_size
    assert forced == _tokens_alone(eager, case, speech, "cuda", seed, 300, True)
    assert stage.slots_in_use == 0


# ------------------------------------------------------------------------------------------ bi-streaming (no fixture)

def test_cosyvoice3_bistream_spec_takes_the_ids_from_the_config(lm, case):
    """CosyVoice3's bi-streaming is not recorded upstream; its ids and masks follow the README's description."""
    from cosyvoice_fast.llm.bistream_eager import bistream_spec
    from cosyvoice_fast.llm.model.bistream import PHASE_FINAL, PHASE_TEXT

    spec = bistream_spec(lm)
    stops = case["stop_token_ids"].tolist()
    assert (spec.eos_id, spec.fill_id, spec.vocab_out) == (int(case["eos_id"]), int(case["fill_id"]), stops[-1] + 1)
    assert spec.banned(PHASE_TEXT) == tuple(i for i in stops if i != int(case["fill_id"]))  # fill allowed
    assert spec.banned(PHASE_FINAL) == tuple(i for i in stops if i != int(case["eos_id"]))  # eos allowed
    assert spec.endofprompt_id == int(case["eop_id"])


@torch.inference_mode()
def test_cosyvoice3_bistream_feeds_the_system_prompt_after_sos(lm, case):
    """The prompt text up to <|endofprompt|> follows sos at once; the rest joins the 5:15 mix with prompt speech,
    so the first step's rows are the zero-shot LM input without the target text's tail and task."""
    from cosyvoice_fast.llm.bistream_eager import EagerBistream

    runner = EagerBistream(lm, sampler=greedy_sample)
    prompt, speech = case["prompt_text"].reshape(-1).tolist(), case["prompt_speech_token"].reshape(-1).tolist()
    state = runner.new_state(prompt, speech)
    head = prompt.index(int(case["eop_id"])) + 1
    state.push_text(case["text"].reshape(-1).tolist())
    plan = state.next_step()
    t, s = state.spec.text_rows, state.spec.speech_rows
    assert [x.as_tuple() for x in plan.segments] == [("sos", 0, 1), ("text", 0, head), ("text", head, t),
                                                      ("prompt_speech", 0, min(s, len(speech)))]
    rows = lm.embed_segments(plan.segments, state.text_ids, state.prompt_speech, state.out)
    x = case["lm_input"]
    n_front = 1 + head + t
    assert torch.equal(rows, torch.cat([x[:, :n_front], x[:, -len(speech):]], dim=1))
    # a whole run (the tiny random LM never picks eos: the cap ends it) yields speech tokens only
    toks = list(runner.tokens(prompt, speech, [case["text"][0, :5], case["text"][0, 5:]], torch.Generator(),
                              max_tokens=200))
    assert len(toks) == 200 and max(toks) < lm.cfg.speech_token_size
    with pytest.raises(ValueError, match=rf"prompt text to hold <\|endofprompt\|> \(text id {int(case['eop_id'])}\)"):
        runner.new_state([i for i in prompt if i != int(case["eop_id"])], speech)
