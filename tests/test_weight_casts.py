"""``training.cast_once_per_update``: autocast's weight copies made once per window, the same update bitwise."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from finetune.config import OptimConfig
from finetune.loop import TrainState, train_one_epoch
from finetune.modeling import set_gradient_checkpointing
from finetune.optimization import build_optimizer, build_scheduler, plan_updates
from finetune.sampling import EpochSampler
from finetune.weight_casts import WeightCasts, casts_once_per_update
from helpers import pad_collate, tiny_bert, token_dataset

try:  # counting casts needs torch's dispatch mode, a private module
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover
    TorchDispatchMode = None

# 38 samples, b=4, k=3: windows of 3, 3, 3 and 1 micro-batches, the last micro-batch short
N, B_MICRO, K = 38, 4, 3


class WeightCastCounter(TorchDispatchMode or object):
    """Counts casts of the model's parameters to bf16, as dispatched below autograd."""

    def __init__(self, model) -> None:
        super().__init__()
        self.params = {p.data_ptr() for p in model.parameters()}
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                and args[0].data_ptr() in self.params):
            self.casts += 1
        return func(*args, **kwargs)


def _train(cast_once: bool, checkpointing: bool = False, epochs: int = 1, count: bool = False,
           loss_fn=None) -> dict:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=K, mixed_precision="bf16")
    model = tiny_bert(seed=0)
    set_gradient_checkpointing(model, checkpointing)
    opt_cfg = OptimConfig(learning_rate=1e-3, warmup_steps=1)
    optimizer = build_optimizer(model, opt_cfg)
    data = token_dataset(N, seed=1)
    dl = DataLoader(data, batch_size=B_MICRO, sampler=EpochSampler(N, seed=7, window_size=B_MICRO * K),
                    collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    scheduler = build_scheduler(optimizer, opt_cfg, plan_updates(len(dl), K, epochs, None, warmup_steps=1))
    snapshots, records = [], []

    def on_update(state):
        snapshots.append([p.detach().clone() for p in acc.unwrap_model(model).parameters()])
        return False

    counter = WeightCastCounter(model) if count else None
    state = TrainState()
    for epoch in range(epochs):
        with counter if counter is not None else nullcontext():
            train_one_epoch(model, optimizer, scheduler, dl, acc, epoch, state=state, max_grad_norm=1.0,
                            on_log=records.append, on_update=on_update, cast_once_per_update=cast_once,
                            loss_fn=loss_fn)
    return {"snapshots": snapshots, "records": records, "casts": counter.casts if counter else None,
            "model": model, "micro_batches": len(dl)}


def test_casting_once_per_update_trains_the_same_weights_bitwise(fresh_accelerate_state):
    every = _train(cast_once=False, epochs=2)
    once = _train(cast_once=True, epochs=2)
    assert len(once["snapshots"]) == len(every["snapshots"]) == 8  # 4 windows per epoch
    for update, (a, b) in enumerate(zip(every["snapshots"], once["snapshots"])):
        for pa, pb in zip(a, b):
            assert torch.equal(pa, pb), f"update {update}: weights differ"
    # the weights moved: copies of the first update's weights were not reused after it
    assert not torch.equal(once["snapshots"][0][5], once["snapshots"][-1][5])
    assert [r["train/loss"] for r in once["records"]] == [r["train/loss"] for r in every["records"]]


@pytest.mark.skipif(TorchDispatchMode is None, reason="torch's dispatch mode is gone")
def test_each_trainable_weight_is_cast_once_per_window_instead_of_once_per_micro_batch(fresh_accelerate_state):
    every = _train(cast_once=False, count=True)
    once = _train(cast_once=True, count=True)
    model = once["model"]
    # autocast casts the weights of the linear layers (matrices and biases); embeddings and norms stay fp32
    cast_per_pass = sum(2 for m in model.modules() if isinstance(m, torch.nn.Linear))
    windows, micro_batches = 4, once["micro_batches"]
    assert micro_batches == 10
    assert every["casts"] == cast_per_pass * micro_batches
    assert once["casts"] == cast_per_pass * windows


@pytest.mark.skipif(TorchDispatchMode is None, reason="torch's dispatch mode is gone")
def test_with_gradient_checkpointing_the_copies_are_made_per_micro_batch(fresh_accelerate_state):
    """Checkpointing saves no copy for the backward: keeping them for the window would raise the peak."""
    asked = _train(cast_once=True, checkpointing=True, count=True)
    model = asked["model"]
    cast_per_pass = sum(2 for m in model.modules() if isinstance(m, torch.nn.Linear))
    # each block's forward runs twice (the recompute in the backward); the pooler and head once
    blocks = sum(2 for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layer." in name)
    assert asked["casts"] == (cast_per_pass + blocks) * asked["micro_batches"]


def test_an_error_inside_a_window_leaves_autocast_as_it_was(fresh_accelerate_state):
    calls = {"n": 0}

    def failing_loss(logits, labels):
        calls["n"] += 1
        if calls["n"] == 2:  # the second micro-batch of the first window
            raise RuntimeError("boom")
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")

    with pytest.raises(RuntimeError, match="boom"):
        _train(cast_once=True, loss_fn=failing_loss)
    level = torch.autocast_increment_nesting()  # the level this call opens: 1 when none was left open
    torch.autocast_decrement_nesting()
    assert level == 1


def test_drop_empties_the_cache_under_a_callers_own_autocast(fresh_accelerate_state):
    """Inside a caller's autocast region the copies would outlive the window: drop empties the cache anyway."""
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        casts = WeightCasts(active=True)
        casts.keep()
        before = linear(x)
        casts.drop()
        with torch.no_grad():
            linear.weight.add_(1.0)
        after = linear(x)
    expected = torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16())
    assert torch.equal(after, expected) and not torch.equal(before, after)


@pytest.mark.parametrize("precision, engine, checkpointing, asked, expected", [
    ("bf16", "NO", False, True, True),
    ("fp16", "MULTI_GPU", False, True, True),
    ("bf16", "MULTI_CPU", False, True, True),
    ("no", "NO", False, True, False),  # fp32: no casts to keep
    ("bf16", "NO", False, False, False),  # turned off
    ("bf16", "NO", True, True, False),  # checkpointing: the copies would outlive the forward
    ("bf16", "FSDP", False, True, False),  # kept copies would hold every block's gathered weights
    ("bf16", "DEEPSPEED", False, True, False),  # keeps its own bf16 weights
])
def test_where_the_copies_are_kept(precision, engine, checkpointing, asked, expected):
    from accelerate.utils import DistributedType

    model = tiny_bert()
    set_gradient_checkpointing(model, checkpointing)
    accelerator = SimpleNamespace(mixed_precision=precision, distributed_type=DistributedType[engine],
                                  unwrap_model=lambda m: m)
    assert casts_once_per_update(accelerator, model, asked) is expected
