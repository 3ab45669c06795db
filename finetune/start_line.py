"""The start line: what a run will do, said once before its first update.

Processes and backend, device and threads, the precision and why it was
chosen, the CPU speed-ups in force, the micro-batch cut, ``b``, ``k`` (by
epoch under a schedule), ``P``, the effective batch, and the updates.
"""

from __future__ import annotations

import torch

from finetune.assembly import Run
from finetune.cpu import plan_cpu_speedups, speedup_settings
from finetune.launch import choose_precision
from finetune.optimization import UpdatePlan


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
        f"b={b.per_device_batch_size} k={b.describe_k()} "
        f"P={b.num_processes} effective_batch={b.effective_batch_size} "
        f"train_samples={len(run.train_dataloader.dataset)} updates={run.plan.total_updates} "
        f"({_updates_by_epoch(run.plan)}, warmup {run.plan.warmup_updates})"
    )


def _updates_by_epoch(plan: UpdatePlan) -> str:
    if len(set(plan.epoch_updates)) <= 1:
        return f"{plan.updates_per_epoch}/epoch x {plan.num_epochs} epochs"
    return f"{'+'.join(map(str, plan.epoch_updates))} over {plan.num_epochs} epochs"
