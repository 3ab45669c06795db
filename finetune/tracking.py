"""Where records go: ``train_log.jsonl`` and Accelerate's trackers; and the progress bar beside them.

One flat record per update (or per ``log_every`` updates) and one per
evaluation. The main process writes them; the same dicts go to the trackers
named in ``logging.report_to`` through ``accelerator.log``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

from finetune.errors import ConfigError
from finetune.outputs import LOG_FILE, json_ready


class RunLogger:
    """Append records to ``<output_dir>/train_log.jsonl`` and to the trackers.

    Args:
        accelerator: The run's ``Accelerator``; only its main process writes.
        output_dir: Directory of the log file.
        use_trackers: Forward records to ``accelerator.log`` (trackers set up
            with ``accelerator.init_trackers``).
        resume_step: When resuming, records with ``step`` above this that an
            interrupted run had already written are dropped from the file first,
            so the log has each update once.
        history: When resuming, the checkpoint's evaluation records: an
            evaluation record at ``resume_step`` is kept only if it is one of
            them (an evaluation cut short after its record was written runs again).
    """

    def __init__(self, accelerator, output_dir: str | os.PathLike, use_trackers: bool = False,
                 resume_step: Optional[int] = None, history: Optional[list[dict[str, Any]]] = None):
        self.accelerator = accelerator
        self.path = Path(output_dir) / LOG_FILE
        self.use_trackers = use_trackers
        if accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.exists():
                self._truncate_after(resume_step, history or [])

    def _truncate_after(self, step: int, history: list[dict[str, Any]]) -> None:
        saved_evals = [json.dumps(json_ready(r), sort_keys=True) for r in history]
        kept = []
        with open(self.path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut by a kill: everything after it is suspect too
                at = record.get("step", 0)
                is_eval = any(k.startswith("eval/") for k in record)
                if at < step or (at == step and (not is_eval or json.dumps(record, sort_keys=True) in saved_evals)):
                    kept.append(line if line.endswith("\n") else line + "\n")
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (main process only) and hand it to the trackers."""
        if self.accelerator.is_main_process:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(json_ready(record)) + "\n")
        if self.use_trackers:
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.accelerator.log(scalars, step=record.get("step"))


def tracker_settings(resume_step: Optional[int]) -> dict[str, dict[str, Any]]:
    """Accelerate's ``init_kwargs`` for a run's trackers, by tracker. A run resumed at ``resume_step`` has
    TensorBoard drop what the stopped run logged past its checkpoint (``purge_step``: TensorBoard's readers
    discard the earlier files' events from that step on), as ``train_log.jsonl`` is cut there: each update is
    shown once, as the resumed run logged it. (An evaluation at the checkpoint's own update that the stopped run
    logged and the resumed run runs again, which the file keeps once, shows twice there.)"""
    if resume_step is None:
        return {}
    return {"tensorboard": {"purge_step": resume_step + 1}}


def read_log(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``<output_dir>/train_log.jsonl``."""
    path = Path(output_dir) / LOG_FILE
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# pip package of each tracker Accelerate supports, where it differs from the tracker's name
_TRACKER_PACKAGES = {"comet_ml": "comet-ml", "aim": "'aim<4'"}


def check_trackers(report_to: list[str]) -> None:
    """Check at start-up that every tracker in ``logging.report_to`` can really be used.

    Accelerate skips a tracker whose package is missing with only a debug
    message, so a run would train without the logs the user asked for. The
    packages are looked up, not imported (some take seconds to import).

    Args:
        report_to: Tracker names from the config (``"all"``: every installed one).

    Raises:
        ConfigError: naming ``logging.report_to``, for a name Accelerate does not
            know, a tracker whose package is not installed (with the pip command),
            or a tensorboard too old for the installed numpy.
    """
    import difflib

    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    known = list(LOGGER_TYPE_TO_CLASS)
    available = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    for name in report_to:
        if name == "all":
            continue
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"one of: all, {', '.join(known)}"
            raise ConfigError(f"logging.report_to: unknown tracker {name!r} ({hint})")
        if name not in available:
            package = _TRACKER_PACKAGES.get(name, name)
            raise ConfigError(
                f"logging.report_to: tracker {name!r} needs a package that is not installed (pip install {package})"
            )
    if "tensorboard" in report_to or ("all" in report_to and "tensorboard" in available):
        check_tensorboard_beside_numpy()


# the first tensorboard that runs beside numpy 2: older ones read np.string_, which numpy 2 removed, when a run
# stores its config (accelerate's add_hparams), after the model and data are loaded
TENSORBOARD_FOR_NUMPY_2 = "2.17.1"


def check_tensorboard_beside_numpy() -> None:
    """Refuse, before anything is loaded, a tensorboard too old for the installed numpy (versions looked up, not
    imported); a tensorboard that is not installed here (tensorboardX instead) is left alone."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version  # not declared: transformers, accelerate and datasets require it

    try:
        tensorboard, numpy = version("tensorboard"), version("numpy")
    except PackageNotFoundError:
        return
    if Version(numpy).major >= 2 and Version(tensorboard) < Version(TENSORBOARD_FOR_NUMPY_2):
        raise ConfigError(f"logging.report_to: tensorboard {tensorboard} does not run beside numpy {numpy} "
                          f"(pip install 'tensorboard>={TENSORBOARD_FOR_NUMPY_2}')")


def flat_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """Flatten the config to ``section.key`` scalars, as trackers' hparam tables want."""
    out: dict[str, Any] = {}
    for section, values in config.items():
        for key, value in (values or {}).items():
            if isinstance(value, (int, float, str, bool)):
                out[f"{section}.{key}"] = value
            elif value is None:
                out[f"{section}.{key}"] = "null"
            else:
                out[f"{section}.{key}"] = json.dumps(value)
    return out


# seconds between redraws of the progress bar where stderr is a file (a batch job's log), not a terminal: each
# redraw appends a bar's worth of text there, one per update otherwise
PROGRESS_SECONDS_IN_A_FILE = 30.0


def progress_bar(total: int, done: int, enabled: bool, file=None):
    """The run's bar, counting updates: redrawn as tqdm does in a terminal or a notebook, every
    :data:`PROGRESS_SECONDS_IN_A_FILE` seconds into a file or a pipe."""
    from tqdm.auto import tqdm

    stream = file if file is not None else sys.stderr
    # a notebook's output redraws in place, though its stream is no terminal
    in_place = (hasattr(stream, "isatty") and stream.isatty()) or "ipykernel" in sys.modules
    return tqdm(total=total, initial=done, desc="train", unit="update", disable=not enabled, file=stream,
                dynamic_ncols=True, mininterval=0.1 if in_place else PROGRESS_SECONDS_IN_A_FILE)


def log_lines_above(bar):
    """Log lines written while the bar is shown go above it, each on a line of its own, instead of being appended
    to the bar's text (tqdm's redirection of the console's logging handlers)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(tqdm_class=type(bar)) if not bar.disable else contextlib.nullcontext()
