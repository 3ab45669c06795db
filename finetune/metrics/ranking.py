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

# Text-column pairs (a binary average ranks one column) past which a ranking metric gets no bootstrap interval:
# its 1,000 resamples cost under 0.1 ms per thousand pairs each, most of a second an evaluation at this many
# (where an interval is narrow: +-0.005 of a ROC AUC of 0.94 at 10,000 texts), ten times that at ten times as
# many (bench.intervals --ranking).
MOST_PAIRS_FOR_AN_INTERVAL = 10_000


def ranked(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The order that sorts ``scores`` from the highest down, and where each run of equal scores ends in it."""
    order = np.argsort(-scores, kind="stable")
    s = scores[order]
    return order, np.flatnonzero(np.r_[s[1:] != s[:-1], True])


def weights_down_to(positive: np.ndarray, weights: np.ndarray, order: np.ndarray, ends: np.ndarray):
    """The weights of the positive and of the negative texts at each distinct score, highest first, and summed
    from the highest score down to it, that score's ties included: four ``R x G`` arrays. Cumulative sums read at
    the ends of the runs of ties: one pass over the texts, where summing each run on its own would loop over
    the runs."""
    w = weights[:, order]
    positive_at = w * positive[order]
    negative_at = w - positive_at
    positives_down, negatives_down = np.cumsum(positive_at, axis=1), np.cumsum(negative_at, axis=1)
    if len(ends) == len(order):  # no two texts tie: each text is its own score
        return positive_at, negative_at, positives_down, negatives_down
    positives_down, negatives_down = positives_down[:, ends], negatives_down[:, ends]
    return (np.diff(positives_down, axis=1, prepend=0.0), np.diff(negatives_down, axis=1, prepend=0.0),
            positives_down, negatives_down)


def roc_auc(positive_at, negative_at, positives_down, negatives_down) -> np.ndarray:
    """ROC AUC of each row of :func:`weights_down_to`'s arrays: each positive text's share of the negative texts
    scored below it, those tied with it counting a half."""
    total_negative = negatives_down[:, -1:]
    ordered = (positive_at * (total_negative - negatives_down + 0.5 * negative_at)).sum(axis=1)
    pairs = positives_down[:, -1] * total_negative[:, 0]
    return np.divide(ordered, pairs, out=np.full(len(pairs), np.nan), where=pairs > 0)


def average_precision(positive_at, negative_at, positives_down, negatives_down) -> np.ndarray:
    """Average precision of each row of :func:`weights_down_to`'s arrays: the precision down to each score at
    which positive texts are, weighted by how many."""
    given = positives_down + negatives_down
    precision = np.divide(positives_down, given, out=np.zeros_like(given), where=given > 0)
    positives = positives_down[:, -1]
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
        order, ends = ranked(scores[:, column])
        down_to = weights_down_to(positive[:, column].astype(np.float64), weights, order, ends)
        for name in names:
            out[name][:, column] = SCORES[name](*down_to)
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
    if average == "binary":  # the positive class's column alone
        by_positive = column_scores(names, scores[:, [pos_label]], positive[:, [pos_label]], weights)
        return {name: values[:, 0] for name, values in by_positive.items()}
    by_column = column_scores(names, scores, positive, weights)
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
        raise ValueError(f"the ranking metrics ({', '.join(names)}) need each text's probabilities: pass them as "
                         "scores=")
    array = np.asarray(scores, dtype=np.float64)
    if array.shape != (texts, columns):
        raise ValueError(f"scores must be {texts} x {columns} probabilities (a row a text, a column a label), "
                         f"got shape {array.shape}")
    return array


def one_hot(references: np.ndarray, num_labels: int) -> np.ndarray:
    """``n x num_labels`` booleans: each text's class."""
    return np.asarray(references, dtype=np.int64)[:, None] == np.arange(num_labels)[None]
