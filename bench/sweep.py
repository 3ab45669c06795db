"""What pruning saves and what a search finds, on the default job: the same trials with and without pruning, then the
best config against the default config over the same seeds.

    python bench/sweep.py                       # 12 trials, 5 seeds (about 70 minutes on 2 CPU cores)
    python bench/sweep.py --trials 4 --seeds 2  # a quick look

Every run is the default job (one epoch) evaluated four times an epoch
(``evaluation.evals_per_epoch=4``), so the pruner can stop a trial within its
epoch at the same shares of the data for every effective batch.

1. ``finetune sweep`` over ``configs/sweeps/default.yaml``'s space (learning
   rate, effective batch; objective f1 of spam) without pruning;
2. the same trials, queued in the same order, with the shipped file's
   pruner: the pruner is the only difference, so the time saved and whether
   the best trial survived are its effect alone;
3. the best config of (1) and the default config, each over ``--seeds``
   seeds (``training.seed`` 42, 43, ...), paired by seed (``--seeds 0``:
   not run).

Each arm is a sweep of its own in a temporary folder, one after the other.
Between (1) and (2), other pruners are replayed on (1)'s evaluations: each
trial's evaluations reported in order to a study with that pruner, the trial
stopped where the pruner says so. A trial's evaluations before a stop do not
depend on the pruner (the same seed trains the same weights), so the replay
says what a sweep with that pruner would have trained and kept, in seconds,
where a sweep takes twenty minutes; (2) checks it against a real sweep.

    python bench/sweep.py --replay FOLDER       # the replay alone, on a finished unpruned sweep's folder
    python bench/sweep.py --plain FOLDER        # (2) and (3) on the trials of a finished unpruned sweep
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPACE = REPO / "configs" / "sweeps" / "default.yaml"
METRIC = "evaluation.metric_for_best_model=f1"


EVERY_RUN: list[str] = []


def sweep(args: list[str]) -> float:
    """Run one ``finetune sweep``; its wall time in seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "finetune.cli", "sweep", *args, METRIC, "logging.progress_bar=false",
                           "output.save_checkpoints=false", *EVERY_RUN],
                          cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"finetune sweep {' '.join(args)} failed:\n{done.stderr[-3000:]}{done.stdout[-3000:]}")
    return time.perf_counter() - start


def rows(folder: Path) -> list[dict]:
    return list(csv.DictReader((folder / "trials.csv").open()))


def queue_trials(folder: Path, trials: list[dict], keys: list[str]) -> None:
    """Create the pruned arm's study with the unpruned arm's values queued in the same order."""
    import optuna

    folder.mkdir(parents=True)
    study = optuna.create_study(study_name=folder.name, storage=f"sqlite:///{folder / 'study.db'}",
                                direction="maximize")
    for row in trials:
        study.enqueue_trial({k: (int(row[k]) if k == "training.effective_batch_size" else float(row[k]))
                             for k in keys})


def stops(folder: Path) -> list[str]:
    """A sweep's pruned trials, each as ``trial@evaluation`` (its evaluations counted in its ``train_log.jsonl``)."""
    found = []
    for row in rows(folder):
        if row["state"] == "pruned":
            log = (folder / row["folder"] / "train_log.jsonl").read_text().splitlines()
            found.append(f"{row['trial']}@{sum('eval/loss' in line for line in log)}")
    return found


def seed_scores(folder: Path) -> dict[int, float]:
    return {int(p.name.removeprefix("seed-")): json.loads((p / "metrics.json").read_text())["eval"]["f1"]
            for p in sorted((folder / "seeds").glob("seed-*"))}


