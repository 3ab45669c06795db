"""A built run: what :func:`finetune.assembly.setup_run` makes, and how a loop trains it as ``fit`` does.

:class:`Run` holds the prepared objects and the decisions made building them. A loop of one's own (a
notebook's) trains what ``finetune train`` trains, as fast, with three of its methods::

    with run.speedups():                  # the CPU speed-ups, or the CUDA graphs on one GPU
        for epoch in run.epochs():        # each epoch at its k, until the plan's updates are made
            train_one_epoch(run.model, run.optimizer, run.scheduler, run.train_dataloader,
                            run.accelerator, epoch, state=run.state, **run.loop_settings())
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from finetune.accumulation import Batching, accumulate_as
from finetune.autobatch import Checkpointing
from finetune.cpu import cpu_speedups, speedup_settings
from finetune.cuda_graphs import graphs_for_run
from finetune.loop import TrainState
from finetune.tasks import Task

if TYPE_CHECKING:
    from finetune.config import Config
    from finetune.optimization import UpdatePlan


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
    # the weights made new for the data's labels (the classification head), empty when the model had its head
    new_head: tuple[str, ...] = ()
    # regression: the value a new head's output starts at (model.regression_head_bias: mean), else None
    head_start: Optional[float] = None
    # training.gradient_checkpointing as decided (autobatch: with the micro-batch under auto)
    checkpointing: Checkpointing = field(default_factory=Checkpointing)
    # model.lora_rank: a finetune.lora.LoraPlan, what the adapters are and train (None: every weight is trained)
    lora: Optional[Any] = None
    # model.freeze_embeddings / freeze_blocks: a finetune.freezing.Frozen (None: nothing frozen)
    frozen: Optional[Any] = None
    # the expected peak memory by part, measured before training (finetune.memory; None under FSDP, DeepSpeed)
    memory: Optional[Any] = None  # a finetune.memory.MemoryPlan
    # how many training texts data.max_length cut, and to what (a finetune.truncation.LongTexts)
    long_texts: Optional[Any] = None
    # how much of the training texts the tokenizer reads as its unknown token (a
    # finetune.unknown_words.UnknownWords; None for a tokenizer without one)
    unknown_words: Optional[Any] = None
    # validation rows whose text a training row has too (finetune.dataloaders.count_seen_in_training)
    seen_in_training: int = 0
    # training.cuda_graphs where it applies: a finetune.cuda_graphs.GraphedMicroBatches, made by speedups() (which
    # fit enters) before the first update; None: eager steps
    graphs: Optional[Any] = None
    # data.test_file / data.test_split_name: a finetune.test_set.TestSet, scored once by the saved model after
    # training (None: no test set)
    test: Optional[Any] = None
    # data.padding as resolved for the model: a finetune.truncation.Padding (None: each batch to its longest text)
    padding: Optional[Any] = None

    def loop_settings(self, **changes: Any) -> dict[str, Any]:
        """The keyword arguments of :func:`~finetune.loop.train_one_epoch` that the config and the build set,
        as ``fit`` passes them: the task's loss (with ``training.class_weights`` and ``label_smoothing``),
        ``max_grad_norm``, the update plan, the non-finite policy, the weight casts, the CUDA graphs and whether
        to measure the gradient noise scale (``logging.noise_scale``).

        A loop of one's own that passes them trains what ``finetune train`` trains; one that leaves out
        ``loss_fn`` trains on the problem type's plain loss, whatever the config weighs. ``changes`` replace
        any of them (``run.loop_settings(loss_fn=focal_loss)``). A replayed micro-batch computes the loss its
        graphs were captured with, so where :meth:`speedups` built graphs, another ``loss_fn`` has them built
        again for it (once: they are kept for the calls after), and ``loss_fn=None``, the plain loss, runs
        eagerly.

        Raises:
            TypeError: for a change that is none of these settings.
        """
        training = self.cfg.training
        settings = {"max_grad_norm": training.max_grad_norm, "plan": self.plan, "loss_fn": self.task.per_sample_loss,
                    "on_nonfinite": training.on_nonfinite, "max_skipped": training.max_skipped,
                    "cast_once_per_update": training.cast_once_per_update, "graphs": self.graphs,
                    "noise_scale": self.cfg.logging.noise_scale}
        unknown = sorted(set(changes) - set(settings))
        if unknown:
            raise TypeError(f"loop_settings: {unknown[0]!r} is not one of them ({', '.join(settings)}); "
                            f"pass it to train_one_epoch itself")
        loss_fn = changes.get("loss_fn", settings["loss_fn"])
        if self.graphs is not None and "graphs" not in changes and self.graphs.loss_fn != loss_fn:
            if loss_fn is None:  # the model's plain loss, which no graph holds
                settings["graphs"] = None
            else:  # a loss of one's own, captured in graphs of its own, kept for the calls after
                self.graphs = settings["graphs"] = graphs_for_run(self, loss_fn)
        return {**settings, **changes}

    def speedups(self) -> contextlib.AbstractContextManager:
        """What ``fit`` trains under, for a loop of one's own to train as fast: enter it around the epochs.

        On a CPU, the speed-ups of :func:`finetune.cpu.cpu_speedups` with the config's settings (and the heap
        the memory plan chose), handed back on exit; on one GPU, the CUDA graphs of ``training.cuda_graphs``
        (:func:`finetune.cuda_graphs.graphs_for_run`), kept in ``graphs`` for :meth:`loop_settings` to pass.
        """
        self.graphs = graphs_for_run(self)
        return cpu_speedups(self.model, self.optimizer, self.accelerator,
                            **speedup_settings(self.cfg.training, self.memory))

    def epochs(self) -> Iterator[int]:
        """The epochs left to train, as ``fit`` trains them: from the state's (a resumed run's part-way one) to
        the plan's last, each with its ``k`` set on the accelerator (``training.accumulation_schedule``), and
        none once the plan's updates are made (``training.max_steps``)."""
        for epoch in range(self.state.epoch, self.plan.num_epochs):
            if self.state.step >= self.plan.total_updates:
                return
            accumulate_as(self.accelerator, self.batching, epoch)
            yield epoch
