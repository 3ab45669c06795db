"""Would a captured update pay? The update made eagerly, as the loop makes it, against replayed from one CUDA graph.

::

    python -m bench.captured_update [--windows 10] [--rounds 5] [section.key=value ...]

The package replays each micro-batch's forward and backward from CUDA graphs
(``training.cuda_graphs``) and makes the update between windows eagerly: the
host launches the clipping, reads the window's totals and the gradient's norm
(its one wait per update), then launches AdamW's step and the zeroing, while
the GPU, which has finished the window, waits for those launches. Capturing
the update as well (clipping, the non-finite check, the step, the zeroing)
would leave the host one replay per update. This measures what that saves on
the GPU check's job before the package carries it.

Both ways train the same windows of ``k`` micro-batches (the config's ``k``;
the GPU check's job: b=64, k=4), replayed from the same
:class:`~finetune.cuda_graphs.GraphedMicroBatches`, with the run's own fused
AdamW:

- ``eager update``: the loop's steps (:func:`finetune.loop.clip_gradients`,
  the norm and the window's loss read on the host, ``optimizer.step()``,
  ``zero_grad`` in place);
- ``eager, skip on the device``: the same steps launched eagerly, but all of
  them before the host reads the norm and the loss: the non-finite check is
  made on the device, where the norm and the loss, not finite, set the
  ``found_inf`` flag that torch's fused AdamW reads (its grad scaler's way of
  skipping a step inside the kernel, the step count included). The GPU then
  runs the step without waiting for the host to launch it after its read;
- ``captured update``: those steps in one CUDA graph, the learning rates device
  tensors filled from the optimizer's before each replay, as a scheduler's
  changes would be. The host then reads the norm and the loss: the same one
  wait.

The second way says how much of the third's gain needs no capture.

Each round starts both ways from the same weights and a fresh AdamW state;
dropout is off (``model.dropout=0``), so that the ways' weights can be
compared after the round: the report gives their largest difference (0: the
same arithmetic), beside how far the eager update's own rounds land from each
other (a GPU's kernels may add in a different order from one run to the next,
and AdamW's first steps turn a gradient's sign into a whole step). It then checks the skip: a window whose gradient holds a NaN
must leave the weights and AdamW's state as they were. Without CUDA nothing is
captured (both the micro-batches and the captured update run eagerly: the
test suite checks the arithmetic and the skip that way).
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


def _flat_weights(tensors) -> torch.Tensor:
    """The weights (``model.parameters()``, or copies of them) as one float vector."""
    return torch.cat([t.detach().float().flatten() for t in tensors])


def _adamw_state(optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]


class CapturedUpdate:
    """Clipping, the non-finite check, fused AdamW's step and the zeroing of the gradients, as one step that
    is captured in a CUDA graph (or, with :func:`~finetune.cuda_graphs.rerun_eagerly`, launched eagerly each time,
    the skip still decided on the device).

    The learning rates stay Python numbers in ``optimizer.param_groups``, where a scheduler writes them; only
    while the step is captured do the groups hold device tensors, which each :meth:`__call__` fills from them.
    ``found_inf`` is the attribute torch's fused AdamW reads, as its grad scaler sets it.
    """

    def __init__(self, model, optimizer, accelerator, max_grad_norm: float, loss_total: torch.Tensor,
                 recorder) -> None:
        from finetune.cuda_graphs import side_stream
        from finetune.loop import clip_gradients

        self.inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds torch's AdamW
        if not self.inner.defaults.get("fused"):
            raise ValueError("the captured update needs torch's fused AdamW (optim.implementation: fused)")
        device = loss_total.device
        self.lrs = [torch.tensor(float(group["lr"]), device=device) for group in self.inner.param_groups]
        self.found_inf = torch.zeros((), device=device)
        self.norm = torch.zeros((), device=device)

        def step(force_skip: bool = False) -> torch.Tensor:
            norm = clip_gradients(model, accelerator, max_grad_norm)
            finite = torch.isfinite(norm) & torch.isfinite(loss_total)
            self.found_inf.copy_(finite.logical_not().to(self.found_inf.dtype))
            if force_skip:
                self.found_inf.fill_(1.0)
            self.inner.step()
            self.inner.zero_grad(set_to_none=False)  # in place: the micro-batches' graphs add into this memory
            self.norm.copy_(norm)
            return self.norm

        # a warm-up before the capture, as torch asks, whose step is skipped inside the kernel: it creates
        # AdamW's state where there is none and changes no weight
        started = time.perf_counter()
        with self._device_rates():
            with side_stream(device):
                step(force_skip=True)
            self.replay, _ = recorder(step, None)
        self.capture_seconds = time.perf_counter() - started

    @contextlib.contextmanager
    def _device_rates(self):
        """While inside: the groups hold the device tensors of the learning rates, capturable, and the optimizer
        the ``found_inf`` flag; on the way out, the Python numbers a scheduler writes, and no flag."""
        floats = [group["lr"] for group in self.inner.param_groups]
        capturable = [group.get("capturable", False) for group in self.inner.param_groups]
        for group, lr in zip(self.inner.param_groups, self.lrs):
            group["lr"], group["capturable"] = lr, True
        self.inner.found_inf = self.found_inf
        try:
            yield
        finally:
            del self.inner.found_inf  # an eager step must not read the flag
            for group, lr, was in zip(self.inner.param_groups, floats, capturable):
                group["lr"], group["capturable"] = lr, was

    def __call__(self) -> torch.Tensor:
        """Make the update with the optimizer's current learning rates; returns the norm before clipping, on
        the device."""
        for tensor, group in zip(self.lrs, self.inner.param_groups):
            tensor.fill_(float(group["lr"]))
        # a graph replays what it captured whatever the groups hold; a step run again (no CUDA) reads them
        with self._device_rates():
            return self.replay()


def measure(overrides: list[str], windows: int = 10, rounds: int = 5, threads: int = 2) -> dict[str, Any]:
    """Train ``windows`` windows each way, ``rounds`` times, ways alternating; then the skip check."""
    import os

    from finetune.assembly import setup_run
    from finetune.cuda_graphs import GraphedMicroBatches, record_cuda_graph, rerun_eagerly
    from finetune.dataloaders import BucketPadding
    from finetune.loop import clip_gradients

    os.environ["FINETUNE_CPU_THREADS"] = str(threads)
    cfg = job_config(ArmSpec("ours", "bbc", 8, 4), ["logging.progress_bar=false", "model.dropout=0",
                                                    "data.balance_micro_batches=false",
                                                    "training.cuda_graphs=false"] + overrides)
    run = setup_run(cfg)
    model, accelerator, optimizer, scheduler = run.model, run.accelerator, run.optimizer, run.scheduler
    schedule = scheduler.state_dict()  # warm-up from 0: each round's updates change the learning rate
    device, cuda = accelerator.device, accelerator.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    recorder = record_cuda_graph if cuda else rerun_eagerly
    b, k = cfg.training.per_device_train_batch_size, run.batching.gradient_accumulation_steps
    max_grad_norm = cfg.training.max_grad_norm or float("inf")
    graphs = GraphedMicroBatches(model, run.task.per_sample_loss, rows=b,
                                 lengths=BucketPadding(run.tokenizer, cfg.data.max_length).sizes,
                                 pad_token_id=run.tokenizer.pad_token_id or 0,
                                 precision=accelerator.mixed_precision, recorder=recorder)
    batches = []
    for batch in run.train_dataloader:
        batches.append({key: value.to(device) for key, value in batch.items()})
        if len(batches) == windows * k:
            break
    windows = len(batches) // k
    model.train()
    start = [p.detach().clone() for p in model.parameters()]
    loss_total = torch.zeros((), dtype=torch.float64, device=device)

    def window(w: int) -> None:
        window_batches = batches[w * k:(w + 1) * k]
        scale = 1.0 / sum(int(batch["labels"].shape[0]) for batch in window_batches)
        loss_total.zero_()
        for batch in window_batches:
            loss_total.add_(graphs.forward_backward(batch, batch["labels"].shape[0], scale)[0].double())

    def eager_update() -> None:
        norm = clip_gradients(model, accelerator, max_grad_norm)
        read = torch.stack([norm.double(), loss_total]).cpu()  # the loop's one wait per update
        if torch.isfinite(read).all():
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=False)

    def skipping_on_the_device(update: "CapturedUpdate") -> Callable[[], None]:
        def way() -> None:
            read = torch.stack([update().double(), loss_total]).cpu()  # the same one wait, after the step
            if torch.isfinite(read).all():
                scheduler.step()  # the next update's rates, filled from the groups

        return way

    def restart() -> None:
        """The round's start: the same weights, zero gradients, a fresh AdamW state and the schedule's start,
        for either way."""
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), start):
                p.copy_(p0)
        optimizer.zero_grad(set_to_none=False)
        for t in _adamw_state(getattr(optimizer, "optimizer", optimizer)):
            t.zero_()  # in place: the captured step holds this memory
        scheduler.load_state_dict(schedule)
        for group, lr in zip(getattr(optimizer, "optimizer", optimizer).param_groups, scheduler.get_last_lr()):
            group["lr"] = lr

    # the micro-batches' graphs and AdamW's state exist before the update is captured
    restart()
    window(0)
    eager_update()
    captured = CapturedUpdate(model, optimizer, accelerator, max_grad_norm, loss_total, recorder)
    ways: dict[str, Callable[[], None]] = {
        "eager update": eager_update,
        "eager, skip on the device": skipping_on_the_device(
            CapturedUpdate(model, optimizer, accelerator, max_grad_norm, loss_total, rerun_eagerly)),
        "captured update": skipping_on_the_device(captured)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    weights: dict[str, torch.Tensor] = {}
    first_eager: Optional[torch.Tensor] = None  # the eager update's weights after round 0
    floor = 0.0  # how far the eager update's own rounds land from each other: the GPU's run-to-run variation
    for r in range(rounds + 1):  # round 0 warms both up, untimed
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            restart()
            sync()
            started = time.perf_counter()
            for w in range(windows):
                window(w)
                ways[name]()
            sync()
            if r > 0:
                times[name].append(1e3 * (time.perf_counter() - started) / windows)
            weights[name] = _flat_weights(model.parameters())
            if name == "eager update":
                first_eager = weights[name] if first_eager is None else first_eager
                floor = max(floor, float((weights[name] - first_eager).abs().max()))
    return {
        "device": torch.cuda.get_device_name() if cuda else "CPU", "precision": accelerator.mixed_precision,
        "overrides": overrides, "b": b, "k": k, "windows": windows, "rounds": rounds,
        "ms_per_update": {name: statistics.median(times[name]) for name in ways},
        "ms_runs": times,
        "max_weight_difference": {name: float((weights[name] - weights["eager update"]).abs().max())
                                  for name in ways if name != "eager update"},
        "eager_rounds_difference": floor,
        "weights_moved": float((weights["eager update"] - _flat_weights(start)).abs().max()),
        "capture_seconds": captured.capture_seconds,
        "skip": skip_check(model, optimizer, window, ways["captured update"], sync),
    }


def skip_check(model, optimizer, window: Callable[[int], None], update: Callable[[], None], sync) -> dict[str, bool]:
    """A window whose gradient holds a NaN, then the captured update: the weights and AdamW's state (moments and
    step counts) must stay as they were, and the gradients must be zeroed for the next window."""
    inner = getattr(optimizer, "optimizer", optimizer)
    window(0)
    weights, state = _flat_weights(model.parameters()), [t.clone() for t in _adamw_state(inner)]
    first = next(p for p in model.parameters() if p.grad is not None)
    first.grad.view(-1)[0] = float("nan")
    update()
    sync()
    return {"weights_kept": bool(torch.equal(_flat_weights(model.parameters()), weights)),
            "state_kept": all(torch.equal(a, b) for a, b in zip(_adamw_state(inner), state)),
            "gradients_zeroed": all(bool((p.grad == 0).all()) for p in model.parameters() if p.grad is not None)}


def markdown(result: dict[str, Any]) -> str:
    eager = result["ms_per_update"]["eager update"]
    plural = lambda n, what: f"{n} {what}{'s' if n != 1 else ''}"  # noqa: E731
    lines = [f"{result['device']}, {result['precision']}, BBC News job, b={result['b']}, k={result['k']}, "
             f"{plural(result['windows'], 'update')} per round, {plural(result['rounds'], 'round')}"
             f"{' with ' + ' '.join(result['overrides']) if result['overrides'] else ''}; the micro-batches "
             f"replayed from CUDA graphs in every way{'' if result['device'] != 'CPU' else ' (on a CPU: run again)'}:",
             "", "| update | ms per update (median) | by round | x eager |", "| --- | ---: | --- | ---: |"]
    for name, ms in result["ms_per_update"].items():
        lines.append(f"| {name} | {ms:.2f} | {', '.join(f'{x:.2f}' for x in result['ms_runs'][name])} "
                     f"| {eager / ms:.3f} |")
    saved = {name: eager - ms for name, ms in result["ms_per_update"].items()}
    skip = result["skip"]
    differences = ", ".join(f"{name} {diff:.3g}" for name, diff in result["max_weight_difference"].items())
    lines += ["", f"Against the eager update, skipping on the device saves "
              f"{saved['eager, skip on the device']:.2f} ms of {eager:.2f} "
              f"({100 * saved['eager, skip on the device'] / eager:.1f}%), the captured update "
              f"{saved['captured update']:.2f} ms ({100 * saved['captured update'] / eager:.1f}%); its capture "
              f"took {result['capture_seconds']:.2f} s. Largest weight difference from the eager update after a "
              f"round: {differences}; the eager update's own rounds, from the same weights and micro-batches, "
              f"{result['eager_rounds_difference']:.3g} (the weights moved up to {result['weights_moved']:.3g}). "
              f"A NaN in the "
              f"gradient, captured: weights kept "
              f"{'yes' if skip['weights_kept'] else 'NO'}, AdamW's state kept {'yes' if skip['state_kept'] else 'NO'}, "
              f"gradients zeroed {'yes' if skip['gradients_zeroed'] else 'NO'}."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=10, help="updates per round and way")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    result = measure(args.overrides, args.windows, args.rounds, args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(RESULTS / "captured_update.json", result)
    print(markdown(result), end="")
    print(json.dumps({"max_weight_difference": result["max_weight_difference"],
                      "eager_rounds_difference": result["eager_rounds_difference"], "skip": result["skip"]}))
    return 0 if all(result["skip"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
