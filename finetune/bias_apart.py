"""``training.bias_apart``: each linear layer's bias added after its matrix product, not inside it.

``nn.Linear`` hands its product and its bias to one ``addmm``. On a CUDA GPU
cuBLAS adds the bias in the product's epilogue, and for some shapes the
kernel it picks to do so is much slower than its kernel for the product
alone: inductor's own timings of bert-base's 8192 x 768 x 768 product on an
H100 gave 0.052 ms with the bias and 0.020 ms for the same product without
it (bench/README.md). Inductor keeps a bf16 or fp16 ``addmm`` whole (its
``keep_addmm_fused_for_half_dtypes``, on by default where the release has it),
so ``training.torch_compile`` does not split it either.

A :class:`BiasApartLinear` computes the product alone and adds the bias
after it: in eager mode a small element-wise kernel of its own; under
``torch.compile`` none, since inductor fuses the addition into the
element-wise work that follows the product (the activation, the dropout and
the residual's addition, or the reshaping of the attention's heads).

What changes is each layer's class, nothing else: the parameters, the
``state_dict`` keys, the checkpoints and the saved model are the linear
layer's, and ``from_pretrained`` reads the model as ever. In fp32 the two
ways compute the same sums, to float rounding; under bf16 or fp16 autocast the product's output
is rounded to the low precision once before the bias is added, where the
fused epilogue adds it first: one more rounding, the same for every
micro-batch, so the accumulation contract holds as it did.
"""

from __future__ import annotations

import torch


class BiasApartLinear(torch.nn.Linear):
    """A linear layer whose bias is added after its product, by a kernel of its own (or fused by a compiler).

    The bias is cast to the product's dtype, as autocast casts it for ``addmm``, so that the rest of the block
    runs in the precision it ran in.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = torch.nn.functional.linear(x, self.weight)
        return product + self.bias.to(product.dtype)


def add_biases_apart(model: torch.nn.Module) -> int:
    """Make every ``nn.Linear`` of ``model`` that has a bias a :class:`BiasApartLinear`, in place; how many.

    Only layers of exactly that class change: a subclass (PEFT's adapters, a quantized layer) has a forward of
    its own, and a LoRA layer's frozen ``base_layer`` inside it is a plain ``nn.Linear``, which changes.
    """
    swapped = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.bias is not None:
            module.__class__ = BiasApartLinear
            swapped += 1
    return swapped
