"""The built-in metrics against scikit-learn, and their loading through evaluate.

scikit-learn is the oracle here only; the package computes the metrics with
numpy (finetune/metrics/_classification.py).
"""

from __future__ import annotations

import functools
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import evaluate
import evaluate.config
import numpy as np
import pytest
from sklearn import metrics as skm

from finetune.config import EvalConfig
from finetune.errors import ConfigError
from finetune.metrics import BUILTIN_METRICS, MetricSuite, builtin_metric_path

TOL = 1e-12


def sklearn_scores(pred, ref, average, pos_label=None, labels=None):
    """The five built-in metrics, as scikit-learn computes them."""
    kw = {"average": average, "zero_division": 0}
    if average == "binary":
        kw["pos_label"] = pos_label
    else:
        kw["labels"] = labels
    return {
        "accuracy": skm.accuracy_score(ref, pred),
        "f1": skm.f1_score(ref, pred, **kw),
        "precision": skm.precision_score(ref, pred, **kw),
        "recall": skm.recall_score(ref, pred, **kw),
        "matthews_correlation": skm.matthews_corrcoef(ref, pred),
    }


@functools.cache
def all_metrics_suite(num_labels, average, pos_label):
    # Shared between tests, which also checks that a suite can compute repeatedly.
    return MetricSuite(list(BUILTIN_METRICS), num_labels, average=average, pos_label=pos_label)


def suite_scores(pred, ref, num_labels, average, pos_label=None):
    suite = all_metrics_suite(num_labels, average, pos_label)
    # Any warning (zero division included) fails the test.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return suite.compute(pred, ref)


def assert_matches(got, expected):
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert type(got[key]) is float, key
        assert got[key] == pytest.approx(value, abs=TOL, rel=0), key


