"""``training.cuda_graphs`` on one micro-batch at a time: does it pay on this GPU, and is its gradient the eager one?

::

    python -m bench.cuda_graphs [--micro-batches 24] [--rounds 5] [section.key=value ...]

On the BBC News job (with overrides: the GPU check's bert-base-sized model,
``data.max_length=128``, ``training.mixed_precision=bf16``,
``training.per_device_train_batch_size=64``), the forward and backward of the
same micro-batches, three ways:

- ``eager``: the package's eager step (``finetune.loop.micro_batch_loss``
  under the model's autocast, then the backward);
- ``static``: :class:`finetune.cuda_graphs.GraphedMicroBatches` replaying
  nothing (``rerun_eagerly``): the same micro-batches on fixed shapes, padded
  to ``b`` rows (the added rows weigh 0) and to one of four lengths;
- ``graphed``: the same class capturing one CUDA graph per length
  (``training.cuda_graphs``; CUDA only).

Each way accumulates the gradient of the same micro-batches, as one window,
into gradients zeroed in place. The report gives milliseconds per
micro-batch (median over ``--rounds``, ways alternating), the relative
difference of each way's accumulated gradient from ``eager``'s, how long
capturing took, after how many micro-batches it has paid for itself, and the
graphs' memory pool. Without CUDA, ``graphed`` is left out and the rest runs (the
test suite checks ``static`` against ``eager`` that way). Dropout is off
(``model.dropout=0``), so that the gradients can be compared. ``static``
against ``graphed`` is what the graphs themselves save; ``eager`` against
``static`` what the padding costs.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from bench.common import REPO, ArmSpec, job_config, write_result  # noqa: E402

RESULTS = REPO / "bench" / "results"


def _gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])


def measure(overrides: list[str], micro_batches: int = 24, rounds: int = 5, threads: int = 2) -> dict[str, Any]:
    """Run the three ways over the same ``micro_batches`` micro-batches, ``rounds`` times each, alternating."""
    import os

    from finetune.assembly import setup_run
    from finetune.cuda_graphs import GraphedMicroBatches, record_cuda_graph, rerun_eagerly
    from finetune.dataloaders import BucketPadding
    from finetune.loop import micro_batch_loss

    os.environ["FINETUNE_CPU_THREADS"] = str(threads)
    cfg = job_config(ArmSpec("ours", "bbc", 8, 1, max_steps=micro_batches),
                     ["logging.progress_bar=false", "model.dropout=0", "training.effective_batch_size=null",
                      "training.gradient_accumulation_steps=1", "data.balance_micro_batches=false"] + overrides)
    run = setup_run(cfg)
    model, accelerator, loss_fn = run.model, run.accelerator, run.task.per_sample_loss
    device, cuda = accelerator.device, accelerator.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    b = cfg.training.per_device_train_batch_size
    sizes = BucketPadding(run.tokenizer, cfg.data.max_length).sizes
    batches = []
    for batch in run.train_dataloader:
        batches.append({k: v.to(device) for k, v in batch.items()})
        if len(batches) == micro_batches:
            break
    samples = sum(int(batch["labels"].shape[0]) for batch in batches)
    scale = 1.0 / samples  # the mean over the micro-batches, as one window
    model.train()

    def eager() -> torch.Tensor:
        total = torch.zeros((), device=device)
        for batch in batches:
            loss_sum, _ = micro_batch_loss(model, dict(batch), batch["labels"].shape[0], loss_fn)
            (loss_sum * scale).backward()
            total += loss_sum.detach().float()
        return total

    def fixed_shapes(recorder) -> Callable[[], torch.Tensor]:
        graphs = GraphedMicroBatches(model, loss_fn, rows=b, lengths=sizes,
                                     pad_token_id=run.tokenizer.pad_token_id or 0,
                                     precision=accelerator.mixed_precision, recorder=recorder)

        def way() -> torch.Tensor:
            total = torch.zeros((), device=device)
            for batch in batches:
                total += graphs.forward_backward(batch, batch["labels"].shape[0], scale)[0].float()
            return total

        way.graphs = graphs
        return way

    ways: dict[str, Callable[[], torch.Tensor]] = {"eager": eager, "static": fixed_shapes(rerun_eagerly)}
    if cuda:
        ways["graphed"] = fixed_shapes(record_cuda_graph)
    times: dict[str, list[float]] = {name: [] for name in ways}
    gradients, losses = {}, {}
    for r in range(rounds + 1):  # round 0 warms every way up (and captures the graphs), untimed
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            model.zero_grad(set_to_none=False)  # in place: a captured backward adds into the gradients' memory
            sync()
            started = time.perf_counter()
            total = ways[name]()
            sync()
            if r > 0:
                times[name].append(1e3 * (time.perf_counter() - started) / len(batches))
            gradients[name], losses[name] = _gradient(model), float(total) / samples
    reference = gradients["eager"]
    graphed = ways["graphed"].graphs if cuda else None
    return {
        "device": torch.cuda.get_device_name() if cuda else "CPU", "precision": accelerator.mixed_precision,
        "overrides": overrides, "micro_batches": len(batches), "rows": b, "lengths": sizes, "rounds": rounds,
        "ms_per_micro_batch": {name: statistics.median(t) for name, t in times.items()},
        "ms_runs": times,
        "gradient_relative_difference": {name: float((g - reference).norm() / reference.norm())
                                         for name, g in gradients.items()},
        "mean_loss": losses,
        "graphs": len(graphed.graphs) if graphed else 0,
        "capture_seconds": graphed.capture_seconds if graphed else None,
        "pool_bytes": graphed.record()["pool_bytes"] if graphed else None,
    }


def break_even(result: dict[str, Any]) -> Optional[float]:
    """Micro-batches after which capturing has paid for itself against eager (``inf``: never; ``None``: nothing
    was captured). Each length is captured once, so a run of more micro-batches than this gains."""
    ms, seconds = result["ms_per_micro_batch"], result.get("capture_seconds")
    if "graphed" not in ms or seconds is None:
        return None
    saved = ms["eager"] - ms["graphed"]
    return 1e3 * seconds / saved if saved > 0 else float("inf")


def markdown(result: dict[str, Any]) -> str:
    base = result["ms_per_micro_batch"]["eager"]
    lines = [f"{result['device']}, {result['precision']}, BBC News job, {result['micro_batches']} micro-batches of "
             f"{result['rows']} rows (lengths {result['lengths']}), {result['rounds']} rounds"
             f"{' with ' + ' '.join(result['overrides']) if result['overrides'] else ''}"
             + (f"; {result['graphs']} graphs captured in {result['capture_seconds']:.1f} s"
                if result["graphs"] else "") + ":", "",
             "| way | ms per micro-batch (median) | x eager | gradient's relative difference from eager |",
             "| --- | ---: | ---: | ---: |"]
    for name, ms in result["ms_per_micro_batch"].items():
        lines.append(f"| {name} | {ms:.2f} | {base / ms:.2f} | {result['gradient_relative_difference'][name]:.2e} |")
    pays = break_even(result)
    if pays is not None:
        when = (f"after {pays:.0f} micro-batches of this size" if pays != float("inf")
                else "never: graphed is not faster than eager")
        pool = (f"; the graphs' memory pool holds {result['pool_bytes'] / 2**20:.0f} MiB"
                if result.get("pool_bytes") else "")
        lines += ["", f"Capturing pays for itself {when}{pool}."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    result = measure(args.overrides, args.micro_batches, args.rounds, args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "cuda_graphs.json", result)
    print(markdown(result), end="")
    print(json.dumps({"gradient_relative_difference": result["gradient_relative_difference"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
