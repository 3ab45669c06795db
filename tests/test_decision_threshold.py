"""A two-class model's decision threshold (``evaluation.threshold`` on single_label): its positive class is
predicted where that class's probability is over the threshold, a number or chosen on the validation texts for
the best F1, and the saved model, ``finetune predict`` and ``finetune score`` predict at it; thresholds given by
label name (``{toxic: 0.3}``) for either kind of thresholded model; and the operating points ``score`` reads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_run import fit_tiny_run, reset_accelerate

from finetune.errors import ConfigError
from finetune.tasks import Task, decision_task


def _config(names, problem_type="single_label_classification", thresholds=None):
    config = SimpleNamespace(id2label=dict(enumerate(names)), num_labels=len(names), problem_type=problem_type)
    if thresholds is not None:
        config.label_thresholds = thresholds
    return config


def _softmax(logits: torch.Tensor) -> np.ndarray:
    return torch.softmax(logits.float(), dim=-1).numpy()


@pytest.mark.parametrize("positive", [0, 1])
def test_the_positive_class_is_predicted_over_the_threshold_else_the_other(positive):
    logits = torch.randn(500, 2, generator=torch.Generator().manual_seed(positive))
    probabilities = _softmax(logits)
    task = Task("single_label", threshold=0.2, positive_class=positive)
    expected = np.where(probabilities[:, positive] > 0.2, positive, 1 - positive)
    assert task.predictions(logits).tolist() == expected.tolist()
    assert task.decide(probabilities).tolist() == expected.tolist()
    assert task.at_thresholds(probabilities, np.array([0.2])).tolist() == expected.tolist()
    assert 0 < (expected != logits.argmax(-1).numpy()).sum()  # 0.2 is not the most probable class
    # at 0.5 the positive class is over it exactly where it is the more probable of the two
    assert Task("single_label", threshold=0.5, positive_class=positive).predictions(logits).tolist() == \
        logits.argmax(-1).tolist()
    assert task.thresholds_by_label(["ham", "spam"]) == {["ham", "spam"][positive]: 0.2}


def test_a_probability_at_the_threshold_is_not_over_it_on_either_path():
    """A tuned threshold is one of the validation texts' probabilities (each distinct prediction of p > t is
    tried), so a text exactly at it must fall on the same side in the evaluation (numpy, at_thresholds) as in
    ``finetune predict`` and ``score`` (torch, predictions): not over it."""
    logits = torch.tensor([[0.0, 0.0], [0.0, 1.0]])  # the first text's probabilities are 0.5 exactly
    at = float(_softmax(logits)[0, 1])
    task = Task("single_label", threshold=at, positive_class=1)
    assert task.predictions(logits).tolist() == [0, 1]
    assert task.at_thresholds(_softmax(logits), np.array([at])).tolist() == [0, 1]
    several = Task("multi_label", threshold=(0.5, 0.25))  # sigmoid(0) is 0.5 exactly
    assert several.predictions(torch.zeros(1, 2)).tolist() == [[0, 1]]
    assert several.at_thresholds(np.full((1, 2), 0.5, dtype=np.float32), np.array([0.5, 0.25])).tolist() == [[0, 1]]


def test_the_tuned_threshold_gives_the_best_f1_of_the_positive_class():
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(0)
    references = (rng.random(400) < 0.2).astype(np.int64)  # 1 the rarer
    # a model that ranks the positive texts higher, not perfectly, on rounded probabilities (ties included)
    spam = np.round(np.clip(0.3 * references + rng.random(400) * 0.6, 0, 1), 2)
    probabilities = np.stack([1 - spam, spam], axis=1).astype(np.float32)
    task = Task("single_label", tune_thresholds="binary", positive_class=1)
    (threshold,) = task.tuned_thresholds(probabilities, references)
    predictions = task.at_thresholds(probabilities, np.array([threshold]))
    tuned_f1 = f1_score(references, predictions)
    every = [f1_score(references, (probabilities[:, 1] > t).astype(int)) for t in np.unique(probabilities[:, 1])]
    assert tuned_f1 == pytest.approx(max(every + [f1_score(references, np.ones_like(references))]))
    assert tuned_f1 > f1_score(references, probabilities.argmax(1))
    # the positive class 0: the same threshold on the mirrored problem
    mirrored = Task("single_label", tune_thresholds="binary", positive_class=0)
    assert mirrored.tuned_thresholds(probabilities[:, ::-1], 1 - references) == pytest.approx([threshold])


def _f1(predicted, truth, average):
    """F1 of ``average`` of (texts, labels) 0/1 arrays, written out: the resampling test's reference."""
    hits, made, held = (predicted & truth).sum(0), predicted.sum(0), truth.sum(0)
    if average == "micro":
        return 2 * hits.sum() / (made.sum() + held.sum()) if made.sum() + held.sum() else 0.0
    by_label = np.divide(2 * hits, made + held, out=np.zeros(len(hits)), where=(made + held) > 0)
    return by_label.mean() if average == "macro" else (by_label * held).sum() / max(held.sum(), 1)


