"""A YAML value into a schema type, strictly: the one place config values are type-checked.

``coerce_value(value, annotation, key)`` accepts what the annotation allows (YAML's
``3e-5`` read as a float, quoted integer mapping keys read as integers) and
otherwise raises a one-line :class:`~finetune.errors.ConfigError` naming the
key, the type expected and the value given. :mod:`finetune.config` calls it for
every key it loads.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from typing import Any, Literal, Union

from finetune.errors import ConfigError


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"list of {type_name(inner)}"
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        return f"mapping of {type_name(key_type)} to {type_name(value_type)}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce_value(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to float)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, key)
    if origin is Literal:
        return _coerce_literal(value, tp, key)
    if origin is list:
        return _coerce_list(value, tp, key)
    if origin is dict:
        return _coerce_dict(value, tp, key)
    return _coerce_scalar(value, tp, key)


def _coerce_union(value: Any, tp: Any, key: str) -> Any:
    """``Optional[X]`` and ``X | Y``: null where allowed, else the first member type that accepts the value."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    # a list or a mapping where one is all a key takes, or the one of its kind a key takes: its own error names
    # the item at fault
    kind = dict if isinstance(value, dict) else list if isinstance(value, list) else None
    containers = [a for a in options if typing.get_origin(a) in (list, dict)]
    if len(options) == 1 and containers:
        return coerce_value(value, options[0], key)
    alike = [a for a in containers if typing.get_origin(a) is kind]
    if len(alike) == 1:
        return coerce_value(value, alike[0], key)
    hint = None  # a member's own (a YAML word read as a number: quote it)
    for arg in options:
        try:
            return coerce_value(value, arg, key)
        except ConfigError as exc:
            hint = hint or exc.hint
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {_describe(value)}", hint=hint)


def literal_spelling(value: Any, tp: Any) -> Any:
    """``value`` as a ``Literal`` key reads it: YAML 1.1 reads a bare `no` as False, and
    ``mixed_precision: no`` means the string."""
    return "no" if value is False and "no" in typing.get_args(tp) else value


def _coerce_literal(value: Any, tp: Any, key: str) -> str:
    """One of a ``Literal``'s strings, with the closest one suggested when the value is not."""
    allowed = typing.get_args(tp)
    value = literal_spelling(value, tp)
    if value in allowed and isinstance(value, str):
        return value
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"{key}: expected one of {type_name(tp)}, got {_describe(value)}{hint}")


def _coerce_list(value: Any, tp: Any, key: str) -> list:
    """A list whose items each pass; errors name the item (``key[i]``)."""
    (inner,) = typing.get_args(tp)
    if isinstance(value, str) and inner is str:
        value = [value]  # `report_to: tensorboard` reads as a one-item list
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {_describe(value)}")
    return [coerce_value(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]


def _coerce_dict(value: Any, tp: Any, key: str) -> dict:
    """A mapping whose keys and values each pass; errors name the entry."""
    key_type, value_type = typing.get_args(tp)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {_describe(value)}")
    out = {}
    for k, v in value.items():
        if key_type is int and isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)  # JSON and some YAML writers quote mapping keys
        out[coerce_value(k, key_type, f"{key} key {k!r}")] = coerce_value(v, value_type, f"{key}[{k!r}]")
    return out


def _coerce_scalar(value: Any, tp: Any, key: str) -> Any:
    """``bool``, ``int``, ``float`` (ints widened, YAML 1.1's ``3e-5`` strings read) or ``str``, strictly."""
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str):
            # PyYAML follows YAML 1.1, which reads `3e-5` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError(f"{key}: must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (bool, int, float)):
            # in a YAML file: a column named `2024` or `no` is read as a number or a boolean
            raise ConfigError(f"{key}: expected {type_name(tp)}, got {_describe(value)}",
                              hint=f"YAML reads the word as {type(value).__name__}: quote it to mean the text")
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {_describe(value)}")


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"
