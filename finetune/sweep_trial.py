"""One trial of a sweep: the ordinary run (or one run per seed) its values make, and what the study learns of it.

A trial's runs are ordinary runs of this package, trained in this process by
:func:`finetune.train.run_training` with the config, the command line's
overrides and the trial's values, in the trial's folder (or one folder per
seed). The folder's ``trial.json`` says what the trial was and how it ended.
How each ending reaches the study:

* finished: its value is the objective, ``evaluation.metric_for_best_model``
  of the saved model (the mean over the trial's seeds);
* pruned: each evaluation (of the first seed) is reported to Optuna at the
  number of training texts seen, which is the same for every effective batch
  at the same point of an epoch; the pruner's "stop" ends the run after that
  evaluation, with nothing more written;
* a non-finite loss (``training.on_nonfinite``): failed, and the sweep goes on;
* SIGTERM / SIGINT: the run saves its checkpoint, a continuation of the
  trial is queued (:func:`finetune.study.queue_continuation`), the sweep ends;
* an input error (a data file, a value the config refuses): the sweep ends
  with its one line.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from finetune.checkpoint_files import list_checkpoints
from finetune.errors import FinetuneError, NonFiniteLossError, OutOfMemory
from finetune.outputs import json_ready, write_atomic
from finetune.search_space import SearchSpace, overrides
from finetune.signals import RunInterrupted
from finetune.study import (BEYOND_BUDGET, CONTINUES, EVAL_LOSS, FAILED, FOLDER, INTERRUPTED, PRUNED, SAME_AS,
                            STOPPED_SWEEP, drawn_before, finished_same, queue_continuation)

logger = logging.getLogger("finetune")

TRIAL_FILE = "trial.json"


@dataclass
class Phase:
    """What a study's trials run: the search over the space, or the best config over seeds or folds.

    Args:
        study: The Optuna study.
        space: What a trial draws (under seeds or folds: ``training.seed``'s or ``data.validation_fold``'s
            choices).
        trials: The budget of drawn trials.
        folder: A trial's folder name from its number and values.
        seeds: Each trial's seeds (its objective is the mean); empty: the config's seed.
        fixed: Overrides every trial of the phase shares (under seeds or folds: the best trial's values).
        pruner: The sweep file's pruner settings, whose pruner each trial's evaluations are reported to; None:
            none (what a pruner of type ``none`` is too).
    """

    name: str
    study: Any
    space: SearchSpace
    trials: int
    folder: Callable[[int, dict[str, Any]], str]
    seeds: list[int] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    pruner: Optional[dict[str, Any]] = None


@dataclass
class TrialRunner:
    """Optuna's objective for one phase: runs a trial and returns its value (NaN: failed, not scored).

    Args:
        root: The sweep's folder.
        config: The run's YAML config (``None``: the default config).
        overrides: The command line's ``section.key=value``.
        metric: The objective (``evaluation.metric_for_best_model``).
        on_trial_end: Called with ``(phase, trial number, trial.json's record)`` once the trial ended.
        group: Where the trackers that group runs (W&B, MLflow, Trackio) show the trials' runs together
            (``logging.run_group``); ``None``: as the config says.
    """

    root: Path
    config: Optional[str]
    overrides: list[str]
    metric: str
    on_trial_end: Callable[[Phase, int, dict[str, Any]], None]
    group: Optional[str] = None
    phase: Optional[Phase] = None

    def __call__(self, trial) -> float:
        phase = self.phase
        params = phase.space.suggest(trial)
        folder = trial.user_attrs.get(FOLDER) or phase.folder(trial.number, params)
        trial.set_user_attr(FOLDER, folder)
        record: dict[str, Any] = {"trial": trial.number, "study": phase.study.study_name, "params": params,
                                  "fixed": phase.fixed, "continues": trial.user_attrs.get(CONTINUES)}
        if CONTINUES not in trial.user_attrs:
            if drawn_before(phase.study, trial.number) >= phase.trials:
                # another worker drew the last trial of the budget at the same time: this one does not run
                trial.set_user_attr(BEYOND_BUDGET, True)
                return float("nan")
            same = finished_same(phase.study, params, trial.number)
            if same is not None:
                # runs are exact and seeded: the same values give the same result, so it is not trained twice
                trial.set_user_attr(SAME_AS, same.number)
                if EVAL_LOSS in same.user_attrs:
                    trial.set_user_attr(EVAL_LOSS, same.user_attrs[EVAL_LOSS])
                self._end(trial, folder, {**record, "state": "same", "same_as": same.number, "value": same.value})
                return same.value
        return self._run(trial, params, folder, record)

    def _run(self, trial, params: dict[str, Any], folder: str, record: dict[str, Any]) -> float:
        import optuna

        phase, start = self.phase, time.perf_counter()
        seeds = phase.seeds or [None]
        values, losses, runs = [], [], []
        for index, seed in enumerate(seeds):
            run_dir = self.root / folder / (f"seed-{seed}" if len(seeds) > 1 else "")
            run_args = self.run_overrides(params, run_dir, seed, continuing=CONTINUES in trial.user_attrs)
            runs.append({"output_dir": str(run_dir), "command": train_command(self.config, run_args)})
            pruning = phase.pruner is not None and phase.pruner["type"] != "none" and index == 0
            hook = pruning_hook(trial, self.metric, phase.pruner.get("warmup_epochs", 0.0)) if pruning else None
            try:
                summary = finished_summary(run_dir) or self._train(run_args, hook)
            except RunInterrupted as exc:
                trial.set_user_attr(INTERRUPTED, exc.message)
                queue_continuation(phase.study, trial)
                self._end(trial, folder, {**record, "state": "interrupted", "runs": runs, "why": exc.message})
                raise
            except NonFiniteLossError as exc:
                trial.set_user_attr(FAILED, exc.message)
                self._end(trial, folder, {**record, "state": "failed", "runs": runs, "why": exc.message})
                return float("nan")
            except FinetuneError as exc:
                trial.set_user_attr(STOPPED_SWEEP, True)
                trial.set_user_attr(FAILED, exc.message)
                if isinstance(exc, OutOfMemory) and exc.settings:
                    # a trial's own hint ("the same command with ...") does not continue a sweep, whose study
                    # refuses another config
                    raise OutOfMemory(exc.message, hint=f"the sweep's study keeps the config it was made with: "
                                      f"run the sweep again with {exc.settings} and another --output") from None
                raise
            if summary["train"].get("ended") == "stopped_by_caller":
                why = pruned_why(trial, self.metric, phase.pruner)
                trial.set_user_attr(PRUNED, why)
                self._end(trial, folder, {**record, "state": "pruned", "runs": runs, "why": why})
                raise optuna.TrialPruned()
            values.append(summary["eval"][self.metric])
            losses.append(summary["eval"]["loss"])
        value = statistics.fmean(values)
        trial.set_user_attr(EVAL_LOSS, statistics.fmean(losses))
        self._end(trial, folder, {**record, "state": "complete", "value": value, "values": values, "runs": runs,
                                  "seconds": round(time.perf_counter() - start, 1)})
        return value

    def run_overrides(self, params: dict[str, Any], run_dir: Path, seed: Optional[int], continuing: bool) -> list[str]:
        """``finetune train``'s overrides of one run: the command line's, the phase's, the trial's, its folder."""
        extra = [f"output.output_dir={run_dir}", "output.resume_from=auto"]
        if continuing and not list_checkpoints(run_dir):
            extra.append("output.overwrite=true")  # stopped before its first checkpoint: the trial starts over
        if seed is not None:
            extra.append(f"training.seed={seed}")
        if self.group is not None:
            extra.append(f"logging.run_group={self.group}")
        return [*self.overrides, *self.phase.fixed, *overrides(params), *extra]

    def _train(self, run_args: list[str], hook) -> dict[str, Any]:
        return train_in_this_process(self.config, run_args, on_evaluation=hook)

    def _end(self, trial, folder: str, record: dict[str, Any]) -> None:
        path = self.root / folder / TRIAL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(json_ready(record), indent=1, default=str) + "\n")
        self.on_trial_end(self.phase, trial.number, record)


def train_command(config: Optional[str], run_args: list[str]) -> str:
    """The ``finetune train`` command that makes (or resumes) this run by hand."""
    import shlex

    return shlex.join(["finetune", "train", *(["--config", config] if config else []), *run_args])


def pruning_hook(trial, metric: str, warmup_epochs: float = 0.0):
    """``fit``'s ``on_evaluation``: report the metric at the texts seen so far, and stop when the pruner says so.

    Every evaluation is reported; the pruner judges those past ``warmup_epochs``
    of training but the run's last: a trial that has trained to its end has
    nothing left to save, and its score, kept as a finished trial's, is the
    study's to rank.
    """

    def on_evaluation(run, metrics: dict[str, Any]) -> bool:
        seen = texts_seen(run)
        trial.report(float(metrics[metric]), seen)
        warmed_up = past_warmup(seen, len(run.train_dataloader.dataset), warmup_epochs)
        return warmed_up and run.state.step < run.plan.total_updates and trial.should_prune()

    return on_evaluation


def past_warmup(seen: int, epoch_texts: int, warmup_epochs: float) -> bool:
    """Whether an evaluation after ``seen`` training texts is past a warm-up of ``warmup_epochs`` epochs of
    ``epoch_texts`` texts each, so that the pruner judges it.

    Optuna's own warm-up counts the steps reported, texts here, which differ
    from one data set to another; a share of the epoch is the same for every
    data set, so a shipped sweep file can say it.
    """
    return seen > round(warmup_epochs * epoch_texts)


def texts_seen(run) -> int:
    """Training texts seen so far, the step an evaluation is reported at.

    Epoch ends fall at the same count for every effective batch; so do
    ``evaluation.evals_per_epoch``'s shares, which are reported at the count
    where their share ends (the update that completes a share ends somewhere in
    its last window, which differs between batches). Other evaluations are
    reported where they happened: ``eval_every``'s, and the last one of a run
    that ``training.max_steps`` ended inside a share, which would otherwise
    repeat the count of the share before it (a step the study keeps once).
    """
    from finetune.fitting import completes_share, epoch_share

    state, per_epoch = run.state, len(run.train_dataloader)
    shares = run.cfg.evaluation.evals_per_epoch
    done = state.micro_batch / per_epoch
    if shares and completes_share(state.micro_batch, run.accelerator.gradient_accumulation_steps, per_epoch, shares):
        done = epoch_share(state.micro_batch, per_epoch, shares) / shares
    return round((state.epoch + done) * len(run.train_dataloader.dataset))


def pruned_why(trial, metric: str, pruner: dict[str, Any]) -> str:
    """The pruned trial's last report beside the line the pruner drew through the finished trials at the same
    point: their median, or their percentile (a hyperband pruner's brackets are not said)."""
    import numpy
    from optuna.trial import TrialState

    frozen = trial.study.get_trials(deepcopy=False)
    own = next(t for t in frozen if t.number == trial.number).intermediate_values
    if not own:
        return "pruned before its first evaluation"
    step = max(own)
    others = [t.intermediate_values[step] for t in frozen
              if t.state == TrialState.COMPLETE and step in t.intermediate_values]
    said = f"pruned after {step} training texts: {metric} {own[step]:.4f}"
    if not others or pruner["type"] not in ("median", "percentile"):
        return said
    if pruner["type"] == "median":
        return f"{said}, the median of {len(others)} finished trials there is {statistics.median(others):.4f}"
    # Optuna keeps the best `percentile` percent: where higher is better, its line is the other end's percentile
    kept = pruner.get("percentile", 50.0)
    at = 100 - kept if trial.study.direction.name == "MAXIMIZE" else kept
    return (f"{said}, percentile {at:g} of {len(others)} finished trials there is "
            f"{float(numpy.percentile(others, at)):.4f}")


def finished_summary(run_dir: Path) -> Optional[dict[str, Any]]:
    """A finished run's ``metrics.json`` (a continued trial keeps the seeds it finished), else ``None``."""
    path = run_dir / "metrics.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text(encoding="utf-8"))
    return summary if summary.get("train", {}).get("ended") in ("completed", "early_stopped") else None


def train_in_this_process(config: Optional[str], run_args: list[str], on_evaluation=None,
                          dry_run: bool = False) -> dict[str, Any]:
    """``finetune train``'s run of ``config`` with ``run_args``, in the sweep's process, leaving nothing of it
    behind for the next (its memory, its compiled code); returns its summary."""
    import gc

    from finetune.train import run_training

    try:
        return run_training(config, run_args, on_evaluation=on_evaluation, dry_run=dry_run)
    finally:
        gc.collect()
        _free_accelerator_memory()
        _forget_compiled_code()


def _free_accelerator_memory() -> None:
    """Give a finished trial's GPU memory back before the next trial's model is built."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _forget_compiled_code() -> None:
    """Clear ``torch.compile``'s caches after a trial, so that the next trial compiles as a run alone would.

    They outlive a run in this process: the next trial's model would be recompiled for each new value of a
    searched setting its graphs hold (a dropout rate), and past dynamo's limit on graphs per function it
    would run eagerly, without a word from the run. Inductor's cache on disk keeps compiling again quick."""
    import torch

    torch.compiler.reset()
