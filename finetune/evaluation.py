"""Loss and metrics of a model on an evaluation dataloader, on any number of processes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, dataloader, accelerator, metrics=None) -> dict[str, float]:
    """Loss and metrics of ``model`` on a prepared evaluation dataloader.

    Per-sample losses, predictions and references are collected with
    ``accelerator.gather_for_metrics``, which drops the samples Accelerate
    repeated to even out processes: every example counts exactly once.

    Args:
        model: The prepared model.
        dataloader: Prepared evaluation dataloader with ``labels`` in each batch.
        accelerator: The ``Accelerator``.
        metrics: A :class:`finetune.metrics.MetricSuite` (or anything with
            ``compute(predictions, references) -> dict``); ``None`` for loss only.

    Returns:
        ``{"loss": ..., "num_samples": ..., <metric>: ...}`` as Python numbers.
    """
    was_training = model.training
    model.eval()
    losses, preds, refs = [], [], []
    for batch in dataloader:
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        loss = F.cross_entropy(logits, labels, reduction="none")
        loss, pred, ref = accelerator.gather_for_metrics((loss, logits.argmax(-1), labels))
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
