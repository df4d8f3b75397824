"""The login of the ``/v1`` routes: the page's Gradio session cookie, ``Authorization: Bearer user:password``
(the ``openai`` client's ``api_key``) or HTTP Basic, checked in constant time against ``--auth``'s accounts."""

from __future__ import annotations

import base64
import binascii
import secrets
from typing import Any, Callable

from fastapi import WebSocketException
from fastapi.requests import HTTPConnection

from cosyvoice_fast.serving.speech_request import ApiError


def auth_dependency(app: Any, auth: Any) -> Callable:
    """A FastAPI dependency accepting the page's Gradio session cookie, ``Authorization: Bearer user:password``
    or HTTP Basic with one of ``auth``'s accounts (a ``(user, password)`` pair or a list of them)."""
    pairs = [auth] if isinstance(auth, tuple) and len(auth) == 2 and isinstance(auth[0], str) else list(auth)
    accounts = {str(u): str(p) for u, p in pairs}

    def valid(user: str, password: str) -> bool:
        ok = accounts.get(user)
        return ok is not None and secrets.compare_digest(ok.encode(), password.encode())

    async def check(request: HTTPConnection) -> None:  # a Request, or the WebSocket of the bi-streaming route
        header = request.headers.get("authorization", "")
        scheme, _, cred = header.partition(" ")
        if scheme.lower() == "bearer" and valid(*_split(cred.strip())):
            return
        if scheme.lower() == "basic":
            try:
                if valid(*_split(base64.b64decode(cred.strip()).decode())):
                    return
            except (binascii.Error, UnicodeDecodeError):
                pass
        tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
        if tokens is not None and cookie_id is not None:
            for name in (f"access-token-{cookie_id}", f"access-token-unsecure-{cookie_id}"):
                if request.cookies.get(name) in tokens:
                    return
        if request.scope.get("type") == "websocket":  # refused at the handshake; a close reason holds 123 bytes
            raise WebSocketException(code=1008, reason="not authenticated: send Authorization: Bearer user:password")
        raise ApiError(401, "not authenticated: this server runs with --auth; send 'Authorization: Bearer "
                            "user:password' (the openai client's api_key='user:password') or log in to the page",
                       code="invalid_api_key")

    return check


def _split(cred: str) -> tuple[str, str]:
    user, _, password = cred.partition(":")
    return user, password
