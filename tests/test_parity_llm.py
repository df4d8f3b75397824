"""Speech LM parity with upstream (case_llm.pt) plus the generation rules: lengths, eos, seeding, cache bounds."""

from __future__ import annotations

import copy
import re
from itertools import islice

import pytest
import torch

from cosyvoice_fast.config.model import ModelConfig
from cosyvoice_fast.llm.model.speech_lm import Qwen2LM
from cosyvoice_fast.llm.model.kv_cache import KVCacheFullError
from cosyvoice_fast.llm.model.sampling import greedy_sample, nucleus_sample, random_sample, ras_sample

TOL = 1e-4


@pytest.fixture(scope="module")
def lm(request, fixture_dir) -> Qwen2LM:
    """The fixture LM through the shared loader; direct strict load while other networks' modules are missing."""
    try:
        return request.getfixturevalue("tiny_models").llm
    except ImportError:
        cfg = ModelConfig.from_files(fixture_dir / "cosyvoice2.yaml", fixture_dir / "CosyVoice-BlankEN/config.json")
        model = Qwen2LM(cfg.llm)
        model.load_state_dict(torch.load(fixture_dir / "llm.pt", weights_only=True), strict=True)
        return model.eval()


@pytest.fixture(scope="module")
def case(load_case) -> dict:
    return load_case("case_llm")


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _zero_shot_input(lm: Qwen2LM, case: dict) -> torch.Tensor:
    return lm.build_lm_input(case["text"], case["prompt_text"], case["prompt_speech_token"])


@torch.inference_mode()
def test_lm_input_and_first_logp(lm, case):
    x = _zero_shot_input(lm, case)
    assert x.shape == case["lm_input"].shape
    assert _max_err(x, case["lm_input"]) <= TOL
    cache = lm.new_cache(x.shape[1] + 1)
    logp = lm.prefill(x, cache)
    assert logp.shape == (1, case["logp_first"].shape[0]) and logp.dtype == torch.float32
    assert _max_err(logp[0], case["logp_first"]) <= TOL


@torch.inference_mode()
def test_kv_cache_forced_steps_and_full_forward(lm, case):
    x = _zero_shot_input(lm, case)
    forced = case["forced_tokens"].tolist()
    cache = lm.new_cache(x.shape[1] + len(forced))
    lm.prefill(x, cache)
    pos = x.shape[1]
    rows = []
    for tok in forced:
        rows.append(lm.decode_step(tok, cache, pos)[0])
        pos += 1
    assert _max_err(torch.stack(rows), case["forced_logp"]) <= TOL

    seq = torch.cat([x, lm.speech_embedding(case["forced_tokens"].long())[None]], dim=1)
    full = lm(seq)[0, x.shape[1] - 1:]
    assert full.shape == case["full_forward_logp"].shape
    assert _max_err(full, case["full_forward_logp"]) <= TOL


@torch.inference_mode()
def test_static_shape_attention_matches(lm, case):
    """The graph-capture call (attend over the whole buffer, positions as a tensor) equals the sliced eager call."""
    x = _zero_shot_input(lm, case)
    forced = case["forced_tokens"].tolist()[:5]
    cache = lm.new_cache(x.shape[1] + 16)
    lm.prefill(x, cache)
    for i, tok in enumerate(forced):
        pos = torch.tensor([x.shape[1] + i])
        hidden = lm.decoder(lm.embed_speech(tok), pos, cache, kv_len=None)
        assert _max_err(lm.log_probs(hidden[:, -1])[0], case["forced_logp"][i]) <= TOL


@torch.inference_mode()
def test_greedy_tokens_exact(lm, case):
    x = _zero_shot_input(lm, case)
    n = case["greedy_tokens"].numel()
    cache = lm.new_cache(x.shape[1] + n)
    logp, pos, out = lm.prefill(x, cache)[0], x.shape[1], []
    for _ in range(n):
        out.append(int(logp.argmax()))
        logp = lm.decode_step(out[-1], cache, pos)[0]
        pos += 1
    assert out == case["greedy_tokens"].tolist()


def test_generate_greedy_matches_recorded(lm, case):
    gen = lm.generate(case["text"], case["prompt_text"], case["prompt_speech_token"],
                      generator=torch.Generator().manual_seed(0), sampler=greedy_sample)
    n = case["greedy_tokens"].numel()
    assert list(islice(gen, n)) == case["greedy_tokens"].tolist()
    gen.close()


