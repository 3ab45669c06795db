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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from finetune.errors import ConfigError
from finetune.outputs import LOG_FILE, TRACKERS_FILE, json_ready, write_atomic

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
                _send(tracker, held.lacks(record) if held is not None else _scalars(record), record.get("step"))


def _scalars(record: dict[str, Any]) -> dict[str, Any]:
    """What a tracker takes of a record: its numbers, but the step."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}


def _send(tracker, numbers: dict[str, Any], step: Optional[int]) -> None:
    if not numbers:
        return
    runs = _TRACKER_RUNS.get(tracker.name)
    if runs is not None and runs.log is not None:
        runs.log(tracker, numbers, step)
    else:
        tracker.log(numbers, step=step)


@dataclass(frozen=True)
class Held:
    """What a resumed run's tracker run holds of the run's updates: every number of each update up to
    ``through``, and besides, each (key, update) pair of ``pairs``."""

    through: int = -1
    pairs: frozenset[tuple[str, int]] = frozenset()

    def lacks(self, record: dict[str, Any]) -> dict[str, Any]:
        """The numbers of ``record`` the tracker run lacks (none: it holds them all)."""
        step = record.get("step")
        if step is not None and step <= self.through:
            return {}
        return {k: v for k, v in _scalars(record).items() if (k, step) not in self.pairs}


# Trackers that write into the run's folder and keep there the stopped run's events up to the checkpoint
_KEEP_THEIR_EVENTS = frozenset({"tensorboard"})


def _held(tracker, continued: frozenset[str]) -> Optional[Held]:
    """What a resumed run's ``tracker`` holds: what the stopped run's tracker run holds where this one goes on
    with it, nothing where it is new; ``None`` where that is not known, or the tracker keeps the stopped run's
    events itself."""
    if tracker.name in continued:
        return _TRACKER_RUNS[tracker.name].holds(tracker)
    return None if tracker.name in _KEEP_THEIR_EVENTS else Held()


@dataclass(frozen=True)
class _TrackerRuns:
    """How a run names and groups one tracker's run, and how a resumed run goes on with it: Accelerate has no common
    call for these, so each library's own arguments."""

    named: Callable[[str], dict[str, Any]]  # the init kwargs that name a new run
    # a new run's group: the init kwargs that put it in one, or what puts it there once started
    group_kwargs: Callable[[str], dict[str, Any]]
    group_started: Callable[[Any, str], None]
    run_id: Callable[[Any], str]  # the started tracker's run id
    continued: Callable[[str], dict[str, Any]]  # the init kwargs that continue the run with that id
    still_there: Callable[[str], bool]  # whether the run with that id can be continued
    holds: Callable[[Any], Optional[Held]]  # what the continued run holds of the run's updates (None: not known)
    log: Optional[Callable[..., None]] = None  # how a record is sent, where not as Accelerate's tracker sends it


def _mlflow_client():
    from mlflow import MlflowClient

    return MlflowClient()


def _mlflow_holds(tracker) -> Held:
    """Each number of each update the MLflow run holds, as its server has them: records go asynchronously, in
    batches that may land out of order, so a kill can lose any of the last ones, not only a tail."""
    client, run_id = _mlflow_client(), tracker.active_run.info.run_id
    return Held(pairs=frozenset((key, metric.step) for key in client.get_run(run_id).data.metrics
                                for metric in client.get_metric_history(run_id, key)))


def _mlflow_queued(tracker, numbers: dict[str, Any], step: Optional[int]) -> None:
    """Queue a record for the MLflow run: MLflow sends its queue in batches, from a thread of its own, and the
    run's end waits for it. Accelerate's tracker sends each record in a request of its own, which the update
    waits for (and its log takes MLflow's arguments only in its later releases)."""
    import mlflow

    run_id, active = tracker.active_run.info.run_id, mlflow.active_run()
    # naming the run costs a request to the server per call; the tracker's run is the active one
    mlflow.log_metrics(numbers, step=step, synchronous=False,
                       **({} if active is not None and active.info.run_id == run_id else {"run_id": run_id}))


def _mlflow_run_is_there(run_id: str) -> bool:
    """Whether the tracking server holds the MLflow run ``run_id``, not deleted."""
    from mlflow.exceptions import MlflowException

    try:
        return _mlflow_client().get_run(run_id).info.lifecycle_stage == "active"
    except MlflowException:  # no such run on this server
        return False


