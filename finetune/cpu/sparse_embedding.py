"""The word embedding's gradient as rows, added into one dense buffer.

A dense embedding backward allocates and zeroes a gradient of the whole
vocabulary on every micro-batch (30522 x 384 floats, 47 MB, for MiniLM) and
adds it into the accumulated one, though a micro-batch of short texts touches
a few hundred rows. With ``nn.Embedding(sparse=True)`` torch's backward
returns just those rows. Clipping and the fused AdamW need a dense gradient,
so a hook adds the rows into a dense buffer as soon as autograd has
accumulated them: the same sums the dense backward gives, to float rounding.
The buffer is reused for as long as the switch is on, so it is neither
reallocated nor faulted in again update after update.

Torch has no "sparse backward, dense gradient" option, hence this switch. It
uses only public APIs (``Embedding.sparse``,
``Tensor.register_post_accumulate_grad_hook``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


def sparse_capable_embedding(model) -> Optional[torch.nn.Embedding]:
    """The model's input (word) embedding if its gradient may be made sparse, else ``None``.

    ``None`` when the input embedding is not an ``nn.Embedding``, is frozen,
    has ``max_norm`` (which renormalises rows in the forward pass), or shares
    its weight with another module (tied weights would mix a sparse and a
    dense gradient).
    """
    model = getattr(model, "module", model)  # DDP's wrapper
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embedding, torch.nn.Embedding) or embedding.max_norm is not None:
        return None
    weight = embedding.weight
    if not weight.requires_grad:
        return None
    if sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is weight) != 1:
        return None
    return embedding


class DenseGradBuffer:
    """One reused dense buffer into which a parameter's sparse gradient is added."""

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None

    def densify(self, param: torch.Tensor) -> None:
        """Replace ``param.grad`` by its dense equivalent when it is sparse (a post-accumulate-grad hook)."""
        grad = param.grad
        if grad is None or not grad.is_sparse:
            return  # already dense: autograd added this micro-batch's rows into the buffer
        buf = self.buffer
        if buf is None or buf.shape != param.shape or buf.dtype != grad.dtype or buf.device != grad.device:
            buf = self.buffer = torch.empty(param.shape, dtype=grad.dtype, device=grad.device)
        buf.zero_()
        buf.add_(grad)  # dense += sparse: index_add of the rows, duplicates summed
        param.grad = buf


@contextlib.contextmanager
def sparse_embedding_rows(embedding: torch.nn.Embedding) -> Iterator[DenseGradBuffer]:
    """Inside, ``embedding``'s backward returns rows and its ``.grad`` is always dense after a backward pass.

    The first backward of a window finds no gradient and leaves the rows as
    a sparse gradient: the hook moves them into the buffer. Every later
    micro-batch's rows are added by autograd into that dense gradient. On
    exit the embedding is as it was.
    """
    buffer = DenseGradBuffer()
    was_sparse = embedding.sparse
    embedding.sparse = True
    handle = embedding.weight.register_post_accumulate_grad_hook(buffer.densify)
    try:
        yield buffer
    finally:
        handle.remove()
        embedding.sparse = was_sparse
