"""``training.torch_compile``: the model is compiled in place, trains, and saves a loadable model.

Inductor takes minutes on a CPU, so the test compiles with dynamo's ``eager``
backend: the forward is still captured by ``torch.compile`` (graphs are
counted), without code generation. The benchmark's ``--levers`` mode measures
the real thing.
"""

from __future__ import annotations

import pytest
import torch

from finetune.config import config_from_dict
from helpers import make_texts, save_tiny_model, write_tsv


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    return save_tiny_model(root / "tiny-bert"), write_tsv(root / "sms.csv", make_texts(60, seed=6))


def _train(assets, out, compile_model: bool):
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


def test_compiled_model_trains_like_the_eager_one_and_saves(assets, tmp_path, monkeypatch, fresh_accelerate_state):
    from torch._dynamo.utils import counters
    from transformers import AutoModelForSequenceClassification

    compiled = []
    real_compile = torch.nn.Module.compile

    def eager_backend_compile(self, *args, **kwargs):
        compiled.append(type(self).__name__)
        return real_compile(self, *args, **{**kwargs, "backend": "eager"})

    monkeypatch.setattr(torch.nn.Module, "compile", eager_backend_compile)
    torch._dynamo.reset()
    counters.clear()
    run = _train(assets, tmp_path / "compiled", compile_model=True)
    assert compiled == ["BertForSequenceClassification"]
    assert counters["stats"]["unique_graphs"] > 0  # the forward really went through torch.compile
    plain = _train(assets, tmp_path / "plain", compile_model=False)
    assert compiled == ["BertForSequenceClassification"]  # not compiled when the option is off
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
