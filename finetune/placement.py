"""Where a run trains, as its start line says it (:mod:`finetune.start_line`), and the GPUs it leaves unused, each
said as a caution after that line: those beside the one it trains on, which a launch over them would use with the
same updates, and those torch cannot reach, which leave the run on the CPU (:mod:`finetune.gpu_reach`)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from finetune.cpu import heap_reason, plan_cpu_speedups, speedup_settings
from finetune.cuda_graphs import graphed_run
from finetune.gpu_reach import unreached_gpus
from finetune.launch import describe_cpu_threads, gpus_left_idle, train_command

if TYPE_CHECKING:
    from finetune.run import Run


def where(run: Run) -> str:
    """The start line's last part: where the run trains (processes, backend, device, threads), its memory plan,
    the speed-ups and levers in force, and how its micro-batches are cut and padded."""
    acc, training = run.accelerator, run.cfg.training
    backend = getattr(acc.state, "backend", None) or "none"
    threads = f" {describe_cpu_threads()}" if acc.device.type == "cpu" else ""
    settings = speedup_settings(training, run.memory)  # training.cpu_heap: auto decided by the memory plan
    speedups = plan_cpu_speedups(run.model, acc, quiet=True, **settings).describe(heap_reason(training.cpu_heap))
    cut = "balanced" if hasattr(run.train_dataloader.batch_sampler, "sizes") else "equal"
    memory = f" {run.memory.describe()}" if run.memory is not None else ""
    engine = f" engine={acc.distributed_type.value}" if acc.distributed_type.value in ("FSDP", "DEEPSPEED") else ""
    graphs = " cuda_graphs=on" if graphed_run(run) else ""
    # said: the first updates carry its compile
    compiled = f" torch_compile={str(training.torch_compile).lower()}" if training.torch_compile else ""
    apart = " bias_apart=on" if training.bias_apart else ""
    model = acc.unwrap_model(run.model)  # what set_forward and set_attention_kernel applied, on the model itself
    fusion = " gradient_accumulation_fusion=on" if getattr(model, "fused_weight_grads", 0) else ""
    asked = getattr(model, "attention_kernel", None)  # where the model's attention takes it
    kernel = f" attention_kernel={asked}" if asked else ""
    return (f"processes={acc.num_processes} backend={backend}{engine} device={acc.device}{threads}{memory}{graphs}"
            f"{compiled}{apart}{fusion}{kernel}"
            f"{' ' + speedups if speedups else ''} workers={run.train_dataloader.num_workers} micro-batches={cut}"
            f"{_padding(run)}")


def _padding(run: Run) -> str:
    said = run.padding.describe() if run.padding is not None else ""
    return f" {said}" if said else ""


def idle_gpus(run: Run) -> str | None:
    """The caution for a run that leaves GPUs of its machine idle, with the launch that trains on them and the
    settings that keep its updates: ``finetune train`` starts one process, where the Trainer spreads its batches
    over every GPU it sees, so a user who switches would otherwise train on one of them without a word."""
    acc, training = run.accelerator, run.cfg.training
    idle = gpus_left_idle(acc.device, acc.num_processes)
    if not idle:
        return None
    used, B, b = acc.num_processes, run.batching.effective_batch_size, run.batching.per_device_batch_size
    gpus = used + idle
    processes = max(p for p in range(1, gpus + 1) if B % p == 0)  # those that can share each update's samples
    shown = f"this machine shows {gpus} GPUs and the run trains on {used}"
    hide = ("CUDA_VISIBLE_DEVICES before the command shows a run only the GPUs it names "
            "(docs/scaling.md#one-machine-several-gpus)")
    if processes <= used:
        return (f"{shown}: its effective batch of {B} splits over no more processes; one that {gpus} divides "
                f"(training.effective_batch_size) splits over all of them; {hide}")
    launch = (f"`{shlex.join(train_command(processes))} ...` with the same arguments" if used == 1 else
              f"its launch with --num_processes {processes}")  # its own config file, FSDP's or DeepSpeed's
    if training.accumulation_schedule is not None:  # its k are each process's: the updates would grow
        return f"{shown}: {launch} trains on {processes}, each k of training.accumulation_schedule per process; {hide}"
    settings = []
    if training.effective_batch_size is None:  # k given: more processes would make each update larger
        settings.append(f"training.effective_batch_size={B}")
    if training.per_device_train_batch_size != "auto" and (B // processes) % b:  # auto chooses one that divides
        micro = max(d for d in range(1, b + 1) if (B // processes) % d == 0)
        settings.append(f"training.per_device_train_batch_size={micro}")
    return (f"{shown}: {launch}{' and ' if settings else ''}{' '.join(settings)} trains on {processes} with the "
            f"same updates; {hide}")


def gpus_out_of_reach(run: Run) -> str | None:
    """The caution for a run on the CPU of a machine whose NVIDIA driver drives GPUs
    (:func:`finetune.gpu_reach.unreached_gpus`)."""
    return unreached_gpus(run.accelerator.device, "the run trains", "trains")
