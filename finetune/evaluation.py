"""Loss and metrics of a model on an evaluation dataloader, on any number of processes."""

from __future__ import annotations

from typing import Optional

import torch

from finetune.chunks import document_logits, split_batch
from finetune.tasks import Task


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, dataloader, accelerator, metrics=None,
                   task: Optional[Task] = None) -> dict[str, float]:
    """Loss and metrics of ``model`` on a prepared evaluation dataloader.

    Per-sample losses, predictions and references are collected with
    ``accelerator.gather_for_metrics``, which drops the samples Accelerate
    repeated to even out processes: every example counts exactly once. A text
    split into windows (``data.truncation: chunks``) is one example, its
    output the mean of its windows' logits.

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
    """
    task = task or Task.of_model(accelerator.unwrap_model(model))
    was_training = model.training
    model.eval()
    losses, preds, refs = [], [], []
    for batch in dataloader:
        inputs, chunk_rows = split_batch(batch)
        labels = batch["labels"]
        logits = document_logits(model(**inputs).logits, chunk_rows)  # a text's windows: one output, one sample
        loss = task.per_sample_loss(logits, labels)
        loss, pred, ref = accelerator.gather_for_metrics((loss, task.predictions(logits), labels))
        losses.append(loss.cpu())
        preds.append(pred.cpu())
        refs.append(ref.cpu())
    if was_training:
        model.train()
    if not losses:
        return {"loss": float("nan"), "num_samples": 0}
    all_loss = torch.cat(losses)
    predictions = torch.cat(preds).numpy()
    references = torch.cat(refs).numpy()
    out: dict[str, float] = {"loss": all_loss.double().mean().item(), "num_samples": int(all_loss.numel())}
    if metrics is not None:
        out.update(metrics.compute(predictions, references))
    return out
