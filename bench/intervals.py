"""What an evaluation's bootstrap intervals cost, beside the metrics they bound: ``python -m bench.intervals``.

For each shape (labels, texts) it makes predictions right on 90% of the texts, then times the five built-in
metrics as every evaluation computes them (``MetricSuite.compute``, through evaluate) and their 95% intervals
(``finetune.metrics.metric_intervals``, 1,000 resamples), each the median of its rounds, and prints a Markdown
table. The intervals' cost grows with the distinct (true, predicted) pairs, not with the texts: the shapes
show both; a regression model's pairs are mostly as many as its texts (the last rows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

SHAPES = ((2, 487), (2, 100_000), (20, 5_000), (100, 20_000), (1000, 50_000))
# regression: the texts, each with its own target (the pairs the resamples draw are as many as the texts)
NUMBERS = (1_500, 20_000)


def timed(fn, rounds: int) -> float:
    """The median seconds of ``rounds`` calls, after one untimed."""
    fn()
    seconds = []
    for _ in range(rounds):
        began = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def main(argv=None) -> int:
    import numpy as np

    from finetune.metrics import BUILTIN_METRICS, MetricSuite, metric_intervals
    from finetune.metrics.other_tasks import REGRESSION_METRICS, RegressionMetrics

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    lines = ["| labels | texts | metrics (ms) | intervals (ms) |", "| ---: | ---: | ---: | ---: |"]
    for labels, texts in SHAPES:
        rng = np.random.default_rng(0)
        references = rng.integers(0, labels, texts)
        predictions = np.where(rng.random(texts) < 0.9, references, rng.integers(0, labels, texts))
        binary = labels == 2
        suite = MetricSuite(list(BUILTIN_METRICS), labels, "binary" if binary else "macro", 1 if binary else None)
        metrics = timed(lambda: suite.compute(predictions, references), args.rounds)
        intervals = timed(lambda: metric_intervals(suite, predictions, references), args.rounds)
        lines.append(f"| {labels} | {texts:,} | {metrics * 1e3:.1f} | {intervals * 1e3:.1f} |")
        print(lines[-1], file=sys.stderr)
    for texts in NUMBERS:
        rng = np.random.default_rng(0)
        targets = rng.normal(size=texts)
        predictions = targets + rng.normal(scale=0.5, size=texts)
        suite = RegressionMetrics(list(REGRESSION_METRICS))
        metrics = timed(lambda: suite.compute(predictions, targets), args.rounds)
        intervals = timed(lambda: metric_intervals(suite, predictions, targets), args.rounds)
        lines.append(f"| a number (regression) | {texts:,} | {metrics * 1e3:.1f} | {intervals * 1e3:.1f} |")
        print(lines[-1], file=sys.stderr)
    print(f"Command: `python -m bench.intervals --rounds {args.rounds}`\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
