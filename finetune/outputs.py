"""What a run writes in ``output.output_dir``, by name, and clearing an earlier run's files.

The layout of an output folder::

    config.yaml            the resolved config of the run
    train_log.jsonl        one record per update (or per log_every updates) and per evaluation
    checkpoints/           checkpoint-<update>/ folders (see finetune.checkpoint_files)
    model.safetensors, config.json, tokenizer files   the final model (transformers' format; LoRA: merged)
    adapter/               a LoRA run's adapter alone (PEFT's format: adapter_config.json, adapter_model.safetensors)
    metrics.json           the run's summary
    all_results.json       the summary under the Trainer's key names (train_runtime, eval_loss, ...)
    README.md              the model card: base model, data, labels, batching, results, how to reproduce
    curves.png             loss, learning rate and evaluation curves
    trackers.json          the W&B and MLflow runs the run logs to, which a resumed run goes on with
    .finetune.lock         locked while a run writes here: one run per folder

Every module that reads or writes these names imports them from here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Optional

from finetune.errors import ConfigError, ModelError

logger = logging.getLogger("finetune")

CONFIG_FILE = "config.yaml"
LOG_FILE = "train_log.jsonl"
CHECKPOINTS_DIR = "checkpoints"
METRICS_FILE = "metrics.json"
CURVES_FILE = "curves.png"
RESULTS_FILE = "all_results.json"
# the tracker runs of the folder's run, by tracker (see finetune.tracking.start_trackers)
TRACKERS_FILE = "trackers.json"
# DVCLive's files (see finetune.tracker_runs.tracker_settings)
DVCLIVE_DIR = "dvclive"
# held by the running run (see OutputLock)
LOCK_FILE = ".finetune.lock"
# checkpoint-<n>, and the temporary and previous copies of one being saved (see finetune.checkpoint_files)
_CHECKPOINT_NAME = re.compile(r"^(\.tmp-|\.old-)?checkpoint-\d+$")
# a LoRA run's adapter, in the output folder and in each checkpoint (see finetune.lora)
ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
MODEL_CARD_FILE = "README.md"
# the model card's first line after its front matter: how a card finetune wrote is told from a user's README
MODEL_CARD_MARK = "<!-- model card written by finetune; rewritten by each run in this folder -->"


# what a run's saved model is made of, besides the names above: transformers' config and weights, the tokenizer
_MODEL_FILE = re.compile(r"^(config\.json|.*\.safetensors|.*\.bin|tokenizer.*|vocab\..*|merges\.txt|"
                         r"special_tokens_map\.json|added_tokens\.json|.*\.model)$")


def is_run_folder(folder: Path) -> bool:
    """Whether ``folder`` is a run's output folder: its ``config.yaml`` beside its log, checkpoints or lock."""
    return (folder / CONFIG_FILE).is_file() and any((folder / name).exists()
                                                    for name in (LOG_FILE, CHECKPOINTS_DIR, LOCK_FILE))


