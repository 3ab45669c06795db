"""Each parameter's depth in the encoder, the count layer-wise learning rates and frozen layers go by.

Depth 0 is the embeddings and what else serves the blocks from below,
1 to ``L`` the transformer blocks from the bottom, ``L + 1`` what is above
them (a pooler, a final norm, the head). Written here because neither
transformers nor PEFT maps a model's parameters to its layers; the blocks are
:func:`finetune.lora.layer_stack`'s, for every supported family.
"""

from __future__ import annotations

import torch

from finetune.errors import ConfigError


def layer_depths(model: torch.nn.Module, setting: str = "optim.layer_lr_decay") -> tuple[dict[int, int], int]:
    """Each parameter's depth in the encoder, by ``id``, and the number of blocks ``L``.

    0: what serves the blocks from below (:func:`~finetune.lora.below_the_blocks`:
    the embeddings, DeBERTa's relative positions, ...); 1 to ``L``: the
    transformer blocks of :func:`~finetune.lora.layer_stack`, bottom to top;
    ``L + 1``: the rest, above the blocks (a pooler, ModernBERT's final norm,
    the head). ALBERT shares one block across its layers, so its ``L`` is 1. A
    LoRA model's adapters sit in its blocks and take their depth.

    Raises:
        ConfigError: for a model whose blocks cannot be found, naming ``setting``, the key that asked.
    """
    from finetune.lora import base_model, below_the_blocks, layer_stack

    base = base_model(model)
    try:
        stack_name, blocks = layer_stack(base)
    except ConfigError:
        raise ConfigError(f"{setting}: finds no transformer blocks in {type(base).__name__}") from None
    depth = {id(p): i for i, block in enumerate(blocks, start=1) for p in block.parameters()}
    depth.update((weight, 0) for weight in below_the_blocks(base, stack_name))
    for param in model.parameters():
        depth.setdefault(id(param), len(blocks) + 1)
    return depth, len(blocks)
