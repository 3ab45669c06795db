"""Which checkpoint a run resumes from, and what must not change for it to be the same run.

A checkpoint carries its run's *fingerprint* (:func:`run_fingerprint`): the
config keys that shape the training trajectory, the resolved ``b``, ``k``, ``P``,
the training rows' hash and the update plan. A run resumes a checkpoint only
where the fingerprints agree (another split of the same effective batch aside,
:mod:`finetune.resplit`). :func:`refuse_another_runs_checkpoints` compares the
config keys before anything is loaded, so that a folder of another run is
refused at once; :func:`choose_checkpoint` verifies the files and compares the
rest once the run is built.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from finetune.checkpoint_files import (STATE_FILE, checkpoints_root, list_checkpoints, read_state, resolve_resume,
                                       unreadable_checkpoints, verify_checkpoint)
from finetune.errors import ConfigError
from finetune.resplit import SPLIT_KEYS, may_change_split, sharded_state, split_change

if TYPE_CHECKING:
    from finetune.run import Run

logger = logging.getLogger("finetune")

# Config keys that may change between a run and its resume: they do not touch the
# training trajectory. Every other key of these sections must be identical.
COMPARED_SECTIONS = ("model", "data", "training", "optim")
# config keys that setup may settle (write back) after the early comparison of config_changes
SETTLED_IN_SETUP = frozenset({"data.validation_split_name", "data.validation_split"})
MAY_CHANGE_ON_RESUME = frozenset({
    "training.on_nonfinite",
    "training.max_skipped",
    "training.eval_each_epoch",
    "training.per_device_eval_batch_size",
    "data.num_workers",
    # where and by how many processes the tokens are made, not what they are (tokenize_splits' tests)
    "data.tokenize_processes",
    "data.cache_tokenized",
    "data.cache_dir",
    # read after training, by the saved model
    "data.test_file",
    "data.test_split_name",
    # recomputation replays the same values (and dropout masks): a run that ran out of memory may resume with it
    "training.gradient_checkpointing",
    "training.memory_check",
    "training.cpu_heap",  # where freed memory goes, not what is computed
    # compared through the resolved b, k, P below, so that either spelling resumes, and another split of the
    # same effective batch too (finetune.resplit)
    "training.gradient_accumulation_steps",
    "training.effective_batch_size",
    "training.per_device_train_batch_size",
    # compared as applied (the fingerprint's cuda_graphs and precision), so that auto resumes what a setting
    # wrote where it decides the same, and a setting resumes what auto decided on another machine
    "training.cuda_graphs",
    "training.mixed_precision",
})


# fingerprint keys added after the checkpoint format was released
ADDED_KEYS = frozenset({
    "precision", "effective_batch_size", "data.train_sha256",
    "training.accumulation_schedule", "plan.epoch_updates", "plan.accumulation",
    "model.problem_type", "data.label_delimiter", "training.class_weights",
    "model.lora_rank", "model.lora_alpha", "model.lora_dropout", "model.lora_target_modules",
    "optim.layer_lr_decay", "data.truncation", "data.head_tokens", "data.stride", "optim.lr_scheduler_kwargs",
    "training.label_smoothing", "model.freeze_embeddings", "model.freeze_blocks", "sharded_state",
    "cuda_graphs", "data.encoding", "data.label_map", "training.bias_apart", "data.drop_labels",
    "data.on_missing_label", "training.gradient_accumulation_fusion", "training.attention_kernel", "labels",
})
# fingerprint keys added since, with what a checkpoint written before trained with: compared as that value, since
# another one now would not resume it
TRAINED_BEFORE_ADDED = {"optim.optimizer": "adamw"}


# --------------------------------------------------------------------------- the fingerprint

def config_fingerprint(cfg) -> dict[str, Any]:
    """The config keys of a run's fingerprint: those of the sections that shape the trajectory."""
    sections = cfg.to_dict()
    return {f"{section}.{key}": value for section in COMPARED_SECTIONS for key, value in sections[section].items()
            if f"{section}.{key}" not in MAY_CHANGE_ON_RESUME}


