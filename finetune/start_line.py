"""The start line: what a run will do, said once, before its first update and after every input check.

It reads as the run does: what (the model, its head, LoRA's adapters, the data and its
validation rows), how (the precision and why it was chosen, ``b x k x P``,
the updates, the metrics' averaging), and where (processes, backend, device,
threads, the memory plan, the CPU speed-ups in force, the micro-batch cut:
:mod:`finetune.placement`), then the output folder. The decisions setup takes on its way (the averaging, the class
weights, the rows read) are said here rather than line by line before it, so
the first line of a run says what will happen and anything wrong in the input
is the one line before it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from finetune.data import SEEN_IN_TRAINING_AT_MOST
from finetune.data_sources import data_sources
from finetune.evaluation import validation_support, validation_targets
from finetune.launch import choose_precision
from finetune.metrics import averaged_over_absent_labels, correlations_over_alike_targets, scores_in_a_line
from finetune.modeling import model_name
from finetune.optimization import UpdatePlan, describe_layer_rates
from finetune.placement import gpus_out_of_reach, idle_gpus, where
from finetune.run import Run
from finetune.schema import DEFAULT_THRESHOLD

if TYPE_CHECKING:
    from finetune.rehearsal import Rehearsal

logger = logging.getLogger("finetune")


# a caution's log record names its kind in this attribute: a sweep says the few-updates caution once for its trials
CAUTION = "caution"
FEW_UPDATES_CAUTION = "few_updates"
# and a sweep says those of the GPUs a trial leaves unused once: the idle ones in its own words (its cure is a
# worker on each GPU, not a launch of each trial), those torch cannot reach as a run says them
IDLE_GPUS_CAUTION = "idle_gpus"
GPUS_OUT_OF_REACH_CAUTION = "gpus_out_of_reach"


def say(run: Run) -> None:
    """Log the start line, then what in it is worth a second look."""
    logger.info(describe(run))
    kinds = {few_updates(run): FEW_UPDATES_CAUTION, idle_gpus(run): IDLE_GPUS_CAUTION,
             gpus_out_of_reach(run): GPUS_OUT_OF_REACH_CAUTION}
    for line in cautions(run):
        logger.warning(line, extra={CAUTION: kinds[line]} if line in kinds else None)


def describe(run: Run) -> str:
    """One line: what the run trains on what, how, and where, then its output folder."""
    return f"start: {_what(run)} | {_how(run)} | {where(run)} -> {run.cfg.output.output_dir}"


# below it, a rate is full fine-tuning's: LoRA's adapters start at zero and usually want 5 to 20 times it
LORA_RATE_AT_LEAST = 3e-4
# fewer updates than this, a new head learns little: the default job's F1 was 0 after 12, 0.88 after 25 and 0.94
# after 50 (docs/configuration.md, few updates)
FEW_UPDATES = 50


def cautions(run: Run) -> list[str]:
    """What the start line shows that is worth a second look, each as a line of its own."""
    lines = []
    lr = run.cfg.optim.learning_rate
    if run.lora is not None and lr < LORA_RATE_AT_LEAST:
        lines.append(f"LoRA (model.lora_rank) at optim.learning_rate={lr:g}, a full fine-tuning rate: adapters start "
                     f"at zero and usually want 5 to 20 times it (2e-3 on the default job; docs/memory.md, LoRA "
                     f"adapters)")
    few = few_updates(run)
    if few is not None:
        lines.append(few)
    unused = idle_gpus(run) or gpus_out_of_reach(run)  # one or the other: a run on a GPU, or on the CPU
    if unused is not None:
        lines.append(unused)
    targets = validation_targets(run)
    alike = correlations_over_alike_targets(
        run.metrics.names, targets, "validation rows",
        "give validation rows whose targets differ, or evaluation.metrics=[mse,mae]") if targets is not None else None
    if alike is not None:
        lines.append(alike)
    support = validation_support(run)
    evaluation, single = run.cfg.evaluation, run.labels.problem_type == "single_label"
    absent = averaged_over_absent_labels(run.metrics.names, evaluation.average, evaluation.positive_label, support,
                                         "validation row", labels=not single) if support else None
    if absent is not None:
        lines.append(f"{absent} (give validation rows of every {'class' if single else 'label'}, or "
                     f"evaluation.average={'weighted' if single else 'micro'})")
    if run.eval_dataloader is not None:
        rows = len(run.eval_dataloader.dataset)
        if run.seen_in_training > SEEN_IN_TRAINING_AT_MOST * rows:
            lines.append(f"{run.seen_in_training} of the {rows} validation rows have a text the training rows have "
                         f"too: their scores say what the model remembers, not how it does on texts it has not seen "
                         f"({_unseen_hint(run.cfg)})")
    padding = run.padding.caution() if run.padding is not None else None
    if padding is not None:
        lines.append(padding)
    test = run.test
    if test is not None and test.seen_in_training > SEEN_IN_TRAINING_AT_MOST * len(test.texts):
        lines.append(f"{test.seen_in_training} of the {len(test.texts)} rows of the test set {test.name} have a text "
                     f"the training rows have too: their scores will say what the model remembers, not how it does "
                     f"on texts it has not seen (take the repeated texts out of one of them)")
    return lines


def few_updates(run: Run) -> str | None:
    """The caution for a run of a new head that makes fewer than :data:`FEW_UPDATES` updates, with the epochs
    that would make that many; none where ``training.max_steps`` sets the length (a quick run, asked for)."""
    plan = run.plan
    if not run.new_head or run.cfg.training.max_steps is not None or plan.total_updates >= FEW_UPDATES:
        return None
    epochs = -(-FEW_UPDATES * plan.num_epochs // plan.total_updates)
    texts = len(run.train_dataloader.dataset)
    return (f"the run makes {counted_updates(plan.total_updates)} in all ({plan.num_epochs} epoch"
            f"{'' if plan.num_epochs == 1 else 's'} of {texts:,} texts, {run.batching.effective_batch_size} an "
            f"update): a new head learns little in so few (the default job's F1 was 0 after 12 updates, 0.88 "
            f"after 25, 0.94 after 50); training.num_train_epochs={epochs} makes about "
            f"{plan.total_updates * epochs // plan.num_epochs} (docs/configuration.md#few-updates)")


def _unseen_hint(cfg) -> str:
    if cfg.data.validation_split_by == "row" and data_sources(cfg.data, cfg.split_seed).carved:
        return "data.validation_split_by=text carves distinct texts, each with all its copies"
    return "take the repeated texts out of the data, or give another data.validation_file"


def _what(run: Run) -> str:
    cfg = run.cfg
    sources = data_sources(cfg.data, cfg.split_seed)
    head = "new head" if run.new_head else "its trained head"
    if run.head_start is not None:
        head += f" starting at the targets' mean, {run.head_start:.4g}"
    seen = f", {run.seen_in_training} of them a text also in train" if run.seen_in_training else ""
    validation = "; no validation"
    if run.eval_dataloader is not None:
        rows = _rows(run.eval_dataloader.dataset, "rows", cfg.data.max_eval_samples, "max_eval_samples")
        validation = f"; validation: {rows}, {sources.validation}{seen}"
    if run.test is not None:
        validation += f"; {run.test.describe()}"
    adapters = (f" with {run.lora.describe()}" if run.lora is not None
                else f" {run.frozen.describe()}" if run.frozen is not None else "")
    cut = run.long_texts.describe() if run.long_texts is not None else ""
    train = _rows(run.train_dataloader.dataset, "train rows", cfg.data.max_train_samples, "max_train_samples")
    return (f"fine-tune {model_name(cfg.model.name_or_path)} ({head}){adapters} for {_labels(run)} "
            f"on {sources.train}: {train}{f' ({cut})' if cut else ''}{validation}")


def _rows(split, noun: str, cap: int | None, key: str) -> str:
    """``N train rows``, saying where the cap ``data.<key>`` drew them: a run on a sample should not pass for one on
    the file."""
    return f"{len(split)} {noun}" + (f" drawn by data.{key}" if cap is not None and len(split) == cap else "")


def _labels(run: Run) -> str:
    names, problem_type = list(run.labels.names), run.labels.problem_type
    if problem_type == "regression":
        return f"regression on {names[0]}"
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    if problem_type == "multi_label":
        return f"{len(names)} labels, any number per text ({shown})"
    return f"{len(names)} classes ({shown})"


def _how(run: Run) -> str:
    acc, b, training, evaluation = run.accelerator, run.batching, run.cfg.training, run.cfg.evaluation
    parts = [
        f"precision={acc.mixed_precision} ({choose_precision(training.mixed_precision, acc.device)[1]})",
        f"b={b.per_device_batch_size} k={b.describe_k()} P={b.num_processes} effective_batch={b.effective_batch_size}",
        f"updates={run.plan.total_updates} ({_updates_by_epoch(run.plan)}, warmup {run.plan.warmup_updates})",
        f"lr={run.cfg.optim.learning_rate:g} ({run.cfg.optim.lr_scheduler_type})",
        run.checkpointing.describe(),
    ]
    if run.cfg.optim.optimizer != "adamw":
        parts.append(f"optimizer={run.cfg.optim.optimizer}")
    layer_rates = describe_layer_rates(run.optimizer.param_groups)
    if layer_rates:
        parts.append(f"lr_by_depth=(x{run.cfg.optim.layer_lr_decay:g} per block down: {layer_rates})")
    if run.labels.problem_type != "regression":
        positive = f" on {evaluation.positive_label!r}" if evaluation.average == "binary" else ""
        parts.append(f"average={evaluation.average}{positive}")
    if run.task.thresholded:
        parts.append(_thresholds(run))
    if run.task.label_smoothing:
        parts.append(f"label_smoothing={run.task.label_smoothing:g}")
    weights = run.task.class_weights
    if weights is not None:
        parts.append("class_weights=" + ",".join(f"{n}:{w:.4g}" for n, w in zip(run.labels.names, weights.tolist())))
    return " ".join(parts)


def _thresholds(run: Run) -> str:
    """What decides a thresholded run's predictions: thresholds chosen at each evaluation (``per_label``), one
    for every label, each named label's, or a two-class run's on its positive class."""
    names, task, given = run.labels.names, run.task, run.cfg.evaluation.threshold
    if run.labels.problem_type == "single_label":  # two classes: the positive one's probability decides
        chosen = "per_label (for its F1)" if task.tune_thresholds else f"{float(task.threshold):g}"
        return f"threshold={chosen} on {names[task.positive_class]!r}"
    if task.tune_thresholds:
        return f"thresholds=per_label (for {task.tune_thresholds} F1)"
    if not isinstance(given, dict):
        return f"threshold={given:g}"
    others = f" (others {DEFAULT_THRESHOLD:g})" if len(given) < len(names) else ""
    return "thresholds=" + ",".join(f"{name}:{t:g}" for name, t in given.items()) + others


def _updates_by_epoch(plan: UpdatePlan) -> str:
    epochs = f"{plan.num_epochs} epoch{'s' if plan.num_epochs != 1 else ''}"
    if len(set(plan.epoch_updates)) <= 1:
        return f"{plan.updates_per_epoch}/epoch x {epochs}"
    return f"{'+'.join(map(str, plan.epoch_updates))} over {epochs}"


def dry_run_line(run: Run, rehearsal: Rehearsal) -> str:
    """``finetune train --dry-run``'s line, from its :class:`~finetune.rehearsal.Rehearsal`: the updates tried,
    their pace, the run's estimated length, its evaluations' time, its checkpoints, the GPU memory, and that
    nothing was written."""
    tried = len(rehearsal.seconds)
    losses = (f"loss {rehearsal.losses[0]:.4f} to {rehearsal.losses[-1]:.4f}" if rehearsal.losses
              else "no finite loss")
    evaluation = _evaluations(run, rehearsal) + _test_set(run, rehearsal) if rehearsal.evaluations else ""
    checkpoints = _checkpoints(rehearsal) if rehearsal.checkpoints else ""
    memory = ""
    if rehearsal.gpu_peak is not None:
        plan = f" (the plan: {run.memory.total / 1024**3:.2f}GB)" if run.memory is not None else ""
        memory = f"; GPU memory peaked at {rehearsal.gpu_peak / 1024**3:.2f}GB{plan}"
    return (f"dry run: {tried} update{'s' if tried != 1 else ''} trained in {sum(rehearsal.seconds):.1f} s "
            f"({losses}), {rehearsal.pace:.2f} s each at the end: "
            f"{_what_is_left(rehearsal)}{evaluation}{checkpoints}{memory}; nothing was written to "
            f"{run.cfg.output.output_dir}")


def _what_is_left(rehearsal: Rehearsal) -> str:
    """The updates a start would train and their estimated time: all of the run's, or those after the
    checkpoint it would resume from."""
    total, done = rehearsal.total_updates, rehearsal.done_updates
    if rehearsal.resumes_from is None:
        return f"the run's {counted_updates(total)} would take about {readable_duration(rehearsal.estimate)}"
    if done >= total:
        return f"the run is finished ({rehearsal.resumes_from}, update {done} of {total}): a start trains nothing"
    return (f"a start resumes from {rehearsal.resumes_from} (update {done} of {total}): its "
            f"{counted_updates(total - done)} left would take about {readable_duration(rehearsal.estimate)}")


def counted_updates(count: int) -> str:
    """``1 update``, ``137 updates``."""
    return f"{count} update{'' if count == 1 else 's'}"


def _test_set(run: Run, rehearsal: Rehearsal) -> str:
    """The test set's scoring after training, at the pace per text of the evaluation tried."""
    if run.test is None or rehearsal.done_updates >= rehearsal.total_updates:
        return ""
    texts = len(run.test.texts)
    each = rehearsal.evaluation_seconds / max(1, len(run.eval_dataloader.dataset))
    return f", scoring its test set of {texts} texts about {readable_duration(texts * each)} (at the evaluation's pace)"


