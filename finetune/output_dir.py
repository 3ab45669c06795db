"""The output folder before and while a run writes there: refusals first, one run at a time, a fresh start.

* :func:`check_output_dir` refuses, before any expensive step, a folder the
  run must not write into (another run's files, a file in the way, no permission);
* :func:`output_lock` holds the folder's lock (:class:`~finetune.outputs.OutputLock`)
  on every process for the whole of ``fit``;
* :func:`start_outputs` clears an earlier run under ``output.overwrite`` and writes ``config.yaml``.

What a finished run writes is :mod:`finetune.results`; the file names are :mod:`finetune.outputs`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from finetune.checkpoint_files import resolve_resume
from finetune.config import Config, config_yaml
from finetune.errors import ConfigError
from finetune.outputs import CONFIG_FILE, LOCK_FILE, OutputLock, clear_previous_run, write_atomic
from finetune.resuming import refuse_another_runs_checkpoints

logger = logging.getLogger("finetune")


def check_output_dir(cfg: Config) -> None:
    """Refuse, before any work, an output directory the run must not write into.

    Raises:
        ConfigError: if ``output.output_dir`` cannot be created or written; if it
            holds an earlier run's files that nothing says to resume or replace
            (``auto`` resumes only from a checkpoint; ``overwrite`` replaces); or if
            ``output.resume_from`` names no complete checkpoint, or only checkpoints of
            a run with other settings.
    """
    out = Path(cfg.output.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.output_dir: {out} exists and is not a directory")
    # Else the run would only fail when it first writes there: after tokenizing, or after training.
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"output.output_dir: cannot create {out}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output.output_dir: cannot write in {existing} (permission denied)")
    resume = resolve_resume(out, cfg.output.resume_from)
    occupied = out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir())
    if occupied and resume is None and not cfg.output.overwrite:
        if cfg.output.resume_from == "auto":
            raise ConfigError(
                f"output.output_dir: {out} holds an earlier run's files but no checkpoint to resume from; "
                f"pass output.overwrite=true to replace that run, or choose another output.output_dir"
            )
        raise ConfigError(
            f"output.output_dir: {out} is not empty; set output.resume_from=auto to continue it "
            f"or output.overwrite=true to write over it"
        )
    refuse_another_runs_checkpoints(cfg)


@contextlib.contextmanager
def output_lock(accelerator, output_dir: str | os.PathLike):
    """Hold the output folder's :class:`~finetune.outputs.OutputLock` (main process) for the block.

    Every process learns whether the main one got it, so all stop together
    when another run holds the folder; none of them has written anything then.

    Raises:
        ConfigError: on every process, naming the folder and the run that holds it.
    """
    lock = OutputLock(output_dir)
    problem = None
    if accelerator.is_main_process:
        try:
            lock.acquire()
        except ConfigError as exc:
            problem = exc.message
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem])[0]
    if problem is not None:
        raise ConfigError(problem)
    try:
        yield
    finally:
        lock.release()


def start_outputs(cfg: Config, accelerator, fresh: bool) -> None:
    """Create the output folder and write ``config.yaml``; a fresh run under ``output.overwrite`` clears the old one."""
    out = Path(cfg.output.output_dir)
    if not accelerator.is_main_process:
        return
    if fresh and cfg.output.overwrite:
        # a fresh run must never resume from, append to, or report an earlier run's state
        for path in clear_previous_run(out):
            logger.info("output.overwrite: removed %s of an earlier run", path)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / CONFIG_FILE, config_yaml(cfg))
