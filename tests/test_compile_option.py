"""``training.torch_compile``: the model (``true``) or each encoder block (``blocks``) is compiled in place,
trains, and saves a loadable model; the blocks share one compile.

Inductor takes minutes on a CPU, so the test compiles with dynamo's ``eager``
backend: the forward is still captured by ``torch.compile`` (graphs are
counted), without code generation. The benchmark's ``--levers`` mode measures
the real thing.
"""

from __future__ import annotations

import pytest
import torch

from finetune.config import config_from_dict
from helpers import ARCHITECTURES, make_texts, save_tiny_model, tiny_model, write_tsv


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    return save_tiny_model(root / "tiny-bert"), write_tsv(root / "sms.csv", make_texts(60, seed=6))


def _train(assets, out, compile_model):
    from accelerate.state import AcceleratorState, GradientState

    from finetune import fit, setup_run

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model, data = assets
    cfg = config_from_dict({
        "model": {"name_or_path": str(model), "dropout": 0.0},
        "data": {"train_file": str(data), "format": "tsv", "has_header": False, "column_names": ["label", "text"],
                 "max_length": 32},
        "training": {"per_device_train_batch_size": 8, "effective_batch_size": 16, "num_train_epochs": 1,
                     "torch_compile": compile_model, "seed": 1,
                     # fp32: the compiled run pads to fixed lengths, the eager one to the longest text, so
                     # they compare at float rounding only where rounding is fp32's
                     "mixed_precision": "no"},
        "evaluation": {"metrics": ["accuracy"]},
        "logging": {"progress_bar": False},
        "output": {"output_dir": str(out), "save_checkpoints": False},
    })
    run = setup_run(cfg)
    fit(run)
    return run


def _compiling_with_dynamos_backend(monkeypatch, backend: str = "eager") -> list[str]:
    """``Module.compile`` with one of dynamo's debugging backends instead of inductor (``eager``: torch's own
    kernels on the captured graph; ``aot_eager``: AOTAutograd's forward and backward graphs too); the list of
    the classes it compiled, as they are."""
    compiled = []
    real_compile = torch.nn.Module.compile

    def eager_backend_compile(self, *args, **kwargs):
        compiled.append(type(self).__name__)
        return real_compile(self, *args, **{**kwargs, "backend": backend})

    monkeypatch.setattr(torch.nn.Module, "compile", eager_backend_compile)
    return compiled


@pytest.mark.parametrize("setting, compiled_classes", [
    (True, ["BertForSequenceClassification"]),
    ("blocks", ["BertLayer", "BertLayer"]),  # the tiny model's two blocks, and nothing else
])
def test_compiled_model_trains_like_the_eager_one_and_saves(setting, compiled_classes, assets, tmp_path, monkeypatch,
                                                            fresh_accelerate_state):
    from torch._dynamo.utils import counters
    from transformers import AutoModelForSequenceClassification

    compiled = _compiling_with_dynamos_backend(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    run = _train(assets, tmp_path / "compiled", compile_model=setting)
    assert compiled == compiled_classes
    assert counters["stats"]["unique_graphs"] > 0  # the forward really went through torch.compile
    plain = _train(assets, tmp_path / "plain", compile_model=False)
    assert compiled == compiled_classes  # not compiled when the option is off
    trained = dict(run.accelerator.unwrap_model(run.model).named_parameters())
    reference = dict(plain.accelerator.unwrap_model(plain.model).named_parameters())
    assert trained.keys() == reference.keys()
    for name, tensor in trained.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-5, atol=1e-6)
    # the saved model carries the plain parameter names (no _orig_mod. prefix) and loads
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "compiled")
    for name, tensor in saved.named_parameters():
        torch.testing.assert_close(tensor, trained[name].detach().cpu())
    torch._dynamo.reset()


