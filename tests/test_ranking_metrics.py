"""ROC AUC and average precision: scikit-learn's values, their bootstrap intervals, and a run that selects on them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn import metrics as skm
from sklearn.preprocessing import label_binarize

from finetune.errors import ConfigError
from finetune.metrics import MetricSuite
from finetune.metrics.other_tasks import MultiLabelMetrics
from finetune.metrics.ranking import RANKING_METRICS, ranking_scores

NAMES = list(RANKING_METRICS)
SKLEARN = {"roc_auc": skm.roc_auc_score, "average_precision": skm.average_precision_score}


def _probabilities(n: int, k: int, seed: int, skill: float = 1.5):
    """Classes and softmax probabilities that favour the true class, rounded so that many texts tie."""
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, k, n)
    logits = rng.normal(size=(n, k)) + skill * np.eye(k)[ref]
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return ref, probs.round(2)


@pytest.mark.parametrize("average, k", [("binary", 2), ("macro", 2), ("macro", 4), ("weighted", 4), ("micro", 4)])
def test_single_label_ranking_metrics_are_sklearns(average, k):
    ref, probs = _probabilities(400, k, seed=k)
    pred = probs.argmax(axis=1)
    suite = MetricSuite(["accuracy", *NAMES], k, average, pos_label=1 if average == "binary" else None)
    ours = suite.compute(pred, ref, scores=probs)
    assert list(ours) == ["accuracy", *NAMES]  # in the order named
    for name in NAMES:
        if average == "binary":
            expected = SKLEARN[name](ref == 1, probs[:, 1])
        else:
            expected = SKLEARN[name](label_binarize(ref, classes=range(k)) if k > 2 else np.eye(2)[ref], probs,
                                     average=average)
        assert ours[name] == pytest.approx(expected, abs=1e-12), name


@pytest.mark.parametrize("average", ["micro", "macro", "weighted"])
def test_multi_label_ranking_metrics_are_sklearns(average):
    rng = np.random.default_rng(3)
    ref = rng.random((300, 5)) < 0.3
    probs = (1 / (1 + np.exp(-(rng.normal(size=(300, 5)) + 1.2 * ref)))).round(2)
    suite = MultiLabelMetrics(["f1", *NAMES], 5, average)
    ours = suite.compute(probs > 0.5, ref, scores=probs)
    for name in NAMES:
        assert ours[name] == pytest.approx(SKLEARN[name](ref, probs, average=average), abs=1e-12), name


@pytest.mark.parametrize("kind", ["class ids", "label vectors"])
def test_each_labels_ranking_metrics_are_its_one_against_the_rest(kind):
    from finetune.metrics import scores_by_label

    rng = np.random.default_rng(8)
    if kind == "class ids":
        ref, probs = _probabilities(300, 3, seed=8)
        pred, positive = probs.argmax(axis=1), np.eye(3, dtype=bool)[ref]
    else:
        positive = rng.random((300, 3)) < 0.3
        probs = (1 / (1 + np.exp(-(rng.normal(size=(300, 3)) + positive)))).round(2)
        ref, pred = positive.astype(np.int64), (probs > 0.5).astype(np.int64)
    by_label = scores_by_label(pred, ref, ["a", "b", "c"], scores=probs, ranking=NAMES)
    plain = scores_by_label(pred, ref, ["a", "b", "c"])
    for i, name in enumerate(["a", "b", "c"]):
        assert {key: value for key, value in by_label[name].items() if key not in NAMES} == plain[name]
        for metric in NAMES:
            assert by_label[name][metric] == pytest.approx(SKLEARN[metric](positive[:, i], probs[:, i]), abs=1e-12)


def test_a_resamples_weights_count_each_text_that_many_times():
    ref, probs = _probabilities(200, 3, seed=5)
    counts = np.random.default_rng(6).integers(0, 4, size=(3, 200))
    weighted = ranking_scores(NAMES, probs, np.eye(3, dtype=bool)[ref], counts, "macro")
    for row, text_counts in enumerate(counts):
        rows = np.repeat(np.arange(200), text_counts)  # each text written out as many times as counted
        for name in NAMES:
            expected = SKLEARN[name](label_binarize(ref[rows], classes=range(3)), probs[rows], average="macro")
            assert weighted[name][row] == pytest.approx(expected, abs=1e-12), (name, row)


def test_a_class_no_text_has_is_left_out_of_the_average_and_alone_has_no_value():
    ref, probs = _probabilities(150, 4, seed=7)
    ref[ref == 3] = 0  # no text of class 3: nothing to rank it against
    suite = MetricSuite(NAMES, 4, "macro")
    ours = suite.compute(probs.argmax(axis=1), ref, scores=probs)
    present = label_binarize(ref, classes=range(4))[:, :3]
    for name in NAMES:
        assert ours[name] == pytest.approx(SKLEARN[name](present, probs[:, :3], average="macro"), abs=1e-12)
    # two classes, and no text of the positive one: neither metric has a value, nor an interval
    from finetune.metrics.intervals import metric_intervals

    binary = MetricSuite(["accuracy", *NAMES], 2, "binary", pos_label=1)
    two = np.stack([probs[:, 0], 1 - probs[:, 0]], axis=1)
    none = np.zeros(len(ref), dtype=np.int64)
    assert [np.isnan(value) for value in binary.compute(none, none, scores=two).values()] == [False, True, True]
    assert list(metric_intervals(binary, none, none, scores=two)) == ["accuracy"]


def test_the_ranking_metrics_need_the_probabilities_and_a_regression_refuses_them():
    from finetune.metrics.other_tasks import RegressionMetrics

    ref, probs = _probabilities(50, 2, seed=1)
    suite = MetricSuite(["f1", "roc_auc"], 2, "binary", pos_label=1)
    with pytest.raises(ValueError, match=r"the ranking metrics \(roc_auc\) need each text's probabilities: pass them as scores="):
        suite.compute(probs.argmax(axis=1), ref)
    with pytest.raises(ValueError, match=r"scores must be 50 x 2 probabilities .* got shape \(50, 3\)"):
        suite.compute(probs.argmax(axis=1), ref, scores=np.ones((50, 3)))
    assert MetricSuite(["f1"], 2, "binary", pos_label=1).compute(probs.argmax(axis=1), ref)  # no scores needed
    with pytest.raises(ConfigError, match="evaluation.metrics: 'roc_auc' is not computed for regression"):
        RegressionMetrics(["mse", "roc_auc"])


def test_the_configs_lists_of_each_problem_types_metrics_are_the_metrics_own():
    from finetune.config import PROBLEM_METRICS
    from finetune.metrics.other_tasks import MULTI_LABEL_METRICS, REGRESSION_METRICS

    assert PROBLEM_METRICS["multi_label"] == MULTI_LABEL_METRICS
    assert PROBLEM_METRICS["regression"] == REGRESSION_METRICS


@pytest.mark.parametrize("name, meant", [("auc", "roc_auc"), ("pr_auc", "average_precision"),
                                          ("roc-auc", "roc_auc"), ("average_precison", "average_precision")])
def test_another_spelling_of_a_ranking_metric_is_named(name, meant, monkeypatch):
    import evaluate.config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)
    with pytest.raises(ConfigError, match=f"cannot load metric '{name}' \\(did you mean '{meant}'\\?\\)") as raised:
        MetricSuite(["accuracy", name], 2, "binary", pos_label=1)
    assert raised.value.hint.startswith("Built in (offline): accuracy, f1, precision, recall, matthews_correlation, "
                                        "roc_auc, average_precision. ")


def test_a_ranking_interval_is_the_spread_of_resampled_texts():
    from finetune.metrics.intervals import metric_intervals

    ref, probs = _probabilities(400, 2, seed=11, skill=1.0)
    pred = probs.argmax(axis=1)
    suite = MetricSuite(["accuracy", *NAMES], 2, "binary", pos_label=1)
    observed = suite.compute(pred, ref, scores=probs)
    intervals = metric_intervals(suite, pred, ref, scores=probs)
    assert list(intervals) == ["accuracy", *NAMES]
    assert metric_intervals(suite, pred, ref, scores=probs) == intervals  # seeded
    assert list(metric_intervals(suite, pred, ref)) == ["accuracy"]  # no probabilities: no ranking interval
    rng = np.random.default_rng(12)
    resampled = {name: [] for name in NAMES}
    for _ in range(1000):
        rows = rng.integers(0, len(ref), len(ref))
        for name in NAMES:
            resampled[name].append(SKLEARN[name](ref[rows] == 1, probs[rows, 1]))
    for name in NAMES:
        low, high = intervals[name]
        assert low < observed[name] < high, name
        assert intervals[name] == pytest.approx(np.quantile(resampled[name], [0.025, 0.975]).tolist(), abs=0.012)


def test_a_paired_ranking_difference_is_that_of_both_models_on_each_resample():
    from finetune.metrics.intervals import metric_intervals, paired_differences

    ref, probs = _probabilities(400, 2, seed=13, skill=1.0)
    noise = np.random.default_rng(14).normal(scale=0.05, size=len(ref))
    other = np.clip(probs + np.stack([-noise, noise], axis=1), 0, 1)  # a model that ranks almost alike
    pred, other_pred = probs.argmax(axis=1), other.argmax(axis=1)
    suite = MetricSuite(NAMES, 2, "binary", pos_label=1)
    differences = paired_differences(suite, pred, other_pred, ref, scores=probs, other_scores=other)
    this, that = metric_intervals(suite, pred, ref, scores=probs), metric_intervals(suite, other_pred, ref,
                                                                                   scores=other)
    rng = np.random.default_rng(15)
    resampled = []
    for _ in range(1000):
        rows = rng.integers(0, len(ref), len(ref))
        resampled.append(skm.roc_auc_score(ref[rows], probs[rows, 1]) - skm.roc_auc_score(ref[rows], other[rows, 1]))
    assert differences["roc_auc"] == pytest.approx(np.quantile(resampled, [0.025, 0.975]).tolist(), abs=0.004)
    for name, (low, high) in differences.items():
        unpaired = np.hypot(this[name][1] - this[name][0], that[name][1] - that[name][0])
        assert high - low < 0.5 * unpaired, name
    assert paired_differences(suite, pred, pred, ref, scores=probs, other_scores=probs) == {
        name: [0.0, 0.0] for name in NAMES}


def test_past_so_many_text_label_pairs_a_ranking_metric_gets_no_interval(monkeypatch):
    import finetune.metrics.intervals as intervals

    ref, probs = _probabilities(300, 3, seed=2)
    suite = MetricSuite(["accuracy", "roc_auc"], 3, "macro")
    assert set(intervals.metric_intervals(suite, probs.argmax(axis=1), ref, scores=probs)) == {"accuracy", "roc_auc"}
    monkeypatch.setattr(intervals, "MOST_PAIRS_FOR_AN_INTERVAL", 899)  # 300 texts x 3 classes
    assert set(intervals.metric_intervals(suite, probs.argmax(axis=1), ref, scores=probs)) == {"accuracy"}
    # a binary average ranks the positive class's column alone: 300 pairs
    ref, probs = ref % 2, np.stack([probs[:, 0], 1 - probs[:, 0]], axis=1)
    binary = MetricSuite(["accuracy", "roc_auc"], 2, "binary", pos_label=1)
    assert set(intervals.metric_intervals(binary, probs.argmax(axis=1), ref, scores=probs)) == {"accuracy", "roc_auc"}
    monkeypatch.setattr(intervals, "MOST_PAIRS_FOR_AN_INTERVAL", 299)
    assert set(intervals.metric_intervals(binary, probs.argmax(axis=1), ref, scores=probs)) == {"accuracy"}


@pytest.mark.parametrize("tuned", [None, "macro"])
def test_an_evaluation_ranks_each_labels_probabilities_with_thresholds_tuned_or_not(tuned):
    """A multi-label evaluation whose thresholds are tuned gathers the probabilities once, for both uses."""
    import torch
    from accelerate import Accelerator
    from types import SimpleNamespace

    from finetune.evaluation import evaluation_of
    from finetune.tasks import Task
    from tiny_run import reset_accelerate

    rng = np.random.default_rng(9)
    labels = (rng.random((60, 3)) < 0.4).astype(np.float32)
    logits = torch.from_numpy((rng.normal(size=(60, 3)) + 1.5 * labels).astype(np.float32))

    class Fixed(torch.nn.Module):  # the logits of the texts a batch names by its input_ids
        config = SimpleNamespace()  # where tuned thresholds are kept

        def forward(self, input_ids):
            return SimpleNamespace(logits=logits[input_ids[:, 0]])

    batches = [{"input_ids": torch.arange(i, i + 20)[:, None], "labels": torch.from_numpy(labels[i:i + 20])}
               for i in range(0, 60, 20)]
    reset_accelerate()
    suite = MultiLabelMetrics(["f1", *NAMES], 3, "macro")
    evaluation = evaluation_of(Fixed(), batches, Accelerator(cpu=True), suite,
                               Task("multi_label", tune_thresholds=tuned), labels=["a", "b", "c"])
    reset_accelerate()
    probs = torch.sigmoid(logits).numpy()
    for name in NAMES:
        assert evaluation.metrics[name] == pytest.approx(SKLEARN[name](labels, probs, average="macro"), abs=1e-6)
        for i, label in enumerate("abc"):
            assert evaluation.by_label[label][name] == pytest.approx(SKLEARN[name](labels[:, i], probs[:, i]), abs=1e-6)
    assert (evaluation.thresholds is not None) == bool(tuned)


@pytest.fixture(scope="module")
def ranked_run(tmp_path_factory):
    from tiny_run import fit_tiny_run

    root = tmp_path_factory.mktemp("ranked")
    cfg, summary = fit_tiny_run(root, evaluation={
        "metrics": ["accuracy", "f1", "roc_auc", "average_precision"], "metric_for_best_model": "roc_auc",
        "load_best_model_at_end": True, "eval_every": 5})
    return root / "out", cfg, summary


def _validation_probabilities(out, cfg):
    import torch

    from finetune.predict import Predictor
    from tiny_run import reset_accelerate

    reset_accelerate()
    predictor = Predictor.load(out)
    rows = [line.split("\t") for line in open(cfg.data.validation_file, encoding="utf-8").read().splitlines()]
    logits = torch.from_numpy(predictor.logits([text for _, text in rows], None))
    spam = [label == "spam" for label, _ in rows]
    return predictor, np.asarray(spam), torch.softmax(logits, dim=-1).numpy()[:, predictor.labels.index("spam")]


def test_a_run_scores_selects_and_keeps_its_best_model_by_roc_auc(ranked_run):
    out, cfg, summary = ranked_run
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    evaluations = [json.loads(line) for line in (out / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
                   if '"eval/roc_auc"' in line]
    assert len(evaluations) > 2
    best = max(evaluations, key=lambda record: record["eval/roc_auc"])
    assert metrics["best"]["step"] == best["step"] and metrics["eval"]["roc_auc"] == best["eval/roc_auc"]
    # the saved (best) model's probabilities of the validation texts give those values, as scikit-learn ranks them
    _, spam, probability = _validation_probabilities(out, cfg)
    assert metrics["eval"]["roc_auc"] == pytest.approx(skm.roc_auc_score(spam, probability), abs=1e-6)
    assert metrics["eval"]["average_precision"] == pytest.approx(skm.average_precision_score(spam, probability),
                                                                 abs=1e-6)
    for name in NAMES:
        low, high = metrics["eval_intervals"][name]
        assert low <= metrics["eval"][name] <= high
    # the binary average is the positive class's own ranking, which the label's scores hold
    assert metrics["eval_by_label"]["spam"]["roc_auc"] == metrics["eval"]["roc_auc"]
    assert metrics["eval_by_label"]["ham"]["roc_auc"] == pytest.approx(skm.roc_auc_score(~spam, 1 - probability),
                                                                       abs=1e-6)
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "| label | precision | recall | F1 | support | roc_auc | average_precision |" in card


def test_score_and_a_comparison_rank_the_files_texts_as_the_run_did(ranked_run, capsys):
    from finetune.comparison import compare
    from finetune.score import score_file

    out, cfg, _ = ranked_run
    predictor, spam, probability = _validation_probabilities(out, cfg)
    result = score_file(out, cfg.data.validation_file, predictor=predictor, count_seen=False)
    assert result.metrics["roc_auc"] == pytest.approx(skm.roc_auc_score(spam, probability), abs=1e-6)
    assert set(result.intervals) == {"accuracy", "f1", *NAMES}
    from finetune.score_tables import format_by_label

    table = format_by_label(result.by_label).splitlines()
    assert table[1].split() == ["label", "precision", "recall", "f1", "support", "predicted", "roc_auc",
                                "avg_precision"]
    assert float(table[3].split()[6]) == pytest.approx(result.by_label["spam"]["roc_auc"], abs=5e-5)
    itself = compare(result, predictor, str(out), result.suite)
    assert itself.differences == {name: 0.0 for name in ["accuracy", "f1", *NAMES]}
    assert itself.intervals == {name: [0.0, 0.0] for name in ["accuracy", "f1", *NAMES]}
