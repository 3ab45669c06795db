"""Precision as a local ``evaluate`` metric module, loadable offline (see ``finetune/metrics/_averaged.py``)."""

from finetune.metrics._averaged import Precision  # noqa: F401  the class evaluate.load finds here
