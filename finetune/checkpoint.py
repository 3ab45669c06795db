"""Checkpoints and exact resume: the format, finding and verifying checkpoints, and :class:`Checkpointer`,
with which ``fit`` saves and restores them.

A checkpoint is a directory ``<output_dir>/checkpoints/checkpoint-<update>/`` with

* what ``accelerator.save_state`` writes: ``model.safetensors``,
  ``optimizer.bin``, ``random_states_<rank>.pkl`` (one per process: Python,
  NumPy, torch CPU and CUDA generators), ``scaler.pt`` under fp16; a LoRA run
  saves ``adapter/`` (its trained weights alone, PEFT's format) in place of
  ``model.safetensors`` (:mod:`finetune.lora`);
* ``scheduler.pt``: the learning-rate scheduler's ``state_dict``;
* ``config.json``, the tokenizer's files and ``config.yaml``: with the weights,
  a model that ``from_pretrained`` and ``finetune predict`` load (a LoRA
  checkpoint: ``finetune predict``, which adds the adapter to its base model);
* ``trainer_state.json``: the loop's :class:`~finetune.loop.TrainState`
  (epoch, updates, micro-batches of the epoch already consumed, counters), the
  run's *fingerprint* (what must not change on resume), the evaluation history,
  and whether the epoch's evaluation is still due;
* ``manifest.json``, written last: every other file's size and SHA-256. A
  resume verifies it and passes over a checkpoint whose files changed (a
  warning names the file), to the next older one that is intact.

Checkpoints are taken only between updates (at a window boundary): every
``output.checkpoint_every`` updates from the ``on_update`` callback of
:func:`~finetune.loop.train_one_epoch`, after each epoch's evaluation, and when
a signal asks the run to stop. Each is written into ``.tmp-checkpoint-<update>``
and renamed into place once every file is on disk, so a directory named
``checkpoint-<update>`` is always complete; a resume never picks a temporary one.

The data order is a function of the seed and the epoch (see
:class:`~finetune.sampling.EpochSampler`), so the position in the epoch is just
``TrainState.micro_batch``; the resumed loop skips that many micro-batches with
``accelerator.skip_first_batches``. With the RNG states restored as well, a
resumed run makes the same updates as one that was never interrupted (bitwise
in fp32 on the same hardware and thread count).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

# torch is imported where a checkpoint is written or read, not here: the output folder's checks
# (finetune.output_dir) run before anything heavy is loaded, so a refused run answers at once.
from finetune.errors import ConfigError, ModelError, OutputError
from finetune.outputs import CHECKPOINTS_DIR
from finetune.resplit import (SPLIT_KEYS, k_in_epoch, may_change_split, micro_batch_on_new_split, reseed,
                              sharded_state, split_change)
from finetune.selection import EvalHistory

if TYPE_CHECKING:
    from finetune.assembly import Run

logger = logging.getLogger("finetune")

CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-" + CHECKPOINT_PREFIX
OLD_PREFIX = ".old-" + CHECKPOINT_PREFIX
STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
MANIFEST_FILE = "manifest.json"
# 2: with manifest.json. Checkpoints of format 1 (no manifest) still resume, unverified.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)

_NAME = re.compile(rf"^(\.old-)?{CHECKPOINT_PREFIX}(\d+)$")  # OLD_PREFIX or the final name

# Config keys that may change between a run and its resume: they do not touch the
# training trajectory. Every other key of these sections must be identical.
COMPARED_SECTIONS = ("model", "data", "training", "optim")
# config keys that setup may settle (write back) after the early comparison of config_changes
SETTLED_IN_SETUP = frozenset({"data.validation_split_name"})
MAY_CHANGE_ON_RESUME = frozenset({
    "training.on_nonfinite",
    "training.max_skipped",
    "training.eval_each_epoch",
    "training.per_device_eval_batch_size",
    "data.num_workers",
    # recomputation replays the same values (and dropout masks): a run that ran out of memory may resume with it
    "training.gradient_checkpointing",
    "training.memory_check",
    "training.cpu_heap",  # where freed memory goes, not what is computed
    # compared through the resolved b, k, P below, so that either spelling resumes, and another split of the
    # same effective batch too (finetune.resplit)
    "training.gradient_accumulation_steps",
    "training.effective_batch_size",
    "training.per_device_train_batch_size",
    # compared as applied (the fingerprint's cuda_graphs), so that auto resumes what true or false wrote
    "training.cuda_graphs",
})


# --------------------------------------------------------------------------- finding checkpoints

def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    """``<output_dir>/checkpoints``."""
    return Path(output_dir) / CHECKPOINTS_DIR


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint directory.

    Raises:
        ConfigError: if the directory is not a complete checkpoint of this format.
    """
    path = Path(path)
    try:
        meta = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"output.resume_from: {path} is not a complete checkpoint (no {STATE_FILE})") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"output.resume_from: {path / STATE_FILE} cannot be read ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        raise ConfigError(f"output.resume_from: {path / STATE_FILE} is not a finetune checkpoint (format "
                          f"{meta.get('format') if isinstance(meta, dict) else '?'}, expected {FORMAT_VERSION})")
    return meta


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``<output_dir>/checkpoints``, oldest (fewest updates) first.

    Temporary directories of a save that was cut short, and directories
    without a readable ``trainer_state.json``, are not checkpoints. A
    ``.old-checkpoint-<update>`` (the previous copy while the same update is
    saved again) counts only if a kill left it without its replacement.
    """
    root = checkpoints_root(output_dir)
    found: dict[int, Path] = {}
    if root.is_dir():
        for child in sorted(root.iterdir(), key=lambda p: p.name.startswith(".")):  # final names first
            match = _NAME.match(child.name)
            if match and child.is_dir() and int(match.group(2)) not in found:
                try:
                    read_state(child)
                except ConfigError:
                    continue
                found[int(match.group(2))] = child
    return [found[step] for step in sorted(found)]


def resolve_resume(output_dir: str | os.PathLike, resume_from: Optional[str]) -> Optional[Path]:
    """The checkpoint ``output.resume_from`` names at first sight (no file verified), or ``None`` for a fresh run.

    A start-up check, before any work: :class:`Checkpointer` then verifies the
    files and, for ``latest`` and ``auto``, passes over damaged checkpoints.

    Args:
        output_dir: ``output.output_dir``.
        resume_from: ``auto`` (the newest complete checkpoint under
            ``<output_dir>/checkpoints``, or ``None`` when there is none),
            ``latest`` (the same, but there must be one) or a checkpoint directory.

    Raises:
        ConfigError: if ``latest`` finds nothing complete, or the directory is no checkpoint.
    """
    if not resume_from:
        return None
    if resume_from in ("auto", "latest"):
        found = list_checkpoints(output_dir)
        if not found and resume_from == "latest":
            raise ConfigError(
                f"output.resume_from: latest, but {checkpoints_root(output_dir)} holds no complete checkpoint "
                f"(output.resume_from=auto starts afresh when there is none)"
            )
        return found[-1] if found else None
    path = Path(resume_from).expanduser()
    if not path.is_dir():
        raise ConfigError(f"output.resume_from: {path} is not a directory (give a checkpoint directory, latest "
                          f"or auto)")
    read_state(path)
    return path


def unreadable_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Directories named like checkpoints whose ``trainer_state.json`` is missing or cannot be read."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    bad = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and _NAME.match(child.name) and not child.name.startswith("."):
            try:
                read_state(child)
            except ConfigError:
                bad.append(child)
    return bad


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """``manifest.json``: the size and SHA-256 of every file in the checkpoint directory (written last)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    entries = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (directory / MANIFEST_FILE).write_text(json.dumps({"files": entries}, indent=1) + "\n", encoding="utf-8")


