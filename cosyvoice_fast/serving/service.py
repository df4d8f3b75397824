"""Assemble a ready-to-serve engine from command-line choices (used by the app, the CLI and the benchmark).

Order of preference: an explicit ``--model-dir``; else ``pretrained_models/CosyVoice2-0.5B`` if present; else
(or with ``--synthetic``) a synthetic directory with random weights, announced in the banner.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cosyvoice_fast.telemetry import request_log
from cosyvoice_fast.config.flags import pick_device
from cosyvoice_fast.config.backends import TORCH_DTYPES, BackendConfig, default_dtype
from cosyvoice_fast.engine.engine import Engine
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.serving.memory import TrimWhenIdle
from cosyvoice_fast.serving.metrics import EngineMetrics, health
from cosyvoice_fast.modeldir.files import LoadedModels, find_model_dir, load_models
from cosyvoice_fast.frontend.request import SynthesisRequest
from cosyvoice_fast.telemetry.request_log import WARMUP_PREFIX
from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

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
    _warming: list[str] = field(default_factory=list)
    _warm_lock: threading.Lock = field(default_factory=threading.Lock)
    warmup_error: str | None = None
    startup: Any = None  # engine.startup.StartupProgress: the start-up phases /health shows

    def warm_up_backends(self, backends: list[BackendConfig]) -> None:
        """Build ``backends``' stages now (their graph captures and kernel compiles), counted in the start-up
        progress (``python -m cosyvoice_fast warmup`` fills the compile cache this way)."""
        from cosyvoice_fast.config.graph_plan import planned_graphs

        if self.startup is not None:
            self.startup.plan(planned_graphs(backends, self.engine.config, self.models.config))
        for backend in backends:
            self.engine.stages(backend)

    def health(self) -> dict:
        """Readiness: model, device, backends, whether the engine's worker runs, and what is still warming up
        (served as GET /health; not ready until the warm-up is over)."""
        return health(self)

    def warming(self) -> list[str]:
        """The warm-up steps not done yet (empty when warm or when no warm-up was asked for)."""
        with self._warm_lock:
            return list(self._warming)

    def start_warmup(self, background: bool = True, backends: list[BackendConfig] | None = None
                     ) -> threading.Thread | None:
        """Do the first-use work before users do: the prompt analysis (ONNX sessions, feature filters, tokenizer)
        and one short request through the default backends (first kernels, allocations; graph captures for that
        shape on a GPU).  Without it the first user's request paid 2-8 s on CPU while /health said ready.

        ``/health`` lists the steps still running under ``warming`` and answers 503 until they are done.  The
        warm-up request is logged like any other (id ``warmup-…``) but kept out of the metrics.  Without a frontend
        (no tokenizer / ONNX files) there is nothing to warm: the engine cannot take text."""
        steps = ["frontend", "engine"] if self.frontend is not None else []
        with self._warm_lock:
            self._warming = list(steps)
        if not background:
            self._warm_up(backends)
            return None
        t = threading.Thread(target=self._warm_up, args=(backends,), name="cosyvoice-warmup", daemon=True)
        t.start()
        return t

    def warm_backends(self) -> list[BackendConfig]:
        """The engine's default backends, and on a GPU also what the app selects by default there (``cudagraph``
        where a stage has it, in bf16), so the first user of either meets built stages."""
        from cosyvoice_fast.engine.stages import available_backends

        configs = [self.engine.default_backend]
        ok = {(b.stage, b.name) for b in available_backends(self.models.device, family=self.models.family)
              if b.available}
        if self.models.device.type == "cuda" and ("flow", "cudagraph") in ok:
            pick = {st: "cudagraph" if (st, "cudagraph") in ok else "eager" for st in ("llm", "flow", "vocoder")}
            fast = BackendConfig(llm=pick["llm"], flow=pick["flow"], vocoder=pick["vocoder"], dtype="bf16")
            if fast != configs[0]:
                configs.append(fast)
        return configs

    def _done(self, step: str) -> None:
        with self._warm_lock:
            if step in self._warming:
                self._warming.remove(step)

    def _warm_up(self, backends: list[BackendConfig] | None = None) -> None:
        sr = 16000
        t = np.arange(2 * sr) / sr  # 2 s of a voiced-looking tone: any voice will do to warm the models
        wav = (0.3 * np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
        backends = backends or self.warm_backends()
        try:
            self.warm_up_backends(backends)  # graphs captured (and kernels compiled) before the first request
            if self.startup is not None:
                self.startup.phase("warming up")
            if self.frontend is not None:
                self.frontend.prompt_features(wav, sr)  # type: ignore[attr-defined]
                self._done("frontend")
                for i, backend in enumerate(backends):
                    req = SynthesisRequest(text="Warming up.", mode="cross_lingual", prompt_wav=wav, prompt_sr=sr,
                                           max_tokens=40, ignore_eos=True, backend=backend,
                                           request_id=f"{WARMUP_PREFIX}{i}-{id(self):x}")
                    for _ in self.engine.stream(req):
                        pass
                self._done("engine")
        except Exception as e:  # noqa: BLE001 - a failed warm-up must not stop the server: users get the cold path
            self.warmup_error = f"{type(e).__name__}: {e}"
            log.warning("warm-up failed (%s); serving anyway, the first request will be slower", self.warmup_error)
            if self.startup is not None:
                self.startup.fail(self.warmup_error)
        finally:
            with self._warm_lock:
                self._warming = []
            if self.startup is not None:
                self.startup.phase("ready")
        log.info("warm-up done: ready")

    def close(self) -> None:
        """Shut the engine down: requests still in flight end with "The server is shutting down" (SSE clients get
        an error event, raw audio streams are aborted), and the log says how many."""
        n = self.engine.active_requests()
        log.info("shutting down: %d request(s) in flight end with 'The server is shutting down'", n)
        self.engine.close()


def load_service(model_dir: str | Path | None = None, synthetic: str | None = None, device: str | None = None,
                 dtype: str | None = None, speaker_cache_dir: str | Path | None = "speakers",
                 progress: bool = True, backend: BackendConfig | None = None,
                 engine_config: EngineConfig | None = None, cache_dir: str | Path | None = None) -> Service:
    """Load models, frontend and engine; the banner says exactly what is running.

    ``dtype`` None follows the device (bf16 on CUDA, fp32 on CPU); ``backend`` is the engine's default stage set
    (built now; its dtype is replaced by the one loaded), ``engine_config`` its capacity.  The command-line tools
    get all of these from :func:`cosyvoice_fast.config.flags.from_cli_args` (``RunChoices.service_kwargs()``).
    ``cache_dir``: the compile cache root (None: ``~/.cache/cosyvoice_fast``, :mod:`~cosyvoice_fast.kernels.
    compile_cache`), activated before anything compiles; the start-up phases are tracked from here."""
    from cosyvoice_fast.config.graph_plan import planned_graphs
    from cosyvoice_fast.engine.startup import StartupProgress
    from cosyvoice_fast.kernels.compile_cache import open_for_model

    startup = StartupProgress()
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
    if dev.type == "cuda" or cache_dir is not None:  # the CPU compiles nothing (Triton's interpreter)
        startup.attach_cache(open_for_model(cache_dir, dev, models.config))  # TRITON_CACHE_DIR before compiles
    frontend = None
    if models.files.has_frontend:
        from cosyvoice_fast.frontend.pipeline import Frontend
        from cosyvoice_fast.frontend.prompt_rules import rules_for_family

        frontend = Frontend.from_model_dir(models.files.root, speaker_cache_dir=speaker_cache_dir,
                                           sample_rate=models.config.sample_rate,
                                           rules=rules_for_family(models.family))
    else:
        log.warning("model directory lacks %s: prompt voices are disabled",
                    ", ".join(models.files.missing_frontend_files()))
        banner += " Prompt-voice frontend unavailable (missing " + ", ".join(models.files.missing_frontend_files()) + ")."
    default = replace(backend, dtype=dtype) if backend is not None else BackendConfig(dtype=dtype)
    startup.plan(planned_graphs([default], engine_config or EngineConfig(), models.config))
    startup.phase("capturing graphs")
    engine = Engine(models, frontend=frontend, backend=default, config=engine_config)
    startup.attach_background(engine.background)  # graphs left for after ready: "ready — capturing N/M"
    request_log.attach(engine)
    engine.add_observer(TrimWhenIdle(engine))  # freed heap back to the OS once a burst is over
    metrics = EngineMetrics().attach(engine)
    engine.remove_observer(metrics.observe)  # the start-up warm-up request stays out of the metrics
    engine.add_observer(lambda tele, outcome: None if tele.request_id.startswith(WARMUP_PREFIX)
                        else metrics.observe(tele, outcome))
    return Service(engine=engine, frontend=frontend, models=models, synthetic=is_synth, banner=banner,
                   model_name=("synthetic-" + (synthetic or "tiny")) if is_synth else path.name,
                   metrics=metrics, startup=startup)