@pytest.mark.parametrize("labels,average", [(1, "macro"), (3, "micro"), (3, "macro"), (3, "weighted"),
                                            (12, "micro"), (12, "macro"), (12, "weighted")])
def test_the_share_of_resamples_that_beat_the_default_is_that_of_resampling_the_texts(labels, average):
    """Checked against the texts drawn one by one, as a bootstrap resample draws them. One label is a two-class
    model's positive class; up to 8 labels the texts are grouped into cells, past that drawn text by text."""
    from sklearn.metrics import f1_score

    from finetune.thresholds import share_beating_default

    rng = np.random.default_rng(3)
    truth = rng.random((300, labels)) < np.geomspace(0.08, 0.3, labels)
    probability = (1 / (1 + np.exp(-(rng.normal(0, 2.0, truth.shape) + 4 * truth - 2)))).astype(np.float32)
    thresholds = np.full(labels, 0.58, dtype=np.float32)
    # the reference's F1 is scikit-learn's (of one label: the positive class's, binary)
    assert _f1(probability > thresholds, truth, average) == pytest.approx(
        f1_score(truth[:, 0], probability[:, 0] > thresholds[0], zero_division=0) if labels == 1 else
        f1_score(truth, probability > thresholds, average=average, zero_division=0))
    beats = []
    for _ in range(1000):
        i = rng.integers(0, 300, 300)
        beats.append(_f1(probability[i] > thresholds, truth[i], average) > _f1(probability[i] > 0.5, truth[i], average))
    assert share_beating_default(probability, truth, thresholds, average) == pytest.approx(np.mean(beats), abs=0.04)
    assert 0.2 < np.mean(beats) < 0.98  # a case in between, where the two could disagree


def test_the_thresholds_move_from_the_default_only_where_the_texts_say_it_pays():
    from finetune.thresholds import f1_thresholds, guarded_f1_thresholds

    # every positive text under 0.5 but over 0.2: 0.5 finds none of them, and any resample says so
    truth = np.array([1] * 20 + [0] * 180)[:, None] > 0
    probability = np.where(truth, 0.3, 0.1).astype(np.float32)
    assert 0.1 < guarded_f1_thresholds(probability, truth)[0] < 0.3
    # a model that is right at 0.5 but for one positive text at 0.02: the best threshold finds it (F1 1.0 here),
    # but that is one text's say, and 0.5 stays
    right = np.where(truth, 0.97, 0.01).astype(np.float32)
    right[0] = 0.02
    assert f1_thresholds(right, truth, "macro")[0] < 0.02
    assert guarded_f1_thresholds(right, truth)[0] == 0.5
    # several labels: kept or given up together, for the F1 of the run's average
    for average in ("micro", "macro", "weighted"):
        missed = guarded_f1_thresholds(np.hstack([probability, right]), np.hstack([truth, truth]), average)
        assert 0.1 < missed[0] < 0.3 and missed[1] < 0.02  # the first label's gain carries the second's move
        assert (guarded_f1_thresholds(np.hstack([right, right]), np.hstack([truth, truth]), average) == 0.5).all()


