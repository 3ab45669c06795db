"""What a run writes in ``output.output_dir``, by name, and clearing an earlier run's files.

The layout of an output folder::

    config.yaml            the resolved config of the run
    train_log.jsonl        one record per update (or per log_every updates) and per evaluation
    checkpoints/           checkpoint-<update>/ folders (see finetune.checkpoint)
    model.safetensors, config.json, tokenizer files   the final model (transformers' format)
    metrics.json           the run's summary
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


def clear_previous_run(output_dir: str | os.PathLike) -> list[Path]:
    """Delete what an earlier run left that a fresh run would otherwise resume from or append to.

    That is ``checkpoints/``, ``train_log.jsonl``, ``metrics.json`` and
    ``curves.png`` (a rerun that dies early must not leave the old run's
    picture beside its new log); the model files and ``config.yaml`` are
    replaced as the new run writes them. Used for
    ``output.overwrite: true`` without ``resume_from``, on the main process.

    Returns:
        The paths removed.
    """
    out = Path(output_dir)
    removed = []
    for path in (out / CHECKPOINTS_DIR, out / LOG_FILE, out / METRICS_FILE, out / CURVES_FILE):
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(path)
        elif path.exists():
            path.unlink()
            removed.append(path)
    return removed
