"""Load the tokenizer and the sequence-classification model."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import weakref
from pathlib import Path
from typing import Any, Optional

from finetune import hub
from finetune.config import ModelConfig
from finetune.errors import ConfigError, ModelError
from finetune.load_reports import held_load_report, new_head_of, show
from finetune.resources import (PACKAGED_HUB_MODELS, is_package_path, model_location, near_names, package_of,
                                package_version)
from finetune.truncation import position_limit

# transformers' names for the labels of a config that was given none
_UNNAMED = re.compile(r"LABEL_\d+")


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer of ``model.tokenizer_name_or_path`` (or the model's)."""
    from transformers import AutoTokenizer

    key = "model.tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model.name_or_path"
    location = model_location(cfg.tokenizer_name_or_path or cfg.name_or_path, key,
                              tokenizer=bool(cfg.tokenizer_name_or_path))
    try:
        return AutoTokenizer.from_pretrained(
            location, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, **hub.model_options(location)
        )
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"{key}: cannot load a tokenizer from {location}: {_why_not_loaded(location, exc)}", _hub_hint(location)
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

    location = model_location(cfg.name_or_path, "model.name_or_path")
    try:
        config = AutoConfig.from_pretrained(location, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                                            **hub.model_options(location))
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"model.name_or_path: cannot load {location}: {_why_not_loaded(location, exc)}", _hub_hint(location)
        ) from None
    limit = position_limit(config)
    if max_length is not None and limit is not None and max_length > limit:
        raise ModelError(
            f"data.max_length: {max_length} exceeds the position limit {limit} of model.name_or_path {location}",
            hint=f"set data.max_length to at most {limit}",
        )
    return config


def load_model(cfg: ModelConfig, id2label: dict[int, str], max_length: Optional[int] = None):
    """``AutoModelForSequenceClassification`` with the data's labels (see :func:`load_model_reporting`)."""
    return load_model_reporting(cfg, id2label, max_length)[0]


def load_model_reporting(cfg: ModelConfig, id2label: dict[int, str], max_length: Optional[int] = None
                         ) -> tuple[Any, tuple[str, ...]]:
    """``AutoModelForSequenceClassification`` with the data's labels, and the names of its new head's weights.

    A classification head made for the data's labels is what fine-tuning
    expects, so transformers' load report, which lists its weights as
    missing, is held back when that is all it says; the caller names the new
    head once (the start line does). A report of anything else (encoder
    weights missing, unexpected or of another shape) is shown as transformers
    wrote it.

    Args:
        cfg: The ``model`` section.
        id2label: Label ids to names, from the training data (regression: one, the target's).
        max_length: ``data.max_length``, checked against the model's position limit.

    Raises:
        ModelError: for a missing path, a directory that is not a model, a
            head whose size disagrees with the labels (unless
            ``model.ignore_mismatched_sizes``), or a too-long ``max_length``.
    """
    from transformers import AutoModelForSequenceClassification

    from finetune.tasks import TRANSFORMERS_PROBLEM_TYPES

    location = model_location(cfg.name_or_path, "model.name_or_path")
    label2id = {name: i for i, name in id2label.items()}
    config = load_model_config(cfg, max_length)
    trained_labels = getattr(config, "id2label", None) or {}
    if has_classification_head(config) and len(trained_labels) != len(id2label) and not cfg.ignore_mismatched_sizes:
        raise ModelError(
            f"model.name_or_path: {location} was trained with {len(trained_labels)} labels, the data has "
            f"{len(id2label)}",
            hint="set model.ignore_mismatched_sizes: true to start a new classification head",
        )
    config.num_labels = len(id2label)
    config.id2label = dict(id2label)
    config.label2id = label2id
    # transformers' pipelines read it: softmax for single labels, sigmoid for multi-label, none for regression
    config.problem_type = TRANSFORMERS_PROBLEM_TYPES[cfg.problem_type]
    if cfg.dropout is not None:
        set_dropout(config, cfg.dropout)
    try:
        with held_load_report() as held:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                location,
                config=config,
                revision=cfg.revision,
                trust_remote_code=cfg.trust_remote_code,
                ignore_mismatched_sizes=cfg.ignore_mismatched_sizes,
                output_loading_info=True,
                **hub.model_options(location, weights=True),
            )
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.name_or_path: cannot load {location}: {_why_not_loaded(location, exc)}") from None
    new_head, other = new_head_of(model, info)
    if other:
        show(held)  # not only the head: transformers' own report says what and why
    return model, new_head


