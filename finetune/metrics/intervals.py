"""How far a score could move on another sample of texts like these: bootstrap intervals.

A validation set of a few hundred texts gives an F1 that moves by points with which texts it happens to hold;
a score without its spread invites reading noise as a difference between two runs. The interval here is the
percentile bootstrap's: the texts resampled with replacement, each metric computed on every resample, and the
middle 95% of the values kept.

Every built-in single-label metric is a function of the confusion matrix (a multi-label one, of the label
tallies of the texts' distinct pairs of true and predicted label sets; a regression one, of the distinct
(prediction, target) pairs, each weighted by how often a resample holds it), and resampling ``n`` texts with
replacement draws the matrix's cells from a multinomial over their observed shares. So a resample costs a count
for each cell that holds texts, whatever the number of texts, and each metric of all resamples is a few array
operations on the counts, with the definitions of :mod:`finetune.metrics._classification` (``zero_division=0``,
``labels=`` over every class, multiclass MCC), which the tests compare at the observed matrix. Written by hand:
evaluate has no bootstrap, and SciPy's (``scipy.stats.bootstrap``) resamples the rows, and is no dependency of
the package. The draws come from a generator of their own, seeded, so two evaluations of the same predictions
give the same interval and no training random state moves. The ranking metrics (ROC AUC, average precision) are
functions of each text's probability, not of a matrix of counts: there every text is a cell, and a resample
weighs the texts by how often it holds each (:mod:`finetune.metrics.ranking`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from finetune.metrics._classification import BUILTIN_METRICS, scores_from_counts
from finetune.metrics.ranking import MOST_PAIRS_FOR_AN_INTERVAL

RESAMPLES = 1000
LEVEL = 0.95
SEED = 0


def confusion_matrix(references, predictions, num_labels: int) -> np.ndarray:
    """``K x K`` counts: row = true class id, column = predicted class id."""
    ref = np.asarray(references, dtype=np.int64)
    pred = np.asarray(predictions, dtype=np.int64)
    return np.bincount(ref * num_labels + pred, minlength=num_labels * num_labels).reshape(num_labels, num_labels)


def metric_intervals(suite: Any, predictions, references, resamples: int = RESAMPLES, level: float = LEVEL,
                     seed: int = SEED, scores=None) -> dict[str, list[float]]:
    """The ``level`` bootstrap interval ``[low, high]`` of each of ``suite``'s metrics: those counted from the
    answers (:func:`counted_intervals`), and the ranking metrics from the texts' probabilities ``scores``
    (:func:`ranking_intervals`), in the suite's order."""
    intervals = {**counted_intervals(suite, predictions, references, resamples, level, seed),
                 **ranking_intervals(suite, scores, references, resamples, level, seed)}
    return {name: intervals[name] for name in suite.names if name in intervals}


def counted_intervals(suite: Any, predictions, references, resamples: int = RESAMPLES, level: float = LEVEL,
                      seed: int = SEED) -> dict[str, list[float]]:
    """The ``level`` bootstrap interval ``[low, high]`` of each of ``suite``'s metrics computed from counts.

    Args:
        suite: A :class:`~finetune.metrics.MetricSuite` (its names, number of labels and averaging).
        predictions: Predicted class ids.
        references: True class ids.
        resamples: How many resamples of the texts.
        level: The share of the resampled values the interval holds (the rest split evenly outside it).
        seed: Seeds the resamples' own generator.

    Returns:
        ``{metric: [low, high]}`` for the built-in metrics among ``suite.names`` (functions of the confusion
        matrix; a metric ``evaluate`` loads by name gets none); empty for none.
    """
    if hasattr(suite, "scores_of_tallies"):  # multi-label: every metric is a function of the label tallies
        return label_set_intervals(suite, predictions, references, resamples, level, seed)
    if hasattr(suite, "scores_of_weights"):  # regression: every metric is a weighted sum over the pairs
        return number_intervals(suite, predictions, references, resamples, level, seed)
    names = [name for name in suite.names if name in BUILTIN_METRICS]
    if not names:
        return {}
    k = suite.num_labels
    cells, counts = np.unique(np.asarray(references, dtype=np.int64) * k + np.asarray(predictions, dtype=np.int64),
                              return_counts=True)  # the confusion matrix's cells that hold texts
    true_of, predicted_of = np.divmod(cells, k)

    def scores(draws: np.ndarray) -> dict[str, np.ndarray]:
        return _class_scores(suite, names, draws, true_of, predicted_of)

    return _middles(names, scores, counts, resamples, level, seed)


