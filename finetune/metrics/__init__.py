"""Validation metrics, computed through the ``evaluate`` library's API.

The built-in metrics (:data:`BUILTIN_METRICS`) are local ``evaluate`` metric
modules laid out as on the Hub, ``finetune/metrics/<name>/<name>.py``, so
``evaluate.load`` reads them from disk and never needs the network. They are
written by hand with numpy (``_classification.py``): the Hub's scripts cannot
be fetched offline, and they call scikit-learn, which this package does not
depend on. The ranking metrics (:data:`RANKING_METRICS`: ROC AUC and average
precision, :mod:`finetune.metrics.ranking`) score the texts' probabilities,
not their classes, so a suite that lists them is handed those as well. Any
other metric name is passed to ``evaluate.load`` as is.

``evaluate`` is imported only when a :class:`MetricSuite` is built: importing
it pulls in transformers and torch, which takes seconds.
"""

from __future__ import annotations

import difflib
import numbers
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from finetune.errors import ConfigError
from finetune.metrics._classification import AVERAGES, BUILTIN_METRICS, class_ids, scores_from_counts
# the bootstrap intervals, with the metrics they bound: one import for whoever scores
from finetune.metrics.intervals import (POINT_INTERVAL, SPREAD, confusion_matrix, metric_intervals,
                                        metrics_with_intervals, paired_differences, scores_in_a_line)
from finetune.metrics.operating_points import label_points, operating_points
from finetune.metrics.ranking import RANKING_METRICS, checked_scores, column_scores, one_hot, ranking_scores

__all__ = ["BUILTIN_METRICS", "CORRELATIONS", "MetricSuite", "POINT_INTERVAL", "RANKING_METRICS", "SPREAD",
           "builtin_metric_path",
           "confusion_matrix", "correlations_over_alike_targets", "label_points", "metric_intervals",
           "metric_suite_for", "metrics_with_intervals", "one_number_for_every_text", "operating_points",
           "paired_differences", "resolve_average",
           "same_answer_for_every_text", "scores_by_label", "scores_in_a_line", "undefined_correlations"]

# The metrics that take the averaging options; the others would reject them.
_AVERAGED = frozenset({"f1", "precision", "recall"})

# Other spellings users reach for (scikit-learn's names, abbreviations).
_ALIASES = {
    "acc": "accuracy",
    "accuracy_score": "accuracy",
    "f1_score": "f1",
    "precision_score": "precision",
    "recall_score": "recall",
    "mcc": "matthews_correlation",
    "matthews_corrcoef": "matthews_correlation",
    "auc": "roc_auc",
    "auroc": "roc_auc",
    "roc_auc_score": "roc_auc",
    "ap": "average_precision",
    "pr_auc": "average_precision",
    "auprc": "average_precision",
    "average_precision_score": "average_precision",
}


def builtin_metric_path(name: str) -> str:
    """Path of a built-in metric's script, to pass to ``evaluate.load``.

    Args:
        name: One of :data:`BUILTIN_METRICS`.

    Returns:
        The absolute path of ``finetune/metrics/<name>/<name>.py``.

    Raises:
        KeyError: If ``name`` is not a built-in metric.
    """
    if name not in BUILTIN_METRICS:
        raise KeyError(f"{name!r} is not a built-in metric; built in: {', '.join(BUILTIN_METRICS)}")
    # An absolute path to the script itself: evaluate.load treats a relative
    # path with at most one "/" that is not a file as a Hub id.
    return str(Path(__file__).resolve().parent / name / f"{name}.py")


