"""``optim.optimizer: adamw_8bit``: bitsandbytes' 8-bit AdamW, its state counted as it is allocated, refused in
one line where it cannot run, and a run with it resumed bitwise."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import finetune.optimizer_state
from finetune.config import OptimConfig, load_config
from finetune.errors import ConfigError
from finetune.memory import levers_that_fit, measure_activations, plan_memory
from finetune.optimization import build_optimizer, check_optimizer
from finetune.optimizer_state import MIN_8BIT_SIZE, optimizer_state_bytes
from helpers import pad_collate, token_dataset

def _bert(hidden: int = 64):
    """A BERT whose matrices are large enough (64 x 64 = 4,096 elements) for 8-bit moments, its vectors not."""
    from transformers import BertForSequenceClassification

    from helpers import tiny_bert_config

    torch.manual_seed(0)
    config = tiny_bert_config()
    config.update({"hidden_size": hidden, "intermediate_size": 2 * hidden})
    return BertForSequenceClassification(config)


def _state_bytes(optimizer) -> int:
    """The bytes the optimizer allocated for its state (its step counters aside)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for k, v in state.items()
               if torch.is_tensor(v) and k != "step")


def _step(model, optimizer) -> None:
    batch = pad_collate(token_dataset(8, seed=2))
    labels = batch.pop("labels")
    F.cross_entropy(model(**batch).logits, labels).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_plan_counts_the_state_each_optimizer_allocates():
    trained = [p for p in _bert().parameters() if p.requires_grad]
    assert any(p.numel() >= MIN_8BIT_SIZE for p in trained) and any(p.numel() < MIN_8BIT_SIZE for p in trained)
    counted = {}
    for name in ("adamw", "adamw_8bit"):
        model = _bert()
        optimizer = build_optimizer(model, OptimConfig(optimizer=name))
        _step(model, optimizer)
        counted[name] = optimizer_state_bytes([p for p in model.parameters() if p.requires_grad], name)
        assert _state_bytes(optimizer) == counted[name], name
    kinds = {v.dtype for state in optimizer.state.values() for k, v in state.items() if k.startswith("state")}
    assert kinds == {torch.uint8, torch.float32}  # the matrices' moments in 8 bits, the vectors' in 32
    assert counted["adamw_8bit"] < 0.4 * counted["adamw"]
    # a full-sized model's state is nearly all matrices: a quarter (0.255 of bert-base's, counted without its weights)
    from transformers import BertConfig, BertForSequenceClassification

    with torch.device("meta"):
        base = list(BertForSequenceClassification(BertConfig()).parameters())
    assert 0.25 < optimizer_state_bytes(base, "adamw_8bit") / optimizer_state_bytes(base, "adamw") < 0.26


def test_the_plan_says_which_state_it_counts_and_names_the_8bit_optimizer_where_it_alone_fits():
    from test_memory_plan import _batches, _CpuAccelerator

    model = _bert()
    activations = measure_activations(model, _batches(), _CpuAccelerator())
    plans = {name: plan_memory(model, activations, b=1, checkpointing=False, device=torch.device("cpu"),
                               optimizer=name) for name in ("adamw", "adamw_8bit")}
    assert " + adamw " in plans["adamw"].describe() and " + adamw8bit " in plans["adamw_8bit"].describe()
    assert plans["adamw_8bit"].record()["optimizer_name"] == "adamw_8bit"
    batching = SimpleNamespace(per_device_batch_size=1, effective_batch_size=1, num_processes=1)
    # a device with exactly what the 8-bit state's plan needs: that lever fits, one byte less and it does not
    need = plans["adamw_8bit"].total - plans["adamw"].resident
    fits = levers_that_fit(replace(plans["adamw"], available=need), model, activations, batching, max_length=32)
    assert "optim.optimizer=adamw_8bit" in fits
    assert fits.index("optim.optimizer=adamw_8bit") < fits.index("model.lora_rank=8")  # trains every weight
    short = levers_that_fit(replace(plans["adamw"], available=need - 1), model, activations, batching, max_length=32)
    assert "optim.optimizer=adamw_8bit" not in short
    # a run with it already is not told to take it
    assert "optim.optimizer=adamw_8bit" not in levers_that_fit(replace(plans["adamw_8bit"], available=need - 1),
                                                               model, activations, batching, max_length=32)


def test_the_automatic_micro_batchs_trial_holds_room_for_the_state_the_optimizer_will_allocate(monkeypatch):
    from finetune import autobatch
    from test_memory_plan import _batches, _CpuAccelerator

    model = _bert()
    held = []
    real_empty = torch.empty

    def counting_empty(*size, **kwargs):
        tensor = real_empty(*size, **kwargs)
        if kwargs.get("dtype") is torch.uint8:
            held.append(tensor.numel())
        return tensor

    monkeypatch.setattr(autobatch.torch, "empty", counting_empty)
    trained = [p for p in model.parameters() if p.requires_grad]
    for name in ("adamw", "adamw_8bit"):
        held.clear()
        assert autobatch.trial_step(model, _batches()(2), _CpuAccelerator(), optimizer=name)
        assert sum(held) == optimizer_state_bytes(trained, name), name


