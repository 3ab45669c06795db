"""One training run of the loop, recorded update by update; run under any process count.

``tests/test_scaling.py`` runs it in-process for ``P = 1`` and through
``accelerate launch --multi_gpu --num_processes 2`` (on a machine without a
GPU) for ``P = 2``, then compares what the two recorded. Not a test module
itself (pytest does not collect it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import chunk_collate, chunked_texts, pad_collate, tiny_bert, token_dataset  # noqa: E402

# 34 training samples with b=4 and P=2: 9 global micro-batches, so process 1's
# last micro-batch is all repeats and process 0's holds 2 real samples; with
# k=2 the windows hold 16, 16 and 2 real samples (a ragged last window).
N_TRAIN = 34
# 23 evaluation samples with batches of 4 on 2 processes: the last batches are padded with repeats.
N_EVAL = 23
EVAL_BATCH = 4


def record_run(b: int, k: int, epochs: int = 2, lr: float = 1e-3, warmup: int = 1, max_grad_norm=0.05,
               cpu: bool = False, schedule: dict | None = None, chunks: bool = False,
               mixed_precision: str = "no", cast_once_per_update: bool = True, fsdp2: bool = False) -> dict:
    """Train the tiny BERT for ``epochs`` with ``(b, k, P)`` and record every update.

    ``P`` is whatever the launcher started; the processes are joined by
    :func:`finetune.launch.init_process_state`, as ``train.py`` joins them
    (``cpu=True`` skips it and runs one process on the CPU, for in-process use).
    Returns the records of this process:
    weights after each update (rank 0 keeps them), learning rates, log records,
    scheduler calls, the micro-batches during whose backward DDP communicated,
    evaluation results, and the process setup. ``schedule`` (``{first epoch: k}``)
    replaces ``k`` with an accumulation schedule. ``chunks``: texts of 1 to 5
    windows each (``data.truncation: chunks``) instead of single rows.
    ``mixed_precision`` and ``cast_once_per_update`` as the Accelerator's and
    ``train_one_epoch``'s. ``fsdp2``: the model sharded by torch's ``fully_shard`` (each block, then the whole)
    instead of wrapped in DDP: Accelerate runs its FSDP on GPUs only, so this is how the loop meets FSDP2's
    sharded parameters, gradients and gradient norm on the CPU.
    """
    from accelerate import Accelerator

    from finetune.config import OptimConfig
    from finetune.evaluation import evaluate_model
    from finetune.loop import TrainState, train_one_epoch
    from finetune.metrics import MetricSuite
    from finetune.optimization import build_optimizer, build_scheduler, plan_updates
    from finetune.sampling import EpochSampler
    from finetune.launch import ddp_settings, init_process_state

    if not cpu:
        cpu = init_process_state().device.type == "cpu"
    from finetune.accumulation import AccumulationSchedule

    ks = AccumulationSchedule.from_dict(schedule) if schedule else AccumulationSchedule.constant(k)
    acc = Accelerator(cpu=cpu, gradient_accumulation_steps=ks.k_at(0), mixed_precision=mixed_precision,
                      kwargs_handlers=ddp_settings())
    P = acc.num_processes
    data = chunked_texts(N_TRAIN, seed=1) if chunks else token_dataset(N_TRAIN, seed=1)
    evaluated = chunked_texts(N_EVAL, seed=2) if chunks else token_dataset(N_EVAL, seed=2)
    collate = chunk_collate if chunks else pad_collate
    model = tiny_bert(seed=0)
    if fsdp2:
        from torch.distributed.fsdp import fully_shard

        for block in model.bert.encoder.layer:
            fully_shard(block)
        fully_shard(model)
    opt_cfg = OptimConfig(learning_rate=lr, lr_scheduler_type="linear", warmup_steps=warmup, weight_decay=0.01)
    optimizer = build_optimizer(model, opt_cfg)
    sampler = EpochSampler(len(data), seed=7, window_size={epoch: b * kk * P for epoch, kk in ks.changes})
    train_dl = DataLoader(data, batch_size=b, sampler=sampler, collate_fn=collate)
    eval_dl = DataLoader(evaluated, batch_size=EVAL_BATCH, collate_fn=collate)
    if fsdp2:  # sharded already: prepared, it would be wrapped in DDP as well
        optimizer, train_dl, eval_dl = acc.prepare(optimizer, train_dl, eval_dl)
    else:
        model, optimizer, train_dl, eval_dl = acc.prepare(model, optimizer, train_dl, eval_dl)
    plan = plan_updates(len(train_dl), ks, epochs, None, warmup_steps=warmup)
    scheduler = build_scheduler(optimizer, opt_cfg, plan)

    calls = {"scheduler": 0, "forward": 0}
    step = scheduler.step

    def counting_step(*a, **kw):
        calls["scheduler"] += 1
        return step(*a, **kw)

    scheduler.step = counting_step
    forward = model.forward

    def counting_forward(*a, **kw):
        calls["forward"] += 1
        return forward(*a, **kw)

    model.forward = counting_forward
    # The micro-batch (counted from 1 over the run) in whose backward DDP all-reduced a bucket.
    comm_at: list[int] = []
    if hasattr(model, "register_comm_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_allreduce(process_group, bucket):
            comm_at.append(calls["forward"])
            return allreduce_hook(process_group, bucket)

        model.register_comm_hook(None, counting_allreduce)

    snapshots, lrs = [], []

    def on_update(train_state):
        # a sharded parameter's whole value is gathered from every process, so every process asks for it
        weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for n, p in acc.unwrap_model(model).named_parameters()}
        if acc.is_main_process:
            snapshots.append(weights)
        return False

    records: list[dict] = []
    train_state = TrainState()
    for epoch in range(epochs):
        acc.gradient_accumulation_steps = plan.k_at(epoch)
        train_one_epoch(model, optimizer, scheduler, train_dl, acc, epoch, state=train_state,
                        max_grad_norm=max_grad_norm, on_log=records.append, on_update=on_update, plan=plan,
                        cast_once_per_update=cast_once_per_update)
    lrs = [r["train/lr"] for r in records]
    # the ranking metrics gather each text's probabilities beside its answer
    metrics = MetricSuite(["accuracy", "f1", "roc_auc", "average_precision"], 2, "binary", pos_label=1)
    evaluation = evaluate_model(model, eval_dl, acc, metrics)
    gradients = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in model.parameters() if p.grad is not None]
    return {
        "num_processes": P,
        # after the last update: the gradients kept, and the distinct memory they live in
        "gradients": len(gradients),
        "gradient_storages": len({g.untyped_storage().data_ptr() for g in gradients}),
        "trained_parameters": sum(p.requires_grad for p in model.parameters()),
        "backend": acc.state.backend,
        "distributed_type": str(acc.distributed_type),
        "process_index": acc.process_index,
        "forwards": calls["forward"],
        "comm_at": comm_at,
        "scheduler_calls": calls["scheduler"],
        "final_lr": optimizer.param_groups[0]["lr"],
        "plan": [plan.updates_per_epoch, plan.total_updates],
        "lrs": lrs,
        "records": records,
        "eval": evaluation,
        "snapshots": snapshots,
        "steps": train_state.step,
    }


# what tests/test_scaling.py runs on two processes, by name: (b, k) and the run's other settings
SCENARIOS = {
    "plain": dict(b=4, k=2),
    "schedule": dict(b=4, k=2, schedule={0: 2, 1: 1}),
    "chunks": dict(b=4, k=2, chunks=True),
    # trained twice in bf16: weight casts in every micro-batch (snapshots_every.pt), then once per update
    "casts": dict(b=4, k=2, mixed_precision="bf16"),
    "fsdp2": dict(b=4, k=2, fsdp2=True),
    # tests/test_noise_scale.py's linear model at a learning rate of 0: the gradient noise scale after 1,024 updates
    "noise": dict(b=4, k=2),
}


def record_noise_scale(b: int, k: int) -> dict:
    """The noise scale the loop measured on the launched processes, each window's first micro-batches one per
    process (``b`` each of ``b * k * P``), averaged over nearly all of 8 epochs' updates (as in the one-process test)."""
    import finetune.noise_scale
    from finetune.launch import init_process_state
    from test_noise_scale import train

    state = init_process_state()
    finetune.noise_scale.DECAY = 0.999
    _, records, train_state = train(k=k, epochs=8, lr=0.0, noise=True, b=b)
    return {"process_index": state.process_index, "processes": state.num_processes, "updates": len(records),
            "noise_scale": train_state.noise_scale(), "snapshots": []}


