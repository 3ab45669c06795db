"""``finetune train --dry-run``: the run built, checked and trained for a few updates as ``fit`` trains them, its
length estimated from them, and nothing written to the output folder."""

from __future__ import annotations

import itertools
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import write_sms_job


def _dry_run_line(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("dry run: "))


def test_a_dry_run_trains_the_runs_first_updates_estimates_its_length_and_writes_nothing(tmp_path, caplog, monkeypatch,
                                                                                        fresh_accelerate_state):
    import finetune.fitting
    from finetune.train import main

    job = write_sms_job(tmp_path, training={"num_train_epochs": 2, "per_device_train_batch_size": 4,
                                            "gradient_accumulation_steps": 2})
    out = tmp_path / "out"
    evaluated = []  # the validation data each evaluation went through
    real = finetune.fitting.evaluation_of
    monkeypatch.setattr(finetune.fitting, "evaluation_of",
                        lambda model, loader, *args, **kwargs: evaluated.append(len(loader.dataset))
                        or real(model, loader, *args, **kwargs))
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert main(["--config", str(job), f"output.output_dir={out}", "--dry-run"]) == 0
    assert not out.exists()  # no folder, lock, log or checkpoint
    assert evaluated == [12]  # one evaluation, of the run's 12 validation rows
    line = _dry_run_line(caplog)
    assert any(r.getMessage().startswith("start: ") for r in caplog.records)  # the start line comes first
    # 48 training rows in windows of 8: 6 updates an epoch, 12 in all; the first epoch's 6 are tried
    match = re.fullmatch(r"dry run: 6 updates trained in [\d.]+ s \(loss ([\d.]+) to ([\d.]+)\), [\d.]+ s each at "
                         r"the end: the run's 12 updates would take about [\d.]+ s, and its (\d+) evaluations of 12 "
                         r"texts about ([\d.]+) s more \(([\d.]+) s each\), and its 2 checkpoints of about "
                         rf"[\d.]+GB each, not timed; nothing was written to {re.escape(str(out))}", line)
    assert match, line
    first, last, evaluations, all_seconds, each = match.groups()
    assert float(all_seconds) == pytest.approx(int(evaluations) * float(each), abs=0.051 * int(evaluations))
    # the same updates as the run itself trains first: the losses its log records; and as many evaluations
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert main(["--config", str(job), f"output.output_dir={out}"]) == 0
    logged = [json.loads(r) for r in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [f"{r['train/loss']:.4f}" for r in logged if "train/loss" in r]
    assert (first, last) == (losses[0], losses[5])
    assert int(evaluations) == sum("eval/loss" in r for r in logged) == 2  # one at each epoch's end


def test_a_dry_run_in_a_folder_that_holds_a_run_leaves_every_file_as_it_was(tmp_path, caplog, fresh_accelerate_state):
    from finetune.train import main

    job = write_sms_job(tmp_path, training={"max_steps": 2})
    out = tmp_path / "out"
    assert main(["--config", str(job), f"output.output_dir={out}"]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert main(["--config", str(job), f"output.output_dir={out}", "--dry-run"]) == 0
        # told to start afresh there, a dry run still replaces nothing: only the real start does
        assert main(["--config", str(job), f"output.output_dir={out}", "output.overwrite=true", "--dry-run"]) == 0
        assert main(["--config", str(job), f"output.output_dir={out}", "output.overwrite=true", "training.max_steps=1",
                     "--dry-run"]) == 0
    after = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before
    finished, afresh, one = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dry run: ")]
    assert one.startswith("dry run: 1 update trained") and ": the run's 1 update would take about " in one
    assert finished.startswith("dry run: 2 updates trained")  # the run has two: no more are tried
    # a start there resumes the finished run and trains nothing; told to overwrite, it trains the run again
    assert (f": the run is finished ({out / 'checkpoints' / 'checkpoint-2'}, update 2 of 2): a start trains "
            f"nothing; nothing was written to {out}") in finished
    assert ": the run's 2 updates would take about " in afresh


def test_a_dry_run_where_a_start_would_resume_estimates_the_updates_left(tmp_path, caplog, monkeypatch,
                                                                        fresh_accelerate_state):
    import shutil

    import finetune.rehearsal
    from finetune.train import main

    job = write_sms_job(tmp_path, training={"max_steps": 6, "num_train_epochs": None, "per_device_train_batch_size": 4,
                                            "gradient_accumulation_steps": 2},
                        output={"checkpoint_every": 2, "keep_last": 3})
    out = tmp_path / "out"
    assert main(["--config", str(job), f"output.output_dir={out}"]) == 0
    for step in (4, 6):  # as if stopped after the second update's checkpoint
        shutil.rmtree(out / "checkpoints" / f"checkpoint-{step}")
    estimated = []
    monkeypatch.setattr(finetune.rehearsal, "pace_and_estimate",
                        lambda seconds, updates: estimated.append((len(seconds), updates)) or (0.5, 2.0))
    with caplog.at_level(logging.INFO, logger="finetune"):
        assert main(["--config", str(job), f"output.output_dir={out}", "--dry-run"]) == 0
    assert estimated == [(6, 4)]  # the first epoch's six updates tried, the four left estimated
    line = _dry_run_line(caplog)
    match = re.fullmatch(rf"dry run: 6 updates trained in [\d.]+ s \(loss [\d.]+ to [\d.]+\), [\d.]+ s each at "
                         rf"the end: a start resumes from {re.escape(str(out / 'checkpoints' / 'checkpoint-2'))} "
                         rf"\(update 2 of 6\): its 4 updates left would take about 2.0 s, and its evaluation of "
                         rf"12 texts about [\d.]+ s more, and its 2 checkpoints of about [\d.]+GB each, not timed; "
                         rf"nothing was written to {re.escape(str(out))}", line)
    assert match, line


@pytest.mark.parametrize("model_type", ["bert", "convbert"])
def test_a_large_validation_set_is_timed_on_its_longest_batch_and_an_even_sample(tmp_path, monkeypatch,
                                                                                fresh_accelerate_state, model_type):
    """Past TIMED_TEXTS validation texts, a dry run evaluates the longest batch (that it fits) and an even sample of
    the rest, and estimates the whole at their seconds per token: minutes fewer on a CPU for a large set. ConvBERT
    reads the padding: every batch of it is padded to data.max_length (data.padding: auto), and counted so."""
    from helpers import save_tiny_model

    import finetune.rehearsal as rehearsal_module
    from finetune import rehearse, setup_run
    from finetune.columns import read_column
    from finetune.start_line import dry_run_line
    from tiny_run import tiny_config, tiny_process

    monkeypatch.setattr(rehearsal_module, "TIMED_TEXTS", 12)
    # a clock a second on at each reading: each pass over the sample takes one
    clock = itertools.count()
    monkeypatch.setattr(rehearsal_module, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    evaluated = []
    real = rehearsal_module.evaluation_of
    monkeypatch.setattr(rehearsal_module, "evaluation_of", lambda model, loader, *args, **kwargs: evaluated.append(
        read_column(loader.dataset, "input_ids")) or real(model, loader, *args, **kwargs))
    with tiny_process():
        model = save_tiny_model(tmp_path / model_type, model_type=model_type)
        run = setup_run(tiny_config(tmp_path, model={"name_or_path": str(model)},
                                    training={"max_steps": 2, "num_train_epochs": None,
                                              "per_device_eval_batch_size": 4}))
        whole = read_column(run.eval_dataloader.dataset, "input_ids")  # longest first, as evaluated
        rehearsal = rehearse(run, updates=2)
        line = dry_run_line(run, rehearsal)
    timed, again = evaluated  # the second pass gives the pace without the first's start-up
    assert again == timed
    assert len(whole) == 40 and len(timed) == rehearsal.timed_texts == 12
    assert timed[:4] == whole[:4]  # the first batch the run's evaluation makes, its longest
    assert timed[-1] == whole[-1] and timed == sorted(timed, key=len, reverse=True)  # spread to the shortest, in order


    def width(batch):  # ConvBERT's: data.max_length; others': a multiple of 8 (the default) of its longest
        return 32 if model_type == "convbert" else -(-max(map(len, batch)) // 8) * 8

    def computed_on(texts):  # batches of 4
        return sum(len(texts[i:i + 4]) * width(texts[i:i + 4]) for i in range(0, len(texts), 4))

    tokens, sample = computed_on(whole), computed_on(timed)
    # the first pass as it took, the other texts' tokens at the second's pace
    assert sample < tokens and rehearsal.timing_seconds == 2
    assert rehearsal.evaluation_seconds == pytest.approx(1 + (tokens - sample) / sample)
    said = r"its (\d+ evaluations|evaluation) of 40 texts about [\d.]+ s more.*timed on 12 of them"
    assert re.search(said, line), line


def test_the_estimate_takes_the_later_updates_pace_for_all_but_the_first(tmp_path, fresh_accelerate_state):
    from finetune import rehearse, setup_run  # what a notebook imports
    from finetune.rehearsal import pace_and_estimate
    from tiny_run import fit_tiny_run, tiny_config, tiny_process

    with tiny_process():
        rehearsal = rehearse(setup_run(tiny_config(tmp_path, training={"max_steps": 2, "num_train_epochs": None})),
                             updates=4)
    assert len(rehearsal.seconds) == len(rehearsal.losses) == 2 and rehearsal.total_updates == 2
    assert rehearsal.estimate == pytest.approx(sum(rehearsal.seconds))  # every update tried: their own seconds
    assert rehearsal.gpu_peak is None  # measured on a CUDA GPU only
    assert rehearsal.evaluation_seconds > 0  # the run has validation data: one evaluation was made and timed
    # a checkpoint's weights and optimizer state: the tensors the same run's own checkpoint holds
    import torch
    from safetensors.torch import load_file

    fit_tiny_run(tmp_path / "real", training={"max_steps": 2, "num_train_epochs": None})
    saved = tmp_path / "real" / "out" / "checkpoints" / "checkpoint-2"
    weights = load_file(str(saved / "model.safetensors")).values()
    state = torch.load(saved / "optimizer.bin", weights_only=True)["state"].values()
    held = sum(t.numel() * t.element_size() for t in [*weights, *(v for s in state for v in s.values())]
               if torch.is_tensor(t))
    assert rehearsal.checkpoints == 1 and rehearsal.checkpoint_bytes == held
    # what the run's folder keeps at its end: that checkpoint, and the saved model's weights
    model = load_file(str(tmp_path / "real" / "out" / "model.safetensors")).values()
    assert rehearsal.kept_checkpoints == 1 and rehearsal.model_bytes == sum(t.numel() * t.element_size() for t in model)
    # a longer run: the tried updates as they took, the rest at the later half's median
    assert pace_and_estimate([0.9, 0.3, 0.2, 0.25, 0.21, 0.22], 100) == pytest.approx((0.22, 2.08 + 0.22 * 94))
    assert pace_and_estimate([0.9], 10) == pytest.approx((0.9, 9.0))
    # fewer updates left than were tried (a resumed run): the first of them, as a fresh process takes them
    assert pace_and_estimate([0.9, 0.3, 0.2, 0.25], 2) == pytest.approx((0.225, 1.2))
    assert pace_and_estimate([0.9, 0.3, 0.2, 0.25], 0) == pytest.approx((0.225, 0.0))


@pytest.mark.parametrize("keep_last", [1, None])
def test_the_checkpoints_a_dry_run_says_a_run_keeps_are_those_its_folder_holds(tmp_path, keep_last,
                                                                                 fresh_accelerate_state):
    """Under a selection, evaluated four times an epoch, a run saves a checkpoint after each evaluation; its folder
    keeps ``output.keep_last`` of them, save the last and the best, which are never deleted: the dry run's count
    (what a sweep's dry run multiplies into the disk it needs) is the real run's, or one more where the best is the
    last."""
    import json

    from finetune import rehearse, setup_run
    from tiny_run import fit_tiny_run, tiny_config, tiny_process

    sections = {"evaluation": {"evals_per_epoch": 4, "metric_for_best_model": "accuracy"},
                "output": {"keep_last": keep_last}}
    with tiny_process():
        rehearsal = rehearse(setup_run(tiny_config(tmp_path / "tried", **sections)))
    fit_tiny_run(tmp_path / "real", **sections)
    out = tmp_path / "real" / "out"
    held = len(list((out / "checkpoints").glob("checkpoint-*")))
    summary = json.loads((out / "metrics.json").read_text())
    best_is_last = summary["best"]["step"] == summary["train"]["updates"]
    if keep_last is None:  # every one saved is kept
        assert rehearsal.kept_checkpoints == rehearsal.checkpoints == held > 2
    else:  # the last and the best, however few keep_last keeps
        assert rehearsal.checkpoints > rehearsal.kept_checkpoints == 2 == held + best_is_last
    from finetune.start_line import _checkpoints

    kept = " (up to 2 kept, output.keep_last)" if keep_last else ""
    assert re.fullmatch(rf", and its {rehearsal.checkpoints} checkpoints of about [\d.]+GB each{re.escape(kept)}, "
                        "not timed", _checkpoints(rehearsal))


def test_a_sweeps_dry_run_says_the_disk_its_runs_keep_and_warns_where_it_is_short(tmp_path, caplog, monkeypatch):
    import logging
    import shutil
    from collections import namedtuple

    from finetune import sweep_dry_run
    from finetune.sweep_dry_run import TriedRun, say_disk

    gb = 1024**3
    tried = [TriedRun([], 1.0, 10, 1.0, 1, 0.1, checkpoints=4, checkpoint_bytes=gb // 4, kept_checkpoints=2,
                      model_bytes=gb // 10),
             TriedRun([], 1.0, 40, 4.0, 1, 0.1, checkpoints=4, checkpoint_bytes=gb // 4, kept_checkpoints=1,
                      model_bytes=gb // 10)]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * gb, 0, 20 * gb))
    output = tmp_path / "not-yet" / "sweep"
    with caplog.at_level(logging.INFO, logger="finetune"):
        say_disk(output, tried, 17)  # the run that keeps more: 0.1 + 2 x 0.25 GB, 17 times
    said = (f"sweep dry run, on disk: each run keeps its model (0.10GB) and up to 2 checkpoints (0.25GB each): about "
            f"10.2GB for the 17 runs left, 20.0GB free in {tmp_path}")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, said)]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * gb, 0, 5 * gb))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"):
        say_disk(output, tried, 17)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, said.replace("20.0GB", "5.0GB")
        + ": the disk would fill before the sweep ends; output.keep_last=1 keeps fewer checkpoints, "
          "output.save_checkpoints=false none (a stopped trial then trains again from its start), or --output "
          "another disk")]
    assert sweep_dry_run.existing_folder(output) == tmp_path


def test_a_run_that_trained_is_not_fitted_or_rehearsed_again_and_its_outputs_are_kept(tmp_path):
    # a notebook's `fit(run)` cell run a second time: the same run, its state at its last update
    from finetune import fit, rehearse
    from tiny_run import fit_tiny_run

    runs = []
    cfg, _ = fit_tiny_run(tmp_path, before_fit=runs.append, training={"max_steps": 2, "num_train_epochs": None})
    out = Path(cfg.output.output_dir)
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert b"train/loss" in before[out / "train_log.jsonl"]
    for again, name in ((fit, "fit"), (rehearse, "rehearse")):
        with pytest.raises(RuntimeError, match=rf"^{name}: this run has trained already \(its state is at update 2, "
                                               r"by fit, rehearse or train_one_epoch\); setup_run builds it again$"):
            again(runs[0])
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


# the tiny run: 150 rows in micro-batches of 8, 19 an epoch; at k=2 ten updates an epoch, the tenth of one micro-batch
@pytest.mark.parametrize("training, evaluation, output", [
    ({}, {}, {}),  # at each epoch's end
    ({"eval_each_epoch": False}, {}, {}),  # the final weights' alone
    ({}, {"eval_every": 4}, {}),  # every 4 updates, and at the epoch ends between
    ({"eval_each_epoch": False}, {"eval_every": 3, "metric_for_best_model": "f1"}, {}),  # each saved, selected
    ({}, {"evals_per_epoch": 3, "metric_for_best_model": "loss"}, {"checkpoint_every": 4}),
    ({"max_steps": 13, "num_train_epochs": None}, {"evals_per_epoch": 4}, {"checkpoint_every": 5}),
    ({"num_train_epochs": 1.5}, {"eval_every": 4, "metric_for_best_model": "f1"}, {"checkpoint_every": 4}),
    ({"gradient_accumulation_steps": None, "accumulation_schedule": {0: 1, 1: 3}}, {"evals_per_epoch": 3}, {}),
    ({"gradient_accumulation_steps": 3, "num_train_epochs": 3}, {"eval_every": 5}, {"save_checkpoints": False}),
])
def test_the_evaluations_and_checkpoints_counted_ahead_are_those_the_run_makes(tmp_path, training, evaluation, output,
                                                                              fresh_accelerate_state):
    from finetune.checkpointer import Checkpointer
    from finetune.fitting import EvaluationSchedule
    from finetune.selection import EvalHistory
    from tiny_run import fit_tiny_run

    counters = []

    def count_ahead(run):
        due = EvaluationSchedule(run)
        counters.append((due, Checkpointer(run, EvalHistory.from_config(run.cfg.evaluation))))

    cfg, summary = fit_tiny_run(tmp_path, before_fit=count_ahead, training=training, evaluation=evaluation,
                                output={"keep_last": None, **output})
    evaluated = [record["step"] for record in summary["epochs"]]
    assert len(set(evaluated)) == len(evaluated) and evaluated[-1] == summary["train"]["updates"]
    root = Path(cfg.output.output_dir) / "checkpoints"
    saved = sorted(int(p.name.split("-")[1]) for p in root.glob("checkpoint-*")) if root.exists() else []
    assert bool(saved) == cfg.output.save_checkpoints
    due, checkpoints = counters[0]
    # from every update a start could resume after: the evaluations and checkpoints the run made after it
    points = range(summary["train"]["updates"] + 1)
    assert [due.count_after(done) for done in points] == [sum(step > done for step in evaluated) for done in points]
    assert [checkpoints.count_after(done, due) for done in points] == [sum(step > done for step in saved)
                                                                       for done in points]


@pytest.mark.parametrize("seconds, said", [(0.42, "0.4 s"), (14.2, "14 s"), (89, "89 s"), (210, "3.5 min"),
                                           (7560, "2.1 h")])
def test_durations_are_said_in_the_unit_that_reads(seconds, said):
    from finetune.start_line import readable_duration

    assert readable_duration(seconds) == said


def test_a_bad_setting_is_refused_in_one_line_before_a_dry_run_builds_anything(tmp_path, capsys):
    from finetune.train import main

    job = write_sms_job(tmp_path)
    capsys.readouterr()  # saving the tiny model may show transformers' bar
    assert main(["--config", str(job), "training.max_step=3", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: command line: training.max_step: unknown key (did you mean training.max_steps?)"]
