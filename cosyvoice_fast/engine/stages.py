"""Stage backends: eager (the reference), cudagraph, fused (Triton kernels inside
the graphs), tensorrt (flow estimator), trtllm (speech LM).

Which implementation serves a (family, backend) is each stage folder's own table (``llm/runners.py``,
``flow/runners.py``, ``vocoder/runners.py``: what to build, whether it can run here, a note where a name means
another runner for a family); this factory only asks them, so nothing in the engine names a model family.

Stage implementations are built once per (stage, backend, dtype) and shared by every stage set that names them:
switching only the vocoder (the app's A/B tab) reuses the LLM and flow already built, instead of a second LLM
with its own KV cache and graphs.  :class:`StageCache` keeps a bounded number per stage.
"""

from __future__ import annotations

import copy
import gc
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.engine import EngineConfig
from cosyvoice_fast.config.backends import BACKEND_CHOICES, BackendInfo, BackendUnavailable
from cosyvoice_fast.flow import runners as flow_runners
from cosyvoice_fast.kernels.graphs import CAPTURE_LOCK
from cosyvoice_fast.flow.stage import FlowStage
from cosyvoice_fast.llm import runners as llm_runners
from cosyvoice_fast.llm.stage import LLMStage
from cosyvoice_fast.vocoder import runners as vocoder_runners
from cosyvoice_fast.vocoder.stage import VocoderStage

log = logging.getLogger(__name__)


@dataclass
class StageSet:
    """The three stage implementations one request runs on."""

    config: BackendConfig
    llm: LLMStage
    flow: FlowStage
    vocoder: VocoderStage

StageKey = tuple[str, str, str]  # (stage, implementation, dtype); the vocoder's dtype is always fp32 (HiFT)


def family_of_models(models: Any) -> str:
    """The model family of ``models`` (``LoadedModels.family``); stand-ins without one are CosyVoice2's."""
    return getattr(models, "family", "cosyvoice2")


def stage_keys(config: BackendConfig, family: str = "cosyvoice2") -> dict[str, StageKey]:
    """The key of each stage ``config`` needs: configs that build the same object get the same key (the runner
    each stage folder's table resolves the backend to: the flow's ``incremental`` flag picks another runner, the
    eager flow's is named ``incremental``; tensorrt and CosyVoice3's graph runners ignore the flag; CosyVoice3's
    fused vocoder is its cudagraph runner; HiFT always runs in fp32)."""
    flow = flow_runners.runner_for(family, config.flow, config.incremental)
    return {"llm": ("llm", config.llm, config.dtype), "flow": ("flow", flow, config.dtype),
            "vocoder": ("vocoder", vocoder_runners.runner_for(family, config.vocoder), "fp32")}


def _build_llm(models: Any, name: str, llm: torch.nn.Module, dtype: torch.dtype, engine: EngineConfig) -> Any:
    return llm_runners.build_llm(family_of_models(models), models, name, llm, dtype, engine)


def _build_flow(models: Any, name: str, flow: torch.nn.Module, engine: EngineConfig) -> Any:
    return flow_runners.build_flow(family_of_models(models), models, name, flow, engine)


def _build_vocoder(models: Any, name: str, engine: EngineConfig) -> Any:
    return vocoder_runners.build_vocoder(family_of_models(models), models, name, engine)


def out_of_memory_advice(stage: str, engine: EngineConfig, error: BaseException) -> str:
    """What to lower when building ``stage`` (its start-up graph captures, its KV cache) ran out of GPU memory:
    the settings that size it, with their values, then the first line of torch's own message."""
    knobs = {"llm": (("llm_slots", "--llm-slots"), ("max_context", "--max-context")),
             "flow": (("flow_buckets", "--flow-buckets"), ("flow_rows", "--flow-rows")),
             "vocoder": (("vocoder_rows", "--vocoder-rows"),)}.get(stage, ())
    named = ", ".join(f"{field}={getattr(engine, field)!r} ({flag})" for field, flag in knobs)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"building the {stage} stage ran out of GPU memory: the capacity settings ask for more than this GPU "
            f"has free ({named}); lower them, or free the GPU of other work. torch said: {first}")


