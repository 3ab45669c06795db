"""Predictions per second in float32 and under bf16 (and, on a GPU, fp16) autocast, side by side.

Usage::

    make train                                       # writes outputs/sms_spam, the default run
    python -m bench.predict                          # its model on 3,000 of the default job's texts
    python -m bench.predict outputs/my_run --texts 20000 --config configs/bbc_news.yaml
    python -m bench.predict --padding bf16           # each batch padded to its longest text, or to 8
    python -m bench.predict --workers 4 --precision bf16   # batches padded in the loop, or by 4 DataLoader workers

Each precision predicts the same texts with the run's model
(``finetune.predict.Predictor``, the ``--precision`` of ``finetune predict``
and ``finetune score``), the precisions alternating by round; a round's
first pass is timed too, so run a round or two more for a steadier median.
Beside the speed: how many labels agree with float32's, and the largest
difference of a probability. Prints a Markdown table for bench/README.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def job_texts(config: Path, n: int) -> list[str]:
    """The first ``n`` training texts of ``config``'s data, read as a run reads them (repeated when fewer)."""
    from finetune.columns import read_column
    from finetune.config import load_config
    from finetune.data import TEXT, load_splits
    from finetune.predict import quiet_progress_bars

    quiet_progress_bars()
    cfg = load_config(str(config), [])
    splits, _ = load_splits(cfg.data, seed=cfg.training.seed)
    texts = read_column(splits["train"], TEXT)
    return [texts[i % len(texts)] for i in range(n)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", nargs="?", default=str(REPO / "outputs" / "sms_spam"))
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml",
                        help="whose training texts to predict (default: the default job's SMS messages)")
    parser.add_argument("--texts", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, help="cut texts to this many tokens (default: the run's "
                        "data.max_length)")
    parser.add_argument("--padding", metavar="PRECISION", choices=["no", "bf16", "fp16"],
                        help="instead of the precisions: each batch padded to its longest text against padded to a "
                             "multiple of 8 (the default), in this precision")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="instead of the precisions: batches padded in the loop against padded by N DataLoader "
                             "workers ahead of the forward passes, in --precision")
    parser.add_argument("--precision", default="no", choices=["no", "bf16", "fp16"],
                        help="the precision of --workers' predictions (default: float32)")
    args = parser.parse_args(argv)
    if not (Path(args.output_dir) / "config.json").is_file():
        raise SystemExit(f"{args.output_dir}: no trained model (run `make train` first, or name a run's folder)")

    from finetune.predict import Predictor

    texts = job_texts(args.config, args.texts)
    if args.padding:
        return compare_padding(args, texts, argv)
    if args.workers is not None:
        return compare_workers(args, texts, argv)
    base = Predictor.load(args.output_dir, batch_size=args.batch_size, max_length=args.max_length)
    precisions = ["no", "bf16"] + (["fp16"] if base.device.type == "cuda" else [])
    predictors = {"no": base}
    for precision in precisions[1:]:
        predictors[precision] = Predictor.load(args.output_dir, batch_size=args.batch_size, precision=precision,
                                               max_length=args.max_length)
    seconds, probabilities = timed_rounds(predictors, texts, args.rounds)
    exact = probabilities["no"]
    command = " ".join(["python -m bench.predict", *(argv if argv is not None else sys.argv[1:])])
    lines = [f"Command: `{command}` ({len(texts)} texts, batch {args.batch_size}, {base.device})", "",
             "| precision | texts/s (median) | x float32 | labels as float32's | largest probability difference |",
             "| --- | ---: | ---: | ---: | ---: |"]
    fp32_rate = len(texts) / statistics.median(seconds["no"])
    for precision in precisions:
        rate = len(texts) / statistics.median(seconds[precision])
        agree = float((probabilities[precision].argmax(1) == exact.argmax(1)).mean())
        largest = float(abs(probabilities[precision] - exact).max())
        name = "float32" if precision == "no" else f"{precision} autocast"
        lines.append(f"| {name} | {rate:.0f} | {rate / fp32_rate:.2f} | {agree:.2%} | {largest:.1e} |")
    print("\n".join(lines))
    return 0


