"""Precision, decided in one place: what ``training.mixed_precision: auto`` stands for on a device, and the
arithmetic of ``finetune predict``'s and ``finetune score``'s forward passes (``--precision``)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional

from finetune.errors import ConfigError
from finetune.machine import cpu_flags, cpu_vendor

if TYPE_CHECKING:
    import torch

# --precision's values, as training.mixed_precision names them
PRECISIONS = ("no", "bf16", "fp16", "auto")


def resolved_precision(precision: str, device) -> str:
    """``precision`` on ``device``: ``auto`` as training's ``auto`` decides it there (:func:`choose_precision`),
    bf16 where the hardware computes it faster than float32, else ``no``; any other name as it is."""
    return choose_precision("auto", device)[0] if precision == "auto" else precision


def autocast_dtype(precision: str, device) -> Optional[Any]:
    """The ``torch.dtype`` autocast computes in for ``precision`` on ``device`` (``None``: float32, no autocast).

    Raises:
        ConfigError: for another name, or fp16 off a CUDA GPU (a CPU would emulate it, far slower than float32).
    """
    import torch

    check_precision(precision, "precision")
    precision = resolved_precision(precision, device)
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
    parser.add_argument("--precision", default="no", metavar="{no,bf16,fp16,auto}",
                        help="arithmetic of the forward passes: no (float32, the default), or bf16 or fp16 "
                        "autocast where they compute faster (a CPU with AMX, an AMD one with avx512_bf16, a recent "
                        "GPU), with probabilities that differ from float32's in their last digits; auto: bf16 where "
                        "the hardware computes it faster, else float32, as training.mixed_precision: auto decides")


# CPU makers (/proc/cpuinfo's vendor_id) whose AVX-512 bf16 products beat fp32's without AMX: on an AMD EPYC with
# avx512_bf16 the default job trained 1.56x as fast in bf16, where an Intel Xeon whose AMX was hidden (avx512_bf16
# alone) trained 0.63x as fast, its bf16 products slower than its fp32 ones (bench/README.md)
AVX512_BF16_PAYS = ("AuthenticAMD",)


def choose_precision(requested: str, device: torch.device, *, flags: Optional[set[str]] = None,
                     vendor: Optional[str] = None, cuda_bf16: Optional[bool] = None) -> tuple[str, str]:
    """The precision ``training.mixed_precision`` stands for on ``device``, and why.

    ``auto`` is bf16 where the hardware computes bf16 products faster than
    fp32 ones, since there it trains faster at the same accuracy, and fp32
    elsewhere. On a CPU that is one with AMX, or an AMD one with AVX-512's bf16
    instructions; an Intel CPU with those instructions and no AMX (a virtual
    machine whose AMX is hidden) computed its bf16 products no faster than
    fp32 and trained slower in bf16, and a CPU without either emulates bf16,
    much slower. fp16 is never chosen: it needs a loss scaler and is only
    worth it on GPUs without bf16, where it is asked for by name.

    Args:
        requested: ``auto``, ``no``, ``bf16`` or ``fp16``.
        device: Where training runs.
        flags: The CPU's flags (default: :func:`cpu_flags`); for tests.
        vendor: The CPU's maker (default: :func:`cpu_vendor`); for tests.
        cuda_bf16: Whether the GPU supports bf16 (default: ask torch); for tests.

    Returns:
        ``(precision, reason)``, the precision as Accelerate names it (``no``, ``bf16``, ``fp16``).
    """
    if requested != "auto":
        return requested, "training.mixed_precision"
    if device.type == "cuda":
        import torch

        # torch's default counts a GPU that emulates bf16 (a T4, a V100) as supporting it
        native = torch.cuda.is_bf16_supported(including_emulation=False) if cuda_bf16 is None else cuda_bf16
        if native:
            return "bf16", "auto: the GPU computes bf16"
        # not chosen for the user (it needs a loss scaler, and activations can overflow), but named: the
        # tensor cores of a GPU without bf16 (a T4, a V100) compute fp16, not fp32
        return "no", "auto: the GPU has no bf16 units; training.mixed_precision=fp16 runs its fp16 tensor cores"
    if device.type == "cpu":
        return _cpu_precision(cpu_flags() if flags is None else flags, cpu_vendor() if vendor is None else vendor)
    return "no", f"auto: fp32 on {device.type}"


def _cpu_precision(flags: set[str], vendor: str) -> tuple[str, str]:
    if "amx_bf16" in flags:
        return "bf16", "auto: the CPU computes bf16 (amx_bf16)"
    if "bf16" in flags:  # an ARM CPU's bf16 instructions (Graviton 3 and later): not measured
        return "no", ("auto: this CPU's bf16 (an ARM CPU's bf16 instructions) is not measured to train faster than "
                      "fp32; training.mixed_precision=bf16 to try it")
    if "avx512_bf16" not in flags:
        return "no", "auto: the CPU would emulate bf16 (no avx512_bf16, amx_bf16 or bf16 among its flags)"
    if vendor in AVX512_BF16_PAYS:
        return "bf16", "auto: the CPU computes bf16 (avx512_bf16)"
    return "no", (f"auto: this CPU's bf16 (avx512_bf16 without AMX, {vendor or 'maker unknown'}) trains slower "
                  "than fp32; training.mixed_precision=bf16 to use it anyway")
