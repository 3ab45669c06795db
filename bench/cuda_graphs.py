"""A micro-batch replayed from CUDA graphs: does it pay on this GPU, and is its gradient the eager one?

Measured before it enters the package::

    python -m bench.cuda_graphs [--micro-batches 24] [--rounds 5] [section.key=value ...]

On the BBC News job (with overrides: the GPU check's bert-base-sized model,
``data.max_length=128``, ``training.mixed_precision=bf16``,
``training.per_device_train_batch_size=64``), the forward and backward of the
same micro-batches, three ways:

- ``eager``: the package's step as it is (``finetune.loop.micro_batch_loss``
  then ``accelerator.backward``), on the package's padded micro-batches;
- ``static``: the same step on fixed shapes, as a graph needs them: every
  micro-batch padded to ``b`` rows (the added rows weigh 0, as repeated
  samples already do) and to one of four lengths
  (``finetune.dataloaders.BucketPadding``'s);
- ``graphed``: the static step captured once per length with
  ``torch.cuda.graph`` and replayed (CUDA only).

Each way accumulates the gradient of the same micro-batches, as one window,
into gradients that persist across replays (zeroed in place, never freed: a
captured backward adds into their memory). The report gives milliseconds per
micro-batch (median over ``--rounds``, ways alternating), each way's largest
relative difference of the accumulated gradient from ``eager``'s, and how long
capturing took. Without CUDA, ``graphed`` is left out and the rest runs (the
test suite checks ``static`` against ``eager`` that way).

Why by hand and not inductor's ``mode="reduce-overhead"``: its CUDA graph
trees hand one output buffer to successive replays, and with gradient
accumulation a replay may overwrite a gradient another micro-batch of the
window still holds (pytorch/pytorch#169545). Capturing the step here keeps
the gradients in the parameters' own ``.grad`` and the graph's only job is
to add into them. Dropout replays from the graph-safe generator, so
``graphed`` is compared with dropout off (``model.dropout=0``, as
the overrides the GPU check passes).
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
WARMUP_REPLAYS = 3  # eager runs on a side stream before capture, with every row weighted 0 (no gradient)


def static_batch(batch: dict[str, torch.Tensor], rows: int, sizes: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """``batch`` padded to ``rows`` rows and to the smallest of ``sizes`` that holds it; ``weights`` marks
    the rows that count (1) and the added ones (0)."""
    n, length = batch["input_ids"].shape
    width = next((s for s in sizes if s >= length), length)
    out = {}
    for key, value in batch.items():
        if value.dim() == 2:  # token-level: input_ids, attention_mask, token_type_ids
            fill = pad_id if key == "input_ids" else 0
            padded = value.new_full((rows, width), fill)
            padded[:n, :length] = value
            padded[n:] = padded[0]  # a real text in each added row: no empty attention, weight 0
        else:  # labels
            padded = value.new_empty((rows,) + tuple(value.shape[1:]))
            padded[:n] = value
            padded[n:] = value[0]
        out[key] = padded
    weights = torch.zeros(rows, dtype=torch.float32, device=batch["input_ids"].device)
    weights[:n] = 1.0
    out["weights"] = weights
    return out


def weighted_step(model, loss_fn: Callable, batch: dict[str, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
    """Forward, the weighted sum of per-sample losses, backward of it times ``scale``; returns the sum (detached)."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "weights")}
    per_sample = loss_fn(model(**inputs).logits, batch["labels"])
    loss_sum = (per_sample * batch["weights"]).sum()
    (loss_sum * scale).backward()
    return loss_sum.detach()


