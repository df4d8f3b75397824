"""The requests the serving benchmarks send and how they sum them up, shared by :mod:`cosyvoice_fast.bench.serve`
(one engine in-process against one Ray Serve replica) and :mod:`cosyvoice_fast.bench.ray_scale` (N replicas).

Both sides of every comparison get the very same request (text, saved voice, seed, token cap), so one request
body, one saved voice, one load generator and one summary serve both benchmarks; a result is a dict per request
(``ttfb_s``, ``audio_s``, ``replica``, ``end`` and, when it failed, ``error``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from cosyvoice_fast.telemetry.record import percentile

VOICE = "bench"
SAMPLE_RATE = 24000


def body(i: int, gen_tokens: int, hop_first: int) -> dict:
    """Request ``i``'s JSON body for ``/v1/audio/speech`` (raw PCM, so bytes / 2 / rate are audio seconds)."""
    return {"input": f"benchmark sentence number {i}, long enough to be a typical request.", "voice": VOICE,
            "seed": i, "max_tokens": gen_tokens, "token_hop_len_first": hop_first, "response_format": "pcm"}


def speak(client: Any, url: str, i: int, gen_tokens: int, hop_first: int,
          on_first: Callable[[dict], None] | None = None) -> dict:
    """One streamed request: ``status``, ``replica``, ``ttfb_s``, ``audio_s``, ``end`` (monotonic) and, when it
    failed, ``error`` (an HTTP status with its message, or the broken transfer)."""
    out: dict[str, Any] = {"i": i, "ttfb_s": float("nan"), "audio_s": 0.0}
    t0 = time.perf_counter()
    n = 0
    try:
        with client.stream("POST", f"{url}/v1/audio/speech", json=body(i, gen_tokens, hop_first)) as r:
            out.update(status=r.status_code, replica=r.headers.get("x-replica"),
                       retry_after=r.headers.get("retry-after"))
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                return out
            for data in r.iter_raw():
                if data and n == 0:
                    out["ttfb_s"] = time.perf_counter() - t0
                    if on_first is not None:
                        on_first(out)
                n += len(data)
    except Exception as e:  # noqa: BLE001 - a broken stream is a result here
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["end"] = time.monotonic()
        out["audio_s"] = n / 2 / SAMPLE_RATE
    return out


def in_process(svc: Any, gen_tokens: int, hop_first: int) -> Callable[[int], dict]:
    """The same request as :func:`speak`, to the engine of the loaded service ``svc`` in this process."""
    from cosyvoice_fast.config.stream import StreamParams
    from cosyvoice_fast.frontend.request import SynthesisRequest

    def one(i: int) -> dict:
        b = body(i, gen_tokens, hop_first)
        req = SynthesisRequest(text=b["input"], mode="speaker", speaker=VOICE, seed=i, max_tokens=gen_tokens,
                               stream_params=StreamParams(token_hop_len_first=hop_first))
        out: dict[str, Any] = {"i": i, "ttfb_s": float("nan"), "audio_s": 0.0, "replica": "in-process"}
        t0 = time.perf_counter()
        try:
            for chunk in svc.engine.stream(req):
                if out["ttfb_s"] != out["ttfb_s"]:
                    out["ttfb_s"] = time.perf_counter() - t0
                out["audio_s"] += len(chunk.samples) / SAMPLE_RATE
        except Exception as e:  # noqa: BLE001 - a failed request is a result here
            out["error"] = f"{type(e).__name__}: {e}"
        out["end"] = time.monotonic()
        return out

    return one


def run_load(fn: Callable[[int], dict], first: int, n: int, concurrency: int) -> tuple[list[dict], float]:
    """``fn(i)`` for i in first..first+n-1, ``concurrency`` at a time; the results and the wall time."""
    out: list[dict] = []
    lock = threading.Lock()
    todo = iter(range(first, first + n))

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            r = fn(i)
            with lock:
                out.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def summarize(results: list[dict], wall_s: float) -> dict:
    """TTFB p50/p95/max (ms) of the successful requests, audio-s/s, errors and the per-replica split."""
    ok = [r for r in results if "error" not in r]
    ttfb = [r["ttfb_s"] * 1e3 for r in ok]
    split: dict[str, int] = {}
    for r in results:
        key = r.get("replica") or "none"
        split[key] = split.get(key, 0) + 1
    errors = [r["error"] for r in results if "error" in r]
    return {"requests": len(results), "ok": len(ok), "errors": len(errors), "error_samples": errors[:3],
            "ttfb_p50_ms": percentile(ttfb, 50), "ttfb_p95_ms": percentile(ttfb, 95),
            "ttfb_max_ms": max(ttfb, default=float("nan")), "wall_s": wall_s,
            "audio_s_per_s": sum(r["audio_s"] for r in ok) / wall_s if wall_s > 0 else float("nan"),
            "per_replica": dict(sorted(split.items(), key=lambda kv: -kv[1]))}


def save_voice(svc: Any, opts: Any, prompt_wav: str | None, seconds: float) -> None:
    """Save the ``bench`` voice into the replicas' speaker directory: ``seconds`` of ``prompt_wav`` (or of noise,
    seeded: the synthetic model's audio is noise anyway, and the GPU box has no audio decoders), through the loaded
    service's frontend or, without one, a bare frontend of ``opts``' model."""
    import numpy as np

    if svc is not None:
        frontend = svc.frontend
    else:
        from cosyvoice_fast.frontend.pipeline import Frontend
        from cosyvoice_fast.modeldir.synthetic import synthetic_model_dir

        root = opts.model_dir or synthetic_model_dir(opts.synthetic or "tiny")
        frontend = Frontend.from_model_dir(root, speaker_cache_dir=opts.speaker_dir)
    if prompt_wav:
        from cosyvoice_fast.frontend.audio import load_audio

        wav, sr = load_audio(prompt_wav)
    else:
        sr = SAMPLE_RATE
        wav = np.random.default_rng(0).standard_normal(int(seconds * sr)).astype(np.float32) * 0.1
    frontend.add_speaker(VOICE, wav[: int(seconds * sr)], sr, "a short transcript")
