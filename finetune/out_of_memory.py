"""A device that runs out of memory mid-run: one line saying where, and the settings that go on with less.

The memory plan refuses a micro-batch it measures as too large before training starts (:mod:`finetune.memory`),
but a run can still run out later: a longer evaluation batch, a fragmented allocator, another process on the
GPU. What the run trained is in its newest checkpoint, and the cheapest way on keeps the run itself: half the
micro-batch at twice the accumulation, the same effective batch and so the same updates, which the same
command then resumes (:mod:`finetune.resplit`). Where the split may not change, gradient checkpointing, which
may change on resume as well.
"""

from __future__ import annotations

import traceback
from typing import Optional

from finetune.checkpoint_files import list_checkpoints
from finetune.errors import OutOfMemory
from finetune.evaluation import evaluation_of
from finetune.resplit import sharded_state


def out_of_memory_error(run, exc: BaseException, dry_run: bool = False) -> OutOfMemory:
    """The one-line error for ``exc`` (an out-of-memory error raised while ``run`` trained or evaluated, or was
    tried in a dry run), for :func:`finetune.errors.out_of_memory_told_as`."""
    acc, state = run.accelerator, run.state
    device = f"{acc.device}" + (f" (process {acc.process_index})" if acc.num_processes > 1 else "")
    newest = list_checkpoints(run.cfg.output.output_dir)
    saved = "in a dry run" if dry_run else checkpoint_said(newest)
    if raised_in(exc, evaluation_of):
        eval_b = run.cfg.training.per_device_eval_batch_size
        message = f"out of memory on {device} evaluating after update {state.step}, at " \
                  f"training.per_device_eval_batch_size={eval_b}; {saved}"
        # half the batches it ran: a validation set smaller than the batch size ran as one batch of all of it
        rows = min(eval_b, -(-len(run.eval_dataloader.dataset) // acc.num_processes))
        settings = f"training.per_device_eval_batch_size={rows // 2}" if rows > 1 else None
        what = "the evaluation batch does not change the training"
    else:
        b, k = run.batching.per_device_batch_size, run.plan.k_at(state.epoch)
        message = f"out of memory on {device} in update {state.step + 1} (epoch {state.epoch}), at b={b}; {saved}"
        settings, what = memory_saving_settings(run, b, k)
    return OutOfMemory(message, hint=hint_line(settings, what, newest, dry_run), settings=settings)


def raised_in(exc: BaseException, function) -> bool:
    """Whether ``function`` was running when ``exc`` was raised."""
    return any(frame.f_code is function.__code__ for frame, _ in traceback.walk_tb(exc.__traceback__))


def checkpoint_said(newest: list) -> str:
    return f"the newest checkpoint is {newest[-1]}" if newest else "no checkpoint was saved yet"


def same_command_with(settings: str, newest: list, dry_run: bool = False) -> str:
    """How the run goes on with ``settings``: from its newest checkpoint, or, with none, afresh in its folder;
    a dry run, which wrote nothing, is tried again."""
    if dry_run:
        return f"the same command with {settings} tries it again"
    if newest:
        return f"the same command with {settings} resumes it from {newest[-1].name}"
    return f"the same command with {settings} output.overwrite=true starts it again (it saved no checkpoint)"


def hint_line(settings: Optional[str], what: str, newest: list, dry_run: bool = False) -> str:
    """The ``hint:`` line: how the same command goes on with ``settings``, and what they do (or, with none, what
    is left)."""
    return f"{same_command_with(settings, newest, dry_run)}: {what}" if settings else what


def memory_saving_settings(run, b: int, k: int) -> tuple[Optional[str], str]:
    """The overrides that train the same updates on less memory, and what they do; with none left, ``None`` and
    the levers that start a new run."""
    training = run.cfg.training
    B = run.batching.effective_batch_size
    if b % 2 == 0 and training.accumulation_schedule is None and sharded_state(run.accelerator) is None:
        # effective_batch_size typed beside b keeps B where the config gave k instead
        keep_b = "" if training.effective_batch_size is not None else f" training.effective_batch_size={B}"
        return (f"training.per_device_train_batch_size={b // 2}{keep_b}",
                f"k={2 * k}, the same updates (effective batch {B}) on about half the activation memory")
    if not run.checkpointing.on:
        return ("training.gradient_checkpointing=true",
                "the same updates, recomputing activations in the backward pass (about a third more compute)")
    eight_bit = "8-bit optimizer state (optim.optimizer=adamw_8bit), " if run.cfg.optim.optimizer == "adamw" else ""
    return None, (f"a shorter data.max_length, {eight_bit}LoRA adapters (model.lora_rank) or frozen blocks "
                  f"(model.freeze_blocks) need less; each is a new run (docs/memory.md)")
