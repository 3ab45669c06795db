"""Build a run from a :class:`~finetune.config.Config` and drive it epoch by epoch.

``train.py`` and the notebooks use the same public helpers:

* :func:`setup_run` loads tokenizer, data, model, optimizer, dataloaders and
  schedule and prepares them with Accelerate (the ``Accelerator`` comes from
  :func:`build_accelerator`);
* :func:`fit` trains all epochs with :func:`finetune.loop.train_one_epoch`
  inside :func:`finetune.cpu.cpu_speedups`, evaluates, checkpoints, and
  writes the outputs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from finetune.accumulation import Batching, layout_for, resolve_accumulation, resolve_batching
from finetune.checkpoint import Checkpointer, load_model_weights, resolve_resume
from finetune.config import Config, config_yaml
from finetune.cpu import cpu_speedups, plan_cpu_speedups, speedup_settings
from finetune.errors import ConfigError, FinetuneError, LaunchError
from finetune.evaluation import evaluate_model
from finetune.launch import choose_precision, choose_workers, configure_cpu_threads, init_process_state
from finetune.loop import NonFiniteLossError, TrainState, train_one_epoch
from finetune.optimization import UpdatePlan, build_optimizer, build_scheduler, plan_updates
from finetune.outputs import (
    CONFIG_FILE, CURVES_FILE, LOCK_FILE, METRICS_FILE, MODEL_CARD_FILE, MODEL_CARD_MARK, RESULTS_FILE,
    OutputLock, clear_previous_run, write_atomic,
)
from finetune.sampling import BalancedBatches, EpochSampler
from finetune.selection import Selection
from finetune.tasks import Task
from finetune.tracking import RunLogger, check_trackers, flat_hparams

logger = logging.getLogger("finetune")


def build_accelerator(cfg, project_dir: Optional[str] = None):
    """An ``Accelerator`` for a :class:`~finetune.config.Config`, with ``k`` resolved for the launched processes.

    Several processes on a machine without a GPU are joined over gloo on the
    CPU (see :func:`finetune.launch.init_process_state`).

    Raises:
        ConfigError: if the effective batch cannot be split over the processes, or a
            tracker in ``logging.report_to`` is unknown or its package is not installed.
        LaunchError: if the precision cannot run on this hardware (fp16 without a GPU),
            or the launched processes cannot be joined.
    """
    from accelerate import Accelerator

    # Accelerate would drop a tracker whose package is missing without a word: fail before any work
    check_trackers(cfg.logging.report_to)
    state = init_process_state()
    precision, _ = choose_precision(cfg.training.mixed_precision, state.device)
    if precision == "fp16" and state.device.type == "cpu":
        raise LaunchError(
            "training.mixed_precision: fp16 needs a GPU; this process runs on the CPU (use bf16 or no)"
        )
    batching = resolve_batching(cfg.training, state.num_processes)
    configure_cpu_threads(state.device, state.num_processes)
    return Accelerator(
        # agree with the state: on a CPU state AcceleratorState would otherwise still pick DeepSpeed if asked
        cpu=state.device.type == "cpu",
        gradient_accumulation_steps=batching.gradient_accumulation_steps,
        mixed_precision=precision,
        log_with=cfg.logging.report_to or None,
        project_dir=project_dir or cfg.output.output_dir,
    )


@dataclass
class Run:
    """Everything a run is made of, prepared by Accelerate (the scheduler excepted)."""

    cfg: Config
    accelerator: Any
    batching: Batching
    tokenizer: Any
    labels: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_dataloader: Any
    eval_dataloader: Any
    metrics: Any
    plan: UpdatePlan
    # the problem type's loss (with class weights) and predictions
    task: Task = field(default_factory=Task)
    # SHA-256 of the training rows (texts and labels, in the data's order): resuming needs the same data
    data_sha256: str = ""
    state: TrainState = field(default_factory=TrainState)


class BucketPadding:
    """Pad each micro-batch to the smallest of a few fixed lengths that holds its longest text.

    ``torch.compile`` builds a graph per input shape; with padding to the
    longest text of each micro-batch nearly every micro-batch is a new shape.
    Four buckets (a quarter of ``data.max_length`` apart, the last one
    ``max_length`` itself) bound the graphs at four per batch size. The
    collators of transformers pad to the longest text, to ``max_length`` or to
    a multiple; none pads to the nearest of a few sizes, hence this wrapper.
    """

    def __init__(self, tokenizer, max_length: int, buckets: int = 4):
        from transformers import DataCollatorWithPadding

        self.sizes = sorted({max(1, -(-max_length * i // buckets)) for i in range(1, buckets + 1)})
        self._pad = {size: DataCollatorWithPadding(tokenizer, padding="max_length", max_length=size)
                     for size in self.sizes}

    def size_for(self, longest: int) -> int:
        return next((size for size in self.sizes if size >= longest), self.sizes[-1])

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        longest = max(len(f["input_ids"]) for f in features)
        return self._pad[self.size_for(longest)](features)


def _collator(tokenizer, accelerator, cfg: Optional[Config] = None):
    """Dynamic padding; under ``training.torch_compile``, padding to a few fixed lengths (:class:`BucketPadding`)."""
    from transformers import DataCollatorWithPadding

    if cfg is not None and cfg.training.torch_compile:
        return BucketPadding(tokenizer, cfg.data.max_length)
    # multiples of 8 let GPU tensor cores work on padded shapes; on the CPU it only adds padding
    multiple = 8 if accelerator.device.type == "cuda" else None
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=multiple)


def training_sampler(cfg: Config, lengths, batching: Batching) -> EpochSampler:
    """The training order of a config: seeded, length-grouped within windows of each epoch's effective
    batch (or within mega-batches of ``data.length_group_windows`` windows)."""
    schedule = resolve_accumulation(cfg.training, batching)
    per_k = batching.per_device_batch_size * batching.num_processes
    return EpochSampler(
        len(lengths),
        seed=cfg.training.seed,
        lengths=lengths,
        group_by_length=cfg.data.group_by_length,
        window_size={epoch: per_k * k for epoch, k in schedule.changes},
        group_windows=cfg.data.length_group_windows,
    )


def balance_micro_batches(cfg: Config, num_processes: int, device_type: str) -> bool:
    """Whether ``data.balance_micro_batches`` applies.

    ``auto``: on one process on a CPU, with length grouping and no ``torch_compile``. On
    several processes Accelerate deals micro-batches of one size round-robin; a compiled
    model would meet a new batch shape at nearly every micro-batch; and on a GPU, where a
    micro-batch costs its kernel launches more than its padding, the many new shapes cost
    more than the padding saved (3.5x slower on an H100, ``bench/README.md``).

    Raises:
        ConfigError: for ``true`` where it cannot apply.
    """
    setting = cfg.data.balance_micro_batches
    why_not = ("it needs one process" if num_processes > 1
               else "it needs data.group_by_length: true" if not cfg.data.group_by_length
               else "it does not combine with training.torch_compile" if cfg.training.torch_compile else None)
    if setting is True and why_not:
        raise ConfigError(f"data.balance_micro_batches: true, but {why_not}; use auto (or false)")
    return setting is True or (setting == "auto" and why_not is None and device_type == "cpu")


def build_dataloaders(cfg: Config, tokenized, tokenizer, accelerator, batching: Batching):
    """Training and evaluation dataloaders (unprepared).

    The training order comes from :class:`~finetune.sampling.EpochSampler`;
    evaluation runs over the validation set sorted by length (the order does
    not matter to the metrics, and sorting pads least).
    """
    from torch.utils.data import DataLoader

    collate = _collator(tokenizer, accelerator, cfg)
    train = tokenized["train"]
    lengths = train["length"]
    train = train.remove_columns(["length"])
    sampler = training_sampler(cfg, lengths, batching)
    b = batching.per_device_batch_size
    if balance_micro_batches(cfg, accelerator.num_processes, accelerator.device.type):
        batches: dict[str, Any] = {"batch_sampler": BalancedBatches(sampler, b)}
    else:
        batches = {"batch_size": b, "sampler": sampler, "drop_last": False}
    pin = accelerator.device.type == "cuda"
    workers = choose_workers(cfg.data.num_workers, accelerator.device, accelerator.num_processes)
    # A DataLoader without a generator draws a seed from the global torch RNG each time it is
    # iterated; its own generator leaves the global RNG (dropout) to the updates alone, which
    # makes a resumed run's dropout masks those of the uninterrupted run.
    train_dl = DataLoader(
        train,
        **batches,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(cfg.training.seed),
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
    )
    eval_dl = None
    if "validation" in tokenized:
        # longest first, so padding is least and an out-of-memory shows at the first batch
        # (select by argsort rather than Dataset.sort, which trips a pyarrow deprecation warning)
        order = np.argsort(-np.asarray(tokenized["validation"]["length"]), kind="stable")
        val = tokenized["validation"].select(order).remove_columns(["length"])
        eval_dl = DataLoader(
            val, batch_size=cfg.training.per_device_eval_batch_size, collate_fn=collate, pin_memory=pin,
            generator=torch.Generator().manual_seed(cfg.training.seed),
        )
    return train_dl, eval_dl


def fit_micro_batch(model, train_dataset, tokenizer, accelerator, batching: Batching) -> Batching:
    """``per_device_train_batch_size: auto``: the largest ``b`` that fits with ``B`` unchanged; sets ``k``."""
    from finetune.autobatch import choose_micro_batch, worst_case_batch

    model.to(accelerator.device)
    collate = _collator(tokenizer, accelerator)
    b, k = choose_micro_batch(
        model,
        lambda size: worst_case_batch(train_dataset, collate, size),
        accelerator,
        batching.effective_batch_size,
        start=batching.per_device_batch_size,
    )
    accelerator.gradient_accumulation_steps = k
    return Batching(b, k, batching.num_processes)


def setup_run(cfg: Config, accelerator=None) -> Run:
    """Load and prepare everything the config describes.

    Nothing is written to ``output.output_dir`` here, so a bad data file or
    model path fails before any earlier output is touched. Every check that
    can reject the input runs before tokenization, which takes minutes on a
    large data set: the model's path and position limit even before the data
    is read.

    Args:
        cfg: A validated config (see :func:`finetune.config.load_config`).
        accelerator: An existing ``Accelerator`` (its ``gradient_accumulation_steps``
            must match the config); built with :func:`build_accelerator` when ``None``.

    Returns:
        A :class:`Run` whose model, optimizer and dataloaders are prepared.
    """
    from accelerate.utils import set_seed

    from finetune.data import content_sha256
    from finetune.modeling import load_model, load_model_config, load_tokenizer

    accelerator = accelerator or build_accelerator(cfg)
    batching = check_batching(cfg, accelerator)
    set_seed(cfg.training.seed)
    tokenizer = load_tokenizer(cfg.model)
    load_model_config(cfg.model, cfg.data.max_length)
    cache_dir = tokenized_cache_dir(cfg)
    splits, labels = load_data(cfg, accelerator)
    model = load_model(cfg.model, labels.id2label, max_length=cfg.data.max_length)
    metrics = metric_suite(cfg, labels, splits["train"])
    task = build_task(cfg, labels, splits["train"])
    tokenized = tokenize_data(cfg, splits, tokenizer, accelerator, cache_dir)
    if cfg.training.per_device_train_batch_size == "auto":
        batching = fit_micro_batch(model, tokenized["train"], tokenizer, accelerator, batching)
    if cfg.training.torch_compile:
        model.compile()  # in place: state_dict keys, unwrap_model and save_pretrained stay as without compiling
    train_dl, eval_dl = build_dataloaders(cfg, tokenized, tokenizer, accelerator, batching)
    optimizer = build_optimizer(model, cfg.optim, device=accelerator.device)
    model, optimizer, train_dl, eval_dl = prepare(accelerator, model, optimizer, train_dl, eval_dl)
    plan = plan_for(cfg, train_dl, accelerator, batching)
    # Not prepared (its wrapper steps P times per call), nor registered for checkpointing:
    # finetune.checkpoint saves it and reads it back with weights_only=True.
    scheduler = build_scheduler(optimizer, cfg.optim, plan)
    # Training's own random draws (dropout) start from the seed itself, not from wherever setup
    # left the generators: the new head's initialisation draws a number that depends on the label
    # count and the architecture. So one seed gives one dropout stream whatever the model, as with
    # the Trainer, which seeds after the model is built. A resumed run restores its checkpointed
    # generators over this one (finetune.checkpoint).
    set_seed(cfg.training.seed)
    return Run(cfg, accelerator, batching, tokenizer, labels, model, optimizer, scheduler, train_dl, eval_dl,
               metrics, plan, task, content_sha256(splits["train"]))


def metric_suite(cfg: Config, labels, train_split):
    """The validation metrics of the problem type, with ``evaluation.average: auto`` decided.

    For single labels ``auto`` looks at the training labels (binary for two
    classes, positive the rarer); for multi-label it is micro. The decision is
    logged and written back into ``cfg``, so ``config.yaml`` (and
    ``finetune.score`` after it) says what the run computed.
    """
    from finetune.metrics import metric_suite_for, resolve_average

    evaluation = cfg.evaluation
    counts = class_counts(train_split, len(labels.names)) if labels.problem_type == "single_label" else None
    if evaluation.average == "auto" and labels.problem_type == "multi_label":
        evaluation.average = "micro"
        logger.info("evaluation.average: auto -> micro (multi_label)")
    elif evaluation.average == "auto" and labels.problem_type == "single_label":
        average, positive = resolve_average(evaluation, labels.names, counts)
        why = "evaluation.positive_label" if evaluation.positive_label else "the rarer of two"
        logger.info("evaluation.average: auto -> %s",
                    f"binary, positive class {positive!r} ({why})" if average == "binary" else average)
        evaluation.average, evaluation.positive_label = average, positive
    return metric_suite_for(evaluation, labels.names, labels.problem_type, counts)


def class_counts(train_split, num_labels: int) -> np.ndarray:
    """Training samples per class id (single labels)."""
    from finetune.data import LABELS

    return np.bincount(np.asarray(train_split[LABELS]), minlength=num_labels)


def build_task(cfg: Config, labels, train_split) -> Task:
    """The run's :class:`~finetune.tasks.Task`: its problem type, with ``training.class_weights`` resolved.

    Raises:
        ConfigError: if a class weight names a label the training data does not have.
    """
    from finetune.tasks import balanced_weights

    spec = cfg.training.class_weights
    if spec is None:
        return Task(labels.problem_type)
    names = list(labels.names)
    if spec == "balanced":
        weights = balanced_weights(class_counts(train_split, len(names)).tolist())
    else:
        unknown = [name for name in spec if name not in names]
        if unknown:
            raise ConfigError(f"training.class_weights: {unknown[0]!r} is not a label of the training data "
                              f"({', '.join(names[:10])}{', ...' if len(names) > 10 else ''})")
        weights = [float(spec.get(name, 1.0)) for name in names]
    logger.info("training.class_weights: %s", ", ".join(f"{n}={w:.4g}" for n, w in zip(names, weights)))
    return Task("single_label", torch.tensor(weights, dtype=torch.float32))


def check_batching(cfg: Config, accelerator) -> Batching:
    """``b``, ``k``, ``P`` of the config on this accelerator's processes.

    Raises:
        ConfigError: if the ``Accelerator`` accumulates another ``k`` than the config.
    """
    batching = resolve_batching(cfg.training, accelerator.num_processes)
    resolve_accumulation(cfg.training, batching)  # a schedule that contradicts k fails here, before any work
    if accelerator.gradient_accumulation_steps != batching.gradient_accumulation_steps:
        raise ConfigError(
            f"training.gradient_accumulation_steps: the Accelerator accumulates "
            f"{accelerator.gradient_accumulation_steps} steps, the config {batching.gradient_accumulation_steps}"
        )
    return batching


def tokenized_cache_dir(cfg: Config) -> Optional[Path]:
    """The checked folder of the tokenization cache, or ``None`` when ``data.cache_tokenized`` is off."""
    from finetune.tokens import default_cache_dir, prepare_cache_dir

    if not cfg.data.cache_tokenized:
        return None
    return prepare_cache_dir(cfg.data.cache_dir or default_cache_dir())


def load_data(cfg: Config, accelerator):
    """The data's splits and label space (the main process first, so that others find its caches)."""
    from finetune.data import load_splits

    with accelerator.main_process_first():
        return load_splits(cfg.data, seed=cfg.training.seed, problem_type=cfg.model.problem_type)