def verify_checkpoint(path: Path) -> Optional[str]:
    """What is wrong with a checkpoint's files, or ``None`` when they are the ones saved.

    A checkpoint of format 1 has no manifest: it is taken as it is.
    """
    try:
        meta = read_state(path)
    except ConfigError as exc:
        return exc.message.split(": ", 1)[-1]
    if meta.get("format", 1) < 2:
        return None
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST_FILE} is missing or unreadable"
    for name, entry in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, {entry['size']} were saved"
        if _sha256(file) != entry["sha256"]:
            return f"{name} does not hold the bytes that were saved (SHA-256 differs)"
    return None


# --------------------------------------------------------------------------- what must not change

# fingerprint keys added after the checkpoint format was released
ADDED_KEYS = frozenset({
    "precision", "effective_batch_size", "data.train_sha256",
    "training.accumulation_schedule", "plan.epoch_updates", "plan.accumulation",
    "model.problem_type", "data.label_delimiter", "training.class_weights",
    "model.lora_rank", "model.lora_alpha", "model.lora_dropout", "model.lora_target_modules",
    "optim.layer_lr_decay", "data.truncation", "data.head_tokens", "data.stride", "optim.lr_scheduler_kwargs",
    "training.label_smoothing", "model.freeze_embeddings", "model.freeze_blocks", "sharded_state",
    "cuda_graphs", "data.encoding", "data.label_map",
})


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
    current = run_fingerprint(run)
    saved = with_graphs_as_applied(meta.get("fingerprint", {}), current)
    # a key only the checkpoint has: one the schema dropped, unless it is one that may change (a release that
    # compared it directly)
    keys = list(current) + [k for k in saved if k not in current and k not in MAY_CHANGE_ON_RESUME]
    if may_change_split(saved, current):
        return _differences(saved, current, [k for k in keys if k not in SPLIT_KEYS])
    changed = _differences(saved, current, keys)
    engine = saved.get("sharded_state") or current["sharded_state"]
    if changed and engine and split_change(saved, current):
        changed += f" ({engine} checkpoints are sharded: they resume on the b, k and P that wrote them)"
    return changed


