"""The epoch's order and micro-batches, made for all windows at once, are those made a window at a time.

:meth:`EpochSampler.order` sorts and shuffles every full mega-batch in one round of tensor operations, and
:class:`BalancedBatches` cuts every full window in one round of array operations
(:func:`~finetune.sampling.least_padding_cuts`), where they had looped over the windows (seconds per epoch at
300,000 texts). The order decides every update and a resumed run's place in the epoch, so it must not move by a
sample: each is checked here against the loop it replaced, kept below as the reference, over random sizes,
windows, mega-batches, paddings and ragged ends.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from finetune.sampling import BalancedBatches, EpochSampler, least_padding_cuts, least_padding_sizes


def reference_order(sampler: EpochSampler) -> list[int]:
    """The epoch order as it was made, one mega-batch at a time."""
    gen = torch.Generator().manual_seed(sampler.seed + sampler.epoch)
    perm = torch.randperm(sampler.num_samples, generator=gen)
    if not sampler.group_by_length:
        return perm.tolist()
    mega = sampler.window_size * sampler.group_windows
    out = []
    for start in range(0, sampler.num_samples, mega):
        chunk = perm[start:start + mega]
        chunk = chunk[torch.sort(sampler.lengths[chunk], descending=True, stable=True).indices]
        windows = list(torch.split(chunk, sampler.window_size))
        tail = windows.pop() if len(windows[-1]) < sampler.window_size else None
        for w in torch.randperm(len(windows), generator=gen).tolist():
            out.append(windows[w])
        if tail is not None:
            out.append(tail)
    return torch.cat(out).tolist() if out else []


def reference_sizes(lengths, groups, cap):
    """One window's least-padding cut as it was made, a window at a time."""
    n = len(lengths)
    length = np.asarray(lengths, dtype=np.int64)
    inf = np.iinfo(np.int64).max // 4
    best = np.full(n + 1, inf, dtype=np.int64)
    best[n] = 0
    ends = np.zeros((groups + 1, n + 1), dtype=np.int64)
    for g in range(1, groups + 1):
        new = np.full(n + 1, inf, dtype=np.int64)
        start = np.arange(n - g + 1)
        most = np.minimum(cap // np.maximum(length[start], 1), n - start - (g - 1))
        start, most = start[most >= 1], most[most >= 1]
        if len(start):
            rows = np.arange(1, int(most.max()) + 1)
            stop = np.minimum(start[:, None] + rows, n)
            cost = rows * length[start][:, None] + best[stop]
            cost = np.where(rows <= most[:, None], cost, 2 * inf)
            pick = np.argmin(cost, axis=1)
            new[start] = cost[np.arange(len(start)), pick]
            ends[g, start] = stop[np.arange(len(start)), pick]
        best = new
    if best[0] >= inf:
        raise ValueError("no cut")
    sizes, i = [], 0
    for g in range(groups, 0, -1):
        sizes.append(int(ends[g, i]) - i)
        i = int(ends[g, i])
    return sizes


def reference_micro_batches(balanced: BalancedBatches) -> list[list[int]]:
    """The epoch's micro-batches as they were cut, a window at a time."""
    sampler = balanced.sampler
    order = torch.as_tensor(reference_order(sampler), dtype=torch.long)
    batches = []
    for window in torch.split(order, sampler.window_size):
        window = window[torch.sort(sampler.lengths[window], descending=True, stable=True).indices]
        groups = -(-len(window) // balanced.batch_size)
        padded = (-(-sampler.lengths[window] // balanced.multiple) * balanced.multiple).tolist()
        sizes = reference_sizes(padded, groups, cap=balanced.batch_size * padded[0])
        batches += [part.tolist() for part in torch.split(window, sizes)]
    return batches


def random_sampler(rng: random.Random, grouped: bool = True) -> EpochSampler:
    b, k = rng.choice([1, 2, 3, 8]), rng.choice([1, 2, 4, 5])
    samples = rng.randint(1, 400)
    lengths = [rng.randint(1, rng.choice([8, 64, 512])) for _ in range(samples)]
    return EpochSampler(samples, seed=rng.randint(0, 99), lengths=lengths, group_by_length=grouped,
                        window_size=b * k, group_windows=rng.choice([1, 1, 2, 3, 16]))


def test_the_order_is_the_one_made_a_mega_batch_at_a_time():
    rng = random.Random(0)
    for _ in range(200):
        sampler = random_sampler(rng, grouped=rng.random() < 0.8)
        for epoch in (0, 1, 3):
            sampler.set_epoch(epoch)
            assert sampler.order() == reference_order(sampler)


def test_an_epoch_of_whole_mega_batches_and_one_of_none():
    # no short last mega-batch, and no samples at all
    sampler = EpochSampler(96, seed=3, lengths=list(range(96)), group_by_length=True, window_size=8, group_windows=3)
    assert len(sampler.order()) == 96 and sampler.order() == reference_order(sampler)
    empty = EpochSampler(0, seed=3, lengths=[], group_by_length=True, window_size=8)
    assert empty.order() == reference_order(empty) == []


def test_the_micro_batches_are_the_ones_cut_a_window_at_a_time():
    rng = random.Random(1)
    for _ in range(150):
        sampler = random_sampler(rng, grouped=rng.random() < 0.7)
        b = rng.choice([d for d in range(1, sampler.window_size + 1) if sampler.window_size % d == 0])
        balanced = BalancedBatches(sampler, b, pad_to_multiple_of=rng.choice([None, 8]))
        for epoch in (0, 2):
            balanced.set_epoch(epoch)
            assert balanced.micro_batches() == reference_micro_batches(balanced)


def test_windows_cut_together_are_each_cut_as_alone():
    rng = np.random.default_rng(2)
    for n, groups in ((1, 1), (7, 3), (32, 4), (64, 8)):
        lengths = -np.sort(-rng.integers(1, 200, size=(50, n)), axis=1)
        caps = -(-n // groups) * lengths[:, 0]
        together = least_padding_cuts(lengths, groups, caps)
        assert together.tolist() == [reference_sizes(row.tolist(), groups, cap) for row, cap in zip(lengths, caps)]


def test_windows_are_cut_a_part_at_a_time_past_the_array_bound(monkeypatch):
    import finetune.sampling as sampling

    rng = np.random.default_rng(3)
    lengths = -np.sort(-rng.integers(1, 100, size=(40, 16)), axis=1)
    caps = 4 * lengths[:, 0]
    whole = least_padding_cuts(lengths, 4, caps)
    monkeypatch.setattr(sampling, "_CUT_ELEMENTS", 17 * 17 * 3)  # three windows a part
    assert least_padding_cuts(lengths, 4, caps).tolist() == whole.tolist()


def test_a_window_no_cut_fits_is_named_by_its_cap():
    lengths = np.array([[10, 10, 10], [50, 50, 50]])
    with pytest.raises(ValueError, match="no cut of 3 samples into 1 micro-batches fits 20 padded tokens"):
        least_padding_cuts(lengths, 1, np.array([30, 20]))
    assert least_padding_sizes([10, 10, 10], 1, cap=30) == [3]
