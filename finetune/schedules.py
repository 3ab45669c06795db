"""transformers' learning-rate schedules, imported without the log lines of what their module imports.

transformers' scheduler module imports PEFT where it is installed, PEFT imports bitsandbytes where that is (as it
is imported, or, from PEFT 0.22, as it first wraps a model's layers), and bitsandbytes, on a CPU that computes bf16,
looks up a 4-bit matrix-product kernel on the Hub as it is imported
(``kernels-community/quantization-bitsandbytes``). No run of this package uses that kernel (it keeps no 4-bit
weights), yet its lookup logs a warning at every run's start: offline, that the publisher's trust was not checked;
on a CUDA build of torch, that no build of the kernel fits. The import runs with those two libraries' loggers
raised to errors; every other record passes, and their levels are put back after it. A LoRA run (PEFT) and an
8-bit AdamW run import bitsandbytes before any schedule, through :func:`quietly_imported`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from contextlib import contextmanager
from typing import Iterator

# the loggers of the lookup: kernels' Hub client, and bitsandbytes' CPU backend, which logs the lookup's failure
LOOKUP_LOGGERS = ("kernels", "bitsandbytes")


@contextmanager
def quiet_kernel_lookup() -> Iterator[None]:
    """Drop the warnings of bitsandbytes' kernel lookup (and anything else below an error those two libraries log)
    while the block runs."""
    loggers = [logging.getLogger(name) for name in LOOKUP_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def quietly_imported(name: str):
    """The module ``name``, imported inside :func:`quiet_kernel_lookup`: PEFT and bitsandbytes, which a LoRA run
    and an 8-bit AdamW run import before any schedule. With PEFT comes bitsandbytes, where it is installed: PEFT
    imports it later, as it first wraps a model's layers, outside any block of the caller's."""
    with quiet_kernel_lookup():
        module = importlib.import_module(name)
        if name == "peft" and importlib.util.find_spec("bitsandbytes") is not None:
            importlib.import_module("bitsandbytes")
        return module


def transformers_schedules():
    """transformers' ``get_scheduler`` and ``SchedulerType``.

    Imported on first use, not with the package: PEFT and bitsandbytes take seconds to import, which a run whose
    data is refused should not wait for.
    """
    with quiet_kernel_lookup():
        from transformers import SchedulerType, get_scheduler
    return get_scheduler, SchedulerType
