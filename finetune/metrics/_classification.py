"""Classification scores in plain numpy, shared by the local metric scripts.

The Hub's accuracy/f1/precision/recall/matthews_correlation scripts cannot be
fetched offline and call scikit-learn, which this package does not depend on,
so the scores are written out here by hand. They follow scikit-learn's
definitions exactly (``zero_division=0``, ``labels=`` semantics, multiclass
MCC), and the tests check them against scikit-learn.

This module must define no ``evaluate`` module classes: ``evaluate.load``
takes the first ``EvaluationModule`` subclass it finds in a script's
namespace as the metric, and a class imported from here would shadow the
script's own.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

AVERAGES = ("binary", "macro", "micro", "weighted")
# the metrics written out here, each a function of the confusion matrix (what its bootstrap intervals draw)
BUILTIN_METRICS: tuple[str, ...] = ("accuracy", "f1", "precision", "recall", "matthews_correlation")


def class_ids(predictions, references) -> tuple[np.ndarray, np.ndarray]:
    """Checks and converts predictions and references to 1-D int64 arrays.

    Args:
        predictions: Predicted class ids (array-like).
        references: True class ids (array-like).

    Returns:
        ``(predictions, references)`` as int64 numpy arrays.

    Raises:
        ValueError: If the inputs are not 1-D integer sequences of the same,
            non-zero length.
    """
    pred = np.asarray(predictions)
    ref = np.asarray(references)
    for name, array in (("predictions", pred), ("references", ref)):
        if array.ndim != 1:
            raise ValueError(f"{name} must be 1-D class ids, got shape {array.shape}")
        # An empty list comes out as float64; that case is reported below.
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{name} must be integer class ids, got dtype {array.dtype}")
    if pred.shape != ref.shape:
        raise ValueError(f"predictions and references differ in length: {pred.size} vs {ref.size}")
    if pred.size == 0:
        raise ValueError("no predictions to score")
    return pred.astype(np.int64, copy=False), ref.astype(np.int64, copy=False)


def _positions(values: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Index of each value in ``labels``, or -1 for values not among them."""
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    at = np.clip(np.searchsorted(sorted_labels, values), 0, labels.size - 1)
    return np.where(sorted_labels[at] == values, order[at], -1)


def _label_counts(pred: np.ndarray, ref: np.ndarray, labels: np.ndarray):
    """Per-label true positives, predicted counts and true counts (support)."""
    k = labels.size
    pred_at = _positions(pred, labels)
    ref_at = _positions(ref, labels)
    pred_sum = np.bincount(pred_at[pred_at >= 0], minlength=k)
    true_sum = np.bincount(ref_at[ref_at >= 0], minlength=k)
    hit = (pred == ref) & (ref_at >= 0)
    tp_sum = np.bincount(ref_at[hit], minlength=k)
    return tp_sum, pred_sum, true_sum


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    # zero_division=0, and no RuntimeWarning: the division only runs where defined.
    out = np.zeros(numerator.shape, dtype=np.float64)
    np.divide(numerator, denominator, out=out, where=denominator != 0)
    return out


def precision_recall_f1(
    predictions,
    references,
    average: str = "binary",
    pos_label: int = 1,
    labels: Sequence[int] | None = None,
) -> tuple[float, float, float]:
    """Averaged precision, recall and F1, as scikit-learn with ``zero_division=0``.

    Args:
        predictions: Predicted class ids.
        references: True class ids.
        average: ``binary`` (scores of ``pos_label`` only), ``macro``
            (unweighted mean over ``labels``), ``micro`` (from the counts
            summed over ``labels``) or ``weighted`` (mean weighted by support).
        pos_label: The positive class with ``average="binary"``; ignored
            otherwise.
        labels: The classes to score (and average over). A class absent from
            both arrays still counts, with scores 0. Defaults to the classes
            present in either array. Ignored with ``average="binary"``, as in
            scikit-learn.

    Returns:
        ``(precision, recall, f1)`` as Python floats.

    Raises:
        ValueError: On an unknown ``average``, repeated ``labels``, or, with
            ``average="binary"``, more than two classes or a ``pos_label``
            absent while two other classes are present.
    """
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    pred, ref = class_ids(predictions, references)
    label_array = _labels_to_score(np.union1d(pred, ref), average, pos_label, labels)
    tp_sum, pred_sum, true_sum = _label_counts(pred, ref, label_array)
    if average == "micro":
        tp_sum, pred_sum, true_sum = (np.array([s.sum()]) for s in (tp_sum, pred_sum, true_sum))

    precision, recall, f1 = scores_from_counts(tp_sum, pred_sum, true_sum)
    if average == "weighted" and true_sum.sum() > 0:
        weights = true_sum
    else:
        # scikit-learn falls back to the plain mean when every support is 0.
        weights = None
    return tuple(float(np.average(s, weights=weights)) for s in (precision, recall, f1))


