"""A tiny fine-tuning run trained in-process with ``fit``, for the tests of what comes after training."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from helpers import make_texts, save_tiny_model, write_tsv


def reset_accelerate() -> None:
    """Forget Accelerate's singletons, so a run gets its own settings in a shared pytest process."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def tiny_config(root: Path, **sections):
    """Config of a 2-epoch run of the tiny BERT on 150 + 40 generated SMS-like rows (TSV, no header)."""
    from finetune.config import config_from_dict

    model = save_tiny_model(root / "tiny-bert")
    train = write_tsv(root / "train.tsv", make_texts(150, seed=3))
    validation = write_tsv(root / "validation.tsv", make_texts(40, seed=4))
    data = {
        "model": {"name_or_path": str(model)},
        "data": {"train_file": str(train), "validation_file": str(validation), "format": "tsv", "has_header": False,
                 "column_names": ["label", "text"], "max_length": 32},
        # fp32 whatever the CPU: several tests compare runs at float rounding
        "training": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_train_epochs": 2,
                     "seed": 5, "mixed_precision": "no"},
        "optim": {"learning_rate": 1e-2, "warmup_ratio": 0.1},
        "evaluation": {"metrics": ["accuracy", "f1", "matthews_correlation"], "average": "binary",
                       "positive_label": "spam"},
        "logging": {"progress_bar": False},
        "output": {"output_dir": str(root / "out")},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return config_from_dict(data)


def fit_tiny_run(root: Path, before_fit=None, on_update=None, **sections):
    """Train the tiny run with ``fit``; returns ``(config, summary)``. The model is in ``config.output.output_dir``.

    ``before_fit`` is called with the prepared run between ``setup_run`` and ``fit``;
    ``on_update`` is ``fit``'s callback (True ends the run).
    """
    from finetune import fit, setup_run

    cfg = tiny_config(root, **sections)
    with tiny_process():
        run = setup_run(cfg)
        if before_fit is not None:
            before_fit(run)
        summary = fit(run, on_update=on_update)
    return cfg, summary


@contextmanager
def tiny_process():
    """Accelerate's state fresh, and one CPU thread, for a tiny run in the test's process; both given back."""
    import torch

    reset_accelerate()
    threads = torch.get_num_threads()
    # a 32-wide model gains nothing from a second thread, and loses a lot on a busy CPU
    os.environ["FINETUNE_CPU_THREADS"], saved = "1", os.environ.get("FINETUNE_CPU_THREADS")
    try:
        yield
    finally:
        if saved is None:
            del os.environ["FINETUNE_CPU_THREADS"]
        else:
            os.environ["FINETUNE_CPU_THREADS"] = saved
        torch.set_num_threads(threads)
        reset_accelerate()
