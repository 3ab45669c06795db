"""A multi-label model's thresholds (finetune.thresholds): the F1 they maximise, checked against trying every one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from finetune.tasks import Task, label_thresholds, model_thresholds, set_model_thresholds
from finetune.thresholds import DEFAULT_THRESHOLD, f1_thresholds


def _f1(hits, predicted, positives) -> float:
    return 2.0 * hits / (predicted + positives) if predicted + positives else 0.0


def _every_threshold(p: np.ndarray) -> list[float]:
    """Thresholds that give every distinct prediction of ``p > t``: each probability, and 0."""
    return sorted({0.0, *p.tolist()})


def _scores(probabilities, references, thresholds):
    """Each label's F1 and the pooled (micro) F1 at ``thresholds``, predicting ``p > t``."""
    predicted = probabilities > np.asarray(thresholds, dtype=np.float32)
    hits, given, positives = (predicted & references).sum(0), predicted.sum(0), references.sum(0)
    return [_f1(h, g, p) for h, g, p in zip(hits, given, positives)], _f1(hits.sum(), given.sum(), positives.sum())


def _texts(seed: int, texts: int, labels: int, decimals: int = 2):
    """Probabilities rounded to ``decimals`` (so that texts share them) loosely tied to their 0/1 labels."""
    rng = np.random.default_rng(seed)
    references = rng.random((texts, labels)) < rng.uniform(0.05, 0.5, labels)
    logits = rng.normal(0, 1.5, (texts, labels)) + 1.2 * references - 1.0
    return np.round(1 / (1 + np.exp(-logits)), decimals).astype(np.float32), references


@pytest.mark.parametrize("seed", range(6))
def test_each_labels_threshold_gives_the_best_f1_any_threshold_gives(seed):
    probabilities, references = _texts(seed, texts=60, labels=4)
    chosen = f1_thresholds(probabilities, references, "macro")
    own, _ = _scores(probabilities, references, chosen)
    for j in range(4):
        p, y = probabilities[:, j], references[:, j]
        best = max(_f1((p > t)[y].sum(), (p > t).sum(), y.sum()) for t in _every_threshold(p))
        assert own[j] == pytest.approx(best, abs=1e-12)
    # the weighted average is the same sum of the labels' own F1s, so it takes the same thresholds
    assert np.array_equal(f1_thresholds(probabilities, references, "weighted"), chosen)
    # and none is below 0.5's, label by label
    at_half, _ = _scores(probabilities, references, [DEFAULT_THRESHOLD] * 4)
    assert all(a >= b - 1e-12 for a, b in zip(own, at_half))


@pytest.mark.parametrize("seed", range(6))
def test_the_micro_thresholds_rise_from_halfs_f1_to_one_no_single_label_can_better(seed):
    probabilities, references = _texts(seed, texts=40, labels=3, decimals=1)
    chosen = f1_thresholds(probabilities, references, "micro")
    _, pooled = _scores(probabilities, references, chosen)
    assert pooled >= _scores(probabilities, references, [DEFAULT_THRESHOLD] * 3)[1]
    # no one label's threshold, of all it could take, raises the pooled F1
    for j in range(3):
        for t in _every_threshold(probabilities[:, j]):
            moved = chosen.copy()
            moved[j] = t
            assert _scores(probabilities, references, moved)[1] <= pooled + 1e-12
    # with few values, every combination can be tried: the search ends at the best of all or within 0.05 of it
    grids = [_every_threshold(probabilities[:, j]) for j in range(3)]
    best = max(_scores(probabilities, references, combo)[1] for combo in itertools.product(*grids))
    assert pooled >= best - 0.05


def test_ties_go_to_the_threshold_nearest_the_default_and_a_label_without_texts_keeps_it():
    # top 1 and all 4 give F1 2/3; the cut under 0.9 is nearer 0.5 than the one under 0.1
    probabilities = np.array([[0.9, 0.7], [0.6, 0.2], [0.4, 0.1], [0.1, 0.3]], dtype=np.float32)
    references = np.array([[1, 0], [0, 0], [0, 0], [1, 0]])
    chosen = f1_thresholds(probabilities, references)
    assert chosen[0] == np.float32(0.75)
    assert chosen[1] == DEFAULT_THRESHOLD  # no text has the second label: nothing to tune on
    # texts that share a probability go together: no threshold splits them
    together = f1_thresholds(np.array([[0.7], [0.7], [0.2]], dtype=np.float32), np.array([[1], [0], [0]]))
    assert np.float32(0.2) <= together[0] < np.float32(0.7)


def test_a_threshold_between_neighbouring_floats_splits_them_in_float32_and_float64():
    upper = np.float32(0.5)
    lower = np.nextafter(upper, np.float32(0))
    chosen = f1_thresholds(np.array([[upper], [lower]]), np.array([[1], [0]]))[0]
    assert upper > chosen and not lower > chosen
    assert float(upper) > float(chosen) and not float(lower) > float(chosen)
    # the torch path a run's evaluation and finetune score take predicts as the thresholds were chosen: on logits
    # of many texts (neighbouring probabilities among them), the same texts over each label's threshold
    logits = torch.randn(20000, 3, generator=torch.Generator().manual_seed(0)) * 4
    probabilities = torch.sigmoid(logits).numpy()
    references = np.random.default_rng(1).random((20000, 3)) < probabilities
    ours = f1_thresholds(probabilities, references, "micro")
    predicted = Task("multi_label", threshold=tuple(ours.tolist())).predictions(logits).numpy()
    assert np.array_equal(predicted, (probabilities > ours).astype(int))