def tokenize_data(cfg: Config, splits, tokenizer, accelerator, cache_dir: Optional[Path]):
    """The tokenized splits; the main process tokenizes (and caches) first, the others then read its files."""
    from finetune.tokens import tokenize_splits

    with accelerator.main_process_first():
        return tokenize_splits(splits, tokenizer, cfg.data.max_length, cache_dir=cache_dir)


def prepare(accelerator, model, optimizer, train_dl, eval_dl):
    """Everything but the scheduler through ``accelerator.prepare``; ``eval_dl`` may be ``None``."""
    if eval_dl is None:
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
        return model, optimizer, train_dl, None
    return accelerator.prepare(model, optimizer, train_dl, eval_dl)


def plan_for(cfg: Config, train_dl, accelerator, batching: Batching) -> UpdatePlan:
    """The run's length in updates, counted on the prepared (per-process) training dataloader."""
    layout = layout_for(train_dl, accelerator)
    return plan_updates(
        layout.micro_batches_per_process,
        resolve_accumulation(cfg.training, batching),
        cfg.training.num_train_epochs,
        cfg.training.max_steps,
        cfg.optim.warmup_steps,
        cfg.optim.warmup_ratio,
    )


def describe(run: Run) -> str:
    """One start-up line: processes, backend, device, CPU speed-ups, b/k/P/B, updates."""
    acc = run.accelerator
    b = run.batching
    backend = getattr(acc.state, "backend", None) or "none"
    training = run.cfg.training
    speedups = plan_cpu_speedups(run.model, acc, quiet=True, **speedup_settings(training)).describe()
    return (
        f"processes={acc.num_processes} backend={backend} device={acc.device} "
        f"{'threads=' + str(torch.get_num_threads()) + ' ' if acc.device.type == 'cpu' else ''}"
        f"precision={acc.mixed_precision} ({choose_precision(training.mixed_precision, acc.device)[1]}) "
        f"{speedups + ' ' if speedups else ''}"
        f"workers={run.train_dataloader.num_workers} "
        f"micro-batches={'balanced' if hasattr(run.train_dataloader.batch_sampler, 'sizes') else 'equal'} "
        f"b={b.per_device_batch_size} k={_accumulation(run)} "
        f"P={b.num_processes} effective_batch={b.effective_batch_size} "
        f"train_samples={len(run.train_dataloader.dataset)} updates={run.plan.total_updates} "
        f"({_updates_by_epoch(run.plan)}, warmup {run.plan.warmup_updates})"
    )


