"""The gradient noise scale (finetune.noise_scale): its estimate against the value computed from every sample's
gradient, and the loop it rides in left as it was."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from finetune.loop import TrainState, train_one_epoch
from finetune.noise_scale import add_estimate, noise_unmeasured, small_batch_terms, window_estimates
from finetune.sampling import EpochSampler

ROWS, FEATURES = 2048, 6


class Linear(torch.nn.Module):
    """A linear regression of ``x``, answering as a transformers model does (``.logits``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(FEATURES, 1)
        with torch.no_grad():
            self.layer.weight.copy_(torch.linspace(-1.0, 1.0, FEATURES))
            self.layer.bias.fill_(0.5)

    def forward(self, x, attention_mask=None):
        return SimpleNamespace(logits=self.layer(x))


def squared_error(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.squeeze(-1) - labels) ** 2


def rows() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=generator)
    y = x @ torch.arange(1.0, FEATURES + 1) + 4 * torch.randn(ROWS, generator=generator)
    return [{"x": x[i], "labels": y[i], "attention_mask": torch.ones(1, dtype=torch.long)} for i in range(ROWS)]


def exact_noise_scale(model: Linear, data: list[dict[str, torch.Tensor]]) -> float:
    """``tr(S) / |G|^2`` from every row's own gradient: its covariance's trace over its mean's squared norm."""
    per_row = []
    for row in data:
        model.zero_grad()
        squared_error(model(row["x"][None]).logits, row["labels"][None]).sum().backward()
        per_row.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    grads = torch.stack(per_row)
    mean = grads.mean(0)
    return float(((grads - mean) ** 2).sum(1).mean() / mean.pow(2).sum())


def train(k: int, epochs: int, lr: float, noise: bool, b: int = 4):
    """The linear model trained by ``train_one_epoch`` on :func:`rows`, in windows of ``b`` x ``k`` x the processes
    launched (``tests/scaling_worker.py`` runs it on two); returns the model, the records and the state."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
    data = rows()
    model = Linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    window = b * k * accelerator.num_processes
    loader = DataLoader(data, batch_size=b, sampler=EpochSampler(len(data), seed=3, window_size=window))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state, records = TrainState(), []
    for epoch in range(epochs):
        records += train_one_epoch(model, optimizer, None, loader, accelerator, epoch, state=state,
                                   loss_fn=squared_error, noise_scale=noise).records
    return accelerator.unwrap_model(model), records, state


def test_the_estimate_is_the_noise_over_the_gradient_where_the_norms_are_their_expectations():
    """E|G_B|^2 = |G|^2 + tr(S) / B. With |G|^2 = 2 and tr(S) = 40, two processes whose first micro-batches hold 4
    and 8 of a window's 24 samples give back both, and their ratio, 20."""
    terms = sum(small_batch_terms(torch.tensor(2 + 40 / b), b, 24) for b in (4, 8))
    assert window_estimates(terms, 2 + 40 / 24, 24) == pytest.approx((2.0, 40.0))
    state = TrainState()
    assert state.noise_scale() is None
    for _ in range(5):
        add_estimate(state, *window_estimates(terms, 2 + 40 / 24, 24))
    assert state.noise_scale() == pytest.approx(20.0)
    add_estimate(state, float("nan"), 1.0)  # a window whose norm was not finite: nothing to learn
    assert state.noise_scale() == pytest.approx(20.0)


def test_the_loop_measures_the_noise_scale_every_samples_gradient_gives(fresh_accelerate_state, monkeypatch):
    """At a learning rate of 0 the gradients' distribution stays put: 8 epochs of windows of 4 micro-batches of 4
    rows, their running estimate against tr(S)/|G|^2 over all 2,048 rows' gradients."""
    exact = exact_noise_scale(Linear(), rows())
    monkeypatch.setattr("finetune.noise_scale.DECAY", 0.999)  # nearly a plain mean over the run's 1,024 updates
    _, records, state = train(k=4, epochs=8, lr=0.0, noise=True)
    assert 4 < exact < 2048  # a noise scale between the micro-batch and the data set
    assert records[-1]["train/noise_scale"] == pytest.approx(exact, rel=0.1)
    assert state.noise_scale() == records[-1]["train/noise_scale"]


