"""Stopping cleanly on SIGTERM / SIGINT: the signals, the stop every process agrees on, and the command that
resumes the run.

A preempted or interrupted run finishes its current update, saves a
checkpoint (:class:`finetune.checkpointer.Checkpointer` saves it;
:func:`finetune.fitting.fit` decides when), prints the command that resumes
it, and exits with the code a shell reports for that signal.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from finetune.errors import FinetuneError

logger = logging.getLogger("finetune")


class RunInterrupted(FinetuneError):
    """A signal stopped the run at a window boundary; a checkpoint was saved.

    ``exit_code`` is ``128 + signal number``: 143 for SIGTERM, 130 for SIGINT,
    what a shell reports for a process killed by that signal.
    """

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class StopSignals:
    """Context manager: SIGTERM and SIGINT ask the run to stop at the next window boundary.

    The first signal is only recorded (:attr:`signum`); the loop finishes the
    current update, saves a checkpoint and exits. A second signal restores the
    default action and re-raises it, for a user who does not want to wait (a
    checkpoint being written then stays a temporary directory, never resumed).
    Handlers can only be installed from the main thread; elsewhere this does nothing.

    A signal reaches one process (or some); :meth:`agree` makes it every
    process's decision, so that all stop after the same update.

    Scopes nest: a sweep holds one around its trials, and each trial's ``fit``
    one around its training. A signal the outer scope received before the inner
    one began (while a trial's model was loading) is the inner one's from its
    start, so training stops after its first update; one the inner scope
    received is the outer one's too once it ends.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        # the signal this process received, and the one all processes agreed to stop on
        self.signum: Optional[int] = None
        self.agreed: Optional[int] = None
        self._previous: dict[int, Any] = {}
        self._outer: Optional[StopSignals] = None

    def agree(self, accelerator, step: Optional[int] = None) -> Optional[int]:
        """The signal to stop on if any process received one: the same answer on every process.

        Call it on every process at the same point (after each update, and
        between epochs). Once agreed, the answer stays; the first time, the
        main process says so in one line (naming update ``step`` when given).
        """
        if self.agreed is not None:
            return self.agreed
        local = self.signum or 0
        if accelerator.num_processes > 1:
            import torch

            # one tiny all-reduce per update so that every rank stops after the same update;
            # max: SIGTERM (a preemption) wins over SIGINT
            flag = torch.tensor([local], dtype=torch.int64, device=accelerator.device)
            local = int(accelerator.reduce(flag, reduction="max").item())
        if local:
            self.agreed = local
            if accelerator.is_main_process:
                after = f"after update {step} " if step is not None else ""
                logger.warning("%s received: stopping %sto save a checkpoint (send it again to stop at once)",
                               signal.Signals(local).name, after)
        return self.agreed

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
            self._outer = next((h.__self__ for h in self._previous.values()
                                if isinstance(getattr(h, "__self__", None), StopSignals)), None)
            if self._outer is not None:
                self.signum = self._outer.signum
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._outer is not None and self._outer.signum is None:
            self._outer.signum = self.signum
        self._outer = None

    def _handle(self, signum: int, frame) -> None:
        # no logging here: a handler may run while the main thread holds a logging lock
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signum = signum


def interruption(signum: int, state, where: str, num_processes: int) -> RunInterrupted:
    """The error that ends a run stopped by ``signum``: where it stopped, its checkpoint, how to resume."""
    name = signal.Signals(signum).name
    return RunInterrupted(
        f"interrupted by {name} after update {state.step} (epoch {state.epoch}, micro-batch "
        f"{state.micro_batch}); {where}; resume with: {resume_command(num_processes)}",
        signum,
    )


def resume_command(num_processes: int = 1, argv: Optional[list[str]] = None) -> str:
    """The command that resumes this run: the same arguments plus ``output.resume_from=latest``; a sweep's
    trial, the sweep's command as it was."""
    argv = list(sys.argv if argv is None else argv)
    launched = "ACCELERATE_USE_CPU" in os.environ or "LOCAL_RANK" in os.environ
    command = Path(argv[0]).name if argv else ""
    sweep = _sweep_command(command, argv)
    if sweep is not None:
        return sweep
    if command == "finetune" or (command == "cli.py" and argv[1:2] == ["train"]):
        # the installed command (or `accelerate launch -m finetune.cli train`)
        script, args = (["-m", "finetune.cli", "train"] if launched else ["finetune", "train"]), argv[2:]
    elif command in ("finetune-train", "train.py"):
        script, args = ([_relative(argv[0])] if command == "train.py" else ["-m", "finetune.train"]), argv[1:]
        if not launched and command == "finetune-train":
            script = ["finetune-train"]
    else:
        return "set output.resume_from=latest and run fit again"
    args = [a for a in args if not a.startswith("output.resume_from=")] + ["output.resume_from=latest"]
    if launched:
        launcher = ["accelerate", "launch"]
        if num_processes > 1:
            launcher += ["--multi_gpu", "--num_processes", str(num_processes)]
    elif script[0].endswith(".py"):
        launcher = ["python"]
    else:
        launcher = []
    return shlex.join(launcher + script + args)


def _sweep_command(command: str, argv: list[str]) -> Optional[str]:
    """A sweep's own command, as it was given (None for another command): run again, a sweep goes on where it
    stopped, its interrupted trial from that trial's checkpoint (finetune.sweep). A sweep runs in one process."""
    if command in ("finetune", "cli.py") and argv[1:2] == ["sweep"]:
        script = ["finetune"] if command == "finetune" else ["python", "-m", "finetune.cli"]
        return shlex.join(script + argv[1:])
    if command in ("finetune-sweep", "sweep.py"):
        return shlex.join((["finetune-sweep"] if command == "finetune-sweep" else ["python", "-m", "finetune.sweep"])
                          + argv[1:])
    return None


def _relative(script: str) -> str:
    """``script`` relative to the working folder when it lies below it."""
    try:
        relative = os.path.relpath(script)
    except ValueError:
        return script
    return relative if not relative.startswith("..") else script
