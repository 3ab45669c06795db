"""Speed-ups for training on a CPU, behind one switch: :func:`cpu_speedups`.

A CPU pays for work that a GPU hides. Up to four things are switched on for as
long as training runs, and switched back when it ends (the last two are the
choices of one setting, and the very last stays):

* **Dropout masks drawn 16 bits at a time** (``training.fast_dropout_masks``,
  :mod:`finetune.cpu.dropout`): torch's CPU ``bernoulli_`` draws one number per
  element outside Intel's MKL; the model's ``nn.Dropout`` modules and its
  ``sdpa`` attention draw four elements per 64-bit number instead (the
  attention not where ``training.attention_kernel`` asks torch for a kernel).
* **The word embedding's gradient as rows** (``training.sparse_embedding_grad``,
  :mod:`finetune.cpu.sparse_embedding`): the backward returns the rows a
  micro-batch used, added into one reused dense buffer.
* **Gradient buffers kept between updates** when accumulating: zeroed in
  place rather than freed, so each window's backward finds the memory layout
  the last one left, and the C heap does not grow with holes that the next
  forward pass cannot reuse.
* **Free heap handed back after each update**, only with
  ``training.cpu_heap: trim`` (glibc's ``malloc_trim``): the activations of
  micro-batches of many shapes leave free chunks scattered in the C heap, which
  otherwise stay counted in the process's memory and grow it window after
  window. ``keep`` leaves them to glibc to reuse: every page handed back is
  faulted in again by the next window (tens of thousands of page faults per
  update for a small BERT), which costs more time than the memory is worth
  where there is memory to spare.
* **Large blocks mapped on their own**, with ``training.cpu_heap: release``
  (glibc's ``mallopt``): every allocation of 1 MiB or more gets its own
  mapping, handed back the moment the tensor is freed. glibc's default raises
  that threshold as large blocks are freed, up to 32 MiB, so a forward pass's
  mid-sized activations come from the heap between small tensors, and the
  freed space is kept; LoRA's small adapter tensors make it worse. The price
  is a page fault per 4 KiB of each large tensor. It is the one switch not
  undone on exit: glibc cannot go back to its adaptive threshold, so the
  process keeps it. The default, ``auto``, keeps the heap where the kept heap
  of the plan's largest micro-batch would fit the memory the run has, and
  otherwise keeps it only until a micro-batch comes whose kept heap could
  outgrow the memory free then: released from that micro-batch on
  (:func:`heap_for`, :func:`released_when_short`).

None of them changes what an update computes beyond float rounding (the
masks keep dropout's distribution, ``p`` on a grid of 2**-16), and the
accumulation tests run with and without them. None applies on a GPU (fused
Philox dropout, microsecond zeroing, a caching allocator), and the first two
leave a compiled model alone, whose graphs were traced without them.

``fit`` enters the switch around the whole training; in a notebook::

    with cpu_speedups(model, optimizer, accelerator):
        for epoch in range(epochs):
            train_one_epoch(model, optimizer, scheduler, dataloader, accelerator, epoch, state=state)
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from finetune.cpu.dropout import attention_switch_unavailable, fast_dropout, sdpa_configs
from finetune.cpu.sparse_embedding import sparse_capable_embedding, sparse_embedding_rows
from finetune.machine import memory_free

logger = logging.getLogger("finetune")

HEAP_SETTINGS = ("keep", "trim", "release")  # what training.cpu_heap sets; its "auto" chooses keep or the next
# auto where memory may be short: kept, and released before the first micro-batch that could not keep it
KEEP_UNTIL_SHORT = "keep_until_short"
# glibc's kept heap held up to 3.3 times the memory plan's total in the settings measured (docs/memory.md, the
# memory levers under both heaps), where the released one held about the plan: a micro-batch keeps the heap only
# where this many times its plan fits in what is free
KEPT_HEAP_ROOM = 4
M_MMAP_THRESHOLD = -3  # glibc's malloc.h
# Every activation of a BERT-sized micro-batch at a few hundred tokens is larger; the weights' and adapters' small
# tensors, and the row-sized tensors of short texts, stay in the heap, where reusing freed space is fast.
RELEASED_BLOCK = 1 << 20


def is_compiled(model) -> bool:
    """Whether ``model`` (or the module inside DDP's wrapper), or any module inside it, runs through
    ``torch.compile``.

    ``torch.compile(model)`` returns a wrapper with ``_orig_mod``;
    ``module.compile()``, as ``training.torch_compile`` does to the model
    (``true``) or to each encoder block (``blocks``), compiles in place and sets
    ``_compiled_call_impl``. Both are read with ``getattr``, so a torch that
    renamed them makes this answer False, never fail.
    """
    inner = getattr(model, "module", model)
    if hasattr(model, "_orig_mod") or hasattr(inner, "_orig_mod"):
        return True
    modules = inner.modules() if callable(getattr(inner, "modules", None)) else [inner]  # the model among them
    return any(getattr(module, "_compiled_call_impl", None) is not None for module in (model, *modules))


@dataclass(frozen=True)
class CpuSpeedups:
    """Which of the speed-ups apply to a model on an accelerator's device."""

    dropout_masks: bool = False
    # False where the attention cannot be switched (see attention_switch_unavailable); dropout modules still are
    attention: bool = False
    sparse_embedding: bool = False
    keep_grads: bool = False
    trim_heap: bool = False
    release_heap: bool = False
    release_when_short: bool = False

    def describe(self, heap_reason: str = "") -> str:
        """The start-up line's words for what is on (empty when nothing is), with why the heap is released
        where ``heap_reason`` says."""
        words = []
        if self.sparse_embedding:
            words.append("embedding_grad=sparse")
        if self.dropout_masks:
            words.append("dropout_masks=fast")
        if self.trim_heap:
            words.append("heap=trim")
        released = "release" if self.release_heap else KEEP_UNTIL_SHORT if self.release_when_short else None
        if released is not None:
            words.append(f"heap={released} ({heap_reason})" if heap_reason else f"heap={released}")
        return " ".join(words)


def speedup_settings(training, memory=None) -> dict:
    """The keyword arguments of :func:`cpu_speedups` and :func:`plan_cpu_speedups` that a ``TrainingConfig`` sets,
    ``training.cpu_heap: auto`` decided by the run's memory plan (``memory``, a
    :class:`~finetune.memory.MemoryPlan`; see :func:`heap_for`)."""
    return {"dropout_masks": training.fast_dropout_masks, "sparse_embedding": training.sparse_embedding_grad,
            "heap": heap_for(training.cpu_heap, memory), "own_attention": training.attention_kernel == "auto",
            "memory": memory}


def heap_for(setting: str, memory=None) -> str:
    """``training.cpu_heap`` as a run applies it: ``auto`` is ``keep`` where :data:`KEPT_HEAP_ROOM` times the
    memory plan's total fits in the memory available (the start line's ``of ...GB available``), or where there is
    no plan to judge by (FSDP, DeepSpeed, a GPU), and :data:`KEEP_UNTIL_SHORT` elsewhere (:func:`released_when_short`).

    A plan counts tensors. glibc's heap, kept, also holds the freed space between them, up to several times
    what they take; released, about what they take. Keeping is faster (up to twice on long texts): so where the
    plan's largest micro-batch could not keep it, the heap is still kept for the micro-batches that can, and
    released before the first that cannot, for the rest of the run. A plan is the largest micro-batch the data
    can make, and under ``data.truncation: chunks`` most are far smaller than it.
    """
    if setting != "auto":
        return setting
    if memory is None or memory.device != "cpu" or memory.available is None:
        return "keep"
    return "keep" if heap_can_be_kept(memory, memory.activations, memory.available) else KEEP_UNTIL_SHORT


def heap_can_be_kept(memory, activations: int, free: int) -> bool:
    """Whether :data:`KEPT_HEAP_ROOM` times the plan ``memory`` with ``activations`` bytes of activations (its
    largest micro-batch's, or the one about to run) fits in ``free`` bytes beside the loaded weights."""
    total = memory.weights + memory.gradients + memory.optimizer + activations
    return KEPT_HEAP_ROOM * total <= free + memory.resident


def heap_reason(setting: str) -> str:
    """The start line's words for why ``auto`` chose what it did (empty for a heap set in the config)."""
    return f"auto: {KEPT_HEAP_ROOM} x the memory plan is more than the memory available" if setting == "auto" else ""


def plan_cpu_speedups(model, accelerator, *, dropout_masks: bool = True, sparse_embedding: bool = True,
                      heap: str = "keep", own_attention: bool = True, memory=None,
                      quiet: bool = False) -> CpuSpeedups:
    """What :func:`cpu_speedups` would switch on for ``model`` on ``accelerator``'s device.

    Args:
        model: The (prepared) model.
        accelerator: The ``Accelerator`` (its device, process count and grad scaler decide).
        dropout_masks: Allow the 16-bit dropout masks.
        sparse_embedding: Allow the sparse word-embedding gradient.
        heap: ``training.cpu_heap``: ``"trim"`` hands free heap memory back after each update,
            ``"release"`` maps large blocks on their own, :data:`KEEP_UNTIL_SHORT` (``auto``'s choice where
            memory may be short, :func:`heap_for`) does so from the first micro-batch that could not keep it.
        memory: The run's :class:`~finetune.memory.MemoryPlan`, which :data:`KEEP_UNTIL_SHORT` judges by.
        own_attention: Allow the attention that draws its dropout masks itself (not where
            ``training.attention_kernel`` asks torch for a kernel).
        quiet: Do not log why the attention stays as it is.
    """
    if heap not in HEAP_SETTINGS and heap != KEEP_UNTIL_SHORT:
        raise ValueError(f"heap must be one of {', '.join(map(repr, HEAP_SETTINGS))}, got {heap!r}")
    if heap == KEEP_UNTIL_SHORT and memory is None:
        raise ValueError(f"heap={KEEP_UNTIL_SHORT!r} judges each micro-batch by the run's memory plan: give memory")
    if accelerator.device.type != "cpu":
        return CpuSpeedups()
    compiled = is_compiled(model)
    masks = dropout_masks and not compiled
    attention = False
    if masks:
        configs = sdpa_configs(model)
        reason = attention_switch_unavailable(configs[0], model) if configs else "its attention is not sdpa"
        if reason is None and not own_attention:
            reason = "training.attention_kernel asks torch for a kernel"
        attention = reason is None
        if configs and reason is not None and not quiet:
            logger.info("cpu speed-ups: attention left as sdpa (%s)", reason)
    # DDP's buckets, FSDP's and DeepSpeed's shards and fp16's grad scaler expect dense gradients
    rows = (sparse_embedding and not compiled and accelerator.num_processes == 1
            and getattr(accelerator, "scaler", None) is None and sparse_capable_embedding(model) is not None)
    # a compiled model would trace the judging hook; it is released from the start instead
    until_short = heap == KEEP_UNTIL_SHORT and not compiled
    releasable = mallopt() is not None
    return CpuSpeedups(dropout_masks=masks, attention=attention, sparse_embedding=rows, keep_grads=True,
                       trim_heap=heap == "trim" and malloc_trim() is not None,
                       release_heap=heap in ("release", KEEP_UNTIL_SHORT) and not until_short and releasable,
                       release_when_short=until_short and releasable)


@contextlib.contextmanager
def kept_gradients(optimizer, accelerator) -> Iterator[None]:
    """Inside, ``optimizer.zero_grad()`` zeroes the gradients in place while ``k > 1`` instead of freeing them.

    With ``k > 1`` the gradient buffers live from a window's first micro-batch
    to its last anyway. Freed at each update and reallocated in the middle of
    the next window's first backward pass, they leave holes in the C heap
    that the next forward pass's tensors do not fit, and the process grows
    window after window. With ``k = 1`` they are freed, so no forward pass
    holds them. (The optimizer's own method is shadowed on the instance and
    restored on exit.)
    """
    zero_grad = optimizer.zero_grad

    @functools.wraps(zero_grad)
    def zero_grad_keeping_buffers(set_to_none: Optional[bool] = None):
        # freed only where the caller allows it (not DDP's bucket views) and nothing is accumulated
        return zero_grad(set_to_none=set_to_none is not False and accelerator.gradient_accumulation_steps == 1)

    optimizer.zero_grad = zero_grad_keeping_buffers
    try:
        yield
    finally:
        del optimizer.zero_grad  # the class's method again


@functools.lru_cache(maxsize=None)
def _glibc(name: str):
    """The C library's function ``name``, or ``None`` where it has none (macOS, musl: no glibc extensions)."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def malloc_trim():
    """glibc's ``malloc_trim``, or ``None``."""
    return _glibc("malloc_trim")


def release_free_heap() -> None:
    """The C heap's free memory goes back to the system (glibc's ``malloc_trim(0)``); elsewhere nothing happens."""
    trim = malloc_trim()
    if trim is not None:
        trim(0)


def mallopt():
    """glibc's ``mallopt``, or ``None``."""
    return _glibc("mallopt")


def release_large_blocks() -> None:
    """From now on, glibc maps every block of :data:`RELEASED_BLOCK` bytes or more on its own (``cpu_heap: release``).

    Freed, such a block goes back to the system at once instead of staying in
    the heap for a later tensor that may not fit it. Setting the threshold
    also ends glibc's adaptive one for the rest of the process (there is no
    call that restores it). torch's CPU allocator takes its memory from
    ``malloc`` and has no such setting of its own, hence ``ctypes``.
    """
    if not mallopt()(M_MMAP_THRESHOLD, RELEASED_BLOCK):
        logger.warning("training.cpu_heap: release: glibc's mallopt refused the threshold; the heap is as before")


def micro_batch_activations(memory, rows: int, tokens: int) -> int:
    """The activations a micro-batch of ``rows`` x ``tokens`` saves, scaled from the plan's largest micro-batch.

    In proportion to the tokens, which over-states a shorter micro-batch's (attention's share falls with the
    square of its length): an estimate that errs towards releasing.
    """
    planned = (memory.windows or memory.micro_batch) * memory.length
    return memory.activations * rows * tokens // max(1, planned)


def rows_and_tokens(args, kwargs) -> Optional[tuple[int, int]]:
    """The rows and tokens of a forward pass's inputs: the first 2-D tensor among them (``input_ids``)."""
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value) and value.dim() == 2:
            return value.shape[0], value.shape[1]
    return None


