"""``finetune sweep``: what it writes, continuing after SIGTERM, several workers, pruning, seeds, folds, bad input.

Every sweep here searches the tiny BERT on 48 generated SMS-like rows; a
trial is a run of a second or two. The sweeps that must be separate
processes (a signal, two workers, a PostgreSQL server) are marked slow.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

import forked
from helpers import REPO, compiling_with, make_texts, offline_env, write_sms_job, write_tsv

SPACE = {"optim.learning_rate": {"low": 1e-3, "high": 3e-2, "log": True},
         "training.effective_batch_size": [4, 8]}


def sms_job(root: Path, epochs: int = 2, **sections) -> Path:
    """The tiny job: micro-batch 4, selection on accuracy (or ``evaluation`` given), fp32."""
    training = {"per_device_train_batch_size": 4, "effective_batch_size": 8, "num_train_epochs": epochs,
                "seed": 1, "mixed_precision": "no", **sections.pop("training", {})}
    evaluation = {"metrics": ["accuracy"], "average": "macro", "metric_for_best_model": "accuracy",
                  **sections.pop("evaluation", {})}
    return write_sms_job(root, training=training, evaluation=evaluation,
                         output={"output_dir": str(root / "out")}, **sections)


def sweep_file(root: Path, name: str = "sweep.yaml", **settings) -> Path:
    path = root / name
    path.write_text(yaml.safe_dump({"space": SPACE, "trials": 4, "sampler": {"type": "random", "seed": 0},
                                    **settings}), encoding="utf-8")
    return path


def sweep_in_process(args: list[str]) -> int:
    from finetune.sweep import main

    os.environ["FINETUNE_CPU_THREADS"] = "1"  # a 32-wide model gains nothing from a second thread
    return main(args)


def sweep_process(args: list[str]):
    """``python -m finetune.cli sweep ARGS`` started as a command of its own; ``communicate()[0]`` is its output."""
    return forked.start([sys.executable, "-m", "finetune.cli", "sweep", *args],
                        env=offline_env({"FINETUNE_CPU_THREADS": "1"}), merge_stderr=True)


def load_study(folder: Path, name: str | None = None):
    import optuna

    return optuna.load_study(study_name=name or folder.resolve().name, storage=f"sqlite:///{folder / 'study.db'}")


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "train_log.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "train/loss" in r]


# --- a dry run ---------------------------------------------------------------------------------------------------


def _rounding(said: float) -> float:
    """How far from the seconds it rounded a duration ``readable_duration`` said can be: to 0.1 s under 10 s, to
    the second from there to 90 s."""
    return 0.05 if said < 10 else 0.5


def test_a_dry_run_tries_the_least_and_most_work_and_says_the_sweeps_length_writing_nothing(
        tmp_path, fresh_accelerate_state, caplog, capsys):
    config = sms_job(tmp_path, data={"on_empty_text": "drop"})  # 48 training rows at b=4: 12 micro-batches an
    with (tmp_path / "sms.tsv").open("a", encoding="utf-8") as fh:  # epoch, 2 epochs; and a row each read leaves out
        fh.write("ham\t \n")
    spec = sweep_file(tmp_path, fixed={"evaluation.evals_per_epoch": 2})  # effective batch 4 or 8: k=1 or 2
    out = tmp_path / "out-sweep"
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert sweep_in_process(["--config", str(config), "--sweep", str(spec), "--seeds", "2", "--dry-run"]) == 0
    assert not out.exists()
    said = [r.getMessage() for r in caplog.records]
    # the sweep's own start line first, as a start says it, without a count of trials done it did not read
    first = next(line for line in said if line.startswith("sweep in "))
    assert first.startswith(f"sweep in {out}: objective accuracy (higher is better); space ") and \
        ("; 4 trials, sampler random (seed 0), pruner median (warmup_epochs 0.25); then the best config over 2 "
         "seeds; storage sqlite:///") in first, first  # a file with no pruner: the default median's warm-up
    # each run tried says its own dry run: the sweep file's fixed evals_per_epoch reached it, 2 an epoch
    runs = [line for line in said if line.startswith("dry run: ")]
    assert len(runs) == 2 and all(", and its 4 evaluations of 12 texts about " in line for line in runs), runs
    # what reading the data found, which each run read alike, said once
    from finetune.sweep_notes import DATA_LOGGERS

    data_notes = [r.getMessage() for r in caplog.records if r.name in DATA_LOGGERS]
    assert data_notes and len(set(data_notes)) == len(data_notes), data_notes
    line = next(line for line in said if line.startswith("sweep dry run: "))
    match = re.fullmatch(r"sweep dry run: a run would take about ([\d.]+) s at training.effective_batch_size=8 \(12 "
                         r"updates\) and ([\d.]+) s at training.effective_batch_size=4 \(24 updates\): its start, "
                         r"updates and evaluations, not its checkpoints \(4 a run, about [\d.]+GB each\) or saved "
                         r"files; the search's 4 trials, then "
                         r"the best config over 2 seeds: 6 runs, about ([\d.]+) s(?: to ([\d.]+) s)?, less what the "
                         rf"pruner stops; nothing was written to {re.escape(str(out))}", line)
    assert match, line
    least, most, sweep_least, sweep_most = (float(said or match[3]) for said in match.groups())  # equal: said once
    fewest, longest = min(least, most), max(least, most)
    assert sweep_least == pytest.approx(6 * fewest, abs=6 * _rounding(fewest) + _rounding(sweep_least))
    assert sweep_most == pytest.approx(6 * longest, abs=6 * _rounding(longest) + _rounding(sweep_most))
    # the sweep is checked as a start checks it: a space the config refuses is one line, and nothing is tried
    bad = sweep_file(tmp_path, name="bad.yaml", space={"optim.learnig_rate": [1e-3]})
    capsys.readouterr()
    assert sweep_in_process(["--config", str(config), "--sweep", str(bad), "--dry-run"]) == 2
    assert "space: optim.learnig_rate: no such config key" in capsys.readouterr().err
    assert not out.exists()
    # no search: the config alone, one run tried, said part by part
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert sweep_in_process(["--config", str(config), "--seeds", "3", "--dry-run"]) == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("sweep dry run: "))
    match = re.fullmatch(r"sweep dry run: a run would take about ([\d.]+) s: its start [\d.]+ s, its 12 updates "
                         r"[\d.]+ s, its 2 evaluations [\d.]+ s, not its checkpoints \(2 a run, about [\d.]+GB "
                         r"each\) or saved files; the config over "
                         rf"3 seeds: 3 runs, about ([\d.]+) s; nothing was written to {re.escape(str(out))}", line)
    assert match, line
    run, runs = float(match[1]), float(match[2])
    assert runs == pytest.approx(3 * run, abs=3 * _rounding(run) + _rounding(runs))
    assert not out.exists()


def test_a_dry_run_tries_one_run_where_the_space_leaves_the_work_as_it_is():
    from finetune.search_space import parse_space
    from finetune.sweep_dry_run import work_corners

    assert work_corners(parse_space({"optim.learning_rate": [1e-3, 1e-2]}, "--sweep")) == [[]]
    # one value: its least work is its most, and one run says it
    assert work_corners(parse_space({"training.effective_batch_size": [16]}, "--sweep")) == [
        ["training.effective_batch_size=16"]]
    assert work_corners(parse_space({"optim.learning_rate": [1e-3], "training.effective_batch_size": [16, 64, 32],
                                     "training.num_train_epochs": {"low": 1, "high": 3}}, "--sweep")) == [
        ["training.effective_batch_size=64", "training.num_train_epochs=1.0"],
        ["training.effective_batch_size=16", "training.num_train_epochs=3.0"]]


def test_a_dry_run_counts_the_sweeps_runs():
    from types import SimpleNamespace

    from finetune.search_space import parse_space
    from finetune.sweep_dry_run import runs_of

    space = parse_space(SPACE, "--sweep")

    def sweep(space=space, trials=12, trial_seeds=1, seeds=0, folds=0):
        return SimpleNamespace(space=space, trials=trials, trial_seeds=trial_seeds, seeds=seeds, folds=folds)

    assert runs_of(sweep()) == (12, "the search's 12 trials")
    assert runs_of(sweep(trial_seeds=3, seeds=5)) == (41, "the search's 12 trials over 3 seeds each, then the best "
                                                          "config over 5 seeds")
    assert runs_of(sweep(trials=1, folds=5)) == (6, "the search's 1 trial, then the best config on each of 5 folds")
    assert runs_of(sweep(space=parse_space(None, "--sweep"), folds=5)) == (5, "the config on each of 5 folds")


# --- the space ---------------------------------------------------------------------------------------------------


def test_space_kinds_follow_the_schema_and_values_read_back():
    from finetune.config import parse_override
    from finetune.search_space import overrides, parse_space

    space = parse_space({"optim.learning_rate": {"low": "1e-5", "high": 1e-4, "log": True},
                         "optim.warmup_ratio": {"low": 0, "high": 1},
                         "training.max_steps": {"low": 10, "high": 40},
                         "optim.lr_scheduler_type": ["linear", "cosine"]}, "s.yaml")
    kinds = {d.key: d.kind for d in space.dimensions}
    assert kinds == {"optim.learning_rate": "float", "optim.warmup_ratio": "float",
                     "training.max_steps": "int", "optim.lr_scheduler_type": "choice"}
    assert space.dimensions[0].low == 1e-5 and space.dimensions[0].log
    values = {"optim.learning_rate": 1e-05, "optim.warmup_ratio": 0.1, "training.max_steps": 30,
              "optim.lr_scheduler_type": "cosine", "data.text_column": "true"}
    # YAML 1.1 reads `1e-05` as a string: every override must read back as the value drawn
    assert dict(parse_override(o) for o in overrides(values)) == values


# --- the best trial ----------------------------------------------------------------------------------------------


def test_of_trials_with_the_best_value_the_lowest_validation_loss_wins_and_the_report_says_why(tmp_path):
    import dataclasses

    import optuna

    from finetune.search_space import parse_space
    from finetune.study import EVAL_LOSS, FOLDER, SAME_AS
    from finetune.sweep_report import Header, best_trial, tied_for_best, write_reports

    study = optuna.create_study(direction="maximize")
    lr = optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)

    def add(value, loss, rate, **attrs):
        study.add_trial(optuna.trial.create_trial(
            value=value, params={"optim.learning_rate": rate}, distributions={"optim.learning_rate": lr},
            user_attrs={FOLDER: f"trial-{len(study.trials):04d}", **({EVAL_LOSS: loss} if loss is not None else {}),
                        **attrs}))

    add(0.95, 0.40, 1e-5)
    add(0.98, 0.31, 2e-5)   # the first of the best value
    add(0.90, 0.05, 3e-5)   # the lowest loss, not of the best value
    add(0.98, 0.22, 4e-5)   # the best value's lowest loss
    add(0.98, 0.22, 4e-5, **{SAME_AS: 3})  # the same values drawn again: trial 3's result
    add(0.98, 0.27, 5e-5)
    add(0.98, None, 6e-5, **{EVAL_LOSS: None})  # a loss not known: ranked after the known ones
    assert [t.number for t in tied_for_best(study.trials, True)] == [1, 3, 4, 5, 6]
    assert best_trial(study.trials, True).number == 3
    assert best_trial(study.trials, False).number == 2  # lower is better: one trial has the lowest value
    header = Header(command="finetune sweep", metric="f1", greater_is_better=True,
                    space=parse_space({"optim.learning_rate": {"low": 1e-5, "high": 1e-3, "log": True}}, "s.yaml"),
                    trials=7, sampler="tpe", pruner="none", storage="sqlite:///study.db")
    write_reports(tmp_path, header, study, None, [])
    report = (tmp_path / "sweep.md").read_text()
    # trial 4 took trial 3's result: not another trial tied with it
    assert ("Best: trial 3 (trial-0003), f1 0.9800: `optim.learning_rate=4e-05`. Tied on f1 with trials 1, 5 and "
            "6: of them, its saved model has the lowest validation loss (0.2200).") in report
    assert "# The best trial of the sweep in" in (tmp_path / "best.yaml").read_text().splitlines()[0]
    assert "trial 3, value 0.9800" in (tmp_path / "best.yaml").read_text().splitlines()[0]
    # the table's first row is the best: of equal values, the lower loss first, which it shows
    assert "| trial | state | `optim.learning_rate` | f1 | validation loss | updates | s |" in report
    table = [line for line in report.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(line.split("|")[1]) for line in table] == [3, 4, 5, 1, 6, 0, 2]
    assert table[0].startswith("| 3 | complete | 4e-05 | 0.9800 | 0.2200 |")
    assert table[4].startswith("| 6 | complete | 6e-05 | 0.9800 |  |")  # no loss known
    # a study from before the losses were kept: the first drawn of the equals, and said so
    old = optuna.create_study(direction="maximize")
    for rate in (1e-5, 2e-5):
        old.add_trial(optuna.trial.create_trial(value=0.9, params={"optim.learning_rate": rate},
                                                distributions={"optim.learning_rate": lr},
                                                user_attrs={FOLDER: f"trial-{len(old.trials):04d}"}))
    assert best_trial(old.trials, True).number == 0
    write_reports(tmp_path, header, old, None, [])
    assert "Tied on f1 with trial 1: the first drawn of them." in (tmp_path / "sweep.md").read_text()
    # where the objective is the loss, the table does not show it twice
    write_reports(tmp_path, dataclasses.replace(header, metric="loss", greater_is_better=False), old, None, [])
    assert "| trial | state | `optim.learning_rate` | loss | updates | s |" in (tmp_path / "sweep.md").read_text()


def test_the_reports_read_the_study_once_while_another_worker_ends_a_trial(tmp_path):
    """A trial of another worker, running when the table's rows were read and the best when the best was chosen,
    left the best without a value, and the report crashed the sweep: the reports read the study's trials once."""
    import optuna

    from finetune.search_space import parse_space
    from finetune.study import FOLDER
    from finetune.sweep_report import Header, write_reports

    lr = optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)

    def trial(number, state, value=None):
        made = optuna.trial.create_trial(state=state, value=value, params={"optim.learning_rate": 1e-5 * (number + 1)},
                                         distributions={"optim.learning_rate": lr},
                                         user_attrs={FOLDER: f"trial-{number:04d}"})
        made.number = number
        return made

    complete, running = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING
    reads = [[trial(0, complete, 0.5), trial(1, running)], [trial(0, complete, 0.5), trial(1, complete, 0.9)]]

    class StudyWhileAnotherWorkerRuns:  # its first read sees trial 1 running, any later one sees it ended
        user_attrs: dict = {}

        def get_trials(self, deepcopy=True):
            return reads.pop(0) if len(reads) > 1 else reads[0]

    header = Header(command="finetune sweep", metric="f1", greater_is_better=True,
                    space=parse_space({"optim.learning_rate": {"low": 1e-5, "high": 1e-3, "log": True}}, "s.yaml"),
                    trials=2, sampler="tpe", pruner="none", storage="sqlite:///study.db")
    write_reports(tmp_path, header, StudyWhileAnotherWorkerRuns(), None, [])
    assert "trial 0, value 0.5000" in (tmp_path / "best.yaml").read_text().splitlines()[0]
    assert "| 1 | running |" in (tmp_path / "sweep.md").read_text()