@pytest.fixture
def no_network(monkeypatch):
    """Offline mode on, and any connection attempt fails at once."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    # evaluate reads HF_EVALUATE_OFFLINE once, at import; without it, a Hub
    # lookup retries with sleeps (1.5 s per unknown name) before failing.
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("pos_label", [0, 1])
def test_binary_matches_sklearn(pos_label):
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 2, 200)
    # Skewed predictions, so that the two pos_label values give different scores.
    pred = np.where(rng.random(200) < 0.7, ref, 1 - ref) * (rng.random(200) < 0.8)
    expected = sklearn_scores(pred, ref, "binary", pos_label=pos_label)
    assert_matches(suite_scores(pred, ref, 2, "binary", pos_label=pos_label), expected)


def test_binary_pos_label_changes_the_scores():
    ref = np.array([0, 0, 0, 1, 1, 1, 1, 0])
    pred = np.array([0, 1, 1, 1, 1, 1, 0, 0])
    zero = suite_scores(pred, ref, 2, "binary", pos_label=0)
    one = suite_scores(pred, ref, 2, "binary", pos_label=1)
    assert zero["precision"] != one["precision"]
    assert one == pytest.approx({"accuracy": 0.625, "f1": 2 / 3, "precision": 0.6, "recall": 0.75,
                                 "matthews_correlation": skm.matthews_corrcoef(ref, pred)}, abs=TOL)


@pytest.mark.parametrize("average", ["macro", "micro", "weighted"])
@pytest.mark.parametrize("num_labels", [3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_multiclass_matches_sklearn(average, num_labels, seed):
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, num_labels, 300)
    # Better than chance, and with unequal classes, so that the averages differ.
    pred = np.where(rng.random(300) < 0.5, ref, rng.integers(0, num_labels, 300) // 2)
    labels = list(range(num_labels))
    expected = sklearn_scores(pred, ref, average, labels=labels)
    assert_matches(suite_scores(pred, ref, num_labels, average), expected)


@pytest.mark.parametrize("kind", ["class ids", "label vectors"])
def test_scores_by_label_match_sklearn_label_by_label(kind):
    from finetune.metrics import scores_by_label

    rng = np.random.default_rng(5)
    if kind == "class ids":
        # label 3 is never predicted (precision 0/0) and label 4 is in neither array (every score 0/0)
        ref = rng.integers(0, 4, 200)
        pred = np.where(rng.random(200) < 0.6, ref, rng.integers(0, 3, 200))
        pred[pred == 3] = 0
    else:
        ref = rng.random((200, 5)) < 0.3
        pred = np.where(rng.random((200, 5)) < 0.7, ref, rng.random((200, 5)) < 0.5)
        ref[:, 4], pred[:, 3] = False, False
    names = ["a", "b", "c", "d", "e"]
    by_name = scores_by_label(pred, ref, names)
    assert list(by_name) == names
    got = {key: [by_name[name][key] for name in names] for key in ("precision", "recall", "f1", "support")}
    precision, recall, f1, support = skm.precision_recall_fscore_support(
        ref, pred, labels=list(range(5)) if kind == "class ids" else None, average=None, zero_division=0)
    np.testing.assert_allclose(got["precision"], precision, atol=TOL)
    np.testing.assert_allclose(got["recall"], recall, atol=TOL)
    np.testing.assert_allclose(got["f1"], f1, atol=TOL)
    assert got["support"] == support.tolist()
    assert got["precision"][3] == 0.0 and got["support"][4] == 0 and got["f1"][4] == 0.0
    # the texts the model gave each label, beside those that have it
    given = np.bincount(pred, minlength=5) if kind == "class ids" else pred.sum(0)
    assert [by_name[name]["predicted"] for name in names] == given.tolist()
    # the macro average is the mean of the labels' F1, as the suite computes it
    if kind == "class ids":
        assert np.mean(got["f1"]) == pytest.approx(suite_scores(pred, ref, 5, "macro")["f1"], abs=TOL)


@pytest.mark.parametrize("pred, ref, said", [
    ([0, 0, 0, 0], [0, 1, 0, 1], "predicted 'ham' for every one of the 4 validation texts"),
    ([0, 1, 0, 0], [0, 1, 0, 1], None),  # two answers: it tells texts apart, however badly
    ([1, 1, 1, 1], [1, 1, 1, 1], None),  # the data has one label: one answer is the right one
    ([[0, 0], [0, 0], [0, 0]], [[1, 0], [0, 1], [1, 1]], "gave none of the 3 validation texts any label"),
    ([[1, 1], [1, 1], [1, 1]], [[1, 0], [0, 1], [1, 1]],
     "gave every one of the 3 validation texts the same labels (ham, spam)"),
    ([[1, 0], [1, 0], [0, 0]], [[1, 0], [0, 1], [1, 1]], None),
])
def test_a_model_that_gives_every_text_the_same_answer_is_cautioned(pred, ref, said):
    from finetune.metrics import scores_by_label
    from finetune.evaluation import one_answer_for_every_text

    by_label = scores_by_label(np.asarray(pred), np.asarray(ref), ["ham", "spam"])
    caution = one_answer_for_every_text({"eval": {"num_samples": len(pred)}, "eval_by_label": by_label})
    assert caution == (None if said is None else f"the saved model {said}: its scores are those of answering alike "
                       "whatever the text (a learning rate too high or too low, or too few updates?)")
    assert one_answer_for_every_text({"eval": {"loss": 0.1}, "eval_by_label": None}) is None  # regression


@pytest.mark.parametrize("pred, ref, said", [
    ([2.5, 2.5, 2.5, 2.5], [1.0, 2.0, 3.0, 4.0], "pearson and spearmanr"),  # one number for every text
    ([1.0, 2.0, 2.5, 3.0], [1.0, 2.0, 3.0, 4.0], None),  # numbers that differ
    ([1.0, 2.0, 2.5, 3.0], [3.0, 3.0, 3.0, 3.0], None),  # targets alike: the data's to say, before training
])
def test_a_regression_model_that_gives_every_text_one_number_is_cautioned(pred, ref, said):
    from finetune.metrics.other_tasks import RegressionMetrics
    from finetune.evaluation import one_answer_for_every_text

    scores = RegressionMetrics(["pearson", "spearmanr", "mse"]).compute(pred, ref)
    caution = one_answer_for_every_text({"eval": scores}, targets=ref)
    assert caution == (None if said is None else f"the saved model predicted one number for every one of the 4 "
                       f"validation texts, so its {said} are undefined (nan): its scores are those of answering "
                       f"alike whatever the text (a learning rate too high or too low, or too few updates?)")


def test_validation_targets_all_alike_are_said_to_leave_the_correlations_undefined():
    from finetune.metrics import correlations_over_alike_targets

    said = correlations_over_alike_targets(["pearson", "mse"], [3.0] * 8, "validation rows", "give others")
    assert said == ("the 8 validation rows all have the target 3: pearson over them is undefined (nan) whatever "
                    "the model predicts; give others")
    assert correlations_over_alike_targets(["mse", "mae"], [3.0] * 8, "validation rows") is None  # none computed
    assert correlations_over_alike_targets(["pearson"], [3.0, 3.5], "validation rows") is None


def test_a_run_whose_model_answers_alike_ends_with_the_caution(tmp_path, caplog):
    import logging

    import torch

    from tiny_run import fit_tiny_run

    def certain_of_ham(run):  # a head that says ham whatever the text, and a rate that cannot move it
        head = run.accelerator.unwrap_model(run.model).classifier
        with torch.no_grad():
            head.weight.zero_()
            head.bias.copy_(torch.tensor([50.0, -50.0]))

    with caplog.at_level(logging.WARNING, logger="finetune"):
        _, summary = fit_tiny_run(tmp_path, before_fit=certain_of_ham, training={"max_steps": 2, "num_train_epochs": None},
                                  optim={"learning_rate": 1e-9})
    assert summary["eval_by_label"]["ham"]["predicted"] == summary["eval"]["num_samples"] == 40
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "the saved model predicted 'ham' for every one of the 40 validation texts: its scores are those of answering "
        "alike whatever the text (a learning rate too high or too low, or too few updates?)"]


@pytest.mark.parametrize("average", ["macro", "micro", "weighted"])
def test_class_never_predicted_scores_zero_precision(average):
    ref = np.array([0, 1, 2, 2, 1, 0, 2, 1])
    pred = np.array([0, 1, 1, 0, 1, 0, 1, 1])  # never predicts 2: its precision is 0/0
    expected = sklearn_scores(pred, ref, average, labels=[0, 1, 2])
    assert_matches(suite_scores(pred, ref, 3, average), expected)


@pytest.mark.parametrize("average", ["macro", "micro", "weighted"])
def test_class_absent_from_both_counts_via_labels(average):
    ref = np.array([0, 1, 2, 2, 1, 0, 2, 1, 0])
    pred = np.array([0, 1, 2, 0, 1, 0, 2, 2, 1])  # class 3 appears nowhere
    expected = sklearn_scores(pred, ref, average, labels=[0, 1, 2, 3])
    assert_matches(suite_scores(pred, ref, 4, average), expected)
    if average == "macro":
        # Class 3 pulls the macro average down: without labels= it would be higher.
        assert expected["f1"] < skm.f1_score(ref, pred, average="macro")


@pytest.mark.parametrize("seed", [3, 4])
def test_mcc_multiclass_matches_sklearn(seed):
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, 4, 500)
    pred = np.where(rng.random(500) < 0.4, ref, rng.integers(0, 4, 500))
    got = MetricSuite(["matthews_correlation"], 4).compute(pred, ref)
    assert got == {"matthews_correlation": pytest.approx(skm.matthews_corrcoef(ref, pred), abs=TOL)}
    assert 0.2 < got["matthews_correlation"] < 0.8


@pytest.mark.parametrize("average", ["macro", "micro", "weighted"])
def test_all_correct(average):
    ref = np.array([0, 1, 2, 2, 1, 0, 1])
    got = suite_scores(ref, ref, 3, average)
    assert got == {name: 1.0 for name in BUILTIN_METRICS}
    assert_matches(got, sklearn_scores(ref, ref, average, labels=[0, 1, 2]))


@pytest.mark.filterwarnings("ignore:A single label was found:UserWarning")  # sklearn's, on the oracle side
def test_all_correct_on_one_class_leaves_mcc_undefined():
    ref = np.zeros(5, dtype=int)
    got = suite_scores(ref, ref, 2, "macro")
    assert got["accuracy"] == 1.0 and got["matthews_correlation"] == 0.0
    assert_matches(got, sklearn_scores(ref, ref, "macro", labels=[0, 1]))


@pytest.mark.parametrize("average", ["binary", "macro", "micro", "weighted"])
def test_all_wrong(average):
    ref = np.array([0, 1, 1, 0, 1, 0])
    pred = 1 - ref
    got = suite_scores(pred, ref, 2, average, pos_label=1 if average == "binary" else None)
    assert got == {"accuracy": 0.0, "f1": 0.0, "precision": 0.0, "recall": 0.0, "matthews_correlation": -1.0}
    assert_matches(got, sklearn_scores(pred, ref, average, pos_label=1, labels=[0, 1]))


def test_local_modules_load_offline(no_network):
    ref, pred = [0, 1, 2, 2, 1, 0], [0, 2, 2, 1, 1, 0]
    expected = sklearn_scores(pred, ref, "macro", labels=[0, 1, 2])
    for name in BUILTIN_METRICS:
        script = Path(builtin_metric_path(name))
        assert script.is_file() and script.parent.name == name
        kw = {"average": "macro", "labels": [0, 1, 2]} if name in ("f1", "precision", "recall") else {}
        # Both spellings evaluate accepts for a local module: the directory and the script.
        for path in (str(script.parent), str(script)):
            module = evaluate.load(path, keep_in_memory=True, **kw)
            assert isinstance(module, evaluate.Metric)
            result = module.compute(predictions=pred, references=ref)
            assert result == {name: pytest.approx(expected[name], abs=TOL)}
    assert_matches(MetricSuite(list(BUILTIN_METRICS), 3).compute(pred, ref), expected)


def test_module_kwargs_at_compute_override_load_time_defaults(no_network):
    ref, pred = [0, 1, 2, 2, 1, 0, 1], [0, 2, 2, 1, 1, 0, 0]
    f1 = evaluate.load(builtin_metric_path("f1"), keep_in_memory=True, average="macro", labels=[0, 1, 2, 3])
    assert f1.compute(predictions=pred, references=ref)["f1"] == pytest.approx(
        skm.f1_score(ref, pred, average="macro", labels=[0, 1, 2, 3], zero_division=0), abs=TOL
    )
    assert f1.compute(predictions=pred, references=ref, average="weighted", labels=[0, 1, 2])["f1"] == (
        pytest.approx(skm.f1_score(ref, pred, average="weighted"), abs=TOL)
    )


def test_local_modules_combine(no_network):
    ref, pred = [1, 0, 1, 1, 0], [1, 1, 1, 0, 0]
    modules = [
        evaluate.load(builtin_metric_path(name), keep_in_memory=True, average="binary", pos_label=1)
        if name in ("f1", "precision", "recall")
        else evaluate.load(builtin_metric_path(name), keep_in_memory=True)
        for name in BUILTIN_METRICS
    ]
    # No averaging kwargs at compute: combine would hand them to accuracy and MCC too.
    got = evaluate.combine(modules).compute(predictions=pred, references=ref)
    assert_matches(got, sklearn_scores(pred, ref, "binary", pos_label=1))


def test_suite_computes_through_evaluate_combine(monkeypatch):
    calls = []
    real_combine = evaluate.combine

    def spy(evaluations, **kwargs):
        calls.append(evaluations)
        return real_combine(evaluations, **kwargs)

    monkeypatch.setattr(evaluate, "combine", spy)
    names = ["recall", "accuracy", "matthews_correlation"]
    suite = MetricSuite(names, 3, average="micro")
    assert len(calls) == 1 and list(calls[0]) == names
    assert all(isinstance(module, evaluate.Metric) for module in calls[0].values())
    got = suite.compute([0, 1, 2, 1], [0, 1, 1, 1])
    assert list(got) == names
    # Loaded once: computing again reuses the same modules.
    assert suite.compute([0, 1, 2, 1], [0, 1, 1, 1]) == got and len(calls) == 1


def test_unknown_metric_is_a_one_line_config_error(no_network):
    with pytest.raises(ConfigError) as info:
        MetricSuite(["accuracy", "acuracy"], 3)
    message = str(info.value)
    assert "evaluation.metrics" in message and "'acuracy'" in message
    assert "did you mean 'accuracy'" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match=r"evaluation\.metrics.*'no_such_score_xyz'") as info:
        MetricSuite(["no_such_score_xyz"], 3)
    assert "did you mean" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^evaluation\.metrics: cannot load metric '/'$"):  # evaluate: IndexError
        MetricSuite(["/"], 3)


@pytest.mark.parametrize("names", [[""], ["accuracy", " "]])
def test_an_empty_metric_name_is_refused_with_the_config(names):
    with pytest.raises(ConfigError, match=r"^evaluation\.metrics: an empty name in \["):
        EvalConfig(metrics=names)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"names": [], "num_labels": 2}, "evaluation.metrics"),
        ({"names": ["f1", "f1"], "num_labels": 2}, "evaluation.metrics"),
        ({"names": ["f1"], "num_labels": 2, "average": "samples"}, "evaluation.average"),
        ({"names": ["f1"], "num_labels": 2, "average": "binary"}, "evaluation.positive_label"),
        ({"names": ["f1"], "num_labels": 3, "average": "binary", "pos_label": 1}, "evaluation.average"),
    ],
)
def test_bad_settings_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MetricSuite(**kwargs)


def test_bad_inputs_are_rejected():
    suite = MetricSuite(["accuracy"], 3)
    with pytest.raises(ValueError, match="outside"):
        suite.compute([0, 3], [0, 1])
    with pytest.raises(ValueError, match="length"):
        suite.compute([0, 1], [0, 1, 2])
    with pytest.raises(ValueError, match="integer"):
        suite.compute([0.5, 1.0], [0, 1])


def test_import_is_light():
    code = "import sys, finetune.metrics; assert not {'evaluate', 'torch', 'sklearn'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- bootstrap intervals

def _noisy_labels(n: int, num_labels: int, right: float, seed: int):
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, num_labels, n)
    pred = np.where(rng.random(n) < right, ref, rng.integers(0, num_labels, n))
    return pred, ref


@pytest.mark.parametrize("average, num_labels", [("binary", 2), ("macro", 4), ("micro", 4), ("weighted", 4)])
def test_the_scores_from_tallies_are_the_suites_at_the_observed_matrix(average, num_labels):
    from finetune.metrics.intervals import confusion_matrix, scores_of_tallies, tallies_of

    pred, ref = _noisy_labels(300, num_labels, 0.6, seed=num_labels)
    ref[:3] = num_labels - 1  # every class present
    suite = MetricSuite(list(BUILTIN_METRICS), num_labels, average, pos_label=1 if average == "binary" else None)
    scores = scores_of_tallies(*tallies_of(confusion_matrix(ref, pred, num_labels)[None]), list(BUILTIN_METRICS),
                               average, suite.pos_label)
    expected = suite.compute(pred, ref)
    assert set(scores) == set(expected)
    for name, values in scores.items():
        assert values.shape == (1,) and values[0] == pytest.approx(expected[name], abs=TOL), name


def test_an_interval_is_the_spread_of_resampled_texts():
    from finetune.metrics import _classification
    from finetune.metrics.intervals import metric_intervals

    pred, ref = _noisy_labels(2000, 2, 0.8, seed=1)
    suite = MetricSuite(["accuracy", "f1", "matthews_correlation"], 2, "binary", pos_label=1)
    observed = suite.compute(pred, ref)
    state = np.random.get_state()
    intervals = metric_intervals(suite, pred, ref)
    assert np.random.get_state()[1].tolist() == state[1].tolist()  # a generator of its own: no global draw
    assert metric_intervals(suite, pred, ref) == intervals  # seeded: the same predictions, the same interval
    for name, (low, high) in intervals.items():
        assert low < observed[name] < high, name
    # accuracy's spread is the binomial's: 1.96 standard errors either side
    p = observed["accuracy"]
    half = 1.96 * np.sqrt(p * (1 - p) / len(ref))
    low, high = intervals["accuracy"]
    assert (high - low) / 2 == pytest.approx(half, rel=0.15)
    # the matrix's cells drawn from a multinomial are the texts resampled one by one: the same F1 quantiles
    rng = np.random.default_rng(7)
    resampled = []
    for _ in range(1000):
        rows = rng.integers(0, len(ref), len(ref))
        resampled.append(_classification.precision_recall_f1(pred[rows], ref[rows], "binary", pos_label=1)[2])
    assert intervals["f1"] == pytest.approx(np.quantile(resampled, [0.025, 0.975]).tolist(), abs=0.006)
    # four times the texts: half the width
    wide = intervals["f1"][1] - intervals["f1"][0]
    pred4, ref4 = _noisy_labels(8000, 2, 0.8, seed=1)
    narrow = metric_intervals(suite, pred4, ref4)["f1"]
    assert (narrow[1] - narrow[0]) == pytest.approx(wide / 2, rel=0.2)


def test_a_negative_bound_is_not_joined_by_a_dash_that_reads_as_a_minus():
    from finetune.metrics import scores_in_a_line

    line = scores_in_a_line({"loss": 1.25, "matthews_correlation": -0.0041, "f1": 0.5, "num_samples": 223},
                            {"matthews_correlation": [-0.0116, 0.0025], "f1": [0.4, 0.6]})
    assert line == "loss=1.2500 matthews_correlation=-0.0041 (-0.0116 to 0.0025) f1=0.5000 (0.4000-0.6000)"


def test_a_metric_not_computed_from_counts_gets_no_interval():
    from finetune.metrics.intervals import metric_intervals

    class Suite:  # a suite with one built-in metric and one evaluate loads (no confusion-matrix form known)
        names, num_labels, average, pos_label = ["f1", "bleu"], 3, "macro", None

    pred, ref = _noisy_labels(100, 3, 0.7, seed=2)
    assert set(metric_intervals(Suite(), pred, ref)) == {"f1"}
    Suite.names = ["bleu"]
    assert metric_intervals(Suite(), pred, ref) == {}


def test_resampled_tallies_draw_the_cells_that_hold_texts_and_keep_the_texts_count():
    from finetune.metrics.intervals import confusion_matrix, resampled, tallies_of, tallies_of_draws

    pred, ref = _noisy_labels(500, 1000, 0.9, seed=3)  # a thousand labels, most of them with no text
    observed = confusion_matrix(ref, pred, 1000)
    cells = np.flatnonzero(observed)
    true_of, predicted_of = np.divmod(cells, 1000)
    batches = [tallies_of_draws(draws, true_of, predicted_of, 1000)
               for draws in resampled(observed.ravel()[cells], resamples=250, seed=0, chunk=100)]
    assert [len(hits) for hits, _, _ in batches] == [100, 100, 50]
    hits, predicted, true = (np.concatenate(parts) for parts in zip(*batches))
    assert (true.sum(axis=1) == 500).all() and (predicted.sum(axis=1) == 500).all() and (hits <= true).all()
    never = np.flatnonzero(observed.sum(axis=1) == 0)
    assert len(never) > 0 and (true[:, never] == 0).all()  # a class without a text is never drawn
    # on average a resample's tallies are the observed ones
    observed_tallies = tallies_of(observed[None])
    for drawn, seen in zip((hits, predicted, true), observed_tallies):
        assert drawn.mean(axis=0) == pytest.approx(seen[0], abs=0.5)


def test_a_paired_difference_shares_the_texts_doubt():
    from finetune.metrics import _classification
    from finetune.metrics.intervals import metric_intervals, paired_differences

    # two models that agree on most texts and differ on a few: each one's interval is wide, their difference's
    # narrow, since a resample that holds hard texts holds them for both
    pred, ref = _noisy_labels(2000, 2, 0.8, seed=5)
    rng = np.random.default_rng(6)
    other = np.where(rng.random(len(ref)) < 0.03, 1 - pred, pred)
    suite = MetricSuite(["accuracy", "f1"], 2, "binary", pos_label=1)
    differences = paired_differences(suite, pred, other, ref)
    this, that = metric_intervals(suite, pred, ref), metric_intervals(suite, other, ref)
    observed = {name: suite.compute(pred, ref)[name] - suite.compute(other, ref)[name] for name in differences}
    for name, (low, high) in differences.items():
        assert low <= observed[name] <= high, name
        # half the width two independent intervals would give the difference
        unpaired = np.hypot(this[name][1] - this[name][0], that[name][1] - that[name][0])
        assert high - low < 0.5 * unpaired, name
    # the same as resampling the texts one by one, both models on each resample
    resampled_differences = []
    for _ in range(1000):
        rows = rng.integers(0, len(ref), len(ref))
        resampled_differences.append(_classification.accuracy(pred[rows], ref[rows])
                                     - _classification.accuracy(other[rows], ref[rows]))
    assert differences["accuracy"] == pytest.approx(np.quantile(resampled_differences, [0.025, 0.975]).tolist(),
                                                    abs=0.002)
    assert paired_differences(suite, pred, pred, ref) == {"accuracy": [0.0, 0.0], "f1": [0.0, 0.0]}


@pytest.mark.parametrize("average", ["micro", "macro", "weighted"])
def test_a_multi_label_interval_is_the_spread_of_resampled_texts(average):
    from finetune.metrics.intervals import metric_intervals
    from finetune.metrics.other_tasks import MultiLabelMetrics

    rng = np.random.default_rng(4)
    ref = rng.random((600, 5)) < 0.3
    pred = np.where(rng.random((600, 5)) < 0.85, ref, ~ref)
    suite = MultiLabelMetrics(["accuracy", "f1", "precision", "recall"], 5, average)
    observed = suite.compute(pred, ref)
    intervals = metric_intervals(suite, pred, ref)
    assert set(intervals) == set(observed)
    for name, (low, high) in intervals.items():
        assert low < observed[name] < high, name
    # the label-set pairs drawn from a multinomial are the texts resampled one by one
    resampled = []
    for _ in range(1000):
        rows = rng.integers(0, len(ref), len(ref))
        resampled.append(suite.compute(pred[rows], ref[rows])["f1"])
    assert intervals["f1"] == pytest.approx(np.quantile(resampled, [0.025, 0.975]).tolist(), abs=0.008)
    # subset accuracy's spread is the binomial's
    p = observed["accuracy"]
    assert (intervals["accuracy"][1] - intervals["accuracy"][0]) / 2 == pytest.approx(
        1.96 * np.sqrt(p * (1 - p) / len(ref)), rel=0.15)


def test_weighted_ranks_are_the_ranks_of_the_values_written_out_that_many_times():
    from scipy.stats import rankdata

    from finetune.metrics.other_tasks import _weighted_ranks

    rng = np.random.default_rng(8)
    x = rng.integers(0, 6, 40).astype(float)  # many ties
    weights = rng.integers(0, 4, (3, 40)).astype(float)
    ranks = _weighted_ranks(x, weights)
    for row, w in zip(ranks, weights):
        written_out = np.repeat(x, w.astype(int))
        expected = rankdata(written_out, method="average")
        # each value's rank is that of its copies
        assert row[w > 0] == pytest.approx(expected[np.cumsum(w.astype(int))[w > 0] - 1])


def test_a_regression_interval_is_the_spread_of_resampled_texts():
    from finetune.metrics.intervals import metric_intervals
    from finetune.metrics.other_tasks import RegressionMetrics

    rng = np.random.default_rng(9)
    ref = rng.normal(size=800)
    pred = ref + rng.normal(scale=0.6, size=800)
    suite = RegressionMetrics(["pearson", "spearmanr", "mse", "mae"])
    observed = suite.compute(pred, ref)
    intervals = metric_intervals(suite, pred, ref)
    assert set(intervals) == set(observed)
    resampled = {name: [] for name in observed}
    for _ in range(1000):
        rows = rng.integers(0, len(ref), len(ref))
        for name, value in suite.compute(pred[rows], ref[rows]).items():
            resampled[name].append(value)
    for name, (low, high) in intervals.items():
        assert low < observed[name] < high, name
        expected = np.quantile(resampled[name], [0.025, 0.975])
        width = expected[1] - expected[0]
        assert [low, high] == pytest.approx(expected.tolist(), abs=0.1 * width), name
    # a constant prediction leaves the correlations undefined: no interval for them, the errors keep theirs
    constant = metric_intervals(suite, np.zeros(800), ref)
    assert set(constant) == {"mse", "mae"}


def test_paired_differences_of_label_sets_and_numbers_are_those_of_resampled_texts():
    from finetune.metrics.intervals import paired_differences
    from finetune.metrics.other_tasks import MultiLabelMetrics, RegressionMetrics

    rng = np.random.default_rng(12)
    ref = rng.random((500, 4)) < 0.3
    this = np.where(rng.random((500, 4)) < 0.85, ref, ~ref)
    other = np.where(rng.random((500, 4)) < 0.05, ~this, this)
    targets = rng.normal(size=500)
    close, closer = targets + rng.normal(scale=0.6, size=500), targets + rng.normal(scale=0.5, size=500)
    for suite, a, b, truth in ((MultiLabelMetrics(["accuracy", "f1"], 4, "macro"), this, other, ref),
                               (RegressionMetrics(["pearson", "spearmanr", "mse"]), close, closer, targets)):
        differences = paired_differences(suite, a, b, truth)
        assert set(differences) == set(suite.names)
        resampled = {name: [] for name in suite.names}
        for _ in range(1000):
            rows = rng.integers(0, len(truth), len(truth))
            first, second = suite.compute(a[rows], truth[rows]), suite.compute(b[rows], truth[rows])
            for name in suite.names:
                resampled[name].append(first[name] - second[name])
        observed = {name: suite.compute(a, truth)[name] - suite.compute(b, truth)[name] for name in suite.names}
        for name, (low, high) in differences.items():
            assert low <= observed[name] <= high, name
            expected = np.quantile(resampled[name], [0.025, 0.975])
            assert [low, high] == pytest.approx(expected.tolist(), abs=0.12 * (expected[1] - expected[0])), name
        assert all(v == [0.0, 0.0] for v in paired_differences(suite, a, a, truth).values())


def test_an_average_that_counts_a_class_the_texts_lack_as_zero_is_cautioned_of_and_its_ceiling_is_the_metrics():
    """Macro averages over every class: one no text has scores 0 whatever the model predicts, so a perfect model
    scores (C - absent) / C, the ceiling the caution names; binary scores the positive class alone; micro and
    weighted weigh a class by its texts, and a perfect model scores 1 under them (no caution)."""
    from finetune.metrics import averaged_over_absent_labels
    from finetune.metrics.other_tasks import MultiLabelMetrics

    references = [0, 0, 2, 2, 0]  # no text of class 'b'
    support = dict(zip(["a", "b", "c"], np.bincount(references, minlength=3).tolist()))
    said = averaged_over_absent_labels(["accuracy", "f1", "recall"], "macro", None, support, "validation row")
    assert said == ("no validation row has the class 'b': the macro average of f1 and recall counts it as 0 among "
                    "the 3 classes, so it reaches at most 0.67 whatever the model predicts")
    perfect = MetricSuite(["f1", "recall"], 3, average="macro").compute(references, references)
    assert perfect["f1"] == perfect["recall"] == pytest.approx(2 / 3)
    for average in ("micro", "weighted"):
        assert averaged_over_absent_labels(["f1", "precision", "recall"], average, None, support, "row") is None
        suite = MetricSuite(["f1", "precision", "recall"], 3, average=average)
        assert suite.compute(references, references) == pytest.approx({"f1": 1.0, "precision": 1.0, "recall": 1.0})
    assert averaged_over_absent_labels(["accuracy"], "macro", None, support, "row") is None
    assert averaged_over_absent_labels(["f1"], "macro", None, {"a": 2, "b": 1, "c": 2}, "row") is None
    # two classes scored on the positive one: its absence is what matters
    assert averaged_over_absent_labels(["f1", "precision", "recall"], "binary", "spam", {"ham": 4, "spam": 0},
                                       "text of held_out.csv") == (
        "no text of held_out.csv has the positive class 'spam': its f1, precision and recall are 0 whatever the "
        "model predicts")
    binary = MetricSuite(["f1", "precision", "recall"], 2, average="binary", pos_label=1)
    assert binary.compute([0, 0, 0], [0, 0, 0]) == {"f1": 0.0, "precision": 0.0, "recall": 0.0}
    assert averaged_over_absent_labels(["f1"], "binary", "spam", {"ham": 0, "spam": 4}, "row") is None
    assert averaged_over_absent_labels(["f1"], "binary", "spam", {"ham": 4, "spam": 0}, "row") == (
        "no row has the positive class 'spam': its f1 is 0 whatever the model predicts")
    # several labels per text, macro over the labels: two of three without a text
    sets = np.array([[1, 0, 0], [1, 0, 0]])
    label_support = dict(zip(["x", "y", "z"], sets.sum(0).tolist()))
    assert averaged_over_absent_labels(["f1"], "macro", None, label_support, "validation row", labels=True) == (
        "no validation row has the labels 'y', 'z': the macro average of f1 counts each as 0 among the 3 labels, "
        "so it reaches at most 0.33 whatever the model predicts")
    assert MultiLabelMetrics(["f1"], 3, "macro").compute(sets, sets)["f1"] == pytest.approx(1 / 3)
    assert averaged_over_absent_labels(["f1"], "micro", None, label_support, "row", labels=True) is None


def test_the_averaging_is_said_in_words_for_the_metrics_that_average():
    """What `finetune score` prints beside a file's count, so that an F1 says whose it is: a two-class run's positive
    class, or the average; nothing where no averaged metric is computed, or for regression."""
    from finetune.metrics import averaging_in_words
    from finetune.metrics.other_tasks import MultiLabelMetrics, RegressionMetrics

    names = ["ham", "spam"]
    assert averaging_in_words(MetricSuite(["accuracy", "f1", "recall"], 2, "binary", pos_label=1), names) == \
        "f1, recall: of 'spam'"
    assert averaging_in_words(MetricSuite(["f1"], 2, "binary", pos_label=0), names) == "f1: of 'ham'"
    assert averaging_in_words(MetricSuite(["precision", "f1"], 3, "macro"), ["a", "b", "c"]) == \
        "precision, f1: macro average"
    assert averaging_in_words(MultiLabelMetrics(["accuracy", "f1"], 3, "micro"), ["a", "b", "c"]) == \
        "f1: micro average"
    assert averaging_in_words(MetricSuite(["accuracy", "matthews_correlation"], 2, "binary", pos_label=1),
                              names) is None
    assert averaging_in_words(RegressionMetrics(["mse", "pearson"]), ["score"]) is None
