"""LoRA adapters (PEFT): which modules get them, adding them, and saving and loading what they train.

With ``model.lora_rank`` set, the encoder's weights stay frozen and each
projection of its transformer blocks learns a low-rank update ``B @ A``
(scaled by ``lora_alpha / lora_rank``); the classification head, new for the
data's labels, is trained in full, with what runs between it and the blocks
(BERT's pooler: :func:`head_modules`). Only the trained weights get gradients and
AdamW state: that is the memory LoRA saves (docs/memory.md measures how much).

The accumulation contract is untouched: the loss, its weights and the
optimizer step are the ones of full fine-tuning, over fewer parameters.

What is saved, and where:

* a checkpoint holds the trained weights only (``adapter/``, PEFT's format)
  instead of the whole model, so it is small; a resume loads them into the
  same frozen base model and goes on bit for bit;
* the output folder holds the model with the adapters merged into its weights
  (what ``transformers.pipeline`` and ``finetune predict`` load, with no PEFT
  needed) and, in ``adapter/``, the adapter alone for PEFT users.

The adapter folder is a subfolder on purpose: transformers loads a folder
that holds both ``config.json`` and ``adapter_config.json`` as a base model
plus an adapter, which for a merged model would apply the update twice.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from finetune.errors import ConfigError, ModelError
from finetune.outputs import ADAPTER_CONFIG, ADAPTER_DIR
from finetune.schedules import quietly_imported

if TYPE_CHECKING:
    from finetune.config import ModelConfig

logger = logging.getLogger("finetune")

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraPlan:
    """What LoRA does to a model: the modules adapted, the head trained in full, and the weights trained."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # module name suffixes, as PEFT matches them
    adapted: int  # modules that got an adapter
    head: tuple[str, ...]  # modules trained in full
    trainable: int
    total: int

    def describe(self) -> str:
        """The start line's words: ``LoRA r=8 alpha=16 on query, key, ... (72 modules): 1.2% of 23M weights``."""
        share = 100.0 * self.trainable / max(1, self.total)
        return (f"LoRA r={self.rank} alpha={self.alpha:g} dropout={self.dropout:g} on {', '.join(self.targets)} "
                f"({self.adapted} modules) + {', '.join(self.head) or 'no head'} in full: "
                f"{self.trainable:,} of {self.total:,} weights trained ({share:.2f}%)")


def is_lora(model) -> bool:
    """Whether ``model`` (or the module inside a DDP wrapper) carries PEFT adapters."""
    model = getattr(model, "module", model)
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model):
    """The transformers model inside PEFT's wrapper; ``model`` itself when it carries no adapters."""
    return model.get_base_model() if is_lora(model) else model


def layer_stack(model) -> tuple[str, torch.nn.ModuleList]:
    """The encoder's transformer blocks: the ``nn.ModuleList`` inside the base model holding the most weights.

    Every architecture the package supports keeps its blocks in one such list
    (``bert.encoder.layer``, ``distilbert.transformer.layer``, ``model.layers``,
    ``albert.encoder.albert_layer_groups``); a list nested in it holds no more
    weights, so the outer one is taken.

    Raises:
        ConfigError: if the model has no such list.
    """
    prefix = model.base_model_prefix
    stacks = [(name, module) for name, module in model.named_modules()
              if isinstance(module, torch.nn.ModuleList) and name.startswith(f"{prefix}.")]
    if not stacks:
        raise ConfigError(f"model.lora_target_modules: auto finds no transformer blocks in {type(model).__name__}; "
                          f"name the modules to adapt")
    size = {name: sum(p.numel() for p in module.parameters()) for name, module in stacks}
    return max(stacks, key=lambda item: (size[item[0]], -len(item[0])))


def below_the_blocks(model, stack_name: str) -> set[int]:
    """The ``id`` of each of the encoder's weights outside its blocks that serves them from below: the embeddings
    and weights named for them (ELECTRA's projection of them to the hidden size), embedding tables, and what the
    module holding the blocks holds beside them (ALBERT's projection, DeBERTa's relative positions and their norm,
    MPNet's relative attention bias), but a final norm there (:func:`final_norm_beside_the_blocks`). Read from
    where each sits, its name and type, not from the order the encoder registers its parts: GTE's and Nomic
    BERT's register their pooler before their blocks, and run it after them.
    ``layer_depths`` puts these at depth 0, and LoRA trains none of them; the rest outside the blocks is above them.
    """
    encoder = getattr(model, model.base_model_prefix)
    holder = stack_name.split(".")[1]  # the encoder's child that holds the blocks
    blocks = {id(p) for p in encoder.get_submodule(stack_name.split(".", 1)[1]).parameters()}
    final = final_norm_beside_the_blocks(model, stack_name)  # beside them, but run on the last one's output
    after = {id(p) for p in encoder.get_submodule(final).parameters()} if final is not None else set()
    tables = {id(p) for module in encoder.modules() if isinstance(module, torch.nn.Embedding)
              for p in module.parameters()}
    return {id(p) for name, p in encoder.named_parameters() if id(p) not in blocks | after
            and (name.startswith(f"{holder}.") or "embed" in name.lower() or id(p) in tables)}