def test_a_saved_model_predicts_at_the_threshold_its_config_carries():
    assert decision_task(_config(["ham", "spam"])) == Task("single_label")
    saved = decision_task(_config(["ham", "spam"], thresholds={"spam": 0.3}))
    assert (saved.positive_class, saved.threshold) == (1, 0.3)
    # given, a threshold decides on the class the config names, else the one given, else the second
    assert decision_task(_config(["spam", "ham"], thresholds={"spam": 0.3}), 0.1).positive_class == 0
    assert decision_task(_config(["ham", "spam"]), 0.1, positive_label="ham").positive_class == 0
    assert decision_task(_config(["ham", "spam"]), 0.1).positive_class == 1
    # a multi-label model's thresholds are every label's, as before
    multi = decision_task(_config(["a", "b"], "multi_label_classification", {"a": 0.2, "b": 0.7}))
    assert multi.threshold == (0.2, 0.7) and multi.positive_class is None
    with pytest.raises(ValueError, match=r"^applies to multi_label models and to single_label ones of two classes; "
                                         r"this one is single_label, which predicts its most probable of 3 classes "
                                         r"\(a, b, c\)$"):
        decision_task(_config(["a", "b", "c"]), 0.3)
    with pytest.raises(ValueError, match="this one is regression, which predicts a number"):
        decision_task(_config(["score"], "regression"), 0.3)
    with pytest.raises(ValueError, match=r"positive label 'eggs' is not one of the model's labels \(ham, spam\)"):
        decision_task(_config(["ham", "spam"]), 0.3, positive_label="eggs")


def test_thresholds_by_label_name_set_those_labels_and_leave_the_rest_at_the_default():
    from finetune.tasks import named_thresholds

    assert named_thresholds({"c": 0.2, "a": 0.7}, "multi_label", ["a", "b", "c"]) == ((0.7, 0.5, 0.2), None)
    # two classes: the one named is the class decided on, whichever it is
    assert named_thresholds({"ham": 0.8}, "single_label", ["ham", "spam"]) == (0.8, 0)
    assert named_thresholds({"spam": 0.2}, "single_label", ["ham", "spam"]) == (0.2, 1)
    with pytest.raises(ValueError, match=r"^'sprot' is not one of the labels \(sport, news\)$"):
        named_thresholds({"sprot": 0.3}, "multi_label", ["sport", "news"])
    with pytest.raises(ValueError, match=r"^two classes are decided by one threshold, on one of them: \{spam: T\}, "
                                         r"not one for each of ham, spam$"):
        named_thresholds({"ham": 0.6, "spam": 0.4}, "single_label", ["ham", "spam"])
    with pytest.raises(ValueError, match=r"this one is single_label, which predicts its most probable of 3 classes"):
        named_thresholds({"a": 0.3}, "single_label", ["a", "b", "c"])
    assert named_thresholds({"b": 0.9}, "multi_label", ["a", "b", "c"], (0.2, 0.7, 0.4)) == ((0.2, 0.9, 0.4), None)
    # a saved model predicts at them, a multi-label one at its own for the labels not named
    multi = decision_task(_config(["a", "b"], "multi_label_classification", {"a": 0.2, "b": 0.7}), {"b": 0.9})
    assert multi.threshold == (0.2, 0.9)
    assert decision_task(_config(["a", "b"], "multi_label_classification"), {"b": 0.9}).threshold == (0.5, 0.9)
    two = decision_task(_config(["ham", "spam"], thresholds={"spam": 0.3}), {"ham": 0.9})
    assert (two.positive_class, two.threshold) == (0, 0.9)
    probabilities = np.array([[0.85, 0.15], [0.95, 0.05]])
    assert two.decide(probabilities).tolist() == [1, 0]  # ham only over 0.9


