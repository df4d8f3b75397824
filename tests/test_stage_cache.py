"""Stage implementations are built once per (stage, backend, dtype), shared across stage sets, and bounded."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

from cosyvoice_fast.engine import stages as backends
from cosyvoice_fast.engine.stages import StageCache, stage_keys
from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.config.engine import EngineConfig


class Built:
    """A stand-in stage that records what it was built from."""

    def __init__(self, stage: str, name: str, module: object = None):
        self.stage, self.name, self.module = stage, name, module


@pytest.fixture
def counting(monkeypatch):
    """Replace the three builders with cheap recorders (the cudagraph ones need a GPU); return the build log."""
    log: list[tuple[str, str]] = []

    def llm(models, name, module, dtype, engine):
        log.append(("llm", name))
        return Built("llm", name, module)

    def flow(models, name, module, engine):
        log.append(("flow", name))
        return Built("flow", name, module)

    def voc(models, name, engine):
        log.append(("vocoder", name))
        return Built("vocoder", name)

    monkeypatch.setattr(backends, "_build_llm", llm)
    monkeypatch.setattr(backends, "_build_flow", flow)
    monkeypatch.setattr(backends, "_build_vocoder", voc)
    return log


def fake_models(dtype: torch.dtype = torch.float32):
    return types.SimpleNamespace(llm=torch.nn.Linear(2, 2).to(dtype), flow=torch.nn.Linear(2, 2).to(dtype),
                                 hift=torch.nn.Linear(2, 2), dtype=dtype, device=torch.device("cpu"), config=None)


def test_switching_only_the_vocoder_reuses_llm_and_flow(counting):
    cache = StageCache(fake_models())
    a = cache.get(BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="eager"))
    b = cache.get(BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="cudagraph"))
    assert b.llm is a.llm and b.flow is a.flow and b.vocoder is not a.vocoder
    assert counting == [("llm", "cudagraph"), ("flow", "cudagraph-incremental"), ("vocoder", "eager"),
                        ("vocoder", "cudagraph")]  # one LLM (one KV cache), one flow
    assert cache.get(BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="eager")) is a  # the set itself too
    assert len(counting) == 4


def test_flow_keys_name_what_is_built():
    def key(**kw):
        return stage_keys(BackendConfig(**kw))["flow"][1]

    assert key(flow="eager") == "incremental"  # the eager flow's incremental runner
    assert key(flow="eager", incremental=False) == "eager"
    assert key(flow="cudagraph") == "cudagraph-incremental" and key(flow="cudagraph", incremental=False) == "cudagraph"
    assert key(flow="fused") == "fused-incremental" and key(flow="fused", incremental=False) == "fused"
    assert key(flow="tensorrt") == key(flow="tensorrt", incremental=False) == "tensorrt"
    assert stage_keys(BackendConfig(dtype="bf16"))["vocoder"] == ("vocoder", "eager", "fp32")  # HiFT stays fp32


def test_the_old_incremental_flow_name_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="flow backend 'incremental' is not a separate backend: use flow='eager' "
                                          "with incremental=True"):
        BackendConfig(flow="incremental")


def test_the_cache_stays_bounded_per_stage(counting):
    cache = StageCache(fake_models(), EngineConfig(stage_variants=2))
    first = cache.get(BackendConfig(llm="eager"))
    cache.get(BackendConfig(llm="cudagraph"))
    cache.get(BackendConfig(llm="trtllm"))  # a third LLM: the least recently used (eager) goes
    assert sorted(cache.stage_names()) == ["flow/incremental/fp32", "llm/cudagraph/fp32", "llm/trtllm/fp32",
                                           "vocoder/eager/fp32"]
    assert BackendConfig(llm="eager") not in cache and len(cache) == 2  # the set holding it went with it
    again = cache.get(BackendConfig(llm="eager"))  # rebuilt on demand; cudagraph is now the oldest LLM
    assert again.llm is not first.llm and again.flow is first.flow
    assert [k for k in cache.stage_names() if k.startswith("llm/")] == ["llm/trtllm/fp32", "llm/eager/fp32"]
    assert [n for s, n in counting if s == "llm"] == ["eager", "cudagraph", "trtllm", "eager"]


def test_a_hit_refreshes_recency(counting):
    cache = StageCache(fake_models(), EngineConfig(stage_variants=2))
    cache.get(BackendConfig(llm="eager"))
    cache.get(BackendConfig(llm="cudagraph"))
    cache.get(BackendConfig(llm="eager"))  # used again: cudagraph is now the oldest
    cache.get(BackendConfig(llm="trtllm"))
    assert [k for k in cache.stage_names() if k.startswith("llm/")] == ["llm/eager/fp32", "llm/trtllm/fp32"]


def test_cast_weights_are_shared_per_dtype_and_freed_with_their_last_user(counting):
    models = fake_models(torch.bfloat16)  # stands for a GPU model loaded in bf16; fp32 copies are made on demand
    cache = StageCache(models, EngineConfig(stage_variants=1))
    a = cache.get(BackendConfig(llm="eager", dtype="fp32"))
    b = cache.get(BackendConfig(llm="eager", dtype="fp32", vocoder="cudagraph"))
    assert a.llm.module is b.llm.module and a.llm.module.weight.dtype == torch.float32
    assert a.llm.module is not models.llm
    cast = weakref.ref(a.llm.module)
    c = cache.get(BackendConfig(llm="eager", dtype="bf16"))  # the model's own dtype: no copy
    assert c.llm.module is models.llm
    del a, b
    gc.collect()
    assert cast() is None  # the fp32 LLM was evicted and nothing else held its weights


def test_cpu_refuses_half_precision_stages(counting):
    with pytest.raises(ValueError, match="dtype bf16 is for GPUs; on CPU use fp32"):
        StageCache(fake_models()).get(BackendConfig(dtype="bf16"))


def test_engine_stages_share_real_stages_and_report_them():
    """The real eager stages of the synthetic tiny model, through Engine.stages and Engine.stats."""
    from cosyvoice_fast.engine.engine import Engine
    from cosyvoice_fast.modeldir.files import load_models
    from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

    models = load_models(synthetic_model_dir("tiny"), device="cpu", progress=False)
    with Engine(models, config=EngineConfig(stage_variants=2)) as eng:
        inc = eng.stages(BackendConfig())
        rec = eng.stages(BackendConfig(incremental=False))
        assert rec.llm is inc.llm and rec.vocoder is inc.vocoder and rec.flow is not inc.flow
        st = eng.stats()
        assert sorted(st["stages_built"]) == ["flow/eager/fp32", "flow/incremental/fp32", "llm/eager/fp32",
                                              "vocoder/eager/fp32"]
        assert st["stage_sets"] == ["eager/eager/eager/fp32", "eager/eager/eager/fp32"]
        assert st["stage_variants"] == 2 and st["max_active"] == 64
        assert {c["incremental"] for c in st["stage_configs"]} == {False, True}


def test_views_do_not_wait_for_a_build(counting, monkeypatch):
    """A health check or metrics scrape during a long build (graph capture) answers at once."""
    import threading

    started, release = threading.Event(), threading.Event()

    def slow_flow(models, name, module, engine):
        started.set()
        assert release.wait(10)
        return Built("flow", name, module)

    cache = StageCache(fake_models())
    cache.get(BackendConfig())
    monkeypatch.setattr(backends, "_build_flow", slow_flow)
    t = threading.Thread(target=cache.get, args=(BackendConfig(incremental=False),))
    t.start()
    try:
        assert started.wait(10)
        views: list = []  # read in a daemon thread: a view that waited for the build would hang the test
        reader = threading.Thread(target=lambda: views.append((cache.configs(), cache.stage_names())), daemon=True)
        reader.start()
        reader.join(10)
        assert views, "a view waited for the build to finish"
        assert views[0][0] == [BackendConfig()] and "llm/eager/fp32" in views[0][1]
    finally:
        release.set()
        t.join(10)
    assert len(cache) == 2


def test_a_failed_build_keeps_the_bound(counting, monkeypatch):
    cache = StageCache(fake_models(), EngineConfig(stage_variants=1))
    cache.get(BackendConfig())

    def broken(models, name, engine):
        raise RuntimeError("no GPU")

    monkeypatch.setattr(backends, "_build_vocoder", broken)
    with pytest.raises(RuntimeError, match="no GPU"):
        cache.get(BackendConfig(llm="cudagraph", vocoder="cudagraph"))
    assert [k for k in cache.stage_names() if k.startswith("llm/")] == ["llm/cudagraph/fp32"]
    assert len(cache) == 0  # the set holding the evicted eager LLM went with it


def test_a_stage_that_fails_to_build_is_not_rebuilt_and_frees_what_it_held(counting, monkeypatch):
    """A build that fails half-way (a Triton kernel out of shared memory while capturing) used to be retried by
    every request, each retry leaking the failed build's allocations through the traceback's frames."""
    held: list[weakref.ref] = []

    class Half:
        """What a builder allocates before it fails (its KV cache)."""

    def llm(models, name, module, dtype, engine):
        counting.append(("llm", name))
        if name != "fused":
            return Built("llm", name, module)
        cache = Half()
        held.append(weakref.ref(cache))
        raise RuntimeError("out of resource: shared memory, Required: 352512")

    monkeypatch.setattr(backends, "_build_llm", llm)
    cache = StageCache(fake_models())
    with pytest.raises(RuntimeError, match="shared memory"):
        cache.get(BackendConfig(llm="fused"))
    gc.collect()
    assert held[0]() is None  # nothing of the failed build stays alive
    with pytest.raises(backends.BackendUnavailable,
                       match=r"llm stage \(fused backend, fp32\) failed to build earlier in this process "
                             r"\(RuntimeError: out of resource: shared memory.*choose another backend"):
        cache.get(BackendConfig(llm="fused", vocoder="cudagraph"))
    assert counting == [("llm", "fused")]  # built once, not again
    assert cache.get(BackendConfig(llm="eager")).llm.name == "eager"  # other backends still build
    assert ("llm", "eager") in counting


def test_out_of_memory_while_building_names_the_capacity_settings(counting, monkeypatch):
    """Start-up captures sized beyond the GPU (e.g. ``--flow-rows 1,2,4,8,16,32``) fail with the settings to lower."""
    def flow(models, name, module, engine):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 44.00 MiB.\nmore detail")

    monkeypatch.setattr(backends, "_build_flow", flow)
    cache = StageCache(fake_models(), EngineConfig(flow_rows=(1, 2, 32)))
    with pytest.raises(torch.OutOfMemoryError) as err:
        cache.get(BackendConfig(flow="cudagraph"))
    msg = str(err.value)
    assert msg.startswith("building the flow stage ran out of GPU memory")
    assert "flow_rows=(1, 2, 32) (--flow-rows)" in msg and "flow_buckets=(50, 100" in msg
    assert msg.endswith("torch said: CUDA out of memory. Tried to allocate 44.00 MiB.")