def _accumulation(run: Run) -> str:
    """``k``, or under a schedule the ``k`` of each of its epochs: ``4 (by epoch {0: 4, 2: 2})``."""
    schedule = resolve_accumulation(run.cfg.training, run.batching)
    return str(run.batching.gradient_accumulation_steps) + ("" if schedule.is_constant else f" (by epoch {schedule})")


def _updates_by_epoch(plan: UpdatePlan) -> str:
    if len(set(plan.epoch_updates)) <= 1:
        return f"{plan.updates_per_epoch}/epoch x {plan.num_epochs} epochs"
    return f"{'+'.join(map(str, plan.epoch_updates))} over {plan.num_epochs} epochs"


def check_output_dir(cfg: Config) -> None:
    """Refuse, before any work, an output directory the run must not write into.

    Raises:
        ConfigError: if ``output.output_dir`` cannot be created or written; if it
            holds an earlier run's files that nothing says to resume or replace
            (``auto`` resumes only from a checkpoint; ``overwrite`` replaces); or if
            ``output.resume_from`` names no complete checkpoint.
    """
    out = Path(cfg.output.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.output_dir: {out} exists and is not a directory")
    # Else the run would only fail when it first writes there: after tokenizing, or after training.
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"output.output_dir: cannot create {out}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output.output_dir: cannot write in {existing} (permission denied)")
    resume = resolve_resume(out, cfg.output.resume_from)
    occupied = out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir())
    if occupied and resume is None and not cfg.output.overwrite:
        if cfg.output.resume_from == "auto":
            raise ConfigError(
                f"output.output_dir: {out} holds an earlier run's files but no checkpoint to resume from; "
                f"pass output.overwrite=true to replace that run, or choose another output.output_dir"
            )
        raise ConfigError(
            f"output.output_dir: {out} is not empty; set output.resume_from=auto to continue it "
            f"or output.overwrite=true to write over it"
        )