def _class_scores(suite: Any, names: list[str], draws: np.ndarray, true_of: np.ndarray, predicted_of: np.ndarray
                  ) -> dict[str, np.ndarray]:
    """A single-label suite's ``names`` for each resample (``draws``, ``R x cells``), whose cells hold the texts of
    class ``true_of`` given class ``predicted_of``."""
    return scores_of_tallies(*tallies_of_draws(draws, true_of, predicted_of, suite.num_labels), names,
                             suite.average, suite.pos_label)


def label_set_intervals(suite: Any, predictions, references, resamples: int = RESAMPLES, level: float = LEVEL,
                        seed: int = SEED) -> dict[str, list[float]]:
    """:func:`metric_intervals` of a multi-label model (0/1 label vectors, scored by a
    :class:`~finetune.metrics.other_tasks.MultiLabelMetrics`). Its cells are the distinct pairs of a text's true
    and predicted label sets: a resample draws how many texts of each pair it holds, and the label tallies are
    those counts summed over the pairs."""
    pred, ref = np.asarray(predictions).astype(bool), np.asarray(references).astype(bool)
    labels = ref.shape[1]
    pairs, counts = np.unique(np.concatenate([ref, pred], axis=1), axis=0, return_counts=True)
    ref_of, pred_of = pairs[:, :labels].astype(np.float64), pairs[:, labels:].astype(np.float64)

    def scores(draws: np.ndarray) -> dict[str, np.ndarray]:
        return _label_set_scores(suite, draws.astype(np.float64), ref_of, pred_of)

    return _middles(list(suite.tallied), scores, counts, resamples, level, seed)


def ranking_intervals(suite: Any, scores, references, resamples: int = RESAMPLES, level: float = LEVEL,
                      seed: int = SEED) -> dict[str, list[float]]:
    """:func:`metric_intervals` of the ranking metrics (``suite.ranking``: ROC AUC, average precision) of the
    texts' probabilities ``scores``. Each text is its own cell, as its probability is its own: a resample's counts
    of the texts weigh them (:func:`finetune.metrics.ranking.ranking_scores`). None past
    :data:`~finetune.metrics.ranking.MOST_PAIRS_FOR_AN_INTERVAL` text-label pairs, and none for a metric undefined
    on the texts (a class they all have, or none has)."""
    names = _ranked_with_intervals(suite, scores, references)
    if not names:
        return {}

    def ranking(draws: np.ndarray) -> dict[str, np.ndarray]:
        return {name: values for name, values in suite.ranking_of(scores, references, draws).items() if name in names}

    return _middles(names, ranking, np.ones(len(references), dtype=np.int64), resamples, level, seed,
                    _ranking_chunk(scores))


def _ranked_with_intervals(suite: Any, *scored) -> list[str]:
    """The ranking metrics of ``suite`` that get an interval on the texts: defined for each ``(scores,
    references)`` of ``scored`` (one model's, or two's), and not too many text-label pairs."""
    names = list(getattr(suite, "ranking", ()))
    scores = scored[0]
    if not names or scores is None:
        return []
    columns = 1 if suite.average == "binary" else np.shape(scores)[1]  # binary ranks the positive class alone
    if len(scores) * columns > MOST_PAIRS_FOR_AN_INTERVAL:
        return []
    for these, references in zip(scored[::2], scored[1::2]):
        observed = suite.ranking_of(these, references, np.ones((1, len(references))))
        names = [name for name in names if np.isfinite(observed[name][0])]
    return names


