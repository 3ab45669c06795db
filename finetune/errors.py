"""User-facing errors.

Anything the user can fix (a config key, a data file, a label, a launch flag)
raises a subclass of :class:`FinetuneError`. The command-line entry points
catch it and print one line instead of a traceback (set ``FINETUNE_DEBUG=1``
or pass ``--debug`` to see the traceback). Every other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import re
import signal
import sys
import time
from typing import Callable


class FinetuneError(Exception):
    """An error caused by the user's input, reported as one line.

    Args:
        message: The line to print. It names the culprit (key, file, row).
        hint: Optional second line telling how to fix it.
    """

    exit_code = 2
    # said by the main process alone (every process meets the same input error), or by each that met it
    every_process = False

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


class FileLayoutError(DataError):
    """A data file whose fields or columns do not match the layout it is read with (format, header, columns)."""


class ModelError(FinetuneError):
    """A model path or checkpoint that cannot be used."""


class LaunchError(FinetuneError):
    """A launch setting (process count, precision, device) that cannot work."""


class OutputError(FinetuneError):
    """The output folder cannot be written: no space left, a permission or another OS error.

    Not the user's input, but told the same way: one line naming the folder;
    what was on disk before is left intact.
    """

    exit_code = 4


class OutOfMemory(FinetuneError):
    """A device ran out of memory mid-run; the line names the newest checkpoint, the hint what resumes it on less.

    Said by each process that ran out: under a launcher it may be another than the main one.
    """

    exit_code = 5
    every_process = True

    def __init__(self, message: str, hint: str | None = None, settings: str | None = None):
        super().__init__(message, hint)
        # the overrides the hint names (``None``: none that keep the run), for a caller with its own hint (a sweep)
        self.settings = settings


class NonFiniteLossError(FinetuneError):
    """The loss of an update was NaN or infinite and the policy (``training.on_nonfinite: stop``) says stop."""

    exit_code = 3


def innermost(exc: BaseException) -> BaseException:
    """The exception at the root of ``exc``'s chain of causes, which names the real problem."""
    while True:
        inner = exc.__cause__ or exc.__context__
        if inner is None or inner is exc:
            return exc
        exc = inner


def root_message(exc: BaseException) -> str:
    """The first line of the innermost cause, which names the real problem."""
    exc = innermost(exc)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = lines[0] if lines else type(exc).__name__
    if len(message) > 300:
        message = message[:297] + "..."
    return f"{type(exc).__name__}: {message}"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says a device ran out of memory (CUDA, XPU, MPS, CPU allocator)."""
    import torch
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(exc, torch.OutOfMemoryError) or should_reduce_batch_size(exc)


@contextlib.contextmanager
def out_of_memory_told_as(error: Callable[[BaseException], OutOfMemory]):
    """Inside, a device's out-of-memory error becomes ``error(exc)``: an :class:`OutOfMemory` saying where and what
    to do, in one line instead of a traceback. Every other exception propagates as it is."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only running out of memory is told here
        if not is_out_of_memory(exc):
            raise
        raise error(exc) from None


def log_to_stderr() -> None:
    """The command's log on stderr: the package's lines from INFO up on the process that speaks, other
    libraries' from WARNING up.

    Libraries say at INFO what a user of this package need not read (an HTTP
    request for each file fetched from the Hub, a font cache being built). A
    log set up already (a program that calls ``main``) is left as it is, as
    ``logging.basicConfig`` leaves it: no logger's level is changed.
    """
    ours_or_warnings = logging.StreamHandler()
    ours_or_warnings.addFilter(_ours_or_a_warning)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=[ours_or_warnings],
                        level=logging.INFO if is_main_rank() else logging.WARNING)


def notes_to_stderr() -> None:
    """The package's log on stderr as a short command's notes, in its own words beside them (``note: ...`` from
    INFO, ``warning: ...`` from WARNING): what reading a file found, which the command would else keep to
    itself; other libraries' lines from WARNING up. A log set up already is left as it is, as in
    :func:`log_to_stderr`."""
    notes = logging.StreamHandler()
    notes.addFilter(_ours_or_a_warning)
    notes.setFormatter(_NoteFormatter())
    logging.basicConfig(handlers=[notes], level=logging.INFO if is_main_rank() else logging.WARNING)


def _ours_or_a_warning(record: logging.LogRecord) -> bool:
    """The package's records, and any library's from WARNING up."""
    return record.levelno >= logging.WARNING or record.name.partition(".")[0] == "finetune"


class _NoteFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{'note' if record.levelno < logging.WARNING else 'warning'}: {record.getMessage()}"


# seconds between progress reports where stderr is a file or a pipe (a batch job's log), not a terminal
PROGRESS_SECONDS_IN_A_FILE = 30.0


def library_bars_seldom_into_a_file() -> None:
    """Where stderr is a file or a pipe (a batch job's log), the bars of the libraries a command runs (datasets
    reading and tokenizing a file, transformers loading weights) redrawn every ``PROGRESS_SECONDS_IN_A_FILE``, as
    the package's own progress is, not ten times a second with each redraw kept in the log. tqdm, which draws them,
    reads its defaults from ``TQDM_*`` variables when it is imported and has no other setting of them, so a command
    calls this first; the processes a launch or a sweep starts inherit it. A value the user set is kept."""
    if not redraws_in_place(sys.stderr):
        os.environ.setdefault("TQDM_MININTERVAL", f"{PROGRESS_SECONDS_IN_A_FILE:g}")


