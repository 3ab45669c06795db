"""``training.attention_kernel``: the kernel asked for runs in every forward, compiled or recomputed, and nowhere else.

On a CPU torch has two kernels, flash and math, and takes flash wherever it
can: ``math`` is the setting a CPU can see. The contract with it (``(8, 4)``
against ``(32, 1)``) is in tests/test_accumulation.py; cuDNN's kernel on a
CUDA GPU at the end of this file.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import finetune.attention_kernel as attention_kernel
from finetune.attention_kernel import (apply_attention_kernel, kernel_refusal, prefer_attention_kernel,
                                       recompute_context)
from finetune.modeling import set_gradient_checkpointing
from helpers import tiny_bert, tiny_bert_config

FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def _micro_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 25, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # padded: transformers passes SDPA a mask
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 0])}


def _attention_ops(model, **batch) -> set[str]:
    """The attention operators a forward and backward of ``model`` ran (torch's profiler names them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(**(batch or _micro_batch())).loss.backward()
    return {event.name for event in profile.events() if "scaled_dot_product" in event.name}


def _torchs_order() -> tuple[bool, ...]:
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled())


def _gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_the_kernel_asked_for_runs_inside_each_forward_and_torchs_order_is_back_after_it():
    plain, preferring = tiny_bert(seed=0), tiny_bert(seed=0)
    prefer_attention_kernel(preferring, "math")
    assert preferring.attention_kernel == "math" and not hasattr(plain, "attention_kernel")
    inside = []
    preferring.bert.encoder.register_forward_hook(lambda *_: inside.append(_torchs_order()))
    before = _torchs_order()
    ops = _attention_ops(plain)
    assert FLASH_CPU in ops and MATH not in ops
    ops = _attention_ops(preferring)
    assert MATH in ops and FLASH_CPU not in ops
    assert inside == [(False, False, True, False)]  # math alone, while the encoder ran
    assert _torchs_order() == before
    torch.testing.assert_close(_gradients(preferring), _gradients(plain), rtol=1e-5, atol=1e-7)  # the same attention


def test_a_forward_that_raises_leaves_torchs_order_as_it_was():
    model = tiny_bert(seed=0)
    prefer_attention_kernel(model, "math")
    before = _torchs_order()
    with pytest.raises(IndexError):
        model(input_ids=torch.full((2, 4), 10_000))  # past the vocabulary: the embedding raises
    assert _torchs_order() == before
    assert MATH in _attention_ops(model)  # and the next forward asks again


def _compiled_attention_ops(kernel: str, compiled: str) -> set[str]:
    """The attention operators of a second forward and backward of the tiny BERT compiled under ``aot_eager``,
    whole or block by block, asking for ``kernel``."""
    torch._dynamo.reset()
    model = tiny_bert(seed=0)
    prefer_attention_kernel(model, kernel)
    if compiled == "whole":
        model.compile(backend="aot_eager")
    else:
        for block in model.bert.encoder.layer:
            block.compile(backend="aot_eager")
    _attention_ops(model)  # the trace
    try:
        return _attention_ops(model)
    finally:
        torch._dynamo.reset()


def test_compiled_blocks_take_the_kernel_when_they_trace():
    """Under ``aot_eager`` a flash call stays an operator of the traced graph, and math is traced into the matrix
    products it is made of: the flash operator is there without the setting and gone with it."""
    assert FLASH_CPU in _compiled_attention_ops("auto", "blocks")
    assert FLASH_CPU not in _compiled_attention_ops("math", "blocks")


