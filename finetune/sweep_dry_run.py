"""``finetune sweep --dry-run``: runs of the sweep tried as ``finetune train --dry-run`` tries one, and the
sweep's length said from them, with nothing written.

A sweep's runs are the search's trials (each over ``--trial-seeds`` seeds), then the best config over
``--seeds`` or ``--folds``. The run tried is the config with the sweep file's ``fixed:`` keys and the command
line's overrides. Where the space searches a key that changes a run's work (its effective batch or ``k``, its
length, its text length), two runs are tried, at the space's least work and at its most: a smaller effective
batch makes more updates of the same epoch, each with its own optimizer step, and takes longer.

A sweep under way (run before, stopped, or run by other workers now) is read from its storage without writing
to it, checked as its start would check it, and said as the runs done and the runs left.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune.search_space import overrides
from finetune.start_line import counted_updates, readable_duration
from finetune.study import (budget_left, check_study, existing_storage, made_with, refuse_another_sweep, running,
                            trials_done)
from finetune.sweep_checks import check_sweep
from finetune.sweep_file import repeats_of
from finetune.sweep_report import start_line
from finetune.sweep_trial import train_in_this_process

logger = logging.getLogger("finetune")

# the tried runs' folder, inside the sweep's: a name no trial has, so that no trial's run is resumed or refused
TRIED_FOLDER = "dry-run"
GB = 1024**3

# searched keys that change a run's work, and whether their larger values make less of it
WORK_KEYS = {"training.effective_batch_size": True, "training.gradient_accumulation_steps": True,
             "training.num_train_epochs": False, "training.max_steps": False, "data.max_length": False}


@dataclass
class TriedRun:
    """One run of the sweep tried, and its estimated seconds: its start (the model loaded, the data read, the
    memory plan), its updates and its evaluations; its checkpoints (counted, with the bytes of one) and saved files
    are not timed."""

    values: list[str]
    start: float
    updates: int
    training: float
    evaluations: int
    evaluating: float
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    # what its folder keeps at its end: the checkpoints output.keep_last leaves, and the saved model's bytes
    kept_checkpoints: int = 0
    model_bytes: int = 0

    @property
    def kept_bytes(self) -> int:
        return self.model_bytes + self.kept_checkpoints * self.checkpoint_bytes

    @property
    def seconds(self) -> float:
        return self.start + self.training + self.evaluating


def rehearse_sweep(sweep) -> dict[str, Any]:
    """Check ``sweep`` (a :class:`finetune.sweep.Sweep`) as a start checks it, and its ``--storage`` as far as that
    writes nothing; try its runs at the space's least and most work, say how long the sweep (or what is left of
    it) would take, and return ``{"runs", "left", "seconds": (least, most)}`` (the seconds of the runs left)."""
    metric, greater = check_sweep(sweep)
    so_far = sweep_so_far(sweep, greater)  # its storage checked, and read where the sweep is under way
    logger.info(start_line(sweep, metric, greater, done=so_far.trials_done))
    runs, which = runs_of(sweep)
    left = so_far.runs_left
    if left == 0:  # nothing to time: its start would only write the reports again
        logger.info("sweep dry run: %s: %d run%s, all done; the same command without --dry-run writes its reports "
                    "again; nothing was written to %s", which, runs, "s" if runs != 1 else "", sweep.output)
        return {"runs": runs, "left": 0, "seconds": (0.0, 0.0)}
    tried = [try_run(sweep, values) for values in work_corners(sweep.space)]
    pruned = ", less what the pruner stops" if so_far.search_left and sweep.pruner["type"] != "none" else ""
    least, most = min(run.seconds for run in tried), max(run.seconds for run in tried)
    shortest, longest = readable_duration(left * least), readable_duration(left * most)
    total = shortest if shortest == longest else f"{shortest} to {longest}"  # as said, not as timed
    count = f"{runs} run{'s' if runs != 1 else ''}"
    length = f"{count}, {runs - left} done, the {left} left about {total}{pruned}" if left < runs else \
        f"{count}, about {total}{pruned}"
    logger.info("sweep dry run: %s; %s: %s; nothing was written to %s", tried_in_words(tried), which, length,
                sweep.output)
    say_disk(sweep.output, tried, left)
    return {"runs": runs, "left": left, "seconds": (left * least, left * most)}


def say_disk(output: Path, tried: list[TriedRun], left: int) -> None:
    """What the runs left keep on disk at their ends (each its model, and the checkpoints ``output.keep_last``
    leaves it), against the space free where the sweep writes; a warning where it is more: a sweep of a large
    model fills a disk many runs in, each trial's folder kept for what it holds."""
    run = max(tried, key=lambda tried_run: tried_run.kept_bytes)
    need, where = left * run.kept_bytes, existing_folder(output)
    free = shutil.disk_usage(where).free
    kept = run.kept_checkpoints
    checkpoints = (f" and up to {kept} checkpoint{'s' if kept != 1 else ''} ({run.checkpoint_bytes / GB:.2f}GB "
                   f"each)") if kept else ""
    said = (f"sweep dry run, on disk: each run keeps its model ({run.model_bytes / GB:.2f}GB){checkpoints}: about "
            f"{need / GB:.1f}GB for the {left} run{'s' if left != 1 else ''} left, {free / GB:.1f}GB free in {where}")
    if need <= free:
        logger.info(said)
        return
    fewer = "output.keep_last=1 keeps fewer checkpoints, " if kept > 1 else ""
    logger.warning("%s: the disk would fill before the sweep ends; %soutput.save_checkpoints=false none (a stopped "
                   "trial then trains again from its start), or --output another disk", said, fewer)


