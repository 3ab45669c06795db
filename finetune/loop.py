"""The training and evaluation loops: exact gradient accumulation.

``train_one_epoch`` keeps the contract of ACCUMULATION.md:

* Each window of ``k`` micro-batches (per process) produces one update whose
  gradient is the mean per-sample gradient over the window's real samples on
  all processes: each micro-batch's *summed* loss is scaled by ``1 / N_w``
  (see :func:`window_loss_scale`), so a ragged last window and a short last
  micro-batch weigh exactly what the big batch would give them.
* ``accelerator.accumulate(model)`` decides when gradients are synchronised
  (once per window under DDP); the loop checks that its own window arithmetic
  agrees with Accelerate's on every micro-batch.
* The scheduler is *not* prepared by Accelerate: the loop steps it once per
  real update (not on a skipped fp16 step), so the schedule counts updates on
  any number of processes.
* The input embedding's backward returns only the rows a micro-batch used
  (one CPU process, see :func:`sparse_embedding_for`); they are added into a
  reused dense buffer, and any gradient still sparse is made dense before
  clipping (see :func:`densify_sparse_grads`).
* On a CPU, dropout masks are drawn 16 bits at a time from torch's generator
  while the loop trains (see :mod:`finetune.dropout`).
* At ``k > 1`` the gradients are zeroed in place after an update rather than
  freed, so every window accumulates into the same buffers (a steady heap).
* Clipping happens once per update on the accumulated gradient, and one log
  record per update (or per ``log_every`` updates) reports the loss the big
  batch would have shown.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from finetune.dropout import fast_dropout, fast_dropout_applies
from finetune.errors import FinetuneError
from finetune.sampling import ShardLayout


class NonFiniteLossError(FinetuneError):
    """The loss of an update was NaN or infinite and the policy says stop."""

    exit_code = 3


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

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class EpochResult:
    """What one call of :func:`train_one_epoch` did."""

    epoch: int
    # optimizer updates made in this call
    updates: int = 0
    # windows dropped because their loss was not finite (``on_nonfinite='skip'``)
    skipped: int = 0
    # mean per-sample training loss over the call's real samples (all processes)
    loss: float = float("nan")
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    # True when the call ended before the end of the epoch (max_updates or a callback)
    stopped_early: bool = False
    records: list[dict[str, Any]] = field(default_factory=list)


def window_loss_scale(real_samples_in_window: int, accelerator) -> float:
    """Factor applied to a micro-batch's *summed* loss before ``accelerator.backward``.

    The update must apply ``(1 / N_w) * sum of per-sample gradients`` over the
    window's ``N_w`` real samples on all processes. ``accelerator.backward``
    divides by ``k`` and DDP (and FSDP/DeepSpeed) average gradients over the
    ``P`` processes, so both are undone here: ``scale = k * P / N_w``.

    Args:
        real_samples_in_window: ``N_w`` (see :meth:`ShardLayout.real_in_window`).
        accelerator: The run's ``Accelerator``.
    """
    return accelerator.gradient_accumulation_steps * accelerator.num_processes / real_samples_in_window


# Each parameter's dense gradient buffer for densify_sparse_grads, reused from update to update:
# id(parameter) -> (weak reference to it, buffer). (A WeakKeyDictionary would compare tensors with ==.)
_dense_grad_buffers: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def _dense_grad_buffer(p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The reused dense gradient buffer of ``p``, with ``like``'s dtype and device (contents undefined)."""
    entry = _dense_grad_buffers.get(id(p))
    if entry is not None and entry[0]() is p:
        buf = entry[1]
        if buf.shape == p.shape and buf.dtype == like.dtype and buf.device == like.device:
            return buf
    buf = torch.empty(p.shape, dtype=like.dtype, device=like.device)
    key = id(p)
    _dense_grad_buffers[key] = (weakref.ref(p, lambda _, key=key: _dense_grad_buffers.pop(key, None)), buf)
    return buf