def _evaluations(run: Run, rehearsal: Rehearsal) -> str:
    """The evaluations a start would make, and their time as the one tried took."""
    count, each = rehearsal.evaluations, rehearsal.evaluation_seconds
    texts = len(run.eval_dataloader.dataset)
    timed = f", timed on {rehearsal.timed_texts} of them" if rehearsal.timed_texts < texts else ""
    if count == 1:
        return f", and its evaluation of {texts} texts about {readable_duration(each)} more{timed}"
    sooner = ", fewer if early stopping ends it" if run.cfg.evaluation.early_stopping_patience else ""
    return (f", and its {count} evaluations of {texts} texts about {readable_duration(count * each)} more "
            f"({readable_duration(each)} each{timed}{sooner})")


def _checkpoints(rehearsal: Rehearsal) -> str:
    """The checkpoints a start would save, the size of one, and how many of them its folder keeps at its end; their
    time depends on a disk not written to."""
    size = f"{rehearsal.checkpoint_bytes / 1024**3:.2f}GB"
    if rehearsal.checkpoints == 1:
        return f", and its checkpoint of about {size}, not timed"
    kept = rehearsal.kept_checkpoints
    pruned = f" (up to {kept} kept, output.keep_last)" if kept < rehearsal.checkpoints else ""
    return f", and its {rehearsal.checkpoints} checkpoints of about {size} each{pruned}, not timed"


def readable_duration(seconds: float) -> str:
    """``0.4 s``, ``42 s``, ``3.5 min`` or ``2.1 h``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def done_line(summary: dict, output_dir: str) -> str:
    """The run's last line: the saved model's validation scores, each with its 95% bootstrap interval where it has
    one, and its folder."""
    intervals = summary.get("eval_intervals") or {}
    said = " (95% bootstrap intervals over the validation texts)" if intervals else ""
    return f"done: {scores_in_a_line(summary['eval'], intervals)}{said} -> {output_dir}"