def final_norm_beside_the_blocks(model, stack_name: str) -> Optional[str]:
    """The name, in the encoder, of a norm that the module holding the blocks keeps beside them with nothing else
    there for it to normalize: a pre-LayerNorm encoder's final norm, which runs on the last block's output
    (XLM-RoBERTa-XL's ``encoder.LayerNorm``). DeBERTa's keeps a norm beside the relative embeddings it normalizes,
    which serves the blocks from below; ALBERT's, MPNet's and RemBERT's keep no norm there. ``None`` where there
    is none."""
    encoder = getattr(model, model.base_model_prefix)
    holder, _, inside = stack_name.split(".", 1)[1].partition(".")
    if not inside:  # the blocks are the encoder's own child: nothing holds them beside
        return None
    beside = [(name, module) for name, module in encoder.get_submodule(holder).named_children()
              if name != inside.split(".")[0] and _holds_weights(module)]
    if len(beside) == 1 and type(beside[0][1]).__name__.endswith("Norm"):
        return f"{holder}.{beside[0][0]}"
    return None


def blocks_of(model) -> torch.nn.ModuleList:
    """The encoder's transformer blocks (a LoRA model's too): :func:`layer_stack` of its base model.

    Raises:
        ConfigError: if the model has no such list.
    """
    return layer_stack(base_model(model))[1]


def auto_target_modules(model) -> list[str]:
    """The attention and feed-forward projections of ``model``'s blocks, as short module-name suffixes.

    That is every ``nn.Linear`` inside :func:`layer_stack`, each named by the
    shortest suffix that matches nothing outside the blocks: BERT's
    ``output.dense`` rather than ``dense``, which would also adapt the pooler.
    PEFT's own defaults adapt the attention's query and value alone; the
    feed-forward projections hold two thirds of a block's weights, and
    adapting every projection is what LoRA's authors (and QLoRA's) found to
    match full fine-tuning best.
    """
    stack_name, stack = layer_stack(model)
    inside = [f"{stack_name}.{name}" for name, module in stack.named_modules() if isinstance(module, torch.nn.Linear)]
    every = [name for name, _ in model.named_modules() if name]
    targets: list[str] = []
    for name in inside:  # the model's own order: query, key, value, ...
        parts = name.split(".")
        for start in range(len(parts) - 1, -1, -1):
            suffix = ".".join(parts[start:])
            if all(n in inside for n in every if _matches(n, suffix)):
                break
        if suffix not in targets:
            targets.append(suffix)
    return targets


def _matches(name: str, suffix: str) -> bool:
    """PEFT's rule for a target given by name: the whole name, or its last dotted parts."""
    return name == suffix or name.endswith(f".{suffix}")


def _matches_within(name: str, module: str) -> bool:
    """Whether ``name`` is ``module`` or inside it."""
    return name == module or name.startswith(f"{module}.")


def head_modules(model) -> list[str]:
    """The modules LoRA trains in full: the classification head and whatever runs above the transformer blocks.

    Outside the encoder, the head itself (``classifier``, DistilBERT's
    ``pre_classifier``, DeBERTa's pooler, ModernBERT's ``head``). Inside it,
    the modules beside the blocks of :func:`layer_stack` that do not serve
    them from below (:func:`below_the_blocks`): BERT's, ALBERT's and GTE's
    pooler, ModernBERT's final norm, and a pre-LayerNorm encoder's final norm kept beside the blocks
    (:func:`final_norm_beside_the_blocks`, XLM-RoBERTa-XL's). They serve the head alone, and
    BERT's pooler was pretrained for next-sentence prediction, a task the new
    labels are not; frozen, it would stand between the adapted blocks and the
    head (docs/memory.md measures what training it changes). ``layer_depths``
    gives the same modules the head's depth.
    """
    prefix = model.base_model_prefix
    outside = [name for name, module in model.named_children() if name != prefix and _holds_weights(module)]
    try:
        stack_name, _ = layer_stack(model)
    except ConfigError:  # no blocks to be above (targets named by hand): the head alone
        return outside
    holder = stack_name.split(".")[1]  # the base model's child that holds them
    below = below_the_blocks(model, stack_name)
    above = [name for name, module in getattr(model, prefix).named_children()
             if name != holder and _holds_weights(module) and not any(id(p) in below for p in module.parameters())]
    final = final_norm_beside_the_blocks(model, stack_name)
    return outside + [f"{prefix}.{name}" for name in above + ([final] if final else [])]


