"""Does ``training.torch_compile`` pay on this machine? Eager against compiled, side by side, warm-up included.

Usage::

    python bench/compile.py                       # the default job, 120 updates per arm, bf16 (auto) and fp32
    python bench/compile.py --updates 300 --precisions auto

Each arm is a real ``finetune/train.py`` run of the default config (no
checkpoints) in its own process, one after the other in one invocation; the
per-update records of its ``train_log.jsonl`` give the time of the first 20
updates (where compiling happens) and the median time of the updates after
them (the steady state). Compiled runs pad each micro-batch to one of four
lengths (``finetune.runner.BucketPadding``), so a handful of graphs serve the
whole run. Prints a Markdown table for ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP = 20  # updates counted as warm-up


def run_arm(out: Path, updates: int, precision: str, compile_: bool) -> dict:
    """Train the default job for ``updates`` updates; per-update seconds from its log, and its validation F1."""
    command = [sys.executable, str(REPO / "finetune" / "train.py"), f"training.max_steps={updates}",
               f"training.mixed_precision={precision}", f"training.torch_compile={str(compile_).lower()}",
               f"output.output_dir={out}", "logging.progress_bar=false", "output.save_checkpoints=false"]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"arm {precision}/compile={compile_} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()
               if '"train/loss"' in line]
    seconds, seen = [], 0
    for record in records:
        samples = record["train/samples"] - seen
        seen = record["train/samples"]
        seconds.append(samples / record["train/samples_per_s"])
    steady = seconds[WARMUP:]
    metrics = json.loads((out / "metrics.json").read_text())
    return {
        "precision": metrics["train"]["mixed_precision"], "compile": compile_, "updates": len(records),
        "warmup_s": sum(seconds[:WARMUP]), "steady_s_per_update": statistics.median(steady),
        "samples_per_s": seen / sum(seconds), "wall_s": wall, "f1": metrics["eval"].get("f1"),
    }


def table(rows: list[dict]) -> str:
    lines = ["| precision | torch_compile | first 20 updates s | steady s/update (median) | x eager steady | "
             "samples/s over the run | run wall s | validation F1 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    eager = {r["precision"]: r["steady_s_per_update"] for r in rows if not r["compile"]}
    for r in rows:
        speedup = eager[r["precision"]] / r["steady_s_per_update"]
        lines.append(f"| {r['precision']} | {str(r['compile']).lower()} | {r['warmup_s']:.1f} | "
                     f"{r['steady_s_per_update']:.3f} | {speedup:.2f} | {r['samples_per_s']:.1f} | {r['wall_s']:.0f} | "
                     f"{r['f1']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=120, help="updates per arm (default 120)")
    parser.add_argument("--precisions", default="auto,no", help="comma-separated mixed_precision values")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            for compile_ in (False, True):
                rows.append(run_arm(Path(tmp) / f"{precision}-{compile_}", args.updates, precision, compile_))
                print(json.dumps(rows[-1]), file=sys.stderr)
    command = " ".join(["python bench/compile.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"Command: `{command}`\n")
    print(table(rows))


if __name__ == "__main__":
    main()