@contextlib.contextmanager
def released_when_short(model, memory) -> Iterator[dict]:
    """Inside, the heap is kept until a training micro-batch whose kept heap could outgrow the memory free comes;
    then it is released (:func:`release_large_blocks`, and the free heap handed back) for the rest of the process.

    ``auto``'s heap where the plan's largest micro-batch could not keep it (:func:`heap_for`): each micro-batch
    is judged before its forward pass by the same rule, :func:`heap_can_be_kept`, with its own activations and
    the memory free at that moment (this process's share of it, :func:`~finetune.machine.memory_free`). A
    kept heap held up to 3.3 times its plan in the settings measured: a micro-batch whose 4 plans fit in what is
    free does not outgrow it. Forward passes without gradients (evaluation) keep no activations and are not
    judged. Yields ``{"released": bool}``.
    """
    state = {"released": False}

    def judge(module, args, kwargs):
        shape = rows_and_tokens(args, kwargs) if torch.is_grad_enabled() else None
        free = memory_free() if shape is not None else None
        if free is None:
            return
        activations, free = micro_batch_activations(memory, *shape), free // max(1, memory.processes)
        if heap_can_be_kept(memory, activations, free):
            return
        release_large_blocks()
        release_free_heap()
        state["released"] = True
        handle.remove()
        logger.info("cpu heap: released from a micro-batch of %d rows x %d tokens on: %d x its plan (%.2fGB of "
                    "activations) is more than the %.1fGB free (training.cpu_heap: auto)", *shape, KEPT_HEAP_ROOM,
                    activations / 1e9, free / 1e9)

    handle = getattr(model, "module", model).register_forward_pre_hook(judge, with_kwargs=True)
    try:
        yield state
    finally:
        handle.remove()


