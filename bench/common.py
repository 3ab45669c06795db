"""What every arm of the benchmark shares: the job, the data, the model, the measurements.

Each arm builds its data and model through the package's own loaders
(:func:`finetune.data.load_splits`, :func:`finetune.tokens.tokenize_splits`,
:func:`finetune.modeling.load_model`) from the same YAML config, in the same
order after the same seed as :func:`finetune.assembly.setup_run`, so the
validation split, the token ids and the new head's initial weights are the
same in all arms.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from bench.memprobe import peak_memory  # noqa: F401 (the arms' peak, as the probe's)

REPO = Path(__file__).resolve().parent.parent

# The two jobs of the benchmark: the default SMS spam job and long texts.
DATASETS = {
    "sms": REPO / "configs" / "default.yaml",
    "bbc": REPO / "configs" / "bbc_news.yaml",
}


@dataclass
class ArmSpec:
    """One run of one arm: which job, how it is batched, how long it trains.

    Args:
        arm: ``ours``, ``trainer`` or ``accelerate``.
        dataset: A key of :data:`DATASETS`.
        b: Micro-batch per process.
        k: Accumulation steps.
        max_steps: Updates to make (``None``: the config's epochs).
        precision: ``no`` or ``bf16``.
        overrides: Extra dotted config overrides (levers, or another model or
            data set), applied by every arm that reads the config.
        options: Arm-specific switches (``group_by_length`` for the Trainer).
        threads: CPU threads for torch.
        env: Extra environment variables for the arm's process (settings
            read from the environment only, such as oneDNN's).
    """

    arm: str
    dataset: str
    b: int
    k: int
    max_steps: Optional[int] = None
    precision: str = "no"
    overrides: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)
    threads: int = 1
    env: dict[str, str] = field(default_factory=dict)

    def option(self, name: str) -> Optional[str]:
        """The value of the ``name=<value>`` option (``engine``, ``checkout``), or ``None`` where it is not given."""
        return next((o.split("=", 1)[1] for o in self.options if o.startswith(f"{name}=")), None)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ArmSpec":
        return cls(**json.loads(text))


def job_config(spec: ArmSpec, extra: Optional[list[str]] = None):
    """The package config of the spec's job, with its batching, length and precision applied."""
    from finetune.config import load_config

    overrides = [
        f"training.per_device_train_batch_size={spec.b}",
        f"training.effective_batch_size={spec.b * spec.k}",
        f"training.mixed_precision={spec.precision}",
    ]
    if spec.max_steps is not None:
        overrides += ["training.num_train_epochs=null", f"training.max_steps={spec.max_steps}"]
    return load_config(DATASETS[spec.dataset], overrides + list(spec.overrides) + list(extra or []))


def load_job(cfg):
    """Tokenizer, tokenized splits (with a ``length`` column), labels, model and metrics of a config.

    Seeds first and loads in :func:`finetune.assembly.setup_run`'s order, so the
    new classification head starts from the same weights as the package's run.
    """
    from accelerate.utils import set_seed

    from finetune.data import load_splits
    from finetune.modeling import load_model, load_tokenizer
    from finetune.assembly import metric_suite
    from finetune.tokens import tokenize_splits

    set_seed(cfg.training.seed)
    tokenizer = load_tokenizer(cfg.model)
    splits, labels = load_splits(cfg.data, seed=cfg.training.seed)
    tokenized = tokenize_splits(splits, tokenizer, cfg.data.max_length)
    model = load_model(cfg.model, labels.id2label, max_length=cfg.data.max_length)
    # the package's own decision for `average: auto` (binary F1 of the rarer class on SMS), so that every
    # arm reports the same F1
    metrics = metric_suite(cfg, labels, splits["train"])
    return tokenizer, tokenized, labels, model, metrics


class CountingCollator:
    """Pads like ``DataCollatorWithPadding`` and records the samples and non-pad tokens of each batch.

    Counting here, on the host before the batch moves to the device, costs the
    arm no device sync. Only batches built while :attr:`counting` is true are
    recorded (the training phase, not evaluation).
    """

    def __init__(self, tokenizer, pad_to_multiple_of: Optional[int] = None):
        from transformers import DataCollatorWithPadding

        self.inner = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
        self.counting = False
        self.batches: list[tuple[int, int]] = []

    def __call__(self, features):
        batch = self.inner(features)
        if self.counting:
            self.batches.append((int(batch["input_ids"].shape[0]), int(batch["attention_mask"].sum())))
        return batch

    def consumed(self, micro_batches: Optional[int] = None) -> tuple[int, int]:
        """``(samples, tokens)`` of the first ``micro_batches`` recorded batches (all by default).

        Accelerate's dataloader collates one batch ahead, so a run stopped by a
        step count has built one batch it never trained on: pass how many it used.
        """
        used = self.batches if micro_batches is None else self.batches[:micro_batches]
        return sum(s for s, _ in used), sum(t for _, t in used)


def set_threads(threads: int) -> None:
    """Use ``threads`` CPU threads in this process (the package's CLI does the same from the core count)."""
    import torch

    torch.set_num_threads(max(1, threads))


def host_waits(train: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run ``train`` on a CUDA GPU with torch's synchronisation check on; returns what it returned and, for
    each time the host waited for the GPU (a blocking copy, a value read on the host), the ``file:line``
    of the Python code that waited. ``tests/test_gpu.py`` bounds them, ``python -m bench.probe device``
    counts them."""
    import warnings

    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result, [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def update_seconds(begin: float, ends: list[float]) -> list[float]:
    """Each update's seconds, from the clock times at which the updates ended and the training began."""
    return [b - a for a, b in zip([begin] + ends[:-1], ends)]


def write_result(path: str | os.PathLike, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
