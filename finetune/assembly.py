"""Assembling a run from a :class:`~finetune.config.Config`: everything training needs, built and prepared.

:func:`setup_run` is the one entry (``train.py``, ``fit`` and the notebooks use
it); its steps run in the order that fails cheapest first::

    batching (b, k by epoch, P)      resolve_batching, once: every later step reads it
    tokenizer, model config          before the data is read: a bad model path fails at once
    data, model, what it trains      dataloaders.load_data (and the test set), modeling.load_model_reporting,
                                     modeling.choose_trained_weights (LoRA adapters, frozen layers, or all),
                                     modeling.set_attention_kernel (training.attention_kernel)
    metrics, task                    metric_suite, build_task
    tokens                           dataloaders.tokenize_data (cached), cut as data.truncation says; the words
                                     its tokenizer cannot read counted (dataloaders.count_unknown_words)
    micro-batch, memory              autobatch.fit_in_memory: under auto the same B, a smaller b, a larger k,
                                     and gradient checkpointing when the micro-batch would be too small; then
                                     the memory plan (finetune.memory), refused when a set b cannot fit
    dataloaders, optimizer           dataloaders.build_dataloaders, optimization.build_optimizer
    accelerator.prepare, plan        the update plan counted on the prepared dataloader
    scheduler                        sized in updates, not prepared

What the run will do is said in one line by :func:`finetune.start_line.describe`.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from finetune.accumulation import Batching, accumulate_as, layout_for, resolve_batching
from finetune.autobatch import fit_in_memory
from finetune.config import DEFAULT_THRESHOLD, PER_LABEL, Config
from finetune.dataloaders import (
    batch_padding, build_dataloaders, collator, count_long_texts, count_seen_in_training, count_unknown_words,
    load_data, longest_text, tokenize_data, tokenized_cache_dir,
)
from finetune.errors import ConfigError
from finetune.launch import build_accelerator
from finetune.optimization import UpdatePlan, build_optimizer, build_scheduler, check_optimizer, plan_updates
from finetune.run import Run
from finetune.tasks import (Task, compute_output_in_float32, named_thresholds, start_regression_head,
                            start_thresholds, threshold_refusal)

logger = logging.getLogger("finetune")


def setup_run(cfg: Config, accelerator=None, batching: Optional[Batching] = None) -> Run:
    """Load and prepare everything the config describes.

    Nothing is written to ``output.output_dir`` here, so a bad data file or
    model path fails before any earlier output is touched. Every check that
    can reject the input runs before tokenization, which takes minutes on a
    large data set: the model's path and position limit even before the data
    is read.

    Args:
        cfg: A validated config (see :func:`finetune.config.load_config`).
        accelerator: An existing ``Accelerator``; built with
            :func:`~finetune.launch.build_accelerator` when ``None``. Its
            ``gradient_accumulation_steps`` is set from the run's batching.
        batching: The run's batching, when the caller resolved it already (``train.py`` does, to
            refuse a batch the launched processes cannot split before anything is built);
            resolved here from ``cfg`` when ``None``.

    Returns:
        A :class:`Run` whose model, optimizer and dataloaders are prepared.

    Raises:
        ConfigError: for a config this data, model or accelerator cannot run.
    """
    from accelerate.utils import set_seed

    from finetune.data import content_sha256
    from finetune.modeling import (check_compiler, choose_trained_weights, load_model_config,
                                   load_model_reporting, load_tokenizer, set_attention_kernel, set_forward,
                                   trained_head_labels)

    accelerator = accelerator or build_accelerator(cfg)
    batching = check_batching(cfg, accelerator, batching)
    check_compiler(cfg.training.torch_compile, accelerator.device)
    check_optimizer(cfg.optim.optimizer, accelerator)
    set_seed(cfg.training.seed)
    tokenizer = load_tokenizer(cfg.model)
    model_config = load_model_config(cfg.model, cfg.data.max_length)
    cache_dir = tokenized_cache_dir(cfg)
    splits, labels, test = load_data(cfg, accelerator, head=trained_head_labels(model_config))
    check_validation_is_there(cfg, splits)
    data_sha256 = content_sha256(splits["train"])  # what a resume checks; the token cache's key reuses it
    seen = count_seen_in_training(splits)
    model, new_head = load_model_reporting(cfg.model, labels.id2label, max_length=cfg.data.max_length)
    head_start = start_regression_head(cfg.model, model, new_head, splits["train"])
    compute_output_in_float32(model)  # a regression model's output is its prediction: not rounded to bf16
    model, lora, frozen = choose_trained_weights(model, cfg.model, accelerator)  # before the memory plan
    set_attention_kernel(model, cfg.training, accelerator, cfg.data.max_length)  # before the plan measures it
    metrics = metric_suite(cfg, labels, splits["train"])
    task = build_task(cfg, labels, splits, device=accelerator.device)
    start_thresholds(model.config, labels.names, task)
    tokenized = tokenize_data(cfg, splits, tokenizer, accelerator, cache_dir, row_digests={"train": data_sha256})
    cut = count_long_texts(cfg, tokenized["train"])
    unknown = count_unknown_words(tokenizer, splits, tokenized, accelerator)
    longest = longest_text(tokenized["train"])
    padding = batch_padding(cfg, model_config, longest)
    probe = collator(tokenizer, accelerator, cfg, longest=longest, fixed=padding.length)
    batching, checkpointing, memory = fit_in_memory(model, tokenized["train"], probe,
                                                    accelerator, batching, cfg.training, cfg.data.max_length,
                                                    optimizer=cfg.optim.optimizer)
    accumulate_as(accelerator, batching, epoch=0)  # before prepare: DeepSpeed reads k there
    set_forward(model, cfg.training, accelerator)
    train_dl, eval_dl = build_dataloaders(cfg, tokenized, tokenizer, accelerator, batching, checkpointing.on,
                                          padding.length)
    optimizer = build_optimizer(model, cfg.optim, device=accelerator.device)
    model, optimizer, train_dl, eval_dl = prepare(accelerator, model, optimizer, train_dl, eval_dl)
    plan = plan_for(cfg, train_dl, accelerator, batching)
    # Not prepared (its wrapper steps P times per call), nor registered for checkpointing:
    # finetune.checkpoint saves it and reads it back with weights_only=True.
    scheduler = build_scheduler(optimizer, cfg.optim, plan)
    # Training's own random draws (dropout) start from the seed itself, not from wherever setup
    # left the generators: the new head's initialisation draws a number that depends on the label
    # count and the architecture. So one seed gives one dropout stream whatever the model, as with
    # the Trainer, which seeds after the model is built. A resumed run restores its checkpointed
    # generators over this one (finetune.checkpoint).
    set_seed(cfg.training.seed)
    return Run(cfg, accelerator, batching, tokenizer, labels, model, optimizer, scheduler, train_dl, eval_dl,
               metrics, plan, task, data_sha256, new_head=new_head,
               checkpointing=checkpointing, lora=lora, frozen=frozen, memory=memory, long_texts=cut,
               unknown_words=unknown,
               seen_in_training=seen, head_start=head_start, test=test, padding=padding)


def check_validation_is_there(cfg: Config, splits) -> None:
    """Refuse a key that needs validation texts where the run has none: thresholds chosen on them
    (``evaluation.threshold: per_label``), and the keys that compare their evaluations (the best model, early
    stopping), which would otherwise do nothing, unsaid.

    Raises:
        ConfigError: naming the first such key that is set.
    """
    needed = cfg.evaluation.needing_validation()
    if "validation" in splits or not needed:
        return
    if needed[0] == "threshold":
        needs = "threshold: per_label chooses thresholds on the validation texts"
    else:
        needs = f"{needed[0]}: compares evaluations on the validation texts"
    raise ConfigError(f"evaluation.{needs}, and this run has none (data.validation_split is 0 and no validation "
                      "file is given)", hint="data.validation_split=0.1 holds out a tenth of the training rows, or "
                                              "give a validation file (--validation FILE)")


def check_batching(cfg: Config, accelerator, batching: Optional[Batching] = None) -> Batching:
    """The run's :class:`~finetune.accumulation.Batching` (``b``, ``k`` by epoch, ``P``): ``batching`` when
    given, else decided here, once.

    Raises:
        ConfigError: if the config's batch cannot be split over the processes, or the ``Accelerator``
            already accumulates another ``k`` (given to ``Accelerator`` or to ``accelerate launch``).
        ValueError: if ``batching`` was resolved for another number of processes than the accelerator's.
    """
    if batching is None:
        batching = resolve_batching(cfg.training, accelerator.num_processes)
    elif batching.num_processes != accelerator.num_processes:
        raise ValueError(f"the batching was resolved for {batching.num_processes} processes, the Accelerator "
                         f"has {accelerator.num_processes}")
    given = accelerator.gradient_accumulation_steps
    if given not in (1, batching.gradient_accumulation_steps):
        raise ConfigError(
            f"training.gradient_accumulation_steps: the Accelerator accumulates {given} steps (from its "
            f"gradient_accumulation_steps or accelerate launch --gradient_accumulation_steps), the config "
            f"{batching.gradient_accumulation_steps}; set k in the config only"
        )
    return batching


def metric_suite(cfg: Config, labels, train_split):
    """The validation metrics of the problem type, with ``evaluation.average: auto`` decided.

    For single labels ``auto`` looks at the training labels (binary for two
    classes, positive the rarer); for multi-label it is micro. The decision is
    logged and written back into ``cfg``, so ``config.yaml`` (and
    ``finetune.score`` after it) says what the run computed.
    """
    from finetune.data import class_counts
    from finetune.metrics import metric_suite_for, resolve_average

    evaluation = cfg.evaluation
    counts = class_counts(train_split, len(labels.names)) if labels.problem_type == "single_label" else None
    if evaluation.average == "auto" and labels.problem_type == "multi_label":
        evaluation.average = "micro"
        logger.debug("evaluation.average: auto -> micro (multi_label)")  # the start line says it
    elif evaluation.average == "auto" and labels.problem_type == "single_label":
        average, positive = resolve_average(evaluation, labels.names, counts)
        why = "evaluation.positive_label" if evaluation.positive_label else "the rarer of two"
        logger.debug("evaluation.average: auto -> %s",  # the start line says it
                    f"binary, positive class {positive!r} ({why})" if average == "binary" else average)
        evaluation.average, evaluation.positive_label = average, positive
    return metric_suite_for(evaluation, labels.names, labels.problem_type, counts)


def build_task(cfg: Config, labels, splits, device=None) -> Task:
    """The run's :class:`~finetune.tasks.Task`: its problem type, ``training.label_smoothing``, and
    ``evaluation.threshold`` (a multi-label model's, or a two-class model's on its positive class), with
    ``training.class_weights`` resolved from the training split of ``splits`` (on ``device``, so that the loss
    moves nothing to the device in each step). Call it after :func:`metric_suite`, which resolves the positive
    class.

    Raises:
        ConfigError: if a class weight names a label the training data does not have, or a threshold is set for a
            model of more than two classes (thresholds tuned on validation texts the run does not have are
            refused earlier, by :func:`check_validation_is_there`).
    """
    spec, smoothing, threshold = cfg.training.class_weights, cfg.training.label_smoothing, cfg.evaluation.threshold
    if labels.problem_type == "multi_label":
        if threshold == PER_LABEL:  # for the F1 the run averages (auto: micro, as metric_suite decides)
            average = cfg.evaluation.average
            return Task("multi_label", tune_thresholds="micro" if average == "auto" else average)
        if isinstance(threshold, dict):
            threshold, _ = _named_thresholds(threshold, labels)
        return Task("multi_label", threshold=threshold)
    if labels.problem_type == "regression":
        return Task("regression")
    decision = _positive_class_decision(cfg, labels, splits["train"])
    return Task("single_label", class_weights(spec, labels.names, splits["train"], device),
                label_smoothing=smoothing, **decision)


def _positive_class_decision(cfg: Config, labels, train_split) -> dict:
    """A two-class run's threshold on its positive class (``Task``'s arguments; none: the most probable class):
    ``evaluation.positive_label``, resolved by :func:`metric_suite` under binary averaging, else the rarer class
    in the training data (the second on a tie), as ``average: auto`` would take it.

    Raises:
        ConfigError: for a threshold set for more than two classes.
    """
    from finetune.data import class_counts

    threshold, names = cfg.evaluation.threshold, list(labels.names)
    if threshold == DEFAULT_THRESHOLD:  # the most probable of two classes is the one over 0.5
        return {}
    if isinstance(threshold, dict):  # on the class it names
        threshold, positive = _named_thresholds(threshold, labels)
        return {"threshold": threshold, "positive_class": positive}
    refusal = threshold_refusal("single_label", names)
    if refusal is not None:
        raise ConfigError(f"evaluation.threshold: {refusal}")
    positive = cfg.evaluation.positive_label
    if positive is None:
        counts = class_counts(train_split, 2).tolist()
        positive = names[1] if counts[1] <= counts[0] else names[0]
    elif positive not in names:  # binary averaging checked it; under another, only the threshold reads it
        raise ConfigError(f"evaluation.positive_label: {positive!r} is not a label of the training data "
                          f"({', '.join(names)})")
    logger.debug("evaluation.threshold: %s on %r", threshold, positive)  # the start line says it
    if threshold == PER_LABEL:
        return {"tune_thresholds": "binary", "positive_class": names.index(positive)}
    return {"threshold": float(threshold), "positive_class": names.index(positive)}


def _named_thresholds(given: dict[str, float], labels) -> tuple:
    """``evaluation.threshold``'s mapping by label name as the run's :class:`Task` takes it
    (:func:`finetune.tasks.named_thresholds`).

    Raises:
        ConfigError: for a name that is not a label of the data, or a mapping the labels cannot take.
    """
    try:
        return named_thresholds(given, labels.problem_type, list(labels.names))
    except ValueError as exc:
        raise ConfigError(f"evaluation.threshold: {exc}") from None


def class_weights(spec, names: Sequence[str], train_split, device=None) -> Optional[torch.Tensor]:
    """``training.class_weights`` (``spec``: ``balanced``, or weights by label name, 1 for a label not named)
    as one float32 weight per class id, on ``device``; None for none.

    Raises:
        ConfigError: if a class weight names a label the training data does not have.
    """
    from finetune.data import class_counts
    from finetune.tasks import balanced_weights

    if spec is None:
        return None
    names = list(names)
    if spec == "balanced":
        weights = balanced_weights(class_counts(train_split, len(names)).tolist())
    else:
        unknown = [name for name in spec if name not in names]
        if unknown:
            raise ConfigError(f"training.class_weights: {unknown[0]!r} is not a label of the training data "
                              f"({', '.join(names[:10])}{', ...' if len(names) > 10 else ''})")
        weights = [float(spec.get(name, 1.0)) for name in names]
    # the start line says it
    logger.debug("training.class_weights: %s", ", ".join(f"{n}={w:.4g}" for n, w in zip(names, weights)))
    return torch.tensor(weights, dtype=torch.float32, device=device)


def prepare(accelerator, model, optimizer, train_dl, eval_dl):
    """Everything but the scheduler through ``accelerator.prepare``; ``eval_dl`` may be ``None``."""
    if eval_dl is None:
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
        return model, optimizer, train_dl, None
    return accelerator.prepare(model, optimizer, train_dl, eval_dl)


def plan_for(cfg: Config, train_dl, accelerator, batching: Batching) -> UpdatePlan:
    """The run's length in updates, counted on the prepared (per-process) training dataloader."""
    layout = layout_for(train_dl, accelerator)
    return plan_updates(
        layout.micro_batches_per_process,
        batching.schedule,
        cfg.training.num_train_epochs,
        cfg.training.max_steps,
        cfg.optim.warmup_steps,
        cfg.optim.warmup_ratio,
    )
