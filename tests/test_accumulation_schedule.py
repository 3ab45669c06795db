"""``training.accumulation_schedule``: ``k`` that changes with the epoch, the contract kept in every epoch.

A schedule ``{0: 4, 1: 2}`` with ``b = 8`` must train the weights of a run
whose epoch 0 updates on big batches of 32 and epoch 1 on big batches of 16,
with one learning-rate schedule sized in the updates both epochs really make.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from finetune.accumulation import AccumulationSchedule, Batching, resolve_batching
from finetune.config import OptimConfig, config_from_dict
from finetune.errors import ConfigError
from finetune.loop import TrainState, train_one_epoch
from finetune.optimization import build_optimizer, build_scheduler, plan_updates
from finetune.sampling import EpochSampler
import forked
from helpers import REPO, offline_env, pad_collate, tiny_bert, token_dataset, write_sms_job

# 76 samples, b=8: 10 micro-batches per epoch. k=4: windows 4, 4, 2 (3 updates); k=2: 5 updates.
N = 76
SCHEDULE = AccumulationSchedule.from_dict({0: 4, 1: 2})


def test_plan_counts_each_epochs_updates_with_its_own_k():
    plan = plan_updates(10, SCHEDULE, 3, None, warmup_ratio=0.1)
    assert plan.epoch_updates == (3, 5, 5) and plan.accumulation == (4, 2, 2)
    assert plan.total_updates == 13 and plan.warmup_updates == 2
    assert [plan.k_at(e) for e in range(5)] == [4, 2, 2, 2, 2]
    # a fractional last epoch counts its share of that epoch's updates
    assert plan_updates(10, SCHEDULE, 1.5, None).total_updates == 3 + 3
    # max_steps: as many epochs as the updates need, counted with each epoch's k
    plan = plan_updates(10, SCHEDULE, None, 6)
    assert (plan.num_epochs, plan.total_updates, plan.epoch_updates) == (2, 6, (3, 5))
    # no schedule: what one k always gave
    plan = plan_updates(10, 4, 2, None)
    assert (plan.epoch_updates, plan.accumulation, plan.total_updates) == ((3, 3), (4, 4), 6)


def _prepared(acc, model, optimizer, data, b, window):
    sampler = EpochSampler(len(data), seed=7, window_size=window)
    return acc.prepare(model, optimizer, DataLoader(data, batch_size=b, sampler=sampler, collate_fn=pad_collate))


def _train(batch_sizes: dict[int, int], ks: dict[int, int]):
    """Two epochs; epoch e uses micro-batch ``batch_sizes[e]`` and ``k = ks[e]``; weights after every update."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=ks[0])
    data = token_dataset(N, seed=1)
    model = tiny_bert(seed=0)
    opt_cfg = OptimConfig(learning_rate=1e-3, warmup_steps=1, weight_decay=0.01)
    optimizer = build_optimizer(model, opt_cfg)
    windows = {e: batch_sizes[e] * ks[e] for e in ks}
    loaders = {}
    for epoch, b in batch_sizes.items():
        model, optimizer, loaders[epoch] = _prepared(acc, model, optimizer, data, b, windows)
    # the plan of the small-batch run: both runs make its updates, on one schedule
    plan = plan_updates(-(-N // 8), SCHEDULE, 2, None, warmup_steps=1)
    plan = dataclasses.replace(plan, schedule=AccumulationSchedule.from_dict(ks))  # same updates, this run's k
    scheduler = build_scheduler(optimizer, opt_cfg, plan)
    calls = []
    step = scheduler.step
    scheduler.step = lambda *a, **kw: (calls.append(1), step(*a, **kw))[1]
    snapshots, records, state = [], [], TrainState()

    def on_update(_state):
        snapshots.append({n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()})

    for epoch in (0, 1):
        acc.gradient_accumulation_steps = plan.k_at(epoch)
        train_one_epoch(model, optimizer, scheduler, loaders[epoch], acc, epoch, state=state,
                        on_log=records.append, on_update=on_update)
    return dict(snapshots=snapshots, records=records, plan=plan, calls=len(calls), state=state,
                lr=optimizer.param_groups[0]["lr"])


def test_a_schedule_trains_the_weights_of_the_big_batches(fresh_accelerate_state):
    small = _train({0: 8, 1: 8}, {0: 4, 1: 2})
    big = _train({0: 32, 1: 16}, {0: 1, 1: 1})
    assert small["plan"].total_updates == len(small["snapshots"]) == len(big["snapshots"]) == 3 + 5
    for update, (a, b) in enumerate(zip(small["snapshots"], big["snapshots"])):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"update {update}, {name}: {m}")
    # one scheduler step per update, and the linear schedule ends at 0 exactly at the last one
    assert small["calls"] == small["state"].step == 8
    assert small["lr"] == 0.0 and min(r["train/lr"] for r in small["records"][1:]) > 0  # 0 only after the last
    # each record says the k and the effective batch its update used
    assert [(r["train/accumulation_steps"], r["train/effective_batch_size"]) for r in small["records"]] == (
        [(4, 32)] * 3 + [(2, 16)] * 5)
    assert [r["train/loss"] for r in small["records"]] == pytest.approx([r["train/loss"] for r in big["records"]],
                                                                        rel=1e-5)


def test_a_notebook_k_change_without_a_schedule_is_refused_with_the_way_to_do_it(fresh_accelerate_state):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = tiny_bert(seed=0)
    opt_cfg = OptimConfig(learning_rate=1e-3)
    optimizer = build_optimizer(model, opt_cfg)
    model, optimizer, dl = _prepared(acc, model, optimizer, token_dataset(N, seed=1), 8, 32)
    plan = plan_updates(len(dl), SCHEDULE, 2, None)
    scheduler = build_scheduler(optimizer, opt_cfg, plan)
    acc.gradient_accumulation_steps = 4
    state = TrainState()
    train_one_epoch(model, optimizer, scheduler, dl, acc, 0, state=state, plan=plan)
    # epoch 1 was planned at k=2: keeping 4 would end the schedule early
    with pytest.raises(ValueError, match=r"epoch 1: the learning-rate scheduler was sized for k=2.*accumulates 4"):
        train_one_epoch(model, optimizer, scheduler, dl, acc, 1, state=state, plan=plan)


def test_the_sampler_groups_each_epoch_within_its_own_windows():
    lengths = [int(x) for x in torch.randint(1, 100, (200,), generator=torch.Generator().manual_seed(0))]
    sampler = EpochSampler(200, seed=3, lengths=lengths, group_by_length=True, window_size={0: 32, 1: 16})
    for epoch, window in ((0, 32), (1, 16), (5, 16)):
        sampler.set_epoch(epoch)
        order = sampler.order()
        assert sorted(order) == list(range(200))
        chunks = [order[i:i + window] for i in range(0, 200, window)]
        assert all([lengths[i] for i in c] == sorted((lengths[i] for i in c), reverse=True) for c in chunks)
        # and not within larger ones: some window boundary breaks the descending order of 2 windows
        pairs = [order[i:i + 2 * window] for i in range(0, 200 - 2 * window, 2 * window)]
        assert any([lengths[i] for i in p] != sorted((lengths[i] for i in p), reverse=True) for p in pairs)


def _training(**training):
    return config_from_dict({"data": {"train_file": "x.tsv"}, "training": training}).training


def test_the_schedule_resolves_over_the_configured_k():
    # epochs before the first key use the configured k; the config's own spelling of k works
    t = _training(per_device_train_batch_size=8, gradient_accumulation_steps=4, accumulation_schedule={2: 1})
    assert resolve_batching(t, 1).schedule.changes == ((0, 4), (2, 1))
    t = _training(per_device_train_batch_size=8, accumulation_schedule={0: 4, 3: 2})
    batching = resolve_batching(t, 2)
    assert batching == Batching(8, 4, 2, AccumulationSchedule.from_dict({0: 4, 3: 2}))
    # one object answers every question about k: the windows the sampler groups by, B of each epoch
    assert [batching.k_at(e) for e in range(5)] == [4, 4, 4, 2, 2]
    assert batching.window_sizes() == {0: 64, 3: 32}
    assert [batching.effective_batch_size_at(e) for e in (0, 3)] == [64, 32]
    # YAML or JSON may quote the epochs
    assert _training(accumulation_schedule={"0": 3}).accumulation_schedule == {0: 3}


@pytest.mark.parametrize("training, message", [
    ({"accumulation_schedule": {0: 0}}, r"training.accumulation_schedule: k must be >= 1, got 0 for epoch 0"),
    ({"accumulation_schedule": {-1: 2}}, r"training.accumulation_schedule: epoch -1 is negative"),
    ({"accumulation_schedule": {}}, r"training.accumulation_schedule: empty"),
    ({"accumulation_schedule": [4, 2]}, r"training.accumulation_schedule: expected mapping of int to int"),
    ({"accumulation_schedule": {0: "four"}}, r"training.accumulation_schedule\[0\]: expected int"),
    ({"accumulation_schedule": {0: 2}, "per_device_train_batch_size": "auto", "effective_batch_size": 32},
     r"training.accumulation_schedule: needs a fixed per_device_train_batch_size"),
])
def test_a_bad_schedule_is_one_line_naming_the_key(training, message):
    with pytest.raises(ConfigError, match=message):
        _training(**training)


def test_a_schedule_that_contradicts_k_is_refused():
    t = _training(per_device_train_batch_size=8, effective_batch_size=64, accumulation_schedule={0: 2, 1: 4})
    with pytest.raises(ConfigError, match=r"epoch 0 accumulates 2, but training.effective_batch_size 64 gives k=8"):
        resolve_batching(t, 1)


# --------------------------------------------------------------------------- end to end, with resume

@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    """A run of 48 training rows, b=4 (12 micro-batches): k=3 in epoch 0 (4 updates), k=2 after (6 updates)."""
    root = tmp_path_factory.mktemp("schedule")
    path = write_sms_job(
        root,
        training={"per_device_train_batch_size": 4, "accumulation_schedule": {0: 3, 1: 2}, "num_train_epochs": 2},
        optim={"warmup_steps": 1},
        output={"checkpoint_every": 2},
    )
    reference = root / "reference"
    proc = _run(path, reference)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, path, reference


def _run(cfg, out, *overrides, **env):
    return forked.run([sys.executable, str(REPO / "tests" / "interrupt_worker.py"), "--config", str(cfg),
                       f"output.output_dir={out}", *overrides],
                      env=offline_env({"FINETUNE_CPU_THREADS": "1", **env}), timeout=240)


def _records(out):
    timing = {"train/samples_per_s", "train/tokens_per_s"}
    lines = (out / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]


@pytest.mark.slow
def test_a_scheduled_run_logs_its_k_and_makes_the_planned_updates(scheduled):
    root, cfg, reference = scheduled
    train = [r for r in _records(reference) if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 11))
    assert [r["train/accumulation_steps"] for r in train] == [3] * 4 + [2] * 6
    assert [r["train/effective_batch_size"] for r in train] == [12] * 4 + [8] * 6
    assert train[-1]["train/samples"] == 2 * 48
    metrics = json.loads((reference / "metrics.json").read_text())
    assert metrics["train"]["updates"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("stop_at, epoch, micro_batch", [(2, 0, 6), (7, 1, 6)])
def test_a_scheduled_run_resumed_in_either_phase_is_bitwise_the_same(scheduled, stop_at, epoch, micro_batch):
    root, cfg, reference = scheduled
    out = root / f"stopped-{stop_at}"
    proc = _run(cfg, out, FINETUNE_TEST_SIGNAL=f"{stop_at}:SIGTERM")
    assert proc.returncode == 143, proc.stderr[-3000:]
    meta = json.loads((out / "checkpoints" / f"checkpoint-{stop_at}" / "trainer_state.json").read_text())
    assert (meta["state"]["epoch"], meta["state"]["micro_batch"]) == (epoch, micro_batch)
    proc = _run(cfg, out, "output.resume_from=latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert _records(out) == _records(reference)
