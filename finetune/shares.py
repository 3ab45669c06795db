"""Texts predicted by several processes, a share of the batches each.

Under ``accelerate launch`` every process holds the same texts. :meth:`finetune.predictor.Predictor.share_of_logits`
runs every ``P``-th of the batches one process would run (the same batches, cut and padded alike), so that the
shares put together are one process's logits, bit for bit on devices that compute alike, in a ``P``-th of the
time. Here: which share is this process's (its batches, and the texts it tokenizes to learn every text's length),
how the shares travel, and how they come back into the texts' order. A run's test set (:mod:`finetune.test_set`)
and ``finetune predict`` and ``score`` under a launch use them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence


def process_state():
    """Accelerate's process state: a run's, where its ``Accelerator`` set one up (a test set scored at its end),
    else the launched processes joined as a run joins them (:func:`finetune.launch.init_process_state`: over
    gloo where there is no GPU), which says what it joined once."""
    from accelerate.state import PartialState, is_initialized

    from finetune.launch import init_process_state

    return PartialState() if is_initialized() else init_process_state()


def process_device():
    """The device training would use (Accelerate's choice), with all CPU cores, or this process's share of them."""
    from finetune.launch import configure_cpu_threads

    state = process_state()
    configure_cpu_threads(state.device, state.num_processes)  # each launched process its share of the cores
    return state.device


def device_of(device):
    """The ``torch.device`` a model loaded with ``device`` runs on: the one given (a name, or a ``torch.device``),
    else the one training would use (:func:`process_device`)."""
    if device is None:
        return process_device()
    import torch

    return torch.device(device)


def launched_processes() -> tuple[int, int]:
    """This process's index and the number of processes launched (``accelerate launch``); ``(0, 1)`` alone."""
    state = process_state()
    return state.process_index, state.num_processes


def slice_of(count: int, share: tuple[int, int]) -> range:
    """With ``share = (i, n)``: the ``i``-th of ``n`` runs of ``count`` rows, in order, their sizes a row apart at
    most (what one process tokenizes so that every process learns every text's length)."""
    part, parts = share
    return range(part * count // parts, (part + 1) * count // parts)


def batches_of_share(lengths: Sequence[int], batch_size: int, share: tuple[int, int]) -> list[list[int]]:
    """With ``share = (i, n)``: the batches ``i``, ``i + n``, ``i + 2n``, ... of those one process runs, as row
    numbers: ``batch_size`` rows each, longest first (rows of one length in their order)."""
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    part, parts = share
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)][part::parts]


def lengths_across_processes(count: int, lengths_of: Callable[[range], list[int]], processes: tuple[int, int]
                             ) -> list[int]:
    """Every one of the ``count`` texts' length in tokens, on every process, each process measuring its
    :func:`slice_of` them (``lengths_of(rows)``): with them each tokenizes only its own batches' texts, so that
    ``n`` processes tokenize every text twice in all, where each would tokenize all of them on the cores they share.

    Raises:
        ValueError: on every process, where they hold different numbers of texts (each predicting its own, say).
    """
    parts = shares_of_every_process((count, lengths_of(slice_of(count, processes))), processes)
    counts = [held for held, _ in parts]
    if len(set(counts)) > 1:
        raise ValueError(f"the processes sharing the batches hold different numbers of texts ({counts}, by process): "
                         f"each must pass the same texts, or predict apart (across_processes=False)")
    return [length for _, lengths in parts for length in lengths]


def shares_of_every_process(share, processes: tuple[int, int], to: Optional[int] = None) -> Optional[list]:
    """Each process's ``share`` (any object that pickles), in process order: on every process, or on process
    ``to`` alone (``None`` on the others). ``processes``: this one's index and their number; alone, ``[share]``.
    Every process must call it, with the same ``to``."""
    index, count = processes
    if count == 1:
        return [share]
    import torch.distributed as dist

    if to is None:
        shares = [None] * count
        dist.all_gather_object(shares, share)
        return shares
    shares = [None] * count if index == to else None
    dist.gather_object(share, shares, dst=to)
    return shares


def logits_in_order(shares, texts: int, labels: int) -> "np.ndarray":  # noqa: F821
    """:meth:`~finetune.predictor.Predictor.share_of_logits`' ``(rows, logits)`` shares put together: a row per
    text, in input order."""
    import numpy as np

    logits = np.zeros((texts, labels), dtype=np.float32)
    for rows, values in shares:
        logits[rows] = values
    return logits