def _closest_builtin(name: str) -> str | None:
    key = name.strip().lower().replace("-", "_")
    if key in _ALIASES:
        return _ALIASES[key]
    matches = difflib.get_close_matches(key, BUILTIN_METRICS + RANKING_METRICS, n=1, cutoff=0.6)
    return matches[0] if matches else None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def resolve_average(evaluation, label_names, counts=None) -> tuple[str, Optional[str]]:
    """The averaging and positive class that ``evaluation`` stands for, with ``average: auto`` decided.

    ``auto`` is binary averaging for two classes, with ``positive_label`` as
    the positive class, or else the class with fewer training samples (the
    one a detector is usually for: spam, fraud, a defect); macro averaging
    for more classes, or for two of the same size without a ``positive_label``.

    Args:
        evaluation: The ``evaluation`` config section.
        label_names: Class names in class-id order.
        counts: Training samples per class, in class-id order (``None``: unknown).

    Returns:
        ``(average, positive label name or None)``.
    """
    if evaluation.average != "auto":
        return evaluation.average, evaluation.positive_label
    names = list(label_names)
    if len(names) != 2:
        return "macro", None
    if evaluation.positive_label is not None:
        return "binary", evaluation.positive_label
    if counts is None or counts[0] == counts[1]:
        return "macro", None
    return "binary", names[0 if counts[0] < counts[1] else 1]


def averaging_in_words(suite, label_names: Sequence[str]) -> Optional[str]:
    """How ``suite`` (a :class:`MetricSuite`, or a multi-label one) averages F1, precision and recall, in words
    (``f1, recall: macro average``, ``f1: of 'spam'``); ``None`` where it computes none of them."""
    averaged = [name for name in suite.names if name in _AVERAGED]
    if not averaged or not hasattr(suite, "average"):
        return None
    positive = getattr(suite, "pos_label", None)
    how = f"of {label_names[positive]!r}" if suite.average == "binary" else f"{suite.average} average"
    return f"{', '.join(averaged)}: {how}"


