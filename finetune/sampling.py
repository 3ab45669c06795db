"""The training sample order, and where each process's real samples sit in it.

Two pieces live here because the exactness of accumulation depends on both:

* :class:`EpochSampler` decides the global order of samples in an epoch. It
  depends only on the seed, the epoch and the effective batch ``B``, never on
  how ``B`` is split into ``b * k * P``; so ``(b, k, P)`` and ``(B, 1, 1)`` see
  the same windows. With ``group_by_length`` it sorts each window by length,
  so that the window's ``k`` micro-batches pad little while its sample set
  stays a uniform random draw, new every epoch. Sorting "mega-batches" of
  several windows (``group_windows > 1``, as the Trainer's ``group_by_length``
  does) pads less, at a price: each update then holds samples of similar
  length, and where length goes with the label (spam is long) of similar label.
* :class:`ShardLayout` knows how Accelerate deals that order out to processes
  (global batch ``g`` of size ``b`` goes to process ``g % P``; the last short
  batch and any missing batches are filled with repeats of the epoch's first
  samples, appended after the real rows). From ``(N, b, P)`` alone it tells how
  many real samples each micro-batch and each window holds, with no look-ahead
  and no communication. PyTorch and Accelerate expose no such count, hence
  this hand-written arithmetic; ``train_one_epoch`` checks it against the
  prepared dataloader's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch.utils.data import Sampler

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
        group_windows: Mega-batch size, in windows (1: sort within each window only).
    """

    def __init__(
        self,
        num_samples: int,
        seed: int,
        lengths: Optional[Sequence[int]] = None,
        group_by_length: bool = False,
        window_size: int = 1,
        group_windows: int = DEFAULT_GROUP_WINDOWS,
    ):
        if group_by_length and (lengths is None or len(lengths) != num_samples):
            raise ValueError("group_by_length needs one length per sample")
        self.num_samples = num_samples
        self.seed = seed
        self.lengths = torch.as_tensor(list(lengths)) if lengths is not None else None
        self.group_by_length = group_by_length
        self.window_size = max(1, window_size)
        self.group_windows = max(1, group_windows)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch`` (call before iterating)."""
        self.epoch = epoch

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


@dataclass(frozen=True)
class ShardLayout:
    """Where the real samples are in one epoch of a prepared dataloader.

    The global stream is the sampler's order cut into batches of ``b``; real
    samples are its first ``N`` positions, anything after them is a repeat that
    Accelerate added so all processes get the same number of full batches.

    Args:
        num_samples: ``N``, samples in the data set.
        batch_size: ``b``, micro-batch size per process.
        num_processes: ``P``.
        process_index: This process's rank.
    """

    num_samples: int
    batch_size: int
    num_processes: int = 1
    process_index: int = 0

    @property
    def micro_batches_per_process(self) -> int:
        """Micro-batches each process sees in one epoch."""
        global_batches = math.ceil(self.num_samples / self.batch_size)
        return math.ceil(global_batches / self.num_processes)

    def _real_before(self, position: int) -> int:
        return min(self.num_samples, max(0, position))

    def real_in_micro_batch(self, j: int, process_index: Optional[int] = None) -> int:
        """Real samples in this process's micro-batch ``j`` (its first rows)."""
        p = self.process_index if process_index is None else process_index
        start = (j * self.num_processes + p) * self.batch_size
        return self._real_before(start + self.batch_size) - self._real_before(start)

    def real_in_window(self, first: int, stop: int) -> int:
        """Real samples, over all processes, in micro-batches ``first .. stop-1``."""
        per_step = self.num_processes * self.batch_size
        return self._real_before(stop * per_step) - self._real_before(first * per_step)

    def windows(self, k: int) -> list[tuple[int, int]]:
        """``(first, stop)`` micro-batch ranges of the epoch's windows; the last may be short."""
        m = self.micro_batches_per_process
        return [(s, min(s + k, m)) for s in range(0, m, k)]

    def window_of(self, j: int, k: int) -> tuple[int, int]:
        """The ``(first, stop)`` range of the window holding micro-batch ``j``."""
        first = (j // k) * k
        return first, min(first + k, self.micro_batches_per_process)

    def updates_per_epoch(self, k: int) -> int:
        """Optimizer updates in one epoch: ``ceil(micro-batches / k)``."""
        return math.ceil(self.micro_batches_per_process / k)
