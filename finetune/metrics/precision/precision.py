"""Precision as a local ``evaluate`` metric module, loadable offline (see ``finetune/metrics/_modules.py``)."""

from finetune.metrics._modules import Precision  # noqa: F401  the class evaluate.load finds here