def densify_sparse_grads(parameters) -> int:
    """Make every sparse ``.grad`` dense, in place; returns how many were.

    An embedding with ``sparse=True`` (see :func:`sparse_embedding_for`)
    leaves each micro-batch's gradient as the rows it used. At ``k > 1``
    :func:`train_one_epoch` gives it a dense gradient from the start, into
    which autograd adds those rows; at ``k = 1`` (or for a caller's own sparse
    embedding) the gradient is still sparse at the update. Clipping and the
    fused AdamW need dense gradients, so before clipping the rows are summed
    into a dense buffer: the same sums the dense embedding backward gives, to
    float rounding. The buffer is kept from update to update, so its 47 MB
    (for BERT's vocabulary) are neither reallocated nor faulted in again; it
    is freed with the parameter.
    """
    count = 0
    for p in parameters:
        grad = p.grad
        if grad is None or not grad.is_sparse:
            continue
        buf = _dense_grad_buffer(p, grad)
        buf.zero_()
        buf.add_(grad)  # dense += sparse: index_add of the rows, duplicates summed
        p.grad = buf
        count += 1
    return count


def sparse_embedding_for(model, accelerator):
    """The input embedding whose gradient :func:`train_one_epoch` makes sparse, or ``None``.

    Only in one process on a CPU, without a compiled model or fp16's gradient
    scaler: DDP's buckets, FSDP's and DeepSpeed's shards expect dense
    gradients, and on a GPU zeroing the dense one costs microseconds. See
    :func:`finetune.modeling.sparse_capable_embedding` for the model's side.
    """
    from finetune.modeling import is_compiled, sparse_capable_embedding

    if accelerator.device.type != "cpu" or accelerator.num_processes != 1:
        return None
    if getattr(accelerator, "scaler", None) is not None:
        return None
    if is_compiled(model):
        return None  # its graphs were traced with a dense backward
    return sparse_capable_embedding(model)


def layout_for(dataloader, accelerator) -> ShardLayout:
    """The :class:`ShardLayout` of a dataloader prepared by ``accelerator`` (or a plain one).

    Raises:
        ValueError: if the dataloader is not dealt out as the layout assumes
            (``split_batches``, ``drop_last``, or a batch sampler of varying sizes).
    """
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


def _lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


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
    sparse_embedding_grad: bool = True,
    fast_dropout_masks: bool = True,
    progress=None,
) -> EpochResult:
    """Train one epoch with exact gradient accumulation.

    Call it with objects already passed through ``accelerator.prepare`` (the
    scheduler excepted: pass it unprepared, this function steps it once per
    update). The accumulation steps ``k`` are ``accelerator.gradient_accumulation_steps``.

    Args:
        model: The prepared model; its ``forward`` must return ``.logits``.
            The batch's ``labels`` are popped before the call, and the loss is
            computed here (per-sample cross-entropy in float32).
        optimizer: The prepared optimizer.
        scheduler: A learning-rate scheduler sized in updates (or ``None``).
        dataloader: The prepared training dataloader. Its sampler's
            ``set_epoch`` is called with ``epoch``.
        accelerator: The ``Accelerator``.
        epoch: Epoch number (from 0), for the sampler and the records.
        state: Counters carried across epochs and checkpoints; updated in
            place. ``state.micro_batch > 0`` resumes mid-epoch after that many
            micro-batches (must be a window boundary).
        max_grad_norm: Clip the accumulated gradient's norm to this (``None``
            or 0: measure the norm without clipping).
        log_every: Write a record every this many windows of the epoch (and at its
            end), averaged over the updates since the last record.
        on_log: Called with each record (a flat dict) on every process; the
            caller decides who writes it.
        on_update: Called after every update with ``state``; returning True
            ends the epoch there (a window boundary), e.g. to checkpoint and stop.
        max_updates: Stop once ``state.step`` reaches this (end of the schedule).
        on_nonfinite: ``"stop"`` raises :class:`NonFiniteLossError`;
            ``"skip"`` drops that update (no optimizer or scheduler step).
        max_skipped: With ``"skip"``, raise after this many skipped updates in a row.
        sparse_embedding_grad: While this call trains, let the word embedding's
            backward return only the rows each micro-batch used, added into a
            reused dense gradient buffer (see :func:`sparse_embedding_for`
            for where it applies). The embedding is put back as it was when the
            call returns, so a loop of your own sees the model unchanged.
        fast_dropout_masks: While this call trains on a CPU, draw dropout
            masks (hidden and attention) 16 bits at a time from torch's
            generator instead of with ``bernoulli_`` (see
            :mod:`finetune.dropout`); the model is handed back unchanged too.
        progress: Optional tqdm bar, advanced by one per update.

    Returns:
        An :class:`EpochResult`.

    Raises:
        NonFiniteLossError: on a NaN/inf loss under the ``stop`` policy, or too
            many skips in a row.
    """
    with contextlib.ExitStack() as switches:
        if fast_dropout_masks and fast_dropout_applies(model, accelerator):
            switches.enter_context(fast_dropout(model))
        embedding = sparse_embedding_for(model, accelerator) if sparse_embedding_grad else None
        if embedding is not None:
            switches.enter_context(_sparse_rows(model, embedding, accelerator))
        return _train_one_epoch(
            model, optimizer, scheduler, dataloader, accelerator, epoch, state=state, max_grad_norm=max_grad_norm,
            log_every=log_every, on_log=on_log, on_update=on_update, max_updates=max_updates,
            on_nonfinite=on_nonfinite, max_skipped=max_skipped, progress=progress,
        )


