"""A sweep's search space: the config keys a sweep varies, the values each may take, and how a trial draws them.

Written under ``space:`` in the sweep's YAML file, one config key per line::

    space:
      optim.learning_rate: {low: 1.0e-5, high: 1.0e-4, log: true}   # a float range, on a log scale
      optim.warmup_ratio: {low: 0.0, high: 0.2, step: 0.05}          # a float range on a grid
      training.num_train_epochs: {low: 1, high: 4}                   # an int key: an int range
      training.effective_batch_size: [16, 32, 64]                    # choices

A range's kind follows the key's type in the schema (a float key gets a float
range even from ``{low: 0, high: 1}``). Keys that change memory and not the
arithmetic (the micro-batch, ``k``, gradient checkpointing) are refused: with
exact accumulation two trials that differ only there are the same trial, so
the search is over ``training.effective_batch_size`` while the micro-batch
stays what the config says fits. Optuna draws the values; this module only
says what may be drawn.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any, Optional, Union

import yaml

from finetune.coerce import literal_spelling
from finetune.errors import ConfigError
from finetune.key_hints import unknown_key_hint
from finetune.schema import SECTIONS

# keys a search must not vary, and why: each names what to search instead
REFUSED = {
    "training.per_device_train_batch_size": "the micro-batch is memory, not math: search "
                                            "training.effective_batch_size and keep the micro-batch that fits",
    "training.gradient_accumulation_steps": "k follows from training.effective_batch_size: search that",
    "training.gradient_checkpointing": "gradient checkpointing changes memory and time, not the result",
    "training.per_device_eval_batch_size": "the evaluation batch changes memory, not the result",
    "training.seed": "seeds are not searched: --seeds N runs the best config over N seeds",
}
REFUSED_SECTIONS = {"output": "where a trial writes is the sweep's choice",
                    "logging": "logging does not change a run's result"}
RANGE_KEYS = {"low", "high", "log", "step"}


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One searched key: a range (``low``..``high``, on a log scale or a grid) or a list of choices."""

    key: str
    kind: str  # "float", "int" or "choice"
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    choices: tuple = ()

    def suggest(self, trial) -> Any:
        """The value of this key in an Optuna trial (drawn, or the one an enqueued trial fixes)."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def probes(self) -> list[Any]:
        """The values checked against the config before any trial: every choice, or a range's two ends."""
        if self.kind == "choice":
            return list(self.choices)
        cast = int if self.kind == "int" else float
        return [cast(self.low), cast(self.high)]

    def describe(self) -> str:
        if self.kind == "choice":
            return f"{self.key} in [{', '.join(render(c) for c in self.choices)}]"
        scale = " log" if self.log else (f" step {render(self.step)}" if self.step else "")
        return f"{self.key} {render(self.low)}..{render(self.high)}{scale}"

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "choice":
            return {"choices": list(self.choices)}
        return {"kind": self.kind, "low": self.low, "high": self.high, "log": self.log, "step": self.step}


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The searched keys, in the order the sweep's file lists them."""

    dimensions: tuple[Dimension, ...] = ()

    def suggest(self, trial) -> dict[str, Any]:
        """The trial's value of every searched key."""
        return {d.key: d.suggest(trial) for d in self.dimensions}

    def describe(self) -> str:
        return "; ".join(d.describe() for d in self.dimensions) or "none (the config as given)"

    def identity(self) -> str:
        """The space as canonical JSON: a study made with another space is refused."""
        return json.dumps({d.key: d.to_dict() for d in self.dimensions}, sort_keys=True)

    def keys(self) -> list[str]:
        return [d.key for d in self.dimensions]


def render(value: Any) -> str:
    """A value as an override writes it, read back by YAML as the same value: ``3.2e-05`` reads as a float."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        text = repr(value)
        if "e" in text and "." not in text.split("e")[0]:
            mantissa, exponent = text.split("e")
            text = f"{mantissa}.0e{exponent}"  # YAML 1.1 reads `1e-05` as a string
        return text
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and yaml.safe_load(value) != value:
        return json.dumps(value)
    return str(value)


def overrides(params: dict[str, Any]) -> list[str]:
    """A trial's values as the ``section.key=value`` overrides of ``finetune train``."""
    return [f"{key}={render(value)}" for key, value in params.items()]


