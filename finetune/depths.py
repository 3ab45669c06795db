"""Each parameter's depth in the encoder, the count layer-wise learning rates and frozen layers go by.

Depth 0 is the embeddings and what the encoder runs before its first block,
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

    0: what serves the blocks from below: the embeddings and the encoder's
    parameters named for them or held in an embedding table (ELECTRA's
    projection of them to the hidden size), and those held beside the blocks
    in the module that holds them (ALBERT's projection, DeBERTa's relative
    positions and their norm, MPNet's relative attention bias); 1 to
    ``L``: the transformer blocks of :func:`~finetune.lora.layer_stack`, bottom
    to top; ``L + 1``: the rest, above the blocks (a pooler, ModernBERT's final
    norm, the head). ALBERT
    shares one block across its layers, so its ``L`` is 1. A LoRA model's
    adapters sit in its blocks and take their depth.

    Raises:
        ConfigError: for a model whose blocks cannot be found, naming ``setting``, the key that asked.
    """
    from finetune.lora import base_model, layer_stack

    base = base_model(model)
    try:
        stack_name, blocks = layer_stack(base)
    except ConfigError:
        raise ConfigError(f"{setting}: finds no transformer blocks in {type(base).__name__}") from None
    depth = {id(p): i for i, block in enumerate(blocks, start=1) for p in block.parameters()}
    top = len(blocks) + 1
    encoder = getattr(base, base.base_model_prefix)
    # by where they sit, their names and types, not by the order the encoder registers its parts: GTE's and Nomic
    # BERT's register their pooler before their blocks, and run it after them
    holder = stack_name.split(".")[1]  # the encoder's child that holds the blocks
    tables = {id(p) for module in encoder.modules() if isinstance(module, torch.nn.Embedding)
              for p in module.parameters()}
    for name, param in encoder.named_parameters():
        serves_the_blocks = name.startswith(f"{holder}.") or "embed" in name.lower() or id(param) in tables
        depth.setdefault(id(param), 0 if serves_the_blocks else top)
    for param in model.parameters():
        depth.setdefault(id(param), top)
    return depth, len(blocks)
