"""A dry run: the built run trained for a few updates as :func:`~finetune.fitting.fit` trains them, from the
first update whatever the folder holds, and evaluated once, with nothing written, to say that it starts and
fits and how long the run would take on this machine, from the checkpoint a start would resume from where the
folder holds one (``finetune train --dry-run``; docs/configuration.md#a-dry-run).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from finetune.accumulation import accumulate_as
from finetune.checkpointer import Checkpointer
from finetune.columns import read_column
from finetune.evaluation import evaluation_of
from finetune.fitting import EvaluationSchedule, check_untrained, evaluate_run
from finetune.loop import TrainState, train_one_epoch
from finetune.lora import is_lora
from finetune.run import Run
from finetune.selection import EvalHistory

# updates a dry run trains: the first few carry the start-up (a new shape's kernels, a graph's capture), the
# later half gives the pace
REHEARSED_UPDATES = 10
# validation texts a dry run evaluates at most: a larger set is timed on its longest batch (that it fits) and an
# even sample of the rest (timed_evaluation); a dry run of a large set on a CPU would otherwise spend minutes on
# the one evaluation
TIMED_TEXTS = 2000


@dataclass
class Rehearsal:
    """What :func:`rehearse` measured."""

    # each update's loss, and its wall seconds (data loading, forward, backward and the optimizer step)
    losses: list[float]
    seconds: list[float]
    # the run's updates; the seconds of the later half's median update; the seconds of the updates a start
    # would train (all of them, or those after resumes_from): as many as were tried as they took, the rest at
    # that pace
    total_updates: int
    pace: float
    estimate: float
    # on a CUDA GPU: the peak of allocated memory over the updates and the evaluation, bytes (None elsewhere)
    gpu_peak: Optional[int]
    # the checkpoint a start would resume from, and the updates it has trained, which the estimate leaves out
    resumes_from: Optional[Path] = None
    done_updates: int = 0
    # the seconds of one evaluation of the validation data, made after the updates as the run makes it (None
    # without validation data): as it took, or estimated from the texts timed where there were more than
    # TIMED_TEXTS; the texts timed, and the seconds that took
    evaluation_seconds: Optional[float] = None
    timed_texts: int = 0
    timing_seconds: float = 0.0
    # the evaluations a start would make, by the run's evaluation schedule (fewer where early stopping ends it)
    evaluations: int = 0
    # the checkpoints a start would save (fewer where early stopping ends it), and the bytes of one: the trained
    # weights and the optimizer's state, as the tried updates left them
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    # the most of them the run's folder keeps at its end (output.keep_last), and the bytes of the model it saves
    kept_checkpoints: int = 0
    model_bytes: int = 0


def rehearse(run: Run, updates: int = REHEARSED_UPDATES) -> Rehearsal:
    """Train ``run`` (from :func:`~finetune.assembly.setup_run`) for ``updates`` updates of its first epoch, as
    :func:`fit` would train them, then evaluate it once, and measure both. The weights and the run's state move:
    the run is spent.

    Raises:
        NonFiniteLossError: on a non-finite loss under ``training.on_nonfinite: stop``, as the run would.
        RuntimeError: for a run that has trained already.
    """
    check_untrained(run, "rehearse")
    acc = run.accelerator
    checkpoints = Checkpointer(run, EvalHistory.from_config(run.cfg.evaluation))  # the one fit would resume
    wanted = min(updates, run.plan.total_updates)  # fewer where the first epoch ends before: the loop stops there
    ends = []

    def after_update(state: TrainState) -> bool:
        ends.append(time.perf_counter())  # the loop has read the update's loss: the device is done with it
        return state.step >= wanted

    if acc.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(acc.device)
    records = []
    with run.speedups():
        accumulate_as(acc, run.batching, 0)
        began = time.perf_counter()
        # the run's own counters, fresh from setup_run: an error names the update it came in
        train_one_epoch(run.model, run.optimizer, run.scheduler, run.train_dataloader, acc, 0, state=run.state,
                        log_every=1, on_log=records.append, on_update=after_update, **run.loop_settings())
    seconds = [end - start for start, end in zip([began] + ends, ends)]
    losses = [record["train/loss"] for record in records if "train/loss" in record]
    evaluation, timed, timing = None, 0, 0.0
    if run.eval_dataloader is not None:  # that it runs and fits at its own batch size, and how long it takes
        evaluation, timed, timing = timed_evaluation(run, TIMED_TEXTS)
    done = checkpoints.resume_meta["state"]["step"] if checkpoints.resume_meta is not None else 0
    pace, estimate = pace_and_estimate(seconds, run.plan.total_updates - done)
    peak = torch.cuda.max_memory_allocated(acc.device) if acc.device.type == "cuda" else None
    due = EvaluationSchedule(run)
    return Rehearsal(losses=losses, seconds=seconds, total_updates=run.plan.total_updates, pace=pace,
                     estimate=estimate, gpu_peak=peak, resumes_from=checkpoints.resume_path,
                     done_updates=done, evaluation_seconds=evaluation, timed_texts=timed, timing_seconds=timing,
                     evaluations=due.count_after(done), checkpoints=checkpoints.count_after(done, due),
                     checkpoint_bytes=checkpoint_bytes(run), kept_checkpoints=checkpoints.kept_after(done, due),
                     model_bytes=saved_model_bytes(run))


def timed_evaluation(run: Run, most: int) -> tuple[float, int, float]:
    """The seconds one evaluation of the run's validation texts takes, the texts timed, and the seconds that took.

    Up to ``most`` texts, the run's own evaluation, timed. Beyond, two evaluations of :func:`timed_rows` (the
    longest batch, which the run's evaluation starts with, and an even sample of the rest, in the same order):
    the first as it took, with the kernels it builds for each new length, as the run's first evaluation builds
    them; the rest of the texts at the second's seconds per token computed on, padding included
    (:func:`padded_tokens`: a sample's batches span more lengths than the run's, and pad more).
    """
    loader = run.eval_dataloader
    texts = len(loader.dataset)
    began = time.perf_counter()
    if texts <= most:
        evaluate_run(run)
        seconds = time.perf_counter() - began
        return seconds, texts, seconds
    batch = run.cfg.training.per_device_eval_batch_size
    step = batch * run.accelerator.num_processes  # the texts of one evaluation step, over the processes
    rows = timed_rows(texts, step, most)
    sample = run.accelerator.prepare_data_loader(
        DataLoader(loader.dataset.select(rows), batch_size=batch, collate_fn=loader.collate_fn))
    ends = []
    for _ in range(2):
        evaluation_of(run.model, sample, run.accelerator, run.metrics, run.task, labels=run.labels.names)
        ends.append(time.perf_counter())
    first, again = ends[0] - began, ends[1] - ends[0]
    windows, lengths = windows_and_lengths(loader.dataset)
    multiple = run.cfg.data.pad_to_multiple_of
    if run.padding is not None and run.padding.length is not None:  # every batch padded to one length
        lengths = np.full_like(lengths, run.padding.length)
    whole = padded_tokens(windows, lengths, step, multiple)
    timed = padded_tokens(windows[rows], lengths[rows], step, multiple)
    return first + again * (whole - timed) / timed, len(rows), ends[1] - began


def timed_rows(texts: int, batch: int, most: int) -> list[int]:
    """Rows of a validation set sorted longest first to time it on: its first ``batch`` (the longest, that it
    fits) and, to ``most`` in all, rows spread evenly over the rest, in their order."""
    spread = np.linspace(batch, texts - 1, num=max(0, most - batch)).round().astype(int)
    return sorted(set(range(min(batch, texts))) | set(spread.tolist()))


def windows_and_lengths(dataset) -> tuple[np.ndarray, np.ndarray]:
    """Each validation text's windows (1, or more under ``data.truncation: chunks``) and its longest one's
    tokens."""
    ids = read_column(dataset, "input_ids")
    chunked = bool(ids) and bool(ids[0]) and isinstance(ids[0][0], list)
    windows = np.array([len(row) if chunked else 1 for row in ids])
    lengths = np.array([max(map(len, row)) if chunked else len(row) for row in ids])
    return windows, lengths


def padded_tokens(windows: np.ndarray, lengths: np.ndarray, batch: int, multiple: Optional[int]) -> int:
    """The tokens, padding included, of the batches of ``batch`` texts these make in their order, each padded to
    its longest window (rounded up to ``multiple``): what an evaluation computes on."""
    total = 0
    for start in range(0, len(lengths), batch):
        longest = int(lengths[start:start + batch].max())
        if multiple:
            longest = -(-longest // multiple) * multiple
        total += int(windows[start:start + batch].sum()) * longest
    return total


def checkpoint_bytes(run: Run) -> int:
    """About what a checkpoint of the run holds: its weights (a LoRA run's adapters alone) and the optimizer's
    state; the tokenizer's files, the random states and the schedule are small beside them."""
    model = run.accelerator.unwrap_model(run.model)
    lora = is_lora(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not lora)
    state = sum(value.numel() * value.element_size() for per_weight in run.optimizer.state.values()
                for value in per_weight.values() if torch.is_tensor(value))
    return weights + state


def saved_model_bytes(run: Run) -> int:
    """About what the run's saved model holds: every weight, a LoRA run's merged into its base (its adapters'
    own copy, small beside them, left out)."""
    model = run.accelerator.unwrap_model(run.model)
    lora = is_lora(model)
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if not (lora and "lora_" in name))


def pace_and_estimate(seconds: list[float], updates: int) -> tuple[float, float]:
    """The median of the later half of the tried updates' ``seconds``, and the seconds of a fresh process's
    ``updates`` updates: as many as were tried as they took (a new process's first updates are its slowest),
    the others at that pace."""
    pace = statistics.median(seconds[len(seconds) // 2:])
    return pace, sum(seconds[:updates]) + pace * max(0, updates - len(seconds))
