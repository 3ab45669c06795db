"""``training.gradient_accumulation_fusion``: each weight gradient added into its fp32 gradient by the product.

Under bf16 or fp16 autocast a linear layer's weight gradient takes three
kernels per micro-batch: the product ``dy.T @ x`` in the low precision (its
sum rounded once more), autograd's cast of it to fp32, and the addition into
the parameter's fp32 gradient. An update of bert-base at ``k = 4`` makes 808
of those additions, 3.0 ms of the 65.8 ms of kernels its compiled blocks took
on an H100 (bench/README.md), and each micro-batch's gradient reaches the sum
rounded to bf16: 1.7e-3 from the exact sum over a window, as far as the big
batch's one bf16 product lands (``python -m bench.products`` measures both).
Megatron-LM's gradient accumulation fusion and Transformer Engine's
``fuse_wgrad_accumulation`` let the product add into the fp32 gradient in
its epilogue instead; torch offers that as ``addmm`` with
``out_dtype=torch.float32``. One kernel, and the window's gradient is the
fp32 sum of exact products: closer to the true mean gradient than either
the textbook accumulation or the big batch itself.

A :class:`FusedAccumulationLinear` runs the forward as ``nn.Linear`` does
(the weight and input cast as autocast would cast them) and has a backward
of its own: the input's gradient as autograd makes it, the bias's summed in
fp32, and the weight's added into ``weight.grad`` by
:func:`accumulate_weight_grad`, not returned to autograd. Nothing else
changes: the parameters, the ``state_dict``, the checkpoints and the saved
model are the linear layer's. A frozen weight (LoRA's base layers,
``model.freeze_blocks``) runs the plain forward. The layer casts its weight
itself, as autocast would, so ``training.cast_once_per_update`` does not
share these layers' weight copies among a window's micro-batches.

The addition is a custom operator (``torch.library.custom_op``), so that
``training.torch_compile`` traces it as one opaque in-place call, without a
graph break. On a CUDA GPU it is one ``addmm`` where the installed torch
takes an fp32 accumulator with low-precision factors; an older torch gets the
product written in fp32 and added (no rounding, one kernel fewer than
autograd's three), and one without fp32 outputs an fp32 product of the
upcast factors (the same sums, slower); the run says once which. On a CPU the
products are fp32 (in fp32, one ``addmm`` where autograd makes a product and
an addition; under bf16, fp32 products of the upcast factors: the same sums
as on a GPU, slower than bf16's units).

It needs one process without a sharding engine: DDP reduces each gradient as
autograd hands it over, and FSDP and DeepSpeed own the gradients, so there
the run says once why and the weights' gradients come from autograd.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from finetune.bias_apart import BiasApartLinear

logger = logging.getLogger("finetune")


def _by_the_product(grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    torch.addmm(grad, grad_output.t(), input, out_dtype=grad.dtype, out=grad)


def _written_then_added(grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    grad.add_(torch.mm(grad_output.t(), input, out_dtype=grad.dtype))


def _upcast(grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    grad.addmm_(grad_output.t().to(grad.dtype), input.to(grad.dtype))


# The ways a CUDA torch may add low-precision products into an fp32 gradient, fastest first: the product adds
# into it, the product is written in fp32 and then added, the factors are cast to fp32
_WAYS = {"addmm": _by_the_product, "mm": _written_then_added, "upcast": _upcast}
# the way each CUDA device takes, found at its first call
_CUDA_WAYS: dict[torch.device, str] = {}


def _add_weight_grad(grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """``grad += grad_output.T @ input`` in ``grad``'s precision, the low-precision factors as they are."""
    if grad_output.dtype == grad.dtype:
        grad.addmm_(grad_output.t(), input)
    elif grad.is_cuda:
        _add_on_cuda(grad, grad_output, input)
    else:
        _upcast(grad, grad_output, input)


def _add_on_cuda(grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """The fused ``addmm`` where this torch takes it, else the best way it has; the first call on a device finds
    it (in a warm-up, never inside a CUDA graph's capture) and says once which it is."""
    way = _CUDA_WAYS.get(grad.device)
    if way is None:
        _CUDA_WAYS[grad.device] = _first_cuda_way(grad, grad_output, input)
    else:
        _WAYS[way](grad, grad_output, input)


def _first_cuda_way(grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> str:
    """Add this call's gradient by the first way this torch runs; return that way's name."""
    try:  # a refused call raises before it writes
        _by_the_product(grad, grad_output, input)
        return "addmm"
    except (RuntimeError, TypeError) as refused:
        why = str(refused).split(". ")[0]
    try:
        _written_then_added(grad, grad_output, input)
        logger.warning("training.gradient_accumulation_fusion: this torch's addmm does not add %s products into "
                       "an %s gradient (%s); each product is written in %s and then added", grad_output.dtype,
                       grad.dtype, why, grad.dtype)
        return "mm"
    except (RuntimeError, TypeError):
        _upcast(grad, grad_output, input)
        logger.warning("training.gradient_accumulation_fusion: this torch has no %s products of %s factors (%s); "
                       "the factors are cast to %s for each product: the same sums, slower", grad.dtype,
                       grad_output.dtype, why, grad.dtype)
        return "upcast"


def accumulate_weight_grad(grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor) -> None:
    """``grad += grad_output.T @ input``, in ``grad``'s precision: what a compiled backward calls, opaque to it."""
    _add_weight_grad(grad, grad_output, input)


# torch.library.custom_op and torch.get_autocast_dtype are torch 2.4's; an older torch trains without the fusion
SUPPORTED = hasattr(torch.library, "custom_op") and hasattr(torch, "get_autocast_dtype")
if SUPPORTED:
    accumulate_weight_grad = torch.library.custom_op("finetune::accumulate_weight_grad",
                                                     mutates_args=("grad",))(accumulate_weight_grad)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], bias_apart: bool) -> torch.Tensor:
    if bias_apart and bias is not None:
        return torch.nn.functional.linear(x, weight) + bias
    return torch.nn.functional.linear(x, weight, bias)


