"""optim.layer_lr_decay: each parameter's learning rate is the one its depth says, on every architecture."""

from __future__ import annotations

import pytest

from finetune.config import ModelConfig, OptimConfig
from finetune.errors import ConfigError
from finetune.lora import add_lora, layer_stack
from finetune.optimization import build_optimizer, decay_groups, describe_layer_rates
from helpers import ARCHITECTURES, Flat, expected_depths, tiny_model

LR, DECAY = 1e-3, 0.5


def _rates(optimizer) -> dict[int, tuple[float, float]]:
    """Each parameter's (learning rate, weight decay), by id; every parameter in exactly one group."""
    rates = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            assert id(param) not in rates
            rates[id(param)] = (group["lr"], group["weight_decay"])
    return rates


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_each_parameter_trains_at_the_rate_of_its_depth_and_keeps_its_weight_decay(model_type):
    model = tiny_model(model_type)
    stack, blocks = layer_stack(model)
    rates = _rates(build_optimizer(model, OptimConfig(learning_rate=LR, weight_decay=0.01, layer_lr_decay=DECAY)))
    decays = {id(p): group["weight_decay"] for group in decay_groups(model, 0.01) for p in group["params"]}
    depths, expected = set(), expected_depths(model)
    for name, param in model.named_parameters():
        if not param.requires_grad:  # RoFormer's fixed sinusoidal positions: nothing to train
            assert id(param) not in rates, name
            continue
        depth = expected[name]
        depths.add(depth)
        lr, weight_decay = rates[id(param)]
        assert lr == pytest.approx(LR * DECAY ** max(0, len(blocks) - depth)), name
        assert weight_decay == decays[id(param)], name
    # the embeddings, every block and the head each have their rate (ALBERT shares one block)
    assert depths == set(range(len(blocks) + 2))
    assert len(blocks) == (1 if model_type == "albert" else 2)


def test_the_rates_of_named_parts_per_architecture():
    def rate(model_type, name):
        model = tiny_model(model_type)
        rates = _rates(build_optimizer(model, OptimConfig(learning_rate=LR, layer_lr_decay=DECAY)))
        return rates[id(dict(model.named_parameters())[name])][0] / LR

    assert rate("bert", "bert.embeddings.word_embeddings.weight") == pytest.approx(0.25)
    assert rate("bert", "bert.encoder.layer.0.attention.self.query.weight") == pytest.approx(0.5)
    assert rate("bert", "bert.pooler.dense.weight") == pytest.approx(1.0)  # above the blocks
    assert rate("roberta", "roberta.embeddings.position_embeddings.weight") == pytest.approx(0.25)
    assert rate("electra", "electra.embeddings_project.weight") == pytest.approx(0.25)  # runs before the blocks
    assert rate("deberta-v2", "deberta.encoder.rel_embeddings.weight") == pytest.approx(0.25)
    assert rate("deberta-v2", "deberta.encoder.LayerNorm.weight") == pytest.approx(0.25)  # the relative positions'
    assert rate("mpnet", "mpnet.encoder.relative_attention_bias.weight") == pytest.approx(0.25)  # used in each block
    assert rate("gte", "gte.pooler.dense.weight") == pytest.approx(1.0)  # registered before the blocks, run after
    assert rate("modernbert", "model.final_norm.weight") == pytest.approx(1.0)
    assert rate("distilbert", "pre_classifier.weight") == pytest.approx(1.0)
    assert rate("albert", "albert.encoder.embedding_hidden_mapping_in.weight") == pytest.approx(0.5)


def test_off_is_one_rate_and_the_schedule_scales_every_rate_alike():
    from transformers import get_scheduler

    model = tiny_model("bert")
    plain = build_optimizer(model, OptimConfig(learning_rate=LR))
    assert {group["lr"] for group in plain.param_groups} == {LR}
    optimizer = build_optimizer(model, OptimConfig(learning_rate=LR, layer_lr_decay=DECAY))
    peaks = [group["lr"] for group in optimizer.param_groups]
    assert sorted(set(peaks)) == pytest.approx([LR * 0.25, LR * 0.5, LR])
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=10)
    factors = []
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        factors.append(optimizer.param_groups[0]["lr"] / peaks[0])
        assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([p * factors[-1] for p in peaks])
    assert factors == pytest.approx([1 / 2, 1.0, 7 / 8, 6 / 8, 5 / 8])  # warmup over 2 updates, then linear to 10


def test_lora_adapters_train_at_their_blocks_rate():
    model, _ = add_lora(tiny_model("bert"), ModelConfig(lora_rank=4))
    rates = _rates(build_optimizer(model, OptimConfig(learning_rate=LR, layer_lr_decay=DECAY)))
    trained = {name: rates[id(p)][0] / LR for name, p in model.named_parameters() if p.requires_grad}
    assert all(id(p) not in rates for p in model.parameters() if not p.requires_grad)
    lora_a = {name: rate for name, rate in trained.items() if "lora_A" in name}
    assert lora_a and all(rate == pytest.approx(0.5 if ".layer.0." in name else 1.0) for name, rate in lora_a.items())
    assert all(rate == pytest.approx(1.0) for name, rate in trained.items() if "classifier" in name)


def test_the_start_line_says_the_peak_rates_top_first_whatever_the_schedule_did():
    from transformers import get_scheduler

    optimizer = build_optimizer(tiny_model("bert"), OptimConfig(learning_rate=LR, layer_lr_decay=DECAY))
    get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=10)  # lr is 0 at the start of warmup
    assert describe_layer_rates(optimizer.param_groups) == "head + block 2 0.001, block 1 0.0005, embeddings 0.00025"
    assert describe_layer_rates(build_optimizer(tiny_model("bert"), OptimConfig()).param_groups) == ""


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5])
def test_a_decay_outside_zero_to_one_is_refused_in_one_line(value):
    with pytest.raises(ConfigError, match=r"^optim.layer_lr_decay: must be in \(0, 1\]"):
        OptimConfig(layer_lr_decay=value)


def test_a_model_without_blocks_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="^optim.layer_lr_decay: finds no transformer blocks in Flat"):
        build_optimizer(Flat(), OptimConfig(layer_lr_decay=DECAY))
