"""The keys that must fit ``model.problem_type``: how the labels are read, the loss's options, the metrics
computed, averaging, thresholds and the best model's metric. :func:`finetune.config.load_config` checks them with
the rest of a config, once every key has its type."""

from __future__ import annotations

import logging

from finetune.errors import ConfigError
from finetune.schema import DEFAULT_METRICS, DEFAULT_THRESHOLD, Config, DataConfig, EvalConfig

logger = logging.getLogger("finetune")


def check_for_problem_type(cfg: Config, metrics_chosen: bool) -> None:
    """Stop at a key that ``model.problem_type`` has no use for; keep the metrics it computes (``metrics_chosen``:
    the user listed them, and is told of those it leaves out)."""
    problem_type = cfg.model.problem_type
    if cfg.training.class_weights is not None and problem_type != "single_label":
        raise ConfigError(f"training.class_weights: apply to single_label only (model.problem_type is {problem_type})")
    if cfg.training.label_smoothing and problem_type != "single_label":
        raise ConfigError(f"training.label_smoothing: applies to single_label only (model.problem_type is {problem_type})")
    _check_label_columns(cfg.data, problem_type)
    if cfg.data.label_delimiter is not None and problem_type != "multi_label":
        raise ConfigError(f"data.label_delimiter: splits multi_label labels only (model.problem_type is {problem_type})")
    if cfg.data.label_map is not None and problem_type == "regression":
        raise ConfigError("data.label_map: names classes, and regression has none (model.problem_type is regression)")
    if cfg.data.drop_labels is not None and problem_type == "regression":
        raise ConfigError("data.drop_labels: names classes, and regression has none (model.problem_type is regression)")
    if cfg.evaluation.threshold != DEFAULT_THRESHOLD and problem_type == "regression":
        # single_label: two classes only, which the data says (finetune.assembly.build_task)
        raise ConfigError("evaluation.threshold: decides between classes, and regression has none "
                          "(model.problem_type is regression)")
    if cfg.data.label_delimiter == "":
        raise ConfigError("data.label_delimiter: must not be empty (null: the column holds lists)")
    _metrics_for_problem_type(cfg.evaluation, problem_type, metrics_chosen)
    _check_evaluation_for_problem_type(cfg.evaluation, problem_type)


# the metrics each problem type computes offline, and its default ones: finetune.metrics' names, written out here
# since importing them would import numpy into every command (a test holds the two equal)
PROBLEM_METRICS = {
    "single_label": None,  # the built-in classification metrics, the ranking ones, and any evaluate.load name
    "multi_label": ("accuracy", "f1", "precision", "recall", "roc_auc", "average_precision"),
    "regression": ("pearson", "spearmanr", "mse", "mae"),
}
REGRESSION_DEFAULT_METRICS = ["pearson", "spearmanr", "mse"]


def _check_label_columns(data: DataConfig, problem_type: str) -> None:
    """``data.label_column`` as a list: a column per label, which only multi_label reads, at least two, each once."""
    columns = data.label_column
    if isinstance(columns, str):
        return
    if problem_type != "multi_label":
        raise ConfigError(f"data.label_column: a list names a column per label, which is multi_label's layout "
                          f"(model.problem_type is {problem_type})", hint="set model.problem_type: multi_label")
    if len(columns) < 2:
        raise ConfigError(f"data.label_column: a list names a column per label, and multi_label needs at least two "
                          f"(got {columns})", hint="a column of 0/1 alone is two classes: name it alone, with single_label")
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise ConfigError(f"data.label_column: {', '.join(map(repr, repeated))} named more than once")
    if data.label_delimiter is not None:
        raise ConfigError("data.label_delimiter: splits the labels of one column, and data.label_column names a "
                          "column per label")


def _metrics_for_problem_type(evaluation: EvalConfig, problem_type: str, chosen: bool) -> None:
    """Keep the metrics the problem type computes.

    A config written for single labels (the shipped ones list accuracy, f1, ...
    matthews_correlation) must work with ``model.problem_type=multi_label`` or
    ``regression`` on the command line: a metric the problem type has no
    meaning for is left out, and when none is left the problem type's defaults
    are used (regression: pearson, spearmanr, mse). Warned of where the user
    ``chosen`` the list, not where a shipped config did.
    """
    allowed = PROBLEM_METRICS[problem_type]
    if allowed is None:
        return  # single labels: the built-in metrics and any evaluate.load name
    kept = [m for m in evaluation.metrics if m in allowed]
    dropped = [m for m in evaluation.metrics if m not in allowed]
    if not kept:
        kept = list(REGRESSION_DEFAULT_METRICS if problem_type == "regression" else DEFAULT_METRICS)
    if dropped and chosen and evaluation.metrics != DEFAULT_METRICS:
        logger.warning("evaluation.metrics: %s not computed for %s (it computes %s); using %s",
                       ", ".join(dropped), problem_type, ", ".join(allowed), ", ".join(kept))
    evaluation.metrics = kept


def _check_evaluation_for_problem_type(evaluation: EvalConfig, problem_type: str) -> None:
    """Averaging and the best-model metric must fit the problem type and the metrics computed."""
    if problem_type != "single_label" and evaluation.average == "binary":
        raise ConfigError(f"evaluation.average: binary needs single_label; {problem_type} uses micro, macro "
                          "or weighted")
    if evaluation.metric_for_best_model is not None:
        name = evaluation.metric_for_best_model.removeprefix("eval/")
        if name != "loss" and name not in evaluation.metrics:
            raise ConfigError(
                f"evaluation.metric_for_best_model: {evaluation.metric_for_best_model!r} is not computed "
                f"(loss or one of evaluation.metrics: {', '.join(evaluation.metrics)})"
            )
