"""LoRA adapters (``model.lora_rank``): what they adapt per architecture, what a run saves, and exact resume.

The accumulation contract with LoRA ((8, 4) against (32, 1), with and without
gradient checkpointing) is in tests/test_accumulation.py, beside the others.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.config import ModelConfig, load_config
from finetune.errors import ConfigError, ModelError
from finetune.lora import add_lora, auto_target_modules, head_modules, layer_stack
from helpers import ARCHITECTURES, blind_to_the_head, expected_depths, tiny_model

TEXTS = ["win a free prize now", "see you at lunch", "urgent cash offer txt", "good morning love"]


def _linear_names_in_blocks(model) -> set[str]:
    stack_name, stack = layer_stack(model)
    return {f"{stack_name}.{n}" for n, m in stack.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_auto_adapts_every_projection_of_the_blocks_and_trains_the_head_in_full(model_type):
    model = tiny_model(model_type)
    blocks = _linear_names_in_blocks(model)
    head = head_modules(model)
    encoder_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    head_weights = sum(p.numel() for name in head for p in model.get_submodule(name).parameters())
    above = {n for n, depth in expected_depths(model).items() if depth > len(layer_stack(model)[1])}
    adapted, plan = add_lora(model, ModelConfig(lora_rank=4))
    prefix = "base_model.model."
    with_adapters = {n.removeprefix(prefix) for n, m in adapted.named_modules() if hasattr(m, "lora_A")}
    # every linear projection in the transformer blocks, and nothing else (no pooler, no embedding, no head)
    assert with_adapters == blocks and plan.adapted == len(blocks)
    # ALBERT shares one layer; FNet's blocks mix tokens by a Fourier transform, which has no projections
    assert len(blocks) >= (2 if model_type == "fnet" else 4) * len(layer_stack(model)[1]) or model_type == "albert"
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    in_full = {n for n in trained if ".modules_to_save." in n}
    assert {n.removeprefix(prefix).split(".modules_to_save.")[0] for n in in_full} == set(head)
    assert trained == in_full | {n for n in trained if ".lora_A." in n or ".lora_B." in n}
    # the head in full: each of its weights trains
    assert sum(p.numel() for n, p in adapted.named_parameters() if n in in_full) == head_weights
    # and it is what the names say is above the blocks (GTE's pooler, registered before them, too)
    assert {n.removeprefix(prefix).replace(".modules_to_save.default.", ".") for n in in_full} == above
    # a forward and backward: gradients reach the trained weights and only them
    ids = torch.randint(5, 30, (3, 9))
    out = adapted(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 1, 2]))
    out.loss.backward()
    assert all((p.grad is not None) == p.requires_grad for p in adapted.parameters())
    lora_b = {n: p.grad for n, p in adapted.named_parameters() if ".lora_B." in n}
    # B starts at zero: its gradient is what moves first
    assert lora_b and all((g.abs().sum() > 0) != blind_to_the_head(model, n) for n, g in lora_b.items())
    # an untrained adapter leaves the model's function as it was
    for name, value in encoder_weights.items():
        assert torch.equal(adapted.get_base_model().get_parameter(name), value), name


def test_auto_names_the_projections_by_their_shortest_unambiguous_suffix():
    assert auto_target_modules(tiny_model("bert")) == ["query", "key", "value", "output.dense", "intermediate.dense"]
    assert auto_target_modules(tiny_model("distilbert")) == ["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"]
    assert auto_target_modules(tiny_model("modernbert")) == ["Wqkv", "Wo", "Wi"]


@pytest.mark.parametrize("config", [{"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072},
                                    {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 4096,
                                     "num_attention_heads": 16}], ids=["bert-base", "bert-large"])
def test_rank_8_trains_under_two_percent_of_a_full_sized_model(config):
    from transformers import BertConfig, BertForSequenceClassification

    with torch.device("meta"):  # sizes only: no memory, no initialisation
        model = BertForSequenceClassification(BertConfig(num_labels=2, **config))
    total = sum(p.numel() for p in model.parameters())
    _, plan = add_lora(model, ModelConfig(lora_rank=8))
    assert plan.total == total
    assert 0.005 < plan.trainable / plan.total < 0.02
    # each adapted projection: r x (inputs + outputs); the pooler: hidden x hidden + hidden; the head: hidden x 2 + 2
    h, ffn, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    per_layer = 8 * (4 * (h + h) + (h + ffn) + (ffn + h))
    assert plan.trainable == layers * per_layer + h * h + h + h * 2 + 2


@pytest.mark.parametrize("model_type, above", [("bert", ["bert.pooler"]), ("albert", ["albert.pooler"]),
                                                ("modernbert", ["model.final_norm"]), ("roberta", []),
                                                ("distilbert", []), ("electra", []), ("deberta-v2", [])])
def test_what_runs_above_the_blocks_is_trained_in_full_with_the_head(model_type, above):
    model = tiny_model(model_type)
    outside = [name for name, _ in model.named_children() if name != model.base_model_prefix]
    head = head_modules(model)
    assert head == [n for n in outside if any(True for _ in model.get_submodule(n).parameters())] + above
    tensors = {name: len(list(model.get_submodule(name).parameters())) for name in above}
    adapted, plan = add_lora(model, ModelConfig(lora_rank=4))
    assert list(plan.head) == head
    for name in above:  # trained as a copy in full, not adapted, and not frozen
        trained = [n for n, p in adapted.named_parameters() if p.requires_grad and f".{name}.modules_to_save." in n]
        assert len(trained) == tensors[name] > 0, name
        assert not any(hasattr(m, "lora_A") for n, m in adapted.named_modules() if f".{name}." in n)


def _an_adapted_projection(alpha: float, dropout: float):
    """The first projection LoRA adapts in a tiny BERT, its low-rank ``B`` drawn (PEFT starts it at zero, where
    neither the scale nor the dropout shows)."""
    adapted, _ = add_lora(tiny_model("bert"), ModelConfig(lora_rank=4, lora_alpha=alpha, lora_dropout=dropout))
    layer = next(m for m in adapted.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer"))
    torch.manual_seed(5)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    return layer


def test_an_adapted_projection_adds_its_low_rank_product_scaled_by_alpha_over_the_rank():
    layer = _an_adapted_projection(alpha=12.0, dropout=0.0).eval()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(3, a.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(layer(x) - layer.base_layer(x), 3.0 * x @ a.T @ b.T)


def test_lora_dropout_drops_the_adapters_input_in_training_only():
    dropped = _an_adapted_projection(alpha=4.0, dropout=0.5).train()
    x = torch.randn(64, dropped.in_features)
    with torch.no_grad():
        assert not torch.equal(dropped(x), dropped(x))  # a new mask each pass
        dropped.eval()
        torch.testing.assert_close(dropped(x), dropped(x))
        kept = _an_adapted_projection(alpha=4.0, dropout=0.0).train()
        assert torch.equal(kept(x), kept(x))


def test_bad_target_modules_are_one_line_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r"model.lora_target_modules: 'qkv' matches no module of "
                                          r"BertForSequenceClassification \(auto would adapt query, key"):
        add_lora(tiny_model("bert"), ModelConfig(lora_rank=4, lora_target_modules=["query", "qkv"]))
    with pytest.raises(ConfigError, match=r"'dense' matches classifier.dense, which is outside the encoder"):
        add_lora(tiny_model("roberta"), ModelConfig(lora_rank=4, lora_target_modules=["dense"]))
    with pytest.raises(ConfigError, match=r"'pooler.dense' matches bert.pooler.dense, which is above the transformer "
                                          r"blocks and trained in full with the head"):
        add_lora(tiny_model("bert"), ModelConfig(lora_rank=4, lora_target_modules=["query", "pooler.dense"]))
    with pytest.raises(ConfigError, match="model.lora_target_modules: an empty list adapts nothing"):
        ModelConfig(lora_rank=4, lora_target_modules=[])
    with pytest.raises(ConfigError, match="model.lora_rank: must be at least 1"):
        load_config(None, ["model.lora_rank=0"])


def test_lora_under_fsdp_or_deepspeed_is_refused_before_training():
    from accelerate.utils import DistributedType

    from finetune.modeling import choose_trained_weights

    cfg = load_config(None, ["model.lora_rank=4"])
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(ConfigError, match=f"model.lora_rank: LoRA under {kind.value} is not supported"):
            choose_trained_weights(tiny_model("bert"), cfg.model, SimpleNamespace(distributed_type=kind))


# --------------------------------------------------------------------------- a LoRA run, end to end


def _said_at_start(run, learning_rate: float) -> list[tuple[str, str]]:
    """The records ``start_line.say`` logs for ``run`` at another peak learning rate, but the caution of the tiny
    run's few updates (tests/test_start_of_run.py holds that one)."""
    from finetune.start_line import few_updates, say

    cfg = dataclasses.replace(run.cfg, optim=dataclasses.replace(run.cfg.optim, learning_rate=learning_rate))
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
    logger = logging.getLogger("finetune")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        say(dataclasses.replace(run, cfg=cfg))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    few = few_updates(run)
    return [record for record in records if record[1] != few]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """A LoRA run to its end, and the same run stopped after update 3 (mid-epoch) and resumed."""
    from tiny_run import fit_tiny_run

    sections = {"model": {"lora_rank": 4, "dropout": 0.1, "lora_dropout": 0.1},  # the random states are restored
                "output": {"checkpoint_every": 3, "keep_last": None},
                # the best evaluation's adapter is loaded back at the end; "best" is the highest loss, so
                # that it is the first epoch's, not the last weights
                "evaluation": {"metric_for_best_model": "loss", "greater_is_better": True,
                               "load_best_model_at_end": True}}
    whole_root, part_root = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("part")
    runs, at_3 = [], {}

    def keep_weights_at_3(state):
        if state.step == 3:
            model = runs[-1].accelerator.unwrap_model(runs[-1].model)
            at_3.update({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        return False

    def keep_run(run):
        from finetune.start_line import describe

        runs.append(run)
        lines.append(describe(run))
        said.update({lr: _said_at_start(run, lr) for lr in (1e-4, 3e-4)})
        said["full fine-tuning"] = _said_at_start(dataclasses.replace(run, lora=None), 1e-4)

    lines, said = [], {}
    whole = fit_tiny_run(whole_root, before_fit=keep_run, on_update=keep_weights_at_3, **sections)
    stopped = fit_tiny_run(part_root, on_update=lambda state: state.step >= 3, **sections)
    resumed = fit_tiny_run(part_root, **{**sections, "output": {**sections["output"], "resume_from": "latest"}})
    return SimpleNamespace(whole=whole, stopped=stopped, resumed=resumed, run=runs[0], start_line=lines[0], said=said,
                           weights_at_3=at_3,
                           out=Path(whole[0].output.output_dir), part=Path(resumed[0].output.output_dir))


def test_a_lora_checkpoint_holds_the_trained_weights_only(lora_runs):
    from safetensors import safe_open

    checkpoint = lora_runs.part / "checkpoints" / "checkpoint-3"
    assert lora_runs.stopped[1]["train"]["ended"] == "stopped_by_caller"
    assert not (checkpoint / "model.safetensors").exists()
    adapter = checkpoint / "adapter" / "adapter_model.safetensors"
    with safe_open(str(adapter), "pt") as fh:
        saved = {name: fh.get_tensor(name) for name in fh.keys()}
    trained = lora_runs.weights_at_3
    assert len(saved) == len(trained)
    assert sum(t.numel() for t in saved.values()) == sum(t.numel() for t in trained.values())
    # the whole model is several times the adapter's size (3x on a tiny model, whose pooler, trained in
    # full, is a fifth of the adapter)
    assert (lora_runs.out / "model.safetensors").stat().st_size > 3 * adapter.stat().st_size


def test_a_resumed_lora_run_ends_bitwise_equal_to_the_uninterrupted_one(lora_runs):
    whole, part = lora_runs.out, lora_runs.part
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert (part / name).read_bytes() == (whole / name).read_bytes(), name
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (whole, part)]
    for m in metrics:
        m["train"].pop("seconds")
        m["train"].pop("data_file")  # the same rows, written into each run's own folder
        m["best"].pop("checkpoint")  # in each run's own folder
        m["memory_plan"].pop("available")  # the machine's, at each start
    assert metrics[0] == metrics[1]


def test_the_saved_adapter_is_the_best_evaluations(lora_runs):
    best = lora_runs.whole[1]["best"]
    assert best["step"] == 10
    saved = (lora_runs.out / "adapter" / "adapter_model.safetensors").read_bytes()
    assert saved == (lora_runs.out / "checkpoints" / f"checkpoint-{best['step']}" / "adapter" /
                     "adapter_model.safetensors").read_bytes()
    # and it is not simply the last one's
    assert saved != (lora_runs.out / "checkpoints" / "checkpoint-18" / "adapter" /
                     "adapter_model.safetensors").read_bytes()


# PEFT's own loader reads transformers' renamed is_gradient_checkpointing: its warning, not the package's
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_the_merged_model_and_the_adapter_load_without_finetune_and_predict_alike(lora_runs):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    run, out = lora_runs.run, lora_runs.out
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    trained = run.accelerator.unwrap_model(run.model).eval()
    with torch.no_grad():
        expected = trained(**batch).logits
        merged = AutoModelForSequenceClassification.from_pretrained(out).eval()
        assert not any(".lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(**batch).logits, expected, rtol=1e-5, atol=1e-5)
        # PEFT's way: the base model, this run's labels, and adapter/
        base = AutoModelForSequenceClassification.from_pretrained(run.cfg.model.name_or_path,
                                                                  config=merged.config)
        with_adapter = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        torch.testing.assert_close(with_adapter(**batch).logits, expected, rtol=1e-5, atol=1e-5)
    scores = pipeline("text-classification", model=str(out), device="cpu", top_k=None)(TEXTS)
    probabilities = expected.softmax(-1)
    for row, probs in zip(scores, probabilities):
        by_label = {d["label"]: d["score"] for d in row}
        assert [by_label[merged.config.id2label[i]] for i in range(2)] == pytest.approx(probs.tolist(), abs=1e-5)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_finetune_predict_loads_a_lora_checkpoint(lora_runs):
    from transformers import AutoTokenizer

    from finetune.predict import Predictor
    from tiny_run import tiny_config

    checkpoint = lora_runs.out / "checkpoints" / "checkpoint-3"
    reports = _Records()
    logging.getLogger("transformers.modeling_utils").addHandler(reports)
    try:
        predictor = Predictor.load(checkpoint, device="cpu")
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(reports)
    # the base model's head is "missing" until the adapter brings it: no report says so to the user
    assert [r.getMessage() for r in reports.records if "LOAD REPORT" in r.getMessage()] == []
    # the base model with the adapter of update 3: set the weights of update 3 into a fresh LoRA model
    cfg = tiny_config(lora_runs.out.parent)
    from finetune.modeling import load_model

    model, _ = add_lora(load_model(cfg.model, {0: "ham", 1: "spam"}), ModelConfig(lora_rank=4))
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.data.copy_(lora_runs.weights_at_3[name])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with torch.no_grad():
        expected = model.eval()(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits
    np_logits = predictor.logits(TEXTS)
    torch.testing.assert_close(torch.from_numpy(np_logits), expected, rtol=1e-5, atol=1e-5)


def test_loading_a_lora_checkpoint_writes_nothing_into_the_loaded_base_weights(lora_runs, monkeypatch):
    """The base model's weights as the loader handed them out are left as they were: a loader may share their
    storage with its other loads of the same model, which an update merged in place would reach."""
    from transformers import AutoModelForSequenceClassification

    from finetune.lora import load_adapter_checkpoint

    handed_out = {}
    load = AutoModelForSequenceClassification.from_pretrained

    def load_and_keep(*args, **kwargs):
        loaded = load(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        handed_out.update({name: (p.detach(), p.detach().clone()) for name, p in model.named_parameters()})
        return loaded

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", load_and_keep)
    merged = load_adapter_checkpoint(lora_runs.out / "checkpoints" / "checkpoint-3")
    adapted = [n for n in handed_out if n.endswith("attention.self.query.weight")]
    assert adapted and all(not torch.equal(merged.get_parameter(n), handed_out[n][1]) for n in adapted)
    assert all(torch.equal(storage, as_loaded) for storage, as_loaded in handed_out.values())


def test_the_adapter_folder_given_as_a_model_is_told_where_the_merged_model_is(lora_runs, tmp_path, capsys):
    from finetune.predict import main

    adapter = lora_runs.out / "adapter"
    assert main([str(adapter), "hello"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[1] == (
        f"hint: it holds a LoRA adapter alone; {lora_runs.out} holds the model with it merged")
    alone = tmp_path / "adapter"
    shutil.copytree(adapter, alone)
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert main([str(alone), "hello"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[1] == (
        f"hint: it holds a LoRA adapter alone, which PEFT loads onto {base} (PeftModel.from_pretrained)")


def test_a_lora_run_says_what_it_trains(lora_runs):
    record = json.loads((lora_runs.out / "metrics.json").read_text())["train"]["lora"]
    plan = lora_runs.run.lora
    assert record["rank"] == 4 and record["target_modules"] == auto_target_modules(tiny_model("bert"))
    assert record["trainable_weights"] == plan.trainable == sum(
        p.numel() for p in lora_runs.run.model.parameters() if p.requires_grad)
    card = (lora_runs.out / "README.md").read_text()
    assert "LoRA adapters of rank 4 (alpha 16) on `query`, `key`" in card and "`adapter/`" in card
    assert f"(new head) with LoRA r=4 alpha=16 dropout=0.1 on query, key, value, output.dense, " \
           f"intermediate.dense (12 modules) + classifier, bert.pooler in full: {plan.trainable:,} of" \
           in lora_runs.start_line


def test_a_fresh_run_clears_an_earlier_lora_runs_adapter_only(tmp_path):
    from finetune.outputs import clear_previous_run

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "mine").mkdir()
    removed = clear_previous_run(tmp_path)
    assert tmp_path / "adapter" in removed and not (tmp_path / "adapter").exists() and (tmp_path / "mine").is_dir()


def test_a_save_replaces_an_earlier_adapter_whole_and_stops_at_a_folder_of_that_name_it_did_not_write(tmp_path):
    from finetune.errors import OutputError
    from finetune.results import _clear_earlier_adapter

    earlier = tmp_path / "adapter"
    earlier.mkdir()
    (earlier / "adapter_config.json").write_text("{}")
    (earlier / "adapter_model.safetensors").write_bytes(b"old")
    _clear_earlier_adapter(earlier)
    assert not earlier.exists()  # no file of the earlier adapter mixes with the new one's
    mine = tmp_path / "adapter"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    with pytest.raises(OutputError, match=r"adapter: a folder finetune did not write is in the way of the LoRA "
                                          r"adapter; move it"):
        _clear_earlier_adapter(mine)
    assert (mine / "notes.txt").read_text() == "the user's"


def test_a_damaged_adapter_is_refused_on_resume(tmp_path):
    from safetensors.torch import save_file

    from finetune.lora import load_adapter_weights

    model, _ = add_lora(tiny_model("bert"), ModelConfig(lora_rank=4))
    model.save_pretrained(str(tmp_path))
    with pytest.raises(ModelError, match="missing"):
        load_adapter_weights(model, tmp_path / "elsewhere")
    save_file({"classifier.weight": torch.zeros(3, 32)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ModelError, match="holds 1 tensors for a model that trains 28"):
        load_adapter_weights(model, tmp_path)
    # as many tensors (2 layers x 6 projections x A, B, the head's and the pooler's weight and bias), of another rank
    other, _ = add_lora(tiny_model("bert"), ModelConfig(lora_rank=2))
    other.save_pretrained(str(tmp_path / "rank2"))
    with pytest.raises(ModelError, match="does not fit this model"):
        load_adapter_weights(model, tmp_path / "rank2")


def test_a_model_peft_cannot_wrap_is_one_line():
    # XLM keeps one normalisation per layer in a ModuleList above its blocks, which PEFT cannot train in full
    with pytest.raises(ConfigError, match="model.lora_rank: PEFT cannot adapt XLMForSequenceClassification: "
                                          "modules_to_save cannot be applied to modules of type") as caught:
        add_lora(tiny_model("xlm"), ModelConfig(lora_rank=4))
    assert "\n" not in caught.value.message and "lora_rank: null" in caught.value.hint


def test_lora_at_a_full_fine_tuning_rate_is_told_so_after_the_start_line(lora_runs):
    start, *rest = lora_runs.said[1e-4]
    assert start[0] == "INFO" and start[1].startswith("start: ") and " lr=0.0001 (linear) " in start[1]
    assert rest == [("WARNING", "LoRA (model.lora_rank) at optim.learning_rate=0.0001, a full fine-tuning rate: "
                                "adapters start at zero and usually want 5 to 20 times it (2e-3 on the default job; "
                                "docs/memory.md, LoRA adapters)")]
    assert [level for level, _ in lora_runs.said[3e-4]] == ["INFO"]  # LoRA's rates
    assert [level for level, _ in lora_runs.said["full fine-tuning"]] == ["INFO"]  # full fine-tuning at its own


@pytest.mark.parametrize("model_type", [*ARCHITECTURES, "megatron-bert"])
def test_a_norm_alone_beside_the_blocks_is_the_encoders_final_norm(model_type):
    """XLM-RoBERTa-XL's and Megatron-BERT's encoders keep their final norm beside the blocks, where DeBERTa keeps
    the norm of its relative embeddings: only a norm with nothing else beside it there runs after the blocks."""
    from finetune.lora import final_norm_beside_the_blocks

    model = tiny_model(model_type)
    final = final_norm_beside_the_blocks(model, layer_stack(model)[0])
    assert final == {"xlm-roberta-xl": "encoder.LayerNorm", "megatron-bert": "encoder.ln"}.get(model_type)
    if final is not None:  # trained in full under LoRA, as the head is
        assert f"{model.base_model_prefix}.{final}" in head_modules(model)