def timed_rounds(predictors: dict, texts: list[str], rounds: int, alternate: bool = False
                 ) -> tuple[dict[str, list[float]], dict]:
    """Each predictor's seconds for ``texts`` in every round (``alternate``: every other round in the reverse
    order), and its last probabilities."""
    import torch

    device = next(iter(predictors.values())).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds: dict[str, list[float]] = {name: [] for name in predictors}
    probabilities = {}
    for round_ in range(rounds):
        for name in (list(predictors)[::-1] if alternate and round_ % 2 else list(predictors)):
            sync()
            began = time.perf_counter()
            probabilities[name] = predictors[name].probabilities(texts)
            sync()
            seconds[name].append(time.perf_counter() - began)
            print(f"{name}: {seconds[name][-1]:.2f} s", file=sys.stderr)
    return seconds, probabilities


def compare_padding(args, texts: list[str], argv) -> int:
    """Texts per second with each batch padded to its longest text and to a multiple of 8, alternating by round,
    and the largest difference of a probability between them (padding is masked: float rounding only)."""
    arms = {"to its longest text": None, "to a multiple of 8": 8}
    seconds, probabilities, device = timed_arms(args, texts, args.padding, "pad_to_multiple_of", arms)
    longest, eight = (probabilities[name] for name in arms)
    lines = arms_table(args, texts, argv, args.padding, device, seconds, "to its longest")
    lines += ["", f"Labels alike: {float((longest.argmax(1) == eight.argmax(1)).mean()):.2%}; largest probability "
                  f"difference {float(abs(longest - eight).max()):.1e}."]
    print("\n".join(lines))
    return 0


def compare_workers(args, texts: list[str], argv) -> int:
    """Texts per second with each batch padded in the prediction loop and padded by ``--workers`` DataLoader
    workers while the model runs the batches before (``Predictor(num_workers=)``), alternating by round; their
    probabilities must agree bit for bit (the same batches, padded alike)."""
    import numpy as np

    arms = {"in the loop": 0, f"by {args.workers} worker{'s' if args.workers != 1 else ''}": args.workers}
    seconds, probabilities, device = timed_arms(args, texts, args.precision, "num_workers", arms)
    here, ahead = (probabilities[name] for name in arms)
    if not np.array_equal(here, ahead):
        raise SystemExit("the workers' batches gave other probabilities than the loop's")
    lines = arms_table(args, texts, argv, args.precision, device, seconds, "in the loop")
    print("\n".join([*lines, "", "The same probabilities, bit for bit."]))
    return 0


def timed_arms(args, texts: list[str], precision: str, setting: str, arms: dict) -> tuple[dict, dict, object]:
    """Each arm's seconds by round and last probabilities, the arms one loaded predictor with ``setting`` (an
    attribute of it) set to the arm's value, alternating by round; and the device."""
    import copy

    from finetune.predict import Predictor

    # one model for every arm: a folder without a trained head would give each load a head of its own
    base = Predictor.load(args.output_dir, batch_size=args.batch_size, precision=precision,
                          max_length=args.max_length)
    predictors = {name: copy.copy(base) for name in arms}
    for name, value in arms.items():
        setattr(predictors[name], setting, value)
    seconds, probabilities = timed_rounds(predictors, texts, args.rounds, alternate=True)
    return seconds, probabilities, base.device


def arms_table(args, texts: list[str], argv, precision: str, device, seconds: dict, first: str) -> list[str]:
    """The command, then a Markdown row per arm: texts per second, against the first arm's (``first`` in the
    column's name), and the seconds of each round."""
    command = " ".join(["python -m bench.predict", *(argv if argv is not None else sys.argv[1:])])
    base_rate = len(texts) / statistics.median(next(iter(seconds.values())))
    lines = [f"Command: `{command}` ({len(texts)} texts, batch {args.batch_size}, {precision}, {device})", "",
             f"| each batch padded | texts/s (median) | x {first} | seconds by round |",
             "| --- | ---: | ---: | --- |"]
    for name, rounds in seconds.items():
        rate = len(texts) / statistics.median(rounds)
        lines.append(f"| {name} | {rate:.0f} | {rate / base_rate:.2f} | {', '.join(f'{s:.2f}' for s in rounds)} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
