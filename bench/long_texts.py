"""Long texts and layer-wise learning rates, side by side over seeds: held-out accuracy, macro F1, samples/s.

Two experiments, each run by ``finetune/train.py`` in its own process, one after the other::

    python bench/long_texts.py                          # both, seeds 0, 1, 2
    python bench/long_texts.py --only truncation --lengths 128 --seeds 0
    python bench/long_texts.py --only layer_decay --decay 0.9

* ``truncation``: BBC News (configs/bbc_news.yaml; articles of several hundred
  tokens) at each ``data.max_length`` of ``--lengths``, with each
  ``data.truncation`` of ``--truncations`` (``head_tail`` at its default head,
  ``chunks`` at its default stride, each a quarter of the window).
* ``layer_decay``: the default job (configs/default.yaml) with
  ``optim.layer_lr_decay`` off and at ``--decay``.

A row is the mean over the seeds (and the spread, min to max); samples/s is
training's, from ``metrics.json`` (samples over the run's training seconds;
a sample is a text, under ``chunks`` too, whose windows the table counts), and
the peak is the run's process's peak resident size, beside the memory plan
(``metrics.json``'s ``memory_plan``: the largest micro-batch's). ``--epochs`` overrides the
configs' epochs for every run, ``--max-steps`` stops each after that many
updates (for speed and memory, not accuracy), and ``--heaps`` runs each
truncation setting under each ``training.cpu_heap`` given::

    python bench/long_texts.py --only truncation --lengths 256 --truncations chunks --seeds 0 \
        --max-steps 20 --heaps release,auto
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


def train(config: str, overrides: list[str], seed: int) -> dict:
    """One run; its held-out metrics and speed."""
    out = Path(tempfile.mkdtemp(prefix="long-texts-"))
    cmd = [sys.executable, str(REPO / "finetune" / "train.py"), "--config", str(REPO / "configs" / config),
           f"training.seed={seed}", f"output.output_dir={out}", "output.save_checkpoints=false",
           "logging.progress_bar=false", *overrides]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                                stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak, which subprocess.run does not give
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        if proc.returncode != 0:
            stderr.seek(0)
            raise RuntimeError(f"{' '.join(overrides)} seed {seed} failed:\n{stderr.read()[-2000:].decode()}")
    metrics = json.loads((out / "metrics.json").read_text())
    cut = metrics["train"].get("long_texts") or {}
    plan = metrics.get("memory_plan") or {}  # null where the run made none
    return {"accuracy": metrics["eval"]["accuracy"], "f1": metrics["eval"]["f1"],
            "samples_per_s": metrics["train"]["samples"] / metrics["train"]["seconds"],
            "texts_cut": cut.get("longer_than_max_length"), "train_rows": cut.get("rows"),
            "windows": cut.get("chunks"), "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,  # Linux: KiB
            "plan_gb": plan["total"] / 1e9 if plan.get("total") else None,
            "wall_s": time.perf_counter() - start}


def experiments(args) -> list[tuple[str, str, list[str]]]:
    """(experiment, setting, config + overrides) for every run asked for, seeds aside."""
    runs = []
    epochs = [f"training.num_train_epochs={args.epochs}"] if args.epochs else []
    epochs += [f"training.max_steps={args.max_steps}"] if args.max_steps else []
    heaps = args.heaps.split(",") if args.heaps else [None]
    if args.only in (None, "truncation"):
        for length in args.lengths.split(","):
            for side in args.truncations.split(","):
                for heap in heaps:
                    runs.append(("truncation", f"max_length={length} {side}" + (f" heap={heap}" if heap else ""),
                                 ["bbc_news.yaml", f"data.max_length={length}", f"data.truncation={side}", *epochs,
                                  *([f"training.cpu_heap={heap}"] if heap else [])]))
    if args.only in (None, "layer_decay"):
        runs.append(("layer_decay", "one rate", ["default.yaml", *epochs]))
        runs.append(("layer_decay", f"layer_lr_decay={args.decay:g}",
                     ["default.yaml", f"optim.layer_lr_decay={args.decay}", *epochs]))
    return runs


def summary(rows: list[dict]) -> str:
    lines = ["| experiment | setting | accuracy | macro F1 (BBC) / F1 (SMS) | F1 min-max | samples/s | peak (GB) "
             "| plan (GB) | texts cut | windows | seeds |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    keys = list(dict.fromkeys((r["experiment"], r["setting"]) for r in rows))
    for experiment, setting in keys:
        runs = [r for r in rows if (r["experiment"], r["setting"]) == (experiment, setting)]
        f1 = [r["f1"] for r in runs]
        cut = runs[0]["texts_cut"]
        cut_text = f"{cut} of {runs[0]['train_rows']}" if cut is not None else "-"
        plan = runs[0].get("plan_gb")  # the same for every seed: the data's largest micro-batch
        lines.append(f"| {experiment} | {setting} | {statistics.mean(r['accuracy'] for r in runs):.4f} | "
                     f"{statistics.mean(f1):.4f} | {min(f1):.4f}-{max(f1):.4f} | "
                     f"{statistics.mean(r['samples_per_s'] for r in runs):.1f} | "
                     f"{max(r['peak_rss_gb'] for r in runs):.2f} | {'-' if plan is None else f'{plan:.2f}'} | "
                     f"{cut_text} | "
                     f"{runs[0].get('windows') or '-'} | {len(runs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["truncation", "layer_decay"], help="one experiment (default: both)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lengths", default="128,256", help="BBC News's data.max_length values")
    parser.add_argument("--truncations", default="head,head_tail,chunks", help="data.truncation values")
    parser.add_argument("--decay", type=float, default=0.9, help="optim.layer_lr_decay against one rate")
    parser.add_argument("--epochs", type=int, help="training.num_train_epochs for every run (default: the config's)")
    parser.add_argument("--max-steps", type=int, help="training.max_steps for every run: speed and memory alone")
    parser.add_argument("--heaps", help="comma-separated training.cpu_heap values for each truncation setting "
                                        "(default: the config's)")
    parser.add_argument("--json", help="also write the runs here")
    args = parser.parse_args(argv)
    rows = []
    for experiment, setting, (config, *overrides) in experiments(args):
        for seed in (int(s) for s in args.seeds.split(",")):
            row = {"experiment": experiment, "setting": setting, "seed": seed, **train(config, overrides, seed)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(summary(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
