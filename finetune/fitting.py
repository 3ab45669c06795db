"""Fitting a run: the epochs, when to evaluate, checkpoints and stops, and the outputs at the end.

:func:`fit` holds the output folder's lock, resumes from a checkpoint when
there is one, and runs :func:`train_epochs`: each epoch is
:func:`finetune.loop.train_one_epoch` with ``k`` set from the run's batching,
followed by its evaluation and checkpoint. :class:`EvaluationSchedule` says
when an evaluation is due, and :class:`Evaluations` what each means for the
best model and early stopping.

A dry run (:func:`finetune.rehearsal.rehearse`) trains and evaluates through
the same pieces: :meth:`~finetune.run.Run.speedups`, :meth:`~finetune.run.Run.loop_settings`
and :func:`evaluate_run`.
"""

from __future__ import annotations

import enum
import logging
import signal
from typing import Any, Callable, Optional

from finetune.checkpointer import Checkpointer
from finetune.evaluation import (EVAL_BY_LABEL, EVAL_INTERVALS, EVAL_THRESHOLDS, evaluation_of,
                                 one_answer_for_every_text, validation_targets)
from finetune.loop import NonFiniteLossError, TrainState, train_one_epoch
from finetune.output_dir import output_lock, start_outputs
from finetune.results import summarize, write_outputs
from finetune.run import Run
from finetune.selection import EvalHistory
from finetune.signals import StopSignals, interruption
from finetune.tracking import RunLogger, log_lines_above, progress_bar, start_trackers

logger = logging.getLogger("finetune")

def fit(
    run: Run,
    on_epoch_end: Optional[Callable[[int, dict[str, Any]], None]] = None,
    on_update: Optional[Callable[[TrainState], bool]] = None,
    on_evaluation: Optional[Callable[[Run, dict[str, Any]], bool]] = None,
) -> dict[str, Any]:
    """Train all epochs, evaluate, log, checkpoint, keep the best model, and write the outputs.

    Resumes from ``output.resume_from`` when set. Checkpoints (see
    :mod:`finetune.checkpointer`) are saved every ``output.checkpoint_every``
    updates, after each evaluation, and when SIGTERM / SIGINT end the run
    (after the current update). Evaluations run at epoch ends and every
    ``evaluation.eval_every`` updates (or ``evaluation.evals_per_epoch``
    times an epoch); ``evaluation.metric_for_best_model``
    marks the best, ``evaluation.early_stopping_patience`` may end the run
    early (outputs are written as for a finished run), and
    ``evaluation.load_best_model_at_end`` makes the saved model the best one.

    Args:
        run: From :func:`setup_run`.
        on_epoch_end: Called with ``(epoch, eval metrics)`` after each epoch's evaluation.
        on_update: Called after every update with the loop's state (after the
            checkpoint callback); returning True ends the run there, without
            final evaluation or outputs.
        on_evaluation: Called after every evaluation with ``(run, eval metrics)``
            (on every process, with the same metrics); returning True ends the
            run there as ``on_update`` does. A sweep's pruner is one.

    Returns:
        The summary ``{"train": {...}, "eval": {...}, "best": {...}, "epochs": [...], "labels": [...]}``,
        as written to ``metrics.json``; ``train.ended`` is ``"stopped_by_caller"`` when
        ``on_update`` or ``on_evaluation`` ended the run (then nothing is written).

    Raises:
        RunInterrupted: after a signal, once the checkpoint is saved (exit code 128 + signal).
        NonFiniteLossError: on a non-finite loss under ``training.on_nonfinite: stop``
            (or too many skips); the message names the last good checkpoint.
        ConfigError: if ``output.resume_from`` names no checkpoint, or one of another setup.
        RuntimeError: for a run that has trained already (see :func:`check_untrained`).
    """
    check_untrained(run, "fit")
    with output_lock(run.accelerator, run.cfg.output.output_dir):  # one run per folder, from here to the end
        return _fit(run, on_epoch_end, on_update, on_evaluation)


