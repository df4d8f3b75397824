"""cosyvoice_fast web app: ``python app.py`` (see ``--help``).

Loads a model directory (or a synthetic random-weight model when none is found, announced in a banner) and serves
the Gradio UI of :mod:`cosyvoice_fast.app.page`: streamed synthesis, a live latency dashboard and an A/B tab.
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    """``python app.py``'s options (each with a help text: tests/test_cli.py walks them)."""
    from cosyvoice_fast.config.flags import add_cli_args

    ap = argparse.ArgumentParser(prog="python app.py", description=__doc__.splitlines()[0])
    add_cli_args(ap)  # --model-dir, --synthetic, --device, --dtype, default backends, engine capacity
    ap.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for every interface)")
    ap.add_argument("--port", type=int, default=7860, help="port to listen on (default 7860)")
    ap.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    ap.add_argument("--auth", metavar="USER:PASS", help="require this login")
    ap.add_argument("--speaker-cache", default="speakers", metavar="DIR", help="where saved voices are kept")
    ap.add_argument("--concurrency", type=int, default=4, help="requests synthesised at the same time")
    ap.add_argument("--max-queue", type=int, default=32, help="waiting requests beyond which users are turned away")
    ap.add_argument("--backend-url", metavar="URL", help="front a Serve cluster (python -m cosyvoice_fast serve --ray)"
                                                         " at URL instead of loading a model here")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from cosyvoice_fast.config.flags import from_cli_args

    ap = build_parser()
    a = ap.parse_args(argv)
    if a.auth is not None and (":" not in a.auth or not a.auth.split(":", 1)[0]):
        ap.error("--auth must look like user:password")
    if a.concurrency < 1 or a.max_queue < 1:
        ap.error("--concurrency and --max-queue must be at least 1")
    a.run = from_cli_args(a, ap)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        print("error: torch is not installed. Run `python install.py`: it installs the CPU or CUDA build that fits "
              "this machine, then the rest of requirements.txt.", file=sys.stderr)
        return 2
    from cosyvoice_fast.app.launch import PortInUse, check_port, serve_until_stopped, setup_logging

    setup_logging()
    try:
        check_port(a.host, a.port)  # before the model loads: a taken port should cost seconds, not a model load
    except PortInUse as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.app.page import build_demo

    logging.getLogger(__name__).info("loading the model …")
    try:
        if a.backend_url:
            from cosyvoice_fast.serving.remote import connect

            svc = connect(a.backend_url)
        else:
            svc = load_service(**a.run.service_kwargs(), speaker_cache_dir=a.speaker_cache, progress=True)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(svc.banner, flush=True)  # after the loading bar has closed: never on the bar's line
    svc.start_warmup()  # /health answers 503 with what is still warming until it is done
    auth = tuple(a.auth.split(":", 1)) if a.auth else None
    try:
        serve_until_stopped(build_demo(svc), svc, host=a.host, port=a.port, share=a.share, auth=auth,
                            concurrency=a.concurrency, max_queue=a.max_queue)
    except PortInUse as e:
        svc.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