def test_settings_it_cannot_run_with_are_one_line_errors_naming_the_key(monkeypatch):
    from accelerate.utils import DistributedType

    with pytest.raises(ConfigError, match="^command line: optim.implementation: fused is a kernel of torch's AdamW; "
                                          "optim.optimizer=adamw_8bit runs bitsandbytes' own"):
        load_config(None, ["optim.optimizer=adamw_8bit", "optim.implementation=fused"])
    with pytest.raises(ConfigError, match=re.escape("command line: optim.optimizer: expected one of 'adamw' | "
                                                    "'adamw_8bit', got str 'adam8bit' (did you mean 'adamw_8bit'?)")):
        load_config(None, ["optim.optimizer=adam8bit"])
    single = SimpleNamespace(distributed_type=DistributedType.NO)
    check_optimizer("adamw_8bit", single)  # installed here
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(ConfigError, match=f"^optim.optimizer: adamw_8bit under {kind.value} is not supported"):
            check_optimizer("adamw_8bit", SimpleNamespace(distributed_type=kind))
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.49.2")
    with pytest.raises(ConfigError, match=r"^optim.optimizer: adamw_8bit needs bitsandbytes>=0.50 .*found 0.49.2"):
        check_optimizer("adamw_8bit", single)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^optim.optimizer: adamw_8bit needs bitsandbytes, which is not installed "
                                          r"\(pip install 'bitsandbytes>=0.50'\)$"):
        check_optimizer("adamw_8bit", single)
    check_optimizer("adamw", single)  # torch's needs nothing


def test_bitsandbytes_warning_about_a_4bit_kernel_is_dropped_and_its_others_kept(caplog):
    # the filter is set where the package is imported, as this module imports it
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        log = logging.getLogger("bitsandbytes.backends.cpu.ops")
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "No module named 'kernels'")
        log.warning("another warning")
    assert [r.getMessage() for r in caplog.records] == ["another warning"]


# --------------------------------------------------------------------------- a run with it, stopped and resumed


@pytest.fixture(scope="module")
def eight_bit_runs(tmp_path_factory):
    """The tiny run with the 8-bit AdamW to its end, and stopped after update 3 (mid-epoch) and resumed. The
    tiny model's matrices are under bitsandbytes' 4,096 elements: the threshold is lowered so that they are
    kept in 8 bits, as a full-sized model's are."""
    from finetune.start_line import describe
    from tiny_run import fit_tiny_run

    patch = pytest.MonkeyPatch()
    patch.setattr(finetune.optimizer_state, "MIN_8BIT_SIZE", 256)
    sections = {"optim": {"learning_rate": 1e-2, "warmup_ratio": 0.1, "optimizer": "adamw_8bit"},
                "output": {"checkpoint_every": 3, "keep_last": None}}
    whole_root, part_root = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("part")
    runs = []
    try:
        whole = fit_tiny_run(whole_root, before_fit=lambda run: runs.append((run, describe(run))), **sections)
        stopped = fit_tiny_run(part_root, on_update=lambda state: state.step >= 3, **sections)
        resumed = fit_tiny_run(part_root, **{**sections, "output": {**sections["output"], "resume_from": "latest"}})
    finally:
        patch.undo()
    return SimpleNamespace(whole=whole, stopped=stopped, resumed=resumed, run=runs[0][0], start_line=runs[0][1])


def test_a_resumed_8bit_run_ends_bitwise_equal_to_the_uninterrupted_one(eight_bit_runs):
    whole, part = (eight_bit_runs.whole[0].output.output_dir, eight_bit_runs.resumed[0].output.output_dir)
    assert eight_bit_runs.stopped[1]["train"]["ended"] == "stopped_by_caller"
    saved = torch.load(f"{part}/checkpoints/checkpoint-3/optimizer.bin", weights_only=True)


    def tensors(state: dict):  # bitsandbytes nests its quantized moments in a dict of their own
        for value in state.values():
            yield from tensors(value) if isinstance(value, dict) else [value] if torch.is_tensor(value) else []

    assert torch.uint8 in {t.dtype for state in saved["state"].values() for t in tensors(state)}  # 8-bit moments
    with open(f"{whole}/model.safetensors", "rb") as a, open(f"{part}/model.safetensors", "rb") as b:
        assert a.read() == b.read()
    metrics = [json.loads(open(f"{d}/metrics.json").read()) for d in (whole, part)]
    assert metrics[0]["memory_plan"]["optimizer_name"] == "adamw_8bit"
    for m in metrics:
        m["train"].pop("seconds")
        m["train"].pop("data_file")  # the same rows, written into each run's own folder
        m["memory_plan"].pop("available")  # the machine's, at each start
    assert metrics[0] == metrics[1]


def test_an_8bit_run_trains_the_8bit_optimizer_and_says_so(eight_bit_runs):
    optimizer = getattr(eight_bit_runs.run.optimizer, "optimizer", eight_bit_runs.run.optimizer)
    assert type(optimizer).__name__ == "AdamW8bit"
    assert " checkpointing=off (auto: the micro-batch is set) optimizer=adamw_8bit " in eight_bit_runs.start_line
    assert " + adamw8bit " in eight_bit_runs.start_line


def test_a_run_resumes_with_the_optimizer_it_started_with(eight_bit_runs):
    from finetune.resuming import config_changes, config_fingerprint

    cfg = eight_bit_runs.whole[0]
    torch_adamw = replace(cfg, optim=replace(cfg.optim, optimizer="adamw"))
    written = json.loads(json.dumps(config_fingerprint(cfg)))
    assert config_changes({"fingerprint": written}, cfg) is None
    assert config_changes({"fingerprint": written}, torch_adamw) == "optim.optimizer: 'adamw_8bit' -> 'adamw'"
    # a checkpoint of a release before the setting trained with torch's AdamW
    written_by_torch_adamw = json.loads(json.dumps(config_fingerprint(torch_adamw)))
    before = {k: v for k, v in written_by_torch_adamw.items() if k != "optim.optimizer"}
    assert config_changes({"fingerprint": before}, torch_adamw) is None
    assert config_changes({"fingerprint": before}, cfg) == "optim.optimizer: 'adamw' -> 'adamw_8bit'"
