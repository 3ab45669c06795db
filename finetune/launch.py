"""Process and device setup: how many processes a launch started, threads, and the ``Accelerator``.

``accelerate launch --multi_gpu --num_processes P`` starts ``P`` processes through
torchrun, whatever the hardware. On a machine with a GPU, Accelerate joins them
over NCCL. On a machine without one, Accelerate only picks its CPU backend
(gloo) when the ``Accelerator`` is told ``cpu=True``; otherwise every process
quietly becomes a separate single-process run that never communicates: ``P``
copies of the same training, each on its own, each writing the same files.

:func:`init_process_state` detects that case (the launcher says ``P > 1``,
Accelerate's state says 1) and starts the state again on the CPU, so the same
command runs one real ``P``-process DDP job on a laptop, a CI runner or a GPU
node. The accumulation arithmetic does not change with ``P``: see
:mod:`finetune.accumulation`.

:func:`configure_cpu_threads` gives each process on a CPU its share of the
cores, and on any device holds the tokenizers' thread pool to the CPU quota.
Inference uses these too; the training run's ``Accelerator`` is built on them
by :func:`build_accelerator`, with the run's precision and compile settings
rather than those a launcher passes (which a warning names).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Optional

from finetune.errors import LaunchError
from finetune.machine import affinity_cores, available_cores, cpu_quota_note
from finetune.precisions import choose_precision

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("finetune")

# Environment variables through which launchers tell a process the world size:
# torchrun (what `accelerate launch` uses) and the MPI flavours Accelerate reads.
_WORLD_SIZE_VARS = ["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"]


def launched_world_size() -> int:
    """Processes the launcher started, over all machines (1 without a launcher).

    Raises:
        LaunchError: if the launcher's variable is not a whole number.
    """
    for name in _WORLD_SIZE_VARS:
        if os.environ.get(name):
            return _processes_in(name)
    return 1


def _processes_in(name: str) -> int:
    """The number of processes the launcher's variable ``name`` holds (at least 1).

    Raises:
        LaunchError: if it is not a whole number.
    """
    value = os.environ[name]
    try:
        return max(1, int(value))
    except ValueError:
        raise LaunchError(f"{name}: expected a whole number of processes, got {value!r}") from None


def several_processes_asked_for_one_started() -> bool:
    """Whether ``accelerate launch --num_processes N`` (N > 1) started this one process alone.

    Accelerate's launcher starts the script once, as a single process, when
    it is not told ``--multi_gpu`` (or a config file's equivalent) and finds
    no GPUs, whatever ``--num_processes`` says. That launcher still sets
    ``MASTER_ADDR`` and ``MASTER_PORT`` for more than one process, and it
    always sets ``ACCELERATE_MIXED_PRECISION``; a launcher that did start
    several processes also sets ``WORLD_SIZE`` (torchrun) or its MPI
    equivalent. The number asked for is not in the environment.
    """
    env = os.environ
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in env
    rendezvous = "MASTER_ADDR" in env and "MASTER_PORT" in env
    return launched_by_accelerate and rendezvous and not any(env.get(name) for name in _WORLD_SIZE_VARS)


@functools.cache  # once per process: a run asks for the process state twice (the batching, the Accelerator)
def _warn_one_process_started() -> None:
    logger.warning(
        "accelerate launch was asked for several processes but started one (without --multi_gpu it starts "
        "one process where it finds no GPUs): it runs as 1 process; for N processes on the CPU, "
        "accelerate launch --multi_gpu --num_processes N ..."
    )


def _requested_engine() -> str | None:
    """``FSDP`` or ``DeepSpeed`` when the launcher asked for one (its flags become these variables)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "FSDP"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "DeepSpeed"
    return None


def init_process_state():
    """Accelerate's process state, joined over gloo on the CPU when there is no GPU.

    Call it before building the ``Accelerator`` (then pass ``cpu=True`` to the
    ``Accelerator`` when the returned state's device is the CPU; see
    :func:`build_accelerator`).

    Returns:
        The ``accelerate.PartialState``, with ``num_processes`` equal to what the
        launcher started.

    Raises:
        LaunchError: if the processes still cannot be joined.
    """
    import torch
    from accelerate import PartialState

    world = launched_world_size()
    state = PartialState()
    if world > 1 and state.num_processes == 1:
        # Accelerate chose no backend (it found no GPU and was not told cpu=True),
        # so no process group exists yet and nothing is torn down by starting
        # over. Accelerate fixes the device choice in its shared state; building
        # that state again with cpu=True is the only way to change it.
        PartialState._reset_state()
        state = PartialState(cpu=True)
    if state.num_processes != world:
        raise LaunchError(
            f"the launcher started {world} processes but Accelerate joined {state.num_processes} "
            f"({state.distributed_type}); check accelerate launch's --num_processes and --num_machines"
        )
    if world == 1 and several_processes_asked_for_one_started():
        _warn_one_process_started()
    # said whichever way the processes were joined (older Accelerate releases join them on the CPU by themselves)
    if world > 1 and state.device.type == "cpu" and not torch.cuda.is_available() and state.is_main_process:
        logger.info(
            "no GPU found: running %d processes as one DDP job on the CPU over %s", world, state.backend
        )
    engine = _requested_engine()
    if engine == "DeepSpeed" and state.device.type == "cpu":
        # Accelerate's DeepSpeed state breaks on the CPU (an AttributeError deep in Accelerator's set-up)
        raise LaunchError("DeepSpeed needs GPUs; on the CPU launch without configs/accelerate/deepspeed_zero2.yaml "
                          "(one process, or --multi_gpu --num_processes N for DDP over gloo)")
    if engine and state.is_main_process and state.device.type == "cpu":
        # Accelerate supports FSDP on GPUs only; on the CPU it runs plain DDP.
        logger.warning("%s was requested but needs GPUs; Accelerate runs plain DDP on the CPU instead", engine)
    return state


def configure_cpu_threads(device: torch.device, num_processes: int) -> Optional[int]:
    """Give each process on a CPU its share of the cores; returns the thread count (None on GPU). On any device,
    first hold the tokenizers' thread pool to the CPU quota (:func:`hold_tokenizers_to_the_quota`).

    ``accelerate launch`` exports ``OMP_NUM_THREADS=1`` unless told otherwise, which
    leaves a CPU run on one core. The cores are those the process may use
    (:func:`~finetune.machine.available_cores`: its affinity, and its container's CPU quota).
    ``FINETUNE_CPU_THREADS`` pins the count instead.
    """
    cores = available_cores()
    hold_tokenizers_to_the_quota(cores)  # a GPU run tokenizes on the CPU too
    if device.type != "cpu":
        return None
    pinned = os.environ.get("FINETUNE_CPU_THREADS")
    if pinned:
        try:
            threads = int(pinned)
        except ValueError:
            threads = 0
        if threads < 1:
            raise LaunchError(f"FINETUNE_CPU_THREADS: expected a whole number of 1 or more, got {pinned!r}")
    else:
        threads = max(1, cores_per_process(num_processes, cores))
    import torch

    torch.set_num_threads(threads)
    return threads


def hold_tokenizers_to_the_quota(cores: int) -> None:
    """Size the tokenizers library's thread pool (Rust's rayon) by the ``cores`` the CPU quota allows
    (:func:`~finetune.machine.available_cores`), where the quota leaves fewer than the process sees and
    ``RAYON_NUM_THREADS`` is not set already.

    rayon starts a thread for every core the process sees, quota or not, so a container of 4 CPUs on a 64-core
    host would encode its batches with 64 threads, which spend the quota early in each of the scheduler's periods
    and wait out the rest together (``python -m bench.cpu_quota --tokenizing``). The pool is made at a
    tokenizer's first batch, so this has to come before that; once it is made, nothing changes its size.
    """
    if "RAYON_NUM_THREADS" not in os.environ and cores < affinity_cores():
        os.environ["RAYON_NUM_THREADS"] = str(cores)


def describe_cpu_threads() -> str:
    """This process's threads, for the start line: ``threads=4``, or ``threads=4 (4 of 64 cores: the CPU quota)``
    where the cores it may use are fewer than it sees."""
    import torch

    quota = cpu_quota_note()
    return f"threads={torch.get_num_threads()}" + (f" ({quota})" if quota else "")


def cores_per_process(num_processes: int, cores: Optional[int] = None) -> int:
    """This machine's share of CPU cores for each of its processes (``LOCAL_WORLD_SIZE`` of them, if set).

    Args:
        num_processes: Processes launched, when the launcher does not say how many run on this machine.
        cores: CPU cores available (default: :func:`~finetune.machine.available_cores`).
    """
    if cores is None:
        cores = available_cores()
    return cores // processes_on_this_machine(num_processes)


def processes_on_this_machine(num_processes: int) -> int:
    """The launched processes that share this machine's cores and RAM: ``LOCAL_WORLD_SIZE`` where the launcher
    sets it, else all ``num_processes``.

    Raises:
        LaunchError: if the launcher's variable is not a whole number.
    """
    return _processes_in("LOCAL_WORLD_SIZE") if os.environ.get("LOCAL_WORLD_SIZE") else max(1, num_processes)


def gpus_left_idle(device: torch.device, num_processes: int) -> int:
    """The GPUs this machine shows (``CUDA_VISIBLE_DEVICES``) that no process of a run on ``device`` trains on.

    0 off a GPU, and for a launch over several machines, whose share of each one its launch decides.
    """
    if device.type != "cuda" or processes_on_this_machine(num_processes) != num_processes:
        return 0
    import torch

    return max(0, torch.cuda.device_count() - num_processes)


def train_command(num_processes: int) -> list[str]:
    """The command that starts ``finetune train`` on ``num_processes`` processes of one machine."""
    if num_processes == 1:
        return ["finetune", "train"]
    return ["accelerate", "launch", "--multi_gpu", "--num_processes", str(num_processes), "-m", "finetune.cli",
            "train"]


def choose_workers(requested, device: torch.device, num_processes: int, cores: Optional[int] = None) -> int:
    """The DataLoader workers ``data.num_workers`` stands for on ``device``.

    ``auto`` is 0 on a CPU: collating a padded micro-batch is cheap next to its
    forward and backward pass there, and a worker would take a core from them.
    On a GPU the main process's collation and kernel launches are what the GPU
    waits for, so ``auto`` is up to 4 workers per process, one core per
    process left for training.

    Args:
        requested: ``auto`` or a number.
        device: Where training runs.
        num_processes: Processes on this machine share its cores.
        cores: CPU cores available (default: :func:`~finetune.machine.available_cores`); for tests.
    """
    if requested != "auto":
        return int(requested)
    if device.type != "cuda":
        return 0
    return max(0, min(4, cores_per_process(num_processes, cores) - 1))


def build_accelerator(cfg, project_dir: Optional[str] = None):
    """An ``Accelerator`` for a :class:`~finetune.config.Config` on the launched processes.

    ``k`` is not decided here: :func:`~finetune.assembly.setup_run` resolves
    the run's batching once and sets the accelerator's accumulation steps.

    Several processes on a machine without a GPU are joined over gloo on the
    CPU (see :func:`finetune.launch.init_process_state`).

    Raises:
        ConfigError: if a tracker in ``logging.report_to`` is unknown or its package is not installed.
        LaunchError: if the precision cannot run on this hardware (fp16 without a GPU),
            or the launched processes cannot be joined.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from finetune.tracking import check_trackers

    # Accelerate would drop a tracker whose package is missing without a word: fail before any work
    check_trackers(cfg.logging.report_to)
    state = init_process_state()
    precision, _ = choose_precision(cfg.training.mixed_precision, state.device)
    if precision == "fp16" and state.device.type == "cpu":
        raise LaunchError(
            "training.mixed_precision: fp16 needs a GPU; this process runs on the CPU (use bf16 or no)"
        )
    for ignored in (launcher_precision_ignored(precision, state.device),
                    launcher_compile_ignored(cfg.training.torch_compile)):
        if ignored is not None and state.is_main_process:
            logger.warning(ignored)
    configure_cpu_threads(state.device, state.num_processes)
    forget_an_earlier_precision(precision, state.num_processes)
    return Accelerator(
        # agree with the state: on a CPU state AcceleratorState would otherwise still pick DeepSpeed if asked
        cpu=state.device.type == "cpu",
        mixed_precision=precision,
        log_with=cfg.logging.report_to or None,
        project_dir=project_dir or cfg.output.output_dir,
        dataloader_config=DataLoaderConfiguration(non_blocking=copies_asynchronously(state.device)),
        kwargs_handlers=ddp_settings(),
        dynamo_backend="no",  # training.torch_compile compiles, with the padding that keeps it to a shape or two
    )


def launcher_precision_ignored(precision: str, device: torch.device,
                               env: Optional[dict[str, str]] = None) -> Optional[str]:
    """The warning for a precision the launcher asked for that the run does not train in, or None.

    ``accelerate config``, ``accelerate launch --mixed_precision`` and
    ``notebook_launcher(mixed_precision=)`` pass theirs as
    ``ACCELERATE_MIXED_PRECISION``; the run's precision is
    ``training.mixed_precision`` alone, so that the config file says how a run
    trained and a resume compares it. A launcher's ``no`` is its default, not
    a choice, and is not named.
    """
    asked = _launcher_choice("ACCELERATE_MIXED_PRECISION", env)
    if asked in ("no", precision):
        return None
    runs_here = asked == "bf16" or (asked == "fp16" and device.type == "cuda")
    how = f"; training.mixed_precision={asked} trains in it" if runs_here else ""
    return (f"the launcher's mixed precision {asked} (accelerate config or --mixed_precision) is not used: "
            f"training.mixed_precision decides, {precision} here{how}")


def launcher_compile_ignored(torch_compile: bool | str, env: Optional[dict[str, str]] = None) -> Optional[str]:
    """The warning for a ``torch.compile`` the launcher asked for, which the run does not make, or None.

    ``accelerate config`` and ``accelerate launch --dynamo_backend`` pass theirs as
    ``ACCELERATE_DYNAMO_BACKEND``, and an ``Accelerator`` left to read it compiles
    the whole model in ``prepare``: at every new micro-batch length again, which
    made a short run of the default job about nine times as long.
    ``training.torch_compile`` compiles instead, padding micro-batches to a few lengths.
    """
    asked = _launcher_choice("ACCELERATE_DYNAMO_BACKEND", env)
    if asked == "no":
        return None
    ours = {False: "off", True: "the whole forward", "blocks": "each encoder block"}[torch_compile]
    how = "" if torch_compile else "; training.torch_compile=blocks compiles each encoder block"
    return (f"the launcher's dynamo backend {asked} (accelerate config or --dynamo_backend) is not used: "
            f"training.torch_compile decides, {ours} here{how}")


def _launcher_choice(variable: str, env: Optional[dict[str, str]]) -> str:
    """What Accelerate's launcher passed in ``variable`` (``env``, default this process's), in lower case as
    Accelerate compares it; ``no`` where it passed nothing."""
    return (os.environ if env is None else env).get(variable, "no").lower()


def ddp_settings() -> list:
    """The Accelerate handlers for DDP on several processes: gradients as views into its all-reduce buckets.

    Without, DDP holds every gradient twice, the parameter's own and its bucket's copy. As views they are
    zeroed in place after each update (:func:`finetune.loop.frees_gradients`), so the buckets are the only
    copy from the first update on.
    """
    from accelerate.utils import DistributedDataParallelKwargs

    return [DistributedDataParallelKwargs(gradient_as_bucket_view=True)]


def copies_asynchronously(device: torch.device) -> bool:
    """Whether batches are copied to ``device`` without waiting: on a CUDA GPU.

    A blocking copy of a micro-batch to a GPU waits for every kernel queued before it, so the host could not
    launch one micro-batch's kernels while the GPU runs the last one's. The loaders pin their batches on a
    CUDA GPU, where an asynchronous copy is then ordered on the stream like a kernel. Elsewhere nothing is
    gained (a CPU copies nothing) or the loaders do not pin.
    """
    return device.type == "cuda"


def forget_an_earlier_precision(precision: str, num_processes: int) -> None:
    """Let a run take another precision than an earlier run in the same process (a notebook cell run again
    with other settings, a sweep's next trial).

    Accelerate fixes a process's precision at its first ``Accelerator`` and refuses another one afterwards
    ("restart your runtime"). In a single process nothing an earlier run left depends on that setting, so
    it is forgotten, as transformers' ``TrainingArguments`` forgets it for each new Trainer; the device and
    any process group (Accelerate's ``PartialState``) stay. Accelerate has no public way to do this: its
    private one is looked up, and where it is gone the run says in one line to start a new process.

    Raises:
        LaunchError: if the precision cannot be changed in this process (several processes, or Accelerate
            without the reset).
    """
    from accelerate.state import AcceleratorState

    earlier = (getattr(AcceleratorState, "_shared_state", None) or {}).get("_mixed_precision")
    if earlier is None or earlier == precision:
        return
    reset = getattr(AcceleratorState, "_reset_state", None)
    if num_processes > 1 or reset is None:
        raise LaunchError(f"training.mixed_precision: {precision}, but this process already trained in {earlier}, "
                          f"and Accelerate keeps a process's first precision; start a new process (or kernel)")
    logger.debug("Accelerate's precision %s of an earlier run in this process replaced by %s", earlier, precision)
    reset()


def autocast(accelerator):
    """The run's autocast (Accelerate's, as ``accelerator.autocast()`` gives it), as a context that also ends when
    its block raises.

    Before Accelerate 1.11, ``accelerator.autocast()`` leaves autocast on for the rest of the process when its
    block raises. The block that raises on purpose is a trial of a micro-batch that runs out of memory; after it,
    autocast's outermost level never closes, so its cache of low-precision weight copies is never emptied, and
    every later forward pass (the run's, the next run's in a notebook) computes with the weights as they were
    cast at the first one: training goes on without its updates reaching the forward pass. Accelerate's own
    context manager, entered here by ``with``, exits on a raise on every release.
    """
    import contextlib

    from accelerate.utils import get_mixed_precision_context_manager

    if not accelerator.native_amp:  # fp32, or an engine that casts by itself (DeepSpeed): no autocast
        return contextlib.nullcontext()
    return get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
