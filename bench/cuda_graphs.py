"""``training.cuda_graphs`` on one micro-batch at a time: does it pay on this GPU, and is its gradient the eager one?

::

    python -m bench.cuda_graphs [--micro-batches 24] [--rounds 5] [--compiled] [--bias-apart] [section.key=value ...]

On the BBC News job (with overrides: the GPU check's bert-base-sized model,
``data.max_length=128``, ``training.mixed_precision=bf16``,
``training.per_device_train_batch_size=64``), the forward and backward of the
same micro-batches, in these ways:

- ``eager``: the package's eager step (``finetune.loop.micro_batch_loss``
  under the model's autocast, then the backward);
- ``static``: :class:`finetune.cuda_graphs.GraphedMicroBatches` replaying
  nothing (``rerun_eagerly``): the same micro-batches on fixed shapes, padded
  to ``b`` rows (the added rows weigh 0) and to one of four lengths;
- ``graphed``: the same class capturing one CUDA graph per length
  (``training.cuda_graphs``; CUDA only);
- with ``--compiled``, ``compiled`` and ``compiled graphed``: ``static`` and
  ``graphed`` with the model's forward compiled (``training.torch_compile``
  as well), each compiling its own; and ``compiled layers`` and ``compiled
  layers graphed``: each encoder block compiled on its own instead (regional
  compilation: one compile that every block of the same kind reuses, so a
  shorter cold start). Eagerly, the blocks' compiled calls cost the host
  more than their fusion saves (bench/README.md, the H100's torch.compile
  table); replayed from a graph they cost it nothing, which these ways
  measure (``training.torch_compile: blocks``).

With ``--bias-apart``, ``static``, ``graphed`` and the compiled layers' ways
once more with the encoder's linear layers computing their product alone and
adding the bias by a kernel of its own (``<way>, bias apart``): the
``products`` part of the GPU check times the two alone, and these ways say
what the difference is worth in
a whole micro-batch, eager, replayed and compiled (where inductor can fuse the
bias into the element-wise kernel after the product).

(The model called without its attention mask inside graphs, for micro-batches
without padding, was measured here once and ran slower than with the mask:
bench/README.md, the H100's second lease.)

A way whose capture CUDA refuses gets no row, and the report gives CUDA's
reason; the other ways are measured. Each way accumulates the gradient of the
same micro-batches, as one window, into gradients zeroed in place. The report
gives milliseconds per micro-batch (median over ``--rounds``, ways
alternating) and samples per second, the relative difference of each way's
accumulated gradient from ``eager``'s, how long each way's set-up took
(capturing, compiling), after how many micro-batches it has paid for itself
against ``eager``, and the graphs' memory pool. Without CUDA the graphed ways
are left out and the rest runs (the test suite checks ``static`` against
``eager`` that way). Dropout is off (``model.dropout=0``), so that the
gradients can be compared. ``static`` against ``graphed`` is what the graphs
themselves save; ``eager`` against ``static`` what the padding costs.
"""

from __future__ import annotations

import contextlib
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


def compiled_blocks(model) -> Callable[[], contextlib.AbstractContextManager]:
    """Regional compilation, for one way alone: a context that swaps each encoder block's forward for its
    compiled one while inside (compiled at the first call inside, which a warm-up makes), and hands the
    model back as it was on the way out, for the other ways."""
    from finetune.lora import blocks_of

    blocks = list(blocks_of(model))
    compiled = [torch.compile(block.forward) for block in blocks]

    @contextlib.contextmanager
    def inside():
        for block, forward in zip(blocks, compiled):
            block.forward = forward  # an instance attribute over the class's method
        try:
            yield
        finally:
            for block in blocks:
                del block.forward

    return inside


