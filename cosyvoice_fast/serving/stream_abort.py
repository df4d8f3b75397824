"""Aborting a raw audio response that already started, with one log line instead of a traceback.

Once the headers of a ``pcm``/``wav``/``mp3`` stream are out, a failure (the engine shut down, a request error, an
encoder failure) can no longer become an HTTP status, and ending the body cleanly would hand the client a cut-off
utterance that looks complete.  The only honest signal is a broken transfer: the response raises, and the server
(uvicorn) closes the connection without the final chunk.  uvicorn also logs every exception that leaves an ASGI
app as "Exception in ASGI application" with its traceback, at ERROR, although this one is expected and was
already logged as one line where it happened.  :class:`StreamAborted` marks such an abort, and the filter that
:func:`quiet_stream_aborts` puts on uvicorn's error logger drops exactly those records (any other exception keeps
its traceback).
"""

from __future__ import annotations

import logging

UVICORN_ERROR_LOGGER = "uvicorn.error"


class StreamAborted(Exception):
    """Raised out of a started audio response to abort its transfer; the reason was logged where it arose."""


class _DropStreamAborted(logging.Filter):
    """Drops a record whose exception is a :class:`StreamAborted` (uvicorn's traceback of an intended abort)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, StreamAborted)


_FILTER = _DropStreamAborted()


def quiet_stream_aborts() -> None:
    """Install the filter on uvicorn's error logger (idempotent; every server in the process logs there)."""
    logger = logging.getLogger(UVICORN_ERROR_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
