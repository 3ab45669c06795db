"""Several runs' models as one (``finetune predict`` and ``finetune score`` of a folder of runs, a sweep's
``folds/``): a text's probabilities are the mean of the models', its decision at the mean of their thresholds,
and models that answer different questions are refused."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from helpers import a_fresh_log, save_tiny_model, write_csv
from tiny_run import reset_accelerate

TEXTS = ["free cash prize call now", "see you at dinner tonight", "win",
         "hello ok thanks love you see you later at home tonight good night",
         "urgent claim your offer txt now free free", "sorry late for the meeting"]


def _member(folder: Path, labels, seed: int, problem_type: str = "single_label_classification",
            thresholds=None) -> Path:
    """A saved sequence-classification model of its own random weights (its head saved too, so that every load
    predicts alike), sharp enough that the models disagree."""
    import torch
    from transformers import AutoModelForSequenceClassification

    save_tiny_model(folder, num_labels=len(labels), seed=seed)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)}, problem_type=problem_type)
    with torch.no_grad():
        model.classifier.weight.mul_(200.0)
    if thresholds is not None:
        model.config.label_thresholds = thresholds
    model.save_pretrained(folder)
    return folder


def _members_alone(runs, texts, method="probabilities"):
    from finetune.predictor import Predictor

    reset_accelerate()
    return [getattr(Predictor.load(run), method)(texts).astype(np.float64) for run in runs]


@pytest.fixture(scope="module")
def folds(tmp_path_factory):
    """A sweep's folds/ as far as predicting goes: three runs of one question, fold-10 after fold-2."""
    root = tmp_path_factory.mktemp("sweep") / "folds"
    labels = ["ham", "spam", "other"]
    return [_member(root / f"fold-{n}", labels, seed) for n, seed in ((1, 1), (2, 2), (10, 3))]


def test_a_folder_of_runs_predicts_the_mean_of_its_models_probabilities(folds):
    from finetune import Ensemble, load_predictor  # the package's own names, as docs/inference.md gives them

    reset_accelerate()
    ensemble = load_predictor(folds[0].parent)
    assert isinstance(ensemble, Ensemble)
    assert [run.name for run in ensemble.runs] == ["fold-1", "fold-2", "fold-10"]  # natural order
    alone = _members_alone(folds, TEXTS)
    mean = np.mean(alone, axis=0)
    assert all(np.abs(one - mean).max() > 0.05 for one in alone)  # the models disagree, so the mean says something
    np.testing.assert_allclose(ensemble.probabilities(TEXTS), mean, rtol=1e-6, atol=1e-7)
    predicted = ensemble.predict(TEXTS)
    assert [row["label"] for row in predicted] == [ensemble.labels[i] for i in mean.argmax(axis=1)]
    assert [row["score"] for row in predicted] == pytest.approx(mean.max(axis=1), abs=1e-6)
    # the logits a score reads are the mean probabilities' own
    logits = ensemble.logits(TEXTS).astype(np.float64)
    softmax = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(softmax, mean, rtol=1e-5, atol=1e-7)


