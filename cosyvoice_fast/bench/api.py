"""First byte of ``POST /v1/audio/speech`` at an ``openai`` client against the engine's TTFB of the same request.

``python -m cosyvoice_fast.bench.api --synthetic tiny --device cpu --runs 5`` starts the app in-process on a free
port, warms it up, then streams ``--runs`` requests one after another and prints, per run and as p50: the
client's first byte (from sending the request), the server's TTFB (from the API handler's start, i.e. with the
body reading as ``app_queue``) and the engine's TTFB (from the engine receiving the request).  JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from typing import Any

from cosyvoice_fast.telemetry.record import percentile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(base_url: str, runs: int, fmt: str, extra: dict[str, Any], voice: str) -> list[dict[str, float]]:
    import httpx
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    out = []
    for i in range(runs + 1):  # the first request warms the prompt cache and is dropped
        t0 = time.perf_counter()
        first = None
        with client.audio.speech.with_streaming_response.create(
                model="cosyvoice2", voice=voice, input="Measuring the first byte of the speech API.",
                response_format=fmt, extra_body=extra) as resp:
            for _ in resp.iter_bytes():
                first = first or time.perf_counter() - t0
            rid = resp.headers["x-request-id"]
        tele = httpx.get(f"{base_url}/v1/requests/{rid}/telemetry", timeout=30).json()["telemetry"]
        bd = tele["derived"]["ttfb_breakdown_ms"]
        server = tele["derived"]["ttfb_ms"]
        if i:
            out.append({"client_first_byte_ms": first * 1e3, "server_ttfb_ms": server,
                        "engine_ttfb_ms": server - bd["app_queue"], "app_queue_ms": bd["app_queue"]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cosyvoice_fast.bench.api", description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--format", default="pcm")
    ap.add_argument("--voice", default="zero_shot_prompt")
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--hop-first", type=int, default=10)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.app.page import build_demo, serve

    svc = load_service(None, synthetic=a.synthetic, device=a.device, progress=False, speaker_cache_dir=None)
    demo = build_demo(svc)
    port = _free_port()
    serve(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True)
    try:
        runs = measure(f"http://127.0.0.1:{port}", a.runs, a.format,
                       {"max_tokens": a.max_tokens, "token_hop_len_first": a.hop_first}, a.voice)
    finally:
        demo.close()
        svc.close()
    keys = list(runs[0])
    print("  ".join(f"{k:>22}" for k in keys))
    for r in runs:
        print("  ".join(f"{r[k]:>22.1f}" for k in keys))
    p50 = {k: percentile([r[k] for r in runs], 50) for k in keys}
    print("p50 " + "  ".join(f"{k}={v:.1f}" for k, v in p50.items()))
    print(f"p50 client first byte - engine TTFB: "
          f"{percentile([r['client_first_byte_ms'] - r['engine_ttfb_ms'] for r in runs], 50):.1f} ms")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(a), "runs": runs, "p50": p50}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