@contextlib.contextmanager
def output_lock(accelerator, output_dir: str | os.PathLike):
    """Hold the output folder's :class:`~finetune.outputs.OutputLock` (main process) for the block.

    Every process learns whether the main one got it, so all stop together
    when another run holds the folder; none of them has written anything then.

    Raises:
        ConfigError: on every process, naming the folder and the run that holds it.
    """
    lock = OutputLock(output_dir)
    problem = None
    if accelerator.is_main_process:
        try:
            lock.acquire()
        except ConfigError as exc:
            problem = exc.message
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem])[0]
    if problem is not None:
        raise ConfigError(problem)
    try:
        yield
    finally:
        lock.release()


def save_model(run: Run, directory: str | os.PathLike) -> None:
    """Save model (safetensors) and tokenizer so ``transformers.pipeline`` can load them.

    They are written into a temporary folder beside, then each file is renamed
    into ``directory``: a stop while writing leaves every file whole, old or new.
    """
    acc = run.accelerator
    acc.wait_for_everyone()
    unwrapped = acc.unwrap_model(run.model)
    state_dict = acc.get_state_dict(run.model)
    if acc.is_main_process:
        directory = Path(directory)
        staging = directory / ".tmp-model"
        if staging.exists():
            shutil.rmtree(staging)
        unwrapped.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)
        run.tokenizer.save_pretrained(staging)
        for file in sorted(staging.iterdir()):
            os.replace(file, directory / file.name)
        staging.rmdir()
    acc.wait_for_everyone()