def test_predict_of_a_folder_of_runs_writes_the_mean_and_says_which_models(folds, tmp_path, capsys):
    from finetune.predict import main as predict

    inputs = write_csv(tmp_path / "in.csv", [("x", text) for text in TEXTS])
    reset_accelerate()
    with a_fresh_log():
        assert predict([str(folds[0].parent), "--file", str(inputs), "--text", "text",
                        "--output", str(tmp_path / "p.csv")]) == 0
    err = capsys.readouterr().err
    assert f"3 models, their probabilities averaged: fold-1, fold-2, fold-10 in {folds[0].parent}" in err
    with open(tmp_path / "p.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    mean = np.mean(_members_alone(folds, TEXTS), axis=0)
    assert [row["text"] for row in rows] == TEXTS
    written = np.array([[float(row[f"predicted_prob_{name}"]) for name in ("ham", "spam", "other")] for row in rows])
    np.testing.assert_allclose(written, mean, atol=1e-6)


def test_the_out_of_fold_predictions_beside_the_runs_are_not_an_output(folds, tmp_path, capsys):
    from finetune.predict import main as predict

    target = folds[0].parent / "predictions.csv"
    inputs = write_csv(tmp_path / "in.csv", [("x", text) for text in TEXTS])
    assert predict([str(folds[0].parent), "--file", str(inputs), "--output", str(target)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --output {target}: is where a sweep writes its folds' "
                                               f"out-of-fold predictions; name another file")
    assert not target.exists()


def test_models_that_answer_another_question_are_refused_in_a_line_naming_the_run(folds, tmp_path, capsys):
    import shutil

    from finetune.predict import main as predict

    folder = tmp_path / "mixed"
    for run in folds[:2]:
        shutil.copytree(run, folder / run.name)
    _member(folder / "fold-3", ["ham", "other", "spam"], 4)  # the same labels in another order
    _member(folder / "fold-4", ["ham", "spam", "other"], 5, "multi_label_classification")
    reset_accelerate()
    assert predict([str(folder), "a text"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (f"error: {folder / 'fold-3'}: labels ham, other, spam, where {folder / 'fold-1'} has ham, spam, "
                    f"other; the models of an ensemble must answer the same question")
    shutil.rmtree(folder / "fold-3")
    assert predict([str(folder), "a text"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        f"error: {folder / 'fold-4'}: a multi_label model, where {folder / 'fold-1'} holds a single_label one")


def test_a_sweeps_own_folder_is_answered_with_its_folds(folds, capsys):
    from finetune.predict import main as predict

    sweep = folds[0].parent.parent
    assert predict([str(sweep), "a text"]) == 2
    err = capsys.readouterr().err
    assert f"{sweep}: no model here" in err
    assert f"{sweep / 'folds'} holds its folds' models, which predict averaged when it is named" in err


def test_an_ensembles_thresholds_are_the_mean_of_its_models_own(tmp_path):
    from finetune.ensemble import Ensemble

    labels = ["sport", "news", "art"]
    multi = "multi_label_classification"
    runs = [_member(tmp_path / "multi" / "a", labels, 1, multi, {"sport": 0.2, "news": 0.6, "art": 0.5}),
            _member(tmp_path / "multi" / "b", labels, 2, multi, {"sport": 0.4, "news": 0.3, "art": 0.8}),
            _member(tmp_path / "multi" / "c", labels, 3, multi)]  # kept none: 0.5 each
    reset_accelerate()
    ensemble = Ensemble(runs)
    assert ensemble.task.threshold == pytest.approx((1.1 / 3, 1.4 / 3, 1.8 / 3))
    mean = np.mean(_members_alone(runs, TEXTS), axis=0)
    decided = [row["labels"] for row in ensemble.predict(TEXTS)]
    assert decided == [[name for name, p, t in zip(labels, row, ensemble.task.threshold) if p > t] for row in mean]
    # each model alone, for a score beside the mean, decides at its own
    assert [task.threshold for _, _, task in ensemble.alone] == [(0.2, 0.6, 0.5), (0.4, 0.3, 0.8), (0.5, 0.5, 0.5)]
    assert Ensemble(runs, threshold=0.9).task.threshold == (0.9, 0.9, 0.9)  # a threshold given replaces them

    # two classes: a threshold kept on the other class counts from this one's side; none kept, 0.5
    two = ["ham", "spam"]
    runs = [_member(tmp_path / "two" / "a", two, 1, thresholds={"spam": 0.3}),
            _member(tmp_path / "two" / "b", two, 2, thresholds={"ham": 0.6}),
            _member(tmp_path / "two" / "c", two, 3)]
    ensemble = Ensemble(runs)
    assert (ensemble.task.positive_class, ensemble.task.threshold) == (1, pytest.approx(0.4))
    unthresholded = Ensemble([runs[2], runs[2]])
    assert unthresholded.task.positive_class is None  # none kept by any: the most probable class


def test_regression_models_average_their_numbers(tmp_path):
    from finetune.ensemble import Ensemble

    runs = [_member(tmp_path / f"r{seed}", ["score"], seed, "regression") for seed in (1, 2)]
    reset_accelerate()
    ensemble = Ensemble(runs)
    mean = np.mean(_members_alone(runs, TEXTS, "logits"), axis=0)
    np.testing.assert_allclose(ensemble.logits(TEXTS), mean, rtol=1e-6)
    assert [row["score"] for row in ensemble.predict(TEXTS)] == pytest.approx(mean[:, 0], rel=1e-6)


def test_score_of_a_folder_of_runs_scores_the_mean_and_against_one_of_them(folds, tmp_path, capsys):
    from finetune.score import main as score

    labels = ["ham", "spam", "other", "spam", "ham", "other"]
    file = write_csv(tmp_path / "held_out.csv", list(zip(labels, TEXTS)))
    reset_accelerate()
    assert score([str(folds[0].parent), "--file", str(file), "--json", str(tmp_path / "s.json"),
                  "--against", str(folds[1]), "data.text_column=text", "data.label_column=label"]) == 0
    report = json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))
    mean = np.mean(_members_alone(folds, TEXTS), axis=0)
    truth = np.array([["ham", "spam", "other"].index(label) for label in labels])
    assert report["metrics"]["loss"] == pytest.approx(-np.log(mean[np.arange(len(truth)), truth]).mean(), rel=1e-5)
    assert report["metrics"]["accuracy"] == pytest.approx((mean.argmax(axis=1) == truth).mean())
    alone = _members_alone(folds, TEXTS)
    assert report["against"]["metrics"]["accuracy"] == pytest.approx((alone[1].argmax(axis=1) == truth).mean())
    # beside the mean, each model's own scores on the same texts
    assert [model["run"] for model in report["models_alone"]] == [str(run) for run in folds]
    for model, probabilities in zip(report["models_alone"], alone):
        assert model["metrics"]["accuracy"] == pytest.approx((probabilities.argmax(axis=1) == truth).mean())
        expected = -np.log(probabilities[np.arange(len(truth)), truth]).mean()
        assert model["metrics"]["loss"] == pytest.approx(expected, rel=1e-5)
    losses = [model["metrics"]["loss"] for model in report["models_alone"]]
    assert (f"each of the 3 models alone: loss {min(losses):.4f} to {max(losses):.4f} "
            f"(mean {sum(losses) / 3:.4f}), accuracy") in capsys.readouterr().out


def test_a_card_is_one_runs_so_a_folder_of_runs_is_not_given_one(folds, tmp_path, capsys):
    from finetune.score import main as score

    file = write_csv(tmp_path / "held_out.csv", list(zip(["ham"] * len(TEXTS), TEXTS)))
    assert score([str(folds[0].parent), "--file", str(file), "--card"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --card: {folds[0].parent} holds 3 runs, and a model card is "
                                               f"one run's; score one of them with --card, or leave out --card")


def test_the_texts_any_model_of_an_ensemble_trained_on_are_counted_once(monkeypatch):
    import finetune.scored_files as scored

    trained = {"a": {("one",), ("two",)}, "b": {("two",), ("three",)}, "c": None}
    monkeypatch.setattr(scored, "trained_rows", lambda run: trained[run])
    texts = ["one", "two", "three", "four", "two"]
    assert scored.texts_seen_in_training(["a", "b"], texts) == 4
    assert scored.texts_seen_in_training("a", texts) == 3
    assert scored.texts_seen_in_training(["a", "c"], texts) is None  # one that cannot be read: not looked for


def test_a_run_of_the_folder_with_no_model_yet_is_left_out_and_said(folds, tmp_path, caplog):
    """A fold still training (its config.yaml written, no model yet) or stopped: the others predict, and the warning
    says how many of the folder's runs do."""
    import logging
    import shutil

    from finetune.ensemble import Ensemble, load_predictor
    from finetune.predictor import Predictor

    folder = tmp_path / "folds"
    for run in folds[:2]:
        shutil.copytree(run, folder / run.name)
    (folder / "fold-3").mkdir()
    (folder / "fold-3" / "config.yaml").write_text("model: {}\n", encoding="utf-8")
    (folder / "notes").mkdir()  # a folder of the user's, no run: not said
    reset_accelerate()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        ensemble = load_predictor(folder)
    assert isinstance(ensemble, Ensemble) and [run.name for run in ensemble.runs] == ["fold-1", "fold-2"]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"{folder}: fold-3 holds a run with no saved model yet (still training, or stopped before its end), left "
        f"out: 2 of 3 runs predict"]
    shutil.rmtree(folder / "fold-2")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert isinstance(load_predictor(folder), Predictor)  # one left: that run's model, still said
    assert "left out: 1 of 2 runs predict" in caplog.text


def test_models_predicted_on_the_cpu_beside_gpus_torch_cannot_reach_say_why_once(folds, tmp_path, monkeypatch,
                                                                                   capsys):
    """A CPU build of torch on a machine whose driver drives GPUs: predict and score (with --against, two loads)
    say once why the models run on the CPU; GPUs hidden on purpose, or a device given, are not said."""
    import torch

    from finetune import machine
    from finetune.ensemble import load_predictor
    from finetune.predict import main as predict
    from finetune.score import main as score

    listed = tmp_path / "gpus"
    (listed / "0000:01:00.0").mkdir(parents=True)
    monkeypatch.setattr(machine, "NVIDIA_GPUS", listed)
    monkeypatch.setattr(torch.version, "cuda", None)
    for name in ("CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    why = (f"this machine has 1 NVIDIA GPU and {{}} on the CPU: torch {torch.__version__} is a build without CUDA; "
           f"one with CUDA predicts on it (the command for this machine: pytorch.org/get-started/locally)")
    inputs = write_csv(tmp_path / "held_out.csv", list(zip(["ham", "spam", "other"] * 2, TEXTS)))
    reset_accelerate()
    with a_fresh_log():
        assert predict([str(folds[0].parent), "--file", str(inputs), "--output", str(tmp_path / "p.csv")]) == 0
    assert capsys.readouterr().err.count("NVIDIA") == 1
    with a_fresh_log():
        assert predict([str(folds[0]), "a text"]) == 0
    assert f"warning: {why.format('the model predicts')}\n" in capsys.readouterr().err
    with a_fresh_log():
        assert score([str(folds[0].parent), "--file", str(inputs), "--against", str(folds[1]),
                      "data.text_column=text", "data.label_column=label"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {why.format('the 3 models predict')}\n" in err and err.count("NVIDIA") == 1
    with a_fresh_log():
        load_predictor(folds[0], device="cpu")  # the device asked for
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the GPUs hidden on purpose
        load_predictor(folds[0])
    assert "NVIDIA" not in capsys.readouterr().err
