"""``training.gradient_accumulation_fusion``: each weight gradient added into fp32 by the product itself.

The same forward, the same parameters and saved model; in fp32 the same gradients (to float rounding), under
bf16 the window's gradient without a rounding of each micro-batch's. The contract with it (``(8, 4)`` against
``(32, 1)``) is in tests/test_accumulation.py, on a CUDA GPU in tests/test_gpu.py.
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from finetune.accumulation_fusion import (FusedAccumulationBiasApartLinear, FusedAccumulationLinear,
                                          fuse_weight_grads, fuse_where_allowed, fusion_refused)
from finetune.bias_apart import add_biases_apart
from helpers import tiny_bert


def _linears(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _micro_batches(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 25, (4, 10), generator=generator) for _ in range(n)]


def _accumulate(model, batches) -> None:
    """One window in fp32: each micro-batch's backward adds into the gradients."""
    for ids in batches:
        model(input_ids=ids).logits.pow(2).sum().backward()


def test_every_linear_layer_is_swapped_and_a_window_accumulates_autograds_gradients():
    """In fp32: the same forward, bit for bit (the same product), and after three micro-batches every gradient
    autograd's, to float rounding (the addition inside the product sums in another order); the parameters and
    state_dict keys as they were; the trainable weights' gradients exist, zero, from the swap on."""
    model, plain = tiny_bert(seed=0), tiny_bert(seed=0)
    expected = _linears(model)
    assert len(expected) == 2 * 6 + 2  # six per block (query, key, value, three outputs), the pooler, the head
    assert fuse_weight_grads(model) == len(expected) == model.fused_weight_grads
    assert [name for name, m in model.named_modules() if type(m) is FusedAccumulationLinear] == expected
    assert all(torch.equal(model.get_submodule(name).weight.grad, torch.zeros_like(model.get_submodule(name).weight))
               for name in expected)
    assert model.state_dict().keys() == plain.state_dict().keys()
    ids = _micro_batches(1)[0]
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)

    model.zero_grad(set_to_none=False)
    _accumulate(model, _micro_batches())
    _accumulate(plain, _micro_batches())
    for (name, mine), theirs in zip(model.named_parameters(), plain.parameters()):
        assert mine.grad is not None and mine.grad.dtype == torch.float32
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_under_bf16_a_windows_weight_gradient_is_the_fp32_sum_of_exact_products():
    """One layer under bf16 autocast, four micro-batches: its weight and bias gradients land within fp32's
    rounding of the exact sum of the bf16 factors' products, where autograd's, rounded to bf16 in each
    micro-batch, land about bf16's rounding away; the forward's output and the input's gradient are
    autograd's, bit for bit."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 48)
    fused = torch.nn.Linear(64, 48)
    fused.load_state_dict(plain.state_dict())
    fuse_weight_grads(fused)
    exact_weight = torch.zeros(48, 64, dtype=torch.float64)
    exact_bias = torch.zeros(48, dtype=torch.float64)
    for _ in range(4):
        x = torch.randn(2, 16, 64)
        grad_out = torch.randn(2, 16, 48).bfloat16()
        outs, grads_in = [], []
        for layer in (plain, fused):
            leaf = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = layer(leaf)
            out.backward(grad_out)
            outs.append(out)
            grads_in.append(leaf.grad)
        assert outs[0].dtype == outs[1].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])
        assert grads_in[0].dtype == grads_in[1].dtype == torch.float32 and torch.equal(grads_in[0], grads_in[1])
        rows = grad_out.reshape(-1, 48).double()
        exact_weight += rows.t() @ x.bfloat16().reshape(-1, 64).double()
        exact_bias += rows.sum(0)

    def error(grad, exact):
        return ((grad.double() - exact).norm() / exact.norm()).item()

    assert error(fused.weight.grad, exact_weight) < 1e-6 < 1e-4 < error(plain.weight.grad, exact_weight)
    assert error(fused.bias.grad, exact_bias) < 1e-6 < 1e-4 < error(plain.bias.grad, exact_bias)


def test_a_gradient_freed_by_a_caller_starts_again_from_zero_and_a_frozen_weight_runs_the_plain_forward():
    model = tiny_bert(seed=0)
    fuse_weight_grads(model)
    head = model.classifier
    model.bert.pooler.dense.weight.requires_grad_(False)
    model.bert.pooler.dense.weight.grad = None
    _accumulate(model, _micro_batches(2, seed=1))
    model.zero_grad(set_to_none=True)  # a notebook's own optimizer.zero_grad()
    _accumulate(model, _micro_batches(1, seed=2))
    once = tiny_bert(seed=0)
    once.bert.pooler.dense.weight.requires_grad_(False)
    _accumulate(once, _micro_batches(1, seed=2))
    torch.testing.assert_close(head.weight.grad, once.classifier.weight.grad, rtol=1e-5, atol=1e-7)
    assert model.bert.pooler.dense.weight.grad is None  # frozen: nothing made, nothing added
    with torch.no_grad():  # evaluation: the plain forward
        torch.testing.assert_close(model(input_ids=_micro_batches(1)[0]).logits,
                                   once(input_ids=_micro_batches(1)[0]).logits, rtol=0, atol=0)


def test_with_biases_apart_the_layers_keep_both():
    """``training.bias_apart`` first, then the fusion: each layer adds its bias after the product and its weight
    gradient in the product; outputs and gradients as the biases-apart model's."""
    model, apart = tiny_bert(seed=0), tiny_bert(seed=0)
    add_biases_apart(model)
    add_biases_apart(apart)
    fuse_weight_grads(model)
    assert {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)} == {FusedAccumulationBiasApartLinear}
    with torch.no_grad():
        ids = _micro_batches(1)[0]
        torch.testing.assert_close(model(input_ids=ids).logits, apart(input_ids=ids).logits, rtol=0, atol=0)
    _accumulate(model, _micro_batches())
    _accumulate(apart, _micro_batches())
    for (name, mine), theirs in zip(model.named_parameters(), apart.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_lora_models_adapters_are_fused_and_its_frozen_bases_run_the_plain_forward():
    from finetune.config import ModelConfig
    from finetune.lora import add_lora

    model, _ = add_lora(tiny_bert(seed=0), ModelConfig(lora_rank=2))
    fuse_weight_grads(model)
    adapters = [m for name, m in model.named_modules() if ".lora_" in name and isinstance(m, torch.nn.Linear)]
    bases = [m for name, m in model.named_modules() if name.endswith(".base_layer")]
    assert adapters and bases
    assert all(type(m) is FusedAccumulationLinear for m in adapters + bases)
    _accumulate(model, _micro_batches(2))
    assert all(m.weight.grad is None for m in bases)
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in adapters
               if m.weight.shape[0] != 2)  # lora_B starts at zero, so lora_A's gradient is zero at first


