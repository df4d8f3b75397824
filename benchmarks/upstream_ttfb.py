"""Time to first audio of upstream's own ``CosyVoice2Model`` on this machine (the "× upstream" row of RESULTS.md).

    python benchmarks/upstream_ttfb.py --upstream-dir DIR --synthetic full --out upstream.json

``DIR`` holds upstream's packages, imported from there and never copied into this project: ``cosyvoice/`` from
github.com/FunAudioLLM/CosyVoice and ``matcha/`` from its third-party Matcha-TTS. Their Python dependencies
(transformers, diffusers, hyperpyyaml, conformer, einops; ruamel.yaml below 0.19, whose loader hyperpyyaml 1.2.3
cannot drive) must be importable; ``--deps DIR`` puts a folder of them first on the path. Upstream modules are
built from the model directory's own ``cosyvoice2.yaml`` (only its ``llm``, ``flow`` and ``hift`` entries and
the scalar settings above them: the rest names training-only code) and loaded with upstream's
``CosyVoice2Model.load``, strict, from the same ``llm.pt`` / ``flow.pt`` / ``hift.pt`` this engine loads.

What is timed is upstream's streaming ``tts()`` generator, as its CLI drives it: from the call until it yields
the first chunk, then to the end. The inputs are the ones ``python -m cosyvoice_fast.bench`` uses (the same
seeded prompt tokens, prompt mel, speaker embedding and text ids), and upstream's LM is held to exactly
``--gen-tokens`` tokens (its ``min_token_text_ratio`` and ``max_token_text_ratio``), as the bench's
``ignore_eos`` does. Two orders are reported:
- ``as_shipped``: back-to-back requests on one model object. Upstream rewrites ``token_hop_len`` on the shared
  object during a request, so every request after the first starts with a 100-token first chunk.
- ``hop_reset``: ``token_hop_len`` put back to 25 before each request, the best case for upstream.

Import shims (only where the real module is missing): ``matcha.utils`` (its package imports training tools:
Lightning, Hydra, Rich; only ``get_pylogger`` is used here), ``torchaudio`` (audio files and Kaldi features, used
by upstream's frontend, not by the model), ``scipy.signal.get_window`` (a periodic Hann window, the only use) and
``omegaconf.DictConfig`` (attribute access to the flow-matching settings).
"""

from __future__ import annotations

import argparse
import functools
import importlib.machinery
import json
import logging
import math
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("upstream_ttfb")

#: the yaml entries upstream's model needs (the scalar settings they refer to are kept as well)
MODEL_KEYS = ("llm", "flow", "hift")


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # libraries probe modules with find_spec
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _missing(name: str) -> bool:
    try:
        __import__(name)
        return False
    except ImportError:
        return True


def install_shims(upstream: Path) -> list[str]:
    """Stand-ins for modules upstream imports at module level but never calls on the inference path."""
    made = []
    pkg = _module("matcha.utils", __path__=[str(upstream / "matcha" / "utils")])
    _module("matcha.utils.pylogger", get_pylogger=logging.getLogger)
    pkg.pylogger = sys.modules["matcha.utils.pylogger"]
    made.append("matcha.utils (get_pylogger only)")
    if _missing("torchaudio"):
        ta = _module("torchaudio", __path__=[])
        comp = _module("torchaudio.compliance", __path__=[])
        comp.kaldi = _module("torchaudio.compliance.kaldi")
        ta.compliance = comp
        made.append("torchaudio")
    if _missing("scipy"):
        def get_window(kind: str, n: int, fftbins: bool = True) -> np.ndarray:
            if kind != "hann" or not fftbins:
                raise NotImplementedError(f"shim get_window({kind!r}, fftbins={fftbins})")
            return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)

        scipy = _module("scipy", __path__=[])
        scipy.signal = _module("scipy.signal", get_window=get_window)
        made.append("scipy.signal.get_window")
    if _missing("omegaconf"):
        class DictConfig(dict):
            def __init__(self, content: dict) -> None:
                super().__init__(content)

            def __getattr__(self, name: str) -> Any:
                try:
                    return self[name]
                except KeyError:
                    raise AttributeError(name) from None

        _module("omegaconf", DictConfig=DictConfig)
        made.append("omegaconf.DictConfig")
    return made


