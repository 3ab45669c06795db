"""``training.sparse_embedding_grad``: the word-embedding gradient as rows, added into one dense buffer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from finetune.cpu import cpu_speedups, plan_cpu_speedups
from finetune.cpu.sparse_embedding import DenseGradBuffer, sparse_capable_embedding
from helpers import tiny_bert
from tiny_run import fit_tiny_run


def _accumulate(sparse: bool, micro_batches):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 6, padding_idx=0, sparse=sparse)
    for ids in micro_batches:
        (embedding(ids) * torch.arange(6.0)).square().sum().backward()
    return embedding


def test_densified_rows_equal_the_dense_accumulated_gradient():
    # repeated ids within and across micro-batches, and the padding id, whose row gets no gradient
    micro_batches = [torch.tensor([[3, 7, 7, 0], [9, 3, 0, 0]]), torch.tensor([[7, 11, 12, 3]]),
                     torch.tensor([[49, 0, 3]])]
    dense = _accumulate(False, micro_batches)
    sparse = _accumulate(True, micro_batches)
    assert sparse.weight.grad.is_sparse
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 2.0)
    buffer = DenseGradBuffer()
    buffer.densify(sparse.weight)
    buffer.densify(plain)
    assert not sparse.weight.grad.is_sparse
    torch.testing.assert_close(sparse.weight.grad, dense.weight.grad, rtol=1e-6, atol=0)
    assert torch.count_nonzero(sparse.weight.grad[0]) == 0
    assert torch.equal(plain.grad, torch.full((3,), 2.0))  # dense gradients are left as they are


def test_the_dense_buffer_is_reused_and_zeroed_between_updates():
    embedding = torch.nn.Embedding(20, 4, sparse=True)
    buffer = DenseGradBuffer()
    embedding(torch.tensor([1, 2])).sum().backward()
    buffer.densify(embedding.weight)
    first = embedding.weight.grad
    embedding.weight.grad = None  # zero_grad(set_to_none=True)
    embedding(torch.tensor([5])).sum().backward()
    buffer.densify(embedding.weight)
    second = embedding.weight.grad
    assert second.data_ptr() == first.data_ptr()
    # only row 5 of the second update, nothing left of rows 1 and 2
    expected = torch.zeros(20, 4)
    expected[5] = 1.0
    assert torch.equal(second, expected)


def test_only_an_untied_trainable_embedding_goes_sparse():
    model = tiny_bert()
    assert sparse_capable_embedding(model) is model.get_input_embeddings()

    frozen = tiny_bert()
    frozen.get_input_embeddings().weight.requires_grad_(False)
    assert sparse_capable_embedding(frozen) is None

    tied = tiny_bert()
    tied.tied_head = torch.nn.Linear(32, tied.config.vocab_size, bias=False)
    tied.tied_head.weight = tied.get_input_embeddings().weight
    assert sparse_capable_embedding(tied) is None

    renormed = tiny_bert()
    renormed.get_input_embeddings().max_norm = 1.0
    assert sparse_capable_embedding(renormed) is None


@pytest.mark.parametrize(
    "device, processes, scaler, compiled, expected",
    [
        ("cpu", 1, None, False, True),
        ("cpu", 2, None, False, False),  # DDP's buckets expect dense gradients
        ("cuda", 1, None, False, False),  # zeroing the dense gradient costs microseconds there
        ("cpu", 1, object(), False, False),  # fp16's gradient scaler
        ("cpu", 1, None, True, False),  # a compiled model traced a dense backward
    ],
)
def test_it_applies_on_one_cpu_process_only(device, processes, scaler, compiled, expected):
    accelerator = SimpleNamespace(device=torch.device(device), num_processes=processes, scaler=scaler)
    model = tiny_bert()
    if compiled:
        model._compiled_call_impl = lambda *a, **kw: None  # what nn.Module.compile() sets
    assert plan_cpu_speedups(model, accelerator).sparse_embedding is expected
    assert model.get_input_embeddings().sparse is False  # asking changes nothing


def test_a_run_trains_the_same_weights_either_way(tmp_path):
    from transformers import AutoModelForSequenceClassification

    layouts = {}
    weights = {}
    for sparse in (True, False):
        seen = layouts.setdefault(sparse, set())

        def watch(run, seen=seen):
            run.model.get_input_embeddings().weight.register_hook(lambda g: seen.add(g.is_sparse))

        cfg, _ = fit_tiny_run(tmp_path / str(sparse), before_fit=watch, training={"sparse_embedding_grad": sparse})
        model = AutoModelForSequenceClassification.from_pretrained(cfg.output.output_dir)
        weights[sparse] = dict(model.named_parameters())
    assert layouts == {True: {True}, False: {False}}  # the key chose the path
    for name, value in weights[False].items():
        if name.endswith("attention.self.key.bias"):
            # Softmax ignores a constant added to every key score, so this bias's true gradient is 0:
            # what it gets is float rounding, which Adam scales up to full steps in either run.
            continue
        torch.testing.assert_close(weights[True][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_an_exception_hands_back_a_dense_gradient_and_a_dense_embedding(fresh_accelerate_state):
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from finetune.loop import train_one_epoch
    from finetune.sampling import EpochSampler
    from helpers import pad_collate, token_dataset

    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_dataset(40, seed=1)
    dl = DataLoader(data, batch_size=4, sampler=EpochSampler(len(data), seed=0, window_size=16),
                    collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    calls = {"n": 0}
    forward = model.forward

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # mid-window: two micro-batches' rows are accumulated
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    model.forward = failing_forward
    with pytest.raises(RuntimeError, match="boom"), cpu_speedups(model, optimizer, acc):
        train_one_epoch(model, optimizer, None, dl, acc, 0)
    embedding = model.get_input_embeddings()
    assert embedding.sparse is False
    assert embedding.weight.grad is not None and not embedding.weight.grad.is_sparse
    assert torch.count_nonzero(embedding.weight.grad) > 0
