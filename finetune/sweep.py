"""``finetune sweep``: search a run's config for the best evaluation, resumable, on one machine or many.

Usage::

    finetune sweep --config configs/default.yaml --sweep configs/sweeps/default.yaml
    finetune sweep --config run.yaml --sweep sweep.yaml --seeds 5            # then the best config over 5 seeds
    finetune sweep --config run.yaml --seeds 5                               # the config as given, over 5 seeds
    finetune sweep --config run.yaml --folds 5                               # 5-fold cross-validation of it
    finetune sweep --sweep sweep.yaml --storage postgresql://user@host/db    # one of several workers
    finetune sweep --sweep sweep.yaml --seeds 5 --dry-run                    # how long it would take; writes nothing

Each trial is an ordinary run of this package in its own folder under the
sweep's folder (``--output``), trained in this process. Optuna draws the
values and prunes; the study lives in ``study.db`` in that folder (or in
``--storage``), so the same command run again continues the sweep, and
several workers given the same ``--storage`` share it. Because accumulation is
exact, ``training.effective_batch_size`` is searched at the memory of the
config's micro-batch. docs/sweeps.md explains it all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

from finetune.errors import CommandParser, ConfigError, library_bars_seldom_into_a_file, log_to_stderr, run_command
from finetune.search_space import Dimension, SearchSpace, overrides, parse_space
from finetune.signals import RunInterrupted, StopSignals
from finetune.study import BASE_PARAMS_ATTR, FEW_UPDATES_ATTR, budget_left, load_or_create, made_with, open_storage, \
    redact, refuse_a_database_in_memory, refuse_another_sweep, running, trials_done
from finetune.sweep_checks import check_sweep
from finetune.sweep_file import DEFAULT_TRIALS, PRUNERS, SAMPLERS, Repeats, describe_pruner, fixed_overrides, \
    folds_of, pruner_retyped, pruner_settings, read_sweep_file, refuse_search_settings, repeats_of, sampler_settings, \
    search_seeds, shipped_sweep, whole_number
from finetune.sweep_notes import disk_short, few_updates_said_once, notes_said_once
from finetune.sweep_report import Header, best_trial, mean_and_deviation, start_line, state_of, \
    write_out_of_fold_predictions, write_reports
from finetune.sweep_trial import Phase, TrialRunner

logger = logging.getLogger("finetune")

# seconds between looks at the study while other workers finish the search's last trials
WAIT_S = 10.0


@dataclasses.dataclass
class Sweep:
    """A sweep's settings, from its file and the command line."""

    config: Optional[str]
    overrides: list[str]
    space: SearchSpace
    trials: int
    sampler: str
    sampler_seed: Optional[int]
    pruner: dict[str, Any]
    seeds: int
    trial_seeds: int
    folds: int
    output: Path
    storage: str
    study_name: str
    command: str
    # the run's config as loaded (the overrides applied), and the sweep file, for the front of its errors
    run_config: Any = None
    where: str = "--sweep"


