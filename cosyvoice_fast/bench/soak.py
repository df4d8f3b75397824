"""Soak test: many requests, sequential then concurrent, with injected faults; resource figures before and after.

``python -m cosyvoice_fast soak --synthetic tiny --requests 500 --concurrency 8`` (or ``--model-dir DIR`` on a
GPU box) runs the mix below through the full path (frontend with a prompt voice, engine, streaming) and prints
resident memory, open file descriptors, threads and the engine's internal queues before and after, plus the
outcome counts and TTFB percentiles.  It exits with status 1 when a leak bound is exceeded.

The mix, by request number ``i``: every ``cancel_every``-th is closed after its first chunk (a user pressing
Stop or leaving), every ``reject_every``-th has a prompt voice that is too short (refused by the frontend), the
rest alternate streaming and non-streaming.  The first ``warmup`` requests are not measured (allocator pools,
lazily built ONNX sessions and stage sets settle there).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_fast.config.stream import StreamParams
from cosyvoice_fast.frontend.request import SynthesisRequest
from cosyvoice_fast.telemetry.record import percentile


@dataclass
class Resources:
    rss_mb: float
    fds: int
    threads: int
    engine_active: int
    engine_incoming: int
    engine_stage_sets: int
    engine_observers: int
    frontend_lru: int

    @classmethod
    def sample(cls, engine: Any) -> "Resources":
        import psutil

        gc.collect()
        p = psutil.Process()
        fds = p.num_fds() if hasattr(p, "num_fds") else p.num_handles()
        fe = getattr(engine, "frontend", None)
        st = engine.stats()
        return cls(rss_mb=p.memory_info().rss / 2**20, fds=fds, threads=threading.active_count(),
                   engine_active=st["active"], engine_incoming=st["queued"], engine_stage_sets=len(st["stage_sets"]),
                   engine_observers=st["observers"], frontend_lru=len(getattr(fe, "_lru", ()) or ()))


@dataclass
class SoakReport:
    requests: int
    concurrency: int
    wall_s: float
    outcomes: dict[str, int]
    faults_injected: dict[str, int]
    before: Resources  # after the warm-up
    after: Resources
    start: Resources  # before the warm-up
    ttfb_ms_p50: float
    ttfb_ms_p95: float
    unexpected_errors: list[str] = field(default_factory=list)

    @property
    def rss_growth_mb(self) -> float:
        return self.after.rss_mb - self.before.rss_mb

    @property
    def fd_growth(self) -> int:
        return self.after.fds - self.before.fds

    def problems(self, max_rss_growth_mb: float = 50.0, max_fd_growth: int = 2) -> list[str]:
        """Leak bounds that were exceeded (empty when all is well)."""
        out = []
        if self.rss_growth_mb > max_rss_growth_mb:
            out.append(f"RSS grew by {self.rss_growth_mb:.1f} MB (> {max_rss_growth_mb:g})")
        if abs(self.fd_growth) > max_fd_growth:
            out.append(f"open file descriptors changed by {self.fd_growth} (> ±{max_fd_growth})")
        if self.after.engine_active or self.after.engine_incoming:
            out.append(f"engine still holds {self.after.engine_active} active / {self.after.engine_incoming} "
                       "incoming requests")
        for name in ("engine_stage_sets", "engine_observers"):
            if getattr(self.after, name) > getattr(self.before, name):
                out.append(f"{name} grew from {getattr(self.before, name)} to {getattr(self.after, name)}")
        if self.after.threads > self.before.threads + 1:
            out.append(f"threads grew from {self.before.threads} to {self.after.threads}")
        out += [f"unexpected error: {e}" for e in self.unexpected_errors[:5]]
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rss_growth_mb"], d["fd_growth"] = self.rss_growth_mb, self.fd_growth
        return d

    def format(self) -> str:
        b, a, s = self.before, self.after, self.start
        lines = [f"soak: {self.requests} requests, concurrency {self.concurrency}, {self.wall_s:.1f} s",
                 f"outcomes: {json.dumps(self.outcomes)}; faults injected: {json.dumps(self.faults_injected)}",
                 f"TTFB p50 {self.ttfb_ms_p50:.1f} ms, p95 {self.ttfb_ms_p95:.1f} ms",
                 f"{'':<22}{'start':>10}{'warm':>10}{'end':>10}"]
        for k in ("rss_mb", "fds", "threads", "engine_active", "engine_incoming", "engine_stage_sets",
                  "engine_observers", "frontend_lru"):
            f = "{:>10.1f}" if k == "rss_mb" else "{:>10d}"
            lines.append(f"{k:<22}" + "".join(f.format(getattr(r, k)) for r in (s, b, a)))
        problems = self.problems()
        lines.append("OK: no growth beyond the bounds" if not problems else "PROBLEMS: " + "; ".join(problems))
        return "\n".join(lines)


def test_prompt(path: Path, seconds: float = 1.0, sr: int = 16000, seed: int = 0) -> Path:
    """A short voiced test prompt written to ``path`` (a harmonic tone with noise: any voice will do here)."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    wav = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.3 * rng.standard_normal(t.size))
    sf.write(path, wav.astype(np.float32), sr)
    return path


test_prompt.__test__ = False  # not a pytest test