def redraws_in_place(stream) -> bool:
    """Whether a progress bar written to ``stream`` is redrawn over itself: a terminal, or a notebook's output,
    though that is no terminal. Into a file or a pipe (a batch job's log) every redraw stays, after a carriage
    return, on the line of the one before."""
    return (hasattr(stream, "isatty") and stream.isatty()) or "ipykernel" in sys.modules


def is_main_rank() -> bool:
    """Whether this is the first process of a launch of several (or no such launch): the one that speaks.

    A ``RANK`` alone (a cluster's job array, say) does not make a process silent: torchrun sets
    ``WORLD_SIZE`` beside it.
    """
    try:
        several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:  # the launch's own check names the variable
        several = False
    return not several or os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


class CommandParser(argparse.ArgumentParser):
    """argparse's parser for a ``finetune`` command, whose usage errors (an option's value of the wrong type, a
    missing argument) are the package's ``error:`` line and a ``hint:`` line, with argparse's exit code 2, where
    argparse prints its usage block first."""

    def __init__(self, *args, **kwargs):
        self.options: list[str] = []  # every option string, for the one a mistyped option was near
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self.options += action.option_strings
        return action

    def error(self, message: str):
        self.exit(2, f"error: {message}\nhint: {self.prog} --help lists its options\n")

    def parse_args(self, args=None, namespace=None):
        self.refuse_unknown_options(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def parse_intermixed_args(self, args=None, namespace=None):
        self.refuse_unknown_options(sys.argv[1:] if args is None else args)
        return super().parse_intermixed_args(args, namespace)

    def refuse_unknown_options(self, argv: list[str]) -> None:
        """Stop at the first option the command lacks, naming the option it is near, before argparse's own checks:
        those would call a required option missing (``--fle`` for ``--file``) or list every token left over."""
        for token in argv:
            if token == "--":  # what follows is positional, a text that starts with "-" among them
                return
            flag = token.partition("=")[0]
            if token.startswith("-") and token != "-" and not _READ_AS_A_VALUE.match(token) and not self.knows(flag):
                self.exit(2, f"error: {flag}: not an option of {self.prog}{near_option(flag, self.options)}\n"
                             f"hint: {self.prog} --help lists its options\n")

    def knows(self, flag: str) -> bool:
        """Whether ``flag`` is an option of this parser, or (as argparse allows) the start of one."""
        return flag in self.options or (self.allow_abbrev and flag.startswith("--")
                                        and any(option.startswith(flag) for option in self.options))


# the tokens starting with "-" that argparse reads as a value: a negative number, or words with a space between
_READ_AS_A_VALUE = re.compile(r"-\d+$|-\d*\.\d+$|.*\s")


def near_option(flag: str, options: list[str], cutoff: float = 0.75) -> str:
    """`` (did you mean --threshold?)`` for a mistyped option (``--treshold``, ``--batch_size``, ``-threshold``), or
    ``""`` where no long option is as near as ``cutoff``."""
    close = difflib.get_close_matches(flag, [option for option in options if option.startswith("--")], n=1,
                                      cutoff=cutoff)
    return f" (did you mean {close[0]}?)" if close else ""


def run_command(action: Callable[[], object], debug: bool = False) -> int:
    """Run a command-line action; a :class:`FinetuneError` becomes one line and its exit code.

    The one place where the ``error:`` / ``hint:`` lines of every ``finetune``
    command are printed. Under a launcher every process meets the same error,
    and the main one alone prints it.

    Args:
        action: The command's work.
        debug: Re-raise instead (also when ``FINETUNE_DEBUG`` is set and not 0),
            so the traceback shows.

    Returns:
        0, or the error's ``exit_code`` (130 for a Ctrl-C no run's handler took). Other exceptions are bugs and
        propagate.
    """
    debug = debug or os.environ.get("FINETUNE_DEBUG", "") not in ("", "0")
    try:
        action()
    except FinetuneError as exc:
        if debug:
            raise
        if is_main_rank() or exc.every_process:
            print(f"error: {exc.message}", file=sys.stderr)
            if exc.hint:
                print(f"hint: {exc.hint}", file=sys.stderr)
        if not is_main_rank():
            # torchrun stops every process as soon as one exits: were this one first, the main one
            # could be killed before it printed the line. Its stop of this one, once the main one exits, is
            # SIGTERM's own, without the traceback of the handler torch's launcher gives its workers
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(3)
        return exc.exit_code
    except KeyboardInterrupt:
        # Ctrl-C where no handler of finetune.signals holds it (a run's start, before training; a prediction): one
        # line, not the traceback of wherever the program was, and the code a shell gives a process SIGINT stopped
        if debug:  # where the traceback was asked for
            raise
        if is_main_rank():
            print("error: interrupted by SIGINT (Ctrl-C)", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0