# --- a 4-trial sweep and what it writes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_trials(tmp_path_factory):
    from accelerate.state import AcceleratorState, GradientState

    root = tmp_path_factory.mktemp("sweep4")
    test = write_tsv(root / "test.tsv", make_texts(12, seed=8))  # which the search leaves out
    config, spec = sms_job(root, data={"test_file": str(test)}), sweep_file(root, pruner="none")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    code = sweep_in_process(["--config", str(config), "--sweep", str(spec)])
    return root, root / "out-sweep", code


def test_four_trials_write_every_file(four_trials, capsys):
    _, out, code = four_trials
    assert code == 0
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert [r["folder"] for r in rows] == [f"trial-000{i}" for i in range(4)]
    for row in rows:
        run = out / row["folder"]
        metrics = json.loads((run / "metrics.json").read_text())
        assert row["state"] == "complete"
        assert float(row["value"]) == pytest.approx(metrics["eval"]["accuracy"], abs=1e-12)
        assert float(row["eval_loss"]) == pytest.approx(metrics["eval"]["loss"], abs=1e-12)
        assert int(row["updates"]) == metrics["train"]["updates"]
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["optim"]["learning_rate"] == pytest.approx(float(row["optim.learning_rate"]))
        assert saved["training"]["effective_batch_size"] == int(row["training.effective_batch_size"])
        assert json.loads((run / "trial.json").read_text())["state"] == "complete"
        assert metrics["test"] is None and saved["data"]["test_file"] is None  # a search chooses: no test set
    best = max(rows, key=lambda r: (float(r["value"]), -float(r["eval_loss"])))  # of equals, the lowest loss
    from finetune.config import load_config

    cfg = load_config(out / "best.yaml")
    assert cfg.optim.learning_rate == pytest.approx(float(best["optim.learning_rate"]))
    assert cfg.training.effective_batch_size == int(best["training.effective_batch_size"])
    assert Path(cfg.output.output_dir) == out / "best"
    assert cfg.data.test_file == str(out.parent / "test.tsv")  # the config chosen, with its test set
    report = (out / "sweep.md").read_text()
    assert f"Best: trial {best['trial']} ({best['folder']})" in report and "4 of 4 trials: 4 complete" in report
    assert f"`finetune predict {out / best['folder']} 'a text'`" in report
    # the best trial's interval over its validation texts, and the trials it cannot tell from the best
    best_metrics = json.loads((out / best["folder"] / "metrics.json").read_text())
    low, high = best_metrics["eval_intervals"]["accuracy"]
    inside = [r["trial"] for r in rows if r is not best and low <= float(r["value"]) <= high]
    said = (f"Its accuracy's 95% bootstrap interval over its {best_metrics['eval']['num_samples']} validation texts "
            f"is {low:.4f} to {high:.4f}; ")
    assert said in report
    assert (f"trial{'s' if len(inside) > 1 else ''} {', '.join(inside)} of the others "
            f"{'lie' if len(inside) > 1 else 'lies'} inside it" if inside
            else "no other trial's value lies inside it") in report
    assert ("An interval of one point means that no resample moved the metric" in report) == (low == high)
    from finetune.predict import main as predict

    capsys.readouterr()
    assert predict([str(out / best["folder"]), "a text"]) == 0  # the command the report gives works as given
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["label"] in ("ham", "spam")
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    study = load_study(out)
    assert study.best_trial.number == int(best["trial"])


def test_the_same_command_again_continues_and_more_trials_extend(four_trials):
    root, out, _ = four_trials
    before = {p.name: (p / "metrics.json").stat().st_mtime_ns for p in out.glob("trial-*")}
    assert sweep_in_process(["--config", str(root / "cfg.yaml"), "--sweep", str(root / "sweep.yaml")]) == 0
    assert {p.name: (p / "metrics.json").stat().st_mtime_ns for p in out.glob("trial-*")} == before
    assert len(load_study(out).trials) == 4


# --- exactness: the search is over the math, not the memory -----------------------------------------------------


def test_the_micro_batch_does_not_change_a_trial(tmp_path, fresh_accelerate_state):
    """Same values, micro-batch 2 or 4 (k doubles): the same objective; a repeated point is not trained again."""
    from accelerate.state import AcceleratorState, GradientState

    values = []
    for micro in (2, 4):
        root = tmp_path / f"micro{micro}"
        root.mkdir()
        # no dropout: its masks are drawn per micro-batch, the one thing a micro-batch may change
        config = sms_job(root, training={"per_device_train_batch_size": micro},
                         evaluation={"metric_for_best_model": "loss"}, model={"dropout": 0.0})
        spec = sweep_file(root, space={"optim.learning_rate": [1e-2]}, trials=2, pruner="none")
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        assert sweep_in_process(["--config", str(config), "--sweep", str(spec)]) == 0
        study = load_study(root / "out-sweep")
        first, second = study.trials
        assert second.value == first.value and second.user_attrs["same_as"] == 0
        assert not (root / "out-sweep" / "trial-0001" / "metrics.json").exists()  # not trained twice
        values.append(first.value)
    # float rounding alone: micro-batches of 2 and 4 sum their products in other orders, which CPUs' kernels
    # round differently (1e-5 apart on some); another k or another number of updates moves it by far more
    assert values[0] == pytest.approx(values[1], rel=1e-4)


def test_trials_in_one_process_may_differ_in_precision(tmp_path, fresh_accelerate_state):
    """Accelerate keeps a process's first precision; the trials share the process and still get their own."""
    config = sms_job(tmp_path, epochs=1)
    spec = tmp_path / "sweep.yaml"
    # a bare `no`, as users write it: YAML reads false
    spec.write_text("space:\n  training.mixed_precision: [no, bf16]\ntrials: 2\nsampler: grid\npruner: none\n",
                    encoding="utf-8")
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec)]) == 0
    with open(tmp_path / "out-sweep" / "trials.csv", encoding="utf-8") as fh:
        rows = {row["training.mixed_precision"]: row for row in csv.DictReader(fh)}
    assert set(rows) == {"no", "bf16"} and {row["state"] for row in rows.values()} == {"complete"}
    losses = {}
    for precision, row in rows.items():
        metrics = json.loads((tmp_path / "out-sweep" / row["folder"] / "metrics.json").read_text())
        assert metrics["train"]["mixed_precision"] == precision
        losses[precision] = metrics["eval"]["loss"]
    assert losses["no"] != losses["bf16"]  # each trial computed in its own precision


def test_each_trial_compiles_as_a_run_alone_would(tmp_path, fresh_accelerate_state, monkeypatch):
    """Trials share a process, and torch.compile's caches with it: a compiled block is recompiled for each new
    dropout rate, and past dynamo's limit (8 per function) it would silently run eagerly. Each trial starts from
    cleared caches instead, so each compiles its own graphs, whatever the trials before it compiled. Dynamo's
    ``eager`` backend stands in for inductor; the backend counts the graphs each trial compiles."""
    import torch

    import finetune.sweep_trial

    compiled = []

    def counting_backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    compiling_with(monkeypatch, counting_backend)
    per_trial = []
    train = finetune.sweep_trial.TrialRunner._train

    def counting_train(self, run_args, hook):
        before = len(compiled)
        try:
            return train(self, run_args, hook)
        finally:
            per_trial.append(len(compiled) - before)

    monkeypatch.setattr(finetune.sweep_trial.TrialRunner, "_train", counting_train)
    config = sms_job(tmp_path, epochs=None, training={"torch_compile": "blocks", "max_steps": 1})
    # each trial compiles a block for training and for evaluation: six reach dynamo's limit of 8 graphs a function
    rates = [round(0.05 + 0.01 * i, 2) for i in range(6)]
    spec = sweep_file(tmp_path, space={"model.dropout": rates}, trials=len(rates), sampler="grid", pruner="none")
    torch.compiler.reset()
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec)]) == 0
    assert len(per_trial) == len(rates) and all(count > 0 for count in per_trial), per_trial
    torch.compiler.reset()


