"""What padding costs: the tokens a run's micro-batches compute, one epoch in the training order, padded four ways.

Usage::

    python -m bench.padding                                   # the default job at max_length 128 and 512
    python -m bench.padding --max-lengths 256 --config configs/bbc_news.yaml [section.key=value ...]

The ways, each over the same micro-batches (the package's training order for
epoch 0, ``b`` texts each):

- ``dynamic``: each micro-batch padded to its own longest text, a multiple of
  8 (the package's eager collator on a GPU);
- ``4 up to max_length``: one of four lengths a quarter of ``data.max_length``
  apart (what ``training.torch_compile`` padded to before the lengths
  followed the data);
- ``4 up to the longest``: what ``training.torch_compile`` padded to before it
  took the graphs' eight, a quarter of the longest training text apart;
- ``8 up to the longest``: ``training.cuda_graphs``'s and
  ``training.torch_compile``'s (eight lengths, one graph each).

Counts only: no model runs. Each way's tokens are also given as a multiple of
the texts' own (non-pad) tokens. Prints a Markdown table for bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(config: Path, max_length: int, overrides: list[str]) -> dict:
    """The tokens each way computes over one epoch of the job at ``max_length``."""
    from finetune.accumulation import resolve_batching
    from finetune.config import load_config
    from finetune.cuda_graphs import MAX_GRAPHS
    from finetune.data import load_splits
    from finetune.dataloaders import BucketPadding, training_sampler
    from finetune.modeling import load_tokenizer
    from finetune.tokens import tokenize_splits
    from finetune.truncation import LENGTH

    cfg = load_config(config, [f"data.max_length={max_length}", *overrides])
    tokenizer = load_tokenizer(cfg.model)
    splits, _ = load_splits(cfg.data, seed=cfg.training.seed)
    lengths = list(tokenize_splits(splits, tokenizer, max_length)["train"][LENGTH])
    batching = resolve_batching(cfg.training, 1)
    order = list(training_sampler(cfg, lengths, batching))
    b = batching.per_device_batch_size
    longest_of = [max(lengths[i] for i in order[start:start + b]) for start in range(0, len(order), b)]
    rows = [len(order[start:start + b]) for start in range(0, len(order), b)]
    longest = max(lengths)
    ways = {
        "dynamic": lambda n: -(-n // 8) * 8,
        "4 up to max_length": BucketPadding(tokenizer, max_length, 4).size_for,
        "4 up to the longest": BucketPadding(tokenizer, max_length, 4, longest=longest).size_for,
        f"{MAX_GRAPHS} up to the longest": BucketPadding(tokenizer, max_length, MAX_GRAPHS, longest=longest).size_for,
    }
    real = sum(lengths)
    tokens = {name: sum(n * width(m) for n, m in zip(rows, longest_of)) for name, width in ways.items()}
    return {"config": str(config), "max_length": max_length, "b": b, "texts": len(lengths), "longest": longest,
            "real_tokens": real, "tokens": tokens, "x_real": {name: t / real for name, t in tokens.items()}}


def table(results: list[dict]) -> str:
    names = list(results[0]["tokens"])
    lines = ["| max_length | longest text | b | " + " | ".join(f"{n}: tokens (x real)" for n in names) + " |",
             "| ---: | ---: | ---: |" + " ---: |" * len(names)]
    for r in results:
        cells = " | ".join(f"{r['tokens'][n]} ({r['x_real'][n]:.2f})" for n in names)
        lines.append(f"| {r['max_length']} | {r['longest']} | {r['b']} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml")
    parser.add_argument("--max-lengths", default="128,512", help="comma-separated (default 128,512)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    results = [measure(args.config, int(n), args.overrides) for n in args.max_lengths.split(",")]
    print(json.dumps(results), file=sys.stderr)
    command = " ".join(["python -m bench.padding", *(argv if argv is not None else sys.argv[1:])])
    print(f"Command: `{command}`\n\n{table(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
