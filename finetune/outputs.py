"""What a run writes in ``output.output_dir``, by name, and clearing an earlier run's files.

The layout of an output folder::

    config.yaml            the resolved config of the run
    train_log.jsonl        one record per update (or per log_every updates) and per evaluation
    checkpoints/           checkpoint-<update>/ folders (see finetune.checkpoint)
    model.safetensors, config.json, tokenizer files   the final model (transformers' format)
    metrics.json           the run's summary
    all_results.json       the summary under the Trainer's key names (train_runtime, eval_loss, ...)
    README.md              the model card: base model, data, labels, batching, results, how to reproduce
    curves.png             loss, learning rate and evaluation curves

Every module that reads or writes these names imports them from here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CONFIG_FILE = "config.yaml"
LOG_FILE = "train_log.jsonl"
CHECKPOINTS_DIR = "checkpoints"
METRICS_FILE = "metrics.json"
CURVES_FILE = "curves.png"
RESULTS_FILE = "all_results.json"
MODEL_CARD_FILE = "README.md"
# the model card's first line after its front matter: how a card finetune wrote is told from a user's README
MODEL_CARD_MARK = "<!-- model card written by finetune; rewritten by each run in this folder -->"


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader, or a run stopped
    mid-write, sees the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def clear_previous_run(output_dir: str | os.PathLike) -> list[Path]:
    """Delete what an earlier run left that a fresh run would otherwise resume from or append to.

    That is ``checkpoints/``, ``train_log.jsonl``, ``metrics.json``,
    ``all_results.json`` and ``curves.png`` (a rerun that dies early must not
    leave the old run's results beside its new log); the model files, the
    model card and ``config.yaml`` are replaced as the new run writes them. Used for
    ``output.overwrite: true`` without ``resume_from``, on the main process.

    Returns:
        The paths removed.
    """
    out = Path(output_dir)
    removed = []
    for path in (out / CHECKPOINTS_DIR, out / LOG_FILE, out / METRICS_FILE, out / RESULTS_FILE, out / CURVES_FILE):
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(path)
        elif path.exists():
            path.unlink()
            removed.append(path)
    return removed