class MetricSuite:
    """The configured metrics, computed with evaluate's API (local modules, combine).

    Each metric is loaded once, here, with ``evaluate.load`` and kept; the
    suite computes them all with one ``evaluate.combine`` object. The
    averaging options are given to f1/precision/recall when they are loaded,
    because ``CombinedEvaluations.compute`` would hand them to every metric.

    Args:
        names: Metric names, in the order of the results. Built-in names load
            from the local modules; any other name goes to
            ``evaluate.load(name)``, which needs the network unless the
            metric is cached.
        num_labels: Number of classes; the class ids are ``0..num_labels-1``
            and all of them count in macro/weighted averages.
        average: Averaging for f1/precision/recall: binary, macro, micro or
            weighted.
        pos_label: Class id of the positive class; required with
            ``average="binary"``, ignored otherwise.

    Raises:
        ConfigError: If ``names`` is empty or repeats a name, a name cannot be
            loaded, ``average`` is unknown, or ``average="binary"`` comes
            without ``pos_label`` or with other than two labels.
        ValueError: If ``num_labels`` < 1 or ``pos_label`` is not a class id.
    """

    @classmethod
    def from_config(cls, evaluation, label_names, whose: str = "the data", counts=None) -> "MetricSuite":
        """The suite of an ``evaluation`` config section for classes ``label_names`` (in class-id order).

        ``evaluation.average: auto`` is resolved by :func:`resolve_average`
        (``counts``: samples per class, to find the rarer of two).

        Raises:
            ConfigError: if ``evaluation.positive_label`` is not one of ``label_names``
                (``whose`` says whose labels they are, for the message).
        """
        names = list(label_names)
        average, positive = resolve_average(evaluation, names, counts)
        pos_label = None
        if average == "binary":
            if positive not in names:
                raise ConfigError(f"evaluation.positive_label: {positive!r} is not a label of "
                                  f"{whose} ({', '.join(names)})")
            pos_label = names.index(positive)
        return cls(evaluation.metrics, len(names), average, pos_label)

    def __init__(self, names: list[str], num_labels: int, average: str = "macro", pos_label: int | None = None):
        names = list(names)
        if not names:
            raise ConfigError("evaluation.metrics: name at least one metric")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"evaluation.metrics: {', '.join(map(repr, repeated))} listed more than once")
        if average not in AVERAGES:
            raise ConfigError(f"evaluation.average: must be one of {', '.join(AVERAGES)}, got {average!r}")
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        if average == "binary":
            if pos_label is None:
                raise ConfigError("evaluation.positive_label: required when evaluation.average is binary")
            if num_labels != 2:
                raise ConfigError(
                    f"evaluation.average: binary needs exactly 2 labels, the data has {num_labels}; "
                    "use macro, micro or weighted"
                )
            if pos_label not in (0, 1):
                raise ValueError(f"pos_label must be a class id (0 or 1), got {pos_label!r}")

        self.names = names
        self.num_labels = num_labels
        self.average = average
        self.pos_label = pos_label if average == "binary" else None
        # the metrics of the texts' probabilities, computed here; evaluate's modules score class ids
        self.ranking = [name for name in names if name in RANKING_METRICS]

        import evaluate  # noqa: PLC0415 - see the module docstring

        self._modules = {name: self._load(evaluate, name) for name in names if name not in self.ranking}
        self._combined = evaluate.combine(self._modules) if self._modules else None

    def _averaging(self) -> dict[str, Any]:
        if self.average == "binary":
            return {"average": "binary", "pos_label": self.pos_label}
        return {"average": self.average, "labels": list(range(self.num_labels))}

    def _load(self, evaluate, name: str):
        # keep_in_memory: the gathered predictions are scored in one process,
        # so evaluate's Arrow cache files and their locks would be pure overhead.
        if name in BUILTIN_METRICS:
            options = self._averaging() if name in _AVERAGED else {}
            return evaluate.load(builtin_metric_path(name), keep_in_memory=True, **options)
        try:
            return evaluate.load(name, keep_in_memory=True)
        # FileNotFoundError, ConnectionError, a missing package, and whatever else evaluate raises for a name it
        # cannot resolve (an IndexError for "/")
        except Exception as error:  # noqa: BLE001
            suggestion = _closest_builtin(name)
            did_you_mean = f" (did you mean {suggestion!r}?)" if suggestion else ""
            raise ConfigError(
                f"evaluation.metrics: cannot load metric {name!r}{did_you_mean}",
                hint=(
                    f"Built in (offline): {', '.join(BUILTIN_METRICS + RANKING_METRICS)}. "
                    f"Other names load with evaluate.load, which failed: {_first_line(error)}"
                ),
            ) from error

    def compute(self, predictions, references, scores=None) -> dict[str, float]:
        """Scores class-id predictions against references with every configured metric.

        Args:
            predictions: 1-D int array or list of predicted class ids.
            references: 1-D int array or list of true class ids.
            scores: ``n x num_labels`` probabilities of each class, for the ranking metrics (``roc_auc``,
                ``average_precision``); needed only where the suite lists one (:attr:`ranking`).

        Returns:
            Plain Python floats keyed by result name, in the order of
            ``names``; a built-in metric's key is its name.

        Raises:
            ValueError: If the inputs are not 1-D integer arrays of the same,
                non-zero length, or hold ids outside ``0..num_labels-1``, or the
                ranking metrics' scores are missing or of another shape.
            ConfigError: If a non-built-in metric returns something other than
                a single number.
        """
        pred, ref = class_ids(predictions, references)
        for name, ids in (("predictions", pred), ("references", ref)):
            # Out-of-range ids would silently drop out of macro averages.
            if ids.min() < 0 or ids.max() >= self.num_labels:
                raise ValueError(
                    f"{name} hold class ids outside 0..{self.num_labels - 1}: {sorted(set(ids.tolist()))[:10]}"
                )
        results = self._combined.compute(predictions=pred, references=ref) if self._combined else {}
        results.update({key: values[0] for key, values in self.ranking_of(scores, ref, np.ones((1, len(ref))))
                        .items()})
        order = {name: i for i, name in enumerate(self.names)}  # a key no name gives (a Hub module's) goes last
        return {key: self._as_float(key, value)
                for key, value in sorted(results.items(), key=lambda item: order.get(item[0], len(order)))}

    def ranking_of(self, scores, references, weights) -> dict[str, np.ndarray]:
        """The ranking metrics of ``scores`` (``n x num_labels``) for each row of ``weights`` (``R x n``: ones,
        or a bootstrap resample's counts of each text), averaged as the suite averages."""
        if not self.ranking:
            return {}
        return ranking_scores(self.ranking, checked_scores(scores, len(references), self.num_labels, self.ranking),
                              one_hot(references, self.num_labels), weights, self.average, self.pos_label)

    @staticmethod
    def _as_float(key: str, value: Any) -> float:
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(
            f"evaluation.metrics: result {key!r} is a {type(value).__name__}, not a number; "
            "use metrics that return single numbers"
        )


