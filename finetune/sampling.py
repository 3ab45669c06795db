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
        mega = self.window_size * self.group_windows
        out: list[torch.Tensor] = []
        for start in range(0, self.num_samples, mega):
            chunk = perm[start : start + mega]
            # stable sort: ties keep the random order, so the result is seeded too
            chunk = chunk[torch.sort(self.lengths[chunk], descending=True, stable=True).indices]
            windows = list(torch.split(chunk, self.window_size))
            # The last window of the epoch is the only one allowed to be short:
            # shuffle full windows and keep a short tail at the end.
            tail = windows.pop() if len(windows[-1]) < self.window_size else None
            for w in torch.randperm(len(windows), generator=gen).tolist():
                out.append(windows[w])
            if tail is not None:
                out.append(tail)
        return torch.cat(out).tolist() if out else []

    def __iter__(self) -> Iterator[int]:
        return iter(self.order())