def bias_apart(model) -> Callable[[], contextlib.AbstractContextManager]:
    """For one way alone: a context in which every linear layer with a bias in the encoder's blocks is the
    package's :class:`~finetune.bias_apart.BiasApartLinear` (``training.bias_apart``; the same parameters, the
    class swapped, which dynamo's guards see, so a compiled block compiles again for it), handed back as
    ``nn.Linear`` on the way out."""
    from finetune.bias_apart import BiasApartLinear
    from finetune.lora import blocks_of

    linears = [module for block in blocks_of(model) for module in block.modules()
               if type(module) is torch.nn.Linear and module.bias is not None]

    @contextlib.contextmanager
    def inside():
        for linear in linears:
            linear.__class__ = BiasApartLinear
        try:
            yield
        finally:
            for linear in linears:
                linear.__class__ = torch.nn.Linear

    return inside


def together(*contexts: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], contextlib.AbstractContextManager]:
    """The contexts entered in order, as one (the layers swapped before the blocks compile)."""
    @contextlib.contextmanager
    def inside():
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            yield

    return inside


def _gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])


def measure(overrides: list[str], micro_batches: int = 24, rounds: int = 5, threads: int = 2,
            compiled: bool = False, apart: bool = False) -> dict[str, Any]:
    """Run the ways over the same ``micro_batches`` micro-batches, ``rounds`` times each, alternating."""
    import os

    from finetune.assembly import setup_run
    from finetune.cuda_graphs import GraphedMicroBatches, record_cuda_graph, refusal, rerun_eagerly
    from finetune.dataloaders import BucketPadding
    from finetune.loop import micro_batch_loss

    os.environ["FINETUNE_CPU_THREADS"] = str(threads)
    cfg = job_config(ArmSpec("ours", "bbc", 8, 1, max_steps=micro_batches),
                     ["logging.progress_bar=false", "model.dropout=0", "training.effective_batch_size=null",
                      "training.gradient_accumulation_steps=1", "data.balance_micro_batches=false",
                      # the eager way's micro-batches padded as an eager run pads them (the fixed-shape ways pad
                      # them again to their lengths)
                      "training.cuda_graphs=false"] + overrides)
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

    def fixed_shapes(recorder, compile_forward: bool = False, regions=None) -> Callable[[], torch.Tensor]:
        graphs = GraphedMicroBatches(model, loss_fn, rows=b, lengths=sizes,
                                     pad_token_id=run.tokenizer.pad_token_id or 0,
                                     precision=accelerator.mixed_precision, recorder=recorder,
                                     compiled=compile_forward)

        def way() -> torch.Tensor:
            total = torch.zeros((), device=device)
            # regions: the blocks compiled for this way's warm-ups, captures and eager reruns alone
            with regions() if regions is not None else contextlib.nullcontext():
                for batch in batches:
                    total += graphs.forward_backward(batch, batch["labels"].shape[0], scale)[0].float()
            return total

        way.graphs = graphs
        return way

    ways: dict[str, Callable[[], torch.Tensor]] = {"eager": eager, "static": fixed_shapes(rerun_eagerly)}
    if cuda:
        ways["graphed"] = fixed_shapes(record_cuda_graph)
    if compiled:
        ways["compiled"] = fixed_shapes(rerun_eagerly, compile_forward=True)
        if cuda:
            ways["compiled graphed"] = fixed_shapes(record_cuda_graph, compile_forward=True)
        ways["compiled layers"] = fixed_shapes(rerun_eagerly, regions=compiled_blocks(model))
        if cuda:
            ways["compiled layers graphed"] = fixed_shapes(record_cuda_graph, regions=compiled_blocks(model))
    if apart:  # the ways without a compile and with compiled blocks, the fastest (a whole compiled forward is not)
        for name in [name for name in ways if name in ("static", "graphed") or name.startswith("compiled layers")]:
            recorder = record_cuda_graph if name.endswith("graphed") else rerun_eagerly
            regions = bias_apart(model)
            if name.startswith("compiled layers"):
                regions = together(regions, compiled_blocks(model))
            ways[f"{name}, bias apart"] = fixed_shapes(recorder, regions=regions)
    times: dict[str, list[float]] = {name: [] for name in ways}
    gradients, losses, refused = {}, {}, {}
    for r in range(rounds + 1):  # round 0 warms every way up (and captures the graphs), untimed
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for name in order:
            if name in refused:
                continue
            model.zero_grad(set_to_none=False)  # in place: a captured backward adds into the gradients' memory
            sync()
            started = time.perf_counter()
            try:
                total = ways[name]()
            except RuntimeError as error:  # CUDA refused a capture: that way is reported so, the others measured
                refused[name] = refusal(error)
                continue
            sync()
            if r > 0:
                times[name].append(1e3 * (time.perf_counter() - started) / len(batches))
            gradients[name], losses[name] = _gradient(model), float(total) / samples
    reference = gradients["eager"]
    ways = {name: way for name, way in ways.items() if name not in refused}
    return {
        "device": torch.cuda.get_device_name() if cuda else "CPU", "precision": accelerator.mixed_precision,
        "overrides": overrides, "micro_batches": len(batches), "rows": b, "lengths": sizes, "rounds": rounds,
        "samples_per_micro_batch": samples / len(batches),
        "ms_per_micro_batch": {name: statistics.median(times[name]) for name in ways},
        "ms_runs": {name: times[name] for name in ways},
        "refused": refused,  # way: CUDA's reason for refusing its capture
        "gradient_relative_difference": {name: float((g - reference).norm() / reference.norm())
                                         for name, g in gradients.items()},
        "mean_loss": losses,
        # each fixed-shape way's set-up: its warm-ups, compiling and capturing, paid once per length
        "setups": {name: {"graphs": len(way.graphs.graphs), "seconds": way.graphs.capture_seconds,
                          "pool_bytes": way.graphs.record()["pool_bytes"]}
                   for name, way in ways.items() if hasattr(way, "graphs")},
    }