def check_untrained(run: Run, caller: str) -> None:
    """Refuse a run whose state has moved since :func:`setup_run`: ``fit`` and ``rehearse`` train from there
    (a checkpoint is theirs to restore), and a second ``fit`` of the same run, a notebook's cell run again, would
    write the outputs anew with none of the run's updates in them, before an outputs folder is touched.

    Raises:
        RuntimeError: naming ``caller`` and the update the run is at.
    """
    state = run.state
    if state.step or state.micro_batch or state.epoch:
        raise RuntimeError(f"{caller}: this run has trained already (its state is at update {state.step}, by fit, "
                           f"rehearse or train_one_epoch); setup_run builds it again")


def _fit(run: Run, on_epoch_end, on_update, on_evaluation) -> dict[str, Any]:
    cfg, acc = run.cfg, run.accelerator
    history = EvalHistory.from_config(cfg.evaluation)
    checkpoints = Checkpointer(run, history)  # chooses and verifies the checkpoint before anything is written
    start_outputs(cfg, acc, fresh=checkpoints.resume_path is None)
    pending_eval = checkpoints.restore()
    resuming = run.state.step > 0 or run.state.micro_batch > 0 or run.state.epoch > 0
    continued = start_trackers(acc, cfg, resume_step=run.state.step if resuming else None)
    log = RunLogger(acc, cfg.output.output_dir, use_trackers=bool(cfg.logging.report_to),
                    resume_step=run.state.step if resuming else None, history=history.records, continued=continued)
    evaluations = Evaluations(run, log, history, checkpoints, on_evaluation)
    # SIGTERM / SIGINT: during training, stop at the next window boundary with a checkpoint; once training
    # is over, the final evaluation and writes still complete (they are what the run is for), then it ends.
    with StopSignals() as signals:
        try:
            ending = train_epochs(run, checkpoints, evaluations, signals, pending_eval, on_epoch_end, on_update)
        except NonFiniteLossError as exc:
            raise NonFiniteLossError(f"{exc.message}; {checkpoints.last_good()}") from None
        finished = ending is not RunEnd.STOPPED_BY_CALLER
        if finished and run.eval_dataloader is not None and not history.done_at(run.state.step):
            evaluations.evaluate(epoch=None)  # the final weights were not evaluated yet
        best = evaluations.best_at_end() if finished else None
        summary = summarize(run, history.records, ended=ending.value, best=best)
        if finished:
            write_outputs(run, summary, same_run=checkpoints.resume_path is not None)
            if summary["test"] is not None:  # the main process's: it scored them
                log.log({"step": run.state.step, **{f"test/{k}": v for k, v in summary["test"]["metrics"].items()}})
            caution = one_answer_for_every_text(summary, validation_targets(run))
            if caution is not None and acc.is_main_process:
                logger.warning(caution)
        if signals.signum is not None and acc.is_main_process:
            logger.warning("%s came while the final outputs were written; they are complete",
                           signal.Signals(signals.signum).name)
    if cfg.logging.report_to:
        acc.end_training()
    return summary


class RunEnd(enum.Enum):
    """How :func:`train_epochs` ended."""

    # the values are metrics.json's train.ended
    COMPLETED = "completed"
    # early stopping: evaluation.early_stopping_patience evaluations without improvement
    EARLY_STOPPED = "early_stopped"
    # fit's on_update or on_evaluation callback asked to stop: nothing more is evaluated or written
    STOPPED_BY_CALLER = "stopped_by_caller"


