"""The evaluation history, the best model and early stopping, judged from the records.

Everything here is a function of the evaluation records ``fit`` keeps (and
saves in every checkpoint), so a resumed run knows its best evaluation and how
long it has waited for a better one without any state of its own.

An evaluation *improves* when its metric beats the best so far by more than
``evaluation.early_stopping_threshold`` (the first evaluation always does).
The best evaluation is the last one that improved; its checkpoint,
``checkpoints/checkpoint-<its update>``, is never pruned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from finetune.config import EvalConfig
from finetune.errors import ConfigError


@dataclass(frozen=True)
class Selection:
    """How evaluations are compared: the metric, its direction and the early-stopping rule."""

    # a key of the evaluation metrics: loss, accuracy, f1, ...
    metric: str
    greater_is_better: bool
    # stop after this many evaluations in a row without improvement (None: never)
    patience: Optional[int] = None
    # an improvement must exceed this
    threshold: float = 0.0

    @classmethod
    def from_config(cls, cfg: EvalConfig) -> Optional["Selection"]:
        """The selection a config asks for, or ``None`` when it asks for none.

        ``load_best_model_at_end`` or ``early_stopping_patience`` without a
        metric select on the validation loss, as the Trainer does. Lower is
        better for a loss or an error (names ending in ``loss``, ``error``,
        ``mse``, ``mae``), higher for every other metric, unless
        ``greater_is_better`` says otherwise.
        """
        if not cfg.compares_evaluations:
            return None
        metric = (cfg.metric_for_best_model or "loss").removeprefix("eval/")
        greater = cfg.greater_is_better
        if greater is None:
            greater = not metric.endswith(("loss", "error", "mse", "mae"))
        return cls(metric, greater, cfg.early_stopping_patience, cfg.early_stopping_threshold)

    def describe(self) -> str:
        return f"{self.metric} ({'higher' if self.greater_is_better else 'lower'} is better)"

    def _improves(self, value: float, best: Optional[float]) -> bool:
        if best is None:
            return value == value  # NaN never improves
        gain = value - best if self.greater_is_better else best - value
        return gain > self.threshold

    def value_of(self, record: dict[str, Any]) -> float:
        """The metric of an evaluation record.

        Raises:
            ConfigError: if the evaluation did not compute it.
        """
        key = f"eval/{self.metric}"
        if key not in record:
            computed = ", ".join(k.removeprefix("eval/") for k in record if k.startswith("eval/"))
            raise ConfigError(f"evaluation.metric_for_best_model: {self.metric!r} is not among the evaluation's "
                              f"results ({computed})")
        return float(record[key])

    def judge(self, history: list[dict[str, Any]]) -> "Judgement":
        """The best record of ``history`` and the evaluations since it (all from the records alone)."""
        best: Optional[dict[str, Any]] = None
        waited = 0
        for record in history:
            if self._improves(self.value_of(record), None if best is None else self.value_of(best)):
                best, waited = record, 0
            else:
                waited += 1
        return Judgement(self, best, waited)


@dataclass(frozen=True)
class Judgement:
    """Where the run stands: its best evaluation, and how many evaluations came after it."""

    selection: Selection
    best: Optional[dict[str, Any]]
    evaluations_since_best: int

    @property
    def best_step(self) -> Optional[int]:
        return None if self.best is None else int(self.best["step"])

    @property
    def best_value(self) -> Optional[float]:
        return None if self.best is None else self.selection.value_of(self.best)

    @property
    def should_stop(self) -> bool:
        patience = self.selection.patience
        return patience is not None and self.evaluations_since_best >= patience

    def why_stopped(self) -> str:
        n = self.evaluations_since_best
        return (f"early stopping: {self.selection.metric} has not improved on {self.best_value:.6g} "
                f"(update {self.best_step}) by more than {self.selection.threshold:g} for "
                f"{n} evaluation{'s' if n != 1 else ''} (evaluation.early_stopping_patience)")


class EvalHistory:
    """The run's evaluation records and, under a :class:`Selection`, which one is best.

    One object, shared: the evaluations add records to it, the run's logger
    keeps a resumed ``train_log.jsonl`` in step with it, each checkpoint saves
    it (and pruning spares the best one's checkpoint), and ``metrics.json``
    reports it. Everything it says is a function of the records, so a resumed
    run knows its best evaluation from the checkpoint alone.

    Args:
        selection: How evaluations are compared, or ``None`` (no best model, no early stopping).
        records: Earlier records (a resumed run's).
    """

    def __init__(self, selection: Optional[Selection] = None, records: Optional[list[dict[str, Any]]] = None):
        self.selection = selection
        self.records: list[dict[str, Any]] = list(records or [])

    @classmethod
    def from_config(cls, cfg: EvalConfig) -> "EvalHistory":
        return cls(Selection.from_config(cfg))

    def restore(self, records: list[dict[str, Any]]) -> None:
        """Replace the records with a checkpoint's."""
        self.records[:] = records

    def add(self, record: dict[str, Any]) -> dict[str, Any]:
        """Keep an evaluation record; under a selection it first says whether it is the best so far (``is_best``)."""
        if self.selection is not None:
            record["is_best"] = self.selection.judge(self.records + [record]).best is record
        self.records.append(record)
        return record

    def done_at(self, step: int) -> bool:
        """Whether the last evaluation was at update ``step``."""
        return bool(self.records) and self.records[-1]["step"] == step

    def judge(self) -> Optional[Judgement]:
        """Where the run stands, or ``None`` without a selection or before any evaluation."""
        if self.selection is None or not self.records:
            return None
        return self.selection.judge(self.records)

    @property
    def best_step(self) -> Optional[int]:
        """The update of the best evaluation so far (``None``: no selection, or none yet)."""
        judgement = self.judge()
        return None if judgement is None else judgement.best_step

    def should_stop(self) -> bool:
        """Early stopping: the last ``early_stopping_patience`` evaluations did not improve."""
        judgement = self.judge()
        return judgement is not None and judgement.should_stop