@contextlib.contextmanager
def trimmed_heap(optimizer) -> Iterator[None]:
    """Inside, every optimizer step ends by handing the C heap's free memory back to the system.

    The lowest resident memory (``training.cpu_heap: trim``), at the cost of
    faulting those pages in again in the next window. The forward and backward
    passes of micro-batches of varying shapes free their activations in chunks
    that later tensors of other sizes do not reuse; glibc keeps them, and the
    resident size climbs window after window. ``malloc_trim(0)`` once per
    update, not per micro-batch, returns them. PyTorch's CPU allocator has no
    such call, hence ``ctypes``.
    """
    trim = malloc_trim()
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper steps the torch optimizer inside
    handle = inner.register_step_post_hook(lambda *_: trim(0))
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def dropout_as_in_training(model, accelerator, training) -> Iterator[bool]:
    """Inside, ``model`` draws dropout masks as :func:`cpu_speedups` will make it in training; yields whether switched.

    For what runs before training and must see what training saves: the
    memory probe and the automatic micro-batch's trial steps. Torch's own
    dropout saves a float32 noise tensor per element it drops, the fast one a
    16-bit mask, so a probe under the wrong one counts a mask twice the size.
    Compiled runs keep torch's dropout (:func:`plan_cpu_speedups`).
    """
    plan = plan_cpu_speedups(model, accelerator, dropout_masks=training.fast_dropout_masks and not
                             training.torch_compile, sparse_embedding=False,
                             own_attention=training.attention_kernel == "auto", quiet=True)
    if not plan.dropout_masks:
        yield False
        return
    with fast_dropout(model, attention=plan.attention):
        yield True


