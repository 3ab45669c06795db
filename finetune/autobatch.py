"""``per_device_train_batch_size: auto``: the largest micro-batch that fits, with ``B`` unchanged.

Accumulation trades memory for time without changing the math: a run at
``(b, k)`` and one at ``(b/2, 2k)`` make the same updates (docs/accumulation.md).
So when memory is short the micro-batch can be halved and ``k`` doubled with
nothing else changing. That is what this module does, once, before training:

* Start at the largest power of two that divides ``B / P`` (so every halving
  still divides it, down to 1).
* Try one forward and backward, as training runs them, on the worst
  micro-batch the data can produce: the ``b`` longest training samples
  (``b`` rows padded to the longest length), with room held for the optimizer
  state that training adds later.
* All processes agree: each reports whether its trial ran out of memory, and
  one failure anywhere makes every process halve ``b``; they all end with the
  same ``b`` and ``k = B / (b * P)``.
* On a CPU the memory plan goes first (:func:`plan_before_trial`): past the
  RAM, or a container's memory limit, a trial is not an error to catch but a
  killed process, so a ``b`` the plan says cannot fit is not tried.

Why not ``accelerate.utils.find_executable_batch_size`` (or the Trainer's
``auto_find_batch_size``, which calls it): it shrinks the batch by 0.9x per
failure *without touching the accumulation*, so the effective batch, and with
it the learning-rate schedule and the updates, change behind the user's back;
and it knows nothing of other processes. Here ``B`` is fixed by the config and
only its split changes.

The trial leaves no trace: gradients are dropped and the random-number
generators restored, so the run trains exactly as one started directly at the
chosen ``b`` and ``k`` (``tests/test_auto_batch.py`` checks the final weights).

The trial runs on the whole, unprepared model: under FSDP or DeepSpeed ZeRO,
which shard the model only when it is prepared, it overestimates the memory a
micro-batch needs and may choose a smaller ``b`` than would fit.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from finetune.chunks import document_logits, split_batch
from finetune.columns import read_column
from finetune.cpu import dropout_as_in_training
from finetune.errors import ConfigError, LaunchError, is_out_of_memory
from finetune.launch import autocast, processes_on_this_machine
from finetune.optimizer_state import state_bytes
from finetune.memory import (
    GB, MemoryPlan, free_cached, levers_that_fit, measure_activations, plan_memory,
    refuse_a_precision_the_model_fails_in, rng_fork, tensor_bytes,
)
from finetune.tasks import Task
from finetune.truncation import BOOKKEEPING, CHUNK_COUNT, LENGTH

logger = logging.getLogger("finetune")


def initial_micro_batch(effective_batch_size: int, num_processes: int) -> int:
    """The first micro-batch to try: the largest power of two dividing ``B / P``.

    Raises:
        ConfigError: if ``B`` cannot be split evenly over the processes.
    """
    if effective_batch_size % num_processes != 0:
        raise ConfigError(
            f"training.effective_batch_size: {effective_batch_size} is not a multiple of the "
            f"{num_processes} processes"
        )
    per_process = effective_batch_size // num_processes
    return per_process & -per_process


def worst_case_batch(dataset, collate: Callable[[list], dict], batch_size: int) -> dict[str, torch.Tensor]:
    """The ``batch_size`` longest samples of ``dataset`` (by its ``length`` column), collated.

    Padding makes every row as long as the longest sample, so this is the
    largest micro-batch, in memory, that an epoch can hand the model.
    """
    columns = [c for c in dataset.column_names if c not in BOOKKEEPING]
    return collate([{c: dataset[i][c] for c in columns} for i in longest_rows(dataset, batch_size)])


def worst_case_windows(dataset, batch_size: int) -> Optional[int]:
    """The windows the texts of :func:`worst_case_batch` make under ``data.truncation: chunks`` (each a row of
    the micro-batch), or None where texts are not split."""
    if CHUNK_COUNT not in dataset.column_names:
        return None
    counts = read_column(dataset, CHUNK_COUNT)
    return sum(counts[i] for i in longest_rows(dataset, batch_size))


def longest_rows(dataset, batch_size: int) -> list[int]:
    """The indices of the ``batch_size`` longest samples of ``dataset``, by its ``length`` column."""
    lengths = torch.as_tensor(read_column(dataset, LENGTH))
    longest = torch.argsort(lengths, descending=True, stable=True).tolist()
    # fewer samples than b (a tiny data set): repeat them, the shape is what matters
    return [longest[i % len(longest)] for i in range(batch_size)]


def trial_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], accelerator, optimizer: str = "adamw") -> bool:
    """One training forward and backward on ``batch``; False if it ran out of memory.

    Runs on the unprepared model (already on the accelerator's device), so no
    collective is involved and a process that fails cannot leave the others
    waiting inside a backward. Gradients are dropped and the random-number
    generators (dropout) restored afterwards.

    Args:
        model: The model, on ``accelerator.device``.
        batch: A collated micro-batch with ``labels``.
        accelerator: The run's ``Accelerator`` (device and autocast).
    """
    device = accelerator.device
    # Held during the trial for what training adds later: the optimizer's state (``optim.optimizer``), a buffer
    # per trainable parameter. On several processes DDP's all-reduce buckets hold the gradients themselves (as
    # views, launch.build_accelerator), so the trial's own gradients stand for them.
    was_training = model.training
    ok = True
    try:
        with rng_fork(device):
            model.train()
            trainable = [p for p in model.parameters() if p.requires_grad]
            reserve = [torch.empty(state_bytes(p, optimizer), dtype=torch.uint8, device=device) for p in trainable]
            inputs, chunk_rows = split_batch({k: v.to(device) for k, v in batch.items()})
            labels = batch["labels"].to(device)
            with autocast(accelerator):  # not accelerator.autocast(): out of memory, it stays on (launch.autocast)
                logits = document_logits(model(**inputs).logits, chunk_rows)
            Task.of_model(model).per_sample_loss(logits, labels).sum().backward()
            del reserve, inputs, labels, logits
    except Exception as exc:  # noqa: BLE001 - anything but an out-of-memory error is re-raised
        if not is_out_of_memory(exc):
            refuse_a_precision_the_model_fails_in(model, split_batch(batch)[0], accelerator, exc)
            raise
        ok = False
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    free_cached(device)  # what the trial (or its failure) left behind, before the next try or training
    return ok


def plan_before_trial(trial: Callable[[torch.nn.Module, dict[str, Any], Any], bool], model, dataset,
                      collate: Callable[[list], dict], accelerator, optimizer: str):
    """``trial``, run only where the memory plan says its micro-batch fits: for a CPU, where a trial past the RAM
    (or past a container's memory limit) does not raise an error to catch but gets the process killed, or the
    machine swapping. The plan's activations are measured once, on the longest rows; the rest follows from the
    parameters, checkpointing as the model has it. ``None`` where not even one row can be measured.
    """
    from finetune.modeling import is_checkpointing

    activations = measure_activations(model, lambda b: worst_case_batch(dataset, collate, b), accelerator)
    if activations is None:
        return None
    processes = processes_on_this_machine(accelerator.num_processes)

    def planned(model, batch, accelerator) -> bool:
        b = len(batch["labels"])  # texts, whose windows the plan counts under chunks
        plan = plan_memory(model, activations, b, is_checkpointing(model), accelerator.device, optimizer,
                           windows=worst_case_windows(dataset, b), processes=processes)
        return plan.fits and trial(model, batch, accelerator)

    return planned


def any_process_failed(failed: bool, accelerator) -> bool:
    """True on every process if ``failed`` is true on any of them (one small all-reduce)."""
    if accelerator.num_processes == 1:
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def choose_micro_batch(
    model: torch.nn.Module,
    make_batch: Callable[[int], dict[str, torch.Tensor]],
    accelerator,
    effective_batch_size: int,
    start: int,
    trial: Callable[[torch.nn.Module, dict[str, Any], Any], bool] = trial_step,
    planned: bool = False,
) -> tuple[int, int]:
    """Halve the micro-batch from ``start`` until a trial step fits on every process.

    Args:
        model: The unprepared model, on ``accelerator.device``.
        make_batch: ``b -> collated worst-case micro-batch of b samples``.
        accelerator: The run's ``Accelerator``; all its processes must call this.
        effective_batch_size: ``B``; kept exactly.
        start: First ``b`` to try (see :func:`initial_micro_batch`).
        trial: ``(model, batch, accelerator) -> fits``; :func:`trial_step`.
        planned: Whether ``trial`` asks the memory plan first (:func:`plan_before_trial`), for the error's words.

    Returns:
        ``(b, k)`` with ``b * k * P == B``.

    Raises:
        LaunchError: if even ``b = 1`` runs out of memory on some process.
    """
    num_processes = accelerator.num_processes
    b = start
    tried = []
    while True:
        failed = any_process_failed(not trial(model, make_batch(b), accelerator), accelerator)
        tried.append(f"{b} ({'out of memory' if failed else 'fits'})")
        if not failed:
            break
        if b == 1:
            raise LaunchError(_nothing_fits(planned=planned))
        b //= 2
    k = effective_batch_size // (b * num_processes)
    logger.debug(  # the start line gives b and k
        "auto micro-batch: b=%d, k=%d (effective batch %d over %d processes); tried b=%s",
        b, k, effective_batch_size, num_processes, ", ".join(tried),
    )
    return b, k


# Below this many samples a micro-batch leaves a GPU's kernels underfed and pays the per-micro-batch cost
# (kernel launches, the optimizer's share) 2-8x more often; recomputing the forward costs about a third
# more compute. So the automatic micro-batch prefers checkpointing to a micro-batch smaller than this.
USEFUL_MICRO_BATCH = 8


@dataclass(frozen=True)
class Checkpointing:
    """Whether the run recomputes activations (``training.gradient_checkpointing``), and why."""

    on: bool = False
    why: str = "off"

    def describe(self) -> str:
        return f"checkpointing={'on' if self.on else 'off'} ({self.why})"


def fixed_checkpointing(model, setting) -> Checkpointing:
    """``training.gradient_checkpointing`` with a fixed micro-batch: as set; ``auto`` is off (nothing to fit)."""
    from finetune.modeling import set_gradient_checkpointing

    on = setting is True
    set_gradient_checkpointing(model, on)
    return Checkpointing(on, "set" if setting != "auto" else "auto: the micro-batch is set")


def fit_micro_batch(model, train_dataset, collate: Callable[[list], dict], accelerator, batching,
                    checkpointing=False, optimizer: str = "adamw", check: bool = True):
    """``per_device_train_batch_size: auto``: the largest ``b`` that fits with ``B`` unchanged.

    The levers in order: the micro-batch first (the math does not change),
    then, under ``training.gradient_checkpointing: auto``, recomputation when
    the micro-batch that fits without it is below :data:`USEFUL_MICRO_BATCH`
    (or below ``B / P``, when that is smaller) and a larger one fits with it.
    On a CPU, under ``check`` (``training.memory_check``), the memory plan goes
    before each trial (:func:`plan_before_trial`).

    Returns:
        ``(batching, checkpointing)``: the run's :class:`~finetune.accumulation.Batching` with that ``b``
        and the ``k`` that keeps ``B``, and the :class:`Checkpointing` chosen.

    Raises:
        LaunchError: if even ``b = 1`` runs out of memory, with every lever allowed.
    """
    from finetune.modeling import set_gradient_checkpointing, supports_checkpointing

    model.to(accelerator.device)
    trial = functools.partial(trial_step, optimizer=optimizer)
    gated = (plan_before_trial(trial, model, train_dataset, collate, accelerator, optimizer)
             if check and accelerator.device.type == "cpu" else None)
    planned, trial = gated is not None, gated or trial

    def largest(recompute: bool) -> tuple[int, int]:
        set_gradient_checkpointing(model, recompute)
        return choose_micro_batch(model, lambda size: worst_case_batch(train_dataset, collate, size), accelerator,
                                  batching.effective_batch_size, start=batching.per_device_batch_size, trial=trial,
                                  planned=planned)

    if checkpointing != "auto":
        b, k = largest(checkpointing)
        return batching.with_micro_batch(b, k), Checkpointing(checkpointing, "set")
    useful = min(USEFUL_MICRO_BATCH, batching.per_device_batch_size)
    try:
        b, k = largest(False)
    except LaunchError:
        b, k = 0, 0
    if b >= useful:
        return batching.with_micro_batch(b, k), Checkpointing(False, f"auto: b={b} fits without it")
    if not supports_checkpointing(model):
        if not b:
            raise LaunchError(_nothing_fits(f" ({type(model).__name__} has no gradient checkpointing)", planned))
        return batching.with_micro_batch(b, k), Checkpointing(False, f"auto: {type(model).__name__} has none")
    try:
        with_it = largest(True)
    except LaunchError:
        raise LaunchError(_nothing_fits(", with gradient checkpointing too", planned)) from None
    if with_it[0] > b:
        return (batching.with_micro_batch(*with_it),
                Checkpointing(True, f"auto: b={with_it[0]} with it, {b or 'none'} without"))
    set_gradient_checkpointing(model, False)
    return batching.with_micro_batch(b, k), Checkpointing(False, f"auto: b={b} either way")


def _nothing_fits(also: str = "", planned: bool = False) -> str:
    failed = "does not fit in the memory available by the memory plan" if planned else "ran out of memory"
    return (f"training.per_device_train_batch_size: auto found no micro-batch that fits: even b=1 {failed} "
            f"(on at least one process){also}; lower data.max_length, keep 8-bit optimizer state "
            f"(optim.optimizer=adamw_8bit), freeze the lower layers (model.freeze_blocks), train LoRA adapters "
            f"(model.lora_rank=8), or use a larger device")


def fit_in_memory(model, train_dataset, collate: Callable[[list], dict], accelerator, batching, training,
                  max_length: int, optimizer: str = "adamw"):
    """The micro-batch, checkpointing and memory plan of a run: what must fit in memory, decided once.

    ``per_device_train_batch_size: auto`` finds ``b`` (and checkpointing under
    ``auto``) by trial steps (:func:`fit_micro_batch`); a set ``b`` takes
    checkpointing as configured. Either way the memory plan follows, and with
    a set ``b`` (whose fit no trial has checked) it is held to the device's
    memory under ``training.memory_check``.

    Args:
        model: The unprepared model.
        train_dataset: The tokenized training split.
        collate: The training collator.
        accelerator: The run's ``Accelerator``.
        batching: The run's :class:`~finetune.accumulation.Batching`.
        training: The ``training`` section.
        max_length: ``data.max_length``.
        optimizer: ``optim.optimizer``, whose state the trial steps hold room for and the plan counts.

    Returns:
        ``(batching, checkpointing, memory plan)``; the plan is ``None`` under FSDP or DeepSpeed.

    Raises:
        LaunchError: when nothing fits (the automatic micro-batch), or the plan does not (a set one).
    """
    with dropout_as_in_training(model, accelerator, training):
        return _fit_in_memory(model, train_dataset, collate, accelerator, batching, training, max_length, optimizer)


def _fit_in_memory(model, train_dataset, collate, accelerator, batching, training, max_length: int, optimizer: str):
    automatic = training.per_device_train_batch_size == "auto"
    if automatic:
        batching, checkpointing = fit_micro_batch(model, train_dataset, collate, accelerator, batching,
                                                  training.gradient_checkpointing, optimizer,
                                                  check=training.memory_check)
    else:
        checkpointing = fixed_checkpointing(model, training.gradient_checkpointing)
    memory = plan_run_memory(model, train_dataset, collate, accelerator, batching, checkpointing.on,
                             check=training.memory_check and not automatic, max_length=max_length,
                             optimizer=optimizer)
    return batching, checkpointing, memory


def plan_run_memory(model, dataset, collate, accelerator, batching, checkpointing: bool, *, check: bool,
                    max_length: int, optimizer: str = "adamw") -> Optional[MemoryPlan]:
    """The run's :class:`MemoryPlan`, measured on the model on its device; ``None`` under FSDP or DeepSpeed,
    whose shards a whole-model plan would overstate.

    Args:
        model: The unprepared model (moved to ``accelerator.device`` here, as ``prepare`` would).
        dataset: The tokenized training split (its ``length`` column finds the longest rows).
        collate: The training collator.
        accelerator: The run's ``Accelerator``.
        batching: The run's :class:`~finetune.accumulation.Batching`, ``b`` decided.
        checkpointing: Whether the run recomputes activations.
        check: Refuse a plan larger than the device's memory.
        max_length: ``data.max_length``, for the shorter lengths the refusal may suggest.
        optimizer: ``optim.optimizer``.

    Raises:
        LaunchError: when ``check`` and the plan does not fit: one line naming the settings that would.
    """
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return None
    try:
        model.to(accelerator.device)
    except Exception as exc:  # noqa: BLE001 - only running out of memory is told here
        if not is_out_of_memory(exc):
            raise
        raise LaunchError(f"memory: the model's weights ({tensor_bytes(model.parameters()) / GB:.2f}GB) do not fit "
                          f"in {accelerator.device}'s free memory; use a larger device") from None
    activations = measure_activations(model, lambda b: worst_case_batch(dataset, collate, b), accelerator)
    if activations is None:
        return None
    b = batching.per_device_batch_size
    plan = plan_memory(model, activations, b, checkpointing, accelerator.device, optimizer,
                       windows=worst_case_windows(dataset, b),
                       processes=processes_on_this_machine(accelerator.num_processes))
    # every process agrees, as the automatic micro-batch's processes do: one refusing alone would leave the others
    # waiting in prepare's first collective
    if check and any_process_failed(not plan.fits, accelerator):
        levers = levers_that_fit(plan, model, activations, batching, max_length)
        advice = (f"any of these alone would fit: {'; '.join(levers)}" if levers
                  else "no single setting fits: combine a smaller micro-batch, training.gradient_checkpointing=true"
                       " and model.lora_rank=8, or use a larger device")
        raise LaunchError(f"memory: the run needs about {plan.describe().removeprefix('memory=')}; {advice} "
                          f"(training.memory_check=false trains anyway)")
    return plan
