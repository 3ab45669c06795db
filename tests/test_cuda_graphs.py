"""``training.cuda_graphs``: micro-batches replayed from CUDA graphs train the eager run's weights.

Each test runs on the CPU and, marked ``gpu``, on a CUDA GPU. On the CPU no
graph can be captured, so :func:`~finetune.cuda_graphs.rerun_eagerly`
stands in for :func:`~finetune.cuda_graphs.record_cuda_graph`: its "replay"
runs the step again. Everything else is the package's own code: the fixed shapes (rows
padded to ``b`` with weight 0, lengths to the buckets), the inputs and loss
scale copied in, the warm-up that must add nothing and draw no random
numbers, the gradients kept in place between updates. On a GPU the same tests
capture real graphs (``bench/gpu.sh`` runs them).
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader
from transformers import BertForSequenceClassification

from finetune.accumulation_fusion import fuse_weight_grads
from finetune.attention_kernel import prefer_attention_kernel
from finetune.bias_apart import add_biases_apart
from finetune.config import OptimConfig, config_from_dict
from finetune.cuda_graphs import GraphedMicroBatches, record_cuda_graph, rerun_eagerly, why_not_graphed
from finetune.loop import TrainState, train_one_epoch
from finetune.modeling import compile_model
from finetune.optimization import build_optimizer, build_scheduler, plan_updates
from finetune.sampling import EpochSampler
from finetune.tasks import Task
from helpers import ARCHITECTURES, ONE_LENGTH, PADDING_READERS, collate_for, compiling_with, pad_collate, tiny_bert, tiny_model, token_dataset

pytestmark = pytest.mark.usefixtures("strict_fp32")

# 38 samples, b=4, k=3: windows of 3, 3, 3 and 1 micro-batches; the last micro-batch holds 2 rows
N, B_MICRO, K = 38, 4, 3
LENGTHS = [12, 18, 26]  # token_dataset's texts are 5 to 25 tokens long

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                     reason="needs a CUDA GPU (bench/gpu.sh)")]),
]


class CountingRecorder:
    """The device's recorder, counting its captures."""

    def __init__(self, device: str) -> None:
        self.record = record_cuda_graph if device == "cuda" else rerun_eagerly
        self.captures = 0
        self.compiled_by_capture: list[int] = []  # graphs torch.compile had made when each capture ended

    def __call__(self, step, pool):
        from torch._dynamo.utils import counters

        self.captures += 1
        recorded = self.record(step, pool)
        self.compiled_by_capture.append(counters["stats"]["unique_graphs"])
        return recorded


class HostReadingBert(BertForSequenceClassification):
    """A forward that reads a tensor on the host, as some models' do: CUDA refuses to capture it."""

    def forward(self, input_ids=None, **kwargs):
        if not bool((input_ids >= 0).all()):
            raise ValueError("a negative token id")
        return super().forward(input_ids=input_ids, **kwargs)


class RefusingRecorder(CountingRecorder):
    """On a CPU, where nothing is captured: the refusal CUDA gives a forward like HostReadingBert's."""

    def __call__(self, step, pool):
        self.captures += 1
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")


def _train(device: str, graphed: bool, epochs: int = 2, host_reading: bool = False, model_type: str = "bert",
           dropout: float = 0.0, compiled: bool | str = False, capture: bool = True, bias_apart: bool = False,
           fusion: bool = False, attention_kernel: str = "auto", precision: str = "no", loss: Optional[Task] = None,
           lengths: Optional[list[int]] = None, loop_loss=None) -> dict:
    """``(4, 3)`` on a tiny model (BERT by default) for ``epochs``, eagerly or replayed (``compiled``:
    ``training.torch_compile``, the graphs' forward compiled, or the blocks under ``"blocks"``; ``capture=False``:
    fixed shapes without graphs, on any device; ``bias_apart``: ``training.bias_apart``; ``fusion``:
    ``training.gradient_accumulation_fusion``; ``attention_kernel``: ``training.attention_kernel``; ``precision``:
    ``"bf16"`` for autocast; ``loss``: the task whose loss trains, the graphs' where graphed; ``lengths``: the
    graphs' lengths; ``loop_loss``: a loss handed to the loop besides); the weights after every update. Each run
    starts its random streams (dropout's) from the same seed."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=device == "cpu", gradient_accumulation_steps=K, mixed_precision=precision)
    model = (tiny_bert(seed=0, dropout=dropout) if model_type == "bert"
             else tiny_model(model_type, num_labels=2, dropout=dropout))
    if host_reading:
        model.__class__ = HostReadingBert
    if bias_apart:
        add_biases_apart(model)
    if fusion:
        fuse_weight_grads(model)
    prefer_attention_kernel(model, attention_kernel)
    if compiled == "blocks":
        compile_model(model, "blocks")
    opt_cfg = OptimConfig(learning_rate=1e-3, warmup_steps=1)
    optimizer = build_optimizer(model, opt_cfg, device=acc.device)
    data = token_dataset(N, seed=1)
    # an encoder that reads the padding is padded to one length, a bucket of its own, as data.padding: auto pads it
    dl = DataLoader(data, batch_size=B_MICRO, sampler=EpochSampler(N, seed=7, window_size=B_MICRO * K),
                    collate_fn=collate_for(model_type))
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    scheduler = build_scheduler(optimizer, opt_cfg, plan_updates(len(dl), K, epochs, None, warmup_steps=1))
    recorder = (RefusingRecorder(device) if host_reading and device == "cpu"
                else CountingRecorder(device if capture else "cpu"))
    lengths = lengths or ([ONE_LENGTH] if model_type in PADDING_READERS else LENGTHS)
    loss = loss or Task()
    graphs = GraphedMicroBatches(model, loss.per_sample_loss, rows=B_MICRO, lengths=lengths,
                                 pad_token_id=model.config.pad_token_id or 0, precision=precision,
                                 recorder=recorder, compiled=compiled) if graphed else None
    snapshots, records, grads, input_memory = [], [], [], []

    def on_update(state):
        snapshots.append([p.detach().cpu().clone() for p in acc.unwrap_model(model).parameters()])
        grads.append([p.grad for p in model.parameters()])
        if graphs is not None:  # where each graph's inputs live: a replay reads the memory it was captured with
            input_memory.append({("loss scale",): graphs.scale.data_ptr(),
                                 **{(width, key): t.data_ptr() for width, (_, inputs) in graphs.graphs.items()
                                    for key, t in inputs.items()}})
        return False

    state = TrainState()
    for epoch in range(epochs):
        train_one_epoch(model, optimizer, scheduler, dl, acc, epoch, state=state, max_grad_norm=1.0,
                        on_log=records.append, on_update=on_update, graphs=graphs,
                        loss_fn=loop_loss or (None if graphed else loss.per_sample_loss))
    shapes = [tuple(batch["input_ids"].shape) for batch in dl]
    return {"snapshots": snapshots, "records": records, "grads": grads, "graphs": graphs, "recorder": recorder,
            "shapes": shapes, "input_memory": input_memory}


@pytest.mark.parametrize("model_type", PADDING_READERS)
def test_an_encoder_that_reads_the_padding_replays_its_eager_weights_from_one_length(model_type):
    """Its micro-batches padded to one length, as data.padding: auto pads them, are one graph's (on the CPU's stand-in
    recorder, which replays by running the step): the eager weights, one length captured. Padded further to the
    graphs' buckets, the replay would read more padding than the eager step."""
    eager = _train("cpu", graphed=False, epochs=1, model_type=model_type)
    replayed = _train("cpu", graphed=True, epochs=1, model_type=model_type)
    for update, (a, b) in enumerate(zip(eager["snapshots"], replayed["snapshots"])):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"update {update + 1}: {m}")
    assert {length for _, length in replayed["shapes"]} == {ONE_LENGTH}
    assert replayed["graphs"].record()["lengths"] == [ONE_LENGTH] and replayed["recorder"].captures == 1


