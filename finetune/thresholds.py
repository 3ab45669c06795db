"""Decision thresholds: the probability over which each label of a multi-label model is predicted, or the positive
class of a two-class one.

A multi-label model predicts every label whose sigmoid probability is over a threshold. One threshold for every
label (0.5 by default, ``evaluation.threshold``) suits labels the model ranks and scales alike; a rare label's
probabilities seldom pass 0.5, and its recall suffers. Under ``evaluation.threshold: per_label`` each evaluation
chooses each label's own, those that maximise the run's F1 (``evaluation.average``) on the validation texts
(:func:`f1_thresholds`), where together they beat 0.5 for every label on nearly every resample of those texts
(:func:`guarded_f1_thresholds`), and scores at them: chosen on the texts they are scored on, those scores lean
high, and a held-out file scored with ``finetune score`` says how they hold. A two-class model predicts its most
probable class, the positive one where its probability is over 0.5; under ``evaluation.threshold`` (a number, or
``per_label``) the positive class's threshold moves, chosen as one label's is, for the positive class's F1. A
mapping ``{label name: threshold}`` sets labels' own (:func:`finetune.tasks.named_thresholds`), such as those
``finetune score`` reads off a held-out file for a target precision or recall
(:mod:`finetune.metrics.operating_points`).

The model's config carries its thresholds by label name (``label_thresholds`` in ``config.json``,
:func:`finetune.tasks.model_thresholds`; ``{"spam": 0.31}`` for a two-class model), in the saved model and in each
checkpoint, where ``finetune predict``, ``finetune score`` and ``Predictor`` read them, and where a user of plain
transformers finds them: ``model.config.label_thresholds``. (transformers keeps an attribute it does not know in
the saved config, and its pipeline ignores it: ``pipeline`` returns the probabilities, to which a caller applies
the thresholds.) scikit-learn's ``TunedThresholdClassifierCV`` tunes one threshold of a binary classifier, by
cross-validating an estimator it refits; nothing in the stack tunes one per label for a pooled F1, or one on a
fine-tuned model's validation texts, or tests the gain on resamples, so this is written here.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from finetune.schema import DEFAULT_THRESHOLD


# chosen thresholds replace the default only where the validation texts say the move pays: their F1 above the
# default's in this share of bootstrap resamples of the texts
SURE = 0.95
RESAMPLES = 1000


def guarded_f1_thresholds(probabilities, references, average: str = "macro", sure: float = SURE,
                          resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """The thresholds of the best F1 of ``average`` on these texts (:func:`f1_thresholds`) where, together, they
    beat :data:`DEFAULT_THRESHOLD` for every label in at least ``sure`` of ``resamples`` bootstrap resamples of
    the texts (:func:`share_beating_default`); else the default for every label. A two-class model's positive
    class is one label (``macro``).

    The best thresholds on a few hundred texts often move far for the sake of a text or two (a well-trained model
    leaves few texts between 0.01 and 0.5), and those gains do not hold on other texts: held out, such
    thresholds scored below the default. A model whose default misses (one early in training, rare labels whose
    probabilities seldom reach 0.5, or a model trained on another balance) beats it on nearly every resample, and
    keeps them.
    """
    probabilities = np.asarray(probabilities, dtype=np.float32)
    references = np.asarray(references) > 0
    best = f1_thresholds(probabilities, references, average)
    if (best == DEFAULT_THRESHOLD).all():
        return best
    share = share_beating_default(probabilities, references, best, average, resamples, seed)
    return best if share >= sure else np.full_like(best, DEFAULT_THRESHOLD)


def share_beating_default(probabilities, references, thresholds, average: str = "macro",
                          resamples: int = RESAMPLES, seed: int = 0) -> float:
    """The share of ``resamples`` bootstrap resamples of the texts on which the F1 of ``average`` at ``thresholds``
    (one per label) is above its F1 at :data:`DEFAULT_THRESHOLD` for every label. A label without texts or
    predictions in a resample scores 0 there (scikit-learn's ``zero_division=0``), so it beats nothing.

    ``probabilities`` and ``references``: ``(texts, labels)``, as :func:`f1_thresholds` takes them.
    """
    probabilities = np.asarray(probabilities, dtype=np.float32)
    references = np.asarray(references) > 0
    counts = _counts_by_text(probabilities, references, np.asarray(thresholds, dtype=np.float32), average)
    texts, _, columns = counts.shape
    # every F1 here is a function of the counts summed over the texts: resampling the texts is resampling their
    # rows, and texts with the same row are drawn as one cell (two classes: at most 8 cells, whatever the texts)
    if columns <= _FEW_COLUMNS:
        cells, sizes = np.unique(counts.reshape(texts, -1), axis=0, return_counts=True)
        cells = cells.reshape(len(cells), 5, columns)
    else:
        cells, sizes = counts, None
    rng, beats = np.random.default_rng(seed), []
    for start in range(0, resamples, _RESAMPLES_AT_ONCE):
        drawn = _drawn(rng, texts, sizes, min(_RESAMPLES_AT_ONCE, resamples - start))
        beats.append(_f1_gain(drawn, cells, average) > 0)
    return float(np.mean(np.concatenate(beats)))


_FEW_COLUMNS = 8  # up to this many labels' counts, texts with the same counts are grouped into cells first
_RESAMPLES_AT_ONCE = 100
_COLUMNS_AT_ONCE = 64  # labels summed at once: (texts, 5 * 64) float32 at a time


def _drawn(rng: np.random.Generator, texts: int, sizes: Optional[np.ndarray], resamples: int) -> np.ndarray:
    """``(resamples, cells)``: how often each cell of ``sizes`` texts is drawn in each bootstrap resample of the
    ``texts``, or each text where ``sizes`` is None; float32, exact for counts up to 2**24."""
    if sizes is not None:
        return rng.multinomial(texts, sizes / texts, size=resamples).astype(np.float32)
    return np.stack([np.bincount(row, minlength=texts) for row in rng.integers(0, texts, (resamples, texts))]
                    ).astype(np.float32)


def _f1_gain(drawn: np.ndarray, cells: np.ndarray, average: str) -> np.ndarray:
    """Each resample's F1 of ``average`` at the thresholds less its F1 at the default, up to a positive factor
    (the labels' count or their texts'), which leaves its sign: the counts of ``cells`` (``(cells, 5, columns)``,
    :func:`_counts_by_text`) summed as ``drawn`` draws them."""
    from finetune.metrics._classification import scores_from_counts  # finetune.metrics imports this module

    gain = np.zeros(len(drawn))
    for block in range(0, cells.shape[2], _COLUMNS_AT_ONCE):  # the same resamples for every label
        part = cells[:, :, block:block + _COLUMNS_AT_ONCE]
        totals = (drawn @ part.reshape(len(part), -1).astype(np.float32)).reshape(len(drawn), 5, -1)
        hits_moved, made_moved, hits_default, made_default, held = totals.transpose(1, 0, 2)
        label_gain = scores_from_counts(hits_moved, made_moved, held)[2] - \
            scores_from_counts(hits_default, made_default, held)[2]
        # weighted F1 weighs each label by its texts in the resample; micro has one column, the pooled counts
        gain += (label_gain * held if average == "weighted" else label_gain).sum(1)
    return gain


def _counts_by_text(probabilities: np.ndarray, references: np.ndarray, thresholds: np.ndarray,
                    average: str) -> np.ndarray:
    """``(texts, 5, columns)``: each text's hits and predictions at ``thresholds``, then at the default, then its
    labels; one column for the pooled counts (``micro``), else one per label whose threshold moved (the others
    gain nothing)."""
    if average != "micro":
        moved = thresholds != DEFAULT_THRESHOLD
        probabilities, references, thresholds = probabilities[:, moved], references[:, moved], thresholds[moved]
    over_moved, over_default = probabilities > thresholds, probabilities > DEFAULT_THRESHOLD
    counts = np.stack([over_moved & references, over_moved, over_default & references, over_default, references],
                      axis=1)
    return counts.sum(2, keepdims=True, dtype=np.int32) if average == "micro" else counts.astype(np.int8)


def f1_thresholds(probabilities, references, average: str = "macro") -> np.ndarray:
    """The thresholds, one per label (float32, in label order), that maximise the F1 of ``average`` on these texts.

    ``probabilities``: the texts' sigmoid probabilities, ``(texts, labels)``; ``references``: their 0/1 labels,
    the same shape. A label is predicted where its probability is over its threshold, as
    :meth:`finetune.tasks.Task.predictions` does.

    * ``macro`` and ``weighted``: each label's threshold maximises its own F1; their mean, plain or weighted by
      the labels' texts, is then the largest any thresholds give.
    * ``micro``: the F1 of the labels' pooled counts ties the labels together. Starting from the default
      threshold, each label in turn takes the threshold that maximises the pooled F1 given the others', until
      none changes: the F1 rises at every change, so it ends at or above the default's, at a threshold no one
      label can better (the best of all, or near it).

    A label that no text has keeps :data:`DEFAULT_THRESHOLD`: at any other, all it would learn is to predict it
    less, from texts that cannot show when it is right.
    """
    probabilities = np.asarray(probabilities, dtype=np.float32)
    references = np.asarray(references) > 0
    if probabilities.ndim != 2 or probabilities.shape != references.shape:
        raise ValueError(f"probabilities {probabilities.shape} and references {references.shape} must be "
                         "(texts, labels) alike")
    labels = [Cuts(probabilities[:, j], references[:, j]) for j in range(probabilities.shape[1])]
    if average == "micro":
        return _pooled_f1_thresholds(labels, probabilities, references)
    return np.array([label.thresholds[label.best(0, 0, label.positives)] if label.tunable else DEFAULT_THRESHOLD
                     for label in labels], dtype=np.float32)


class Cuts:
    """One label's possible thresholds. Predicting its ``m`` most probable texts gives ``hits(m)`` of its
    ``positives``, so one sort counts every threshold: a cut falls between two different probabilities (texts of
    one probability go together), over 0."""

    def __init__(self, probability: np.ndarray, truth: np.ndarray):
        order = np.argsort(-probability, kind="stable")
        ranked = probability[order]
        below = np.append(ranked[1:], np.float32(0.0))  # the probability under each cut
        cuts = np.flatnonzero(ranked > below)
        self.positives = int(truth.sum())
        self.predicted = cuts + 1
        self.hits = np.cumsum(truth[order])[cuts]
        self.thresholds = _between(ranked[cuts], below[cuts])
        # a label no text has, or whose probabilities are all 0, keeps the default
        self.tunable = self.positives > 0 and cuts.size > 0

    def best(self, hits_else: int, predicted_else: int, positives: int) -> int:
        """The cut whose ``F1 = 2 * hits / (predicted + positives)``, with the others' hits and predictions added,
        is the largest; of cuts that tie, the one whose threshold is nearest the default."""
        f1 = 2.0 * (hits_else + self.hits) / (predicted_else + self.predicted + positives)
        tied = np.flatnonzero(f1 == f1.max())
        return int(tied[np.argmin(np.abs(self.thresholds[tied] - DEFAULT_THRESHOLD))])


def _pooled_f1_thresholds(labels: list[Cuts], probabilities: np.ndarray, references: np.ndarray) -> np.ndarray:
    """Micro F1's thresholds, label by label from the default, each change a strict rise (so it ends)."""
    thresholds = np.full(len(labels), DEFAULT_THRESHOLD, dtype=np.float32)
    predicted_now = probabilities > thresholds
    hits = (predicted_now & references).sum(0)
    predicted = predicted_now.sum(0)
    positives = int(references.sum())
    changed = True
    while changed:
        changed = False
        for j, label in enumerate(labels):
            if not label.tunable:
                continue
            hits_else, predicted_else = hits.sum() - hits[j], predicted.sum() - predicted[j]
            i = label.best(hits_else, predicted_else, positives)
            now = 2.0 * hits.sum() / (predicted.sum() + positives)
            if 2.0 * (hits_else + label.hits[i]) / (predicted_else + label.predicted[i] + positives) > now:
                thresholds[j], hits[j], predicted[j] = label.thresholds[i], label.hits[i], label.predicted[i]
                changed = True
    return thresholds


def _between(upper: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """Float32 ``t`` with ``lower <= t < upper``, element by element: ``p > t`` then holds for ``upper`` and not
    ``lower`` in float32 or float64 alike. The midpoint, or ``lower`` itself where the two are neighbouring floats."""
    middle = ((upper.astype(np.float64) + lower.astype(np.float64)) / 2).astype(np.float32)
    return np.where((lower <= middle) & (middle < upper), middle, lower)


def format_thresholds(labels: Sequence[str], thresholds: Sequence[float], most: int = 12) -> str:
    """``sport 0.31, news 0.62, ...``: the first ``most`` labels' thresholds, and how many more."""
    named = [f"{name} {t:.3g}" for name, t in zip(labels, thresholds)]
    more = len(named) - most
    return ", ".join(named[:most]) + (f" and {more} more" if more > 0 else "")