@pytest.mark.parametrize("setting", [True, "blocks"])
def test_a_compile_serves_every_block_and_every_length_after_the_second(setting, monkeypatch):
    """What docs/performance.md says a compile costs: the first length compiles, the second compiles once more
    with the length dynamic, and every later length reuses that; under ``blocks`` one compile serves every block
    (not one per block: the tiny model has two)."""
    from torch._dynamo.utils import counters

    from finetune.modeling import compile_model
    from helpers import tiny_bert

    _compiling_with_dynamos_backend(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    model = tiny_bert().train()
    compile_model(model, setting)
    graphs_after = []
    for length in (8, 16, 24, 32):
        ids = torch.randint(5, 25, (4, length))
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.zeros(4, dtype=torch.long)).loss.backward()
        graphs_after.append(counters["stats"]["unique_graphs"])
    # transformers 4's BERT builds its mask with code that older torch releases' dynamo breaks a whole-model
    # graph at (torch 2.6 does, 2.13 traces it), so a compile there is one graph more: the same two compiles, the
    # later lengths reusing the second
    from finetune.hub import transformers_major

    one_graph = setting == "blocks" or transformers_major() >= 5
    first = 1 if one_graph else 1 + bool(counters["graph_break"])
    assert graphs_after == [first, first + 1, first + 1, first + 1], dict(counters["graph_break"])
    if one_graph:
        assert not counters["graph_break"]
    torch._dynamo.reset()


