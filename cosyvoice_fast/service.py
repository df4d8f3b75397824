"""Assemble a ready-to-serve engine from command-line choices (used by the app, the CLI and the benchmark).

Order of preference: an explicit ``--model-dir``; else ``pretrained_models/CosyVoice2-0.5B`` if present; else
(or with ``--synthetic``) a synthetic directory with random weights, announced in the banner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from .cli_args import pick_device
from .config import TORCH_DTYPES, BackendConfig, default_dtype
from .engine import Engine
from .engine_config import EngineConfig
from .metrics import EngineMetrics, health
from .modelfiles import LoadedModels, find_model_dir, load_models
from .synthetic import synthetic_model_dir

log = logging.getLogger(__name__)

DTYPES = TORCH_DTYPES


@dataclass
class Service:
    engine: Engine
    frontend: object | None
    models: LoadedModels
    synthetic: bool
    banner: str
    model_name: str
    metrics: EngineMetrics | None = None  # Prometheus counters of this service's engine (own registry)

    def health(self) -> dict:
        """Readiness: model, device, backends, whether the engine's worker runs (served as GET /health)."""
        return health(self)

    def close(self) -> None:
        self.engine.close()


def load_service(model_dir: str | Path | None = None, synthetic: str | None = None, device: str | None = None,
                 dtype: str | None = None, speaker_cache_dir: str | Path | None = "speakers",
                 progress: bool = True, backend: BackendConfig | None = None,
                 engine_config: EngineConfig | None = None) -> Service:
    """Load models, frontend and engine; the banner says exactly what is running.

    ``dtype`` None follows the device (bf16 on CUDA, fp32 on CPU); ``backend`` is the engine's default stage set
    (built now; its dtype is replaced by the one loaded), ``engine_config`` its capacity.  The command-line tools
    get all of these from :func:`cosyvoice_fast.cli_args.from_cli_args` (``RunChoices.service_kwargs()``)."""
    dev = pick_device(device)
    dtype = dtype or default_dtype(dev)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose fp32, fp16 or bf16")
    if dev.type == "cpu" and dtype != "fp32":
        log.warning("dtype %s on CPU is slow and inexact; using fp32", dtype)
        dtype = "fp32"
    found = None if synthetic else find_model_dir(model_dir)
    if synthetic or found is None:
        size = synthetic or "tiny"
        path = synthetic_model_dir(size)
        banner = (f"Running on a SYNTHETIC {size} model with random weights: the audio is noise, the timings are "
                  "real. For real speech put CosyVoice2-0.5B in pretrained_models/CosyVoice2-0.5B "
                  "(python -m cosyvoice_fast download) or pass --model-dir.")
        if model_dir is None and not synthetic:
            log.warning("no model directory found at pretrained_models/CosyVoice2-0.5B; using synthetic weights")
        is_synth = True
    else:
        path = found
        banner = f"Model: {path.name}"
        is_synth = False
    models = load_models(path, device=dev, dtype=DTYPES[dtype], progress=progress)
    frontend = None
    if models.files.has_frontend:
        from .frontend.pipeline import Frontend

        frontend = Frontend.from_model_dir(models.files.root, speaker_cache_dir=speaker_cache_dir,
                                           sample_rate=models.config.sample_rate)
    else:
        log.warning("model directory lacks %s: prompt voices are disabled",
                    ", ".join(models.files.missing_frontend_files()))
        banner += " Prompt-voice frontend unavailable (missing " + ", ".join(models.files.missing_frontend_files()) + ")."
    default = replace(backend, dtype=dtype) if backend is not None else BackendConfig(dtype=dtype)
    engine = Engine(models, frontend=frontend, backend=default, config=engine_config)
    return Service(engine=engine, frontend=frontend, models=models, synthetic=is_synth, banner=banner,
                   model_name=("synthetic-" + (synthetic or "tiny")) if is_synth else path.name,
                   metrics=EngineMetrics().attach(engine))