def has_classification_head(config: Any) -> bool:
    """Whether a model's config names a sequence-classification model: one saved with a trained head."""
    return any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or []))


def trained_head_labels(config: Any) -> Optional[list[str]]:
    """The classes a model's classification head was trained for, in the order of its outputs; ``None`` where it
    has no such head (an encoder alone, a regression head) or its config names none (transformers' ``LABEL_0``).

    transformers loads a trained head whose size fits the data's labels as it is, output by output, and names its
    outputs by the config it is handed, whatever they meant. The data's label ids come in an order of their own
    (sorted, ``data.label_map``'s or a ``ClassLabel``'s), so a head trained as ``{0: spam, 1: ham}`` continued on
    data labelled ``ham`` and ``spam`` started with each output taken for the other class: every prediction
    inverted. Where the head was trained for the data's labels, their ids take the head's order
    (:func:`finetune.labels.encode_train`), so each output keeps its class and the fine-tuned model the
    ids of the one it started from; where it was trained for others, a warning says how its outputs are taken
    (:func:`finetune.label_warnings.warn_of_a_head_for_other_labels`).
    """
    id2label = getattr(config, "id2label", None) or {}
    regression = getattr(config, "problem_type", None) == "regression"
    if not has_classification_head(config) or regression or len(id2label) < 2:
        return None
    names = [str(id2label[i]) for i in sorted(id2label, key=int)]
    return None if all(_UNNAMED.fullmatch(name) for name in names) else names


def set_dropout(config, p: float) -> None:
    """Set every dropout probability of a transformers config to ``p`` (``model.dropout``).

    Each family names its own: BERT's ``hidden_dropout_prob`` and
    ``attention_probs_dropout_prob``, DistilBERT's ``dropout``,
    ``attention_dropout`` and ``seq_classif_dropout``, ModernBERT's
    ``embedding_dropout`` and ``mlp_dropout``, DeBERTa's ``pooler_dropout``,
    ELECTRA's ``summary_last_dropout``. A head's ``classifier_dropout`` of
    ``None`` means "the hidden dropout", so it is set too.
    """
    for name, value in config.to_dict().items():
        probability = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        if "dropout" in name and probability:
            setattr(config, name, p)


def choose_trained_weights(model, cfg: ModelConfig, accelerator):
    """``model`` set to train what ``model.*`` asks: LoRA adapters (``model.lora_rank``, :mod:`finetune.lora`),
    every weight but the bottom of the encoder (``model.freeze_embeddings``, ``model.freeze_blocks``,
    :mod:`finetune.freezing`), or every weight. Returns ``(model, LoraPlan or None, Frozen or None)``.

    Raises:
        ConfigError: for LoRA under FSDP or DeepSpeed, whose sharded saving would bypass the adapter's
            checkpoints; for target modules that match nothing or the head; for more frozen blocks than
            the model has.
    """
    from accelerate.utils import DistributedType

    from finetune.freezing import freeze_bottom
    from finetune.lora import add_lora

    if cfg.lora_rank is None:
        return model, None, freeze_bottom(model, cfg.freeze_embeddings, cfg.freeze_blocks)
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(f"model.lora_rank: LoRA under {accelerator.distributed_type.value} is not supported; "
                          f"launch with one process or --multi_gpu (DDP)")
    return (*add_lora(model, cfg), None)


# A classifier never decodes, so the key/value cache some configs switch on (BERT's, for its decoder use) is unused;
# left on under checkpointing, transformers warns on the first recomputing forward that it turns the cache off. The
# models whose cache was switched off here get it back when checkpointing goes off (after a probe or a trial).
_CACHE_SWITCHED_OFF: "weakref.WeakSet" = weakref.WeakSet()


