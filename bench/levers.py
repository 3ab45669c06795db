"""``bench/run.py --levers``: the package's performance options, measured one at a time.

End-to-end arms (the package's CLI on the SMS job, a fixed number of updates,
alternating, medians of the repeats), each changing one thing from the
package's defaults:

* length-grouped batching off (``data.group_by_length=false``), and over
  mega-batches of 16 windows (``data.length_group_windows=16``);
* equal micro-batches (``data.balance_micro_batches=false``), and each micro-batch
  padded to its longest text (``data.pad_to_multiple_of=null``) rather than to a
  multiple of 8;
* the word embedding's gradient dense (``training.sparse_embedding_grad=false``)
  against its default sparse rows, made dense once per update;
* the C heap's free memory handed back after every update
  (``training.cpu_heap=trim``), and every large block mapped on its own and
  handed back when freed (``release``), against the default, which keeps it
  where memory is ample (``auto``);
* torch's own dropout masks (``training.fast_dropout_masks=false``) against
  the default 16-bit masks, and dropout off (``model.dropout=0.0``), which
  bounds what any mask generator can gain (it changes the training, so it is
  a bound, not an option);
* AdamW kernels: ``optim.implementation`` ``for_loop`` (torch's CPU default)
  and ``foreach`` against the default (fused where torch has it), and
  bitsandbytes' 8-bit AdamW (``optim.optimizer=adamw_8bit``);
* one DataLoader worker (``data.num_workers=1``);
* ``training.torch_compile=true``: the first updates carry the compile time,
  reported as the overhead over the steady update time;
* bf16 autocast (fp32 on a GPU run, whose default here is bf16), fewer
  updates on a CPU without bf16 matrix units, where it is emulated;
* for reference, the Trainer with its defaults and with its
  ``group_by_length`` sampling.

And micro-benchmarks in one process (``python -m bench.levers micro``):
AdamW step time per kernel and for the 8-bit AdamW (also alone: ``python -m
bench.levers steps``), tokenization time (without the cache, a first
run that writes the cache, and a rerun that reads it), evaluation time in
length order against random order, and each training order's padding and
label mix per window (also alone, in seconds: ``python -m bench.levers windows``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.common import ArmSpec, job_config, set_threads, write_result  # noqa: E402
from finetune.machine import available_cores  # noqa: E402

# Evaluation is not timed; a small validation subset keeps the slow arms (bf16 on a CPU) short.
EVAL_SUBSET = ["data.max_eval_samples=64"]


def lever_jobs(s, steps: int):
    """The lever arms (``bench.run.Job``), baseline first."""
    from bench.run import Job, selected

    b, k = s.batching["sms"]
    base = ArmSpec("ours", "sms", b, k, max_steps=steps, precision=s.precision,
                   overrides=EVAL_SUBSET + list(s.extra_overrides), threads=s.threads)

    def ours(name, *overrides, **changes):
        spec = replace(base, overrides=base.overrides + list(overrides), **changes)
        return Job(f"lever/{name}", spec, "lever", name)

    other_precision = "no" if s.precision == "bf16" else "bf16"
    # bf16 is emulated on CPUs without AVX512-BF16/AMX (~17x slower): fewer updates there
    slow = other_precision == "bf16" and not _cuda()
    jobs = [
        ours("baseline (package defaults)"),
        ours("no length grouping", "data.group_by_length=false"),
        ours("length grouping over 16 windows", "data.length_group_windows=16"),
        ours("equal micro-batches", "data.balance_micro_batches=false"),
        ours("padding to the longest text", "data.pad_to_multiple_of=null"),
        ours("dense embedding gradient", "training.sparse_embedding_grad=false"),
        ours("torch dropout masks", "training.fast_dropout_masks=false"),
        ours("heap trimmed after each update", "training.cpu_heap=trim"),
        ours("heap released (large blocks mapped on their own)", "training.cpu_heap=release"),
        ours("gradient noise scale measured", "logging.noise_scale=true"),
        ours("weight gradients added by their products", "training.gradient_accumulation_fusion=true"),
        # oneDNN reads its kernel cache's size from the environment only; its default holds 1024 kernels
        ours("oneDNN cache of 4096 kernels", env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "4096"}),
        ours("dropout off (bound)", "model.dropout=0.0"),
        ours("AdamW for_loop", "optim.implementation=for_loop"),
        ours("AdamW foreach", "optim.implementation=foreach"),
        ours("AdamW 8-bit (bitsandbytes)", "optim.optimizer=adamw_8bit"),
        ours("1 DataLoader worker", "data.num_workers=1"),
        ours("torch.compile", "training.torch_compile=true"),
        ours(f"precision {other_precision}", precision=other_precision,
             max_steps=max(1, steps // 10) if slow else steps),
        Job("lever/Trainer", replace(base, arm="trainer"), "lever", "Trainer (defaults)"),
        Job("lever/Trainer group_by_length", replace(base, arm="trainer", options=["group_by_length"]), "lever",
            "Trainer, group_by_length"),
    ]
    if s.only:
        return [j for j in jobs if selected(j.name, s.only)]
    if s.smoke:
        # compiling takes minutes on a CPU: the smoke run leaves it out unless asked (--only compile)
        jobs = [j for j in jobs if "compile" not in j.name]
    return jobs


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(s, lever_steps: int) -> int:
    """Run the lever arms and the micro-benchmarks; write ``levers.md`` and ``levers.json``."""
    from bench.run import code_version, machine_info, rounds, run_helper, run_job

    started = time.perf_counter()
    code = code_version()
    print(f"levers: results in {s.out}", flush=True)
    micro = run_helper("levers", ["micro", str(s.threads), ",".join(s.extra_overrides)], s, "levers_micro")
    jobs = lever_jobs(s, lever_steps)
    plan = rounds(jobs, s.repeats)
    total = sum(len(r) for r in plan)
    results, index = [], 0
    for repeat, round_jobs in enumerate(plan):
        for job in round_jobs:
            index += 1
            print(f"levers: [{index}/{total}] repeat {repeat + 1}: {job.name} ...", flush=True)
            result = run_job(job, s, 500 + index)
            results.append(result)
            status = (f"{result['samples'] / result['train_seconds']:.1f} samples/s" if result.get("ok")
                      else result["error"])
            print(f"levers:     {status} ({result['wall_seconds']:.0f}s)", flush=True)
    rows = summarize(jobs, results)
    report = {"smoke": s.smoke, "precision": s.precision, "repeats": s.repeats, "lever_steps": lever_steps,
              "b": s.batching["sms"][0], "k": s.batching["sms"][1],
              "machine": machine_info(s.threads, code["commit"]), "code": code,
              "micro": micro, "rows": rows, "results": results,
              "wall_minutes": (time.perf_counter() - started) / 60}
    write_result(s.out / "levers.json", report)
    text = levers_markdown(report)
    (s.out / "levers.md").write_text(text, encoding="utf-8")
    print(text)
    return 0 if all(r.get("ok") for r in results) else 1


def summarize(jobs, results) -> dict[str, dict[str, Any]]:
    """Medians per lever: samples/s, ratio to the baseline, steady update time, warm-up overhead."""
    from bench.run import steady_state

    rows = {}
    for job in jobs:
        runs = [r for r in results if r["job"] == job.name and r.get("ok")]
        row: dict[str, Any] = {"label": job.label, "repeats": len(runs), "overrides": job.spec.overrides,
                               "precision": job.spec.precision, "updates": job.spec.max_steps}
        if runs:
            row["samples_per_s"] = statistics.median(r["samples"] / r["train_seconds"] for r in runs)
            row["rss_peak_mib"] = statistics.median(r["rss_peak_mib"] for r in runs)
            timed = steady_state(runs)
            if timed is not None:  # the time beyond `updates x steady`: warm-up, compilation, new shapes
                row["steady_update_seconds"], row["overhead_seconds"] = timed
        rows[job.name] = row
    base = rows.get("lever/baseline (package defaults)", {}).get("samples_per_s")
    for row in rows.values():
        if base and "samples_per_s" in row:
            row["x_baseline"] = row["samples_per_s"] / base
    return rows


def levers_markdown(report: dict[str, Any]) -> str:
    from bench.run import describe_commit

    def f(value, spec=".2f"):
        return "n/a" if value is None else f"{value:{spec}}"

    lines = [f"# Levers{' (SMOKE: numbers mean nothing)' if report['smoke'] else ''}", "",
             f"SMS job, b={report.get('b', '?')} k={report.get('k', '?')}, {report['lever_steps']} updates per run (fewer where noted), medians of "
             f"{report['repeats']} repeats, alternating; wall time {report['wall_minutes']:.1f} min  ",
             *([f"Machine: {m['gpu'] or m['cpu']}, {m['threads_per_arm']} threads per arm; torch {m['torch']}; "
                f"commit {describe_commit(report)}"] if (m := report.get("machine")) else []), "",
             "| lever | updates | samples/s | x baseline | steady s/update | warm-up overhead s | peak RSS MiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in report["rows"].values():
        lines.append(f"| {row['label']} | {row['updates']} | {f(row.get('samples_per_s'), '.1f')} "
                     f"| {f(row.get('x_baseline'))} | {f(row.get('steady_update_seconds'), '.3f')} "
                     f"| {f(row.get('overhead_seconds'), '.1f')} | {f(row.get('rss_peak_mib'), '.0f')} |")
    micro = report.get("micro") or {}
    if micro:
        lines += ["", "## Micro-benchmarks", ""]
        for name, ms in micro.get("adamw_step_ms", {}).items():
            lines.append(f"- AdamW step, {name}: {ms:.1f} ms (median; {micro['params_millions']:.1f}M parameters)")
        for name, t in micro.get("tokenize_seconds", {}).items():
            lines.append(f"- tokenization, {name} (median of {t['repeats']}): without the cache "
                         f"{t['no cache']:.2f} s, first run (tokenizes and writes the cache) {t['first run']:.2f} s, "
                         f"rerun (reads the cache) {t['rerun']:.2f} s")
        for name, t in micro.get("eval_seconds", {}).items():
            lines.append(f"- evaluation of the SMS validation set, {name}: {t:.2f} s")
        if micro.get("windows"):
            lines += ["", "Training orders (`python -m bench.levers windows`):", "",
                      *windows_markdown(micro["windows"])]
    failures = [r for r in report["results"] if not r.get("ok")]
    if failures:
        lines += ["", "## Failed runs", ""] + [f"- {r['job']}: {r['error']}: {' / '.join(r['log_tail'])}"
                                               for r in failures]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- micro-benchmarks


def _alternating(fns: dict[str, Any], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, calls alternating between them."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(warmup + repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def optimizer_steps(model, device) -> dict[str, Any]:
    """Median milliseconds of one optimizer step over ``model``'s trained weights, per AdamW kernel and for
    bitsandbytes' 8-bit AdamW (where it is installed), the calls alternating."""
    import importlib.util

    import torch

    from finetune.optimizer_state import eight_bit_adamw

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kernels = {"for_loop": {"foreach": False, "fused": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    optimizers = {name: torch.optim.AdamW(params, lr=1e-8, **kw) for name, kw in kernels.items()}
    if importlib.util.find_spec("bitsandbytes") is not None:
        optimizers["8-bit (bitsandbytes)"] = eight_bit_adamw([{"params": params}], lr=1e-8)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps = {name: (lambda o=o: (o.step(), sync())) for name, o in optimizers.items()}
    out = {"params_millions": sum(p.numel() for p in params) / 1e6,
           "adamw_step_ms": {k: v * 1000 for k, v in _alternating(steps, repeats=10, warmup=2).items()}}
    for p in params:
        p.grad = None
    return out


def micro(threads: int, overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """AdamW kernels, tokenization, evaluation order and padding share, in this process."""
    import datasets
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding

    from bench.common import load_job
    from finetune.data import load_splits
    from finetune.tokens import tokenize_splits
    from finetune.truncation import model_inputs
    from finetune.evaluation import evaluate_model
    from finetune.modeling import load_tokenizer

    set_threads(threads)
    out: dict[str, Any] = {}
    cfg = job_config(ArmSpec("ours", "sms", 16, 2, overrides=list(overrides or [])))
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer, tokenized, _, model, metrics = load_job(cfg)
    model.to(accelerator.device)

    out.update(optimizer_steps(model, accelerator.device))

    out["tokenize_seconds"] = {}
    for dataset in ("sms", "bbc"):
        dcfg = job_config(ArmSpec("ours", dataset, 8, 4, overrides=list(overrides or [])))
        tok = load_tokenizer(dcfg.model)
        splits, _ = load_splits(dcfg.data, seed=dcfg.training.seed)
        tokenize_splits(splits, tok, dcfg.data.max_length)  # warm-up: the first call pays one-off imports
        timing: dict[str, list[float]] = {"no cache": [], "first run": [], "rerun": []}
        for _ in range(3):
            with tempfile.TemporaryDirectory() as cache:
                for attempt, cache_dir in (("no cache", None), ("first run", cache), ("rerun", cache)):
                    # without the package's cache, datasets' own fingerprint cache could still answer for
                    # a file-backed split: switched off, so "no cache" is the cost of tokenizing
                    if cache_dir is None:
                        datasets.disable_caching()
                    start = time.perf_counter()
                    tokenize_splits(splits, tok, dcfg.data.max_length, cache_dir=cache_dir)
                    timing[attempt].append(time.perf_counter() - start)
                    datasets.enable_caching()
        out["tokenize_seconds"][dataset] = {**{k: statistics.median(v) for k, v in timing.items()}, "repeats": 3}

    collate = DataCollatorWithPadding(tokenizer)
    validation = tokenized["validation"]
    size = cfg.training.per_device_eval_batch_size
    sorted_dl = accelerator.prepare(DataLoader(model_inputs(validation.sort("length", reverse=True)),
                                               batch_size=size, collate_fn=collate))
    shuffled_dl = accelerator.prepare(DataLoader(model_inputs(validation.shuffle(seed=0)),
                                                 batch_size=size, collate_fn=collate))
    model = accelerator.prepare(model)
    out["eval_seconds"] = _alternating({
        "length order (package)": lambda: evaluate_model(model, sorted_dl, accelerator, metrics),
        "random order": lambda: evaluate_model(model, shuffled_dl, accelerator, metrics),
    }, repeats=3)

    out["windows"] = window_mix(overrides)
    return out


ORDERS = {
    "random (no grouping)": {"group_by_length": False},
    "sorted within each window, equal micro-batches": {"group_by_length": True, "group_windows": 1},
    "sorted within each window, balanced micro-batches (default)": {"group_by_length": True, "group_windows": 1,
                                                                    "balanced": True},
    "mega-batches of 16 windows": {"group_by_length": True, "group_windows": 16},
}


def window_mix(overrides: Optional[list[str]] = None) -> dict[str, dict[str, dict[str, float]]]:
    """Padding and label mix of each training order, on the SMS and BBC News jobs at their b and k.

    Per order: the share of padded positions in the job's micro-batches (each padded as the collator pads it, to
    a multiple of ``data.pad_to_multiple_of``), the
    mean total-variation distance between a window's label shares and the
    training set's (0 when every update holds the set's mix; a uniform random
    window of 32 is not 0 either), and the share of windows that miss a label.
    """
    from bench.run import JOB_BATCHING
    from finetune.data import load_splits
    from finetune.tokens import tokenize_splits
    from finetune.modeling import load_tokenizer
    from finetune.sampling import BalancedBatches, EpochSampler

    result = {}
    for dataset in ("sms", "bbc"):
        b, k = JOB_BATCHING[dataset]
        cfg = job_config(ArmSpec("ours", dataset, b, k, overrides=list(overrides or [])))
        # the training split's lengths and labels only: no model to load
        splits, labels = load_splits(cfg.data, seed=cfg.training.seed)
        train = tokenize_splits(splits, load_tokenizer(cfg.model), cfg.data.max_length)["train"]
        lengths, y = train["length"], train["labels"]
        overall = [sum(1 for v in y if v == c) / len(y) for c in range(len(labels))]
        result[dataset] = {}
        for name, kwargs in ORDERS.items():
            kwargs = dict(kwargs)
            balanced = kwargs.pop("balanced", False)
            sampler = EpochSampler(len(y), seed=cfg.training.seed, lengths=lengths, window_size=b * k, **kwargs)
            order = sampler.order()
            multiple = cfg.data.pad_to_multiple_of or 1  # as the collator pads: to a multiple of it
            cuts = BalancedBatches(sampler, b, multiple).micro_batches() if balanced else \
                [order[i : i + b] for i in range(0, len(order), b)]
            real = padded = 0
            for cut in cuts:
                batch = [lengths[j] for j in cut]
                real += sum(batch)
                padded += len(batch) * -(-max(batch) // multiple) * multiple
            distances, missing = [], 0
            for i in range(0, len(order), b * k):
                window = [y[j] for j in order[i : i + b * k]]
                shares = [window.count(c) / len(window) for c in range(len(labels))]
                distances.append(sum(abs(a - o) for a, o in zip(shares, overall)) / 2)
                missing += min(shares) == 0
            result[dataset][name] = {"padding_share": 1 - real / padded, "label_distance": statistics.mean(distances),
                                     "windows_missing_a_label": missing / len(distances), "b": b, "k": k}
    return result


def windows_markdown(result: dict[str, Any]) -> list[str]:
    lines = ["| job | order | padding | label distance per window | windows missing a label |",
             "| --- | --- | ---: | ---: | ---: |"]
    for dataset, orders in result.items():
        for name, r in orders.items():
            lines.append(f"| {dataset} (b={r['b']}, k={r['k']}) | {name} | {100 * r['padding_share']:.1f}% "
                         f"| {r['label_distance']:.3f} | {100 * r['windows_missing_a_label']:.0f}% |")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "steps":
        # seconds: one optimizer step over the default job's model, per kernel and in 8 bits
        import torch

        from bench.common import load_job

        set_threads(int(argv[1]) if len(argv) > 1 else available_cores())
        model = load_job(job_config(ArmSpec("ours", "sms", 16, 2)))[3]
        result = optimizer_steps(model, torch.device("cpu"))
        for name, ms in result["adamw_step_ms"].items():
            print(f"- AdamW step, {name}: {ms:.1f} ms (median; {result['params_millions']:.1f}M parameters)")
        return 0
    if argv and argv[0] == "windows":
        # seconds, no training: how each training order pads and mixes labels
        print("\n".join(windows_markdown(window_mix(argv[1:]))))
        return 0
    if not argv or argv[0] != "micro":
        print("usage: python -m bench.levers windows [section.key=value ...] | "
              "python -m bench.levers steps [THREADS] | "
              "python -m bench.levers micro THREADS OVERRIDES OUT_JSON (bench/run.py --levers runs it)")
        return 2
    overrides = [o for o in argv[2].split(",") if o] if len(argv) > 3 else []
    write_result(argv[-1], micro(int(argv[1]), overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