def existing_folder(path: Path) -> Path:
    """``path``, or its nearest folder above that exists: where a folder not made yet will be."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@dataclass
class SoFar:
    """Where a sweep stands, as its storage holds it: the search's trials finished (as the start line counts them;
    ``None`` where nothing was read), and the runs left to train, of the search (each trial over its seeds) and
    of the seeds or folds. A trial running in another worker, or interrupted and queued to continue from its
    checkpoint, counts as a whole run left."""

    trials_done: Optional[int]
    search_left: int
    repeats_left: int

    @property
    def runs_left(self) -> int:
        return self.search_left + self.repeats_left


def sweep_so_far(sweep, greater: bool) -> SoFar:
    """Where ``sweep`` stands, its storage read without writing, and checked as a start checks it: a study made
    with another space or config, or the folder of another sweep, is refused."""
    import optuna

    repeats = repeats_of(sweep, sweep.run_config.training.seed)
    storage = existing_storage(sweep.storage)
    names = set(optuna.get_all_study_names(storage)) if storage is not None else set()
    if not names & {sweep.study_name, f"{sweep.study_name}.seeds", f"{sweep.study_name}.folds"}:
        trials = sweep.trials if sweep.space.dimensions else 0
        return SoFar(None, trials * sweep.trial_seeds, len(repeats.values) if repeats else 0)
    identity = made_with(sweep.space, sweep.run_config)
    refuse_another_sweep(storage, sweep.study_name, identity, searches=bool(sweep.space.dimensions),
                         repeated=repeats.name if repeats else None)

    def left_in(name: str, trials: int) -> tuple[int, Optional[int]]:
        """Trials left of ``trials`` in the study ``name``, and those finished (None: no such study yet)."""
        if name not in names:
            return trials, None
        study = optuna.load_study(study_name=name, storage=storage)
        check_study(study, sweep.study_name, "maximize" if greater else "minimize", identity)
        return budget_left(study, trials) + running(study), trials_done(study)

    trials, done = left_in(sweep.study_name, sweep.trials) if sweep.space.dimensions else (0, None)
    repeated = left_in(f"{sweep.study_name}.{repeats.name}", len(repeats.values))[0] if repeats else 0
    return SoFar(done, trials * sweep.trial_seeds, repeated)


def work_corners(space) -> list[list[str]]:
    """The overrides of the runs to try: none where the space searches no key that changes the work, else the
    space's least work and its most (one run where they are the same: a key searched over one value)."""
    searched = [d for d in space.dimensions if d.key in WORK_KEYS]
    if not searched:
        return [[]]
    ends = {d.key: (min(d.probes()), max(d.probes())) for d in searched}
    least = overrides({key: high if WORK_KEYS[key] else low for key, (low, high) in ends.items()})
    most = overrides({key: low if WORK_KEYS[key] else high for key, (low, high) in ends.items()})
    return [least] if most == least else [least, most]


