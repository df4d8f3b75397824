"""Starting and stopping the app's server the way an operator expects (used by ``app.py``).

- A taken port is found *before* the model loads (seconds to minutes), and the message names our flag
  (``--port``), not Gradio's ``GRADIO_SERVER_PORT`` / ``launch()`` parameters.
- Gradio's own start-up lines ("set `share=True` in `launch()`") are replaced by ours (``--share``).
- Log lines and tqdm bars share one terminal: logging goes through ``tqdm.write`` so a bar is never cut in two.
- Shutdown (Ctrl-C, SIGTERM) first fails every open request, so each client stream ends with a message instead of
  hanging, gives Gradio a moment to deliver those errors, then closes the server.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class PortInUse(RuntimeError):
    """The port the app should listen on is taken; the message says what to do."""


def port_message(host: str, port: int, why: str = "is already in use") -> str:
    return (f"port {port} on {host} {why} (another app.py or server?). Start with another port, e.g. "
            f"--port {port + 1}, or stop the program that holds it.")


def check_port(host: str, port: int) -> None:
    """Raise :class:`PortInUse` when ``host:port`` cannot be listened on.  Binds the way uvicorn does
    (SO_REUSEADDR, so a socket of a just-stopped server in TIME_WAIT is not mistaken for a live one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise PortInUse(f"--host {host}: cannot resolve this address ({e.strerror}). Use an address of this "
                        "machine, e.g. 127.0.0.1 or 0.0.0.0.") from e
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
            s.listen(1)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(port_message(host, port)) from e
            if e.errno == errno.EACCES:
                raise PortInUse(port_message(host, port, "needs administrator rights (ports below 1024)")) from e
            raise PortInUse(f"cannot listen on {host}:{port} ({e.strerror}); check --host and --port") from e


def setup_logging(level: int = logging.INFO) -> None:
    """Log lines through ``tqdm.write``: a line logged while a progress bar is drawn goes above the bar instead of
    being glued to it."""
    from tqdm import tqdm

    class TqdmHandler(logging.StreamHandler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                tqdm.write(self.format(record), file=self.stream)
            except Exception:  # noqa: BLE001 - logging must never raise
                self.handleError(record)

    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore"):  # Gradio's own start-up probes: one line per HTTP call otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)


def urls_message(local_url: str, share_url: str | None, share: bool) -> str:
    """Our start-up lines in place of Gradio's."""
    lines = [f"Running on {local_url.rstrip('/')}  (health: {local_url.rstrip('/')}/health)"]
    if share_url:
        lines.append(f"Public link: {share_url}  (temporary; anyone with it can use the app: consider --auth)")
    elif share:
        lines.append("Could not create the public link (see above); the app runs locally.")
    else:
        lines.append("For a public gradio.live link, restart with --share (add --auth user:pass to protect it).")
    return "\n".join(lines)


def shutdown(demo: Any, service: Any, grace_s: float = 3.0) -> None:
    """Fail every open request (each stream ends with "the server is shutting down"), let Gradio send those
    errors for up to ``grace_s`` seconds, then close the server."""
    service.close()  # the engine fails its open requests with EngineClosed; the handlers turn that into messages
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _busy(demo):
        time.sleep(0.05)
    demo.close()


def _busy(demo: Any) -> bool:
    """Whether Gradio's queue still has events in flight (best effort: the attribute is Gradio's own)."""
    queue = getattr(demo, "_queue", None)
    jobs = getattr(queue, "active_jobs", None) or []
    return any(j for j in jobs)


def serve_until_stopped(demo: Any, service: Any, *, host: str, port: int, share: bool, **serve_kwargs: Any) -> None:
    """Launch (quietly), print our URL lines, wait for Ctrl-C or SIGTERM, then shut down gracefully."""
    from cosyvoice_fast.app.page import serve

    try:
        _, local_url, share_url = serve(demo, host=host, port=port, share=share, prevent_thread_lock=True,
                                        quiet=True, **serve_kwargs)
    except OSError as e:  # the port was taken between the early check and now
        raise PortInUse(port_message(host, port)) from e
    print(urls_message(local_url, share_url, share), flush=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
        log.info("shutting down: ending open requests")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutdown(demo, service)