def require_saved_model(path: str | Path, flag: Optional[str] = None) -> Path:
    """``path`` as a folder holding a saved model (a run's output folder); ``flag``, the option that named it.

    Raises:
        ModelError: if there is no ``config.json`` in it, naming ``flag`` before the folder.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError(f"{flag + ' ' if flag else ''}{path}: no model here (no config.json); pass a run's "
                         f"output_dir", hint=what_the_folder_holds_instead(path))
    return path


def what_the_folder_holds_instead(folder: Path) -> Optional[str]:
    """For a folder given as a model that holds none (no ``config.json``): where the model it stands for is.

    A LoRA run's ``adapter/`` is the adapter alone, whose run's folder holds the model with it merged; a run
    that stopped before its end (or is still training) has saved checkpoints but no model yet.
    """
    folder = Path(folder)
    if (folder / ADAPTER_CONFIG).is_file():
        if (folder.parent / "config.json").is_file():
            return f"it holds a LoRA adapter alone; {folder.parent} holds the model with it merged"
        try:
            base = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))["base_model_name_or_path"]
        except (OSError, ValueError, KeyError, TypeError):
            base = "its base model"
        return f"it holds a LoRA adapter alone, which PEFT loads onto {base} (PeftModel.from_pretrained)"
    # a sweep's folder: the runs of its repeats (finetune.sweep_file's Repeats) predict together
    repeats = [folder / name for name in ("folds", "seeds") if any((run / "config.json").is_file()
                                                                  for run in (folder / name).glob("*"))]
    if repeats:
        return (f"a sweep's folder: {repeats[0]} holds its {repeats[0].name}' models, which predict averaged when it "
                f"is named; or name one run, as sweep.md does")
    saved = [c for c in (folder / CHECKPOINTS_DIR).glob("checkpoint-*") if (c / "config.json").is_file()
             and c.name.split("-")[-1].isdigit()]
    if saved:
        newest = max(saved, key=lambda c: int(c.name.split("-")[-1]))
        return (f"its run has saved no model yet (stopped, or still training); its newest checkpoint holds one: "
                f"{newest}")
    return None


def refuse_a_run_file(path: str | os.PathLike, output_dir: str | os.PathLike, flag: str) -> None:
    """Refuse ``path`` as a command's output when it is a directory or one of the files the run in
    ``output_dir`` wrote.

    ``finetune predict`` and ``finetune score`` write next to a run when told
    to; replacing its ``config.yaml``, its log or its model would break the run.

    Raises:
        ConfigError: naming the flag and the file.
    """
    if Path(path).is_dir():  # a picture or a table written there would take the directory's name plus a suffix
        raise ConfigError(f"{flag} {path}: is a directory; name a file")
    target, out = Path(path).resolve(), Path(output_dir).resolve()
    if target.parent == out:
        ours = target.name in (CONFIG_FILE, LOG_FILE, METRICS_FILE, CURVES_FILE, RESULTS_FILE, LOCK_FILE,
                               MODEL_CARD_FILE) or _MODEL_FILE.match(target.name)
    else:
        ours = out in target.parents and target.relative_to(out).parts[0] in (CHECKPOINTS_DIR, ADAPTER_DIR)
    if ours:
        raise ConfigError(f"{flag} {path}: is a file of the run in {output_dir}; name another file")


def json_ready(value: Any) -> Any:
    """``value`` with every NaN or infinity (a correlation of a constant, a loss that overflowed) as its text,
    ``"nan"``, ``"inf"``: JSON has no such numbers, and what ``json.dumps`` writes for them (``NaN``) stops
    every reader but Python's."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader, or a run stopped
    mid-write, sees the old file or the new one, never a part. The temporary file is this process's
    own: several sweep workers rewrite the same report."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def clear_previous_run(output_dir: str | os.PathLike) -> list[Path]:
    """Delete what an earlier run wrote that a fresh run would otherwise resume from or append to.

    That is the ``checkpoint-<n>`` folders (and leftovers of interrupted
    saves) in ``checkpoints/``, ``train_log.jsonl``, ``metrics.json``,
    ``all_results.json`` and ``curves.png`` (a rerun that dies early must not
    leave the old run's results beside its new log); the model files, the
    model card and ``config.yaml`` are replaced as the new run writes them.
    A LoRA run's ``adapter/`` goes too, lest it sit beside another run's
    model. Nothing finetune does not write is touched: other files in
    ``checkpoints/`` stay, and so does the folder then. Used for
    ``output.overwrite: true`` on a fresh start, on the main process.

    Returns:
        The paths removed.
    """
    out = Path(output_dir)
    removed = []
    checkpoints = out / CHECKPOINTS_DIR
    if checkpoints.is_dir():
        for child in sorted(checkpoints.iterdir()):
            match = _CHECKPOINT_NAME.match(child.name)
            # a final checkpoint-<n> holds finetune's trainer_state.json; a .tmp-/.old- one is a save in progress
            if child.is_dir() and match and (match.group(1) or (child / "trainer_state.json").is_file()):
                shutil.rmtree(child)
                removed.append(child)
        if not any(checkpoints.iterdir()):
            checkpoints.rmdir()
    adapter = out / ADAPTER_DIR
    if (adapter / ADAPTER_CONFIG).is_file():
        shutil.rmtree(adapter)
        removed.append(adapter)
    for path in (out / LOG_FILE, out / METRICS_FILE, out / RESULTS_FILE, out / CURVES_FILE):
        if path.is_file():
            path.unlink()
            removed.append(path)
    return removed


class OutputLock:
    """One run per output folder: an exclusive lock on ``<output_dir>/.finetune.lock`` while the run lives.

    The lock is the operating system's (``fcntl.flock``), so it is released
    whenever the process ends, killed or not: a crashed run never leaves a
    stale lock. The file stays, holding the last holder's pid, host and start
    time for the message a second run gets. On a file system without locks
    (some network mounts), or a system without ``fcntl`` (Windows), the run
    goes on with a warning.
    """

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            ConfigError: naming the folder and the run that holds it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # Windows has no flock: the run goes on, as on a file system without locks
            logger.warning("output.output_dir: this system has no file locks (fcntl): a second run in %s would "
                           "not be detected", self.path.parent)
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"output.output_dir: {self.path.parent} is in use by another run ({holder}); "
                              f"wait for it to end, or choose another output.output_dir") from None
        except OSError as exc:  # no locks on this file system
            logger.warning("output.output_dir: cannot lock %s (%s): a second run in this folder would not be "
                           "detected", self.path, exc.strerror or exc)
            os.close(fd)
            return
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"


def saved_config(output_dir: str | os.PathLike):
    """The :class:`~finetune.config.Config` a run saved as ``config.yaml``, or ``None`` if there is none.

    Raises:
        ConfigError: if the file exists but is not a valid config.
    """
    from finetune.config import config_from_dict, read_yaml

    path = Path(output_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    return config_from_dict(read_yaml(path), source=str(path))
