"""When ``fit`` saves a checkpoint and what it restores from one: :class:`Checkpointer`. What a checkpoint holds,
and saving and loading one, is :mod:`finetune.checkpoint`."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from finetune.checkpoint import load_checkpoint, load_model_weights, save_checkpoint
from finetune.checkpoint_files import CHECKPOINT_PREFIX, checkpoints_root, read_state
from finetune.evaluation import EVAL_THRESHOLDS
from finetune.resplit import k_in_epoch, micro_batch_on_new_split, split_change
from finetune.resuming import check_compatible, choose_checkpoint, padding_change, padding_lengths, run_fingerprint
from finetune.selection import EvalHistory
from finetune.tasks import set_model_thresholds

if TYPE_CHECKING:
    from finetune.run import Run

logger = logging.getLogger("finetune")


class Checkpointer:
    """Saving and restoring the run's checkpoints, for :func:`finetune.fitting.fit`.

    :meth:`restore` loads the checkpoint ``output.resume_from`` names (chosen
    and verified when this is made, before anything is written).
    :meth:`after_update` saves every ``output.checkpoint_every`` updates, or
    at once when the run is stopping; ``fit`` saves after each epoch's
    evaluation with :meth:`save`. When to stop is not decided here (see
    :class:`finetune.signals.StopSignals`), nor which evaluation is best (see
    :class:`finetune.selection.EvalHistory`, which every checkpoint saves).

    Args:
        run: The :class:`~finetune.run.Run`.
        history: The run's evaluation history (saved with each checkpoint; restored on resume).
    """

    def __init__(self, run: "Run", history: EvalHistory):
        self.run = run
        self.history = history
        out = run.cfg.output
        self.enabled = out.save_checkpoints
        self.every = out.checkpoint_every
        self.resume_path = choose_checkpoint(run)
        self.resume_meta = read_state(self.resume_path) if self.resume_path is not None else None  # its state
        self._split_change: Optional[str] = None  # "(b, k, P) = ... -> ..." when resuming on another split
        if self.resume_meta is not None:
            check_compatible(self.resume_meta, run, self.resume_path)
            self._split_change = split_change(self.resume_meta.get("fingerprint", {}), run_fingerprint(run))
        self.last_saved: Optional[Path] = self.resume_path
        self._saved_at: Optional[tuple[int, int, int]] = None

    # -- resume

    def restore(self) -> Optional[int]:
        """Load the checkpoint named by ``output.resume_from`` (if any) into the run and the history.

        Returns:
            The epoch whose evaluation is still due, or ``None``.
        """
        import torch

        if self.resume_path is None:
            return None
        meta = load_checkpoint(self.run, self.resume_path, self.resume_meta, fresh_streams=bool(self._split_change))
        self.history.restore(meta.get("history", []))
        carry_thresholds(self.run, self.history.records)
        if self._split_change:
            self._go_on_at_the_new_split(meta["fingerprint"])
        threads, saved_threads = torch.get_num_threads(), meta.get("cpu_threads")
        if (self.run.accelerator.device.type == "cpu" and saved_threads and saved_threads != threads
                and not self._split_change and self.run.accelerator.is_main_process):
            logger.warning("resuming with %d CPU threads per process, the checkpoint ran with %d: the rest of the "
                           "run is the same training but not bitwise the uninterrupted run (FINETUNE_CPU_THREADS=%d "
                           "restores that)", threads, saved_threads, saved_threads)
        self._warn_of_other_padding(meta)
        self._saved_at = self._position()
        state = self.run.state
        logger.info("resumed from %s: update %d, epoch %d, micro-batch %d", self.resume_path, state.step,
                    state.epoch, state.micro_batch)
        return meta.get("pending_eval_epoch")

    def _warn_of_other_padding(self, meta: dict[str, Any]) -> None:
        """Say so where this run pads its micro-batches otherwise than the checkpoint's run did (another
        release's fixed lengths, say): the same training, not bitwise."""
        from finetune.cuda_graphs import graphed_run

        change = padding_change(meta, padding_lengths(self.run), graphed_run(self.run))
        if change and not self._split_change and self.run.accelerator.is_main_process:
            logger.warning("resuming with micro-batches padded otherwise than the checkpoint's run padded them "
                           "(%s): the rest of the run is the same training to float rounding, but not bitwise the "
                           "uninterrupted run, and dropout draws other masks", change)

    def _go_on_at_the_new_split(self, saved: dict[str, Any]) -> None:
        """Move the epoch's position to the new ``k`` (the same windows trained), and say what changed."""
        state, run = self.run.state, self.run
        state.micro_batch = micro_batch_on_new_split(state.micro_batch, k_in_epoch(saved, state.epoch),
                                                     run.plan.k_at(state.epoch), len(run.train_dataloader))
        if run.accelerator.is_main_process:
            logger.warning("resuming on another split of the effective batch of %d: %s. The updates are the same "
                           "to float rounding, not bitwise the uninterrupted run's, and dropout draws other masks",
                           run.batching.effective_batch_size, self._split_change)

    # -- saving

    def _position(self) -> tuple[int, int, int]:
        s = self.run.state
        return (s.step, s.epoch, s.micro_batch)

    def save(self, reason: str, pending_eval_epoch: Optional[int] = None) -> Optional[Path]:
        """Save a checkpoint now (all processes), unless checkpoints are off."""
        if not self.enabled:
            return None
        self.last_saved = save_checkpoint(self.run, self.history.records, pending_eval_epoch, reason,
                                          protect=self.best())
        self._saved_at = self._position()
        return self.last_saved

    def save_unless_saved(self, reason: str, pending_eval_epoch: Optional[int] = None) -> None:
        """Save, unless a checkpoint of this very position exists already (a stop right after a save)."""
        if self._saved_at != self._position():
            self.save(reason, pending_eval_epoch)

    def best(self) -> Optional[Path]:
        """The best evaluation's checkpoint (``evaluation.metric_for_best_model``), or ``None``."""
        step = self.history.best_step
        return None if step is None else checkpoints_root(self.run.cfg.output.output_dir) / f"{CHECKPOINT_PREFIX}{step}"

    def load_best(self) -> None:
        """Load the best evaluation's weights into the run's model (``evaluation.load_best_model_at_end``)."""
        load_model_weights(self.run, self.best())

    def after_update(self, state, stopping: Optional[int] = None) -> None:
        """After every update: a checkpoint every ``output.checkpoint_every`` updates, or now when the run
        stops on signal ``stopping``. The last update of an epoch (or of the run) is left to ``fit``,
        which saves after the epoch's evaluation."""
        per_epoch = len(self.run.train_dataloader)
        if state.micro_batch >= per_epoch or state.step >= self.run.plan.total_updates:
            return
        if self._saved_at == self._position():
            return  # nothing new (a skipped update)
        if stopping is not None:
            self.save(f"{signal.Signals(stopping).name} after update {state.step}")
        elif self.every and state.step % self.every == 0 and (self._saved_at or (-1,))[0] != state.step:
            self.save(f"every {self.every} updates")

    def count_after(self, done: int, due) -> int:
        """How many checkpoints :func:`~finetune.fitting.fit` saves after update ``done``, unless early stopping
        ends the run: one at each epoch's end and at the last update, one after each evaluation inside an epoch
        under a selection (``due``, the run's :class:`~finetune.fitting.EvaluationSchedule`, says when), and one
        every ``output.checkpoint_every`` updates, a position saved once."""
        if not self.enabled:
            return 0
        selecting = self.history.selection is not None
        updates = self.run.plan.updates_after(done, len(self.run.train_dataloader))
        return sum(ends or (selecting and due.mid_epoch(step, micro_batch, k))
                   or bool(self.every and step % self.every == 0) for step, micro_batch, k, ends in updates)

    def kept_after(self, done: int, due) -> int:
        """The most checkpoints the run's folder holds at its end, of those :meth:`count_after` counts: at most
        ``output.keep_last``, save the last and, under a selection, the best, which pruning never deletes
        (:func:`~finetune.checkpoint_files.prune`)."""
        saved, limit = self.count_after(done, due), self.run.cfg.output.keep_last
        protected = 2 if self.history.selection is not None else 1
        return saved if limit is None else min(saved, max(limit, protected))

    def where(self) -> str:
        """Where the last checkpoint is, for the message of a stopped run."""
        if self.enabled and self.last_saved is not None:
            return f"checkpoint {self.last_saved}"
        return "no checkpoint saved (output.save_checkpoints is false)"

    def last_good(self) -> str:
        """Where the last checkpoint is, for a message (the non-finite stop)."""
        if self.last_saved is None:
            return "no checkpoint saved yet"
        return (f"last good checkpoint: {self.last_saved}. Resuming it with the same settings replays the same "
                f"updates; to go on with others (a lower optim.learning_rate, say), start a run from its weights: "
                f"model.name_or_path={self.last_saved} output.output_dir=<a new folder>")


def carry_thresholds(run: "Run", records: list[dict[str, Any]]) -> None:
    """A resumed model's config takes the thresholds its last evaluation chose (``evaluation.threshold:
    per_label``), as it held them before the stop: a checkpoint saved before the next evaluation saves them."""
    chosen = [record[EVAL_THRESHOLDS] for record in records if EVAL_THRESHOLDS in record]
    if chosen:
        set_model_thresholds(run.accelerator.unwrap_model(run.model).config, list(chosen[-1]), chosen[-1].values())
