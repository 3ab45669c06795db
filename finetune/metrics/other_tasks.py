"""Metrics of multi-label classification and regression, in plain numpy.

Written by hand for the reason the classification scores are
(``_classification.py``): evaluate's Hub scripts for them need the network and
scikit-learn or SciPy, which this package does not depend on. They follow
scikit-learn's and SciPy's definitions (``zero_division=0``; Spearman with
average ranks for ties), and the tests check them against independent
computations.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from finetune.errors import ConfigError
from finetune.metrics._classification import scores_from_counts

MULTI_LABEL_METRICS = ("accuracy", "f1", "precision", "recall")
MULTI_LABEL_AVERAGES = ("micro", "macro", "weighted")
REGRESSION_METRICS = ("pearson", "spearmanr", "mse", "mae")


class MultiLabelMetrics:
    """Scores of 0/1 label vectors: ``accuracy`` is subset accuracy (every label of a text right).

    Args:
        names: Some of :data:`MULTI_LABEL_METRICS`.
        num_labels: Length of each label vector.
        average: micro (over all text-label pairs), macro (mean over labels)
            or weighted (by each label's number of true occurrences).
    """

    def __init__(self, names: Sequence[str], num_labels: int, average: str = "micro"):
        unknown = [n for n in names if n not in MULTI_LABEL_METRICS]
        if unknown:
            raise ConfigError(f"evaluation.metrics: {unknown[0]!r} is not computed for multi_label "
                              f"(one of: {', '.join(MULTI_LABEL_METRICS)})")
        if average not in MULTI_LABEL_AVERAGES:
            raise ConfigError(f"evaluation.average: {average!r} is not used for multi_label "
                              f"(one of: {', '.join(MULTI_LABEL_AVERAGES)})")
        self.names, self.num_labels, self.average = list(names), num_labels, average

    def compute(self, predictions, references) -> dict[str, float]:
        pred = np.asarray(predictions).astype(bool)
        ref = np.asarray(references).astype(bool)
        if pred.shape != ref.shape or pred.ndim != 2 or pred.shape[1] != self.num_labels:
            raise ValueError(f"predictions {pred.shape} and references {ref.shape} must both be "
                             f"(samples, {self.num_labels}) label vectors")
        tallies = ((pred & ref).sum(0)[None], pred.sum(0)[None], ref.sum(0)[None],
                   (pred == ref).all(1).mean(keepdims=True))
        return {name: float(values[0]) for name, values in self.scores_of_tallies(*tallies).items()}

    def scores_of_tallies(self, hits, predicted, support, exact) -> dict[str, np.ndarray]:
        """Each metric for every row of the tallies (``R x labels``: each label's hits, texts given it and texts
        that have it; ``exact``, ``R``: the share of texts with every label right): what :meth:`compute` and the
        bootstrap intervals (:mod:`finetune.metrics.intervals`) score."""
        hits, predicted, support = (np.asarray(a, dtype=np.float64) for a in (hits, predicted, support))
        if self.average == "micro":
            hits, predicted, support = (s.sum(axis=1, keepdims=True) for s in (hits, predicted, support))
        scores = dict(zip(("precision", "recall", "f1"), scores_from_counts(hits, predicted, support)))
        out: dict[str, np.ndarray] = {}
        for name in self.names:
            if name == "accuracy":
                out[name] = np.asarray(exact, dtype=np.float64)
            elif self.average == "weighted":
                total = support.sum(axis=1)
                out[name] = np.divide((scores[name] * support).sum(axis=1), total, out=np.zeros_like(total),
                                      where=total > 0)
            else:
                out[name] = scores[name].mean(axis=1)
        return out


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank (SciPy's ``rankdata(method="average")``)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else float("nan")  # undefined for a constant


class RegressionMetrics:
    """Scores of numeric predictions: Pearson and Spearman correlation, mean squared and absolute error."""

    def __init__(self, names: Sequence[str]):
        unknown = [n for n in names if n not in REGRESSION_METRICS]
        if unknown:
            raise ConfigError(f"evaluation.metrics: {unknown[0]!r} is not computed for regression "
                              f"(one of: {', '.join(REGRESSION_METRICS)})")
        self.names = list(names)

    def compute(self, predictions, references) -> dict[str, float]:
        pred = np.asarray(predictions, dtype=np.float64).reshape(-1)
        ref = np.asarray(references, dtype=np.float64).reshape(-1)
        if pred.shape != ref.shape or pred.size == 0:
            raise ValueError(f"predictions ({pred.size}) and references ({ref.size}) must be as many, and some")
        values = {
            "pearson": lambda: _pearson(pred, ref),
            "spearmanr": lambda: _pearson(_average_ranks(pred), _average_ranks(ref)),
            "mse": lambda: float(((pred - ref) ** 2).mean()),
            "mae": lambda: float(np.abs(pred - ref).mean()),
        }
        return {name: values[name]() for name in self.names}
