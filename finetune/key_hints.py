"""What a config key the schema lacks is told: the Trainer's name for a key, a near miss in its section, or
the section that has it (``training.learning_rat``, ``learning_rate``, ``num_train_epoch``).
"""

from __future__ import annotations

import dataclasses
import difflib

from finetune.schema import SECTIONS

# TrainingArguments' names (and EarlyStoppingCallback's) that no section has, and the key that does their work
# here: what a Trainer user types first gets its key in the error. docs/trainer.md has the whole table, and
# tests/test_config_reference.py holds the two to each other.
TRAINER_NAMES = {
    "auto_find_batch_size": "training.per_device_train_batch_size",
    "optim": "optim.implementation",
    "logging_steps": "logging.log_every",
    "logging_strategy": "logging.log_every",
    "eval_strategy": "evaluation.eval_every",
    "eval_steps": "evaluation.eval_every",
    "save_strategy": "output.checkpoint_every",
    "save_steps": "output.checkpoint_every",
    "save_total_limit": "output.keep_last",
    "resume_from_checkpoint": "output.resume_from",
    "data_seed": "training.seed",
    "bf16": "training.mixed_precision",
    "fp16": "training.mixed_precision",
    "tf32": "training.mixed_precision",
    "torch_compile_mode": "training.torch_compile",
    "train_sampling_strategy": "data.group_by_length",
    "dataloader_num_workers": "data.num_workers",
    "project": "logging.project_name",
    "disable_tqdm": "logging.progress_bar",
    "label_smoothing_factor": "training.label_smoothing",
}


def key_hint(key: str, names: list[str], prefix: str) -> str:
    """`` (did you mean ...?)`` for an unknown key: the Trainer's name for a key, a near miss in its section,
    else the section that has it."""
    if key in TRAINER_NAMES:
        return f" (the Trainer's {key} is {TRAINER_NAMES[key]} here; docs/trainer.md)"
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if close:
        return f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)"
    # a key of another section written under this one (training.learning_rate), or at the top (learning_rate)
    if prefix in SECTIONS or not prefix:
        return _did_you_mean(sections_having(key, besides=prefix) or near_misses_elsewhere(key, besides=prefix))
    return ""


def near_misses_elsewhere(key: str, besides: str) -> list[str]:
    """``section.name`` of the closest key of the other sections, for a misspelt key under the wrong section
    (``training.learning_rat``); empty when none is near."""
    others = {f"{section}.{f.name}": f.name for section, cls in SECTIONS.items() if section != besides
              for f in dataclasses.fields(cls)}
    close = difflib.get_close_matches(key, list(others.values()), n=1, cutoff=0.8)
    return [dotted for dotted, name in others.items() if close and name == close[0]]


def sections_having(key: str, besides: str = "") -> list[str]:
    """``section.key`` for each section of the schema (but ``besides``) that has a key named ``key``."""
    return [f"{section}.{key}" for section, cls in SECTIONS.items()
            if section != besides and key in {f.name for f in dataclasses.fields(cls)}]


def unknown_key_hint(dotted: str) -> str:
    """`` (did you mean ...?)`` for a ``section.key`` the schema lacks (``""`` when nothing is near)."""
    section, _, key = dotted.rpartition(".")
    if section in SECTIONS:
        return key_hint(key, [f.name for f in dataclasses.fields(SECTIONS[section])], section)
    if key in TRAINER_NAMES:
        return key_hint(key, [], "")
    return _did_you_mean(sections_having(key))


def _did_you_mean(candidates: list[str]) -> str:
    return f" (did you mean {' or '.join(candidates)}?)" if candidates else ""
