"""Where records go: ``train_log.jsonl`` and Accelerate's trackers; and the progress bar beside them.

One flat record per update (or per ``log_every`` updates) and one per
evaluation. The main process writes them; the same dicts go to the trackers
named in ``logging.report_to`` through ``accelerator.log``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from finetune.errors import PROGRESS_SECONDS_IN_A_FILE, ConfigError, redraws_in_place
from finetune.outputs import LOG_FILE, json_ready
from finetune.tracker_runs import (CONTINUATION, NAMING, SENDERS, Held, runs_to_continue, scalars,
                                    tracker_settings, write_tracker_runs)

logger = logging.getLogger("finetune")


class RunLogger:
    """Append records to ``<output_dir>/train_log.jsonl`` and to the trackers.

    Args:
        accelerator: The run's ``Accelerator``; only its main process writes.
        output_dir: Directory of the log file.
        use_trackers: Forward records to the trackers set up with ``accelerator.init_trackers``
            (:func:`start_trackers`).
        resume_step: When resuming, records with ``step`` above this that an
            interrupted run had already written are dropped from the file first,
            so the log has each update once.
        history: When resuming, the checkpoint's evaluation records: an
            evaluation record at ``resume_step`` is kept only if it is one of
            them (an evaluation cut short after its record was written runs again).
        continued: Trackers that go on with the stopped run's own tracker runs (:func:`start_trackers`).

    On a resume, each tracker run gets the updates it lacks, once: one that goes on with the stopped run's is
    not sent again the updates past the checkpoint it holds (the resumed run makes them again, with the same
    numbers but the timings), and is sent first those up to the checkpoint it lacks (W&B's, where a kill lost
    them from its buffer); a new tracker run (a tracker added on resume, a run that is gone, a tracker that starts
    one at each start) is sent first every update up to the checkpoint, from the file, so that it holds the
    whole run. TensorBoard keeps the stopped run's events up to the checkpoint in the run's folder.
    """

    def __init__(self, accelerator, output_dir: str | os.PathLike, use_trackers: bool = False,
                 resume_step: Optional[int] = None, history: Optional[list[dict[str, Any]]] = None,
                 continued: frozenset[str] = frozenset()):
        self.accelerator = accelerator
        self.path = Path(output_dir) / LOG_FILE
        self.use_trackers = use_trackers
        kept = []  # the records up to the checkpoint
        if accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.exists():
                kept = self._truncate_after(resume_step, history or [])
        # by tracker, what its run holds of the run's updates, where that is known; the main process holds the
        # trackers
        self.held = {t.name: _held(t, continued) for t in accelerator.trackers} \
            if resume_step is not None and use_trackers else {}
        for tracker in accelerator.trackers if self.held else ():
            held = self.held[tracker.name]
            for record in kept if held is not None else ():
                _send(tracker, held.lacks(record), record.get("step"))

    def _truncate_after(self, step: int, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Cut the file back to ``step``; return the records kept."""
        saved_evals = [json.dumps(json_ready(r), sort_keys=True) for r in history]
        kept, records = [], []
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
                    records.append(record)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)
        return records

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (main process only) and hand it to the trackers."""
        if self.accelerator.is_main_process:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(json_ready(record)) + "\n")
        if self.use_trackers:
            # what accelerator.log does, tracker by tracker (the main process holds them all; the others none),
            # less what a tracker run holds from the stopped run already
            for tracker in self.accelerator.trackers:
                held = self.held.get(tracker.name)
                _send(tracker, held.lacks(record) if held is not None else scalars(record), record.get("step"))


def _send(tracker, numbers: dict[str, Any], step: Optional[int]) -> None:
    if not numbers:
        return
    send = SENDERS.get(tracker.name)
    if send is not None:
        send(tracker, numbers, step)
    else:
        tracker.log(numbers, step=step)


# Trackers that write into the run's folder and keep there the stopped run's events up to the checkpoint (DVCLive
# writes there too, but empties its folder at each start: it is sent the whole run again, as a new tracker run is)
_KEEP_THEIR_EVENTS = frozenset({"tensorboard"})


def _held(tracker, continued: frozenset[str]) -> Optional[Held]:
    """What a resumed run's ``tracker`` holds: what the stopped run's tracker run holds where this one goes on
    with it, nothing where it is new; ``None`` where that is not known, or the tracker keeps the stopped run's
    events itself."""
    if tracker.name in continued:
        return CONTINUATION[tracker.name].holds(tracker)
    return None if tracker.name in _KEEP_THEIR_EVENTS else Held()


def start_trackers(accelerator, cfg, resume_step: Optional[int]) -> frozenset[str]:
    """Start the trackers of ``logging.report_to`` for a run, fresh or resumed at update ``resume_step``.

    A resumed run goes on with the W&B and MLflow runs its output folder's ``trackers.json`` names, and they keep
    the settings they were started with (MLflow refuses a changed parameter, and only keys that do not change the
    training can change on resume); every other tracker gets the run's settings as hyperparameters. A fresh run
    starts new tracker runs and names them in ``trackers.json``.

    Returns:
        The names of the trackers that go on with the stopped run's tracker runs.
    """
    out = Path(cfg.output.output_dir)
    # the main process starts the trackers, and alone asks their servers
    earlier = runs_to_continue(out, cfg.logging.report_to) if resume_step is not None and \
        accelerator.is_main_process else {}
    name = cfg.logging.run_name or cfg.output.output_dir
    try:
        accelerator.init_trackers(cfg.logging.project_name,
                                  init_kwargs=tracker_settings(resume_step, earlier, name, cfg.logging.run_group, out))
    except Exception as exc:  # a tracker library's own failure to start (no login, no server, ...), whatever it is
        library = type(exc).__module__.split(".")[0]
        who = library if library in _known_trackers() else "a tracker"
        raise ConfigError(f"logging.report_to: {who} did not start: {exc}") from exc
    continued = frozenset(t.name for t in accelerator.trackers if t.name in earlier and t.name in CONTINUATION)
    hparams = flat_hparams(cfg.to_dict()) if accelerator.trackers else {}
    for tracker in accelerator.trackers:
        if tracker.name not in continued:
            tracker.store_init_configuration(hparams)
            if cfg.logging.run_group and tracker.name in NAMING:
                NAMING[tracker.name].group_started(tracker, cfg.logging.run_group)
    if accelerator.is_main_process:
        started = {t.name: CONTINUATION[t.name].run_id(t) for t in accelerator.trackers if t.name in CONTINUATION}
        write_tracker_runs(out, {**earlier, **started})
    return continued


def _known_trackers() -> list[str]:
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    return list(LOGGER_TYPE_TO_CLASS)


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

    from accelerate.tracking import get_available_trackers

    known = _known_trackers()
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


def progress_bar(total: int, done: int, enabled: bool, file=None):
    """The run's progress, counting updates: a tqdm bar redrawn in place in a terminal or a notebook; into a file
    or a pipe, a log line every :data:`PROGRESS_SECONDS_IN_A_FILE` seconds (:class:`ProgressLines`)."""
    from tqdm.auto import tqdm

    stream = file if file is not None else sys.stderr
    if enabled and not redraws_in_place(stream):
        return ProgressLines(total, done)
    return tqdm(total=total, initial=done, desc="train", unit="update", disable=not enabled, file=stream,
                dynamic_ncols=True, mininterval=0.1)


class ProgressLines:
    """The progress bar's place where nothing redraws in place: a log line of tqdm's text, without its bar, every
    :data:`PROGRESS_SECONDS_IN_A_FILE` seconds and when it closes.

    Written by hand, as tqdm has no mode of whole lines: into a file its bar is redrawn after a carriage return,
    so that a log file keeps every redraw, and the log lines written between them, as one line.
    ``update``, ``set_postfix`` and the context are the part of tqdm's interface the loop and ``fit`` use.
    """

    disable = False

    def __init__(self, total: int, done: int, clock=None) -> None:
        import time

        self.total, self.initial, self.n = total, done, done
        self.clock = clock or time.monotonic
        self.started = self.said_at = self.clock()
        self.said_n, self.postfix = done, ""

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.said_at >= PROGRESS_SECONDS_IN_A_FILE:
            self.say()

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def say(self) -> None:
        from tqdm import tqdm

        self.said_at, self.said_n = self.clock(), self.n
        logger.info(tqdm.format_meter(self.n, self.total, self.said_at - self.started, prefix="train",
                                      unit="update", initial=self.initial, postfix=self.postfix or None,
                                      bar_format="{desc}: {percentage:.0f}%, {n_fmt}/{total_fmt} updates "
                                                 "[{elapsed}<{remaining}, {rate_fmt}{postfix}]"))

    def close(self) -> None:
        if self.n != self.said_n:  # where the last line left off
            self.say()

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def log_lines_above(bar):
    """Log lines written while the bar is shown go above it, each on a line of its own, instead of being appended
    to the bar's text (tqdm's redirection of the console's logging handlers)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    drawn = not bar.disable and not isinstance(bar, ProgressLines)  # a line of its own needs no redirecting
    return logging_redirect_tqdm(tqdm_class=type(bar)) if drawn else contextlib.nullcontext()