def model_yaml(text: str) -> str:
    """The yaml's scalar settings and its ``llm`` / ``flow`` / ``hift`` entries (top-level blocks)."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line and (line[0].isalpha() or line[0] == "_") and ":" in line:  # a top-level key
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
    keep = []
    for block in blocks:
        key, _, rest = block[0].partition(":")
        nested = any(ln.strip() and not ln.lstrip().startswith("#") for ln in block[1:])
        if key in MODEL_KEYS or (not nested and "!" not in rest and not key.startswith("__")):
            keep.append("\n".join(block))
    return "\n".join(keep) + "\n"


def build(model_dir: Path, upstream: Path) -> Any:
    from hyperpyyaml import load_hyperpyyaml

    blank = model_dir / "CosyVoice-BlankEN"
    if not any(blank.glob("*.safetensors")) and not any(blank.glob("*.bin")):
        # a random-weight directory ships only the config; the LM's weights come from llm.pt either way
        import transformers

        cls = transformers.Qwen2ForCausalLM
        # with the attention ``from_pretrained`` picks by default where torch has it (SDPA)
        cls.from_pretrained = classmethod(lambda c, path, **kw: c._from_config(
            transformers.Qwen2Config.from_pretrained(path), attn_implementation="sdpa"))
    conf = load_hyperpyyaml(model_yaml((model_dir / "cosyvoice2.yaml").read_text()),
                            overrides={"qwen_pretrain_path": str(blank)})
    from cosyvoice.cli.model import CosyVoice2Model

    return conf, CosyVoice2Model


def one(model: Any, inputs: Any, reset_hop: bool) -> tuple[float, float, int]:
    """(ms to the first chunk, ms to the end, samples) of one streaming ``tts`` call."""
    if reset_hop:
        model.token_hop_len = 25
    emb = inputs.embedding
    t0 = time.perf_counter()
    first, samples = math.nan, 0
    for out in model.tts(text=inputs.text_segments[0].int(), flow_embedding=emb, llm_embedding=emb,
                         prompt_text=inputs.prompt_text.int(),
                         llm_prompt_speech_token=inputs.llm_prompt_speech_token.int(),
                         flow_prompt_speech_token=inputs.flow_prompt_speech_token.int(),
                         prompt_speech_feat=inputs.prompt_feat, stream=True):
        if math.isnan(first):
            first = (time.perf_counter() - t0) * 1e3
        samples += out["tts_speech"].shape[-1]
    return first, (time.perf_counter() - t0) * 1e3, samples


def summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"p50": statistics.median(v), "p95": v[min(len(v) - 1, math.ceil(0.95 * len(v)) - 1)],
            "min": v[0], "max": v[-1], "n": len(v)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="python benchmarks/upstream_ttfb.py")
    ap.add_argument("--upstream-dir", required=True, help="folder holding upstream's cosyvoice/ and matcha/")
    ap.add_argument("--deps", help="folder of upstream's Python dependencies, put first on the path")
    ap.add_argument("--model-dir", help="a CosyVoice2 model directory (default: --synthetic)")
    ap.add_argument("--synthetic", default="full", help="random-weight directory of this size (tiny | full)")
    ap.add_argument("--fp16", action="store_true",
                    help="upstream's fp16 switch (autocast around the LM and flow; its default is fp32)")
    ap.add_argument("--requests", type=int, default=5, help="timed requests per order (after one warm-up)")
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--text-tokens", type=int, default=30)
    ap.add_argument("--gen-tokens", type=int, default=150)
    ap.add_argument("--out", default="upstream_ttfb.json")
    a = ap.parse_args(argv)

    upstream = Path(a.upstream_dir).resolve()
    if not (upstream / "cosyvoice").is_dir() or not (upstream / "matcha").is_dir():
        raise SystemExit(f"--upstream-dir {upstream}: expected cosyvoice/ and matcha/ in it")
    if a.deps:
        sys.path.insert(0, str(Path(a.deps).resolve()))
    sys.path.insert(0, str(upstream))
    shims = install_shims(upstream)

    from cosyvoice_fast.bench.engine_bench import synthetic_inputs
    from cosyvoice_fast.config.model import ModelConfig
    from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

    model_dir = Path(a.model_dir) if a.model_dir else synthetic_model_dir(a.synthetic)
    cfg = ModelConfig.from_files(model_dir / "cosyvoice2.yaml", model_dir / "CosyVoice-BlankEN" / "config.json")
    conf, model_cls = build(model_dir, upstream)
    model = model_cls(conf["llm"], conf["flow"], conf["hift"], fp16=a.fp16)
    model.load(str(model_dir / "llm.pt"), str(model_dir / "flow.pt"), str(model_dir / "hift.pt"))
    if cfg.flow.vocab_size < cfg.llm.speech_token_size:  # test-sized models only: fold ids as this engine does
        log.warning("flow vocabulary %d < LM speech tokens %d (a test-sized model): folding token ids",
                    cfg.flow.vocab_size, cfg.llm.speech_token_size)
        inner = model.flow.inference
        model.flow.inference = lambda token, **kw: inner(token=token % cfg.flow.vocab_size, **kw)
    ratio = a.gen_tokens / a.text_tokens  # min_len = max_len = gen_tokens: the bench's ignore_eos workload
    model.llm.inference = functools.partial(model.llm.inference, min_token_text_ratio=ratio,
                                            max_token_text_ratio=ratio)
    dev = model.device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    attn = getattr(model.llm.llm.model.config, "_attn_implementation", None)
    log.info("upstream CosyVoice2Model on %s (%s, Qwen2 attention %s), shims: %s", gpu, "fp16" if a.fp16 else "fp32",
             attn, shims)

    inputs = [synthetic_inputs(cfg, a.prompt_tokens, a.text_tokens, seed=i) for i in range(a.requests + 1)]
    one(model, inputs[0], reset_hop=True)  # warm-up: CUDA context, cuDNN choices
    runs: dict[str, list[dict[str, float]]] = {}
    for order, reset in (("hop_reset", True), ("as_shipped", False)):
        model.token_hop_len = 25  # the first request of each order starts as a fresh model would
        rows = []
        for i in range(1, a.requests + 1):
            ttfb, total, n = one(model, inputs[i], reset)
            rows.append({"ttfb_ms": ttfb, "total_ms": total, "samples": n})
            print(f"{order} request {i}: first audio {ttfb:.1f} ms, whole {total:.0f} ms, {n} samples", flush=True)
        runs[order] = rows
    result = {"gpu": gpu, "dtype": "fp16" if a.fp16 else "fp32", "torch": torch.__version__, "args": vars(a),
              "shims": shims, "qwen2_attention": attn, "model_dir": str(model_dir), "upstream_dir": str(upstream),
              "runs": runs,
              "ttfb_ms": {k: summary([r["ttfb_ms"] for r in v]) for k, v in runs.items()}}
    Path(a.out).write_text(json.dumps(result, indent=1))
    for k, s in result["ttfb_ms"].items():
        print(f"upstream {k}: first audio p50 {s['p50']:.1f} ms (min {s['min']:.1f}, max {s['max']:.1f}, "
              f"n {s['n']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