# --- pruning ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings, shares, pruned_at, why", [
    ({}, None, 48, "the median of 1 finished trials there is"),
    ({"warmup_texts": 49}, None, 96, "the median of 1 finished trials there is"),
    ({"warmup_epochs": 1}, None, 96, "the median of 1 finished trials there is"),
    # the evaluation at half an epoch, 24 texts, is the warm-up's last: judged from the next on
    ({"warmup_epochs": 0.5}, 2, 48, "the median of 1 finished trials there is"),
    ({}, 2, 24, "the median of 1 finished trials there is"),
    # the lowest quarter stopped: the loss's line is its 75th percentile (lower is better)
    ({"type": "percentile", "percentile": 75.0}, None, 48, "percentile 75 of 1 finished trials there is")])
def test_pruning_stops_a_trial_worse_than_the_median(tmp_path, fresh_accelerate_state, settings, shares, pruned_at,
                                                     why):
    root = tmp_path
    config = sms_job(root, epochs=3, evaluation={"metric_for_best_model": "loss", "evals_per_epoch": shares})
    # a learning rate that learns, then one that barely moves: the second is worse at its first evaluation
    # (48 training texts, an epoch, or 24 at two an epoch), or at the first one past the pruner's warm-up
    pruner = {"type": "median", "startup_trials": 1, **settings}
    spec = sweep_file(root, space={"optim.learning_rate": [1e-2, 1e-7]}, trials=2,
                      sampler={"type": "grid", "seed": 1}, pruner=pruner)
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec)]) == 0
    study = load_study(root / "out-sweep")
    by_lr = {t.params["optim.learning_rate"]: t for t in study.trials}
    good, bad = by_lr[1e-2], by_lr[1e-7]
    assert good.number == 0, "the grid's seed must put the learning rate that learns first"
    assert good.state.name == "COMPLETE" and bad.state.name == "PRUNED"
    step = max(bad.intermediate_values)
    assert step == pruned_at
    assert bad.intermediate_values[step] > good.intermediate_values[step]  # worse than the median of one
    bad_dir = root / "out-sweep" / bad.user_attrs["folder"]
    assert not (bad_dir / "metrics.json").exists()
    assert max(steps_logged(bad_dir)) < max(steps_logged(root / "out-sweep" / good.user_attrs["folder"]))
    record = json.loads((bad_dir / "trial.json").read_text())
    assert record["state"] == "pruned"
    assert record["why"] == f"pruned after {step} training texts: loss {bad.intermediate_values[step]:.4f}, {why} " \
                            f"{good.intermediate_values[step]:.4f}"
    row = next(r for r in csv.DictReader((root / "out-sweep" / "trials.csv").open()) if r["state"] == "pruned")
    assert row["note"] == record["why"] and row["value"] == ""


def test_a_trial_behind_the_median_at_its_last_evaluation_finishes(tmp_path, fresh_accelerate_state):
    # the pruner's warm-up ends past the second of three evaluations: the learning rate that barely moves is behind
    # the median at the third, where it has trained to its end; it is kept as a finished trial with its score
    config = sms_job(tmp_path, epochs=3, evaluation={"metric_for_best_model": "loss"})
    spec = sweep_file(tmp_path, space={"optim.learning_rate": [1e-2, 1e-7]}, trials=2,
                      sampler={"type": "grid", "seed": 1},
                      pruner={"type": "median", "startup_trials": 1, "warmup_texts": 97})
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec)]) == 0
    study = load_study(tmp_path / "out-sweep")
    by_lr = {t.params["optim.learning_rate"]: t for t in study.trials}
    good, bad = by_lr[1e-2], by_lr[1e-7]
    assert good.number == 0 and sorted(bad.intermediate_values) == [48, 96, 144]
    assert bad.intermediate_values[144] > good.intermediate_values[144]  # behind the median of one there
    assert bad.state.name == "COMPLETE"
    saved = json.loads((tmp_path / "out-sweep" / bad.user_attrs["folder"] / "metrics.json").read_text())
    assert bad.value == saved["eval"]["loss"] and saved["train"]["ended"] == "completed"


def test_a_pruned_trials_note_names_the_line_its_pruner_drew():
    """Where higher is better, Optuna's percentile pruner keeping the best 75 percent draws its line at the others'
    25th percentile; the median pruner at their median; hyperband's brackets are not said."""
    import optuna

    from finetune.sweep_trial import pruned_why

    study = optuna.create_study(direction="maximize")
    for value in (0.2, 0.4, 0.6, 0.8, 1.0):
        finished = study.ask()
        finished.report(value, 10)
        study.tell(finished, value)
    trial = study.ask()
    trial.report(0.3, 10)
    said = "pruned after 10 training texts: f1 0.3000"
    assert pruned_why(trial, "f1", {"type": "percentile", "percentile": 75.0}) == \
        f"{said}, percentile 25 of 5 finished trials there is 0.4000"
    assert pruned_why(trial, "f1", {"type": "median"}) == f"{said}, the median of 5 finished trials there is 0.6000"
    assert pruned_why(trial, "f1", {"type": "hyperband"}) == said


def test_the_benchmarks_replay_asks_the_pruner_where_a_sweep_asks_it(monkeypatch):
    """bench/sweep.py replays pruners on an unpruned sweep's evaluations: a trial's stop, the texts it trained to
    there, the warm-up's share and the last evaluation never judged, as ``finetune sweep`` has them."""
    monkeypatch.syspath_prepend(str(REPO))  # bench/ is not part of the installed package
    from bench.sweep import Curve, replay

    def curve(number, *values):  # four quarters of an epoch of 400 texts at B=100
        return Curve(number, list(values), [100, 200, 300, 400], [100, 200, 300, 400], values[-1], 400)

    trials = [curve(0, 0.9, 0.9, 0.9, 0.9), curve(1, 0.9, 0.9, 0.9, 0.9),
              curve(2, 0.0, 0.5, 0.95, 0.99),  # behind at the first two quarters
              curve(3, 0.0, 0.95, 0.96, 0.97),  # behind at the first quarter only
              curve(4, 0.95, 0.95, 0.95, 0.1)]  # behind at its last evaluation alone
    median = {"type": "median", "startup_trials": 2}
    assert replay(trials, median) == {"trained": 400 + 400 + 100 + 100 + 400, "stops": ["2@1", "3@1"], "best": 0.9}
    assert replay(trials, {**median, "warmup_epochs": 0.25}) == {"trained": 400 + 400 + 200 + 400 + 400,
                                                                 "stops": ["2@2"], "best": 0.97}
    assert replay(trials, {"type": "none"})["stops"] == []


def test_evals_per_epoch_reports_every_batch_at_the_same_texts_seen(tmp_path, fresh_accelerate_state):
    # 48 training rows in micro-batches of 4: 12 per epoch, in 5 shares ending after micro-batches 2.4, 4.8, 7.2,
    # 9.6 and 12. B=8 (k=2) completes one share per update from update 2 on; B=16 (k=4) completes shares 1, 3
    # (2 and 3 in one update: one evaluation) and 5
    config = sms_job(tmp_path, epochs=1)
    spec = sweep_file(tmp_path, space={"training.effective_batch_size": [8, 16]}, trials=2,
                      sampler={"type": "grid", "seed": 0}, pruner={"type": "median", "startup_trials": 10},
                      fixed={"evaluation.evals_per_epoch": 5})  # the sweep file's settings for every trial
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec)]) == 0
    study = load_study(tmp_path / "out-sweep")
    by_batch = {t.params["training.effective_batch_size"]: t for t in study.trials}
    assert {b: t.state.name for b, t in by_batch.items()} == {8: "COMPLETE", 16: "COMPLETE"}
    at_share = [round(48 * i / 5) for i in range(1, 6)]  # the texts seen where share i ends
    assert sorted(by_batch[8].intermediate_values) == at_share
    assert sorted(by_batch[16].intermediate_values) == [at_share[0], at_share[2], at_share[4]]
    for batch, steps in ((8, [2, 3, 4, 5, 6]), (16, [1, 2, 3])):
        folder = tmp_path / "out-sweep" / by_batch[batch].user_attrs["folder"]
        records = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
        evals = [r for r in records if "eval/accuracy" in r]
        assert [r["step"] for r in evals] == steps
        assert "evaluation.evals_per_epoch=5" in json.loads((folder / "trial.json").read_text())["runs"][0]["command"]
        # what each evaluation reported is what it measured
        assert [by_batch[batch].intermediate_values[t] for t in sorted(by_batch[batch].intermediate_values)] == \
            [r["eval/accuracy"] for r in evals]


def test_a_run_cut_inside_a_share_reports_its_last_evaluation_where_it_happened(tmp_path, fresh_accelerate_state):
    # B=8 (k=2) over 48 rows in micro-batches of 4: 6 updates an epoch, a share of 5 ending at each update from
    # 2 on. training.max_steps=7 ends the run 2 micro-batches into epoch 1, inside its first share: the last
    # evaluation is reported at the 56 texts seen, not again at the 48 of epoch 0's end (a step kept once)
    config = sms_job(tmp_path, epochs=2)
    spec = sweep_file(tmp_path, space={"training.effective_batch_size": [8]}, trials=1,
                      sampler={"type": "grid", "seed": 0}, pruner={"type": "median", "startup_trials": 10},
                      fixed={"evaluation.evals_per_epoch": 5, "training.max_steps": 7})
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec)]) == 0
    (trial,) = load_study(tmp_path / "out-sweep").trials
    at_share = [round(48 * i / 5) for i in range(1, 6)]
    assert sorted(trial.intermediate_values) == at_share + [56]
    folder = tmp_path / "out-sweep" / trial.user_attrs["folder"]
    records = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [2, 3, 4, 5, 6, 7]
    assert [trial.intermediate_values[t] for t in sorted(trial.intermediate_values)] == \
        [r["eval/accuracy"] for r in evals]


# --- seeds ------------------------------------------------------------------------------------------------------


def test_seeds_report_mean_and_deviation_of_their_scores(tmp_path, fresh_accelerate_state):
    config = sms_job(tmp_path)
    assert sweep_in_process(["--config", str(config), "--seeds", "3", "optim.learning_rate=1e-2"]) == 0
    out = tmp_path / "out-sweep"
    scores = {s: json.loads((out / "seeds" / f"seed-{s}" / "metrics.json").read_text())["eval"]["accuracy"]
              for s in (1, 2, 3)}
    report = (out / "sweep.md").read_text()
    mean, std = statistics.fmean(scores.values()), statistics.stdev(scores.values())
    assert f"accuracy: mean {mean:.4f}, standard deviation {std:.4f}" in report
    for seed, value in scores.items():
        assert f"| {seed} | {value:.4f} |" in report
        saved = yaml.safe_load((out / "seeds" / f"seed-{seed}" / "config.yaml").read_text())
        assert saved["training"]["seed"] == seed and saved["optim"]["learning_rate"] == 1e-2
        assert saved["logging"]["run_group"] == str(out)  # W&B and MLflow show the sweep's runs as one group