def test_a_run_takes_thresholds_by_label_name_and_says_them():
    from finetune.assembly import build_task
    from finetune.start_line import _thresholds

    cfg = SimpleNamespace(training=SimpleNamespace(class_weights=None, label_smoothing=0.0),
                          evaluation=SimpleNamespace(threshold={"news": 0.3}, positive_label=None, average="micro"))
    multi = SimpleNamespace(problem_type="multi_label", names=["sport", "news", "tech"])
    task = build_task(cfg, multi, {"train": None, "validation": None})
    assert task == Task("multi_label", threshold=(0.5, 0.3, 0.5))
    run = SimpleNamespace(labels=multi, task=task, cfg=cfg)
    assert _thresholds(run) == "thresholds=news:0.3 (others 0.5)"
    cfg.evaluation.threshold = {"news": 0.3, "sport": 0.6, "tech": 0.2}
    run.task = build_task(cfg, multi, {"train": None, "validation": None})
    assert run.task.threshold == (0.6, 0.3, 0.2) and _thresholds(run) == "thresholds=news:0.3,sport:0.6,tech:0.2"
    from finetune.model_card import _thresholds as card_line

    saved = run.task.thresholds_by_label(multi.names)
    assert card_line(cfg.evaluation, saved, multi.names, "multi_label") == [
        "- Thresholds: sport 0.6, news 0.3, tech 0.2 (`evaluation.threshold`, by label); in `config.json` as "
        "`label_thresholds`, which `finetune predict` applies and `pipeline()` does not"]
    two = SimpleNamespace(problem_type="single_label", names=["ham", "spam"])
    cfg.evaluation.threshold, cfg.evaluation.positive_label = {"ham": 0.9}, "spam"  # the class named decides
    run = SimpleNamespace(labels=two, task=build_task(cfg, two, {"train": None, "validation": None}), cfg=cfg)
    assert run.task == Task("single_label", threshold=0.9, positive_class=0)
    assert _thresholds(run) == "threshold=0.9 on 'ham'"
    cfg.evaluation.threshold = {"eggs": 0.9}
    with pytest.raises(ConfigError, match=r"^evaluation.threshold: 'eggs' is not one of the labels \(ham, spam\)$"):
        build_task(cfg, two, {"train": None, "validation": None})


@pytest.mark.parametrize("given, message", [
    ("{sport: 1.2}", r"evaluation.threshold\['sport'\]: must be between 0 and 1, got 1.2"),
    ("{}", r"evaluation.threshold: empty; give a number between 0 and 1, \{label: threshold, \.\.\.\}, or per_label"),
    ("{sport: high}", r"evaluation.threshold\['sport'\]: expected float, got str 'high'"),
    ("{1: 0.3}", r"evaluation.threshold key 1: expected str, got int 1"),
])
def test_a_bad_threshold_by_label_name_is_one_line_naming_the_label(given, message):
    from finetune.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"evaluation.threshold={given}"])


