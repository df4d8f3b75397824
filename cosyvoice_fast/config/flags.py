"""The command-line flags of every tool that loads a model, declared once: ``add_cli_args`` / ``from_cli_args``.

``app.py``, ``python -m cosyvoice_fast synth|speaker-state|build-engines|soak``, ``bench``, ``bench_flow`` and
``profile_stages`` used to declare ``--model-dir``, ``--synthetic`` and ``--dtype`` each on their own, with three
different dtype defaults, so one command worked on a CPU and the next refused.  Here a flag means the same
everywhere; the dtype default follows the device (:func:`~cosyvoice_fast.config.backends.default_dtype`); every
:class:`~cosyvoice_fast.config.engine.EngineConfig` field is a flag generated from the dataclass (a new field gets
its flag without touching a tool); and every error names the flag to change, not the Python field behind it.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, Iterable

import torch

from cosyvoice_fast.config.backends import BACKEND_CHOICES, TORCH_DTYPES, BackendConfig, default_dtype
from cosyvoice_fast.config.engine import EngineConfig

PARTS = ("model", "device", "backends", "engine")

#: help text of each EngineConfig flag (tests check that every field has one)
ENGINE_HELP: dict[str, str] = {
    "max_streams": "requests running at once; more wait in the admission queue",
    "llm_slots": "LLM KV-cache slots, or 'auto': sized from free GPU memory, at most --max-streams "
                 "(--max-streams on CPU)",
    "max_context": "LM positions per slot: prompt text + prompt speech + text + generated speech tokens",
    "queue_limit": "requests waiting for admission; one more is refused (HTTP 429/503)",
    "flow_buckets": "mel-frame lengths whose flow graphs are captured at start-up, comma-separated",
    "flow_rows": "flow batch sizes captured per length bucket, comma-separated",
    "vocoder_rows": "vocoder batch sizes captured, comma-separated",
    "cuda_streams": "2: the LLM and flow + vocoder in their own threads and CUDA streams (overlapped); 1: one after the other",
    "capture_at_start": "capture graphs on first use instead of at start-up (faster start, slower first requests)",
    "background_capture": "report ready after the first-chunk graphs and capture the rest in a background thread "
                          "while serving (NOT VERIFIED YET: its GPU test has not passed; see docs/architecture.md, "
                          "Start-up); default: every graph before ready",
    "llm_memory_fraction": "share of free GPU memory the LLM KV cache may take when --llm-slots is auto",
    "stage_variants": "built backends kept per stage (LLM, flow, vocoder); the least recently used beyond it is "
                      "dropped",
    "first_chunk_wait_ms": "ms a ready first chunk may wait for other requests' first chunks a few tokens away, "
                           "to share one flow solve (0: never wait)",
    "later_chunk_wait_ms": "ms a ready later chunk may wait for other requests' chunks a few tokens away, to share "
                           "one flow solve, while its listener has audio left (0: never wait)",
    "first_chunk_priority": "keep every LM decoding while a first chunk is solved (more audio per second under "
                            "load; first chunks share the GPU) instead of pausing those past their first chunk",
}


#: other names of a switch's flag
SWITCH_ALIASES: dict[str, tuple[str, ...]] = {}


class CliError(ValueError):
    """A command-line value is wrong; the message names the flag and says what to pass instead."""


def flag(field_name: str) -> str:
    """``max_streams`` -> ``--max-streams``; a switch that is on by default is turned off by its ``--no-`` flag
    (``capture_at_start`` -> ``--no-capture-at-start``)."""
    name = "--" + field_name.replace("_", "-")
    default = {f.name: f.default for f in fields(EngineConfig)}.get(field_name)
    return "--no-" + name[2:] if default is True else name


# ------------------------------------------------------------------------------------------ value parsers
# Syntax only: ranges are EngineConfig's to check (one source of truth); its messages are re-labelled with the flag.
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None


def _slots(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def _parser_for(default: Any) -> Callable[[str], Any]:
    if default is None:
        return _slots
    if isinstance(default, tuple):
        return _int_tuple
    if isinstance(default, float):
        return _float
    return _int


def _metavar(default: Any) -> str:
    if default is None:
        return "N|auto"
    if isinstance(default, tuple):
        return "N,N,…"
    return "X" if isinstance(default, float) else "N"


def _show(default: Any) -> str:
    if default is None:
        return "auto"
    if isinstance(default, tuple):
        return ",".join(str(v) for v in default)
    return str(default)


# ------------------------------------------------------------------------------------------ declaring
def add_cli_args(parser: argparse.ArgumentParser, *, parts: Iterable[str] = PARTS,
                 synthetic_default: str | None = None) -> None:
    """Declare the shared flags on ``parser``.

    ``parts`` picks groups: ``model`` (``--model-dir``, ``--synthetic``), ``device`` (``--device``, ``--dtype``),
    ``backends`` (``--llm-backend``, ``--flow-backend``, ``--vocoder-backend``, ``--recompute-flow``: the engine's
    default stage set, built at start-up) and ``engine`` (one flag per ``EngineConfig`` field).
    ``synthetic_default`` is the model a GPU tool measures when neither ``--model-dir`` nor ``--synthetic`` is
    given (``full`` for the benchmarks); without it the default model directory is looked up."""
    parts = tuple(parts)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"add_cli_args: unknown parts {sorted(unknown)}; choose from {PARTS}")
    parser.set_defaults(cli_parts=parts, synthetic_default=synthetic_default)
    if "model" in parts:
        g = parser.add_argument_group("model")
        g.add_argument("--model-dir", metavar="DIR",
                       help="CosyVoice2-0.5B or Fun-CosyVoice3-0.5B directory (default: " + (
                           f"a synthetic {synthetic_default} model)" if synthetic_default else
                           "pretrained_models/CosyVoice2-0.5B if present, else a synthetic tiny model, announced)"))
        g.add_argument("--synthetic", choices=["tiny", "full", "tiny3", "full3"],
                       help="random weights of that size, no download (the audio is noise, the timings are real); "
                            "tiny/full: CosyVoice2, tiny3/full3: CosyVoice3"
                            + (f"; default {synthetic_default} when --model-dir is not given" if synthetic_default
                               else ""))
    if "device" in parts:
        g = parser.add_argument_group("device")
        g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 … (default: cuda if available)")
        g.add_argument("--dtype", choices=list(TORCH_DTYPES),
                       help="LM and flow precision (default: bf16 on a CUDA GPU, fp32 on CPU; HiFT stays fp32)")
        g.add_argument("--cache-dir", metavar="DIR",
                       help="compiled kernels kept between starts, one subdirectory per GPU, driver, library "
                            "versions and model (default: $XDG_CACHE_HOME/cosyvoice_fast or ~/.cache/cosyvoice_fast)")
    if "backends" in parts:
        g = parser.add_argument_group("backends (the engine's default; built at start-up)")
        for stage, names in BACKEND_CHOICES.items():
            g.add_argument(f"--{stage}-backend", choices=list(names), default="eager",
                           help=f"{stage} implementation (default: eager)" + (
                               "; it streams incrementally (each chunk reuses the earlier frames' keys/values, as "
                               "the app does) unless --recompute-flow is given" if stage == "flow" else ""))
        g.add_argument("--recompute-flow", action="store_true",
                       help="recompute the whole prefix for every streaming chunk (upstream's scheme) instead of "
                            "the incremental flow")
    if "engine" in parts:
        g = parser.add_argument_group("engine capacity")
        for f in fields(EngineConfig):
            default = f.default if f.default is not MISSING else None
            help_text = ENGINE_HELP.get(f.name, "")
            if isinstance(default, bool):  # on by default: a --no- flag turns it off; off: its flag turns it on
                g.add_argument(flag(f.name), *SWITCH_ALIASES.get(f.name, ()), dest=f.name,
                               action="store_false" if default else "store_true", default=None, help=help_text)
                continue
            g.add_argument(flag(f.name), dest=f.name, type=_parser_for(default), default=None,
                           metavar=_metavar(default),
                           help=f"{help_text} (default: {_show(default)})")


# ------------------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class RunChoices:
    """What the flags chose, resolved: the device is a real device and the dtype a real dtype."""

    model_dir: str | None
    synthetic: str | None
    device: torch.device
    dtype: str
    backend: BackendConfig
    engine: EngineConfig
    cache_dir: str | None = None  # --cache-dir (None: the default compile cache root)

    def service_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`cosyvoice_fast.serving.service.load_service` (add ``speaker_cache_dir`` etc.)."""
        return {"model_dir": self.model_dir, "synthetic": self.synthetic, "device": str(self.device),
                "dtype": self.dtype, "backend": self.backend, "engine_config": self.engine,
                "cache_dir": self.cache_dir}


