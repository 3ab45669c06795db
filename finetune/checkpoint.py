"""Checkpoints and exact resume, and :class:`Checkpointer`, the callback with which ``fit`` saves them.

A checkpoint is a directory ``<output_dir>/checkpoints/checkpoint-<update>/`` with

* what ``accelerator.save_state`` writes: ``model.safetensors``,
  ``optimizer.bin``, ``random_states_<rank>.pkl`` (one per process: Python,
  NumPy, torch CPU and CUDA generators), ``scaler.pt`` under fp16;
* ``scheduler.pt``: the learning-rate scheduler's ``state_dict``;
* ``config.json``, the tokenizer's files and ``config.yaml``: with the weights,
  a model that ``from_pretrained`` and ``finetune predict`` load;
* ``trainer_state.json``: the loop's :class:`~finetune.loop.TrainState`
  (epoch, updates, micro-batches of the epoch already consumed, counters), the
  run's *fingerprint* (what must not change on resume), the evaluation history,
  and whether the epoch's evaluation is still due.

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
import json
import logging
import os
import re
import shutil
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from finetune.errors import ConfigError, ModelError
from finetune.outputs import CHECKPOINTS_DIR
from finetune.selection import Selection
from finetune.signals import RunInterrupted, StopSignals, resume_command

logger = logging.getLogger("finetune")

CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-" + CHECKPOINT_PREFIX
OLD_PREFIX = ".old-" + CHECKPOINT_PREFIX
STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
FORMAT_VERSION = 1

_NAME = re.compile(rf"^(\.old-)?{CHECKPOINT_PREFIX}(\d+)$")  # OLD_PREFIX or the final name

# Config keys that may change between a run and its resume: they do not touch the
# training trajectory. Every other key of these sections must be identical.
COMPARED_SECTIONS = ("model", "data", "training", "optim")
MAY_CHANGE_ON_RESUME = frozenset({
    "training.on_nonfinite",
    "training.max_skipped",
    "training.eval_each_epoch",
    "training.per_device_eval_batch_size",
    "data.num_workers",
    # compared through the resolved b, k, P below, so that either spelling resumes
    "training.gradient_accumulation_steps",
    "training.effective_batch_size",
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
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
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
    """The checkpoint ``output.resume_from`` names, or ``None`` for a fresh run.

    Args:
        output_dir: ``output.output_dir``.
        resume_from: ``latest`` (the complete checkpoint with the most updates
            under ``<output_dir>/checkpoints``) or a checkpoint directory.

    Raises:
        ConfigError: if there is nothing complete to resume from.
    """
    if not resume_from:
        return None
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise ConfigError(
                f"output.resume_from: latest, but {checkpoints_root(output_dir)} holds no complete checkpoint "
                f"(drop output.resume_from to start afresh, with output.overwrite=true)"
            )
        return found[-1]
    path = Path(resume_from).expanduser()
    if not path.is_dir():
        raise ConfigError(f"output.resume_from: {path} is not a directory (give a checkpoint directory or latest)")
    read_state(path)
    return path


# --------------------------------------------------------------------------- what must not change

# fingerprint keys added after the checkpoint format was released
ADDED_KEYS = frozenset({"precision", "training.accumulation_schedule", "plan.epoch_updates", "plan.accumulation"})


def run_fingerprint(run) -> dict[str, Any]:
    """What a resume must find unchanged for the rest of the run to be the same run.

    The config sections that shape the trajectory (model, data, training,
    optim; :data:`MAY_CHANGE_ON_RESUME` excepted), the resolved ``b``, ``k``,
    ``P``, the number of training samples and the update plan (so the
    schedule, sized in updates, is the one the checkpoint was on).
    """
    cfg = run.cfg.to_dict()
    fingerprint: dict[str, Any] = {}
    for section in COMPARED_SECTIONS:
        for key, value in cfg[section].items():
            name = f"{section}.{key}"
            if name not in MAY_CHANGE_ON_RESUME:
                fingerprint[name] = value
    fingerprint.update({
        "precision": run.accelerator.mixed_precision,  # what training.mixed_precision: auto chose here
        "processes": run.batching.num_processes,
        "per_device_train_batch_size": run.batching.per_device_batch_size,
        "gradient_accumulation_steps": run.batching.gradient_accumulation_steps,
        "train_samples": len(run.train_dataloader.dataset),
        # k is compared above as gradient_accumulation_steps
        **{f"plan.{k}": v for k, v in asdict(run.plan).items() if k != "gradient_accumulation_steps"},
    })
    return json.loads(json.dumps(fingerprint))  # as it reads back from the file (tuples -> lists)


def check_compatible(meta: dict[str, Any], run, path: Path) -> None:
    """Refuse to resume a checkpoint written under another setup (one line naming what changed).

    Raises:
        ConfigError: listing up to three differing keys with old and new values.
    """
    saved = meta.get("fingerprint", {})
    current = run_fingerprint(run)
    # config keys first (what the user changed), then what follows from them (b, k, P, the plan)
    keys = list(current) + [k for k in saved if k not in current]
    # keys that checkpoints of earlier releases lack are not a change
    changed = [k for k in keys if saved.get(k) != current.get(k) and (k in saved or k not in ADDED_KEYS)]
    if changed:
        shown = "; ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed[:3])
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        raise ConfigError(
            f"output.resume_from: {path} was written by a run with other settings: {shown}{more}; "
            f"resume with the same settings, or start afresh"
        )


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
    added here. Everything goes into a temporary directory that is renamed to
    ``checkpoint-<update>`` once complete; afterwards the oldest checkpoints
    beyond ``output.keep_last`` are deleted.

    The scheduler is saved here rather than through
    ``accelerator.register_for_checkpointing`` because ``load_state`` unpickles
    registered objects with ``weights_only=False``; this file is read back with
    ``weights_only=True``.

    Args:
        run: The :class:`~finetune.runner.Run`; ``run.state`` must sit at a window boundary.
        history: Evaluation records so far (restored into ``metrics.json`` on resume).
        pending_eval_epoch: The epoch whose evaluation has not run yet (a stop
            right after its last update), or ``None``.
        reason: Why it was saved, for the log line.
        protect: A checkpoint that pruning must keep (the best one).

    Returns:
        The checkpoint directory.
    """
    acc = run.accelerator
    root = checkpoints_root(run.cfg.output.output_dir)
    step = run.state.step
    final = root / f"{CHECKPOINT_PREFIX}{step}"
    tmp = root / f"{TMP_PREFIX}{step}"
    if acc.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    with _quiet_accelerate():
        acc.save_state(str(tmp), safe_serialization=True)
    if acc.is_main_process:
        if run.scheduler is not None:
            torch.save(run.scheduler.state_dict(), tmp / SCHEDULER_FILE)
        write_model_files(run, tmp)
        meta = {
            "format": FORMAT_VERSION,
            "state": run.state.to_dict(),
            "num_processes": acc.num_processes,
            "fingerprint": run_fingerprint(run),
            "history": history,
            "pending_eval_epoch": pending_eval_epoch,
            "reason": reason,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        # written last: with the rename below, its presence marks a complete checkpoint
        (tmp / STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    acc.wait_for_everyone()  # every rank's RNG file is in place
    if acc.is_main_process:
        _fsync_tree(tmp)
        if final.exists():
            # the same update saved again (its epoch's evaluation ran since): swap, never leaving
            # a half-built directory under the final name
            old = root / f"{OLD_PREFIX}{step}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, run.cfg.output.keep_last, keep={final, protect})
        logger.info("checkpoint saved: %s (%s)", final, reason or f"update {step}")
    acc.wait_for_everyone()
    return final


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


def load_checkpoint(run, path: str | os.PathLike, meta: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, RNG states and ``run.state`` from a checkpoint.

    Call on every process, after :func:`check_compatible`, as late as possible
    before training (the restored RNG states are the ones the next update needs).

    Returns:
        The checkpoint's ``trainer_state.json`` (``history``, ``pending_eval_epoch``, ...).

    Raises:
        ModelError: if the RNG states could not be restored (the resume would not be exact).
    """
    path = Path(path)
    meta = meta if meta is not None else read_state(path)
    acc = run.accelerator
    # Accelerate logs a failure to restore the RNG states at INFO level and goes on; a
    # resume without them is not exact, so check that the generator really changed.
    torch.manual_seed(0x5EED)
    sentinel = torch.get_rng_state()
    # model via safetensors; optimizer and RNG states via torch.load(weights_only=True)
    with _quiet_accelerate():
        acc.load_state(str(path))
    if torch.equal(torch.get_rng_state(), sentinel):
        raise ModelError(f"{path}: could not restore the random number generator states "
                         f"(random_states_{acc.process_index}.pkl)")
    if run.scheduler is not None:
        run.scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True))
    for key, value in meta["state"].items():
        setattr(run.state, key, value)
    return meta


def load_model_weights(run, path: Path) -> None:
    """Load only the weights of checkpoint ``path`` into the run's model (on every process).

    Raises:
        ModelError: if the checkpoint or its weights file is gone.
    """
    from safetensors.torch import load_model

    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ModelError(f"{weights}: missing; cannot load the best model (was the checkpoint deleted?)")
    load_model(run.accelerator.unwrap_model(run.model), str(weights), strict=True, device=str(run.accelerator.device))


# --------------------------------------------------------------------------- the callback fit uses

class Checkpointer:
    """Checkpoints and interruption for :func:`finetune.runner.fit`.

    :meth:`on_update` is the ``on_update`` callback of ``train_one_epoch``:
    every ``output.checkpoint_every`` updates it saves a checkpoint, and once a
    signal was received (on any process: the flag is all-reduced so that all
    ranks stop after the same update) it saves one and returns True, which ends
    the epoch at that window boundary. The last update of an epoch (or of the
    run) is left to ``fit``, which saves after the epoch's evaluation.

    Args:
        run: The :class:`~finetune.runner.Run`.
        history: The list ``fit`` appends evaluation records to (saved with each checkpoint).
    """

    def __init__(self, run, history: list[dict[str, Any]]):
        self.run = run
        self.history = history
        out = run.cfg.output
        self.enabled = out.save_checkpoints
        self.every = out.checkpoint_every
        self.resume_path = resolve_resume(out.output_dir, out.resume_from)
        self._resume_meta = read_state(self.resume_path) if self.resume_path is not None else None
        if self._resume_meta is not None:
            check_compatible(self._resume_meta, run, self.resume_path)
        self.selection = Selection.from_config(run.cfg.evaluation)
        self.signals = StopSignals()
        self.stop_signum: Optional[int] = None
        self.last_saved: Optional[Path] = self.resume_path
        self._saved_at: Optional[tuple[int, int, int]] = None
        self._announced = False

    # -- resume

    def restore(self) -> Optional[int]:
        """Load the checkpoint named by ``output.resume_from`` (if any) into the run.

        Returns:
            The epoch whose evaluation is still due, or ``None``.
        """
        if self.resume_path is None:
            return None
        meta = load_checkpoint(self.run, self.resume_path, self._resume_meta)
        self.history[:] = meta.get("history", [])
        self._saved_at = self._position()
        state = self.run.state
        logger.info("resumed from %s: update %d, epoch %d, micro-batch %d", self.resume_path, state.step,
                    state.epoch, state.micro_batch)
        return meta.get("pending_eval_epoch")

    # -- saving

    def _position(self) -> tuple[int, int, int]:
        s = self.run.state
        return (s.step, s.epoch, s.micro_batch)

    def save(self, reason: str, pending_eval_epoch: Optional[int] = None) -> Optional[Path]:
        """Save a checkpoint now (all processes), unless checkpoints are off."""
        if not self.enabled:
            return None
        self.last_saved = save_checkpoint(self.run, self.history, pending_eval_epoch, reason, protect=self.best())
        self._saved_at = self._position()
        return self.last_saved

    def best(self) -> Optional[Path]:
        """The best evaluation's checkpoint (``evaluation.metric_for_best_model``), or ``None``."""
        if self.selection is None:
            return None
        step = self.selection.judge(self.history).best_step
        return None if step is None else checkpoints_root(self.run.cfg.output.output_dir) / f"{CHECKPOINT_PREFIX}{step}"

    def __enter__(self) -> "Checkpointer":
        self.signals.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.signals.__exit__(*exc)

    def _stop_agreed(self) -> Optional[int]:
        """The signal number if any process received one (the same answer on every process)."""
        acc = self.run.accelerator
        local = self.signals.signum or 0
        if acc.num_processes > 1:
            # one tiny all-reduce per update so that every rank stops after the same update;
            # max: SIGTERM (a preemption) wins over SIGINT
            flag = torch.tensor([local], dtype=torch.int64, device=acc.device)
            local = int(acc.reduce(flag, reduction="max").item())
        return local or None

    def on_update(self, state) -> bool:
        """``train_one_epoch``'s callback: checkpoint every N updates; True to stop after a signal."""
        if self.stop_signum is None:
            self.stop_signum = self._stop_agreed()
            if self.stop_signum is not None and not self._announced and self.run.accelerator.is_main_process:
                self._announced = True
                logger.warning("%s received: stopping after update %d to save a checkpoint (send it again to "
                               "stop at once)", signal.Signals(self.stop_signum).name, state.step)
        per_epoch = len(self.run.train_dataloader)
        if state.micro_batch >= per_epoch or state.step >= self.run.plan.total_updates:
            return self.stop_signum is not None  # fit saves after the epoch's evaluation
        if self._saved_at == self._position():
            return self.stop_signum is not None  # nothing new (a skipped update)
        if self.stop_signum is not None:
            self.save(f"{signal.Signals(self.stop_signum).name} after update {state.step}")
            return True
        if self.every and state.step % self.every == 0 and (self._saved_at or (-1,))[0] != state.step:
            self.save(f"every {self.every} updates")
        return False

    def interrupt(self, pending_eval_epoch: Optional[int]) -> None:
        """Save (if not saved at this position already) and raise :class:`RunInterrupted`.

        Args:
            pending_eval_epoch: The epoch that just finished training and whose
                evaluation has not run (``None`` mid-epoch, or when none is due).

        Raises:
            RunInterrupted: always, with the command that resumes the run.
        """
        signum = self.stop_signum or self.signals.signum or signal.SIGTERM
        name = signal.Signals(signum).name
        state = self.run.state
        if self._saved_at != self._position():
            self.save(f"{name} after update {state.step}", pending_eval_epoch)
        if self.enabled and self.last_saved is not None:
            where = f"checkpoint {self.last_saved}"
        else:
            where = "no checkpoint saved (output.save_checkpoints is false)"
        raise RunInterrupted(
            f"interrupted by {name} after update {state.step} (epoch {state.epoch}, micro-batch "
            f"{state.micro_batch}); {where}; resume with: "
            f"{resume_command(self.run.accelerator.num_processes)}",
            signum,
        )

    def check_signal(self) -> None:
        """Between epochs: stop if a signal came during evaluation (the epoch's checkpoint is saved)."""
        if self.stop_signum is None:
            self.stop_signum = self._stop_agreed()
        if self.stop_signum is not None:
            self.interrupt(None)

    def last_good(self) -> str:
        """Where the last checkpoint is, for a message (the non-finite stop)."""
        if self.last_saved is None:
            return "no checkpoint saved yet"
        return f"last good checkpoint: {self.last_saved} (resume with output.resume_from=latest)"
