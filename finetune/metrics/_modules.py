"""The built-in metrics as ``evaluate`` metric classes: accuracy, precision, recall, F1, Matthews correlation.

Each sub-folder (``accuracy/``, ``f1/``, ...) holds a script that
``evaluate.load`` can load offline. The script imports its one class from here
(``evaluate.load`` takes the first metric class in the script's namespace), so
the scripts share one computation and one description. Hand-written with numpy
(see ``_classification.py``) because the Hub's scripts need the network and
call scikit-learn, which ``finetune`` does not depend on.
"""

import evaluate
import numpy as np

from finetune.metrics import _classification

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): Predicted class ids.
    references (`list` of `int`): True class ids.
    average (`str`): binary, macro, micro or weighted. Defaults to the value
        given to ``evaluate.load`` (binary if none).
    pos_label (`int`): The positive class with ``average="binary"``. Defaults to
        the value given to ``evaluate.load`` (1 if none).
    labels (`list` of `int`): All class ids, so that a class absent from both
        arrays still counts in the average. Defaults to the value given to
        ``evaluate.load`` (the classes present if none).

Returns:
    {score} (`float`): The averaged {score}, in [0, 1].

Examples:
    >>> metric = evaluate.load("finetune/metrics/{score}", average="macro", labels=[0, 1, 2])
    >>> metric.compute(predictions=[0, 2, 1, 0], references=[0, 1, 1, 0])
    {example}
"""


_PLAIN_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): Predicted class ids.
    references (`list` of `int`): True class ids.

Returns:
    {score} (`float`): {meaning}.

Examples:
    >>> metric = evaluate.load("finetune/metrics/{score}")
    >>> metric.compute(predictions=[0, 2, 1, 0], references=[0, 1, 1, 0])
    {example}
"""


class Accuracy(evaluate.Metric):
    """Accuracy, the fraction of correct predictions, as scikit-learn's ``accuracy_score``."""

    def _info(self):
        kwargs = _PLAIN_KWARGS_DESCRIPTION.format(
            score="accuracy", meaning="The fraction of predictions equal to the references, in [0, 1]",
            example={"accuracy": _classification.accuracy(np.array([0, 2, 1, 0]), np.array([0, 1, 1, 0]))})
        return _classification.class_id_metric_info(
            "Accuracy = (number of correct predictions) / (number of predictions).\n", "", kwargs)

    def _compute(self, predictions, references):
        return {"accuracy": _classification.accuracy(predictions, references)}


class MatthewsCorrelation(evaluate.Metric):
    """The Matthews correlation coefficient over all classes, as scikit-learn's ``matthews_corrcoef``."""

    def _info(self):
        example = _classification.matthews_correlation(np.array([0, 2, 1, 0]), np.array([0, 1, 1, 0]))
        kwargs = _PLAIN_KWARGS_DESCRIPTION.format(
            score="matthews_correlation",
            meaning="The coefficient, in [-1, 1]; 0.0 when only one class is predicted or true",
            example={"matthews_correlation": example})
        description = "Matthews correlation coefficient (multiclass R_K statistic); 0 where undefined.\n"
        return _classification.class_id_metric_info(description, "", kwargs)

    def _compute(self, predictions, references):
        return {"matthews_correlation": _classification.matthews_correlation(predictions, references)}


class AveragedMetric(evaluate.Metric):
    """Precision, recall or F1 over class ids (:attr:`score` says which).

    Args:
        average: Default averaging (binary, macro, micro, weighted).
        pos_label: Default positive class for ``average="binary"``.
        labels: Default list of all class ids.
        *args: Passed on to ``evaluate.Metric``.
        **kwargs: Passed on to ``evaluate.Metric``.
    """

    score = ""  # "precision", "recall" or "f1"
    description = ""  # the formula, for evaluate's MetricInfo

    def __init__(self, *args, average="binary", pos_label=1, labels=None, **kwargs):
        super().__init__(*args, **kwargs)
        # Set at load time so that evaluate.combine(...).compute() needs no
        # averaging kwargs: combine hands every kwarg to every module.
        self._defaults = {"average": average, "pos_label": pos_label, "labels": labels}

    def _info(self):
        zero_division = "Division by zero scores 0, as scikit-learn's ``zero_division=0``, without warnings.\n"
        scores = dict(zip(("precision", "recall", "f1"), _classification.precision_recall_f1(
            np.array([0, 2, 1, 0]), np.array([0, 1, 1, 0]), average="macro", pos_label=1, labels=[0, 1, 2])))
        example = {self.score: scores[self.score]}
        kwargs = _KWARGS_DESCRIPTION.format(score=self.score, example=example)
        return _classification.class_id_metric_info(self.description + "\n" + zero_division, "", kwargs)

    def _compute(self, predictions, references, average=None, pos_label=None, labels=None):
        options = _classification.averaging_options(self._defaults, average, pos_label, labels)
        precision, recall, f1 = _classification.precision_recall_f1(predictions, references, **options)
        return {self.score: {"precision": precision, "recall": recall, "f1": f1}[self.score]}


class Precision(AveragedMetric):
    """Precision, TP / (TP + FP), as scikit-learn's ``precision_score``."""

    score = "precision"
    description = "Precision = TP / (TP + FP), per class, then averaged."


class Recall(AveragedMetric):
    """Recall, TP / (TP + FN), as scikit-learn's ``recall_score``."""

    score = "recall"
    description = "Recall = TP / (TP + FN), per class, then averaged."


class F1(AveragedMetric):
    """F1 score, the harmonic mean of precision and recall, as scikit-learn's ``f1_score``."""

    score = "f1"
    description = "F1 = 2 * TP / (2 * TP + FP + FN), per class, then averaged."
