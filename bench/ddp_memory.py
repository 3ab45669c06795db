"""DDP's gradients as views into its all-reduce buckets against separate copies: peak memory per process.

Two processes (over gloo on a machine without a GPU, NCCL on GPUs) train the
default job's MiniLM-L6 through the package's ``setup_run`` and
``train_one_epoch``, once with the package's DDP settings
(:func:`finetune.launch.ddp_settings`: gradients are views into DDP's
buckets) and once with DDP's default (each gradient a tensor of its own,
copied into its bucket for the all-reduce); nothing else differs. Each
process reports its peak memory over the updates less its memory before the
model was built: resident size on a CPU, ``torch.cuda.max_memory_allocated``
on a GPU. The settings alternate, each launch a fresh pair of processes::

    python bench/ddp_memory.py                      # 2 repeats of each setting, 6 updates each
    python bench/ddp_memory.py --repeats 3 --updates 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

REPO = Path(__file__).resolve().parent.parent
SETTINGS = ("views (the package)", "copies (DDP's default)")


def child(setting: str, updates: int, out: Path) -> None:
    """One process of a launch: train ``updates`` updates under ``setting``, write what it measured."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from bench.memory_levers import rss_bytes
    from bench.memprobe import peak_memory
    from finetune.assembly import setup_run
    from finetune.config import load_config
    from finetune.cpu import cpu_speedups, speedup_settings
    from finetune.launch import ddp_settings, init_process_state
    from finetune.loop import train_one_epoch

    state = init_process_state()
    gpu = state.device.type == "cuda"
    before_mib = 0.0 if gpu else rss_bytes() / 2**20  # a GPU's peak counts from nothing allocated
    handlers = ddp_settings() if setting == SETTINGS[0] else [DistributedDataParallelKwargs()]
    accelerator = Accelerator(cpu=state.device.type == "cpu", kwargs_handlers=handlers)
    cfg = load_config(str(REPO / "configs" / "default.yaml"), [
        "training.per_device_train_batch_size=8", "training.effective_batch_size=32", "training.mixed_precision=no",
        f"training.max_steps={updates}", "logging.progress_bar=false", f"output.output_dir={out.parent}"])
    run = setup_run(cfg, accelerator)
    with cpu_speedups(run.model, run.optimizer, accelerator, **speedup_settings(cfg.training)):
        train_one_epoch(run.model, run.optimizer, run.scheduler, run.train_dataloader, accelerator, 0,
                        state=run.state, max_grad_norm=cfg.training.max_grad_norm, plan=run.plan, max_updates=updates)
    trained = sum(p.numel() * p.element_size() for p in run.model.parameters() if p.requires_grad)
    peak = peak_memory()
    result = {"setting": setting, "rank": accelerator.process_index, "updates": run.state.step,
              "peak_over_baseline_mib": (peak["gpu_peak_mib"] if gpu else peak["rss_peak_mib"]) - before_mib,
              "gradients_mib": trained / 2**20, "device": state.device.type,
              "k": accelerator.gradient_accumulation_steps}
    (out.parent / f"{out.name}.{accelerator.process_index}.json").write_text(json.dumps(result), encoding="utf-8")


def launch(setting: str, updates: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(Path(__file__).resolve()), "--child", setting, str(updates), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"bench/ddp_memory.py: {setting} failed:\n{proc.stderr[-3000:]}")
    return [json.loads((out.parent / f"{out.name}.{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], int(argv[2]), Path(argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python bench/ddp_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--updates", type=int, default=6)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for setting in (SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]):
                print(f"ddp_memory: repeat {repeat + 1}: {setting} ...", file=sys.stderr, flush=True)
                runs[setting] += launch(setting, args.updates, Path(tmp) / f"{repeat}-{SETTINGS.index(setting)}")
    first = runs[SETTINGS[0]][0]
    print(f"Two processes ({first['device']}), the default job's MiniLM-L6 in fp32, b=8, k={first['k']}, "
          f"{args.updates} updates, {args.repeats} launches per setting; trained weights' gradients "
          f"{first['gradients_mib']:.0f} MiB per process:\n")
    print("| DDP gradients | peak over baseline MiB per process (median) | by launch and rank |")
    print("| --- | ---: | --- |")
    for setting, rows in runs.items():
        peaks = [r["peak_over_baseline_mib"] for r in rows]
        print(f"| {setting} | {statistics.median(peaks):.0f} | {', '.join(f'{p:.0f}' for p in peaks)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
