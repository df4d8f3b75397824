"""Read a hyperpyyaml file (cosyvoice2.yaml) as inert data, never executing it.

hyperpyyaml tags (``!new:``, ``!name:``, ``!apply:``) would import and call whatever the file names.  The loader
here maps every tag to a plain dict that remembers its tag, resolves ``!ref <key>`` (and ``<a> * <b>``
arithmetic through a whitelist of AST nodes), and drops the ``__set_seed`` style side-effect keys.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range; the message names file and field."""


def require(d: Any, key: str, where: str, fname: str, model: str = "CosyVoice2 or CosyVoice3") -> Any:
    """``d[key]``, or a :class:`ConfigError` naming the file, the dotted field (``where`` + ``key``) and the kind of
    model directory (``model``) the reader expected; the one field getter of every section reader in config/."""
    if not isinstance(d, dict) or key not in d:
        raise ConfigError(f"{fname}: missing field {where}{key}; is this a {model} model directory?")
    return d[key]


@contextmanager
def field_types(fname: str, what: str = "a field") -> Iterator[None]:
    """Turn a ``TypeError`` / ``ValueError`` from converting a yaml value (``int("x")``) into a ConfigError that names
    the file; a ConfigError raised inside passes through unchanged (it already names its field)."""
    try:
        yield
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{fname}: {what} has the wrong type ({e})") from e


class _Tagged(dict):
    """Inert stand-in for a hyperpyyaml ``!new:`` / ``!name:`` node: its keyword arguments plus the tag."""

    def __init__(self, tag: str, kwargs: dict[str, Any]):
        super().__init__(kwargs)
        self.tag = tag


class _Ref(str):
    """An unresolved ``!ref <key>`` expression."""


class _InertLoader(yaml.SafeLoader):
    """SafeLoader that accepts hyperpyyaml tags without importing or calling anything."""


def _construct_tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return _Tagged(suffix, loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return _Tagged(suffix, {"_args": loader.construct_sequence(node, deep=True)})
    return _Tagged(suffix, {"_value": loader.construct_scalar(node)})


def _construct_ref(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    return _Ref(loader.construct_scalar(node))


_InertLoader.add_multi_constructor("!new:", lambda l, s, n: _construct_tagged(l, "new:" + s, n))
_InertLoader.add_multi_constructor("!name:", lambda l, s, n: _construct_tagged(l, "name:" + s, n))
_InertLoader.add_multi_constructor("!apply:", lambda l, s, n: _construct_tagged(l, "apply:" + s, n))
_InertLoader.add_constructor("!ref", _construct_ref)

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv}


def _eval_arith(expr: str) -> float | int:
    """Evaluate ``3 * 2``-style arithmetic (numbers and + - * / // only); anything else is refused."""

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        raise ValueError(f"unsupported expression {expr!r}")

    return ev(ast.parse(expr, mode="eval"))


def _resolve(doc: dict[str, Any], value: Any, depth: int = 0) -> Any:
    if depth > 20:
        raise ValueError("!ref nesting too deep (a reference cycle?)")
    if isinstance(value, _Ref):
        keys = re.findall(r"<([^<>]+)>", value)
        if keys and value.strip() == f"<{keys[0]}>":
            return _resolve(doc, _lookup(doc, keys[0]), depth + 1)
        text = value
        for k in keys:
            text = text.replace(f"<{k}>", repr(_resolve(doc, _lookup(doc, k), depth + 1)))
        return _eval_arith(text)
    if isinstance(value, _Tagged):
        out = _Tagged(value.tag, {k: _resolve(doc, v, depth + 1) for k, v in value.items()})
        return out
    if isinstance(value, dict):
        return {k: _resolve(doc, v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(doc, v, depth + 1) for v in value]
    return value


def _lookup(doc: dict[str, Any], dotted: str) -> Any:
    cur: Any = doc
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise ValueError(f"!ref <{dotted}> names no key in the file")
        cur = cur[part]
    return cur


def read_hyperpyyaml(path: str | Path) -> dict[str, Any]:
    """Read a hyperpyyaml file as plain data: tags become dicts with a ``.tag``; ``!ref`` is resolved."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_InertLoader)  # noqa: S506 - inert loader
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path.name}: cannot be read as YAML ({e}); is the file complete?") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path.name}: expected a mapping at the top level")
    try:
        return {k: _resolve(raw, v) for k, v in raw.items() if not k.startswith("__")}
    except ValueError as e:
        raise ConfigError(f"{path.name}: {e}") from e
