"""What a classifier's outputs become as predictions: a label or labels decided at thresholds, a dict a text.

One model (:class:`finetune.predictor.Predictor`) and several averaged (:class:`finetune.ensemble.Ensemble`)
decide alike; they differ only in where their logits and probabilities come from.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from finetune.errors import ConfigError


class PredictionRows:
    """Decisions and prediction rows of a classifier. A subclass gives ``labels``, ``problem_type``,
    ``positive_label``, ``decision_config`` (the transformers config whose ``label_thresholds`` decide),
    ``logits(texts, text_pairs, progress)`` and ``probabilities(texts, text_pairs, progress)``."""

    labels: list[str]
    problem_type: str
    positive_label: Optional[str]

    def task_at(self, threshold=None):
        """The model's :class:`~finetune.tasks.Task`, predicting at ``threshold`` (a number, one per label, or
        ``{label name: threshold}``); ``None``: at its own thresholds (:func:`finetune.tasks.decision_task`).

        Raises:
            ConfigError: for a threshold where none applies (regression, more than two classes): said, not ignored.
        """
        from finetune.tasks import decision_task

        try:
            return decision_task(self.decision_config, threshold, self.positive_label)
        except ValueError as exc:
            raise ConfigError(f"threshold {threshold}: {exc}") from None

    def predict(self, texts: Sequence[str], text_pairs: Optional[Sequence[str]] = None,
                progress: bool = False) -> list[dict[str, Any]]:
        """One dict per text, in input order.

        * single label: ``{"label", "score", "probabilities": {label: p}}``;
        * multi-label: ``{"labels": [every label with p > its threshold], "probabilities": {label: p}}``;
        * regression: ``{"score": the predicted number}``.
        """
        if self.problem_type == "regression":
            return [{"score": float(row[0])} for row in self.logits(texts, text_pairs, progress)]
        probs = self.probabilities(texts, text_pairs, progress)
        results = []
        for row, decided in zip(probs, self.task.decide(probs)):
            probabilities = {name: float(p) for name, p in zip(self.labels, row)}
            if self.problem_type == "multi_label":
                chosen = [name for name, yes in zip(self.labels, decided) if yes]
                results.append({"labels": chosen, "probabilities": probabilities})
                continue
            label = int(decided)
            results.append({"label": self.labels[label], "score": float(row[label]), "probabilities": probabilities})
        return results

    def empty_prediction(self) -> dict[str, Any]:
        """What an empty text gets, so that output rows still line up with the input."""
        if self.problem_type == "regression":
            return {"score": None}
        probabilities = {name: None for name in self.labels}
        if self.problem_type == "multi_label":
            return {"labels": [], "probabilities": probabilities}
        return {"label": "", "score": None, "probabilities": probabilities}


def probabilities_of_logits(logits: "np.ndarray", problem_type: str) -> "np.ndarray":  # noqa: F821
    """Float32 label probabilities of float32 ``logits``: each row's softmax (single label), each label's
    sigmoid (multi-label); computed in float64, so that logits too large to exponentiate stay exact."""
    import numpy as np

    logits = logits.astype(np.float64)
    if problem_type == "multi_label":
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    logits -= logits.max(axis=1, keepdims=True)
    exp = np.exp(logits)
    return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)
