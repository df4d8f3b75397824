"""Input widgets whose API is honest and whose refusals name the field.

Gradio checks slider bounds and dropdown choices itself, before our handler runs, with messages that do not say
which input was wrong ("Value 0 is less than minimum value 1.", "Value: cudagraph is not in the list of choices:
['eager']") and a server traceback for each.  These subclasses do the same checks with our messages: the field's
API name, the allowed range, and for a backend that cannot run here, the reason.  Whole-number sliders are typed
``integer`` in ``view_api()`` and a fractional value is refused instead of being silently truncated.
Each class sets Gradio's ``is_template`` marker, so the page draws Gradio's own widget of the parent class.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import gradio as gr

from .request_log import log_refused


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


class FieldSlider(gr.Slider):
    """A slider for the API field ``field``; whole-number steps make it an ``integer`` input."""

    is_template = True  # Gradio draws it with the parent's widget (and names it so in the API)

    def get_config(self, cls: type | None = None) -> dict[str, Any]:
        return super().get_config(cls or gr.Slider)  # the parent's parameters (label, info, value, ...)

    def __init__(self, minimum: float, maximum: float, value: float, *, field: str, step: float = 1, **kw: Any):
        self.field = field
        self.integer = float(step).is_integer() and float(minimum).is_integer()
        super().__init__(minimum, maximum, value, step=step, precision=0 if self.integer else None, **kw)

    def preprocess(self, payload: Any) -> int | float:
        return check_number(self.field, payload, self.minimum, self.maximum, self.integer)

    def api_info(self) -> dict[str, Any]:
        kind = "whole number" if self.integer else "number"
        return {"type": "integer" if self.integer else "number",
                "description": f"{kind} from {_fmt(self.minimum)} to {_fmt(self.maximum)}"}


class FieldNumber(gr.Number):
    """A whole-number box (the seed) with our range message."""

    is_template = True  # Gradio draws it with the parent's widget (and names it so in the API)

    def get_config(self, cls: type | None = None) -> dict[str, Any]:
        return super().get_config(cls or gr.Number)  # the parent's parameters (label, info, value, ...)

    def __init__(self, value: int, *, field: str, minimum: int, maximum: int, **kw: Any):
        self.field = field
        super().__init__(value, precision=0, minimum=minimum, maximum=maximum, **kw)

    def preprocess(self, payload: Any) -> int | None:
        if payload is None:
            return None
        return int(check_number(self.field, payload, self.minimum, self.maximum, True))


def _check_choice(field: str, payload: Any, choices: Sequence[Any], unavailable: Mapping[str, str]) -> Any:
    if payload in choices:
        return payload
    allowed = ", ".join(repr(c) for c in choices)
    if isinstance(payload, str) and payload in unavailable:
        raise _refuse(f"{field}={payload!r} is not available here: {unavailable[payload]}. Choose {allowed}.")
    raise _refuse(f"{field}={payload!r} is not one of the choices: {allowed}.")


class FieldDropdown(gr.Dropdown):
    """A dropdown whose refusal names the field and, for a choice that exists but cannot run here, why."""

    is_template = True  # Gradio draws it with the parent's widget (and names it so in the API)

    def get_config(self, cls: type | None = None) -> dict[str, Any]:
        return super().get_config(cls or gr.Dropdown)  # the parent's parameters (label, info, value, ...)

    def __init__(self, choices: Sequence[Any], *, field: str, unavailable: Mapping[str, str] | None = None,
                 **kw: Any):
        self.field = field
        self.unavailable = dict(unavailable or {})
        super().__init__(choices, **kw)

    def preprocess(self, payload: Any) -> Any:
        if payload is None:
            return None
        return _check_choice(self.field, payload, [v for _, v in self.choices], self.unavailable)


class FieldRadio(gr.Radio):
    """Radio buttons (the mode) whose refusal names the field and the choices."""

    is_template = True  # Gradio draws it with the parent's widget (and names it so in the API)

    def get_config(self, cls: type | None = None) -> dict[str, Any]:
        return super().get_config(cls or gr.Radio)  # the parent's parameters (label, info, value, ...)

    def __init__(self, choices: Sequence[Any], *, field: str, **kw: Any):
        self.field = field
        super().__init__(choices, **kw)

    def preprocess(self, payload: Any) -> Any:
        if payload is None:
            return None
        return _check_choice(self.field, payload, [v for _, v in self.choices], {})
