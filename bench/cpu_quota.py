"""Training in a container whose CPU quota is smaller than the cores it sees: threads by the quota or by the cores.

Usage (as root on Linux, which may make a cgroup and a mount namespace)::

    python -m bench.cpu_quota                       # the default job's first 24 updates under a quota of 1 CPU
    python -m bench.cpu_quota --cpus 1 --pin 8      # and with 8 threads, as a host of 8 cores would start

A container given ``--cpus 4`` on a 64-core host sees 64 cores: in ``os.cpu_count()`` and in its CPU affinity.
Only the cgroup's CPU quota says it may use 4. This benchmark makes such a cgroup and runs ``finetune train`` inside
it, seen from inside as a container sees its own (``bench.cgroups``), each way in a fresh process, the ways
alternating by round:

- ``threads by the quota``: the package's choice (:func:`finetune.machine.available_cores`);
- ``threads by the cores``: ``FINETUNE_CPU_THREADS`` pinned to the cores the affinity allows, which is what the
  package chose before it read the quota;
- ``N threads`` for each ``--pin N``: a host of more cores than this one.

Each run's training samples/s is the median of its updates' after the first four (the start, the first
shapes), as its ``train_log.jsonl`` logs them. Prints a Markdown table for bench/README.md.

``--tokenizing`` times the tokenizers' thread pool (Rust's rayon) instead: the default job's messages, repeated to
``--texts``, encoded by its tokenizer in batches of 1,000 as ``datasets``' ``map`` hands them over, in a fresh
process per way: the package's choice (:func:`finetune.launch.hold_tokenizers_to_the_quota`, a pool of the
quota's cores), ``RAYON_NUM_THREADS`` at the cores the affinity allows (rayon's own count, which ignores the
quota), and each ``--pin N``::

    python -m bench.cpu_quota --tokenizing --pin 16 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.cgroups import in_a_container

REPO = Path(__file__).resolve().parent.parent
WARM_UPDATES = 4


def train_once(prefix: list[str], workdir: Path, updates: int, threads: int | None,
               config: Path = REPO / "configs" / "default.yaml") -> dict:
    """The first ``updates`` updates of ``config`` (the default job), under ``prefix``, with ``threads`` pinned
    (or the package's own choice): its median samples/s after the warm-up and what its start line says of the
    threads."""
    out = workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    env = {key: value for key, value in os.environ.items() if key != "FINETUNE_CPU_THREADS"}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    if threads is not None:
        env["FINETUNE_CPU_THREADS"] = str(threads)
    command = [*prefix, sys.executable, "-m", "finetune.cli", "train", "--config", str(config),
               "--output", str(out), f"training.max_steps={updates}", "logging.progress_bar=false",
               "output.save_checkpoints=false"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir)
    if done.returncode != 0:
        raise SystemExit(f"finetune train failed under the quota:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    rates = [r["train/samples_per_s"] for r in records if "train/samples_per_s" in r][WARM_UPDATES:]
    start = next(line for line in done.stderr.splitlines() if " threads=" in line)
    return {"samples_per_s": statistics.median(rates), "start": start[start.index("threads="):].split(" memory=")[0]}


TOKENIZE = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
import torch
from bench.predict import job_texts
from finetune.launch import configure_cpu_threads
from finetune.modeling import load_tokenizer
from finetune.config import load_config

cfg = load_config({config!r}, [])
texts = job_texts({config!r}, {texts})
configure_cpu_threads(torch.device("cpu"), 1)  # as a run does before it tokenizes
tokenizer = load_tokenizer(cfg.model)
start = time.perf_counter()
for i in range(0, len(texts), 1000):
    tokenizer(texts[i:i + 1000], truncation=True, max_length=cfg.data.max_length)
seconds = time.perf_counter() - start
print(json.dumps({{"texts_per_s": len(texts) / seconds, "pool": os.environ.get("RAYON_NUM_THREADS")}}))
"""


def tokenize_once(prefix: list[str], texts: int, threads: int | None,
                  config: Path = REPO / "configs" / "default.yaml") -> dict:
    """``texts`` of ``config``'s training texts encoded by its tokenizer under ``prefix``, with the tokenizers'
    pool at ``threads`` (or the package's own choice): texts/s and the pool's size as set."""
    env = {key: value for key, value in os.environ.items() if key != "RAYON_NUM_THREADS"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="true")
    if threads is not None:
        env["RAYON_NUM_THREADS"] = str(threads)
    child = TOKENIZE.format(repo=str(REPO), config=str(config), texts=texts)
    done = subprocess.run([*prefix, sys.executable, "-c", child], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"tokenizing failed under the quota:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpus", type=float, default=1.0, help="the cgroup's CPU quota, in CPUs (default 1)")
    parser.add_argument("--updates", type=int, default=24, help="updates of the default job each run trains")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pin", type=int, action="append", default=[], metavar="N",
                        help="also a way with N threads pinned (repeatable)")
    parser.add_argument("--tokenizing", action="store_true",
                        help="time the tokenizers' thread pool on the default job's texts instead of training")
    parser.add_argument("--texts", type=int, default=50_000, help="with --tokenizing: texts each way encodes")
    args = parser.parse_args(argv)
    if args.tokenizing:
        return compare_tokenizing(args, argv)
    from finetune.machine import affinity_cores

    seen = affinity_cores()
    ways = {"threads by the quota": None, "threads by the cores": seen, **{f"{n} threads": n for n in args.pin}}
    rates: dict[str, list[float]] = {way: [] for way in ways}
    said: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp, in_a_container(cpus=args.cpus) as prefix:
        for _ in range(args.rounds):
            for way, threads in ways.items():
                result = train_once(prefix, Path(tmp), args.updates, threads)
                rates[way].append(result["samples_per_s"])
                said[way] = result["start"]
    base = statistics.median(rates["threads by the cores"])
    command = " ".join(["python -m bench.cpu_quota", *(argv if argv is not None else sys.argv[1:])])
    lines = [f"Command: `{command}` (a quota of {args.cpus:g} CPU, rounded up to {math.ceil(args.cpus)}, on "
             f"{seen} cores; the default job's first {args.updates} updates, samples/s after the first "
             f"{WARM_UPDATES}; medians of {args.rounds} rounds)", "",
             "| threads | the start line says | samples/s by round | median | against threads by the cores |",
             "| --- | --- | --- | ---: | ---: |"]
    for way in ways:
        rounds = ", ".join(f"{r:.1f}" for r in rates[way])
        median = statistics.median(rates[way])
        lines.append(f"| {way} | `{said[way]}` | {rounds} | {median:.1f} | {median / base:.2f}x |")
    print("\n".join(lines))
    return 0