def parse_space(raw: Any, where: str) -> SearchSpace:
    """The space of a sweep file's ``space:`` mapping.

    Raises:
        ConfigError: one line naming ``where`` and the key: an unknown or refused
            key, a malformed range, empty or mixed choices.
    """
    if raw is None:
        return SearchSpace()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: space: expected a mapping of config keys to ranges or choices, "
                          f"got {type(raw).__name__}")
    return SearchSpace(tuple(_dimension(str(key), value, f"{where}: space: {key}") for key, value in raw.items()))


def _dimension(key: str, value: Any, where: str) -> Dimension:
    key_type = _key_type(key, where)
    if isinstance(value, list):
        if not value:
            raise ConfigError(f"{where}: no choices; give a list of values or a range {{low: ..., high: ...}}")
        if typing.get_origin(key_type) is typing.Literal:  # the trials say the value as the key reads it
            value = [literal_spelling(v, key_type) for v in value]
        if len(set(map(render, value))) != len(value):
            raise ConfigError(f"{where}: choices repeat a value: {value}")
        if not all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
            raise ConfigError(f"{where}: choices must be numbers, strings, booleans or null, got {value}")
        return Dimension(key, "choice", choices=tuple(value))
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a list of choices or a range {{low: ..., high: ...}}, got {value!r}")
    unknown = sorted(set(value) - RANGE_KEYS)
    if unknown or not {"low", "high"} <= set(value):
        problem = f"unknown {', '.join(unknown)}" if unknown else "missing " + " and ".join(
            k for k in ("low", "high") if k not in value)
        raise ConfigError(f"{where}: a range is {{low, high}} with optional log and step; {problem}")
    kind = _range_kind(key_type, where)
    low, high = (_number(value[k], f"{where}: {k}") for k in ("low", "high"))
    log, step = value.get("log", False), value.get("step")
    if not isinstance(log, bool):
        raise ConfigError(f"{where}: log must be true or false, got {log!r}")
    step = None if step is None else _number(step, f"{where}: step")
    if kind == "int" and not all(float(v).is_integer() for v in (low, high, step or 1)):
        raise ConfigError(f"{where}: {key} is an integer key; low, high and step must be integers")
    if not low < high:
        raise ConfigError(f"{where}: low must be below high, got low {render(low)}, high {render(high)}")
    if log and (low <= 0 or step not in (None, 1)):
        raise ConfigError(f"{where}: a log range needs low > 0 and no step, got low {render(low)}"
                          + (f", step {render(step)}" if step not in (None, 1) else ""))
    if step is not None and step <= 0:
        raise ConfigError(f"{where}: step must be > 0, got {render(step)}")
    return Dimension(key, kind, low, high, log, step)


def _key_type(key: str, where: str) -> Any:
    """The schema's type of ``section.key``; refused and unknown keys raise."""
    section, _, name = key.partition(".")
    if section in SECTIONS and name in {f.name for f in dataclasses.fields(SECTIONS[section])}:
        if key in REFUSED:
            raise ConfigError(f"{where}: not searchable: {REFUSED[key]}")
        if section in REFUSED_SECTIONS:
            raise ConfigError(f"{where}: not searchable: {REFUSED_SECTIONS[section]}")
        return typing.get_type_hints(SECTIONS[section])[name]
    raise ConfigError(f"{where}: no such config key{unknown_key_hint(key)}")


def _range_kind(key_type: Any, where: str) -> str:
    args = set(typing.get_args(key_type)) if typing.get_origin(key_type) is Union else {key_type}
    if float in args:
        return "float"
    if int in args and bool not in args:
        return "int"
    raise ConfigError(f"{where}: a range needs a number key; give this key a list of choices")


def _number(value: Any, where: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)  # YAML 1.1 reads `1e-5` as a string
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    return value