def scores_from_counts(tp_sum, pred_sum, true_sum) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each label's precision, recall and F1 from its true positives, its predictions and its true samples.

    ``zero_division=0``, and F1 from the counts, 2tp / (2tp + fp + fn), as
    scikit-learn computes them; what every averaging starts from.
    """
    tp_sum, pred_sum, true_sum = (np.asarray(s, dtype=np.float64) for s in (tp_sum, pred_sum, true_sum))
    return _divide(tp_sum, pred_sum), _divide(tp_sum, true_sum), _divide(2.0 * tp_sum, true_sum + pred_sum)


def _labels_to_score(present: np.ndarray, average: str, pos_label: int,
                     labels: Sequence[int] | None) -> np.ndarray:
    """The classes :func:`precision_recall_f1` scores: ``pos_label`` alone for ``binary``, else ``labels``
    (checked) or the classes ``present`` in either array."""
    if average == "binary":
        if present.size > 2:
            raise ValueError(
                f"average='binary' needs at most two classes, found {present.size}; "
                "use macro, micro or weighted"
            )
        if pos_label not in present and present.size == 2:
            raise ValueError(f"pos_label={pos_label} is not one of the classes {present.tolist()}")
        return np.asarray([pos_label], dtype=np.int64)
    if labels is None:
        return present
    label_array = np.asarray(labels, dtype=np.int64).reshape(-1)
    if label_array.size == 0:
        raise ValueError("labels must not be empty")
    if np.unique(label_array).size != label_array.size:
        raise ValueError(f"labels has repeated classes: {label_array.tolist()}")
    return label_array


def accuracy(predictions, references) -> float:
    """Fraction of predictions equal to the references.

    Args:
        predictions: Predicted class ids.
        references: True class ids.

    Returns:
        The accuracy as a Python float.
    """
    pred, ref = class_ids(predictions, references)
    return float(np.mean(pred == ref))


def matthews_correlation(predictions, references) -> float:
    """Multiclass Matthews correlation coefficient (Gorodkin's R_K), as scikit-learn.

    Args:
        predictions: Predicted class ids.
        references: True class ids.

    Returns:
        The coefficient in [-1, 1] as a Python float; 0.0 where it is
        undefined (only one class predicted, or only one class true).
    """
    pred, ref = class_ids(predictions, references)
    # Classes absent from both arrays add nothing to any of the sums below.
    present = np.union1d(pred, ref)
    t_sum = np.bincount(np.searchsorted(present, ref), minlength=present.size).astype(np.float64)
    p_sum = np.bincount(np.searchsorted(present, pred), minlength=present.size).astype(np.float64)
    n_correct = float(np.count_nonzero(pred == ref))
    n_samples = p_sum.sum()
    # Float sums throughout: integer products overflow int64 from ~55k samples.
    cov_ytyp = n_correct * n_samples - np.dot(t_sum, p_sum)
    cov_ypyp = n_samples**2 - np.dot(p_sum, p_sum)
    cov_ytyt = n_samples**2 - np.dot(t_sum, t_sum)
    denominator = cov_ypyp * cov_ytyt
    if denominator == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(denominator))


def class_id_metric_info(description: str, citation: str, inputs_description: str):
    """The ``evaluate.MetricInfo`` every script here shares: int class ids in, numpy format.

    A function, not a base class: ``evaluate.load`` would take a shared class
    for the script's own metric.
    """
    # imported here: importing finetune.metrics must not pull in evaluate
    import datasets
    import evaluate

    return evaluate.MetricInfo(
        description=description,
        citation=citation,
        inputs_description=inputs_description,
        features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
        format="numpy",
    )


def averaging_options(defaults: dict, average=None, pos_label=None, labels=None) -> dict:
    """Per-call ``average``/``pos_label``/``labels``, falling back to those given at load time."""
    given = {"average": average, "pos_label": pos_label, "labels": labels}
    return {k: defaults[k] if v is None else v for k, v in given.items()}
