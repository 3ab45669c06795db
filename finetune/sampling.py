"""The training sample order.

:class:`EpochSampler` decides the global order of samples in an epoch. It
depends only on the seed, the epoch and the effective batch ``B``, never on
how ``B`` is split into ``b * k * P``; so ``(b, k, P)`` and ``(B, 1, 1)`` see
the same windows, which the exactness of accumulation needs.

With ``group_by_length`` it sorts each window by length, so that the window's
``k`` micro-batches pad little while its sample set stays a uniform random
draw, new every epoch. Sorting "mega-batches" of
several windows (``group_windows > 1``, as the Trainer's ``group_by_length``
does) pads less, at a price: each update then holds samples of similar
length, and where length goes with the label (spam is long) of similar label.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Optional, Sequence, Union

import torch
from torch.utils.data import Sampler

from finetune.accumulation import value_at_epoch

# A mega-batch holds this many effective batches before it is sorted by length.
# 1 sorts within each window: its samples stay the uniform random draw of the
# ungrouped order. Larger groups pad less but make each window's samples alike in
# length: on the SMS set with 16, 40% of the windows hold no spam at all, against
# 1% here (`python -m bench.levers windows` measures padding and label mix per window).
DEFAULT_GROUP_WINDOWS = 1


class EpochSampler(Sampler[int]):
    """Seeded random order per epoch, optionally grouped by length.

    The same ``seed`` and epoch give the same order on every process, which is
    what Accelerate's sharding expects.

    Args:
        num_samples: Size of the data set.
        seed: Base seed; epoch ``e`` uses ``seed + e``.
        lengths: Token count per sample; required when ``group_by_length``.
        group_by_length: Sort by length within each mega-batch to cut padding.
        window_size: The effective batch ``B``; windows are shuffled as units.
            Under an accumulation schedule, ``{first epoch: B}``: each epoch
            groups within its own windows.
        group_windows: Mega-batch size, in windows (1: sort within each window only).
    """

    def __init__(
        self,
        num_samples: int,
        seed: int,
        lengths: Optional[Sequence[int]] = None,
        group_by_length: bool = False,
        window_size: Union[int, Mapping[int, int]] = 1,
        group_windows: int = DEFAULT_GROUP_WINDOWS,
    ):
        if group_by_length and (lengths is None or len(lengths) != num_samples):
            raise ValueError("group_by_length needs one length per sample")
        self.num_samples = num_samples
        self.seed = seed
        self.lengths = torch.as_tensor(list(lengths)) if lengths is not None else None
        self.group_by_length = group_by_length
        self.window_sizes = dict(window_size) if isinstance(window_size, Mapping) else {0: window_size}
        self.group_windows = max(1, group_windows)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch`` (call before iterating)."""
        self.epoch = epoch

    @property
    def window_size(self) -> int:
        """``B`` of the current epoch."""
        return max(1, value_at_epoch(self.window_sizes, self.epoch))

    def __len__(self) -> int:
        return self.num_samples

    def order(self) -> list[int]:
        """The sample indices of the current epoch, in training order."""
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.num_samples, generator=gen)
        if not self.group_by_length:
            return perm.tolist()
        size = self.window_size
        mega = size * self.group_windows
        full = self.num_samples - self.num_samples % mega
        # the full mega-batches sorted and shuffled together, then the epoch's shorter last one: the order of a
        # mega-batch at a time, in one round of tensor operations rather than one per mega-batch
        out = [self._windows_shuffled(perm[:full].view(-1, mega), gen)] if full else []
        if full < self.num_samples:
            chunk = self._by_length(perm[full:].view(1, -1))[0]
            windows = list(torch.split(chunk, size))
            # The last window of the epoch is the only one allowed to be short:
            # shuffle full windows and keep a short tail at the end.
            tail = windows.pop() if len(windows[-1]) < size else None
            out += [windows[w] for w in torch.randperm(len(windows), generator=gen).tolist()]
            out += [tail] if tail is not None else []
        return torch.cat(out).tolist() if out else []

    def _by_length(self, chunks: torch.Tensor) -> torch.Tensor:
        """Each row of sample indices sorted by length, longest first."""
        # stable sort: ties keep the random order, so the result is seeded too
        by_length = torch.sort(self.lengths[chunks], dim=1, descending=True, stable=True).indices
        return torch.gather(chunks, 1, by_length)

    def _windows_shuffled(self, chunks: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Full mega-batches (a row each) sorted by length, each one's windows shuffled, flat."""
        windows = self._by_length(chunks).view(len(chunks), self.group_windows, -1)
        # one permutation per mega-batch, drawn in their order as the generator gave them one at a time
        shuffles = torch.stack([torch.randperm(self.group_windows, generator=gen) for _ in range(len(chunks))])
        return torch.gather(windows, 1, shuffles[:, :, None].expand_as(windows)).reshape(-1)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order())