@pytest.mark.parametrize("device", DEVICES)
def test_replayed_micro_batches_train_the_eager_weights(device):
    """(4, 3) replayed = (4, 3) eager after every update, the short last micro-batch padded with rows of weight 0."""
    eager, replayed = _train(device, graphed=False), _train(device, graphed=True)
    assert len(replayed["snapshots"]) == len(eager["snapshots"]) == 8
    for update, (a, b) in enumerate(zip(eager["snapshots"], replayed["snapshots"])):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"update {update + 1}: {m}")
    assert not torch.equal(replayed["snapshots"][0][5], replayed["snapshots"][-1][5])
    for a, b in zip(eager["records"], replayed["records"]):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-6)
        assert (b["train/samples"], b["train/tokens"]) == (a["train/samples"], a["train/tokens"])
    # the micro-batches were padded (the last in rows, most in length), and each length captured once over 2 epochs
    shapes = replayed["shapes"]
    widths = sorted({next(size for size in LENGTHS if size >= length) for _, length in shapes})
    assert shapes[-1][0] < B_MICRO and any(length not in LENGTHS for _, length in shapes) and len(widths) > 1
    record = replayed["graphs"].record()
    assert record["lengths"] == widths and replayed["recorder"].captures == len(widths)
    assert record["refused"] is None
    # each micro-batch (and the window's loss scale) was copied into the graphs' inputs, never into new tensors
    for before, after in zip(replayed["input_memory"], replayed["input_memory"][1:]):
        assert all(after[place] == pointer for place, pointer in before.items())
    assert len(replayed["input_memory"][-1]) > len(replayed["input_memory"][0])  # lengths captured later too
    if device == "cuda":  # the pool holds the graphs' activations: some memory, and not the weights'
        assert 0 < record["pool_bytes"] < torch.cuda.memory_reserved()
    else:
        assert record["pool_bytes"] is None


def test_a_micro_batch_the_graphs_do_not_take_trains_on_the_loss_they_replay():
    """A micro-batch longer than every captured length runs eagerly on the graphs' loss (label smoothing here, as a
    config's), not on the model's plain loss: part replayed and part not, (4, 3) trains the weights of (4, 3)
    trained eagerly on that loss, after every update."""
    smoothed = Task(label_smoothing=0.3)
    eager = _train("cpu", graphed=False, loss=smoothed)
    mixed = _train("cpu", graphed=True, loss=smoothed, lengths=[LENGTHS[1]])
    lengths = {length for _, length in mixed["shapes"]}
    assert min(lengths) <= LENGTHS[1] < max(lengths)  # some micro-batches replayed, some too long to be
    assert len(mixed["snapshots"]) == len(eager["snapshots"]) == 8
    for update, (a, b) in enumerate(zip(eager["snapshots"], mixed["snapshots"])):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"update {update + 1}: {m}")


def test_a_loss_other_than_the_one_the_graphs_replay_is_refused():
    with pytest.raises(ValueError, match=r"^train_one_epoch: loss_fn is not the loss the graphs were captured with, "
                                         r"which every replayed micro-batch computes; capture them with it"):
        _train("cpu", graphed=True, loop_loss=Task(label_smoothing=0.1).per_sample_loss)


