"""AdamW and a learning-rate schedule sized in real optimizer updates.

The schedule's length is the number of updates the run will make, counted on
the prepared (per-process) dataloader: ``ceil(micro-batches / k)`` per epoch,
each epoch with its own ``k`` under ``training.accumulation_schedule``.
Sizing it in micro-batches (or stepping it per micro-batch) would end the
schedule ``k`` times too late; see docs/accumulation.md, rule 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from finetune.accumulation import AccumulationSchedule, updates_per_epoch
from finetune.config import OptimConfig
from finetune.depths import layer_depths
from finetune.errors import ConfigError
from finetune.optimizer_state import BITSANDBYTES, eight_bit_adamw
from finetune.resplit import sharded_state


def _fused_devices() -> list[str]:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:  # a torch that does not say: it has the CUDA kernel at least
        return ["cuda"]
    return list(_get_fused_kernels_supported_devices())


def adamw_kernel(implementation: str, device_type: str) -> dict[str, bool]:
    """The ``fused`` / ``foreach`` arguments of ``torch.optim.AdamW`` for ``optim.implementation``.

    ``auto`` picks the fused kernel wherever torch has one for the device: it
    updates all parameters in one pass instead of a dozen element-wise ops per
    tensor (measured by ``bench/run.py --levers``). Otherwise torch chooses.

    Args:
        implementation: ``auto``, ``fused``, ``foreach`` or ``for_loop``.
        device_type: Where the parameters will be updated (``cpu``, ``cuda``, ...).

    Raises:
        ConfigError: if ``fused`` is forced on a device torch has no fused kernel for.
    """
    if implementation == "auto":
        return {"fused": True} if device_type in _fused_devices() else {}
    if implementation == "fused":
        if device_type not in _fused_devices():
            raise ConfigError(
                f"optim.implementation: this torch has no fused AdamW for {device_type} "
                f"(it has one for {', '.join(_fused_devices())}); use auto"
            )
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    return {"foreach": False, "fused": False}


def check_optimizer(optimizer: str, accelerator) -> None:
    """Refuse, before anything is loaded, an ``optim.optimizer`` this installation or launch cannot run.

    Raises:
        ConfigError: for ``adamw_8bit`` without bitsandbytes, or under FSDP or DeepSpeed (which shard the
            optimizer's state their own way, and under which it is untested).
    """
    import importlib.metadata
    import importlib.util

    from packaging.requirements import Requirement  # not declared: transformers, accelerate and datasets require it

    if optimizer != "adamw_8bit":
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"optim.optimizer: adamw_8bit needs bitsandbytes, which is not installed "
                          f"(pip install '{BITSANDBYTES}')")
    installed = importlib.metadata.version("bitsandbytes")
    if not Requirement(BITSANDBYTES).specifier.contains(installed, prereleases=True):
        raise ConfigError(f"optim.optimizer: adamw_8bit needs {BITSANDBYTES} (its optimizers run on the CPU too), "
                          f"found {installed} (pip install -U '{BITSANDBYTES}')")
    engine = sharded_state(accelerator)
    if engine is not None:
        raise ConfigError(f"optim.optimizer: adamw_8bit under {engine} is not supported; launch with one process "
                          f"or --multi_gpu (DDP)")


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: ``weight_decay`` everywhere but on biases and normalisation weights.

    Empty groups are left out. The benchmark's arms use the same groups.
    """
    no_decay: set[int] = set()
    for module in model.modules():
        # LayerNorm and friends: decaying their scale towards 0 hurts and is not what BERT did
        if isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or "norm" in type(module).__name__.lower():
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            no_decay.add(id(param))
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if id(p) not in no_decay], "weight_decay": weight_decay},
        {"params": [p for p in trainable if id(p) in no_decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, device: Optional[torch.device] = None
) -> torch.optim.Optimizer:
    """AdamW with no weight decay on biases and normalisation weights (:func:`decay_groups`), and with
    ``optim.layer_lr_decay`` a learning rate per depth (:func:`layer_rate_groups`): torch's, or bitsandbytes'
    8-bit one under ``optim.optimizer: adamw_8bit`` (:mod:`finetune.optimizer_state`).

    Args:
        model: The (unprepared) model.
        cfg: The ``optim`` section.
        device: Where the parameters will be trained (the accelerator's
            device); picks the kernel of ``optim.implementation``. Default:
            the device the parameters are on now.
    """
    groups = decay_groups(model, cfg.weight_decay)
    if cfg.layer_lr_decay is not None:
        groups = layer_rate_groups(model, groups, cfg.learning_rate, cfg.layer_lr_decay)
    hyperparameters = {"lr": cfg.learning_rate, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon}
    if cfg.optimizer == "adamw_8bit":
        return eight_bit_adamw(groups, **hyperparameters)
    device_type = torch.device(device).type if device is not None else groups[0]["params"][0].device.type
    return torch.optim.AdamW(groups, **hyperparameters, **adamw_kernel(cfg.implementation, device_type))


def layer_rate_groups(model: torch.nn.Module, groups: list[dict], learning_rate: float, decay: float) -> list[dict]:
    """``groups`` split by depth, each with ``lr = learning_rate * decay ** max(0, L - depth)``.

    The head and the top block train at ``learning_rate``, each block below at
    ``decay`` times the one above, the embeddings at ``decay ** L``. Each
    group keeps its weight decay. transformers' schedulers multiply every
    group's rate by the same factor, so the ratios hold all run long; the
    start line says the rates (:func:`describe_layer_rates`). Written here
    because neither transformers nor accelerate builds such groups.
    """
    depth, blocks = layer_depths(model)
    split = []
    for group in groups:
        by_depth: dict[int, list] = {}
        for param in group["params"]:
            by_depth.setdefault(depth[id(param)], []).append(param)
        for d in sorted(by_depth, reverse=True):
            split.append({**group, "params": by_depth[d], "lr": learning_rate * decay ** max(0, blocks - d),
                          "depth": d})
    return split


def describe_layer_rates(groups: list[dict]) -> str:
    """``head + block 6 0.0001, block 5 9e-05, ..., embeddings 5.31e-05``: the peak rate per depth, top first.

    Empty for groups without depths (``optim.layer_lr_decay`` off). Read from the groups' ``initial_lr``
    (set by the scheduler) where there is one, so that it says the peak rates at any time.
    """
    rates = {group["depth"]: group.get("initial_lr", group["lr"]) for group in groups if "depth" in group}
    if not rates:
        return ""
    head = max(rates)  # one above the top block, which trains at the head's rate (layer_rate_groups)
    rates.pop(head - 1, None)
    names = {0: "embeddings", head: f"head + block {head - 1}"}
    return ", ".join(f"{names.get(d, f'block {d}')} {rate:.3g}" for d, rate in sorted(rates.items(), reverse=True))


@dataclass(frozen=True)
class UpdatePlan:
    """How long the run is, in optimizer updates, epoch by epoch.

    ``k`` is not stored here: the plan was counted with ``schedule`` (the
    run's :class:`~finetune.accumulation.AccumulationSchedule`, the same object
    the run's batching holds) and reads it from there.
    """

    # updates of epoch 0 (of every epoch when k is constant)
    updates_per_epoch: int
    num_epochs: int
    total_updates: int
    warmup_updates: int
    # the k of each epoch, as the updates were counted
    schedule: AccumulationSchedule
    # per epoch: the updates it makes (the last one's may stop short at total_updates)
    epoch_updates: tuple[int, ...] = ()

    def k_at(self, epoch: int) -> int:
        """``k`` of ``epoch``."""
        return self.schedule.k_at(epoch)

    def updates_after(self, done: int, micro_batches_per_epoch: int) -> Iterator[tuple[int, int, int, bool]]:
        """The run's updates after update ``done``, as the loop makes them: ``(step, micro-batch its window ends
        at in its epoch, k, whether it ends its epoch or the run)``; windows of ``k`` micro-batches from each
        epoch's start, its last one ragged."""
        step = 0
        for epoch, updates in enumerate(self.epoch_updates):
            k = self.k_at(epoch)
            for window in range(1, updates + 1):
                step += 1
                if step > self.total_updates:  # max_steps ends the run inside an epoch counted whole
                    return
                micro_batch = min(window * k, micro_batches_per_epoch)
                if step > done:
                    yield step, micro_batch, k, micro_batch >= micro_batches_per_epoch or step == self.total_updates

    @property
    def accumulation(self) -> tuple[int, ...]:
        """``k`` of each epoch of the plan."""
        return tuple(self.k_at(epoch) for epoch in range(self.num_epochs))

    def check_accumulation(self, k: int, epoch: int) -> None:
        """Refuse to train epoch ``epoch`` at ``k`` when the plan counted it at another ``k``.

        An epoch run at another ``k`` makes a different number of updates, so a
        learning-rate schedule sized by this plan would end early or late.

        Raises:
            ValueError: saying how to size the schedule for the ``k`` wanted.
        """
        expected = self.k_at(epoch)
        if expected != k:
            raise ValueError(
                f"epoch {epoch}: the learning-rate scheduler was sized for k={expected} "
                f"({self.total_updates} updates over k={list(self.accumulation)}), but the accelerator accumulates "
                f"{k}. To change k by epoch, size the schedule for it: plan = plan_updates(len(dataloader), "
                f"AccumulationSchedule.from_dict({{0: ..., <epoch>: ...}}), epochs, None); "
                f"build_scheduler(optimizer, cfg.optim, plan); and before each epoch set "
                f"accelerator.gradient_accumulation_steps = plan.k_at(epoch) (a run setup_run built sets it in "
                f"its epochs: for epoch in run.epochs())"
            )


def plan_updates(
    micro_batches_per_epoch: int,
    gradient_accumulation_steps: Union[int, AccumulationSchedule],
    num_train_epochs: Optional[float],
    max_steps: Optional[int],
    warmup_steps: int = 0,
    warmup_ratio: float = 0.0,
) -> UpdatePlan:
    """Count the updates the run will really make.

    Each epoch makes ``ceil(micro-batches / k_e)`` updates with its own ``k_e``;
    the schedule's length is their sum (up to ``max_steps``, or over a
    fractional last epoch). Sizing it with one ``k`` while ``k`` changes would
    end the schedule early or late.

    Args:
        micro_batches_per_epoch: ``len(prepared train dataloader)`` (per process).
        gradient_accumulation_steps: ``k``, or an :class:`~finetune.accumulation.AccumulationSchedule`
            (a run passes its ``batching.schedule``).
        num_train_epochs: Epochs (may be fractional); ``None`` means 1, or as
            many as ``max_steps`` needs.
        max_steps: Total updates, overriding epochs.
        warmup_steps: Warmup in updates; wins over ``warmup_ratio`` when > 0.
        warmup_ratio: Warmup as a fraction of the total updates.
    """
    schedule = (gradient_accumulation_steps if isinstance(gradient_accumulation_steps, AccumulationSchedule)
                else AccumulationSchedule.constant(gradient_accumulation_steps))
    if micro_batches_per_epoch == 0:
        raise ValueError("the training set yields no micro-batch")
    counts: list[int] = []
    if max_steps is not None:
        total = max_steps
        while sum(counts) < max_steps:
            counts.append(updates_per_epoch(micro_batches_per_epoch, schedule.k_at(len(counts))))
    else:
        n = 1.0 if num_train_epochs is None else num_train_epochs
        for epoch in range(math.ceil(n)):
            full = updates_per_epoch(micro_batches_per_epoch, schedule.k_at(epoch))
            counts.append(full if epoch + 1 <= n else math.ceil((n - epoch) * full))
        total = max(1, sum(counts))
    warmup = warmup_steps if warmup_steps > 0 else math.ceil(warmup_ratio * total)
    return UpdatePlan(counts[0], len(counts), total, min(warmup, total), schedule, tuple(counts))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, plan: UpdatePlan):
    """``transformers.get_scheduler`` sized in updates.

    Step it once per update (``train_one_epoch`` does); do not pass it to
    ``accelerator.prepare``, whose wrapper steps it once per process. Pass the
    same ``plan`` to ``train_one_epoch`` so that it refuses an epoch run at a
    ``k`` the schedule was not sized for.
    """
    from finetune.schedules import transformers_schedules

    get_scheduler, _ = transformers_schedules()
    return get_scheduler(
        cfg.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=plan.warmup_updates,
        num_training_steps=plan.total_updates,
        scheduler_specific_kwargs=dict(cfg.lr_scheduler_kwargs),
    )