class EvaluationSchedule:
    """When an evaluation is due.

    Evaluations run at each epoch's end (``training.eval_each_epoch``) and
    every ``evaluation.eval_every`` updates, or ``evaluation.evals_per_epoch``
    times an epoch, at the same shares of the data for every batch size (the
    epoch's end among them); none without validation data.
    """

    def __init__(self, run: Run):
        self.run = run
        self.every = run.cfg.evaluation.eval_every
        self.shares = run.cfg.evaluation.evals_per_epoch
        self.validating = run.eval_dataloader is not None

    def at_epoch_end(self, step: int) -> bool:
        """After update ``step``, the last of an epoch or of the run."""
        return self.validating and (self.run.cfg.training.eval_each_epoch or self.shares is not None
                                    or bool(self.every and step % self.every == 0))

    def mid_epoch(self, step: int, micro_batch: int, k: int) -> bool:
        """After update ``step`` inside an epoch at ``k``, whose window ended at micro-batch ``micro_batch``: every
        ``eval_every`` updates, or when a share of the epoch is complete."""
        if not self.validating:
            return False
        if self.shares is not None:
            return completes_share(micro_batch, k, len(self.run.train_dataloader), self.shares)
        return bool(self.every and step % self.every == 0)

    def count_after(self, done: int) -> int:
        """How many evaluations :func:`fit` makes after update ``done``, unless early stopping ends the run; the
        final weights' among them."""
        count = 0
        for step, micro_batch, k, ends in self.run.plan.updates_after(done, len(self.run.train_dataloader)):
            if step == self.run.plan.total_updates:
                return count + self.validating  # fit evaluates the final weights, due or not
            count += self.at_epoch_end(step) if ends else self.mid_epoch(step, micro_batch, k)
        return count


class Evaluations:
    """Evaluating when the :class:`EvaluationSchedule` says, and what each evaluation means for the best model
    and early stopping.

    Each record goes to the run's :class:`~finetune.selection.EvalHistory`,
    which says under a selection whether it is the best so far; a checkpoint is
    then saved right after every evaluation, so that the best weights exist on
    disk whenever they were seen.
    """

    def __init__(self, run: Run, log: RunLogger, history: EvalHistory, checkpoints: Checkpointer,
                 on_evaluation: Optional[Callable[[Run, dict[str, Any]], bool]] = None):
        self.run, self.log, self.history, self.checkpoints = run, log, history, checkpoints
        self.due = EvaluationSchedule(run)
        self.on_evaluation = on_evaluation
        # the on_evaluation callback asked the run to end
        self.caller_stopped = False
        self._announced = False

    def evaluate(self, epoch: Optional[int]) -> dict[str, Any]:
        """Evaluate now, log the record (marked best or not) and keep it, tell the caller; returns the metrics."""
        metrics = evaluate_and_log(self.run, self.log, self.history, epoch)
        if self.on_evaluation is not None and self.on_evaluation(self.run, metrics):
            self.caller_stopped = True
        return metrics

    def checkpoint_after(self, step: int) -> None:
        """Under a selection, every evaluation's weights are saved: the best must exist on disk."""
        if self.history.selection is not None:
            self.checkpoints.save(f"evaluation at update {step}")

    def should_stop(self) -> bool:
        """Early stopping (said once, on the main process)."""
        stop = self.history.should_stop()
        if stop and not self._announced and self.run.accelerator.is_main_process:
            self._announced = True
            logger.info(self.history.judge().why_stopped())
        return stop

    def best_at_end(self) -> Optional[dict[str, Any]]:
        """The best evaluation; under ``load_best_model_at_end`` its weights are loaded into the model."""
        judgement = self.history.judge()
        if judgement is None or judgement.best is None:
            return None
        selection, at_end = judgement.selection, judgement.best_step == self.run.state.step
        best = {"step": judgement.best_step, "metric": selection.metric, "value": judgement.best_value,
                "greater_is_better": selection.greater_is_better,
                "checkpoint": None if at_end else str(self.checkpoints.best())}
        if self.run.cfg.evaluation.load_best_model_at_end and not at_end:
            self.checkpoints.load_best()
            logger.info("evaluation.load_best_model_at_end: the saved model is update %d's (%s %.6g), not "
                        "update %d's", judgement.best_step, selection.metric, judgement.best_value,
                        self.run.state.step)
        return best


