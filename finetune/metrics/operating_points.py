"""Where a thresholded model's thresholds could go: on a labelled file, the threshold that reaches each target
precision or recall of a two-class model's positive class, or of each label of a multi-label model, and what it
costs in the other (``finetune score``).

A spam filter's users rarely want the F1 that 0.5 gives: one wants 99% of what it flags to be spam, another 95%
of the spam found. Each row answers one such aim on the file scored: for a precision, the lowest threshold that
keeps it (the most recall at that precision); for a recall, the highest that reaches it (the most precision).
They are read off the file's texts, so they hold for texts like them; the threshold goes to ``finetune predict
--threshold`` or ``evaluation.threshold`` (by label name, ``{toxic: 0.3}``, for several labels). scikit-learn's
``precision_recall_curve`` gives the whole curve; this reads the few points a user asks of it, written here to use
the cuts :mod:`finetune.thresholds` already counts. ``finetune.score_tables`` prints them.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from finetune.metrics._classification import scores_from_counts
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
    precision, recall, f1 = (float(score) for score in scores_from_counts(hits, predicted, positives))
    return {"aim": aim, "threshold": float(threshold), "precision": precision, "recall": recall, "f1": f1,
            "predicted": predicted}


def label_points(task, probabilities, references, names, pos_label: Optional[int]) -> Optional[dict[str, list]]:
    """What ``finetune score`` reports of a thresholded model, ``{label: operating_points(...)}``, each read at
    the threshold the model predicts at: every label's of a multi-label model, the positive class's of a
    two-class single-label one (0.5 where it carries none); None for a regression model or more classes, which
    no threshold decides.

    ``task``: the :class:`~finetune.tasks.Task` the file was scored with; ``probabilities``: each text's class
    or label probabilities; ``references``: their class ids, or 0/1 label vectors; ``pos_label``: the
    metrics' positive class id, where a two-class model carries none (else the second class).
    """
    probabilities, references = np.asarray(probabilities), np.asarray(references)
    if task.problem_type == "multi_label":
        thresholds = task.thresholds_by_label(names)
        return {name: operating_points(probabilities[:, j], references[:, j], thresholds[name])
                for j, name in enumerate(names)}
    if task.problem_type != "single_label" or len(names) != 2:
        return None
    positive = task.positive_class if task.positive_class is not None else 1 if pos_label is None else pos_label
    threshold = float(task.threshold) if task.positive_class is not None else 0.5
    return {names[positive]: operating_points(probabilities[:, positive], references == positive, threshold)}
