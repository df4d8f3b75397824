"""One set of flags for every tool that loads a model: parsing, the device-following dtype, errors naming flags."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest
import torch

from cosyvoice_fast.config.flags import (
    ENGINE_HELP, SWITCH_ALIASES, CliError, add_cli_args, flag, from_cli_args, pick_device,
)
from cosyvoice_fast.config.backends import BackendConfig, default_dtype
from cosyvoice_fast.config.engine import EngineConfig


def parse(argv: list[str], **kw) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="t")
    add_cli_args(ap, **kw)
    return ap, ap.parse_args(argv)


def choices(argv: list[str], **kw):
    return from_cli_args(parse(argv, **kw)[1])


@pytest.fixture
def fake_gpu(monkeypatch):
    """A machine that says it has one CUDA GPU (nothing is run on it: only the choices are resolved)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_every_engine_config_field_has_a_flag_and_help():
    ap, _ = parse([])
    declared = {a.dest: a.option_strings for a in ap._actions}
    for f in fields(EngineConfig):
        assert declared[f.name] == [flag(f.name), *SWITCH_ALIASES.get(f.name, ())], f.name
        assert ENGINE_HELP[f.name], f.name
    assert set(ENGINE_HELP) == {f.name for f in fields(EngineConfig)}


def test_engine_flags_build_the_engine_config():
    run = choices(["--max-streams", "8", "--llm-slots", "6", "--max-context", "1024", "--queue-limit", "0",
                   "--flow-buckets", "50,100", "--flow-rows", "1,2", "--vocoder-rows", "1", "--cuda-streams", "1",
                   "--no-capture-at-start", "--llm-memory-fraction", "0.5", "--stage-variants", "2",
                   "--first-chunk-wait-ms", "0", "--later-chunk-wait-ms", "5", "--no-first-chunk-priority"])
    assert run.engine == EngineConfig(max_streams=8, llm_slots=6, max_context=1024, queue_limit=0,
                                      flow_buckets=(50, 100), flow_rows=(1, 2), vocoder_rows=(1,), cuda_streams=1,
                                      capture_at_start=False, llm_memory_fraction=0.5, stage_variants=2,
                                      first_chunk_wait_ms=0.0, later_chunk_wait_ms=5.0, first_chunk_priority=False)


def test_no_engine_flags_give_the_defaults_and_auto_slots():
    assert choices([]).engine == EngineConfig()
    assert choices(["--llm-slots", "auto"]).engine.llm_slots is None


@pytest.mark.parametrize("argv, message", [
    (["--max-streams", "0"], "--max-streams must be a positive integer, got 0"),
    (["--flow-rows", "4,2"], "--flow-rows must be strictly increasing"),
    (["--max-context", "10"], "--max-context must be at least 64"),
    (["--cuda-streams", "3"], "--cuda-streams must be 1 or 2"),
    (["--llm-slots", "0"], "--llm-slots must be a positive integer or None"),
    (["--queue-limit", "-1"], "--queue-limit must be an integer >= 0"),
    (["--llm-memory-fraction", "1.5"], "--llm-memory-fraction must be a number in (0, 1]"),
    (["--first-chunk-wait-ms", "-1"], "--first-chunk-wait-ms must be a number of milliseconds in [0, 1000]"),
    (["--later-chunk-wait-ms", "2000"], "--later-chunk-wait-ms must be a number of milliseconds in [0, 1000]"),
    (["--stage-variants", "0"], "--stage-variants must be a positive integer"),
    (["--model-dir", "/m", "--synthetic", "tiny"], "--model-dir /m and --synthetic tiny name two models"),
    (["--device", "cpu", "--dtype", "bf16"], "--dtype bf16 needs a CUDA GPU"),
    (["--device", "nonsense"], "--device 'nonsense' is not a device"),
])
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(CliError) as e:
        choices(argv)
    assert message in str(e.value)
    assert "EngineConfig." not in str(e.value)


def test_with_a_parser_the_error_is_a_usage_error(capsys):
    ap, a = parse(["--flow-buckets", "100,50"])
    with pytest.raises(SystemExit) as e:
        from_cli_args(a, ap)
    assert e.value.code == 2
    assert "t: error: --flow-buckets must be strictly increasing" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--flow-rows", "1,x"], "argument --flow-rows: expected comma-separated integers like 1,2,4, got '1,x'"),
    (["--llm-slots", "many"], "argument --llm-slots: expected a positive integer or 'auto', got 'many'"),
    (["--max-streams", "2.5"], "argument --max-streams: expected an integer, got '2.5'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--llm-backend", "fast"], "argument --llm-backend: invalid choice: 'fast'"),
])
def test_unparseable_values_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_dtype_follows_the_device_on_cpu():
    run = choices(["--device", "cpu"])
    assert run.device == torch.device("cpu") and run.dtype == "fp32" and run.backend.dtype == "fp32"
    assert default_dtype("cpu") == "fp32" and default_dtype("cuda:0") == "bf16"


def test_dtype_follows_the_device_on_a_gpu(fake_gpu):
    run = choices([])  # --device auto
    assert run.device.type == "cuda" and run.dtype == "bf16" and run.backend.dtype == "bf16"
    assert choices(["--dtype", "fp16"]).dtype == "fp16"
    with pytest.raises(CliError, match=r"--device cuda:3: this machine has 1 CUDA GPU"):
        pick_device("cuda:3")