def _holds_weights(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def check_targets(model, targets: list[str]) -> int:
    """The number of modules ``targets`` adapt, every one inside the encoder.

    Raises:
        ConfigError: for a target that matches no module, or one in the head (trained in full already).
    """
    prefix = f"{model.base_model_prefix}."
    names = [name for name, _ in model.named_modules() if name]
    head = head_modules(model)
    adapted: set[str] = set()
    for target in targets:
        found = [n for n in names if _matches(n, target)]
        if not found:
            raise ConfigError(f"model.lora_target_modules: {target!r} matches no module of {type(model).__name__} "
                              f"(auto would adapt {', '.join(auto_target_modules(model))})")
        outside = [n for n in found if not n.startswith(prefix)]
        if outside:
            raise ConfigError(f"model.lora_target_modules: {target!r} matches {outside[0]}, which is outside the "
                              f"encoder (the head is trained in full); name a longer suffix")
        in_head = [n for n in found if any(_matches_within(n, module) for module in head)]
        if in_head:
            raise ConfigError(f"model.lora_target_modules: {target!r} matches {in_head[0]}, which is above the "
                              f"transformer blocks and trained in full with the head; name a longer suffix")
        adapted.update(found)
    return len(adapted)


def add_lora(model, cfg: "ModelConfig") -> tuple[torch.nn.Module, LoraPlan]:
    """``model`` with LoRA adapters (PEFT) as ``cfg`` says, and what was done.

    Args:
        model: A transformers ``...ForSequenceClassification`` model.
        cfg: The ``model`` section; ``cfg.lora_rank`` must be set.

    Raises:
        ConfigError: for target modules that match nothing or match the head, or a
            model PEFT cannot wrap.
    """
    quietly_imported("peft")
    from peft import LoraConfig, get_peft_model

    targets = auto_target_modules(model) if cfg.lora_target_modules == "auto" else list(cfg.lora_target_modules)
    adapted = check_targets(model, targets)
    head = head_modules(model)
    config = LoraConfig(task_type="SEQ_CLS", r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                        lora_dropout=cfg.lora_dropout, target_modules=list(targets), modules_to_save=list(head))
    try:
        with _no_rename_warning():
            peft_model = get_peft_model(model, config)
    except (TypeError, ValueError) as exc:  # a layout PEFT cannot wrap, said in its words
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model.lora_rank: PEFT cannot adapt {type(model).__name__}: {first}",
                          hint="train every weight (model.lora_rank: null)") from None
    trainable, total = trained_weights(peft_model)
    plan = LoraPlan(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, tuple(targets), adapted, tuple(head),
                    trainable, total)
    logger.debug("model.lora: %s", plan.describe())
    return peft_model, plan


@contextlib.contextmanager
def _no_rename_warning() -> Iterator[None]:
    """PEFT reads transformers' older ``is_gradient_checkpointing``, which warns that it was renamed: a
    warning about PEFT's code, not the user's, so it is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def trained_weights(model) -> tuple[int, int]:
    """``(trained, total)`` weights of the model as it is used: an adapted module counts once, not twice.

    PEFT keeps a frozen original beside the trained copy of each head module;
    the total counts the model a merged save holds.
    """
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_originals = sum(p.numel() for name, p in model.named_parameters() if ".original_module." in name)
    lora = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    total = sum(p.numel() for p in model.parameters()) - frozen_originals - lora
    return trainable, total


# --------------------------------------------------------------------------- saving and loading


def save_adapter(model, directory: Path) -> None:
    """PEFT's adapter files (the LoRA weights and the head) into ``directory``."""
    model.save_pretrained(str(directory), safe_serialization=True)


def load_adapter_weights(model, directory: Path) -> None:
    """Load the adapter weights saved by :func:`save_adapter` into ``model``, every trained weight checked.

    Raises:
        ModelError: if the folder is missing, or its weights do not cover exactly what ``model`` trains.
    """
    quietly_imported("peft")
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = Path(directory) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ModelError(f"{weights}: missing; a LoRA run's checkpoint keeps its trained weights there")
    state = load_file(str(weights), device=str(next(model.parameters()).device))
    expected = sum(1 for p in model.parameters() if p.requires_grad)
    problem = None if len(state) == expected else f"holds {len(state)} tensors for a model that trains {expected}"
    if problem is None:
        try:
            unexpected = list(getattr(set_peft_model_state_dict(model, state), "unexpected_keys", None) or [])
        except (KeyError, RuntimeError) as exc:  # a weight missing, or of another shape
            unexpected = [str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__]
        problem = f"does not fit this model ({unexpected[0]})" if unexpected else None
    if problem is not None:
        raise ModelError(f"{weights}: {problem}: another run's adapter?")