def fit(
    run: Run,
    on_epoch_end: Optional[Callable[[int, dict[str, Any]], None]] = None,
    on_update: Optional[Callable[[TrainState], bool]] = None,
) -> dict[str, Any]:
    """Train all epochs, evaluate, log, checkpoint, keep the best model, and write the outputs.

    Resumes from ``output.resume_from`` when set. Checkpoints (see
    :mod:`finetune.checkpoint`) are saved every ``output.checkpoint_every``
    updates, after each evaluation, and when SIGTERM / SIGINT end the run
    (after the current update). Evaluations run at epoch ends and every
    ``evaluation.eval_every`` updates; ``evaluation.metric_for_best_model``
    marks the best, ``evaluation.early_stopping_patience`` may end the run
    early (outputs are written as for a finished run), and
    ``evaluation.load_best_model_at_end`` makes the saved model the best one.

    Args:
        run: From :func:`setup_run`.
        on_epoch_end: Called with ``(epoch, eval metrics)`` after each epoch's evaluation.
        on_update: Called after every update with the loop's state (after the
            checkpoint callback); returning True ends the run there, without
            final evaluation or outputs.

    Returns:
        The summary ``{"train": {...}, "eval": {...}, "best": {...}, "epochs": [...], "labels": [...]}``,
        as written to ``metrics.json``; ``train.stopped_early`` is True when
        ``on_update`` ended the run (then nothing is written).

    Raises:
        RunInterrupted: after a signal, once the checkpoint is saved (exit code 128 + signal).
        NonFiniteLossError: on a non-finite loss under ``training.on_nonfinite: stop``
            (or too many skips); the message names the last good checkpoint.
        ConfigError: if ``output.resume_from`` names no checkpoint, or one of another setup.
    """
    with output_lock(run.accelerator, run.cfg.output.output_dir):  # one run per folder, from here to the end
        return _fit(run, on_epoch_end, on_update)