def set_gradient_checkpointing(model, on: bool) -> None:
    """Switch transformers' gradient checkpointing of ``model`` on or off.

    Non-reentrant (``use_reentrant=False``): it needs no input that requires
    a gradient, works with the embedding's own backward, and restores the
    random-number generators before recomputing, so dropout draws the same
    masks twice and the update is the one without checkpointing.

    Raises:
        ConfigError: if it is asked for and the model's class does not support it.
    """
    # transformers renamed it activation checkpointing; the gradient_checkpointing_* names are the older ones
    renamed = hasattr(model, "activation_checkpointing_enable")
    if not on:
        if is_checkpointing(model) and renamed:
            model.activation_checkpointing_disable()
        elif is_checkpointing(model):
            model.gradient_checkpointing_disable()
        if model in _CACHE_SWITCHED_OFF:
            model.config.use_cache = True
            _CACHE_SWITCHED_OFF.discard(model)
        return
    if not supports_checkpointing(model):
        from finetune.lora import base_model

        raise ConfigError(f"training.gradient_checkpointing: {type(base_model(model)).__name__} does not support it",
                          hint="set it to false; a smaller micro-batch, LoRA or a shorter max_length save memory too")
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
        _CACHE_SWITCHED_OFF.add(model)
    from finetune.attention_kernel import recompute_context

    kwargs = {"use_reentrant": False}
    recompute = recompute_context(model)  # training.attention_kernel's, in the recompute too
    if recompute is not None:
        kwargs["context_fn"] = recompute
    if renamed:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers also makes the embeddings' output require a gradient, which reentrant checkpointing needs
    # and this one does not; left on, it outlives checkpointing (the memory probe switches it on and off), and
    # under frozen embeddings and blocks (model.freeze_*) it runs the backward pass through every frozen block
    try:
        model.disable_input_require_grads()
    except AttributeError:  # no such hook was added (a release or a model that adds none)
        pass


def check_compiler(setting, device) -> None:
    """Refuse ``training.torch_compile`` in one line where its compile would fail: inductor could not build
    kernels for ``device``, or a whole compile would trace transformers' mask building on a torch older than that
    code needs. The compile happens at the first update, and its failure there is a page of traceback."""
    if not setting:
        return
    why = _compiler_missing(device)
    if why is not None:
        raise ConfigError(f"training.torch_compile: {why}", hint="set training.torch_compile=false to train "
                          "without compiling")
    import torch

    # transformers 5 builds the attention mask inside the forward a whole compile traces, asking
    # torch.compiler.is_exporting, which an older torch lacks: the trace fails at the first update
    if setting is True and not hasattr(torch.compiler, "is_exporting") and hub.transformers_major() >= 5:
        raise ConfigError(f"training.torch_compile: true traces transformers' mask building, which calls "
                          f"torch.compiler.is_exporting, and torch {torch.__version__} has none",
                          hint="set training.torch_compile=blocks to compile the encoder blocks alone, or "
                          "install a newer torch")


def _compiler_missing(device) -> Optional[str]:
    """Why inductor cannot build kernels for ``device`` here (``None``: nothing it needs is missing). Its CPU
    kernels are C++ built by ``$CXX`` (else g++, clang++ on macOS); its GPU kernels are Triton's, for compute
    capability 7.0 and newer, whose launchers a C compiler builds (``$CC``, else gcc or clang)."""
    import torch

    if device.type == "cpu":
        cxx = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
        return None if shutil.which(cxx) else f"inductor builds CPU kernels with the C++ compiler {cxx}, not found"
    if device.type != "cuda":
        return None
    if importlib.util.find_spec("triton") is None:
        return "inductor builds GPU kernels with Triton, which is not installed"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 7:
        return (f"Triton builds kernels for compute capability 7.0 and newer; {torch.cuda.get_device_name(device)} "
                f"is {major}.{minor}")
    compilers = [os.environ["CC"]] if os.environ.get("CC") else ["gcc", "clang"]  # Triton's own search
    if not any(shutil.which(c) for c in compilers):
        return f"Triton builds its kernels' launchers with a C compiler ({' or '.join(compilers)}), none found"
    return None


def set_attention_kernel(model, training, accelerator, max_length: int) -> None:
    """``training.attention_kernel`` asked for by ``model`` in place (see :mod:`finetune.attention_kernel`), and
    where it will not run said once. Before the memory plan, which then measures the kernel training runs."""
    from finetune.attention_kernel import apply_attention_kernel

    apply_attention_kernel(model, training.attention_kernel, accelerator, max_length)


