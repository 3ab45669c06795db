"""Where a new regression head starts: the targets' mean against transformers' 0, side by side over seeds.

    python bench/regression_head.py                      # epochs 1 and 3, seeds 0, 1, 2
    python bench/regression_head.py --epochs 3 --seeds 0

The job: the embedded MiniLM (configs/default.yaml's model) on a rating task
written here from a fixed seed, 300 short reviews of five words, each word
drawn from five positive and five negative ones, rated by its number of
positive words plus uniform noise in [0, 0.5) (so from 0 to 5.5, mean about
2.9). Synthetic, so that it needs no network; the question it answers is the
offset, which any rating scale far from 0 has. Each run is
``finetune/train.py`` in its own process with ``model.problem_type=regression``
and ``model.regression_head_bias`` at ``mean`` or ``zero``; 10% of the rows
are held out (stratified by the target, as every regression run's carve). A row is the mean over the seeds of the held-out MSE and Pearson
correlation, with each seed's MSE.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOOD = ("great", "excellent", "superb", "lovely", "fine")
BAD = ("awful", "poor", "dull", "terrible", "weak")


def write_ratings(path: Path, rows: int = 300, seed: int = 5) -> Path:
    """The rating task's CSV: ``text,rating``."""
    rng = random.Random(seed)
    lines = ["text,rating"]
    for _ in range(rows):
        positive = rng.randint(0, 5)
        words = rng.sample(GOOD, positive) + rng.sample(BAD, 5 - positive)
        rng.shuffle(words)
        lines.append(f"{' '.join(words)},{positive + rng.random() * 0.5:.3f}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def train(data: Path, start: str, epochs: int, seed: int) -> dict:
    """One run; its held-out metrics."""
    out = Path(tempfile.mkdtemp(prefix="regression-head-"))
    cmd = [sys.executable, str(REPO / "finetune" / "train.py"), f"data.train_file={data}", "data.label_column=rating",
           "model.problem_type=regression", f"model.regression_head_bias={start}",
           f"training.num_train_epochs={epochs}", f"training.seed={seed}", f"output.output_dir={out}",
           "output.save_checkpoints=false", "logging.progress_bar=false"]
    proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{start} epochs {epochs} seed {seed} failed:\n{proc.stderr[-2000:]}")
    return json.loads((out / "metrics.json").read_text())["eval"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    data = write_ratings(Path(tempfile.mkdtemp(prefix="ratings-")) / "ratings.csv")
    print(f"python bench/regression_head.py --epochs {' '.join(map(str, args.epochs))} "
          f"--seeds {' '.join(map(str, args.seeds))}\n")
    print("| epochs | head starts at | held-out MSE (mean) | Pearson (mean) | MSE by seed |")
    print("| ---: | --- | ---: | ---: | --- |")
    for epochs in args.epochs:
        for start in ("zero", "mean"):
            runs = [train(data, start, epochs, seed) for seed in args.seeds]
            mse = [r["mse"] for r in runs]
            pearson = [r["pearson"] for r in runs]
            print(f"| {epochs} | {'0 (transformers)' if start == 'zero' else 'the targets mean'} | "
                  f"{statistics.fmean(mse):.3f} | {statistics.fmean(pearson):.3f} | "
                  f"{', '.join(f'{m:.3f}' for m in mse)} |", flush=True)


if __name__ == "__main__":
    main()