def epoch_share(micro_batch: int, per_epoch: int, shares: int) -> int:
    """How many of an epoch's ``shares`` equal parts are complete after its first ``micro_batch`` micro-batches."""
    return micro_batch * shares // per_epoch


def completes_share(micro_batch: int, k: int, per_epoch: int, shares: int) -> bool:
    """Whether the window ending after micro-batch ``micro_batch`` of its epoch completes one of its ``shares``."""
    window_start = (micro_batch - 1) // k * k  # windows start at multiples of k from the epoch's start
    return epoch_share(micro_batch, per_epoch, shares) > epoch_share(window_start, per_epoch, shares)


def train_epochs(run: Run, checkpoints: Checkpointer, evaluations: Evaluations, signals: StopSignals,
                 pending_eval: Optional[int], on_epoch_end, on_update) -> RunEnd:
    """The epochs from the run's state on, each followed by its evaluation and checkpoint.

    Each epoch trains at its own ``k`` (the run's batching says which); a
    signal stops the run at the next window boundary with a checkpoint.

    Raises:
        RunInterrupted: after a signal, once the checkpoint is saved.
    """
    cfg, acc = run.cfg, run.accelerator

    def after_update(state: TrainState) -> bool:
        at_epoch_end = state.micro_batch >= len(run.train_dataloader) or state.step >= run.plan.total_updates
        early = False
        if not at_epoch_end and evaluations.due.mid_epoch(state.step, state.micro_batch,
                                                          acc.gradient_accumulation_steps):
            evaluations.evaluate(epoch=None)
            evaluations.checkpoint_after(state.step)
            early = evaluations.should_stop()
        stopping = signals.agree(acc, step=state.step)  # on every process, every update: it may all-reduce
        checkpoints.after_update(state, stopping)
        asked = bool(on_update(state)) if on_update is not None else False
        return asked or evaluations.caller_stopped or stopping is not None or early

    def end_of_epoch(epoch: int) -> None:
        if evaluations.due.at_epoch_end(run.state.step):
            metrics = evaluations.evaluate(epoch)
            if on_epoch_end is not None:
                on_epoch_end(epoch, metrics)
        checkpoints.save(f"end of epoch {epoch}" if run.state.epoch > epoch else f"last update, in epoch {epoch}")

    progress = progress_bar(run.plan.total_updates, run.state.step,
                            enabled=acc.is_main_process and cfg.logging.progress_bar)
    with progress, run.speedups(), log_lines_above(progress):
        if pending_eval is not None:
            end_of_epoch(pending_eval)  # the run was stopped between an epoch's last update and its evaluation
        for epoch in run.epochs():  # each at its k (training.accumulation_schedule), until the plan's updates
            if evaluations.should_stop():
                break
            first_update = run.state.step + 1
            result = train_one_epoch(
                run.model, run.optimizer, run.scheduler, run.train_dataloader, acc, epoch, state=run.state,
                log_every=cfg.logging.log_every, on_log=evaluations.log.log, on_update=after_update,
                progress=progress, **run.loop_settings(),
            )
            logger.info(epoch_line(run, epoch, first_update, result))
            finished = not result.stopped_early or run.state.step >= run.plan.total_updates
            if signals.agreed is not None:
                eval_due = finished and evaluations.due.at_epoch_end(run.state.step)
                interrupt(run, checkpoints, signals.agreed, pending_eval_epoch=epoch if eval_due else None)
            if not finished:
                # an evaluation mid-epoch ended the run, or a callback asked to stop (no evaluation of a part)
                early = evaluations.should_stop() and not evaluations.caller_stopped
                return RunEnd.EARLY_STOPPED if early else RunEnd.STOPPED_BY_CALLER
            end_of_epoch(epoch)
            if signals.agree(acc) is not None:
                interrupt(run, checkpoints, signals.agreed, None)  # a signal during the evaluation
            if evaluations.caller_stopped:
                return RunEnd.STOPPED_BY_CALLER
            if evaluations.should_stop():
                return RunEnd.EARLY_STOPPED
    return RunEnd.COMPLETED


