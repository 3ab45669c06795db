"""The sweep file (``--sweep``): its keys read and checked, one line per bad value, before torch is imported.

What a file may say is in docs/sweeps.md; :func:`finetune.sweep.build_sweep` puts the command's flags over it.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Optional

from finetune.errors import ConfigError
from finetune.search_space import SearchSpace, overrides

FILE_KEYS = {"space", "fixed", "trials", "sampler", "pruner", "seeds", "folds", "trial_seeds"}
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "percentile", "hyperband", "none")
PRUNER_KEYS = {"type", "startup_trials", "min_trials", "warmup_texts", "warmup_epochs", "percentile"}
DEFAULT_TRIALS = 20


def read_sweep_file(path: Optional[str]) -> dict[str, Any]:
    if path is None:
        return {}
    from finetune.config import read_yaml

    data = read_yaml(path)
    for key in data:
        if key not in FILE_KEYS:
            close = difflib.get_close_matches(str(key), sorted(FILE_KEYS), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key!r}{hint}; a sweep file has {', '.join(sorted(FILE_KEYS))}")
    return data


def shipped_sweep() -> str:
    """The default job's sweep file, as a path from here where it is below the working folder (a checkout's
    ``configs/sweeps/default.yaml``), else where the package installed it."""
    from finetune.config import SHIPPED_CONFIGS

    path = SHIPPED_CONFIGS / "sweeps" / "default.yaml"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def fixed_overrides(raw: Any, space: SearchSpace, config: Optional[str], where: str) -> list[str]:
    """The sweep file's ``fixed:`` mapping (config keys every trial gets) as overrides, each checked against the
    config; the command line's overrides come after them and win."""
    from finetune.config import load_config

    if raw is None:
        return []
    if not isinstance(raw, dict) or not all(isinstance(key, str) for key in raw):
        raise ConfigError(f"{where}: fixed: expected a mapping of section.key to a value, got {raw!r}")
    for key in raw:
        if key in space.keys():
            raise ConfigError(f"{where}: fixed: {key}: is also in the space; a key is either searched or fixed")
    fixed = overrides(raw)
    try:
        load_config(config, fixed)
    except ConfigError as exc:
        raise ConfigError(f"{where}: fixed: {exc.message.removeprefix('command line: ')}") from None
    return fixed


def whole_number(value: Any, key: str, where: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where}: {key}: must be an integer >= {least}, got {value!r}")
    return value


def pruner_settings(value: Any, where: str) -> dict[str, Any]:
    settings = {"type": value} if isinstance(value, str) or value is None else value
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}: pruner: expected a name or a mapping with type, got {value!r}")
    unknown = sorted(set(settings) - PRUNER_KEYS)
    if unknown:
        raise ConfigError(f"{where}: pruner: unknown {', '.join(unknown)}; a pruner has {', '.join(sorted(PRUNER_KEYS))}")
    settings = {"type": "none" if settings.get("type") is None else settings["type"],
                **{k: v for k, v in settings.items() if k != "type"}}
    if settings["type"] not in PRUNERS:
        raise ConfigError(f"{where}: pruner: {settings['type']!r} is not one of {', '.join(PRUNERS)}")
    for key in ("startup_trials", "min_trials", "warmup_texts"):
        if key in settings:
            whole_number(settings[key], f"pruner: {key}", where, 1 if key == "min_trials" else 0)
    warmup = settings.get("warmup_epochs", 0.0)
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < float("inf"):
        raise ConfigError(f"{where}: pruner: warmup_epochs: must be a number of epochs >= 0 (0.25: a quarter), "
                          f"got {warmup!r}")
    percentile = settings.get("percentile", 50.0)
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile < 100:
        raise ConfigError(f"{where}: pruner: percentile: must be a number between 0 and 100, got {percentile!r}")
    return settings


def describe_pruner(settings: dict[str, Any]) -> str:
    extra = ", ".join(f"{k} {v}" for k, v in settings.items() if k != "type")
    return settings["type"] + (f" ({extra})" if extra else "")
