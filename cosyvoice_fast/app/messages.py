"""What a user is told when a request fails: the library's own message (written for users), never a server path,
and never a traceback in the server log for a user's mistake."""

from __future__ import annotations

import re

import gradio as gr

# An absolute path inside a message: POSIX (/tmp/gradio/ab12/x.wav) or Windows (C:\\Users\\...\\x.wav), quoted or not.
_ABS_PATH = re.compile(r"(?<![\w.:/\\])(?:[A-Za-z]:[\\/]|/)(?:[^\s'\"/\\]+[\\/])+([^\s'\"/\\]*)")


def redact_paths(text: str) -> str:
    """Replace every absolute path in ``text`` by its file name: messages shown to users must not reveal the
    server's directories (Gradio's upload cache, the model directory, the home directory)."""
    return _ABS_PATH.sub(lambda m: m.group(1) or "<path>", text)


def user_error(message: str) -> gr.Error:
    """The error a user sees in the page or ``gradio_client``.  Gradio would print a traceback for each one; a user
    mistake is not a server failure, so the request log's one line is all the server log gets."""
    return gr.Error(message, print_exception=False)


SHUTTING_DOWN = "The server is shutting down, so this request was stopped. Try again once it is back."


def user_message(e: BaseException) -> str:
    """The user-facing text of ``e`` (library messages are written for users), without server paths."""
    return redact_paths(str(e)) or type(e).__name__
