"""``training.on_nonfinite``: stop or skip on a NaN loss, injected at a chosen micro-batch (in-process)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from finetune.config import OptimConfig
from finetune.loop import NonFiniteLossError, TrainState, train_one_epoch
from finetune.optimization import build_optimizer, build_scheduler, plan_updates
from finetune.sampling import EpochSampler
from helpers import pad_collate, tiny_bert, token_dataset

# 24 samples, b=4, k=2: micro-batches 0..5, windows (updates) [0,1] [2,3] [4,5]
N, B_MICRO, K = 24, 4, 2


def _setup(nan_at: set[int]):
    """A tiny BERT whose forward returns NaN logits at the training micro-batches in ``nan_at``."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=K)
    data = token_dataset(N, seed=2)
    model = tiny_bert(seed=0)
    calls = {"n": 0}

    def hook(module, args, output):
        j = calls["n"]
        calls["n"] += 1
        if j in nan_at:
            output.logits = output.logits * float("nan")  # keeps the graph: backward runs as for a real NaN
        return output

    model.register_forward_hook(hook)
    opt_cfg = OptimConfig(learning_rate=1e-3, warmup_steps=0)
    optimizer = build_optimizer(model, opt_cfg)
    dl = DataLoader(data, batch_size=B_MICRO, sampler=EpochSampler(N, seed=3, window_size=B_MICRO * K),
                    collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    scheduler = build_scheduler(optimizer, opt_cfg, plan_updates(len(dl), K, 1, None))
    return acc, model, optimizer, scheduler, dl


def _params(acc, model):
    return {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}


def test_stop_names_update_and_micro_batch_and_keeps_weights(fresh_accelerate_state):
    acc, model, optimizer, scheduler, dl = _setup(nan_at={3})
    after = []
    state = TrainState()
    with pytest.raises(NonFiniteLossError) as err:
        train_one_epoch(model, optimizer, scheduler, dl, acc, 0, state=state, on_nonfinite="stop",
                        on_update=lambda s: after.append(_params(acc, model)) or False)
    assert "update 2" in err.value.message and "micro-batch 3" in err.value.message
    assert err.value.exit_code == 3
    assert state.step == 1 and len(after) == 1
    # the bad window was not applied: the weights are still those after update 1
    for name, value in _params(acc, model).items():
        assert torch.equal(value, after[0][name]), name
    assert scheduler.last_epoch == 1


def test_skip_drops_the_update_and_counts_it(fresh_accelerate_state):
    acc, model, optimizer, scheduler, dl = _setup(nan_at={2})
    seen = []

    def on_update(state):
        grads = [p.grad for p in acc.unwrap_model(model).parameters()]
        # cleared: freed, or at k > 1 zeroed in place (kept between updates); a NaN left would poison the next
        cleared = all(g is None or (not g.is_sparse and bool((g == 0).all())) for g in grads)
        seen.append((state.step, state.skipped_updates, _params(acc, model), cleared))
        return False

    records = []
    state = TrainState()
    result = train_one_epoch(model, optimizer, scheduler, dl, acc, 0, state=state, on_nonfinite="skip",
                             max_skipped=2, on_update=on_update, on_log=records.append)
    assert [(s, k) for s, k, _, _ in seen] == [(1, 0), (1, 1), (2, 1)]
    # window 2 changed nothing: no optimizer step, and its gradients were zeroed
    for name, value in seen[1][2].items():
        assert torch.equal(value, seen[0][2][name]), name
    assert seen[1][3]
    assert not any(torch.equal(v, seen[1][2][n]) for n, v in seen[2][2].items() if n.startswith("classifier"))
    assert scheduler.last_epoch == 2  # stepped on the two real updates only
    assert result.updates == 2 and result.skipped == 1
    assert state.skipped_updates == 1 and state.skipped_in_row == 0
    assert [r["step"] for r in records] == [1, 2]
    assert [r["train/skipped_updates"] for r in records] == [0, 1]


def test_skip_stops_after_max_skipped_in_a_row(fresh_accelerate_state):
    acc, model, optimizer, scheduler, dl = _setup(nan_at=set(range(6)))
    state = TrainState()
    with pytest.raises(NonFiniteLossError, match="2 updates in a row"):
        train_one_epoch(model, optimizer, scheduler, dl, acc, 0, state=state, on_nonfinite="skip", max_skipped=2)
    assert state.step == 0 and state.skipped_updates == 2


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_finite_loss_with_nan_gradient_is_not_applied(fresh_accelerate_state, policy):
    """A NaN gradient behind a finite loss must not reach the weights."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from finetune.config import OptimConfig
    from finetune.optimization import build_optimizer
    from finetune.sampling import EpochSampler
    from helpers import pad_collate, tiny_bert, token_dataset

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    data = token_dataset(32, seed=2)
    model = tiny_bert(seed=0)
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-3))
    dl = DataLoader(data, batch_size=4, sampler=EpochSampler(32, seed=1), collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    weight = acc.unwrap_model(model).classifier.weight
    calls = {"n": 0}

    def poison_second_window(grad):  # micro-batches 2 and 3 form update 2
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 3 else grad

    weight.register_hook(poison_second_window)
    snapshots = []
    state = TrainState()

    def on_update(s):
        snapshots.append(weight.detach().clone())

    if policy == "stop":
        with pytest.raises(NonFiniteLossError, match=r"non-finite gradient norm \(nan\) at update 2"):
            train_one_epoch(model, optimizer, None, dl, acc, 0, state=state, on_update=on_update,
                            on_nonfinite="stop")
        assert state.step == 1
        assert torch.equal(weight.detach(), snapshots[0])  # the poisoned update never happened
    else:
        result = train_one_epoch(model, optimizer, None, dl, acc, 0, state=state, on_update=on_update,
                                 on_nonfinite="skip", max_skipped=3)
        assert result.skipped == 1 and result.updates == 3 and state.skipped_updates == 1
        assert torch.isfinite(weight).all()
        assert all(torch.isfinite(s).all() for s in snapshots)


def test_a_lowered_grad_scale_counts_as_a_skipped_step():
    """A fused optimizer runs its step under fp16 and skips the update in its kernel: the scale tells."""
    from types import SimpleNamespace

    from finetune.loop import step_was_skipped

    class Scaler:
        def __init__(self, scale: float):
            self.scale = scale

        def get_scale(self) -> float:
            return self.scale

    lowered = SimpleNamespace(optimizer_step_was_skipped=False, scaler=Scaler(2.0**15))
    assert step_was_skipped(lowered, scale_before=2.0**16)
    assert not step_was_skipped(lowered, scale_before=2.0**15)  # kept (or grown): the step happened
    assert step_was_skipped(SimpleNamespace(optimizer_step_was_skipped=True, scaler=None), None)
    assert not step_was_skipped(SimpleNamespace(optimizer_step_was_skipped=False, scaler=None), None)


def test_a_window_skipped_for_its_loss_under_fp16_closes_the_grad_scalers_step():
    """The loop clips before it reads the window's loss (one transfer brings both), and under fp16 clipping
    unscales the gradients, which opens a step of the grad scaler. A window then skipped for its loss must
    close that step, or the next window's clipping fails ("unscale_() has already been called")."""
    from types import SimpleNamespace

    from finetune.loop import apply_update, clip_gradients

    model = torch.nn.Linear(3, 1)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    def clip_grad_norm_(parameters, max_norm):  # what Accelerate's does under fp16: unscale, then clip
        scaler.unscale_(optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    accelerator = SimpleNamespace(scaler=scaler, optimizer_step_was_skipped=False, clip_grad_norm_=clip_grad_norm_)
    nan_loss = torch.tensor([float("nan"), 2.0, 6.0], dtype=torch.float64)
    for _ in range(3):
        scaler.scale(model(torch.full((2, 3), float("nan"))).sum()).backward()
        norm = clip_gradients(model, accelerator, max_grad_norm=1.0)
        update = apply_update(optimizer, None, accelerator, nan_loss, float(norm))
        assert update.what == "loss" and not update.applied
        optimizer.zero_grad()
    assert torch.equal(model.weight, before)
    assert scaler.get_scale() == 4.0 * 0.5**3  # each skipped window's non-finite gradient lowered the scale


def test_a_step_the_grad_scaler_skips_leaves_the_weights_and_the_schedule_where_they_were():
    """Under fp16 a finite loss can overflow in the backward: the grad scaler skips the optimizer's step, and the
    schedule must not advance for an update that did not happen (a fused optimizer is called and skips inside its
    kernel, so only the lowered scale tells). The next window's step moves both."""
    from types import SimpleNamespace

    from finetune.loop import apply_update, clip_gradients

    model = torch.nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda update: 1.0 / (update + 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    class ScaledOptimizer:  # what Accelerate's optimizer does under fp16
        param_groups = inner.param_groups

        def step(self):
            scaler.step(inner)
            scaler.update()

    def clip_grad_norm_(parameters, max_norm):
        scaler.unscale_(inner)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    accelerator = SimpleNamespace(scaler=scaler, optimizer_step_was_skipped=False, clip_grad_norm_=clip_grad_norm_)
    finite_loss = torch.tensor([3.0, 2.0, 6.0], dtype=torch.float64)
    before = model.weight.detach().clone()
    for overflow, updates_made in ((True, 0), (False, 1)):
        scaler.scale(model(torch.ones(2, 3)).sum() * (float("inf") if overflow else 1.0)).backward()
        norm = clip_gradients(model, accelerator, max_grad_norm=None)
        update = apply_update(ScaledOptimizer(), scheduler, accelerator, finite_loss, float(norm))
        assert update.applied  # a finite loss: the scaler, not the loop, decides
        assert scheduler.last_epoch == updates_made
        assert torch.equal(model.weight, before) == overflow
        inner.zero_grad()
    assert scaler.get_scale() == 2.0  # halved once, by the overflow


def test_a_resume_inside_a_window_is_refused(fresh_accelerate_state):
    """A state that stopped inside a window (a notebook's, or a resume under another k) would split the window's
    update in two: the epoch is refused before any micro-batch runs."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = tiny_bert(seed=0)
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-3))
    dl = DataLoader(token_dataset(40, seed=1), batch_size=4, collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"cannot resume at micro-batch 6: not a window boundary \(k=4\)"):
        train_one_epoch(model, optimizer, None, dl, acc, 0, state=TrainState(micro_batch=6))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