# the pruners replayed, as a sweep file's ``pruner:`` says them
PRUNERS = {
    "median, 4 startup trials": {"type": "median", "startup_trials": 4},
    "median, from the 2nd quarter": {"type": "median", "startup_trials": 4, "warmup_epochs": 0.25},
    "the lowest quarter (percentile 75)": {"type": "percentile", "percentile": 75.0, "startup_trials": 4},
    "the lowest quarter, from the 2nd quarter": {"type": "percentile", "percentile": 75.0, "startup_trials": 4,
                                              "warmup_epochs": 0.25},
}
# not hyperband: Optuna deals its trials to brackets by Python's hash() of the study's name, which changes from one
# process to the next, so a replay of it would not repeat


@dataclasses.dataclass
class Curve:
    """One unpruned trial: the metric at each evaluation, the texts seen there and the texts trained to it."""

    number: int  # the trial's number in its sweep
    values: list[float]
    seen: list[int]  # the step the sweep reports an evaluation at (the epoch's share of the training texts)
    trained: list[int]  # updates to the evaluation times the effective batch
    value: float  # the trial's objective
    texts: int  # the training texts of an epoch


def curves(folder: Path, metric: str = "f1") -> list[Curve]:
    """The trials of a finished unpruned sweep, in the order they ran, from their ``train_log.jsonl``."""
    found = []
    for row in rows(folder):
        if row["state"] != "complete":  # a failed trial has no curve to replay
            continue
        run = folder / row["folder"]
        evals = [r for r in map(json.loads, (run / "train_log.jsonl").read_text().splitlines())
                 if f"eval/{metric}" in r]
        texts, batch = (json.loads((run / "metrics.json").read_text())["train"][k]
                        for k in ("train_samples", "effective_batch_size"))
        shares = len(evals)  # one epoch, evaluated at each of its shares
        found.append(Curve(int(row["trial"]), [r[f"eval/{metric}"] for r in evals],
                           [round(texts * (i + 1) / shares) for i in range(shares)],
                           [r["step"] * batch for r in evals], float(row["value"]), texts))
    return found


def replay(trials: list[Curve], settings: dict) -> dict:
    """What a sweep of these trials with this pruner would train and find.

    Each trial's evaluations are reported in order and the pruner asked after
    each, as ``finetune sweep`` asks it: not at or before ``warmup_epochs``,
    nor at the last evaluation (a trial that has trained to its end is not
    stopped: nothing is left to save).
    """
    import optuna

    from finetune.sweep import make_pruner
    from finetune.sweep_trial import past_warmup

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line for each study made
    study = optuna.create_study(study_name="replay", direction="maximize", pruner=make_pruner(settings),
                                sampler=optuna.samplers.RandomSampler(seed=0))
    trained, stopped, best = 0, [], float("-inf")
    for curve in trials:
        trial = study.ask()
        for i, (value, seen) in enumerate(zip(curve.values, curve.seen)):
            trial.report(value, seen)
            judged = i < len(curve.values) - 1 and past_warmup(seen, curve.texts, settings.get("warmup_epochs", 0))
            if judged and trial.should_prune():
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                trained += curve.trained[i]
                stopped.append(f"{curve.number}@{i + 1}")
                break
        else:
            study.tell(trial, curve.value)
            trained += curve.trained[-1]
            best = max(best, curve.value)
    return {"trained": trained, "stops": stopped, "best": best}


