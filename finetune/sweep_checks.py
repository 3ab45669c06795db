"""What a sweep's start checks before its first trial, and its dry run before the runs it tries: one process,
the objective, every value of the space against the config, alone and beside each value of every other key (each a
one-line error), and a pruner that would
compare trials at different texts seen (a warning)."""

from __future__ import annotations

import itertools
import logging

from finetune.errors import ConfigError
from finetune.search_space import overrides, render

logger = logging.getLogger("finetune")


def check_sweep(sweep) -> tuple[str, bool]:
    """What a start checks before its first trial: one process, the objective, the space against the config;
    returns the objective's metric and whether greater is better."""
    from finetune.launch import launched_world_size

    if launched_world_size() > 1:  # MPI launchers too; a malformed count is one line, not a traceback
        raise ConfigError("finetune sweep runs each trial in one process: start one worker per GPU "
                          "(CUDA_VISIBLE_DEVICES=i finetune sweep ... --storage URL) instead of accelerate launch")
    metric, greater = objective_of(sweep.run_config)
    check_space_against_config(sweep, sweep.where)
    check_test_set(sweep)
    warn_if_pruning_misaligned(sweep)
    return metric, greater


def check_test_set(sweep) -> None:
    """A test set (``data.test_file``), which the search's trials leave out: read now against the training data's
    labels where seeds or folds runs will score it after the search, so that a file they cannot read stops the
    sweep before its first trial rather than after its last; said where nothing in the sweep will score it.

    Raises:
        FinetuneError: as a run reading the test set raises it (:func:`finetune.data.load_test_split`).
    """
    data = sweep.run_config.data
    if (data.test_file is None and data.test_split_name is None) or not sweep.space.dimensions:
        return  # without a search, every run reads it at its start
    if not sweep.seeds and not sweep.folds:
        logger.warning("the test set %s is scored by no run of this sweep: its search leaves it out, and seeds or "
                       "folds runs (--seeds, --folds) of the config it chooses would score it; best.yaml keeps it",
                       data.test_file or data.test_split_name)
        return
    from finetune.data import load_splits, load_test_split

    cfg = sweep.run_config
    _, labels = load_splits(data, seed=cfg.split_seed, problem_type=cfg.model.problem_type)
    load_test_split(data, labels)


def objective_of(cfg) -> tuple[str, bool]:
    """The metric a trial is scored by and its direction: ``evaluation.metric_for_best_model`` (default: loss)."""
    from finetune.selection import Selection

    selection = Selection.from_config(cfg.evaluation)
    if selection is not None:
        return selection.metric, selection.greater_is_better
    return "loss", False


def check_space_against_config(sweep, where: str) -> None:
    """Every choice and both ends of every range must make a config this package accepts, alone and beside each
    value of every other key (``model.lora_rank: [null, 8]`` with a searched ``model.lora_alpha``): checked before
    any trial, where a refused pair would otherwise stop the sweep at the first trial that draws it."""
    dims = sweep.space.dimensions
    for dim in dims:
        for value in dim.probes():
            _check_values(sweep, where, {dim.key: value})
    for i, dim in enumerate(dims):
        for other in dims[i + 1:]:
            for value, other_value in itertools.product(dim.probes(), other.probes()):
                _check_values(sweep, where, {dim.key: value, other.key: other_value})


def _check_values(sweep, where: str, params: dict) -> None:
    from finetune.accumulation import resolve_batching
    from finetune.config import load_config

    try:
        cfg = load_config(sweep.config, [*sweep.overrides, *overrides(params)])
        resolve_batching(cfg.training, 1)
    except ConfigError as exc:
        reason = exc.message.removeprefix("command line: ")
        values = " with ".join(f"{key}: {render(value)}" for key, value in params.items())
        raise ConfigError(f"{where}: space: {values} is refused: {reason}") from None


def warn_if_pruning_misaligned(sweep) -> None:
    """``eval_every`` counts updates, whose texts differ between effective batches: the pruner would compare
    trials only at epoch ends, where their reports meet; ``evals_per_epoch`` puts them at the same texts."""
    every = sweep.run_config.evaluation.eval_every
    if every and sweep.pruner.get("type") != "none" and "training.effective_batch_size" in sweep.space.keys():
        logger.warning("evaluation.eval_every=%d evaluates at different texts seen for each effective batch, so the "
                       "pruner can compare trials only at epoch ends; evaluation.evals_per_epoch evaluates at the "
                       "same shares of the data for every batch", every)