def compare_tokenizing(args, argv: list[str] | None) -> int:
    """``--tokenizing``: each way's texts/s, the ways alternating by round, as a Markdown table."""
    from finetune.machine import affinity_cores

    seen = affinity_cores()
    ways = {"pool by the quota (the package)": None, "pool by the cores (rayon's own)": seen,
            **{f"pool of {n}": n for n in args.pin}}
    rates: dict[str, list[float]] = {way: [] for way in ways}
    pools: dict[str, str] = {}
    with in_a_container(cpus=args.cpus) as prefix:
        for _ in range(args.rounds):
            for way, threads in ways.items():
                result = tokenize_once(prefix, args.texts, threads)
                rates[way].append(result["texts_per_s"])
                pools[way] = result["pool"] or "unset"
    base = statistics.median(rates["pool by the cores (rayon's own)"])
    command = " ".join(["python -m bench.cpu_quota", *(argv if argv is not None else sys.argv[1:])])
    lines = [f"Command: `{command}` (a quota of {args.cpus:g} CPU on {seen} cores; {args.texts} of the default "
             f"job's texts encoded in batches of 1,000; medians of {args.rounds} rounds)", "",
             "| tokenizers' pool | RAYON_NUM_THREADS | texts/s by round | median | against the pool by the cores |",
             "| --- | --- | --- | ---: | ---: |"]
    for way in ways:
        median = statistics.median(rates[way])
        lines.append(f"| {way} | {pools[way]} | {', '.join(f'{r:.0f}' for r in rates[way])} | {median:.0f} | "
                     f"{median / base:.2f}x |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