class StageCache:
    """Built stage implementations of one engine, at most ``engine_config.stage_variants`` per stage.

    ``get(config)`` returns a :class:`StageSet` whose three members are shared with every other set naming the
    same (stage, backend, dtype).  Past the bound the least recently used implementation is dropped, with every
    cached set that holds it (requests still running on it keep it alive until they finish).  Weights cast to
    another dtype are shared by all implementations of that dtype and freed with the last of them.
    Thread-safe: builds are serialised (two first requests for one config build it once), and the views
    (``configs``, ``stage_names``: health checks and metrics scrapes) never wait for a build, which may capture
    graphs for seconds.
    """

    def __init__(self, models: Any, engine_config: EngineConfig | None = None):
        self.models = models
        self.engine_config = engine_config or EngineConfig()
        self._stages: OrderedDict[StageKey, Any] = OrderedDict()
        self._sets: OrderedDict[BackendConfig, StageSet] = OrderedDict()
        self._casts: weakref.WeakValueDictionary[tuple[str, torch.dtype], torch.nn.Module] = \
            weakref.WeakValueDictionary()
        self._failed: dict[StageKey, str] = {}  # stages whose build raised (not retried: see _stage)
        self._deferred: list[Any] = []  # built runners' captures left for the background (take_deferred)
        self._lock = threading.Lock()  # guards the dicts; held only briefly
        self._build_lock = threading.Lock()  # one build at a time

    def _hit(self, config: BackendConfig) -> StageSet | None:
        with self._lock:
            hit = self._sets.get(config)
            if hit is not None:
                self._sets.move_to_end(config)
                for key in stage_keys(config, family_of_models(self.models)).values():
                    self._stages.move_to_end(key)
            return hit

    def get(self, config: BackendConfig) -> StageSet:
        hit = self._hit(config)
        if hit is not None:
            return hit
        with self._build_lock:
            hit = self._hit(config)  # built by another thread while this one waited
            if hit is not None:
                return hit
            keys = stage_keys(config, family_of_models(self.models))
            dtype = config.torch_dtype
            if dtype != self.models.dtype and self.models.device.type == "cpu" and dtype != torch.float32:
                raise ValueError(f"dtype {config.dtype} is for GPUs; on CPU use fp32")
            try:
                llm = self._stage(keys["llm"], lambda: _build_llm(self.models, keys["llm"][1],
                                                                  self._cast("llm", dtype), dtype, self.engine_config))
                flow = self._stage(keys["flow"], lambda: _build_flow(self.models, keys["flow"][1],
                                                                     self._cast("flow", dtype), self.engine_config))
                voc = self._stage(keys["vocoder"],
                                  lambda: _build_vocoder(self.models, keys["vocoder"][1], self.engine_config))
                built = StageSet(config=config, llm=llm, flow=flow, vocoder=voc)
                with self._lock:
                    self._sets[config] = built
            finally:  # also when a later stage failed to build: the bound holds either way
                with self._lock:
                    self._evict()
            return built

    def _stage(self, key: StageKey, build: Callable[[], Any]) -> Any:
        with self._lock:
            stage = self._stages.get(key)
            if stage is not None:
                self._stages.move_to_end(key)
                return stage
            failed = self._failed.get(key)
        if failed is not None:
            raise BackendUnavailable(f"the {key[0]} stage ({key[1]} backend, {key[2]}) failed to build earlier in "
                                     f"this process ({failed}); choose another backend, or restart to retry")
        log.info("building the %s stage: %s backend, %s", *key)
        try:
            with CAPTURE_LOCK:  # outside the view lock: captures may take seconds; never beside a background one
                stage = build()
        except BackendUnavailable:
            raise  # a refusal before anything was built: cheap to ask again, and the message says why
        except Exception as e:
            if isinstance(e, torch.OutOfMemoryError):  # the capacity settings, not the backend, are at fault
                e = torch.OutOfMemoryError(out_of_memory_advice(key[0], self.engine_config, e))
            # A build that fails half-way (a kernel out of shared memory during capture, out of memory) is not
            # retried by every later request: each retry took seconds and leaked what the failed build had
            # allocated (its frames live on in the traceback).  Drop those frames and give the memory back.
            with self._lock:
                self._failed[key] = f"{type(e).__name__}: {e}"[:300]
            log.error("building the %s stage (%s backend, %s) failed: %s", *key, self._failed[key])
            e = e.with_traceback(None)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise e
        with self._lock:
            self._stages[key] = stage
            self._deferred.extend(getattr(stage, "deferred", None) or ())
        return stage

    def take_deferred(self) -> list[Any]:
        """The captures built runners left for after ready (``kernels.graphs.DeferredCapture``), handed over once."""
        with self._lock:
            out, self._deferred = self._deferred, []
            return out

    def _cast(self, part: str, dtype: torch.dtype) -> torch.nn.Module:
        module = getattr(self.models, part)
        if dtype == self.models.dtype:
            return module
        cast = self._casts.get((part, dtype))
        if cast is None:
            cast = copy.deepcopy(module).to(dtype)
            self._casts[(part, dtype)] = cast
        return cast

    def _evict(self) -> None:
        limit = self.engine_config.stage_variants
        for stage in ("llm", "flow", "vocoder"):
            keys = [k for k in self._stages if k[0] == stage]  # least recently used first
            for key in keys[:max(0, len(keys) - limit)]:
                gone = self._stages.pop(key)
                log.info("dropping the %s stage (%s backend, %s): more than %d built", *key, limit)
                for cfg in [c for c, s in self._sets.items() if getattr(s, stage) is gone]:
                    del self._sets[cfg]

    # ---- views for stats() and health -----------------------------------------------------------------------
    def configs(self) -> list[BackendConfig]:
        """The backend configs whose stage sets are cached, least recently used first."""
        with self._lock:
            return list(self._sets)

    def llm_stages(self) -> list[Any]:
        """The built LLM implementations (their slot counts feed ``Engine.stats``)."""
        with self._lock:
            return [s for k, s in self._stages.items() if k[0] == "llm"]

    def stage_names(self) -> list[str]:
        """Built implementations as ``stage/backend/dtype`` strings, least recently used first."""
        with self._lock:
            return ["/".join(k) for k in self._stages]

    def __iter__(self) -> Iterator[BackendConfig]:
        return iter(self.configs())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sets)

    def __contains__(self, config: object) -> bool:
        with self._lock:
            return config in self._sets


