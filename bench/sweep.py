"""What pruning saves and what a search finds, on the default job: the same trials with and without pruning, then the
best config against the default config over the same seeds.

    python bench/sweep.py                       # 12 trials, 5 seeds (about 70 minutes on 2 CPU cores)
    python bench/sweep.py --trials 4 --seeds 2  # a quick look

Every run is the default job (one epoch) evaluated four times an epoch
(``evaluation.evals_per_epoch=4``), so the pruner can stop a trial within its
epoch at the same shares of the data for every effective batch.

1. ``finetune sweep`` over ``configs/sweeps/default.yaml``'s space (learning
   rate, effective batch; objective f1 of spam) without pruning;
2. the same trials, queued in the same order, with the median pruner: the
   pruner is the only difference, so the time saved and whether the best
   trial survived are its effect alone;
3. the best config of (1) and the default config, each over ``--seeds``
   seeds (``training.seed`` 42, 43, ...), paired by seed.

Each arm is a sweep of its own in a temporary folder, one after the other.
"""

from __future__ import annotations

import argparse
import csv
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


def seed_scores(folder: Path) -> dict[int, float]:
    return {int(p.name.removeprefix("seed-")): json.loads((p / "metrics.json").read_text())["eval"]["f1"]
            for p in sorted((folder / "seeds").glob("seed-*"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=1, help="training.num_train_epochs of every run")
    parser.add_argument("--evals-per-epoch", type=int, default=4, help="evaluation.evals_per_epoch of every run: "
                        "the points where the pruner compares trials")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    EVERY_RUN[:] = [f"training.num_train_epochs={args.epochs}", f"evaluation.evals_per_epoch={args.evals_per_epoch}"]
    root = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    keys = ["optim.learning_rate", "training.effective_batch_size"]

    plain = root / "no-pruning"
    plain_s = sweep(["--sweep", str(SPACE), "--trials", str(args.trials), "--pruner", "none", "--output", str(plain)])
    plain_rows = rows(plain)
    queue_trials(root / "pruning", plain_rows, keys)
    pruned_s = sweep(["--sweep", str(SPACE), "--trials", str(args.trials), "--output", str(root / "pruning")])
    pruned_rows = rows(root / "pruning")

    best = max(plain_rows, key=lambda r: float(r["value"] or "nan"))
    sweep(["--seeds", str(args.seeds), "--output", str(root / "default-seeds")])
    sweep(["--seeds", str(args.seeds), "--output", str(root / "best-seeds"),
           *(f"{k}={best[k]}" for k in keys)])
    default, tuned = seed_scores(root / "default-seeds"), seed_scores(root / "best-seeds")

    def best_of(trials):
        done = [r for r in trials if r["state"] == "complete"]
        return max(float(r["value"]) for r in done) if done else float("nan")

    def updates(trials):  # the work done, whatever else the machine was doing
        return sum(int(r["updates"] or 0) for r in trials)

    result = {
        "trials": args.trials,
        "no_pruning": {"seconds": plain_s, "updates": updates(plain_rows), "best": best_of(plain_rows)},
        "pruning": {"seconds": pruned_s, "updates": updates(pruned_rows), "best": best_of(pruned_rows),
                    "pruned": sum(r["state"] == "pruned" for r in pruned_rows)},
        "best_values": {k: best[k] for k in keys},
        "seeds": {"default": default, "best": tuned,
                  "paired_gain": {s: tuned[s] - default[s] for s in default if s in tuned}},
    }
    print(json.dumps(result, indent=1))
    print("| search | wall s | updates trained | trials pruned | best f1 |\n| --- | ---: | ---: | ---: | ---: |")
    for name, arm in (("no pruning", result["no_pruning"]), ("median pruner", result["pruning"])):
        print(f"| {name} | {arm['seconds']:.0f} | {arm['updates']} | {arm.get('pruned', 0)} | {arm['best']:.4f} |")
    gains = list(result["seeds"]["paired_gain"].values())
    print("\n| config | f1 mean | f1 std | per seed |\n| --- | ---: | ---: | --- |")
    for name, scores in (("default", default), ("best of the search", tuned)):
        values = list(scores.values())
        print(f"| {name} | {statistics.fmean(values):.4f} | {statistics.stdev(values) if len(values) > 1 else 0:.4f} "
              f"| {', '.join(f'{v:.4f}' for v in values)} |")
    print(f"\npaired gain (best - default), mean over seeds: {statistics.fmean(gains):+.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