def _fit(run: Run, on_epoch_end, on_update) -> dict[str, Any]:
    cfg, acc = run.cfg, run.accelerator
    history: list[dict[str, Any]] = []
    checkpoints = Checkpointer(run, history)  # chooses and verifies the checkpoint before anything is written
    start_outputs(run, fresh=checkpoints.resume_path is None)
    if cfg.logging.report_to:
        acc.init_trackers(cfg.logging.project_name, config=flat_hparams(cfg.to_dict()))
    pending_eval = checkpoints.restore()
    resuming = run.state.step > 0 or run.state.micro_batch > 0 or run.state.epoch > 0
    log = RunLogger(acc, cfg.output.output_dir, use_trackers=bool(cfg.logging.report_to),
                    resume_step=run.state.step if resuming else None, history=history)
    evaluations = Evaluations(run, log, history, checkpoints)
    # SIGTERM / SIGINT: during training, stop at the next window boundary with a checkpoint; once training
    # is over, the final evaluation and writes still complete (they are what the run is for), then it ends.
    with checkpoints:
        try:
            ending = train_epochs(run, checkpoints, evaluations, pending_eval, on_epoch_end, on_update)
        except NonFiniteLossError as exc:
            raise NonFiniteLossError(f"{exc.message}; {checkpoints.last_good()}") from None
        finished = ending != STOPPED_BY_CALLER
        if finished and run.eval_dataloader is not None and not evaluations.done_at(run.state.step):
            evaluations.evaluate(epoch=None)  # the final weights were not evaluated yet
        best = evaluations.best_at_end() if finished else None
        summary = summarize(run, history, stopped_early=not finished, early_stopped=ending == EARLY_STOPPED,
                            best=best)
        if finished:
            write_outputs(run, summary)
        if checkpoints.signals.signum is not None and acc.is_main_process:
            logger.warning("%s came while the final outputs were written; they are complete",
                           signal.Signals(checkpoints.signals.signum).name)
    if cfg.logging.report_to:
        acc.end_training()
    return summary


def start_outputs(run: Run, fresh: bool) -> None:
    """Create the output folder and write ``config.yaml``; a fresh run under ``output.overwrite`` clears the old one."""
    out = Path(run.cfg.output.output_dir)
    if not run.accelerator.is_main_process:
        return
    if fresh and run.cfg.output.overwrite:
        # a fresh run must never resume from, append to, or report an earlier run's state
        for path in clear_previous_run(out):
            logger.info("output.overwrite: removed %s of an earlier run", path)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / CONFIG_FILE, config_yaml(run.cfg))


# how train_epochs ended
COMPLETED, EARLY_STOPPED, STOPPED_BY_CALLER = "completed", "early stopped", "stopped by the caller"


