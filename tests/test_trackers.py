"""``logging.report_to``: any tracker Accelerate supports, checked at start-up; what a resumed run sends the
tracker runs it goes on with.

End to end, their own files read back: TensorBoard in test_cli.py; TensorBoard, W&B (offline) and MLflow (SQLite)
over a kill and a resume in test_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import forked
from helpers import REPO, make_texts, offline_env, save_tiny_model, write_tsv

from finetune.errors import ConfigError
from finetune.tracker_runs import Held, read_tracker_runs, runs_to_continue, tracker_settings, write_tracker_runs
from finetune.tracking import RunLogger, check_trackers, read_log


def missing_tracker() -> str:
    """A tracker Accelerate supports whose package is not installed here."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    available = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    missing = [name for name in ("wandb", "mlflow", "trackio", "comet_ml", "aim", "clearml", "dvclive", "swanlab")
               if name in LOGGER_TYPE_TO_CLASS and name not in available]
    if not missing:
        pytest.skip("every tracker package is installed")
    return missing[0]


def test_installed_and_known_trackers_pass():
    check_trackers([])
    check_trackers(["tensorboard"])
    check_trackers(["all"])


def test_unknown_tracker_names_the_key():
    with pytest.raises(ConfigError) as info:
        check_trackers(["tensorboard", "tensorbord"])
    assert str(info.value) == "logging.report_to: unknown tracker 'tensorbord' (did you mean 'tensorboard'?)"


@pytest.mark.parametrize("report_to", [["tensorboard"], ["all"]])
def test_a_tensorboard_too_old_for_numpy_2_is_refused_before_anything_loads(monkeypatch, report_to):
    """tensorboard before 2.17.1 reads np.string_, gone in numpy 2, when a run stores its config: after the model
    and the data are loaded, in a traceback. The check reads the installed versions alone."""
    import importlib.metadata

    installed = {"tensorboard": "2.16.2", "numpy": "2.0.2"}
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed.get(name) or real(name))
    with pytest.raises(ConfigError) as info:
        check_trackers(report_to)
    assert str(info.value) == ("logging.report_to: tensorboard 2.16.2 does not run beside numpy 2.0.2 "
                               "(pip install 'tensorboard>=2.17.1')")
    for tensorboard, numpy in (("2.17.1", "2.0.2"), ("2.16.2", "1.26.4"), ("2.20.0rc1", "2.3.0")):
        installed.update(tensorboard=tensorboard, numpy=numpy)
        check_trackers(report_to)  # the release that runs beside numpy 2, or numpy 1
    installed.update(tensorboard="2.16.2", numpy="2.0.2")
    check_trackers([])  # not asked for: not checked


def test_missing_package_names_the_key_and_the_pip_package():
    name = missing_tracker()
    with pytest.raises(ConfigError) as info:
        check_trackers(["tensorboard", name])
    package = {"comet_ml": "comet-ml", "aim": "'aim<4'"}.get(name, name)
    assert str(info.value) == (f"logging.report_to: tracker {name!r} needs a package that is not installed "
                               f"(pip install {package})")