@contextlib.contextmanager
def _sparse_rows(model, embedding, accelerator):
    """While inside, ``embedding``'s backward returns rows; on exit it is as it was, its gradient dense."""
    was_sparse = embedding.sparse
    embedding.sparse = True
    try:
        weight = embedding.weight
        if accelerator.gradient_accumulation_steps > 1 and weight.grad is None:
            # The kept gradients (see keep_grads below) make the embedding's a dense buffer into which
            # each micro-batch's rows are added. Start the first window that way too, so that it sums
            # in the same order as every later one, and a resumed run stays bitwise the uninterrupted one.
            weight.grad = _dense_grad_buffer(weight, like=weight).zero_()
        yield
    finally:
        embedding.sparse = was_sparse
        # an exception can leave a window's rows behind: hand back the dense gradient torch would have
        densify_sparse_grads(model.parameters())


def _train_one_epoch(model, optimizer, scheduler, dataloader, accelerator, epoch, *, state, max_grad_norm, log_every,
                     on_log, on_update, max_updates, on_nonfinite, max_skipped, progress) -> EpochResult:
    state = state if state is not None else TrainState(epoch=epoch)
    state.epoch = epoch
    k = accelerator.gradient_accumulation_steps
    layout = layout_for(dataloader, accelerator)
    device = accelerator.device
    if hasattr(dataloader, "set_epoch"):
        dataloader.set_epoch(epoch)  # Accelerate's: passes the epoch down to the sampler
    else:
        # a plain torch DataLoader (e.g. from a notebook) has no set_epoch of its own
        for obj in (getattr(dataloader, "sampler", None),
                    getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                break

    # With k > 1 the gradient buffers must live from a window's first micro-batch to its last
    # anyway; keeping them from update to update too (zeroed, not freed) gives the allocator the
    # same layout every window. Freed and reallocated in the middle of each window's backward
    # pass, they left holes that the next forward pass could not reuse, and glibc's heap grew
    # by ~200 MB on the BBC News job at b=8, k=4 (README, Performance). With k = 1 they are
    # freed, so a forward pass never holds them.
    keep_grads = k > 1

    start = state.micro_batch
    if start % k != 0 and start != layout.micro_batches_per_process:
        raise ValueError(f"cannot resume at micro-batch {start}: not a window boundary (k={k})")
    batches = accelerator.skip_first_batches(dataloader, start) if start > 0 else dataloader
    result = EpochResult(epoch=epoch)
    model.train()
    t0 = time.perf_counter()

    # Device-side accumulators: no host sync per micro-batch. Index 0: summed
    # loss of real samples, 1: real samples, 2: real non-pad tokens.
    window_stats = torch.zeros(3, dtype=torch.float64, device=device)
    first_bad = torch.full((), -1, dtype=torch.long, device=device)
    log_stats = torch.zeros(3, dtype=torch.float64)
    log_grad_norm = torch.zeros((), dtype=torch.float32, device=device)
    log_lr_sum = 0.0
    log_updates = 0
    log_t0 = time.perf_counter()
    epoch_loss_sum = 0.0  # over updates that happened (skipped windows excluded)
    epoch_loss_samples = 0.0
    window_real = 0

    j = start - 1
    for j, batch in enumerate(batches, start=start):
        first, stop = layout.window_of(j, k)
        if j == first:
            window_real = layout.real_in_window(first, stop)
            window_stats.zero_()
            first_bad.fill_(-1)
        labels = batch.pop("labels")
        real = layout.real_in_micro_batch(j)
        with accelerator.accumulate(model):
            # Our window arithmetic and Accelerate's sync decision must agree,
            # or an update would mix two windows.
            if accelerator.sync_gradients != (j == stop - 1):
                raise RuntimeError(
                    f"accumulation out of step at micro-batch {j}: Accelerate sync="
                    f"{accelerator.sync_gradients}, window ends at {stop - 1}"
                )
            outputs = model(**batch)
            per_sample = F.cross_entropy(outputs.logits.float(), labels, reduction="none")
            if real < labels.shape[0]:
                # rows past `real` repeat earlier samples to even out processes: weight 0
                keep = torch.arange(labels.shape[0], device=per_sample.device) < real
                per_sample = torch.where(keep, per_sample, torch.zeros_like(per_sample))
                tokens = batch["attention_mask"][:real].sum()
            else:
                tokens = batch["attention_mask"].sum()
            loss_sum = per_sample.sum()
            accelerator.backward(loss_sum * window_loss_scale(window_real, accelerator))
            detached = loss_sum.detach()
            window_stats[0] += detached.double()
            window_stats[1] += real
            window_stats[2] += tokens.double()
            # remember the first non-finite micro-batch without a host sync
            bad_now = (~torch.isfinite(detached)) & (first_bad < 0)
            first_bad.copy_(torch.where(bad_now, torch.full_like(first_bad, j), first_bad))

            if accelerator.sync_gradients:
                # One collective and one host transfer per update: the window's loss,
                # samples and tokens over all processes. Every process needs the loss to
                # take the same decision on a non-finite update.
                totals = accelerator.reduce(window_stats.clone(), reduction="sum").cpu()
                window_loss = (totals[0] / totals[1]).item()
                problem = None
                grad_norm = None
                if not math.isfinite(window_loss):
                    bad = int(first_bad.item())
                    where = f"micro-batch {bad} on process {accelerator.process_index}" if bad >= 0 else (
                        f"micro-batches {first}-{stop - 1} on another process"
                    )
                    problem = f"loss ({window_loss})", where
                else:
                    lr = _lr(optimizer)
                    densify_sparse_grads(model.parameters())
                    grad_norm = accelerator.clip_grad_norm_(
                        model.parameters(), max_grad_norm if max_grad_norm else float("inf")
                    )
                    # A finite loss can still give NaN/inf gradients, which would poison the weights.
                    # Under fp16 the grad scaler owns that case (it skips the step, and the scheduler
                    # with it); DeepSpeed clips inside its engine and returns no norm.
                    if grad_norm is not None and accelerator.scaler is None:
                        norm = float(grad_norm)  # host sync; the norm is global, so every process agrees
                        if not math.isfinite(norm):
                            problem = f"gradient norm ({norm})", f"micro-batches {first}-{stop - 1}"
                if problem is not None:
                    what, where = problem
                    if on_nonfinite == "stop":
                        raise NonFiniteLossError(
                            f"non-finite {what} at update {state.step + 1} (epoch {epoch}, "
                            f"first at {where}); stopping (training.on_nonfinite: skip drops such updates)"
                        )
                    optimizer.zero_grad(set_to_none=not keep_grads)
                    state.skipped_updates += 1
                    state.skipped_in_row += 1
                    result.skipped += 1
                    if state.skipped_in_row >= max_skipped:
                        raise NonFiniteLossError(
                            f"{state.skipped_in_row} updates in a row had a non-finite {what.split(' (')[0]} "
                            f"(last at epoch {epoch}, first at {where}); stopping (training.max_skipped)"
                        )
                else:
                    state.skipped_in_row = 0
                    optimizer.step()
                    if scheduler is not None and not accelerator.optimizer_step_was_skipped:
                        scheduler.step()
                    optimizer.zero_grad(set_to_none=not keep_grads)
                    state.step += 1
                    result.updates += 1
                    log_stats += totals
                    epoch_loss_sum += float(totals[0])
                    epoch_loss_samples += float(totals[1])
                    if grad_norm is None:
                        log_grad_norm += float("nan")  # DeepSpeed: the engine clipped; no norm to report
                    else:
                        log_grad_norm += grad_norm.detach().float() if torch.is_tensor(grad_norm) else float(grad_norm)
                    log_lr_sum += lr
                    log_updates += 1
                samples, tokens_total = int(totals[1]), int(totals[2])
                state.samples_seen += samples
                state.tokens_seen += tokens_total
                result.samples += samples
                result.tokens += tokens_total
                state.micro_batch = stop

                at_end = stop == layout.micro_batches_per_process
                # every log_every-th window of the epoch (not of this call), so that a run resumed
                # mid-epoch writes its records at the same steps as an uninterrupted one
                window_number = -(-stop // k)
                if log_updates and (window_number % log_every == 0 or at_end or state.step == max_updates):
                    now = time.perf_counter()
                    elapsed = max(now - log_t0, 1e-9)
                    record = {
                        "step": state.step,
                        "epoch": epoch + stop / layout.micro_batches_per_process,
                        "train/loss": float(log_stats[0] / log_stats[1]),
                        "train/lr": log_lr_sum / log_updates,
                        "train/grad_norm": log_grad_norm.item() / log_updates,  # host sync, once per record
                        "train/samples": state.samples_seen,
                        "train/tokens": state.tokens_seen,
                        "train/samples_per_s": float(log_stats[1]) / elapsed,
                        "train/tokens_per_s": float(log_stats[2]) / elapsed,
                        "train/skipped_updates": state.skipped_updates,
                    }
                    result.records.append(record)
                    if on_log is not None:
                        on_log(record)
                    if progress is not None:
                        progress.set_postfix(loss=f"{record['train/loss']:.4f}", lr=f"{record['train/lr']:.2e}")
                    log_stats.zero_()
                    log_grad_norm.zero_()
                    log_lr_sum = 0.0
                    log_updates = 0
                    log_t0 = now
                if progress is not None:
                    progress.update(1)
                stop_now = bool(on_update(state)) if on_update is not None else False
                if max_updates is not None and state.step >= max_updates:
                    stop_now = True
                if stop_now and not at_end:
                    result.stopped_early = True
                    break

    if j + 1 >= layout.micro_batches_per_process:
        # the epoch is complete: the next call starts the next epoch from its first micro-batch
        state.micro_batch = 0
        state.epoch = epoch + 1
    result.seconds = time.perf_counter() - t0
    result.loss = epoch_loss_sum / epoch_loss_samples if epoch_loss_samples else float("nan")
    return result


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, dataloader, accelerator, metrics=None) -> dict[str, float]:
    """Loss and metrics of ``model`` on a prepared evaluation dataloader.

    Per-sample losses, predictions and references are collected with
    ``accelerator.gather_for_metrics``, which drops the samples Accelerate
    repeated to even out processes: every example counts exactly once.

    Args:
        model: The prepared model.
        dataloader: Prepared evaluation dataloader with ``labels`` in each batch.
        accelerator: The ``Accelerator``.
        metrics: A :class:`finetune.metrics.MetricSuite` (or anything with
            ``compute(predictions, references) -> dict``); ``None`` for loss only.

    Returns:
        ``{"loss": ..., "num_samples": ..., <metric>: ...}`` as Python numbers.
    """
    was_training = model.training
    model.eval()
    losses, preds, refs = [], [], []
    for batch in dataloader:
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        loss = F.cross_entropy(logits, labels, reduction="none")
        loss, pred, ref = accelerator.gather_for_metrics((loss, logits.argmax(-1), labels))
        losses.append(loss.cpu())
        preds.append(pred.cpu())
        refs.append(ref.cpu())
    if was_training:
        model.train()
    if not losses:
        return {"loss": float("nan"), "num_samples": 0}
    all_loss = torch.cat(losses)
    predictions = torch.cat(preds).numpy()
    references = torch.cat(refs).numpy()
    out: dict[str, float] = {"loss": all_loss.double().mean().item(), "num_samples": int(all_loss.numel())}
    if metrics is not None:
        out.update(metrics.compute(predictions, references))
    return out
