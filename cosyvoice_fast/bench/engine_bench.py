"""GPU benchmark: TTFB p50/p95 and its stage split, LLM ms/token, flow and vocoder ms per chunk, RTF, throughput.

    python -m cosyvoice_fast.bench --synthetic full --backends eager,cudagraph --concurrency 1,4,16 \
        --requests 20 --prompt-tokens 75 --text-tokens 30 --gen-tokens 150 --dtype bf16 --out bench_out

``--synthetic full3`` measures CosyVoice3 (Fun-CosyVoice3-0.5B's sizes) the same way; ``results.json`` names the
family.  Inputs are token ids drawn from a seeded generator (no frontend: it is not what is measured), the LM is forced
to produce exactly ``--gen-tokens`` tokens (EOS ignored) so runs are comparable, and every backend is warmed up
before timing.  Writes ``results.json`` and ``report.html`` (Plotly) to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from cosyvoice_fast.config.backends import BackendConfig
from cosyvoice_fast.config.yamlfile import ConfigError
from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.config.presets import parse_backend
from cosyvoice_fast.bench.gpu_busy import GpuBusy
from cosyvoice_fast.bench.host_cpu import HostCpu
from cosyvoice_fast.frontend.request import ModelInputs, SynthesisRequest
from cosyvoice_fast.telemetry.record import RequestTelemetry, aggregate, percentile

log = logging.getLogger(__name__)

def synthetic_inputs(cfg: Any, prompt_tokens: int, text_tokens: int, seed: int) -> ModelInputs:
    """Random but valid model inputs of the requested sizes (a CosyVoice3 prompt text holds its
    ``<|endofprompt|>`` id mid-way: system part, marker, transcript)."""
    g = torch.Generator().manual_seed(seed)
    vocab_text = cfg.llm.qwen.vocab_size
    speech_vocab = min(cfg.llm.speech_token_size, cfg.flow.vocab_size)
    prompt_text = torch.randint(0, vocab_text, (1, max(1, text_tokens // 2)), generator=g)
    if cfg.llm.endofprompt_id is not None:
        prompt_text[0, prompt_text.shape[1] // 2] = cfg.llm.endofprompt_id
    return ModelInputs(
        text_segments=[torch.randint(0, vocab_text, (1, text_tokens), generator=g)],
        prompt_text=prompt_text,
        llm_prompt_speech_token=torch.randint(0, speech_vocab, (1, prompt_tokens), generator=g),
        flow_prompt_speech_token=torch.randint(0, speech_vocab, (1, prompt_tokens), generator=g),
        prompt_feat=torch.randn(1, 2 * prompt_tokens, 80, generator=g) - 5.0,
        embedding=torch.randn(1, cfg.flow.spk_embed_dim, generator=g),
    )


def write_report(results: dict[str, Any], out: Path) -> None:
    """``report.html`` beside ``results.json``; skipped with a warning where plotly is not installed (GPU
    boxes without the app's dependencies): ``python -m cosyvoice_fast.bench --report DIR`` renders it later."""
    try:
        from cosyvoice_fast.app.report import benchmark_report_html
    except ImportError as e:
        log.warning("no report.html (%s); render it elsewhere with: python -m cosyvoice_fast.bench --report %s",
                    e, out)
        return
    (out / "report.html").write_text(benchmark_report_html(results))


def run_wave(engine: Any, requests: list[SynthesisRequest]) -> list[RequestTelemetry]:
    """Run requests concurrently (one consumer thread each) and return their telemetry."""
    out: list[RequestTelemetry | None] = [None] * len(requests)
    errors: list[BaseException] = []

    def consume(i: int, r: SynthesisRequest) -> None:
        try:
            for ch in engine.stream(r):
                if ch.telemetry is not None:
                    out[i] = ch.telemetry
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [t for t in out if t is not None]


def queue_parts(teles: list[RequestTelemetry]) -> dict[str, dict[str, float]]:
    """The TTFB ``queue`` stage in its two parts, p50/p95: admitted until the LLM side started its prefill
    (``queue_llm_ms``), and the first chunk's tokens ready until the chunk side started its flow
    (``queue_chunk_ms``)."""
    reqs = [t for t in teles if t.chunks]
    llm = [(t.prefill_start - (t.frontend_done if math.isnan(t.admitted) else t.admitted)) * 1e3 for t in reqs]
    chunk = [(t.chunks[0].flow_start - t.chunks[0].tokens_ready) * 1e3 for t in reqs]
    return {name: {"p50": percentile(v, 50), "p95": percentile(v, 95)}
            for name, v in (("queue_llm_ms", llm), ("queue_chunk_ms", chunk))}


def timeline(teles: list[RequestTelemetry], t0: float) -> list[dict[str, Any]]:
    """Every timed request's raw timestamps (:meth:`RequestTelemetry.to_dict`, relative to its receipt) plus
    ``start_s``, its receipt relative to the timed run's start, so the requests can be laid on one time axis
    (which stage waits for which, where the GPU sits idle between waves)."""
    return [{"start_s": t.received - t0, **t.to_dict()} for t in teles]


def bench_config(engine: Any, backend: BackendConfig, concurrency: int, n_requests: int, args: argparse.Namespace,
                 trace: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Warm up, then time ``n_requests`` in waves of ``concurrency`` (a wave starts when the last one ended);
    the aggregate figures.  ``trace``: when given, :func:`timeline` of the timed requests is appended to it."""
    cfg = engine.models.config
    params = StreamParams(token_hop_len_first=args.token_hop_len_first, pre_lookahead_len=args.pre_lookahead_len)

    voice = synthetic_inputs(cfg, args.prompt_tokens, args.text_tokens, seed=0) if args.same_voice else None

    def make(i: int) -> SynthesisRequest:
        inputs = synthetic_inputs(cfg, args.prompt_tokens, args.text_tokens, seed=i)
        if voice is not None:  # another text, the same prompt voice (a saved speaker, a popular voice)
            inputs = replace(inputs, llm_prompt_speech_token=voice.llm_prompt_speech_token,
                             flow_prompt_speech_token=voice.flow_prompt_speech_token, prompt_feat=voice.prompt_feat,
                             embedding=voice.embedding, prompt_key=None)
        return SynthesisRequest(inputs=inputs, seed=i, stream=True, stream_params=params, backend=backend,
                                max_tokens=args.gen_tokens, ignore_eos=True)

    run_wave(engine, [make(10_000 + i) for i in range(max(2, concurrency))])  # warm-up (captures, autotune)
    dev = engine.models.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    teles: list[RequestTelemetry] = []
    with GpuBusy(dev) if getattr(args, "gpu_busy", False) else nullcontext() as busy, HostCpu() as host:
        t0 = time.perf_counter()
        done = 0
        while done < n_requests:
            wave = min(concurrency, n_requests - done)
            teles += run_wave(engine, [make(done + i) for i in range(wave)])
            done += wave
        wall = time.perf_counter() - t0
    if trace is not None:
        trace += timeline(teles, t0)
    agg = aggregate(teles)
    step_ms = [(b - a) * 1e3 for t in teles for a, b in zip(t.token_times[1:], t.token_times[2:])]
    agg["llm_ms_per_token"] = {"p50": percentile(step_ms, 50), "p95": percentile(step_ms, 95)}
    agg["audio_s_per_s"] = sum(t.audio_seconds for t in teles) / wall
    agg["wall_s"] = wall
    agg["gpu_mem_peak_gib"] = (torch.cuda.max_memory_allocated(dev) / 2**30) if dev.type == "cuda" else None
    agg["underruns"] = sum(r["underrun"] for t in teles for r in t.chunk_report())
    agg.update(queue_parts(teles))
    agg.update(host.report())
    if busy is not None:
        agg["gpu_busy_pct"] = busy.percent
        agg["gpu_busy_samples"] = len(busy.samples)
    return agg


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from cosyvoice_fast.config.flags import add_cli_args, from_cli_args

    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast.bench")
    add_cli_args(ap, parts=("model", "device", "engine"))
    ap.add_argument("--backends", default="eager,cudagraph")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=75)
    ap.add_argument("--text-tokens", type=int, default=30)
    ap.add_argument("--gen-tokens", type=int, default=150)
    ap.add_argument("--token-hop-len-first", type=int, default=25)
    ap.add_argument("--pre-lookahead-len", type=int, default=3)
    ap.add_argument("--gpu-busy", action="store_true",
                    help="sample the GPU's busy %% (nvidia-smi utilization.gpu, every 100 ms) while the timed "
                         "requests run; reported as gpu_busy_pct")
    ap.add_argument("--same-voice", action="store_true",
                    help="every request uses the same prompt voice (different text): the incremental flow then "
                         "starts from the voice's cached prompt state; default: a new voice per request")
    ap.add_argument("--timeline", action="store_true",
                    help="also write timeline.json to --out: every timed request's raw stage and chunk timestamps "
                         "on the run's time axis")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--report", metavar="DIR", help="only render DIR/report.html from DIR/results.json")
    a = ap.parse_args(argv)
    if a.report:
        write_report(json.loads((Path(a.report) / "results.json").read_text()), Path(a.report))
        return 0

    from cosyvoice_fast.engine.stages import available_backends
    from cosyvoice_fast.serving.service import load_service

    run = from_cli_args(a, ap)
    levels = [int(x) for x in a.concurrency.split(",")]
    room = run.engine.max_streams + run.engine.queue_limit
    if max(levels) > room:  # a wave the engine cannot hold measures refusals, not the engine
        ap.error(f"--concurrency {max(levels)} is more than the engine holds (--max-streams {run.engine.max_streams} "
                 f"+ --queue-limit {run.engine.queue_limit} = {room}); raise them or lower the concurrency")
    a.dtype = run.dtype  # the device's default when not given: the results and the table say which
    svc = load_service(**run.service_kwargs(), speaker_cache_dir=None, progress=False)
    dev = svc.models.device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    avail = {(b.stage, b.name): b for b in available_backends(dev, family=svc.models.family)}
    results: dict[str, Any] = {"gpu": gpu, "dtype": a.dtype, "model": svc.model_name,
                               "family": svc.models.family, "args": vars(a),
                               "engine_config": asdict(run.engine), "torch": torch.__version__, "runs": []}
    trace: list[dict[str, Any]] | None = [] if a.timeline else None
    try:
        for name in a.backends.split(","):
            try:
                backend = parse_backend(name, a.dtype)
            except ConfigError as e:
                raise SystemExit(str(e)) from None
            missing = [f"{s}:{getattr(backend, s)} ({avail[(s, getattr(backend, s))].reason})"
                       for s in ("llm", "flow", "vocoder") if not avail[(s, getattr(backend, s))].available]
            if missing:
                log.warning("skipping backend %s: %s", name, "; ".join(missing))
                results["runs"].append({"backend": name, "skipped": "; ".join(missing)})
                continue
            for c in levels:
                log.info("backend %s, concurrency %d, %d requests", name, c, a.requests)
                requests: list[dict[str, Any]] | None = [] if a.timeline else None
                agg = bench_config(svc.engine, backend, c, a.requests, a, requests)
                if trace is not None:
                    trace.append({"backend": name, "concurrency": c, "requests": requests})
                results["runs"].append({"backend": name, "concurrency": c, **agg})
                print(_row(name, c, agg), flush=True)
    finally:
        svc.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_finite(results), indent=1))
    if trace is not None:
        (out / "timeline.json").write_text(json.dumps(_finite(trace)))
    write_report(results, out)
    print(f"\nGPU {gpu}, dtype {a.dtype}, prompt {a.prompt_tokens} tokens, text {a.text_tokens} tokens, "
          f"{a.gen_tokens} generated tokens, hop_first {a.token_hop_len_first}, lookahead {a.pre_lookahead_len}")
    print(HEADER)
    for r in results["runs"]:
        if "skipped" not in r:
            print(_row(r["backend"], r["concurrency"], r))
    for r in results["runs"]:
        if r.get("gpu_busy_pct") is not None:
            print(f"{r['backend']} c{r['concurrency']}: GPU busy {r['gpu_busy_pct']:.1f} % of the timed run "
                  f"({r['gpu_busy_samples']} nvidia-smi samples)")
    for r in results["runs"]:
        if r.get("host_cpu_pct") is not None:
            print(f"{r['backend']} c{r['concurrency']}: host CPU {r['host_cpu_pct']:.0f} % of a core "
                  f"(LLM thread {_pct(r.get('llm_thread_cpu_pct'))}, "
                  f"chunk thread {_pct(r.get('chunks_thread_cpu_pct'))})")
    for r in results["runs"]:
        if "queue_llm_ms" in r:
            print(f"{r['backend']} c{r['concurrency']}: TTFB queue p50 {r['queue_llm_ms']['p50']:.1f} ms before the "
                  f"prefill, {r['queue_chunk_ms']['p50']:.1f} ms before the first chunk's flow")
    return 0


HEADER = (f"{'backend':<10}{'conc':>5}{'TTFB p50':>10}{'TTFB p95':>10}{'LLM ms/tok':>11}{'flow ms/ch':>11}"
          f"{'voc ms/ch':>10}{'RTF p50':>9}{'audio s/s':>10}")


def _row(name: str, c: int, agg: dict[str, Any]) -> str:
    return (f"{name:<10}{c:>5}{agg['ttfb_ms']['p50']:>10.1f}{agg['ttfb_ms']['p95']:>10.1f}"
            f"{agg['llm_ms_per_token']['p50']:>11.2f}{agg['flow_ms_per_chunk']['p50']:>11.1f}"
            f"{agg['vocoder_ms_per_chunk']['p50']:>10.1f}{agg['rtf']['p50']:>9.3f}{agg['audio_s_per_s']:>10.2f}")


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} %"


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


if __name__ == "__main__":
    raise SystemExit(main())
