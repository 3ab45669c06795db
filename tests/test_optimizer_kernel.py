"""``optim.implementation``: which AdamW kernel runs, and that the fused one is the same AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from finetune.config import OptimConfig
from finetune.errors import ConfigError
from finetune.optimization import adamw_kernel, build_optimizer
from helpers import pad_collate, tiny_bert, token_dataset


def test_auto_picks_the_fused_kernel_where_torch_has_one():
    model = tiny_bert()
    optimizer = build_optimizer(model, OptimConfig())
    # torch >= 2.4 has a fused AdamW for the CPU: auto must use it here
    assert optimizer.defaults["fused"] is True
    loop = build_optimizer(model, OptimConfig(implementation="for_loop"))
    assert (loop.defaults["fused"], loop.defaults["foreach"]) == (False, False)
    assert build_optimizer(model, OptimConfig(implementation="foreach")).defaults["foreach"] is True
    # a device without a fused kernel: auto falls back to torch's choice, forcing it is a config error
    assert adamw_kernel("auto", "no-such-device") == {}
    with pytest.raises(ConfigError, match="optim.implementation: this torch has no fused AdamW for no-such-device"):
        adamw_kernel("fused", "no-such-device")


def test_fused_kernel_makes_the_same_updates_as_the_loop():
    """Same AdamW (decay groups, bias correction) whatever the kernel, to float tolerance."""
    data = pad_collate(token_dataset(16, seed=2))
    labels = data.pop("labels")
    weights = {}
    for implementation in ("for_loop", "fused"):
        model = tiny_bert(seed=0)
        optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-2, weight_decay=1.0,
                                                       implementation=implementation))
        for _ in range(3):
            F.cross_entropy(model(**data).logits, labels).backward()
            optimizer.step()
            optimizer.zero_grad()
        weights[implementation] = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = dict(tiny_bert(seed=0).named_parameters())
    for name, tensor in weights["fused"].items():
        # rounding differs (the kernels order the arithmetic differently), the update does not
        torch.testing.assert_close(tensor, weights["for_loop"][name], rtol=1e-4, atol=1e-5)
    # the updates were not empty: the comparison is not between two untouched models
    moved = max((weights["fused"][n] - p.detach()).abs().max().item() for n, p in start.items())
    assert moved > 1e-3
