"""The memory plan: what a run's peak memory is made of, said before training, and checked against the device.

Training holds, at its peak (the backward pass of a window's micro-batch)::

    weights        every parameter and buffer (frozen ones too)
    gradients      one per trained weight (on several processes, views into DDP's all-reduce buckets)
    optimizer      AdamW's two moments per trained weight (float32, or 8-bit: finetune.optimizer_state)
    activations    what the forward pass saved for the backward, for b rows at the longest length,
                   plus the working set of one layer's backward

The first three follow from the parameters. The activations depend on the
architecture, the attention kernel, autocast and checkpointing, so they are
measured rather than derived from a formula: one forward pass each at ``b = 1``
and ``b = 2`` on the longest training rows, counting the bytes autograd saves
(``torch.autograd.graph.saved_tensors_hooks``), per encoder block and outside
them. What ``b = 2`` saves beyond ``b = 1`` is the per-row cost; what is left
at ``b = 1`` is fixed (autocast's cast copies of the weights). From that the
plan predicts any ``b``, with checkpointing (each block keeps only its input;
one block is recomputed at a time) and without.

Hand-written: accelerate's ``estimate-memory`` counts parameters and AdamW
state only, and transformers and PEFT have no activation estimate.

With a micro-batch set in the config, a plan larger than the device's memory
(a GPU's free memory, a CPU's available RAM, or its container's memory limit) stops the run before training
with one line that names the settings that would fit. On a GPU the automatic
micro-batch trusts its own trial steps instead; on a CPU, where a trial past the
memory is killed rather than caught, it tries only what the plan says fits
(``finetune.autobatch``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

import torch

from finetune.chunks import split_batch
from finetune.errors import ConfigError, is_out_of_memory
from finetune.launch import autocast
from finetune.lora import blocks_of, head_modules, is_lora
from finetune.machine import memory_free, memory_limit_headroom, ram_available
from finetune.optimizer_state import optimizer_state_bytes, state_name

GB = 1e9


@dataclass(frozen=True)
class Activations:
    """Bytes the forward pass saves for the backward, measured per training row at the longest length."""

    fixed: int  # saved whatever b (autocast's cast copies of the weights)
    per_row_block: int  # in one encoder block that keeps activations
    per_row_block_input: int  # a block's input: what checkpointing keeps of a block
    per_row_other: int  # outside the blocks (embeddings, head, loss)
    blocks: int  # block calls that keep activations: not frozen blocks below the first trained one
    length: int  # the length measured at

    def estimate(self, b: int, checkpointing: bool, length: Optional[int] = None) -> int:
        """Saved activations plus one block's backward working set, for ``b`` rows of ``length`` tokens.

        Another length scales the per-row bytes in proportion, which over-states a shorter length's
        (attention's share falls with the square of it): a plan for a shorter ``max_length`` errs high.
        """
        kept = self.per_row_block_input * self.blocks + self.per_row_block if checkpointing \
            else self.per_row_block * self.blocks
        per_row = self.per_row_other + kept + self.per_row_block  # + the block whose backward is running
        scale = (length or self.length) / self.length
        return self.fixed + round(b * per_row * scale)


@dataclass(frozen=True)
class MemoryPlan:
    """The expected peak of a run, in bytes, by what takes it, and what the device has."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    micro_batch: int
    length: int
    checkpointing: bool
    device: str
    available: Optional[int]  # free GPU memory or available RAM, beside what the run already holds
    resident: int = 0  # of the total, what is already allocated on the device (the loaded weights)
    optimizer_name: str = "adamw"  # optim.optimizer
    windows: Optional[int] = None  # data.truncation: chunks: the rows the longest micro-batch's b texts make
    limited: bool = False  # on a CPU, the process's memory limit (a container's) left less than the RAM available
    processes: int = 1  # on a CPU, the processes on this machine, whose plans share what is available

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.available is None or self.total - self.resident <= self.available

    def describe(self) -> str:
        """The start line's words: ``memory=1.9GB (weights 0.4 + gradients 0.4 + adamw 0.9 + ...)`` (``adamw8bit``
        under the 8-bit AdamW)."""
        have = (f" of {(self.available + self.resident) / GB:.1f}GB "
                f"{'available' if self.device == 'cpu' else 'free'}" if self.available is not None else "")
        have += " under the memory limit" if self.limited and have else ""
        have += f" to each of {self.processes} processes" if self.processes > 1 and have else ""
        rows = f"b={self.micro_batch}" + (f" texts in {self.windows} windows" if self.windows is not None else "")
        return (f"memory={self.total / GB:.2f}GB (weights {self.weights / GB:.2f} + gradients "
                f"{self.gradients / GB:.2f} + {state_name(self.optimizer_name)} {self.optimizer / GB:.2f} + "
                f"activations {self.activations / GB:.2f} at {rows} x {self.length} tokens){have}")

    def record(self) -> dict[str, Any]:
        """``metrics.json``'s ``memory_plan``: every part in bytes."""
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "optimizer_name": self.optimizer_name, "windows": self.windows,
                "activations": self.activations, "total": self.total, "micro_batch": self.micro_batch,
                "length": self.length, "gradient_checkpointing": self.checkpointing, "device": self.device,
                "available": None if self.available is None else self.available + self.resident,
                "available_under_memory_limit": self.limited, "processes_sharing_it": self.processes}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def _counting_saved_tensors(model) -> Iterator[dict]:
    """Inside, every tensor autograd saves is counted once (by storage); yields ``{"saved": bytes}``.

    The parameters themselves, which autograd saves too, are not activations and not counted.
    """
    counts = {"saved": 0}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: set[int] = set()

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in weights and key not in seen:
            seen.add(key)
            counts["saved"] += storage.nbytes()
        # Detached: an op that saves its own output (tanh, softmax) would otherwise hold, in its graph node, a
        # tensor whose grad_fn is that node, a cycle through autograd's C++ that Python's collector cannot see.
        # The probe's graph would live for the whole run, with its activations and the parameters' gradient
        # accumulators, which a CUDA graph's capture refuses (they belong to another stream).
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counts


