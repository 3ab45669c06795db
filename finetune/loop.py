"""The training loop: one epoch of exact gradient accumulation.

:func:`train_one_epoch` is what ``fit`` runs and what a notebook imports. Its
body is the algorithm; each step is a named piece further down this file::

    for each micro-batch j of the epoch:
        at a window's first micro-batch: count the window's real samples N_w,
            keep autocast's weight copies until the update           WeightCasts
        inside accelerator.accumulate(model):
            loss = summed loss of the micro-batch's real samples     micro_batch_loss
            backward(loss * k * P / N_w)                             window_loss_scale
            (or both replayed from a CUDA graph)                     GraphedMicroBatches
        add loss, samples and tokens to the window's totals          WindowStats
        at the window's last micro-batch (Accelerate syncs there):
            drop the weight copies                                   WeightCasts
            clip the window's gradient                               clip_gradients
            reduce the totals over processes, and read them and
                the gradient's norm on the host: one wait            WindowStats.read
            step optimizer and scheduler, or skip                    apply_update
            count, log, and maybe stop                               LogWindow, should_stop

The arithmetic (which samples are real, the window's scale, the updates per
epoch) lives in :mod:`finetune.accumulation`; ``docs/accumulation.md`` states
the contract the loop keeps.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from finetune.accumulation import layout_for, window_loss_scale
from finetune.chunks import document_logits, split_batch, tokens_per_text
from finetune.errors import NonFiniteLossError
from finetune.noise_scale import (TERMS, add_estimate, noise_scale_of, noise_scale_said, noise_unmeasured,
                                  small_batch_terms, squared_gradient_norm, window_estimates)
from finetune.tasks import LossFn, Task
from finetune.weight_casts import WeightCasts, casts_once_per_update

if TYPE_CHECKING:
    from finetune.cuda_graphs import GraphedMicroBatches
    from finetune.optimization import UpdatePlan

logger = logging.getLogger("finetune")


@dataclass
class TrainState:
    """Counters that span epochs; saved in checkpoints so a resumed run continues them."""

    epoch: int = 0
    # updates made so far (optimizer steps that happened)
    step: int = 0
    # micro-batches of the current epoch already consumed (a window boundary)
    micro_batch: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    skipped_updates: int = 0
    skipped_in_row: int = 0
    # seconds spent training so far (windows only: no evaluation, checkpoints or start-up), over resumes too
    train_seconds: float = 0.0
    # summed per-sample loss and samples of the updates made (skipped windows excluded): the run's mean loss
    loss_sum: float = 0.0
    loss_samples: int = 0
    # the gradient noise scale's moving averages of |G|^2 and tr(S), and their weight (finetune.noise_scale)
    noise_gradient: float = 0.0
    noise_trace: float = 0.0
    noise_weight: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def noise_scale(self) -> Optional[float]:
        """The gradient noise scale measured so far, in samples (``train_one_epoch(noise_scale=True)``), or None."""
        return noise_scale_of(self)

    def noise_scale_said(self, effective_batch: int) -> str:
        """The gradient noise scale measured so far beside ``effective_batch``, in words."""
        return noise_scale_said(self, effective_batch)

    def count_window(self, totals: torch.Tensor, stop: int, applied: bool, seconds: float) -> None:
        """A window ending at micro-batch ``stop`` is done; ``totals`` are its reduced loss, samples, tokens."""
        self.samples_seen += int(totals[1])
        self.tokens_seen += int(totals[2])
        self.train_seconds += seconds
        self.micro_batch = stop
        if applied:
            self.step += 1
            self.skipped_in_row = 0
            self.loss_sum += float(totals[0])
            self.loss_samples += int(totals[1])


@dataclass
class EpochResult:
    """What one call of :func:`train_one_epoch` did."""

    epoch: int
    # optimizer updates made in this call
    updates: int = 0
    # windows dropped because their loss was not finite (``on_nonfinite='skip'``)
    skipped: int = 0
    # mean per-sample training loss over the call's real samples (all processes), skipped windows excluded
    loss: float = float("nan")
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    # True when the call ended before the end of the epoch (max_updates or a callback)
    stopped_early: bool = False
    # with noise_scale: why this epoch could not measure it, or None where it did
    noise_unmeasured: Optional[str] = None
    records: list[dict[str, Any]] = field(default_factory=list)
    _loss_sum: float = field(default=0.0, repr=False)
    _loss_samples: float = field(default=0.0, repr=False)

    def count_window(self, totals: torch.Tensor, applied: bool) -> None:
        self.samples += int(totals[1])
        self.tokens += int(totals[2])
        if applied:
            self.updates += 1
            self._loss_sum += float(totals[0])
            self._loss_samples += float(totals[1])
            self.loss = self._loss_sum / self._loss_samples


def train_one_epoch(
    model: torch.nn.Module,
    optimizer,
    scheduler,
    dataloader,
    accelerator,
    epoch: int,
    *,
    state: Optional[TrainState] = None,
    max_grad_norm: Optional[float] = None,
    log_every: int = 1,
    on_log: Optional[Callable[[dict[str, Any]], None]] = None,
    on_update: Optional[Callable[[TrainState], bool]] = None,
    max_updates: Optional[int] = None,
    on_nonfinite: str = "stop",
    max_skipped: int = 10,
    progress=None,
    loss_fn: Optional[LossFn] = None,
    plan: Optional["UpdatePlan"] = None,
    cast_once_per_update: bool = False,
    graphs: Optional["GraphedMicroBatches"] = None,
    noise_scale: bool = False,
) -> EpochResult:
    """Train one epoch with exact gradient accumulation.

    Call it with objects already passed through ``accelerator.prepare`` (the
    scheduler excepted: pass it unprepared, this function steps it once per
    update). The accumulation steps ``k`` are ``accelerator.gradient_accumulation_steps``;
    under an accumulation schedule set it to ``plan.k_at(epoch)`` before each call
    (and pass ``plan``, which checks it; ``for epoch in run.epochs()`` sets it).
    Each update applies the mean gradient over its window's real samples on
    all processes, so ``(b, k, P)`` trains the same weights as ``(b*k*P, 1, 1)``,
    the epoch's ragged last window included. Wrap the epochs in ``run.speedups()``
    (:meth:`finetune.run.Run.speedups`) for the speed ``fit`` gets.

    Args:
        model: The prepared model; its ``forward`` must return ``.logits``.
            The batch's ``labels`` are popped before the call, and the loss is
            computed here with ``loss_fn``.
        optimizer: The prepared optimizer.
        scheduler: A learning-rate scheduler sized in updates (or ``None``);
            see :func:`finetune.optimization.plan_updates`.
        dataloader: The prepared training dataloader. Its sampler's
            ``set_epoch`` is called with ``epoch``.
        accelerator: The ``Accelerator``.
        epoch: Epoch number (from 0), for the sampler and the records.
        state: Counters carried across epochs and checkpoints; updated in
            place. ``state.micro_batch > 0`` resumes mid-epoch after that many
            micro-batches (must be a window boundary). Pass the same one to
            every epoch: without it, the records count updates from 1 (and
            warn of it after epoch 0).
        max_grad_norm: Clip the accumulated gradient's norm to this (``None``
            or 0: measure the norm without clipping).
        log_every: Write a record every this many windows of the epoch (and at its
            end), averaged over the updates since the last record.
        on_log: Called with each record (a flat dict) on every process; the
            caller decides who writes it.
        on_update: Called after every update with ``state``; returning True
            ends the epoch there (a window boundary), e.g. to checkpoint and stop.
        max_updates: Stop once ``state.step`` reaches this (default: ``plan.total_updates``
            when ``plan`` is given, else no limit). A call with ``state.step`` there
            already trains nothing, and warns.
        on_nonfinite: ``"stop"`` raises :class:`NonFiniteLossError`;
            ``"skip"`` drops that update (no optimizer or scheduler step).
        max_skipped: With ``"skip"``, raise after this many skipped updates in a row.
        progress: Optional tqdm bar, advanced by one per update.
        loss_fn: ``loss_fn(logits, labels) -> per-sample losses`` (a 1-D tensor,
            one value per row, not reduced). ``None``: the loss of the model's
            ``config.problem_type`` (cross-entropy, per-label binary
            cross-entropy, or squared error; see :mod:`finetune.tasks`), without
            the config's class weights or label smoothing: ``**run.loop_settings()``
            passes the run's. With ``graphs``, theirs (what a replayed micro-batch
            computes); another is refused. The update is the mean of these values
            over the window's real samples.
        plan: The :class:`~finetune.optimization.UpdatePlan` the scheduler was
            sized with: the epoch is refused before any update when the
            accelerator's ``k`` is not the one the plan counted for it.
        cast_once_per_update: Under bf16/fp16 autocast, make the low-precision
            copies of the weights once per window instead of once per
            micro-batch (bitwise the same update; see :mod:`finetune.weight_casts`).
            Off by default: fewer kernels, but no faster where measured.
        graphs: Replay each micro-batch's forward and backward from CUDA
            graphs (:class:`~finetune.cuda_graphs.GraphedMicroBatches`, built
            once per run); a micro-batch it does not take runs eagerly.
        noise_scale: Measure the gradient noise scale (:mod:`finetune.noise_scale`)
            into ``state``, logged as ``train/noise_scale``: the norm of each
            window's first micro-batch's gradient beside the window's. It reads
            the gradients and changes nothing; measured where ``k > 1`` and the
            gradients are whole and unscaled (``EpochResult.noise_unmeasured``
            says why not elsewhere).

    Returns:
        An :class:`EpochResult`.

    Raises:
        NonFiniteLossError: on a NaN/inf loss under the ``stop`` policy, or too
            many skips in a row.
        ValueError: if ``k`` is not the one ``plan`` counted for this epoch, or ``loss_fn``
            is not the loss ``graphs`` were captured with.
    """
    state = state if state is not None else state_of_a_first_call(epoch)
    k = accelerator.gradient_accumulation_steps
    if plan is not None:
        plan.check_accumulation(k, epoch)
        max_updates = plan.total_updates if max_updates is None else max_updates
    if max_updates is not None and state.step >= max_updates:
        return nothing_left_to_train(epoch, state.step)
    loss_fn = loss_of(model, accelerator, loss_fn, graphs)
    state.epoch = epoch
    batches = epoch_batches(dataloader, accelerator, epoch, state.micro_batch, k)
    layout = layout_for(dataloader, accelerator)  # after the epoch is set: micro-batch sizes may depend on it
    window = WindowStats(accelerator.device)
    logs = LogWindow(k, effective_batch=layout.batch_size * k * layout.num_processes)
    result = EpochResult(epoch=epoch)
    if noise_scale:
        result.noise_unmeasured = noise_unmeasured(accelerator, k, graphs)
    noise = noise_scale and result.noise_unmeasured is None
    model.train()
    t0 = time.perf_counter()

    # a graph casts inside its own autocast region, with the cache off
    with WeightCasts(casts_once_per_update(accelerator, model, cast_once_per_update and graphs is None)) as casts:
        for j, batch in enumerate(batches, start=state.micro_batch):
            first, stop = layout.window_of(j, k)
            if j == first:
                window.start(first, stop, real_samples=layout.real_in_window(first, stop))
                casts.keep()  # the window's micro-batches share one cast of each weight
            real = layout.real_in_micro_batch(j)
            with accelerator.accumulate(model):  # no_sync for all but the window's last micro-batch
                check_sync_agrees(accelerator, j, stop)
                scale = window_loss_scale(window.real_samples, accelerator)
                if graphs is not None and graphs.takes(batch):
                    # accelerator.backward divides by k; the replayed backward is told the same scale
                    loss_sum, tokens = graphs.forward_backward(batch, real, scale / k)
                else:
                    loss_sum, tokens = micro_batch_loss(model, batch, real, loss_fn)
                    accelerator.backward(loss_sum * scale)
            window.add(j, loss_sum.detach(), real, tokens)
            if noise and j == first < stop - 1:  # the window's first micro-batch's gradient, alone in the model
                window.keep_first_gradient(model, real, layout.num_processes)
            if j < stop - 1:
                continue

            casts.drop()  # before the weights change
            grad_norm = clip_gradients(model, accelerator, max_grad_norm)
            totals, norm, small = window.read(accelerator, grad_norm)  # one collective, one wait per update
            update = apply_update(optimizer, scheduler, accelerator, totals, norm)
            if noise and update.applied and small[-1] == layout.num_processes:  # every process's first measured
                add_estimate(state, *window_estimates(small, norm ** 2, window.real_samples))
            optimizer.zero_grad(set_to_none=frees_gradients(model, graphs))
            if update.applied:
                logs.add(totals, update)
            else:
                skip_nonfinite(update, window.where(update, accelerator.process_index), state, result,
                               on_nonfinite, max_skipped, warn=accelerator.is_main_process)
            state.count_window(totals, stop, update.applied, seconds=window.seconds())
            result.count_window(totals, update.applied)
            at_end = stop == layout.micro_batches_per_process
            if logs.due(stop, k, log_every, last=at_end or state.step == max_updates):
                record = logs.record(state, epoch + stop / layout.micro_batches_per_process, noise)
                report(record, result, on_log, progress)
            if progress is not None:
                progress.update(1)
            if should_stop(state, on_update, max_updates) and not at_end:
                result.stopped_early = True
                break
            window.restart_clock()  # the next window's time includes fetching its first micro-batch

    if state.micro_batch >= layout.micro_batches_per_process:
        state.micro_batch, state.epoch = 0, epoch + 1  # the next call starts the next epoch
    result.seconds = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------- the steps, in loop order


def state_of_a_first_call(epoch: int) -> TrainState:
    """The counters of a call without ``state``: fresh, so its records count updates from 1. After the first
    epoch that is not what a loop over epochs wants, and a warning says so (once per calling line)."""
    if epoch > 0:
        warnings.warn(f"train_one_epoch: epoch {epoch} without state=, so its records count updates (and "
                      f"samples) from 1 again; pass one TrainState() to every epoch to count across them",
                      stacklevel=3)
    return TrainState(epoch=epoch)


def loss_of(model, accelerator, loss_fn: Optional[LossFn], graphs: Optional["GraphedMicroBatches"]) -> LossFn:
    """The loss an epoch trains on: ``loss_fn``, else the graphs' (a micro-batch they do not take runs eagerly on
    the loss the others replay), else the model's problem type's plain loss.

    Raises:
        ValueError: for a ``loss_fn`` that is not the one ``graphs`` replay.
    """
    if graphs is not None:
        if loss_fn is not None and loss_fn != graphs.loss_fn:
            raise ValueError("train_one_epoch: loss_fn is not the loss the graphs were captured with, which every "
                             "replayed micro-batch computes; capture them with it (graphs_for_run(run, loss_fn=...), "
                             "which run.loop_settings(loss_fn=...) calls) or pass graphs=None")
        return graphs.loss_fn
    return loss_fn or Task.of_model(accelerator.unwrap_model(model)).per_sample_loss


def nothing_left_to_train(epoch: int, step: int) -> EpochResult:
    """A call after the last update (a notebook's training cell run again): no update, and a warning, where one
    more would step the schedule past its end (a cosine's rate rises again there)."""
    warnings.warn(f"train_one_epoch: epoch {epoch}: the {step} updates planned are done (state.step), so nothing "
                  f"was trained; setup_run builds the run again to train it again", stacklevel=3)
    return EpochResult(epoch=epoch)


def epoch_batches(dataloader, accelerator, epoch: int, start: int, k: int):
    """The epoch's micro-batches from micro-batch ``start`` on, in the epoch's order.

    Raises:
        ValueError: if ``start`` is not a window boundary (a resume must not split a window).
    """
    micro_batches = len(dataloader)
    if start % k != 0 and start != micro_batches:
        raise ValueError(f"cannot resume at micro-batch {start}: not a window boundary (k={k})")
    set_epoch(dataloader, epoch)
    count_micro_batches_from(accelerator, start)
    if start == 0:
        return dataloader
    skipping = accelerator.skip_first_batches(dataloader, start)
    # Before Accelerate 1.15 the skipping loader starts at iteration 0, which its first iteration hands the
    # sampler as the epoch: a resume in any epoch but the first would take the first epoch's order
    set_epoch(skipping, epoch)
    return skipping


def count_micro_batches_from(accelerator, start: int) -> None:
    """Accelerate ends a window by counting the epoch's micro-batches (``Accelerator.step``, reset at the
    dataloader's end), and ``load_state`` restores the count a checkpoint's run had reached at its own ``k``:
    resumed on another split, that count would end the new windows at the wrong micro-batch. The epoch's count
    starts where the epoch does. Where Accelerate keeps no such count, :func:`check_sync_agrees` still guards."""
    if hasattr(accelerator, "step"):
        accelerator.step = start


def set_epoch(dataloader, epoch: int) -> None:
    """Give ``dataloader``'s sampler the epoch, which sets its order."""
    if hasattr(dataloader, "set_epoch"):
        dataloader.set_epoch(epoch)  # Accelerate's: passes the epoch down to the sampler
        return
    # a plain torch DataLoader (e.g. from a notebook) has no set_epoch of its own
    for obj in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None),
                getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)
            return