class Evaluations:
    """When to evaluate, and what each evaluation means for the best model and early stopping.

    Evaluations run at each epoch's end (``training.eval_each_epoch``) and
    every ``evaluation.eval_every`` updates. Under a selection
    (:class:`~finetune.selection.Selection`) each record says whether it is the
    best so far, and a checkpoint is saved right after every evaluation, so
    that the best weights exist on disk whenever they were seen.
    """

    def __init__(self, run: Run, log: RunLogger, history: list[dict[str, Any]], checkpoints: Checkpointer):
        self.run, self.log, self.history, self.checkpoints = run, log, history, checkpoints
        self.selection = Selection.from_config(run.cfg.evaluation)
        self.every = run.cfg.evaluation.eval_every
        self._announced = False

    def due_at_epoch_end(self, step: int) -> bool:
        if self.run.eval_dataloader is None:
            return False
        return self.run.cfg.training.eval_each_epoch or bool(self.every and step % self.every == 0)

    def due_mid_epoch(self, step: int) -> bool:
        return self.run.eval_dataloader is not None and bool(self.every and step % self.every == 0)

    def done_at(self, step: int) -> bool:
        return bool(self.history) and self.history[-1]["step"] == step

    def evaluate(self, epoch: Optional[int]) -> dict[str, Any]:
        """Evaluate now, log the record (marked best or not) and keep it; returns the metrics."""
        return evaluate_and_log(self.run, self.log, self.history, epoch, self.selection)

    def checkpoint_after(self, step: int) -> None:
        """Under a selection, every evaluation's weights are saved: the best must exist on disk."""
        if self.selection is not None:
            self.checkpoints.save(f"evaluation at update {step}")

    def should_stop(self) -> bool:
        """Early stopping: the last ``early_stopping_patience`` evaluations did not improve."""
        if self.selection is None or not self.history:
            return False
        judgement = self.selection.judge(self.history)
        if judgement.should_stop and not self._announced and self.run.accelerator.is_main_process:
            self._announced = True
            logger.info(judgement.why_stopped())
        return judgement.should_stop

    def best_at_end(self) -> Optional[dict[str, Any]]:
        """The best evaluation; under ``load_best_model_at_end`` its weights are loaded into the model."""
        if self.selection is None or not self.history:
            return None
        judgement = self.selection.judge(self.history)
        if judgement.best is None:
            return None
        best = {"step": judgement.best_step, "metric": self.selection.metric, "value": judgement.best_value,
                "greater_is_better": self.selection.greater_is_better,
                "checkpoint": str(self.checkpoints.best()) if judgement.best_step != self.run.state.step else None}
        if self.run.cfg.evaluation.load_best_model_at_end and judgement.best_step != self.run.state.step:
            load_model_weights(self.run, self.checkpoints.best())
            logger.info("evaluation.load_best_model_at_end: the saved model is update %d's (%s %.6g), not "
                        "update %d's", judgement.best_step, self.selection.metric, judgement.best_value,
                        self.run.state.step)
        return best


def train_epochs(run: Run, checkpoints: Checkpointer, evaluations: Evaluations, pending_eval: Optional[int],
                 on_epoch_end, on_update) -> str:
    """The epochs from the run's state on, each followed by its evaluation and checkpoint.

    Returns:
        How the epochs ended: ``COMPLETED``, ``EARLY_STOPPED`` or ``STOPPED_BY_CALLER``.
    """
    from tqdm.auto import tqdm

    cfg, acc = run.cfg, run.accelerator

    def on_any_update(state: TrainState) -> bool:
        at_epoch_end = state.micro_batch >= len(run.train_dataloader) or state.step >= run.plan.total_updates
        early = False
        if not at_epoch_end and evaluations.due_mid_epoch(state.step):
            evaluations.evaluate(epoch=None)
            evaluations.checkpoint_after(state.step)
            early = evaluations.should_stop()
        stop = checkpoints.on_update(state)  # on every process, every update: it may all-reduce
        return (bool(on_update(state)) if on_update is not None else False) or stop or early

    def end_of_epoch(epoch: int) -> None:
        if evaluations.due_at_epoch_end(run.state.step):
            metrics = evaluations.evaluate(epoch)
            if on_epoch_end is not None:
                on_epoch_end(epoch, metrics)
        checkpoints.save(f"end of epoch {epoch}")

    progress = tqdm(total=run.plan.total_updates, initial=run.state.step, desc="train", unit="update",
                    disable=not (acc.is_main_process and cfg.logging.progress_bar), dynamic_ncols=True)
    speedups = cpu_speedups(run.model, run.optimizer, acc, **speedup_settings(cfg.training))
    with progress, speedups:
        if pending_eval is not None:
            end_of_epoch(pending_eval)  # the run was stopped between an epoch's last update and its evaluation
        for epoch in range(run.state.epoch, run.plan.num_epochs):
            if run.state.step >= run.plan.total_updates or evaluations.should_stop():
                break
            acc.gradient_accumulation_steps = run.plan.k_at(epoch)  # training.accumulation_schedule
            result = train_one_epoch(
                run.model, run.optimizer, run.scheduler, run.train_dataloader, acc, epoch,
                state=run.state, max_grad_norm=cfg.training.max_grad_norm, log_every=cfg.logging.log_every,
                on_log=evaluations.log.log, on_update=on_any_update, max_updates=run.plan.total_updates,
                on_nonfinite=cfg.training.on_nonfinite, max_skipped=cfg.training.max_skipped, progress=progress,
                loss_fn=run.task.per_sample_loss,
            )
            logger.info("epoch %d: %d updates, loss %.4f, %d samples in %.1fs",
                        epoch, result.updates, result.loss, result.samples, result.seconds)
            finished = not result.stopped_early or run.state.step >= run.plan.total_updates
            if checkpoints.stop_signum is not None:
                eval_due = finished and evaluations.due_at_epoch_end(run.state.step)
                checkpoints.interrupt(pending_eval_epoch=epoch if eval_due else None)
            if not finished:
                # an evaluation mid-epoch ended the run, or a callback asked to stop (no evaluation of a part)
                return EARLY_STOPPED if evaluations.should_stop() else STOPPED_BY_CALLER
            end_of_epoch(epoch)
            checkpoints.check_signal()  # a signal during the evaluation: stop on the epoch's checkpoint
            if evaluations.should_stop():
                return EARLY_STOPPED
    return COMPLETED