def run_fingerprint(run: "Run") -> dict[str, Any]:
    """What a resume must find unchanged for the rest of the run to be the same run.

    The config sections that shape the trajectory (model, data, training,
    optim; :data:`MAY_CHANGE_ON_RESUME` excepted), the resolved ``b``, ``k``,
    ``P``, the number of training samples and the update plan (so the
    schedule, sized in updates, is the one the checkpoint was on).
    """
    from finetune.cuda_graphs import graphed_run  # torch: not before a config error is said

    fingerprint = config_fingerprint(run.cfg)
    fingerprint.update({
        # the training rows themselves: a file edited in place is another run
        "data.train_sha256": getattr(run, "data_sha256", None),
        # first of what follows from the config: a changed effective batch is named as such
        "effective_batch_size": run.batching.effective_batch_size,
        "precision": run.accelerator.mixed_precision,  # what training.mixed_precision: auto chose here
        "processes": run.batching.num_processes,
        "sharded_state": sharded_state(run.accelerator),  # FSDP's and DeepSpeed's: laid out for these processes
        # micro-batches padded to the graphs' shapes draw other dropout masks: another trajectory, in tolerance
        "cuda_graphs": graphed_run(run),
        "per_device_train_batch_size": run.batching.per_device_batch_size,
        "gradient_accumulation_steps": run.batching.gradient_accumulation_steps,
        "train_samples": len(run.train_dataloader.dataset),
        # the label ids: the data's own order, or that of the trained head the run started from
        "labels": list(run.labels.names),
        # the update plan (k is compared above as gradient_accumulation_steps); these key names are the ones
        # checkpoints have always carried, so that older checkpoints compare
        "plan.updates_per_epoch": run.plan.updates_per_epoch,
        "plan.num_epochs": run.plan.num_epochs,
        "plan.total_updates": run.plan.total_updates,
        "plan.warmup_updates": run.plan.warmup_updates,
        "plan.epoch_updates": run.plan.epoch_updates,
        "plan.accumulation": run.plan.accumulation,
    })
    return json.loads(json.dumps(fingerprint))  # as it reads back from the file (tuples -> lists)


def changed_settings(meta: dict[str, Any], run) -> Optional[str]:
    """What differs between a checkpoint's fingerprint and this run's, in words (``None``: nothing).

    Up to three keys with old and new values: config keys first (what the user
    changed), then what follows from them (the effective batch, b, k, P, the plan).
    Another split of the same effective batch is no difference where it may change
    (:func:`finetune.resplit.may_change_split`).
    """
    saved, current = _fingerprints(meta, run)
    changed = _differences(saved, current, _compared_keys(saved, current))
    engine = saved.get("sharded_state") or current["sharded_state"]
    if changed and engine and split_change(saved, current) and not may_change_split(saved, current):
        changed += f" ({engine} checkpoints are sharded: they resume on the b, k and P that wrote them)"
    return changed


def _fingerprints(meta: dict[str, Any], run) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint's fingerprint, as applied, and this run's."""
    current = run_fingerprint(run)
    return fingerprint_as_applied(written_fingerprint(meta, current), current), current


def written_fingerprint(meta: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's fingerprint, with what a release before an added key of ``current`` trained with
    (:data:`TRAINED_BEFORE_ADDED`)."""
    return {**{k: v for k, v in TRAINED_BEFORE_ADDED.items() if k in current}, **meta.get("fingerprint", {})}


