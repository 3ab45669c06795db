"""A regression run's validation rows: stratified by the target's order (the run's carve) against a seeded random
draw of as many rows (what the carve was before), over seeds.

    python bench/carves.py                 # 300 seeds, 1,000 and 300 rows, a tenth held out
    python bench/carves.py --seeds 20 --fraction 0.2

No training: a carve depends on the targets alone. Two target distributions: the rating task of
``bench/regression_head.py`` (0 to 5.5, about uniform) and a skewed one (log-normal, as prices, counts and
durations are). For each seed and each way of carving, three figures of the held-out targets against all of
them: the largest gap between their two cumulative distributions (Kolmogorov-Smirnov), how far their mean is, in
standard deviations of the whole; and the spread over seeds of one fixed model's validation MSE and Pearson
correlation (its errors the same at every seed): how much of a run's score is the carve's luck.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def rating_targets(rows: int) -> np.ndarray:
    """The targets of ``bench/regression_head.py``'s rating task (its own file, read back)."""
    from bench.regression_head import write_ratings

    with tempfile.TemporaryDirectory() as folder:
        lines = write_ratings(Path(folder) / "ratings.csv", rows=rows).read_text(encoding="utf-8").splitlines()[1:]
    return np.asarray([float(line.rsplit(",", 1)[1]) for line in lines])


def skewed_targets(rows: int) -> np.ndarray:
    return np.round(np.random.default_rng(11).lognormal(3.0, 1.0, rows), 2)


def ks_distance(held: np.ndarray, whole: np.ndarray) -> float:
    """The largest gap between the cumulative distributions of ``held`` and ``whole``."""
    points = np.sort(whole)
    below_held = np.searchsorted(np.sort(held), points, side="right") / len(held)
    below_whole = np.searchsorted(points, points, side="right") / len(whole)
    return float(np.abs(below_held - below_whole).max())


def figures(targets: np.ndarray, held: np.ndarray) -> tuple[float, float, float, float]:
    """The KS distance, the mean's gap in standard deviations, and a fixed model's MSE and Pearson correlation on
    the ``held`` rows (its predictions: the targets plus an error of half their standard deviation, the same at
    every seed)."""
    predictions = targets + 0.5 * targets.std() * np.random.default_rng(0).standard_normal(len(targets))
    gap = abs(targets[held].mean() - targets.mean()) / targets.std()
    mse = float(np.mean((predictions[held] - targets[held]) ** 2))
    return ks_distance(targets[held], targets), gap, mse, float(np.corrcoef(predictions[held], targets[held])[0, 1])


def compare(name: str, targets: np.ndarray, seeds: int, fraction: float) -> list[str]:
    from finetune.carve import target_strata

    n_validation = int(np.ceil(fraction * len(targets)))
    ways = {"stratified by the target (the run's)": lambda seed: target_strata(targets, n_validation, seed),
            "random (a seeded draw of as many rows)":
                lambda seed: np.random.default_rng(seed).permutation(len(targets))[:n_validation]}
    lines = []
    for way, carve in ways.items():
        ks, gap, mse, pearson = np.asarray([figures(targets, carve(seed)) for seed in range(seeds)]).T
        lines.append(f"| {name}, {len(targets):,} rows | {way} | {ks.mean():.3f} ({ks.max():.3f}) | "
                     f"{gap.mean():.3f} ({gap.max():.3f}) | {mse.std() / mse.mean():.3f} | {pearson.std():.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=300)
    parser.add_argument("--fraction", type=float, default=0.1)
    args = parser.parse_args()
    print(f"python bench/carves.py --seeds {args.seeds} --fraction {args.fraction}\n")
    print("| targets | held out | KS distance to all, mean (worst) | mean's gap in SDs, mean (worst) | "
          "a fixed model's MSE over seeds: SD / mean | its Pearson over seeds: SD |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for rows in (1000, 300):
        for name, targets in (("ratings 0-5.5", rating_targets(rows)), ("log-normal", skewed_targets(rows))):
            print("\n".join(compare(name, targets, args.seeds, args.fraction)), flush=True)


if __name__ == "__main__":
    main()