@contextlib.contextmanager
def cpu_speedups(model, optimizer, accelerator, *, dropout_masks: bool = True,
                 sparse_embedding: bool = True, heap: str = "keep", own_attention: bool = True, memory=None
                 ) -> Iterator[CpuSpeedups]:
    """Switch on the CPU speed-ups that apply (:func:`plan_cpu_speedups`); all but ``cpu_heap: release`` are
    undone on exit.

    Args:
        model: The prepared model.
        optimizer: The prepared optimizer.
        accelerator: The ``Accelerator``.
        dropout_masks: ``training.fast_dropout_masks``.
        sparse_embedding: ``training.sparse_embedding_grad``.
        heap: ``training.cpu_heap``: ``"keep"``, ``"trim"`` or ``"release"``, or :data:`KEEP_UNTIL_SHORT`
            (``auto``'s choice where memory may be short: :func:`heap_for`).
        own_attention: ``training.attention_kernel`` is ``auto``.
        memory: The run's :class:`~finetune.memory.MemoryPlan`, which :data:`KEEP_UNTIL_SHORT` judges by.

    Yields:
        The :class:`CpuSpeedups` in force.
    """
    plan = plan_cpu_speedups(model, accelerator, dropout_masks=dropout_masks, sparse_embedding=sparse_embedding,
                             heap=heap, own_attention=own_attention, memory=memory)
    with contextlib.ExitStack() as switches:
        if plan.dropout_masks:
            switches.enter_context(fast_dropout(model, attention=plan.attention))
        if plan.sparse_embedding:
            switches.enter_context(sparse_embedding_rows(sparse_capable_embedding(model)))
        if plan.keep_grads:
            switches.enter_context(kept_gradients(optimizer, accelerator))
        if plan.trim_heap:
            switches.enter_context(trimmed_heap(optimizer))
        if plan.release_heap:
            release_large_blocks()
        if plan.release_when_short:
            switches.enter_context(released_when_short(model, memory))
        yield plan