def _compared_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fingerprint keys a resume compares: this run's, and a key only the checkpoint has (one the schema
    dropped, unless it is one that may change: a release that compared it directly); the split of the effective
    batch left out where it may change."""
    keys = list(current) + [k for k in saved if k not in current and k not in MAY_CHANGE_ON_RESUME]
    return [k for k in keys if k not in SPLIT_KEYS] if may_change_split(saved, current) else keys


def fingerprint_as_applied(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's fingerprint with ``cuda_graphs`` and ``precision`` as applied. Checkpoints written before
    ``auto`` record ``training.cuda_graphs`` as spelled, ``true`` or ``false``: ``true`` was applied where graphs
    apply now; those written before the precision was recorded ran in the ``training.mixed_precision`` they name
    (``auto`` aside)."""
    if "cuda_graphs" not in saved and "training.cuda_graphs" in saved:
        saved = {**saved, "cuda_graphs": saved["training.cuda_graphs"] is True and current["cuda_graphs"]}
    if "precision" not in saved and saved.get("training.mixed_precision", "auto") != "auto":
        saved = {**saved, "precision": saved["training.mixed_precision"]}
    return saved


def padding_lengths(run) -> Optional[list[int]]:
    """The fixed lengths a run pads its training micro-batches to (``None``: each to its longest text)."""
    collate = run.train_dataloader.collate_fn
    sizes = getattr(getattr(collate, "pad", collate), "sizes", None)  # a ChunkCollator wraps its padding
    return list(sizes) if sizes is not None else None


def padding_change(meta: dict[str, Any], current: Optional[list[int]], graphed_now: bool) -> Optional[str]:
    """How a checkpoint's micro-batches were padded against how this run's are, in words (``None``: alike).

    Other padding gives the same updates to float rounding, and dropout other masks: a resume goes on, with a
    warning. Checkpoints written before the lengths were recorded padded a compiled or graphed run's
    micro-batches to four lengths a quarter of ``data.max_length`` apart, and an eager run's to their longest.
    """
    from finetune.dataloaders import bucket_lengths

    if "padding_lengths" in meta:
        saved = meta["padding_lengths"]
    else:
        fingerprint = fingerprint_as_applied(meta.get("fingerprint", {}), {"cuda_graphs": graphed_now})
        top = fingerprint.get("data.max_length")
        fixed = fingerprint.get("training.torch_compile") is True or fingerprint.get("cuda_graphs") is True
        saved = bucket_lengths(top, 4) if fixed and isinstance(top, int) else None
    if saved == current:
        return None
    return f"{_padding_in_words(saved)} -> {_padding_in_words(current)}"


def _padding_in_words(lengths: Optional[list[int]]) -> str:
    return "each to its longest text" if lengths is None else f"to lengths {lengths}"


def config_changes(meta: dict[str, Any], cfg) -> Optional[str]:
    """What differs between a checkpoint's config keys and ``cfg``'s, in words (``None``: nothing).

    The half of :func:`changed_settings` that needs no model and no data, so
    that a folder of another run is refused before either is loaded. Keys
    that setup settles (:data:`SETTLED_IN_SETUP`) wait for the full check.
    """
    return _differences(*_config_fingerprints(meta, cfg))


def _config_fingerprints(meta: dict[str, Any], cfg) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """A checkpoint's config keys, ``cfg``'s (as they read back from the file), and the keys that compare before
    setup: those it does not settle (:data:`SETTLED_IN_SETUP`)."""
    current = json.loads(json.dumps(config_fingerprint(cfg)))
    saved = written_fingerprint(meta, current)
    return saved, current, [k for k in current if k not in SETTLED_IN_SETUP]


def _changed_keys(saved: dict[str, Any], current: dict[str, Any], keys: list[str]) -> list[str]:
    # keys that checkpoints of earlier releases lack are not a change
    return [k for k in keys if saved.get(k) != current.get(k) and (k in saved or k not in ADDED_KEYS)]


def _differences(saved: dict[str, Any], current: dict[str, Any], keys: list[str]) -> Optional[str]:
    """Up to three of ``keys`` whose values differ, with old and new values (``None``: none differs)."""
    changed = _changed_keys(saved, current, keys)
    if not changed:
        return None
    shown = "; ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed[:3])
    return shown + (f" (and {len(changed) - 3} more)" if len(changed) > 3 else "")