def _ranking_chunk(scores) -> int:
    """Resamples at a time for the ranking metrics: about two million text-label pairs each."""
    return max(1, 2_000_000 // max(1, np.asarray(scores).size))


def _label_set_scores(suite: Any, draws: np.ndarray, ref_of: np.ndarray, pred_of: np.ndarray
                      ) -> dict[str, np.ndarray]:
    """A multi-label suite's scores of each resample (``draws``, ``R x cells``, as floats), whose cells hold texts
    of the true label sets ``ref_of`` given the sets ``pred_of`` (each ``cells x labels``, 0/1 as floats)."""
    exact_of = (ref_of == pred_of).all(axis=1).astype(np.float64)
    texts = draws.sum(axis=1)  # each resample holds as many texts as the file
    return suite.scores_of_tallies(draws @ (ref_of * pred_of), draws @ pred_of, draws @ ref_of,
                                   draws @ exact_of / texts)


def number_intervals(suite: Any, predictions, references, resamples: int = RESAMPLES, level: float = LEVEL,
                     seed: int = SEED) -> dict[str, list[float]]:
    """:func:`metric_intervals` of a regression model (scored by a
    :class:`~finetune.metrics.other_tasks.RegressionMetrics`). Its cells are the distinct (prediction, target)
    pairs, which a resample holds as many times as it draws them: each metric is scored with those counts as
    weights, Spearman's on the ranks the counts give. The work grows with the pairs, mostly as many as the texts.
    A correlation that is undefined on the texts (a constant side) gets no interval."""
    pred = np.asarray(predictions, dtype=np.float64).reshape(-1)
    ref = np.asarray(references, dtype=np.float64).reshape(-1)
    pairs, counts = np.unique(np.stack([pred, ref], axis=1), axis=0, return_counts=True)
    observed = suite.scores_of_weights(pairs[:, 0], pairs[:, 1], counts[None].astype(np.float64))
    names = [name for name, value in observed.items() if np.isfinite(value[0])]

    def scores(draws: np.ndarray) -> dict[str, np.ndarray]:
        scored = suite.scores_of_weights(pairs[:, 0], pairs[:, 1], draws)
        return {name: scored[name] for name in names}

    return _middles(names, scores, counts, resamples, level, seed)


def paired_differences(suite: Any, predictions, others, references, resamples: int = RESAMPLES,
                       level: float = LEVEL, seed: int = SEED, scores=None, other_scores=None
                       ) -> dict[str, list[float]]:
    """The ``level`` bootstrap interval of each metric's difference, ``predictions``' score less ``others``',
    both models scored on every resample of the same texts (a paired bootstrap): what a comparison of two models
    on one file can say, where their two intervals alone would overstate the doubt the texts share. The cells are
    the distinct (truth, this model's answer, the other's) of the texts, for each problem type as
    :func:`metric_intervals` has them.

    The ranking metrics' cells are the texts, each model's probabilities of them (``scores``, ``other_scores``).

    Returns:
        ``{metric: [low, high]}`` of the difference, as :func:`metric_intervals` gives intervals.
    """
    intervals = {**_paired_counted(suite, predictions, others, references, resamples, level, seed),
                 **_paired_ranking(suite, scores, other_scores, references, resamples, level, seed)}
    return {name: intervals[name] for name in suite.names if name in intervals}


def _paired_counted(suite: Any, predictions, others, references, resamples: int, level: float, seed: int
                    ) -> dict[str, list[float]]:
    """:func:`paired_differences` of the metrics counted from the two models' answers."""
    if hasattr(suite, "scores_of_tallies"):
        return _paired_label_sets(suite, predictions, others, references, resamples, level, seed)
    if hasattr(suite, "scores_of_weights"):
        return _paired_numbers(suite, predictions, others, references, resamples, level, seed)
    names = [name for name in suite.names if name in BUILTIN_METRICS]
    if not names:
        return {}
    k = suite.num_labels
    keys = (np.asarray(references, dtype=np.int64) * k + np.asarray(predictions, dtype=np.int64)) * k \
        + np.asarray(others, dtype=np.int64)
    cells, counts = np.unique(keys, return_counts=True)  # (true, this model's, the other's) that hold texts
    true_of, this_of, other_of = cells // (k * k), cells // k % k, cells % k

    def difference(draws: np.ndarray) -> dict[str, np.ndarray]:
        this, other = (_class_scores(suite, names, draws, true_of, of) for of in (this_of, other_of))
        return {name: this[name] - other[name] for name in names}

    return _middles(names, difference, counts, resamples, level, seed)


def _paired_ranking(suite, scores, other_scores, references, resamples, level, seed) -> dict[str, list[float]]:
    """:func:`paired_differences` of the ranking metrics: both models' probabilities weighed by each resample of
    the texts."""
    if other_scores is None:
        return {}
    names = _ranked_with_intervals(suite, scores, references, other_scores, references)
    if not names:
        return {}

    def difference(draws: np.ndarray) -> dict[str, np.ndarray]:
        this, other = (suite.ranking_of(these, references, draws) for these in (scores, other_scores))
        return {name: this[name] - other[name] for name in names}

    return _middles(names, difference, np.ones(len(references), dtype=np.int64), resamples, level, seed,
                    _ranking_chunk(scores))


def _paired_label_sets(suite, predictions, others, references, resamples, level, seed) -> dict[str, list[float]]:
    """:func:`paired_differences` of two multi-label models: the cells are the texts' distinct (true set, this
    model's set, the other's)."""
    sets = [np.asarray(a).astype(bool) for a in (references, predictions, others)]
    labels = sets[0].shape[1]
    rows, counts = np.unique(np.concatenate(sets, axis=1), axis=0, return_counts=True)
    ref_of, this_of, other_of = (rows[:, i * labels:(i + 1) * labels].astype(np.float64) for i in range(3))

    def difference(draws: np.ndarray) -> dict[str, np.ndarray]:
        draws = draws.astype(np.float64)
        this, other = (_label_set_scores(suite, draws, ref_of, pred_of) for pred_of in (this_of, other_of))
        return {name: this[name] - other[name] for name in suite.tallied}

    return _middles(list(suite.tallied), difference, counts, resamples, level, seed)


def _paired_numbers(suite, predictions, others, references, resamples, level, seed) -> dict[str, list[float]]:
    """:func:`paired_differences` of two regression models: the cells are the texts' distinct (target, this
    model's number, the other's); a metric undefined for either model on the texts gets no interval."""
    triples, counts = np.unique(np.stack([np.asarray(a, dtype=np.float64).reshape(-1)
                                          for a in (references, predictions, others)], axis=1),
                                axis=0, return_counts=True)
    ref_of, this_of, other_of = triples[:, 0], triples[:, 1], triples[:, 2]
    weights = counts[None].astype(np.float64)
    names = [name for name in suite.names if np.isfinite(suite.scores_of_weights(this_of, ref_of, weights)[name][0])
             and np.isfinite(suite.scores_of_weights(other_of, ref_of, weights)[name][0])]

    def difference(draws: np.ndarray) -> dict[str, np.ndarray]:
        this, other = suite.scores_of_weights(this_of, ref_of, draws), suite.scores_of_weights(other_of, ref_of,
                                                                                                  draws)
        return {name: this[name] - other[name] for name in names}

    return _middles(names, difference, counts, resamples, level, seed)


def _middles(names: list[str], scores, counts: np.ndarray, resamples: int, level: float, seed: int,
             chunk: int = 100) -> dict[str, list[float]]:
    """The ``level`` interval of each of ``names`` over the resamples of the cells ``counts``, each resample's
    values given by ``scores(draws)``; a resample where a value is undefined (NaN: a correlation over one repeated
    pair) is left out of its quantiles."""
    values: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for draws in resampled(counts, resamples, seed, chunk):
        for name, scored in scores(draws).items():
            values[name].append(scored)
    out = {}
    for name, parts in values.items():
        drawn = np.concatenate(parts)
        out[name] = _middle(drawn[np.isfinite(drawn)], level)
    return out


def _middle(values: np.ndarray, level: float) -> list[float]:
    tail = (1.0 - level) / 2
    return [float(v) for v in np.quantile(values, [tail, 1.0 - tail])]


def tallies_of(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the metrics read of confusion matrices ``R x K x K`` (rows the true class): each class's hits (its
    texts given it), the texts given it (predicted), and its texts (true), each ``R x K``."""
    return np.diagonal(counts, axis1=1, axis2=2), counts.sum(axis=1), counts.sum(axis=2)


def resampled(counts: np.ndarray, resamples: int, seed: int, chunk: int = 100):
    """``resamples`` resamples of texts counted by cell (``counts``, the cells that hold texts), ``chunk`` at a time:
    each an array of how many of the resample's texts fall in each cell. Only occupied cells are drawn, so the work
    grows with the texts' distinct cells, not with ``K x K``: a thousand labels cost what their errors do.

    A resample is a draw from the multinomial over the cells' shares where the cells are few beside the texts
    (numpy draws it cell by cell), and each text's cell drawn alone where they are many (a regression model's
    pairs, mostly one text each): the same distribution, each way where it is cheaper, and chunks of no more than
    about two million drawn texts."""
    texts = int(counts.sum())
    rng = np.random.default_rng(seed)
    by_text = len(counts) * 7 > texts
    cell_of_text = np.repeat(np.arange(len(counts)), counts) if by_text else None
    if by_text:
        chunk = max(1, min(chunk, 2_000_000 // texts))
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        if not by_text:
            yield rng.multinomial(texts, counts / texts, size=size)
            continue
        cells = cell_of_text[rng.integers(0, texts, size=(size, texts))] + np.arange(size)[:, None] * len(counts)
        yield np.bincount(cells.ravel(), minlength=size * len(counts)).reshape(size, len(counts))


def tallies_of_draws(draws: np.ndarray, true_of: np.ndarray, predicted_of: np.ndarray, num_labels: int):
    """The tallies (:func:`tallies_of`) of resampled cell counts ``draws`` (``R x cells``), whose cells hold the
    texts of class ``true_of`` given class ``predicted_of``."""
    offsets = np.arange(len(draws))[:, None] * num_labels  # each resample's own K slots

    def tally(of: np.ndarray, counts: np.ndarray) -> np.ndarray:
        slots = (offsets + of).ravel()
        return np.bincount(slots, weights=counts.ravel(), minlength=len(draws) * num_labels).reshape(
            len(draws), num_labels)

    hit = true_of == predicted_of
    return tally(true_of[hit], draws[:, hit]), tally(predicted_of, draws), tally(true_of, draws)


def scores_of_tallies(hits: np.ndarray, predicted: np.ndarray, true: np.ndarray, names: list[str], average: str,
                      pos_label: Any = None) -> dict[str, np.ndarray]:
    """Each metric of ``names`` for every row of the tallies (:func:`tallies_of`), averaged as a
    :class:`~finetune.metrics.MetricSuite` averages: ``binary`` on ``pos_label``, ``macro``, ``micro`` or
    ``weighted`` over every class."""
    hits, predicted, true = (np.asarray(a, dtype=np.float64) for a in (hits, predicted, true))
    texts = true.sum(axis=1)
    out = {}
    if "accuracy" in names:
        out["accuracy"] = hits.sum(axis=1) / texts
    averaged = [name for name in ("precision", "recall", "f1") if name in names]
    if averaged:
        by_average = _averaged(hits, predicted, true, average, pos_label)
        out.update({name: by_average[name] for name in averaged})
    if "matthews_correlation" in names:
        covariance = hits.sum(axis=1) * texts - (true * predicted).sum(axis=1)
        spread = (texts ** 2 - (predicted ** 2).sum(axis=1)) * (texts ** 2 - (true ** 2).sum(axis=1))
        out["matthews_correlation"] = np.divide(covariance, np.sqrt(spread), out=np.zeros_like(covariance),
                                                where=spread != 0)  # undefined: 0, as the metric says
    return {name: out[name] for name in names}


def _averaged(hits, predicted, true, average: str, pos_label: Any) -> dict[str, np.ndarray]:
    """Precision, recall and F1, one value per resample, for an ``average``."""
    if average == "micro":
        precision, recall, f1 = scores_from_counts(hits.sum(axis=1), predicted.sum(axis=1), true.sum(axis=1))
        return {"precision": precision, "recall": recall, "f1": f1}
    per_class = dict(zip(("precision", "recall", "f1"), scores_from_counts(hits, predicted, true)))
    if average == "binary":
        return {name: values[:, pos_label] for name, values in per_class.items()}
    if average == "weighted":  # every resample holds texts, so its supports never sum to 0
        return {name: (values * true).sum(axis=1) / true.sum(axis=1) for name, values in per_class.items()}
    return {name: values.mean(axis=1) for name, values in per_class.items()}


# what the intervals are, and what one of a single point means, said where they are shown
SPREAD = (f"the middle {LEVEL:.0%} of the metric's values over the texts resampled with replacement ({RESAMPLES} "
          f"bootstrap resamples): how far it could move on another sample of texts like these")
POINT_INTERVAL = ("An interval of one point means that no resample moved the metric, as the texts hold no error "
                  "of the kind that would: it is not certain.")


def scores_in_a_line(metrics: dict[str, Any], intervals: dict[str, list[float]]) -> str:
    """The metrics in one line of a log, each with its interval where it has one: ``loss=0.0416 f1=0.9683
    (0.9298-0.9929)``; ``matthews_correlation=-0.0041 (-0.0116 to 0.0025)``, where a dash would read as a minus."""
    return " ".join(f"{k}={v:.4f}" + (f" ({_span(*intervals[k])})" if k in intervals else "")
                    for k, v in metrics.items() if isinstance(v, float))


def _span(low: float, high: float) -> str:
    return f"{low:.4f}-{high:.4f}" if low >= 0 else f"{low:.4f} to {high:.4f}"


def metrics_with_intervals(metrics: dict[str, Any], intervals: dict[str, list[float]]) -> str:
    """One metric a line, with its interval where it has one, and what the intervals are."""
    width = max(len(k) for k in metrics)
    lines = [f"  {key.ljust(width)}  " + (f"{value:.4f}" if isinstance(value, float) else f"{value}")
             + (f"  ({LEVEL:.0%} interval {intervals[key][0]:.4f} to {intervals[key][1]:.4f})"
                if key in intervals else "") for key, value in metrics.items()]
    if intervals:
        lines.append(f"  {LEVEL:.0%} interval: {SPREAD}")
        if any(low == high for low, high in intervals.values()):
            lines.append(f"  {POINT_INTERVAL}")
    return "\n".join(lines)
