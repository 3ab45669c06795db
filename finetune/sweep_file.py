"""The sweep file (``--sweep``): its keys read and checked, one line per bad value, before torch is imported; and
what its ``seeds`` or ``folds`` run after the search (:class:`Repeats`).

What a file may say is in docs/sweeps.md; :func:`finetune.sweep.build_sweep` puts the command's flags over it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune.errors import ConfigError
from finetune.search_space import SearchSpace, overrides

FILE_KEYS = {"space", "fixed", "trials", "sampler", "pruner", "seeds", "folds", "trial_seeds"}
SAMPLERS = ("tpe", "random", "grid")
SAMPLER_KEYS = ("type", "seed")
# each pruner's settings besides its type: warmup_epochs is the sweep's own (its trials judged past it), the
# others are Optuna's pruner's arguments, which hyperband, as built here, takes none of
PRUNER_TAKES = {
    "median": ("startup_trials", "min_trials", "warmup_texts", "warmup_epochs"),
    "percentile": ("startup_trials", "min_trials", "warmup_texts", "warmup_epochs", "percentile"),
    "hyperband": ("warmup_epochs",),
    "none": (),
}
PRUNERS = tuple(PRUNER_TAKES)
# the evaluations a pruner never judges, where its settings do not say: those of the first quarter of an epoch, where
# a trial of a large effective batch has made few updates yet; judged from there, the median and percentile pruners
# stopped the trials that went on to tie for the best on the default job (docs/sweeps.md#pruning)
DEFAULT_WARMUP_EPOCHS = 0.25
PRUNER_KEYS = {"type", *(key for keys in PRUNER_TAKES.values() for key in keys)}
DEFAULT_TRIALS = 20


def read_sweep_file(path: Optional[str]) -> dict[str, Any]:
    if path is None:
        return {}
    from finetune.config import read_yaml

    data = read_yaml(path, "sweep file", hint=f"--sweep {shipped_sweep()} searches the default job's learning rate "
                                            "and effective batch")
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


# the settings of a search, each as the sweep file's key and its flag, which a sweep without a space would ignore
SEARCH_SETTINGS = (("trials", "--trials"), ("sampler", "--sampler"), ("sampler_seed", "--sampler-seed"),
                   ("pruner", "--pruner"), ("trial_seeds", "--trial-seeds"))


def refuse_search_settings(args, data: dict[str, Any], where: str, runs: str) -> None:
    """Refuse a search's setting (a flag, or a key of the sweep file) in a sweep without a space, which runs the
    config as given (``runs``: over its seeds, or on its folds): set, it would be ignored, and a user who asked for
    trials would get none without a word.

    Raises:
        ConfigError: naming the first such flag or key.
    """
    for key, flag in SEARCH_SETTINGS:
        given = getattr(args, key, None)
        if given is not None:
            named, space, setting = f"{flag} {given}", "give --sweep FILE with space:", flag
        elif key in data:
            named, space, setting = f"{where}: {key}", "give the file a space:", key
        else:
            continue
        raise ConfigError(f"{named}: a setting of a search, and this sweep has no space to search (it runs the "
                          f"config as given {runs}); {space}, or leave out {setting}",
                          hint=f"--sweep {shipped_sweep()} searches a classifier's learning rate and effective batch, "
                               "by F1")


def sampler_settings(value: Any, where: str) -> tuple[str, Optional[int]]:
    """The file's ``sampler:``, a name or a mapping of its type and seed, as (type, seed); tpe unless it says."""
    settings = {"type": value} if isinstance(value, str) else value
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}: sampler: expected a name or a mapping with type and seed, got {value!r}")
    unknown = sorted(set(settings) - set(SAMPLER_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{where}: sampler: unknown {', '.join(map(str, unknown))}; a sampler has type and seed")
    kind, seed = settings.get("type", "tpe"), settings.get("seed")
    if kind not in SAMPLERS:
        raise ConfigError(f"{where}: sampler: {kind!r} is not one of {', '.join(SAMPLERS)}")
    if seed is not None:
        whole_number(seed, "sampler: seed", where, 0)
    return kind, seed


def pruner_settings(value: Any, where: str) -> dict[str, Any]:
    """The file's ``pruner:``, checked: a name, or a mapping of its type (median where it names none) and the
    settings that type takes; ``null`` is ``none``. A type that takes ``warmup_epochs`` gets
    :data:`DEFAULT_WARMUP_EPOCHS` where the file gives none."""
    settings = {"type": value} if isinstance(value, str) or value is None else value
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}: pruner: expected a name or a mapping with type, got {value!r}")
    unknown = sorted(set(settings) - PRUNER_KEYS, key=str)
    if unknown:
        raise ConfigError(f"{where}: pruner: unknown {', '.join(map(str, unknown))}; a pruner has "
                          f"{', '.join(sorted(PRUNER_KEYS))}")
    kind = settings.get("type", "median")
    settings = {"type": "none" if kind is None else kind, **{k: v for k, v in settings.items() if k != "type"}}
    if settings["type"] not in PRUNERS:
        raise ConfigError(f"{where}: pruner: {settings['type']!r} is not one of {', '.join(PRUNERS)}")
    for key in settings:
        if key != "type" and key not in PRUNER_TAKES[settings["type"]]:
            raise ConfigError(f"{where}: pruner: {key}: {not_taken(key, settings['type'])}")
    for key in ("startup_trials", "min_trials", "warmup_texts"):
        if key in settings:
            whole_number(settings[key], f"pruner: {key}", where, 1 if key == "min_trials" else 0)
    if "warmup_epochs" in PRUNER_TAKES[settings["type"]]:
        settings.setdefault("warmup_epochs", DEFAULT_WARMUP_EPOCHS)
    warmup = settings.get("warmup_epochs", 0.0)
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < float("inf"):
        raise ConfigError(f"{where}: pruner: warmup_epochs: must be a number of epochs >= 0 (0.25: a quarter), "
                          f"got {warmup!r}")
    percentile = settings.get("percentile", 50.0)
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile < 100:
        raise ConfigError(f"{where}: pruner: percentile: must be a number between 0 and 100, got {percentile!r}")
    return settings


def not_taken(key: str, kind: str) -> str:
    """Why a ``kind`` pruner refuses the setting ``key``, naming the pruners that take it."""
    if kind == "none":
        return "type none prunes nothing and takes no settings"
    takers = [name for name, keys in PRUNER_TAKES.items() if key in keys]
    names = " and ".join(takers) if len(takers) < 3 else f"{', '.join(takers[:-1])} and {takers[-1]}"
    return f"a {kind} pruner does not take it; {names} {'does' if len(takers) == 1 else 'do'}"


def pruner_retyped(settings: dict[str, Any], kind: str) -> dict[str, Any]:
    """``--pruner KIND`` over the file's pruner: that type, with the file's settings it takes (a warm-up, the
    trials to wait for), so that changing the pruner on the command line changes the pruner alone."""
    if kind not in PRUNERS:
        raise ConfigError(f"--pruner: {kind!r} is not one of {', '.join(PRUNERS)}")
    return {"type": kind, **{k: v for k, v in settings.items() if k in PRUNER_TAKES[kind]}}


def describe_pruner(settings: dict[str, Any]) -> str:
    extra = ", ".join(f"{k} {v}" for k, v in settings.items() if k != "type")
    return settings["type"] + (f" ({extra})" if extra else "")


@dataclass(frozen=True)
class Repeats:
    """The best config (without a space: the config) run once for each value of one key: over seeds
    (``training.seed``) or over the folds of K-fold cross-validation (``data.validation_fold``)."""

    # "seeds" or "folds": the study's suffix, the runs' folder and the report's heading
    name: str
    key: str
    values: tuple[int, ...]
    # overrides every run shares: the folds' count
    fixed: tuple[str, ...] = ()

    @property
    def unit(self) -> str:
        return self.name[:-1]

    def folder(self, value: int) -> str:
        return f"{self.name}/{self.unit}-{value}"


def seeds_from(seed: int, count: int) -> Repeats:
    return Repeats("seeds", "training.seed", tuple(seed + i for i in range(count)))


def folds_of(count: int) -> Repeats:
    return Repeats("folds", "data.validation_fold", tuple(range(1, count + 1)), (f"data.validation_folds={count}",))


def search_seeds(sweep, seed: int) -> tuple[int, ...]:
    """The seeds each trial of a sweep's search trains with: ``seed``, or ``--trial-seeds`` of them from it on."""
    return tuple(seed + i for i in range(sweep.trial_seeds))


def repeats_of(sweep, seed: int) -> Optional[Repeats]:
    """What runs after a sweep's search (a :class:`finetune.sweep.Sweep`): the seeds, or the folds, or nothing.

    The seeds start past the search's own: the config was chosen for its score on those, which is partly their
    luck, and a mean over them would count that luck again. Without a search nothing was chosen, and they start
    at ``seed``.
    """
    if sweep.seeds:
        return seeds_from(max(search_seeds(sweep, seed)) + 1 if sweep.space.dimensions else seed, sweep.seeds)
    return folds_of(sweep.folds) if sweep.folds else None
