"""F1 score as a local ``evaluate`` metric module, loadable offline.

Load it with ``evaluate.load("<path to this directory or file>")``. It is
hand-written with numpy (see ``finetune/metrics/_classification.py``) because
the Hub's script needs the network and calls scikit-learn, which ``finetune``
does not depend on.
"""

import evaluate

from finetune.metrics import _classification

_CITATION = ""

_DESCRIPTION = """F1 = 2 * TP / (2 * TP + FP + FN), per class, then averaged.
Division by zero scores 0, as scikit-learn's ``zero_division=0``, without warnings.
"""

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
    f1 (`float`): The averaged F1 score, in [0, 1].

Examples:
    >>> metric = evaluate.load("finetune/metrics/f1", average="macro", labels=[0, 1, 2])
    >>> metric.compute(predictions=[0, 2, 1, 0], references=[0, 1, 1, 0])
    {'f1': 0.5555555555555555}
"""


class F1(evaluate.Metric):
    """F1 score, the harmonic mean of precision and recall, as scikit-learn's ``f1_score``.

    Args:
        average: Default averaging (binary, macro, micro, weighted).
        pos_label: Default positive class for ``average="binary"``.
        labels: Default list of all class ids.
        *args: Passed on to ``evaluate.Metric``.
        **kwargs: Passed on to ``evaluate.Metric``.
    """

    def __init__(self, *args, average="binary", pos_label=1, labels=None, **kwargs):
        super().__init__(*args, **kwargs)
        # Set at load time so that evaluate.combine(...).compute() needs no
        # averaging kwargs: combine hands every kwarg to every module.
        self._defaults = {"average": average, "pos_label": pos_label, "labels": labels}

    def _info(self):
        return _classification.class_id_metric_info(_DESCRIPTION, _CITATION, _KWARGS_DESCRIPTION)

    def _compute(self, predictions, references, average=None, pos_label=None, labels=None):
        options = _classification.averaging_options(self._defaults, average, pos_label, labels)
        precision, recall, f1 = _classification.precision_recall_f1(predictions, references, **options)
        return {"f1": f1}