# The trackers whose runs a run names and groups, and a resumed run goes on with; the others start a new run at
# each start.
_TRACKER_RUNS = {
    "wandb": _TrackerRuns(
        named=lambda name: {"name": name},
        group_kwargs=lambda group: {"group": group},
        group_started=lambda tracker, group: None,  # read-only once the run started
        run_id=lambda tracker: tracker.run.id,
        continued=lambda run_id: {"id": run_id, "resume": "allow"},
        still_there=lambda run_id: True,  # resume="allow" starts a new run under the id where there is none
        # what its server counts (W&B's writer buffers: a SIGKILL loses the last records); offline, not known: each
        # start's files hold what that start sent
        holds=lambda tracker: None if tracker.run.offline else Held(through=tracker.run.starting_step - 1)),
    "mlflow": _TrackerRuns(
        named=lambda name: {"run_name": name},
        # a tag of the started run: Accelerate would put tags given at the start on a new experiment too
        group_kwargs=lambda group: {},
        group_started=lambda tracker, group: _mlflow_client().set_tag(tracker.active_run.info.run_id, "group",
                                                                      group),
        run_id=lambda tracker: tracker.active_run.info.run_id,
        continued=lambda run_id: {"run_id": run_id},
        still_there=_mlflow_run_is_there,  # start_run fails on a run deleted or unknown
        holds=_mlflow_holds,
        log=_mlflow_queued),
}


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
                                  init_kwargs=tracker_settings(resume_step, earlier, name, cfg.logging.run_group))
    except Exception as exc:  # a tracker library's own failure to start (no login, no server, ...), whatever it is
        library = type(exc).__module__.split(".")[0]
        who = library if library in _known_trackers() else "a tracker"
        raise ConfigError(f"logging.report_to: {who} did not start: {exc}") from exc
    continued = frozenset(t.name for t in accelerator.trackers if t.name in earlier and t.name in _TRACKER_RUNS)
    hparams = flat_hparams(cfg.to_dict()) if accelerator.trackers else {}
    for tracker in accelerator.trackers:
        if tracker.name not in continued:
            tracker.store_init_configuration(hparams)
            if cfg.logging.run_group and tracker.name in _TRACKER_RUNS:
                _TRACKER_RUNS[tracker.name].group_started(tracker, cfg.logging.run_group)
    if accelerator.is_main_process:
        started = {t.name: _TRACKER_RUNS[t.name].run_id(t) for t in accelerator.trackers if t.name in _TRACKER_RUNS}
        write_tracker_runs(out, {**earlier, **started})
    return continued


def tracker_settings(resume_step: Optional[int], earlier: Optional[dict[str, str]] = None,
                     run_name: Optional[str] = None, run_group: Optional[str] = None) -> dict[str, dict[str, Any]]:
    """Accelerate's ``init_kwargs`` for a run's trackers, by tracker.

    TensorBoard drops what earlier event files in its folder hold from the run's first update on
    (``purge_step``: TensorBoard's readers discard earlier files' events from that step): a resumed run's past
    its checkpoint, as ``train_log.jsonl`` is cut there, and all of an earlier run's that ``output.overwrite``
    replaced. Each update is shown once, as this run logged it. (An evaluation at the checkpoint's own update
    that the stopped run logged and the resumed run runs again, which the file keeps once, shows twice there.)
    The W&B and MLflow runs in ``earlier`` (tracker name to run id) are continued, as they were named and
    grouped; new ones are named ``run_name`` (and W&B's grouped in ``run_group``; MLflow's group is a tag set
    on the started run).
    """
    settings: dict[str, dict[str, Any]] = {"tensorboard": {"purge_step": (resume_step or 0) + 1}}
    for tracker, runs in _TRACKER_RUNS.items():
        if tracker in (earlier or {}):
            settings[tracker] = runs.continued(earlier[tracker])
        else:
            settings[tracker] = {**(runs.named(run_name) if run_name else {}),
                                 **(runs.group_kwargs(run_group) if run_group else {})}
    return {tracker: kwargs for tracker, kwargs in settings.items() if kwargs}


def runs_to_continue(output_dir: str | os.PathLike, report_to: list[str]) -> dict[str, str]:
    """The tracker runs of the folder's ``trackers.json`` that a resumed run reporting to ``report_to`` goes on with:
    those it reports to and their servers still hold. Of one that is gone (deleted, or another tracking server
    now), a warning; the tracker starts a new run."""
    runs = read_tracker_runs(output_dir)
    for tracker, run_id in list(runs.items()):
        if tracker not in _TRACKER_RUNS or (tracker not in report_to and "all" not in report_to):
            continue
        try:
            there = _TRACKER_RUNS[tracker].still_there(run_id)
        except ImportError:  # "all", and that tracker is not installed: it does not start
            continue
        if not there:
            logger.warning("logging.report_to: the %s run %s that %s names is gone (deleted, or another server): "
                           "a new %s run takes the records from here on", tracker, run_id,
                           Path(output_dir) / TRACKERS_FILE, tracker)
            del runs[tracker]
    return runs


def read_tracker_runs(output_dir: str | os.PathLike) -> dict[str, str]:
    """The tracker runs an output folder's run logs to (``trackers.json``: tracker name to run id), or none."""
    path = Path(output_dir) / TRACKERS_FILE
    try:
        runs = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: the resumed run starts new tracker runs
    return {str(k): str(v) for k, v in runs.items()} if isinstance(runs, dict) else {}


def write_tracker_runs(output_dir: str | os.PathLike, runs: dict[str, str]) -> None:
    """Name the folder's tracker runs in ``trackers.json``; without any, an earlier run's file goes, lest a later
    resume take its runs for this one's."""
    path = Path(output_dir) / TRACKERS_FILE
    if runs:
        write_atomic(path, json.dumps(runs, indent=2, sort_keys=True) + "\n")
    else:
        path.unlink(missing_ok=True)


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