def epoch_line(run: Run, epoch: int, first_update: int, result) -> str:
    """What one epoch's training did, saying whether the epoch ended or stopped part-way (a signal,
    ``training.max_steps``, a callback) and which updates ran here (a resumed epoch starts part-way)."""
    state = run.state
    if state.epoch > epoch:  # train_one_epoch moves the state to the next epoch at the epoch's end
        where = f"epoch {epoch} done"
    else:
        where = (f"epoch {epoch} stopped at update {state.step}, micro-batch {state.micro_batch} of "
                 f"{len(run.train_dataloader)}")
    updates = f"updates {first_update}-{state.step}" if result.updates else "no updates"
    line = f"{where}: {updates}, loss {result.loss:.4f} over {result.samples} samples in {result.seconds:.1f}s"
    return line + noise_said(run, epoch, result)


def noise_said(run: Run, epoch: int, result) -> str:
    """logging.noise_scale: the gradient noise scale measured so far, or why the epoch could not measure it;
    nothing without the setting (docs/logging.md#the-gradient-noise-scale)."""
    if not run.cfg.logging.noise_scale:
        return ""
    if result.noise_unmeasured is not None:
        return f"; gradient noise scale not measured: {result.noise_unmeasured}"
    return f"; gradient noise scale {run.state.noise_scale_said(run.batching.effective_batch_size_at(epoch))}"


def interrupt(run: Run, checkpoints: Checkpointer, signum: int, pending_eval_epoch: Optional[int]) -> None:
    """Stop on a signal: save (unless this position is saved already), then raise.

    Args:
        pending_eval_epoch: The epoch that just finished training and whose
            evaluation has not run (``None`` mid-epoch, or when none is due).

    Raises:
        RunInterrupted: always, with the command that resumes the run.
    """
    state = run.state
    checkpoints.save_unless_saved(f"{signal.Signals(signum).name} after update {state.step}", pending_eval_epoch)
    raise interruption(signum, state, checkpoints.where(), run.accelerator.num_processes)


def evaluate_and_log(run: Run, log: RunLogger, history: EvalHistory, epoch: Optional[int]) -> dict[str, Any]:
    """Evaluate on the validation split, keep the record in ``history`` (marked best or not) and log it.

    ``epoch`` is the epoch just finished (``None`` mid-epoch, or for the evaluation after training).

    Returns:
        The metrics.
    """
    evaluation = evaluate_run(run)
    metrics = evaluation.metrics
    record: dict[str, Any] = {"step": run.state.step}
    if epoch is not None:
        record["epoch"] = epoch + 1
        logger.info("epoch %d eval: %s", epoch, _fmt(metrics))
    else:
        logger.info("update %d eval: %s", run.state.step, _fmt(metrics))
    if evaluation.thresholds is not None:
        logger.info("  %s", evaluation.thresholds_said())
    record.update({f"eval/{k}": v for k, v in metrics.items()})
    if evaluation.by_label is not None:
        record[EVAL_BY_LABEL] = evaluation.by_label  # beside the eval/ scalars, which trackers and the curves take
    if evaluation.intervals:
        record[EVAL_INTERVALS] = evaluation.intervals
    if evaluation.thresholds is not None:
        record[EVAL_THRESHOLDS] = evaluation.thresholds
    log.log(history.add(record))
    return metrics


def evaluate_run(run: Run):
    """The run's model on its validation data, with its metrics, task and label names: every evaluation of
    :func:`fit`, and the one of :func:`rehearse`."""
    return evaluation_of(run.model, run.eval_dataloader, run.accelerator, run.metrics, run.task,
                         labels=run.labels.names)


def _fmt(metrics: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