def test_backend_flags_set_the_default_stage_set():
    run = choices(["--llm-backend", "cudagraph", "--flow-backend", "cudagraph", "--recompute-flow"])
    assert run.backend == BackendConfig(llm="cudagraph", flow="cudagraph", vocoder="eager", dtype="fp32",
                                        incremental=False)
    # parts a tool did not ask for are not declared, and their values are the defaults
    ap, a = parse([], parts=("model", "device"))
    assert not any(o in ap._option_string_actions for o in ("--llm-backend", "--max-streams"))
    assert from_cli_args(a).engine == EngineConfig() and from_cli_args(a).backend == BackendConfig()


def test_service_kwargs_carry_every_choice():
    kw = choices(["--synthetic", "tiny", "--max-streams", "5"]).service_kwargs()
    assert kw == {"model_dir": None, "synthetic": "tiny", "device": "cpu", "dtype": "fp32",
                  "backend": BackendConfig(), "engine_config": EngineConfig(max_streams=5),
                  "cache_dir": None}


def test_a_tools_synthetic_default_yields_to_model_dir():
    assert choices([], synthetic_default="full").synthetic == "full"
    run = choices(["--model-dir", "/models/cv2"], synthetic_default="full")
    assert run.synthetic is None and run.model_dir == "/models/cv2"
    assert choices([]).synthetic is None  # no default: load_service looks for pretrained_models/


def test_every_tool_declares_the_shared_flags(monkeypatch):
    import app
    from cosyvoice_fast.cli import main as cli
    from cosyvoice_fast.bench import soak

    assert app.parse_args(["--max-streams", "3", "--device", "cpu"]).run.engine.max_streams == 3
    ap = argparse.ArgumentParser()
    soak.add_arguments(ap)
    assert from_cli_args(ap.parse_args(["--queue-limit", "7"])).engine.queue_limit == 7
    # the CLI resolves the flags before loading anything: a bad value costs no model load
    monkeypatch.setattr("cosyvoice_fast.serving.service.load_service", lambda **kw: pytest.fail("loaded a model"))
    assert cli.main(["synth", "--synthetic", "tiny", "--text", "hi", "--max-streams", "0"]) == 2
    assert cli.main(["speaker-state", "bob", "--synthetic", "tiny", "--dtype", "bf16", "--device", "cpu"]) == 2


def test_bench_runs_on_cpu_without_a_dtype_flag(tmp_path):
    """Issue 14: ``bench --synthetic tiny --backends eager`` refused on a CPU ("dtype bf16 is for GPUs")."""
    from cosyvoice_fast.bench import engine_bench as bench

    out = tmp_path / "b"
    assert bench.main(["--synthetic", "tiny", "--backends", "eager", "--concurrency", "1", "--requests", "2",
                       "--prompt-tokens", "10", "--text-tokens", "4", "--gen-tokens", "6", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["dtype"] == "fp32" and res["gpu"] == "cpu"
    assert res["engine_config"]["max_streams"] == EngineConfig().max_streams
    (run,) = res["runs"]
    assert run["backend"] == "eager" and run["concurrency"] == 1 and run["n"] == 2


def test_bench_timeline_lays_every_timed_request_on_one_time_axis(tmp_path):
    """``--timeline`` writes each timed request's stage and chunk timestamps with its start in the run."""
    from cosyvoice_fast.bench import engine_bench as bench
    from cosyvoice_fast.config.schedule import StreamParams, plan

    out = tmp_path / "t"
    assert bench.main(["--synthetic", "tiny", "--backends", "eager", "--concurrency", "2", "--requests", "4",
                       "--prompt-tokens", "10", "--text-tokens", "4", "--gen-tokens", "50", "--timeline",
                       "--out", str(out)]) == 0
    (run,) = json.loads((out / "timeline.json").read_text())
    assert (run["backend"], run["concurrency"], len(run["requests"])) == ("eager", 2, 4)
    n_chunks = len(plan(10, 50, StreamParams()))
    starts = sorted(r["start_s"] for r in run["requests"])
    assert starts[0] >= 0 and starts[2] > starts[1]  # two waves: the second starts after the first
    for r in run["requests"]:
        assert len(r["token_times"]) == 50 and len(r["chunks"]) == n_chunks
        assert r["frontend_done"] <= r["prefill_start"] <= r["prefill_done"] <= r["token_times"][0]
        for c in r["chunks"]:
            assert c["tokens_ready"] <= c["flow_start"] <= c["flow_end"] <= c["vocoder_end"] <= c["delivered"]
        assert r["chunks"][-1]["finalize"] and r["chunks"][-1]["delivered"] <= r["finished"]
    assert n_chunks == 2 and "timeline" not in json.loads((out / "results.json").read_text())


def test_switches_on_by_default_get_a_no_flag():
    assert flag("capture_at_start") == "--no-capture-at-start"
    assert flag("first_chunk_priority") == "--no-first-chunk-priority"
    assert flag("first_chunk_wait_ms") == "--first-chunk-wait-ms"
    assert choices(["--no-first-chunk-priority"]).engine == EngineConfig(first_chunk_priority=False)
    with pytest.raises(ValueError, match=r"EngineConfig.first_chunk_priority must be True or False, got 0"):
        EngineConfig(first_chunk_priority=0)
