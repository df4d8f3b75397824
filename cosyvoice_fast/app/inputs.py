"""Input widgets whose API is honest and whose refusals name the field.

Gradio checks slider bounds and dropdown choices itself, before our handler runs, with messages that do not say
which input was wrong ("Value 0 is less than minimum value 1.", "Value: cudagraph is not in the list of choices:
['eager']") and a server traceback for each.  These subclasses do the same checks with our messages: the field's
API name, the allowed range, and for a backend that cannot run here, the reason.  Whole-number sliders are typed
``integer`` in ``view_api()`` and a fractional value is refused instead of being silently truncated.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import gradio as gr

from cosyvoice_fast.telemetry.request_log import log_refused


def _refuse(message: str) -> gr.Error:
    """A user mistake: the message reaches the client, the server logs one line (no traceback)."""
    log_refused("-", "-", 0, message)
    return gr.Error(message, print_exception=False)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def check_number(field: str, payload: Any, minimum: float, maximum: float, integer: bool) -> int | float:
    """``payload`` as an int (``integer``) or float within [minimum, maximum], else a message naming ``field``."""
    kind = "a whole number" if integer else "a number"
    span = f"from {_fmt(minimum)} to {_fmt(maximum)}"
    if isinstance(payload, bool) or not isinstance(payload, (int, float)) or not math.isfinite(payload):
        raise _refuse(f"{field}={payload!r} is not {kind}: use {kind} {span}.")
    if integer and not float(payload).is_integer():
        raise _refuse(f"{field}={payload!r} must be a whole number {span} (it is not rounded for you).")
    if not minimum <= payload <= maximum:
        raise _refuse(f"{field}={_fmt(payload)} is out of range: use {kind} {span}.")
    return int(payload) if integer else float(payload)


def _bind(component: gr.components.Component, **methods: Any) -> Any:
    """Replace methods on this one component.  Not a subclass: Gradio writes a ``.pyi`` stub beside the module of
    every Component subclass, and sends the parent's widget and parameters only for its own classes."""
    for name, fn in methods.items():
        setattr(component, name, fn)
    return component


def field_slider(minimum: float, maximum: float, value: float, *, field: str, step: float = 1,
                **kw: Any) -> gr.Slider:
    """A slider for the API field ``field``; whole-number steps make it an ``integer`` input."""
    integer = float(step).is_integer() and float(minimum).is_integer()
    kind = "whole number" if integer else "number"
    slider = gr.Slider(minimum, maximum, value, step=step, precision=0 if integer else None, **kw)
    return _bind(slider,
                 preprocess=lambda payload: check_number(field, payload, minimum, maximum, integer),
                 api_info=lambda: {"type": "integer" if integer else "number",
                                   "description": f"{kind} from {_fmt(minimum)} to {_fmt(maximum)}"})


def field_number(value: int, *, field: str, minimum: int, maximum: int, **kw: Any) -> gr.Number:
    """A whole-number box (the seed) with our range message."""
    box = gr.Number(value, precision=0, minimum=minimum, maximum=maximum, **kw)
    return _bind(box, preprocess=lambda payload: None if payload is None
                 else int(check_number(field, payload, minimum, maximum, True)))


def _check_choice(field: str, payload: Any, choices: Sequence[Any], unavailable: Mapping[str, str]) -> Any:
    if payload is None or payload in choices:
        return payload
    allowed = ", ".join(repr(c) for c in choices)
    if isinstance(payload, str) and payload in unavailable:
        raise _refuse(f"{field}={payload!r} is not available here: {unavailable[payload]}. Choose {allowed}.")
    raise _refuse(f"{field}={payload!r} is not one of the choices: {allowed}.")


def field_dropdown(choices: Sequence[Any], *, field: str, unavailable: Mapping[str, str] | None = None,
                  **kw: Any) -> gr.Dropdown:
    """A dropdown whose refusal names the field and, for a choice that exists but cannot run here, why."""
    dropdown = gr.Dropdown(choices, **kw)
    why = dict(unavailable or {})
    return _bind(dropdown, preprocess=lambda payload: _check_choice(field, payload,
                                                                    [v for _, v in dropdown.choices], why))


def field_radio(choices: Sequence[Any], *, field: str, **kw: Any) -> gr.Radio:
    """Radio buttons (the mode) whose refusal names the field and the choices."""
    radio = gr.Radio(choices, **kw)
    return _bind(radio, preprocess=lambda payload: _check_choice(field, payload, [v for _, v in radio.choices], {}))