def metric_suite_for(evaluation, label_names, problem_type: str = "single_label", counts=None,
                     whose: str = "the data"):
    """The metrics of an ``evaluation`` section for a problem type: what training validates with and
    ``finetune score`` scores with.

    ``average: auto`` is resolved as :func:`resolve_average` says for single
    labels (``counts``: samples per class) and is micro for multi-label.
    """
    from finetune.metrics.other_tasks import MultiLabelMetrics, RegressionMetrics

    if problem_type == "regression":
        return RegressionMetrics(evaluation.metrics)
    if problem_type == "multi_label":
        average = "micro" if evaluation.average == "auto" else evaluation.average
        return MultiLabelMetrics(evaluation.metrics, len(label_names), average)
    return MetricSuite.from_config(evaluation, label_names, whose=whose, counts=counts)


def scores_by_label(predictions, references, names: list[str], scores=None, ranking: Sequence[str] = ()
                    ) -> dict[str, dict[str, float]]:
    """Each label's precision, recall, F1 and support (its true samples), every label scored alone.

    What a macro average hides: the one class a model gets wrong. ``predictions`` and ``references`` are
    class ids (single-label) or 0/1 label vectors (multi-label) over the labels ``names`` (in id order); a
    label absent from both scores 0. With ``scores`` (each text's probability of each label), the ``ranking``
    metrics of each label against the rest too (``roc_auc``, ``average_precision``; NaN where no text, or
    every text, has the label).

    Returns:
        ``{name: {"precision": ..., "recall": ..., "f1": ..., "support": ..., "predicted": ...}}`` in id order:
        ``predicted``, the samples the model gave the label, beside ``support``, those that have it.
    """
    pred, ref = np.asarray(predictions), np.asarray(references)
    if pred.ndim == 1:  # class ids: each class is a label whose true positives are the hits on it
        pred, ref = class_ids(pred, ref)
        tp, predicted, support = (np.bincount(ids, minlength=len(names)) for ids in (ref[pred == ref], pred, ref))
    else:  # 0/1 label vectors
        pred, ref = pred.astype(bool), ref.astype(bool)
        tp, predicted, support = (pred & ref).sum(0), pred.sum(0), ref.sum(0)
    precision, recall, f1 = scores_from_counts(tp, predicted, support)
    positive = ref if ref.ndim == 2 else one_hot(ref, len(names))
    ranked = column_scores(list(ranking), checked_scores(scores, len(ref), len(names), list(ranking)), positive,
                           np.ones((1, len(ref)))) if ranking else {}
    return {str(name): {"precision": float(precision[i]), "recall": float(recall[i]), "f1": float(f1[i]),
                        "support": int(support[i]), "predicted": int(predicted[i]),
                        **{metric: float(values[0, i]) for metric, values in ranked.items()}}
            for i, name in enumerate(names)}


def same_answer_for_every_text(by_label: Optional[dict[str, dict[str, float]]], texts: Optional[int],
                               texts_named: str, model_named: str) -> Optional[str]:
    """A caution when a model gave every text the same answer, else None.

    A run whose learning rate is far too high or too low, or whose updates
    are too few, ends predicting the commonest class for every text (or, with
    several labels per text, no label at all), and its accuracy is then the
    commonest class's share: a number that looks like learning. The counts
    are those of :func:`scores_by_label` (``predicted`` beside ``support``).

    Args:
        by_label: Each label's scores, with ``support`` and ``predicted``.
        texts: How many texts were scored.
        texts_named: What the texts are, for the sentence (``validation texts``, ``texts of test.csv``).
        model_named: What the model is (``the saved model``, ``the model``).
    """
    if not by_label or not texts or "predicted" not in next(iter(by_label.values())):
        return None
    present = sum(1 for scores in by_label.values() if scores["support"] > 0)
    counts = {name: scores["predicted"] for name, scores in by_label.items()}
    if present < 2 or any(count not in (0, texts) for count in counts.values()):
        return None  # the texts got different answers, or the data has one label to give
    given = [name for name, count in counts.items() if count == texts]
    if not given:  # several labels per text, none above the threshold anywhere
        said = f"gave none of the {texts} {texts_named} any label"
    elif len(given) == 1:
        said = f"predicted {given[0]!r} for every one of the {texts} {texts_named}"
    else:
        said = f"gave every one of the {texts} {texts_named} the same labels ({', '.join(given)})"
    return (f"{model_named} {said}: its scores are those of answering alike whatever the text (a learning rate "
            f"too high or too low, or too few updates?)")


