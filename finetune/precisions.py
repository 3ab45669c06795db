"""The arithmetic of ``finetune predict``'s and ``finetune score``'s forward passes: ``--precision``."""

from __future__ import annotations

import argparse
from typing import Any, Optional

from finetune.errors import ConfigError

# --precision's values, as training.mixed_precision names them
PRECISIONS = ("no", "bf16", "fp16")


def autocast_dtype(precision: str, device) -> Optional[Any]:
    """The ``torch.dtype`` autocast computes in for ``precision`` on ``device`` (``None``: float32, no autocast).

    Raises:
        ConfigError: for another name, or fp16 off a CUDA GPU (a CPU would emulate it, far slower than float32).
    """
    import torch

    check_precision(precision, "precision")
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"precision fp16: needs a CUDA GPU, the model is on {device.type} (use bf16 or no)")
    return {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def check_precision(precision: str, key: str) -> None:
    """Refuse a name :data:`PRECISIONS` lacks, saying ``key`` (``--precision`` on a command line): before
    torch is imported, so that a command's wrong argument is said at once.

    Raises:
        ConfigError: naming ``key``.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"{key}: must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    """``--precision``, shared by ``predict`` and ``score``."""
    parser.add_argument("--precision", default="no", metavar="{no,bf16,fp16}",
                        help="arithmetic of the forward passes: no (float32, the default), or bf16 or fp16 "
                        "autocast where they compute faster (a CPU with AMX, an AMD one with avx512_bf16, a recent "
                        "GPU), with probabilities that differ from float32's in their last digits")