def try_run(sweep, values: list[str]) -> TriedRun:
    """``finetune train --dry-run`` of one run of the sweep, with ``values`` for searched keys."""
    began = time.perf_counter()
    summary = train_in_this_process(sweep.config, [*sweep.overrides, *values,
                                                   f"output.output_dir={sweep.output / TRIED_FOLDER}"], dry_run=True)
    rehearsal = summary["rehearsal"]
    each = rehearsal.evaluation_seconds or 0.0
    # a trial is built in the sweep's process as this run was, after its own imports
    start = max(0.0, time.perf_counter() - began - sum(rehearsal.seconds) - rehearsal.timing_seconds)
    return TriedRun(values, start, rehearsal.total_updates, rehearsal.estimate, rehearsal.evaluations,
                    rehearsal.evaluations * each, rehearsal.checkpoints, rehearsal.checkpoint_bytes,
                    rehearsal.kept_checkpoints, rehearsal.model_bytes)


def tried_in_words(tried: list[TriedRun]) -> str:
    """A run's estimate, part by part; or where two were tried, each one's at its values."""
    if len(tried) == 1:
        run = tried[0]
        count = f"{run.evaluations} evaluations" if run.evaluations > 1 else "evaluation"
        evaluations = f", its {count} {readable_duration(run.evaluating)}" if run.evaluations else ""
        return (f"a run would take about {readable_duration(run.seconds)}: its start {readable_duration(run.start)}, "
                f"its {counted_updates(run.updates)} {readable_duration(run.training)}{evaluations}, {untimed(tried)}")
    each = " and ".join(f"{readable_duration(run.seconds)} at {' '.join(run.values)} ({counted_updates(run.updates)})"
                        for run in tried)
    return f"a run would take about {each}: its start, updates and evaluations, {untimed(tried)}"


def untimed(tried: list[TriedRun]) -> str:
    """What a run writes, which the estimate leaves out: its checkpoints, counted, and its saved files."""
    counts = sorted({run.checkpoints for run in tried})
    if counts[-1] == 0:
        return "not its saved files"
    size = max(run.checkpoint_bytes for run in tried) / 1024**3
    many = str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    return f"not its checkpoints ({many} a run, about {size:.2f}GB each) or saved files"


def runs_of(sweep) -> tuple[int, str]:
    """How many runs the whole sweep trains, and what they are in words (those done already included)."""
    runs, parts = 0, []
    if sweep.space.dimensions:
        runs += sweep.trials * sweep.trial_seeds
        seeds = f" over {sweep.trial_seeds} seeds each" if sweep.trial_seeds > 1 else ""
        parts.append(f"the search's {sweep.trials} trial{'s' if sweep.trials != 1 else ''}{seeds}")
    what = "the best config" if sweep.space.dimensions else "the config"
    if sweep.seeds:
        runs += sweep.seeds
        parts.append(f"{what} over {sweep.seeds} seeds")
    if sweep.folds:
        runs += sweep.folds
        parts.append(f"{what} on each of {sweep.folds} folds")
    return runs, ", then ".join(parts)