def run_soak(engine: Any, requests: int = 200, concurrency: int = 4, max_tokens: int = 8, warmup: int = 8,
             prompt: str | Path | None = None, cancel_every: int = 7, reject_every: int = 11,
             text: str = "Soak test, sentence one.", stream_params: StreamParams | None = None) -> SoakReport:
    """Run ``requests`` requests (half one at a time, half ``concurrency`` at once) on ``engine``.

    Requests to be cancelled stream in 2-token chunks (so they are cut mid-stream); the others use
    ``stream_params`` (default: 4-token chunks, no look-ahead)."""
    tmp = tempfile.TemporaryDirectory(prefix="cosyvoice_soak_")
    if prompt is None:
        prompt = test_prompt(Path(tmp.name) / "prompt.wav")
    short = test_prompt(Path(tmp.name) / "short.wav", seconds=0.2)  # refused: under the 0.5 s minimum
    lock = threading.Lock()
    outcomes: dict[str, int] = {"ok": 0, "cancelled": 0, "rejected": 0, "error": 0}
    faults = {"cancel_after_first_chunk": 0, "too_short_prompt": 0}
    ttfbs: list[float] = []
    unexpected: list[str] = []
    params = stream_params or StreamParams(token_hop_len_first=4, token_hop_len=4, pre_lookahead_len=0)
    cancel_params = StreamParams(token_hop_len_first=2, token_hop_len=2, pre_lookahead_len=0)

    def one(i: int) -> None:
        cancel = cancel_every > 0 and i % cancel_every == cancel_every - 1
        reject = not cancel and reject_every > 0 and i % reject_every == reject_every - 1
        req = SynthesisRequest(text=text, mode="cross_lingual", prompt_wav=str(short if reject else prompt),
                               seed=i, stream=i % 2 == 0 or cancel, stream_params=cancel_params if cancel else params,
                               max_tokens=max_tokens,
                               ignore_eos=True)
        try:
            it = engine.stream(req)
        except ValueError as e:
            with lock:
                outcomes["rejected"] += 1
                if reject:
                    faults["too_short_prompt"] += 1
                else:
                    unexpected.append(f"request {i} refused: {e}")
            return
        try:
            n = 0
            for ch in it:
                n += 1
                if cancel:
                    break
                if ch.telemetry is not None:
                    with lock:
                        ttfbs.append(ch.telemetry.ttfb * 1e3)
        except Exception as e:  # noqa: BLE001 - counted and reported
            with lock:
                outcomes["error"] += 1
                unexpected.append(f"request {i} failed: {type(e).__name__}: {e}")
            return
        finally:
            it.close()
        with lock:
            if cancel:
                outcomes["cancelled"] += 1
                faults["cancel_after_first_chunk"] += 1
            else:
                outcomes["ok"] += 1

    try:
        start = Resources.sample(engine)
        for i in range(warmup):
            one(i)
        _settle(engine)
        for d in (outcomes, faults):  # the warm-up's outcomes are not part of the figures
            d.update(dict.fromkeys(d, 0))
        ttfbs.clear()
        before = Resources.sample(engine)
        t0 = time.perf_counter()
        half = requests // 2
        for i in range(half):
            one(warmup + i)
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="soak") as pool:
            list(pool.map(one, range(warmup + half, warmup + requests)))
        wall = time.perf_counter() - t0
        _settle(engine)
        after = Resources.sample(engine)
    finally:
        tmp.cleanup()
    return SoakReport(requests=requests, concurrency=concurrency, wall_s=wall, outcomes=outcomes,
                      faults_injected=faults, before=before, after=after, start=start,
                      ttfb_ms_p50=percentile(ttfbs, 50), ttfb_ms_p95=percentile(ttfbs, 95),
                      unexpected_errors=unexpected)


def _settle(engine: Any, timeout: float = 10.0) -> None:
    """Wait until cancelled requests have been dropped by the worker."""
    deadline = time.monotonic() + timeout
    while engine.active_requests() and time.monotonic() < deadline:
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast soak", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return cmd_soak(ap.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cosyvoice_fast.config.flags import add_cli_args

    add_cli_args(p)
    p.add_argument("--requests", type=int, default=500, help="measured requests (default 500)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--max-tokens", type=int, default=25, help="speech tokens per request (25 = 1 s of audio)")
    p.add_argument("--warmup", type=int, default=16,
                   help="requests run first and not measured (allocator pools, first kernels; default 16)")
    p.add_argument("--prompt-wav", help="prompt voice (default: a generated 1 s test tone)")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0,
                   help="fail when resident memory grows more than this over the measured requests (default 50)")
    p.add_argument("--json", help="also write the report here")


def cmd_soak(a: argparse.Namespace) -> int:
    from cosyvoice_fast.config.flags import from_cli_args
    from cosyvoice_fast.serving.service import load_service

    if a.requests < 2 or a.concurrency < 1:
        print("error: --requests must be at least 2 and --concurrency at least 1", file=sys.stderr)
        return 2
    try:
        run = from_cli_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="cosyvoice_soak_speakers_") as spk:
        svc = load_service(**run.service_kwargs(), speaker_cache_dir=spk, progress=False)
        try:
            if svc.frontend is None:
                print("error: the soak needs a model directory with the frontend files (prompt voices)",
                      file=sys.stderr)
                return 2
            rep = run_soak(svc.engine, requests=a.requests, concurrency=a.concurrency, max_tokens=a.max_tokens,
                           warmup=a.warmup, prompt=a.prompt_wav)
        finally:
            svc.close()
    print(rep.format())
    if a.json:
        Path(a.json).write_text(json.dumps(rep.to_dict(), indent=1))
    return 1 if rep.problems(max_rss_growth_mb=a.max_rss_growth_mb) else 0


if __name__ == "__main__":
    sys.exit(main())
