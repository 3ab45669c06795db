"""A K-fold sweep's models predicting together, against each of them alone and against one model of every row.

    python bench/ensemble.py                    # 5 folds, one split: about 10 minutes on 2 CPU cores
    python bench/ensemble.py --folds 3 --splits 7,8

The job: the default job (the embedded MiniLM, configs/default.yaml's settings) on the embedded SMS Spam
Collection, 20% of its messages held out (seeded by ``--splits``; 972 of them), two classes (ham, spam), as
``bench/thresholds.py --binary`` holds them out. On the other 80%:

1. ``finetune sweep --folds K``: K runs of the default config, each holding out another fold of the training
   messages as its validation texts (``data.validation_folds``);
2. ``finetune train`` of the same config on every training message (``data.validation_split=0``): what a user
   who does not keep the folds' models would train, with the whole of the data.

Each is scored on the held-out messages by ``finetune score`` in a process of its own: every fold's model alone,
the folds' folder (the K models, their probabilities averaged, at the mean of their thresholds: none, here),
and the one model of every row; then the folds' folder ``--against`` that one model, for the paired difference
of each metric with its 95% interval over resamples of the held-out messages. The F1 is spam's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: the package and bench/ from this checkout
    sys.path.insert(0, str(REPO))

from bench.thresholds import write_two_classes  # noqa: E402

METRICS = "evaluation.metrics=[accuracy,f1,average_precision]"


def finetune(*args: str) -> float:
    """``finetune ARGS`` in a process of its own, offline; its seconds."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"finetune {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - started


def scored(model: Path, test: Path, out: Path, *more: str) -> dict:
    """``finetune score MODEL --file TEST``'s JSON report, and the seconds it took under ``seconds``."""
    report = out / f"{model.name}-{len(list(out.glob('*.json')))}.json"
    seconds = finetune("score", str(model), "--file", str(test), "--no-overlap-check", "--json", str(report),
                       METRICS, *more)
    return {**json.loads(report.read_text(encoding="utf-8")), "seconds": seconds}


def measure(split: int, folds: int) -> dict:
    """One held-out split: the fold models' held-out scores, the ensemble's, the one model's, and the paired
    difference of the ensemble against it."""
    work = Path(tempfile.mkdtemp(prefix="ensemble-"))
    train, test = write_two_classes(work, seed=split)
    data = ["--data", str(train), "--text", "text", "--label", "label"]
    sweep_seconds = finetune("sweep", *data, "--folds", str(folds), "--output", str(work / "sweep"),
                             "evaluation.metric_for_best_model=f1", METRICS, "logging.progress_bar=false")
    whole_seconds = finetune("train", *data, "--output", str(work / "whole"), "data.validation_split=0",
                             "output.save_checkpoints=false", "logging.progress_bar=false")
    fold_runs = sorted((work / "sweep" / "folds").glob("fold-*"), key=lambda run: int(run.name.split("-")[1]))
    alone = [scored(run, test, work)["metrics"] for run in fold_runs]
    together = scored(work / "sweep" / "folds", test, work, "--against", str(work / "whole"))
    whole = scored(work / "whole", test, work)["metrics"]
    return {"split": split, "folder": str(work), "held_out": together["metrics"]["num_samples"],
            "alone": alone, "together": together["metrics"], "whole": whole,
            "intervals": together["against"]["intervals"],
            "seconds": {"sweep": sweep_seconds, "whole": whole_seconds, "together": together["seconds"]}}


def table(rows: list[dict]) -> str:
    """The markdown table of every split: each metric of the fold models (mean, and range), the ensemble, the
    one model of every row, and the ensemble's paired difference from it with its interval."""
    lines = ["| split | metric | fold models alone: mean (range) | the folds together | one model of every row "
             "| together minus one model (95% interval) |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        for metric in ("accuracy", "f1", "average_precision", "loss"):
            values = [one[metric] for one in row["alone"]]
            interval = row["intervals"].get(metric)  # none for the loss: the comparison pairs the metrics
            said = f"{row['together'][metric] - row['whole'][metric]:+.4f}" + (
                f" ({interval[0]:+.4f} to {interval[1]:+.4f})" if interval else "")
            lines.append(f"| {row['split']} | {metric} | {statistics.fmean(values):.4f} ({min(values):.4f}-"
                         f"{max(values):.4f}) | {row['together'][metric]:.4f} | {row['whole'][metric]:.4f} "
                         f"| {said} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--splits", default="7", help="the held-out carves' seeds, comma-separated")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args(argv)
    rows = [measure(int(split), args.folds) for split in args.splits.split(",")]
    print(table(rows))
    for row in rows:
        seconds = row["seconds"]
        print(f"split {row['split']}: {row['held_out']} held-out messages; the sweep {seconds['sweep']:.0f} s, "
              f"the one model {seconds['whole']:.0f} s, scoring the {args.folds} together (against the one) "
              f"{seconds['together']:.0f} s; runs in {row['folder']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
