"""A test set (``data.test_file``, ``data.test_split_name``): read at the start, never chosen on, scored once by
the saved model after training, as ``finetune score`` scores a file."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from helpers import make_texts, run_cli, write_sms_job, write_tsv
from tiny_run import fit_tiny_run, tiny_config, tiny_process

CHOOSING = {"evaluation": {"metrics": ["accuracy", "f1", "matthews_correlation"], "average": "binary",
                           "positive_label": "spam", "threshold": "per_label", "metric_for_best_model": "f1",
                           "load_best_model_at_end": True, "evals_per_epoch": 2}}


def _test_file(root: Path, seed: int = 9, rows: int = 30) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return write_tsv(root / "test.tsv", make_texts(rows, seed=seed))


def test_the_saved_model_is_scored_on_the_test_file_as_finetune_score_scores_it(tmp_path):
    """The run's test scores are those ``finetune score`` gives the saved model on the file: the same metrics,
    intervals and each label's scores, at the threshold the validation texts chose; and they are in metrics.json,
    all_results.json (the Trainer's ``test_*``), the card the Hub reads and the log's last record."""
    from huggingface_hub import ModelCard

    from finetune.model_card import SCORED_SPLIT
    from finetune.score import score_file

    test = _test_file(tmp_path / "files")
    cfg, summary = fit_tiny_run(tmp_path, data={"test_file": str(test)}, **CHOOSING)
    out = Path(cfg.output.output_dir)
    scores = summary["test"]
    assert scores["file"] == "test.tsv" and scores["metrics"]["num_samples"] == 30 and scores["precision"] == "no"
    assert json.loads((out / "metrics.json").read_text())["test"] == json.loads(json.dumps(scores))

    again = score_file(out, test, count_seen=False)
    assert again.metrics == scores["metrics"] and again.intervals == scores["intervals"]
    assert again.by_label == scores["by_label"]
    chosen = summary["eval_thresholds"]["spam"]  # chosen on the validation texts, and never on the test's
    assert scores["by_label"]["spam"]["threshold"] == chosen and chosen != 0.5

    results = json.loads((out / "all_results.json").read_text())
    assert {k: v for k, v in results.items() if k.startswith("test_")} == {
        ("test_samples" if k == "num_samples" else f"test_{k}"): v for k, v in scores["metrics"].items()}
    cards = {(r.dataset_name, r.dataset_split, r.metric_type): r.metric_value
             for r in ModelCard.load(out / "README.md").data.eval_results}
    for metric in ("loss", "accuracy", "f1", "matthews_correlation"):
        assert cards[("test.tsv", SCORED_SPLIT, metric)] == pytest.approx(scores["metrics"][metric], rel=1e-12)
    assert cards[("validation.tsv", "all rows", "f1")] == pytest.approx(summary["eval"]["f1"], rel=1e-12)
    last = json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])
    assert last == {"step": summary["train"]["updates"], **{f"test/{k}": v for k, v in scores["metrics"].items()}}


def test_the_test_set_changes_nothing_the_run_chooses_or_trains(tmp_path):
    """With and without a test file (one the model scores badly on: its labels swapped) the run keeps the same
    best evaluation, thresholds and weights, byte for byte: nothing is chosen on it, and reading it draws nothing
    from the generators training uses."""
    swapped = [("ham" if label == "spam" else "spam", text) for label, text in make_texts(30, seed=9)]
    test = write_tsv(tmp_path / "swapped.tsv", swapped)
    _, plain = fit_tiny_run(tmp_path / "plain", **CHOOSING)
    cfg, tested = fit_tiny_run(tmp_path / "tested", data={"test_file": str(test)}, **CHOOSING)
    assert plain["test"] is None and tested["test"]["metrics"]["accuracy"] < 0.5  # it was scored, and badly
    for key in ("eval", "eval_thresholds", "epochs"):
        assert tested[key] == plain[key], key
    assert {**tested["best"], "checkpoint": None} == {**plain["best"], "checkpoint": None}  # each in its folder
    assert ((tmp_path / "tested" / "out" / "model.safetensors").read_bytes()
            == (tmp_path / "plain" / "out" / "model.safetensors").read_bytes())


def test_a_test_set_that_does_not_fit_beside_the_trained_model_is_said_and_the_run_written(tmp_path, monkeypatch,
                                                                                            caplog):
    """Out of memory loading the saved model beside the trained one: a warning with the command that scores it in
    a process of its own, and every other output written, as without a test set."""
    import logging

    import torch

    from finetune.predict import Predictor

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Predictor, "load", no_room)
    test = _test_file(tmp_path / "files")
    with caplog.at_level(logging.WARNING, logger="finetune"):
        cfg, summary = fit_tiny_run(tmp_path, data={"test_file": str(test)})
    out = Path(cfg.output.output_dir)
    assert summary["test"] is None and json.loads((out / "metrics.json").read_text())["test"] is None
    assert not any(key.startswith("test_") for key in json.loads((out / "all_results.json").read_text()))
    assert "test.tsv" not in (out / "README.md").read_text() and (out / "model.safetensors").is_file()
    assert (f"the test set test.tsv was not scored: out of memory on cpu with the saved model beside the trained "
            f"one; the run's other outputs are written without its scores. Score it in a process of its own: "
            f"finetune score {out} --file {test}") in caplog.messages


def test_every_process_scores_a_share_of_the_test_batches_and_the_main_one_all_of_them(tmp_path, monkeypatch,
                                                                                     caplog):
    """On P processes each runs every P-th of the batches one process would run, and the main process scores
    what they all sent: the scores of one process. A process that ran out of memory leaves the test set unscored
    on all of them, said once."""
    import logging
    from types import SimpleNamespace

    from finetune import shares, test_set
    from finetune.predict import Predictor

    test = _test_file(tmp_path / "files")
    kept = []
    cfg, summary = fit_tiny_run(tmp_path, before_fit=kept.append, data={"test_file": str(test)},
                                training={"per_device_eval_batch_size": 4})
    out, run = Path(cfg.output.output_dir), kept[0]

    def on_process(index, others):
        sent = []

        def gathered(share, processes, to=None):
            assert processes == (index, 2) and to == 0  # to the main process alone
            sent.append(share)
            return [share, *others] if index == 0 else None

        monkeypatch.setattr(shares, "shares_of_every_process", gathered)
        accelerator = SimpleNamespace(process_index=index, num_processes=2, is_main_process=index == 0,
                                      mixed_precision="no", wait_for_everyone=lambda: None)
        return test_set.score_test_set(SimpleNamespace(**{**vars(run), "accelerator": accelerator}), out), sent[0]

    scored, second = on_process(1, [])
    expected = Predictor.load(out, batch_size=4).share_of_logits(run.test.texts, None, (1, 2))
    assert scored is None and 0 < len(second[0]) < 30
    assert second[0].tolist() == expected[0].tolist() and (second[1] == expected[1]).all()
    scored, first = on_process(0, [second])
    assert len(first[0]) + len(second[0]) == 30 and not set(first[0].tolist()) & set(second[0].tolist())
    assert json.dumps(scored) == json.dumps(summary["test"])  # one process's scores, to the last digit
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert on_process(0, ["cuda:1"])[0] is None  # the other process ran out of memory
    assert sum(said.startswith("the test set test.tsv was not scored: out of memory on cuda:1 with the saved model")
               for said in caplog.messages) == 1


def test_the_start_line_counts_the_test_rows_and_warns_of_those_trained_on(tmp_path):
    from finetune import setup_run
    from finetune.start_line import cautions, describe

    rows = make_texts(150, seed=3)[:20] + make_texts(5, seed=9)  # 20 training texts (tiny_config's train seed)
    test = write_tsv(tmp_path / "mixed.tsv", rows)
    with tiny_process():
        run = setup_run(tiny_config(tmp_path, data={"test_file": str(test)}))
        line, warned = describe(run), cautions(run)
    trained = set(text for _, text in make_texts(150, seed=3))
    seen = sum(text in trained for _, text in rows)
    assert seen >= 20
    assert f"; test: 25 rows of mixed.tsv, scored after training, {seen} of them a text also in train |" in line
    assert any(said.startswith(f"{seen} of the 25 rows of the test set mixed.tsv have a text the training rows have "
                               f"too") for said in warned)


def test_a_dry_run_says_how_long_scoring_the_test_set_would_take(tmp_path):
    from finetune import setup_run
    from finetune.rehearsal import rehearse
    from finetune.start_line import dry_run_line, readable_duration

    test = _test_file(tmp_path / "files", rows=60)
    with tiny_process():
        run = setup_run(tiny_config(tmp_path, data={"test_file": str(test)}))
        rehearsal = rehearse(run)
        line = dry_run_line(run, rehearsal)
    each = rehearsal.evaluation_seconds / 40  # the validation file's 40 texts
    assert (f", scoring its test set of 60 texts about {readable_duration(60 * each)} (at the evaluation's pace)"
            in line)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rows, said", [
    ([("spam", "win cash now"), ("eggs", "a label the training data lacks")],
     "label 'eggs' at line 2 not among the 2 labels of the train data (ham, spam)"),
    ([("ham", "")], "1 empty or null text in column 'text' (line 1)"),
])
def test_a_test_file_the_run_cannot_score_stops_it_before_training(tmp_path, rows, said):
    from finetune import setup_run
    from finetune.errors import DataError

    test = write_tsv(tmp_path / "bad.tsv", rows)
    with tiny_process(), pytest.raises(DataError) as raised:
        setup_run(tiny_config(tmp_path, data={"test_file": str(test)}))
    assert raised.value.message.startswith(f"{test}: {said}")
    assert not (tmp_path / "out").exists()


def test_a_bad_test_file_leaves_a_finished_run_as_it_was(tmp_path):
    """The command with a test file it cannot read: one line naming it, exit 2, no traceback, and the folder of
    the run it names untouched."""
    job = write_sms_job(tmp_path, training={"max_steps": 2})
    out = tmp_path / "out"
    assert run_cli(["--config", str(job), f"output.output_dir={out}"]).returncode == 0
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    bad = write_tsv(tmp_path / "bad.tsv", [("spam", "win cash"), ("eggs", "no such label")])
    done = run_cli(["--config", str(job), f"output.output_dir={out}", "output.overwrite=true",
                    f"data.test_file={bad}"])
    assert done.returncode == 1, done.stderr  # the run's 2, which accelerate's launcher makes 1
    errors = [line for line in done.stderr.splitlines() if line.startswith(("error", "Traceback"))]
    assert errors == [f"error: {bad}: label 'eggs' at line 2 not among the 2 labels of the train data (ham, spam)"]
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


def test_a_stopped_run_resumes_with_a_test_file_given_since_and_scores_it(tmp_path):
    """The test set touches nothing training does: a run stopped without one resumes with one (and the same
    weights as a run that had it from the start)."""
    test = _test_file(tmp_path / "files")
    fit_tiny_run(tmp_path / "stopped", on_update=lambda state: state.step >= 6, output={"checkpoint_every": 3})
    cfg, resumed = fit_tiny_run(tmp_path / "stopped", data={"test_file": str(test)})
    _, whole = fit_tiny_run(tmp_path / "whole", data={"test_file": str(test)})
    assert resumed["train"]["updates"] == whole["train"]["updates"]
    assert resumed["test"]["metrics"] == whole["test"]["metrics"]
    assert ((tmp_path / "stopped" / "out" / "model.safetensors").read_bytes()
            == (tmp_path / "whole" / "out" / "model.safetensors").read_bytes())


def test_a_finished_run_given_a_test_file_trains_nothing_and_scores_its_model(tmp_path):
    """The same command again, with a test file: the finished run restores its last checkpoint, trains no update,
    and scores the model it had saved, which stays byte for byte."""
    test = _test_file(tmp_path / "files")
    cfg, first = fit_tiny_run(tmp_path)
    out = Path(cfg.output.output_dir)
    model = (out / "model.safetensors").read_bytes()
    _, again = fit_tiny_run(tmp_path, data={"test_file": str(test)})
    assert first["test"] is None and again["test"]["metrics"]["num_samples"] == 30
    assert again["train"]["updates"] == first["train"]["updates"] and again["eval"] == first["eval"]
    assert (out / "model.safetensors").read_bytes() == model
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert sum("train/loss" in record for record in log) == first["train"]["updates"]  # each update once


# --------------------------------------------------------------------------- reading the test set


def _data_config(**data):
    from finetune.config import config_from_dict

    return config_from_dict({"data": data}).data


def _saved_splits(root: Path, test_labels: list[int]) -> Path:
    """A DatasetDict saved to disk: train and validation of 2 classes (a ClassLabel), and a test split."""
    import datasets

    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["ham", "spam"])})

    def split(labels):
        return datasets.Dataset.from_dict({"text": [f"text number {i}" for i in range(len(labels))],
                                           "label": labels}, features=features)

    datasets.DatasetDict({"train": split([0, 1] * 6), "validation": split([0, 1]),
                          "test": split(test_labels)}).save_to_disk(str(root / "saved"))
    return root / "saved"


def test_a_saved_data_sets_test_split_is_read_against_the_training_labels(tmp_path):
    from finetune.data import LabelSpace, labelled_columns, load_test_split

    folder = _saved_splits(tmp_path, [1, 1, 0])
    # the labels in the order of the run's, which here are reversed: ids follow the training data's names
    split, name = load_test_split(_data_config(train_file=str(folder), test_split_name="test"),
                                  LabelSpace(["spam", "ham"]))
    assert name == f"{folder}[test]"
    assert labelled_columns(split) == (["text number 0", "text number 1", "text number 2"], None, [0, 0, 1])


def test_a_test_split_that_is_not_there_or_not_labelled_is_one_line(tmp_path):
    from finetune.data import LabelSpace, load_test_split
    from finetune.errors import ConfigError, DataError

    folder = _saved_splits(tmp_path, [1, -1, -1])  # a Hub test split's labels, withheld
    labels = LabelSpace(["ham", "spam"])
    with pytest.raises(DataError) as raised:
        load_test_split(_data_config(train_file=str(folder), test_split_name="heldout"), labels)
    assert raised.value.message == f"data.test_split_name: {folder} has no split 'heldout' (splits: train, " \
                                   f"validation, test)"
    with pytest.raises(DataError) as raised:
        load_test_split(_data_config(train_file=str(folder), test_split_name="test"), labels)
    assert raised.value.message == f"{folder}[test]: 2 rows without a label in column 'label' (rows 2, 3)"
    withheld = _saved_splits(tmp_path / "benchmark", [-1, -1, -1])  # GLUE's test splits: every label withheld
    with pytest.raises(DataError) as raised:
        load_test_split(_data_config(train_file=str(withheld), test_split_name="test"), labels)
    assert raised.value.message == (f"data.test_split_name: {withheld}[test] has no labels (every row's is -1: a "
                                    f"benchmark keeps its test labels for its leaderboard)")
    assert raised.value.hint == ("take its validation split as the test set, and carve the validation rows from "
                                 "train: data.test_split_name=validation data.validation_split_name=null")
    # which is a valid config, reading the validation split as the test set
    split, _ = load_test_split(_data_config(train_file=str(withheld), test_split_name="validation",
                                            validation_split_name=None), labels)
    assert len(split) == 2
    one_file = write_tsv(tmp_path / "train.tsv", make_texts(10))
    with pytest.raises(ConfigError) as raised:
        load_test_split(_data_config(train_file=str(one_file), test_split_name="test"), labels)
    assert raised.value.message == f"data.test_split_name: {one_file} is one file, not a data set of splits"
    assert load_test_split(_data_config(train_file=str(one_file)), labels) is None


@pytest.mark.parametrize("data, said", [
    ({"test_file": "t.csv", "test_split_name": "test"}, "data.test_split_name: data.test_file (t.csv) is the test set "
                                                        "already: set one of them"),
    ({"test_file": "train.csv"}, "data.test_file: train.csv is data.train_file too; a test set is rows the run "
                                 "neither trains nor chooses on"),
    ({"validation_file": "dev.csv", "test_file": "dev.csv"}, "data.test_file: dev.csv is data.validation_file too"),
    ({"test_split_name": "validation"}, "data.test_split_name: 'validation' is data.validation_split_name too"),
])
def test_a_test_set_that_is_no_test_set_is_refused(data, said):
    from finetune.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        _data_config(train_file="train.csv", **data)
    assert raised.value.message.startswith(said)


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_the_held_out_files_have_options_of_their_own(command):
    from finetune.sweep import parse_args as sweep_args
    from finetune.train import parse_args as train_args

    parse = train_args if command == "train" else sweep_args
    args = parse(["--data", "train.csv", "--validation", "dev.csv", "--test", "test.csv", "training.seed=3"])
    assert args.overrides[:3] == ["data.train_file=train.csv", "data.validation_file=dev.csv",
                                  "data.test_file=test.csv"]
    assert args.overrides[-1] == "training.seed=3"


def test_a_hub_data_set_on_the_command_line_replaces_the_files_test_file(tmp_path):
    """A config's files, test file among them, are replaced by a Hub data set typed on the command line, as the
    training and validation files are."""
    import yaml

    from finetune.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"data": {"train_file": "train.csv", "test_file": "test.csv"}}))
    cfg = load_config(str(path), ["data.dataset_name=imdb", "data.test_split_name=test"])
    assert (cfg.data.train_file, cfg.data.test_file, cfg.data.test_split_name) == (None, None, "test")


def test_finetune_score_scores_a_files_split_alone_as_the_run_scored_its_test_split(tmp_path):
    """``--split test`` scores the rows of one split of a file with a column of splits: the run's test split,
    scored again by ``finetune score`` to the same numbers; every row of the file without it."""
    from finetune.errors import ConfigError, DataError
    from finetune.score import parse_args, run, score_file

    rows = [(label, text, split) for (label, text), split in
            zip(make_texts(110, seed=7), ["train"] * 70 + ["validation"] * 20 + ["test"] * 20)]
    data = tmp_path / "files" / "all.tsv"
    data.parent.mkdir()
    data.write_text("".join(f"{label}\t{text}\t{split}\n" for label, text, split in rows), encoding="utf-8")
    cfg, summary = fit_tiny_run(tmp_path, data={"train_file": str(data), "validation_file": None,
                                                "column_names": ["label", "text", "split"], "split_column": "split",
                                                "test_split_name": "test"})
    out = Path(cfg.output.output_dir)
    assert summary["test"]["file"] == "all.tsv[test]" and summary["test"]["metrics"]["num_samples"] == 20

    alone = score_file(out, data, split="test", count_seen=False)
    assert alone.file == f"{data}[test]" and alone.metrics == summary["test"]["metrics"]
    assert alone.texts == [text for _, text, split in rows if split == "test"]
    assert score_file(out, data, count_seen=False).metrics["num_samples"] == 110  # the whole file
    from finetune.predict import main as predict

    with tiny_process():  # finetune predict --split reads the run's column of splits as score does
        assert predict([str(out), "--file", str(data), "--split", "test", "--output", str(tmp_path / "p.csv")]) == 0
    with open(tmp_path / "p.csv", newline="", encoding="utf-8") as fh:
        assert [row["text"] for row in csv.DictReader(fh)] == alone.texts

    report = tmp_path / "score.json"
    with tiny_process():
        run(parse_args([str(out), "--file", str(data), "--split", "validation", "--json", str(report)]))
    assert json.loads(report.read_text())["file"] == f"{data}[validation]"
    assert (out / "confusion_all-validation.png").is_file() and not (out / "confusion_all.png").exists()
    with pytest.raises(DataError, match=r"^--split: .*all\.tsv's column 'split' has no split 'tset' \(splits: "
                                        r"train, validation, test\)$"):
        score_file(out, data, split="tset")
    plain = write_tsv(tmp_path / "files" / "plain.tsv", [(label, text) for label, text, _ in rows])
    with pytest.raises(DataError, match=r"plain\.tsv: no column 'split' \(data.split_column\)"):
        score_file(out, plain, ["data.column_names=[label, text]"], split="test")
    with pytest.raises(ConfigError, match=r"^--split: .*plain\.tsv is one file, not a data set of splits$"):
        score_file(out, plain, ["data.column_names=[label, text]", "data.split_column=null"], split="test")
