"""What an evaluation's bootstrap intervals cost, beside the metrics they bound: ``python -m bench.intervals``.

For each shape (labels, texts) it makes predictions right on 90% of the texts, then times the five built-in
metrics as every evaluation computes them (``MetricSuite.compute``, through evaluate) and their 95% intervals
(``finetune.metrics.metric_intervals``, 1,000 resamples), each the median of its rounds, and prints a Markdown
table. The intervals' cost grows with the distinct (true, predicted) pairs, not with the texts: the shapes
show both; a regression model's pairs are mostly as many as its texts (the last rows).

``--ranking`` times ROC AUC and average precision instead (``finetune.metrics.ranking``), from softmax
probabilities that favour the true class, and their intervals: each resample weighs every text, so their cost
grows with the texts times the classes ranked (one for a binary average), and past
``MOST_PAIRS_FOR_AN_INTERVAL`` an evaluation computes none (the last row).
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
# the ranking metrics: (classes, texts), binary for two classes, macro for more
RANKED_SHAPES = ((2, 487), (2, 2_000), (2, 10_000), (5, 2_000), (2, 100_000))


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
    parser.add_argument("--ranking", action="store_true", help="time roc_auc and average_precision instead")
    args = parser.parse_args(argv)
    if args.ranking:
        return ranking(args.rounds)
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


def ranking(rounds: int) -> int:
    """``--ranking``: the ranking metrics and their intervals, for each of :data:`RANKED_SHAPES`."""
    import numpy as np

    from finetune.metrics import MetricSuite, metric_intervals

    lines = ["| classes | texts | ranked pairs | metrics (ms) | intervals (ms) |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for classes, texts in RANKED_SHAPES:
        rng = np.random.default_rng(0)
        references = rng.integers(0, classes, texts)
        logits = rng.normal(size=(texts, classes)) + 1.5 * np.eye(classes)[references]
        scores = (np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)).astype(np.float32)
        predictions = scores.argmax(axis=1)
        binary = classes == 2
        suite = MetricSuite(["roc_auc", "average_precision"], classes, "binary" if binary else "macro",
                            1 if binary else None)
        metrics = timed(lambda: suite.compute(predictions, references, scores=scores), rounds)
        given = metric_intervals(suite, predictions, references, scores=scores)
        intervals = timed(lambda: metric_intervals(suite, predictions, references, scores=scores), rounds)
        pairs = texts * (1 if binary else classes)
        lines.append(f"| {classes} | {texts:,} | {pairs:,} | {metrics * 1e3:.1f} | "
                     + (f"{intervals * 1e3:.1f} |" if given else "none (past the limit) |"))
        print(lines[-1], file=sys.stderr)
    print(f"Command: `python -m bench.intervals --ranking --rounds {rounds}`\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