def merged_copy(model) -> torch.nn.Module:
    """A plain transformers model whose weights have the adapters added in; ``model`` is left as it is.

    A copy rather than merging in place and back, which would not give the
    trained weights back bit for bit. It costs one more model in memory, once,
    at the end of the run.
    """
    return copy.deepcopy(model).merge_and_unload()


@contextlib.contextmanager
def adapter_in_checkpoints(accelerator, model) -> Iterator[None]:
    """Inside, ``accelerator.save_state`` saves the adapter (the trained weights) instead of the whole model,
    and ``load_state`` loads it back: a LoRA checkpoint is small and resumes exactly.

    Accelerate's pre-hooks are the documented way to replace its model saving;
    the optimizer, the random states and the rest are saved by Accelerate as
    before. Outside this context nothing changes.
    """
    def save_adapter_instead(models, weights, output_dir):
        index = _index_of(models, model, accelerator)
        weights.pop(index)  # Accelerate writes no model.safetensors for it
        if accelerator.is_main_process:
            save_adapter(accelerator.unwrap_model(model), Path(output_dir) / ADAPTER_DIR)

    def load_adapter_instead(models, input_dir):
        models.pop(_index_of(models, model, accelerator))
        load_adapter_weights(accelerator.unwrap_model(model), Path(input_dir) / ADAPTER_DIR)

    handles = [accelerator.register_save_state_pre_hook(save_adapter_instead),
               accelerator.register_load_state_pre_hook(load_adapter_instead)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _index_of(models: list, model, accelerator) -> int:
    """Where ``model`` is in Accelerate's list of prepared models, which holds it wrapped or not: under DDP
    the module as it was before wrapping, under FSDP the wrapper."""
    target = accelerator.unwrap_model(model)
    return next(i for i, m in enumerate(models) if accelerator.unwrap_model(m) is target)


# --------------------------------------------------------------------------- using a LoRA checkpoint


def is_adapter_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint of a LoRA run: its model is the base model plus ``adapter/``."""
    path = Path(path)
    return (path / ADAPTER_DIR / ADAPTER_CONFIG).is_file() and not any(
        (path / name).is_file() for name in ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json"))


def load_adapter_checkpoint(path: Path):
    """The fine-tuned model of a LoRA run's checkpoint, merged: its base model, its config, its adapter.

    Raises:
        ModelError: if the base model the adapter was trained on cannot be loaded.
    """
    quietly_imported("peft")
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from finetune import hub
    from finetune.load_reports import held_load_report, new_head_of, show

    path = Path(path)
    base = base_model_of(path / ADAPTER_DIR)
    config = AutoConfig.from_pretrained(path)
    try:
        # the base model has no head for the run's labels: the adapter brings it (modules_to_save)
        with held_load_report() as held:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                base, config=config, output_loading_info=True, **hub.model_options(base, weights=True))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: a LoRA checkpoint, whose base model {base} cannot be loaded: "
                         f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0]}") from None
    if new_head_of(model, info)[1]:
        show(held)  # more than the head: transformers' report says what
    with _no_rename_warning():
        adapted = PeftModel.from_pretrained(model, str(path / ADAPTER_DIR))
    return merged_into_own_storage(adapted)


def merged_into_own_storage(adapted):
    """The PEFT model ``adapted`` with its adapters merged into weights of storage of their own.

    PEFT's merge writes each merged weight into the base layer's tensor (in place from PEFT 0.22, ``safe_merge``
    too), and a loader may share that storage with its other loads of the same base model: a second load of a
    checkpoint after a run in the same process added its update into the first's weights. Each weight and bias
    a merge writes is copied first; ``safe_merge`` checks the merged values are finite.
    """
    from peft.tuners.lora import LoraLayer

    for module in adapted.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            for tensor in (base.weight, getattr(base, "bias", None)):
                if tensor is not None:
                    tensor.data = tensor.data.clone()
    return adapted.merge_and_unload(safe_merge=True)


def base_model_of(adapter_dir: Path) -> str:
    """The base model an adapter folder names (``base_model_name_or_path`` in its config).

    Raises:
        ModelError: if its config cannot be read or names none.
    """
    try:
        return json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{Path(adapter_dir) / ADAPTER_CONFIG}: cannot read its base model ({exc})") from None
