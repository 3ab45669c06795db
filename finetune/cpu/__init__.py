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
  process keeps it. The default, ``auto``, releases where the kept heap could
  outgrow the memory the run has (:func:`heap_for`), and keeps it elsewhere.

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

from finetune.cpu.dropout import attention_switch_unavailable, fast_dropout, sdpa_configs
from finetune.cpu.sparse_embedding import sparse_capable_embedding, sparse_embedding_rows

logger = logging.getLogger("finetune")

HEAP_SETTINGS = ("keep", "trim", "release")  # what training.cpu_heap applies; its "auto" chooses keep or release
# glibc's kept heap held up to 3.3 times the memory plan's total in the settings measured (docs/memory.md, the
# memory levers under both heaps), where the released one held about the plan: with less than this many times the
# plan available, `auto` releases
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
        if self.release_heap:
            words.append(f"heap=release ({heap_reason})" if heap_reason else "heap=release")
        return " ".join(words)


def speedup_settings(training, memory=None) -> dict:
    """The keyword arguments of :func:`cpu_speedups` and :func:`plan_cpu_speedups` that a ``TrainingConfig`` sets,
    ``training.cpu_heap: auto`` decided by the run's memory plan (``memory``, a
    :class:`~finetune.memory.MemoryPlan`; see :func:`heap_for`)."""
    return {"dropout_masks": training.fast_dropout_masks, "sparse_embedding": training.sparse_embedding_grad,
            "heap": heap_for(training.cpu_heap, memory), "own_attention": training.attention_kernel == "auto"}


def heap_for(setting: str, memory=None) -> str:
    """``training.cpu_heap`` as a run applies it: ``auto`` is ``release`` on a CPU where :data:`KEPT_HEAP_ROOM`
    times the memory plan's total is more than the memory available (the start line's ``of ...GB available``),
    and ``keep`` elsewhere, or where there is no plan to judge by (FSDP, DeepSpeed).

    A plan counts tensors. glibc's heap, kept, also holds the freed space between them, up to several times
    what they take; released, about what they take: where memory is short, the released heap is the one whose
    peak the plan (and the check against a container's limit) says. Where it is not, keeping is faster.
    """
    if setting != "auto":
        return setting
    if memory is None or memory.device != "cpu" or memory.available is None:
        return "keep"
    return "release" if KEPT_HEAP_ROOM * memory.total > memory.available + memory.resident else "keep"


def heap_reason(setting: str) -> str:
    """The start line's words for why ``auto`` released the heap (empty for a heap set in the config)."""
    return f"auto: {KEPT_HEAP_ROOM} x the memory plan is more than the memory available" if setting == "auto" else ""


def plan_cpu_speedups(model, accelerator, *, dropout_masks: bool = True, sparse_embedding: bool = True,
                      heap: str = "keep", own_attention: bool = True, quiet: bool = False) -> CpuSpeedups:
    """What :func:`cpu_speedups` would switch on for ``model`` on ``accelerator``'s device.

    Args:
        model: The (prepared) model.
        accelerator: The ``Accelerator`` (its device, process count and grad scaler decide).
        dropout_masks: Allow the 16-bit dropout masks.
        sparse_embedding: Allow the sparse word-embedding gradient.
        heap: ``training.cpu_heap``: ``"trim"`` hands free heap memory back after each update,
            ``"release"`` maps large blocks on their own.
        own_attention: Allow the attention that draws its dropout masks itself (not where
            ``training.attention_kernel`` asks torch for a kernel).
        quiet: Do not log why the attention stays as it is.
    """
    if heap not in HEAP_SETTINGS:
        raise ValueError(f"heap must be one of {', '.join(map(repr, HEAP_SETTINGS))}, got {heap!r}")
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
    return CpuSpeedups(dropout_masks=masks, attention=attention, sparse_embedding=rows, keep_grads=True,
                       trim_heap=heap == "trim" and malloc_trim() is not None,
                       release_heap=heap == "release" and mallopt() is not None)


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
                 sparse_embedding: bool = True, heap: str = "keep", own_attention: bool = True
                 ) -> Iterator[CpuSpeedups]:
    """Switch on the CPU speed-ups that apply (:func:`plan_cpu_speedups`); all but ``cpu_heap: release`` are undone on exit.

    Args:
        model: The prepared model.
        optimizer: The prepared optimizer.
        accelerator: The ``Accelerator``.
        dropout_masks: ``training.fast_dropout_masks``.
        sparse_embedding: ``training.sparse_embedding_grad``.
        heap: ``training.cpu_heap``: ``"keep"``, ``"trim"`` or ``"release"``.
        own_attention: ``training.attention_kernel`` is ``auto``.

    Yields:
        The :class:`CpuSpeedups` in force.
    """
    plan = plan_cpu_speedups(model, accelerator, dropout_masks=dropout_masks, sparse_embedding=sparse_embedding,
                             heap=heap, own_attention=own_attention)
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
        yield plan