def with_graphs_as_applied(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's fingerprint with ``cuda_graphs`` as applied. Checkpoints written before ``auto`` record
    ``training.cuda_graphs`` as spelled, ``true`` or ``false``: ``true`` was applied where graphs apply now."""
    if "cuda_graphs" in saved or "training.cuda_graphs" not in saved:
        return saved
    return {**saved, "cuda_graphs": saved["training.cuda_graphs"] is True and current["cuda_graphs"]}


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
        fingerprint = with_graphs_as_applied(meta.get("fingerprint", {}), {"cuda_graphs": graphed_now})
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
    saved = meta.get("fingerprint", {})
    current = json.loads(json.dumps(config_fingerprint(cfg)))
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
        raise _another_runs_checkpoint(path, changed)


# --------------------------------------------------------------------------- saving and loading

@contextlib.contextmanager
def _quiet_accelerate():
    """Hold Accelerate's per-file INFO lines (six per save) back: one line per checkpoint is ours."""
    loggers = [logging.getLogger(name) for name in ("accelerate.accelerator", "accelerate.checkpointing")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _fsync_tree(path: Path) -> None:
    """Flush the files of ``path`` to disk, so that the rename publishes complete data even after a crash."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(fd)


def save_checkpoint(run, history: list[dict[str, Any]], pending_eval_epoch: Optional[int] = None,
                    reason: str = "", protect: Optional[Path] = None) -> Path:
    """Save the run's full state at the current window boundary; call it on every process.

    ``accelerator.save_state`` writes model (safetensors), optimizer, RNG states
    of every process and the fp16 scaler; the scheduler and the loop's state are
    added here, and last ``manifest.json`` (every file's size and SHA-256).
    Everything goes into a temporary directory that is renamed to
    ``checkpoint-<update>`` once complete; afterwards the oldest checkpoints
    beyond ``output.keep_last`` are deleted. Before writing, the free space is
    checked against the size of the last checkpoint.

    The scheduler is saved here rather than through
    ``accelerator.register_for_checkpointing`` because ``load_state`` unpickles
    registered objects with ``weights_only=False``; this file is read back with
    ``weights_only=True``.

    Args:
        run: The :class:`~finetune.assembly.Run`; ``run.state`` must sit at a window boundary.
        history: Evaluation records so far (restored into ``metrics.json`` on resume).
        pending_eval_epoch: The epoch whose evaluation has not run yet (a stop
            right after its last update), or ``None``.
        reason: Why it was saved, for the log line.
        protect: A checkpoint that pruning must keep (the best one).

    Returns:
        The checkpoint directory.

    Raises:
        OutputError: on every process, when any of them cannot write (a full disk, a
            permission): the temporary directory is removed, earlier checkpoints are untouched.
    """
    acc = run.accelerator
    root = checkpoints_root(run.cfg.output.output_dir)
    step = run.state.step
    final = root / f"{CHECKPOINT_PREFIX}{step}"
    tmp = root / f"{TMP_PREFIX}{step}"
    problem = None
    if acc.is_main_process:
        problem = _space_problem(root)
        if problem is None:
            problem = _attempt(lambda: _fresh_dir(tmp), root)
    _stop_on_problem(acc, problem, tmp, step)
    problem = _attempt(lambda: _write_state(run, tmp, history, pending_eval_epoch, reason), root)
    _stop_on_problem(acc, problem, tmp, step)  # every rank's RNG file is in place, or all stop
    if acc.is_main_process:
        problem = _attempt(lambda: _publish(tmp, final, root), root)
    _stop_on_problem(acc, problem, tmp, step)
    if acc.is_main_process:
        _prune(root, run.cfg.output.keep_last, keep={final, protect})
        logger.info("checkpoint saved: %s (%s)", final, reason or f"update {step}")
    acc.wait_for_everyone()
    return final


def _model_weights_of(run):
    """Accelerate's saving and loading of the whole model, or, for a LoRA run, of its adapter alone."""
    from finetune.lora import adapter_in_checkpoints, is_lora

    return adapter_in_checkpoints(run.accelerator, run.model) if is_lora(run.model) else contextlib.nullcontext()


def _fresh_dir(tmp: Path) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def _write_state(run, tmp: Path, history, pending_eval_epoch, reason: str) -> None:
    """Everything but the manifest into ``tmp``: Accelerate's state on every process, then ours on the main one."""
    import torch

    acc = run.accelerator
    with _quiet_accelerate(), _model_weights_of(run):
        acc.save_state(str(tmp), safe_serialization=True)
    if acc.is_main_process:
        if run.scheduler is not None:
            torch.save(run.scheduler.state_dict(), tmp / SCHEDULER_FILE)
        write_model_files(run, tmp)
        meta = {
            "format": FORMAT_VERSION,
            "state": run.state.to_dict(),
            "num_processes": acc.num_processes,
            "cpu_threads": torch.get_num_threads() if acc.device.type == "cpu" else None,
            "padding_lengths": padding_lengths(run),
            "fingerprint": run_fingerprint(run),
            "history": history,
            "pending_eval_epoch": pending_eval_epoch,
            "reason": reason,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _publish(tmp: Path, final: Path, root: Path) -> None:
    """The manifest (last), flush to disk, and the rename that makes the checkpoint exist."""
    write_manifest(tmp)
    _fsync_tree(tmp)
    if final.exists():
        # the same update saved again (its epoch's evaluation ran since): swap, never leaving
        # a half-built directory under the final name
        old = root / f"{OLD_PREFIX}{final.name.removeprefix(CHECKPOINT_PREFIX)}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _space_problem(root: Path) -> Optional[str]:
    """Not enough free space for another checkpoint the size of the last one, said in words; else ``None``."""
    previous = list_checkpoints(root.parent)
    if not previous:
        return None
    needed = _size(previous[-1])
    free = shutil.disk_usage(root).free
    if free >= needed:
        return None
    return (f"no space left for a checkpoint: {free / 1e6:.0f} MB free, the last one took {needed / 1e6:.0f} MB")


def _attempt(action, root: Path) -> Optional[str]:
    """Run ``action``; a failed write (a full disk, a permission, an OS error) comes back as a phrase."""
    try:
        action()
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "no space left on device"
        return f"{exc.strerror or exc}" + (f" ({exc.filename})" if getattr(exc, "filename", None) else "")
    except RuntimeError as exc:
        # torch.save reports a failed write as a RuntimeError from its zip writer, without the OS's reason
        text = str(exc)
        if not any(mark in text for mark in ("PytorchStreamWriter", "unexpected pos", "file write failed")):
            raise
        if shutil.disk_usage(root).free < (1 << 20):
            return "no space left on device"
        return f"the write failed ({text.splitlines()[0][:120]})"
    return None


def _stop_on_problem(acc, problem: Optional[str], tmp: Path, step: int) -> None:
    """All processes learn whether any failed to write; then all stop, the partial checkpoint removed.

    Raises:
        OutputError: one line naming the folder and what failed.
    """
    if acc.num_processes > 1:
        from accelerate.utils import gather_object

        problems = [p for p in gather_object([problem]) if p]
        problem = problems[0] if problems else None
    if problem is None:
        return
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    raise OutputError(
        f"cannot save {CHECKPOINT_PREFIX}{step} in {tmp.parent}: {problem}; the partial checkpoint was removed "
        f"and the earlier ones are intact (free space, then run the same command to resume)"
    )


def write_model_files(run, directory: Path) -> None:
    """Beside the weights ``save_state`` wrote: the model's ``config.json``, the tokenizer and the run's config.

    With them a checkpoint directory is a model that ``from_pretrained``,
    ``transformers.pipeline`` and ``finetune predict`` load, so a run stopped
    before its end can still be used.
    """
    from finetune.config import save_config
    from finetune.outputs import CONFIG_FILE

    run.accelerator.unwrap_model(run.model).config.save_pretrained(directory)
    run.tokenizer.save_pretrained(directory)
    save_config(run.cfg, directory / CONFIG_FILE)


def _prune(root: Path, keep_last: Optional[int], keep: set) -> None:
    """Delete checkpoints beyond ``keep_last`` (oldest first, never one in ``keep``) and leftovers of
    interrupted saves. The ones in ``keep`` count towards ``keep_last``."""
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            shutil.rmtree(child, ignore_errors=True)  # a save cut short by a kill
    if keep_last is None:
        return
    complete = list_checkpoints(root.parent)
    kept = [p for p in complete if p in keep]
    others = [p for p in complete if p not in keep]
    for path in others[: max(0, len(others) - max(0, keep_last - len(kept)))]:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(run, path: str | os.PathLike, meta: Optional[dict[str, Any]] = None,
                    fresh_streams: bool = False) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, RNG states and ``run.state`` from a checkpoint.

    Call on every process, after :func:`check_compatible`, as late as possible
    before training (the restored RNG states are the ones the next update needs).
    With ``fresh_streams`` (a resume on another split, :mod:`finetune.resplit`) the
    processes are seeded afresh instead: the checkpoint holds the streams of other processes.

    Returns:
        The checkpoint's ``trainer_state.json`` (``history``, ``pending_eval_epoch``, ...).

    Raises:
        ModelError: if the RNG states could not be restored (the resume would not be exact).
    """
    import torch

    path = Path(path)
    meta = meta if meta is not None else read_state(path)
    acc = run.accelerator
    # Accelerate logs a failure to restore the RNG states at INFO level and goes on; a
    # resume without them is not exact, so check that the generator really changed.
    torch.manual_seed(0x5EED)
    sentinel = torch.get_rng_state()
    # model via safetensors; optimizer and RNG states via torch.load(weights_only=True)
    try:
        with _quiet_accelerate(), _model_weights_of(run):
            acc.load_state(str(path))
    except pickle.UnpicklingError as exc:
        # weights_only refused an object that is not plain data: never unpickle it
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(f"{path}: a file holds objects that are not plain tensors and data, so it is not "
                         f"loaded (torch.load weights_only: {first[:120]})") from None
    if torch.equal(torch.get_rng_state(), sentinel) and not fresh_streams:
        raise ModelError(f"{path}: could not restore the random number generator states "
                         f"(random_states_{acc.process_index}.pkl)")
    if run.scheduler is not None:
        run.scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True))
    check_finite(run, path)
    for key, value in meta["state"].items():
        setattr(run.state, key, value)
    if fresh_streams:
        reseed(run.cfg.training.seed, run.state.step)
    return meta


def check_finite(run, path: Path) -> None:
    """The loaded weights and optimizer state hold no NaN or inf (a checkpoint saved from a diverged run).

    Raises:
        ModelError: naming the first tensor that is not finite.
    """
    import torch

    model = run.accelerator.unwrap_model(run.model)
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise ModelError(f"{path}: weight {name} holds NaN or inf values; resume from an earlier checkpoint "
                             f"(output.resume_from=<its directory>)")
    for group_state in run.optimizer.state.values():
        for key, value in group_state.items():
            if torch.is_tensor(value) and value.is_floating_point() and not torch.isfinite(value).all():
                raise ModelError(f"{path}: the optimizer state ({key}) holds NaN or inf values; resume from an "
                                 f"earlier checkpoint (output.resume_from=<its directory>)")


def load_model_weights(run, path: Path) -> None:
    """Load only the weights of checkpoint ``path`` into the run's model (on every process).

    Raises:
        ModelError: if the checkpoint or its weights file is gone.
    """
    from safetensors.torch import load_model

    from finetune.lora import ADAPTER_DIR, is_lora, load_adapter_weights

    if is_lora(run.model):
        load_adapter_weights(run.accelerator.unwrap_model(run.model), path / ADAPTER_DIR)
        return
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ModelError(f"{weights}: missing; cannot load the best model (was the checkpoint deleted?)")
    model = run.accelerator.unwrap_model(run.model)
    # the weights' own device: safetensors refuses "cpu:0", the Accelerator's device on a multi-process CPU run
    load_model(model, str(weights), strict=True, device=str(next(model.parameters()).device))


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
        changed = changed_settings(read_state(path), run)
        if changed is None:
            return path
        other_run = other_run or changed
    if other_run is not None:
        raise _another_runs_folder(out.output_dir, other_run)
    raise ConfigError(f"output.resume_from: {spec}, but no checkpoint in {checkpoints_root(out.output_dir)} is "
                      f"intact (see the warnings above); name one, or pass output.overwrite=true to start afresh")


# --------------------------------------------------------------------------- the callback fit uses

class Checkpointer:
    """Saving and restoring the run's checkpoints, for :func:`finetune.fitting.fit`.

    :meth:`restore` loads the checkpoint ``output.resume_from`` names (chosen
    and verified when this is made, before anything is written).
    :meth:`after_update` saves every ``output.checkpoint_every`` updates, or
    at once when the run is stopping; ``fit`` saves after each epoch's
    evaluation with :meth:`save`. When to stop is not decided here (see
    :class:`finetune.signals.StopSignals`), nor which evaluation is best (see
    :class:`finetune.selection.EvalHistory`, which every checkpoint saves).

    Args:
        run: The :class:`~finetune.assembly.Run`.
        history: The run's evaluation history (saved with each checkpoint; restored on resume).
    """

    def __init__(self, run: "Run", history: EvalHistory):
        self.run = run
        self.history = history
        out = run.cfg.output
        self.enabled = out.save_checkpoints
        self.every = out.checkpoint_every
        self.resume_path = choose_checkpoint(run)
        self._resume_meta = read_state(self.resume_path) if self.resume_path is not None else None
        self._split_change: Optional[str] = None  # "(b, k, P) = ... -> ..." when resuming on another split
        if self._resume_meta is not None:
            check_compatible(self._resume_meta, run, self.resume_path)
            self._split_change = split_change(self._resume_meta.get("fingerprint", {}), run_fingerprint(run))
        self.last_saved: Optional[Path] = self.resume_path
        self._saved_at: Optional[tuple[int, int, int]] = None

    # -- resume

    def restore(self) -> Optional[int]:
        """Load the checkpoint named by ``output.resume_from`` (if any) into the run and the history.

        Returns:
            The epoch whose evaluation is still due, or ``None``.
        """
        import torch

        if self.resume_path is None:
            return None
        meta = load_checkpoint(self.run, self.resume_path, self._resume_meta, fresh_streams=bool(self._split_change))
        self.history.restore(meta.get("history", []))
        if self._split_change:
            self._go_on_at_the_new_split(meta["fingerprint"])
        threads, saved_threads = torch.get_num_threads(), meta.get("cpu_threads")
        if (self.run.accelerator.device.type == "cpu" and saved_threads and saved_threads != threads
                and not self._split_change and self.run.accelerator.is_main_process):
            logger.warning("resuming with %d CPU threads per process, the checkpoint ran with %d: the rest of the "
                           "run is the same training but not bitwise the uninterrupted run (FINETUNE_CPU_THREADS=%d "
                           "restores that)", threads, saved_threads, saved_threads)
        self._warn_of_other_padding(meta)
        self._saved_at = self._position()
        state = self.run.state
        logger.info("resumed from %s: update %d, epoch %d, micro-batch %d", self.resume_path, state.step,
                    state.epoch, state.micro_batch)
        return meta.get("pending_eval_epoch")

    def _warn_of_other_padding(self, meta: dict[str, Any]) -> None:
        """Say so where this run pads its micro-batches otherwise than the checkpoint's run did (another
        release's fixed lengths, say): the same training, not bitwise."""
        from finetune.cuda_graphs import graphed_run

        change = padding_change(meta, padding_lengths(self.run), graphed_run(self.run))
        if change and not self._split_change and self.run.accelerator.is_main_process:
            logger.warning("resuming with micro-batches padded otherwise than the checkpoint's run padded them "
                           "(%s): the rest of the run is the same training to float rounding, but not bitwise the "
                           "uninterrupted run, and dropout draws other masks", change)

    def _go_on_at_the_new_split(self, saved: dict[str, Any]) -> None:
        """Move the epoch's position to the new ``k`` (the same windows trained), and say what changed."""
        state, run = self.run.state, self.run
        state.micro_batch = micro_batch_on_new_split(state.micro_batch, k_in_epoch(saved, state.epoch),
                                                     run.plan.k_at(state.epoch), len(run.train_dataloader))
        if run.accelerator.is_main_process:
            logger.warning("resuming on another split of the effective batch of %d: %s. The updates are the same "
                           "to float rounding, not bitwise the uninterrupted run's, and dropout draws other masks",
                           run.batching.effective_batch_size, self._split_change)

    # -- saving

    def _position(self) -> tuple[int, int, int]:
        s = self.run.state
        return (s.step, s.epoch, s.micro_batch)

    def save(self, reason: str, pending_eval_epoch: Optional[int] = None) -> Optional[Path]:
        """Save a checkpoint now (all processes), unless checkpoints are off."""
        if not self.enabled:
            return None
        self.last_saved = save_checkpoint(self.run, self.history.records, pending_eval_epoch, reason,
                                          protect=self.best())
        self._saved_at = self._position()
        return self.last_saved

    def save_unless_saved(self, reason: str, pending_eval_epoch: Optional[int] = None) -> None:
        """Save, unless a checkpoint of this very position exists already (a stop right after a save)."""
        if self._saved_at != self._position():
            self.save(reason, pending_eval_epoch)

    def best(self) -> Optional[Path]:
        """The best evaluation's checkpoint (``evaluation.metric_for_best_model``), or ``None``."""
        step = self.history.best_step
        return None if step is None else checkpoints_root(self.run.cfg.output.output_dir) / f"{CHECKPOINT_PREFIX}{step}"

    def after_update(self, state, stopping: Optional[int] = None) -> None:
        """After every update: a checkpoint every ``output.checkpoint_every`` updates, or now when the run
        stops on signal ``stopping``. The last update of an epoch (or of the run) is left to ``fit``,
        which saves after the epoch's evaluation."""
        per_epoch = len(self.run.train_dataloader)
        if state.micro_batch >= per_epoch or state.step >= self.run.plan.total_updates:
            return
        if self._saved_at == self._position():
            return  # nothing new (a skipped update)
        if stopping is not None:
            self.save(f"{signal.Signals(stopping).name} after update {state.step}")
        elif self.every and state.step % self.every == 0 and (self._saved_at or (-1,))[0] != state.step:
            self.save(f"every {self.every} updates")

    def where(self) -> str:
        """Where the last checkpoint is, for the message of a stopped run."""
        if self.enabled and self.last_saved is not None:
            return f"checkpoint {self.last_saved}"
        return "no checkpoint saved (output.save_checkpoints is false)"

    def last_good(self) -> str:
        """Where the last checkpoint is, for a message (the non-finite stop)."""
        if self.last_saved is None:
            return "no checkpoint saved yet"
        return (f"last good checkpoint: {self.last_saved}. Resuming it with the same settings replays the same "
                f"updates; to go on with others (a lower optim.learning_rate, say), start a run from its weights: "
                f"model.name_or_path={self.last_saved} output.output_dir=<a new folder>")