def _ras_recipe(fixture_dir, case: dict) -> tuple[int, dict]:
    """How ``ras_sampled_seeded`` was drawn: the seed and sampler arguments, read from the case file when it
    stores them (``ras_seed``, ``ras_kwargs``), else from the fixture README's line on that key."""
    if "ras_seed" in case:
        return int(case["ras_seed"]), dict(case.get("ras_kwargs", {}))
    readme = (fixture_dir / "README.md").read_text(encoding="utf-8") if (fixture_dir / "README.md").is_file() else ""
    line = next((ln for ln in readme.splitlines() if "ras_sampled_seeded" in ln), "")
    seed = re.search(r"manual_seed\((\d+)\)", line)
    args = re.search(r"ras_sampling\(([^)]*)\)", line)
    if seed is None or args is None:
        pytest.skip(f"{fixture_dir} does not say how ras_sampled_seeded was drawn (no ras_seed in case_llm.pt, "
                    "no 'ras_sampling(...)' and 'manual_seed(N)' on its README line)")
    kwargs = {}
    for item in filter(None, (a.strip() for a in args.group(1).split(","))):
        key, _, value = item.partition("=")
        kwargs[key.strip()] = float(value) if "." in value else int(value)
    return int(seed.group(1)), kwargs


def test_ras_reproduces_upstream_global_rng_draws(case, fixture_dir):
    """Upstream drew these after torch.manual_seed(seed); a private CPU generator with that seed gives the same."""
    seed, kwargs = _ras_recipe(fixture_dir, case)
    g = torch.Generator().manual_seed(seed)
    draws = [ras_sample(case["logp_first"], [], g, **kwargs) for _ in range(case["ras_sampled_seeded"].numel())]
    assert draws == case["ras_sampled_seeded"].tolist()


def test_ras_falls_back_on_repetition(case):
    """A nucleus pick already in the window is banned and replaced by a full-distribution draw."""
    logp = case["logp_first"]
    first = nucleus_sample(logp, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    redrawn = ras_sample(logp, [first], g)  # same seed: the nucleus step picks ``first`` again, then falls back
    assert redrawn != first
    banned = logp.clone()
    banned[first] = -float("inf")
    g_ref = torch.Generator().manual_seed(3)
    nucleus_sample(logp, g_ref)
    assert redrawn == random_sample(banned, g_ref)
    # Every top-25 token in the window: each draw falls back to the full distribution minus its nucleus pick.
    top = logp.topk(25).indices.tolist()
    for s in range(20):
        got = ras_sample(logp, top, torch.Generator().manual_seed(s), win_size=25, tau_r=0.04)
        g_ref = torch.Generator().manual_seed(s)
        pick = nucleus_sample(logp, g_ref)
        banned = logp.clone()
        banned[pick] = -float("inf")
        assert pick in top and got == random_sample(banned, g_ref) and got != pick
    # Below the threshold (one occurrence, needs two) nothing changes.
    assert ras_sample(logp, [first], torch.Generator().manual_seed(3), tau_r=0.2) == first


def test_seeded_requests_are_independent(lm, case):
    args = (case["text"], case["prompt_text"], case["prompt_speech_token"])
    n = 25
    rng_before = torch.get_rng_state()
    alone = [list(islice(lm.generate(*args, generator=torch.Generator().manual_seed(s)), n)) for s in (1, 2)]
    g1 = lm.generate(*args, generator=torch.Generator().manual_seed(1))
    g2 = lm.generate(*args, generator=torch.Generator().manual_seed(2))
    inter: list[list[int]] = [[], []]
    for _ in range(n):
        inter[0].append(next(g1))
        inter[1].append(next(g2))
    assert inter == alone
    assert alone[0] != alone[1]
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is never touched
    assert not torch.is_inference_mode_enabled()  # suspending a generator leaks no inference mode


def _eos_seeker(eos: int, fallback: int):
    """A sampler that ends generation as soon as eos is allowed, else emits ``fallback``."""

    def sample(logp: torch.Tensor, history, generator) -> int:
        return eos if torch.isfinite(logp[eos]) else fallback

    return sample


def _never_stop(logp: torch.Tensor, history, generator) -> int:
    return 7


def test_length_rules(lm):
    cfg = lm.cfg
    text = torch.tensor([[5, 6, 7]], dtype=torch.int32)
    prompt_text = torch.tensor([[8, 9, 10, 11]], dtype=torch.int32)  # prompt text does not count
    g = torch.Generator()
    n_min, n_max = lm.length_limits(3)
    assert (n_min, n_max) == (int(3 * cfg.min_token_text_ratio), int(3 * cfg.max_token_text_ratio))
    assert 0 < n_min < n_max
    assert len(list(lm.generate(text, prompt_text, generator=g, sampler=_eos_seeker(cfg.eos_token, 3)))) == n_min
    assert len(list(lm.generate(text, prompt_text, generator=g, sampler=_never_stop))) == n_max
    assert len(list(lm.generate(text, generator=g, sampler=_never_stop, max_tokens=9))) == 9
    # ignore_eos: every stop id masked at every step, runs to max_tokens even past the max_token_text_ratio cap.
    out = list(lm.generate(text, generator=g, sampler=_eos_seeker(cfg.eos_token, 3), max_tokens=n_max + 15,
                           ignore_eos=True))
    assert out == [3] * (n_max + 15)
    # Any id >= speech_token_size ends generation and is never yielded (upstream masks only eos before min_len).
    for stop in (cfg.speech_token_size + 1, cfg.speech_token_size + 2):
        toks = list(lm.generate(text, generator=g, sampler=lambda lp, h, gen, s=stop: s if len(h) == 2 else 4))
        assert toks == [4, 4]
    # The real sampler never yields a special id.
    toks = list(lm.generate(text, generator=torch.Generator().manual_seed(5)))
    assert n_min <= len(toks) <= n_max and max(toks) < cfg.speech_token_size


@torch.inference_mode()
def test_mode_inputs(lm, case):
    """Cross-lingual drops prompt text and speech; instruct2 keeps prompt text (the instruction) only."""
    full = _zero_shot_input(lm, case)
    n_p, n_t, n_s = (case[k].shape[1] for k in ("prompt_text", "text", "prompt_speech_token"))
    cross = lm.build_lm_input(case["text"], torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, dtype=torch.int32))
    assert cross.shape[1] == 1 + n_t + 1
    assert torch.equal(cross[:, 1:1 + n_t], full[:, 1 + n_p:1 + n_p + n_t])
    assert torch.equal(cross[:, -1], full[:, 1 + n_p + n_t])  # task id right after the text
    instruct = lm.build_lm_input(case["text"], case["prompt_text"], None)
    assert torch.equal(instruct, full[:, :full.shape[1] - n_s])