def check_sync_agrees(accelerator, j: int, stop: int) -> None:
    """Accelerate's sync decision must match the window arithmetic, or an update would mix two windows."""
    if accelerator.sync_gradients != (j == stop - 1):
        raise RuntimeError(
            f"accumulation out of step at micro-batch {j}: Accelerate sync="
            f"{accelerator.sync_gradients}, window ends at {stop - 1}"
        )


def micro_batch_loss(model, batch: dict[str, torch.Tensor], real: int,
                     loss_fn: LossFn) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed per-sample loss of the micro-batch's first ``real`` samples, and their non-pad tokens.

    A sum, not a mean: :func:`~finetune.accumulation.window_loss_scale` turns
    the window's sums into the mean over its real samples. Samples past
    ``real`` repeat earlier ones to even out processes and get weight 0. A
    sample split into windows (``data.truncation: chunks``) is one sample: its
    output is the mean of its windows' logits (:mod:`finetune.chunks`).
    """
    inputs, chunk_rows = split_batch(batch)
    labels = batch["labels"]
    per_sample = loss_fn(document_logits(model(**inputs).logits, chunk_rows), labels)
    if per_sample.shape != labels.shape[:1]:
        raise ValueError(f"loss_fn must return one loss per row (shape ({labels.shape[0]},)), "
                         f"got shape {tuple(per_sample.shape)}")
    tokens = tokens_per_text(batch["attention_mask"], chunk_rows)
    if real < labels.shape[0]:
        keep = torch.arange(labels.shape[0], device=per_sample.device) < real
        per_sample = torch.where(keep, per_sample, torch.zeros_like(per_sample))
        return per_sample.sum(), tokens[:real].sum()
    return per_sample.sum(), tokens.sum()


class WindowStats:
    """One window's summed loss, real samples and non-pad tokens, kept on the device.

    Adding to device tensors needs no host sync per micro-batch; the window
    pays one reduce and one transfer at its end. The first micro-batch whose
    loss was not finite is remembered the same way, for the error message.
    """

    def __init__(self, device) -> None:
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, samples, tokens
        # each process's terms of the noise scale's estimates (finetune.noise_scale.small_batch_terms), or zeros
        self.small = torch.zeros(TERMS, dtype=torch.float64, device=device)
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)
        self.first = self.stop = self.real_samples = 0
        self.t0 = time.perf_counter()

    def start(self, first: int, stop: int, real_samples: int) -> None:
        """Begin the window of micro-batches ``first .. stop-1`` holding ``real_samples`` (all processes)."""
        self.first, self.stop, self.real_samples = first, stop, real_samples
        self.totals.zero_()
        self.small.zero_()
        self.first_bad.fill_(-1)

    def add(self, j: int, loss_sum: torch.Tensor, samples: int, tokens: torch.Tensor) -> None:
        self.totals[0] += loss_sum.double()
        self.totals[1] += samples
        self.totals[2] += tokens.double()
        bad_now = (~torch.isfinite(loss_sum)) & (self.first_bad < 0)
        self.first_bad.copy_(torch.where(bad_now, torch.full_like(self.first_bad, j), self.first_bad))

    def keep_first_gradient(self, model, real: int, processes: int) -> None:
        """This process's terms of the noise scale's estimates, from the gradient its window's first micro-batch of
        ``real`` samples left in the model (:mod:`finetune.noise_scale`)."""
        if not 0 < real < self.real_samples:
            return
        to_mean = self.real_samples / (processes * real)  # the grads hold the samples' sum times P / N_w
        terms = small_batch_terms(squared_gradient_norm(model) * to_mean ** 2, real, self.real_samples)
        self.small += terms.to(self.small.device)

    def restart_clock(self) -> None:
        """Start timing the next window (after this one's logging and callbacks, before its first fetch)."""
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        """Time since the clock started: the window's fetches, forwards, backwards and update."""
        return time.perf_counter() - self.t0

    def read(self, accelerator, grad_norm: Optional[torch.Tensor]
             ) -> tuple[torch.Tensor, Optional[float], torch.Tensor]:
        """The window's totals and its first micro-batches' squared norms, each summed over all processes (every
        process gets the same), and the gradient's norm, on the host, in one transfer: the loop's one wait for
        the device per update."""
        summed = accelerator.reduce(torch.cat([self.totals, self.small]), reduction="sum")
        if grad_norm is None:  # DeepSpeed clips inside its engine
            summed = summed.cpu()
            return summed[:3], None, summed[3:]
        both = torch.cat([summed, torch.as_tensor(grad_norm, device=summed.device).reshape(1).to(summed.dtype)])
        both = both.cpu()
        return both[:3], float(both[-1]), both[3:-1]

    def where(self, update: "Update", process_index: int) -> str:
        """Where a non-finite value first appeared, for the error message."""
        span = f"micro-batches {self.first}-{self.stop - 1}"
        if update.what != "loss":
            return span
        bad = int(self.first_bad.item())
        return f"micro-batch {bad} on process {process_index}" if bad >= 0 else f"{span} on another process"


@dataclass
class Update:
    """What :func:`apply_update` did with one window's gradient."""

    # the learning rate the update used (or would have used)
    lr: float
    # the gradient norm before clipping; None where the engine clips itself (DeepSpeed)
    grad_norm: Optional[float] = None
    # when the update was skipped: "loss" or "gradient norm", and the value that was not finite
    what: Optional[str] = None
    value: float = 0.0

    @property
    def applied(self) -> bool:
        return self.what is None


def clip_gradients(model, accelerator, max_grad_norm: Optional[float]) -> Optional[torch.Tensor]:
    """Clip the window's accumulated gradient to ``max_grad_norm`` (``None`` or 0: measure it only).

    Returns the norm before clipping, still on the device (``None`` where the
    engine clips itself: DeepSpeed). Clipping before the host has read the
    window's loss lets one transfer bring both; a window that is then skipped
    drops its gradient whatever clipping did to it.
    """
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2's norm is a DTensor, which plain tensors cannot join
        grad_norm = grad_norm.full_tensor()
    return grad_norm


def apply_update(optimizer, scheduler, accelerator, totals: torch.Tensor, grad_norm: Optional[float]) -> Update:
    """Step the optimizer and the scheduler with the clipped gradient, unless a value is not finite.

    ``totals`` and ``grad_norm`` are on the host (:meth:`WindowStats.read`).
    The scheduler steps once per update that the optimizer really made: not on
    a skipped window, and not when fp16's grad scaler skipped the step.
    """
    lr = float(optimizer.param_groups[0]["lr"])
    window_loss = float(totals[0] / totals[1])
    if not math.isfinite(window_loss):
        skipped = Update(lr, grad_norm, what="loss", value=window_loss)
    # A finite loss can still give NaN/inf gradients, which would poison the weights. Under fp16 the grad
    # scaler owns that case (it skips the step, and the scheduler with it); DeepSpeed returns no norm.
    elif grad_norm is not None and accelerator.scaler is None and not math.isfinite(grad_norm):
        skipped = Update(lr, grad_norm, what="gradient norm", value=grad_norm)
    else:
        scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else None  # fp16 only: a host sync
        optimizer.step()
        if scheduler is not None and not step_was_skipped(accelerator, scale):
            scheduler.step()
        return Update(lr, grad_norm)
    if accelerator.scaler is not None:
        # clipping unscaled the gradients, which opens a step of the grad scaler: it closes here, with no
        # optimizer step, as it would have had the step met the non-finite gradients of a non-finite loss
        accelerator.scaler.update()
    return skipped


def frees_gradients(model, graphs: Optional["GraphedMicroBatches"] = None) -> bool:
    """Whether an update frees the gradients, so that the next forward pass does not hold them, rather than
    zeroing them in place.

    In place where their memory must stay: a captured backward adds into it (CUDA graphs), and DDP's
    gradients are views into its all-reduce buckets, which DDP holds anyway: freed, the next window's
    backward would allocate a second copy beside the buckets until the window's all-reduce. In place too where
    the linear layers add their weight gradients themselves (``training.gradient_accumulation_fusion``).
    """
    return (graphs is None and not getattr(model, "gradient_as_bucket_view", False)
            and not getattr(model, "fused_weight_grads", 0))


def step_was_skipped(accelerator, scale_before: Optional[float]) -> bool:
    """Whether fp16's grad scaler skipped the optimizer step that just ran (an overflow).

    Accelerate's flag comes from whether the optimizer's ``step`` was called,
    but a fused optimizer (torch's fused AdamW, the default on CUDA) is called
    and skips the update inside its kernel. The scaler lowers its scale after
    every overflow, and only then: that is the test that holds for both.
    """
    if accelerator.optimizer_step_was_skipped:
        return True
    return scale_before is not None and accelerator.scaler.get_scale() < scale_before


def skip_nonfinite(update: Update, where: str, state: TrainState, result: EpochResult, on_nonfinite: str,
                   max_skipped: int, warn: bool = True) -> None:
    """Apply ``training.on_nonfinite`` to an update that was not made: raise, or count the skip (with a
    warning line when ``warn``, so a skip is seen when it happens, not only in the log's counter).

    Raises:
        NonFiniteLossError: under ``"stop"``, or after ``max_skipped`` skips in a row.
    """
    if on_nonfinite == "stop":
        raise NonFiniteLossError(
            f"non-finite {update.what} ({update.value}) at update {state.step + 1} (epoch {state.epoch}, "
            f"first at {where}); stopping (training.on_nonfinite: skip drops such updates)"
        )
    state.skipped_updates += 1
    state.skipped_in_row += 1
    result.skipped += 1
    if warn:
        logger.warning("skipped update %d: non-finite %s (%s) at %s (epoch %d); %d skipped in a row, at most %d "
                       "(training.max_skipped)", state.step + 1, update.what, update.value, where, state.epoch,
                       state.skipped_in_row, max_skipped)
    if state.skipped_in_row >= max_skipped:
        raise NonFiniteLossError(
            f"{state.skipped_in_row} updates in a row had a non-finite {update.what} "
            f"(last at epoch {state.epoch}, first at {where}); stopping (training.max_skipped)"
        )


class LogWindow:
    """The updates since the last record, averaged into one flat record."""

    def __init__(self, k: int, effective_batch: int) -> None:
        self.k, self.effective_batch = k, effective_batch  # the epoch's; a schedule may change them
        self.totals = torch.zeros(3, dtype=torch.float64)  # loss sum, samples, tokens (already on the host)
        self.grad_norm = 0.0
        self.lr_sum = 0.0
        self.updates = 0
        self.t0 = time.perf_counter()

    def add(self, totals: torch.Tensor, update: Update) -> None:
        self.totals += totals
        # DeepSpeed: the engine clipped; no norm to report
        self.grad_norm += update.grad_norm if update.grad_norm is not None else float("nan")
        self.lr_sum += update.lr
        self.updates += 1

    def due(self, stop: int, k: int, log_every: int, last: bool) -> bool:
        """Whether the window ending at ``stop`` writes a record.

        Every ``log_every``-th window of the epoch (not of this call), so that
        a run resumed mid-epoch writes its records at the same steps as an
        uninterrupted one; and always at the epoch's or the run's last update.
        """
        window_number = -(-stop // k)
        return self.updates > 0 and (window_number % log_every == 0 or last)

    def record(self, state: TrainState, epoch: float, noise: bool = False) -> dict[str, Any]:
        """The record of the updates since the last one (then starts over); with ``noise``, the gradient noise
        scale measured so far, where there is one."""
        now = time.perf_counter()
        elapsed = max(now - self.t0, 1e-9)
        record = {
            "step": state.step,
            "epoch": epoch,
            "train/loss": float(self.totals[0] / self.totals[1]),
            "train/lr": self.lr_sum / self.updates,
            "train/grad_norm": self.grad_norm / self.updates,
            "train/samples": state.samples_seen,
            "train/tokens": state.tokens_seen,
            "train/samples_per_s": float(self.totals[1]) / elapsed,
            "train/tokens_per_s": float(self.totals[2]) / elapsed,
            "train/skipped_updates": state.skipped_updates,
            "train/accumulation_steps": self.k,
            "train/effective_batch_size": self.effective_batch,
        }
        scale = state.noise_scale() if noise else None
        if scale is not None:
            record["train/noise_scale"] = scale
        self.totals.zero_()
        self.grad_norm = self.lr_sum = 0.0
        self.updates, self.t0 = 0, now
        return record


def report(record: dict[str, Any], result: EpochResult, on_log, progress) -> None:
    """Hand a record to the caller and show it on the progress bar, at the bar's next redraw."""
    result.records.append(record)
    if on_log is not None:
        on_log(record)
    if progress is not None:
        # not redrawn now: a redraw per record would defeat the bar's interval into a batch job's log
        progress.set_postfix(loss=f"{record['train/loss']:.4f}", lr=f"{record['train/lr']:.2e}", refresh=False)


def should_stop(state: TrainState, on_update, max_updates: Optional[int]) -> bool:
    """Whether to end the epoch after this update: the caller asked, or the schedule is done."""
    asked = bool(on_update(state)) if on_update is not None else False  # called after every update
    return asked or (max_updates is not None and state.step >= max_updates)