@contextlib.contextmanager
def _watching_blocks(blocks) -> Iterator[dict]:
    """Inside, the calls of blocks that keep activations are counted with their inputs' bytes, and the first
    of them kept with its block.

    A block keeps activations where a gradient flows through it: it trains, or its input needs a gradient.
    Frozen blocks below the first trained one (``model.freeze_blocks``) keep none and are not counted.
    Yields ``{"calls": n, "input": bytes, "first": (block, args, kwargs) or None}``.
    """
    seen = {"calls": 0, "input": 0, "first": None}

    def enter(module, args, kwargs):
        hidden = args[0] if args and torch.is_tensor(args[0]) else kwargs.get("hidden_states")
        if not (any(p.requires_grad for p in module.parameters())
                or (torch.is_tensor(hidden) and hidden.requires_grad)):
            return
        seen["calls"] += 1  # ALBERT calls its one shared block once per layer
        seen["input"] += tensor_bytes(a for a in args[:1] if torch.is_tensor(a))
        if seen["first"] is None:
            seen["first"] = (module, args, kwargs)

    handles = [block.register_forward_pre_hook(enter, with_kwargs=True) for block in blocks]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _one_pass(model, blocks, inputs, accelerator, can_recompute: bool) -> dict:
    """What one training forward pass saves outside the blocks and in one block, and what the blocks take in.

    With checkpointing on, the blocks save nothing during the pass (each keeps
    its input), so the pass costs little memory and what it saves is the part
    outside the blocks; the first block's call is then run again alone,
    without checkpointing, to count what a block saves. A model that cannot
    recompute is counted whole, its blocks' share being the whole less nothing:
    its estimate errs high by what lies outside the blocks.
    """
    from finetune.modeling import set_gradient_checkpointing

    set_gradient_checkpointing(model, can_recompute)
    with _watching_blocks(blocks) as seen, _counting_saved_tensors(model) as whole, autocast(accelerator):
        model(**inputs)
    calls = seen["calls"]
    if not can_recompute:
        return {"other": 0, "block": whole["saved"] / max(1, calls), "input": seen["input"], "calls": calls}
    if seen["first"] is None:  # every block frozen: the head alone trains
        return {"other": whole["saved"], "block": 0, "input": 0, "calls": 0}
    set_gradient_checkpointing(model, False)
    block, args, kwargs = seen["first"]
    with _counting_saved_tensors(model) as saved, autocast(accelerator):
        block(*args, **kwargs)
    return {"other": whole["saved"], "block": saved["saved"], "input": seen["input"], "calls": calls}