def run_scenario(name: str, out: Path) -> None:
    """One of :data:`SCENARIOS` into ``out``: each rank's record (``rank<r>.json``), rank 0's weights after every
    update (``snapshots.pt``)."""
    out.mkdir(parents=True, exist_ok=True)
    settings = SCENARIOS[name]
    if name == "casts":
        every = record_run(**settings, cast_once_per_update=False)
        if every["process_index"] == 0:
            torch.save(every["snapshots"], out / "snapshots_every.pt")
    result = record_noise_scale(**settings) if name == "noise" else record_run(**settings)
    snapshots = result.pop("snapshots")
    (out / f"rank{result['process_index']}.json").write_text(json.dumps(result), encoding="utf-8")
    if result["process_index"] == 0:
        torch.save(snapshots, out / "snapshots.pt")


def main() -> None:
    """``scaling_worker.py --out DIR NAME ...``: the scenarios named, one after another, each into ``DIR/NAME``.

    One launch runs them all: starting two processes costs more than any of their runs.
    """
    from accelerate.state import AcceleratorState, GradientState

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    for name in args.scenarios:
        run_scenario(name, Path(args.out) / name)
        # the next scenario's Accelerator is made afresh (its precision may differ); the process group stays
        AcceleratorState._reset_state()
        GradientState._reset_state()


if __name__ == "__main__":
    main()
