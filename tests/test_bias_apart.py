"""``training.bias_apart``: each linear layer's bias added after its product; the same parameters, model and sums.

The contract with it (``(8, 4)`` against ``(32, 1)``, and against the fused
layers' run) is in tests/test_accumulation.py.
"""

from __future__ import annotations

import torch

from finetune.bias_apart import BiasApartLinear, add_biases_apart
from helpers import tiny_bert


def _biased_linears(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]


def test_every_linear_layer_with_a_bias_is_swapped_and_computes_the_same():
    model, plain = tiny_bert(seed=0), tiny_bert(seed=0)
    unbiased = torch.nn.Linear(4, 4, bias=False)
    model.add_module("extra", unbiased)  # a layer without a bias keeps addmm's absence: nothing to move
    expected = _biased_linears(model)
    assert len(expected) == 2 * 6 + 2  # six per block (query, key, value, three outputs), the pooler, the head
    assert add_biases_apart(model) == len(expected)
    assert [name for name, m in model.named_modules() if type(m) is BiasApartLinear] == expected
    assert type(unbiased) is torch.nn.Linear
    assert model.state_dict().keys() == plain.state_dict().keys() | {"extra.weight"}
    ids = torch.randint(5, 25, (3, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-6, atol=1e-6)


def test_under_bf16_autocast_the_bias_is_added_in_the_products_precision():
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear(x)
        add_biases_apart(linear)
        apart = linear(x)
    assert type(linear) is BiasApartLinear
    assert fused.dtype == apart.dtype == torch.bfloat16  # the block after it runs in the precision it ran in
    torch.testing.assert_close(apart.float(), fused.float(), rtol=2 ** -7, atol=2 ** -7)  # one more rounding
    product = torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16())
    assert torch.equal(apart, product + linear.bias.bfloat16())


def test_a_lora_layers_frozen_base_is_swapped_and_its_adapters_are_not():
    from finetune.config import ModelConfig
    from finetune.lora import add_lora

    model, _ = add_lora(tiny_bert(seed=0), ModelConfig(lora_rank=2))
    swapped = add_biases_apart(model)
    bases = [name for name, m in model.named_modules() if name.endswith(".base_layer")]
    assert bases and all(type(model.get_submodule(name)) is BiasApartLinear for name in bases)
    assert not any(type(m) is BiasApartLinear for name, m in model.named_modules() if ".lora_" in name)
    assert swapped == len(_biased_linears(model))


def test_a_subclass_of_linear_keeps_its_own_forward():
    """A layer of a class derived from ``nn.Linear`` (a quantized layer, a gradient-fused one, torch's own
    ``NonDynamicallyQuantizableLinear``) computes its output its own way: swapped, that way would be lost."""
    from finetune.accumulation_fusion import FusedAccumulationLinear

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scaled(4, 4), FusedAccumulationLinear(4, 4))
    x = torch.randn(3, 4)
    before = model(x)
    assert add_biases_apart(model) == 1
    assert [type(m) for m in model] == [BiasApartLinear, Scaled, FusedAccumulationLinear]
    torch.testing.assert_close(model(x), before)


def test_a_compiled_block_traces_the_product_without_its_bias(monkeypatch):
    """What inductor is handed: under ``training.torch_compile: blocks``, each block's graph computes its linear
    layers' products without a bias and adds the bias as an operation of its own, which inductor fuses into the
    element-wise work after it."""
    from types import SimpleNamespace

    from finetune.modeling import set_forward

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *a, **kw: real_compile(self, *a, **{**kw, "backend": recording_backend}))

    def linears_with_a_bias(bias_apart: bool) -> list[bool]:
        torch._dynamo.reset()
        graphs.clear()
        model = tiny_bert(seed=0)
        set_forward(model, SimpleNamespace(bias_apart=bias_apart, gradient_accumulation_fusion=False,
                                           torch_compile="blocks"))
        ids = torch.randint(5, 25, (2, 8))
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
        calls = [node for gm in graphs for node in gm.graph.nodes if node.target is torch._C._nn.linear]
        return [len(node.args) > 2 and node.args[2] is not None or node.kwargs.get("bias") is not None
                for node in calls]

    fused, apart = linears_with_a_bias(False), linears_with_a_bias(True)
    assert len(fused) == len(apart) == 6  # one block's graph, which the other block reuses
    assert all(fused) and not any(apart)
    torch._dynamo.reset()


def test_a_run_with_biases_apart_says_so_saves_the_plain_model_and_resumes_only_with_it(tmp_path,
                                                                                         fresh_accelerate_state):
    from tiny_run import check_a_layer_setting

    check_a_layer_setting(tmp_path, "bias_apart", BiasApartLinear)
