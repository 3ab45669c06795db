"""``training.attention_kernel``: which of torch's attention kernels the encoder asks for first.

transformers' ``sdpa`` attention calls ``scaled_dot_product_attention``,
which runs the first kernel in its order whose constraints a call's inputs
meet; torch's default order is flash, memory-efficient, math, cuDNN. Flash takes no mask, so a padded
micro-batch (and every micro-batch the CUDA graphs replay, which keep their
mask) runs the memory-efficient kernel; cuDNN's, which takes a mask and
dropout, comes after math, which takes everything, so torch never runs it.

The setting puts one kernel first (``torch.nn.attention.sdpa_kernel`` with
``set_priority``) and torch's order after it: where the first refuses a
call's inputs (cuDNN on an older GPU, a head size it lacks), the next runs,
so a preference never fails a run. ``math`` is asked for alone: the
reference kernel, which runs everything, and on a CPU, where torch keeps
its own order (flash, then math), the only way to have it. There is no
``flash``: torch tries it first already.

The model enters the preference at the start of each forward and leaves it
at the end (a forward pre-hook, and a forward hook that runs even when the
forward raises), so it holds wherever the model runs: ``fit`` and its
evaluations, a notebook's ``train_one_epoch``, the memory plan's trial
micro-batch, the captures of CUDA graphs, and the traces of
``torch.compile``, which chooses the kernel when it traces (the hooks
themselves stay out of the compiled code). The backward runs the kernel the
forward ran: autograd records which. Hooks on the outermost model, since
PEFT's wrapper calls the inner model's ``forward`` directly; the CUDA
graphs' step, which calls the forward function past the hooks, enters the
preference itself (:func:`asked_kernel`). Gradient checkpointing recomputes
each block in the backward, outside the forward: its checkpoints get the
preference for the recompute too (:func:`recompute_context`), or the
recompute would run another kernel, which saves other tensors, and torch's
check of the recompute would fail.

A kernel is a way to compute the same attention: the accumulation contract
holds with any of them, to the float rounding each kernel has. Changing it
changes that rounding, so a checkpoint resumes only with the kernel it was
made with.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger("finetune")

# the kernels each setting enables, in the order they are tried
KERNEL_ORDERS = {
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH,
                  SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
}
SETTINGS = ("auto", *KERNEL_ORDERS)


def prefer_attention_kernel(model: torch.nn.Module, kernel: str) -> None:
    """Make ``model`` ask ``scaled_dot_product_attention`` for ``kernel`` first in each forward; ``"auto"``
    leaves torch's order. Sets ``model.attention_kernel`` to the kernel asked for.

    Raises:
        ValueError: for a name :data:`SETTINGS` lacks.
    """
    if kernel not in SETTINGS:
        raise ValueError(f"attention kernel must be one of {', '.join(SETTINGS)}, got {kernel!r}")
    if kernel == "auto":
        return
    model.attention_kernel = kernel
    entered = []  # a stack: a forward inside a forward (a wrapper's) enters and leaves its own

    @torch.compiler.disable  # a generator's context cannot be traced across two hooks; run both eagerly
    def enter(module, args, kwargs):
        preference = asked_kernel(model)
        preference.__enter__()
        entered.append(preference)

    @torch.compiler.disable
    def leave(module, args, kwargs, output):
        entered.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


def asked_kernel(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The kernel ``model`` asks for, for a caller that runs its forward function past the hooks (the CUDA graphs'
    step, which leaves out Accelerate's wrapper too) to enter around it; nothing where it asks for none."""
    kernel = getattr(model, "attention_kernel", "auto")
    return contextlib.nullcontext() if kernel == "auto" else sdpa_kernel(KERNEL_ORDERS[kernel], set_priority=True)