def test_blocks_name_the_setting_where_a_model_has_none(monkeypatch):
    from finetune.errors import ConfigError
    from finetune.modeling import compile_model

    _compiling_with_dynamos_backend(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.base_model_prefix = "encoder"
    with pytest.raises(ConfigError, match=r"^training.torch_compile: blocks finds no transformer blocks in Sequential$"):
        compile_model(model, "blocks")


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_every_familys_blocks_compile_and_give_the_eager_gradient(model_type, monkeypatch):
    """``blocks`` finds each supported family's blocks, and its compiled blocks (AOTAutograd's graphs, run by eager
    kernels: dynamo's ``aot_eager`` backend stands in for inductor) give the eager forward's loss and gradient."""
    from torch._dynamo.utils import counters

    from finetune.lora import blocks_of
    from finetune.modeling import compile_model

    _compiling_with_dynamos_backend(monkeypatch, "aot_eager")
    ids = torch.randint(5, 25, (4, 12))
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0  # a padded row

    def loss_and_gradient(compiled: bool):
        model = tiny_model(model_type, num_labels=2, dropout=0.0).train()
        if compiled:
            compile_model(model, "blocks")
        loss = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 0, 1])).loss
        loss.backward()
        return model, loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    torch._dynamo.reset()
    counters.clear()
    model, loss, gradient = loss_and_gradient(compiled=True)
    assert all(getattr(block, "_compiled_call_impl", None) is not None for block in blocks_of(model))
    assert counters["stats"]["unique_graphs"] > 0 and counters["aot_autograd"]["total"] > 0
    _, eager_loss, eager_gradient = loss_and_gradient(compiled=False)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(gradient, eager_gradient, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("setting, said", [(False, None), (True, "torch_compile=true"), ("blocks", "torch_compile=blocks")])
def test_the_start_line_says_what_compiles(setting, said, tmp_path, monkeypatch, fresh_accelerate_state):
    """The first updates of a compiled run carry its compile: the start line says so."""
    from finetune import setup_run
    from finetune.start_line import describe
    from tiny_run import tiny_config

    _compiling_with_dynamos_backend(monkeypatch)
    line = describe(setup_run(tiny_config(tmp_path, training={"torch_compile": setting})))
    if said is None:
        assert "torch_compile" not in line
    else:
        assert f" {said} " in line
    torch._dynamo.reset()


def test_a_run_with_compiled_blocks_stopped_and_resumed_saves_the_same_model(tmp_path, monkeypatch,
                                                                            fresh_accelerate_state):
    """A checkpoint of a run whose blocks are compiled in place holds the plain weights, and its resume (blocks
    compiled again) ends on the uninterrupted run's model, byte for byte (dropout on: the restored generators
    give the same masks; dynamo's eager backend runs torch's own kernels)."""
    from pathlib import Path

    from tiny_run import fit_tiny_run

    compiled = _compiling_with_dynamos_backend(monkeypatch)
    sections = {"model": {"dropout": 0.1}, "training": {"torch_compile": "blocks"}, "output": {"checkpoint_every": 3}}
    cfg, _ = fit_tiny_run(tmp_path / "whole", **sections)
    part = tmp_path / "part"
    fit_tiny_run(part, on_update=lambda state: state.step >= 4, **sections)
    resumed, _ = fit_tiny_run(part, **{**sections, "output": {**sections["output"], "resume_from": "latest"}})
    assert compiled == ["BertLayer"] * 6  # each of the three runs compiled its two blocks
    assert (Path(resumed.output.output_dir) / "model.safetensors").read_bytes() == \
        (Path(cfg.output.output_dir) / "model.safetensors").read_bytes()
    torch._dynamo.reset()


def test_compiling_without_a_compiler_is_one_line_before_anything_is_built(assets, tmp_path, monkeypatch, capsys,
                                                                          fresh_accelerate_state):
    """Inductor builds CPU kernels with a C++ compiler; where none is, the run stops at once, naming the setting,
    and not at its first update with a page of inductor's traceback. (In this process: the check reads ``$CXX``
    as the run starts, and a command of its own with another ``$CXX`` could not be a fork of the suite's.)"""
    from finetune.train import main

    model, data = assets
    monkeypatch.setenv("CXX", "no-such-c++")
    assert main([f"model.name_or_path={model}", f"data.train_file={data}", "data.format=tsv",
                 "data.has_header=false", "data.column_names=[label, text]", "training.torch_compile=blocks",
                 f"output.output_dir={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-2:] == [
        "error: command line: training.torch_compile: inductor builds CPU kernels with the C++ compiler "
        "no-such-c++, not found",
        "hint: set training.torch_compile=false to train without compiling"]
    assert not (tmp_path / "out").exists()


def test_what_inductor_needs_on_a_gpu_is_checked_before_compiling(monkeypatch):
    import importlib.util

    from finetune.errors import ConfigError
    from finetune.modeling import check_compiler

    cuda = torch.device("cuda", 0)
    check_compiler(False, cuda)  # not compiling: nothing is asked of the machine
    real_find_spec = importlib.util.find_spec
    triton = {"installed": False}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if triton["installed"] else None) if name == "triton"
                        else real_find_spec(name, *a))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100-PCIE-16GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 0))
    with pytest.raises(ConfigError, match="inductor builds GPU kernels with Triton, which is not installed"):
        check_compiler(True, cuda)
    triton["installed"] = True
    with pytest.raises(ConfigError, match=r"compute capability 7\.0 and newer; Tesla P100-PCIE-16GB is 6\.0"):
        check_compiler("blocks", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_compiler(True, cuda)  # an H100 with Triton and a C compiler
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(ConfigError, match=r"launchers with a C compiler \(no-such-cc\), none found"):
        check_compiler(True, cuda)


def test_a_whole_compile_that_transformers_mask_building_would_break_is_one_line(monkeypatch):
    """transformers 5 builds the mask inside the forward and asks ``torch.compiler.is_exporting``, which older
    torch releases lack: a whole compile there fails at its first trace, so the run stops before it starts; the
    blocks, which leave the mask to the eager model, compile as before."""
    from finetune import hub
    from finetune.errors import ConfigError
    from finetune.modeling import check_compiler

    cpu = torch.device("cpu")
    monkeypatch.delattr(torch.compiler, "is_exporting", raising=False)
    monkeypatch.setattr(hub, "transformers_major", lambda: 5)
    with pytest.raises(ConfigError, match=r"training\.torch_compile: true traces transformers' mask building, "
                       r"which calls torch\.compiler\.is_exporting, and torch .+ has none"):
        check_compiler(True, cpu)
    check_compiler("blocks", cpu)
    monkeypatch.setattr(hub, "transformers_major", lambda: 4)  # its BERT builds the mask without asking
    check_compiler(True, cpu)
