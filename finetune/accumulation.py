"""The arithmetic of exact gradient accumulation, in one place.

Names: ``b`` samples per micro-batch and process, ``k`` micro-batches per
update (accumulation steps), ``P`` processes, effective batch ``B = b*k*P``.
An *update* consumes one *window*: ``k`` consecutive micro-batches on every
process; an epoch's last window may hold fewer, and its last micro-batch fewer
samples. ``docs/accumulation.md`` states the contract this module serves.

* :func:`resolve_batching` derives ``k`` from ``B`` (or checks the two agree).
* :class:`ShardLayout` knows which samples each micro-batch and each window
  really holds once Accelerate has dealt the epoch out to the processes.
* :func:`window_loss_scale` is the factor that makes a window's gradient the
  mean over its real samples, whatever ``k``, ``P`` and the window's size.
* :func:`updates_per_epoch` counts the updates an epoch makes, which is what
  the learning-rate schedule is sized in.
* :class:`AccumulationSchedule` lets ``k`` change from one epoch to the next
  (``training.accumulation_schedule``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, TypeVar

from finetune.config import TrainingConfig
from finetune.errors import ConfigError


T = TypeVar("T")


def value_at_epoch(changes: Mapping[int, T], epoch: int) -> T:
    """The value of a ``{first epoch: value}`` step function at ``epoch`` (the last key ``<= epoch``)."""
    keys = [e for e in changes if e <= epoch]
    return changes[max(keys)] if keys else changes[min(changes)]


@dataclass(frozen=True)
class AccumulationSchedule:
    """``k`` epoch by epoch, as a step function ``{first epoch: k}``.

    Each ``k`` holds from its epoch until the next key, as in Lightning's
    ``accumulate_grad_batches={0: 8, 4: 2}``. ``b`` and ``P`` stay fixed, so
    the effective batch of epoch ``e`` is ``b * k_e * P``.
    """

    changes: tuple[tuple[int, int], ...]

    @classmethod
    def constant(cls, k: int) -> "AccumulationSchedule":
        return cls(((0, k),))

    @classmethod
    def from_dict(cls, changes: Mapping[int, int]) -> "AccumulationSchedule":
        """From ``{first epoch: k}``; it must say what epoch 0 uses."""
        if 0 not in changes:
            raise ValueError("an accumulation schedule needs a k for epoch 0")
        return cls(tuple(sorted((int(e), int(k)) for e, k in changes.items())))

    def k_at(self, epoch: int) -> int:
        """``k`` of epoch ``epoch`` (counted from 0)."""
        return value_at_epoch(dict(self.changes), epoch)

    @property
    def is_constant(self) -> bool:
        return len({k for _, k in self.changes}) == 1

    def __str__(self) -> str:
        return "{" + ", ".join(f"{e}: {k}" for e, k in self.changes) + "}"


@dataclass(frozen=True)
class Batching:
    """The run's batching, decided once at setup: ``b``, ``P`` and ``k`` epoch by epoch.

    Everything that needs ``k`` (the sampler's windows, the update plan, the
    loop's accelerator, checkpoints, the model card) reads it from here.
    ``B = b * k * P`` is the effective batch.

    Args:
        per_device_batch_size: ``b``, samples per micro-batch and process.
        gradient_accumulation_steps: ``k`` of epoch 0.
        num_processes: ``P``.
        schedule: ``k`` by epoch (``training.accumulation_schedule``); default: this ``k`` throughout.
    """

    per_device_batch_size: int
    gradient_accumulation_steps: int
    num_processes: int
    schedule: Optional[AccumulationSchedule] = None

    def __post_init__(self) -> None:
        if self.schedule is None:
            object.__setattr__(self, "schedule", AccumulationSchedule.constant(self.gradient_accumulation_steps))
        elif self.schedule.k_at(0) != self.gradient_accumulation_steps:
            raise ValueError(f"the schedule's epoch 0 accumulates {self.schedule.k_at(0)}, not "
                             f"{self.gradient_accumulation_steps}")

    @property
    def effective_batch_size(self) -> int:
        """``B`` of epoch 0."""
        return self.effective_batch_size_at(0)

    def k_at(self, epoch: int) -> int:
        """``k`` of ``epoch`` (counted from 0)."""
        return self.schedule.k_at(epoch)

    def effective_batch_size_at(self, epoch: int) -> int:
        return self.per_device_batch_size * self.k_at(epoch) * self.num_processes

    def window_sizes(self) -> dict[int, int]:
        """Samples per window, ``{first epoch: b * k * P}``, as the sampler groups them."""
        return {epoch: self.effective_batch_size_at(epoch) for epoch, _ in self.schedule.changes}

    def with_micro_batch(self, b: int, k: int) -> "Batching":
        """The same effective batch cut into ``k`` micro-batches of ``b`` (the automatic micro-batch)."""
        if b * k != self.per_device_batch_size * self.gradient_accumulation_steps or not self.schedule.is_constant:
            raise ValueError(f"b={b}, k={k} does not keep the effective batch {self.effective_batch_size}")
        return Batching(b, k, self.num_processes)

    def describe_k(self) -> str:
        """``k``, or under a schedule the ``k`` of each of its epochs: ``4 (by epoch {0: 4, 2: 2})``."""
        k = str(self.gradient_accumulation_steps)
        return k if self.schedule.is_constant else f"{k} (by epoch {self.schedule})"


def resolve_accumulation(training: TrainingConfig, k: int) -> AccumulationSchedule:
    """The run's ``k`` per epoch: ``training.accumulation_schedule`` over epoch 0's ``k``.

    Epochs before the schedule's first key use ``k`` (from
    ``gradient_accumulation_steps`` or ``effective_batch_size``, else 1).

    Raises:
        ConfigError: if the schedule sets epoch 0 to another ``k`` than the one
            ``gradient_accumulation_steps`` or ``effective_batch_size`` gives.
    """
    schedule = training.accumulation_schedule
    if not schedule:
        return AccumulationSchedule.constant(k)
    given = training.gradient_accumulation_steps is not None or training.effective_batch_size is not None
    if 0 in schedule and given and schedule[0] != k:
        source = ("gradient_accumulation_steps" if training.gradient_accumulation_steps is not None
                  else f"effective_batch_size {training.effective_batch_size}")
        raise ConfigError(
            f"training.accumulation_schedule: epoch 0 accumulates {schedule[0]}, but training.{source} "
            f"gives k={k}; set epoch 0's k in one place"
        )
    return AccumulationSchedule.from_dict({0: k, **schedule})


def resolve_batching(training: TrainingConfig, num_processes: int) -> Batching:
    """The run's :class:`Batching` for ``P`` processes: ``k`` derived from ``effective_batch_size`` (or taken
    as given), and ``training.accumulation_schedule`` over it.

    With ``per_device_train_batch_size: auto`` ``b`` is the first micro-batch to
    try (the largest power of two dividing ``B / P``); the run's setup may
    halve it (doubling ``k``) if it does not fit, see :mod:`finetune.autobatch`.

    Raises:
        ConfigError: if ``B`` is not divisible by ``b * P``, both keys are
            given and disagree, or the schedule contradicts them.
    """
    b, k = _micro_batch_and_k(training, num_processes)
    return Batching(b, k, num_processes, resolve_accumulation(training, k))


def _micro_batch_and_k(training: TrainingConfig, num_processes: int) -> tuple[int, int]:
    b = training.per_device_train_batch_size
    k = training.gradient_accumulation_steps
    B = training.effective_batch_size
    if b == "auto":
        from finetune.autobatch import initial_micro_batch

        b = initial_micro_batch(B, num_processes)
        return b, B // (b * num_processes)
    if B is None:
        schedule = training.accumulation_schedule or {}
        return b, k or schedule.get(0, 1)
    if B % (b * num_processes) != 0:
        step = b * num_processes
        nearest = sorted({max(step, B // step * step), (B // step + 1) * step})
        raise ConfigError(
            f"training.effective_batch_size: {B} samples per update cannot be split over {num_processes} "
            f"process{'es' if num_processes > 1 else ''} with per_device_train_batch_size {b} "
            f"(it must be a multiple of {b} x {num_processes} = {step})",
            hint=f"set training.effective_batch_size to a multiple of {step} ({' or '.join(map(str, nearest))} "
            f"are nearest), or change per_device_train_batch_size or the number of processes",
        )
    derived = B // (b * num_processes)
    if k is not None and k != derived:
        raise ConfigError(
            f"training.gradient_accumulation_steps: {k} contradicts effective_batch_size {B} = "
            f"{b} x {num_processes} processes x {derived}; set only one of them"
        )
    return b, derived


def accumulate_as(accelerator, batching: Batching, epoch: int) -> None:
    """Tell Accelerate the ``k`` of ``epoch``: ``accumulate()`` syncs and ``backward`` divides by it.

    The one place a run writes ``k`` into the ``Accelerator``, before each epoch.
    """
    accelerator.gradient_accumulation_steps = batching.k_at(epoch)


def updates_per_epoch(micro_batches_per_process: int, k: int) -> int:
    """Optimizer updates in one epoch: ``ceil(micro-batches per process / k)``, the ragged window included."""
    return math.ceil(micro_batches_per_process / k)


class _Windows:
    """Windows of ``k`` micro-batches over an epoch; a subclass says ``micro_batches_per_process``."""

    def windows(self, k: int) -> list[tuple[int, int]]:
        """``(first, stop)`` micro-batch ranges of the epoch's windows; the last may be short."""
        m = self.micro_batches_per_process
        return [(s, min(s + k, m)) for s in range(0, m, k)]

    def window_of(self, j: int, k: int) -> tuple[int, int]:
        """The ``(first, stop)`` range of the window holding micro-batch ``j``."""
        first = (j // k) * k
        return first, min(first + k, self.micro_batches_per_process)

    def updates_per_epoch(self, k: int) -> int:
        """Optimizer updates in one epoch (see :func:`updates_per_epoch`)."""
        return updates_per_epoch(self.micro_batches_per_process, k)


@dataclass(frozen=True)
class ShardLayout(_Windows):
    """Where the real samples are in one epoch of a prepared dataloader.

    Accelerate deals the sampler's order out in batches of ``b``: global batch
    ``g`` goes to process ``g % P``, and the last short batch and any missing
    batches are filled with repeats of the epoch's first samples, appended
    after the real rows. The real samples are therefore the stream's first
    ``N`` positions. From ``(N, b, P)`` alone this tells how many real samples
    each micro-batch and each window holds, with no look-ahead and no
    communication. PyTorch and Accelerate expose no such count, hence this
    hand-written arithmetic; :func:`layout_for` checks it against the prepared
    dataloader's length.

    Args:
        num_samples: ``N``, samples in the data set.
        batch_size: ``b``, micro-batch size per process.
        num_processes: ``P``.
        process_index: This process's rank.
    """

    num_samples: int
    batch_size: int
    num_processes: int = 1
    process_index: int = 0

    @property
    def micro_batches_per_process(self) -> int:
        """Micro-batches each process sees in one epoch."""
        global_batches = math.ceil(self.num_samples / self.batch_size)
        return math.ceil(global_batches / self.num_processes)

    def _real_before(self, position: int) -> int:
        return min(self.num_samples, max(0, position))

    def real_in_micro_batch(self, j: int, process_index: Optional[int] = None) -> int:
        """Real samples in this process's micro-batch ``j`` (its first rows)."""
        p = self.process_index if process_index is None else process_index
        start = (j * self.num_processes + p) * self.batch_size
        return self._real_before(start + self.batch_size) - self._real_before(start)

    def real_in_window(self, first: int, stop: int) -> int:
        """Real samples, over all processes, in micro-batches ``first .. stop-1``."""
        per_step = self.num_processes * self.batch_size
        return self._real_before(stop * per_step) - self._real_before(first * per_step)


@dataclass(frozen=True)
class SizedLayout(_Windows):
    """One process's epoch of micro-batches of known, varying sizes (:class:`~finetune.sampling.BalancedBatches`).

    Every sample is real (one process: nothing is repeated to even out
    processes), so a micro-batch's real samples are its size.

    Args:
        sizes: Samples in each micro-batch of the epoch.
        batch_size: ``b`` of the equal cut, which sets the effective batch ``b * k``.
    """

    sizes: tuple[int, ...]
    batch_size: int
    num_processes: int = 1

    @property
    def micro_batches_per_process(self) -> int:
        return len(self.sizes)

    def real_in_micro_batch(self, j: int) -> int:
        return self.sizes[j]

    def real_in_window(self, first: int, stop: int) -> int:
        return sum(self.sizes[first:stop])


def layout_for(dataloader, accelerator) -> "ShardLayout | SizedLayout":
    """The layout of a dataloader prepared by ``accelerator`` (or a plain one), for its current epoch.

    Raises:
        ValueError: if the dataloader is not dealt out as the layout assumes
            (``split_batches``, ``drop_last``, a batch sampler of varying sizes
            that does not say them, or one that does on several processes).
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if callable(getattr(batch_sampler, "sizes", None)):
        if accelerator.num_processes != 1:
            raise ValueError("micro-batches of varying sizes (BalancedBatches) work on one process only")
        return SizedLayout(tuple(batch_sampler.sizes()), batch_sampler.batch_size)
    num_processes = accelerator.num_processes
    total = getattr(dataloader, "total_batch_size", None)
    batch_size = total // num_processes if total else dataloader.batch_size
    if batch_size is None:
        raise ValueError("train_one_epoch needs a dataloader with a fixed batch_size")
    layout = ShardLayout(len(dataloader.dataset), batch_size, num_processes, accelerator.process_index)
    if len(dataloader) != layout.micro_batches_per_process:
        raise ValueError(
            f"dataloader has {len(dataloader)} micro-batches per process, expected "
            f"{layout.micro_batches_per_process} for {layout.num_samples} samples, b={batch_size}, "
            f"P={num_processes}: use drop_last=False and no split_batches"
        )
    return layout


def window_loss_scale(real_samples_in_window: int, accelerator) -> float:
    """Factor applied to a micro-batch's *summed* loss before ``accelerator.backward``.

    The update must apply ``(1 / N_w) * sum of per-sample gradients`` over the
    window's ``N_w`` real samples on all processes. ``accelerator.backward``
    divides by ``k``, and DDP (FSDP, DeepSpeed) average gradients over the
    ``P`` processes; both are undone here: ``scale = k * P / N_w``. Dividing
    each micro-batch's *mean* loss by ``k`` instead would be exact only for a
    full window of equal micro-batches.

    Args:
        real_samples_in_window: ``N_w`` (see :meth:`ShardLayout.real_in_window`).
        accelerator: The run's ``Accelerator``.
    """
    return accelerator.gradient_accumulation_steps * accelerator.num_processes / real_samples_in_window
