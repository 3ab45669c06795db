"""Ranking metrics: how well a model's probabilities order the texts, at no threshold.

ROC AUC is the chance that a text of a class gets a higher probability of it than a text of another class (ties
count a half); average precision is the precision at each text of the class, taken in the order of the
probabilities and averaged (the area under the precision-recall curve as scikit-learn sums it, without
interpolation). Neither depends on where the decision threshold sits, which is what a spam filter's or a
moderator's threshold is later chosen on, and what F1 at one threshold hides.

Each metric is computed one-vs-rest for each column (a class of a single-label model, a label of a multi-label
one) and averaged as ``evaluation.average`` says: ``binary`` reads the positive class's column, ``macro`` the mean
over the columns where it is defined, ``weighted`` that mean weighted by each column's texts, ``micro`` every
(text, column) pair as one ranking. A column whose texts all have it, or none does, has no ROC AUC (nothing to
order against); one that none has, no average precision: such a column is left out of the averages, and a
metric with no column left is NaN.

Every function takes the texts' weights, ``R x n``: a row of ones is the texts as they are, and a row of counts
is a bootstrap resample (:mod:`finetune.metrics.intervals`), scored without repeating a text. The texts are
sorted once; each resample then costs a few passes over ``n``. Written by hand: scikit-learn, which has both, is
no dependency of the package (the tests compare with it), and it takes one resample at a time.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

RANKING_METRICS = ("roc_auc", "average_precision")

# Text-column pairs past which a ranking metric's bootstrap interval is not computed: each of the 1,000 resamples
# costs a few passes over the pairs, and past this many those passes would take longer than the evaluation.
MOST_PAIRS_FOR_AN_INTERVAL = 500_000


def ranked(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The order that sorts ``scores`` from the highest down, and where each run of equal scores starts in it."""
    order = np.argsort(-scores, kind="stable")
    s = scores[order]
    return order, np.flatnonzero(np.r_[True, s[1:] != s[:-1]])


def tied_weights(positive: np.ndarray, weights: np.ndarray, order: np.ndarray, starts: np.ndarray):
    """The weights of the positive and of the negative texts at each distinct score, highest first (``R x G``)."""
    w = weights[:, order]
    pos = w * positive[order]
    return np.add.reduceat(pos, starts, axis=1), np.add.reduceat(w - pos, starts, axis=1)


def roc_auc(positive_at: np.ndarray, negative_at: np.ndarray) -> np.ndarray:
    """ROC AUC of each row of the weights of positive and negative texts at each distinct score, highest first."""
    negatives_below = negative_at[:, ::-1].cumsum(axis=1)[:, ::-1] - negative_at
    pairs = positive_at.sum(axis=1) * negative_at.sum(axis=1)
    ordered = (positive_at * (negatives_below + 0.5 * negative_at)).sum(axis=1)
    return np.divide(ordered, pairs, out=np.full(len(pairs), np.nan), where=pairs > 0)


def average_precision(positive_at: np.ndarray, negative_at: np.ndarray) -> np.ndarray:
    """Average precision of each row, as :func:`roc_auc` takes them."""
    hits = positive_at.cumsum(axis=1)
    given = hits + negative_at.cumsum(axis=1)
    precision = np.divide(hits, given, out=np.zeros_like(hits), where=given > 0)
    positives = hits[:, -1]
    return np.divide((positive_at * precision).sum(axis=1), positives, out=np.full(len(positives), np.nan),
                     where=positives > 0)


SCORES = {"roc_auc": roc_auc, "average_precision": average_precision}


def column_scores(names: list[str], scores: np.ndarray, positive: np.ndarray, weights: np.ndarray
                  ) -> dict[str, np.ndarray]:
    """Each metric of ``names`` for each column and each row of ``weights``: ``{name: R x columns}``.

    Args:
        scores: ``n x columns`` probabilities (of each class, or each label).
        positive: ``n x columns`` booleans: the text has the class (or label).
        weights: ``R x n`` counts of each text (a row of ones: the texts as they are).
    """
    out = {name: np.empty((len(weights), scores.shape[1])) for name in names}
    for column in range(scores.shape[1]):
        order, starts = ranked(scores[:, column])
        at = tied_weights(positive[:, column].astype(np.float64), weights, order, starts)
        for name in names:
            out[name][:, column] = SCORES[name](*at)
    return out


def ranking_scores(names: list[str], scores: np.ndarray, positive: np.ndarray, weights: np.ndarray,
                   average: str, pos_label: Optional[int] = None) -> dict[str, np.ndarray]:
    """Each metric of ``names``, averaged over the columns as ``average`` says, for each row of ``weights`` (see
    :func:`column_scores`; ``pos_label``: the column ``binary`` reads)."""
    weights = np.asarray(weights, dtype=np.float64)
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    if average == "micro":  # every (text, column) pair, each with its text's weight
        flat = column_scores(names, scores.reshape(-1, 1), positive.reshape(-1, 1),
                             np.repeat(weights, scores.shape[1], axis=1))
        return {name: values[:, 0] for name, values in flat.items()}
    by_column = column_scores(names, scores, positive, weights)
    if average == "binary":
        return {name: values[:, pos_label] for name, values in by_column.items()}
    support = weights @ positive.astype(np.float64) if average == "weighted" else np.ones_like(by_column[names[0]])
    out = {}
    for name, values in by_column.items():
        kept = np.where(np.isnan(values), 0.0, support)
        total = kept.sum(axis=1)
        out[name] = np.divide((np.nan_to_num(values) * kept).sum(axis=1), total, out=np.full(len(total), np.nan),
                              where=total > 0)
    return out


def checked_scores(scores, texts: int, columns: int, names: list[str]) -> np.ndarray:
    """``scores`` as an ``texts x columns`` float array; ValueError naming the metrics that need them where they
    are missing or of another shape."""
    if scores is None:
        raise ValueError(f"{', '.join(names)} score the texts' probabilities: pass them as scores=")
    array = np.asarray(scores, dtype=np.float64)
    if array.shape != (texts, columns):
        raise ValueError(f"scores must be {texts} x {columns} probabilities (a row a text, a column a label), "
                         f"got shape {array.shape}")
    return array


def one_hot(references: np.ndarray, num_labels: int) -> np.ndarray:
    """``n x num_labels`` booleans: each text's class."""
    return np.asarray(references, dtype=np.int64)[:, None] == np.arange(num_labels)[None]
