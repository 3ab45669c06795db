"""finetune: exact gradient accumulation for BERT-family text classifiers.

Importing the package is cheap and touches no device; the heavy modules load
on first use of their names.

>>> from finetune import train_one_epoch, evaluate_model, load_config, setup_run
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

# bitsandbytes, which PEFT imports wherever it is installed, warns on import on CPUs with bf16 that a 4-bit matrix
# kernel from the Hub is missing: a kernel of its quantized layers, which nothing here calls. That warning alone
# is dropped; the logger's others pass.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda record: "gemm_4bit" not in str(record.msg))

_EXPORTS = {
    "train_one_epoch": "finetune.loop",
    "evaluate_model": "finetune.evaluation",
    "TrainState": "finetune.loop",
    "EpochResult": "finetune.loop",
    "window_loss_scale": "finetune.accumulation",
    "ShardLayout": "finetune.accumulation",
    "resolve_batching": "finetune.accumulation",
    "Batching": "finetune.accumulation",
    "AccumulationSchedule": "finetune.accumulation",
    "cpu_speedups": "finetune.cpu",
    "speedup_settings": "finetune.cpu",
    "graphs_for_run": "finetune.cuda_graphs",
    "Config": "finetune.config",
    "load_config": "finetune.config",
    "setup_run": "finetune.assembly",
    "build_accelerator": "finetune.launch",
    "fit": "finetune.fitting",
    "rehearse": "finetune.rehearsal",
    "Run": "finetune.run",
    "UpdatePlan": "finetune.optimization",
    "plan_updates": "finetune.optimization",
    "build_optimizer": "finetune.optimization",
    "build_scheduler": "finetune.optimization",
    "EpochSampler": "finetune.sampling",
    "FinetuneError": "finetune.errors",
    "Predictor": "finetune.predict",
    "Ensemble": "finetune.ensemble",
    "load_predictor": "finetune.ensemble",
    "score_file": "finetune.score",
    "curves_figure": "finetune.plot",
    "plot_curves": "finetune.plot",
    "compare_figure": "finetune.plot",
    "plot_comparison": "finetune.plot",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'finetune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
