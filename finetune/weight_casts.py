"""Autocast's low-precision copies of the weights, made once per update instead of once per micro-batch.

Under bf16 or fp16 autocast each matrix product first casts its fp32 weight
to the low precision. Autocast caches those copies (of leaf tensors that
require a gradient), but empties the cache whenever the outermost autocast
region exits, and Accelerate wraps every forward in a region of its own: so
each micro-batch casts every trainable weight again, ``k`` times per update,
although the weights only change at the update. On a GPU each cast is a
kernel launch, and the launches, not the kernels, bound a base-sized model's
micro-batch.

:class:`WeightCasts` holds one autocast nesting level open from a window's
first micro-batch until just before its update. Autocast then keeps its cache
for the whole window: the copies are made by the window's first forward and
reused by the others. They are the same bits a later micro-batch would have
cast, so the update is bitwise the same (``tests/test_weight_casts.py``).
The open level only keeps the cache; it does not turn autocast on, so the loss
and the backward pass run as before. Each micro-batch's backward still casts
its gradients back to fp32 before adding them up: accumulating in fp32 is
what keeps the sum exact.

Not applied with gradient checkpointing: no layer then saves its weights'
copies for the backward pass, so plain autocast frees them at the end of each
forward, and keeping them through the backward would add their size to the
peak that checkpointing exists to lower. Without checkpointing every layer
saves its copies for its backward anyway, so keeping them between
micro-batches leaves the peak as it was. Not applied under FSDP either (a
kept copy would hold every block's gathered weights at once, which sharding
exists to avoid), or DeepSpeed (whose bf16 mode keeps its own low-precision
weights). torch has no documented handle on autocast's
nesting level; :func:`torch.autocast` itself moves it with
``torch.autocast_increment_nesting`` and ``torch.autocast_decrement_nesting``,
so this module checks for those at run time and casts per micro-batch, as
plain autocast does, where they are gone.
"""

from __future__ import annotations

import torch

_NESTING_API = all(hasattr(torch, name) for name in
                   ("autocast_increment_nesting", "autocast_decrement_nesting", "clear_autocast_cache"))


def casts_once_per_update(accelerator, model, enabled: bool = True) -> bool:
    """Whether the run's autocast copies are kept for a window: asked for, under autocast, without gradient
    checkpointing, on one process or DDP, with torch's nesting counter at hand."""
    from accelerate.utils import DistributedType

    from finetune.modeling import is_checkpointing

    return (enabled and _NESTING_API and accelerator.mixed_precision in ("bf16", "fp16")
            and accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED)
            and not is_checkpointing(accelerator.unwrap_model(model)))


class WeightCasts:
    """Keeps autocast's weight copies from a window's first micro-batch until its update.

    Use it around the loop over micro-batches, so that an exception cannot
    leave the cache open (copies of old weights would then serve the next
    forward)::

        with WeightCasts(active) as casts:
            for each micro-batch:
                at the window's first: casts.keep()
                forward, backward
                at the window's last, before the update: casts.drop()
    """

    def __init__(self, active: bool) -> None:
        self.active = active
        self.kept = False

    def keep(self) -> None:
        """From now on the copies autocast makes stay until :meth:`drop`."""
        if self.active and not self.kept:
            torch.autocast_increment_nesting()
            self.kept = True

    def drop(self) -> None:
        """Forget the copies: call before the weights change."""
        if self.kept:
            torch.autocast_decrement_nesting()
            # also when a caller's own autocast region is still open: its copies are of the old weights too
            torch.clear_autocast_cache()
            self.kept = False

    def __enter__(self) -> "WeightCasts":
        return self

    def __exit__(self, *exc) -> None:
        self.drop()