@torch.inference_mode()
def test_kv_cache_bounds(lm, case):
    x = _zero_shot_input(lm, case)
    max_len = x.shape[1] + 4
    cache = lm.new_cache(max_len)
    assert cache.k[0].shape == (1, lm.cfg.qwen.num_key_value_heads, max_len, lm.cfg.qwen.head_dim)
    logp = lm.prefill(x, cache)[0]
    pos = x.shape[1]
    while pos < max_len:  # fill every slot up to max_len
        logp = lm.decode_step(int(logp.argmax()), cache, pos)[0]
        pos += 1
    assert torch.isfinite(logp).all()
    with pytest.raises(KVCacheFullError, match=rf"max_len >= {max_len + 1}.*holds {max_len}"):
        lm.decode_step(0, cache, pos)
    with pytest.raises(KVCacheFullError):
        lm.prefill(x, lm.new_cache(x.shape[1] - 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs(lm, case, dtype):
    """Half models keep fp32 rotary frequencies and fp32 log-probs and stay near the fp32 reference."""
    half = copy.deepcopy(lm).to(dtype)
    assert half.decoder.rotary.inv_freq.dtype == torch.float32
    with torch.inference_mode():
        x = _zero_shot_input(half, case)
        cache = half.new_cache(x.shape[1] + 1)
        assert cache.dtype == dtype
        logp = half.prefill(x, cache)[0]
    assert logp.dtype == torch.float32
    assert _max_err(logp, case["logp_first"]) < 0.15
    assert abs(logp.exp().sum().item() - 1.0) < 1e-4


def test_fused_projections_keep_values_state_dict_and_outputs(tiny_models):
    """``fuse_projections`` (one GEMM for q/k/v and for gate/up) changes storage, not the model."""
    import copy

    llm = copy.deepcopy(tiny_models.llm)
    before = {k: v.clone() for k, v in llm.state_dict().items()}
    x = torch.randn(1, 7, llm.cfg.llm_input_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(7)
    with torch.inference_mode():
        ref = llm.decoder(x, pos, llm.new_cache(16), kv_len=7)
        llm.decoder.fuse_projections().fuse_projections()  # idempotent
        got = llm.decoder(x, pos, llm.new_cache(16), kv_len=7)
        plain = llm.decoder(x, pos)  # the cache-free path too
    after = llm.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    attn = llm.decoder.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # views, no second copy
    assert (got - ref).abs().max().item() <= 1e-5
    assert (plain - ref).abs().max().item() <= 1e-5
    # a copy loses the aliasing: it runs unfused (never stale after a load), until fused again
    clone = copy.deepcopy(llm)
    assert not clone.decoder.layers[0].self_attn._fused() and not clone.decoder.layers[0].mlp._fused()
    with torch.no_grad():
        clone.decoder.layers[0].self_attn.q_proj.weight.mul_(2.0)  # e.g. another checkpoint loaded into it
    clone.decoder.fuse_projections()
    assert clone.decoder.layers[0].self_attn._fused()
    attn2 = clone.decoder.layers[0].self_attn
    assert torch.equal(attn2.qkv_weight[:attn2.q_proj.weight.shape[0]], attn2.q_proj.weight)