def evaluate_and_log(run: Run, log: RunLogger, history: list[dict[str, Any]], epoch: Optional[int],
                     selection: Optional[Selection] = None):
    """Evaluate on the validation split, log the record and keep it in ``history``; returns the metrics.

    ``epoch`` is the epoch just finished (``None`` mid-epoch, or for the evaluation after training).
    Under a ``selection`` the record says whether it is the best evaluation so far (``is_best``).
    """
    metrics = evaluate_model(run.model, run.eval_dataloader, run.accelerator, run.metrics, run.task)
    record: dict[str, Any] = {"step": run.state.step}
    if epoch is not None:
        record["epoch"] = epoch + 1
        logger.info("epoch %d eval: %s", epoch, _fmt(metrics))
    else:
        logger.info("update %d eval: %s", run.state.step, _fmt(metrics))
    record.update({f"eval/{k}": v for k, v in metrics.items()})
    if selection is not None:
        record["is_best"] = selection.judge(history + [record]).best is record
    log.log(record)
    history.append(record)
    return metrics


def summarize(run: Run, history: list[dict[str, Any]], stopped_early: bool = False, early_stopped: bool = False,
              best: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The run's summary: what ``metrics.json`` holds.

    ``eval`` holds the metrics of the saved model: the best evaluation's under
    ``evaluation.load_best_model_at_end``, else the last one's.
    """
    final = history[-1] if history else {}
    if best is not None and run.cfg.evaluation.load_best_model_at_end:
        final = next(r for r in history if r["step"] == best["step"])
    return {
        "train": {
            "updates": run.state.step,
            "skipped_updates": run.state.skipped_updates,
            "samples": run.state.samples_seen,
            "tokens": run.state.tokens_seen,
            "seconds": run.state.train_seconds,  # the whole run's, as the counts around it
            "loss": run.state.loss_sum / run.state.loss_samples if run.state.loss_samples else None,
            "train_samples": len(run.train_dataloader.dataset),
            "epoch": run.state.epoch + run.state.micro_batch / max(1, len(run.train_dataloader)),
            "effective_batch_size": run.batching.effective_batch_size,
            "gradient_accumulation_steps": run.batching.gradient_accumulation_steps,
            "accumulation_by_epoch": list(run.plan.accumulation),
            "num_processes": run.batching.num_processes,
            "mixed_precision": run.accelerator.mixed_precision,
            "stopped_early": stopped_early,
            "early_stopped": early_stopped,
        },
        "eval": {k.removeprefix("eval/"): v for k, v in final.items() if k.startswith("eval/")},
        "best": best,
        "epochs": history,
        "labels": list(run.labels.names),
    }


def write_outputs(run: Run, summary: dict[str, Any]) -> None:
    """The final model, ``metrics.json``, ``all_results.json``, the model card and ``curves.png``.

    Each file is written to a temporary name and renamed, so a run stopped
    while writing leaves the old file or the new one.
    """
    from finetune.model_card import all_results, model_card

    out = Path(run.cfg.output.output_dir)
    save_model(run, out)
    if not run.accelerator.is_main_process:
        return
    write_atomic(out / METRICS_FILE, json.dumps(summary, indent=2) + "\n")
    write_atomic(out / RESULTS_FILE, json.dumps(all_results(summary), indent=2) + "\n")
    write_model_card(out / MODEL_CARD_FILE, model_card(run.cfg, summary))
    write_curves(out)


def write_model_card(path: Path, card: str) -> bool:
    """Write the model card, unless ``path`` is a README the user wrote (then warn and keep it)."""
    if path.exists() and MODEL_CARD_MARK not in path.read_text(encoding="utf-8", errors="replace"):
        logger.warning("%s was not written by finetune: kept as it is, and no model card written", path)
        return False
    write_atomic(path, card)
    return True


def write_curves(out: Path) -> None:
    """``curves.png`` from the run's log; a missing matplotlib costs the picture, not the run."""
    from finetune.plot import plot_curves

    try:
        plot_curves(out)
    except FinetuneError as exc:
        logger.warning("%s not written: %s", out / CURVES_FILE, exc.message)


def _fmt(metrics: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