def _tiny_job(tmp_path) -> Path:
    cfg = {
        "model": {"name_or_path": str(save_tiny_model(tmp_path / "tiny-bert"))},
        "data": {"train_file": str(write_tsv(tmp_path / "sms.tsv", make_texts(40, seed=1))), "format": "tsv",
                 "has_header": False, "column_names": ["label", "text"], "max_length": 32},
        "logging": {"report_to": ["tensorboard"], "progress_bar": False},
        "output": {"output_dir": str(tmp_path / "out")},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return tmp_path / "cfg.yaml"


def test_missing_tracker_stops_train_py_before_any_work(tmp_path):
    name = missing_tracker()
    out = tmp_path / "out"
    proc = forked.run([sys.executable, "finetune/train.py", "--config", str(_tiny_job(tmp_path)),
                       f"logging.report_to=[tensorboard,{name}]"], env=offline_env(), timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"logging.report_to: tracker {name!r} needs a package" in errors[0]
    assert not out.exists()  # nothing was written, no data was read into the output



@pytest.mark.slow
def test_a_tracker_that_cannot_start_stops_the_run_in_one_line(tmp_path):
    """W&B online without a login (no key, no netrc: a home of its own) raises its own error when the run starts
    its trackers, after the model is loaded: one line naming the key, with W&B's words, not a traceback."""
    env = {name: value for name, value in offline_env().items() if not name.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path), WANDB_MODE="online")
    proc = forked.run([sys.executable, "finetune/train.py", "--config", str(_tiny_job(tmp_path)),
                       "logging.report_to=[wandb]"], env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: command line: logging.report_to: wandb did not start: ")
    assert not (tmp_path / "out" / "train_log.jsonl").exists()  # no update was made

def _trackio_runs(folder: Path) -> list[SimpleNamespace]:
    """The Trackio runs of the project ``finetune`` that hold updates, as Trackio's own SQLite file in ``folder``
    keeps them, oldest first: each run's name, group, and updates' losses."""
    with contextlib.closing(sqlite3.connect(folder / "finetune.db")) as db:
        groups = {run_id: json.loads(config).get("_Group")
                  for run_id, config in db.execute("select run_id, config from configs")}
        runs = db.execute("select run_id, run_name from metrics group by run_id order by min(id)").fetchall()
        return [SimpleNamespace(name=name, group=groups.get(run_id), steps=[
                    (step, json.loads(numbers)["train/loss"]) for step, numbers in db.execute(
                        "select step, metrics from metrics where run_id = ? order by id", (run_id,))
                    if "train/loss" in json.loads(numbers)])
                for run_id, name in runs]


@pytest.mark.slow
def test_trackio_runs_are_named_for_their_folder_and_a_resumed_one_holds_the_whole_run(tmp_path):
    """Trackio's runs were named at random (``dainty-sunset-0``), so a sweep's trials could not be told apart. Named
    for the output folder as W&B's and MLflow's are, and grouped; killed while saving update 4 and resumed at 2, the
    resumed start's Trackio run (a new one of the same name) holds each update once, as ``train_log.jsonl``."""
    pytest.importorskip("trackio", reason="trackio is not installed (the floors leave it out: .ci/floors)")
    out, trackio_dir = tmp_path / "out", tmp_path / "trackio"
    run = [sys.executable, str(REPO / "tests" / "interrupt_worker.py"), "--config", str(_tiny_job(tmp_path)),
           "logging.report_to=[trackio]", "training.max_steps=6", "output.checkpoint_every=2"]
    env = offline_env({"TRACKIO_DIR": str(trackio_dir), "FINETUNE_CPU_THREADS": "1"})
    killed = forked.run(run, env={**env, "FINETUNE_TEST_KILL_SAVING": "4"}, timeout=180)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = forked.run(run, env=env, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint-2: update 2" in resumed.stderr
    logged = [(r["step"], r["train/loss"]) for r in read_log(out) if "train/loss" in r]
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5, 6]
    runs = _trackio_runs(trackio_dir)
    assert {r.name for r in runs} == {str(out)} and runs[-1].group is None
    assert [step for step, _ in runs[-1].steps] == [step for step, _ in logged]
    assert [loss for _, loss in runs[-1].steps] == pytest.approx([loss for _, loss in logged], rel=1e-6)

    fresh = forked.run(run + ["output.overwrite=true", "logging.run_name=lr3e-4", "logging.run_group=lr",
                              "optim.learning_rate=3e-4"], env=env, timeout=180)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    last = _trackio_runs(trackio_dir)[-1]
    assert (last.name, last.group) == ("lr3e-4", "lr")
    assert last.steps == pytest.approx([(r["step"], r["train/loss"]) for r in read_log(out) if "train/loss" in r])


class _Tracker:
    """Stands in for one of Accelerate's trackers: its name, the updates it was sent, and (as W&B's) the step its
    run starts at, which W&B's server counts, or that it is offline, or (as MLflow's) its run's id."""

    def __init__(self, name: str, starting_step: int = 0, offline: bool = False, run_id: str = "run-1"):
        self.name, self.sent = name, []
        self.run = SimpleNamespace(id=run_id, starting_step=starting_step, offline=offline)
        self.active_run = SimpleNamespace(info=SimpleNamespace(run_id=run_id))

    def log(self, values: dict, step=None):
        assert values == {"train/loss": 1.0 / step}  # the record's numbers, the step apart
        self.sent.append(step)


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A client of a real MLflow tracking store (SQLite) in ``tmp_path``, and an experiment in it."""
    import warnings

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with warnings.catch_warnings():  # MLflow's store uses a loader option the newest SQLAlchemy deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        client = MlflowClient()
        yield client, client.create_experiment("finetune")


def _resumed_at_4_of_6(folder, trackers: list, continued: set[str]) -> RunLogger:
    """The stopped run wrote updates 1 to 6 and was killed; its checkpoint is at 4; the resumed run logs 5 to 8."""
    records = [{"step": step, "train/loss": 1.0 / step} for step in range(1, 7)]
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    acc = SimpleNamespace(is_main_process=True, trackers=trackers)
    log = RunLogger(acc, folder, use_trackers=True, resume_step=4, continued=frozenset(continued))
    for step in range(5, 9):
        log.log({"step": step, "train/loss": 1.0 / step})
    assert [r["step"] for r in read_log(folder)] == [1, 2, 3, 4, 5, 6, 7, 8]
    return log


def test_a_continued_tracker_run_is_sent_each_update_it_lacks_once(tmp_path, mlflow_store):
    """MLflow's server (a real store) says which updates its run holds: 1 to 6 but 4, whose batch the kill lost
    (the records are queued, so not only a tail can go): 4 comes from the file, 5 and 6 are not sent again.
    W&B's server counts what its run holds: 1 to 5 (its writer lost update 6 in the kill), or only 1 and 2 (the
    kill lost 3 and 4 too, before the checkpoint): they come from the file. Offline, W&B counts nothing: its
    start gets what the resumed run makes. TensorBoard keeps the earlier files' 1 to 4 and drops their 5 and 6
    itself."""
    import mlflow as mlflow_library
    from mlflow.entities import Metric

    client, experiment = mlflow_store
    run_id = client.create_run(experiment).info.run_id
    client.log_batch(run_id, metrics=[Metric("train/loss", 1.0 / step, 0, step) for step in (1, 2, 3, 5, 6)])
    mlflow, tensorboard = _Tracker("mlflow", run_id=run_id), _Tracker("tensorboard")
    wandb, lost, offline = _Tracker("wandb", starting_step=6), _Tracker("wandb", 3), _Tracker("wandb", offline=True)
    _resumed_at_4_of_6(tmp_path, [wandb, mlflow, tensorboard], {"wandb", "mlflow"})
    assert wandb.sent == [6, 7, 8]
    assert tensorboard.sent == [5, 6, 7, 8]
    assert mlflow.sent == []  # MLflow's records are queued with MLflow itself, not sent through Accelerate's call
    mlflow_library.flush_async_logging()
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert all(m.value == 1.0 / m.step for m in history)
    _resumed_at_4_of_6(tmp_path, [lost], {"wandb"})
    assert lost.sent == [3, 4, 5, 6, 7, 8]
    _resumed_at_4_of_6(tmp_path, [offline], {"wandb"})
    assert offline.sent == [5, 6, 7, 8]


def test_a_tracker_run_is_sent_the_numbers_of_an_update_it_lacks():
    """MLflow holds each number of an update apart: an evaluation's record and the update's, at the same step,
    or two numbers of one record in batches of their own."""
    record = {"step": 4, "train/loss": 0.5, "train/lr": 1e-4, "note": "not a number"}
    assert Held().lacks(record) == {"train/loss": 0.5, "train/lr": 1e-4}
    assert Held(through=4).lacks(record) == {} and Held(through=3).lacks(record) == Held().lacks(record)
    assert Held(pairs=frozenset({("train/loss", 4), ("train/lr", 3)})).lacks(record) == {"train/lr": 1e-4}


def test_a_new_tracker_run_on_a_resume_is_sent_the_whole_run(tmp_path, mlflow_store):
    """A tracker added on the resume, a run that is gone, or one of the trackers that start a run at each start:
    the updates up to the checkpoint come from the file, and it holds the whole run."""
    import mlflow as mlflow_library

    client, experiment = mlflow_store
    run_id = client.create_run(experiment).info.run_id
    wandb, mlflow, aim = _Tracker("wandb", starting_step=6), _Tracker("mlflow", run_id=run_id), _Tracker("aim")
    _resumed_at_4_of_6(tmp_path, [wandb, mlflow, aim], continued=set())
    assert wandb.sent == aim.sent == [1, 2, 3, 4, 5, 6, 7, 8]
    mlflow_library.flush_async_logging()
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_the_tracker_runs_to_continue_are_those_the_folder_names(tmp_path):
    assert read_tracker_runs(tmp_path) == {}
    write_tracker_runs(tmp_path, {"wandb": "a1b2c3d4", "mlflow": "0f9e"})
    assert read_tracker_runs(tmp_path) == {"wandb": "a1b2c3d4", "mlflow": "0f9e"}
    settings = tracker_settings(resume_step=4, earlier=read_tracker_runs(tmp_path))
    assert settings == {"tensorboard": {"purge_step": 5}, "wandb": {"id": "a1b2c3d4", "resume": "allow"},
                        "mlflow": {"run_id": "0f9e"}}
    assert tracker_settings(resume_step=None) == {"tensorboard": {"purge_step": 1}}  # an earlier run's events go
    # a new tracker run is named; one that goes on keeps its name; Trackio's starts anew, named as the first
    assert tracker_settings(None, None, "outputs/reviews") == {
        "tensorboard": {"purge_step": 1}, "wandb": {"name": "outputs/reviews"},
        "mlflow": {"run_name": "outputs/reviews"}, "trackio": {"name": "outputs/reviews"}}
    assert tracker_settings(None, None, "outputs/s/trial-1", "outputs/s") == {
        "tensorboard": {"purge_step": 1}, "wandb": {"name": "outputs/s/trial-1", "group": "outputs/s"},
        "mlflow": {"run_name": "outputs/s/trial-1"}, "trackio": {"name": "outputs/s/trial-1", "group": "outputs/s"}}
    assert tracker_settings(4, {"wandb": "a1b2c3d4", "trackio": "5e6f"}, "outputs/reviews") == {
        "tensorboard": {"purge_step": 5}, "wandb": {"id": "a1b2c3d4", "resume": "allow"},
        "mlflow": {"run_name": "outputs/reviews"}, "trackio": {"name": "outputs/reviews"}}
    # DVCLive writes into the run's folder, not into ./dvclive, which it empties at each start
    assert tracker_settings(None, output_dir=tmp_path / "out")["dvclive"] == {"dir": str(tmp_path / "out" / "dvclive")}
    write_tracker_runs(tmp_path, {})  # a fresh run without such trackers: the earlier run's names go
    assert not (tmp_path / "trackers.json").exists()
    (tmp_path / "trackers.json").write_text("[1, 2", encoding="utf-8")  # cut short: new tracker runs
    assert read_tracker_runs(tmp_path) == {}


def test_a_run_goes_on_with_an_mlflow_run_only_where_its_server_still_holds_it(tmp_path, mlflow_store, caplog):
    """A deleted MLflow run (or one on another tracking server) cannot be started again: the resumed run says so and
    starts a new one, instead of ending in MLflow's traceback after the model is loaded."""
    client, experiment = mlflow_store
    kept, deleted = (client.create_run(experiment).info.run_id for _ in range(2))
    client.delete_run(deleted)
    for run_id, there in ((kept, True), (deleted, False), ("0" * 32, False)):
        write_tracker_runs(tmp_path, {"mlflow": run_id, "wandb": "a1b2c3d4"})
        caplog.clear()
        assert runs_to_continue(tmp_path, ["mlflow", "wandb"]) == \
            {**({"mlflow": run_id} if there else {}), "wandb": "a1b2c3d4"}
        said = [r.getMessage() for r in caplog.records]
        assert said == ([] if there else [
            f"logging.report_to: the mlflow run {run_id} that {tmp_path / 'trackers.json'} names is gone "
            "(deleted, or another server): a new mlflow run takes the records from here on"])
    # not reported to: neither asked for nor dropped
    assert runs_to_continue(tmp_path, ["wandb"]) == {"mlflow": "0" * 32, "wandb": "a1b2c3d4"}


def test_mlflow_holds_every_record_once_the_run_has_ended(tmp_path, mlflow_store, fresh_accelerate_state):
    """MLflow's records go asynchronously, so that the training does not wait for its server at each update;
    when the run ends (``fit`` returns, in a notebook or a sweep's process too) they are all with the server."""
    from accelerate import Accelerator

    client, _ = mlflow_store
    acc = Accelerator(cpu=True, log_with="mlflow", project_dir=str(tmp_path))
    acc.init_trackers("finetune")
    run_id = acc.trackers[0].active_run.info.run_id
    log = RunLogger(acc, tmp_path, use_trackers=True)
    for step in range(1, 401):
        log.log({"step": step, "train/loss": 1.0 / step, "train/learning_rate": 1e-4})
    acc.end_training()  # as fit ends
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 401))
    assert {m.step: m.value for m in history} == {step: 1.0 / step for step in range(1, 401)}
    assert client.get_run(run_id).info.status == "FINISHED"
