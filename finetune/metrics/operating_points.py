"""Where a two-class model's threshold could go: on a labelled file, the threshold that reaches each target precision
or recall of the positive class, and what it costs in the other (``finetune score``).

A spam filter's users rarely want the F1 that 0.5 gives: one wants 99% of what it flags to be spam, another 95%
of the spam found. Each row answers one such aim on the file scored: for a precision, the lowest threshold that
keeps it (the most recall at that precision); for a recall, the highest that reaches it (the most precision).
They are read off the file's texts, so they hold for texts like them; the threshold goes to ``finetune predict
--threshold`` or ``evaluation.threshold``. scikit-learn's ``precision_recall_curve`` gives the whole curve; this
reads the few points a user asks of it, written here to use the cuts :mod:`finetune.thresholds` already counts.
``finetune.score_tables`` prints them.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from finetune.thresholds import Cuts

# the aims a file is read for: these precisions, and these recalls, of the positive class
TARGETS = (0.9, 0.95, 0.99)


def operating_points(probability, truth, threshold: float, targets=TARGETS) -> list[dict[str, Any]]:
    """The positive class's precision, recall, F1 and predicted texts at the model's ``threshold`` (the row
    ``aim: "the model's"``), and at the threshold each target precision and recall asks for (``aim: "precision
    >= 0.95"``); a target no threshold reaches has ``threshold: None``.

    ``probability``: each text's probability of the positive class; ``truth``: whether it is of that class.
    """
    probability = np.asarray(probability, dtype=np.float32)
    truth = np.asarray(truth) > 0
    predicted = probability > threshold
    rows = [_row("the model's", threshold, int((predicted & truth).sum()), int(predicted.sum()), int(truth.sum()))]
    cuts = Cuts(probability, truth)
    precision = cuts.hits / cuts.predicted
    recall = cuts.hits / max(cuts.positives, 1)
    for target in targets:  # the most recall that keeps the precision: the cut with the most texts predicted
        kept = np.flatnonzero(precision >= target)
        rows.append(_at(cuts, f"precision >= {target:g}", kept[-1] if kept.size and cuts.positives else None))
    for target in targets:  # the most precision that reaches the recall: the cut with the fewest texts predicted
        reached = np.flatnonzero(recall >= target)
        rows.append(_at(cuts, f"recall >= {target:g}", reached[0] if reached.size and cuts.positives else None))
    return rows


def _at(cuts: Cuts, aim: str, cut: Optional[int]) -> dict[str, Any]:
    if cut is None:
        return {"aim": aim, "threshold": None}
    return _row(aim, float(cuts.thresholds[cut]), int(cuts.hits[cut]), int(cuts.predicted[cut]), cuts.positives)


def _row(aim: str, threshold: float, hits: int, predicted: int, positives: int) -> dict[str, Any]:
    precision = hits / predicted if predicted else 0.0
    recall = hits / positives if positives else 0.0
    f1 = 2 * hits / (predicted + positives) if predicted + positives else 0.0
    return {"aim": aim, "threshold": float(threshold), "precision": precision, "recall": recall, "f1": f1,
            "predicted": predicted}


def two_class_points(task, probabilities, references, names, pos_label: Optional[int]) -> Optional[dict[str, Any]]:
    """What ``finetune score`` reports of a two-class single-label model: ``{"label": the positive class,
    "points": operating_points(...)}``, read at its own threshold (0.5 where it carries none); None for another.

    ``task``: the :class:`~finetune.tasks.Task` the file was scored with; ``probabilities``: each text's class
    probabilities; ``references``: their class ids; ``pos_label``: the metrics' positive class id, where the
    model carries none (else the second class).
    """
    if task.problem_type != "single_label" or len(names) != 2:
        return None
    positive = task.positive_class if task.positive_class is not None else 1 if pos_label is None else pos_label
    threshold = float(task.threshold) if task.positive_class is not None else 0.5
    points = operating_points(np.asarray(probabilities)[:, positive], np.asarray(references) == positive, threshold)
    return {"label": names[positive], "points": points}
