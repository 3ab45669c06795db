"""Resuming a checkpoint on another split of the same effective batch: other ``b``, ``k`` or ``P``.

A job requeued onto fewer GPUs, or onto GPUs with less memory (where
``per_device_train_batch_size: auto`` picks a smaller ``b``), cannot keep the
checkpoint's ``(b, k, P)``. It does not need to: the epoch's sample order
depends on the seed, the epoch and ``B`` alone (:mod:`finetune.sampling`), and
every update applies the mean gradient over its window's samples however
``B`` is split (``docs/accumulation.md``). So the rest of the run makes the
same updates on ``(b', k', P')`` with ``b' * k' * P' = B``, to float rounding:
the windows already trained are skipped as ``k'`` micro-batches each.

What does not carry over bitwise: the float sums (other shapes and reduction
orders) and the random streams (the checkpoint holds one per old process, so
every process is seeded afresh from the seed and the update, which makes such a
resume repeatable). FSDP and DeepSpeed keep sharded state, laid out for the
processes that wrote it, so their checkpoints resume on the same split only.
"""

from __future__ import annotations

from typing import Any, Optional

# The fingerprint keys (finetune.resuming.run_fingerprint) that say how B is split: free to change while
# "effective_batch_size" stays, on an engine without sharded state.
SPLIT_KEYS = frozenset({"processes", "per_device_train_batch_size", "gradient_accumulation_steps", "plan.accumulation"})


def sharded_state(accelerator) -> Optional[str]:
    """The engine whose checkpoints are sharded over the processes (``"FSDP"``, ``"DEEPSPEED"``), or ``None``."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    return kind.value if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED) else None


def may_change_split(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a checkpoint with fingerprint ``saved`` may resume on ``current``'s split: the same ``B`` (which
    checkpoints of earlier releases did not record), and no sharded state on either side."""
    return ("effective_batch_size" in saved and saved["effective_batch_size"] == current["effective_batch_size"]
            and "sharded_state" in saved and saved["sharded_state"] is None and current["sharded_state"] is None)


def split_change(saved: dict[str, Any], current: dict[str, Any]) -> Optional[str]:
    """``"(b, k, P) = (4, 2, 2) -> (4, 4, 1)"`` when the split differs, else ``None``."""
    def split(f: dict[str, Any]) -> tuple:
        return f.get("per_device_train_batch_size"), f.get("gradient_accumulation_steps"), f.get("processes")

    # a key older checkpoints lack (plan.accumulation) is no change
    if all(saved[key] == current.get(key) for key in SPLIT_KEYS if key in saved):
        return None
    return f"(b, k, P) = {split(saved)} -> {split(current)}"


def k_in_epoch(fingerprint: dict[str, Any], epoch: int) -> int:
    """The ``k`` a fingerprint's run accumulated in ``epoch``; past its plan's last epoch (the position of a run
    stopped after its last update), its first epoch's. Only fingerprints that may change their split come here,
    and every such one records the plan's ``k`` per epoch."""
    by_epoch = fingerprint["plan.accumulation"]
    return by_epoch[epoch] if epoch < len(by_epoch) else fingerprint["gradient_accumulation_steps"]


def micro_batch_on_new_split(micro_batch: int, old_k: int, new_k: int, micro_batches_per_process: int) -> int:
    """Where the epoch goes on at ``new_k``: after the same windows the checkpoint's run had trained at ``old_k``.

    ``micro_batch`` is a window boundary, or the epoch's end (after a ragged last window); so is the result.
    """
    windows = -(-micro_batch // old_k)
    return min(windows * new_k, micro_batches_per_process)


def reseed(seed: int, step: int) -> None:
    """Seed every process afresh, from the run's seed and the update, each process its own stream."""
    from accelerate.utils import set_seed

    set_seed(seed + step, device_specific=True)