def measure_activations(model, make_batch, accelerator) -> Optional[Activations]:
    """Probe ``model`` with forward passes of 1 and 2 of the longest rows (see the module's docstring).

    Runs as training does (train mode, autocast), with checkpointing on where
    the model supports it, so that the probe holds little memory whatever the
    run uses; the random-number generators are restored and no gradient is
    left behind. ``None`` when even one row runs out of memory.

    Args:
        model: The unprepared model, on ``accelerator.device``.
        make_batch: ``b -> the collated worst-case micro-batch of b rows``.
        accelerator: The run's ``Accelerator``.
    """
    from finetune.modeling import is_checkpointing, set_gradient_checkpointing, supports_checkpointing

    blocks = blocks_of(model)
    recomputing, was_training = is_checkpointing(model), model.training
    can_recompute = supports_checkpointing(model)
    model.train()
    counts = []
    try:
        with rng_fork(accelerator.device):
            for b in (1, 2):
                inputs = {k: v.to(accelerator.device) for k, v in split_batch(make_batch(b))[0].items()}
                length = inputs["input_ids"].shape[1]
                try:
                    counts.append((_one_pass(model, blocks, inputs, accelerator, can_recompute), length))
                except Exception as exc:  # noqa: BLE001 - only running out of memory ends the probe early
                    if not is_out_of_memory(exc):
                        refuse_a_precision_the_model_fails_in(model, inputs, accelerator, exc)
                        raise
                    break
                finally:
                    del inputs
    finally:
        set_gradient_checkpointing(model, recomputing)
        model.train(was_training)
        free_cached(accelerator.device)
    if not counts:
        return None
    one, length = counts[0]
    # without a second probe (it ran out of memory), all of b=1's bytes count per row: an estimate that errs high
    two = counts[1][0] if len(counts) > 1 else {key: 2 * value for key, value in one.items()}
    calls = one["calls"]
    per_row = {key: max(0, two[key] - one[key]) for key in ("block", "input", "other")}
    fixed = max(0, round(one["other"] + calls * one["block"] - per_row["other"] - calls * per_row["block"]))
    return Activations(fixed=fixed, per_row_block=round(per_row["block"]),
                       per_row_block_input=round(per_row["input"] / max(1, calls)),
                       per_row_other=round(per_row["other"]),
                       blocks=calls, length=length)


def refuse_a_precision_the_model_fails_in(model, inputs: dict[str, torch.Tensor], accelerator, error: Exception):
    """Where a probe's forward failed under autocast with an error other than running out of memory, try it again
    in float32: if that runs, the model (its transformers code) cannot compute in the run's precision, which one
    line says, with the setting that trains it. Where it fails in float32 too, or the run has no autocast, nothing
    is said here and the error stands, traceback and all.

    Raises:
        ConfigError: ``training.mixed_precision``, naming the model type and the error's first line.
    """
    precision = accelerator.mixed_precision
    if precision not in ("bf16", "fp16") or not accelerator.native_amp:
        return
    model.zero_grad(set_to_none=True)
    try:
        with rng_fork(accelerator.device):
            model(**{k: v.to(accelerator.device) for k, v in inputs.items()}).logits.float().sum().backward()
    except Exception:  # noqa: BLE001 - it fails in float32 too: the first error is the one to show
        return
    finally:
        model.zero_grad(set_to_none=True)
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    raise ConfigError(f"training.mixed_precision: {precision}: {model_type}'s forward fails under {precision} autocast "
                      f"({type(error).__name__}: {first}) and runs in float32", hint="training.mixed_precision=no")


def free_cached(device: torch.device) -> None:
    """What a probe or a trial step left behind goes back (and the device's cache), before training allocates.

    On the CPU the freed activations stay in glibc's heap (a probe runs before
    ``cpu_heap: release`` maps large blocks on their own), and training's large
    blocks do not reuse that space: trimming hands it back, or it stays in the
    process's resident size for the whole run.
    """
    import gc

    gc.collect()
    if device.type == "cpu":
        from finetune.cpu import release_free_heap

        release_free_heap()
    else:
        from accelerate.utils.memory import clear_device_cache

        clear_device_cache()