def break_even(result: dict[str, Any], way: str) -> float:
    """Micro-batches after which ``way``'s set-up (warm-up, compiling, capturing) has paid for itself against
    eager (``inf``: never). Each length is set up once, so a run of more micro-batches than this gains."""
    ms = result["ms_per_micro_batch"]
    saved = ms["eager"] - ms[way]
    return 1e3 * result["setups"][way]["seconds"] / saved if saved > 0 else float("inf")


def markdown(result: dict[str, Any]) -> str:
    base = result["ms_per_micro_batch"]["eager"]
    lines = [f"{result['device']}, {result['precision']}, BBC News job, {result['micro_batches']} micro-batches of "
             f"{result['rows']} rows (lengths {result['lengths']}), {result['rounds']} rounds"
             f"{' with ' + ' '.join(result['overrides']) if result['overrides'] else ''}:", "",
             "| way | ms per micro-batch (median) | samples/s | x eager | gradient's relative difference from eager "
             "| set-up s | pays after micro-batches | graphs' pool MiB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, ms in result["ms_per_micro_batch"].items():
        setup = result["setups"].get(name)
        pays = None if setup is None else break_even(result, name)
        pool = setup["pool_bytes"] if setup else None
        lines.append(f"| {name} | {ms:.2f} | {1e3 * result['samples_per_micro_batch'] / ms:.1f} | {base / ms:.2f} "
                     f"| {result['gradient_relative_difference'][name]:.2e} "
                     f"| {'' if setup is None else format(setup['seconds'], '.1f')} "
                     f"| {'' if pays is None else 'never' if pays == float('inf') else format(pays, '.0f')} "
                     f"| {'' if not pool else format(pool / 2**20, '.0f')} |")
    lines += ["", "Set-up: each length's warm-up, compiling and capture, once per run; \"pays after\" counts the "
              "micro-batches of this size after which a way is ahead of eager."]
    for name, why in result.get("refused", {}).items():  # results from before this have none
        lines += ["", f"{name}: no row, CUDA refused its capture ({why})."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compiled", action="store_true",
                        help="also the fixed-shape ways with the forward compiled (training.torch_compile)")
    parser.add_argument("--bias-apart", action="store_true",
                        help="also each fixed-shape way with the encoder's biases added apart from their products")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    result = measure(args.overrides, args.micro_batches, args.rounds, args.threads, args.compiled, args.bias_apart)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "cuda_graphs.json", result)
    print(markdown(result), end="")
    print(json.dumps({"gradient_relative_difference": result["gradient_relative_difference"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
