"""Two models on the same labelled texts: ``finetune score RUN --file F --against OTHER``, for any problem type.

Which of two runs is better is a question about their difference on the same texts, not about each one's score
alone: texts hard for one model are mostly hard for the other, so the doubt the file leaves is largely shared
and falls out of the difference. The difference's interval is the paired bootstrap's
(:func:`finetune.metrics.paired_differences`): both models scored on each resample of the texts. An interval
that holds 0 is no evidence that either model does better on texts like these.

The other run's model reads the file as the first run's settings read it (the same rows, in the same order,
with the same labels) and is scored with the first run's metrics; each model cuts its texts as its own run did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from finetune.errors import ConfigError


@dataclass
class Comparison:
    """What :func:`compare` found."""

    # the other run's output directory
    against: str
    # the other model's scores, with the first run's metric settings
    metrics: dict[str, float]
    # each metric's difference, the first model's score less the other's
    differences: dict[str, float]
    # the 95% paired bootstrap interval [low, high] of each difference
    intervals: dict[str, list[float]]

    def to_dict(self) -> dict[str, Any]:
        return {"against": self.against, "metrics": self.metrics, "differences": self.differences,
                "intervals": self.intervals}


def score_against(this, other_dir, batch_size: int, precision: str, across_processes: bool = False) -> Comparison:
    """Load the other run's model (or a folder of runs' models, averaged: :mod:`finetune.ensemble`) and compare it
    with ``this`` on the same texts (:func:`compare`); ``across_processes``: the launched processes share its
    batches (:class:`~finetune.predictor.Predictor`)."""
    from finetune.errors import out_of_memory_told_as
    from finetune.predict import batch_too_large, load_predictor

    with out_of_memory_told_as(lambda _: batch_too_large(batch_size)):
        predictor = load_predictor(other_dir, batch_size=batch_size, precision=precision,
                                   across_processes=across_processes, notes=False)  # said of the first model
        return compare(this, predictor, str(other_dir), this.suite)


def compare(this, predictor, other_dir: str, suite) -> Comparison:
    """The other model's scores on the texts ``this`` (a :class:`~finetune.score.Score`) was scored on, and each
    metric's difference with its paired interval.

    Args:
        this: The first model's score of the file (with its texts).
        predictor: The other run's :class:`~finetune.predictor.Predictor`.
        other_dir: The other run's folder, for the report.
        suite: The first run's metrics (a :class:`~finetune.metrics.MetricSuite`, or the multi-label or
            regression ones).

    Raises:
        ConfigError: for a model of another problem type, or one that predicts a label the first does not know.
    """
    import torch

    from finetune.metrics import paired_differences

    kind = problem_type_of(this)
    check_comparable(this.labels, kind, predictor.labels, predictor.problem_type, other_dir)
    logits = torch.from_numpy(predictor.logits(this.texts, this.pairs, progress=True))
    task = predictor.task  # the other model at its own thresholds
    others = in_this_runs_labels(task.predictions(logits).numpy(), predictor.labels, this.labels, kind)
    # the ranking metrics' probabilities, each label's in this run's column of it (0 for one the other lacks)
    scores = {} if this.scores is None else {"scores": in_this_runs_columns(
        task.probabilities(logits).numpy(), predictor.labels, this.labels)}
    metrics = suite.compute(others, this.references, **scores)
    differences = {name: this.metrics[name] - value for name, value in metrics.items()}
    intervals = paired_differences(suite, this.predictions, others, this.references, scores=this.scores,
                                   other_scores=scores.get("scores"))
    return Comparison(str(other_dir), metrics, differences, intervals)


def check_comparable(ours: list[str], kind: str, theirs: list[str], their_kind: str, other_dir) -> None:
    """Refuse a model that answers another question: another problem type, or a label this run's model lacks.

    Raises:
        ConfigError: naming ``--against`` and the other run's folder.
    """
    if their_kind != kind:
        raise ConfigError(f"--against {other_dir}: its model is {their_kind}, this run's {kind}: the two do not "
                          f"answer the same question")
    unknown = [name for name in theirs if name not in ours] if kind != "regression" else []
    if unknown:
        raise ConfigError(f"--against {other_dir}: its model predicts {unknown[0]!r}, which is no label of "
                          f"this run's ({', '.join(ours[:10])}): the two do not answer the same question")


def problem_type_of(score) -> str:
    """A :class:`~finetune.score.Score`'s problem type, from what it holds: a confusion matrix (single labels),
    each label's scores alone (several labels a text), or neither (a number)."""
    if score.confusion is not None:
        return "single_label"
    return "multi_label" if score.by_label is not None else "regression"


def in_this_runs_labels(answers: np.ndarray, theirs: list[str], ours: list[str], kind: str) -> np.ndarray:
    """The other model's answers in this run's label order (names matched): class ids renumbered, or label
    vectors' columns moved (a label the other model lacks is never predicted); a number stays as it is."""
    if kind == "regression":
        return answers
    if kind == "single_label":
        return np.asarray([ours.index(name) for name in theirs], dtype=np.int64)[answers]
    return in_this_runs_columns(answers, theirs, ours)


def in_this_runs_columns(matrix: np.ndarray, theirs: list[str], ours: list[str]) -> np.ndarray:
    """A matrix of the other model's with a column a label (its label vectors, its probabilities), its columns
    moved to this run's label order by name; a label the other model lacks gets a column of zeros."""
    moved = np.zeros((len(matrix), len(ours)), dtype=matrix.dtype)
    moved[:, [ours.index(name) for name in theirs]] = matrix
    return moved


def format_comparison(this, comparison: Comparison, texts: int) -> str:
    """The two models' scores side by side, each difference with its interval, and what the interval is."""
    width = max(len(name) for name in comparison.metrics)
    lines = [f"against {comparison.against}, on the same {texts} texts (scored with this run's metrics):",
             f"  {'metric'.ljust(width)}  this    other   this - other"]
    for name, value in comparison.metrics.items():
        low_high = (f"  (95% interval {comparison.intervals[name][0]:+.4f} to {comparison.intervals[name][1]:+.4f})"
                    if name in comparison.intervals else "")
        lines.append(f"  {name.ljust(width)}  {this.metrics[name]:.4f}  {value:.4f}  "
                     f"{comparison.differences[name]:+.4f}{low_high}")
    if comparison.intervals:
        holding = [name for name, (low, high) in comparison.intervals.items() if low <= 0 <= high]
        lines.append("  95% interval: the middle 95% of the difference over the texts resampled with replacement, "
                     "both models on each resample (a paired bootstrap)")
        lines.append("  " + (f"{', '.join(holding)}: the interval holds 0, so these texts are no evidence that either "
                             "model is better" if holding else
                             "no interval holds 0: each difference is beyond what resampling these texts moves"))
    return "\n".join(lines)