def test_folds_validate_on_every_row_once_and_report_mean_and_deviation(tmp_path, fresh_accelerate_state, capsys):
    config = sms_job(tmp_path, epochs=1)
    chosen = ["optim.learning_rate=1e-2", "evaluation.greater_is_better=true"]
    assert sweep_in_process(["--config", str(config), "--folds", "3", *chosen]) == 0
    out = tmp_path / "out-sweep"
    runs = {fold: out / "folds" / f"fold-{fold}" for fold in (1, 2, 3)}
    evals = {fold: json.loads((run / "metrics.json").read_text())["eval"] for fold, run in runs.items()}
    assert sum(e["num_samples"] for e in evals.values()) == 60  # the 60 rows, each validated once
    report = (out / "sweep.md").read_text()
    scores = [e["accuracy"] for e in evals.values()]
    mean, std = statistics.fmean(scores), statistics.stdev(scores)
    assert "## Over 3 folds" in report and f"accuracy: mean {mean:.4f}, standard deviation {std:.4f}" in report
    assert "- space: none" in report and "sampler" not in report  # nothing drawn, nothing pruned
    # the model to keep: the same config on every row, without the selection no validation text can make
    command = (f"finetune train --config {config} {' '.join(chosen)} data.validation_split=0 "
               f"evaluation.metric_for_best_model=null evaluation.greater_is_better=null "
               f"output.output_dir={out / 'all-rows'}")
    assert f"trains on every row: `{command}`" in report
    kept = accepted_without_validation(config, command.split()[4:])
    assert (kept.data.validation_split, kept.data.validation_folds, kept.optim.learning_rate) == (0.0, None, 1e-2)
    assert kept.output.output_dir == str(out / "all-rows")
    for fold, run in runs.items():
        assert f"| {fold} | {evals[fold]['accuracy']:.4f} |" in report
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert (saved["data"]["validation_folds"], saved["data"]["validation_fold"]) == (3, fold)
        assert saved["training"]["seed"] == 1 and saved["optim"]["learning_rate"] == 1e-2
    # out of fold: each of the 60 rows predicted once, by its fold's model, as that run scored it
    with open(out / "folds" / "predictions.csv", encoding="utf-8", newline="") as fh:
        predicted = list(csv.DictReader(fh))
    assert list(predicted[0]) == ["fold", "text", "label", "predicted_label", "predicted_score",
                                  "predicted_prob_ham", "predicted_prob_spam"]
    rows = [line.split("\t") for line in (tmp_path / "sms.tsv").read_text().splitlines()]
    assert sorted((r["label"], r["text"]) for r in predicted) == sorted((label, text) for label, text in rows)
    for fold, scored in evals.items():
        mine = [r for r in predicted if r["fold"] == str(fold)]
        assert len(mine) == scored["num_samples"]
        right = sum(r["label"] == r["predicted_label"] for r in mine)
        assert right / len(mine) == pytest.approx(scored["accuracy"])
    assert "out-of-fold" in (out / "sweep.md").read_text()
    # the folds' models together: the command the report gives, the mean of what each says
    assert f"`finetune predict {out / 'folds'} --file texts.csv`" in report
    assert f"`finetune score {out / 'folds'} --file test.csv --against {out / 'all-rows'}`" in report
    from finetune.ensemble import load_predictor
    from finetune.predictor import Predictor

    texts = [r["text"] for r in predicted[:8]]
    alone = [Predictor.load(run).probabilities(texts) for run in runs.values()]
    together = load_predictor(out / "folds").probabilities(texts)
    assert (abs(together - sum(alone) / len(alone)) <= 1e-6).all()
    # seeds runs in the folds' folder would write their report over the folds': refused, the folder as it was
    before = (out / "sweep.md").read_bytes()
    capsys.readouterr()
    assert sweep_in_process(["--config", str(config), "--seeds", "2", "optim.learning_rate=1e-2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the study holds folds runs, and this sweep runs seeds" in err[0], err
    assert (out / "sweep.md").read_bytes() == before and not (out / "seeds").exists()


def test_a_test_file_the_seeds_could_not_read_stops_the_sweep_before_its_first_trial(tmp_path, capsys, caplog,
                                                                                      fresh_accelerate_state):
    """The search leaves the test set out: it is read at the sweep's start, against the training labels, where the
    seeds runs will score it after the search; a search alone is told that nothing will."""
    bad = write_tsv(tmp_path / "bad.tsv", [("spam", "win cash"), ("eggs", "no such label")])
    config, spec = sms_job(tmp_path), sweep_file(tmp_path, trials=2)
    args = ["--config", str(config), "--sweep", str(spec), "--test", str(bad)]
    assert sweep_in_process([*args, "--seeds", "2"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: {bad}: label 'eggs' at line 2 not among the 2 "
                                                        f"labels of the train data (ham, spam)")
    assert not (tmp_path / "out-sweep").exists()
    from finetune.sweep import build_sweep, parse_args
    from finetune.sweep_checks import check_test_set

    search_alone = build_sweep(parse_args(args), args)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        check_test_set(search_alone)
    assert caplog.messages == [f"the test set {bad} is scored by no run of this sweep: its search leaves it out, and seeds or "
                    f"folds runs (--seeds, --folds) of the config it chooses would score it; best.yaml keeps it"]


def test_folds_after_a_search_run_its_best_config(four_trials, tmp_path, fresh_accelerate_state):
    """The search's command again with --folds (in a copy of its folder): no trial runs again, and each fold's
    run trains the best trial's values."""
    root, out, _ = four_trials
    copy = Path(shutil.copytree(out, tmp_path / "out-sweep"))
    args = ["--config", str(root / "cfg.yaml"), "--sweep", str(root / "sweep.yaml"), "--output", str(copy)]
    assert sweep_in_process([*args, "--folds", "2"]) == 0
    assert len(load_study(copy).trials) == 4 and len(list(copy.glob("trial-*"))) == 4
    best = yaml.safe_load((copy / "best.yaml").read_text())
    for fold in (1, 2):
        saved = yaml.safe_load((copy / "folds" / f"fold-{fold}" / "config.yaml").read_text())
        assert saved["optim"]["learning_rate"] == best["optim"]["learning_rate"]
        assert saved["training"]["effective_batch_size"] == best["training"]["effective_batch_size"]
        assert (saved["data"]["validation_folds"], saved["data"]["validation_fold"]) == (2, fold)
    report = (copy / "sweep.md").read_text()
    assert "4 of 4 trials: 4 complete" in report and "## Over 2 folds" in report
    # the test set, which the search left out, scored by each fold's model
    folds = [json.loads((copy / "folds" / f"fold-{fold}" / "metrics.json").read_text()) for fold in (1, 2)]
    tests = [fold["test"]["metrics"]["accuracy"] for fold in folds]
    assert all(fold["test"]["file"] == "test.tsv" and fold["test"]["metrics"]["num_samples"] == 12 for fold in folds)
    mean, std = statistics.fmean(tests), statistics.stdev(tests)
    assert (f"accuracy on the test set test.tsv, scored once by each run's saved model after training (nothing was "
            f"chosen on it): mean {mean:.4f}, standard deviation {std:.4f}") in report
    for fold, (run, test) in enumerate(zip(folds, tests), start=1):
        assert f"| {fold} | {run['eval']['accuracy']:.4f} | {test:.4f} |" in report
    command = f"finetune train --config {copy / 'best.yaml'} data.validation_split=0 evaluation.metric_for_best_model=null"
    assert f"trains on every row: `{command}`" in report
    kept = accepted_without_validation(copy / "best.yaml", command.split()[4:])
    assert (kept.optim.learning_rate, kept.output.output_dir) == (best["optim"]["learning_rate"], str(copy / "best"))
    # the folds together against that model, on the sweep's own test file
    assert f"`finetune score {copy / 'folds'} --file {root / 'test.tsv'} --against {copy / 'best'}`" in report


def test_seeds_after_a_search_run_its_best_config_on_seeds_it_was_not_chosen_on(four_trials, tmp_path,
                                                                                fresh_accelerate_state):
    """The search's trials trained with seed 1, and the best was chosen for its score there: the seeds runs of its
    config are seeds 2 and 3, whose mean is not the choice's luck counted again."""
    root, out, _ = four_trials
    copy = Path(shutil.copytree(out, tmp_path / "out-sweep"))
    args = ["--config", str(root / "cfg.yaml"), "--sweep", str(root / "sweep.yaml"), "--output", str(copy)]
    assert sweep_in_process([*args, "--seeds", "2"]) == 0
    assert sorted(p.name for p in (copy / "seeds").iterdir()) == ["seed-2", "seed-3"]
    best = yaml.safe_load((copy / "best.yaml").read_text())
    scores = []
    for seed in (2, 3):
        run = copy / "seeds" / f"seed-{seed}"
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["training"]["seed"] == seed and best["training"]["seed"] == 1
        assert saved["optim"]["learning_rate"] == best["optim"]["learning_rate"]
        scores.append(json.loads((run / "metrics.json").read_text())["eval"]["accuracy"])
    report = (copy / "sweep.md").read_text()
    assert f"accuracy: mean {statistics.fmean(scores):.4f}, standard deviation {statistics.stdev(scores):.4f}" in report
    assert "Seeds 2 to 3, none that the search trained with" in report
    assert f"| seed | accuracy | test accuracy |\n| ---: | ---: | ---: |\n| 2 | {scores[0]:.4f} | " in report
    assert f" |\n| 3 | {scores[1]:.4f} | " in report
    # the seeds' models together: the commands the report gives, the mean of what each says
    assert (f"`finetune predict {copy / 'seeds'} --file texts.csv`; `finetune score {copy / 'seeds'} --file "
            f"{root / 'test.tsv'}` scores their mean beside each model alone") in report  # the sweep's test file
    from finetune.ensemble import load_predictor
    from finetune.predictor import Predictor

    texts = [line.split("\t")[1] for line in (root / "test.tsv").read_text().splitlines()]
    alone = [Predictor.load(copy / "seeds" / f"seed-{seed}").probabilities(texts) for seed in (2, 3)]
    assert abs(alone[0] - alone[1]).max() > 1e-4  # two seeds' models that differ, so their mean says something
    assert (abs(load_predictor(copy / "seeds").probabilities(texts) - (alone[0] + alone[1]) / 2) <= 1e-6).all()


def test_the_search_and_its_seeds_runs_share_no_seed():
    from types import SimpleNamespace

    from finetune.sweep_file import repeats_of, search_seeds

    searched = SimpleNamespace(space=SimpleNamespace(dimensions=("optim.learning_rate",)), trial_seeds=3, seeds=4,
                               folds=0)
    assert search_seeds(searched, 42) == (42, 43, 44) and repeats_of(searched, 42).values == (45, 46, 47, 48)
    alone = SimpleNamespace(space=SimpleNamespace(dimensions=()), trial_seeds=1, seeds=2, folds=0)
    assert repeats_of(alone, 42).values == (42, 43)  # nothing was chosen: the config's own seed first


def accepted_without_validation(config: Path, overrides: list[str]):
    """The config of a run on every row, which the check that runs once its data has loaded accepts."""
    from finetune.assembly import check_validation_is_there
    from finetune.config import load_config

    kept = load_config(str(config), overrides)
    check_validation_is_there(kept, {"train": None})
    return kept


@pytest.mark.parametrize("problem_type", ["multi_label", "per_label", "regression"])
def test_out_of_fold_rows_name_each_label_as_the_file_does(tmp_path, problem_type):
    """The held-out rows the out-of-fold file gives each fold: every row once over the folds, with its label as
    written (names joined as the predicted ones are, a 0/1 column each, a number), whatever the encoding the run
    trained on."""
    from finetune.config import config_from_dict
    from finetune.out_of_fold import held_out_rows

    label_column: str | list[str] = "label"
    if problem_type in ("multi_label", "per_label"):
        written = [(f"text {i}", ["sport", "news"][: 1 + i % 2]) for i in range(12)]
        lines = [json.dumps({"text": text, "label": label}) for text, label in written]
        if problem_type == "per_label":  # the columns in another order than the names sort
            label_column = ["sport", "news"]
            lines = [json.dumps({"text": text, "sport": int("sport" in label), "news": int("news" in label)})
                     for text, label in written]
    else:
        written = [(f"text {i}", i / 4) for i in range(12)]
        lines = [json.dumps({"text": text, "label": value}) for text, value in written]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    seen = []
    for fold in (1, 2, 3):
        kind = "multi_label" if problem_type == "per_label" else problem_type
        cfg = config_from_dict({"data": {"train_file": str(tmp_path / "d.jsonl"), "validation_folds": 3,
                                         "validation_fold": fold, "label_column": label_column},
                                "model": {"problem_type": kind}})
        rows = held_out_rows(cfg, fold)
        assert len(rows) == 4 and {r["fold"] for r in rows} == {fold}
        if problem_type == "per_label":
            assert [list(r) for r in rows] == [["fold", "text", "sport", "news"]] * 4
            seen += [(r["text"], [name for name in ("news", "sport") if r[name]]) for r in rows]
        elif problem_type == "multi_label":  # as predicted_labels beside it: joined by ","
            seen += [(r["text"], r["label"].split(",")) for r in rows]
        else:
            seen += [(r["text"], r["label"]) for r in rows]
    if problem_type != "regression":  # the names as the file lists them (label order: sorted)
        assert sorted(seen) == sorted((text, sorted(label)) for text, label in written)
    else:
        assert sorted(seen) == sorted(written)


# --- bad input: one line, exit 2, before any trial ----------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_input_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    sms_job(root)
    return root


@pytest.mark.parametrize("settings, args, message", [
    ({"space": {"optim.learnig_rate": [1e-3]}}, [], "space: optim.learnig_rate: no such config key (did you mean "),
    ({"space": {"optim.learning_rate": {"low": 1e-2, "high": 1e-3}}}, [], "low must be below high"),
    ({"space": {"optim.learning_rate": {"low": 0.0, "high": 1e-3, "log": True}}}, [], "a log range needs low > 0"),
    ({"space": {"optim.learning_rate": {"low": 1e-3}}}, [], "missing high"),
    ({"space": {"training.max_steps": {"low": 1, "high": 2.5}}}, [], "is an integer key"),
    ({"space": {"training.per_device_train_batch_size": [4, 8]}}, [], "the micro-batch is memory, not math"),
    ({"space": {"training.effective_batch_size": [6]}}, [], "space: training.effective_batch_size: 6 is refused"),
    # each value is accepted alone; the pair would stop the sweep at the first trial that drew it
    # (the config's rank, from the command line, accepts every alpha)
    ({"space": {"model.lora_rank": [None, 8], "model.lora_alpha": [16.0, 32.0]}}, ["model.lora_rank=4"],
     "space: model.lora_alpha: 32.0 with model.lora_rank: null is refused: model.lora_alpha: applies to LoRA adapters"),
    ({"space": {"optim.learning_rate": []}}, [], "no choices"),
    ({"trails": 3}, [], "unknown key 'trails' (did you mean trials?)"),
    ({"sampler": "bayes"}, [], "sampler: 'bayes' is not one of tpe, random, grid"),
    ({"pruner": {"type": "median", "startup": 2}}, [], "pruner: unknown startup"),
    ({"trials": 0}, [], "trials: must be >= 1"),
    ({"pruner": {"type": "median", "warmup_texts": -5}}, [], "pruner: warmup_texts: must be an integer >= 0"),
    ({"pruner": {"type": "median", "warmup_epochs": "a quarter"}}, [],
     "pruner: warmup_epochs: must be a number of epochs >= 0 (0.25: a quarter), got 'a quarter'"),
    ({"pruner": {"type": "median", "percentile": 75}}, [],
     "pruner: percentile: a median pruner does not take it; percentile does"),
    ({"pruner": {"type": "hyperband", "startup_trials": 4}}, [],
     "pruner: startup_trials: a hyperband pruner does not take it; median and percentile do"),
    ({"pruner": {"type": "none", "warmup_epochs": 0.25}}, [],
     "pruner: warmup_epochs: type none prunes nothing and takes no settings"),
    ({}, ["--pruner", "early"], "--pruner: 'early' is not one of median, percentile, hyperband, none"),
    ({"sampler": {"type": "tpe", "sed": 0}}, [], "sampler: unknown sed; a sampler has type and seed"),
    ({"sampler": {"seed": -1}}, [], "sampler: seed: must be an integer >= 0, got -1"),
    ({}, ["--sampler", "bayes"], "--sampler: 'bayes' is not one of tpe, random, grid"),
    ({}, ["--sampler-seed", "-3"], "--sampler-seed: must be an integer >= 0, got -3"),
    ({"sampler": "grid", "space": SPACE}, [], "grid needs a list of choices"),
    ({}, ["--seeds", "-1"], "seeds: must be an integer >= 0"),
    ({}, ["--folds", "1"], "folds: must be >= 2 (or 0: none), got 1"),
    ({"seeds": 2}, ["--folds", "3"], "seeds and folds: give one; seeds keep the validation rows"),
    ({"fixed": {"evaluation.evals_per_epch": 4}}, [], "fixed: evaluation.evals_per_epch: unknown key"),
    ({"fixed": {"evaluation.evals_per_epoch": 0}}, [], "fixed: evaluation.evals_per_epoch: must be >= 1"),
    ({"fixed": {"optim.learning_rate": 1e-3}}, [], "fixed: optim.learning_rate: is also in the space"),
    ({"fixed": ["evaluation.evals_per_epoch=4"]}, [], "fixed: expected a mapping of section.key to a value"),
    ({}, ["--storage", "mysqlx://nowhere/db"], "--storage mysqlx://nowhere/db: "),
    # a dry run checks the storage too, without writing to it: the URL, the driver, a server that answers
    ({}, ["--storage", "mysqlx://nowhere/db", "--dry-run"], "--storage mysqlx://nowhere/db: "),
    ({}, ["--storage", "postgresql+psycopg://sweep:secret@127.0.0.1:1/db", "--dry-run"],
     "--storage postgresql+psycopg://sweep:***@127.0.0.1:1/db: "),
    # a study in memory ran, and was gone with the process: nothing to continue or share
    ({}, ["--storage", "sqlite:///"], "--storage sqlite:///: a database in memory, which no other worker shares"),
    ({}, ["--storage", "sqlite:///:memory:", "--dry-run"], "--storage sqlite:///:memory:: a database in memory"),
])
def test_bad_input_is_one_line_before_any_trial(bad_input_job, capsys, settings, args, message):
    tmp_path, config = bad_input_job, bad_input_job / "cfg.yaml"
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump({"space": {"optim.learning_rate": [1e-3]}, **settings}), encoding="utf-8")
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not list((tmp_path / "out-sweep").glob("trial-*"))


def test_a_missing_sweep_file_is_named_as_one_with_the_shipped_one_as_a_hint(bad_input_job, capsys):
    from finetune.sweep_file import shipped_sweep

    missing = bad_input_job / "sweeps" / "mine.yaml"
    assert sweep_in_process(["--config", str(bad_input_job / "cfg.yaml"), "--sweep", str(missing)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: sweep file not found: {missing}",
        f"hint: --sweep {shipped_sweep()} searches the default job's learning rate and effective batch"]


@pytest.mark.parametrize("file, flags, sampler, pruner", [
    # the file as it stands; a pruner named by its settings alone is the default, median
    ({"sampler": {"type": "tpe", "seed": 3}, "pruner": {"warmup_epochs": 0.25}}, [],
     ("tpe", 3), {"type": "median", "warmup_epochs": 0.25}),
    # a flag changes its one setting: the sampler's type keeps the file's seed, and the pruner's type the file's
    # settings it takes (a median pruner has no percentile, a hyperband one no startup trials)
    ({"sampler": {"type": "tpe", "seed": 3},
      "pruner": {"type": "percentile", "percentile": 75, "startup_trials": 4, "warmup_epochs": 0.25}},
     ["--sampler", "random", "--pruner", "median"], ("random", 3),
     {"type": "median", "startup_trials": 4, "warmup_epochs": 0.25}),
    ({"sampler": {"type": "tpe", "seed": 3}, "pruner": {"type": "median", "startup_trials": 4, "warmup_epochs": 1}},
     ["--sampler-seed", "5", "--pruner", "hyperband"], ("tpe", 5), {"type": "hyperband", "warmup_epochs": 1}),
    ({"sampler": "grid", "pruner": {"type": "median", "warmup_epochs": 1}}, ["--pruner", "none"], ("grid", None),
     {"type": "none"}),
    # a file with no pruner: the default median's warm-up, which a percentile pruner takes too
    ({}, ["--pruner", "percentile", "--sampler-seed", "0"], ("tpe", 0), {"type": "percentile", "warmup_epochs": 0.25}),
])
def test_a_flag_changes_its_one_setting_and_keeps_the_files_others(bad_input_job, file, flags, sampler, pruner):
    from finetune.sweep import build_sweep, parse_args

    spec = bad_input_job / "flags.yaml"
    spec.write_text(yaml.safe_dump({"space": {"optim.learning_rate": [1e-3]}, **file}), encoding="utf-8")
    argv = ["--config", str(bad_input_job / "cfg.yaml"), "--sweep", str(spec), *flags]
    sweep = build_sweep(parse_args(argv), argv)
    assert ((sweep.sampler, sweep.sampler_seed), sweep.pruner) == (sampler, pruner)


def test_a_study_of_an_older_optuna_schema_is_one_line_saying_how_to_upgrade_it(bad_input_job, capsys):
    """A sweep begun before Optuna was upgraded: its tables' schema is older than the new Optuna reads."""
    import sqlite3

    import optuna

    tmp_path, config = bad_input_job, bad_input_job / "cfg.yaml"
    db = tmp_path / "old-schema-sweep" / "study.db"
    db.parent.mkdir()
    optuna.create_study(storage=f"sqlite:///{db}", study_name="old-schema-sweep")
    with sqlite3.connect(db) as connection:  # an earlier revision of Optuna's tables, as a sweep of then left them
        connection.execute("UPDATE alembic_version SET version_num = 'v3.0.0.a'")
    before = db.read_bytes()
    spec = sweep_file(tmp_path, name="old.yaml", space={"optim.learning_rate": [1e-3]}, trials=1)
    capsys.readouterr()  # Optuna's line on the study made above
    for dry_run in ([], ["--dry-run"]):
        assert sweep_in_process(["--config", str(config), "--sweep", str(spec), "--output", str(db.parent),
                                 *dry_run]) == 2
        error, hint = capsys.readouterr().err.strip().splitlines()
        assert error == (f"error: --storage sqlite:///{db}: the study's tables have an older schema than this "
                         f"Optuna's ({optuna.__version__})")
        assert hint == f"hint: optuna storage upgrade --storage sqlite:///{db} brings them up to date"
    assert db.read_bytes() == before and not list(db.parent.glob("trial-*"))


def test_folds_beside_a_validation_file_say_how_to_drop_it(bad_input_job, capsys):
    config = str(bad_input_job / "cfg.yaml")
    assert sweep_in_process(["--config", config, "--folds", "3", "data.validation_file=held_out.tsv"]) == 2
    error, hint = capsys.readouterr().err.strip().splitlines()
    assert error == ("error: --folds 3: data.validation_folds: folds are cut from the training data, and "
                     "data.validation_file (held_out.tsv) is a validation set of its own: set one of them")
    assert hint == "hint: data.validation_file=null on the command line cuts the folds from the training data alone"
    assert not (bad_input_job / "out-sweep" / "folds").exists()


@pytest.mark.parametrize("variable, value, message", [
    ("WORLD_SIZE", "2", "finetune sweep runs each trial in one process: start one worker per GPU"),
    ("PMI_SIZE", "4", "finetune sweep runs each trial in one process: start one worker per GPU"),  # an MPI launch
    ("WORLD_SIZE", "two", "WORLD_SIZE: expected a whole number of processes, got 'two'"),
])
def test_a_launched_sweep_is_refused_in_one_line(bad_input_job, capsys, monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("RANK", "0")  # the main process: it says why
    spec = bad_input_job / "launched.yaml"
    spec.write_text(yaml.safe_dump({"space": {"optim.learning_rate": [1e-3]}}), encoding="utf-8")
    assert sweep_in_process(["--config", str(bad_input_job / "cfg.yaml"), "--sweep", str(spec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not list((bad_input_job / "out-sweep").glob("trial-*"))


def test_a_bad_sweep_file_is_said_before_torch_is_imported(bad_input_job):
    """A mistyped key in the space is answered at once: torch and transformers (seconds) wait for the checks."""
    spec = bad_input_job / "typo.yaml"
    spec.write_text(yaml.safe_dump({"space": {"optim.learnig_rate": [1e-3]}}), encoding="utf-8")
    from helpers import call_in_a_fresh_python

    code, imported, stderr = call_in_a_fresh_python("finetune.sweep.main",
                                                    ["--config", str(bad_input_job / "cfg.yaml"), "--sweep", str(spec)])
    assert (code, imported) == ("2", []), stderr[-2000:]
    assert "space: optim.learnig_rate: no such config key" in stderr


def test_a_folder_made_with_another_space_is_refused(four_trials, capsys):
    root, out, _ = four_trials
    other = sweep_file(root, "other.yaml", space={"optim.learning_rate": [1e-3, 2e-3]})
    assert sweep_in_process(["--config", str(root / "cfg.yaml"), "--sweep", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the study was made with another space" in err[0], err
    assert len(load_study(out).trials) == 4


def test_a_sweep_without_a_space_leaves_a_searchs_folder_as_it_was(four_trials, capsys):
    """Seeds alone (no space) in a search's folder would write its own sweep.md over the search's: refused
    before any run, the folder untouched."""
    root, out, _ = four_trials
    before = {p: p.read_bytes() for p in out.glob("*") if p.is_file()}
    assert sweep_in_process(["--config", str(root / "cfg.yaml"), "--seeds", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the study holds a search, and this sweep has no space" in err[0], err
    assert {p: p.read_bytes() for p in out.glob("*") if p.is_file()} == before
    assert not (out / "seeds").exists()


def _said(caplog, start: str) -> str:
    """The last line logged that starts so."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)][-1]


def _everything(folder: Path) -> dict[Path, tuple[int, bytes]]:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


def test_a_dry_run_of_a_sweep_under_way_says_the_runs_done_and_left_and_writes_nothing(four_trials, caplog, capsys):
    """The 4 trials done: 2 more and 2 seeds leave 4 runs of 8; the study and the folder are only read."""
    root, out, _ = four_trials
    before = _everything(out)
    args = ["--config", str(root / "cfg.yaml"), "--sweep", str(root / "sweep.yaml"), "--dry-run"]
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert sweep_in_process([*args, "--trials", "6", "--seeds", "2"]) == 0
    assert "; 6 trials (4 done), sampler random" in _said(caplog, "sweep in ")
    line = _said(caplog, "sweep dry run: ")
    match = re.search(r"the search's 6 trials, then the best config over 2 seeds: 8 runs, 4 done, the 4 left about "
                      r"([\d.]+) s(?: to ([\d.]+) s)?; nothing was written", line)  # no pruner: nothing less
    assert match, line
    least = min(float(x) for x in re.findall(r"([\d.]+) s at training.effective_batch_size=\d", line))
    assert float(match[1]) == pytest.approx(4 * least, abs=4 * _rounding(least) + _rounding(float(match[1])))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert sweep_in_process(args) == 0
    assert _said(caplog, "sweep dry run: ") == (f"sweep dry run: the search's 4 trials: 4 runs, all done; the same "
                                                f"command without --dry-run writes its reports again; nothing was "
                                                f"written to {out}")
    assert not [r for r in caplog.records if r.getMessage().startswith("dry run: ")]  # no run tried: none is left
    # another space is refused as the start refuses it, before any run is tried
    other = sweep_file(root, "other-dry.yaml", space={"optim.learning_rate": [1e-3, 2e-3]})
    capsys.readouterr()
    assert sweep_in_process(["--config", str(root / "cfg.yaml"), "--sweep", str(other), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the study was made with another space" in err[0], err
    assert _everything(out) == before


def test_a_search_is_refused_in_the_folder_of_seeds_runs_made_without_it(tmp_path, fresh_accelerate_state, capsys,
                                                                         caplog):
    config = sms_job(tmp_path, epochs=1)
    assert sweep_in_process(["--config", str(config), "--seeds", "1"]) == 0
    report = (tmp_path / "out-sweep" / "sweep.md").read_bytes()
    # a dry run of more seeds counts the one done
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert sweep_in_process(["--config", str(config), "--seeds", "3", "--dry-run"]) == 0
    assert "; the config over 3 seeds: 3 runs, 1 done, the 2 left about " in _said(caplog, "sweep dry run: ")
    spec = sweep_file(tmp_path, space={"optim.learning_rate": [1e-3]}, trials=1, pruner="none")
    capsys.readouterr()
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec), "--seeds", "1", "--dry-run"]) == 2
    assert "the study was made with another space" in capsys.readouterr().err
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec), "--seeds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the study was made with another space" in err[0], err
    assert not list((tmp_path / "out-sweep").glob("trial-*"))  # refused before its first trial
    assert (tmp_path / "out-sweep" / "sweep.md").read_bytes() == report


# --- in separate processes: a signal, two workers, a shared server ----------------------------------------------


def test_a_signal_outside_training_stops_the_sweep_cleanly(tmp_path, fresh_accelerate_state, monkeypatch):
    import finetune.sweep_trial
    import finetune.train

    config = sms_job(tmp_path, epochs=1)  # 6 updates a trial
    spec = sweep_file(tmp_path, space={"optim.learning_rate": [1e-3, 2e-3, 3e-3]}, trials=3,
                      sampler={"type": "grid", "seed": 0}, pruner="none")
    args = ["--config", str(config), "--sweep", str(spec)]
    out = tmp_path / "out-sweep"

    # 1. while the first trial's outputs are written: it completes, and the sweep stops before the next
    end = finetune.sweep_trial.TrialRunner._end

    def end_then_signal(runner, trial, folder, record):
        end(runner, trial, folder, record)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(finetune.sweep_trial.TrialRunner, "_end", end_then_signal)
    assert sweep_in_process(args) == 143
    assert [t.state.name for t in load_study(out).trials] == ["COMPLETE"]
    monkeypatch.undo()

    # 2. while the second trial loads its model: it stops after its first update, with a checkpoint
    run_training = finetune.train.run_training

    def signal_then_train(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return run_training(*a, **kw)

    monkeypatch.setattr(finetune.train, "run_training", signal_then_train)
    assert sweep_in_process(args) == 130
    second = out / "trial-0001"
    assert steps_logged(second) == [1] and (second / "checkpoints" / "checkpoint-1").is_dir()
    assert json.loads((second / "trial.json").read_text())["state"] == "interrupted"
    monkeypatch.undo()

    # 3. the same command finishes the sweep: the second trial resumed (trial 2 continues it in its folder),
    # each update once, and the grid's third point drawn as trial 3: every point once
    assert sweep_in_process(args) == 0
    complete = [t for t in load_study(out).trials if t.state.name == "COMPLETE"]
    assert [(t.number, t.user_attrs["folder"]) for t in complete] == [(0, "trial-0000"), (2, "trial-0001"),
                                                                      (3, "trial-0003")]
    assert sorted(t.params["optim.learning_rate"] for t in complete) == [1e-3, 2e-3, 3e-3]
    assert steps_logged(second) == [1, 2, 3, 4, 5, 6]


def test_a_trial_out_of_memory_stops_the_sweep_with_the_setting_for_a_new_sweep(tmp_path, fresh_accelerate_state,
                                                                                monkeypatch, capsys):
    """A trial's own hint ("the same command with ...") cannot continue a sweep, whose study refuses another
    config: the sweep says to run it again with the setting, in another folder."""
    import torch

    import finetune.loop

    config = sms_job(tmp_path, epochs=1)  # b=4, k=2
    spec = sweep_file(tmp_path, space={"optim.learning_rate": [1e-3, 2e-3]}, trials=2,
                      sampler={"type": "grid", "seed": 0}, pruner="none")
    calls, original = [0], finetune.loop.micro_batch_loss

    def micro_batch_loss(*args, **kwargs):  # the third micro-batch does not fit: update 2's first
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        return original(*args, **kwargs)

    monkeypatch.setattr(finetune.loop, "micro_batch_loss", micro_batch_loss)
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec)]) == 5
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error:", "hint:"))]
    assert said == ["error: out of memory on cpu in update 2 (epoch 0), at b=4; no checkpoint was saved yet",
                    "hint: the sweep's study keeps the config it was made with: run the sweep again with "
                    "training.per_device_train_batch_size=2 and another --output"]
    trial = load_study(tmp_path / "out-sweep").trials[0]
    assert trial.state.name == "FAIL" and trial.user_attrs["failed"].startswith("out of memory on cpu in update 2")


def stopped_by_sigterm(args: list[str], run_dir: Path, updates: int) -> str:
    """A sweep started as a command of its own and sent SIGTERM once the run in ``run_dir`` has logged
    ``updates`` updates; its output, once it exited with 143."""
    proc = sweep_process(args)
    deadline = time.monotonic() + 240
    while not ((run_dir / "train_log.jsonl").exists() and len(steps_logged(run_dir)) >= updates):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, log[-3000:]
    return log


@pytest.mark.slow
def test_sigterm_in_the_third_trial_then_the_same_command_finishes_it(tmp_path):
    config = sms_job(tmp_path, epochs=6)
    spec = sweep_file(tmp_path, pruner="none")
    args = ["--config", str(config), "--sweep", str(spec)]
    out = tmp_path / "out-sweep"
    third = out / "trial-0002"
    stopped_by_sigterm(args, third, updates=3)
    stopped_at = max(steps_logged(third))
    assert (third / "checkpoints").is_dir() and not (third / "metrics.json").exists()

    again = sweep_process(args)
    log = again.communicate(timeout=400)[0]
    assert again.returncode == 0, log[-3000:]
    assert "; 4 trials (2 done), sampler" in log  # the stopped third is not done: its continuation comes first
    assert f"resumed from {third / 'checkpoints'}" in log
    study = load_study(out)
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    # trial 3 continued trial 2 in its folder; the sampler's fourth trial is number 4
    assert sorted(t.user_attrs["folder"] for t in complete) == ["trial-0000", "trial-0001", "trial-0002", "trial-0004"]
    continuation = next(t for t in complete if t.user_attrs["folder"] == "trial-0002")
    assert continuation.number == 3 and continuation.user_attrs["continues"] == 2
    assert len({tuple(t.params.values()) for t in complete}) == 4
    steps = steps_logged(third)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > stopped_at  # each update once
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert [(r["folder"], r["state"], r["attempts"]) for r in rows][2] == ("trial-0002", "complete", "2")

    # the continued trial is bitwise the trial run without a stop
    from finetune.search_space import overrides

    whole = tmp_path / "uninterrupted"
    done = forked.run([sys.executable, "-m", "finetune.cli", "train", "--config", str(config),
                       *overrides(continuation.params), f"output.output_dir={whole}"],
                      env=offline_env({"FINETUNE_CPU_THREADS": "1"}))
    assert done.returncode == 0, done.stderr[-2000:]
    from safetensors.torch import load_file

    resumed, straight = load_file(third / "model.safetensors"), load_file(whole / "model.safetensors")
    assert resumed.keys() == straight.keys() and all(resumed[k].equal(straight[k]) for k in resumed)
    assert json.loads((third / "metrics.json").read_text())["eval"] == json.loads(
        (whole / "metrics.json").read_text())["eval"]


@pytest.mark.slow
def test_a_trial_stopped_before_any_checkpoint_starts_over_when_the_same_command_continues_it(tmp_path):
    """Without checkpoints (output.save_checkpoints: false) a stopped trial leaves its folder with a log and no
    checkpoint: its continuation trains it again from its first update, in the same folder."""
    config = sms_job(tmp_path, epochs=6)
    spec = sweep_file(tmp_path, pruner="none", trials=1, fixed={"output.save_checkpoints": False})
    args = ["--config", str(config), "--sweep", str(spec)]
    first = tmp_path / "out-sweep" / "trial-0000"
    stopped_by_sigterm(args, first, updates=2)
    assert not (first / "checkpoints").exists() and not (first / "metrics.json").exists()

    again = sweep_process(args)
    log = again.communicate(timeout=400)[0]
    assert again.returncode == 0, log[-3000:]
    assert "; 1 trial (0 done), sampler" in log and "resumed from" not in log
    steps = steps_logged(first)
    assert steps == list(range(1, len(steps) + 1)) and (first / "metrics.json").exists()  # from 1, each update once
    rows = list(csv.DictReader((tmp_path / "out-sweep" / "trials.csv").open()))
    assert [(r["folder"], r["state"], r["attempts"]) for r in rows] == [("trial-0000", "complete", "2")]


def test_a_trial_a_worker_drew_past_the_budget_at_the_same_time_as_another_runs_nothing(tmp_path):
    """Two workers can draw the budget's last trial at once; the one numbered later must not run."""
    import math

    import optuna

    from finetune.search_space import parse_space
    from finetune.study import BEYOND_BUDGET
    from finetune.sweep_trial import Phase, TrialRunner

    study = optuna.create_study(direction="maximize")
    space = parse_space(SPACE, "sweep.yaml")
    for value in (0.5, 0.6):  # a budget of two, drawn and finished
        trial = study.ask()
        space.suggest(trial)
        study.tell(trial, value)
    ran, ended = [], []
    runner = TrialRunner(tmp_path, None, [], "accuracy", on_trial_end=lambda *end: ended.append(end))
    runner._run = lambda trial, params, folder, record: ran.append(folder) or 0.7  # no training
    runner.phase = Phase("search", study, space, 2, lambda n, _: f"trial-{n:04d}")
    late = study.ask()
    assert math.isnan(runner(late)) and late.user_attrs[BEYOND_BUDGET] is True
    assert ran == [] and ended == [] and list(tmp_path.iterdir()) == []
    runner.phase.trials = 3  # within a budget of three, the same draw runs
    assert runner(study.ask()) == 0.7 and ran == ["trial-0003"]


@pytest.mark.slow
def test_two_workers_share_one_sqlite_study(tmp_path):
    config = sms_job(tmp_path)
    spec = sweep_file(tmp_path, trials=6, pruner="none", sampler="random")
    args = ["--config", str(config), "--sweep", str(spec)]
    workers = [sweep_process(args) for _ in range(2)]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [log[-2000:] for log in logs]
    out = tmp_path / "out-sweep"
    study = load_study(out)
    ran = [t for t in study.trials if not t.user_attrs.get("beyond_budget")]
    assert len(ran) == 6 and all(t.state.name == "COMPLETE" for t in ran)
    folders = sorted(t.user_attrs["folder"] for t in ran)
    assert folders == sorted(set(folders)) == sorted(p.name for p in out.glob("trial-*") if (p / "metrics.json").exists())
    for folder in folders:
        steps = steps_logged(out / folder)
        assert steps == list(range(1, len(steps) + 1))  # one run in each folder, not two
    per_worker = [sum("search trial" in line for line in log.splitlines()) for log in logs]
    assert sum(per_worker) == 6 and min(per_worker) >= 1, per_worker
    # each worker ends by naming the study's best trial, the same one
    from finetune.sweep_report import best_trial

    winner = best_trial(study.trials, greater_is_better=True)
    for log in logs:
        assert re.search(rf"best: trial {winner.number}, accuracy {winner.value:.4f}: optim.learning_rate=", log), log


def postgres_binaries() -> str | None:
    for folder in [os.environ.get("PG_BIN", ""), "/usr/local/bin", *sorted(Path("/usr/lib/postgresql").glob("*/bin"))]:
        if folder and (Path(folder) / "initdb").exists() and (Path(folder) / "pg_ctl").exists():
            return str(folder)
    return None


@pytest.fixture
def postgres_url(tmp_path):
    """A PostgreSQL server of this test's own, in a temporary folder; its URL. Stopped at the end."""
    pytest.importorskip("psycopg", reason="the PostgreSQL driver psycopg is not installed (pip install 'psycopg[binary]')")
    binaries = postgres_binaries()
    if binaries is None:
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql)")
    from helpers import free_port

    # the server refuses to run as root: where the tests run as root, it runs as the postgres user, in a
    # folder of its own (pytest's temporary folders are closed to other users)
    home = Path(tempfile.mkdtemp(prefix="finetune-test-pg-"))
    run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if run_as:
        shutil.chown(home, "postgres")
    data, port = home / "data", free_port()
    started = False
    try:
        for command in (["initdb", "-D", str(data), "-U", "sweep", "--auth=trust"],
                        ["pg_ctl", "-D", str(data), "-l", str(home / "server.log"), "-w", "-o",
                         f"-p {port} -k {home} -c listen_addresses=127.0.0.1", "start"]):
            done = subprocess.run([*run_as, f"{binaries}/{command[0]}", *command[1:]], capture_output=True, text=True)
            assert done.returncode == 0, f"{command[0]}: {done.stdout[-1500:]}{done.stderr[-1500:]}"
        started = True
        yield f"postgresql+psycopg://sweep@127.0.0.1:{port}/postgres"
    finally:
        if started:
            subprocess.run([*run_as, f"{binaries}/pg_ctl", "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.slow
def test_two_workers_share_a_postgresql_study(tmp_path, postgres_url, fresh_accelerate_state, caplog):
    import sqlalchemy

    work = tmp_path / "work"
    work.mkdir()
    config = sms_job(work)
    spec = sweep_file(work, trials=4, pruner="none")
    # a dry run asks the server, and writes nothing to it: not even Optuna's tables
    assert sweep_in_process(["--config", str(config), "--sweep", str(spec), "--storage", postgres_url,
                             "--dry-run"]) == 0
    engine = sqlalchemy.create_engine(postgres_url)
    assert sqlalchemy.inspect(engine).get_table_names() == []
    engine.dispose()
    # each worker its own folder, as on two machines: the study on the server is what they share
    args = [["--config", str(config), "--sweep", str(spec), "--storage", postgres_url, "--study-name", "shared",
             "--output", str(work / f"machine{i}")] for i in range(2)]
    workers = [sweep_process(a) for a in args]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], [log[-2000:] for log in logs]
    import optuna

    study = optuna.load_study(study_name="shared", storage=postgres_url)
    ran = [t for t in study.trials if not t.user_attrs.get("beyond_budget")]
    assert len(ran) == 4 and all(t.state.name == "COMPLETE" for t in ran)
    runs = [p.name for i in range(2) for p in (work / f"machine{i}").glob("trial-*") if (p / "metrics.json").exists()]
    assert sorted(runs) == sorted(t.user_attrs["folder"] for t in ran)  # every trial ran once, on one machine
    assert "storage postgresql+psycopg://sweep@127.0.0.1" in logs[0]
    # a third worker's dry run, with a larger budget, reads the study on the server and changes nothing there
    tables = lambda: {t: connection.execute(sqlalchemy.text(f"SELECT * FROM {t}")).all()  # noqa: E731
                      for t in sqlalchemy.inspect(connection).get_table_names()}
    engine = sqlalchemy.create_engine(postgres_url)
    with engine.connect() as connection:
        before = tables()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert sweep_in_process([*args[0], "--trials", "6", "--dry-run"]) == 0
    assert "the search's 6 trials: 6 runs, 4 done, the 2 left about " in _said(caplog, "sweep dry run: ")
    with engine.connect() as connection:
        assert tables() == before and before["trials"]
    engine.dispose()


def test_the_shipped_sweep_file_fits_the_default_config():
    from finetune.sweep import build_sweep, parse_args
    from finetune.sweep_checks import check_space_against_config

    spec = REPO / "configs" / "sweeps" / "default.yaml"
    args = ["--sweep", str(spec)]
    sweep = build_sweep(parse_args(args), args)
    assert sweep.space.keys() == ["optim.learning_rate", "training.effective_batch_size"] and sweep.trials == 12
    evaluation = sweep.run_config.evaluation
    assert (evaluation.metric_for_best_model, evaluation.evals_per_epoch) == ("f1", 4)
    check_space_against_config(sweep, str(spec))  # every batch splits into the default micro-batch


@pytest.mark.parametrize("evaluation, warned", [("evaluation.eval_every=5", True),
                                                ("evaluation.evals_per_epoch=4", False)])
def test_eval_every_with_a_searched_batch_is_warned_of(bad_input_job, caplog, evaluation, warned):
    import logging

    from finetune.sweep import build_sweep, parse_args
    from finetune.sweep_checks import warn_if_pruning_misaligned

    spec = sweep_file(bad_input_job, "batch.yaml")  # SPACE searches the effective batch
    args = ["--config", str(bad_input_job / "cfg.yaml"), "--sweep", str(spec), evaluation]
    sweep = build_sweep(parse_args(args), args)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        warn_if_pruning_misaligned(sweep)
    assert ("evaluation.eval_every=5 evaluates at different texts seen" in caplog.text) is warned


def test_nothing_to_search_names_the_shipped_sweep_file_which_runs(bad_input_job, capsys, monkeypatch):
    from finetune.sweep import read_sweep_file

    monkeypatch.chdir(REPO)
    assert sweep_in_process(["--config", str(bad_input_job / "cfg.yaml")]) == 2
    error, hint = capsys.readouterr().err.strip().splitlines()
    assert error == "error: --sweep: nothing to run: give a space (--sweep FILE with space:), --seeds N or --folds K"
    assert hint == ("hint: --sweep configs/sweeps/default.yaml searches a classifier's learning rate and effective "
                    "batch, by F1")
    assert read_sweep_file(hint.split()[2])["space"]  # the named file is a sweep file with a space
    monkeypatch.chdir(bad_input_job)  # from elsewhere, the whole path
    assert sweep_in_process(["--config", str(bad_input_job / "cfg.yaml")]) == 2
    assert f"--sweep {REPO / 'configs' / 'sweeps' / 'default.yaml'} " in capsys.readouterr().err


def test_a_search_setting_in_a_sweep_with_no_space_is_refused_not_ignored(bad_input_job, capsys, monkeypatch):
    """Without a space a sweep runs the config as given over its seeds or folds: --trials (or the sampler, the
    pruner, the trials' seeds), a flag or a key of the file, would be ignored, and a user who asked for trials
    would get none; each is refused in one line naming it, before anything is written."""
    monkeypatch.chdir(bad_input_job)
    output = bad_input_job / "no-space-sweep"
    config = ["--config", str(bad_input_job / "cfg.yaml"), "--output", str(output)]
    given = [(["--trials", "4"], "--trials 4", "--trials"), (["--sampler", "random"], "--sampler random", "--sampler"),
             (["--sampler-seed", "3"], "--sampler-seed 3", "--sampler-seed"), (["--pruner", "none"], "--pruner none",
             "--pruner"), (["--trial-seeds", "2"], "--trial-seeds 2", "--trial-seeds")]
    for flags, named, setting in given:
        assert sweep_in_process([*config, "--seeds", "2", *flags]) == 2
        error = capsys.readouterr().err.strip().splitlines()[0]
        assert error == (f"error: {named}: a setting of a search, and this sweep has no space to search (it runs the "
                         f"config as given over 2 seeds); give --sweep FILE with space:, or leave out {setting}")
    spec = bad_input_job / "no-space.yaml"
    spec.write_text("fixed:\n  training.num_train_epochs: 2\nfolds: 3\npruner: none\n", encoding="utf-8")
    assert sweep_in_process([*config, "--sweep", str(spec)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[0] == (
        f"error: {spec}: pruner: a setting of a search, and this sweep has no space to search (it runs the config as "
        f"given on each of 3 folds); give the file a space:, or leave out pruner")
    assert not output.exists()


def test_a_note_on_the_command_lines_keys_is_said_once_per_sweep(bad_input_job, caplog):
    """The sweep reads its config for each value of the space it checks, then for each trial: the note that
    training.max_steps replaces the file's epochs would repeat with each."""
    spec = bad_input_job / "batches.yaml"
    spec.write_text(yaml.safe_dump({"space": {"training.effective_batch_size": [8, 16, 32]}}), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="finetune"):
        # the storage is refused after the space's values were checked, before any trial
        assert sweep_in_process(["--config", str(bad_input_job / "cfg.yaml"), "--sweep", str(spec),
                                 "--storage", "mysqlx://nowhere/db", "training.max_steps=2"]) == 2
        in_the_sweep = [r for r in caplog.records if "replaces training.num_train_epochs" in r.getMessage()]
        assert len(in_the_sweep) == 1
        from finetune.config import load_config

        load_config(bad_input_job / "cfg.yaml", ["training.max_steps=2"])  # outside a sweep, each read says it
    assert len([r for r in caplog.records if "replaces training.num_train_epochs" in r.getMessage()]) == 2


def test_a_search_of_few_updates_a_trial_cautions_once_then_sums_its_trials_up(tmp_path, fresh_accelerate_state,
                                                                              caplog):
    """Each trial at its own effective batch makes its own few updates: the caution is said for the first, and
    once the search is done one line says how many trials made too few and which epochs give the fewest enough."""
    from finetune.start_line import FEW_UPDATES

    config = sms_job(tmp_path, epochs=1)
    spec = sweep_file(tmp_path, space={"training.effective_batch_size": [4, 8]}, trials=2, sampler="grid",
                      pruner="none")
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert sweep_in_process(["--config", str(config), "--sweep", str(spec)]) == 0
    said = [r.getMessage() for r in caplog.records]
    cautions = [line for line in said if "a new head learns little in so few (the default job's" in line]
    rows = list(csv.DictReader((tmp_path / "out-sweep" / "trials.csv").open()))
    fewest, most = sorted(int(row["updates"]) for row in rows)
    assert len(cautions) == 1 and fewest < most < FEW_UPDATES, (cautions, fewest, most)
    enough = -(-FEW_UPDATES // fewest)  # one epoch: each more makes as many again
    assert f"2 of the 2 finished trials made fewer than {FEW_UPDATES} updates ({fewest} to {most}): a new head " \
           f"learns little in so few, and such a trial's score says how many it made as much as what it searched; " \
           f"a sweep with training.num_train_epochs={enough} (and another --output: a sweep's study keeps the " \
           f"config it was made with) gives its fewest about {fewest * enough} (docs/sweeps.md#few-updates)" in said
    assert fewest * enough >= FEW_UPDATES > fewest * (enough - 1)
    summary = next(line for line in said if "finished trials made fewer than" in line)
    assert f"\n{summary}.\n" in (tmp_path / "out-sweep" / "sweep.md").read_text()  # the report says it too
    # a search of runs of a set length, training.max_steps, is a quick one asked for: neither is said
    caplog.clear()
    quick = sweep_file(tmp_path, name="quick.yaml", space={"training.effective_batch_size": [4]}, trials=1)
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert sweep_in_process(["--config", str(config), "--sweep", str(quick), "--output", str(tmp_path / "quick"),
                                 "training.num_train_epochs=null", "training.max_steps=3"]) == 0
    assert not [r for r in caplog.records if "new head learns little" in r.getMessage()]
    assert (tmp_path / "quick" / "trial-0000" / "metrics.json").is_file()
    assert "made fewer than" not in (tmp_path / "quick" / "sweep.md").read_text()


def test_a_worker_that_loses_the_race_to_create_the_tables_opens_them_on_its_next_try(monkeypatch):
    """Two workers starting at once on a new PostgreSQL database both create the study's tables; the one that
    loses meets "relation already exists" (a ProgrammingError, not a lock's OperationalError) and must try again."""
    import optuna
    import sqlalchemy.exc

    from finetune import study
    from finetune.errors import ConfigError

    calls = []

    def storage(answers):
        def open_it(url, **kwargs):
            calls.append(url)
            answer = answers[min(len(calls), len(answers)) - 1]
            if isinstance(answer, Exception):
                raise sqlalchemy.exc.ProgrammingError("CREATE TABLE studies (...)", {}, answer)
            return answer
        return open_it

    monkeypatch.setattr(study.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(optuna.storages, "RDBStorage",
                        storage([Exception('relation "studies" already exists'), "the storage"]))
    assert study.open_storage("postgresql+psycopg://sweep@db/postgres") == "the storage" and len(calls) == 2
    calls.clear()  # any other programming error (a schema it may not write to) is said at once
    monkeypatch.setattr(optuna.storages, "RDBStorage", storage([Exception("permission denied for schema public")]))
    with pytest.raises(ConfigError, match="cannot open the study's database: permission denied for schema public"):
        study.open_storage("postgresql+psycopg://sweep@db/postgres")
    assert len(calls) == 1


def test_a_trials_undefined_value_is_written_as_json_every_reader_reads(tmp_path):
    # a sweep on a regression's pearson can end a trial at NaN (targets or predictions all alike): trial.json
    # holds it as metrics.json does, "nan", which a strict parser reads
    from types import SimpleNamespace

    from finetune.sweep_trial import TRIAL_FILE, TrialRunner

    ended = []
    runner = SimpleNamespace(root=tmp_path, phase="search", on_trial_end=lambda *args: ended.append(args))
    record = {"trial": 0, "state": "complete", "value": float("nan"), "values": [float("nan"), 0.5]}
    TrialRunner._end(runner, SimpleNamespace(number=0), "trial-0000", record)
    text = (tmp_path / "trial-0000" / TRIAL_FILE).read_text(encoding="utf-8")
    written = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} written as a JSON number"))
    assert written["value"] == "nan" and written["values"] == ["nan", 0.5]
    assert ended == [("search", 0, record)]  # the sweep's own record keeps the number


@pytest.mark.parametrize("pairs", [False, True])
def test_the_reports_commands_run_from_the_folder_the_sweep_was_started_in(tmp_path, monkeypatch, pairs):
    """A sweep started with relative paths (its --output, its data) writes commands that run from where it was
    started: the best trial's model, best.yaml, and the every-row run read the files they name from there. A
    model of pairs, which `finetune predict DIR "a text"` refuses, is given a file of pairs with its two columns."""
    from finetune.config import load_config
    from finetune.search_space import parse_space
    from finetune.sweep_report import BEST_YAML, Header, best_yaml, predict_command, train_on_every_row

    monkeypatch.chdir(tmp_path)
    write_tsv(tmp_path / "nli.tsv", make_texts(4, seed=0))
    data = {"train_file": "nli.tsv", "format": "tsv", "has_header": False, "column_names": ["label", "text"],
            **({"text_pair_column": "hypothesis"} if pairs else {})}
    Path("cfg.yaml").write_text(yaml.safe_dump({"data": data}), encoding="utf-8")
    root = Path("runs") / "nli-sweep"
    root.mkdir(parents=True)
    space = parse_space({"optim.learning_rate": [1e-3, 1e-2]}, "--sweep")
    header = Header("accuracy", True, space, "grid", "none", "sqlite://", 2, "finetune sweep", "cfg.yaml")
    best = {"folder": "trial-0001", "optim.learning_rate": 1e-2, "trial": 1, "value": 0.5}
    said = predict_command(root, header, best)
    assert said == ("`finetune predict runs/nli-sweep/trial-0001 --file pairs.csv` (a file with the columns `text` "
                    "and `hypothesis`)" if pairs else "`finetune predict runs/nli-sweep/trial-0001 'a text'`")
    (root / BEST_YAML).write_text(best_yaml(root, header, best), encoding="utf-8")
    command = train_on_every_row(root, header, best).split()
    assert command[:4] == ["finetune", "train", "--config", "runs/nli-sweep/best.yaml"]
    kept = load_config(command[3], command[4:])
    assert Path(kept.data.train_file).is_file() and kept.output.output_dir == "runs/nli-sweep/best"
    assert kept.optim.learning_rate == 1e-2 and kept.data.validation_split == 0.0


def test_a_sweep_whose_runs_left_would_fill_the_disk_says_so_once_after_its_first_trial(tmp_path, caplog,
                                                                                         monkeypatch,
                                                                                         fresh_accelerate_state):
    """After its first finished trial a sweep knows what a run keeps (that trial's folder); where the runs left
    would keep more than the disk has free, it warns once, long before a checkpoint would stop a trial."""
    config, spec = sms_job(tmp_path, epochs=1), sweep_file(tmp_path, trials=3, pruner="none")
    out = tmp_path / "out-sweep"
    real = shutil.disk_usage
    # short where the sweep writes; the checkpoints' own check of their folder's space sees the real disk
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000) if Path(path) == out
                        else real(path))
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert sweep_in_process(["--config", str(config), "--sweep", str(spec), "--output", str(out)]) == 0
    short = [message for message in caplog.messages if "would fill" in message]
    assert len(short) == 1 and short[0].startswith("the 2 runs left would keep about ")  # of 3 trials, after one
    assert f"GB each as {out / 'trial-0000'} does, and {out} has 0.0GB free: the disk would fill" in short[0]


def test_the_disk_a_sweeps_runs_left_keep_is_what_a_finished_run_holds_times_their_number(tmp_path, monkeypatch):
    from collections import namedtuple

    from finetune.sweep_notes import disk_short

    run = tmp_path / "sweep" / "trial-0003"
    (run / "checkpoints" / "checkpoint-9").mkdir(parents=True)
    gb = 1024**3
    with open(run / "model.safetensors", "wb") as handle:  # sparse: their sizes, not the disk's blocks
        handle.truncate(gb // 2)
    with open(run / "checkpoints" / "checkpoint-9" / "optimizer.bin", "wb") as handle:
        handle.truncate(gb)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * gb, 0, 10 * gb))
    assert disk_short(tmp_path / "sweep", run, 6) is None  # 9.0GB of 10.0GB free
    assert disk_short(tmp_path / "sweep", run, 7) == (
        f"the 7 runs left would keep about 10.5GB, 1.50GB each as {run} does, and {tmp_path / 'sweep'} has 10.0GB "
        f"free: the disk would fill before the sweep ends; free some, or stop the sweep: one started with "
        f"output.keep_last=1 (or output.save_checkpoints=false) keeps less")