def build_stage_set(models: Any, config: BackendConfig, engine_config: EngineConfig | None = None) -> StageSet:
    """A stand-alone stage set for ``config`` over ``models`` (cast copies where the dtype differs).  An engine
    uses its :class:`StageCache` instead, so that sets share their stages."""
    return StageCache(models, engine_config).get(config)


#: stage -> its folder's table: family -> backend -> (why it cannot run here, or None; a note)
_TABLES = {"llm": llm_runners.BACKENDS, "flow": flow_runners.BACKENDS, "vocoder": vocoder_runners.BACKENDS}


def available_backends(device: torch.device | str, engines_dir: str | Path = "engines",
                       family: str = "cosyvoice2") -> list[BackendInfo]:
    """Every (stage, backend) pair of ``family`` with whether it can run on ``device`` and, if not, the reason
    (each backend asked through its stage folder's table), in :data:`BACKEND_CHOICES` order."""
    dev, engines = torch.device(device), Path(engines_dir)
    out = []
    for stage, names in BACKEND_CHOICES.items():
        table = _TABLES[stage].get(family)
        if table is None:
            raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(_TABLES[stage])}")
        for name in names:
            why, note = table[name]
            reason = why(dev, engines)
            out.append(BackendInfo(stage, name, reason is None, reason or "", note))
    return out


def check_available(config: BackendConfig, device: torch.device | str, family: str = "cosyvoice2") -> None:
    """Raise :class:`BackendUnavailable` naming the first stage whose chosen backend cannot run here (for
    ``family``'s models)."""
    infos = {(b.stage, b.name): b for b in available_backends(device, family=family)}
    for stage in ("llm", "flow", "vocoder"):
        name = getattr(config, stage)
        info = infos.get((stage, name))
        if info is None or not info.available:
            why = info.reason if info else "not implemented for this stage"
            raise BackendUnavailable(f"{stage} backend {name!r} is unavailable: {why}. Choose 'eager' instead.")