def test_predicts_threshold_takes_a_number_or_thresholds_by_label_name_and_names_what_is_wrong(tmp_path, capsys):
    from finetune.predict import check_options, parse_args

    def threshold(given):
        args = parse_args([str(tmp_path), "a text", "--threshold", given])
        check_options(args)
        return args.threshold

    assert threshold("0.3") == 0.3
    assert threshold("{toxic: 0.3, insult: 0.6}") == {"toxic": 0.3, "insult": 0.6}
    for given, message in (("1.5", r"^--threshold: must be between 0 and 1, got 1.5$"),
                           ("{toxic: 0}", r"^--threshold\['toxic'\]: must be between 0 and 1, got 0.0$"),
                           ("high", r"^--threshold: expected float or mapping of str to float, got str 'high'$"),
                           ("{toxic:0.3}", r"YAML needs a space after each ':' of a mapping")):
        with pytest.raises(ConfigError, match=message):
            threshold(given)
    # the command says it in one line, and exits as for any bad input
    from finetune.cli import main as finetune

    capsys.readouterr()
    assert finetune(["predict", str(tmp_path), "a text", "--threshold", "high"]) == 2
    assert capsys.readouterr().err == "error: --threshold: expected float or mapping of str to float, got str 'high'\n"
    # a name the model does not have, or a threshold its kind does not take, is said from its config.json alone,
    # before any weights load (this folder has none)
    from transformers import BertConfig

    model = tmp_path / "model"
    BertConfig(num_labels=3, id2label={0: "sport", 1: "news", 2: "tech"},
               problem_type="multi_label_classification").save_pretrained(model)
    assert finetune(["predict", str(model), "a text", "--threshold", "{sprot: 0.3}"]) == 2
    assert capsys.readouterr().err == "error: --threshold: 'sprot' is not one of the labels (sport, news, tech)\n"
    BertConfig(num_labels=3, id2label={0: "sport", 1: "news", 2: "tech"}).save_pretrained(model)
    assert finetune(["predict", str(model), "a text", "--threshold", "0.3"]) == 2
    assert capsys.readouterr().err.startswith("error: --threshold: applies to multi_label models and to single_label "
                                              "ones of two classes; this one is single_label")
    (model / "config.json").write_text("{not json", encoding="utf-8")
    assert finetune(["predict", str(model), "a text", "--threshold", "0.3"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {model}: cannot load the model's config: ")


def test_score_takes_a_threshold_where_one_applies_and_refuses_it_in_the_runs_words_before_loading_weights():
    from finetune.score import threshold_given

    assert threshold_given(0.3, "single_label", ["ham", "spam"]) == 0.3
    assert threshold_given(0.3, "multi_label", ["a", "b", "c"]) == 0.3
    assert threshold_given("per_label", "single_label", ["ham", "spam"]) is None  # the model's own
    assert threshold_given({"b": 0.2}, "multi_label", ["a", "b", "c"]) == {"b": 0.2}
    with pytest.raises(ConfigError, match=r"^evaluation.threshold: 'd' is not one of the labels \(a, b, c\)$"):
        threshold_given({"d": 0.2}, "multi_label", ["a", "b", "c"])
    names = [f"class{i}" for i in range(7)]
    with pytest.raises(ConfigError, match=r"^evaluation.threshold: applies to multi_label models and to "
                                          r"single_label ones of two classes; this one is single_label, which "
                                          r"predicts its most probable of 7 classes \(class0, class1, class2, "
                                          r"class3, class4, \.\.\.\)$"):
        threshold_given(0.3, "single_label", names)


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory):
    """The tiny spam run, one short epoch (a model that still errs), its threshold chosen on the validation texts."""
    root = tmp_path_factory.mktemp("tuned")
    said = []
    from finetune.start_line import describe

    cfg, summary = fit_tiny_run(root, before_fit=lambda run: said.append(describe(run)),
                                training={"num_train_epochs": 1}, optim={"learning_rate": 2e-3},
                                evaluation={"metrics": ["accuracy", "f1", "roc_auc"], "threshold": "per_label"})
    return root, cfg, summary, said[0]


def _validation(root):
    rows = [line.split("\t") for line in (root / "validation.tsv").read_text(encoding="utf-8").splitlines()]
    return [text for _, text in rows], np.array([1 if label == "spam" else 0 for label, _ in rows])


@pytest.mark.slow
def test_a_run_chooses_its_threshold_and_everything_after_predicts_at_it(tuned_run, tmp_path, capsys):
    from sklearn.metrics import f1_score, roc_auc_score
    from transformers import AutoConfig

    from finetune.predict import Predictor, main
    from finetune.score import score_file
    from finetune.score_tables import format_by_label

    root, cfg, summary, start = tuned_run
    out = root / "out"
    assert "threshold=per_label (for its F1) on 'spam'" in start
    (name, threshold), = summary["eval_thresholds"].items()
    assert name == "spam" and 0 < threshold < 1
    assert AutoConfig.from_pretrained(out).label_thresholds == {"spam": threshold}
    texts, references = _validation(root)
    reset_accelerate()
    predictor = Predictor.load(out, device="cpu")
    spam = predictor.probabilities(texts)[:, 1]
    at_threshold = (spam > threshold).astype(int)
    # the run's F1 is the saved model's at its threshold, the best any threshold gives on these texts
    assert summary["eval"]["f1"] == pytest.approx(f1_score(references, at_threshold), abs=1e-6)
    best = max(f1_score(references, (spam > t).astype(int)) for t in np.append(np.unique(spam), 0.0))
    assert summary["eval"]["f1"] == pytest.approx(best, abs=1e-6)
    assert summary["eval"]["f1"] >= f1_score(references, (spam > 0.5).astype(int))
    assert summary["eval"]["roc_auc"] == pytest.approx(roc_auc_score(references, spam), abs=1e-6)
    assert (at_threshold != (spam > 0.5)).any(), "the threshold should change an answer on this run"
    # predict and score predict at it
    labels = [p["label"] for p in predictor.predict(texts)]
    assert labels == ["spam" if yes else "ham" for yes in at_threshold]
    scored = score_file(out, root / "validation.tsv", predictor=predictor, count_seen=False)
    assert scored.metrics["f1"] == pytest.approx(summary["eval"]["f1"], abs=1e-6)
    assert scored.by_label["spam"]["threshold"] == threshold and "threshold" not in scored.by_label["ham"]
    # the operating points start from the model's own threshold, whose row is the file's F1
    points = scored.operating_points
    assert list(points) == ["spam"] and points["spam"][0]["threshold"] == pytest.approx(threshold)
    assert points["spam"][0]["f1"] == pytest.approx(scored.metrics["f1"], abs=1e-6)
    assert scored.to_dict()["operating_points"] == points
    table = format_by_label(scored.by_label).splitlines()
    assert table[1].endswith("threshold") and table[3].split()[0] == "spam"
    assert float(table[3].split()[-1]) == pytest.approx(threshold, rel=1e-2)
    assert len(table[2].split()) == len(table[3].split()) - 1  # ham: no threshold
    at_half = score_file(out, root / "validation.tsv", ["evaluation.threshold=0.5"], predictor=predictor,
                         count_seen=False)
    assert at_half.metrics["f1"] == pytest.approx(f1_score(references, (spam > 0.5).astype(int)), abs=1e-6)
    # --threshold on the command line replaces the model's
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main([str(out), "--threshold", "0.9", "--file", str(tmp_path / "texts.txt"), "--output",
                 str(tmp_path / "p.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [row["predicted_label"] if "predicted_label" in row else row["label"] for row in rows] == \
        ["spam" if p > 0.9 else "ham" for p in spam]
    card = (out / "README.md").read_text()
    assert f"- Threshold: `spam` where its probability is over {threshold:.4g}, chosen on the validation texts" in card


@pytest.mark.slow
def test_a_threshold_of_ones_own_is_saved_from_the_start(tmp_path):
    from transformers import AutoConfig

    from finetune.predict import Predictor

    cfg, summary = fit_tiny_run(tmp_path, training={"num_train_epochs": 1}, optim={"learning_rate": 2e-3},
                                evaluation={"threshold": 0.2})
    out = tmp_path / "out"
    assert summary["eval_thresholds"] == {"spam": 0.2}
    assert AutoConfig.from_pretrained(out).label_thresholds == {"spam": pytest.approx(0.2)}
    texts, references = _validation(tmp_path)
    reset_accelerate()
    predictor = Predictor.load(out, device="cpu")
    spam = predictor.probabilities(texts)[:, 1]
    from sklearn.metrics import f1_score
    assert summary["eval"]["f1"] == pytest.approx(f1_score(references, (spam > 0.2).astype(int)), abs=1e-6)
    assert "- Threshold: `spam` where its probability is over 0.2 (`evaluation.threshold`), else `ham`" in \
        (out / "README.md").read_text()
    # the default, 0.5, saves none: the most probable class, as every single-label model predicts
    reset_accelerate()
    cfg, summary = fit_tiny_run(tmp_path / "half", training={"num_train_epochs": None, "max_steps": 2})
    assert summary["eval_thresholds"] is None
    assert not hasattr(AutoConfig.from_pretrained(tmp_path / "half" / "out"), "label_thresholds")


def test_the_by_label_table_gives_the_positive_class_its_threshold_in_either_place():
    from finetune.score_tables import format_by_label

    scores = {"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 4, "predicted": 4}
    for positive in ("spam", "ham"):
        by_label = {name: {**scores, **({"threshold": 0.3} if name == positive else {})} for name in ("spam", "ham")}
        head, *rows = format_by_label(by_label).splitlines()[1:]
        assert head.split()[-1] == "threshold"
        assert {row.split()[0]: row.split()[-1] for row in rows} == {positive: "0.3",
                                                                    ({"spam", "ham"} - {positive}).pop(): "4"}
        assert len({len(row.rstrip()) for row in rows if row.startswith(positive)} | {len(head)}) == 1


def test_a_runs_threshold_decides_on_its_positive_class_and_more_than_two_classes_are_refused():
    from finetune.assembly import build_task

    cfg = SimpleNamespace(training=SimpleNamespace(class_weights=None, label_smoothing=0.0),
                          evaluation=SimpleNamespace(threshold=0.3, positive_label=None))
    labels = SimpleNamespace(problem_type="single_label", names=["a", "b", "c"])
    with pytest.raises(ConfigError, match=r"^evaluation.threshold: applies to multi_label models and to "
                                          r"single_label ones of two classes; this one is single_label, which "
                                          r"predicts its most probable of 3 classes \(a, b, c\)$"):
        build_task(cfg, labels, {"train": None, "validation": None})
    two = SimpleNamespace(problem_type="single_label", names=["ham", "spam"])
    cfg.evaluation.positive_label = "eggs"  # under macro averaging, which does not read it: the threshold does
    with pytest.raises(ConfigError, match=r"^evaluation.positive_label: 'eggs' is not a label of the training "
                                          r"data \(ham, spam\)$"):
        build_task(cfg, two, {"train": None, "validation": None})
    cfg.evaluation.positive_label = "ham"
    assert build_task(cfg, two, {"train": None, "validation": None}) == Task("single_label", threshold=0.3,
                                                                             positive_class=0)
    # none named (macro averaging): the rarer in the training data, the second on a tie
    import datasets

    from finetune.tables import LABELS
    cfg.evaluation.positive_label = None
    for labels_of_rows, positive in (([0, 0, 0, 1], 1), ([0, 1, 1, 1], 0), ([0, 1], 1)):
        train = datasets.Dataset.from_dict({LABELS: labels_of_rows})
        assert build_task(cfg, two, {"train": train, "validation": None}).positive_class == positive
    cfg.evaluation.threshold = 0.5  # the default: the most probable class
    assert build_task(cfg, labels, {"train": None, "validation": None}) == Task("single_label")


def test_the_operating_points_are_the_best_each_aim_allows_on_the_texts():
    from finetune.metrics import operating_points

    rng = np.random.default_rng(4)
    truth = rng.random(400) < 0.2
    probability = np.round(np.clip(0.35 * truth + rng.random(400) * 0.6, 0, 1), 2).astype(np.float32)  # ties
    rows = {row["aim"]: row for row in operating_points(probability, truth, 0.5)}

    def at(t):
        predicted = probability > t
        hits = (predicted & truth).sum()
        return hits / max(predicted.sum(), 1), hits / truth.sum(), predicted.sum()

    every = [at(t) for t in np.append(np.unique(probability), -1.0) if (probability > t).any()]
    assert rows["the model's"]["precision"] == pytest.approx(at(0.5)[0])
    for target in (0.9, 0.95, 0.99):
        row = rows[f"precision >= {target:g}"]
        best_recall = max([r for p, r, _ in every if p >= target], default=None)
        if best_recall is None:
            assert row["threshold"] is None
            continue
        assert row["recall"] == pytest.approx(best_recall) and row["precision"] >= target
        assert at(row["threshold"])[:2] == pytest.approx((row["precision"], row["recall"]))  # p > t gives it
    for target in (0.9, 0.95, 0.99):
        row = rows[f"recall >= {target:g}"]
        best_precision = max(p for p, r, _ in every if r >= target)
        assert row["precision"] == pytest.approx(best_precision) and row["recall"] >= target
        assert at(row["threshold"])[:2] == pytest.approx((row["precision"], row["recall"]))
    assert all(rows[f"precision >= {target:g}"]["threshold"] is not None for target in (0.9, 0.95, 0.99))
    # a file whose most probable text is not of the class: no threshold reaches a precision of 0.99 there
    truth, probability = np.array([0, 1, 1, 0]), np.array([0.9, 0.8, 0.7, 0.1], dtype=np.float32)
    rows = {row["aim"]: row for row in operating_points(probability, truth, 0.5)}
    assert rows["precision >= 0.99"] == {"aim": "precision >= 0.99", "threshold": None}
    assert rows["recall >= 0.99"]["predicted"] == 3 and rows["recall >= 0.99"]["precision"] == pytest.approx(2 / 3)


def test_operating_points_are_read_on_the_class_or_labels_the_model_decides_on_at_their_thresholds():
    from finetune.metrics import label_points, operating_points

    probabilities = np.array([[0.2, 0.8], [0.7, 0.3], [0.4, 0.6]], dtype=np.float32)
    references = np.array([1, 0, 0])
    saved = label_points(Task("single_label", threshold=0.3, positive_class=0), probabilities, references,
                         ["ham", "spam"], pos_label=1)
    assert list(saved) == ["ham"] and saved["ham"][0]["threshold"] == pytest.approx(0.3)
    # at p(ham) > 0.3: the texts of 0.7 and 0.4, both ham
    assert saved["ham"][0]["predicted"] == 2 and saved["ham"][0]["precision"] == 1.0
    unsaved = label_points(Task("single_label"), probabilities, references, ["ham", "spam"], pos_label=None)
    assert list(unsaved) == ["spam"] and unsaved["spam"][0]["threshold"] == 0.5
    assert label_points(Task("single_label"), np.ones((3, 3)) / 3, references, ["a", "b", "c"], None) is None
    assert label_points(Task("regression"), None, np.array([0.5, 1.0]), ["score"], None) is None
    # a multi-label model's: each label's own, read on its column at its own threshold
    rng = np.random.default_rng(0)
    truth = (rng.random((200, 3)) < [0.2, 0.5, 0.7]).astype(int)
    probability = np.clip(0.5 * truth + 0.6 * rng.random((200, 3)), 0, 1).astype(np.float32)
    multi = label_points(Task("multi_label", threshold=(0.3, 0.5, 0.7)), probability, truth, ["a", "b", "c"], None)
    assert list(multi) == ["a", "b", "c"]
    for j, (name, threshold) in enumerate(zip("abc", (0.3, 0.5, 0.7))):
        assert multi[name] == operating_points(probability[:, j], truth[:, j], threshold)
        assert multi[name][0]["predicted"] == int((probability[:, j] > threshold).sum())


def test_a_multi_label_models_operating_points_print_one_row_a_label_with_what_each_threshold_keeps():
    from finetune.score_tables import format_operating_points

    def row(aim, threshold, precision=0.0, recall=0.0):
        return {"aim": aim, "threshold": threshold, "precision": precision, "recall": recall, "f1": 0.0,
                "predicted": 1}

    aims = [f"{kind} >= {target}" for kind in ("precision", "recall") for target in ("0.9", "0.95", "0.99")]
    points = {"sport": [row("the model's", 0.5)] + [row(aim, 0.1 * (i + 1), 0.91 + i / 100, 0.5 - i / 100)
                                                    for i, aim in enumerate(aims)],
              "politics": [row("the model's", 0.5)] + [row(aim, None) for aim in aims]}
    lines = format_operating_points(points).splitlines()
    assert lines[2].split() == ["precision", ">=", "recall", ">="]
    assert lines[3].split() == ["label", "0.9", "0.95", "0.99", "0.9", "0.95", "0.99"]
    # a precision's aim keeps its recall, a recall's its precision
    assert lines[4].split() == ["sport", "0.1", "(0.50)", "0.2", "(0.49)", "0.3", "(0.48)",
                                "0.4", "(0.94)", "0.5", "(0.95)", "0.6", "(0.96)"]
    assert lines[5].split() == ["politics"] + ["none"] * 6
    assert len({len(line) for line in lines[3:]}) == 1  # aligned
    # two classes: the positive class's table in full
    two = format_operating_points({"spam": points["sport"]}).splitlines()
    assert two[0].startswith("spam's threshold") and two[1].split()[0] == "aim" and len(two) == 9


def test_the_evaluation_log_line_names_the_thresholds_chosen_or_says_why_none_moved():
    from finetune.evaluation import Evaluation

    def said(thresholds):
        return Evaluation({}, thresholds=thresholds).thresholds_said()

    assert said({"money": 0.31, "sorry": 0.125}) == "at each label's threshold, chosen on these texts: money 0.31, " \
                                                    "sorry 0.125"
    assert said({"spam": 0.227}) == "at the threshold, chosen on these texts: spam 0.227"
    for kept in ({"spam": 0.5}, {"money": 0.5, "sorry": 0.5}):
        assert said(kept) == "at 0.5, kept: no thresholds chosen on these texts beat it on 95% of resamples of them"
