"""Accuracy as a local ``evaluate`` metric module, loadable offline.

Load it with ``evaluate.load("<path to this directory or file>")``. It is
hand-written with numpy (see ``finetune/metrics/_classification.py``) because
the Hub's script needs the network and calls scikit-learn, which ``finetune``
does not depend on.
"""

import evaluate

from finetune.metrics import _classification

_CITATION = ""

_DESCRIPTION = """Accuracy = (number of correct predictions) / (number of predictions).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): Predicted class ids.
    references (`list` of `int`): True class ids.

Returns:
    accuracy (`float`): The fraction of predictions equal to the references, in [0, 1].

Examples:
    >>> metric = evaluate.load("finetune/metrics/accuracy")
    >>> metric.compute(predictions=[0, 2, 1, 0], references=[0, 1, 1, 0])
    {'accuracy': 0.75}
"""


class Accuracy(evaluate.Metric):
    """Accuracy, the fraction of correct predictions, as scikit-learn's ``accuracy_score``."""

    def _info(self):
        return _classification.class_id_metric_info(_DESCRIPTION, _CITATION, _KWARGS_DESCRIPTION)

    def _compute(self, predictions, references):
        return {"accuracy": _classification.accuracy(predictions, references)}
