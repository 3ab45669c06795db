"""Checkpoints and exact resume: what a checkpoint holds, and saving and loading one. When ``fit`` saves and
what it restores is :class:`finetune.checkpointer.Checkpointer`; the folder's names, finding, verifying and
publishing are :mod:`finetune.checkpoint_files`; which checkpoint a run resumes, and what must not change for it
to, :mod:`finetune.resuming`.

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
import json
import logging
import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any, Optional

# torch is imported where a checkpoint is written or read, not here: the output folder's checks
# (finetune.output_dir) run before anything heavy is loaded, so a refused run answers at once.
from finetune.checkpoint_files import (CHECKPOINT_PREFIX, FORMAT_VERSION, SCHEDULER_FILE, STATE_FILE, TMP_PREFIX,
                                       checkpoints_root, fresh_dir, prune, publish, read_state, space_problem)
from finetune.errors import ModelError, OutputError
from finetune.resplit import reseed
from finetune.resuming import padding_lengths, run_fingerprint

logger = logging.getLogger("finetune")


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
        run: The :class:`~finetune.run.Run`; ``run.state`` must sit at a window boundary.
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
        problem = space_problem(root)
        if problem is None:
            problem = _attempt(lambda: fresh_dir(tmp), root)
    _stop_on_problem(acc, problem, tmp, step)
    problem = _attempt(lambda: _write_state(run, tmp, history, pending_eval_epoch, reason), root)
    _stop_on_problem(acc, problem, tmp, step)  # every rank's RNG file is in place, or all stop
    if acc.is_main_process:
        problem = _attempt(lambda: publish(tmp, final, root), root)
    _stop_on_problem(acc, problem, tmp, step)
    if acc.is_main_process:
        prune(root, run.cfg.output.keep_last, keep={final, protect})
        logger.info("checkpoint saved: %s (%s)", final, reason or f"update {step}")
    acc.wait_for_everyone()
    return final


def _model_weights_of(run):
    """Accelerate's saving and loading of the whole model, or, for a LoRA run, of its adapter alone."""
    from finetune.lora import adapter_in_checkpoints, is_lora

    return adapter_in_checkpoints(run.accelerator, run.model) if is_lora(run.model) else contextlib.nullcontext()


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


def load_checkpoint(run, path: str | os.PathLike, meta: Optional[dict[str, Any]] = None,
                    fresh_streams: bool = False) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, RNG states and ``run.state`` from a checkpoint.

    Call on every process, after :func:`~finetune.resuming.check_compatible`, as late as possible
    before training (the restored RNG states are the ones the next update needs).
    With ``fresh_streams`` (a resume on another split, :mod:`finetune.resplit`) the
    processes are seeded afresh instead: the checkpoint holds the streams of other processes.

    Returns:
        The checkpoint's ``trainer_state.json`` (``history``, ``pending_eval_epoch``, ...).

    Raises:
        ModelError: if the RNG states could not be restored (the resume would not be exact), or the optimizer's
            state is of other parameter groups than ``run.optimizer``'s.
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
    except ValueError as exc:
        if "parameter group" not in str(exc):  # torch's words for an optimizer state of other groups
            raise
        raise ModelError(f"{path}: its optimizer state holds other parameter groups than this run's optimizer "
                         f"({exc}): the weights that train, or the rates they train at, were counted otherwise "
                         f"when it was saved (by an earlier finetune's count of the layers, or for another model)",
                         hint="resume it with the finetune that wrote it, or start anew with output.overwrite=true "
                              "or another output.output_dir") from None
    if torch.equal(torch.get_rng_state(), sentinel) and not fresh_streams:
        raise ModelError(f"{path}: could not restore the random number generator states "
                         f"(random_states_{acc.process_index}.pkl), without which the resumed run would draw "
                         f"other dropout masks than the run it continues",
                         hint="resume from an earlier checkpoint (output.resume_from=<its directory>)")
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