def recompute_context(model: torch.nn.Module) -> Optional[Callable[[], tuple]]:
    """The ``context_fn`` of ``torch.utils.checkpoint`` (non-reentrant) that recomputes ``model``'s blocks with
    the kernel its forward asked for; ``None`` where it asks for none."""
    if getattr(model, "attention_kernel", "auto") == "auto":
        return None
    return lambda: (contextlib.nullcontext(), asked_kernel(model))  # the forward has it already


def kernel_refusal(kernel: str, config, device: torch.device, dtype: torch.dtype, length: int) -> Optional[str]:
    """Which micro-batches ``kernel`` would not run an encoder's attention for in training, and why, in torch's
    words (a padded micro-batch has a boolean mask, an unpadded one none); ``None`` where it runs both, and for
    ``"auto"``.

    Tried on ``device`` with one text of ``length`` tokens, the model ``config``'s heads, head size and
    attention dropout, in ``dtype``, with gradients, since some kernels' limits depend on each.
    """
    if kernel == "auto":
        return None
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # BERT's name, and DistilBERT's and ModernBERT's
    dropout = next((float(getattr(config, name) or 0.0) for name in ("attention_probs_dropout_prob",
                                                                    "attention_dropout") if hasattr(config, name)), 0.0)
    query = torch.zeros(1, heads, length, head_dim, device=device, dtype=dtype, requires_grad=True)
    mask = torch.ones(1, 1, length, length, device=device, dtype=torch.bool)
    mask[..., length - max(1, length // 4):] = False  # the last quarter is padding
    padded, unpadded = (_refusal(kernel, query, case_mask, dropout) for case_mask in (mask, None))
    if padded is not None and padded == unpadded:
        return f"every micro-batch ({padded})"
    cases = [f"{case} ({reason})" for case, reason in (("a padded micro-batch", padded), ("an unpadded one", unpadded))
             if reason is not None]
    return " and ".join(cases) or None


def _refusal(kernel: str, query: torch.Tensor, mask: Optional[torch.Tensor], dropout: float) -> Optional[str]:
    """Why ``kernel`` alone does not run this attention (the reasons torch warns of), or ``None``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(KERNEL_ORDERS[kernel][0]):
                torch.nn.functional.scaled_dot_product_attention(query, query, query, attn_mask=mask,
                                                                 dropout_p=dropout)
        except RuntimeError as exc:
            reasons = [_first_line(str(w.message)) for w in caught]
            reasons = [r for r in reasons if r and not r.endswith("because:")]  # headings of the lines after them
            if reasons:
                return "; ".join(dict.fromkeys(reasons))
            if query.device.type == "cpu":  # cuDNN's and the memory-efficient kernel are CUDA's
                return f"torch has no {kernel} kernel for a cpu"
            return _first_line(str(exc))
    return None


def _first_line(message: str) -> str:
    """A torch warning's first line, without the source location torch appends."""
    lines = message.split(" (Triggered internally", 1)[0].strip().splitlines()
    return lines[0].strip() if lines else ""


def apply_attention_kernel(model: torch.nn.Module, kernel: str, accelerator, length: int) -> None:
    """``training.attention_kernel`` on ``model``, in place, and where it will not run said once (the main
    process), for micro-batches of up to ``length`` tokens in ``accelerator``'s precision on its device. A model
    whose attention is not torch's (MPNet's, DeBERTa's own) is left as it is, and the run says so."""
    if kernel == "auto":
        return
    # transformers' name for the attention a model runs; a release without it is taken to run torch's
    implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if implementation != "sdpa":
        if accelerator.is_main_process:
            logger.warning("training.attention_kernel: %s has no effect: the model's attention is %r, not torch's "
                           "scaled_dot_product_attention", kernel, implementation)
        return
    prefer_attention_kernel(model, kernel)
    if not accelerator.is_main_process:
        return
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision), torch.float32)
    refusal = kernel_refusal(kernel, model.config, accelerator.device, dtype, length)
    if refusal is not None:
        logger.warning("training.attention_kernel: %s refuses %s; there attention runs torch's next kernel",
                       kernel, refusal)