def pick_device(device: str | None) -> torch.device:
    """``auto``/None -> cuda when a GPU is visible, else cpu; anything else must name a usable device."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise CliError(f"--device {device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise CliError(f"--device {device}: only cpu and cuda are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CliError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                       f"(cuda:0 … cuda:{torch.cuda.device_count() - 1})")
    return dev


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if getattr(args, f.name, None) is not None}
    if "llm_slots" in given and given["llm_slots"] is None:
        del given["llm_slots"]
    try:
        return EngineConfig(**given)
    except ValueError as e:  # EngineConfig names its field; the user typed a flag
        msg = re.sub(r"EngineConfig\.(\w+)", lambda m: flag(m.group(1)), str(e))
        raise CliError(msg) from None


def from_cli_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> RunChoices:
    """Resolve the flags ``add_cli_args`` declared.  A bad value raises :class:`CliError` naming the flag, or, with
    ``parser``, ends the program through ``parser.error`` (usage + message, exit status 2)."""
    try:
        return _resolve(args)
    except CliError as e:
        if parser is not None:
            parser.error(str(e))
        raise


def _resolve(args: argparse.Namespace) -> RunChoices:
    parts = getattr(args, "cli_parts", PARTS)
    model_dir, synthetic = getattr(args, "model_dir", None), getattr(args, "synthetic", None)
    if model_dir and synthetic:
        raise CliError(f"--model-dir {model_dir} and --synthetic {synthetic} name two models: pass one of them")
    if not model_dir and not synthetic:
        synthetic = getattr(args, "synthetic_default", None)
    device = pick_device(getattr(args, "device", "auto") if "device" in parts else "auto")
    dtype = getattr(args, "dtype", None) or default_dtype(device)
    if dtype not in TORCH_DTYPES:
        raise CliError(f"--dtype {dtype!r}: choose {', '.join(TORCH_DTYPES)}")
    if device.type == "cpu" and dtype != "fp32":
        raise CliError(f"--dtype {dtype} needs a CUDA GPU (this run is on the CPU): pass --dtype fp32, or leave "
                       "--dtype out (its default follows the device)")
    if "backends" in parts:
        try:
            backend = BackendConfig(llm=args.llm_backend, flow=args.flow_backend, vocoder=args.vocoder_backend,
                                    dtype=dtype, incremental=not args.recompute_flow)
        except ValueError as e:
            raise CliError(str(e)) from None
    else:
        backend = BackendConfig(dtype=dtype)
    engine = _engine_config(args) if "engine" in parts else EngineConfig()
    return RunChoices(model_dir=model_dir, synthetic=synthetic, device=device, dtype=dtype, backend=backend,
                      engine=engine, cache_dir=getattr(args, "cache_dir", None) if "device" in parts else None)
