"""Server memory after load (issue 60): start `python app.py --synthetic tiny`, stream speech over HTTP at a steady
concurrency for --minutes, then a burst of --burst streams at once, then idle; print the server's RSS at the end of
the first minute, after the soak, after the burst and after the idle, and exit 1 if the last exceeds the first
minute's by more than --margin-mb.

    python benchmarks/memory_soak.py --minutes 10 --concurrency 8 --burst 96 --margin-mb 150
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one(client: httpx.AsyncClient, url: str, tokens: int) -> bool:
    body = {"model": "cosyvoice2", "voice": "zero_shot_prompt", "input": "Memory soak, one more sentence.",
            "response_format": "pcm", "max_tokens": tokens}
    try:
        async with client.stream("POST", url + "/v1/audio/speech", json=body, timeout=300) as r:
            async for _ in r.aiter_bytes():
                pass
            return r.status_code == 200
    except httpx.HTTPError:
        return False


async def run(args: argparse.Namespace, pid: int, url: str) -> dict:
    out: dict = {"ok": 0, "failed": 0}
    async with httpx.AsyncClient() as client:
        deadline = time.monotonic() + 60 * args.minutes
        first_minute = time.monotonic() + 60

        async def worker() -> None:
            while time.monotonic() < deadline:
                out["ok" if await one(client, url, args.tokens) else "failed"] += 1

        async def sampler() -> None:
            await asyncio.sleep(max(0.0, first_minute - time.monotonic()))
            out["rss_first_minute_mb"] = rss_mb(pid)

        await asyncio.gather(sampler(), *(worker() for _ in range(args.concurrency)))
        out["rss_after_soak_mb"] = rss_mb(pid)
        results = await asyncio.gather(*(one(client, url, args.tokens) for _ in range(args.burst)))
        out["burst_ok"] = sum(results)
        out["rss_after_burst_mb"] = rss_mb(pid)
    await asyncio.sleep(args.idle)
    out["rss_after_idle_mb"] = rss_mb(pid)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the steady soak")
    ap.add_argument("--concurrency", type=int, default=8, help="streams in flight during the soak")
    ap.add_argument("--burst", type=int, default=96, help="streams started at once after the soak")
    ap.add_argument("--tokens", type=int, default=50, help="speech tokens per request (25 = 1 s of audio)")
    ap.add_argument("--idle", type=float, default=15.0, help="seconds of idle before the last reading")
    ap.add_argument("--margin-mb", type=float, default=150.0, help="allowed growth over the first minute's RSS")
    ap.add_argument("--port", type=int, default=7873)
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "app.py", "--synthetic", "tiny", "--port", str(args.port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).json().get("ready"):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        out = asyncio.run(run(args, server.pid, url))
    finally:
        server.terminate()
        server.wait(30)
    out["growth_mb"] = out["rss_after_idle_mb"] - out["rss_first_minute_mb"]
    out["margin_mb"] = args.margin_mb
    print(json.dumps(out, indent=1))
    return 0 if out["growth_mb"] <= args.margin_mb and out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
