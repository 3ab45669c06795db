"""F1 score as a local ``evaluate`` metric module, loadable offline (see ``finetune/metrics/_averaged.py``)."""

from finetune.metrics._averaged import F1  # noqa: F401  the class evaluate.load finds here
