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
from finetune.metrics.ranking import RANKING_METRICS, checked_scores, ranking_scores

MULTI_LABEL_METRICS = ("accuracy", "f1", "precision", "recall", *RANKING_METRICS)
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
        # the metrics of the labels' probabilities (finetune.metrics.ranking); the others count label sets
        self.ranking = [name for name in self.names if name in RANKING_METRICS]
        self.tallied = [name for name in self.names if name not in RANKING_METRICS]

    def compute(self, predictions, references, scores=None) -> dict[str, float]:
        """Each metric of 0/1 label vectors against the true ones; ``scores``, each label's probability
        (``n x num_labels``), for the ranking metrics where the suite lists one."""
        pred = np.asarray(predictions).astype(bool)
        ref = np.asarray(references).astype(bool)
        if pred.shape != ref.shape or pred.ndim != 2 or pred.shape[1] != self.num_labels:
            raise ValueError(f"predictions {pred.shape} and references {ref.shape} must both be "
                             f"(samples, {self.num_labels}) label vectors")
        tallies = ((pred & ref).sum(0)[None], pred.sum(0)[None], ref.sum(0)[None],
                   (pred == ref).all(1).mean(keepdims=True))
        values = {**self.scores_of_tallies(*tallies), **self.ranking_of(scores, ref, np.ones((1, len(ref))))}
        return {name: float(values[name][0]) for name in self.names}

    def ranking_of(self, scores, references, weights) -> dict[str, np.ndarray]:
        """The ranking metrics of each label's probabilities for each row of ``weights``, as
        :meth:`finetune.metrics.MetricSuite.ranking_of` has them."""
        if not self.ranking:
            return {}
        return ranking_scores(self.ranking, checked_scores(scores, len(references), self.num_labels, self.ranking),
                              np.asarray(references).astype(bool), weights, self.average)

    def scores_of_tallies(self, hits, predicted, support, exact) -> dict[str, np.ndarray]:
        """Each metric for every row of the tallies (``R x labels``: each label's hits, texts given it and texts
        that have it; ``exact``, ``R``: the share of texts with every label right): what :meth:`compute` and the
        bootstrap intervals (:mod:`finetune.metrics.intervals`) score."""
        hits, predicted, support = (np.asarray(a, dtype=np.float64) for a in (hits, predicted, support))
        if self.average == "micro":
            hits, predicted, support = (s.sum(axis=1, keepdims=True) for s in (hits, predicted, support))
        scores = dict(zip(("precision", "recall", "f1"), scores_from_counts(hits, predicted, support)))
        out: dict[str, np.ndarray] = {}
        for name in self.tallied:
            if name == "accuracy":
                out[name] = np.asarray(exact, dtype=np.float64)
            elif self.average == "weighted":
                total = support.sum(axis=1)
                out[name] = np.divide((scores[name] * support).sum(axis=1), total, out=np.zeros_like(total),
                                      where=total > 0)
            else:
                out[name] = scores[name].mean(axis=1)
        return out


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
        return {name: float(v[0]) for name, v in self.scores_of_weights(pred, ref, np.ones((1, pred.size))).items()}

    def scores_of_weights(self, pred: np.ndarray, ref: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
        """Each metric for every row of ``weights`` (``R x n``): the pairs ``(pred, ref)`` each counted as many
        times as its weight says, as the texts of a bootstrap resample are (:mod:`finetune.metrics.intervals`);
        a row of ones is the pairs as they are, what :meth:`compute` scores. A correlation over constant values
        is NaN, as it is undefined."""
        weights = np.asarray(weights, dtype=np.float64)
        total = weights.sum(axis=1)
        values = {
            "pearson": lambda: _weighted_pearson(pred, ref, weights),
            "spearmanr": lambda: _weighted_pearson(_weighted_ranks(pred, weights), _weighted_ranks(ref, weights),
                                                   weights),
            "mse": lambda: weights @ (pred - ref) ** 2 / total,
            "mae": lambda: weights @ np.abs(pred - ref) / total,
        }
        return {name: values[name]() for name in self.names}


def _weighted_ranks(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Each value's rank from 1 among the values counted ``weights`` times (``R x n``), ties sharing their mean
    rank (SciPy's ``rankdata(method="average")`` of the values written out that many times), for every row.
    With weights of one, Spearman's correlation is the Pearson correlation of these ranks."""
    order = np.argsort(x, kind="mergesort")
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    sorted_x, sorted_weights = x[order], np.take(weights, order, axis=1)
    through = np.cumsum(sorted_weights, axis=1)  # the values up to each one, it included
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])  # where each distinct value begins
    if len(starts) == len(x):  # no ties: a value's copies hold the ranks after those before it
        return np.take(through - (sorted_weights - 1) / 2, back, axis=1)
    ends = np.r_[starts[1:], len(x)] - 1
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(x)]))
    group_through = through[:, ends]
    group_before = np.c_[np.zeros(len(weights)), group_through[:, :-1]]
    return np.take((group_before + group_through + 1) / 2, group[back], axis=1)


def _weighted_pearson(a: np.ndarray, b: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Pearson's correlation of ``a`` and ``b`` (each ``n``, or ``R x n``) over each row's weights, from weighted
    sums; NaN where a side is constant. Values given once (``n``) are first shifted by their plain means, which
    keeps the sums' cancellation small for targets far from 0; ranks (``R x n``) lie within the texts' number."""
    def weighted_sum(x: np.ndarray, y: np.ndarray) -> np.ndarray:  # each row's sum of weight * x * y
        if x.ndim == y.ndim == 1:
            return weights @ (x * y)
        return np.einsum("ij,ij,ij->i", weights, np.broadcast_to(x, weights.shape), np.broadcast_to(y, weights.shape))

    if a.ndim == 1:
        a = a - a.mean()
    if b.ndim == 1:
        b = b - b.mean()
    total = weights.sum(axis=1)
    ones = np.ones(weights.shape[1])
    sum_a, sum_b = weighted_sum(a, ones), weighted_sum(b, ones)
    covariance = weighted_sum(a, b) - sum_a * sum_b / total
    square_a, square_b = weighted_sum(a, a), weighted_sum(b, b)
    spread = np.sqrt(np.clip(square_a - sum_a ** 2 / total, 0, None) * np.clip(square_b - sum_b ** 2 / total, 0, None))
    # a constant side has no spread, to the sums' rounding
    defined = spread > 1e-12 * np.sqrt(square_a * square_b)
    return np.divide(covariance, spread, out=np.full_like(covariance, np.nan), where=defined)