# finetune train's options that a sweep takes, for every trial
SWEEP_FLAGS = ("data", "validation", "test", "text", "text_pair", "label", "model")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from finetune.train import add_column_options, add_held_out_options, shortcut_overrides

    parser = CommandParser(prog="finetune sweep", description=__doc__.splitlines()[0],
                           epilog="every option and the sweep file: docs/sweeps.md")
    parser.add_argument("--config", help="the run's YAML config (default: configs/default.yaml)")
    parser.add_argument("--data", metavar="FILE", help="training data, as finetune train --data takes it "
                        "(data.train_file)")
    add_held_out_options(parser)
    add_column_options(parser)
    parser.add_argument("--model", metavar="NAME", help="the pretrained encoder (model.name_or_path)")
    parser.add_argument("--sweep", metavar="FILE",
                        help="the sweep's YAML: space, fixed, trials, sampler, pruner, seeds, folds")
    parser.add_argument("--output", metavar="DIR", help="the sweep's folder (default: the config's "
                        "output.output_dir with -sweep appended)")
    parser.add_argument("--storage", metavar="URL", help="the study's database, shared by several workers "
                        "(default: sqlite:///<output>/study.db)")
    parser.add_argument("--study-name", help="the study's name in --storage (default: the folder's name)")
    parser.add_argument("--trials", type=int, help="trials the sampler draws (default: the file's, else 20)")
    parser.add_argument("--sampler", help=f"one of {', '.join(SAMPLERS)} (default: the file's, else tpe; "
                        "its seed is kept)")
    parser.add_argument("--sampler-seed", type=int, help="the sampler's seed, for a reproducible one-worker sweep")
    parser.add_argument("--pruner", help=f"one of {', '.join(PRUNERS)} (default: the file's, else median; the "
                        "file's settings it takes, its warm-up among them, are kept)")
    parser.add_argument("--seeds", type=int, help="then run the best config (without a space: the config) over "
                        "this many seeds: training.seed, +1, ...")
    parser.add_argument("--folds", type=int, help="then run the best config (without a space: the config) on "
                        "each of this many folds of the training data (K-fold cross-validation: "
                        "data.validation_folds)")
    parser.add_argument("--trial-seeds", type=int, help="run every trial over this many seeds; its objective is "
                        "their mean (default: 1)")
    parser.add_argument("--dry-run", action="store_true", help="check the sweep, try a run of it as finetune train "
                        "--dry-run does (two where the space changes the work), say how long the sweep (or what is "
                        "left of it) would take, and write nothing")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for every trial")
    args, args.unknown = parser.parse_known_intermixed_args(argv)
    args.options = parser.options  # for the one a mistyped option is near
    args.overrides = shortcut_overrides(args, SWEEP_FLAGS) + list(args.overrides)
    return args


def build_sweep(args: argparse.Namespace, argv: list[str]) -> Sweep:
    """The settings: the flags over the sweep file over the defaults, each checked (one line per bad value)."""
    from finetune.config import load_config

    data = read_sweep_file(args.sweep)
    where = args.sweep or "--sweep"
    space = parse_space(data.get("space"), where)
    pick = lambda flag, key, default: flag if flag is not None else data.get(key, default)  # noqa: E731
    trials = whole_number(pick(args.trials, "trials", DEFAULT_TRIALS if space.dimensions else 0), "trials", where, 0)
    seeds = whole_number(pick(args.seeds, "seeds", 0), "seeds", where, 0)
    trial_seeds = whole_number(pick(args.trial_seeds, "trial_seeds", 1), "trial_seeds", where, 1)
    folds = whole_number(pick(args.folds, "folds", 0), "folds", where, 0)
    if folds == 1:
        raise ConfigError(f"{where}: folds: must be >= 2 (or 0: none), got 1")
    if seeds and folds:
        raise ConfigError(f"{where}: seeds and folds: give one; seeds keep the validation rows and change the "
                          "training's randomness, folds keep the seed and change the validation rows")
    if not space.dimensions and not seeds and not folds:
        raise ConfigError(f"{where}: nothing to run: give a space (--sweep FILE with space:), --seeds N or --folds K",
                          hint=f"--sweep {shipped_sweep()} searches a classifier's learning rate and effective "
                               "batch, by F1")
    if not space.dimensions:
        refuse_search_settings(args, data, where, f"over {seeds} seeds" if seeds else f"on each of {folds} folds")
    if space.dimensions and trials < 1:
        raise ConfigError(f"{where}: trials: must be >= 1 with a space, got {trials}")
    # a flag changes its one setting: --sampler keeps the file's seed, --pruner the file's settings it takes
    sampler, sampler_seed = sampler_settings(data.get("sampler", "tpe"), where)
    if args.sampler is not None and args.sampler not in SAMPLERS:
        raise ConfigError(f"--sampler: {args.sampler!r} is not one of {', '.join(SAMPLERS)}")
    sampler = args.sampler or sampler
    if args.sampler_seed is not None:
        sampler_seed = whole_number(args.sampler_seed, "--sampler-seed", "command line", 0)
    if sampler == "grid" and any(d.kind != "choice" for d in space.dimensions):
        raise ConfigError(f"{where}: sampler: grid needs a list of choices for every key of the space")
    pruner = pruner_settings(data.get("pruner", "median"), where)
    if args.pruner is not None:
        pruner = pruner_retyped(pruner, args.pruner)
    fixed = fixed_overrides(data.get("fixed"), space, args.config, where)
    cfg = load_config(args.config, [*fixed, *args.overrides])
    output = Path(args.output or f"{cfg.output.output_dir.rstrip('/')}-sweep")
    storage = args.storage or f"sqlite:///{(output / 'study.db').resolve()}"
    refuse_a_database_in_memory(storage)
    command = shlex.join(["finetune", "sweep", *argv])
    if folds:  # a config the folds cannot be cut from (a validation file) is said before any trial
        try:
            load_config(args.config, [*fixed, *args.overrides, *folds_of(folds).fixed])
        except ConfigError as exc:
            raise ConfigError(f"--folds {folds}: {exc.message.removeprefix('command line: ')}",
                              hint=exc.hint or "data.validation_file=null on the command line cuts the folds from "
                                               "the training data alone") from None
    return Sweep(args.config, [*fixed, *args.overrides], space, trials, sampler, sampler_seed, pruner, seeds,
                 trial_seeds, folds, output, storage, args.study_name or output.resolve().name, command, cfg, where)