@pytest.mark.slow  # a whole forward's compile: 10 s
def test_a_whole_compiled_forward_runs_the_hooks_outside_its_graph_and_takes_the_kernel():
    from torch._dynamo.utils import counters

    counters.clear()
    ops = _compiled_attention_ops("math", "whole")
    assert FLASH_CPU not in ops  # which the same compile of torch's order runs, as the blocks' test shows
    breaks = dict(counters["graph_break"])
    from finetune.hub import transformers_major

    if transformers_major() >= 5:
        assert not breaks
    else:  # transformers 4's BERT sets an attribute of its config where it builds its mask, which torch 2.6's
        # dynamo breaks the graph at (2.13's does not): that break, and none at the hooks
        assert all("setattr" in reason and "HFPretrainedConfigVariable" in reason for reason in breaks), breaks


def test_checkpointed_blocks_are_recomputed_with_the_forwards_kernel():
    """Torch checks that a recompute saves what the forward saved: another kernel would not (an error), and the
    recomputed gradients are the stored ones, bit for bit."""
    grads = {}
    for checkpointing in (False, True):
        model = tiny_bert(seed=0)
        prefer_attention_kernel(model, "math")  # before checkpointing, as setup_run does
        set_gradient_checkpointing(model, checkpointing)
        assert MATH in _attention_ops(model)
        grads[checkpointing] = _gradients(model)
    assert torch.equal(grads[True], grads[False])
    assert recompute_context(tiny_bert(seed=0)) is None  # auto: torch's own order recomputes as it computed


def test_a_kernel_the_device_lacks_is_named_and_the_ones_it_has_are_not():
    config = tiny_bert_config(dropout=0.1)
    for kernel in ("cudnn", "efficient"):
        assert kernel_refusal(kernel, config, torch.device("cpu"), torch.float32, 24) == \
            f"every micro-batch (torch has no {kernel} kernel for a cpu)"
    for kernel in ("math", "auto"):
        assert kernel_refusal(kernel, config, torch.device("cpu"), torch.bfloat16, 24) is None


def test_a_refusal_gives_torchs_reasons_and_tells_padded_micro_batches_from_unpadded(monkeypatch):
    # flash on a CPU refuses dropout, and says why: the same path a GPU kernel's refusal takes
    monkeypatch.setitem(attention_kernel.KERNEL_ORDERS, "flash", [torch.nn.attention.SDPBackend.FLASH_ATTENTION])
    refusal = kernel_refusal("flash", tiny_bert_config(dropout=0.1), torch.device("cpu"), torch.float32, 16)
    assert refusal.startswith("every micro-batch (") and "dropout" in refusal
    assert "Triggered internally" not in refusal and "because:" not in refusal
    assert kernel_refusal("flash", tiny_bert_config(dropout=0.0), torch.device("cpu"), torch.float32, 16) is None
    monkeypatch.setattr(attention_kernel, "_refusal", lambda kernel, q, mask, p: "a reason" if mask is not None else None)
    assert kernel_refusal("math", tiny_bert_config(), torch.device("cpu"), torch.float32, 16) == \
        "a padded micro-batch (a reason)"


def test_the_run_says_a_refusal_once_on_its_main_process(caplog):
    def accelerator(main):
        return SimpleNamespace(is_main_process=main, mixed_precision="bf16", device=torch.device("cpu"))

    with caplog.at_level(logging.WARNING, logger="finetune"):
        apply_attention_kernel(tiny_bert(seed=0), "cudnn", accelerator(False), 32)
        assert not caplog.records
        model = tiny_bert(seed=0)
        apply_attention_kernel(model, "cudnn", accelerator(True), 32)
    assert [r.getMessage() for r in caplog.records] == [
        "training.attention_kernel: cudnn refuses every micro-batch (torch has no cudnn kernel for a cpu); "
        "there attention runs torch's next kernel"]
    assert FLASH_CPU in _attention_ops(model)  # torch's next choice: training goes on


