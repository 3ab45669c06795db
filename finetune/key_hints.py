"""What a config key the schema lacks is told: the Trainer's name for a key, a near miss in its section, or
the section that has it (``training.learning_rat``, ``learning_rate``, ``num_train_epoch``); and what an option
the command lacks is told: the setting that does its work (``--num_train_epochs 3``).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing

from finetune.errors import ConfigError, near_option
from finetune.schema import SECTIONS

# TrainingArguments' names (and EarlyStoppingCallback's) that no section has, and the key that does their work
# here: what a Trainer user types first gets its key in the error. docs/trainer.md has the whole table, and
# tests/test_config_reference.py holds the two to each other.
TRAINER_NAMES = {
    "auto_find_batch_size": "training.per_device_train_batch_size",
    "optim": "optim.optimizer",
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


# the argument names of transformers' text-classification example scripts (run_glue.py, run_classification.py)
# and the short names users type, where no section has the name: the key that does the work here
SCRIPT_NAMES = {
    "model_name_or_path": "model.name_or_path",
    "tokenizer_name": "model.tokenizer_name_or_path",
    "max_seq_length": "data.max_length",
    "text_column_names": "data.text_column",
    "text_column_name": "data.text_column",
    "label_column_name": "data.label_column",
    "dataset_config_name": "data.dataset_config",
    "validation": "data.validation_file",
    "lr": "optim.learning_rate",
    "epochs": "training.num_train_epochs",
    "batch_size": "training.per_device_train_batch_size",
    # TrainingArguments' names of earlier transformers releases, still in many scripts
    "overwrite_output_dir": "output.overwrite",
    "evaluation_strategy": "evaluation.eval_every",
}


# what the Trainer and its scripts do with a setting that is a command of its own here, or the run's own way
_UPLOADED = "the output folder is a Hub repository as it stands: hf upload (docs/inference.md)"
DONE_ELSEWHERE = {
    "do_predict": "a test set is scored once, by the saved model after training: --test TEST (data.test_file; a "
                  "finished run's model: finetune score OUTPUT_DIR --file TEST)",
    "do_eval": "every run evaluates its validation data: evaluation.eval_every or evaluation.evals_per_epoch",
    "do_train": "finetune train trains",
    "push_to_hub": _UPLOADED,
    "hub_model_id": _UPLOADED,
}


def done_elsewhere(name: str) -> str | None:
    """How this package does the work of a Trainer setting it has no key for (``do_predict``), or None."""
    return DONE_ELSEWHERE.get(name.replace("-", "_"))


def key_hint(key: str, names: list[str], prefix: str) -> str:
    """`` (did you mean ...?)`` for an unknown key: the Trainer's name for a key, a near miss in its section,
    else the section that has it."""
    if key in DONE_ELSEWHERE:
        return f" ({DONE_ELSEWHERE[key]})"
    if key in TRAINER_NAMES:
        return f" (the Trainer's {key} is {TRAINER_NAMES[key]} here; docs/trainer.md)"
    if key in SCRIPT_NAMES:  # a script's name under a section too (optim.lr): the key that does its work
        return f" ({key} is {SCRIPT_NAMES[key]} here)"
    # a key of another section written under this one (data.seed), or at the top (learning_rate): its own name
    # there beats a near name here (data.split_seed)
    elsewhere = prefix in SECTIONS or not prefix
    exact = sections_having(key, besides=prefix) if elsewhere else []
    if exact:
        return _did_you_mean(exact)
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if close:
        return f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)"
    return _did_you_mean(near_misses_elsewhere(key, besides=prefix)) if elsewhere else ""


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


def setting_for_option(name: str) -> str | None:
    """The ``section.key`` an option of another tool names (``--num_train_epochs``, ``--lr``), or None."""
    name = name.replace("-", "_")
    if name in TRAINER_NAMES:
        return TRAINER_NAMES[name]
    if name in SCRIPT_NAMES:
        return SCRIPT_NAMES[name]
    having = sections_having(name)
    return having[0] if len(having) == 1 else None


def value_to_write(name: str, dotted: str) -> str:
    """What to write after ``dotted=`` for an option ``name`` typed without a value: ``true`` for a switch
    (``--overwrite_output_dir``), the precision it names (``--bf16``), else a placeholder."""
    if name in ("bf16", "fp16"):
        return name
    section, _, key = dotted.partition(".")
    tp = typing.get_type_hints(SECTIONS[section])[key]
    return "true" if tp is bool or bool in typing.get_args(tp) else "VALUE"


def unknown_key_hint(dotted: str) -> str:
    """`` (did you mean ...?)`` for a ``section.key`` the schema lacks (``""`` when nothing is near)."""
    section, _, key = dotted.rpartition(".")
    if section in SECTIONS:
        return key_hint(key, [f.name for f in dataclasses.fields(SECTIONS[section])], section)
    if key in TRAINER_NAMES or key in SCRIPT_NAMES or key in DONE_ELSEWHERE:
        return key_hint(key, [], "")
    return _did_you_mean(sections_having(key))


def _did_you_mean(candidates: list[str]) -> str:
    return f" (did you mean {' or '.join(candidates)}?)" if candidates else ""


def refuse_options(unknown: list[str], argv: list[str], command: str, flags: dict[str, str],
                   options: list[str]) -> None:
    """Stop at an option ``command`` lacks, naming the setting that does its work where there is one.

    The Trainer's arguments and those of transformers' example scripts
    (``--num_train_epochs 3``, ``--learning_rate=2e-5``, ``--bf16``) are what
    a user of those types first; here each is a ``section.key=value``.

    Args:
        unknown: What argparse left over.
        argv: The command line, for the value after the option.
        command: The command, as the user typed it.
        flags: The command's own options and the keys they set (``--data``: ``data.train_file``), which
            the line names where one sets the key.
        options: Every option of the command, for the one a mistyped option is near (``--confg``).

    Raises:
        ConfigError: always, for the first option of ``unknown``.
    """
    option = next((token for token in unknown if token.startswith("-")), unknown[0])
    flag, _, value = option.partition("=")
    name = flag.lstrip("-")
    key, guessed = setting_for_option(name), False
    help_line = f"{command} --help lists its options and every setting, given as section.key=value"
    if key is None and done_elsewhere(name) is None:  # mistyped: the command's option or a setting's name
        near = near_misses_elsewhere(name.replace("-", "_"), besides="")
        key, guessed = (near[0], True) if len(near) == 1 else (None, False)
        closeness = difflib.SequenceMatcher(None, name.replace("-", "_"), key.partition(".")[2]).ratio() if key else 0
        own = near_option(flag, options, cutoff=max(0.75, closeness))  # the nearer of the two
        if own:
            raise ConfigError(f"{flag}: not an option of {command}{own}", hint=help_line)
    if key is None:
        raise ConfigError(f"{flag}: not an option of {command}", hint=done_elsewhere(name) or help_line)
    if name.endswith("_strategy"):  # "steps", "epoch": a count of updates here
        value = "N"
    elif not value:
        after = argv[argv.index(option) + 1:argv.index(option) + 2] if option in argv else []
        value = after[0] if after and not after[0].startswith("-") and "=" not in after[0] else (
            value_to_write(name, key))
    own = {setting: own_flag for own_flag, setting in flags.items()}
    if key in own:
        raise ConfigError(f"{flag}: not an option of {command}; write --{own[key].replace('_', '-')} {value}")
    if guessed:
        raise ConfigError(f"{flag}: not an option of {command}; did you mean the setting {key}? write {key}={value}")
    raise ConfigError(f"{flag}: not an option of {command}; the setting is {key}: write {key}={value}")