def test_task_predictions_take_one_threshold_per_label():
    logits = torch.tensor([[0.0, 0.0], [1.0, -1.0], [-1.0, 1.0]])
    task = Task("multi_label", threshold=(0.3, 0.6))
    assert task.predictions(logits).tolist() == [[1, 0], [1, 0], [0, 1]]
    with pytest.raises(ValueError, match="tuned thresholds apply to multi_label, and to single_label with a "
                                         "positive class"):
        Task("single_label", tune_thresholds="micro")


def test_a_models_config_carries_its_thresholds_by_label_name():
    from transformers import BertConfig

    config = BertConfig(num_labels=2, id2label={0: "a", 1: "b"}, problem_type="multi_label_classification")
    assert model_thresholds(config, ["a", "b"]) is None
    assert label_thresholds(config, ["a", "b"]) == (0.5, 0.5)
    set_model_thresholds(config, ["a", "b"], [0.25, 0.75])
    assert model_thresholds(config, ["b", "a"]) == (0.75, 0.25)  # by name, in the order asked
    assert model_thresholds(config, ["a", "c"]) is None  # not one for every label
    assert label_thresholds(config, ["a", "b"]) == (0.25, 0.75)
    assert label_thresholds(config, ["a", "b"], 0.4) == (0.4, 0.4)
    assert label_thresholds(config, ["a", "b"], np.float32(0.25)) == (0.25, 0.25)
    with pytest.raises(ValueError, match="1 thresholds for 2 labels"):
        label_thresholds(config, ["a", "b"], [0.4])

    class Model:  # Task.of_model reads them, where evaluate_model has no task
        pass

    model = Model()
    model.config = config
    assert Task.of_model(model).threshold == (0.25, 0.75)


def test_a_run_with_one_threshold_starts_its_model_with_it_and_one_that_chooses_them_with_none():
    from transformers import BertConfig

    from finetune.tasks import start_thresholds

    for task, expected in ((Task("multi_label", threshold=0.3), {"a": 0.3, "b": 0.3}),
                           (Task("multi_label", tune_thresholds="micro"), None), (Task("single_label"), None),
                           (Task("single_label", threshold=0.2, positive_class=0), {"a": 0.2}),
                           (Task("single_label", tune_thresholds="binary", positive_class=1), None)):
        config = BertConfig(num_labels=2)
        start_thresholds(config, ["a", "b"], task)
        assert getattr(config, "label_thresholds", None) == expected


def test_a_resumed_model_takes_the_thresholds_its_last_evaluation_chose():
    from types import SimpleNamespace

    from transformers import BertConfig

    from finetune.checkpointer import carry_thresholds

    model = SimpleNamespace(config=BertConfig(num_labels=2))
    run = SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    carry_thresholds(run, [{"step": 4}])  # a run that chose none (one threshold for every label) keeps its own
    assert not hasattr(model.config, "label_thresholds")
    carry_thresholds(run, [{"step": 4, "eval_thresholds": {"a": 0.2, "b": 0.7}}, {"step": 6, "is_best": False},
                           {"step": 8, "eval_thresholds": {"a": 0.3, "b": 0.6}}])
    assert model.config.label_thresholds == {"a": 0.3, "b": 0.6}


@pytest.mark.slow
def test_a_checkpoint_saved_after_a_resume_holds_the_thresholds_the_run_had_chosen(tmp_path):
    """The thresholds an evaluation chose (``evaluation.threshold: per_label``) are the model's until the next one
    chooses again: each checkpoint in between is a model that predicts at them. A run stopped right after an
    evaluation and resumed saves the same checkpoints as the run that never stopped."""
    from transformers import AutoConfig

    from finetune.checkpoint_files import list_checkpoints
    from tiny_run import fit_tiny_run

    sections = {"evaluation": {"threshold": "per_label", "metric_for_best_model": "f1", "evals_per_epoch": 2},
                "training": {"num_train_epochs": 1}, "optim": {"learning_rate": 2e-3},
                "output": {"checkpoint_every": 1, "keep_last": None}}

    def thresholds(root):
        return {path.name: getattr(AutoConfig.from_pretrained(path), "label_thresholds", None)
                for path in list_checkpoints(root / "out")}

    fit_tiny_run(tmp_path / "whole", **sections)
    fit_tiny_run(tmp_path / "part", on_update=lambda state: state.step >= 5, **sections)  # evaluated at update 5
    assert list(thresholds(tmp_path / "part"))[-1] == "checkpoint-5"
    fit_tiny_run(tmp_path / "part", **sections)
    whole = thresholds(tmp_path / "whole")
    assert whole["checkpoint-4"] is None and whole["checkpoint-5"] is not None  # chosen at update 5 ...
    assert whole["checkpoint-6"] == whole["checkpoint-5"]  # ... and held until the next evaluation
    assert thresholds(tmp_path / "part") == whole