def make_sampler(sweep: Sweep, trials_so_far: int):
    """The sampler; a seeded one is seeded past the trials the study holds, so a continued sweep draws new values.

    The grid is the exception: its seed orders the grid, and a trial's point is its index in that order, so every
    process of the study (a continuation, another worker) must order it alike: the seed as given.
    """
    import optuna

    if sweep.sampler == "grid":
        grid = {d.key: list(d.choices) for d in sweep.space.dimensions}
        return optuna.samplers.GridSampler(grid, seed=sweep.sampler_seed)
    seed = None if sweep.sampler_seed is None else sweep.sampler_seed + trials_so_far
    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(settings: dict[str, Any]):
    import optuna

    kind = settings["type"]
    if kind == "none":
        return optuna.pruners.NopPruner()
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner()
    # a trial reports at the training texts it has seen, so Optuna's warm-up steps are texts
    startup, least, warmup = (settings.get("startup_trials", 5), settings.get("min_trials", 1),
                              settings.get("warmup_texts", 0))
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=warmup, n_min_trials=least)
    return optuna.pruners.PercentilePruner(settings.get("percentile", 50.0), n_startup_trials=startup,
                                           n_warmup_steps=warmup, n_min_trials=least)


def run_sweep(sweep: Sweep) -> dict[str, Any]:
    """Run (or continue) the sweep: the search, then the seeds or folds. Returns what ``sweep.md`` reports."""
    import optuna

    cfg = sweep.run_config
    metric, greater = check_sweep(sweep)
    sweep.output.mkdir(parents=True, exist_ok=True)
    # after the checks above, which need neither torch nor transformers: a bad sweep file is said at once
    from finetune.train import quiet_library_progress

    quiet_library_progress()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # every trial's ending is logged here, in one line
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    storage = open_storage(sweep.storage)
    direction = "maximize" if greater else "minimize"
    identity = made_with(sweep.space, cfg)
    repeats = repeats_of(sweep, cfg.training.seed)
    refuse_another_sweep(storage, sweep.study_name, identity, searches=bool(sweep.space.dimensions),
                         repeated=repeats.name if repeats else None)
    search = (load_or_create(storage, sweep.study_name, direction, identity) if sweep.space.dimensions else None)
    done = trials_done(search) if search else 0
    logger.info(start_line(sweep, metric, greater, done))
    header = Header(metric, greater, sweep.space, sweep.sampler, describe_pruner(sweep.pruner),
                    redact(sweep.storage), sweep.trials, sweep.command, sweep.config, tuple(sweep.overrides),
                    cfg.training.num_train_epochs)
    studies: dict[str, Any] = {"search": search, "repeats": None}
    report = lambda *_: write_reports(sweep.output, header, studies["search"], repeats,  # noqa: E731
                                      repeat_results(studies["repeats"], repeats))
    runner = TrialRunner(sweep.output, sweep.config, sweep.overrides, metric,
                         on_trial_end=progress_line(sweep, metric, greater, report),
                         group=None if cfg.logging.run_group else str(sweep.output))
    # a signal outside a trial's training ends the sweep between trials
    with StopSignals() as signals, few_updates_said_once() as few_updates:
        run_phases(sweep, runner, signals, storage, studies, identity, greater, repeats)
    if few_updates.cautioned and search is not None:
        search.set_user_attr(FEW_UPDATES_ATTR, True)  # for sweep.md, which a continuation writes again
    few = report()  # sweep.md's note of the trials that made too few updates, said in the log too
    if few is not None:
        logger.warning(few)
    winner = best_trial(search.get_trials(deepcopy=False), greater) if search is not None else None
    if winner is not None:
        logger.info("best: trial %d, %s %.4f: %s", winner.number, metric, winner.value,
                    " ".join(overrides(winner.params)))
    values = repeat_results(studies["repeats"], repeats)
    results = {"search": search is not None, **({repeats.name: values} if repeats else {})}
    if values:
        mean, std = mean_and_deviation([v for _, v in values])
        logger.info("over %d %s: %s mean %.4f, standard deviation %.4f (%s)", len(values), repeats.name, metric, mean,
                    std, ", ".join(f"{repeats.unit} {s}: {v:.4f}" for s, v in values))
    if repeats is not None and repeats.name == "folds" and len(values) == len(repeats.values):
        written = write_out_of_fold_predictions(sweep.output, repeats)
        if written is not None:
            logger.info("out-of-fold predictions (each row by the fold's model that did not train on it): %s", written)
    logger.info("sweep done: %s", sweep.output / "sweep.md")
    return results


