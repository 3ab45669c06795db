"""Does ``training.torch_compile`` pay on this machine? Without and with it, side by side, warm-up included.

Usage::

    python bench/compile.py                       # the default job, 120 updates per arm, bf16 (auto) and fp32
    python bench/compile.py --updates 300 --precisions auto
    python bench/compile.py --precisions auto --updates 60 --rerun     # also each compiled arm's second run
    python bench/compile.py --config configs/bbc_news.yaml --precisions bf16 --updates 60 --warmup 20 \
        --override model.name_or_path=<bench/bert_base.py folder> --override data.max_length=128 \
        --override training.per_device_train_batch_size=64 --override training.effective_batch_size=256 \
        --arm "compiled, no workers=training.torch_compile=true,data.num_workers=0"

Each arm is a real ``finetune/train.py`` run (no checkpoints) in its own
process, one after the other in one invocation; the per-update records of its
``train_log.jsonl`` give the time of the first ``--warmup`` updates (where
compiling happens) and the median time of the updates after them (the steady
state). The arms: not compiled, ``compiled`` (the whole forward,
``training.torch_compile=true``) and ``compiled blocks`` (each encoder block,
``training.torch_compile=blocks``). Compiled runs pad each micro-batch to one of
eight lengths (``finetune.dataloaders.BucketPadding``); the first two compile,
and the second's graph, with the length dynamic, serves the rest.

Each arm compiles into a compile cache of its own, empty at its start
(``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``): its warm-up is a first
run's on this machine, not one that finds an earlier arm's or invocation's
kernels. ``--rerun`` runs each compiled arm a second time on the cache its
first run filled, as a rerun, a resumed run or a sweep's next trial on the
same machine would (``(rerun)`` rows). ``--arm LABEL=key=value,...`` adds an
arm (in every precision) with its own overrides. Prints a Markdown table for
``bench/README.md``.
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
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"


ARMS = [("not compiled", ["training.torch_compile=false"]), ("compiled", ["training.torch_compile=true"]),
        ("compiled blocks", ["training.torch_compile=blocks"])]


def compiles(overrides: list[str]) -> bool:
    """Whether an arm's overrides turn ``training.torch_compile`` on (its last word on it counts)."""
    said = [o.partition("=")[2] for o in overrides if o.startswith("training.torch_compile=")]
    return bool(said) and said[-1].lower() not in ("false", "no", "0")


def run_arm(out: Path, updates: int, precision: str, label: str, overrides: list[str], config: Path = DEFAULT_CONFIG,
            warmup: int = 20, cache: Path | None = None) -> dict:
    """Train ``config`` for ``updates`` updates; per-update seconds from its log, and its validation F1.
    ``cache``: the folder of its compile caches (inductor's and Triton's), instead of the machine's."""
    command = [sys.executable, str(REPO / "finetune" / "train.py"), "--config", str(config),
               "training.num_train_epochs=null", f"training.max_steps={updates}",
               f"training.mixed_precision={precision}", *overrides,
               f"output.output_dir={out}", "logging.progress_bar=false", "output.save_checkpoints=false",
               "logging.log_every=1"]
    start = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if cache is not None:
        env.update(TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"arm {precision}/{label} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()
               if '"train/loss"' in line]
    seconds, seen = [], 0
    for record in records:
        samples = record["train/samples"] - seen
        seen = record["train/samples"]
        seconds.append(samples / record["train/samples_per_s"])
    steady = seconds[warmup:]
    metrics = json.loads((out / "metrics.json").read_text())
    return {
        "precision": metrics["train"]["mixed_precision"], "arm": label, "updates": len(records),
        "warmup_s": sum(seconds[:warmup]), "steady_s_per_update": statistics.median(steady),
        "samples_per_s": seen / sum(seconds), "wall_s": wall, "f1": metrics["eval"].get("f1"),
    }


def table(rows: list[dict], warmup: int = 20) -> str:
    """One row per arm; the steady state against the first arm of the same precision (not compiled)."""
    lines = [f"| precision | arm | first {warmup} updates s | steady s/update (median) | x not compiled steady | "
             "samples/s over the run | run wall s | validation F1 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    first: dict[str, float] = {}
    for r in rows:
        first.setdefault(r["precision"], r["steady_s_per_update"])
    for r in rows:
        speedup = first[r["precision"]] / r["steady_s_per_update"]
        lines.append(f"| {r['precision']} | {r['arm']} | {r['warmup_s']:.1f} | "
                     f"{r['steady_s_per_update']:.3f} | {speedup:.2f} | {r['samples_per_s']:.1f} | {r['wall_s']:.0f} | "
                     f"{r['f1']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=120, help="updates per arm (default 120)")
    parser.add_argument("--warmup", type=int, default=20, help="updates counted as warm-up (default 20)")
    parser.add_argument("--precisions", default="auto,no", help="comma-separated mixed_precision values")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the job (default: configs/default.yaml)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted override for every arm (repeatable)")
    parser.add_argument("--arm", action="append", default=[], metavar="LABEL=KEY=VALUE,...",
                        help="an extra arm with its own overrides (repeatable)")
    parser.add_argument("--rerun", action="store_true",
                        help="run each compiled arm again on the compile cache its first run filled")
    parser.add_argument("--json", type=Path, help="also write every row to this file")
    args = parser.parse_args(argv)
    if args.warmup >= args.updates:
        parser.error("--warmup must be below --updates: the steady state needs updates after it")
    # the package's defaults otherwise: on a GPU in bf16 every arm replays micro-batches from CUDA graphs
    arms = list(ARMS)
    for spec in args.arm:
        label, _, overrides = spec.partition("=")
        arms.append((label, [o for o in overrides.split(",") if o]))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions.split(","):
            for i, (label, overrides) in enumerate(arms):
                every = args.override + overrides
                runs = [label, f"{label} (rerun)"] if args.rerun and compiles(every) else [label]
                for j, name in enumerate(runs):
                    rows.append(run_arm(Path(tmp) / f"{precision}-{i}-{j}", args.updates, precision, name, every,
                                        args.config, args.warmup, cache=Path(tmp) / f"cache-{precision}-{i}"))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    command = " ".join(["python bench/compile.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"Command: `{command}`\n")
    print(table(rows, args.warmup))


if __name__ == "__main__":
    main()
