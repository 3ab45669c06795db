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


def check_a_layer_setting(root: Path, key: str, layer_class=None, value=True, off=False, **sections) -> None:
    """A ``training`` setting that changes how the model's layers run, not what they hold: its run's start line
    says ``key=on`` (``key=value`` for a setting that is not a switch; a plain run's nothing), its saved model is
    of transformers' own classes (none of ``layer_class``) and holds the plain run's weights (to training
    tolerance), and a config with ``off`` is refused the run's checkpoints, which stay as they were.
    ``sections``: more settings, of both runs (the plain one in ``root / "plain"``)."""
    import re

    import pytest
    import torch
    from transformers import AutoModelForSequenceClassification

    from finetune.errors import ConfigError
    from finetune.output_dir import check_output_dir
    from finetune.start_line import describe

    lines = []
    training = sections.pop("training", {})
    cfg, _ = fit_tiny_run(root, before_fit=lambda run: lines.append(describe(run)), training={**training, key: value},
                          **sections)
    assert f" {key}={'on' if value is True else value} " in lines[0]
    fit_tiny_run(root / "plain", before_fit=lambda run: lines.append(describe(run)), training=training, **sections)
    assert key not in lines[1]
    saved = AutoModelForSequenceClassification.from_pretrained(cfg.output.output_dir)
    if layer_class is not None:  # the class is the run's, not the file's
        assert not any(isinstance(m, layer_class) for m in saved.modules())
    reference = AutoModelForSequenceClassification.from_pretrained(root / "plain" / "out")
    for (name, weight), (_, expected) in zip(saved.state_dict().items(), reference.state_dict().items()):
        if name.endswith("attention.self.key.bias"):
            # its true gradient is 0 (softmax ignores a shift every key shares): each run's is rounding noise,
            # which AdamW's normalisation turns into steps of the learning rate's size, different in each run
            assert weight.abs().max() < 1e-3 and expected.abs().max() < 1e-3
            continue
        torch.testing.assert_close(weight, expected, rtol=1e-4, atol=1e-6, msg=name)
    again = tiny_config(root, output={"resume_from": "latest"}, training={key: off})
    before = sorted(p.name for p in (root / "out" / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match=re.escape(f"training.{key}: {value!r} -> {off!r}")):
        check_output_dir(again)
    assert sorted(p.name for p in (root / "out" / "checkpoints").iterdir()) == before
