"""Each tracker's runs: how a new one is named and grouped, where it writes, and how a resumed run goes on with the
stopped run's.

Accelerate starts every tracker with keyword arguments of its library's own (``init_kwargs``) and has no common
call for a run's name, its group, its folder or its continuation, so the tables here hold each library's own
arguments. A tracker that is in none of them gets Accelerate's defaults.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from finetune.outputs import DVCLIVE_DIR, TRACKERS_FILE, write_atomic

logger = logging.getLogger("finetune")


def scalars(record: dict[str, Any]) -> dict[str, Any]:
    """What a tracker takes of a record: its numbers, but the step."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}


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
        return {k: v for k, v in scalars(record).items() if (k, step) not in self.pairs}


def _no_group_once_started(tracker, group: str) -> None:
    """A tracker whose group is given at the start, or read-only once its run started."""


@dataclass(frozen=True)
class Naming:
    """How a new run of one tracker is named and put in a group: the init kwargs that do it, or (for a group the
    start cannot take) what does it once the run started."""

    named: Callable[[str], dict[str, Any]]
    grouped: Callable[[str], dict[str, Any]] = lambda group: {}
    group_started: Callable[[Any, str], None] = _no_group_once_started


@dataclass(frozen=True)
class Continuation:
    """How a resumed run goes on with the tracker run the stopped run started."""

    run_id: Callable[[Any], str]  # the started tracker's run id
    continued: Callable[[str], dict[str, Any]]  # the init kwargs that continue the run with that id
    still_there: Callable[[str], bool]  # whether the run with that id can be continued
    holds: Callable[[Any], Optional[Held]]  # what the continued run holds of the run's updates (None: not known)


def _mlflow_client():
    from mlflow import MlflowClient

    return MlflowClient()


def _mlflow_grouped(tracker, group: str) -> None:
    """MLflow's group is a tag of the started run: Accelerate would put tags given at the start on a new
    experiment too."""
    _mlflow_client().set_tag(tracker.active_run.info.run_id, "group", group)


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


# The trackers whose runs a run names (after its output folder, or logging.run_name) and groups
# (logging.run_group); the others name their runs as Accelerate's defaults do (Trackio, for one, a random name).
NAMING = {
    "wandb": Naming(named=lambda name: {"name": name}, grouped=lambda group: {"group": group}),
    "mlflow": Naming(named=lambda name: {"run_name": name}, group_started=_mlflow_grouped),
    "trackio": Naming(named=lambda name: {"name": name}, grouped=lambda group: {"group": group}),
}

# The trackers whose runs a resumed run goes on with; the others start a new run at each start. Trackio's is
# not among them: it continues a run by name, and no public call says which updates a continued run holds (a kill
# loses its last ones), so a resumed run's Trackio run is a new one of the same name, which is sent the whole run.
CONTINUATION = {
    "wandb": Continuation(
        run_id=lambda tracker: tracker.run.id,
        continued=lambda run_id: {"id": run_id, "resume": "allow"},
        still_there=lambda run_id: True,  # resume="allow" starts a new run under the id where there is none
        # what its server counts (W&B's writer buffers: a SIGKILL loses the last records); offline, not known: each
        # start's files hold what that start sent
        holds=lambda tracker: None if tracker.run.offline else Held(through=tracker.run.starting_step - 1)),
    "mlflow": Continuation(
        run_id=lambda tracker: tracker.active_run.info.run_id,
        continued=lambda run_id: {"run_id": run_id},
        still_there=_mlflow_run_is_there,  # start_run fails on a run deleted or unknown
        holds=_mlflow_holds),
}

# How a record is sent to a tracker, where not as Accelerate's tracker sends it
SENDERS: dict[str, Callable[[Any, dict[str, Any], Optional[int]], None]] = {"mlflow": _mlflow_queued}


def tracker_settings(resume_step: Optional[int], earlier: Optional[dict[str, str]] = None,
                     run_name: Optional[str] = None, run_group: Optional[str] = None,
                     output_dir: Optional[str | os.PathLike] = None) -> dict[str, dict[str, Any]]:
    """Accelerate's ``init_kwargs`` for a run's trackers, by tracker.

    TensorBoard drops what earlier event files in its folder hold from the run's first update on
    (``purge_step``: TensorBoard's readers discard earlier files' events from that step): a resumed run's past
    its checkpoint, as ``train_log.jsonl`` is cut there, and all of an earlier run's that ``output.overwrite``
    replaced. Each update is shown once, as this run logged it. (An evaluation at the checkpoint's own update
    that the stopped run logged and the resumed run runs again, which the file keeps once, shows twice there.)
    DVCLive writes into ``output_dir``: its default folder is ``dvclive`` in the working directory, which it
    empties at each start, so every run started there (each trial of a sweep, a resume) deleted the curves of
    the one before; in the run's folder it empties only the run's own, which the run sends it again.
    The tracker runs in ``earlier`` (tracker name to run id) are continued, as they were named and grouped; new
    ones are named ``run_name`` and grouped in ``run_group`` (:data:`NAMING`).
    """
    settings: dict[str, dict[str, Any]] = {"tensorboard": {"purge_step": (resume_step or 0) + 1}}
    if output_dir is not None:
        settings["dvclive"] = {"dir": str(Path(output_dir) / DVCLIVE_DIR)}
    for tracker, naming in NAMING.items():
        if tracker in (earlier or {}) and tracker in CONTINUATION:
            settings[tracker] = CONTINUATION[tracker].continued(earlier[tracker])
        else:
            settings[tracker] = {**(naming.named(run_name) if run_name else {}),
                                 **(naming.grouped(run_group) if run_group else {})}
    return {tracker: kwargs for tracker, kwargs in settings.items() if kwargs}


def runs_to_continue(output_dir: str | os.PathLike, report_to: list[str]) -> dict[str, str]:
    """The tracker runs of the folder's ``trackers.json`` that a resumed run reporting to ``report_to`` goes on with:
    those it reports to and their servers still hold. Of one that is gone (deleted, or another tracking server
    now), a warning; the tracker starts a new run."""
    runs = read_tracker_runs(output_dir)
    for tracker, run_id in list(runs.items()):
        if tracker not in CONTINUATION or (tracker not in report_to and "all" not in report_to):
            continue
        try:
            there = CONTINUATION[tracker].still_there(run_id)
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