class BalancedBatches(Sampler[list[int]]):
    """Each window of :class:`EpochSampler` cut into micro-batches where they pad least (one process).

    A window's samples, longest first, are cut into as many micro-batches as
    cuts of ``batch_size`` would make, but at the points that minimise the
    padded tokens (:func:`least_padding_sizes`): short texts go in larger
    micro-batches, long ones in smaller. No micro-batch holds more padded
    tokens than the window's first equal cut (``batch_size`` x its longest
    text), so memory peaks no higher. The windows, and so the updates, are
    those of the sampler: the loop sums per-sample losses and scales by the
    window's sample count, which does not depend on where the window is cut.
    PyTorch's and Accelerate's batch samplers cut equal sizes only, hence this.

    Args:
        sampler: The epoch order; needs its ``lengths``.
        batch_size: ``b``, the micro-batch of an equal cut.
        pad_to_multiple_of: The collator pads each micro-batch's length up to a multiple of this (None: to
            its longest text): the padded tokens are counted as it pads.
    """

    def __init__(self, sampler: EpochSampler, batch_size: int, pad_to_multiple_of: Optional[int] = None):
        if sampler.lengths is None:
            raise ValueError("BalancedBatches needs an EpochSampler with lengths")
        self.sampler = sampler
        self.batch_size = batch_size
        self.multiple = pad_to_multiple_of or 1
        self._epoch: Optional[int] = None
        self._batches: list[list[int]] = []

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def micro_batches(self) -> list[list[int]]:
        """The current epoch's micro-batches (sample indices), in training order."""
        if self._epoch != self.sampler.epoch:
            order = torch.as_tensor(self.sampler.order(), dtype=torch.long)
            self._batches = []
            full = len(order) - len(order) % self.sampler.window_size
            # the full windows cut together, the epoch's short last one (if any) alone: the same cuts as one window
            # at a time, without a round of array operations per window (1.3 s of the start at 300,000 texts)
            for windows in (order[:full].view(-1, self.sampler.window_size), order[full:].view(1, -1)):
                if windows.numel():
                    self._batches += self._cut(windows)
            self._epoch = self.sampler.epoch
        return self._batches

    def _cut(self, windows: torch.Tensor) -> list[list[int]]:
        """The micro-batches of equal-sized ``windows`` (one a row), each cut where it pads least."""
        # longest first: already so when the sampler groups by length, sorted here otherwise
        lengths = self.sampler.lengths[windows]
        lengths, by_length = torch.sort(lengths, dim=1, descending=True, stable=True)
        windows = torch.gather(windows, 1, by_length)
        groups = -(-windows.shape[1] // self.batch_size)
        padded = -(-lengths // self.multiple) * self.multiple  # as the collator pads
        sizes = least_padding_cuts(padded.numpy(), groups, caps=self.batch_size * padded[:, 0].numpy())
        samples = windows.reshape(-1).tolist()
        stops = sizes.reshape(-1).cumsum().tolist()
        return [samples[start:stop] for start, stop in zip([0] + stops[:-1], stops)]

    def sizes(self) -> list[int]:
        """Samples in each micro-batch of the current epoch."""
        return [len(batch) for batch in self.micro_batches()]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.micro_batches())

    def __len__(self) -> int:
        # windows are multiples of batch_size, so an epoch has as many micro-batches as equal cuts make
        return -(-self.sampler.num_samples // self.batch_size)


def least_padding_sizes(lengths: Sequence[int], groups: int, cap: int) -> list[int]:
    """Sizes of ``groups`` consecutive micro-batches of ``lengths`` (longest first) with the fewest padded tokens.

    A micro-batch padded to its first (longest) text costs ``rows x that
    length``; none may cost more than ``cap``, and each holds one sample at
    least (:func:`least_padding_cuts` for one window).

    Raises:
        ValueError: if no cut fits within ``cap``.
    """
    import numpy as np

    return least_padding_cuts(np.asarray([lengths], dtype=np.int64), groups, np.asarray([cap]))[0].tolist()


# Elements of the largest array one round of least_padding_cuts makes (windows x starts x row counts), beyond
# which it takes its windows a part at a time: about 32 MB of int64.
_CUT_ELEMENTS = 1 << 22


def least_padding_cuts(lengths: "np.ndarray", groups: int, caps: "np.ndarray") -> "np.ndarray":  # noqa: F821
    """For each row of ``lengths`` (windows of ``n`` samples, longest first), the sizes of ``groups`` consecutive
    micro-batches with the fewest padded tokens, none costing more than the row's ``caps`` (one array of
    ``windows x groups``).

    Dynamic programming over the cut points: for each group, every window, every start and every row count at
    once, as one ``windows x starts x rows`` array (in parts of about :data:`_CUT_ELEMENTS`).

    Raises:
        ValueError: if no cut of a window fits within its cap.
    """
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    caps = np.asarray(caps, dtype=np.int64)
    windows, n = lengths.shape
    part = max(1, _CUT_ELEMENTS // ((n + 1) * (n + 1)))
    if windows > part:
        return np.concatenate([least_padding_cuts(lengths[i:i + part], groups, caps[i:i + part])
                               for i in range(0, windows, part)])
    inf = np.iinfo(np.int64).max // 4
    # best[w, i]: fewest padded tokens for window w's lengths[i:] in the groups placed so far (from the end)
    best = np.full((windows, n + 1), inf, dtype=np.int64)
    best[:, n] = 0
    ends = np.zeros((groups + 1, windows, n + 1), dtype=np.int64)
    for g in range(1, groups + 1):
        new = np.full((windows, n + 1), inf, dtype=np.int64)
        start = np.arange(n - g + 1)
        # rows from each start: at least one, at most what fits the cap, leaving one sample per later group
        most = np.minimum(caps[:, None] // np.maximum(lengths[:, start], 1), n - start - (g - 1))
        reachable = most >= 1
        if reachable.any():
            rows = np.arange(1, int(most.max()) + 1)
            stop = np.minimum(start[:, None] + rows, n)
            cost = rows * lengths[:, start, None] + best[:, stop]
            # row counts past a start's most never win: above any reachable cost, even an unreachable one
            cost = np.where(rows <= most[:, :, None], cost, 2 * inf)
            pick = np.argmin(cost, axis=2)  # the fewest rows among equal costs
            new[:, start] = np.where(reachable, np.take_along_axis(cost, pick[:, :, None], axis=2)[:, :, 0], inf)
            ends[g][:, start] = np.where(reachable, stop[start, pick], 0)
        best = new
    failed = np.flatnonzero(best[:, 0] >= inf)
    if len(failed):
        raise ValueError(f"no cut of {n} samples into {groups} micro-batches fits {caps[failed[0]]} padded tokens "
                         f"each")
    sizes = np.zeros((windows, groups), dtype=np.int64)
    at = np.zeros(windows, dtype=np.int64)
    every = np.arange(windows)
    for g in range(groups, 0, -1):
        stop = ends[g, every, at]
        sizes[:, groups - g] = stop - at
        at = stop
    return sizes