@pytest.mark.parametrize("compiled", [True, "blocks"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_forward_compiles_in_the_warm_up_and_replays_to_the_uncompiled_weights(device, compiled,
                                                                                         monkeypatch):
    """``training.torch_compile`` with ``training.cuda_graphs``: each length's forward and backward (the whole
    forward's, or under ``blocks`` the encoder blocks') are compiled in its warm-up, never in a capture or a
    replay, and the replays train the weights of the same compiled steps run without graphs, which are those of
    eager steps to the compiled kernels' rounding.

    On a CPU, dynamo's ``aot_eager`` backend stands in for inductor (which compiles for minutes there): the
    forward and backward graphs AOTAutograd traces, run by eager kernels, so the weights are the eager ones.
    """
    from torch._dynamo.utils import counters

    if device == "cpu":
        compiling_with(monkeypatch, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    replayed = _train(device, graphed=True, compiled=compiled)
    compiled_graphs = counters["stats"]["unique_graphs"]
    recorder = replayed["recorder"]
    assert replayed["graphs"].record()["compiled"] == compiled and replayed["graphs"].record()["lengths"]
    assert recorder.captures == len(replayed["graphs"].graphs) > 1
    # compiled before the first capture ended, and nothing compiled after the last (its replays and 2 epochs' worth)
    assert 0 < recorder.compiled_by_capture[0] and recorder.compiled_by_capture[-1] == compiled_graphs
    assert counters["aot_autograd"]["total"] > 0  # the backward went through the compiled graph too
    torch._dynamo.reset()  # the reference compiles afresh, as the replayed run did: the same kernels, length by length
    reference = (_train(device, graphed=False) if device == "cpu"
                 else _train(device, graphed=True, compiled=compiled, capture=False))
    for update, (a, b) in enumerate(zip(reference["snapshots"], replayed["snapshots"])):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"update {update + 1}: {m}")
    for a, b in zip(reference["records"], replayed["records"]):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_blocks_with_biases_apart_replay_to_their_unreplayed_weights(device, monkeypatch):
    """``training.bias_apart`` under compiled blocks replayed from graphs: each block's products without their
    biases compile and capture, and the replays train the weights of the same steps without graphs (on a CPU,
    under ``aot_eager``: the eager weights of the layers with their biases apart)."""
    from torch._dynamo.utils import counters

    if device == "cpu":
        compiling_with(monkeypatch, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    replayed = _train(device, graphed=True, compiled="blocks", bias_apart=True)
    assert replayed["recorder"].captures == len(replayed["graphs"].graphs) > 1
    assert counters["aot_autograd"]["total"] > 0
    torch._dynamo.reset()
    reference = (_train(device, graphed=False, bias_apart=True) if device == "cpu"
                 else _train(device, graphed=True, compiled="blocks", capture=False, bias_apart=True))
    for update, (a, b) in enumerate(zip(reference["snapshots"], replayed["snapshots"])):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"update {update + 1}: {m}")
    assert not torch.equal(replayed["snapshots"][0][5], replayed["snapshots"][-1][5])


@pytest.mark.parametrize("compiled", [False, "blocks"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_weight_gradients_replay_to_their_unreplayed_weights(device, compiled, monkeypatch):
    """``training.gradient_accumulation_fusion`` replayed from graphs, eager or compiled blocks: the fused
    addition into each weight's gradient is captured and replayed into the memory the gradients had at capture,
    and the replays train the weights of the same steps without graphs (on a CPU, compiled under ``aot_eager``:
    the eager fused layers' weights)."""
    from torch._dynamo.utils import counters

    if device == "cpu":
        compiling_with(monkeypatch, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    replayed = _train(device, graphed=True, compiled=compiled, fusion=True)
    assert replayed["recorder"].captures == len(replayed["graphs"].graphs) > 1
    assert not counters["graph_break"]
    torch._dynamo.reset()
    reference = (_train(device, graphed=False, fusion=True) if device == "cpu"
                 else _train(device, graphed=True, compiled=compiled, capture=False, fusion=True))
    for update, (a, b) in enumerate(zip(reference["snapshots"], replayed["snapshots"])):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"update {update + 1}: {m}")
    first = replayed["grads"][0]
    assert all(all(g is h for g, h in zip(first, update)) for update in replayed["grads"][1:])  # never replaced
    assert not torch.equal(replayed["snapshots"][0][5], replayed["snapshots"][-1][5])


@pytest.mark.parametrize("device", DEVICES)
def test_the_attention_kernel_asked_for_is_captured_and_replays_to_its_unreplayed_weights(device):
    """``training.attention_kernel`` inside the graphs: the capture records the kernel asked for (math, where torch
    takes flash on a CPU and the memory-efficient kernel for the masked micro-batches of a GPU's graphs), and the
    replays train the weights of the same steps without graphs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        replayed = _train(device, graphed=True, attention_kernel="math")
    ran = {event.name for event in profile.events() if "scaled_dot_product" in event.name}
    assert replayed["recorder"].captures == len(replayed["graphs"].graphs) > 1
    assert "aten::_scaled_dot_product_attention_math" in ran
    assert not any("flash" in name or "efficient" in name for name in ran)
    reference = (_train(device, graphed=False, attention_kernel="math") if device == "cpu"
                 else _train(device, graphed=True, capture=False, attention_kernel="math"))
    for update, (a, b) in enumerate(zip(reference["snapshots"], replayed["snapshots"])):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"update {update + 1}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh)")
@pytest.mark.parametrize("compiled", [False, "blocks"])
def test_cudnns_attention_with_dropout_is_captured_in_bf16(compiled):
    """``training.attention_kernel: cudnn`` where it runs, bf16 with BERT's dropout, eager or compiled blocks: every
    length is captured (none refused), the capture records cuDNN's kernel where the check says it takes the
    job's attention, and training moves the weights with finite losses. Printed for the GPU check's log."""
    from finetune.attention_kernel import kernel_refusal

    torch._dynamo.reset()
    refusal = kernel_refusal("cudnn", tiny_bert(dropout=0.1).config, torch.device("cuda"), torch.bfloat16,
                             max(LENGTHS))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        replayed = _train("cuda", graphed=True, compiled=compiled, dropout=0.1, attention_kernel="cudnn",
                          precision="bf16")
    ran = sorted({event.name for event in profile.events() if "dot_product" in event.name})
    print(f"\ncudnn attention, bf16, dropout 0.1, compiled={compiled}: refusal {refusal!r}; captured {ran}")
    record = replayed["graphs"].record()
    assert record["refused"] is None and replayed["recorder"].captures == len(record["lengths"]) > 1
    assert any("cudnn" in name for name in ran) == (refusal is None)
    assert all(math.isfinite(r["train/loss"]) for r in replayed["records"])
    assert not torch.equal(replayed["snapshots"][0][5], replayed["snapshots"][-1][5])


def _unpadded_micro_batch(device: str = "cpu") -> dict[str, torch.Tensor]:
    """``b`` texts that fill the shortest length: a mask of ones, which transformers drops when it can look."""
    g = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(5, 30, (B_MICRO, LENGTHS[0]), generator=g),
             "attention_mask": torch.ones(B_MICRO, LENGTHS[0], dtype=torch.long),
             "labels": torch.randint(0, 2, (B_MICRO,), generator=g)}
    return {key: value.to(device) for key, value in batch.items()}


class CapturingRecorder(CountingRecorder):
    """The device's recorder, counting what torch.compile compiles while a graph is captured and replayed. On a
    CPU, the step runs once as the capture and again at each replay, each time with
    ``torch.cuda.is_current_stream_capturing()`` saying yes: transformers asks it before dropping a mask without
    padding, and what a capture decided there is what its replays run."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.compiled_in_capture = 0

    def __call__(self, step, pool):
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        if self.record is record_cuda_graph:
            recorded = super().__call__(step, pool)
        else:
            def capturing_step():
                with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
                    return step()

            capturing_step()
            recorded = super().__call__(capturing_step, pool)
        self.compiled_in_capture += counters["stats"]["unique_graphs"] - before
        return recorded


@pytest.mark.parametrize("compiled", [True, "blocks"])
@pytest.mark.parametrize("device", DEVICES)
def test_micro_batches_without_padding_compile_in_the_warm_up_not_in_the_capture(device, compiled, monkeypatch):
    """Texts that fill their length (long ones do) make micro-batches whose mask is all ones, which transformers
    drops eagerly and keeps under capture. Compiled blocks warmed up without the mask were compiled again in
    the capture, for the mask, and CUDA refused it: the run fell back to eager steps. The warm-up now keeps
    the mask as the capture does, so everything compiles before the capture, and the replays compile nothing."""
    from torch._dynamo.utils import counters

    if device == "cpu":
        compiling_with(monkeypatch, "eager")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_bert(seed=0).to(device).train()
    if compiled == "blocks":
        compile_model(model, "blocks")
    full = _unpadded_micro_batch(device)
    recorder = CapturingRecorder(device)
    graphs = GraphedMicroBatches(model, Task().per_sample_loss, rows=B_MICRO, lengths=LENGTHS, recorder=recorder,
                                 compiled=compiled)
    assert graphs.takes(full) and recorder.captures == 1
    for _ in range(2):
        graphs.forward_backward(full, real=B_MICRO, loss_scale=1.0)
    assert counters["stats"]["unique_graphs"] > 0 and recorder.compiled_in_capture == 0
    assert graphs.failed is None and graphs.record()["lengths"] == [LENGTHS[0]]


def test_the_warm_ups_padding_mark_goes_only_where_no_position_is_padding(monkeypatch):
    """The mark is needed only where the mask has no padding, and there every row keeps the rest of its tokens. A
    mask that has padding keeps it as it is: a left-padded micro-batch whose last text is its last token alone,
    marked there, would leave that row nothing to attend to. The mark is made on the device: on a GPU, reading
    the mask on the host or writing a Python number into it makes the host wait for every queued kernel, so
    both raise here."""
    from finetune.cuda_graphs import _show_padding

    def host_wait(*args, **kwargs):
        raise AssertionError("a host read of, or host write into, the mask")

    full = {"attention_mask": torch.ones(B_MICRO, LENGTHS[0], dtype=torch.long)}
    mask = torch.ones(B_MICRO, LENGTHS[0], dtype=torch.long)
    mask[-1, :-1] = 0  # left padding
    padded = {"attention_mask": mask.clone()}
    one_token = {"attention_mask": torch.ones(B_MICRO, 1, dtype=torch.long)}
    with monkeypatch.context() as guard:
        for name in ("__bool__", "item", "tolist", "__setitem__"):
            guard.setattr(torch.Tensor, name, host_wait)
        for inputs in (full, padded, one_token):
            _show_padding(inputs)
    assert int((full["attention_mask"] == 0).sum()) == 1 and bool((full["attention_mask"].sum(1) > 0).all())
    assert torch.equal(padded["attention_mask"], mask)
    assert bool(one_token["attention_mask"].all())  # a length of one: no row may lose its token


def test_fixed_shapes_without_graphs_compile_in_the_warm_up_too(monkeypatch):
    """``rerun_eagerly`` (the fixed shapes without graphs, which bench.cuda_graphs times as ``static``) runs each
    "replay" eagerly, where transformers drops a mask without padding: its warm-up must drop it too, or the
    blocks compile again at the first replay, outside the set-up time the benchmark reports."""
    from torch._dynamo.utils import counters

    compiling_with(monkeypatch, "eager")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_bert(seed=0).train()
    compile_model(model, "blocks")
    full = _unpadded_micro_batch()
    graphs = GraphedMicroBatches(model, Task().per_sample_loss, rows=B_MICRO, lengths=LENGTHS,
                                 recorder=rerun_eagerly, compiled="blocks")
    assert graphs.takes(full)
    after_warm_up = counters["stats"]["unique_graphs"]
    graphs.forward_backward(full, real=B_MICRO, loss_scale=1.0)
    assert after_warm_up > 0 and counters["stats"]["unique_graphs"] == after_warm_up


@pytest.mark.parametrize("compiled", [True, "blocks"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_replays_draw_new_dropout_masks(device, compiled, monkeypatch):
    """Inductor draws a compiled dropout's masks from seeds it takes from the device's generator at each call: a
    replay must take new ones, not repeat the capture's. The same micro-batch replayed three times, dropout on,
    gives three losses. (On a CPU each "replay" runs the step again: the check has teeth on a GPU.)"""
    if device == "cpu":
        compiling_with(monkeypatch, "eager")
    torch._dynamo.reset()
    model = tiny_bert(seed=0, dropout=0.1).to(device).train()
    if compiled == "blocks":
        compile_model(model, "blocks")
    batch = {k: v.to(device) for k, v in pad_collate(token_dataset(B_MICRO, seed=2)).items()}
    graphs = GraphedMicroBatches(model, Task().per_sample_loss, rows=B_MICRO, lengths=LENGTHS,
                                 recorder=CountingRecorder(device), compiled=compiled)
    losses = [float(graphs.forward_backward(batch, real=B_MICRO, loss_scale=1.0)[0]) for _ in range(3)]
    assert len(set(losses)) == 3, losses
    assert graphs.record()["lengths"] and graphs.failed is None


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_every_familys_blocks_compile_in_the_warm_up_of_micro_batches_without_padding(model_type, monkeypatch):
    """The same for each supported family's compiled blocks, on the CPU (dynamo's eager backend): thirteen of the
    fourteen dropped the mask in the warm-up and compiled again in the capture; DeBERTa-v2 builds its own mask."""
    from torch._dynamo.utils import counters

    compiling_with(monkeypatch, "eager")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(model_type, num_labels=2, dropout=0.0).train()
    compile_model(model, "blocks")
    full = _unpadded_micro_batch()
    recorder = CapturingRecorder("cpu")
    graphs = GraphedMicroBatches(model, Task().per_sample_loss, rows=B_MICRO, lengths=LENGTHS, recorder=recorder,
                                 compiled="blocks")
    assert graphs.takes(full)
    graphs.forward_backward(full, real=B_MICRO, loss_scale=1.0)
    assert counters["stats"]["unique_graphs"] > 0 and recorder.compiled_in_capture == 0


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_stay_in_place_from_update_to_update(device):
    """A captured backward adds into the gradients' memory: zero_grad must zero them, not free them."""
    run = _train(device, graphed=True, epochs=1)
    first, last = run["grads"][0], run["grads"][-1]
    assert all(a is not None and a is b for a, b in zip(first, last))
    assert all(float(g.abs().sum()) == 0.0 for g in last)  # zeroed after the last update


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_whose_capture_fails_trains_eagerly_from_there_said_once(device, caplog):
    """A forward that reads a tensor on the host cannot be captured: the run goes on eagerly, with the eager
    run's weights (the warm-up before the failed capture added nothing), and says why once. Dropout is on: a
    refused capture must leave the generator and the stream as they were for the eager micro-batches (CUDA ends it
    without torch's epilogue)."""
    eager = _train(device, graphed=False, epochs=1, host_reading=True, dropout=0.1)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        fallen = _train(device, graphed=True, epochs=1, host_reading=True, dropout=0.1)
    assert len(fallen["snapshots"]) == len(eager["snapshots"]) == 4
    for update, (a, b) in enumerate(zip(eager["snapshots"], fallen["snapshots"])):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"update {update + 1}: {m}")
    said = [r.message for r in caplog.records if "training.cuda_graphs" in r.message]
    assert len(said) == 1 and "a micro-batch runs eagerly: the capture failed (" in said[0], said
    if device == "cpu":
        assert "(CUDA error: operation not permitted when stream is capturing), so from here on" in said[0]
    assert fallen["recorder"].captures == 1 and fallen["graphs"].record()["lengths"] == []
    assert fallen["graphs"].record()["refused"] == said[0].split("a micro-batch runs eagerly: ")[1]


def test_a_refused_capture_is_said_by_its_first_error_with_the_cause_a_caller_can_fix():
    """Ending an invalidated capture raises again ("a previous error"): the warning gives the error before it."""
    from finetune.cuda_graphs import refusal

    try:
        try:
            raise RuntimeError("CUDA error: operation would make the legacy stream depend on a capturing blocking "
                               "stream\nSearch for `cudaErrorStreamCaptureImplicit' ...")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nSearch ...")
    except RuntimeError as error:
        said = refusal(error)
    assert said.startswith("CUDA error: operation would make the legacy stream depend on a capturing blocking stream")
    assert said.endswith("a tensor from an eager forward, such as a kept loss, still holds its autograd graph")
    assert refusal(RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")) == \
        "CUDA error: operation not permitted when stream is capturing"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh)")
def test_a_graph_kept_from_an_eager_forward_is_named_and_training_goes_on_eagerly(caplog):
    """A loss kept from an eager forward holds the parameters' gradient accumulators, made on the default stream:
    CUDA refuses the capture (the accumulators cannot take a gradient made on the capture's stream). The warning
    says what to drop, and eager micro-batches with dropout run on the stream and generator they had."""
    model, batch, graphs, _ = _one_micro_batch("cuda")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    kept = Task().per_sample_loss(model(**inputs).logits, batch["labels"]).sum()
    generator = torch.cuda.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert not graphs.takes(batch)
    said = [r.message for r in caplog.records if "training.cuda_graphs" in r.message]
    assert len(said) == 1 and "still holds its autograd graph" in said[0], said
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert torch.equal(torch.cuda.get_rng_state(), generator)
    del kept
    model.zero_grad(set_to_none=True)
    Task().per_sample_loss(model(**inputs).logits, batch["labels"]).sum().backward()  # dropout draws eagerly
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh)")
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_every_family_trains_its_eager_weights_replayed_or_not(model_type, caplog):
    """Each supported family, on a GPU: replayed where CUDA captures its forward, eagerly from the first
    refused capture where it does not (said as a warning in the test report); the eager weights either way.
    BERT's must capture."""
    import warnings

    eager = _train("cuda", graphed=False, epochs=1, model_type=model_type)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        replayed = _train("cuda", graphed=True, epochs=1, model_type=model_type)
    for update, (a, b) in enumerate(zip(eager["snapshots"], replayed["snapshots"])):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=lambda m: f"update {update + 1}: {m}")
    captured = replayed["graphs"].record()["lengths"]
    if not captured:
        said = [r.message for r in caplog.records if "training.cuda_graphs" in r.message]
        warnings.warn(f"{model_type}: not captured, trained eagerly: {said}")
    assert captured or model_type != "bert"


def _one_micro_batch(device: str, dropout: float = 0.1):
    torch.manual_seed(0)
    model = tiny_bert(seed=0, dropout=dropout).to(device).train()
    batch = {k: v.to(device) for k, v in pad_collate(token_dataset(3, seed=2)).items()}
    recorder = CountingRecorder(device)
    graphs = GraphedMicroBatches(model, Task().per_sample_loss, rows=B_MICRO, lengths=LENGTHS, recorder=recorder)
    return model, batch, graphs, recorder


def _rng_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


@pytest.mark.parametrize("device", DEVICES)
def test_the_capture_adds_nothing_and_draws_no_random_numbers(device):
    """A replay that captured first gives the gradient, the loss and the generator of a replay that did not.

    The gradients already hold a sum, as they do when a new length first
    appears in the middle of a window: the warm-up must add nothing to it.
    """
    model, batch, graphs, recorder = _one_micro_batch(device)
    short = {k: v[:, :6] if v.dim() == 2 else v for k, v in batch.items()}
    assert batch["input_ids"].shape[1] > LENGTHS[0]
    graphs.forward_backward(short, real=3, loss_scale=0.5)  # another length first, so the scale is not 0
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    torch.manual_seed(5)
    first_loss, tokens = graphs.forward_backward(batch, real=3, loss_scale=0.5)
    first = [p.grad.clone() for p in model.parameters()]
    after_first = _rng_state(device)
    for p in model.parameters():
        p.grad.fill_(0.25)
    torch.manual_seed(5)
    second_loss, _ = graphs.forward_backward(batch, real=3, loss_scale=0.5)
    assert recorder.captures == 2
    assert torch.equal(_rng_state(device), after_first)
    assert torch.equal(first_loss, second_loss)
    for a, p in zip(first, model.parameters()):
        assert torch.equal(a, p.grad)
    assert int(tokens) == int(batch["attention_mask"].sum())
    # dropout was on: the draws of a replay matter (a third replay, from where the second left, differs)
    third_loss, _ = graphs.forward_backward(batch, real=3, loss_scale=0.5)
    assert not torch.equal(third_loss, second_loss)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_real_weigh_nothing(device):
    """The loss and gradient of 3 real rows padded to 4 are those of the 3 rows alone, eagerly."""
    model, batch, graphs, _ = _one_micro_batch(device, dropout=0.0)
    loss_sum, _ = graphs.forward_backward(batch, real=2, loss_scale=1.0)
    replayed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    two = {k: v[:2] for k, v in batch.items()}
    per_sample = Task().per_sample_loss(model(**{k: v for k, v in two.items() if k != "labels"}).logits,
                                        two["labels"])
    per_sample.sum().backward()
    torch.testing.assert_close(loss_sum, per_sample.sum().detach(), rtol=1e-6, atol=1e-7)
    for a, p in zip(replayed, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_freed_by_a_caller_make_the_graphs_be_captured_again(device, caplog):
    model, batch, graphs, recorder = _one_micro_batch(device, dropout=0.0)
    graphs.forward_backward(batch, real=3, loss_scale=1.0)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)  # a replay would now add into freed memory
    with caplog.at_level(logging.WARNING, logger="finetune"):
        graphs.forward_backward(batch, real=3, loss_scale=1.0)
        model.zero_grad(set_to_none=True)
        graphs.forward_backward(batch, real=3, loss_scale=1.0)
    assert recorder.captures == 3
    assert sum("gradients were replaced" in r.message for r in caplog.records) == 1  # said once
    for a, p in zip(expected, model.parameters()):
        assert torch.equal(a, p.grad)


def test_micro_batches_a_graph_cannot_hold_run_eagerly_said_once(caplog):
    model, batch, graphs, _ = _one_micro_batch("cpu", dropout=0.0)
    wide = {k: torch.cat([v, v]) for k, v in batch.items()}  # 6 rows > b=4
    long = {k: (torch.nn.functional.pad(v, (0, 30)) if v.dim() == 2 else v) for k, v in batch.items()}
    other = dict(batch, position_ids=torch.zeros_like(batch["input_ids"]))
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert graphs.takes(batch)
        assert not graphs.takes(wide) and not graphs.takes(wide)
        assert not graphs.takes(long)
        assert not graphs.takes(other)
    said = [r.message for r in caplog.records]
    assert len(said) == 3
    assert "6 rows, more than b=4" in said[0] and "longer than 26" in said[1] and "'position_ids'" in said[2]


@pytest.mark.parametrize("device, processes, engine, precision, checkpointing, chunked, why", [
    ("cuda", 1, "NO", "bf16", False, False, None),
    ("cuda", 1, "NO", "no", False, False, None),
    ("cpu", 1, "NO", "no", False, False, "no CUDA device"),
    ("cuda", 2, "MULTI_GPU", "bf16", False, False, "several processes"),
    ("cuda", 1, "FSDP", "bf16", False, False, "sharding engine"),
    ("cuda", 1, "NO", "fp16", False, False, "fp16"),
    ("cuda", 1, "NO", "bf16", True, False, "gradient checkpointing"),
    ("cuda", 1, "NO", "bf16", False, True, "chunks"),
])
def test_where_micro_batches_are_replayed(device, processes, engine, precision, checkpointing, chunked, why):
    from accelerate.utils import DistributedType

    accelerator = SimpleNamespace(device=torch.device(device), num_processes=processes,
                                  distributed_type=DistributedType[engine], mixed_precision=precision)
    said = why_not_graphed(accelerator, checkpointing=checkpointing, chunked=chunked)
    assert said is None if why is None else why in said


@pytest.mark.parametrize("setting, device, processes, precision, replayed", [
    ("auto", "cuda", 1, "bf16", True),  # where it was measured to pay
    ("auto", "cuda", 1, "no", False),  # fp32: not measured
    ("auto", "cpu", 1, "bf16", False),
    ("auto", "cuda", 2, "bf16", False),
    ("auto", "cuda", 1, "fp16", False),
    (True, "cuda", 1, "no", True),
    (True, "cuda", 1, "bf16", True),
    (True, "cpu", 1, "bf16", False),
    (False, "cuda", 1, "bf16", False),
])
def test_auto_replays_bf16_micro_batches_on_one_gpu_and_true_fp32_ones_too(setting, device, processes, precision,
                                                                           replayed):
    from accelerate.utils import DistributedType

    from finetune.cuda_graphs import graphed

    accelerator = SimpleNamespace(device=torch.device(device), num_processes=processes, mixed_precision=precision,
                                  distributed_type=DistributedType.MULTI_GPU if processes > 1 else DistributedType.NO)
    assert graphed(setting, accelerator, checkpointing=False, chunked=False) is replayed
    assert graphed(setting, accelerator, checkpointing=True, chunked=False) is False


@pytest.mark.parametrize("torch_compile", [False, True, "blocks"])
def test_a_runs_graphs_hold_the_compiled_forward_under_torch_compile(torch_compile, monkeypatch):
    """The two settings combine: the graphs of a run with ``training.torch_compile: true`` compile the model's own
    forward; under ``blocks`` they compile nothing themselves (setup compiled the blocks in place), and call the
    model's plain forward, which runs the compiled blocks (the test above trains both)."""
    import finetune.cuda_graphs as cuda_graphs

    monkeypatch.setattr(cuda_graphs, "graphed_run", lambda run: True)  # as on one CUDA GPU
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: ("compiled", fn))
    cfg = config_from_dict({"data": {"train_file": "x.tsv"},
                            "training": {"cuda_graphs": True, "torch_compile": torch_compile}})
    model = tiny_bert(seed=0)
    run = SimpleNamespace(cfg=cfg, model=model, task=Task(), batching=SimpleNamespace(per_device_batch_size=B_MICRO),
                          train_dataloader=SimpleNamespace(collate_fn=SimpleNamespace(sizes=LENGTHS)),
                          tokenizer=SimpleNamespace(pad_token_id=0), accelerator=SimpleNamespace(mixed_precision="no"))
    graphs = cuda_graphs.graphs_for_run(run)
    assert graphs.record()["compiled"] == torch_compile
    forward = graphs.forward[1] if torch_compile is True else graphs.forward
    assert graphs.forward[0] == "compiled" if torch_compile is True else not isinstance(forward, tuple)
    assert forward.__func__ is type(model).forward and forward.__self__ is model  # the model's own, unwrapped


@pytest.mark.parametrize("setting, said", [
    (True, ["training.cuda_graphs: not applied (no CUDA device); micro-batches run eagerly"]),
    ("auto", []),  # nothing was asked for: the default says nothing where it does not apply
])
def test_without_a_gpu_the_setting_says_so_and_the_run_trains_eagerly(setting, said, caplog):
    from finetune.autobatch import Checkpointing
    from finetune.cuda_graphs import graphs_for_run

    cfg = config_from_dict({"data": {"train_file": "x.tsv"}, "training": {"cuda_graphs": setting}})
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, mixed_precision="no",
                                  distributed_type=None)
    run = SimpleNamespace(cfg=cfg, accelerator=accelerator, checkpointing=Checkpointing())
    with caplog.at_level(logging.WARNING, logger="finetune"):
        graphs = graphs_for_run(run)
    assert graphs is None
    assert [r.message for r in caplog.records] == said


@pytest.mark.parametrize("setting, device, precision, truncation, fixed", [
    (True, "cuda", "bf16", "head", True),
    ("auto", "cuda", "bf16", "head", True),
    ("auto", "cuda", "no", "head", False),
    (True, "cpu", "no", "head", False),  # graphs fall back there: no padding beyond the longest text
    (True, "cuda", "fp16", "head", False),
    (True, "cuda", "bf16", "chunks", False),
])
def test_the_training_collator_pads_to_fixed_lengths_where_graphs_run(setting, device, precision, truncation, fixed,
                                                                      tokenizers):
    from accelerate.utils import DistributedType

    from finetune.dataloaders import BucketPadding, collator

    cfg = config_from_dict({"data": {"train_file": "x.tsv", "max_length": 32, "truncation": truncation},
                            "training": {"cuda_graphs": setting}})
    accelerator = SimpleNamespace(device=torch.device(device), num_processes=1, mixed_precision=precision,
                                  distributed_type=DistributedType.NO)

    def fixed_by(**kw) -> bool:
        pad = collator(tokenizers["fast"], accelerator, cfg, **kw)
        return isinstance(getattr(pad, "pad", pad), BucketPadding)

    assert fixed_by() is fixed
    assert not fixed_by(checkpointing=True)  # gradient checkpointing as decided: no graphs, so no padding for them
    assert not fixed_by(evaluation=True)  # evaluation is never replayed from graphs


def test_graphs_pad_to_as_many_lengths_as_they_keep_up_to_the_longest_training_text(tokenizers):
    """A capture costs a fraction of a second and a compile seconds: graphs alone take MAX_GRAPHS lengths,
    compiled ones four, each evenly apart up to the longest training text, so that short texts under a long
    max_length are not padded to a quarter of it; evaluation (compiled) pads up to max_length."""
    from accelerate.utils import DistributedType

    from finetune.cuda_graphs import MAX_GRAPHS
    from finetune.dataloaders import collator

    accelerator = SimpleNamespace(device=torch.device("cuda"), num_processes=1, mixed_precision="bf16",
                                  distributed_type=DistributedType.NO)

    def sizes(longest, **training):
        cfg = config_from_dict({"data": {"train_file": "x.tsv", "max_length": 512}, "training": training})
        return collator(tokenizers["fast"], accelerator, cfg, longest=longest).sizes

    assert MAX_GRAPHS == 8
    assert sizes(100) == [13, 25, 38, 50, 63, 75, 88, 100]
    assert sizes(None) == [64, 128, 192, 256, 320, 384, 448, 512]
    assert sizes(900) == sizes(None)  # windows of chunked texts count all their tokens: max_length holds
    # compiled as well, the same lengths: a compile serves every length after the second (test_compile_option)
    assert sizes(100, torch_compile=True) == sizes(100, torch_compile="blocks") == sizes(100)
    cfg = config_from_dict({"data": {"train_file": "x.tsv", "max_length": 512}, "training": {"torch_compile": True}})
    assert collator(tokenizers["fast"], accelerator, cfg, evaluation=True, longest=100).sizes == sizes(None)
    # a micro-batch is padded by less than one length's width: at most 12 tokens a row here, not 127
    pad = collator(tokenizers["fast"], accelerator, config_from_dict(
        {"data": {"train_file": "x.tsv", "max_length": 512}}), longest=100)

    def padding(n: int) -> int:
        return pad([{"input_ids": [5] * n, "attention_mask": [1] * n}])["input_ids"].shape[1] - n

    widths = [padding(n) for n in range(1, 101)]
    assert max(widths) == 12 and min(widths) == 0


def test_a_compiled_model_evaluates_on_fixed_lengths_too(tokenizers):
    from accelerate.utils import DistributedType

    from finetune.dataloaders import BucketPadding, collator

    cfg = config_from_dict({"data": {"train_file": "x.tsv", "max_length": 32}, "training": {"torch_compile": True}})
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1, mixed_precision="no",
                                  distributed_type=DistributedType.NO)
    assert isinstance(collator(tokenizers["fast"], accelerator, cfg, evaluation=True), BucketPadding)


def test_the_graphs_pad_to_the_lengths_of_the_runs_collator():
    from accelerate.utils import DistributedType

    from finetune.autobatch import Checkpointing
    from finetune.cuda_graphs import graphs_for_run

    cfg = config_from_dict({"data": {"train_file": "x.tsv"}, "training": {"cuda_graphs": True}})
    accelerator = SimpleNamespace(device=torch.device("cuda"), num_processes=1, mixed_precision="bf16",
                                  distributed_type=DistributedType.NO)
    run = SimpleNamespace(cfg=cfg, accelerator=accelerator, checkpointing=Checkpointing(), model=tiny_bert(),
                          task=Task(), batching=SimpleNamespace(per_device_batch_size=16),
                          tokenizer=SimpleNamespace(pad_token_id=0),
                          train_dataloader=SimpleNamespace(collate_fn=SimpleNamespace(sizes=[32, 64, 96, 128])))
    graphs = graphs_for_run(run)
    assert (graphs.rows, graphs.lengths, graphs.dtype) == (16, [32, 64, 96, 128], torch.bfloat16)
