"""What a sweep says once for all its trials, not once for each: the notes on the config and the data that every
trial reads alike, and the caution of a run of few updates, summed up over the search's trials once they are done."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator, Optional

# the loggers of what reading the data finds, which every trial of a sweep reads alike
DATA_LOGGERS = ("finetune.data", "finetune.labels", "finetune.label_warnings", "finetune.carve")
# and of what the command line's keys replace in the config, which a sweep reads for each value it checks and trial
NOTE_LOGGERS = ("finetune.config", *DATA_LOGGERS)

EPOCHS = "training.num_train_epochs"


class FirstTimeOnly(logging.Filter):
    """Lets each message through the first time it is logged."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.said:
            return False
        self.said.add(message)
        return True


class GpusSaidOnce(logging.Filter):
    """Lets the first trial's caution of the GPUs it leaves unused through, and drops the other trials' copies: in
    the sweep's words where they are idle (a trial runs in one process, so the cure is a worker on each GPU, not
    the launch a run's caution names), as a run says it where torch cannot reach them."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        from finetune.start_line import CAUTION, GPUS_OUT_OF_REACH_CAUTION, IDLE_GPUS_CAUTION

        kind = getattr(record, CAUTION, None)
        if kind not in (IDLE_GPUS_CAUTION, GPUS_OUT_OF_REACH_CAUTION):
            return True
        if kind in self.said:
            return False
        self.said.add(kind)
        if kind == IDLE_GPUS_CAUTION:
            import torch

            gpus = torch.cuda.device_count()
            record.msg, record.args = (f"this machine shows {gpus} GPUs and each trial trains on one: a worker on "
                                       f"each, this command started {gpus} times with CUDA_VISIBLE_DEVICES=0 to "
                                       f"{gpus - 1}, shares the study and searches up to {gpus} times as fast "
                                       f"(docs/sweeps.md#several-workers)"), ()
        return True


@contextlib.contextmanager
def notes_said_once() -> Iterator[None]:
    """Within it, a note on the config (a key the command line replaces) or on the data (a row left out, a label
    warned of) is logged the first time only: every trial reads the same config and data and would say it again;
    a note that differs (another fold's carve) is said. So are the cautions of the GPUs a trial leaves unused."""
    first, gpus = FirstTimeOnly(), GpusSaidOnce()
    loggers = [logging.getLogger(name) for name in NOTE_LOGGERS]
    for data_logger in loggers:
        data_logger.addFilter(first)
    logging.getLogger("finetune").addFilter(gpus)  # the start line's logger
    try:
        yield
    finally:
        for data_logger in loggers:
            data_logger.removeFilter(first)
        logging.getLogger("finetune").removeFilter(gpus)


class FewUpdatesOnce(logging.Filter):
    """Lets the first run's caution of few updates through and counts the others, which it drops: trials that
    differ in their effective batch differ in their updates, so each would say it again in other numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.cautioned = 0

    def filter(self, record: logging.LogRecord) -> bool:
        from finetune.start_line import CAUTION, FEW_UPDATES_CAUTION

        if getattr(record, CAUTION, None) != FEW_UPDATES_CAUTION:
            return True
        self.cautioned += 1
        return self.cautioned == 1


@contextlib.contextmanager
def few_updates_said_once() -> Iterator[FewUpdatesOnce]:
    """Within it, the start line's caution of few updates is said for the first run only; the filter yielded
    counts the runs cautioned, for :func:`few_updates_in_search` after them."""
    said = FewUpdatesOnce()
    start_line_logger = logging.getLogger("finetune")
    start_line_logger.addFilter(said)
    try:
        yield said
    finally:
        start_line_logger.removeFilter(said)


def few_updates_in_search(rows: list[dict[str, Any]], epochs: Optional[float]) -> Optional[str]:
    """The search's finished trials (not pruned) that trained fewer updates than a new head needs, in a line, with
    the epochs that give the fewest enough; ``None`` where none did. ``rows``: ``trials.csv``'s; ``epochs``: the
    config's ``training.num_train_epochs`` (a searched value is the trial's own)."""
    from finetune.start_line import FEW_UPDATES

    finished = [row for row in rows if row["state"] == "complete" and row["updates"] is not None]
    few = sorted((row for row in finished if row["updates"] < FEW_UPDATES), key=lambda row: row["updates"])
    if not few:
        return None
    fewest, most = few[0], few[-1]["updates"]
    own = float(fewest.get(EPOCHS, epochs) or 1)
    enough = -(-FEW_UPDATES * own // fewest["updates"])
    count = f"{fewest['updates']}" if fewest["updates"] == most else f"{fewest['updates']} to {most}"
    how = (f"a space of {EPOCHS} from {enough:g}" if EPOCHS in fewest
           else f"{EPOCHS}={enough:g} (and another --output: a sweep's study keeps the config it was made with)")
    return (f"{len(few)} of the {len(finished)} finished trials made fewer than {FEW_UPDATES} updates ({count}): a "
            f"new head learns little in so few, and such a trial's score says how many it made as much as what it "
            f"searched; a sweep with {how} gives its fewest about {int(fewest['updates'] * enough / own)} "
            f"(docs/sweeps.md#few-updates)")


def disk_short(output: Path, folder: Path, runs_left: int) -> Optional[str]:
    """The caution for a sweep whose runs left would keep more than the disk holds, measured on the trial that just
    finished: what its run's ``folder`` holds (its model, the checkpoints its ``output.keep_last`` left), times the
    runs left, against the space free where the sweep writes; ``None`` where it fits. Said, once, many trials before the
    disk fills, where a trial's checkpoint would else stop it there."""
    import shutil

    from finetune.checkpoint_files import folder_bytes

    held = folder_bytes(folder)
    need, free = held * runs_left, shutil.disk_usage(output).free
    if need <= free:
        return None
    gb = 1024**3
    return (f"the {runs_left} run{'s' if runs_left != 1 else ''} left would keep about {need / gb:.1f}GB, "
            f"{held / gb:.2f}GB each as {folder} does, and {output} has {free / gb:.1f}GB free: the disk would "
            f"fill before the sweep ends; free some, or stop the sweep: one started with output.keep_last=1 (or "
            f"output.save_checkpoints=false) keeps less")