# --------------------------------------------------------------------------- another run's checkpoints

# what a run asked to train longer (or shorter) changes; its checkpoints cannot take it, its model can
LENGTH_KEYS = ("training.num_train_epochs", "training.max_steps")


def _another_runs_folder(output_dir, change: str, hint: Optional[str] = None) -> ConfigError:
    """The refusal of a folder whose every checkpoint is another run's (``resume_from: auto``)."""
    return ConfigError(f"output.output_dir: {output_dir} holds checkpoints of another run ({change}); "
                       f"pass output.overwrite=true to replace that run, or choose another output.output_dir", hint)


def _longer_run_hint(output_dir, meta: dict[str, Any], cfg, newest: Path) -> Optional[str]:
    """Where only the run's length changed: how to train that run's model further, as a new run. Its schedule
    was planned for the length it had (the learning rate decays to its end), so it cannot be resumed for
    longer; a run that starts from its weights has a schedule of its own."""
    changed = _changed_keys(*_config_fingerprints(meta, cfg))
    if not changed or not set(changed) <= set(LENGTH_KEYS):
        return None
    folder = Path(output_dir)
    model = folder if (folder / "config.json").is_file() else newest  # the finished model, or the last checkpoint
    return (f"to train that run's model further, start a new run from it: the same command with --model {model} "
            f"--output {folder.with_name(folder.name + '-continued')} (a schedule and optimizer of its own)")


def _another_runs_checkpoint(path, change: str) -> ConfigError:
    """The refusal of a named (or ``latest``) checkpoint written under other settings."""
    return ConfigError(f"output.resume_from: {path} was written by a run with other settings: {change}; "
                       f"resume with the same settings, or start afresh")


def refuse_another_runs_checkpoints(cfg) -> None:
    """Before anything is loaded: refuse to resume when the checkpoints at hand are another run's.

    ``output.resume_from: auto`` needs one checkpoint with this config;
    ``latest`` or a named checkpoint must have it. Their files are verified,
    and the data and the plan compared, once the run is built
    (:func:`choose_checkpoint`); this reads only each ``trainer_state.json``.

    Raises:
        ConfigError: the message :func:`choose_checkpoint` or :func:`check_compatible` would give.
    """
    out = cfg.output
    spec = out.resume_from
    if not spec or (spec == "auto" and out.overwrite):
        return
    if spec in ("auto", "latest"):
        candidates = list_checkpoints(out.output_dir)
    else:
        candidates = [resolve_resume(out.output_dir, spec)]
    readable = [(path, _readable_state(path)) for path in candidates]
    changes = [config_changes(meta, cfg) for _, meta in readable if meta is not None]
    if not changes or any(change is None for change in changes):
        return
    if spec == "auto":
        newest, meta = next((path, meta) for path, meta in reversed(readable) if meta is not None)
        raise _another_runs_folder(out.output_dir, changes[-1], _longer_run_hint(out.output_dir, meta, cfg, newest))
    raise _another_runs_checkpoint(readable[-1][0], changes[-1])


def _readable_state(path: Path) -> Optional[dict[str, Any]]:
    try:
        return read_state(path)
    except ConfigError:
        return None  # damaged: choose_checkpoint passes it over, or says so


def check_compatible(meta: dict[str, Any], run, path: Path) -> None:
    """Refuse to resume a checkpoint written under another setup (one line naming what changed).

    Raises:
        ConfigError: listing up to three differing keys with old and new values.
    """
    changed = changed_settings(meta, run)
    if changed:
        raise _refusal(meta, run, f"output.resume_from: {path}", changed, _another_runs_checkpoint(path, changed))


