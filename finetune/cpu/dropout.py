"""Dropout with masks drawn 16 bits at a time, for training on a CPU.

Torch's CPU dropout draws its mask with ``bernoulli_``: one Mersenne Twister
draw per element unless MKL's vectorised generator is available, which is
only on Intel CPUs. On other CPUs, with many short sequences, drawing masks
can take a tenth of a BERT step's time. In attention it is worse: ``scaled_dot_product_attention`` with ``dropout_p > 0``
leaves its fused CPU kernel for an unfused path that masks the same way.

Here one 64-bit draw from torch's generator gives four 16-bit words, and an
element is kept when its word is at least ``round(p * 65536)``: the drop
probability is ``p`` on a grid of 2**-16 (at most 7.6e-6 off), and kept
elements are scaled by the exact inverse of the resulting keep probability,
so the expected output equals the input, as with torch's dropout. The words
come from the global ``torch.Generator``, so ``torch.manual_seed`` and the
checkpointed generator states reproduce every mask.

Written by hand because torch has no faster CPU mask generator and
transformers no dropout hook: :func:`fast_dropout` switches a model's
``nn.Dropout`` modules to :class:`FastDropout` and its ``sdpa`` attention to
:func:`attention_forward` for as long as training runs, then switches back.
:func:`finetune.cpu.cpu_speedups` decides when it applies.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
from torch import nn

_LEVELS = 1 << 16  # one mask element per 16-bit word
ATTENTION_NAME = "finetune_sdpa"  # registered with transformers' attention and mask interfaces


def keep_mask(shape, p: float, *, device=None, generator: Optional[torch.Generator] = None):
    """A boolean mask that keeps each element with probability ``1 - p``, ``p`` rounded to a multiple of 2**-16.

    Returns:
        ``(mask, scale)``: ``mask`` has ``shape``; ``scale`` is one over the
        keep probability, for the rounded ``p``.
    """
    threshold = round(p * _LEVELS)
    if not 0 <= threshold < _LEVELS:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)  # from=int64 min, to=None: all 64 bits uniform
    # Each int16 word is uniform on [-32768, 32767]; keep the top 65536 - threshold values.
    mask = words.view(torch.int16)[:n].view(shape) >= threshold - _LEVELS // 2
    return mask, _LEVELS / (_LEVELS - threshold)


class _MaskedScale(torch.autograd.Function):
    """``x * mask * scale``; saves the boolean mask for the backward pass (torch's dropout saves a float one)."""

    @staticmethod
    def forward(ctx, x, mask, scale):
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x.mul(mask).mul_(scale)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad.mul(mask).mul_(ctx.scale), None, None


def drop(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout with :func:`keep_mask`'s masks; ``x`` itself when not training or ``p == 0``."""
    if not training or p == 0.0:
        return x
    mask, scale = keep_mask(x.shape, p, device=x.device)
    return _MaskedScale.apply(x, mask, scale)


class FastDropout(nn.Dropout):
    """``nn.Dropout`` whose masks come from :func:`keep_mask` (with ``inplace``, the result is a new tensor)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return drop(input, self.p, self.training)


class _Attention(torch.autograd.Function):
    """``dropout(softmax(q k^T * scaling + mask)) v`` with its gradient written out.

    Autograd over the same formula does the same arithmetic (a test checks
    the two agree to float rounding), but copies the non-contiguous head views in
    every matrix product and keeps a float copy of the dropped probabilities;
    this keeps the softmax output and the boolean mask only.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, q, k, v, mask, scaling, p):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling)
        if mask is not None:
            if mask.dtype == torch.bool:  # transformers' sdpa masks: True attends
                scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
            else:
                scores.add_(mask)
        probs = torch.softmax(scores, dim=-1)
        keep, scale = keep_mask(probs.shape, p, device=probs.device)
        out = torch.matmul(probs.mul(keep).mul_(scale), v)
        ctx.save_for_backward(q, k, v, probs, keep)
        ctx.scaling, ctx.scale = scaling, scale
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")  # under the forward's autocast state: bf16 and fp32 mix as there
    def backward(ctx, grad):
        q, k, v, probs, keep = ctx.saved_tensors
        grad = grad.contiguous()
        grad_v = torch.matmul(probs.mul(keep).mul_(ctx.scale).transpose(-1, -2), grad)
        grad_dropped = torch.matmul(grad, v.transpose(-1, -2)).mul_(keep).mul_(ctx.scale)
        grad_scores = torch._softmax_backward_data(grad_dropped, probs, -1, probs.dtype).mul_(ctx.scaling)
        grad_q = torch.matmul(grad_scores, k)
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)
        return grad_q, grad_k, grad_v, None, None, None


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' ``sdpa`` attention function, with the probabilities' dropout drawn by :func:`keep_mask`.

    Without dropout (evaluation), and for anything but plain bidirectional
    attention on a CPU (causal, grouped key/value heads, a position bias, a
    cache, soft-capping, a mask that is not 4-d), it *is* transformers' ``sdpa``
    function. Otherwise it computes what SDPA's unfused path computes:
    ``softmax(q k^T * scaling + mask)``, dropped out, times ``v``.
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    plain = (
        dropout > 0.0
        and query.device.type == "cpu"
        and not causal
        and query.shape == key.shape == value.shape
        and getattr(module, "num_key_value_groups", 1) == 1
        and (attention_mask is None or attention_mask.dim() == 4)
        and all(kwargs.get(name) is None for name in ("position_bias", "cache", "softcap", "sliding_window", "s_aux"))
        and not kwargs.get("output_attentions", False)
    )
    if not plain:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    out = _Attention.apply(query, key, value, attention_mask, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


def attention_switch_unavailable(config, model: Optional[nn.Module] = None) -> Optional[str]:
    """Why the attention of ``model``, whose attention config is ``config``, cannot be switched, or ``None`` if it can.

    The switch leans on three things transformers and torch do not promise to
    keep: transformers 5's attention and mask registries (older releases pick
    attention classes at construction, so renaming would do nothing or worse),
    the config's ``_attn_implementation_internal`` field, and
    ``torch._softmax_backward_data`` for the written-out backward. Each is
    checked here, so that a release that changed one leaves the attention
    alone instead of failing mid-run. With ``model``, its modeling code must
    look attention up in the registry too: ModernBERT's in transformers 5.0
    keeps a table of its own, where the switched name is a KeyError.
    """
    import transformers

    from finetune.hub import transformers_major

    if transformers_major() < 5:
        return f"transformers {transformers.__version__} predates the attention registry"
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask  # noqa: F401
    except ImportError as exc:
        return f"transformers has no {exc.name or 'attention registry'}"
    if not hasattr(config, "_attn_implementation_internal"):
        return "the model config has no _attn_implementation_internal"
    if not callable(getattr(torch, "_softmax_backward_data", None)):
        return "torch has no _softmax_backward_data"
    own_tables = modeling_without_the_registry(model) if model is not None else []
    if own_tables:
        return f"{own_tables[0]} picks its attention from a table of its own, not transformers' registry"
    return None


def modeling_without_the_registry(model: nn.Module) -> list[str]:
    """The transformers modeling modules of ``model``'s layers that do not look attention up in transformers'
    registry (``ALL_ATTENTION_FUNCTIONS``, which each modeling module that consults it imports)."""
    import sys

    names = {type(module).__module__ for module in model.modules()}
    return sorted(name for name in names if name.startswith("transformers.models.")
                  and not hasattr(sys.modules.get(name), "ALL_ATTENTION_FUNCTIONS"))


def _register() -> None:
    """Register :func:`attention_forward` and sdpa's masks under :data:`ATTENTION_NAME`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)  # the same masks as sdpa


def sdpa_configs(model: nn.Module) -> list:
    """The distinct configs of ``model``'s modules whose attention is ``sdpa``."""
    configs: list = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation_internal", None) == "sdpa" and all(c is not config for c in configs):
            configs.append(config)
    return configs


@contextlib.contextmanager
def fast_dropout(model: nn.Module, attention: bool = True) -> Iterator[int]:
    """Inside, the model's ``nn.Dropout`` modules (and ``sdpa`` attention) draw masks with :func:`keep_mask`.

    Only modules of exactly ``nn.Dropout`` and configs whose attention is
    ``sdpa`` are switched; pass ``attention=False`` to leave attention alone
    (see :func:`attention_switch_unavailable`). On exit, exceptions included,
    each is handed back as it was, so a saved model or a loop of the caller's
    own never sees the switch. Yields how many dropout modules were switched.
    """
    switched = [m for m in model.modules() if type(m) is nn.Dropout]
    configs = sdpa_configs(model) if attention else []
    if configs:
        _register()
    try:
        for m in switched:
            m.__class__ = FastDropout
        for c in configs:
            c._attn_implementation_internal = ATTENTION_NAME  # not the property: it would recurse into sub-configs
        yield len(switched)
    finally:
        for m in switched:
            m.__class__ = nn.Dropout
        for c in configs:
            c._attn_implementation_internal = "sdpa"