def rng_fork(device: torch.device):
    """Inside, the random-number generators of ``device`` (and the CPU's) draw; on exit they are as before."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    index = device.index if device.index is not None else 0
    return torch.random.fork_rng(devices=[index], device_type=device.type)


def available_memory(device: torch.device) -> Optional[int]:
    """Free memory on a GPU; on a CPU the RAM available (Linux's ``MemAvailable``), or less where the process's
    cgroup (a container's memory limit) leaves less; ``None`` where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    return memory_free()


def memory_limit_binds() -> bool:
    """Whether this process's cgroup (a container's memory limit) leaves it less than the machine's RAM does."""
    headroom, ram = memory_limit_headroom(), ram_available()
    return headroom is not None and (ram is None or headroom < ram)


def plan_memory(model, activations: Activations, b: int, checkpointing: bool, device: torch.device,
                optimizer: str = "adamw", windows: Optional[int] = None, processes: int = 1) -> MemoryPlan:
    """The :class:`MemoryPlan` of training ``model`` at micro-batch ``b`` on ``device`` with ``optimizer``
    (``optim.optimizer``); ``windows``: the rows the longest micro-batch's texts make under chunks.

    On a CPU the ``processes`` on this machine (:func:`~finetune.launch.processes_on_this_machine`) each make the
    same plan, and each is held to its share of the RAM available: what each will add must fit beside the others'.
    A GPU is each process's own."""
    processes = processes if device.type == "cpu" else 1
    available = available_memory(device)
    weights = tensor_bytes(model.parameters()) + tensor_bytes(model.buffers())
    trained = [p for p in model.parameters() if p.requires_grad]
    on_device = next(model.parameters()).device
    resident = weights if on_device.type == device.type else 0
    return MemoryPlan(weights=weights, gradients=tensor_bytes(trained),
                      optimizer=optimizer_state_bytes(trained, optimizer),
                      activations=activations.estimate(b, checkpointing), micro_batch=b,
                      length=activations.length, checkpointing=checkpointing, device=device.type,
                      available=None if available is None else available // processes, resident=resident,
                      optimizer_name=optimizer, windows=windows, processes=processes,
                      limited=device.type == "cpu" and memory_limit_binds())


def levers_that_fit(plan: MemoryPlan, model, activations: Activations, batching, max_length: int) -> list[str]:
    """The settings that alone would make ``plan`` fit, as ``key=value`` overrides, in the order to try them."""
    from finetune.modeling import supports_checkpointing

    found = []
    for b in _smaller_micro_batches(batching):
        if replace(plan, micro_batch=b, activations=activations.estimate(b, plan.checkpointing)).fits:
            k = batching.effective_batch_size // (b * batching.num_processes)
            found.append(f"training.per_device_train_batch_size={b} (k={k})")
            break
    if supports_checkpointing(model) and not plan.checkpointing and replace(
            plan, checkpointing=True, activations=activations.estimate(plan.micro_batch, True)).fits:
        found.append("training.gradient_checkpointing=true")
    trained = [p for p in model.parameters() if p.requires_grad]
    if plan.optimizer_name == "adamw" and replace(
            plan, optimizer=optimizer_state_bytes(trained, "adamw_8bit"), optimizer_name="adamw_8bit").fits:
        found.append("optim.optimizer=adamw_8bit")
    embeddings = _trained_embeddings(model)
    if embeddings and replace(plan, gradients=plan.gradients - tensor_bytes(embeddings),
                              optimizer=plan.optimizer - optimizer_state_bytes(embeddings, plan.optimizer_name)).fits:
        found.append("model.freeze_embeddings=true")
    if not is_lora(model) and replace(plan, gradients=_lora_share(model, plan.gradients),
                                      optimizer=_lora_share(model, plan.optimizer)).fits:
        found.append("model.lora_rank=8")
    for length in (max_length // 2, max_length // 4):
        if length >= 32 and replace(plan, activations=activations.estimate(
                plan.micro_batch, plan.checkpointing, length=min(length, activations.length))).fits:
            found.append(f"data.max_length={length}")
            break
    return found


def _trained_embeddings(model) -> list[torch.nn.Parameter]:
    """The embeddings' weights that train (none under LoRA, frozen, or a model of unknown layers)."""
    from finetune.depths import layer_depths

    if is_lora(model):
        return []
    try:
        depth, _ = layer_depths(model, setting="model.freeze_embeddings")
    except ConfigError:
        return []
    return [p for p in model.parameters() if p.requires_grad and depth[id(p)] == 0]


def _smaller_micro_batches(batching) -> list[int]:
    """The micro-batches below ``b`` that keep ``B`` (halving, as the automatic micro-batch does)."""
    b, sizes = batching.per_device_batch_size, []
    while b > 1 and b % 2 == 0:
        b //= 2
        sizes.append(b)
    return sizes


def _lora_share(model, full: int) -> int:
    """``full`` (gradients or optimizer bytes) scaled to what LoRA at rank 8 would train of ``model``:
    an adapter on each projection of the blocks, and the head (with the pooler) in full."""
    blocks = blocks_of(model)
    adapters = sum(8 * (m.in_features + m.out_features) for m in blocks.modules() if isinstance(m, torch.nn.Linear))
    head = sum(p.numel() for name in head_modules(model) for p in model.get_submodule(name).parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return round(full * (adapters + head) / max(1, trained))