# a search chooses, and a test set is what nothing is chosen on: the search's trials do not score it; the seeds or
# folds runs of the config it chose (best.yaml keeps it) do
SEARCH_LEAVES_OUT = ("data.test_file=null", "data.test_split_name=null")


def run_phases(sweep: Sweep, runner: TrialRunner, signals: StopSignals, storage, studies: dict[str, Any],
               identity: dict[str, str], greater: bool, repeats: Optional[Repeats]) -> None:
    """The search (with a space), then the seeds or folds runs (with ``--seeds`` or ``--folds``)."""
    search = studies["search"]
    if search is not None:
        search.sampler, search.pruner = make_sampler(sweep, len(search.trials)), make_pruner(sweep.pruner)
        seeds = search_seeds(sweep, sweep.run_config.training.seed)
        trial_seeds = list(seeds) if len(seeds) > 1 else []
        runner.phase = Phase("search", search, sweep.space, sweep.trials, lambda n, _: f"trial-{n:04d}", trial_seeds,
                             fixed=list(SEARCH_LEAVES_OUT), pruner=sweep.pruner)
        run_phase(runner, signals)
    if repeats is not None:
        studies["repeats"] = repeats_study(storage, sweep, greater, identity, search, repeats)
        fixed = [*repeats.fixed, *overrides(json.loads(studies["repeats"].user_attrs[BASE_PARAMS_ATTR]))]
        space = SearchSpace((Dimension(repeats.key, "choice", choices=repeats.values),))
        runner.phase = Phase(repeats.name, studies["repeats"], space, len(repeats.values),
                             lambda _, params: repeats.folder(params[repeats.key]), fixed=fixed)
        run_phase(runner, signals)