def set_forward(model, training, accelerator=None) -> None:
    """How ``model``'s forward runs, set in place: ``training.bias_apart``, then
    ``training.gradient_accumulation_fusion`` where ``accelerator``'s processes allow it (said once where they
    do not), then ``training.torch_compile``, whose compile traces the layers as they will train."""
    if training.bias_apart:
        from finetune.bias_apart import add_biases_apart

        add_biases_apart(model)
    if training.gradient_accumulation_fusion:
        from finetune.accumulation_fusion import fuse_where_allowed

        fuse_where_allowed(model, accelerator)
    compile_model(model, training.torch_compile)


def compile_model(model, setting) -> None:
    """``training.torch_compile``, applied to ``model`` in place, so that its state_dict keys, Accelerate's
    ``unwrap_model`` and ``save_pretrained`` stay as without compiling.

    ``True`` compiles the whole forward. ``"blocks"`` compiles each encoder block on its own (regional
    compilation): the blocks of one kind share their code, so dynamo traces one and inductor compiles it
    once for all of them, and the cold start is a fraction of the whole model's. The embeddings and the
    head stay eager; their few kernels are the price.

    Raises:
        ConfigError: if ``"blocks"`` finds no list of transformer blocks in the model.
    """
    if setting is True:
        model.compile()
    elif setting == "blocks":
        from finetune.lora import base_model, blocks_of

        try:
            blocks = blocks_of(model)
        except ConfigError:
            raise ConfigError(f"training.torch_compile: blocks finds no transformer blocks in "
                              f"{type(base_model(model)).__name__}", hint="set it to true to compile the whole "
                              "forward") from None
        for block in blocks:
            block.compile()


def supports_checkpointing(model) -> bool:
    """Whether transformers can recompute ``model``'s layers (its class's ``supports_gradient_checkpointing``)."""
    return bool(getattr(model, "supports_gradient_checkpointing", False))


def is_checkpointing(model) -> bool:
    """Whether ``model`` recomputes its layers' activations in the backward pass."""
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def hub_id(name_or_path: str) -> Optional[str]:
    """The Hugging Face Hub id of the model ``model.name_or_path`` names, where one is known.

    A Hub id is its own; a model shipped in a Python package the package's
    (:data:`~finetune.resources.PACKAGED_HUB_MODELS`); a folder of the Hub's
    cache (``.../models--org--name/snapshots/<commit>``) the id it was
    downloaded as. A local folder of any other kind has none: its contents
    may be anything.
    """
    if is_package_path(name_or_path):
        return PACKAGED_HUB_MODELS.get(package_of(name_or_path)[0])
    path = Path(name_or_path).expanduser()
    cached = next((p.name for p in (path, *path.parents) if p.name.startswith("models--")), None)
    if cached:
        return cached[len("models--"):].replace("--", "/")
    if path.exists() or name_or_path.startswith((".", "/", "~")):
        return None
    return name_or_path


def model_name(name_or_path: str) -> str:
    """The starting model, named so that the name means something on another machine.

    Its Hub id where one is known (:func:`hub_id`); else, for a model inside
    a Python package, its path there and the package with its version, and
    for a local folder, the folder's name.
    """
    known = hub_id(name_or_path)
    if known:
        return known
    if is_package_path(name_or_path):
        dist, inner = package_of(name_or_path)
        return f"{inner} of the Python package {dist} {package_version(dist)}"
    return f"the local model {Path(name_or_path).expanduser().resolve().name}"


def _why_not_loaded(location: str, exc: BaseException) -> str:
    """The loader's reason, or, where the Hub could not be reached, that the local cache lacks it too."""
    offline = hub.offline_reason(location)
    if offline is not None and isinstance(exc, OSError):  # a file it did not find; a ValueError says its own
        return f"not in the local Hugging Face cache, and the Hub cannot be reached ({offline})"
    return _first_line(exc)


def _hub_hint(location: str) -> Optional[str]:
    """Say why a name that is no local path was looked up on the Hub (a mistyped relative path?)."""
    if hub.is_local(location):
        return None
    near = near_names(Path(location))
    return f"{location!r} is not a local path, so it was taken as a Hugging Face Hub id{'; ' + near if near else ''}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