# what a setting left to `auto` decides by the machine, and the value that decides it as a checkpoint's run had
# it: a run requeued onto another kind of machine is still the same run, which the setting resumes
DECIDED_BY_THE_MACHINE = {
    "precision": ("training.mixed_precision", lambda saved: saved),
    # graphs that applied elsewhere may not apply here (a CPU); none applied there is eager, which runs anywhere
    "cuda_graphs": ("training.cuda_graphs", lambda saved: None if saved else "false"),
}


def resuming_overrides(meta: dict[str, Any], run) -> Optional[str]:
    """The overrides that resume a checkpoint whose fingerprint differs from this run's only in what settings
    left to ``auto`` decided on another machine (``training.mixed_precision=bf16``), or None."""
    saved, current = _fingerprints(meta, run)
    changed = _changed_keys(saved, current, _compared_keys(saved, current))
    if not changed or not set(changed) <= set(DECIDED_BY_THE_MACHINE):
        return None
    overrides = []
    for key in changed:
        setting, value_for = DECIDED_BY_THE_MACHINE[key]
        value = value_for(saved[key])
        if value is None or getattr(run.cfg.training, setting.split(".")[1]) != "auto":
            return None
        overrides.append(f"{setting}={value}")
    return " ".join(overrides)


def _refusal(meta: dict[str, Any], run, where: str, change: str, another_run: ConfigError) -> ConfigError:
    """The refusal of a checkpoint with other settings: where only this machine's ``auto`` settings keep it from
    resuming, one that says so and names the overrides that resume it; else ``another_run``."""
    overrides = resuming_overrides(meta, run)
    if overrides is None:
        return another_run
    return ConfigError(f"{where} holds a run whose `auto` settings chose otherwise on the machine that wrote it "
                       f"({change})", hint=f"the same command with {overrides} resumes it")


# --------------------------------------------------------------------------- the checkpoint a run resumes

def choose_checkpoint(run) -> Optional[Path]:
    """The checkpoint this run resumes from, its files verified; ``None`` for a fresh start.

    ``latest`` and ``auto`` take the newest checkpoint whose files match its
    manifest, passing over (with one warning line each) damaged ones and
    directories without a readable ``trainer_state.json``. ``auto`` also
    requires the same run (:func:`check_compatible`); it starts afresh when the
    folder holds no checkpoint, and under ``output.overwrite`` (which then
    clears the folder's earlier run).

    Raises:
        ConfigError: if no intact checkpoint is left, a named one is damaged, or under
            ``auto`` the folder holds only checkpoints of another run.
    """
    out = run.cfg.output
    spec = out.resume_from
    if not spec or (spec == "auto" and out.overwrite):
        return None
    if spec not in ("auto", "latest"):
        path = resolve_resume(out.output_dir, spec)
        problem = verify_checkpoint(path)
        if problem:
            raise ConfigError(f"output.resume_from: {path} is damaged: {problem}; name an older checkpoint")
        return path
    for bad in unreadable_checkpoints(out.output_dir):
        logger.warning("passing over %s: its %s is missing or unreadable", bad, STATE_FILE)
    candidates = list_checkpoints(out.output_dir)
    if not candidates:
        return resolve_resume(out.output_dir, spec)  # auto: a fresh start; latest: the error
    other_run = None
    for path in reversed(candidates):
        problem = verify_checkpoint(path)
        if problem:
            logger.warning("passing over %s: %s", path, problem)
            continue
        if spec == "latest":
            return path
        meta = read_state(path)
        changed = changed_settings(meta, run)
        if changed is None:
            return path
        other_run = other_run or (changed, meta)
    if other_run is not None:
        changed, meta = other_run
        raise _refusal(meta, run, f"output.output_dir: {out.output_dir}", changed,
                       _another_runs_folder(out.output_dir, changed))
    raise ConfigError(f"output.resume_from: {spec}, but no checkpoint in {checkpoints_root(out.output_dir)} is "
                      f"intact (see the warnings above); name one, or pass output.overwrite=true to start afresh")