# the averages that score each class (or label) on its own texts; macro's counts one the texts lack as 0
PER_LABEL_AVERAGED = ("f1", "precision", "recall")


def averaged_over_absent_labels(metric_names: Sequence[str], average: str, positive: Optional[str],
                                support: dict[str, int], texts_named: str, labels: bool = False) -> Optional[str]:
    """A caution when the texts lack a class that ``average`` scores 0 whatever the model predicts, else None:
    macro averages over every class, binary scores the ``positive`` one alone, where micro and weighted weigh a
    class by its texts, so that one without texts adds nothing. ``support``: each class's texts, by name;
    ``labels``: they are labels, several to a text."""
    chosen = [name for name in PER_LABEL_AVERAGED if name in metric_names]
    absent = [name for name, count in support.items() if count == 0]
    if not chosen or not absent or average not in ("binary", "macro"):
        return None
    scores = ", ".join(chosen[:-1]) + (" and " if len(chosen) > 1 else "") + chosen[-1]
    if average == "binary":
        return None if positive not in absent else (
            f"no {texts_named} has the positive class {positive!r}: its {scores} {'is' if len(chosen) == 1 else 'are'} "
            f"0 whatever the model predicts")
    kind = ("label", "labels") if labels else ("class", "classes")
    listed = ", ".join(repr(name) for name in absent[:5]) + (f" and {len(absent) - 5} more" if len(absent) > 5 else "")
    return (f"no {texts_named} has the {kind[len(absent) > 1]} {listed}: the macro average of {scores} counts "
            f"{'it' if len(absent) == 1 else 'each'} as 0 among the {len(support)} {kind[1]}, so it reaches at most "
            f"{(len(support) - len(absent)) / len(support):.2f} whatever the model predicts")


# the regression metrics that are undefined (NaN) where the predictions or the targets are all alike
CORRELATIONS = ("pearson", "spearmanr")


def undefined_correlations(scores: dict[str, Any]) -> list[str]:
    """The correlations among ``scores`` that came out undefined (NaN)."""
    return [name for name in CORRELATIONS if isinstance(scores.get(name), float) and np.isnan(scores[name])]


def one_number_for_every_text(scores: dict[str, Any], targets, texts_named: str, model_named: str
                              ) -> Optional[str]:
    """A caution when a regression model gave every text the same number, else None.

    A correlation is undefined where either side is constant. With ``targets``
    that differ, an undefined one says the model answered every text alike, as
    a classifier that predicts one class does (:func:`same_answer_for_every_text`);
    targets all alike are the data's to say, before training
    (:func:`correlations_over_alike_targets`).
    """
    undefined = undefined_correlations(scores)
    if not undefined or np.ptp(np.asarray(targets, dtype=np.float64)) == 0:
        return None
    return (f"{model_named} predicted one number for every one of the {len(targets)} {texts_named}, so its "
            f"{' and '.join(undefined)} {'is' if len(undefined) == 1 else 'are'} undefined (nan): its scores are "
            f"those of answering alike whatever the text (a learning rate too high or too low, or too few updates?)")


def correlations_over_alike_targets(metric_names, targets, texts_named: str, remedy: Optional[str] = None
                                    ) -> Optional[str]:
    """A caution when regression targets are all one number and a correlation is among ``metric_names``: it
    is undefined (NaN) whatever the model predicts; ``remedy`` says what to do about it, where there is a way."""
    values = np.asarray(targets, dtype=np.float64)
    chosen = [name for name in CORRELATIONS if name in metric_names]
    if not chosen or len(values) == 0 or np.ptp(values) != 0:
        return None
    return (f"the {len(values)} {texts_named} all have the target {values[0]:g}: {' and '.join(chosen)} over them "
            f"{'is' if len(chosen) == 1 else 'are'} undefined (nan) whatever the model predicts"
            + (f"; {remedy}" if remedy else ""))
