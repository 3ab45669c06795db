"""Loss and metrics of a model on an evaluation dataloader, on any number of processes, and what in the saved
model's is worth a warning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from finetune.chunks import document_logits, split_batch
from finetune.columns import read_column
from finetune.metrics import metric_intervals, one_number_for_every_text, same_answer_for_every_text, scores_by_label
from finetune.tables import LABELS
from finetune.tasks import Task, label_names, set_model_thresholds
from finetune.thresholds import DEFAULT_THRESHOLD, SURE, format_thresholds


# the keys of an evaluation record (train_log.jsonl, metrics.json) that hold Evaluation.by_label and .intervals
EVAL_BY_LABEL = "eval_by_label"
EVAL_INTERVALS = "eval_intervals"
EVAL_THRESHOLDS = "eval_thresholds"


@dataclass
class Evaluation:
    """What one pass over the evaluation data measured."""

    metrics: dict[str, float]  # {"loss": ..., "num_samples": ..., <metric>: ...}
    # each label's precision, recall, F1 and support, by name (finetune.metrics.scores_by_label); None for
    # regression, or when no label names were given
    by_label: Optional[dict[str, dict[str, float]]] = None
    # each built-in metric's 95% bootstrap interval [low, high] over the texts (finetune.metrics.intervals); None
    # when no label names were given
    intervals: Optional[dict[str, list[float]]] = None
    # each label's threshold chosen on these texts, by name (Task.tune_thresholds: finetune.thresholds), at which
    # the metrics were scored; None where the task's threshold was used
    thresholds: Optional[dict[str, float]] = None

    def thresholds_said(self) -> str:
        """The thresholds chosen, for a log line: ``at each label's threshold, chosen on these texts: hurry 0.149,
        money 0.563``; where 0.5 stayed for every label, that and why."""
        thresholds = self.thresholds or {}
        if all(t == DEFAULT_THRESHOLD for t in thresholds.values()):
            return (f"at {DEFAULT_THRESHOLD}, kept: no thresholds chosen on these texts beat it on {SURE:.0%} of "
                    f"resamples of them")
        whose = "each label's threshold" if len(thresholds) > 1 else "the threshold"  # two classes: one
        return f"at {whose}, chosen on these texts: " + format_thresholds(list(thresholds), list(thresholds.values()))


def evaluate_model(model: torch.nn.Module, dataloader, accelerator, metrics=None,
                   task: Optional[Task] = None) -> dict[str, float]:
    """Loss and metrics of ``model`` on a prepared evaluation dataloader: the metrics of :func:`evaluation_of`.

    Args:
        model: The prepared model.
        dataloader: Prepared evaluation dataloader with ``labels`` in each batch.
        accelerator: The ``Accelerator``.
        metrics: A :class:`finetune.metrics.MetricSuite` (or anything with
            ``compute(predictions, references) -> dict``); ``None`` for loss only.
        task: The :class:`~finetune.tasks.Task` whose loss and predictions to
            use; ``None``: the model's ``config.problem_type``, unweighted.

    Returns:
        ``{"loss": ..., "num_samples": ..., <metric>: ...}`` as Python numbers.

    Raises:
        ValueError: for no dataloader (``run.eval_dataloader`` of a run without validation data).
    """
    if dataloader is None:
        raise ValueError("evaluate_model: no dataloader to evaluate; a run without validation data "
                         "(data.validation_split=0 and no validation file) has none")
    return evaluation_of(model, dataloader, accelerator, metrics, task).metrics


@torch.no_grad()
def evaluation_of(model: torch.nn.Module, dataloader, accelerator, metrics=None, task: Optional[Task] = None,
                  labels: Optional[Sequence[str]] = None) -> Evaluation:
    """Loss, metrics and, given the ``labels``' names, each label's scores, in one pass over the dataloader.

    Per-sample losses, predictions and references are collected with
    ``accelerator.gather_for_metrics``, which drops the samples Accelerate
    repeated to even out processes: every example counts exactly once. A text
    split into windows (``data.truncation: chunks``) is one example, its
    output the mean of its windows' logits. Under ``task.tune_thresholds`` each label's threshold (a two-class
    model's: its positive class's) is chosen on these texts first, the metrics are scored at it, and the model's
    config keeps it (``label_thresholds``, which a checkpoint or model saved next saves;
    :mod:`finetune.thresholds`). The arguments are :func:`evaluate_model`'s, and ``labels``: the label names in
    id order.
    """
    task = task or Task.of_model(accelerator.unwrap_model(model))
    ranked = bool(getattr(metrics, "ranking", None))  # ROC AUC or average precision: each text's probabilities
    was_training = model.training
    model.eval()
    losses, preds, refs, probs = [], [], [], []
    for batch in dataloader:
        inputs, chunk_rows = split_batch(batch)
        logits = document_logits(model(**inputs).logits, chunk_rows)  # a text's windows: one output, one sample
        loss = task.per_sample_loss(logits, batch["labels"])
        # to be tuned, thresholds need every text's probabilities: the predictions follow them, and the ranking
        # metrics read them; without thresholds to tune, the ranking metrics' probabilities are gathered apart
        answers = task.probabilities(logits) if task.tune_thresholds else task.predictions(logits)
        apart = (task.probabilities(logits),) if ranked and not task.tune_thresholds else ()
        gathered = accelerator.gather_for_metrics((loss, answers, batch["labels"], *apart))
        for kept, value in zip((losses, preds, refs, probs), gathered):
            kept.append(value.cpu())
    if was_training:
        model.train()
    if not losses:
        return Evaluation({"loss": float("nan"), "num_samples": 0})
    all_loss = torch.cat(losses)
    predictions = torch.cat(preds).numpy()
    references = torch.cat(refs).numpy()
    scores = {"scores": torch.cat(probs).numpy() if probs else predictions} if ranked else {}
    ranking = {**scores, "ranking": metrics.ranking} if ranked else {}  # each label's too
    tuned = None
    if task.tune_thresholds:
        tuned = task.tuned_thresholds(predictions, references)
        predictions = task.at_thresholds(predictions, tuned)
    out: dict[str, float] = {"loss": all_loss.double().mean().item(), "num_samples": int(all_loss.numel())}
    if metrics is not None:
        out.update(metrics.compute(predictions, references, **scores))
    by_label = intervals = None
    if labels is not None and task.problem_type != "regression":
        by_label = scores_by_label(predictions, references, labels, **ranking)
    if labels is not None and metrics is not None:
        intervals = metric_intervals(metrics, predictions, references, **scores)
    if tuned is not None:
        config = accelerator.unwrap_model(model).config
        names = task.thresholded_labels(labels if labels is not None else label_names(config))
        # the model's config carries the thresholds chosen for its weights: a checkpoint saved next saves them
        set_model_thresholds(config, names, tuned.tolist())
        tuned = dict(zip(names, tuned.tolist()))
    return Evaluation(out, by_label, intervals, tuned)


def one_answer_for_every_text(summary: dict[str, Any], targets=None) -> Optional[str]:
    """A caution when the saved model gave every validation text the same answer, else None
    (:func:`finetune.metrics.same_answer_for_every_text`, on the final evaluation); for regression, given the
    validation ``targets``, the same number (:func:`finetune.metrics.one_number_for_every_text`)."""
    if targets is not None:
        return one_number_for_every_text(summary["eval"], targets, "validation texts", "the saved model")
    return same_answer_for_every_text(summary.get("eval_by_label"), summary["eval"].get("num_samples"),
                                      "validation texts", "the saved model")


def validation_targets(run) -> Optional[list[float]]:
    """The regression targets of the validation rows of ``run`` (a :class:`~finetune.run.Run`; None for
    classes, or without validation)."""
    if run.labels.problem_type != "regression" or run.eval_dataloader is None:
        return None
    return read_column(run.eval_dataloader.dataset, LABELS)


def validation_support(run) -> Optional[dict[str, int]]:
    """Each class's (or label's) validation rows in ``run`` (a :class:`~finetune.run.Run`), by name; None for
    regression, or without validation."""
    from finetune.data import class_counts

    if run.labels.problem_type == "regression" or run.eval_dataloader is None:
        return None
    validation, names = run.eval_dataloader.dataset, run.labels.names
    if run.labels.problem_type == "multi_label":
        labels = read_column(validation, LABELS)
        counts = np.asarray(labels, dtype=np.float64).reshape(len(labels), len(names)).sum(0)
    else:
        counts = class_counts(validation, len(names))
    return {str(name): int(count) for name, count in zip(names, counts)}
