"""Load the tokenizer and the sequence-classification model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from finetune.config import ModelConfig
from finetune.errors import ModelError
from finetune.resources import resolve_path


def _location(name_or_path: str, key: str) -> str:
    """Resolve ``pkg:`` specs; check local paths; pass Hub ids (``name``, ``org/name``) through."""
    location = resolve_path(name_or_path, key)
    path = Path(location).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise ModelError(f"{key}: {location} is a directory but not a model (no config.json)")
        return str(path)
    if location.startswith((".", "/", "~")) or location.count("/") > 1:
        raise ModelError(f"{key}: model path not found: {location}")
    return location


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer of ``model.tokenizer_name_or_path`` (or the model's)."""
    from transformers import AutoTokenizer

    key = "model.tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model.name_or_path"
    location = _location(cfg.tokenizer_name_or_path or cfg.name_or_path, key)
    try:
        return AutoTokenizer.from_pretrained(
            location, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"{key}: cannot load a tokenizer from {location}: {_first_line(exc)}", _hub_hint(location)
        ) from None


def load_model_config(cfg: ModelConfig, max_length: Optional[int] = None):
    """The model's configuration, checked against ``data.max_length``.

    It reads one small file, so a run checks the model with it before reading
    any data; :func:`load_model` checks the same again.

    Args:
        cfg: The ``model`` section.
        max_length: ``data.max_length``, checked against the model's position limit.

    Returns:
        The ``transformers`` ``PretrainedConfig``.

    Raises:
        ModelError: for a missing path, a directory that is not a model, a
            configuration that cannot be read, or a ``max_length`` above the
            model's position limit.
    """
    from transformers import AutoConfig

    location = _location(cfg.name_or_path, "model.name_or_path")
    try:
        config = AutoConfig.from_pretrained(location, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"model.name_or_path: cannot load {location}: {_first_line(exc)}", _hub_hint(location)
        ) from None
    limit = getattr(config, "max_position_embeddings", None)
    if max_length is not None and limit is not None and max_length > limit:
        raise ModelError(
            f"data.max_length: {max_length} exceeds the position limit {limit} of model.name_or_path {location}",
            hint=f"set data.max_length to at most {limit}",
        )
    return config


def load_model(cfg: ModelConfig, id2label: dict[int, str], max_length: Optional[int] = None):
    """``AutoModelForSequenceClassification`` with the data's labels.

    Args:
        cfg: The ``model`` section.
        id2label: Class ids to names, from the training data.
        max_length: ``data.max_length``, checked against the model's position limit.

    Raises:
        ModelError: for a missing path, a directory that is not a model, a
            head whose size disagrees with the labels (unless
            ``model.ignore_mismatched_sizes``), or a too-long ``max_length``.
    """
    from transformers import AutoModelForSequenceClassification

    location = _location(cfg.name_or_path, "model.name_or_path")
    label2id = {name: i for i, name in id2label.items()}
    config = load_model_config(cfg, max_length)
    trained_labels = getattr(config, "id2label", None) or {}
    has_head = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    if has_head and len(trained_labels) != len(id2label) and not cfg.ignore_mismatched_sizes:
        raise ModelError(
            f"model.name_or_path: {location} was trained with {len(trained_labels)} labels, the data has "
            f"{len(id2label)}",
            hint="set model.ignore_mismatched_sizes: true to start a new classification head",
        )
    config.num_labels = len(id2label)
    config.id2label = dict(id2label)
    config.label2id = label2id
    if cfg.dropout is not None:
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            if hasattr(config, name):
                setattr(config, name, cfg.dropout)
    try:
        return AutoModelForSequenceClassification.from_pretrained(
            location,
            config=config,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
            ignore_mismatched_sizes=cfg.ignore_mismatched_sizes,
        )
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.name_or_path: cannot load {location}: {_first_line(exc)}") from None


def sparse_capable_embedding(model):
    """The model's input (word) embedding if its gradient may be made sparse, else ``None``.

    A dense embedding backward allocates and zeroes a gradient of the whole
    vocabulary on every micro-batch (30522 x 384 floats, 47 MB, for MiniLM)
    and adds it into the accumulated one: on a CPU that costs about 10 ms a
    micro-batch, though a micro-batch of SMS messages touches a few hundred
    rows. With ``sparse=True`` torch's backward returns just those rows, and
    :func:`finetune.loop.train_one_epoch` adds them into a dense gradient
    buffer it allocates once, so clipping and the optimizer see the same
    gradient as before (to float rounding).

    ``None`` when the input embedding is not an ``nn.Embedding``, is frozen,
    has ``max_norm`` (which renormalises rows in the forward pass), or shares
    its weight with another module (tied weights would mix a sparse and a
    dense gradient).
    """
    import torch

    model = getattr(model, "module", model)  # DDP's wrapper
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embedding, torch.nn.Embedding) or embedding.max_norm is not None:
        return None
    weight = embedding.weight
    if not weight.requires_grad:
        return None
    if sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is weight) != 1:
        return None
    return embedding


def is_compiled(model) -> bool:
    """Whether ``model`` (or the module inside DDP's wrapper) runs through ``torch.compile``.

    ``torch.compile(model)`` returns a wrapper with ``_orig_mod``;
    ``model.compile()``, as ``training.torch_compile`` does, compiles in place
    and sets ``_compiled_call_impl``. A compiled model's graphs were traced
    with the modules it had then, so the loop's switches (sparse embedding
    gradient, 16-bit dropout masks) leave it alone.
    """
    for candidate in (model, getattr(model, "module", model)):
        if hasattr(candidate, "_orig_mod") or getattr(candidate, "_compiled_call_impl", None) is not None:
            return True
    return False


def _hub_hint(location: str) -> Optional[str]:
    """Say why a name that is no local path was looked up on the Hub (a mistyped relative path?)."""
    if Path(location).expanduser().exists():
        return None
    return f"{location!r} is not a local path, so it was taken as a Hugging Face Hub id"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