class _LinearAddingItsWeightGrad(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight's gradient into ``grad`` itself and returns none for it."""

    @staticmethod
    def forward(ctx, x, weight, bias, grad, bias_apart: bool):
        device = x.device.type
        if torch.is_autocast_enabled(device):  # cast here as autocast casts linear's arguments
            dtype = torch.get_autocast_dtype(device)
            with torch.autocast(device, enabled=False):
                x, weight = x.to(dtype), weight.to(dtype)
                bias = None if bias is None else bias.to(dtype)
                out = _linear(x, weight, bias, bias_apart)
        else:
            out = _linear(x, weight, bias, bias_apart)
        ctx.save_for_backward(x, weight, grad)  # as cast: what the backward's products take
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_cast, weight_cast, grad = ctx.saved_tensors
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        inputs = x_cast.reshape(-1, x_cast.shape[-1])
        if torch.compiler.is_compiling():
            accumulate_weight_grad(grad, rows, inputs)
        else:  # eagerly the operator's dispatch is host time for nothing
            _add_weight_grad(grad, rows, inputs)
        needs_x, _, needs_bias, _, _ = ctx.needs_input_grad  # x: not below the lowest trained block
        grad_x = grad_out.to(weight_cast.dtype) @ weight_cast if needs_x else None  # autograd casts it to x's dtype
        grad_bias = rows.sum(0, dtype=torch.float32) if ctx.has_bias and needs_bias else None
        return grad_x, None, grad_bias, None, None


class FusedAccumulationLinear(torch.nn.Linear):
    """A linear layer whose weight gradient is added into ``weight.grad`` by its product (see the module)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(x)  # nn.Linear's, or BiasApartLinear's for the class below
        if self.weight.grad is None:  # freed by a caller since the last update: the sum starts again from 0
            self.weight.grad = torch.zeros_like(self.weight)
        return _LinearAddingItsWeightGrad.apply(x, self.weight, self.bias, self.weight.grad,
                                                isinstance(self, BiasApartLinear))


class FusedAccumulationBiasApartLinear(FusedAccumulationLinear, BiasApartLinear):
    """The same with ``training.bias_apart``: the product without its bias, then the bias added."""


def fusion_refused(accelerator) -> Optional[str]:
    """Why the run's weight gradients must come from autograd, or None where they can be fused."""
    from accelerate.utils import DistributedType

    if not SUPPORTED:
        return f"torch {torch.__version__} has no torch.library.custom_op (2.4 and newer have it)"
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return f"{accelerator.distributed_type.value} owns the gradients"
    if accelerator.num_processes > 1:
        return f"{accelerator.num_processes} processes: DDP reduces each gradient as autograd hands it over"
    return None


def fuse_weight_grads(model: torch.nn.Module) -> int:
    """Make every ``nn.Linear`` of ``model`` (and every ``training.bias_apart`` layer) a fused one, in place, its
    trainable weights given a zero gradient; how many.

    Only layers of exactly those classes change: a subclass (PEFT's LoRA layer, a quantized layer) has a
    forward of its own; the plain ``nn.Linear`` layers inside a LoRA layer (its frozen base, its adapters)
    change.
    """
    fused = {torch.nn.Linear: FusedAccumulationLinear, BiasApartLinear: FusedAccumulationBiasApartLinear}
    swapped = 0
    for module in model.modules():
        if type(module) in fused:
            module.__class__ = fused[type(module)]
            if module.weight.requires_grad and module.weight.grad is None:
                module.weight.grad = torch.zeros_like(module.weight)
            swapped += 1
    # read by the loop (loop.frees_gradients): the gradients are zeroed in place at an update, never freed, so
    # that a compiled block never meets a freed one and compiles a second time for it
    model.fused_weight_grads = swapped
    return swapped


def fuse_where_allowed(model: torch.nn.Module, accelerator=None) -> int:
    """:func:`fuse_weight_grads` where ``accelerator`` (one process when None) allows it, else says once why
    not (on the main process); how many layers it fused."""
    refused = fusion_refused(accelerator) if accelerator is not None else None
    if refused is not None:
        if getattr(accelerator, "is_main_process", True):
            logger.warning("training.gradient_accumulation_fusion: not applied: %s; the weight gradients come "
                           "from autograd", refused)
        return 0
    return fuse_weight_grads(model)