class GraphedStep:
    """:func:`weighted_step` replayed from one CUDA graph per input shape, the graphs sharing one memory pool.

    A new shape is captured on first sight: ``WARMUP_REPLAYS`` eager runs on a
    side stream with every row weighted 0 (their gradient is zero, so the
    parameters' ``.grad`` keep their sums), then the capture, then one replay
    for the real micro-batch. The gradients must exist before (zeros) and
    stay allocated: the captured backward adds into their memory.
    """

    def __init__(self, model, loss_fn: Callable) -> None:
        self.model, self.loss_fn = model, loss_fn
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.pool = None
        self.scale = None
        self.capture_seconds = 0.0

    def __call__(self, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        key = tuple((k, tuple(v.shape)) for k, v in sorted(batch.items()))
        if key not in self.graphs:
            self._capture(key, batch)
        graph, static, loss_sum = self.graphs[key]
        for name, value in batch.items():
            static[name].copy_(value, non_blocking=True)
        self.scale.fill_(scale)
        graph.replay()
        return loss_sum.clone()

    def _capture(self, key: tuple, batch: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        if self.scale is None:
            self.scale = torch.zeros((), device=batch["input_ids"].device)
        static = {name: value.clone() for name, value in batch.items()}
        static["weights"].zero_()  # the warm-up adds nothing to the gradients
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_REPLAYS):
                weighted_step(self.model, self.loss_fn, static, self.scale)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            loss_sum = weighted_step(self.model, self.loss_fn, static, self.scale)
        self.pool = graph.pool()
        self.graphs[key] = (graph, static, loss_sum)
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - started


def _gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])


def _zero_grads(model) -> None:
    """Zero every trainable weight's gradient in place (allocating it the first time): replays add into them."""
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()


def measure(overrides: list[str], micro_batches: int = 24, rounds: int = 5, threads: int = 2) -> dict[str, Any]:
    """Run the three ways over the same ``micro_batches`` micro-batches, ``rounds`` times each, alternating."""
    import os

    from finetune.assembly import setup_run
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
    pad_id = run.tokenizer.pad_token_id or 0
    batches = []
    for batch in run.train_dataloader:
        batches.append({k: v.to(device) for k, v in batch.items()})
        if len(batches) == micro_batches:
            break
    statics = [static_batch(batch, b, sizes, pad_id) for batch in batches]
    samples = sum(int(batch["labels"].shape[0]) for batch in batches)
    scale = 1.0 / samples  # the mean over the micro-batches, as one window
    model.train()

    def eager() -> torch.Tensor:
        total = torch.zeros((), device=device)
        for batch in batches:
            with accelerator.autocast():
                loss_sum, _ = micro_batch_loss(model, dict(batch), batch["labels"].shape[0], loss_fn)
            (loss_sum * scale).backward()
            total += loss_sum.detach().float()
        return total

    def static() -> torch.Tensor:
        scale_t = torch.tensor(scale, device=device)
        total = torch.zeros((), device=device)
        for batch in statics:
            with accelerator.autocast():
                total += weighted_step(model, loss_fn, batch, scale_t).float()
        return total

    ways: dict[str, Callable[[], torch.Tensor]] = {"eager": eager, "static": static}
    graphed: Optional[GraphedStep] = None
    if cuda:
        graphed = GraphedStep(_autocast_forward(model, accelerator), loss_fn)

        def replayed() -> torch.Tensor:
            total = torch.zeros((), device=device)
            for batch in statics:
                total += graphed(batch, scale).float()
            return total

        ways["graphed"] = replayed
    times: dict[str, list[float]] = {name: [] for name in ways}
    gradients, losses = {}, {}
    for r in range(rounds + 1):  # round 0 warms every way up (and captures the graphs), untimed
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            _zero_grads(model)
            sync()
            started = time.perf_counter()
            total = ways[name]()
            sync()
            if r > 0:
                times[name].append(1e3 * (time.perf_counter() - started) / len(batches))
            gradients[name], losses[name] = _gradient(model), float(total) / samples
    reference = gradients["eager"]
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
    }


def _autocast_forward(model, accelerator):
    """The model with its forward under the run's autocast, with autocast's weight cache off.

    A capture must not leave autocast's cache holding copies made in the
    graph's private memory, which later replays overwrite (torch's CUDA graph
    notes ask for ``cache_enabled=False`` under capture).
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    if dtype is None:
        return model

    class Cast(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **inputs):
            with torch.autocast("cuda", dtype=dtype, cache_enabled=False):
                out = self.inner(**inputs)
            out.logits = out.logits.float()
            return out

    return Cast(accelerator.unwrap_model(model, keep_fp32_wrapper=False))


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