def _accelerator(processes=1, engine="NO"):
    from accelerate.utils import DistributedType

    return SimpleNamespace(num_processes=processes, distributed_type=DistributedType[engine])


@pytest.mark.parametrize("processes, engine, said", [
    (1, "NO", None), (2, "MULTI_CPU", "2 processes: DDP reduces each gradient as autograd hands it over"),
    (1, "FSDP", "FSDP owns the gradients"), (1, "DEEPSPEED", "DEEPSPEED owns the gradients")])
def test_where_autograd_must_hand_over_the_gradients_the_run_says_why_once_and_fuses_nothing(processes, engine, said,
                                                                                             caplog):
    accelerator = _accelerator(processes, engine)
    assert fusion_refused(accelerator) == said
    model = tiny_bert(seed=0)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        fused = fuse_where_allowed(model, accelerator)
    if said is None:
        assert fused == 14 and not caplog.records
    else:
        assert fused == 0 and not any(type(m) is FusedAccumulationLinear for m in model.modules())
        assert [r.getMessage() for r in caplog.records] == [
            f"training.gradient_accumulation_fusion: not applied: {said}; the weight gradients come from autograd"]
        caplog.clear()  # another process of the same run says nothing
        other = SimpleNamespace(**vars(accelerator), is_main_process=False)
        assert fuse_where_allowed(tiny_bert(seed=0), other) == 0 and not caplog.records


