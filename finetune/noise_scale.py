"""The gradient noise scale: the effective batch above which an update stops being worth its samples.

McCandlish, Kaplan, Amodei et al. ("An Empirical Model of Large-Batch Training", 2018) show that the batch size
``B`` trades samples for updates around ``B_simple = tr(S) / |G|^2``, the noise of one sample's gradient (``S``,
its covariance) over the true gradient's squared norm: well below ``B_simple`` an update's direction is mostly
noise, and doubling ``B`` nearly halves the updates a loss takes; well above it, doubling ``B`` buys almost
nothing. Both come from the norms of one gradient at two batch sizes, since a mean of ``B`` samples' gradients
has ``E|G_B|^2 = |G|^2 + tr(S) / B``. Accumulation has both at no cost but one norm: the window's first
micro-batch alone (``b`` samples, before any other is added) and the whole window (its ``B`` samples, whose norm
clipping computes anyway).

Each window gives unbiased estimates of ``|G|^2`` and ``tr(S)``; alone they are noisy (and may be negative), so
each is averaged over the updates (an exponential moving average, corrected for its start as Adam's moments are)
before they are divided, as the paper does. By hand: neither accelerate, transformers nor torch measures it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

# how much of the moving averages each update leaves to the earlier ones: about the last 50 updates count
DECAY = 0.98


def squared_gradient_norm(model: torch.nn.Module) -> torch.Tensor:
    """The squared norm of the gradients the model holds, on the device (no host sync); a sparse gradient (an
    embedding's) is coalesced first, which sums the rows it holds twice."""
    total = None
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        values = g.coalesce().values() if g.is_sparse else g
        part = values.float().pow(2).sum()
        total = part if total is None else total + part
    if total is None:
        return torch.zeros((), dtype=torch.float32)
    return total


def noise_unmeasured(accelerator, k: int, graphs=None) -> Optional[str]:
    """Why the noise scale cannot be measured in this run's epochs, or None where it can: it needs a window of
    more than one micro-batch, and the first micro-batch's gradient whole and unscaled in the model."""
    from finetune.resplit import sharded_state

    engine = sharded_state(accelerator)
    if k < 2:
        return "k=1: an update's samples are one micro-batch, with no smaller batch inside it to compare"
    if graphs is not None:
        return "the micro-batches are replayed from CUDA graphs, whose gradients build up outside the model"
    if engine is not None:
        return f"{engine} holds the gradients in shards"
    if accelerator.scaler is not None:
        return "fp16's loss scaling multiplies the gradients"
    return None


# what each process adds for its window's first micro-batch (small_batch_terms), summed over the processes
TERMS = 5


def small_batch_terms(squared_norm: torch.Tensor, b_small: int, b_big: int) -> torch.Tensor:
    """One process's part of the window's estimates, on the device: ``squared_norm`` is that of the mean gradient of
    its first micro-batch's ``b_small`` samples, ``b_big`` the window's samples on every process.

    The estimates, ``|G|^2 = (B X_B - b X_b) / (B - b)`` and ``tr(S) = (X_b - X_B) / (1/b - 1/B)``, are linear in
    ``X_b``: their terms summed over the processes give the processes' mean estimate, whatever each one's ``b``
    (balanced micro-batches differ in size), once ``X_B`` is known (:func:`window_estimates`)."""
    weight = 1.0 / (b_big - b_small)
    both = b_small * b_big * weight
    constant = torch.tensor([0.0, weight, 0.0, both, 1.0], dtype=torch.float64, device=squared_norm.device)
    per_norm = torch.tensor([b_small * weight, 0.0, both, 0.0, 0.0], dtype=torch.float64, device=squared_norm.device)
    return constant + per_norm * squared_norm.double()


def window_estimates(terms, big: float, b_big: int) -> tuple[float, float]:
    """``(|G|^2, tr(S))`` of a window: the processes' summed :func:`small_batch_terms` (each process's counted in
    ``terms[4]``) and ``big``, the squared norm of the window's mean gradient over its ``b_big`` samples."""
    processes = float(terms[4])
    gradient = (big * b_big * float(terms[1]) - float(terms[0])) / processes
    noise = (float(terms[2]) - big * float(terms[3])) / processes
    return gradient, noise


def add_estimate(state, gradient: float, noise: float) -> None:
    """One update's estimates of ``|G|^2`` and ``tr(S)`` into ``state``'s moving averages (a
    :class:`~finetune.loop.TrainState`, whose checkpoints carry them); nothing where one is not finite."""
    if not (math.isfinite(gradient) and math.isfinite(noise)):
        return
    state.noise_gradient = DECAY * state.noise_gradient + (1 - DECAY) * gradient
    state.noise_trace = DECAY * state.noise_trace + (1 - DECAY) * noise
    state.noise_weight = DECAY * state.noise_weight + (1 - DECAY)


def noise_scale_of(state) -> Optional[float]:
    """``B_simple`` in samples from ``state``'s moving averages; None before any update, or while the averaged
    ``|G|^2`` or ``tr(S)`` is not above 0 (the noise of a few updates' estimates)."""
    if state.noise_weight == 0 or state.noise_gradient <= 0 or state.noise_trace <= 0:
        return None
    return state.noise_trace / state.noise_gradient  # the start's correction divides both alike


def noise_scale_said(state, effective_batch: int) -> str:
    """The noise scale measured so far, beside the effective batch, in words for the log."""
    value = noise_scale_of(state)
    if value is not None:
        return f"about {value:.0f} samples over the last updates (effective batch {effective_batch})"
    if state.noise_weight > 0 and state.noise_trace > 0 >= state.noise_gradient:
        return (f"beyond measure: the mean gradient is lost in the noise of the last updates' samples, as it is "
                f"near a minimum (the scale is far above the effective batch, {effective_batch})")
    return "none yet (no update with a smaller batch inside it)"
