"""What a key typed on the command line replaces in the config file.

Some settings can be said two ways: the run's length (``max_steps`` or
``num_train_epochs``), the batch (``effective_batch_size`` or ``k``), the data
(a file or a Hub data set). A file gives one of them; a user who types the
other on the command line means it, as ``max_steps`` overrides the epochs in
the Trainer. Here the typed key replaces the file's, and the log says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

# its own logger: a sweep, which reads its config for every trial, says each note once (finetune.sweep_notes)
logger = logging.getLogger("finetune.config")

# (a key chosen on the command line, the file's keys it replaces): each pair says one thing two ways
_COMMAND_LINE_CHOICES = (
    ("training.max_steps", ("training.num_train_epochs",)),
    ("training.num_train_epochs", ("training.max_steps",)),
    ("training.gradient_accumulation_steps", ("training.effective_batch_size",)),
    ("training.accumulation_schedule", ("training.effective_batch_size",)),
    ("training.effective_batch_size", ("training.gradient_accumulation_steps",)),
    ("data.train_file", ("data.dataset_name", "data.dataset_config", "data.test_split_name")),
    ("data.dataset_name", ("data.train_file", "data.validation_file", "data.test_file", "data.split_column")),
)


def let_the_command_line_choose(data: dict[str, Any], given: set[str], path: Path) -> None:
    """A key given on the command line replaces the file's keys that say the same thing another way.

    The run's length: ``training.max_steps`` replaces ``num_train_epochs``,
    and the other way round, as in the Trainer, where ``max_steps``
    overrides the epochs: a user who types ``training.max_steps=5`` for a
    quick run means five updates. The batch: ``gradient_accumulation_steps``
    or ``accumulation_schedule`` replaces the file's
    ``effective_batch_size`` (``k`` is then what was typed), and
    ``effective_batch_size`` replaces the file's ``gradient_accumulation_steps``
    (``k`` then follows from it), except under ``per_device_train_batch_size:
    auto``, which needs the effective batch. The data: a file (``--data``)
    replaces the file's Hub data set, and a Hub data set replaces its files.
    Both given in one place still contradict each other unless they agree.
    """
    auto_batch = _value_at(data, "training.per_device_train_batch_size") == "auto"  # it needs effective_batch_size
    for chosen, replaced in _COMMAND_LINE_CHOICES:
        first = replaced[0]
        if (chosen not in given or first in given or _value_at(data, chosen) is None
                or _value_at(data, first) is None or (auto_batch and first == "training.effective_batch_size")):
            continue
        dropped = [key for key in replaced if key not in given and _value_at(data, key) is not None]
        logger.info(f"{chosen}={_spelled(_value_at(data, chosen))} on the command line replaces "
             f"{', '.join(f'{key}: {_spelled(_value_at(data, key))}' for key in dropped)} of {path}")
        for key in dropped:
            section, name = key.split(".")
            data[section][name] = None


def _value_at(data: dict[str, Any], dotted: str) -> Any:
    section, name = dotted.split(".")
    return data[section].get(name) if isinstance(data.get(section), dict) else None


def _spelled(value: Any) -> str:
    """A config value as it would be typed: ``{0: 8, 4: 2}`` for a mapping, a file mapping's path."""
    if isinstance(value, dict):
        if "path" in value:
            return str(value["path"])
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)