def replay_table(trials: list[Curve]) -> str:
    everything = sum(c.trained[-1] for c in trials)
    lines = ["| pruner | texts trained | x no pruning | stops (trial@evaluation) | best f1 kept |",
             "| --- | ---: | ---: | --- | ---: |"]
    for name, settings in {"none": {"type": "none"}, **PRUNERS}.items():
        got = replay(trials, settings)
        lines.append(f"| {name} | {got['trained']:,} | {got['trained'] / everything:.2f} | "
                     f"{', '.join(got['stops']) or '-'} | {got['best']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from finetune.sweep_file import pruner_settings, read_sweep_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=1, help="training.num_train_epochs of every run")
    parser.add_argument("--evals-per-epoch", type=int, default=4, help="evaluation.evals_per_epoch of every run: "
                        "the points where the pruner compares trials")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--replay", metavar="FOLDER", help="only replay the pruners on this unpruned sweep's folder")
    parser.add_argument("--plain", metavar="FOLDER", help="take (1) from this finished unpruned sweep's folder")
    args = parser.parse_args(argv)
    if args.replay:
        print(replay_table(curves(Path(args.replay))))
        return 0
    EVERY_RUN[:] = [f"training.num_train_epochs={args.epochs}", f"evaluation.evals_per_epoch={args.evals_per_epoch}"]
    root = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    keys = ["optim.learning_rate", "training.effective_batch_size"]

    plain = Path(args.plain) if args.plain else root / "no-pruning"
    plain_s = float("nan") if args.plain else sweep(["--sweep", str(SPACE), "--trials", str(args.trials), "--pruner",
                                                      "none", "--output", str(plain)])
    plain_rows, plain_curves = rows(plain), curves(plain)
    replayed = replay_table(plain_curves)
    print(replayed, flush=True)
    queue_trials(root / "pruning", plain_rows, keys)
    pruned_s = sweep(["--sweep", str(SPACE), "--trials", str(len(plain_rows)), "--output", str(root / "pruning")])
    pruned_rows = rows(root / "pruning")
    shipped = replay(plain_curves, pruner_settings(read_sweep_file(str(SPACE))["pruner"], str(SPACE)))["stops"]
    print(f"the shipped pruner's stops, replayed: {', '.join(shipped) or '-'}; in the sweep: "
          f"{', '.join(stops(root / 'pruning')) or '-'}", flush=True)

    best = max(plain_rows, key=lambda r: float(r["value"] or "nan"))
    default, tuned = {}, {}
    if args.seeds:
        sweep(["--seeds", str(args.seeds), "--output", str(root / "default-seeds")])
        sweep(["--seeds", str(args.seeds), "--output", str(root / "best-seeds"),
               *(f"{k}={best[k]}" for k in keys)])
        default, tuned = seed_scores(root / "default-seeds"), seed_scores(root / "best-seeds")

    def best_of(trials):
        done = [r for r in trials if r["state"] == "complete"]
        return max(float(r["value"]) for r in done) if done else float("nan")

    def texts(trials):  # the work done, whatever else the machine was doing
        return sum(int(r["updates"] or 0) * int(r["training.effective_batch_size"]) for r in trials)

    result = {
        "trials": len(plain_rows),
        "no_pruning": {"seconds": plain_s, "texts": texts(plain_rows), "best": best_of(plain_rows)},
        "pruning": {"seconds": pruned_s, "texts": texts(pruned_rows), "best": best_of(pruned_rows),
                    "pruned": sum(r["state"] == "pruned" for r in pruned_rows), "stops": stops(root / "pruning"),
                    "replayed_stops": shipped},
        "replay": replayed,
        "best_values": {k: best[k] for k in keys},
        "seeds": {"default": default, "best": tuned,
                  "paired_gain": {s: tuned[s] - default[s] for s in default if s in tuned}},
    }
    print(json.dumps(result, indent=1))
    print("| search | wall s | texts trained | trials pruned | best f1 |\n| --- | ---: | ---: | ---: | ---: |")
    for name, arm in (("no pruning", result["no_pruning"]), ("the shipped pruner", result["pruning"])):
        print(f"| {name} | {arm['seconds']:.0f} | {arm['texts']:,} | {arm.get('pruned', 0)} | {arm['best']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    gains = list(result["seeds"]["paired_gain"].values())
    if not gains:
        return 0
    print("\n| config | f1 mean | f1 std | per seed |\n| --- | ---: | ---: | --- |")
    for name, scores in (("default", default), ("best of the search", tuned)):
        values = list(scores.values())
        print(f"| {name} | {statistics.fmean(values):.4f} | {statistics.stdev(values) if len(values) > 1 else 0:.4f} "
              f"| {', '.join(f'{v:.4f}' for v in values)} |")
    print(f"\npaired gain (best - default), mean over seeds: {statistics.fmean(gains):+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