def run_phase(runner: TrialRunner, signals: StopSignals) -> None:
    """Run the phase's trials until its budget is spent (queued continuations first), then wait while other
    workers finish its last ones, running any continuation they leave queued.

    Raises:
        RunInterrupted: a signal came outside a trial's training (a signal during it ends that trial with a
            checkpoint and a queued continuation, and reaches here as the same error).
    """
    import time

    import optuna

    phase, said = runner.phase, False
    while True:
        stop_if_signalled(signals)
        if budget_left(phase.study, phase.trials):
            phase.study.optimize(runner, n_trials=1)
            continue
        others = running(phase.study)
        if not others:
            return
        if not said:
            logger.info("%s: waiting for %d trial(s) other workers run", phase.name, others)
            said = True
        time.sleep(WAIT_S)
        optuna.storages.fail_stale_trials(phase.study)  # a lost worker's trial is queued to continue here


def stop_if_signalled(signals: StopSignals) -> None:
    if signals.signum is not None:
        name = signal.Signals(signals.signum).name
        raise RunInterrupted(f"interrupted by {name} between trials; run the same command to continue the sweep",
                             signals.signum)


def repeats_study(storage, sweep: Sweep, greater: bool, identity: dict[str, str], search, repeats: Repeats):
    """The study of the seeds or folds runs: the best trial's values (or none) with each seed or fold queued once."""
    winner = best_trial(search.get_trials(deepcopy=False), greater) if search is not None else None
    best = winner.params if winner is not None else {}
    direction = "maximize" if greater else "minimize"
    study = load_or_create(storage, f"{sweep.study_name}.{repeats.name}", direction, identity)
    if BASE_PARAMS_ATTR not in study.user_attrs:
        study.set_user_attr(BASE_PARAMS_ATTR, json.dumps(best, sort_keys=True))
    for value in repeats.values:
        study.enqueue_trial({repeats.key: value}, skip_if_exists=True)
    return study


def repeat_results(study, repeats: Optional[Repeats]) -> list[tuple[int, float]]:
    """Each finished seed's or fold's value, in order."""
    if study is None:
        return []
    scored = [t for t in study.get_trials(deepcopy=False) if state_of(t) == "complete"]
    return sorted((t.params[repeats.key], t.value) for t in scored)


def progress_line(sweep: Sweep, metric: str, greater: bool, report):
    """The callback at each trial's end: one line, then the reports rewritten; after the first trial that finished,
    the caution of a disk the runs left would fill (:func:`finetune.sweep_notes.disk_short`), where it would."""
    measured = []

    def on_trial_end(phase: Phase, number: int, record: dict[str, Any]) -> None:
        values = " ".join(overrides(record["params"])) or "the config"
        state = record["state"]
        if state in ("complete", "same"):
            what = f"{metric} {record['value']:.4f}" + (f" (same values as trial {record['same_as']})"
                                                        if state == "same" else "")
        else:
            what = f"{state}: {record.get('why', '')}"
        seconds = f" in {record['seconds']:.0f}s" if "seconds" in record else ""
        logger.info("%s trial %d%s: %s; %s", phase.name, number, seconds, what, values)
        report()
        if state == "complete" and not measured:
            from finetune.sweep_dry_run import sweep_so_far

            measured.append(number)
            left = sweep_so_far(sweep, greater).runs_left - 1  # this trial still counts, as running
            run = Path(record["runs"][0]["output_dir"])  # a trial over several seeds: its first seed's
            short = disk_short(sweep.output, run, left) if left > 0 else None
            if short is not None:
                logger.warning(short)

    return on_trial_end


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.unknown:
        from finetune.config import refuse_options  # key_hints' own, through config: one package import fewer
        from finetune.train import SHORTCUTS

        flags = {flag: SHORTCUTS[flag] for flag in SWEEP_FLAGS}
        return run_command(lambda: refuse_options(args.unknown, argv, "finetune sweep", flags, args.options),
                           debug=args.debug)
    library_bars_seldom_into_a_file()  # before anything imports tqdm
    log_to_stderr()
    # a note on the command line's keys, or on what reading the data found, said once for the sweep, not for each
    # of its reads
    with notes_said_once():
        if args.dry_run:
            from finetune.sweep_dry_run import rehearse_sweep

            return run_command(lambda: rehearse_sweep(build_sweep(args, argv)), debug=args.debug)
        return run_command(lambda: run_sweep(build_sweep(args, argv)), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
