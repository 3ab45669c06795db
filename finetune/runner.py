"""Deprecated: the former home of run assembly and fitting, now split by phase.

Each name still imports from here, with a ``DeprecationWarning`` naming its
module now; this alias goes in a later release:

* :mod:`finetune.run`: ``Run`` (a built run); :mod:`finetune.assembly`: ``setup_run`` (building and preparing it);
* :mod:`finetune.start_line`: ``describe``;
* :mod:`finetune.launch`: ``build_accelerator``;
* :mod:`finetune.dataloaders`: collators, the training order, the micro-batch cut;
* :mod:`finetune.output_dir`: the output folder's checks and lock;
* :mod:`finetune.fitting`: ``fit``, the epochs, evaluations and stops;
* :mod:`finetune.results`: what a finished run writes.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = {
    "Run": "finetune.run",
    "setup_run": "finetune.assembly",
    "describe": "finetune.start_line",
    "metric_suite": "finetune.assembly",
    "build_task": "finetune.assembly",
    "build_accelerator": "finetune.launch",
    "BucketPadding": "finetune.dataloaders",
    "build_dataloaders": "finetune.dataloaders",
    "training_sampler": "finetune.dataloaders",
    "balance_micro_batches": "finetune.dataloaders",
    "check_output_dir": "finetune.output_dir",
    "output_lock": "finetune.output_dir",
    "fit": "finetune.fitting",
    "train_epochs": "finetune.fitting",
    "Evaluations": "finetune.fitting",
    "summarize": "finetune.results",
    "save_model": "finetune.results",
    "write_outputs": "finetune.results",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'finetune.runner' has no attribute {name!r}")
    module = _MOVED[name]
    warnings.warn(f"finetune.runner.{name} is now {module}.{name}; finetune.runner goes in a later release",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
