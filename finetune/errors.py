"""User-facing errors.

Anything the user can fix (a config key, a data file, a label, a launch flag)
raises a subclass of :class:`FinetuneError`. The command-line entry points
catch it and print one line instead of a traceback (set ``FINETUNE_DEBUG=1``
or pass ``--debug`` to see the traceback). Every other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations


class FinetuneError(Exception):
    """An error caused by the user's input, reported as one line.

    Args:
        message: The line to print. It names the culprit (key, file, row).
        hint: Optional second line telling how to fix it.
    """

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ConfigError(FinetuneError):
    """A bad configuration file, key, value or command-line override."""


class DataError(FinetuneError):
    """A missing or malformed data file, column, text or label."""


class ModelError(FinetuneError):
    """A model path or checkpoint that cannot be used."""


class LaunchError(FinetuneError):
    """A launch setting (process count, precision, device) that cannot work."""
