"""``model.freeze_embeddings`` and ``model.freeze_blocks``: the bottom of the encoder keeps its pretrained values.

The frozen weights end the run bitwise as they began, everything above them
trains, they hold no gradient and no AdamW state, and below the lowest trained
block no activations are kept (the memory plan measures it). The contract
for the weights that train is in tests/test_accumulation.py.
"""

from __future__ import annotations

import pytest
import torch

from finetune.config import ModelConfig, OptimConfig, config_from_dict
from finetune.errors import ConfigError
from finetune.freezing import freeze_bottom
from finetune.lora import layer_stack
from finetune.depths import layer_depths
from finetune.optimization import build_optimizer
from helpers import ARCHITECTURES, Flat, blind_to_the_head, expected_depths, pad_collate, tiny_model, token_dataset


def _train_a_little(model, steps: int = 3):
    """A few AdamW steps on a padded batch; returns the optimizer."""
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-2, weight_decay=0.01))
    batch = pad_collate(token_dataset(8, seed=2))
    model.train()
    for _ in range(steps):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        torch.nn.functional.cross_entropy(out.logits, batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_frozen_depths_keep_their_values_and_everything_above_trains(model_type):
    model = tiny_model(model_type, num_labels=2, dropout=0.0)
    depth, blocks = layer_depths(model)
    # what the names say (a pooler registered before the blocks runs after them: GTE's, Nomic BERT's)
    assert {name: depth[id(p)] for name, p in model.named_parameters()} == expected_depths(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainable_before = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = freeze_bottom(model, freeze_embeddings=True, freeze_blocks=1)
    optimizer = _train_a_little(model)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, param in model.named_parameters():
        if depth[id(param)] <= 1:  # the embeddings and block 1
            assert not param.requires_grad and id(param) not in in_optimizer, name
            assert param.grad is None and param not in optimizer.state, name
            assert torch.equal(param, before[name]), name
        elif name in trainable_before and "position" not in name:  # RoFormer's fixed positions never train
            assert param.requires_grad and id(param) in in_optimizer, name
            # (a weight the head is blind to still moves: AdamW's decay)
            assert not torch.equal(param, before[name]) or blind_to_the_head(model, name), f"{name} did not train"
    assert frozen.blocks == 1 and 0 < frozen.frozen < frozen.total
    assert frozen.frozen == sum(p.numel() for p in model.parameters() if depth[id(p)] <= 1)


def test_the_embeddings_alone_or_with_blocks_and_the_head_alone():
    model = tiny_model("bert", num_labels=2)
    frozen = freeze_bottom(model, freeze_embeddings=True, freeze_blocks=0)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert not any("embeddings" in name for name in trained)
    assert any(".layer.0." in name for name in trained) and frozen.describe().startswith("frozen=embeddings (")
    # frozen blocks freeze the embeddings below them, asked for or not: their gradient would run through every block
    model = tiny_model("bert", num_labels=2)
    _, blocks = layer_stack(model)
    frozen = freeze_bottom(model, freeze_embeddings=False, freeze_blocks=len(blocks))
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"}
    assert frozen.describe().startswith("frozen=embeddings+blocks 1-2 (")
    assert freeze_bottom(tiny_model("bert"), freeze_embeddings=False, freeze_blocks=0) is None


def test_frozen_blocks_keep_no_activations_and_the_plan_counts_only_what_trains():
    from accelerate import Accelerator

    from finetune.memory import measure_activations, plan_memory

    accelerator = Accelerator(cpu=True)
    batch = pad_collate(token_dataset(8, seed=2))

    def plan(blocks):
        model = tiny_model("bert", num_labels=2)
        freeze_bottom(model, freeze_embeddings=blocks is not None, freeze_blocks=blocks or 0)
        activations = measure_activations(model, lambda b: {k: v[:b] for k, v in batch.items()}, accelerator)
        return model, activations, plan_memory(model, activations, b=8, checkpointing=False,
                                               device=torch.device("cpu"))

    model, all_blocks, everything = plan(None)
    _, _, embeddings = plan(0)
    frozen_model, one_kept, one_block = plan(1)
    trained = sum(p.numel() * p.element_size() for p in frozen_model.parameters() if p.requires_grad)
    assert one_block.gradients == trained and one_block.optimizer == 2 * trained
    assert embeddings.gradients < everything.gradients and one_block.gradients < embeddings.gradients
    assert one_block.weights == everything.weights  # frozen weights are still held
    # the first block is not run backwards: the autograd graph keeps nothing of it, and the plan counts the
    # one block that keeps activations, at a trained block's size
    assert (all_blocks.blocks, one_kept.blocks) == (2, 1)
    assert one_kept.per_row_block == all_blocks.per_row_block > 0
    assert one_block.activations < embeddings.activations
    _, none_kept, head_alone = plan(2)
    assert none_kept.blocks == 0 and head_alone.activations < one_block.activations


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the hook on a block whose input needs none
def test_under_checkpointing_the_backward_pass_stops_at_the_first_trained_block():
    """transformers makes the embeddings' output require a gradient when it checkpoints, for its reentrant
    mode; with the bottom frozen that would run the backward pass through every frozen block."""
    from finetune.modeling import set_gradient_checkpointing

    model = tiny_model("bert", num_labels=2)
    freeze_bottom(model, freeze_embeddings=True, freeze_blocks=1)
    set_gradient_checkpointing(model, True)
    _, blocks = layer_stack(model)
    backward_through = []
    for i, block in enumerate(blocks):
        block.register_full_backward_pre_hook(lambda module, grad, i=i: backward_through.append(i))
    _train_a_little(model, steps=1)
    assert backward_through == [1]  # the second block only: the first, frozen, is not run backwards


def test_frozen_settings_the_model_cannot_take_are_one_line():
    with pytest.raises(ConfigError, match=r"^model.freeze_blocks: 3, but BertForSequenceClassification has 2 "
                                          r"transformer blocks; at most 2, which trains the head alone$"):
        freeze_bottom(tiny_model("bert"), freeze_embeddings=False, freeze_blocks=3)
    with pytest.raises(ConfigError, match=r"^model.freeze_blocks: must be 0 or more, got -1$"):
        ModelConfig(freeze_blocks=-1)
    with pytest.raises(ConfigError, match=r"^model.freeze_embeddings: LoRA \(model.lora_rank\) keeps the whole "
                                          r"encoder frozen already; use one or the other$"):
        ModelConfig(lora_rank=8, freeze_embeddings=True)
    with pytest.raises(ConfigError, match=r"^model.freeze_blocks: finds no transformer blocks in Flat$"):
        freeze_bottom(Flat(), freeze_embeddings=False, freeze_blocks=1)


def test_a_resume_with_other_frozen_weights_is_another_run():
    from finetune.resuming import _differences, config_fingerprint

    def fingerprint(**model):
        return config_fingerprint(config_from_dict({"data": {"train_file": "x.tsv"}, "model": model}))

    saved, current = fingerprint(freeze_blocks=2), fingerprint(freeze_blocks=3)
    assert _differences(saved, current, sorted(current)) == "model.freeze_blocks: 2 -> 3"
    old = {k: v for k, v in fingerprint().items() if not k.startswith("model.freeze")}  # a checkpoint from before
    assert _differences(old, fingerprint(), sorted(fingerprint())) is None


@pytest.mark.slow
def test_a_run_keeps_the_pretrained_bottom_says_so_and_resumes_exactly(tmp_path):
    """End to end with ``fit``: the saved model's embeddings and block 1 are the pretrained model's, bit for bit;
    the start line, metrics.json and the model card say what was frozen; stopped and resumed, the same model."""
    from pathlib import Path

    from safetensors.torch import load_file

    from finetune.start_line import describe
    from tiny_run import fit_tiny_run

    sections = {"model": {"freeze_blocks": 1, "dropout": 0.1}, "output": {"checkpoint_every": 3}}
    lines = []
    cfg, summary = fit_tiny_run(tmp_path / "whole", before_fit=lambda run: lines.append(describe(run)), **sections)
    out = Path(cfg.output.output_dir)
    pretrained = load_file(Path(cfg.model.name_or_path) / "model.safetensors")
    trained = load_file(out / "model.safetensors")
    prefix = "bert."  # the tiny model is saved as a bare BertModel
    bottom = [n for n in pretrained if n.startswith(("embeddings.", "encoder.layer.0."))]
    assert bottom and all(torch.equal(trained[prefix + n], pretrained[n]) for n in bottom)
    assert not torch.equal(trained[prefix + "encoder.layer.1.output.dense.weight"],
                           pretrained["encoder.layer.1.output.dense.weight"])
    record = summary["train"]["frozen"]
    assert record["blocks"] == 1 and 0 < record["frozen_weights"] < record["total_weights"]
    share = 100 * record["frozen_weights"] / record["total_weights"]
    assert f" frozen=embeddings+block 1 ({share:.0f}% of the weights) for 2 classes" in lines[0]
    card = (out / "README.md").read_text(encoding="utf-8")
    assert (f"- Weights kept as pretrained: the embeddings and the lowest 1 transformer block, "
            f"{record['frozen_weights']:,} of {record['total_weights']:,} ({share:.1f}%).") in card

    part = tmp_path / "part"
    fit_tiny_run(part, on_update=lambda state: state.step >= 4, **sections)
    cfg_resumed, _ = fit_tiny_run(part, **{**sections, "output": {**sections["output"], "resume_from": "latest"}})
    assert (Path(cfg_resumed.output.output_dir) / "model.safetensors").read_bytes() == \
        (out / "model.safetensors").read_bytes()
