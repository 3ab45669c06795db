"""``model.freeze_embeddings`` and ``model.freeze_blocks``: the bottom of the encoder kept as pretrained.

A frozen weight costs its value only: no gradient and no AdamW state. Below
the lowest trained block the backward pass has nothing to do either: autograd
keeps an operation's inputs only where a gradient flows through it, and none
flows into a frozen block whose input needs none, so a frozen block's
activations are not kept and it is not run backwards. The memory plan
measures the activations of the model as frozen, so it counts that.

Which weights a depth holds is :func:`finetune.depths.layer_depths`' count,
as the layer-wise learning rates use it, for every supported family: depth 0
is the embeddings and what runs before the first block (ELECTRA's and
ALBERT's projections, DeBERTa's relative-position table), 1 to ``L`` the
blocks from the bottom. Frozen blocks freeze the embeddings below them too:
training those would send a gradient back through every frozen block, which
keeps all their activations. The weights that train get the big batch's
update, as in any run (``tests/test_accumulation.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from finetune.depths import layer_depths
from finetune.errors import ConfigError


@dataclass(frozen=True)
class Frozen:
    """What was frozen: the blocks (the embeddings always), and the weights frozen of all the model's."""

    blocks: int
    frozen: int
    total: int

    def describe(self) -> str:
        """``frozen=embeddings+blocks 1-4 (31% of the weights)``"""
        return f"frozen={self.what()} ({100 * self.frozen / self.total:.0f}% of the weights)"

    def what(self) -> str:
        """``embeddings+blocks 1-4``"""
        return "embeddings" + (f"+blocks 1-{self.blocks}" if self.blocks > 1 else "+block 1" if self.blocks else "")

    def record(self) -> dict:
        """For ``metrics.json`` (and the model card): what was frozen, and the weights frozen of all."""
        return {"embeddings": True, "blocks": self.blocks, "frozen_weights": self.frozen, "total_weights": self.total}


def freeze_bottom(model, freeze_embeddings: bool, freeze_blocks: int) -> Optional[Frozen]:
    """Stop the embeddings, and the lowest ``freeze_blocks`` blocks, from training (``None``: nothing asked).

    Raises:
        ConfigError: for a model whose blocks cannot be found, or more blocks than it has.
    """
    if not freeze_embeddings and not freeze_blocks:
        return None
    key = "model.freeze_blocks" if freeze_blocks else "model.freeze_embeddings"
    depth, blocks = layer_depths(model, setting=key)
    if freeze_blocks > blocks:
        raise ConfigError(f"model.freeze_blocks: {freeze_blocks}, but {type(model).__name__} has {blocks} "
                          f"transformer block{'s' if blocks != 1 else ''}; at most {blocks}, which trains the "
                          f"head alone")
    frozen = 0
    for param in model.parameters():
        if depth[id(param)] <= freeze_blocks:
            param.requires_grad_(False)
            frozen += param.numel()
    return Frozen(freeze_blocks, frozen, sum(p.numel() for p in model.parameters()))
