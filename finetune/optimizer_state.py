"""The optimizer's state: what it weighs, and the 8-bit AdamW (``optim.optimizer: adamw_8bit``) that makes it a
quarter.

torch's AdamW keeps two moments per trained weight, each of the weight's dtype: 8 bytes a float32 weight, as
much as the weights and their gradients together. bitsandbytes' 8-bit AdamW (Dettmers et al. 2022, "8-bit
Optimizers via Block-wise Quantization") keeps each moment as one byte per weight and one float32 scale per
block of ``BLOCK`` weights, so about 2 bytes a weight; a tensor under ``MIN_8BIT_SIZE`` elements (a bias, a
norm) keeps float32 moments, where quantizing would save little and cost precision.

The gradient it is given is the one the accumulation contract makes, the big batch's; the update made from it
is AdamW's to the quantization of its moments, so a run with it trains other weights than torch's AdamW, near
them. The memory plan (:mod:`finetune.memory`) and the automatic micro-batch's trial count the state from
:func:`state_bytes`, which a test holds to what the optimizer allocates. Hand-written: neither torch nor
bitsandbytes says what an optimizer's state will weigh before its first step allocates it, and the plan is made
before training.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

# bitsandbytes' default, passed to it explicitly so that the plan counts what the optimizer does
MIN_8BIT_SIZE = 4096
# the block of bitsandbytes' blockwise 8-bit optimizers: one float32 scale per block of each moment
BLOCK = 256
# each 8-bit moment's quantization map (its 256 levels, float32), one copy per tensor
LEVELS = 256
# 0.50 is the first release whose optimizers run on a CPU
BITSANDBYTES = "bitsandbytes>=0.50"


def state_bytes(param: torch.Tensor, optimizer: str) -> int:
    """The bytes of ``optimizer``'s state for one trained ``param`` (``adamw`` or ``adamw_8bit``)."""
    n = param.numel()
    if optimizer == "adamw":
        return 2 * n * param.element_size()
    if n < MIN_8BIT_SIZE:
        return 2 * n * 4
    return 2 * (n + 4 * math.ceil(n / BLOCK) + 4 * LEVELS)


def optimizer_state_bytes(params: Iterable[torch.Tensor], optimizer: str) -> int:
    """The bytes of ``optimizer``'s state for all of ``params`` (each counted as trained)."""
    return sum(state_bytes(p, optimizer) for p in params)


def state_name(optimizer: str) -> str:
    """The memory plan's word for the state: ``adamw`` or ``adamw8bit``."""
    return optimizer.replace("_", "")


def eight_bit_adamw(groups: list[dict], **hyperparameters) -> torch.optim.Optimizer:
    """bitsandbytes' blockwise 8-bit AdamW over ``groups`` (decoupled weight decay, as torch's)."""
    from finetune.schedules import quietly_imported

    bitsandbytes = quietly_imported("bitsandbytes")  # its import looks a 4-bit kernel up on the Hub

    return bitsandbytes.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_SIZE, **hyperparameters)
