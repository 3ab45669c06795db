"""Arm (a): the job through this package's CLI, ``accelerate launch -q finetune/train.py``.

The shipped config of the job with dotted overrides for the batching, the run
length, the precision and the output folder (no checkpoints, no progress
bar), launched under :mod:`bench.memprobe` so the launched process reports its
peak memory. Throughput comes from the run's own ``metrics.json``: samples and
non-pad tokens over the seconds spent in ``train_one_epoch`` (evaluation,
start-up and saving excluded).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import DATASETS, REPO, ArmSpec


def command(spec: ArmSpec, workdir: Path) -> list[str]:
    """The launch command of one run, writing under ``workdir``."""
    overrides = [
        f"training.per_device_train_batch_size={spec.b}",
        f"training.effective_batch_size={spec.b * spec.k}",
        f"training.mixed_precision={spec.precision}",
        f"output.output_dir={workdir / 'out'}",
        "output.overwrite=true",
        "output.save_checkpoints=false",
        "logging.progress_bar=false",
    ]
    if spec.max_steps is not None:
        overrides += ["training.num_train_epochs=null", f"training.max_steps={spec.max_steps}"]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "-q", *engine_config(spec), "--num_processes", "1",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    root = checkout(spec)
    config = root / DATASETS[spec.dataset].relative_to(REPO)
    return launcher + [str(REPO / "bench" / "memprobe.py"), str(root / "finetune" / "train.py"),
                       "--config", str(config)] + overrides + list(spec.overrides)


def checkout(spec: ArmSpec) -> Path:
    """The checkout whose package (and configs) the run trains: the spec's ``checkout=<folder>`` option
    (``bench/run.py --baseline``), or this one. Its ``finetune/train.py`` puts its own folder first on the
    import path, so the run imports that checkout's package."""
    folder = spec.option("checkout")
    return Path(folder) if folder else REPO


def engine_config(spec: ArmSpec) -> list[str]:
    """``--config_file`` of the shipped Accelerate config that the spec's ``engine=<name>`` option names
    (``fsdp``, ``deepspeed_zero2``), or nothing: the launcher's flags then run plain, one process."""
    engine = spec.option("engine")
    return ["--config_file", str(REPO / "configs" / "accelerate" / f"{engine}.yaml")] if engine else []


def collect(workdir: Path) -> dict:
    """Measurements of a finished run from its ``metrics.json`` and the probe's memory file."""
    metrics = json.loads((workdir / "out" / "metrics.json").read_text(encoding="utf-8"))
    memory = json.loads((workdir / "memory.json").read_text(encoding="utf-8"))
    train = metrics["train"]
    updates = [json.loads(line) for line in (workdir / "out" / "train_log.jsonl").read_text().splitlines()
               if line.strip()]
    # seconds of each update, from the per-update records (log_every 1): for compile time and warm-up
    per_update = [r["train/samples"] for r in updates if "train/samples_per_s" in r]
    rates = [(r["train/samples_per_s"]) for r in updates if "train/samples_per_s" in r]
    sizes = [b - a for a, b in zip([0] + per_update[:-1], per_update)]
    update_seconds = [n / rate for n, rate in zip(sizes, rates) if rate > 0]
    return {
        "updates": train["updates"],
        "samples": train["samples"],
        "tokens": train["tokens"],
        "train_seconds": train["seconds"],
        "eval": {k: v for k, v in metrics["eval"].items() if k not in ("loss", "num_samples")},
        "update_seconds": update_seconds,
        # training.cuda_graphs as applied: a refused capture leaves the run eager, which its rate alone hides
        "cuda_graphs": train.get("cuda_graphs"),
        **memory,
    }
