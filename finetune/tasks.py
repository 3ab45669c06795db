"""Problem types: what a label is, the per-sample loss, what a prediction is, and where a new regression head starts.

===============  ====================  ==================================================  ======================
problem type     label of a text       per-sample loss ``l_i`` (float32)                   prediction
===============  ====================  ==================================================  ======================
single_label     one class id          ``w[y_i] * CE_e(z_i, y_i)`` (``w`` = 1 without      ``argmax z_i``; two
                                       class weights; ``CE_e`` against targets smoothed    classes at a threshold:
                                       by ``e``, plain CE at ``e`` = 0)                    ``softmax(z_i)_c > t``
                                                                                           ? ``c`` : the other
multi_label      a 0/1 vector over     ``mean_j BCE(z_ij, y_ij)``: the mean over the L      ``sigmoid(z_ij) > t_j``
                 the L labels          labels, as transformers' ``BCEWithLogitsLoss``      (finetune.thresholds)
regression       a number              ``(z_i - y_i) ** 2``, as transformers' ``MSELoss``  ``z_i``
===============  ====================  ==================================================  ======================

Every update applies the gradient of ``(1/N_w) * sum_i l_i`` over its window's
``N_w`` real samples, whatever ``b``, ``k`` and ``P`` (docs/accumulation.md):
the loop only sums ``l_i`` over a micro-batch's real rows. With class weights
that is the *sample* mean of weighted losses, not PyTorch's
``CrossEntropyLoss(weight=w)``, which divides by ``sum_i w[y_i]``: that
denominator depends on the labels of the whole window, so a micro-batch could
not be scaled before the window is seen, and it changes from window to window
with the label mix. ``training.class_weights: balanced`` sets
``w_c = n / (C * n_c)`` (scikit-learn's "balanced"), whose mean over the
training samples is 1, so the loss keeps its scale.

A caller's own loss (``train_one_epoch(loss_fn=...)``) has the same shape:
``loss_fn(logits, labels) -> per-sample losses``, a 1-D tensor of ``b`` values
that does not reduce over the batch.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from finetune.schema import DEFAULT_THRESHOLD
from finetune.thresholds import guarded_f1_thresholds

PROBLEM_TYPES = ("single_label", "multi_label", "regression")
# what transformers' PretrainedConfig.problem_type calls each (its pipelines read it)
TRANSFORMERS_PROBLEM_TYPES = {
    "single_label": "single_label_classification",
    "multi_label": "multi_label_classification",
    "regression": "regression",
}

# the attribute of a saved model's config that holds its thresholds, {label name: threshold}: every label's
# (multi_label), or the positive class's (single_label of two classes); finetune.thresholds
CONFIG_THRESHOLDS = "label_thresholds"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def label_names(model_config) -> list[str]:
    """A model's label names in label-id order (its config's ``id2label``)."""
    return [model_config.id2label[i] for i in range(model_config.num_labels)]


def model_labels(output_dir) -> tuple[list[str], str]:
    """A saved model's label names in label-id order, and its problem type, from its ``config.json`` alone (the
    weights stay unread: what a command checks against them is said at once).

    Raises:
        ModelError: if ``output_dir`` holds no model config, or one transformers cannot read.
    """
    config = saved_model_config(output_dir)
    return label_names(config), problem_type_of(config)


def saved_model_config(output_dir):
    """A saved model's transformers config (its ``config.json``), without its weights.

    Raises:
        ModelError: if ``output_dir`` holds no model config, or one transformers cannot read.
    """
    from transformers import AutoConfig

    from finetune.errors import ModelError
    from finetune.outputs import require_saved_model

    path = require_saved_model(output_dir)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:  # not JSON, an unknown model_type: as loading the model says it
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelError(f"{path}: cannot load the model's config: {first}") from None


def problem_type_of(model_config) -> str:
    """The short problem type of a transformers config (single_label when it says none)."""
    long = getattr(model_config, "problem_type", None) or "single_label_classification"
    for short, name in TRANSFORMERS_PROBLEM_TYPES.items():
        if name == long:
            return short
    raise ValueError(f"unknown problem_type {long!r} in the model's config")


@dataclass(frozen=True)
class Task:
    """A problem type with its loss and its predictions.

    Args:
        problem_type: single_label, multi_label or regression.
        class_weights: single_label only: one weight per class id (float32), or ``None``.
        label_smoothing: single_label only: ``e`` of the smoothed targets (torch's ``label_smoothing``).
        threshold: multi_label: the sigmoid probability above which a label is predicted, one for every
            label or one per label (in label-id order). single_label with a ``positive_class``: the softmax
            probability of that class above which it is predicted (else the other class).
        tune_thresholds: the F1 whose threshold an evaluation chooses on its texts, in place of ``threshold``
            (``evaluation.threshold: per_label``, :func:`finetune.thresholds.guarded_f1_thresholds`): for multi_label
            the averaging (``micro``, ``macro`` or ``weighted``), for single_label ``binary`` (the positive
            class's F1); ``None``: ``threshold`` it is.
        positive_class: single_label of two classes only: the class id ``threshold`` decides on; ``None``: the
            most probable class is predicted.
    """

    problem_type: str = "single_label"
    class_weights: Optional[torch.Tensor] = None
    threshold: Union[float, tuple[float, ...]] = DEFAULT_THRESHOLD
    label_smoothing: float = 0.0
    tune_thresholds: Optional[str] = None
    positive_class: Optional[int] = None

    def __post_init__(self) -> None:
        if self.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"problem_type must be one of {', '.join(PROBLEM_TYPES)}, got {self.problem_type!r}")
        if self.class_weights is not None and self.problem_type != "single_label":
            raise ValueError("class weights apply to single_label only")
        if self.label_smoothing and self.problem_type != "single_label":
            raise ValueError("label smoothing applies to single_label only")
        if self.positive_class is not None and self.problem_type != "single_label":
            raise ValueError("a positive class applies to single_label only")
        if self.tune_thresholds and not self.thresholded:
            raise ValueError("tuned thresholds apply to multi_label, and to single_label with a positive class")

    @classmethod
    def of_model(cls, model) -> "Task":
        """The task a model's config declares (:func:`decision_task`), without class weights."""
        return decision_task(model.config)

    @property
    def thresholded(self) -> bool:
        """Whether a threshold decides the predictions (multi_label, or two classes with a positive one)."""
        return self.problem_type == "multi_label" or self.positive_class is not None

    def thresholded_labels(self, names: Sequence[str]) -> list[str]:
        """The names of the labels a threshold decides on: every label (multi_label), the positive class, or
        none."""
        if self.problem_type == "multi_label":
            return list(names)
        return [names[self.positive_class]] if self.positive_class is not None else []

    def thresholds_by_label(self, names: Sequence[str]) -> dict[str, float]:
        """``{label: threshold}`` for :meth:`thresholded_labels`; empty where none decides."""
        chosen = self.thresholded_labels(names)
        given = self.threshold if isinstance(self.threshold, tuple) else (self.threshold,) * len(chosen)
        return {name: float(t) for name, t in zip(chosen, given)}

    def per_sample_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``l_i`` for each row, in float32 (see the table above)."""
        logits = logits.float()
        if self.problem_type == "single_label":
            loss = F.cross_entropy(logits, labels, reduction="none", label_smoothing=self.label_smoothing)
            if self.class_weights is not None:
                loss = loss * self.class_weights.to(loss.device)[labels]
            return loss
        if self.problem_type == "multi_label":
            return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(-1)
        return (logits.squeeze(-1) - labels.float()) ** 2

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """Class ids, 0/1 label vectors, or numbers (see the table above)."""
        if self.problem_type == "single_label" and self.positive_class is None:
            return logits.argmax(-1)
        if self.problem_type == "single_label":
            positive, other = self.positive_class, 1 - self.positive_class
            over = torch.softmax(logits.float(), dim=-1)[:, positive] > float(self.threshold)
            return torch.where(over, positive, other)
        if self.problem_type == "multi_label":
            threshold = torch.as_tensor(self.threshold, dtype=torch.float32, device=logits.device)
            return (torch.sigmoid(logits.float()) > threshold).long()
        return logits.float().squeeze(-1)

    def decide(self, probabilities: np.ndarray) -> np.ndarray:
        """What :meth:`predictions` gives, from the texts' :meth:`probabilities` as a NumPy array."""
        if self.problem_type == "single_label" and self.positive_class is None:
            return probabilities.argmax(-1)
        return self.at_thresholds(probabilities, np.atleast_1d(np.asarray(self.threshold, dtype=np.float64)))

    def at_thresholds(self, probabilities: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
        """What :meth:`predictions` gives at ``thresholds`` (one per :meth:`thresholded_labels`), from the
        texts' :meth:`probabilities` as a NumPy array."""
        if self.problem_type == "multi_label":
            return (probabilities > thresholds).astype(np.int64)
        positive = self.positive_class
        return np.where(probabilities[:, positive] > thresholds[0], positive, 1 - positive).astype(np.int64)

    def tuned_thresholds(self, probabilities: np.ndarray, references: np.ndarray) -> np.ndarray:
        """The thresholds (one per :meth:`thresholded_labels`) that maximise the F1 of ``tune_thresholds`` on
        these texts, where that beats 0.5 on nearly every resample of them, else 0.5
        (:func:`finetune.thresholds.guarded_f1_thresholds`); ``references``: their labels."""
        if self.problem_type == "multi_label":
            return guarded_f1_thresholds(probabilities, references, self.tune_thresholds)
        positive = self.positive_class  # its F1 alone: one label, a yes or no
        return guarded_f1_thresholds(probabilities[:, [positive]], (references == positive)[:, None], "macro")

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Each class's probability (softmax) or each label's (sigmoid), in float32: what the ranking metrics
        (ROC AUC, average precision) order the texts by."""
        if self.problem_type == "single_label":
            return torch.softmax(logits.float(), dim=-1)
        if self.problem_type == "multi_label":
            return torch.sigmoid(logits.float())
        raise ValueError("a regression model gives numbers, not probabilities")


def model_thresholds(model_config, labels: Sequence[str]) -> Optional[tuple[float, ...]]:
    """The thresholds a saved model's config carries (``label_thresholds``), in the order of ``labels``; None
    where it carries none (a model trained before they were saved, or elsewhere) or not one for every label."""
    saved = getattr(model_config, CONFIG_THRESHOLDS, None)
    if not isinstance(saved, dict) or any(name not in saved for name in labels):
        return None
    return tuple(float(saved[name]) for name in labels)


def label_thresholds(model_config, labels: Sequence[str], given=None) -> tuple[float, ...]:
    """A multi-label model's thresholds in the order of ``labels``: ``given`` (one number for every label, or
    one per label), else those its config carries (:func:`model_thresholds`), else the default for every label."""
    if given is None:
        return model_thresholds(model_config, labels) or (DEFAULT_THRESHOLD,) * len(labels)
    if isinstance(given, numbers.Real):  # a NumPy number too
        return (float(given),) * len(labels)
    if len(given) != len(labels):
        raise ValueError(f"{len(given)} thresholds for {len(labels)} labels")
    return tuple(float(t) for t in given)


def positive_threshold(model_config) -> Optional[tuple[int, float]]:
    """A two-class single-label model's positive class id and its threshold, where its config carries one
    (``label_thresholds`` naming one of its two labels); None where it predicts its most probable class."""
    saved = getattr(model_config, CONFIG_THRESHOLDS, None)
    names = label_names(model_config)
    if len(names) != 2 or not isinstance(saved, dict) or len(saved) != 1 or next(iter(saved)) not in names:
        return None
    name, threshold = next(iter(saved.items()))
    return names.index(name), float(threshold)


def decision_task(model_config, threshold=None, positive_label: Optional[str] = None) -> Task:
    """The task of a saved model as its config declares it (``problem_type``), predicting as the run left it: a
    multi-label model at its thresholds, a two-class one at its positive class's where it carries one
    (``label_thresholds``), else at its most probable class. ``threshold``, where given, replaces them: a
    number (or one per label, multi_label); for two classes it decides on the class the config names, else
    ``positive_label``, else the second class (id 1, as scikit-learn's ``pos_label=1``); or a mapping
    ``{label name: threshold}`` (:func:`named_thresholds`), where a multi-label model's labels not named keep
    theirs.

    Raises:
        ValueError: for a threshold given to a regression model or one of more than two classes, a
            ``positive_label`` that is not one of its labels, or a mapping :func:`named_thresholds` refuses.
    """
    kind, names = problem_type_of(model_config), label_names(model_config)
    if isinstance(threshold, dict):  # a multi-label model's labels not named keep its own
        own = label_thresholds(model_config, names) if kind == "multi_label" else None
        named, positive = named_thresholds(threshold, kind, names, own)
        return Task(kind, threshold=named, positive_class=positive)
    if kind == "multi_label":
        return Task(kind, threshold=label_thresholds(model_config, names, threshold))
    saved = positive_threshold(model_config) if kind == "single_label" else None
    if threshold is None:
        return Task(kind) if saved is None else Task(kind, threshold=saved[1], positive_class=saved[0])
    refuse_threshold(threshold, kind, names)
    if saved is None and positive_label is not None and positive_label not in names:
        raise ValueError(f"positive label {positive_label!r} is not one of the model's labels ({', '.join(names)})")
    positive = saved[0] if saved is not None else names.index(positive_label) if positive_label is not None else 1
    return Task(kind, threshold=float(threshold), positive_class=positive)


def named_thresholds(given: dict[str, float], problem_type: str, names: Sequence[str],
                     others: Optional[Sequence[float]] = None) -> tuple[Union[float, tuple], Optional[int]]:
    """Thresholds given by label name (``evaluation.threshold: {toxic: 0.3}``, ``finetune predict --threshold``)
    as a :class:`Task` takes them, ``(threshold, positive_class)``: a multi-label model's one per label in the
    order of ``names`` (a label not named keeps its threshold of ``others``, else :data:`DEFAULT_THRESHOLD`) and
    no positive class; a two-class model's one threshold and the class it decides on, the one named.

    Raises:
        ValueError: for a name that is not one of ``names``, both of two classes named, or a model of another
            kind (:func:`threshold_refusal`).
    """
    refusal = threshold_refusal(problem_type, names)
    if refusal is not None:
        raise ValueError(refusal)
    unknown = [name for name in given if name not in names]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not one of the labels ({', '.join(names[:12])}"
                         f"{', ...' if len(names) > 12 else ''})")
    if problem_type == "multi_label":
        others = others or (DEFAULT_THRESHOLD,) * len(names)
        return tuple(float(given.get(name, other)) for name, other in zip(names, others)), None
    if len(given) != 1:  # p(a) > t is p(b) < 1 - t: a second number could only repeat or contradict the first
        raise ValueError(f"two classes are decided by one threshold, on one of them: {{{names[1]}: T}}, not "
                         f"one for each of {', '.join(given)}")
    (name, threshold), = given.items()
    return float(threshold), list(names).index(name)


def refuse_threshold(threshold, problem_type: str, names: Sequence[str]) -> None:
    """Raise where ``threshold`` (a number, or by label name) cannot decide a model of ``problem_type`` with these
    labels (``names``): :func:`threshold_refusal`'s words, or :func:`named_thresholds`'.

    Raises:
        ValueError: saying why.
    """
    if isinstance(threshold, dict):
        named_thresholds(threshold, problem_type, names)
        return
    refusal = threshold_refusal(problem_type, names)
    if refusal is not None:
        raise ValueError(refusal)


def threshold_refusal(problem_type: str, names: Sequence[str]) -> Optional[str]:
    """Why a decision threshold cannot apply to a model of ``problem_type`` with these labels (``names``), in
    words an error goes on with; None where one applies: multi-label models, and single-label ones of two classes.
    The run, ``finetune predict`` and ``finetune score`` refuse a threshold in these same words."""
    if problem_type == "multi_label" or (problem_type == "single_label" and len(names) == 2):
        return None
    answer = "a number" if problem_type == "regression" else \
        f"its most probable of {len(names)} classes ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
    return (f"applies to multi_label models and to single_label ones of two classes; this one is {problem_type}, "
            f"which predicts {answer}")


def set_model_thresholds(model_config, labels: Sequence[str], thresholds: Sequence[float]) -> None:
    """Put ``thresholds`` (in the order of ``labels``) in the model's config, where saving it writes them."""
    setattr(model_config, CONFIG_THRESHOLDS, {name: float(t) for name, t in zip(labels, thresholds)})


def start_thresholds(model_config, names: Sequence[str], task: Task) -> None:
    """A run's model starts with the thresholds it predicts at in its config, where each checkpoint saves them:
    ``task``'s number (``evaluation.threshold``) for every label of a multi-label model, or for a two-class
    model's positive class; under ``per_label`` none, until an evaluation chooses them. ``names``: the labels."""
    if task.thresholded and not task.tune_thresholds:
        by_label = task.thresholds_by_label(names)
        set_model_thresholds(model_config, list(by_label), list(by_label.values()))


def balanced_weights(counts: list[int]) -> list[float]:
    """``n / (C * n_c)`` per class (scikit-learn's "balanced"); a class absent from the data gets 1."""
    n, classes = sum(counts), len(counts)
    return [n / (classes * c) if c else 1.0 for c in counts]


def start_regression_head(cfg, model, new_head: tuple[str, ...], train_split) -> Optional[float]:
    """Under ``model.regression_head_bias: mean`` (``cfg``: the config's ``model`` section), set the bias of a
    new regression head's output to the mean of the training split's targets; return that mean.

    transformers starts the output near 0, so on targets far from 0 (a 1-5 rating) the first updates go to
    learning their offset, through a bias whose gradient the whole encoder shares. Started at the mean, the
    head's error is the targets' spread from the first update. ``None`` where nothing was set: another
    problem type, ``zero``, a model that had its head (``new_head`` empty), or a head without one output bias.
    """
    import numpy as np

    from finetune.columns import read_column
    from finetune.tables import LABELS

    if cfg.problem_type != "regression" or cfg.regression_head_bias != "mean":
        return None
    named = dict(model.named_parameters())
    biases = [name for name in new_head if name.endswith("bias") and name in named and named[name].numel() == 1]
    if len(biases) != 1:
        return None
    mean = float(np.mean(np.asarray(read_column(train_split, LABELS), dtype=np.float64)))
    with torch.no_grad():
        named[biases[0]].fill_(mean)
    return mean


class Float32Output(torch.nn.Linear):
    """An ``nn.Linear`` that computes in float32 under autocast; weights an engine keeps in 16 bits (DeepSpeed's,
    FSDP's mixed precision) are read in float32 for the product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)


def compute_output_in_float32(model: torch.nn.Module) -> Optional[str]:
    """For a regression model, make its one linear layer with a single output (BERT's ``classifier``, RoBERTa's
    ``classifier.out_proj``) a :class:`Float32Output`, and return its name; None, and nothing changed, for a
    classifier or a model without exactly one such layer.

    A regression model's output is its prediction, not a logit a softmax compares with others. Under autocast its
    last layer returns bf16, whose 8 significant bits leave steps of 4 between neighbouring values from 512 to
    1024: on targets of that size every prediction rounds to one of a few values, the loss stops moving while the
    weights move, and the validation correlations come out undefined. The layer is a few hundred multiply-adds per
    text; in float32 it returns what its weights say. Classifiers keep autocast's head: their logits only rank
    classes, and the default job's figures stay as they are. The layer keeps its parameters, their names and its
    hooks (its class is swapped, not the module), so checkpoints, ``save_pretrained`` and PEFT see what they saw.
    """
    if problem_type_of(model.config) != "regression":
        return None
    outputs = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.out_features == 1]
    if len(outputs) != 1:
        return None
    name, module = outputs[0]
    module.__class__ = Float32Output
    return name