def test_compiled_blocks_trace_the_fused_addition_without_a_graph_break():
    """Under ``training.torch_compile: blocks`` each block's graph holds the fused layers (dynamo and AOTAutograd
    trace the custom operator's in-place addition in the backward), and a window's gradients are the eager
    fused model's."""
    from torch._dynamo.utils import counters

    from finetune.modeling import set_forward

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = tiny_bert(seed=0), tiny_bert(seed=0)
    fuse_weight_grads(eager)
    real_compile = torch.nn.Module.compile
    try:
        torch.nn.Module.compile = lambda self, *a, **kw: real_compile(self, *a, **{**kw, "backend": "aot_eager"})
        set_forward(compiled, SimpleNamespace(bias_apart=False, gradient_accumulation_fusion=True,
                                              torch_compile="blocks"))
        assert compiled.fused_weight_grads == 14
        _accumulate(compiled, _micro_batches())
    finally:
        torch.nn.Module.compile = real_compile
    _accumulate(eager, _micro_batches())
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    for (name, mine), theirs in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7, msg=name)
    torch._dynamo.reset()


def test_a_fused_run_says_so_saves_the_plain_model_and_resumes_only_with_the_fusion(tmp_path, fresh_accelerate_state):
    """... and the gradient noise scale, which reads the window's first micro-batch's gradient in the middle of the
    window, is the plain run's."""
    import json

    from tiny_run import check_a_layer_setting

    check_a_layer_setting(tmp_path, "gradient_accumulation_fusion", FusedAccumulationLinear,
                          logging={"noise_scale": True, "progress_bar": False})

    def noise(folder):
        records = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
        return [r["train/noise_scale"] for r in records if r.get("train/noise_scale") is not None]

    fused, plain = noise(tmp_path / "out"), noise(tmp_path / "plain" / "out")
    assert len(fused) == len(plain) > 3 and fused == pytest.approx(plain, rel=1e-5)


def test_a_torch_without_fp32_products_of_bf16_factors_adds_the_upcast_product_and_says_so_once(caplog,
                                                                                                 monkeypatch):
    """What the CUDA path does where the installed torch refuses both of its faster ways, run on the CPU, which
    has neither ``out_dtype`` product: the first call finds the way, adds the gradient and says once which way
    it took and why; the calls after it take the same way silently."""
    import finetune.accumulation_fusion as fusion

    monkeypatch.setattr(fusion, "_CUDA_WAYS", {})
    grad = torch.zeros(6, 5)
    grad_output, x = torch.randn(8, 6).bfloat16(), torch.randn(8, 5).bfloat16()
    exact = grad_output.double().t() @ x.double()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        fusion._add_on_cuda(grad, grad_output, x)
        fusion._add_on_cuda(grad, grad_output, x)
    assert fusion._CUDA_WAYS == {grad.device: "upcast"}
    torch.testing.assert_close(grad.double(), 2 * exact, rtol=1e-6, atol=1e-6)
    [said] = [r.getMessage() for r in caplog.records]
    # torch's own reason in the parentheses, worded by each release its way (an unknown keyword, a missing kernel)
    assert re.fullmatch(r"training\.gradient_accumulation_fusion: this torch has no torch\.float32 products of "
                        r"torch\.bfloat16 factors \(.*(out_dtype|dtype_out).*\); the factors are cast to "
                        r"torch\.float32 for each product: the same sums, slower", said), said