def test_a_model_whose_attention_is_its_own_is_left_as_it_is_and_the_run_says_so(caplog):
    from helpers import tiny_model

    model = tiny_model("mpnet", num_labels=2)  # transformers runs MPNet's attention itself
    with caplog.at_level(logging.WARNING, logger="finetune"):
        apply_attention_kernel(model, "math", SimpleNamespace(is_main_process=True), 32)
    assert [r.getMessage() for r in caplog.records] == [
        "training.attention_kernel: math has no effect: the model's attention is 'eager', not torch's "
        "scaled_dot_product_attention"]
    assert not hasattr(model, "attention_kernel") and not model._forward_pre_hooks


def test_an_unknown_kernel_is_refused_naming_the_key():
    from finetune.errors import ConfigError
    from finetune.config import config_from_dict

    with pytest.raises(ValueError, match="one of auto, cudnn, efficient, math, got 'flash'"):
        prefer_attention_kernel(tiny_bert(seed=0), "flash")
    with pytest.raises(ConfigError, match="training.attention_kernel"):
        config_from_dict({"data": {"train_file": "train.csv"}, "training": {"attention_kernel": "flash"}})


def test_a_kernel_asked_for_takes_the_place_of_the_cpus_own_attention():
    from accelerate import Accelerator

    from finetune.cpu import plan_cpu_speedups

    model, accelerator = tiny_bert(seed=0, dropout=0.1), Accelerator(cpu=True)
    own = plan_cpu_speedups(model, accelerator, quiet=True)
    asked = plan_cpu_speedups(model, accelerator, own_attention=False, quiet=True)
    # the CPU's own attention plugs into transformers' attention registry, which transformers 4 predates
    from finetune.hub import transformers_major

    assert own.attention == (transformers_major() >= 5) and own.dropout_masks
    assert not asked.attention and asked.dropout_masks  # the hidden layers' masks are still its own


def test_a_run_with_a_kernel_says_so_saves_the_plain_model_and_resumes_only_with_it(tmp_path, fresh_accelerate_state,
                                                                                    caplog):
    """``math`` against the plain run (flash on a CPU): the plain run's weights to training tolerance; ``cudnn``,
    which a CPU lacks, is said once and trains the plain run's weights bit for bit (torch's next kernel is flash)."""
    from transformers import AutoModelForSequenceClassification

    from tiny_run import check_a_layer_setting, fit_tiny_run

    check_a_layer_setting(tmp_path, "attention_kernel", value="math", off="auto")
    with caplog.at_level(logging.WARNING, logger="finetune"):
        cfg, _ = fit_tiny_run(tmp_path / "cudnn", training={"attention_kernel": "cudnn"})
    assert sum("training.attention_kernel: cudnn refuses" in r.getMessage() for r in caplog.records) == 1
    refused = AutoModelForSequenceClassification.from_pretrained(cfg.output.output_dir).state_dict()
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "plain" / "out").state_dict()
    assert all(torch.equal(refused[name], plain[name]) for name in plain)


# ---------------------------------------------------------------------------------------------- on a CUDA GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run bench/gpu.sh on a GPU machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cudnns_kernel_runs_on_a_gpu_where_it_says_it_does(dtype):
    """Where the check finds cuDNN's kernel takes the job's attention (bf16 on a recent GPU), a padded micro-batch
    runs it, forward and backward; where it refuses (fp32: cuDNN's attention is 16-bit), torch's next kernel runs
    and the check said why. Printed for the GPU check's log."""
    model = tiny_bert(seed=0).cuda()
    prefer_attention_kernel(model, "cudnn")
    refusal = kernel_refusal("cudnn", model.config, torch.device("cuda"), dtype, 10)
    batch = {name: value.cuda() for name, value in _micro_batch().items()}
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            model(**batch).loss.backward()
    ran = {event.name for event in profile.events() if "scaled_dot_product" in event.name}
    print(f"\nattention_kernel=cudnn in {dtype}: refusal {refusal!r}; ran {sorted(ran)}")
    cudnn = any("cudnn" in name for name in ran)
    assert cudnn == (refusal is None)
    if dtype == torch.float32:
        assert refusal is not None