def test_measuring_it_changes_no_update(fresh_accelerate_state):
    with_it, records, _ = train(k=4, epochs=2, lr=1e-3, noise=True)
    without, plain, _ = train(k=4, epochs=2, lr=1e-3, noise=False)
    for a, b in zip(with_it.parameters(), without.parameters()):
        assert torch.equal(a, b)
    assert "train/noise_scale" in records[-1] and all("train/noise_scale" not in r for r in plain)
    assert [r["train/loss"] for r in records] == [r["train/loss"] for r in plain]


def test_a_run_without_a_smaller_batch_or_with_gradients_it_cannot_read_says_why(fresh_accelerate_state):
    from accelerate import Accelerator

    plain = Accelerator(cpu=True)
    assert noise_unmeasured(plain, 4) is None
    assert "k=1" in noise_unmeasured(plain, 1)
    assert "CUDA graphs" in noise_unmeasured(plain, 4, graphs=object())
    from accelerate.utils import DistributedType

    assert "shards" in noise_unmeasured(SimpleNamespace(distributed_type=DistributedType.FSDP, scaler=None), 4)
    assert "fp16" in noise_unmeasured(SimpleNamespace(distributed_type=DistributedType.NO, scaler=object()), 4)
    _, records, state = train(k=1, epochs=1, lr=1e-3, noise=True)
    assert all("train/noise_scale" not in r for r in records) and state.noise_scale() is None


def test_a_run_says_its_noise_scale_each_epoch_logs_it_and_keeps_it(tmp_path, caplog):
    """logging.noise_scale through fit: each record's value is the state's moving averages' ratio, the epoch's line
    says it, metrics.json keeps the last one; a run without the setting measures nothing."""
    import json
    import logging

    from tiny_run import fit_tiny_run

    with caplog.at_level(logging.INFO, logger="finetune"):
        cfg, summary = fit_tiny_run(tmp_path / "on", logging={"noise_scale": True, "progress_bar": False})
    lines = [r.getMessage() for r in caplog.records if "epoch 1 done" in r.getMessage()]
    out = Path(cfg.output.output_dir)
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    values = [r["train/noise_scale"] for r in records if "train/noise_scale" in r]
    saved = json.loads((out / "metrics.json").read_text())["train"]["noise_scale"]
    assert len(lines) == 1 and "gradient noise scale " in lines[0] and "(effective batch 16" in lines[0]
    assert values and all(v > 0 for v in values) and saved == summary["train"]["noise_scale"]
    if saved is not None:
        assert saved == values[-1] and f"about {saved:.0f} samples" in lines[0]
    else:
        assert "beyond measure" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="finetune"):
        cfg, summary = fit_tiny_run(tmp_path / "off", training={"num_train_epochs": None, "max_steps": 2})
    assert summary["train"]["noise_scale"] is None
    assert not any("noise scale" in r.getMessage() for r in caplog.records)


def test_a_resumed_run_carries_the_estimate_on_as_if_it_had_not_stopped(tmp_path):
    """The moving averages are in the checkpoint: a run stopped after update 7 (of 20) and resumed logs, update by
    update, the noise scale of the run that was not stopped (a resume that started them over would not)."""
    import json

    from tiny_run import fit_tiny_run

    def logged(cfg) -> dict[int, float]:
        lines = (Path(cfg.output.output_dir) / "train_log.jsonl").read_text().splitlines()
        return {r["step"]: r["train/noise_scale"] for r in map(json.loads, lines) if "train/noise_scale" in r}

    sections = {"logging": {"noise_scale": True, "progress_bar": False}}
    whole, summary = fit_tiny_run(tmp_path / "whole", output={"checkpoint_every": 7}, **sections)
    fit_tiny_run(tmp_path / "part", on_update=lambda state: state.step >= 7, output={"checkpoint_every": 7},
                 **sections)
    part, resumed = fit_tiny_run(tmp_path / "part", output={"checkpoint_every": 7, "resume_from": "latest"},
                                 **sections)
    assert max(logged(whole)) == summary["train"]["updates"] > 7 + 2
    assert logged(part) == logged(whole) and resumed["train"]["noise_scale"] == summary["train"]["noise_scale"]
