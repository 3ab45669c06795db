"""Matthews correlation as a local ``evaluate`` metric module, loadable offline.

Load it with ``evaluate.load("<path to this directory or file>")``. It is
hand-written with numpy (see ``finetune/metrics/_classification.py``) because
the Hub's script needs the network and calls scikit-learn, which ``finetune``
does not depend on.
"""

import evaluate

from finetune.metrics import _classification

_CITATION = ""

_DESCRIPTION = """Matthews correlation coefficient (multiclass R_K statistic); 0 where undefined.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): Predicted class ids.
    references (`list` of `int`): True class ids.

Returns:
    matthews_correlation (`float`): The coefficient, in [-1, 1]; 0.0 when only one class is predicted or true.

Examples:
    >>> metric = evaluate.load("finetune/metrics/matthews_correlation")
    >>> metric.compute(predictions=[0, 2, 1, 0], references=[0, 1, 1, 0])
    {'matthews_correlation': 0.6708203932499369}
"""


class MatthewsCorrelation(evaluate.Metric):
    """Multiclass Matthews correlation coefficient, as scikit-learn's ``matthews_corrcoef``."""

    def _info(self):
        return _classification.class_id_metric_info(_DESCRIPTION, _CITATION, _KWARGS_DESCRIPTION)

    def _compute(self, predictions, references):
        return {"matthews_correlation": _classification.matthews_correlation(predictions, references)}
