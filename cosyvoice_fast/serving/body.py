"""Reading an API request body safely: counted while it streams, JSON nesting bounded, every parse error an
:class:`ApiError` in the API's own shape (never FastAPI's ``{"detail"}`` and never a 500).

A body without ``Content-Length`` (chunked) is refused with 413 the moment its running count passes the limit, so
a client cannot make the server buffer hundreds of MB before the size check.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.exceptions import HTTPException

from cosyvoice_fast.serving.speech_request import MAX_BODY_BYTES, ApiError, bad

MAX_JSON_DEPTH = 32  # the deepest body the API has is 3 levels (backends inside the body)


def too_large(size: str) -> ApiError:
    return ApiError(413, f"request body is {size}; at most {MAX_BODY_BYTES // 2**20} MB are accepted (the prompt "
                         "audio should be 3 to 10 s)", param="prompt_audio", code="body_too_large")


async def read_raw(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole body, refused (413) as soon as it is known or counted to exceed ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise too_large(f"{int(length) / 2**20:.1f} MB")
    parts, total = [], 0
    async for piece in request.stream():
        total += len(piece)
        if total > limit:
            raise too_large(f"larger than {limit / 2**20:.1f} MB")
        parts.append(piece)
    raw = b"".join(parts)
    request._body = raw  # starlette's form parser reads the cached body instead of the (consumed) stream
    return raw


async def read_body(request: Request) -> dict[str, Any]:
    """JSON or a form (multipart with file part ``prompt_audio``, or urlencoded) -> a dict."""
    raw = await read_raw(request)
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data") or ctype.startswith("application/x-www-form-urlencoded"):
        try:
            form = await request.form(max_part_size=MAX_BODY_BYTES)
            out: dict[str, Any] = {}
            for key, value in form.multi_items():
                out[key] = await value.read() if hasattr(value, "read") else value
        except HTTPException as e:  # starlette's multipart errors (bad boundary, too many parts...)
            raise bad("body", f"the form could not be read: {e.detail}: send multipart/form-data with the fields "
                              "as parts (prompt_audio as a file part)", code="invalid_form") from None
        except (ValueError, KeyError, AssertionError) as e:
            raise bad("body", f"the form could not be read ({type(e).__name__}): send a well-formed "
                              "multipart/form-data body", code="invalid_form") from None
        if isinstance(out.get("backends"), str) and out["backends"].startswith("{"):
            out["backends"] = parse_json(out["backends"].encode(), "backends")
        return out
    return parse_json(raw, "body")


def parse_json(raw: bytes, param: str) -> Any:
    """``raw`` as JSON; 400 naming ``param`` when it is not JSON or nests deeper than :data:`MAX_JSON_DEPTH`
    (the parser's own recursion guard catches absurd depths; the bound is checked on the result without
    recursion)."""
    depth_error = bad(param, f"{param} nests deeper than {MAX_JSON_DEPTH} levels: send a flat JSON object",
                      code="too_deep")
    try:
        value = json.loads(raw or b"null")
    except RecursionError:
        raise depth_error from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(param, f"{param} is not valid JSON ({e.msg if hasattr(e, 'msg') else e}): send a JSON object "
                         "with Content-Type: application/json") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise depth_error
    return value


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, iteratively (stops early once past the bound)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > MAX_JSON_DEPTH:
                return deepest
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest
