"""The benchmark: this package against ``transformers.Trainer`` and a plain Accelerate loop.

One command runs every arm of the same job (same model, data split, effective
batch, AdamW settings, schedule, precision, length and seed), each in its own
fresh process, alternating arms within each repeat and rotating which arm goes
first, and reports medians over the repeats as a Markdown table and JSON:

* training samples/s and non-pad tokens/s (training phase only: no start-up,
  no evaluation, no saving), with the ratio to the Trainer's, over a fixed
  number of updates at each job's own ``(b, k)``, three repeats;
* peak memory of the training process (RSS on the CPU; ``max_memory_allocated``
  on a GPU, with the ratio to the Trainer's, and ``max_memory_reserved``, which
  alone counts a CUDA graph's memory pool);
* final validation accuracy and F1 after the SMS job's full epoch in each arm,
  over ``--accuracy-seeds`` seeds (42, 43, ...; one by default, to keep the
  benchmark near 25 minutes on two cores), each arm paired with the Trainer
  at the same seed; a fourth arm, the Trainer fed the package's own sample
  order, separates the arithmetic from the luck of the order;
* model FLOPs utilisation: estimated training FLOPs/s over the machine's
  matmul peak for the precision, measured here too;
* accumulation overhead ``(b=8, k=4)`` against ``(b=8, k=1)`` and memory of
  ``(8, 4)``, ``(8, 1)`` and ``(32, 1)`` (package CLI, BBC News, same samples);
* whether the Trainer's ``k > 1`` path changes BERT's gradients
  (:mod:`bench.trainer_grad_check`); if it does, the Trainer trains the
  accuracy comparison at ``k = 1`` with the same effective batch.

``--levers`` instead measures the package's performance options one at a time
(:mod:`bench.levers`). ``--baseline CHECKOUT`` adds a row trained by the
package (and configs) of another checkout, in the same rounds: a change's
before and after, each paired with the same Trainer runs. ``--smoke`` runs
everything for a few updates, to check the benchmark itself; its numbers mean
nothing.

Usage::

    python bench/run.py                      # full comparison, ~25 min on 2 CPU cores
    python bench/run.py --levers             # the levers
    python bench/run.py --smoke              # a few updates per arm
    git worktree add /tmp/before <commit> && python bench/run.py --datasets sms --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench import arm_ours  # noqa: E402
from bench.common import REPO, ArmSpec, write_result  # noqa: E402
from finetune.machine import available_cores  # noqa: E402

# The jobs of the shipped configs: (b, k) per dataset, B = 32 in both; --batching b,k replaces them.
JOB_BATCHING = {"sms": (8, 4), "bbc": (8, 4)}  # each job's config


@dataclass
class Job:
    """One arm of the comparison; run ``repeats`` times."""

    name: str  # e.g. "sms/ours"
    spec: ArmSpec
    role: str = "main"  # main | accumulation | accuracy | lever
    label: str = ""  # what the table calls it
    seed: Optional[int] = None  # accuracy runs: the seed this run trains with

    @property
    def dataset(self) -> str:
        return self.spec.dataset


@dataclass
class Settings:
    out: Path
    repeats: int
    threads: int
    precision: str
    smoke: bool
    sms_steps: Optional[int]
    bbc_steps: int
    datasets: list[str]
    only: list[str] = field(default_factory=list)
    extra_overrides: list[str] = field(default_factory=list)
    timeout: int = 3600
    accuracy_steps: Optional[int] = None  # None: the full epoch
    accuracy_seeds: int = 1
    first_seed: int = 42
    batching: dict[str, tuple[int, int]] = field(default_factory=lambda: dict(JOB_BATCHING))
    engines: list[str] = field(default_factory=list)  # shipped Accelerate configs to add rows for (GPU)
    graphs: bool = False  # a row for training.cuda_graphs (GPU)
    baseline: Optional[Path] = None  # another checkout of the package, for a row of its own (before and after)


# --------------------------------------------------------------------------- the plan


# --engines: the shipped Accelerate configs (configs/accelerate/<name>.yaml) as the table names them
ENGINE_NAMES = {"fsdp": "FSDP2", "deepspeed_zero2": "DeepSpeed ZeRO-2"}
# what torch.compile's mode="max-autotune-no-cudagraphs" turns on, as environment variables inductor reads
AUTOTUNE_ENV = {"TORCHINDUCTOR_MAX_AUTOTUNE": "1", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}
# ATen's own switch: addmm computed by cuBLAS from a copy of the bias, not by cuBLASLt with the bias in its epilogue
ADDMM_WITHOUT_LT_ENV = {"DISABLE_ADDMM_CUDA_LT": "1"}

# Speed runs evaluate on this many validation samples only: evaluation is not timed, and
# the accuracy comes from the full-epoch runs.
SPEED_EVAL = ["data.max_eval_samples=32"]


def selected(name: str, only: list[str]) -> bool:
    """``--only``: each entry a substring of the arm's name, or ``=name`` for that arm alone."""
    if not only:
        return True
    return any(name == o[1:] if o.startswith("=") else o in name for o in only)


def main_jobs(s: Settings, trainer_k1: bool) -> list[Job]:
    """The comparison's arms.

    * Speed and memory (role ``main``): the three arms at the job's own ``(b, k)``
      for a fixed number of updates, per dataset; on BBC News also the
      accumulation arms ``(8, 1)`` and ``(32, 1)`` on the same samples.
    * Accuracy (role ``accuracy``): the SMS job's full epoch in each arm; the
      Trainer at ``k = 1`` (same ``B``) if its ``k > 1`` path is wrong for BERT.
    """
    jobs = []
    for dataset in s.datasets:
        b, k = s.batching[dataset]
        steps = s.sms_steps if dataset == "sms" else s.bbc_steps
        base = ArmSpec("ours", dataset, b, k, max_steps=steps, precision=s.precision,
                       overrides=SPEED_EVAL + list(s.extra_overrides), threads=s.threads)
        jobs += [
            Job(f"{dataset}/ours", base, label=f"finetune (this package), b={b} k={k}"),
            Job(f"{dataset}/trainer", replace(base, arm="trainer"), label=f"transformers.Trainer, b={b} k={k}"),
            Job(f"{dataset}/accelerate", replace(base, arm="accelerate"),
                label=f"Accelerate example loop, b={b} k={k}"),
        ]
        jobs += [Job(f"{dataset}/ours {engine}", replace(base, options=[f"engine={engine}"]),
                     label=f"finetune under {ENGINE_NAMES.get(engine, engine)}, one process, b={b} k={k}")
                 for engine in s.engines]
        if s.baseline is not None:
            jobs.append(Job(f"{dataset}/ours baseline", replace(base, options=[f"checkout={s.baseline}"]),
                            label=f"finetune at {checkout_commit(s.baseline)}, b={b} k={k}"))
        if s.graphs:
            # on a GPU in bf16 the package's own arm replays its micro-batches from graphs (training.cuda_graphs:
            # auto): the lever's worth is that arm against this one
            blocks = replace(base, overrides=base.overrides + ["training.cuda_graphs=true",
                                                               "training.torch_compile=blocks"])
            jobs += [
                Job(f"{dataset}/ours eager", replace(base, overrides=base.overrides + ["training.cuda_graphs=false"]),
                    label=f"finetune, eager micro-batches (training.cuda_graphs=false), b={b} k={k}"),
                # not among the GPU check's default arms: its compile makes a short run long
                Job(f"{dataset}/ours compiled graphs",
                    replace(base, overrides=base.overrides + ["training.cuda_graphs=true", "training.torch_compile=true"]),
                    label=f"finetune, compiled and replayed from CUDA graphs, b={b} k={k}"),
                Job(f"{dataset}/ours compiled blocks graphs", blocks,
                    label=f"finetune, each block compiled, replayed from CUDA graphs, b={b} k={k}"),
            ]
            # The levers on the fastest arm first (compiled blocks), then on the graphed default, a part cut by
            # its time limit keeping the arms it finished: training.attention_kernel=cudnn, the one kernel torch
            # never picks and one that takes the mask the graphs keep; training.gradient_accumulation_fusion,
            # each weight gradient added into fp32 by its product, two kernels fewer per weight and micro-batch;
            # training.bias_apart, each linear layer's product without its bias, where cuBLAS's addmm picks a
            # slower kernel (the bias a kernel of its own in the graphed default, fused by inductor into the
            # element-wise kernel after it in compiled blocks); all three together first; and ATen's own switch
            # that keeps addmm off cuBLASLt last
            fusion, apart = "training.gradient_accumulation_fusion=true", "training.bias_apart=true"
            cudnn = "training.attention_kernel=cudnn"
            levers = (("all levers", [apart, fusion, cudnn], "with its biases apart, weight gradients added by their "
                       "products and cuDNN's attention"),
                      ("cudnn attention", [cudnn], f"asking for cuDNN's attention ({cudnn})"),
                      ("fusion", [fusion], f"weight gradients added by their products ({fusion})"),
                      ("bias apart fusion", [apart, fusion], "with its biases apart and weight gradients added by "
                       "their products"),
                      ("bias apart", [apart], f"with its biases apart ({apart})"))
            both = ((blocks, f"{dataset}/ours compiled blocks graphs", "finetune, each block compiled,"),
                    (base, f"{dataset}/ours", "finetune"))
            jobs += [Job(f"{name} {lever}", replace(arm, overrides=arm.overrides + settings),
                         label=f"{way} {what}, b={b} k={k}")
                     for arm, name, way in both for lever, settings, what in levers]
            jobs += [Job(f"{name} addmm without cublaslt", replace(arm, env={**arm.env, **ADDMM_WITHOUT_LT_ENV}),
                         label=f"{way} addmm kept off cuBLASLt (DISABLE_ADDMM_CUDA_LT=1), b={b} k={k}")
                     for arm, name, way in both]
            # inductor's max-autotune without its own graphs (the package captures by hand): matrix products
            # chosen by timing cuBLAS against Triton's templates, with bias and activation fused into them,
            # and the element-wise kernels' launch shapes tuned. Settings inductor reads from the environment
            jobs.append(Job(f"{dataset}/ours compiled blocks autotuned graphs",
                            replace(blocks, env={**blocks.env, **AUTOTUNE_ENV}),
                            label=f"finetune, each block compiled with max-autotune, replayed from CUDA graphs, "
                                  f"b={b} k={k}"))
        if dataset == "bbc" and k > 1:
            # the same samples in every arm: (b, 1) makes k times the updates
            jobs += [
                Job("bbc/ours bk1", replace(base, b=b, k=1, max_steps=steps * k), "accumulation",
                    f"finetune, b={b} k=1 (B={b})"),
                Job("bbc/ours Bk1", replace(base, b=b * k, k=1), "accumulation", f"finetune, b={b * k} k=1"),
            ]
    return [j for j in jobs if selected(j.name, s.only)]


def checkout_commit(folder: Path) -> str:
    """The short commit a checkout of the package is at (``--baseline``), or its folder where git cannot say."""
    try:
        return subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(folder)


# Accuracy run r trains with seed first_seed + r (default 42, the shipped config's). The seed
# draws the validation carve, the head's initial weights, the sample order and dropout, so
# each seed is a different draw of everything random; every arm runs every seed, which pairs
# their scores seed by seed. Repeating one seed would only repeat one deterministic run.
def accuracy_jobs(s: Settings, trainer_k1: bool) -> list[Job]:
    """The SMS job trained for its full epoch (or ``accuracy_steps`` in a smoke run) in each arm.

    Besides the three arms, the Trainer runs once more fed the package's own
    sample order (:class:`finetune.sampling.EpochSampler`, same seed and
    windows): with the same samples in every update, what is left between it
    and the package is arithmetic (and dropout's draws), not the order's luck.
    When the precision is bf16 the package also trains in fp32, so that its
    "F1 - finetune" column is what bf16 costs, seed by seed.
    """
    if "sms" not in s.datasets or s.accuracy_seeds < 1:
        return []
    b, k = s.batching["sms"]
    tb, tk = (b * k, 1) if trainer_k1 else (b, k)
    base = ArmSpec("ours", "sms", b, k, max_steps=s.accuracy_steps, precision=s.precision,
                   overrides=list(s.extra_overrides), threads=s.threads)
    jobs = [
        Job("sms/ours accuracy", base, "accuracy", f"finetune (this package), b={b} k={k}"),
        Job("sms/trainer accuracy", replace(base, arm="trainer", b=tb, k=tk), "accuracy",
            f"transformers.Trainer, b={tb} k={tk}"),
        Job("sms/trainer accuracy, package order", replace(base, arm="trainer", b=tb, k=tk, options=["package_order"]),
            "accuracy", f"transformers.Trainer in this package's sample order, b={tb} k={tk}"),
        Job("sms/accelerate accuracy", replace(base, arm="accelerate"), "accuracy",
            f"Accelerate example loop, b={b} k={k}"),
    ]
    if s.precision == "bf16":
        # what bf16 costs in accuracy, paired seed by seed with the package's bf16 run
        jobs.append(Job("sms/ours accuracy, fp32", replace(base, precision="no"), "accuracy",
                        f"finetune (this package) in fp32, b={b} k={k}"))
    return [j for j in jobs if selected(j.name, s.only)]


def rounds(jobs: list[Job], repeats: int) -> list[list[Job]]:
    """Each repeat runs every job once, alternating arms; the first arm rotates between repeats."""
    out = []
    for r in range(repeats):
        shift = r % max(1, len(jobs))
        out.append(jobs[shift:] + jobs[:shift])
    return out


def seeded_rounds(jobs: list[Job], seeds: int, first_seed: int = 42) -> list[list[Job]]:
    """Like :func:`rounds`, but round ``r`` trains every job with seed ``first_seed + r``."""
    out = []
    for r, round_jobs in enumerate(rounds(jobs, seeds)):
        seed = first_seed + r
        out.append([replace(j, seed=seed, spec=replace(j.spec, overrides=[*j.spec.overrides, f"training.seed={seed}"]))
                    for j in round_jobs])
    return out


# --------------------------------------------------------------------------- running


def _env(s: Settings, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        # every arm gets the same cores: the package reads FINETUNE_CPU_THREADS, the others OMP_NUM_THREADS
        OMP_NUM_THREADS=str(s.threads),
        FINETUNE_CPU_THREADS=str(s.threads),
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.update(extra or {})
    return env


def run_job(job: Job, s: Settings, index: int) -> dict[str, Any]:
    """Run one arm once in a fresh process; returns its measurements (or the error)."""
    workdir = s.out / "runs" / f"{index:03d}-{job.name.replace('/', '-').replace(' ', '-')}"
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file = workdir / "spec.json"
    spec_file.write_text(job.spec.to_json(), encoding="utf-8")
    result_file = workdir / "result.json"
    if job.spec.arm == "ours":
        cmd = arm_ours.command(job.spec, workdir)
        env = _env(s, {"BENCH_MEMORY_OUT": str(workdir / "memory.json"), **job.spec.env})
    else:
        cmd = [sys.executable, "-m", f"bench.arm_{job.spec.arm}", str(spec_file), str(result_file)]
        env = _env(s, job.spec.env)
    # a compile cache of its own, empty: a compiled arm's warm-up is a first run's on this machine, not one that
    # finds the kernels of an earlier round, arm or benchmark
    env.update(TORCHINDUCTOR_CACHE_DIR=str(workdir / "compile-cache" / "inductor"),
               TRITON_CACHE_DIR=str(workdir / "compile-cache" / "triton"))
    start = time.perf_counter()
    with open(workdir / "log.txt", "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=s.timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - start
    if code != 0:
        tail = (workdir / "log.txt").read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
        return {"job": job.name, "seed": job.seed, "ok": False, "error": f"exit {code}", "log_tail": tail,
                "wall_seconds": wall}
    result = arm_ours.collect(workdir) if job.spec.arm == "ours" else json.loads(result_file.read_text())
    result.update(job=job.name, seed=job.seed, ok=True, wall_seconds=wall, b=job.spec.b, k=job.spec.k)
    return result


def run_helper(module: str, args: list[str], s: Settings, name: str) -> Optional[dict]:
    """Run ``python -m bench.<module> ARGS OUT`` and return what it wrote (None on failure)."""
    out = s.out / f"{name}.json"
    with open(s.out / f"{name}.log", "w", encoding="utf-8") as log:
        proc = subprocess.run([sys.executable, "-m", f"bench.{module}", *args, str(out)], cwd=REPO, env=_env(s),
                              stdout=log, stderr=subprocess.STDOUT, timeout=s.timeout)
    return json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None


# --------------------------------------------------------------------------- model FLOPs


def flops_model(dataset: str, s: Settings) -> dict[str, float]:
    """What the FLOPs estimate needs: matmul parameters per token, attention size, mean squared length.

    Training FLOPs = 6 x (matmul weights of the encoder) x non-pad tokens
    (forward 2, backward 4 per weight and token) + attention scores and
    weighted sum, 12 x layers x hidden x sum of squared sequence lengths
    (4 L d s^2 forward per sequence, times 3), the sum estimated as samples
    x mean squared length of the training set. Padding is not counted: MFU
    counts the useful work.
    """
    import datasets

    from bench.common import job_config
    from finetune.data import load_splits
    from finetune.tokens import tokenize_splits
    from finetune.modeling import load_model_config, load_tokenizer

    datasets.disable_progress_bars()

    spec = ArmSpec("ours", dataset, *s.batching[dataset], overrides=list(s.extra_overrides))
    cfg = job_config(spec)
    config = load_model_config(cfg.model, cfg.data.max_length)
    d, layers, ff = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    tokenizer = load_tokenizer(cfg.model)
    splits, _ = load_splits(cfg.data, seed=cfg.split_seed)
    lengths = tokenize_splits(splits, tokenizer, cfg.data.max_length)["train"]["length"]
    return {
        "matmul_params": layers * (4 * d * d + 2 * d * ff),
        "layers": layers,
        "hidden": d,
        "mean_length": statistics.fmean(lengths),
        "mean_sq_length": statistics.fmean(x * x for x in lengths),
    }


def training_flops(samples: float, tokens: float, fm: dict[str, float]) -> float:
    return 6 * fm["matmul_params"] * tokens + 12 * fm["layers"] * fm["hidden"] * fm["mean_sq_length"] * samples


# --------------------------------------------------------------------------- aggregation


def _median(values: list[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def aggregate(jobs: list[Job], results: list[dict], peak: Optional[dict], fms: dict[str, dict]) -> dict[str, dict]:
    """Medians per job over its successful repeats, with throughput, memory, metrics and MFU."""
    out = {}
    for job in jobs:
        runs = [r for r in results if r["job"] == job.name and r.get("ok")]
        row: dict[str, Any] = {"label": job.label, "role": job.role, "b": job.spec.b, "k": job.spec.k,
                               "repeats": len(runs), "failed": sum(1 for r in results if r["job"] == job.name
                                                                   and not r.get("ok"))}
        if runs:
            row["updates"] = runs[0]["updates"]
            row["samples"] = runs[0]["samples"]
            row["samples_per_s"] = _median([r["samples"] / r["train_seconds"] for r in runs])
            row["tokens_per_s"] = _median([r["tokens"] / r["train_seconds"] for r in runs])
            row["train_seconds"] = _median([r["train_seconds"] for r in runs])
            row["samples_per_s_runs"] = [round(r["samples"] / r["train_seconds"], 3) for r in runs]
            row["rss_peak_mib"] = _median([r.get("rss_peak_mib") for r in runs])
            row["gpu_peak_mib"] = _median([r.get("gpu_peak_mib") for r in runs])
            row["gpu_reserved_peak_mib"] = _median([r.get("gpu_reserved_peak_mib") for r in runs])
            names = sorted({m for r in runs for m in r["eval"]})
            if job.role == "accuracy":
                # runs of different seeds are different draws, not repeats: their mean, and each seed's
                row["eval"] = {m: _mean([r["eval"].get(m) for r in runs]) for m in names}
                row["eval_by_seed"] = {str(r["seed"]): r["eval"] for r in runs}
            else:
                row["eval"] = {m: _median([r["eval"].get(m) for r in runs]) for m in names}
            fm = fms.get(job.dataset)
            if fm is not None:
                flops = _median([training_flops(r["samples"], r["tokens"], fm) / r["train_seconds"] for r in runs])
                row["train_gflops_per_s"] = flops / 1e9
                if peak:
                    row["mfu"] = flops / 1e9 / peak["peak_gflops"]
            refused = [r["cuda_graphs"]["refused"] for r in runs if (r.get("cuda_graphs") or {}).get("refused")]
            if refused:
                row["graphs_refused"] = refused[0]
            timed = steady_state(runs)
            if timed is not None:
                row["steady_update_seconds"], row["cold_seconds"] = timed
                row["first_update_seconds"] = _median([r["update_seconds"][0] for r in runs])
                row["steady_samples_per_s"] = row["samples"] / row["updates"] / row["steady_update_seconds"]
        out[job.name] = row
    # ratios to the Trainer of the same dataset; accuracy rows paired by seed with it and with the package
    for name, row in out.items():
        dataset = name.split("/")[0]
        if row["role"] == "accuracy":
            for ref_name, short in ((f"{dataset}/trainer accuracy", "trainer"), (f"{dataset}/ours accuracy", "ours")):
                if ref_name in out:
                    _paired_f1(row, out[ref_name], short)
        ref = out.get(f"{dataset}/trainer accuracy" if row["role"] == "accuracy" else f"{dataset}/trainer")
        if not ref or "samples_per_s" not in ref or "samples_per_s" not in row:
            continue
        row["samples_per_s_x_trainer"] = row["samples_per_s"] / ref["samples_per_s"]
        if row["role"] != "accuracy" and name != f"{dataset}/trainer":
            by_round = _paired_speed(results, name, f"{dataset}/trainer")
            if by_round:
                row["samples_per_s_x_trainer_by_round"] = by_round
                row["samples_per_s_x_trainer_paired"] = statistics.median(by_round)
        row["tokens_per_s_x_trainer"] = row["tokens_per_s"] / ref["tokens_per_s"]
        memory_key = "gpu_peak_mib" if row.get("gpu_peak_mib") else "rss_peak_mib"
        if row.get(memory_key) and ref.get(memory_key):
            row["memory_x_trainer"] = row[memory_key] / ref[memory_key]
        if row["role"] != "accuracy" and "f1" in row.get("eval", {}) and "f1" in ref.get("eval", {}):
            row["f1_minus_trainer_pt"] = 100 * (row["eval"]["f1"] - ref["eval"]["f1"])
    return out


def steady_state(runs: list[dict]) -> Optional[tuple[float, float]]:
    """The runs' steady seconds per update (the median update after the first three, median over the runs of more
    than four updates) and their start beyond it: the median of a run's training seconds less its updates at the
    steady rate (cold start, warm-up, new shapes). ``None`` where no run timed enough updates."""
    steady = [statistics.median(r["update_seconds"][3:]) for r in runs if len(r.get("update_seconds", [])) > 4]
    if not steady:
        return None
    per_update = statistics.median(steady)
    return per_update, statistics.median(r["train_seconds"] - len(r["update_seconds"]) * per_update
                                         for r in runs if r.get("update_seconds"))


def _steady_state_table(mains: list[dict], trainer: Optional[dict]) -> list[str]:
    """Each arm's cold start and steady rate, and how long a run must be for it to beat the Trainer."""
    timed = [r for r in mains if r.get("steady_update_seconds")]
    if not timed:
        return []
    lines = ["| arm | first update s | steady s/update | steady samples/s | x Trainer | start beyond steady s "
             "| faster than the Trainer |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in timed:
        ratio = (r["steady_samples_per_s"] / trainer["steady_samples_per_s"]
                 if trainer and trainer.get("steady_samples_per_s") else None)
        lines.append(f"| {r['label']} | {_fmt(r['first_update_seconds'], '.3f')} "
                     f"| {_fmt(r['steady_update_seconds'], '.4f')} | {_fmt(r['steady_samples_per_s'])} "
                     f"| {_fmt(ratio, '.2f')} | {_fmt(r['cold_seconds'], '.2f')} "
                     f"| {overtakes(r, trainer) if trainer and r is not trainer else ''} |")
    return lines + ["", "Steady: the median update after the first three. Start beyond steady: the run's training "
                    "seconds less its updates at the steady rate (first kernels, warm-up, new shapes). The package's "
                    "updates are timed from its log (training windows only), the Trainer's and the Accelerate "
                    "loop's from one update's end to the next.", ""]


def overtakes(row: dict, trainer: dict) -> str:
    """For how long a run of ``row``'s arm is faster than the Trainer's, from both arms' start-up and steady rate."""
    if not trainer.get("steady_update_seconds"):
        return "n/a"
    gain = trainer["steady_update_seconds"] - row["steady_update_seconds"]  # per update, once warm
    head = trainer["cold_seconds"] - row["cold_seconds"]  # at the start
    if gain > 0:
        return "from the first update" if head >= 0 else f"after {math.ceil(-head / gain)} updates"
    if head > 0 and gain < 0:
        return f"for the first {math.floor(head / -gain)} updates only"
    return "never"


def _paired_speed(results: list[dict], name: str, ref: str) -> list[float]:
    """Each round's samples/s of ``name`` over ``ref``'s in the same round, rounds in order.

    The speed of a shared machine drifts over minutes by more than the gap
    between arms; the arms of one round run back to back, so their ratio
    cancels most of the drift that a ratio of medians over all rounds keeps.
    """
    def speeds(job: str) -> dict:
        return {r["round"]: r["samples"] / r["train_seconds"] for r in results
                if r["job"] == job and r.get("ok") and r.get("round") is not None}

    mine, theirs = speeds(name), speeds(ref)
    return [mine[k] / theirs[k] for k in mine if k in theirs]  # in the order the rounds ran


def _paired_f1(row: dict, ref: dict, name: str) -> None:
    """``f1_minus_<name>_pt``: the mean over shared seeds of the row's F1 minus the reference's, and each seed's."""
    mine, theirs = row.get("eval_by_seed", {}), ref.get("eval_by_seed", {})
    seeds = sorted((s for s in mine if s in theirs and "f1" in mine[s] and "f1" in theirs[s]), key=int)
    if not seeds:
        return
    diffs = [100 * (mine[s]["f1"] - theirs[s]["f1"]) for s in seeds]
    row[f"f1_minus_{name}_pt"] = statistics.fmean(diffs)
    row[f"f1_minus_{name}_pt_by_seed"] = dict(zip(seeds, diffs))


# --------------------------------------------------------------------------- report


def _fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def code_version() -> dict[str, Any]:
    """The commit, and the git tree of ``finetune/``, when a run starts.

    ``dirty`` is true when the working tree's ``finetune/`` differs from that
    commit: the arms run the working tree, so its code is then not the commit's.
    ``--combine`` pools only reports of the same clean ``finetune/`` tree.
    """
    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "finetune")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "finetune_tree": git("rev-parse", "HEAD:finetune"),
        "dirty": None if status is None else bool(status),
    }


def describe_commit(report: dict[str, Any]) -> str:
    """The report's commit, flagged when its ``finetune/`` had uncommitted changes."""
    dirty = (report.get("code") or {}).get("dirty")
    return f"{report['machine']['commit']}{' with uncommitted changes to finetune/' if dirty else ''}"


def machine_info(threads: int, commit: Optional[str] = None) -> dict[str, Any]:
    import accelerate
    import torch
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    return {
        "cpu": cpu,
        "cores_available": available_cores(),
        "threads_per_arm": threads,
        "memory_gib": round(memory_gib, 1) if memory_gib else None,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "commit": commit,
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: machine, finding, one table per dataset, accumulation and memory."""
    m, rows = report["machine"], report["rows"]
    gpu = bool(m["gpu"])
    mem_name = "GPU peak MiB" if gpu else "peak RSS MiB"
    lines = [
        f"# Benchmark{' (SMOKE: a few updates per arm, numbers mean nothing)' if report['smoke'] else ''}",
        "",
        f"Command: `{report['command']}`  ",
        *([f"Pooling the runs of: {'; '.join(f'`{c}`' for c in report['combined_from'])}  "]
          if report.get("combined_from") else []),
        f"Machine: {m['gpu'] or m['cpu']}, {m['cores_available']} cores available, {m['threads_per_arm']} threads "
        f"per arm, {m['memory_gib']} GiB; torch {m['torch']}, transformers {m['transformers']}, "
        f"accelerate {m['accelerate']}; commit {describe_commit(report)}  ",
        f"Precision: {report['precision']}; medians of {report['repeats']} repeats, arms alternating; "
        f"wall time {report['wall_minutes']:.1f} min",
        "",
    ]
    rounds_run = report.get("rounds") or {}
    if rounds_run.get("first_round_arms") is not None:
        lines += [f"**Cut short:** the first round stopped after {rounds_run['first_round_arms']} of its "
                  f"{rounds_run['arms']} arms; the tables are those arms' single runs.", ""]
    elif rounds_run.get("done", 0) < rounds_run.get("planned", 0):
        lines += [f"**Cut short:** {rounds_run['done']} of {rounds_run['planned']} rounds ran; the tables are "
                  f"theirs.", ""]
    finding = report.get("trainer_grad_check")
    if finding:
        lines += [f"**Trainer and accumulation:** {finding['summary']}."]
        if finding["changes_gradients"]:
            lines += ["The Trainer therefore trains the accuracy comparison at k=1 with the same effective "
                      "batch; its speed and memory runs use the job's (b, k), which the scale of the gradient "
                      "does not affect."]
        lines += [""]
    peak = report.get("peak")
    if peak:
        lines += [f"Matmul peak ({peak['dtype']}, {peak['device']}): {peak['peak_gflops']:.0f} GFLOP/s "
                  f"(by size: {peak['gflops_by_size']})", ""]
        if "warmup_seconds" in peak:
            lines += [f"Before the first round the machine ran a small BERT's training steps in "
                      f"{peak['warmup_seconds']:.1f} s (bench/peak.py), so that no arm pays the machine's first "
                      "load of CUDA's libraries.", ""]
        if "warmup_error" in peak:
            lines += [f"The machine's warm-up before the first round failed ({peak['warmup_error']}): the first "
                      "arm may have paid the machine's first load of CUDA's libraries.", ""]
    lengths = [o.split("=", 1)[1] for o in report.get("overrides", []) if o.startswith("data.max_length=")]
    titles = {"sms": "SMS spam (the default job)", "bbc": f"BBC News, max_length {lengths[-1] if lengths else 256}"}
    for dataset in ("sms", "bbc"):
        mains = [r for n, r in rows.items() if n.startswith(dataset + "/") and r["role"] == "main"]
        if not mains:
            continue
        lines += [f"## {titles[dataset]}: speed and memory ({mains[0].get('updates', '?')} updates per run)", "",
                  f"| arm | samples/s | non-pad tokens/s | x Trainer | {mem_name} | x Trainer "
                  f"|{' GPU reserved MiB |' if gpu else ''} MFU |",
                  f"| --- | ---: | ---: | ---: | ---: | ---: |{' ---: |' if gpu else ''} ---: |"]
        for r in mains:
            mem = r.get("gpu_peak_mib") if gpu else r.get("rss_peak_mib")
            reserved = f" {_fmt(r.get('gpu_reserved_peak_mib'), '.0f')} |" if gpu else ""
            lines.append(
                f"| {r['label']} | {_fmt(r.get('samples_per_s'))} | {_fmt(r.get('tokens_per_s'), '.0f')} "
                f"| {_fmt(r.get('samples_per_s_x_trainer'), '.2f')} | {_fmt(mem, '.0f')} "
                f"| {_fmt(r.get('memory_x_trainer'), '.2f')} |{reserved} "
                f"{_fmt(100 * r['mfu'] if r.get('mfu') is not None else None, '.1f', '%')} |"
            )
        if gpu:
            lines += ["", "GPU peak: `torch.cuda.max_memory_allocated`. A CUDA graph's memory pool (the "
                      "training.cuda_graphs row) counts as allocated only while it is captured and as reserved "
                      "for the rest of the run: compare that row by the reserved peak."]
        refused = [r for r in mains if r.get("graphs_refused")]
        if refused:
            lines += ["", "Replayed from CUDA graphs only in part, the rest eagerly: " + "; ".join(
                f"{r['label']}: {r['graphs_refused']}" for r in refused) + "."]
        paired = [r for r in mains if r.get("samples_per_s_x_trainer_by_round")]
        if paired:
            lines += ["", "Samples/s x Trainer paired by round (each round runs every arm back to back): " + "; ".join(
                f"{r['label']} {r['samples_per_s_x_trainer_paired']:.2f} (median; rounds "
                f"{', '.join(f'{x:.2f}' for x in r['samples_per_s_x_trainer_by_round'])})" for r in paired) + "."]
        lines += [""] + _steady_state_table(mains, rows.get(f"{dataset}/trainer"))
    accuracy = [r for r in rows.values() if r["role"] == "accuracy"]
    if accuracy:
        seeds = sorted({s for r in accuracy for s in r.get("eval_by_seed", {})}, key=int)
        lines += [f"## SMS spam: accuracy ({accuracy[0].get('updates', '?')} updates; seeds {', '.join(seeds)}; "
                  "means over seeds, differences paired by seed)", "",
                  "| arm | validation accuracy | F1 (spam) | F1 by seed | F1 - Trainer (pt) | F1 - finetune (pt) "
                  "| samples/s over the run |",
                  "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
        for r in accuracy:
            ev, by_seed = r.get("eval", {}), r.get("eval_by_seed", {})
            per_seed = " / ".join(_fmt(by_seed[s].get("f1"), ".4f") if s in by_seed else "n/a" for s in seeds)
            lines.append(f"| {r['label']} | {_fmt(ev.get('accuracy'), '.4f')} | {_fmt(ev.get('f1'), '.4f')} "
                         f"| {per_seed} | {_fmt(r.get('f1_minus_trainer_pt'), '+.2f')} "
                         f"| {_fmt(r.get('f1_minus_ours_pt'), '+.2f')} | {_fmt(r.get('samples_per_s'))} |")
        lines += ["", "The seed draws the validation carve, the new head's weights, the sample order and dropout; "
                  "each arm runs every seed. The Trainer in the package's sample order sees the same samples in "
                  "every update as the package.", ""]
    acc = {n: r for n, r in rows.items() if n in ("bbc/ours", "bbc/ours bk1", "bbc/ours Bk1") and "samples_per_s" in r}
    if {"bbc/ours", "bbc/ours bk1"} <= set(acc):  # (b*k, 1) where it ran: the GPU check leaves it out
        b, k = report.get("batching", JOB_BATCHING)["bbc"]
        b1 = acc["bbc/ours bk1"]
        key = "gpu_peak_mib" if gpu else "rss_peak_mib"
        lines += [
            "## Accumulation: time and memory (package CLI, BBC News, same samples)", "",
            f"| batching | samples/s | x ({b}, 1) | {mem_name} | x ({b}, 1) |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, r in ((f"b={b}, k={k} (B={b * k})", acc["bbc/ours"]), (f"b={b}, k=1 (B={b})", b1),
                        (f"b={b * k}, k=1 (B={b * k})", acc.get("bbc/ours Bk1"))):
            if r is None:
                continue
            lines.append(f"| {name} | {_fmt(r['samples_per_s'])} | {r['samples_per_s'] / b1['samples_per_s']:.3f} "
                         f"| {_fmt(r[key], '.0f')} | {r[key] / b1[key]:.3f} |")
        lines += ["", f"({b}, 1) makes {k} times the updates of the others on the same samples, so its time "
                  f"includes {k} times the optimizer steps: that is the cost accumulation saves.", ""]
    failures = [r for r in report["results"] if not r.get("ok")]
    if failures:
        lines += ["## Failed runs", ""] + [f"- {r['job']}: {r['error']}: {' / '.join(r['log_tail'])}"
                                           for r in failures] + [""]
    lines += [
        "Notes: samples/s and tokens/s (non-pad) cover the training phase only (no start-up, evaluation or "
        "saving); speed runs evaluate on a few samples, the accuracy runs on the whole validation split. Peak "
        "memory is the whole training process's. MFU = estimated training FLOPs/s (6 x encoder "
        "matmul weights x non-pad tokens + attention) / measured matmul peak. The Trainer runs with its "
        "defaults apart from the job's settings (random batches, its fused AdamW); the Accelerate loop with "
        "torch's AdamW defaults. Raw runs: `bench.json`.",
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- entry point


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="results folder (default bench/results)")
    parser.add_argument("--smoke", action="store_true", help="a few updates per arm, one repeat: checks the benchmark")
    parser.add_argument("--levers", action="store_true", help="measure the package's performance options instead")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per arm (default 3; smoke 1)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per arm (default: all available cores)")
    parser.add_argument("--precision", choices=["auto", "no", "bf16"], default="auto",
                        help="auto: bf16 where the GPU or CPU computes it natively (AVX512-BF16/AMX), else fp32")
    parser.add_argument("--datasets", default="sms,bbc", help="comma-separated: sms, bbc")
    parser.add_argument("--sms-steps", type=int, default=24, help="updates per SMS speed run (default 24)")
    parser.add_argument("--bbc-steps", type=int, default=4, help="updates per BBC News run (default 4)")
    parser.add_argument("--batching", default=None, metavar="b,k",
                        help="micro-batch and accumulation steps of every job (default: each config's, 8,4)")
    parser.add_argument("--accuracy-seeds", type=int, default=1,
                        help="full-epoch SMS runs per arm for the accuracy comparison, with seeds 42, 43, ... "
                             "(default 1; 0 skips them)")
    parser.add_argument("--first-seed", type=int, default=42, help="seed of the first accuracy run (default 42)")
    parser.add_argument("--lever-steps", type=int, default=30, help="updates per lever run (default 30)")
    parser.add_argument("--only", default="", help="comma-separated substrings of arm names (or =name for one arm exactly): run only those")
    parser.add_argument("--override", action="append", default=[], metavar="section.key=value",
                        help="extra config override for every arm (e.g. another model)")
    parser.add_argument("--engines", default="", metavar="NAME,...",
                        help="also run the package under these configs/accelerate/<NAME>.yaml, one process each "
                             "(fsdp, deepspeed_zero2; GPUs only)")
    parser.add_argument("--graphs", action="store_true",
                        help="also run the package with training.cuda_graphs: false (eager micro-batches), and with "
                             "training.cuda_graphs: true and training.torch_compile: true or blocks (GPUs only)")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="also run the package of another checkout (git worktree add /tmp/before <commit>) "
                             "with its own configs, in the same rounds: before and after, side by side")
    parser.add_argument("--skip-grad-check", action="store_true", help="do not run the Trainer gradient check")
    parser.add_argument("--combine", nargs="+", metavar="RESULTS_DIR",
                        help="run nothing: pool the runs of earlier results folders (e.g. accuracy runs of "
                             "different seeds) into one report in --out")
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    import torch

    threads = args.threads or available_cores()
    precision = args.precision
    if precision == "auto":  # the package's own rule: bf16 where the device computes it natively
        from finetune.precisions import choose_precision

        precision = choose_precision("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu"))[0]
    engines = [e for e in args.engines.split(",") if e]
    for engine in engines:
        if not (REPO / "configs" / "accelerate" / f"{engine}.yaml").is_file():
            raise SystemExit(f"--engines: no configs/accelerate/{engine}.yaml (fsdp, deepspeed_zero2)")
    if engines and not torch.cuda.is_available():
        raise SystemExit("--engines needs a CUDA GPU: Accelerate runs FSDP and DeepSpeed on GPUs only")
    if args.graphs and not torch.cuda.is_available():
        raise SystemExit("--graphs needs a CUDA GPU: elsewhere training.cuda_graphs trains eagerly")
    baseline = Path(args.baseline).resolve() if args.baseline else None
    if baseline is not None and not (baseline / "finetune" / "train.py").is_file():
        raise SystemExit(f"--baseline: {baseline} is not a checkout of this package (no finetune/train.py)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return Settings(
        out=out,
        repeats=args.repeats or (1 if args.smoke else 3),
        threads=threads,
        precision=precision,
        smoke=args.smoke,
        sms_steps=2 if args.smoke else args.sms_steps,
        bbc_steps=1 if args.smoke else args.bbc_steps,
        accuracy_steps=2 if args.smoke else None,
        accuracy_seeds=args.accuracy_seeds,
        first_seed=args.first_seed,
        datasets=[d for d in args.datasets.split(",") if d],
        only=[o for o in args.only.split(",") if o],
        extra_overrides=args.override,
        batching=_batching(args.batching),
        engines=engines,
        graphs=args.graphs,
        baseline=baseline,
    )


def _batching(text: Optional[str]) -> dict[str, tuple[int, int]]:
    if not text:
        return dict(JOB_BATCHING)
    b, k = (int(x) for x in text.split(","))
    return {dataset: (b, k) for dataset in JOB_BATCHING}


def combine(folders: list[str], out: Path, command: str) -> int:
    """Pool the runs of earlier ``bench.json`` reports and aggregate them as one (``--combine``).

    Rows with the same name are the same arm (e.g. accuracy runs of other
    seeds); machine, peak and Trainer finding come from the first report.
    """
    reports = [json.loads((Path(f) / "bench.json").read_text(encoding="utf-8")) for f in folders]
    for folder, report in zip(folders[1:], reports[1:]):
        if report.get("overrides", []) != reports[0].get("overrides", []):
            print(f"bench: {folder} ran with --override {report.get('overrides', [])}, {folders[0]} with "
                  f"{reports[0].get('overrides', [])}: not the same job, not pooled", file=sys.stderr)
            return 2
    first_code = reports[0].get("code")
    for folder, report in zip(folders, reports):
        code = report.get("code")
        if code is None:
            print(f"bench: {folder} is an older report that records no code version: pooled as the same code",
                  file=sys.stderr)
        elif code.get("dirty"):
            print(f"bench: {folder} ran finetune/ with uncommitted changes to {code['commit']}: its code is not "
                  f"known, not pooled", file=sys.stderr)
            return 2
        elif first_code is not None and code.get("finetune_tree") != first_code.get("finetune_tree"):
            print(f"bench: {folder} ran the finetune/ of {code['commit']}, {folders[0]} that of "
                  f"{first_code['commit']}, and they differ: not the same package, not pooled", file=sys.stderr)
            return 2
    seen: dict[tuple, str] = {}
    for folder, report in zip(folders, reports):
        for r in report["results"]:
            if r.get("seed") is None:
                continue
            if (r["job"], r["seed"]) in seen:
                print(f"bench: {r['job']} seed {r['seed']} is in both {seen[r['job'], r['seed']]} and {folder}",
                      file=sys.stderr)
                return 2
            seen[r["job"], r["seed"]] = folder
    jobs: dict[str, Job] = {}
    for report in reports:
        for name, row in report["rows"].items():
            jobs.setdefault(name, Job(name, ArmSpec("ours", name.split("/")[0], row["b"], row["k"]), row["role"],
                                      row["label"]))
    first = reports[0]
    # round 0 of one report did not run beside round 0 of another: rounds pair within a report only
    results = [{**r, "round": f"{i}.{r['round']}"} if r.get("round") is not None else r
               for i, report in enumerate(reports) for r in report["results"]]
    report = {
        **first,
        "command": command,
        "combined_from": [r["command"] for r in reports],
        "rounds": None,  # each report's own rounds; the pooled medians say nothing of a cut
        "repeats": max(r["repeats"] for r in reports),
        "accuracy_seeds": sum(r.get("accuracy_seeds", 0) for r in reports),
        "rows": aggregate(list(jobs.values()), results, first.get("peak"), first.get("flops_model") or {}),
        "results": results,
        "wall_minutes": sum(r["wall_minutes"] for r in reports),
    }
    publish(report, out)
    return 0


def publish(report: dict[str, Any], out: Path, quiet: bool = False) -> None:
    """Write ``bench.json`` and ``bench.md`` into ``out``; print the Markdown unless ``quiet``."""
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "bench.json", report)
    text = markdown(report)
    (out / "bench.md").write_text(text, encoding="utf-8")
    if not quiet:
        print(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python bench/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.combine:
        return combine(args.combine, Path(args.out), command)
    s = settings_from(args)
    if args.levers:
        from bench import levers

        return levers.run(s, lever_steps=2 if args.smoke else args.lever_steps)
    started = time.perf_counter()
    code = code_version()  # now, not at the end: the tree may change while the arms run
    print(f"bench: results in {s.out}", flush=True)
    finding = None
    if not args.skip_grad_check:
        print("bench: checking the Trainer's gradients at k>1 ...", flush=True)
        finding = run_helper("trainer_grad_check", ["--out"], s, "trainer_grad_check")
    trainer_k1 = bool(finding and finding["changes_gradients"])
    peak = run_helper("peak", [s.precision, str(s.threads)], s, "peak")
    speed = main_jobs(s, trainer_k1)
    accuracy = accuracy_jobs(s, trainer_k1)
    jobs = speed + accuracy
    plan = rounds(speed, s.repeats) + seeded_rounds(accuracy, s.accuracy_seeds, s.first_seed)
    total = sum(len(r) for r in plan)
    fms = {d: flops_model(d, s) for d in s.datasets}
    header = {
        "command": command,
        "smoke": s.smoke,
        "precision": s.precision,
        "repeats": s.repeats,
        "accuracy_seeds": s.accuracy_seeds,
        "overrides": s.extra_overrides,
        "batching": s.batching,
        "machine": machine_info(s.threads, code["commit"]),
        "code": code,
        "trainer_grad_check": finding,
        "peak": peak,
        "flops_model": fms,
    }
    results, index = [], 0

    def report(rounds_done: int, first_round_arms: Optional[int] = None) -> dict[str, Any]:
        rounds_run = {"done": rounds_done, "planned": len(plan)}
        if first_round_arms is not None:
            rounds_run.update(first_round_arms=first_round_arms, arms=len(plan[0]))
        return {**header, "rows": aggregate(jobs, results, peak, fms), "results": results,
                "wall_minutes": (time.perf_counter() - started) / 60, "rounds": rounds_run}

    for repeat, round_jobs in enumerate(plan):
        for arm, job in enumerate(round_jobs, start=1):
            index += 1
            which = f"seed {job.seed}" if job.seed is not None else f"repeat {repeat + 1}"
            print(f"bench: [{index}/{total}] {which}: {job.name} ...", flush=True)
            result = run_job(job, s, index)
            result["round"] = repeat  # the arms of one round run back to back: their ratio is paired
            results.append(result)
            status = (f"{result['samples'] / result['train_seconds']:.1f} samples/s" if result.get("ok")
                      else result["error"])
            print(f"bench:     {status} ({result['wall_seconds']:.0f}s)", flush=True)
            if repeat == 0 and arm < len(round_jobs):
                # within the first round, after every arm: a single-round comparison (the GPU check's long
                # compiled parts) stopped on a time limit keeps the arms that ran
                publish(report(0, first_round_arms=arm), s.out, quiet=True)
        # after every round, so that a run stopped on a time limit leaves the tables of the rounds it finished
        publish(report(repeat + 1), s.out, quiet=repeat + 1 < len(plan))
    if not plan:
        publish(report(0), s.out)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
