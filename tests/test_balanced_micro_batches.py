"""Balanced micro-batches: each window cut where it pads least, with the same updates as one big batch.

``data.balance_micro_batches`` moves the cut points inside each length-sorted
window; the window, and so the update, must not change. These tests check the
cut (fewest padded tokens, against a brute force), its bounds (memory no
higher than the equal cut's), and the contract itself: ``(b, k)`` with
balanced cuts equals ``(b*k, 1)`` after every update, ragged window included.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader

from finetune.accumulation import SizedLayout
from finetune.config import OptimConfig
from finetune.errors import ConfigError
from finetune.loop import TrainState, train_one_epoch
from finetune.optimization import build_optimizer, build_scheduler, plan_updates
from finetune.sampling import BalancedBatches, EpochSampler, least_padding_sizes
from helpers import pad_collate, tiny_bert, token_dataset

N = 76  # b=8: 10 micro-batches, windows of 4, 4 and 2 at k=4: a ragged last window


def _padded(lengths, sizes):
    """Padded tokens of consecutive micro-batches of ``sizes`` over ``lengths`` (longest first)."""
    total, start = 0, 0
    for size in sizes:
        total += size * lengths[start]
        start += size
    return total


def _fewest_padded(lengths, groups, cap):
    """Brute force over every cut: the fewest padded tokens with each micro-batch within ``cap``."""
    best = None
    for cuts in itertools.combinations(range(1, len(lengths)), groups - 1):
        bounds = (0, *cuts, len(lengths))
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        if max(size * lengths[start] for start, size in zip(bounds, sizes)) <= cap:
            padded = _padded(lengths, sizes)
            best = padded if best is None else min(best, padded)
    return best


def test_the_cut_pads_least_within_the_cap_against_a_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 11)
        groups = rng.randint(1, n)
        b = -(-n // groups)
        lengths = sorted((rng.randint(1, 60) for _ in range(n)), reverse=True)
        cap = b * lengths[0]
        sizes = least_padding_sizes(lengths, groups, cap)
        assert len(sizes) == groups and sum(sizes) == n and min(sizes) >= 1
        assert _padded(lengths, sizes) == _fewest_padded(lengths, groups, cap)
        start = 0
        for size in sizes:
            assert size * lengths[start] <= cap
            start += size


def test_short_texts_go_in_larger_micro_batches():
    # one long text and seven short ones, two micro-batches of an equal cut of 4
    lengths = [100, 10, 10, 10, 10, 10, 10, 10]
    assert _padded(lengths, [4, 4]) == 440
    sizes = least_padding_sizes(lengths, 2, cap=4 * 100)
    assert sizes == [1, 7] and _padded(lengths, sizes) == 170


def test_an_impossible_cap_is_refused():
    with pytest.raises(ValueError, match="no cut of 3 samples into 1 micro-batches"):
        least_padding_sizes([10, 10, 10], 1, cap=20)


def _sampler(lengths, window):
    return EpochSampler(len(lengths), seed=7, lengths=lengths, group_by_length=True, window_size=window)


def test_balanced_batches_keep_each_window_and_pad_less_than_equal_cuts():
    data = token_dataset(N, seed=1)
    lengths = [len(x["input_ids"]) for x in data]
    balanced = BalancedBatches(_sampler(lengths, 32), batch_size=8)
    for epoch in range(3):
        balanced.set_epoch(epoch)
        equal_sampler = _sampler(lengths, 32)
        equal_sampler.set_epoch(epoch)
        order = equal_sampler.order()
        equal = [order[i:i + 8] for i in range(0, N, 8)]
        batches = balanced.micro_batches()
        assert len(batches) == len(equal) == len(balanced) == 10
        sizes = balanced.sizes()
        assert sizes != [8] * 9 + [4]  # the cuts really moved
        for first, stop in ((0, 4), (4, 8), (8, 10)):  # the same samples in each window
            assert sorted(sum(batches[first:stop], [])) == sorted(sum(equal[first:stop], []))
            cap = 8 * max(lengths[i] for i in sum(equal[first:stop], []))
            assert all(len(b) * max(lengths[i] for i in b) <= cap for b in batches[first:stop])

        def padded(bs):
            return sum(len(b) * max(lengths[i] for i in b) for b in bs)

        assert padded(batches) < padded(equal)
        layout = SizedLayout(tuple(sizes), batch_size=8)
        assert [layout.real_in_window(a, b) for a, b in layout.windows(4)] == [32, 32, 12]


def test_the_cut_counts_the_tokens_as_the_collator_pads_them():
    """Padded to a multiple of 8 (``data.pad_to_multiple_of``), no micro-batch holds more tokens than the window's
    equal cut; a cut that counted the texts' own lengths would put more there."""
    data = token_dataset(N, seed=1)
    lengths = [len(x["input_ids"]) for x in data]

    def padded(batch):  # its tokens as the collator pads them
        return len(batch) * -(-max(lengths[i] for i in batch) // 8) * 8

    over = {}
    for multiple in (8, None):
        balanced = BalancedBatches(_sampler(lengths, 32), batch_size=8, pad_to_multiple_of=multiple)
        over[multiple] = 0
        for epoch in range(3):
            balanced.set_epoch(epoch)
            batches = balanced.micro_batches()
            for first, stop in ((0, 4), (4, 8), (8, 10)):
                cap = 8 * -(-max(lengths[i] for batch in batches[first:stop] for i in batch) // 8) * 8
                over[multiple] += sum(padded(batch) > cap for batch in batches[first:stop])
    assert over[8] == 0 and over[None] > 0


def _run(b: int, k: int, balanced: bool, epochs: int = 2, max_grad_norm=None):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=k)
    data = token_dataset(N, seed=1)
    lengths = [len(x["input_ids"]) for x in data]
    model = tiny_bert(seed=0)
    opt_cfg = OptimConfig(learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.01)
    optimizer = build_optimizer(model, opt_cfg)
    sampler = _sampler(lengths, b * k)
    if balanced:
        dl = DataLoader(data, batch_sampler=BalancedBatches(sampler, b), collate_fn=pad_collate)
    else:
        dl = DataLoader(data, batch_size=b, sampler=sampler, collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    plan = plan_updates(len(dl), k, epochs, None, warmup_steps=1)
    scheduler = build_scheduler(optimizer, opt_cfg, plan)
    rows, snapshots, records = [], [], []
    model.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)

    def on_update(state):
        snapshots.append({n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()})
        return False

    state = TrainState()
    for epoch in range(epochs):
        train_one_epoch(model, optimizer, scheduler, dl, acc, epoch, state=state, max_grad_norm=max_grad_norm,
                        on_log=records.append, on_update=on_update)
    return snapshots, records, rows, state


@pytest.mark.parametrize("max_grad_norm", [None, 0.02])
def test_balanced_micro_batches_equal_the_big_batch_after_every_update(fresh_accelerate_state, max_grad_norm):
    big, big_records, _, _ = _run(b=32, k=1, balanced=False, max_grad_norm=max_grad_norm)
    small, small_records, rows, state = _run(b=8, k=4, balanced=True, max_grad_norm=max_grad_norm)
    assert len(rows) == 20 and rows != [8] * 9 + [4] + [8] * 9 + [4]  # unequal micro-batches were trained
    assert len(big) == len(small) == 6 and state.samples_seen == 2 * N
    for update, (a, b) in enumerate(zip(big, small)):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"update {update}, {name}: {m}")
    for rb, rs in zip(big_records, small_records):
        assert rs["train/loss"] == pytest.approx(rb["train/loss"], rel=1e-5)
        assert rs["train/samples"] == rb["train/samples"]


def test_the_setting_applies_on_one_cpu_process_with_length_grouping_only():
    from finetune.config import config_from_dict
    from finetune.dataloaders import balance_micro_batches

    def cfg(**data):
        return config_from_dict({"data": {"train_file": "x.csv", **data}, "training": {}})

    assert balance_micro_batches(cfg(), 1, "cpu") is True
    assert balance_micro_batches(cfg(), 1, "cuda") is False  # measured slower on a GPU: not by default
    assert balance_micro_batches(cfg(balance_micro_batches=True), 1, "cuda") is True
    assert balance_micro_batches(cfg(), 2, "cpu") is False
    assert balance_micro_batches(cfg(group_by_length=False), 1, "cpu") is False
    assert balance_micro_batches(cfg(balance_micro_batches=False), 1, "cpu") is False
    with pytest.raises(ConfigError, match="data.balance_micro_batches: true, but it needs one process"):
        balance_micro_batches(cfg(balance_micro_batches=True), 2, "cpu")
    with pytest.raises(ConfigError, match="needs data.group_by_length: true"):
        balance_micro_batches(cfg(balance_micro_batches=True, group_by_length=False), 1, "cpu")
